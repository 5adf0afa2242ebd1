"""Baselines to measure m2nkit against: gather-then-broadcast and the raw wire floor.

m2nkit claims that sending each worker only its slabs, straight from each
trainer rank's shard, beats the way RL frameworks move weights today. A
claim like that needs the field's way implemented fairly, on the same
process group, the same processes, the same checkpoint and the same
receiving storage; this module is that comparison and nothing else. It is
not a transport m2nkit offers.

:func:`gather_then_broadcast_round` follows the pattern of OpenRLHF's and
open-instruct's weight sync and of vLLM's RLHF example: the trainer gathers
each parameter whole (DeepSpeed ``GatheredParameters``, FSDP2
``DTensor.full_tensor()``), trainer rank 0 broadcasts it to the workers,
and every worker receives the full tensor (``WorkerWrap.update_weight``
allocates ``torch.empty(shape)``) and hands it to ``load_weights``. Per
wire tensor in manifest order:

1. every trainer rank all-gathers the full tensor from the local shards —
   a real collective among the ``T`` trainer ranks only, on their own
   stateless gloo group (:func:`create_trainer_group`): one group over all
   ``T + N`` ranks cannot all-gather over a subset of them. Uneven
   ``Shard(0)`` chunks are padded to the largest chunk and trimmed after,
   as FSDP2 does; every trainer rank ends up holding the full tensor, as
   ``full_tensor()`` leaves it;
2. trainer rank 0 sends the *full* tensor to every worker (point to point
   over the ``T + N`` group), so it sends ``N`` times the model;
3. each worker keeps the pieces it needs — the wire boxes of its bindings
   in the same plan m2nkit uses — and drops the rest, as vLLM's
   ``weight_loader`` narrows a full checkpoint tensor.

The all-gather spans all ``T`` trainer ranks, each contributing its own box;
with replicated layouts (``hsdp:R,S``, ``replicated:N``) a real trainer
gathers only across the shard axis, so there the baseline's all-gather
bytes are an overstatement (its bytes to the workers are not). With FSDP,
the benchmark's default, every rank holds a distinct chunk and the count
is what a ring all-gather of the padded chunks sends.

It is given the same courtesies as m2nkit's ``torch_p2p``: one tensor's
sends stay in flight while the next one is gathered, the receive for the
next tensor is posted before the current one is unpacked, and tensors the
inference side skips (a tied ``lm_head``) are not sent.

:func:`raw_floor_round` is the floor of this machine: exactly the bytes the
m2nkit plan puts on each (trainer rank, worker) link, as one message per
link from buffers filled in advance — no reading, packing or unpacking:
a lower bound for any transfer of the plan's bytes between these
processes over this group. :func:`message_pattern_round` sits between the
two: the same bytes in exactly torch_p2p's messages (its buckets, pairs,
tags and sizes), from buffers filled in advance, so its time over the
floor's is what the message pattern alone costs, and the transport's over
it is what its copies and bookkeeping cost.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from m2nkit.engine.control import TransferError, create_group, wait_work
from m2nkit.engine.deadline import Deadline
from m2nkit.engine.plan_types import Plan, next_local
from m2nkit.manifest.pieces import box_slices

__all__ = [
    "GATHER_GROUP_PREFIX",
    "RoundBytes",
    "create_trainer_group",
    "gather_then_broadcast_round",
    "held_stream",
    "message_fill",
    "message_pattern_buffers",
    "message_pattern_round",
    "raw_floor_buffers",
    "raw_floor_round",
]

#: ``PrefixStore`` prefix of the trainer-only group (its own keys, its own store).
GATHER_GROUP_PREFIX = "m2nkit-baseline-gather"


@dataclass(frozen=True)
class RoundBytes:
    """Bytes one rank moved in one round of a baseline.

    Attributes:
        sent: bytes sent point to point to workers (trainer ranks).
        received: bytes received point to point (workers).
        gathered: bytes this trainer rank sent inside the trainer
            all-gathers, counted as gloo's ring all-gather sends them:
            ``T - 1`` padded chunks per wire tensor. 0 for workers.
    """

    sent: int = 0
    received: int = 0
    gathered: int = 0


def create_trainer_group(host: str, port: int, rank: int, num_trainer_ranks: int, *,
                         timeout_s: float):
    """Join the stateless gloo group of the ``T`` trainer ranks only.

    The all-gather of :func:`gather_then_broadcast_round` runs here. It
    needs its own ``TCPStore`` (``port``, hosted by trainer rank 0) because
    a group of ``T + N`` ranks can run collectives only over all of them.
    Returns ``(store, group)``.

    Raises:
        TransferError: the rendezvous did not complete within ``timeout_s``.
        ValueError: ``rank`` is not a trainer rank.
    """
    if not 0 <= rank < num_trainer_ranks:
        raise ValueError(f"rank {rank} is not a trainer rank (0..{num_trainer_ranks - 1}); "
                         "only trainer ranks join the gather group")
    return create_group(host, port, rank, num_trainer_ranks, timeout_s=timeout_s,
                        prefix=GATHER_GROUP_PREFIX)


def held_stream(checkpoint, metas, num_trainer_ranks: int,
                rank: int) -> Iterable[tuple[str, torch.Tensor]]:
    """``iter_local`` of trainer ``rank`` for a manifest ``metas``, its data read from ``checkpoint``.

    What a trainer holds after a training step, for the baseline of the
    FSDP2 demo: ``checkpoint`` is the trainers' parameters saved after the
    step (``m2nkit.adapters.hf_checkpoint.Checkpoint``, full tensors by wire
    name), ``metas`` the live ``fsdp2_source`` manifest the m2nkit round sent
    (its layouts and wire dtypes) over ``num_trainer_ranks`` ranks. Per wire
    tensor ``rank`` holds, in manifest order: a tensor of
    ``meta.local_shape(rank)`` whose pieces are the rank's boxes read from
    ``checkpoint`` (``read_box``), cast to the wire dtype as ``fsdp2_source``
    casts the local shard. Lazy: one tensor at a time.

    Raises:
        KeyError: a wire tensor of ``metas`` that ``checkpoint`` lacks.
    """
    for m in metas:
        if not m.holds(rank):
            continue
        local = torch.empty(m.local_shape(rank), dtype=m.dtype)
        for pc in m.source_pieces(num_trainer_ranks):
            if pc.rank == rank:
                local[box_slices(pc.local_box)] = checkpoint.read_box(m.name, pc.box).to(m.dtype)
        yield m.name, local


def _check(plan: Plan, rank: int) -> None:
    if plan.problems:
        raise ValueError(f"the plan has {len(plan.problems)} problem(s), first: "
                         f"{plan.problems[0]}; a baseline round needs a plan that can run")
    world = plan.num_trainer_ranks + plan.num_workers
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in the transfer group of {world} ranks "
                         f"({plan.num_trainer_ranks} trainer ranks + {plan.num_workers} workers)")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``uint8`` view of ``t`` (a copy only when ``t`` is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def gather_then_broadcast_round(group, trainer_group, plan: Plan, rank: int, *,
                                stream: Iterable[tuple[str, torch.Tensor]] | None = None,
                                storage: Mapping[str, torch.Tensor] | None = None,
                                timeout_s: float) -> RoundBytes:
    """One round the way RL frameworks move weights today (see the module docstring).

    Every rank of the ``T + N`` group calls it with the same ``plan``.
    Trainer ranks ``[0, T)`` pass ``trainer_group`` (:func:`create_trainer_group`)
    and ``stream``, their ``iter_local()`` — ``(wire name, local tensor)``
    per owned wire tensor in manifest order, each local tensor of the shape
    of the rank's box. Workers ``[T, T+N)`` pass ``storage``, their
    vLLM-layout parameters (``allocate_storage``); every binding of the
    worker is written from the full tensor it receives.

    Per wire tensor of ``S`` bytes, trainer rank 0 sends ``N * S`` bytes,
    every worker receives ``S``, and every trainer rank sends ``(T - 1) *
    chunk`` bytes in the all-gather (``chunk``: the largest rank's box,
    bytes).

    ``timeout_s`` bounds each wait (an all-gather, a send, a receive)
    separately: a measuring tool with the field's per-operation timeouts,
    not the runtime's one deadline per round.

    Returns:
        ``RoundBytes`` of this rank.

    Raises:
        ValueError: the plan has problems, ``rank`` is outside the group, or
            a trainer rank lacks ``stream``/``trainer_group`` or a worker
            ``storage``.
        TransferError: a stream out of manifest order or of the wrong
            shape, or a collective, send or receive that failed or timed out.
    """
    _check(plan, rank)
    T = plan.num_trainer_ranks
    if rank < T:
        if stream is None or trainer_group is None:
            raise ValueError(f"trainer rank {rank} needs stream= and trainer_group=")
        return _gather_and_send(group, trainer_group, plan, rank, stream, timeout_s)
    if storage is None:
        raise ValueError(f"worker {rank - T} (rank {rank}) needs storage=")
    return _receive_full(group, plan, rank - T, storage, timeout_s)


def _gather_and_send(group, trainer_group, plan: Plan, rank: int,
                     stream: Iterable[tuple[str, torch.Tensor]], timeout_s: float) -> RoundBytes:
    T, N = plan.num_trainer_ranks, plan.num_workers
    it = iter(stream)
    sent = gathered = 0
    in_flight: list[tuple[object, str]] = []
    keep_alive: torch.Tensor | None = None
    for wi, wp in enumerate(plan.wires):
        local = None
        if wp.meta.holds(rank):
            local = next_local(it, wp, rank, error=TransferError)
        if wp.skipped:
            continue

        # 1. all-gather among the trainer ranks: every rank contributes its
        #    local tensor padded to the largest, every rank receives all of them.
        shapes = {r: wp.meta.local_shape(r) for r in wp.owners}
        chunk = max(math.prod(sh) for sh in shapes.values()) * wp.itemsize
        mine = torch.empty(chunk, dtype=torch.uint8)
        if local is not None and local.numel():
            raw = _as_bytes(local)
            mine[:raw.numel()].copy_(raw)
        outs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(T)]
        what = f"trainer rank {rank}: all-gather of '{wp.name}'"
        try:
            work = trainer_group.allgather([outs], [mine])
        except RuntimeError as e:
            raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
        wait_work(work, timeout_s, what)
        gathered += (T - 1) * chunk
        # Trim the padding and place every box: the full tensor, on every
        # trainer rank, as DTensor.full_tensor() leaves it.
        full = torch.empty(wp.meta.shape, dtype=wp.meta.dtype)
        for pc in wp.pieces:
            sh = shapes[pc.rank]
            held = outs[pc.rank][:math.prod(sh) * wp.itemsize].view(wp.meta.dtype).view(sh)
            full[box_slices(pc.box)].copy_(held[box_slices(pc.local_box)])
        del outs, mine

        # 2. rank 0 sends the full tensor to every worker; the previous
        #    tensor's sends were left in flight while this one was gathered.
        for work, what in in_flight:
            wait_work(work, timeout_s, what)
        in_flight = []
        keep_alive = None
        if rank != 0:
            continue
        payload = _as_bytes(full)
        for w in range(N):
            what = f"trainer rank 0: send of '{wp.name}' to worker {w}"
            try:
                work = group.send([payload], T + w, wi)
            except RuntimeError as e:
                raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
            in_flight.append((work, what))
            sent += payload.numel()
        keep_alive = payload  # the buffer must outlive its sends
    for work, what in in_flight:
        wait_work(work, timeout_s, what)
    del keep_alive
    leftover = next(it, None)
    if leftover is not None:
        raise TransferError(f"trainer rank {rank}: source yielded '{leftover[0]}' after the last "
                            "wire tensor of the manifest")
    return RoundBytes(sent=sent, gathered=gathered)


def _receive_full(group, plan: Plan, worker: int, storage: Mapping[str, torch.Tensor],
                  timeout_s: float) -> RoundBytes:
    T = plan.num_trainer_ranks
    todo = [wi for wi, wp in enumerate(plan.wires) if not wp.skipped]

    def post(wi: int):
        wp = plan.wires[wi]
        buf = torch.empty(wp.meta.nbytes, dtype=torch.uint8)
        what = f"worker {worker} (rank {T + worker}): receive of '{wp.name}' from trainer rank 0"
        try:
            work = group.recv([buf], 0, wi)
        except RuntimeError as e:
            raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
        return wi, buf, work, what

    received = 0
    pending = post(todo[0]) if todo else None
    for k in range(len(todo)):
        wi, buf, work, what = pending
        pending = post(todo[k + 1]) if k + 1 < len(todo) else None
        wait_work(work, timeout_s, what)
        received += buf.numel()
        wp = plan.wires[wi]
        full = buf.view(wp.meta.dtype).view(wp.meta.shape)
        # 3. keep this worker's boxes, drop the rest (vLLM's weight_loader
        #    narrows the full checkpoint tensor the same way).
        for b in wp.bindings:
            if b.worker != worker:
                continue
            storage[b.param][box_slices(b.region)].copy_(full[box_slices(b.box)])
    return RoundBytes(received=received)


def raw_floor_buffers(plan: Plan, rank: int) -> dict[int, torch.Tensor]:
    """Filled ``uint8`` buffers for :func:`raw_floor_round`, one per link of ``rank``.

    A trainer rank gets ``{worker: buffer}``, a worker ``{trainer rank:
    buffer}``, each of the plan's ``link_bytes`` for that link. Every page
    is written here, so the round measures the wire, not page faults.

    Raises:
        ValueError: ``rank`` is outside the ``T + N`` group.
    """
    _check(plan, rank)
    T = plan.num_trainer_ranks
    out = {}
    for (src, dst), n in sorted(plan.link_bytes.items()):
        if rank == src:
            out[dst] = torch.full((n,), (src * 31 + dst) % 251, dtype=torch.uint8)
        elif rank == T + dst:
            out[src] = torch.zeros(n, dtype=torch.uint8)
    return out


def message_pattern_buffers(plan: Plan, schedule,
                            rank: int) -> dict[tuple[int, int, int], torch.Tensor]:
    """Filled ``uint8`` buffers for :func:`message_pattern_round`, one per message of ``rank``.

    Keyed ``(bucket, peer rank, tag)`` over torch_p2p's messages of one round
    at ``schedule`` (a ``torch_p2p.BucketSchedule``; ``torch_p2p.round_messages``:
    the transport's own buckets, pairs, tags and sizes). A trainer rank's buffers are filled with a byte derived from
    ``(trainer rank, worker, tag)`` (:func:`message_fill`), a worker's with
    zeros; every page is written here.

    Raises:
        ValueError: ``rank`` is outside the ``T + N`` group.
    """
    from m2nkit.engine.transports.torch_p2p import round_messages

    _check(plan, rank)
    T = plan.num_trainer_ranks
    out = {}
    for m in round_messages(plan, schedule):
        if rank == m.src:
            out[(m.bucket, T + m.worker, m.tag)] = torch.full(
                (m.nbytes,), message_fill(m.src, m.worker, m.tag), dtype=torch.uint8)
        elif rank == T + m.worker:
            out[(m.bucket, m.src, m.tag)] = torch.zeros(m.nbytes, dtype=torch.uint8)
    return dict(sorted(out.items()))


def message_fill(src: int, worker: int, tag: int) -> int:
    """The byte :func:`message_pattern_buffers` fills trainer ``src``'s message ``tag`` to
    ``worker`` with (1..251: never the receive buffers' zero)."""
    return 1 + (src * 131 + worker * 31 + tag * 7) % 251


def message_pattern_round(group, plan: Plan, buffers: Mapping[tuple[int, int, int], torch.Tensor],
                          rank: int, *, timeout_s: float) -> RoundBytes:
    """Replay torch_p2p's messages of one round from pre-filled buffers: no copies, no layouts.

    ``buffers`` come from :func:`message_pattern_buffers` (the same plan,
    schedule and rank). Bucket by bucket, as ``send_round``/``recv_round``
    run them: every message of the bucket posted, then all waited for,
    before the next bucket. Its time against :func:`raw_floor_round`'s
    (the same bytes as one message per link) is what gloo's per-message
    cost alone takes for the transport's message pattern; the transport's
    time against it is what its own copies and bookkeeping take.

    Raises:
        TransferError: a send or receive failed or timed out.
    """
    _check(plan, rank)
    T = plan.num_trainer_ranks
    deadline = Deadline(timeout_s)
    posted, bucket, n = [], None, 0
    for (k, peer, tag), buf in buffers.items():
        if k != bucket:
            for work, what in posted:
                wait_work(work, deadline, what)
            posted, bucket = [], k
        if rank < T:
            what = f"trainer rank {rank}: pattern send of bucket {k} to worker {peer - T}"
            op = group.send
        else:
            what = f"worker {rank - T} (rank {rank}): pattern receive of bucket {k} from " \
                   f"trainer rank {peer}"
            op = group.recv
        try:
            posted.append((op([buf], peer, tag), what))
        except RuntimeError as e:
            raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
        n += buf.numel()
    for work, what in posted:
        wait_work(work, deadline, what)
    return RoundBytes(sent=n) if rank < T else RoundBytes(received=n)


def raw_floor_round(group, plan: Plan, rank: int, buffers: Mapping[int, torch.Tensor], *,
                    timeout_s: float) -> RoundBytes:
    """Move the plan's bytes per link as one raw gloo message per link.

    ``buffers`` come from :func:`raw_floor_buffers` for the same ``rank``.
    Trainer ranks post every send at once, workers every receive; then
    both wait. The wall time of this round is the least any transfer of
    the plan's bytes can take on this group.

    Raises:
        ValueError: the buffers do not match the plan's links of ``rank``.
        TransferError: a send or receive failed or timed out.
    """
    _check(plan, rank)
    T = plan.num_trainer_ranks
    if rank < T:
        links = {dst: n for (src, dst), n in plan.link_bytes.items() if src == rank}
    else:
        links = {src: n for (src, dst), n in plan.link_bytes.items() if dst == rank - T}
    got = {peer: b.numel() for peer, b in buffers.items()}
    if got != links:
        raise ValueError(f"rank {rank}: buffers cover links {got} but the plan has {links}; "
                         "build them with raw_floor_buffers(plan, rank)")
    posted = []
    for peer, buf in sorted(buffers.items()):
        if rank < T:
            what = f"trainer rank {rank}: floor send to worker {peer}"
            op = lambda b=buf, p=peer: group.send([b], T + p, 0)  # noqa: E731
        else:
            what = f"worker {rank - T} (rank {rank}): floor receive from trainer rank {peer}"
            op = lambda b=buf, p=peer: group.recv([b], p, 0)  # noqa: E731
        try:
            posted.append((op(), what))
        except RuntimeError as e:
            raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
    for work, what in posted:
        wait_work(work, timeout_s, what)
    n = sum(links.values())
    return RoundBytes(sent=n) if rank < T else RoundBytes(received=n)
