"""m2nkit inside SGLang 0.5.23: a custom weight loader that receives rounds in place.

SGLang runs a function of the caller's choosing inside every TP worker, with
the worker's live model, without any patch: a server started with
``--custom-weight-loader m2nkit.engine.plugins.sglang.load`` accepts
``update_weights_from_tensor(..., load_format="m2nkit.engine.plugins.sglang.load")``
and each TP worker then calls ``load(model, named_tensors)``
(``srt/model_executor/model_runner_components/weight_updater.py``,
``WeightUpdater.update_weights_from_tensor``: ``load_format in
self.custom_weight_loaders`` -> ``dynamic_import(load_format)(model, named_tensors)``).
The tensors SGLang hands over are m2nkit's *command*, never weights: one
empty ``uint8`` tensor whose name is a JSON object (:func:`command_tensors`),
``{"m2nkit": 1, "op": ..., "call": n, "worker": w, "replicas": D, ...}``.
The bytes of the round move over m2nkit's own group, straight into the live
parameters (addresses unchanged), as in the vLLM plugin.

Ops (one ``update_weights_from_tensor`` request each, sent by
:class:`SGLangClient`): ``init`` (the ``InitPayload``; every live
``named_parameters()`` is held against the plan before any byte moves, and a
refusal is told to every rank naming the parameter), ``start``, ``update``
(the round's receive; returns after every rank's verdict), ``finish`` (the
commit, then the model's own post-load step, SGLang's ``post_load_weights``),
``shutdown``.

**Never raise into SGLang.** SGLang 0.5.23 calls the loader inside its
scheduler's request dispatch with no ``except`` around it
(``managers/scheduler.py`` ``process_input_requests``); an exception ends the
scheduler process (``run_scheduler_process``: "Scheduler hit an exception",
``SIGQUIT`` to the server) and the loader's return value is ignored, so
SGLang answers ``success=True`` whatever happened. :func:`load` therefore
catches every failure, logs it, and writes each worker's outcome of each call
into the session's store (the ``TCPStore`` trainer rank 0 hosts, key
``sglang/<session>/<call>/<worker>``), where :class:`SGLangClient` reads it
after SGLang's answer and raises ``WeightSyncError`` naming the worker. The
version: the client sets SGLang's ``weight_version`` only after every worker
reported its commit (``UpdateWeightVersionReqInput``, SGLang's
``/update_weight_version``), so a failed or incomplete round never sets it;
SGLang itself records a version only for a successful call
(``tokenizer_control_mixin.py`` ``update_weights_from_tensor``:
``FanOutCommunicator.merge_results``, then ``_update_weight_version_if_provided``).

Why the command is a tensor *name*: a CPU tensor's bytes go through SGLang's
``MultiprocessingSerializer`` (``ForkingPickler``) as a shared-memory file
descriptor, which reaches only a server on the same host; a string and an
empty tensor (``rebuild_storage_empty``, allowed by SGLang's ``SafeUnpickler``)
travel inline, so the command reaches a server on another node too.

DP replicas: SGLang 0.5.23 refuses ``update_weights_from_tensor`` on a server
with ``--dp-size`` > 1 (``tokenizer_control_mixin.py``: "data-parallel replicas
are not supported"), so ``sglang:tp=T,dp=D`` is D servers of one TP group
each; the client drives them all and names each TP rank's worker
``replica * T + tp_rank`` in its command.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from m2nkit.engine.control import PlanMismatchError
from m2nkit.engine.plugins.live_model import (
    buffer_device,
    live_model_problems,
    receive_mode,
    refuse_everywhere,
)
from m2nkit.engine.receiver import M2NReceiver, M2NUpdateInfo, refuse_unparsed_payload
from m2nkit.engine.session import InitPayload, plan_from_manifest, session_destination

__all__ = ["LOADER", "load", "M2NSGLangEngine", "command_tensors", "read_command",
           "SGLangClient", "EngineServer", "HTTPServer", "served_spec"]

#: The loader's import path: ``--custom-weight-loader`` and ``load_format``.
LOADER = "m2nkit.engine.plugins.sglang.load"
OPS = ("init", "start", "update", "finish", "shutdown")
_LIST_AT_MOST = 8
_log = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# the command


def command_tensors(command: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` that carry ``command``: ``[(json, empty uint8 tensor)]``."""
    return [(json.dumps({"m2nkit": 1, **command}, sort_keys=True),
             torch.empty(0, dtype=torch.uint8))]


def read_command(named_tensors: Sequence[tuple[Any, Any]]) -> dict:
    """The command of :func:`command_tensors` back.

    Raises:
        ValueError: not exactly one named tensor, a name that is not m2nkit's
            JSON command, or an unknown ``op`` (names what came).
    """
    items = list(named_tensors)
    if len(items) != 1 or not isinstance(items[0][0], str):
        raise ValueError(f"{LOADER} takes one m2nkit command tensor, got "
                         f"{[n if isinstance(n, str) else type(n).__name__ for n, _ in items][:4]} "
                         "(weights go over m2nkit's own group, not through SGLang)")
    try:
        command = json.loads(items[0][0])
    except ValueError:
        command = None
    if not isinstance(command, dict) or command.get("m2nkit") != 1:
        raise ValueError(f"{LOADER}: tensor name {items[0][0][:80]!r} is not an m2nkit command")
    if command.get("op") not in OPS:
        raise ValueError(f"{LOADER}: op {command.get('op')!r} is not one of {', '.join(OPS)}")
    for key in ("worker", "replicas", "call"):
        v = command.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{LOADER}: command field {key!r} must be an int >= 0, got {v!r}")
    return command


def _outcome_key(session: str, call: int, worker: int) -> str:
    return f"sglang/{session}/{call}/{worker}"


# --------------------------------------------------------------------------
# inside SGLang's workers


def served_spec(model: torch.nn.Module, replicas: int) -> str:
    """The ``sglang:`` spec this TP worker serves, read from SGLang's own server arguments.

    ``tp`` is ``--tp-size``, ``ep`` is ``--ep-size`` equal to it (``> 1``),
    ``dp`` the number of servers the client drives (``replicas``), the dtype
    the model's parameters are served in, written ``auto`` when SGLang's
    ``auto`` rule (``adapters.sglang.rules.sglang_dtype``) gives it
    (``srt/runtime_context.py`` ``get_server_args``).

    Raises:
        ValueError: ``--ep-size`` other than 1 or ``--tp-size``, pipeline
            parallelism, DP attention (names the argument).
    """
    from sglang.srt.runtime_context import get_server_args

    from m2nkit.adapters.sglang.rules import sglang_dtype
    from m2nkit.adapters.sglang.spec import SGLangSpec

    args = get_server_args()
    tp, ep = int(args.tp_size), int(args.ep_size)
    if int(getattr(args, "pp_size", 1)) != 1:
        raise ValueError(f"SGLang --pp-size {args.pp_size}: m2nkit does not plan for pipeline "
                         "parallelism (use 1)")
    if getattr(args, "enable_dp_attention", False):
        raise ValueError("SGLang --enable-dp-attention is not planned by m2nkit")
    if ep not in (1, tp):
        raise ValueError(f"SGLang --ep-size {ep} with --tp-size {tp}: m2nkit plans --ep-size 1 "
                         "or equal to --tp-size")
    served = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    name = str(served).removeprefix("torch.")
    try:
        auto = sglang_dtype(model.config, "auto")[0]
    except ValueError:
        auto = None
    return str(SGLangSpec(tp, replicas, ep == tp and tp > 1, "auto" if auto == name else name))


class M2NSGLangEngine:
    """One SGLang TP worker's end of m2nkit sessions: ``M2NReceiver`` on the live model.

    Built by :func:`load` at the first command for a model, kept for its
    lifetime. The receiver writes each slab straight into the live
    parameters (``in_place``, or ``staged`` with ``M2NKIT_RECEIVE_MODE``).

    Args:
        model: SGLang's live model (``ModelRunner.model``; ``model.config`` its HF config).
        worker: ``replica * tp + tp_rank``.
        replicas: the servers of the session (``dp``).

    Raises:
        ValueError: ``worker`` is not this TP rank of ``replicas`` servers;
            as :func:`served_spec`; an architecture m2nkit's SGLang rules do not have.
    """

    def __init__(self, model: torch.nn.Module, worker: int, replicas: int) -> None:
        from sglang.srt.runtime_context import get_parallel

        from m2nkit.adapters.sglang.destination import sglang_destination

        self.model = model
        self.spec = served_spec(model, replicas)
        self.tp_rank, tp = get_parallel().tp_rank, get_parallel().tp_size
        if worker % tp != self.tp_rank or worker >= tp * replicas:
            raise ValueError(f"SGLang TP rank {self.tp_rank} of {tp}: the command names worker "
                             f"{worker}, which is TP rank {worker % tp} of replica {worker // tp} "
                             f"(of {replicas}); each server's payload list is indexed by TP rank")
        self.worker, self.replicas, self.tp = worker, replicas, tp
        self.destination = sglang_destination(model.config, self.spec)
        self.mode = receive_mode()
        self._receiver: M2NReceiver | None = None

    def __str__(self) -> str:
        return f"worker {self.worker} (SGLang replica {self.worker // self.tp}, tp rank {self.tp_rank})"

    @property
    def weight_version(self) -> str | None:
        return self._receiver.weight_version if self._receiver is not None else None

    @property
    def store(self):
        return self._receiver._store if self._receiver is not None else None

    @property
    def session(self) -> str | None:
        payload = self._receiver._payload if self._receiver is not None else None
        return payload.session if payload is not None else None

    def init(self, init_info: Mapping[str, Any]) -> None:
        """Hold the live model against the plan, then join the session.

        Every parameter the plan declares for this worker must be a live
        parameter of that local shape and dtype, every live parameter must be
        declared, every declared tie shared storage (``live_model_problems``);
        otherwise every rank of the session raises this worker's message
        (``PlanMismatchError``) and nothing moves.

        Raises:
            ValueError: a payload that does not parse (also told to the trainers).
            PlanMismatchError: this worker or another rank refused.
            TransferError: the rendezvous or agreement ran past ``timeout_s``.
        """
        try:
            payload = InitPayload.from_json(init_info)
        except (TypeError, ValueError) as e:
            message = f"{self}: {e}"
            refuse_unparsed_payload(init_info, self.worker, message)
            raise ValueError(message) from None
        planned = None
        if payload.inference == self.destination.spec:
            try:
                destination = session_destination(payload, self.destination, str(self))
                plan, digest = plan_from_manifest(payload.manifest, destination)
                planned = (plan, digest)
            except ValueError:
                plan = None            # the receiver refuses it with its own message
            if plan is not None:
                found = live_model_problems(self.model, plan.destination, self.worker,
                                            engine="SGLang")
                if found:
                    more = (f" ... and {len(found) - _LIST_AT_MOST} more"
                            if len(found) > _LIST_AT_MOST else "")
                    message = (f"{self}: SGLang's {type(self.model).__name__} does not match "
                               f"m2nkit's layout for {self.spec}: "
                               + "; ".join(found[:_LIST_AT_MOST]) + more)
                    refuse_everywhere(payload, self.worker, message)
                    raise PlanMismatchError(f"{message}; nothing was sent")
        device = buffer_device(payload, next(self.model.parameters()).device)
        if self._receiver is None or self._receiver.device != device:
            if self._receiver is not None:
                self._receiver.shutdown()
            self._receiver = M2NReceiver(self.destination, self.worker, target=self.model,
                                         device=device, mode=self.mode)
        self._receiver.init_transfer_engine(payload, planned=planned)

    def _require(self, what: str) -> M2NReceiver:
        if self._receiver is None or self._receiver.plan is None:
            raise ValueError(f"{self}: {what} before an init")
        return self._receiver

    def start(self) -> None:
        """Begin a round; the live model is held against the plan once more (ties, shapes)."""
        receiver = self._require("start")
        found = live_model_problems(self.model, receiver.plan.destination, self.worker,
                                    undeclared=False, engine="SGLang")
        if found:
            raise ValueError(f"{self}: the live model changed since the session's init: "
                             + "; ".join(found[:_LIST_AT_MOST]) + "; nothing was written")
        receiver.start_weight_update()

    def update(self, update_info: Mapping[str, Any]) -> None:
        """Receive this worker's slabs; returns once every rank's verdict is in."""
        receiver = self._require("update")
        try:
            info = M2NUpdateInfo(**dict(update_info))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self}: {e}") from None
        receiver.receive_weights(info)

    def finish(self, weight_version: str | None) -> None:
        """Commit the round, then SGLang's post-load step for loaders that bypass ``load_weights``.

        ``post_load_weights(model)`` (``srt/model_loader/loader.py``: the
        model's ``post_load_weights``, e.g. DeepSeek's MLA ``w_kc``/``w_vc``
        from ``kv_b_proj``); SGLang's ``end_weight_update`` skips it once a
        load ran (``run_post_load = not loaded_weights``).

        Raises:
            IncompleteRoundError: wire tensors missing or the round failed;
                nothing committed.
        """
        from sglang.srt.model_loader.loader import post_load_weights

        self._require("finish").finish_weight_update(weight_version)
        with torch.no_grad():
            post_load_weights(self.model)

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.shutdown()


_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, M2NSGLangEngine]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def engine_of(model: torch.nn.Module) -> M2NSGLangEngine | None:
    """The engine :func:`load` built for ``model`` (``None`` before its first command)."""
    return _ENGINES.get(model)


def load(model: torch.nn.Module, named_tensors: Sequence[tuple[Any, Any]]) -> None:
    """SGLang's custom weight loader: run one m2nkit command on this TP worker's live model.

    Called by SGLang as ``load(model, named_tensors)`` in each TP worker
    (``WeightUpdater.update_weights_from_tensor``). Never raises (see the
    module docstring): a failure is logged and written, with this worker's
    name, as the call's outcome into the session's store, where
    :class:`SGLangClient` raises it.
    """
    with _LOCK:
        engine, command, error = _ENGINES.get(model), None, None
        try:
            command = read_command(named_tensors)
            if engine is None:
                engine = _ENGINES[model] = M2NSGLangEngine(model, command["worker"],
                                                           command["replicas"])
            op = command["op"]
            if op == "init":
                engine.init(command.get("init_info"))
            elif op == "start":
                engine.start()
            elif op == "update":
                engine.update(command.get("update_info") or {})
            elif op == "finish":
                engine.finish(command.get("weight_version"))
            else:
                engine.shutdown()
        except Exception as e:  # noqa: BLE001 - never into SGLang's scheduler (module docstring)
            error = f"{type(e).__name__}: {e}"
            _log.error("m2nkit %s: %s", (command or {}).get("op"), error)
        if engine is not None and command is not None:
            _report(engine, command, error)


def _report(engine: M2NSGLangEngine, command: dict, error: str | None) -> None:
    """Write this worker's outcome of ``command`` into the session's store (best effort)."""
    store, session = engine.store, engine.session
    if command["op"] == "init" and error is None or store is None or session is None:
        return
    try:
        store.set(_outcome_key(session, command["call"], engine.worker),
                  json.dumps({"error": error}))
    except Exception:  # noqa: BLE001 - the store's host is gone: the trainers know already
        _log.error("m2nkit: could not report %s of call %s", command["op"], command["call"])


# --------------------------------------------------------------------------
# the trainer side


class EngineServer:
    """One in-process ``sglang.Engine`` (verl's and AReaL's colocated rollouts) as a client target.

    ``send(request)`` runs the tokenizer manager's handler of the request's
    type on the engine's loop, as ``Engine.update_weights_from_tensor`` does
    (``srt/entrypoints/engine.py``); returns ``(success, message)``.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def tp_size(self) -> int:
        return int(self.engine.server_args.tp_size)

    @property
    def custom_weight_loader(self) -> list[str]:
        return list(self.engine.server_args.custom_weight_loader or [])

    def send(self, request: Any) -> tuple[bool, str]:
        name = _HANDLERS[type(request).__name__]
        result = self.engine.loop.run_until_complete(
            getattr(self.engine.tokenizer_manager, name)(
                request, *([None] if name != "update_weight_version" else [])))
        return (True, "Success") if result is None else (bool(result[0]), str(result[1]))


class HTTPServer:
    """One SGLang server over HTTP (slime's and Miles' layout) as a client target.

    ``send(request)`` POSTs the request's fields as JSON to SGLang's route of
    the same name (``srt/entrypoints/http_server.py``: ``/update_weights_from_tensor``,
    ``/begin_weight_update``, ``/end_weight_update``, ``/update_weight_version``);
    bytes fields go base64, as SGLang's HTTP schema reads them.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def _info(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.base_url + "/get_server_info",
                                    timeout=self.timeout_s) as r:
            return json.loads(r.read())

    @property
    def tp_size(self) -> int:
        return int(self._info()["tp_size"])

    @property
    def custom_weight_loader(self) -> list[str]:
        return list(self._info().get("custom_weight_loader") or [])

    def send(self, request: Any) -> tuple[bool, str]:
        import base64
        import urllib.error
        import urllib.request

        def plain(v):
            if isinstance(v, (bytes, bytearray)):
                return base64.b64encode(bytes(v)).decode()
            return [plain(x) for x in v] if isinstance(v, list) else v

        body = {f: plain(getattr(request, f)) for f in request.__struct_fields__
                if f not in ("rid", "http_worker_ipc")}
        req = urllib.request.Request(self.base_url + "/" + _HANDLERS[type(request).__name__],
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                out = json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                out = json.loads(text)
            except ValueError:
                return False, f"HTTP {e.code}: {text[:500]}"
        return bool(out.get("success", False)), str(out.get("message", out))


#: SGLang request class -> its tokenizer-manager handler and HTTP route (the same name).
_HANDLERS = {"UpdateWeightsFromTensorReqInput": "update_weights_from_tensor",
             "BeginWeightUpdateReqInput": "begin_weight_update",
             "EndWeightUpdateReqInput": "end_weight_update",
             "UpdateWeightVersionReqInput": "update_weight_version"}


class SGLangClient:
    """``VLLMWeightSyncClient`` for SGLang servers: what ``M2NTrainerEngine`` drives on rank 0.

    Each call is SGLang requests built from SGLang's own classes
    (``managers/io_struct.py``): ``UpdateWeightsFromTensorReqInput`` whose
    ``serialized_named_tensors`` holds, per TP rank, ``MultiprocessingSerializer.serialize``
    of that rank's command (:func:`command_tensors`), with
    ``load_format=LOADER``; a round sits inside SGLang's weight-update session
    (``BeginWeightUpdateReqInput`` ... ``EndWeightUpdateReqInput``, which 0.5.23
    requires around ``update_weights_from_tensor``). After SGLang answers,
    every worker's outcome is read from the session's store; the version is
    set (``UpdateWeightVersionReqInput``) only once every worker committed.

    Args:
        servers: one per replica (``dp``), in replica order: :class:`EngineServer`,
            :class:`HTTPServer`, or anything with ``send(request) -> (ok, message)``,
            ``tp_size`` and ``custom_weight_loader``.
        timeout_s: seconds a store read may wait (the outcomes are written
            before SGLang answers, so this is slack).

    Raises (every call):
        WeightSyncError: SGLang refused a request (its message), or a worker
            failed the call (names the worker and its error), or reported nothing.
    """

    def __init__(self, servers: Sequence[Any], timeout_s: float = 30.0) -> None:
        from m2nkit.engine.clients import WeightSyncError

        if not servers:
            raise ValueError("SGLangClient needs at least one server")
        self.servers, self.timeout_s = list(servers), timeout_s
        self.tp = {s.tp_size for s in self.servers}
        if len(self.tp) != 1:
            raise ValueError(f"SGLangClient: the servers run different --tp-size {sorted(self.tp)}")
        self.tp = self.tp.pop()
        for k, s in enumerate(self.servers):
            if LOADER not in s.custom_weight_loader:
                # SGLang raises NotImplementedError for an unknown load_format inside its
                # scheduler, which ends the server: refuse here instead.
                raise WeightSyncError(
                    f"SGLang server {k} was not started with --custom-weight-loader {LOADER} "
                    f"(it has {s.custom_weight_loader}); start it with that flag", status=400)
        self._call = 0
        self._payload: dict | None = None
        self._store = None

    def get_world_size(self) -> int:
        return self.tp * len(self.servers)

    def _fan_out(self, make) -> None:
        """``make(k)`` -> request for server ``k``; send to every server at once; raise on refusal."""
        from m2nkit.engine.clients import WeightSyncError

        results: dict[int, tuple[bool, str]] = {}

        def run(k):
            try:
                results[k] = self.servers[k].send(make(k))
            except Exception as e:  # noqa: BLE001 - reported below, per server
                results[k] = (False, f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=run, args=(k,), daemon=True)
                   for k in range(len(self.servers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = {k: m for k, (ok, m) in sorted(results.items()) if not ok}
        if bad:
            raise WeightSyncError("; ".join(f"SGLang server {k}: {m}" for k, m in bad.items()),
                                  status=500)

    def _command(self, op: str, flush_cache: bool = False, **fields) -> int:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        self._call += 1
        call, n = self._call, len(self.servers)

        def make(k):
            return UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[MultiprocessingSerializer.serialize(command_tensors(
                    {"op": op, "call": call, "worker": k * self.tp + r, "replicas": n, **fields}))
                    for r in range(self.tp)],
                load_format=LOADER, flush_cache=flush_cache)

        self._fan_out(make)
        return call

    def _session(self, begin: bool) -> None:
        """Open (``begin``) or close SGLang's weight-update session on every server.

        A session a failed round left open (its ``finish`` never came) is
        closed first, then opened again.
        """
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        from m2nkit.engine.clients import WeightSyncError

        if not begin:
            self._fan_out(lambda k: EndWeightUpdateReqInput())
            return
        try:
            self._fan_out(lambda k: BeginWeightUpdateReqInput())
        except WeightSyncError as e:
            if "already open" not in str(e):
                raise
            for k, server in enumerate(self.servers):
                server.send(EndWeightUpdateReqInput())      # "no session" where none was open
            self._fan_out(lambda k: BeginWeightUpdateReqInput())

    def _outcomes(self, call: int, op: str) -> None:
        """Every worker's outcome of ``call``, from the session's store; raise naming the failures."""
        import torch.distributed as dist

        from m2nkit.engine.clients import WeightSyncError

        p = self._payload
        if p is None:
            raise WeightSyncError(f"SGLang {op}: no session (init_weight_transfer_engine first)",
                                  status=400)
        try:
            if self._store is None:
                self._store = dist.PrefixStore("m2nkit", dist.TCPStore(
                    p["master_address"], p["master_port"], None, False,
                    timedelta(seconds=self.timeout_s), wait_for_workers=False))
            keys = [_outcome_key(p["session"], call, w) for w in range(self.get_world_size())]
            got = {w: json.loads(self._store.get(k)) if self._store.check([k]) else None
                   for w, k in enumerate(keys)}
        except Exception as e:  # noqa: BLE001 - the session's store is gone
            raise WeightSyncError(f"SGLang {op}: the session's store at {p['master_address']}:"
                                  f"{p['master_port']} cannot be read: {e}", status=None) from None
        bad = {w: ("reported nothing (see that SGLang server's log)" if o is None else o["error"])
               for w, o in got.items() if o is None or o["error"]}
        if bad:
            raise WeightSyncError(f"{op} failed on workers {sorted(bad)}: " + "; ".join(
                f"worker {w}: {m}" for w, m in bad.items()), status=500)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Send the init payload to every worker (inside a weight-update session).

        A worker's refusal reaches every trainer rank through the plan
        agreement (``PlanMismatchError`` naming it), not through this call.
        """
        self._payload, self._store = dict(init_info), None
        self._session(begin=True)
        try:
            self._command("init", init_info=init_info)
        finally:
            self._session(begin=False)

    def start_weight_update(self) -> None:
        self._session(begin=True)
        self._outcomes(self._command("start"), "start_weight_update")

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        self._outcomes(self._command("update", update_info=dict(update_info)), "update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Commit on every worker; then end SGLang's session and set its ``weight_version``.

        The version is set only after every worker reported its commit, and
        the commit request flushes SGLang's cache (``flush_cache=True``: it
        fails, as SGLang's own rule says, while requests still run).
        """
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        try:
            self._outcomes(self._command("finish", flush_cache=True,
                                         weight_version=weight_version),
                           "finish_weight_update")
        finally:
            self._session(begin=False)
        if weight_version is not None:
            self._fan_out(lambda k: UpdateWeightVersionReqInput(new_version=str(weight_version),
                                                                abort_all_requests=False))

    def shutdown_weight_transfer_engine(self) -> None:
        self._session(begin=True)
        try:
            self._command("shutdown")
        finally:
            self._session(begin=False)
