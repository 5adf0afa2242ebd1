"""``nccl_m2n``: one ``nccl.m2n.reshard`` per wire tensor that it can carry.

NVIDIA's ``nccl.m2n`` (nccl-extensions, ``nccl_m2n/README.md``) moves a
global tensor between two disjoint groups of GPU ranks of one NCCL
communicator in a single call, from the source layout straight into the
destination layout, with no host involvement. This transport issues one such
call per wire tensor its own rules accept (``can_carry``, in
``nccl_m2n_rules.py``: contiguous rank intervals, at most a 2-D mesh, one
sharded dim per side, even division, 1-D to 3-D, one piece per rank, a
contiguous destination region, the fan limits) and hands every other wire
tensor to a ``TorchP2PTransport`` over the same ranks, so any plan runs
whole; nothing is ever gathered on the trainer.

Ranks follow vLLM's ``m2n_common.py``: trainer ranks ``[0, T)``, workers
``[T, T+N)``, one nccl4py communicator over all of them
(``nccl_m2n_runtime.py``), bootstrapped through the ``TCPStore`` of the
session's group (``m2nkit.engine.control.create_group``).

Ordering is what keeps this deadlock-free. The manifest is cut into
*segments* (``nccl_m2n_rules.plan_segments``): maximal runs of consecutive
wire tensors with the same carrier. Every rank walks the same segments in
the same order: an ``nccl_m2n`` segment issues its reshards in manifest
order on every rank of the communicator (ranks outside a side pass ``None``
for it, as nccl.m2n requires); a ``torch_p2p`` segment runs the torch_p2p
transport's ``send_round`` / ``recv_round`` on a sub-plan of just that
segment and completes before the next segment starts. A trainer's providers
are still called once per owned wire tensor, in manifest order.

Timeouts: every wait for GPU completion of a reshard (and the end-of-round
fence) polls a CUDA event against the round's deadline and, on expiry or on
an asynchronous NCCL error, aborts the communicator and raises
``TransferError`` (``NcclResharder``); ``torch_p2p`` segments keep
``torch_p2p``'s own waits. See docs/nccl_m2n.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from m2nkit.engine.control import TransferError
from m2nkit.engine.plan_types import Plan, WirePlan, next_local
from m2nkit.engine.transports.nccl_m2n_rules import (
    CARRIER_M2N,
    CARRIER_P2P,
    Segment,
    can_carry,
    plan_segments,
    sub_plan,
    wire_carrier,
)
from m2nkit.engine.transports.nccl_m2n_runtime import (
    M2NCall,
    NcclResharder,
    Resharder,
    destination_view,
    import_nccl_m2n,
    m2n_descriptors,
)
from m2nkit.engine.transports.torch_p2p import TorchP2PTransport
from m2nkit.manifest.pieces import box_slices

__all__ = ["RoundReport", "NcclM2NTransport"]


@dataclass
class RoundReport:
    """What one rank did in one round.

    Attributes:
        m2n_tensors, p2p_tensors: wire tensors of the plan carried by each
            transport (plan-wide, the same on every rank).
        m2n_bytes: bytes of this rank's buffers handed to nccl.m2n (a
            trainer: the local shards it passed; a worker: the regions it
            received).
        p2p_bytes: bytes ``torch_p2p`` moved for this rank (the sizes of
            its messages, as ``torch_p2p`` returns them).
        segments: segments walked.
        seconds: wall time of the round on this rank, up to its GPU work
            completing.
    """

    m2n_tensors: int = 0
    p2p_tensors: int = 0
    m2n_bytes: int = 0
    p2p_bytes: int = 0
    segments: int = 0
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of this rank in the round, both carriers (``Transport``'s ``RoundResult``)."""
        return self.m2n_bytes + self.p2p_bytes


class _Cursor:
    """A trainer's ``iter_local()`` stream, taken one owned wire tensor at a time."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]], rank: int):
        self.it = iter(stream)
        self.rank = rank

    def take(self, wp: WirePlan) -> tuple[str, torch.Tensor]:
        return wp.name, next_local(self.it, wp, self.rank, error=TransferError)

    def segment(self, plan: Plan, wires: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """Exactly this rank's owned wire tensors of one segment, pulled lazily."""
        for wi in wires:
            wp = plan.wires[wi]
            if wp.meta.holds(self.rank):
                yield self.take(wp)

    def finish(self) -> None:
        leftover = next(self.it, None)
        if leftover is not None:
            raise TransferError(f"trainer rank {self.rank}: source yielded '{leftover[0]}' after "
                                "the last wire tensor of the manifest")


class NcclM2NTransport:
    """Move a plan's wire tensors: nccl.m2n where the plan allows, torch_p2p elsewhere.

    A ``Transport`` (``m2nkit.engine.transports.base``). Build it with
    :meth:`connect` (real NCCL) or directly from a group and any
    ``Resharder``. Every rank of the communicator calls ``send_round``
    (trainer ranks ``0..T-1``) or ``recv_round`` (worker ranks ``T..T+N-1``)
    once per round with the same plan, and ``close`` at the end. The wire
    tensors nccl.m2n cannot carry go through a ``TorchP2PTransport`` over
    the same group (fresh staging bytes per segment, as ``torch_p2p``
    without a kept pool).

    Args:
        group: the session's process group over the same ``T+N`` ranks
            (``control.create_group``), for the torch_p2p segments.
        resharder: issues the reshards (``NcclResharder``).
        rank: this rank in both the group and the communicator.
        device: where staging buffers and trainer copies live (``cuda:i``).
        timeout_s: seconds any single wait may take (torch_p2p waits, and
            every reshard completion wait).
        bucket_bytes: ``torch_p2p`` bucket size within a segment.
        max_pending_bytes: bytes of reshard buffers kept referenced while
            their reshards run; beyond it the oldest is waited for.
    """

    name: ClassVar[str] = CARRIER_M2N
    #: The planner records this verdict per wire tensor (``nccl_m2n_rules``).
    can_carry = staticmethod(can_carry)

    @staticmethod
    def why_unavailable() -> str | None:
        """``None`` where CUDA is available; nccl.m2n moves GPU tensors only."""
        if torch.cuda.is_available():
            return None
        return ("needs CUDA GPUs and this process sees none; use 'torch_p2p' (any backend, "
                "gloo on CPU)")

    @staticmethod
    def check_source(source: Any, rank: int) -> None:
        """Refuse a source that runs collectives while it is iterated.

        nccl_m2n joins each wire tensor's reshard without asking the source
        on ranks that hold none of it, so the source's own collectives would
        be issued in a different order on different ranks (NCCL: a
        deadlock); docs/bridge.md.

        Raises:
            ValueError: ``source.collectives_while_iterating`` is true
                (Megatron-Bridge's export or gather); names the rank.
        """
        if getattr(source, "collectives_while_iterating", False):
            raise ValueError(f"trainer rank {rank}: this source runs collectives while it "
                             "is iterated (Megatron-Bridge's export or gather), which the "
                             "nccl_m2n transport cannot interleave safely; use "
                             "transport='torch_p2p', or a source without them "
                             "(bridge_source in mode='tasks' with no fallback kinds)")

    def __init__(self, group: Any, resharder: Resharder, *, rank: int,
                 device: torch.device | str = "cuda", timeout_s: float,
                 bucket_bytes: int = 64 << 20, max_pending_bytes: int = 256 << 20) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if bucket_bytes <= 0 or max_pending_bytes < 0:
            raise ValueError(f"bucket_bytes must be > 0 and max_pending_bytes >= 0, got "
                             f"{bucket_bytes} and {max_pending_bytes}")
        self.group = group
        self.resharder = resharder
        self.rank = rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.max_pending_bytes = max_pending_bytes
        self._p2p = TorchP2PTransport(group, rank=rank, device=self.device, timeout_s=timeout_s,
                                      bucket_bytes=bucket_bytes, keep_buffers=False)
        # Derived from the last plan object seen; a round with another plan rebuilds them.
        self._prepared: tuple[Plan, list[Segment], dict[int, M2NCall]] | None = None
        self._sub_plans: dict[Segment, Plan] = {}

    @classmethod
    def connect(cls, store: Any, group: Any, rank: int, world_size: int, *,
                device: torch.device | str | int, timeout_s: float,
                bucket_bytes: int = 64 << 20, max_pending_bytes: int = 256 << 20,
                max_cta: int | None = None, key: str = "nccl_m2n/unique_id") -> "NcclM2NTransport":
        """Create the nccl4py communicator over all ranks and wrap it.

        Rank 0 creates the NCCL unique id and puts its 128 bytes into
        ``store`` (the ``TCPStore`` from ``control.create_group``) under
        ``key``; the others wait for it up to ``timeout_s``. Use a new
        ``key`` for every new communicator on the same store (after an
        abort). Collective: every rank calls it.

        Raises:
            NcclM2NUnavailableError: nccl.m2n or nccl4py does not import.
            TransferError: the unique id did not arrive within ``timeout_s``,
                or NCCL failed to create the communicator or the handle.
        """
        m2n, core = import_nccl_m2n()
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        torch.cuda.set_device(dev)
        try:
            if rank == 0:
                uid = core.get_unique_id()
                store.set(key, bytes(uid))
            else:
                store.wait([key], timedelta(seconds=timeout_s))
                uid = core.UniqueId.from_bytes(store.get(key))
        except (RuntimeError, dist.DistStoreError) as e:
            raise TransferError(f"rank {rank}: the NCCL unique id under '{key}' did not arrive "
                                f"within {timeout_s:g} s: {e}") from e
        try:
            comm = core.Communicator.init(nranks=world_size, rank=rank, unique_id=uid)
        except Exception as e:
            raise TransferError(f"rank {rank}: creating the NCCL communicator of {world_size} "
                                f"ranks failed: {type(e).__name__}: {e}") from e
        try:
            resharder = NcclResharder(comm, rank=rank, device=dev, timeout_s=timeout_s,
                                      max_cta=max_cta)
        except Exception as e:
            comm.destroy()
            raise TransferError(f"rank {rank}: nccl.m2n.init failed: {type(e).__name__}: {e}") from e
        return cls(group, resharder, rank=rank, device=dev, timeout_s=timeout_s,
                   bucket_bytes=bucket_bytes, max_pending_bytes=max_pending_bytes)

    # ---- helpers

    def _prepare(self, plan: Plan):
        if plan.problems:
            raise ValueError(f"the plan has {len(plan.problems)} problem(s), first: "
                             f"{plan.problems[0]}; nothing was sent")
        if self._prepared is not None and self._prepared[0] is plan:
            _, segments, calls = self._prepared
        else:
            segments = plan_segments(plan)
            m2n = getattr(self.resharder, "m2n", None)
            calls = {wi: m2n_descriptors(plan, wi, m2n=m2n)
                     for wi, w in enumerate(plan.wires) if wire_carrier(w) == CARRIER_M2N}
            self._prepared = (plan, segments, calls)
            self._sub_plans = {}
        report = RoundReport(m2n_tensors=len(calls),
                             p2p_tensors=sum(1 for w in plan.wires if wire_carrier(w) == CARRIER_P2P),
                             segments=len(segments))
        return segments, calls, report

    def _sub_plan(self, plan: Plan, seg: Segment) -> Plan:
        """The sub-plan of a torch_p2p segment (cached with the plan; its buckets with it)."""
        if seg not in self._sub_plans:
            self._sub_plans[seg] = sub_plan(plan, seg.wires)
        return self._sub_plans[seg]

    def _source_buffer(self, call: M2NCall, wp: WirePlan, local: torch.Tensor) -> torch.Tensor:
        # can_carry admits one piece per rank at the start of its local
        # tensor; explicit pieces may sit in a larger tensor (padding rows).
        mine = wp.rank_pieces(self.rank)
        if len(mine) == 1:
            local = local[box_slices(mine[0].local_box)]
        if tuple(local.shape) != call.src_local_shape or local.dtype != call.dtype:
            raise TransferError(f"trainer rank {self.rank}: local '{wp.name}' is "
                                f"{tuple(local.shape)} {local.dtype}; its box needs "
                                f"{call.src_local_shape} {call.dtype}")
        return local.to(self.device).contiguous()

    # ---- rounds

    def send_round(self, plan: Plan, rank: int, stream: Iterable[tuple[str, torch.Tensor]], *,
                   deadline=None) -> RoundReport:
        """Send this trainer rank's part of one round.

        ``stream`` is the rank's ``iter_local()``: one ``(name, local
        tensor)`` per owned wire tensor in manifest order; each provider runs
        once, when its wire tensor's turn comes. ``deadline`` (the round's
        ``m2nkit.engine.deadline.Deadline``) bounds every wait of the round;
        without it each wait gets ``timeout_s``.

        Raises:
            ValueError: the plan has problems, or ``rank`` is not this
                transport's trainer rank.
            TransferError: a stream out of order or of the wrong shape, a
                failed reshard or send, or a timeout.
        """
        if rank != self.rank or not 0 <= rank < plan.num_trainer_ranks:
            raise ValueError(f"send_round for trainer rank {rank} on the transport of rank "
                             f"{self.rank} (trainer ranks are 0..{plan.num_trainer_ranks - 1})")
        t0 = time.perf_counter()
        if hasattr(self.resharder, "deadline"):
            self.resharder.deadline = deadline
        segments, calls, report = self._prepare(plan)
        cursor = _Cursor(stream, rank)
        for seg in segments:
            if seg.carrier == CARRIER_P2P:
                report.p2p_bytes += self._p2p.send_round(
                    self._sub_plan(plan, seg), rank, cursor.segment(plan, seg.wires),
                    deadline=deadline).nbytes
                continue
            for wi in seg.wires:
                wp = plan.wires[wi]
                local = cursor.take(wp)[1] if wp.meta.holds(rank) else None
                call = calls.get(wi)
                if call is None:      # moves nothing; its provider was still called
                    continue
                src = self._source_buffer(call, wp, local) if rank in call.src_ranks else None
                self.resharder.issue(call, src, None)
                report.m2n_bytes += 0 if src is None else src.numel() * src.element_size()
                del local, src
                self.resharder.drain(self.max_pending_bytes)
        cursor.finish()
        self.resharder.drain(0)
        self.resharder.fence()
        report.seconds = time.perf_counter() - t0
        return report

    def recv_round(self, plan: Plan, worker: int, storage: Mapping[str, torch.Tensor], *,
                   deadline=None) -> tuple[set[str], RoundReport]:
        """Receive this worker's part of one round straight into ``storage``.

        ``deadline`` (the round's) bounds every wait; without it each wait
        gets ``timeout_s``.

        ``storage`` is the worker's vLLM-layout parameters (``{param:
        tensor}`` on this transport's device). nccl.m2n writes each m2n wire
        tensor's region in place; torch_p2p segments unpack their slabs.

        Returns:
            ``(names of wire tensors fully received, report)``.

        Raises:
            ValueError: the plan has problems, or ``worker`` is not this
                transport's worker.
            TransferError: a failed or timed-out reshard or receive; its
                ``received`` attribute lists the wire tensors that arrived
                whole and ``missing`` the others.
        """
        T = plan.num_trainer_ranks
        if T + worker != self.rank or not 0 <= worker < plan.num_workers:
            raise ValueError(f"recv_round for worker {worker} (rank {T + worker}) on the "
                             f"transport of rank {self.rank}")
        t0 = time.perf_counter()
        if hasattr(self.resharder, "deadline"):
            self.resharder.deadline = deadline
        segments, calls, report = self._prepare(plan)
        expected = {w.name for w in plan.wires
                    if w.sends_to(worker)}
        done: set[str] = set()
        notify = getattr(storage, "wires_received", None)   # a reload's (torch_p2p.recv_round)

        def _landed(names) -> set[str]:
            whole = set(names) & expected
            if whole and notify is not None:
                notify(sorted(whole))     # drain waited for each one's event: its bytes landed
            return whole

        try:
            for seg in segments:
                if seg.carrier == CARRIER_P2P:
                    names, got = self._p2p.recv_round(self._sub_plan(plan, seg), worker,
                                                      storage, deadline=deadline)
                    done |= names
                    report.p2p_bytes += got.nbytes
                    continue
                for wi in seg.wires:
                    call = calls.get(wi)
                    if call is None:
                        continue
                    dst = destination_view(plan, wi, worker, storage) \
                        if self.rank in call.dst_ranks else None
                    if dst is not None and (tuple(dst.shape) != call.dst_local_shape
                                            or dst.dtype != call.dtype):
                        raise TransferError(
                            f"worker {worker}: region of '{call.name}' is {tuple(dst.shape)} "
                            f"{dst.dtype}; nccl.m2n delivers {call.dst_local_shape} {call.dtype}")
                    self.resharder.issue(call, None, dst)
                    report.m2n_bytes += 0 if dst is None else dst.numel() * dst.element_size()
                    done |= _landed(self.resharder.drain(self.max_pending_bytes))
            done |= _landed(self.resharder.drain(0))
            self.resharder.fence()
        except TransferError as e:
            prior = set(getattr(e, "received", ()))
            e.received = sorted(done | prior)
            e.missing = sorted(expected - done - prior)
            raise
        report.seconds = time.perf_counter() - t0
        return done, report

    def close(self) -> None:
        """Finish and release the communicator (collective: every rank calls it)."""
        self.resharder.close()
