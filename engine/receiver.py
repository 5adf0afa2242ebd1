"""The worker-side receiver: one vLLM worker's end of a transfer session.

A receiver owns one worker's live vLLM-layout storage and commits a version
only for a *complete* round. Two modes (``mode=``):

* ``"staged"`` (default): bytes land in a staging copy first; the copy is
  written into the live parameters at ``finish_weight_update`` only when
  every wire tensor the plan sends this worker arrived. A round that fails
  halfway (dead trainer, timeout, broken group) never leaves half-new
  weights behind: the live storage and the committed version stay as they
  were, and the error lists what arrived and what is missing. The price is
  memory and a copy: during a round the worker holds its parameters twice
  (live + staging), freed at commit or abort. For callers that keep
  generating during a round.
* ``"in_place"``: bytes land in the live parameters themselves (a slab whose
  region is contiguous there is received straight into it; the rest through
  a reused bounce buffer of at most one bucket), so a round costs no copy of
  the model and the extra memory stays within one bucket. For callers that
  paused generation (what vLLM's own engines do). A failed round then
  leaves *mixed* weights: some tensors of the new round, the rest older.
  The receiver says so: the version stays the last committed one, the
  round's error and ``finish_weight_update``'s refusal say that the live
  weights are now mixed and that a new complete round is needed before they
  are served, and ``weights_mixed`` is True until one commits.

In both modes parameters are written in place (``copy_`` or a receive into
their storage): their addresses never change, which CUDA graphs need.

A live model whose parameters are not in the wire's format (a quantized
vLLM model) is given with a ``reload=`` (:class:`ReloadTarget`): the round
lands in the checkpoint-format tensors it hands out, and it makes the live
parameters from them; the receiver's checks, rounds and verdicts stay the
same.

Before any byte moves the receiver checks the init payload against itself
(the inference spec, the manifest digest, the plan it rebuilds from its own
destination layout, the plan digest) and then ``agree_on_plan`` with every rank;
any difference is an error on every rank, never a hang or shifted weights
(docs/engine.md, "What happens in a round"; docs/reference.md §2: workers reject a payload whose
recomputed digest differs). A refusal is told to the trainers through the
same agreement. Each round it tells the trainers, in the session store, that
it joined (``join_round``: its ``update_weights`` passed its checks) right
before it posts its receives; the trainers send only once every worker did.
After its receives every rank takes part in ``finish_round``,
one verdict for the round: a worker whose own bytes all arrived still does
not commit when another rank failed.

The receiver knows no model family: its caller passes the destination
layout as a ``DestinationBuilder`` (``m2nkit.adapters.vllm.vllm_destination``).
Timing: ``timeout_s`` of the payload bounds the init and each round, not
each wait (one deadline each, ``m2nkit.engine.deadline``); a failed round
raises within ``timeout_s + REPORT_GRACE_S`` of ``update_weights``.

Contract: vLLM ``vllm/distributed/weight_transfer/base.py``
(``WeightTransferEngine``), as restated in ``m2nkit.manifest.protocol``;
the calls arrive through vLLM's routes
(``vllm/entrypoints/serve/dev/rlhf/api_router.py``: ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol

import torch

from m2nkit.engine.control import (
    PlanMismatchError,
    TransferError,
    agree_on_plan,
    create_group,
    finish_round,
    join_round,
    refuse_rendezvous,
    release_group,
)
from m2nkit.engine.deadline import Deadline
from m2nkit.engine.plan_types import Plan
from m2nkit.engine.session import (
    DestinationBuilder,
    InitPayload,
    check_destination,
    plan_from_manifest,
    session_destination,
)
from m2nkit.engine.transports.registry import open_transport
from m2nkit.manifest.destination import DestinationLayout
from m2nkit.manifest.protocol import WeightTransferEngine, WeightTransferUpdateInfo

__all__ = ["M2NUpdateInfo", "IncompleteRoundError", "SupersededError", "M2NReceiver",
           "build_vllm_storage", "RECEIVE_MODES", "refuse_unparsed_payload", "ReloadTarget"]

#: ``M2NReceiver(mode=...)``: copy at commit, or receive into the live parameters.
RECEIVE_MODES = ("staged", "in_place")

_LIST_AT_MOST = 40  # wire names quoted in one error message

#: Seconds a worker that refuses an unparseable init payload spends at most
#: telling the trainers' rendezvous store why (``_refuse_unparsed``).
REFUSAL_CONNECT_S = 5.0


class IncompleteRoundError(TransferError):
    """``finish_weight_update`` refused: some wire tensors of the round never arrived.

    ``received`` and ``missing`` list the wire tensor names.
    """

    def __init__(self, message: str, received: list[str], missing: list[str]) -> None:
        super().__init__(message)
        self.received = received
        self.missing = missing


class SupersededError(TransferError):
    """A call of a session that a newer ``init_weight_transfer_engine`` replaced."""


@dataclass
class M2NUpdateInfo(WeightTransferUpdateInfo):
    """Per-round update info: ``{"round": k, "version": v, "session": s}``.

    ``round`` (int >= 0) labels the round in errors; ``version`` is the
    weight version the trainer intends to commit (used when
    ``finish_weight_update`` gets none); ``session`` the init payload's
    ``session`` (a worker refuses a call of a superseded session; ``None``:
    not checked).

    Raises:
        ValueError: ``round`` not a non-negative int, ``version`` or
            ``session`` not a string or None.
    """

    round: int
    version: str | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 0:
            raise ValueError(f"update_info field 'round' must be an int >= 0, got {self.round!r}")
        if self.version is not None and not isinstance(self.version, str):
            raise ValueError(f"update_info field 'version' must be a string or null, "
                             f"got {self.version!r}")
        if self.session is not None and not isinstance(self.session, str):
            raise ValueError(f"update_info field 'session' must be a string or null, "
                             f"got {self.session!r}")


def _few(names, n: int = _LIST_AT_MOST) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - n} more" if len(names) > n else ""
    return "[" + ", ".join(f"'{x}'" for x in names[:n]) + "]" + more


def build_vllm_storage(destination: DestinationLayout, worker: int,
                       device: torch.device | str = "cpu") -> torch.nn.Module:
    """One worker's vLLM-layout storage as a plain ``torch.nn.Module``.

    Parameters sit in nested submodules along their dotted vLLM names, so
    ``module.named_parameters(remove_duplicate=False)`` yields exactly the
    names a vLLM worker's model has (``model.layers.0.self_attn.qkv_proj.weight``),
    each with the worker-local shape and dtype of ``destination``. Aliases
    (a tied ``lm_head.weight``, Qwen3-MoE ``mlp.experts.gate.weight``) are
    the same ``Parameter`` registered under both names. Every element is 0
    (NaN-free; the ``zero_boxes`` of vocab padding must be 0 anyway, as in
    vLLM's loaders). ``requires_grad`` is off.

    Raises:
        ValueError: no parameter of ``destination`` belongs to ``worker``.
    """
    root = torch.nn.Module()
    params: dict[str, torch.nn.Parameter] = {}

    def put(name: str, p: torch.nn.Parameter) -> None:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_parameter(leaf, p)

    for p in destination.params:
        if p.worker != worker:
            continue
        t = torch.zeros(p.shape, dtype=p.dtype, device=device)
        params[p.name] = torch.nn.Parameter(t, requires_grad=False)
        put(p.name, params[p.name])
    if not params:
        raise ValueError(f"destination {destination.spec} has no parameters on worker {worker} "
                         f"(workers 0..{destination.num_workers - 1})")
    for alias, target in destination.aliases.items():
        if target in params and alias not in params:
            put(alias, params[target])
    return root


class ReloadTarget(Protocol):
    """A live model whose rounds go through a reload path instead of straight writes.

    For a model whose live parameters are not what the wire carries (a
    quantized vLLM model: kernel-format ``weight`` in e4m3 and its scales,
    made from checkpoint-format tensors by ``process_weights_after_loading``),
    the receiver writes each round into the checkpoint-format tensors this
    object hands out, and the reload makes the live parameters from them
    (part by part as their wire tensors land, the rest at :meth:`commit`).
    The version commits only after :meth:`commit`. The vLLM plugin's is
    ``m2nkit.engine.plugins.vllm_reload.LayerwiseReload`` (vLLM's layerwise
    reload).

    * :meth:`params`: ``{name: tensor}`` of the checkpoint-format layout (shape
      and dtype are what the plan is checked against; the tensors may be on
      the meta device);
    * :meth:`begin` ``(plan, worker)``: start a round; returns the
      ``{name: tensor}`` mapping the round's slabs are written into (looked up
      by name as they arrive). A mapping with a ``wires_received(names)``
      method hears, after each bucket, which wire tensors landed whole
      (``torch_p2p.recv_round``), so it may make parts live during the round;
    * :meth:`commit`: every wire tensor arrived and every rank agreed: make the
      rest live from what was written (in place: addresses stay);
    * :meth:`abort`: the round failed or was dropped: what was not made live
      yet stays as it was before :meth:`begin`;
    * ``live_changed``: whether this round already made some of the live
      parameters (then a failed round leaves them mixed).
    """

    live_changed: bool

    def params(self) -> Mapping[str, torch.Tensor]: ...

    def begin(self, plan: Plan, worker: int) -> Mapping[str, torch.Tensor]: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


def _unique_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in module.named_parameters()}


def _check_target(module: Any, plan: Plan, worker: int,
                  reload: ReloadTarget | None = None) -> None:
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"worker {worker}: the update target must be a torch.nn.Module, "
                         f"got {type(module).__name__}")
    have = (dict(reload.params()) if reload is not None
            else dict(module.named_parameters(remove_duplicate=False)))
    for p in plan.destination.params:
        if p.worker != worker:
            continue
        t = have.get(p.name)
        if t is None:
            raise ValueError(f"worker {worker}: the target storage has no parameter '{p.name}' "
                             f"that plan {plan.destination.spec} writes")
        if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
            raise ValueError(f"worker {worker}: target parameter '{p.name}' is {tuple(t.shape)} "
                             f"{t.dtype}; the plan writes {tuple(p.shape)} {p.dtype}")


def _zero_unwritten(storage: Mapping[str, torch.Tensor], plan: Plan, worker: int) -> None:
    """Write 0 into the regions of ``storage`` no slab writes (the layout's ``zero_boxes``).

    Those are vocab padding: vLLM's loaders fill them with 0 at every load
    (``VocabParallelEmbedding.weight_loader``: ``param[loaded rows:].fill_(0)``).
    A round writes them too, so that storage whose bytes were lost since the
    last round (vLLM's ``sleep(level=2)`` then ``wake_up``: new memory with
    undefined bytes, docs/colocated.md "Sleep mode") ends the round equal to
    a fresh load, not only in the elements the wire carries.
    """
    with torch.no_grad():
        for p in plan.destination.params:
            if p.worker == worker and p.zero_boxes and p.name in storage:
                for z in p.zero_boxes:
                    storage[p.name][tuple(slice(a, b) for a, b in z)] = 0


class M2NReceiver(WeightTransferEngine):
    """One vLLM worker's receiver, over any transport of the registry (the payload's).

    Args:
        destination: the inference side's layout rules, a
            ``DestinationBuilder`` built by an adapter (e.g.
            ``m2nkit.adapters.vllm.vllm_destination(hf_config, "vllm:tp=2")``);
            its ``spec`` must equal the payload's ``inference``.
        worker: this worker's index ``dp_index * tp + tp_rank``; it joins the
            group as rank ``rank_offset + worker``.
        target: the live storage, an ``nn.Module`` whose parameters carry
            vLLM names (``build_vllm_storage``). ``None``: allocated at the
            first ``init_transfer_engine`` from the plan's destination.
        device: where storage, staging and receive buffers live (``"cpu"``
            for gloo, a CUDA device for nccl).
        mode: ``"staged"`` (default; receive into a staging copy, copy it
            into the live parameters at commit; a failed round leaves them
            untouched) or ``"in_place"`` (receive straight into the live
            parameters; no copy of the model; a failed round leaves them
            mixed, see the module docstring).
        reload: a :class:`ReloadTarget` for ``target`` (a quantized vLLM
            model): each round is written into the checkpoint-format tensors
            it hands out and made live by the reload (as parts complete, and
            the rest at its ``commit``, after the round's verdict); a failed
            round is aborted there: what it had not made live stays, and the
            weights count as mixed only if it had (``live_changed``).
            ``mode`` must then be ``"in_place"`` (the reload's tensors are the
            only copy).

    Sessions: a new ``init_transfer_engine`` while a session is live
    *replaces* it. The older session's trainers are told through their own
    session store (key ``superseded``) and their next ``send_weights`` fails
    on every rank with a ``superseded`` error, before anything is sent; an
    ``update_weights`` that still carries the older session's id is refused
    with ``SupersededError``. Replacing rather than refusing lets a trainer
    that crashed and restarted re-init without restarting the inference
    side (the old session cannot say goodbye when its trainer died).

    Lifecycle (per ``WeightTransferEngine``): ``init_transfer_engine`` (again
    after any failed round: the group is then broken), then per round
    ``start_weight_update``, ``update_weights({"round": k, "version": v})``,
    ``finish_weight_update(v)``; ``shutdown`` at the end. One call at a
    time (``InProcessClient`` and the server's worker loop ensure it).

    Raises:
        ValueError: ``destination`` is not a ``DestinationBuilder``,
            ``worker`` is outside ``0..num_workers-1``, or ``mode`` is not
            one of ``RECEIVE_MODES``.
    """

    init_info_cls: ClassVar[type] = InitPayload
    update_info_cls: ClassVar[type] = M2NUpdateInfo

    def __init__(self, destination: DestinationBuilder, worker: int,
                 target: torch.nn.Module | None = None, *,
                 device: torch.device | str = "cpu", mode: str = "staged",
                 reload: ReloadTarget | None = None) -> None:
        super().__init__(target, model_config=None, device=device)
        self.destination = check_destination(destination, "M2NReceiver destination")
        n = destination.num_workers
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < n:
            raise ValueError(f"worker {worker!r} is not in 0..{n - 1} for {destination.spec}")
        if mode not in RECEIVE_MODES:
            raise ValueError(f"M2NReceiver mode {mode!r} is not one of {list(RECEIVE_MODES)}")
        if reload is not None and (target is None or mode != "in_place"):
            raise ValueError("M2NReceiver reload= needs the live target it reloads and "
                             f"mode='in_place' (got target={type(target).__name__}, "
                             f"mode={mode!r})")
        self.worker = worker
        self._reload = reload
        self._reloading = False              # reload.begin() ran, no commit or abort yet
        self.mode = mode
        self._open = False                   # a round was started and not finished
        self._mixed: str | None = None       # in-place: the round that left mixed weights
        self._rounds_seen: set[int] = set()
        self._version: str | None = None
        self._payload: InitPayload | None = None
        self._plan: Plan | None = None
        self._expected: frozenset[str] = frozenset()
        self._store = None
        self._group = None
        self._transport = None               # the session's Transport (transports/registry.py)
        self._broken: str | None = None      # why the group is unusable
        self._staging: dict[str, torch.Tensor] | None = None
        self._received: set[str] = set()
        self._round: M2NUpdateInfo | None = None
        self._failed: str | None = None      # why the current round failed

    # -- state ------------------------------------------------------------

    @property
    def weight_version(self) -> str | None:
        """The last committed version (``None`` before the first commit)."""
        return self._version

    @property
    def storage(self) -> dict[str, torch.Tensor]:
        """The live storage, ``{vLLM name: tensor}`` including aliases; empty before init."""
        if self.model is None:
            return {}
        return {n: p.data for n, p in self.model.named_parameters(remove_duplicate=False)}

    @property
    def weights_mixed(self) -> bool:
        """In-place mode: a failed round left the live weights mixed (until a round commits)."""
        return self._mixed is not None

    @property
    def plan(self) -> Plan | None:
        """The plan of the current session (``None`` before init)."""
        return self._plan

    def _name(self) -> str:
        return f"worker {self.worker}"

    # -- init -------------------------------------------------------------

    def parse_init_info(self, init_dict: Mapping[str, Any]) -> InitPayload:
        """``InitPayload.from_json`` with this worker named in the error.

        A payload refused here cannot be joined: when its rendezvous fields
        are readable, the refusal is also written into the trainers' store
        (:func:`refuse_unparsed_payload`, at most ``REFUSAL_CONNECT_S``), so
        every trainer rank raises it at once instead of at its rendezvous
        timeout.

        Raises:
            ValueError: not a dict, a missing or unknown field, a bad value
                (the message names the field).
        """
        try:
            payload = InitPayload.from_json(init_dict)
            for name in ("master_address", "inference", "manifest_digest", "plan_digest"):
                if not isinstance(getattr(payload, name), str):
                    raise ValueError(f"init payload field '{name}' must be a string, "
                                     f"got {getattr(payload, name)!r}")
            if not isinstance(payload.manifest, Mapping):
                raise ValueError("init payload field 'manifest' must be an object")
        except (TypeError, ValueError) as e:
            message = f"{self._name()}: {e}"
            self._refuse_unparsed(init_dict, message)
            raise ValueError(message) from None
        return payload

    def _refuse_unparsed(self, init_dict: Any, message: str) -> None:
        refuse_unparsed_payload(init_dict, self.worker, message)

    def _session_plan(self, payload: InitPayload,
                      planned: tuple[Plan, str] | None = None) -> Plan:
        """Every check that needs no peer; returns the plan this worker rebuilt.

        ``planned``: ``(plan, manifest digest)`` the caller already rebuilt
        from this payload (see :meth:`init_transfer_engine`); checked the same.
        """
        me, spec = self._name(), self.destination.spec
        if payload.inference != spec:
            raise ValueError(f"{me}: init payload field 'inference' is '{payload.inference}' but "
                             f"this worker serves '{spec}'")
        if payload.num_workers != self.destination.num_workers:
            raise ValueError(f"{me}: init payload world_size {payload.world_size} - rank_offset "
                             f"{payload.rank_offset} = {payload.num_workers} workers, but "
                             f"{spec} has {self.destination.num_workers}")
        if planned is None:
            destination = session_destination(payload, self.destination, me)
            try:
                plan, digest = plan_from_manifest(payload.manifest, destination)
            except ValueError as e:
                raise ValueError(f"{me}: init payload field 'manifest': {e}") from None
        else:
            plan, digest = planned
        if digest != payload.manifest_digest:
            raise ValueError(f"{me}: init payload field 'manifest_digest' is "
                             f"{payload.manifest_digest[:16]}... but the manifest hashes to "
                             f"{digest[:16]}...; the manifest was changed or corrupted")
        if plan.num_trainer_ranks != payload.rank_offset:
            raise ValueError(f"{me}: init payload rank_offset {payload.rank_offset} differs from "
                             f"the manifest's num_trainer_ranks {plan.num_trainer_ranks}")
        if plan.problems:
            raise ValueError(f"{me}: the plan for this manifest cannot run: "
                             + "; ".join(str(p) for p in plan.problems[:_LIST_AT_MOST]))
        if plan.digest() != payload.plan_digest:
            raise PlanMismatchError(
                f"{me}: init payload field 'plan_digest' is {payload.plan_digest[:16]}... but this "
                f"worker's plan for the same manifest and {spec} is {plan.digest()[:16]}... "
                "(a different model config, destination rules or m2nkit version); nothing was sent")
        return plan

    def init_transfer_engine(self, init_info: InitPayload | Mapping[str, Any], *,
                             planned: tuple[Plan, str] | None = None) -> None:
        """Check the payload, then join a fresh group and agree on the plan.

        ``planned``: ``plan_from_manifest(payload.manifest,
        session_destination(payload, destination, ...))`` for this very
        payload and this receiver's destination, where the caller built it
        already (the vLLM plugin, whose own checks need it): it is not built
        a second time, and every check below holds it as it would the
        receiver's own.

        A payload that does not parse is refused at once. One that parses
        but is refused (spec, digests, plan, target) still joins its group
        and reports the refusal through ``agree_on_plan(plan=None, error=...)``,
        so every trainer rank fails at once with this worker's message
        instead of waiting out the rendezvous. One deadline of the payload's
        ``timeout_s``, set on entry, bounds the rendezvous and the
        agreement either way. Nothing moves and nothing
        changes here (an earlier session, the live storage and the version
        stay). An accepted payload first shuts down any earlier group;
        storage is allocated when no target was given.

        Raises:
            ValueError: a bad payload (names the field), an inference spec
                other than this worker's (names both), a manifest digest
                that does not match the manifest, a plan with problems
                (names the wire tensors), a target that does not fit the plan.
            PlanMismatchError: the payload's plan digest differs from the
                plan this worker rebuilt, or ``agree_on_plan`` found ranks
                that disagree or refuse. Nothing was sent.
            TransferError: the rendezvous or agreement did not finish by the
                deadline (``timeout_s`` of the payload).
        """
        payload = (init_info if isinstance(init_info, InitPayload)
                   else self.parse_init_info(init_info))
        deadline = Deadline(payload.timeout_s)
        rank = payload.rank_offset + self.worker
        try:
            plan = self._session_plan(payload, planned)
            if self.model is not None:
                _check_target(self.model, plan, self.worker, self._reload)
        except (ValueError, PlanMismatchError) as refusal:
            if rank < payload.world_size:
                self._report_refusal(payload, rank, str(refusal), deadline)
            raise
        if self.model is None:
            self.model = build_vllm_storage(plan.destination, self.worker, self.device)
            self._default_target = (self.model, self.model_config)
        self._tell_superseded(payload)
        self.shutdown()
        store, group = create_group(payload.master_address, payload.master_port, rank,
                                    payload.world_size, timeout_s=max(deadline.left(), 1.0),
                                    backend=payload.backend, session=payload.session)
        try:
            agree_on_plan(group, rank, payload.world_size, plan, deadline=deadline)
            # Collective where the transport needs it (nccl_m2n: its communicator).
            self._transport = open_transport(payload.transport, store, group, rank,
                                             payload.world_size, device=self.device,
                                             timeout_s=payload.timeout_s,
                                             bucket_bytes=payload.bucket_bytes)
        except BaseException:
            release_group(group)
            raise
        self._store, self._group = store, group
        self._payload, self._plan = payload, plan
        self._expected = frozenset(
            w.name for w in plan.wires if w.sends_to(self.worker))
        self._broken = None
        self._rounds_seen = set()
        self._open, self._staging, self._round, self._failed = False, None, None, None
        self._received = set()

    def _tell_superseded(self, payload: InitPayload) -> None:
        """Leave word in the live session's store that ``payload`` replaces it.

        The older trainers read it at their next ``send_weights`` and fail on
        every rank with "superseded". Best effort and bounded (1 s): a store
        whose host is gone (the usual reason for a re-init) is skipped.
        """
        old, store = self._payload, self._store
        if old is None or store is None:
            return
        note = json.dumps({"worker": self.worker, "session": payload.session,
                           "rendezvous": f"{payload.master_address}:{payload.master_port}"})
        try:
            store.set_timeout(timedelta(seconds=1.0))
            store.set("superseded", note)
        except Exception:  # noqa: BLE001 - the old session's host may be gone
            pass

    def _report_refusal(self, payload: InitPayload, rank: int, message: str,
                        deadline: Deadline) -> None:
        """Join the payload's group only to tell every rank why this worker refuses."""
        group = None
        try:
            _, group = create_group(payload.master_address, payload.master_port, rank,
                                    payload.world_size, timeout_s=max(deadline.left(), 1.0),
                                    backend=payload.backend, session=payload.session)
            agree_on_plan(group, rank, payload.world_size, None, error=message,
                          deadline=deadline)
        except (TransferError, ValueError):
            pass                  # raised with our own message, or nobody came: refuse anyway
        finally:
            release_group(group)

    # -- rounds -----------------------------------------------------------

    def _live(self) -> dict[str, torch.Tensor]:
        """The live parameters, every name (aliases included): in-place writes go here."""
        return {n: p.data for n, p in self.model.named_parameters(remove_duplicate=False)}

    def _require_session(self, what: str) -> None:
        if self._broken:
            raise TransferError(f"{self._name()}: {what} on a broken group ({self._broken}); "
                                "call init_transfer_engine again with a fresh group")
        if self._group is None:
            raise ValueError(f"{self._name()}: {what} before init_transfer_engine")

    def start_weight_update(self) -> None:
        """Begin a round. Staged mode: allocate the staging copy of the live storage.

        Staged mode costs one more copy of the worker's parameters until the
        round ends; in-place mode allocates nothing here.

        Raises:
            ValueError: no session yet; the target no longer fits the plan.
            TransferError: the group broke in an earlier round (re-init first).
        """
        self._require_session("start_weight_update")
        self._abort_reload()                 # a round started and never finished
        _check_target(self.model, self._plan, self.worker, self._reload)
        self._staging = ({n: t.clone() for n, t in _unique_params(self.model).items()}
                         if self.mode == "staged" else None)
        if self._reload is not None:
            self._staging = self._reload.begin(self._plan, self.worker)   # looked up lazily
            self._reloading = True
        self._open = True
        self._received = set()
        self._round = None
        self._failed = None

    def receive_weights(self, update_info: M2NUpdateInfo) -> None:
        """Receive this worker's slabs of one round into staging, then agree on the verdict.

        After its receives (whole or failed) the worker joins every rank in
        ``finish_round``, the end-of-round verdict the trainer engine also
        calls: this worker learns whether any other rank failed (then it
        must not commit either, or TP ranks would serve mixed versions), and
        the trainers learn this worker's error at once. A worker whose own
        receive failed closes its group connections first, so trainers
        blocked on it fail at once too.

        Timing: one deadline, the payload's ``timeout_s`` after this call,
        bounds every receive and the verdict; a failed round raises within
        ``timeout_s + REPORT_GRACE_S`` (2 s) of the call.

        Raises:
            ValueError: no round started, this round was already received,
                or its ``round`` number was already used in this session.
            TransferError: the receive failed or timed out, or another rank
                failed; the message names the root cause and its rank, and
                ``received`` and ``missing`` list wire tensor names. The
                group is broken afterwards.
        """
        if not self._open:
            raise ValueError(f"{self._name()}: update_weights before start_weight_update")
        session = self._payload.session if self._payload is not None else ""
        if update_info.session is not None and update_info.session != session:
            raise SupersededError(
                f"{self._name()}: update_weights of session '{update_info.session}' refused: "
                f"that session was superseded by a newer init_weight_transfer_engine "
                f"(session '{session}'), which this worker now serves; nothing was received "
                "and the newer session is untouched; the older trainer must call trainer_init "
                "again")
        self._require_session("update_weights")
        if self._round is not None:
            raise ValueError(f"{self._name()}: round {self._round.round} was already received; "
                             "call finish_weight_update, then start_weight_update")
        if update_info.round in self._rounds_seen:
            raise ValueError(f"{self._name()}: update_info round {update_info.round} was already "
                             "used in this session; each round needs a new number")
        deadline = Deadline(self._payload.timeout_s)
        self._round = update_info
        self._rounds_seen.add(update_info.round)
        payload, rank = self._payload, self._payload.rank_offset + self.worker
        mine: Exception | None = None
        target = self._staging if self.mode == "staged" or self._reload else self._live()
        if self.mode == "in_place" and self._reload is None:
            # From the first byte on, the live weights may be partly this round's.
            self._mixed = f"round {update_info.round}"
        if self._reload is None:        # the reload zeroes each layer it materializes
            _zero_unwritten(target, self._plan, self.worker)
        try:
            # The trainers post their sends only once every worker joined
            # (control.wait_workers_joined): a refusal above reaches them first.
            join_round(self._store, update_info.round, self.worker)
            done, _ = self._transport.recv_round(self._plan, self.worker, target,
                                                 deadline=deadline)
            self._received = set(done)
        except Exception as e:
            mine = e
            self._received = set(getattr(e, "received", ()))
            # Its frames hold the group and the pending receives; cleared,
            # _close_group can really close the connections.
            traceback.clear_frames(e.__traceback__)
        try:
            # A worker that failed closes its connections (pending receives
            # included) once its report is in: trainers blocked on it fail at
            # once. The verdict goes through the store, which stays up.
            finish_round(self._store, rank, payload.world_size,
                         num_trainer_ranks=payload.rank_offset, round_id=update_info.round,
                         error=None if mine is None else f"{self._name()}: {mine}",
                         deadline=deadline,
                         on_reported=self._close_group if mine is not None else None)
            verdict = None
        except Exception as e:  # a TransferError naming the root cause
            verdict = e
        if mine is None and verdict is None:
            return
        self._failed = str(verdict or mine)
        self._broken = f"round {update_info.round} failed"
        if self._reload is not None and self._reload.live_changed:
            self._mixed = f"round {update_info.round}"       # layers it already made live
        self._close_group()
        missing = sorted(self._expected - self._received)
        # The root cause (from the verdict) first, then this worker's view.
        why = getattr(verdict, "cause", None) or str(verdict or mine)
        if mine is not None:
            what = f"{why}; here: {mine}; received {len(self._received)} of " \
                   f"{len(self._expected)} wire tensors, missing {_few(missing)}"
        else:
            what = f"{why}; this worker received all {len(self._expected)} wire tensors, " \
                   "but another rank failed"
        what += self._mixed_note()
        err = TransferError(f"{self._name()}: round {update_info.round} failed after "
                            f"{deadline.elapsed():.1f} s: {what}")
        err.received, err.missing = sorted(self._received), missing
        raise err from (verdict or mine)

    def _abort_reload(self) -> None:
        """Undo a reload's ``begin`` that no ``commit`` followed (the live parameters stay)."""
        if self._reloading:
            self._reloading = False
            self._reload.abort()

    def _mixed_note(self) -> str:
        if self._mixed is None:
            return ""
        return (f"; in-place mode: the live weights are now mixed ({self._mixed} wrote part of "
                f"them, the rest is older), the version stays {self._version!r}; run a new "
                "complete round before serving them")

    def _close_group(self) -> None:
        """Close the group's connections (pending receives included); keep the store.

        gloo closes its sockets when the last reference to the group and to
        its work objects goes; the caller cleared the failed receive's
        frames, so dropping ``self._group`` here is the last one.
        """
        group, self._group = self._group, None
        transport, self._transport = self._transport, None
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - best effort while reporting a failure
                pass
        release_group(group)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Commit the round: staged mode copies staging into the live storage; set the version.

        Commits only when every wire tensor the plan sends this worker
        arrived and no rank reported a failure. The copy is in place
        (``param.data.copy_``; in-place mode received into the parameters
        already), so the live tensors keep their addresses (vLLM's CUDA
        graphs hold them). The version becomes ``weight_version``, else the
        round's ``version``.

        Raises:
            ValueError: no round started.
            IncompleteRoundError: wire tensors are missing (listed) or the
                round failed elsewhere; the version is unchanged. Staged
                mode: the live storage is unchanged, staging is freed.
                In-place mode: the message says the live weights are mixed
                and a new complete round is needed.
        """
        if not self._open:
            raise ValueError(f"{self._name()}: finish_weight_update without start_weight_update")
        staging, self._staging, self._open = self._staging, None, False
        missing = sorted(self._expected - self._received)
        if missing or self._failed or self._round is None:
            self._abort_reload()
            label = f"round {self._round.round}" if self._round else "the round (never received)"
            why = f"{len(missing)} of {len(self._expected)} wire tensors missing {_few(missing)}" \
                if missing else f"it failed elsewhere ({self._failed})"
            if self._mixed is None:
                unchanged = "the live weights are unchanged"
                if self.mode == "in_place" and self._round is None:
                    unchanged += " (nothing was received)"
                tail = f"; version stays {self._version!r}, {unchanged}"
            else:
                tail = self._mixed_note()
            raise IncompleteRoundError(
                f"{self._name()}: {label} is incomplete, not committing: {why}{tail}",
                sorted(self._received), missing)
        if self._reload is not None:
            self._reloading = False
            try:
                self._reload.commit()
            except Exception as e:
                # Layers made live before the failure are this round's, the rest older.
                self._mixed = f"round {self._round.round}, whose reload failed ({e})"
                raise
        elif staging is not None:
            live = _unique_params(self.model)
            with torch.no_grad():
                for name, t in staging.items():
                    live[name].copy_(t)
        self._mixed = None
        if weight_version is None and self._round is not None:
            weight_version = self._round.version
        self._version = weight_version

    def shutdown(self) -> None:
        """Abort and drop the group (pending receives included); idempotent.

        The live storage and version stay; a later ``init_transfer_engine``
        starts a new session.
        """
        group, self._group, self._store = self._group, None, None
        transport, self._transport = self._transport, None
        self._staging, self._open = None, False
        self._abort_reload()
        if transport is not None:
            transport.close()
        release_group(group)


def refuse_unparsed_payload(init_dict: Any, worker: int, message: str) -> bool:
    """Tell the trainers waiting at a payload's rendezvous why worker ``worker`` will not come.

    For a worker engine whose ``parse_init_info`` refused ``init_dict``
    (``message``, naming the worker and the field): a payload that does not
    parse cannot be joined, so the trainers would wait out their rendezvous.
    When its rendezvous fields (``master_address``, ``master_port``,
    ``session``) are readable, the refusal goes into that store
    (``control.refuse_rendezvous``) and every trainer rank raises
    ``PlanMismatchError`` quoting it at once. Bounded by
    ``REFUSAL_CONNECT_S`` (the trainers' store may not be up yet) and by the
    payload's ``timeout_s``. Returns whether the refusal was written; never
    raises. ``M2NReceiver.parse_init_info`` calls it; other worker engines
    (the vLLM plugin) should too.
    """
    if not isinstance(init_dict, Mapping):
        return False
    host, port = init_dict.get("master_address"), init_dict.get("master_port")
    offset, session = init_dict.get("rank_offset"), init_dict.get("session", "")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) \
            or not 0 < port < 65536 or not isinstance(session, str):
        return False
    who = (f"worker {worker} (rank {offset + worker})"
           if isinstance(offset, int) and not isinstance(offset, bool) and offset > 0
           else f"worker {worker}")
    timeout = init_dict.get("timeout_s")
    bound = REFUSAL_CONNECT_S
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        bound = min(bound, float(timeout))
    return refuse_rendezvous(host, port, who, message, timeout_s=bound, session=session)
