"""The trainer-side engine: one per trainer rank, ``send_weights()`` every RL step.

Implements ``TrainerWeightTransferEngine`` (vLLM ``weight_transfer/base.py``)
over m2nkit's plan: each trainer rank sends only its own slabs, straight
into each worker's vLLM-layout storage. Trainer rank 0 drives the inference
side through a ``VLLMWeightSyncClient``; every rank joins one stateless
process group with the workers (trainer ranks ``[0, T)``, workers
``[T, T+N)``, vLLM ``m2n_common.py``) and, before any byte moves, every rank
agrees on the manifest digest and the plan.

A round (``send_weights``) on rank 0: ``start_weight_update()``, then
``update_weights(...)`` in a thread (the inference side's RPC returns only
once the workers have received everything, so it must overlap the send).
Once every worker joined the round (``control.wait_workers_joined``) rank 0
opens it in the session's store (``control.open_round``) and every rank
runs the transport; then ``finish_weight_update(version)``, which commits
the new version on the workers only if the round arrived whole, and rank 0
tells the other ranks whether they committed (``control.report_commit``).
The other ranks post no send before rank 0 opened the round
(``control.wait_round_open``) and return only after its commit word
(``control.wait_commit``). When rank 0 could not start the round (a worker
refused ``start_weight_update``; the server or the workers refused
``update_weights`` before the workers joined) it aborts the round there
with its reason, and every rank raises at once naming it first; a refused
commit likewise fails every rank with rank 0's reason. (A gloo send that
is already waiting cannot be interrupted, so a refusal has to be known
before the first send.)

The engine knows no model family: the caller passes the destination layout
as a ``DestinationBuilder`` (``m2nkit.adapters.vllm.vllm_destination``).

Timing: ``timeout_s`` bounds a whole round, not each wait. ``send_weights``
sets one ``Deadline`` when it starts; every wait of the round (each bucket's
send, the control-plane calls, the end-of-round verdict) gets only the time
left to it. A failed round therefore raises within ``timeout_s +
REPORT_GRACE_S`` (2 s) of the ``send_weights`` call, on every trainer rank,
with the root cause and the rank it came from. ``trainer_init`` keeps the
same bound for the init (rendezvous, agreement, the init RPC).
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from m2nkit.manifest.protocol import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient
from m2nkit.manifest.destination import layout_to_json
from m2nkit.manifest.serialize import manifest_to_json

from .control import (
    PlanMismatchError,
    TransferError,
    agree_on_plan,
    create_group,
    finish_round,
    open_round,
    release_group,
    report_commit,
    wait_commit,
    wait_round_open,
    wait_verdict_seen,
    wait_workers_joined,
)
from .deadline import REPORT_GRACE_S, Deadline
from .fp8_wire import Fp8WireSender, fp8_wire_plan
from .session import DestinationBuilder, InitPayload, check_destination, plan_from_manifest
from .transports.registry import TRANSPORTS, check_transport, open_transport
from .transports.torch_p2p import BucketSchedule

__all__ = ["M2NTrainerInitInfo", "M2NTrainerEngine", "RoundStats"]


@dataclass
class M2NTrainerInitInfo(TrainerInitInfo):
    """How this trainer rank joins a transfer session.

    Attributes:
        num_trainer_ranks: T, the trainer ranks taking part (ranks ``0..T-1``).
        destination: the workers' layout rules, a ``DestinationBuilder``
            built by an adapter, e.g.
            ``m2nkit.adapters.vllm.vllm_destination(hf_config, "vllm:tp=2")``;
            the same on every rank.
        master_address, master_port: where trainer rank 0 hosts the
            rendezvous store; the same on every rank.
        group_backend: ``torch.distributed`` backend of the group, ``"gloo"`` or ``"nccl"``.
        timeout_s: seconds, the bound on ``trainer_init`` and on each round
            (``send_weights``), not on each wait: every wait of one counts
            down to one deadline. A failed round raises within
            ``timeout_s + REPORT_GRACE_S`` of its start.
        bucket_bytes: transport bucket size (bytes); ``torch_p2p`` keeps one
            bucket in flight, so the trainer's extra memory is at most about
            one bucket (plus the local tensors its zero-copy sends still read).
        transport: ``"torch_p2p"`` (default; any backend) or ``"nccl_m2n"``
            (GPUs; set ``group_backend="nccl"`` and ``device``).
        device: where staging buffers live (``"cpu"``, or this rank's ``"cuda:i"``).
    """

    backend: ClassVar[str] = "m2nkit"

    num_trainer_ranks: int = 1
    destination: DestinationBuilder | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 29555
    group_backend: str = "gloo"
    timeout_s: float = 60.0
    bucket_bytes: int = 64 << 20
    transport: str = "torch_p2p"
    device: str = "cpu"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_transport(self.transport, "transport")
        if self.num_trainer_ranks <= 0 or self.rank >= self.num_trainer_ranks:
            raise ValueError(f"trainer rank {self.rank} is outside 0..{self.num_trainer_ranks - 1} "
                             f"(num_trainer_ranks={self.num_trainer_ranks})")
        check_destination(self.destination, "M2NTrainerInitInfo.destination")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def _fp8_wire_of(info: M2NTrainerInitInfo, plan):
    """The ``Fp8Plan`` of a ``wire=fp8`` session (``engine.fp8_wire``), else ``None``.

    Raises:
        ValueError: ``wire=fp8`` over a transport other than ``torch_p2p``,
            or a model the fp8 wire does not carry (``fp8_wire.fp8_wire_plan``).
    """
    if plan.problems:
        return None
    fp8 = fp8_wire_plan(info.destination, plan)
    if fp8 is not None and info.transport != "torch_p2p":
        raise ValueError(f"trainer rank {info.rank}: wire=fp8 runs over the torch_p2p transport "
                         f"only, not {info.transport!r}")
    return fp8


@dataclass
class RoundStats:
    """What one ``send_weights`` call did on this rank."""

    round: int
    version: str
    bytes_sent: int
    seconds: float
    extra: dict = field(default_factory=dict)


def _call_in_thread(fn, *args):
    """Run ``fn(*args)`` in a daemon thread; returns ``(thread, box)`` where box holds result/error."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"m2nkit-{getattr(fn, '__name__', 'rpc')}")
    t.start()
    return t, box


def _join(thread, box, until: float, what: str):
    """Join a ``_call_in_thread`` thread until ``until`` (``time.monotonic``); its result.

    Raises:
        TransferError: it is still running then, or it raised.
    """
    thread.join(max(0.0, until - time.monotonic()))
    if thread.is_alive():
        raise TransferError(f"{what} did not return by the deadline")
    if "error" in box:
        raise TransferError(f"{what} failed: {box['error']}") from box["error"]
    return box.get("result")


class M2NTrainerEngine(TrainerWeightTransferEngine[M2NTrainerInitInfo]):
    """Trainer-side m2nkit engine, over any transport of the registry (``init_info.transport``).

    Build it with ``trainer_init`` on every trainer rank; call
    ``send_weights()`` on every rank each step; ``shutdown()`` at the end.
    ``source`` is an ``M2NWeightSource`` (``ManifestM2NWeightSource``,
    ``DTensorModuleSource``, a checkpoint manifest) whose metadata is the
    same on every rank and whose ``iter_local()`` yields this rank's pieces.
    """

    init_info_cls = M2NTrainerInitInfo

    def __init__(self, *, init_info: M2NTrainerInitInfo, client: VLLMWeightSyncClient | None,
                 source, plan, payload: InitPayload, group, store, transport) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.plan = plan
        self.payload = payload
        #: torch_p2p's buckets of the plan at ``bucket_bytes`` (for reports; cached on the plan).
        self.schedule = BucketSchedule.of(plan, init_info.bucket_bytes)
        self._group = group
        self._store = store
        self._transport = transport  # a Transport (transports/registry.py); None after shutdown
        self._round = 0
        self._broken: str | None = None
        self._busy = threading.Lock()

    @classmethod
    def trainer_init(cls, init_info: M2NTrainerInitInfo, *, client: VLLMWeightSyncClient | None = None,
                     source=None) -> "M2NTrainerEngine":
        """Plan, rendezvous with the workers, and agree on the plan.

        Rank 0 calls ``client.init_weight_transfer_engine`` with the init
        payload while joining the group. One deadline of ``timeout_s``,
        set on entry, bounds the rendezvous, the agreement and the init
        RPC; it returns or raises within ``timeout_s + REPORT_GRACE_S``.
        A worker that refuses the payload before it could join (it does not
        parse), or an init RPC that fails on rank 0, ends every rank's
        rendezvous at once (``control.create_group``) with that reason.

        Raises:
            ValueError: a plan with problems (on every rank, after the
                ranks agreed on it).
            PlanMismatchError: ranks disagree or a worker refused (on every
                rank, naming the first differing wire tensor or the worker
                and its reason), or rank 0's init RPC failed.
            TransferError: the deadline passed (rendezvous, agreement or the
                init RPC), naming what was waited for.
        """
        info = init_info
        deadline = Deadline(info.timeout_s)
        if source is None:
            raise ValueError("trainer_init needs a source (an M2NWeightSource)")
        if info.is_sender and client is None:
            raise ValueError("trainer rank 0 needs a client to drive the inference side")
        TRANSPORTS[info.transport].check_source(source, info.rank)
        metas = list(source.metadata)
        manifest = manifest_to_json(metas, info.num_trainer_ranks)
        plan, digest = plan_from_manifest(manifest, info.destination)
        fp8 = _fp8_wire_of(info, plan)      # wire=fp8: refused here, before any rendezvous
        payload = InitPayload(
            master_address=info.master_address, master_port=info.master_port,
            rank_offset=info.num_trainer_ranks,
            world_size=info.num_trainer_ranks + plan.num_workers,
            backend=info.group_backend, inference=info.destination.spec, manifest=manifest,
            manifest_digest=digest, plan_digest=plan.digest(), timeout_s=info.timeout_s,
            bucket_bytes=info.bucket_bytes, transport=info.transport,
            session=uuid.uuid4().hex[:16],
            # a traced layout travels along: each worker checks its own part instead of
            # tracing every worker (engine.session.session_destination)
            destination=(layout_to_json(plan.destination)
                         if getattr(info.destination, "layout", None) == "traced" else None),
        )
        rpc = None
        if info.is_sender:
            rpc = _call_in_thread(client.init_weight_transfer_engine, payload.to_json())

        def rpc_refused() -> str | None:
            # Rank 0: the init RPC already failed (a worker refused, the
            # server is unreachable): every rank stops waiting for the workers.
            if rpc is None or rpc[0].is_alive() or "error" not in rpc[1]:
                return None
            e = rpc[1]["error"]
            return f"init_weight_transfer_engine failed: {type(e).__name__}: {e}"

        store = group = None
        try:
            # The store's own timeout also bounds later store calls: keep a floor.
            store, group = create_group(info.master_address, info.master_port, info.rank,
                                        payload.world_size, timeout_s=max(deadline.left(), 1.0),
                                        backend=info.group_backend, session=payload.session,
                                        watch=rpc_refused)
            agree_on_plan(group, info.rank, payload.world_size, plan, deadline=deadline)
            transport = None
            if not plan.problems:       # a plan with problems is refused below, on every rank
                transport = open_transport(info.transport, store, group, info.rank,
                                           payload.world_size, device=info.device,
                                           timeout_s=info.timeout_s, bucket_bytes=info.bucket_bytes)
        except BaseException as e:
            # Release the group and the store (rank 0's port) so a fresh
            # trainer_init can use the same rendezvous right away.
            release_group(group)
            store = group = None
            if isinstance(e, TransferError) and rpc is not None and not rpc[0].is_alive() \
                    and "error" in rpc[1] and "init_weight_transfer_engine failed" not in str(e):
                # Same class (a refusal stays a PlanMismatchError), with the RPC's word added.
                kind = type(e) if type(e) in (TransferError, PlanMismatchError) else TransferError
                raise kind(f"{e}; the inference side said: {rpc[1]['error']}") from e
            raise
        try:
            if rpc is not None:
                _join(*rpc, deadline.at + 0.75 * REPORT_GRACE_S, "init_weight_transfer_engine")
        except BaseException:
            release_group(group)
            raise
        if plan.problems:
            release_group(group)
            # Identical on every rank (the plans agreed), so every rank refuses.
            listed = "; ".join(str(p) for p in plan.problems[:5])
            raise ValueError(f"trainer rank {info.rank}: the plan has {len(plan.problems)} problem(s), "
                             f"nothing can be sent: {listed}")
        if fp8 is not None:
            transport = Fp8WireSender(transport, plan, fp8, source)
        return cls(init_info=info, client=client, source=source, plan=plan, payload=payload,
                   group=group, store=store, transport=transport)

    @property
    def notes(self) -> tuple[str, ...]:
        """Sentences on how this session was decided, for the user to see.

        The destination's (``plan.destination.notes``: how vLLM's dtype and
        expert placement were chosen), then the source's own ``notes`` when
        it has them (``bridge_source``: which wire tensors went through
        Megatron-Bridge's gather, and why). Identical on every rank.
        """
        return tuple(self.plan.destination.notes) + tuple(getattr(self.source, "notes", ()) or ())

    def send_weights(self, weight_version: str | None = None) -> RoundStats:
        """Run one round on this rank; returns what it sent.

        ``weight_version`` (rank 0) labels the version the workers commit
        (converted with ``str``); default: the round number.

        Timing: one deadline, ``timeout_s`` after the call, bounds every
        wait of the round; a failed round raises within ``timeout_s +
        REPORT_GRACE_S`` (2 s) of the call, on every rank whose own code
        (the source) returns in time. A successful round also returns by
        then, or raises.

        Raises:
            ValueError: called after ``shutdown()``.
            RuntimeError: another ``send_weights`` is running on this engine.
            TransferError: a peer died or stalled, the source broke the
                manifest order or came after the deadline, the inference
                side refused to start the round or to receive it (every
                rank, at once: rank 0 aborts it before any send) or to
                commit it (every rank, with rank 0's reason). The message
                names the root cause first (rank 0's reason, else the ranks
                that sent no report, else the first failure reported, with
                its rank). The workers' version is then unchanged (after a
                failed commit: see the reason and check their
                weight_version), this engine has released its group and
                refuses further rounds: build a fresh engine
                (``trainer_init``) for the next round.
        """
        if self._broken:
            raise TransferError(f"trainer rank {self.init_info.rank}: this engine's group broke in "
                                f"an earlier round ({self._broken}); build a fresh engine with "
                                "trainer_init")
        if self._group is None:
            raise ValueError(f"trainer rank {self.init_info.rank}: send_weights after shutdown(); "
                             "build a fresh engine with trainer_init")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"trainer rank {self.init_info.rank}: send_weights is already "
                               "running on this engine; rounds cannot overlap")
        try:
            return self._send_round(weight_version)
        except BaseException as e:
            # The group cannot be trusted after a failed round: release it
            # (and rank 0's store port) now; the next round needs a new engine.
            self._broken = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            self.shutdown()
            raise
        finally:
            self._busy.release()

    def _send_round(self, weight_version) -> RoundStats:
        deadline = Deadline(self.init_info.timeout_s)
        # The verdict ends by deadline + 0.65 grace (control.finish_round);
        # the RPC joins get to 0.75 of it, the rest is slack for a loaded machine.
        hard = deadline.at + 0.75 * REPORT_GRACE_S
        self._round += 1
        version = str(weight_version) if weight_version is not None else str(self._round)
        rank, world = self.init_info.rank, self.payload.world_size
        rpc = None
        sent, error = 0, None
        try:
            if self.is_sender:
                self._start_round(deadline)
                rpc = _call_in_thread(self.client.update_weights,
                                      {"round": self._round, "version": version,
                                       "session": self.payload.session})
                self._open_round(deadline, rpc)
            else:
                self._check_superseded()
                # Nothing is sent before rank 0 started the round on the
                # workers: if it could not, this ends here, naming its reason.
                wait_round_open(self._store, rank, self._round, deadline)
            sent = self._transport.send_round(self.plan, rank, self.source.iter_local(),
                                              deadline=deadline).nbytes
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"{type(e).__name__}: {e}"
            # Its frames hold the group and the round's pending work objects;
            # dropped, the group's connections can close (see _abort_group).
            traceback.clear_frames(e.__traceback__)
        try:
            # Every rank (trainers and workers) ends the round with one verdict.
            # A rank that failed closes its connections once its report is in:
            # peers blocked on it fail at once instead of at their deadline.
            finish_round(self._store, rank, world, num_trainer_ranks=self.plan.num_trainer_ranks,
                         round_id=self._round, error=error, deadline=deadline,
                         on_reported=self._abort_group if error else None)
        except TransferError as e:
            try:
                self._check_superseded()
            except TransferError as superseded:          # the root cause, named first
                raise TransferError(f"{superseded} (round {self._round}: "
                                    f"{getattr(e, 'cause', e)})") from e
            except RuntimeError:
                pass                                     # the store is gone: report e
            if rpc is not None:
                rpc[0].join(max(0.0, hard - time.monotonic()))
                if "error" in rpc[1] and str(rpc[1]["error"]) not in str(e):
                    raise TransferError(f"{e}; the inference side said: {rpc[1]['error']}") from e
            raise
        if self.is_sender:
            self._commit(rpc, version, deadline, hard)
        else:
            # Rank 0 alone asks the workers to commit: its word ends the round here.
            wait_commit(self._store, rank, self._round, deadline.at + 0.9 * REPORT_GRACE_S)
        return RoundStats(self._round, version, sent, deadline.elapsed())

    def _open_round(self, deadline: Deadline, rpc) -> None:
        """Rank 0: open the round for the other trainer ranks once every worker joined it.

        ``rpc`` is the running ``update_weights`` call. When it fails before
        every worker joined (the server or the workers refused it up front)
        or a worker has not joined by the deadline, the round is aborted in
        the store with that reason (``control.open_round``): no trainer rank
        has posted a send yet, so every one fails at once naming it, instead
        of waiting in a send no worker will ever receive.

        Raises:
            TransferError: the reason, after the abort is in the store.
        """
        def refused() -> str | None:
            if rpc[0].is_alive() or "error" not in rpc[1]:
                return None
            return f"trainer rank 0: update_weights failed: {rpc[1]['error']}"

        reason = wait_workers_joined(self._store, self._round, num_workers=self.plan.num_workers,
                                     num_trainer_ranks=self.plan.num_trainer_ranks,
                                     deadline=deadline, refused=refused)
        open_round(self._store, self._round, reason)
        if reason is not None:
            raise TransferError(reason)

    def _commit(self, rpc, version: str, deadline: Deadline, hard: float) -> None:
        """Rank 0, after a round every rank succeeded in: ``finish_weight_update``, then tell
        the other trainer ranks whether the workers committed (``control.report_commit``).

        Raises:
            TransferError: ``update_weights`` or ``finish_weight_update``
                failed or did not return by ``hard``; every trainer rank
                raises the same reason (rank 0 first waits, at most
                ``REPORT_GRACE_S / 2``, until they have read it).
        """
        try:
            _join(*rpc, hard, "update_weights")
            commit = _call_in_thread(self.client.finish_weight_update, version)
            commit[0].join(max(0.0, hard - time.monotonic()))
            if commit[0].is_alive():
                raise TransferError(f"finish_weight_update (the commit of {version!r}) did not "
                                    "return by the deadline; whether the workers committed is "
                                    "unknown: check their weight_version")
            _join(*commit, hard, "finish_weight_update")
        except TransferError as e:
            reason = f"trainer rank 0: {e}"
            report_commit(self._store, self._round, reason,
                          readers=self.plan.num_trainer_ranks - 1,
                          until=min(deadline.at + REPORT_GRACE_S,
                                    time.monotonic() + 0.5 * REPORT_GRACE_S))
            raise TransferError(f"trainer rank 0: round {self._round} failed: {reason}") from e
        report_commit(self._store, self._round)

    def _start_round(self, deadline: Deadline) -> None:
        """Rank 0: start the round on the workers (``start_weight_update``).

        When it cannot (the session was superseded, or ``start_weight_update``
        failed: a worker refused, the server is gone), the round is aborted
        in the store with that reason (``control.open_round``), so every
        trainer rank fails at once naming it instead of sending into
        workers that were never asked to receive. Else
        :meth:`_open_round` opens it once the workers joined.

        Raises:
            TransferError: the reason, after the abort is in the store.
        """
        try:
            self._check_superseded()
            try:
                _join(*_call_in_thread(self.client.start_weight_update),
                      deadline.at, "start_weight_update")
            except TransferError as e:
                raise TransferError(f"trainer rank 0: {e}") from e
        except Exception as e:
            reason = str(e) if str(e).startswith("trainer rank 0: ") \
                else f"trainer rank 0: {type(e).__name__}: {e}"
            try:
                open_round(self._store, self._round, reason)
            except RuntimeError:
                pass                        # the store lives here; the verdict says the rest
            raise

    def _check_superseded(self) -> None:
        """Raise if a worker left word that a newer init replaced this session.

        One store round trip (the session store, hosted by trainer rank 0).
        Raised inside the round, so the end-of-round verdict carries it to
        every rank.

        Raises:
            TransferError: the session was superseded (names the new rendezvous).
        """
        if self._store is None or not self._store.check(["superseded"]):
            return
        try:
            note = json.loads(self._store.get("superseded"))
            by = (f" by the session at {note.get('rendezvous')} (worker {note.get('worker')} "
                  "switched to it)")
        except (ValueError, RuntimeError, AttributeError):
            by = ""
        raise TransferError(f"trainer rank {self.init_info.rank}: this session was superseded"
                            f"{by}: a newer init_weight_transfer_engine replaced it on the "
                            "workers; nothing was sent; build a fresh engine with trainer_init "
                            "to send again")

    def _abort_group(self) -> None:
        """Close this rank's group connections (not the store); the engine is broken anyway.

        Dropping the last reference to the group closes its sockets, so a
        peer blocked on this rank fails at once ("connection closed")
        instead of at its deadline. The transport holds the group too, so it
        is closed and dropped first (as the receiver's ``_close_group`` does).
        """
        transport, self._transport = self._transport, None
        if transport is not None:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - best effort while reporting a failure
                pass
        del transport
        group, self._group = self._group, None
        release_group(group)
        del group

    def shutdown(self) -> None:
        """Drop the transport, the process group and the store (idempotent).

        Trainer rank 0 hosts the session store: after a successful round it
        first waits (at most ``REPORT_GRACE_S``) until every rank has read
        that round's verdict, so no rank still polling it loses the store.
        """
        if (self._store is not None and self.init_info.rank == 0 and self._round > 0
                and self._broken is None and self.payload is not None):
            wait_verdict_seen(self._store, self._round, self.payload.world_size, REPORT_GRACE_S,
                              commit_readers=self.plan.num_trainer_ranks - 1)
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        group, self._group = self._group, None
        release_group(group)
        self._store = None
