"""Real SGLang workers on CPU: the harness of the SGLang plugin's tests and ``m2nkit demo --receiver sglang``.

An SGLang server runs none of this: it loads :mod:`m2nkit.engine.plugins.sglang`
by its ``--custom-weight-loader`` flag. Here one *host* process runs under
``.venv-sglang/bin/python`` (SGLang's stack cannot share ``.venv``,
docs/sglang.md), imports SGLang once and forks one process per TP rank.
Each builds what an SGLang TP worker holds, with SGLang's own code:

* SGLang's parallel state over real gloo groups
  (``runtime_context.publish(ServerArgs(..., device="cpu",
  custom_weight_loader=[LOADER]))``, ``init_distributed_environment``,
  ``initialize_model_parallel``);
* SGLang's model class from its registry (``loader._initialize_model``),
  loaded by its own ``model.load_weights`` from the checkpoint (v0);
* SGLang's own weight-update path around that live model: the scheduler's
  ``SchedulerWeightUpdaterManager`` (``managers/scheduler_components/weight_updater.py``:
  the session check, ``deserialize_own_rank``, the TP barrier, the version
  recorded only on success) over the model runner's ``WeightUpdater``
  (``model_runner_components/weight_updater.py``: ``load_format`` in
  ``custom_weight_loaders`` -> ``dynamic_import(load_format)(model, named_tensors)``).
  What a scheduler process adds around them is stood in by the smallest
  objects they read: the TP worker's ``weight_update_runners`` (SGLang's own
  ``TpModelWorker.deserialize_own_rank``), the scheduler's
  ``record_weight_version_change`` (SGLang's own, on an idle scheduler), a
  cache flush that succeeds (no requests run here).

The host plays SGLang's tokenizer manager: each request the real
``SGLangClient`` builds (SGLang's ``io_struct`` classes) goes to every TP
worker at once, and the server answers success only if all did, as
``FanOutCommunicator.merge_results`` does. Trainers drive it through
``demo_vllm.WorkersClient`` (the four weight-sync calls, ``verify``,
``collective_rpc``) from ``.venv``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["SGLangWorkers", "sglang_python"]

#: The weight-sync calls the host answers with its ``SGLangClient``.
CLIENT_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                "finish_weight_update", "shutdown_weight_transfer_engine")


def sglang_python() -> Path:
    """``$M2NKIT_SGLANG_PYTHON``, else ``.venv-sglang/bin/python`` of this checkout
    (``scripts/side_sglang.sh`` builds it)."""
    if os.environ.get("M2NKIT_SGLANG_PYTHON"):
        return Path(os.environ["M2NKIT_SGLANG_PYTHON"])
    return Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"


# --------------------------------------------------------------------------
# one TP worker (forked from the host, under .venv-sglang)


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")


def _server_args(checkpoint: str, tp: int, ep: bool):
    from sglang.srt.server_args import ServerArgs

    from m2nkit.engine.plugins.sglang import LOADER

    return ServerArgs(model_path=checkpoint, tp_size=tp, ep_size=tp if ep else 1, device="cpu",
                      skip_tokenizer_init=True, disable_custom_all_reduce=True,
                      custom_weight_loader=[LOADER])


def _build_model(checkpoint: str, tp: int, ep: bool):
    """SGLang's model class for ``checkpoint``, loaded by its own ``load_weights`` (the oracle's way)."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    mc = ModelConfig.from_server_args(_server_args(checkpoint, tp, ep))
    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
        model = _initialize_model(mc, loader.load_config, None)
    with torch.no_grad():
        model.load_weights(loader._get_all_weights(mc, model))
    return model, mc


def _updater(model, mc, tp_rank: int):
    """SGLang's scheduler-level weight updater around ``model`` (see the module docstring)."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_model

    runner = SimpleNamespace(weight_updater=WeightUpdater(
        tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=mc,
        custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: model,
        update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None))

    class TpWorker:           # what the manager reads of SGLang's TpModelWorker
        deserialize_own_rank = TpModelWorker.deserialize_own_rank

        def weight_update_runners(self):
            return [("target", runner)]

    class IdleScheduler:      # SGLang's own version bookkeeping on a scheduler with no requests
        record_weight_version_change = Scheduler.record_weight_version_change
        handle_update_weight_version = Scheduler.handle_update_weight_version
        waiting_queue, chunked_req, hisparse_coordinator = [], None, None

        def collect_inflight_reqs(self):
            return set()

    scheduler = IdleScheduler()
    manager = SchedulerWeightUpdaterManager(
        tp_worker=TpWorker(), draft_worker=None, memory_saver_adapter=None,
        flush_cache=lambda **kwargs: True, is_fully_idle=lambda **kwargs: True,
        scheduler=scheduler)
    return manager, scheduler


def _dispatch(manager, scheduler, request) -> tuple[bool, str]:
    """What SGLang's scheduler does with each request type (``Scheduler._request_dispatcher``)."""
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    kind = type(request).__name__
    if kind == "UpdateWeightsFromTensorReqInput":
        # the tokenizer manager normalizes the payloads before the scheduler sees them
        request.serialized_named_tensors = normalize_serialized_named_tensor_payloads(
            request.serialized_named_tensors)
        out = manager.update_weights_from_tensor(request)
    elif kind == "BeginWeightUpdateReqInput":
        out = manager.begin_weight_update(request)
    elif kind == "EndWeightUpdateReqInput":
        out = manager.end_weight_update(request)
    elif kind == "UpdateWeightVersionReqInput":
        scheduler.handle_update_weight_version(request)
        return True, f"Weight version updated to {request.new_version}"
    else:
        raise ValueError(f"no handler for {kind}")
    return bool(out.success), str(out.message)


def _worker_main(conn, checkpoint: str, tp: int, ep: bool, rank: int, port: int) -> None:
    """One SGLang TP worker: build, load v0, then serve ``(cmd, arg)`` until told to stop."""
    import torch

    from m2nkit.engine.clients import error_status

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.runtime_context import SpawnRanks, get_serving, publish

        from m2nkit.engine.in_process import bitwise_equal
        from m2nkit.engine.plugins.sglang import engine_of

        publish(_server_args(checkpoint, tp, ep), role="scheduler",
                ranks=SpawnRanks(world_rank=rank))
        ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                        backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(backend="gloo")
        model, mc = _build_model(checkpoint, tp, ep)
        manager, scheduler = _updater(model, mc, rank)

        def params(m):
            return {n: p.data for n, p in m.named_parameters(remove_duplicate=False)}

        before = {n: t.clone() for n, t in params(model).items()}
        addresses = {n: t.data_ptr() for n, t in params(model).items()}
        state = {"model": model, "worker": rank, "manager": manager}
        conn.send((True, {"seconds": time.perf_counter() - t0, "pid": os.getpid(),
                          "model": type(model).__name__, "parameters": len(before)}))
    except BaseException as e:  # noqa: BLE001 - reported to the host
        conn.send((False, (500, f"SGLang TP rank {rank} failed to start: {type(e).__name__}: "
                                f"{e}\n{traceback.format_exc()[-2000:]}")))
        return

    def verify(ckpt: str) -> dict:
        """This worker against SGLang's own ``load_weights`` of ``ckpt`` in a fresh model."""
        live = params(model)
        fresh, _ = _build_model(ckpt, tp, ep)
        ref = params(fresh)
        derived = {}
        for name, module in model.named_modules():     # DeepSeek MLA: post_load_weights' w_kc/w_vc
            other = dict(fresh.named_modules())[name]
            for attr in ("w_kc", "w_vc"):
                a, b = getattr(module, attr, None), getattr(other, attr, None)
                if isinstance(b, torch.Tensor):
                    derived[f"{name}.{attr}"] = isinstance(a, torch.Tensor) and bitwise_equal(a, b)
        engine = engine_of(model)
        return {
            "compared": len(ref),
            "names_only_live": sorted(set(live) - set(ref)),
            "names_only_fresh": sorted(set(ref) - set(live)),
            "differ": sorted(n for n in ref if n in live and not bitwise_equal(live[n], ref[n])),
            "unchanged_since_start": sorted(n for n, t in live.items()
                                            if n in before and bitwise_equal(t, before[n])),
            "moved": sorted(n for n, t in live.items() if addresses.get(n) != t.data_ptr()),
            "version": engine.weight_version if engine is not None else None,
            "sglang_version": get_serving().weight_version,
            "derived_differ": sorted(n for n, ok in derived.items() if not ok),
            "derived": len(derived),
        }

    calls = {
        "send": lambda req: _dispatch(manager, scheduler, req),
        "verify": verify,
        "weight_version": lambda arg: (engine_of(model).weight_version
                                       if engine_of(model) is not None else None),
        "collective_rpc": lambda arg: arg[0](state, *arg[1]),
    }
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            engine = engine_of(model)
            if engine is not None:
                engine.shutdown()
            conn.send((True, None))
            return
        try:
            conn.send((True, calls[cmd](arg)))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            traceback.clear_frames(e.__traceback__)
            conn.send((False, (error_status(e), f"{type(e).__name__}: {e}")))


# --------------------------------------------------------------------------
# the host (under .venv-sglang)


def _host_class():
    import multiprocessing as mp

    from m2nkit.adapters.sglang.spec import parse_sglang_spec
    from m2nkit.engine.clients import WeightSyncError
    from m2nkit.engine.plugins.sglang import LOADER, SGLangClient
    from m2nkit.engine.tools.demo_vllm import WorkerHost
    from m2nkit.engine.tools.procs import free_port

    class Server:
        """The host's TP workers as one SGLang server for ``SGLangClient``."""

        def __init__(self, host, tp):
            self.host, self.tp_size, self.custom_weight_loader = host, tp, [LOADER]

        def send(self, request):
            replies = self.host.call("send", request, None)
            bad = [m for ok, m in replies if not ok]
            return (not bad, "; ".join(bad) if bad else replies[0][1])

    class Host(WorkerHost):
        client = None

        def start_workers(self, checkpoint: str, spec_text: str, *_) -> list[dict]:
            spec = parse_sglang_spec(spec_text)
            if spec.dp != 1:
                raise WeightSyncError(f"{spec}: this harness runs one SGLang server (dp=1)",
                                      status=400)
            self.stop_workers()
            ctx, port = mp.get_context("fork"), free_port()
            for r in range(spec.tp):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_worker_main,
                                args=(theirs, checkpoint, spec.tp, spec.ep, r, port),
                                name=f"m2nkit-sglang-tp{r}", daemon=True)
                p.start()
                theirs.close()
                self.workers.append((p, mine))
            started = self._gather("start", self.timeout_s)
            self.client = SGLangClient([Server(self, spec.tp)])
            return started

        def client_call(self, cmd: str, arg: Any):
            if self.client is None:
                raise WeightSyncError(f"{cmd}: no workers are running (start_workers first)",
                                      status=400)
            fn = getattr(self.client, cmd)
            return fn() if cmd in ("start_weight_update", "shutdown_weight_transfer_engine") \
                else fn(arg)

    return Host


def main() -> int:
    """The host: import SGLang once, print the listener's address, serve until stdin closes."""
    from multiprocessing.connection import Listener

    from m2nkit.engine.tools.demo_vllm import serve_host

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _quiet()
    authkey = bytes.fromhex(os.environ.pop("M2NKIT_HOST_AUTHKEY"))
    timeout_s = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
    try:
        import torch

        torch.set_num_threads(1)
        import sglang.srt.managers.scheduler  # noqa: F401 - SGLang's import, once for every fork
        from sglang.srt.model_loader import loader  # noqa: F401

        host = _host_class()(timeout_s)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(json.dumps({"address": list(listener.address)}), flush=True)
    busy = threading.Lock()

    def client_calls(cmd: str, arg: Any) -> tuple[bool, Any]:
        if cmd not in CLIENT_CALLS:
            return False, None
        with busy:
            return True, host.client_call(cmd, arg)

    serve_host(listener, host, name="m2nkit-sglang-host-accept", extra=client_calls,
               answer_unreadable=True)
    # EOF: the parent is gone or said stop. Read the raw descriptor: a forked worker closes
    # sys.stdin on start (multiprocessing's _bootstrap), which would block on the lock a
    # sys.stdin.read() here holds.
    while os.read(sys.stdin.fileno(), 1 << 16):
        pass
    host.stop_workers()
    listener.close()
    return 0


# --------------------------------------------------------------------------
# the parent's side (under .venv)


class SGLangWorkers:
    """The SGLang host process (``.venv-sglang``) and the client that drives it.

    Use::

        with SGLangWorkers(timeout_s=300) as host:
            host.start_workers(checkpoint_v0, "sglang:tp=2")   # forks 2 TP workers, loads v0
            ... trainers send with host.client (a demo_vllm.WorkersClient) ...
            reports = host.client.verify(checkpoint_v1)

    ``path``: folders put in front of the host's ``PYTHONPATH``, where the
    functions given to ``client.collective_rpc`` are imported from (the tests').

    Raises (``start``):
        RuntimeError: ``.venv-sglang`` is missing, or the host did not come up
            within ``timeout_s`` (its error).
    """

    def __init__(self, timeout_s: float = 300.0, path: tuple[str, ...] = ()) -> None:
        self.timeout_s = timeout_s
        self.path = tuple(str(p) for p in path)
        self._proc = None
        self.client = None

    def start(self) -> "SGLangWorkers":
        from m2nkit.engine.tools.demo_vllm import WorkersClient

        python = sglang_python()
        if not python.exists():
            raise RuntimeError(f"{python} is missing: scripts/setup.sh installs SGLang's stack "
                               "there (scripts/side_sglang.sh)")
        authkey = secrets.token_bytes(16)
        env = {**os.environ, "M2NKIT_HOST_AUTHKEY": authkey.hex()}
        if self.path:   # where the functions given to collective_rpc live
            env["PYTHONPATH"] = os.pathsep.join([*self.path, env.get("PYTHONPATH", "")])
        self._proc = subprocess.Popen(
            [str(python), "-c", "import sys; from m2nkit.engine.tools.sglang_workers import main; "
             "sys.exit(main())", str(self.timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        line = _readline(self._proc, self.timeout_s)
        # anything SGLang prints later is drained, so a full pipe never blocks a worker
        threading.Thread(target=self._proc.stdout.read, daemon=True).start()
        reply = json.loads(line) if line else {"error": f"it exited ({self._proc.poll()})"}
        if "address" not in reply:
            self.stop()
            raise RuntimeError(f"the SGLang worker host failed to start: {reply.get('error')}")
        self.client = WorkersClient(tuple(reply["address"]), authkey, self.timeout_s)
        return self

    def start_workers(self, checkpoint, spec: str) -> list[dict]:
        """Fork one TP worker per rank of ``spec`` (stopping earlier ones); each loads ``checkpoint``."""
        return self.client.request("start_workers", (str(Path(checkpoint).resolve()), str(spec)))

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(5)

    def __enter__(self) -> "SGLangWorkers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _readline(proc, timeout_s: float) -> str:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()),
                         daemon=True)
    t.start()
    t.join(timeout_s)
    return box.get("line", "")
