"""``torch_p2p``: execute any plan with ``torch.distributed`` point-to-point ops.

Works over any backend (gloo over 127.0.0.1 on CPU, nccl on GPU) and any
layout, including those ``nccl.m2n`` cannot express: it has no rules
(``can_carry`` is ``None``). It moves bytes over the session's process group
(trainer ranks ``[0, T)``, workers ``[T, T+N)``, vLLM ``m2n_common.py``),
which the control plane built and agreed on (``m2nkit.engine.control``).
:class:`TorchP2PTransport` is its ``Transport``; the functions below are its
data plane, also used on their own by the baseline and the benchmarks.

Wire tensors are cut into *buckets*: consecutive tensors in manifest order,
closed once some rank would send or receive ``bucket_bytes``. Within a
bucket a slab of ``DIRECT_BYTES`` or more is a message of its own (cut where
that makes it contiguous on both sides), sent straight from the provider's
local tensor and received straight into the worker's parameter where its
region is contiguous there (zero-copy), through a bounce copy otherwise; the
smaller slabs of a (trainer, worker) pair share one packed message. With
``RUN_PIECE_BYTES`` set (off by default), slabs of a pair that continue one
another in a worker parameter (an expert's gate and up halves in vLLM's
fused ``w13_weight``, the next expert's after them) travel as one *run*
message, packed on the trainer and received straight into the parameter
(:func:`_messages`). Both
sides derive bucket boundaries and message layouts from the plan alone
(cached on it), so no sizes are exchanged. One bucket is in flight at a
time and staged bytes come from a ``BufferPool`` kept across rounds, so a
rank's extra memory stays within about one bucket, not one model.

Every wait of a round counts down to one ``Deadline`` set when the round
starts (``m2nkit.engine.deadline``), so waits never add up: a dead or stalled
peer becomes a ``TransferError`` naming the peer and the bucket, never a hang.
:func:`exchange_in_process` runs the same messages inside one process (no
group), for ``m2nkit plan --verify``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, NamedTuple

import numpy as np
import torch

from m2nkit.engine.control import TransferError, error_gist, wait_work
from m2nkit.engine.deadline import Deadline
from m2nkit.engine.plan_types import Plan, Slab, SlabTable, next_local

__all__ = [
    "TorchP2PTransport",
    "P2PReport",
    "BucketSchedule",
    "link_slabs",
    "BufferPool",
    "DIRECT_BYTES",
    "region_is_contiguous",
    "send_round",
    "recv_round",
    "exchange_in_process",
    "message_count",
    "RoundMessage",
    "round_messages",
]


@dataclass(frozen=True)
class BucketSchedule:
    """Bucket boundaries over ``plan.wires``: ``bounds[k]`` to ``bounds[k+1]``.

    A bucket closes *before* the wire tensor that would make some trainer
    send, or some worker receive, more than ``bucket_bytes`` in it, so no
    rank stages more than one bucket; a single tensor larger than that is a
    bucket of its own (its large slabs travel zero-copy). Derived from the
    plan alone, so every rank agrees.
    """

    bounds: tuple[int, ...]
    bucket_bytes: int

    @classmethod
    def build(cls, plan: Plan, bucket_bytes: int = 64 << 20) -> "BucketSchedule":
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        bounds = [0]
        send = np.zeros(plan.num_trainer_ranks, dtype=np.int64)
        recv = np.zeros(plan.num_workers, dtype=np.int64)
        for i, w in enumerate(plan.wires):
            if not len(w.table):
                continue
            nb = w.slab_nbytes()
            s = np.bincount(w.table[:, SlabTable.SRC], weights=nb,
                            minlength=len(send)).astype(np.int64)
            r = np.bincount(w.table[:, SlabTable.DST], weights=nb,
                            minlength=len(recv)).astype(np.int64)
            if bounds[-1] < i and (send.any() or recv.any()) and \
                    max((send + s).max(initial=0), (recv + r).max(initial=0)) > bucket_bytes:
                bounds.append(i)                      # close before it would exceed
                send[:] = 0
                recv[:] = 0
            send += s
            recv += r
        if bounds[-1] != len(plan.wires):
            bounds.append(len(plan.wires))
        return cls(tuple(bounds), bucket_bytes)

    @classmethod
    def of(cls, plan: Plan, bucket_bytes: int = 64 << 20) -> "BucketSchedule":
        """:meth:`build`, cached on ``plan`` per ``bucket_bytes`` (as the message layouts are)."""
        cache = plan.__dict__.setdefault("_m2nkit_buckets", {})
        if bucket_bytes not in cache:
            cache[bucket_bytes] = cls.build(plan, bucket_bytes)
        return cache[bucket_bytes]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def wires(self, k: int) -> range:
        return range(self.bounds[k], self.bounds[k + 1])


def link_slabs(plan: Plan, wires: range, *, src: int | None = None,
                dst: int | None = None) -> dict[int, list[tuple[int, Slab]]]:
    """Per peer: the ``(wire index, Slab)`` of one message, in packing order.

    ``src=rank`` gives a trainer rank's messages keyed by worker;
    ``dst=worker`` a worker's keyed by trainer rank. Slabs are packed by
    falling element size (8, 4, 2, 1 bytes), then in manifest and plan order.
    Every slab's bytes are a multiple of its element size, so each slab then
    starts at an offset its dtype can be viewed at, with no padding: the
    message is exactly the slab bytes.
    """
    out: dict[int, list] = {}
    for wi in wires:
        for slab in plan.wires[wi].slabs(src=src, dst=dst):
            out.setdefault(slab.dst if src is not None else slab.src, []).append((wi, slab))
    for items in out.values():
        items.sort(key=lambda item: -plan.wires[item[0]].itemsize)  # stable
    return out


#: A slab of at least this many bytes travels as a message of its own: sent
#: straight from the trainer's local tensor where its region is contiguous
#: there, received straight into the worker's parameter where its region is
#: contiguous there (no copy on either side). Smaller slabs of one (trainer,
#: worker) pair and bucket share one packed message: one copy each way costs
#: less than a message each. Both sides derive which is which from the plan.
DIRECT_BYTES = 256 << 10


def region_is_contiguous(shape: tuple[int, ...], region: tuple[slice, ...]) -> bool:
    """Whether ``t[region]`` of a C-contiguous ``t`` of ``shape`` is one contiguous run.

    True when every dim after the first partial one is whole and every dim
    before it has extent 1 (unit-step slices, as ``Slab`` regions are).
    """
    ext = [min(s.stop, n) - s.start for s, n in zip(region, shape)]
    k = len(shape)
    while k > 0 and ext[k - 1] == shape[k - 1]:
        k -= 1                     # trailing whole dims
    return all(e <= 1 for e in ext[:max(k - 1, 0)])


def _byte_range(shape: tuple[int, ...] | None, region: tuple[slice, ...],
                itemsize: int) -> tuple[int, int] | None:
    """``(first byte, end byte)`` of ``t[region]`` in a C-contiguous ``t`` of ``shape``.

    ``None`` where the region is not one contiguous run of ``t``'s bytes
    (:func:`region_is_contiguous`) or ``shape`` is unknown or of another rank.
    Computed once per plan, so a round takes a zero-copy message as one slice
    of the tensor's flat bytes instead of indexing its region anew.
    """
    if shape is None or len(shape) != len(region) or not region_is_contiguous(shape, region):
        return None
    start, count, stride = 0, 1, 1
    for s, n in zip(reversed(region), reversed(shape)):
        start += s.start * stride
        count *= min(s.stop, n) - s.start
        stride *= n
    return start * itemsize, (start + count) * itemsize


def _flat_view(t: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor | None:
    """``t``'s bytes as one flat uint8 view when ``t`` is C-contiguous with ``shape``, else None."""
    if shape is None or tuple(t.shape) != shape or not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


def _aligned(n: int) -> int:
    """``n`` rounded up to 16 bytes: carve-outs of a pool start where any dtype can be viewed."""
    return (n + 15) & ~15


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (same storage)."""
    return t.reshape(-1).view(torch.uint8)


class BufferPool:
    """Staging bytes of one rank, reused across buckets and rounds (grow-only).

    A transport takes ``reserve(n)`` at the start of a bucket, once the
    previous bucket's messages are done with it, and carves the bucket's
    packed messages and bounce copies out of it. The pool grows to the
    largest bucket's need and stays there, so after the first round no
    bucket allocates (no page faults on fresh buffers); ``nbytes`` is what
    it holds. It also keeps the views of its bytes that each bucket's packed
    messages carve (:meth:`views`), so after the first round a bucket does
    not re-slice them either. One pool per engine or receiver; not thread-safe.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._views: dict[int, tuple[object, object]] = {}

    def views(self, layout: object, build) -> Any:
        """``build(bytes)``: the views of the pool's bytes that ``layout`` carves, made once.

        ``layout`` is a message layout cached on the plan (:func:`_send_layout`,
        :func:`_recv_layout`); the views are kept until the bytes change
        (``reserve`` grows them, ``release`` drops them), so a round reuses the
        previous round's views instead of slicing and re-viewing the pool per
        slab. They view only the pool's own bytes, so keeping them holds no
        other memory. ``layout`` is kept with them: its ``id`` is not reused
        while the entry lives.
        """
        hit = self._views.get(id(layout))
        if hit is None or hit[0] is not layout:
            hit = self._views[id(layout)] = (layout, build(self._buf))
        return hit[1]

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    def reserve(self, n: int) -> torch.Tensor:
        """At least ``n`` bytes (a uint8 tensor); earlier views must be out of use."""
        if n > self._buf.numel():
            self._views.clear()
            self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)  # free first
            self._buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        return self._buf

    def release(self) -> None:
        """Drop the bytes (a later ``reserve`` allocates again)."""
        self._views.clear()
        self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)


def _dst_shapes(plan: Plan) -> dict[tuple[int, str], tuple[int, ...]]:
    """``{(worker, vLLM name): local shape}`` of the plan's destination (cached on the plan)."""
    cached = plan.__dict__.get("_m2nkit_dst_shapes")
    if cached is None:
        cached = {(p.worker, p.name): tuple(p.shape) for p in plan.destination.params}
        plan.__dict__["_m2nkit_dst_shapes"] = cached
    return cached


def _split_direct(plan: Plan, wi: int, slab: Slab) -> list[Slab]:
    """A large slab as messages contiguous on both sides where the plan's shapes allow.

    A slab of stacked experts ``[4, I, H]`` is contiguous neither in the
    trainer's ``[4, 2I, H]`` shard nor in vLLM's ``[E, I, H]`` parameter,
    but each expert's ``[1, I, H]`` is, in both: the slab is cut along its
    leading dims (the fewest that give contiguous parts), while each part
    keeps ``DIRECT_BYTES`` or more. Computed from the plan alone (the
    manifest's local shape, the destination's parameter shape), so the
    trainer and the worker cut alike; where no cut works, the slab stays
    whole and the side that is not contiguous copies.
    """
    src_shape = plan.wires[wi].meta.local_shape(slab.src)
    dst_shape = _dst_shapes(plan).get((slab.dst, slab.param))
    ext = [b - a for a, b in slab.box]
    if not ext:
        return [slab]
    for k in range(len(ext)):
        outer = int(np.prod(ext[:k])) if k else 1
        if slab.nbytes // outer < DIRECT_BYTES:
            break

        def sub(region_start, shape):
            region = tuple(slice(s, s + (1 if d < k else e))
                           for d, (s, e) in enumerate(zip(region_start, ext)))
            return shape is None or region_is_contiguous(shape, region)

        if sub(slab.dst_start, dst_shape) and (src_shape is None or sub(slab.src_start,
                                                                          src_shape)):
            if k == 0:
                return [slab]
            parts = []
            for idx in np.ndindex(*ext[:k]):
                idx = tuple(int(i) for i in idx)
                parts.append(slab._replace(
                    box=tuple((a + i, a + i + 1) for (a, _), i in zip(slab.box[:k], idx))
                    + tuple(slab.box[k:]),
                    src_start=tuple(s + i for s, i in zip(slab.src_start[:k], idx))
                    + tuple(slab.src_start[k:]),
                    dst_start=tuple(s + i for s, i in zip(slab.dst_start[:k], idx))
                    + tuple(slab.dst_start[k:]),
                    nbytes=slab.nbytes // outer))
            return parts
    return [slab]


#: A slab part smaller than this may share a message with its neighbours in
#: the worker's parameter (a *run*, :func:`_messages`); a larger one stays a
#: message of its own, sent zero-copy where it can be. 0 (the default): no
#: runs. Measured over gloo on 2 shared cores (docs/benchmarks.md, issue 20),
#: ``4 << 20`` cut a round's messages 2.2x (2,832 -> 1,296 at fsdp:8 -> tp=4)
#: but not its CPU time (the trainer's packing copies cost what the saved
#: messages did) and grew the trainer's staging pool (12 -> 30 MiB), so it is
#: off until a device run (``benchmarks/gpu_check.py``) shows it pays on NCCL.
RUN_PIECE_BYTES = 0


def _flat_range(plan: Plan, slab: Slab) -> tuple[str, int, int] | None:
    """``(param, first element, end element)`` of ``slab`` in its worker parameter, flattened.

    ``None`` where the region is not one contiguous run of the parameter's
    C-order elements (or the parameter's shape is not the slab's rank):
    :func:`_byte_range` counted in elements.
    """
    span = _byte_range(_dst_shapes(plan).get((slab.dst, slab.param)), slab.dst_region, 1)
    return None if span is None else (slab.param, *span)


def _messages(plan: Plan, items: list[tuple[int, Slab]]):
    """One pair's messages of one bucket: ``(packed [(wi, slab, offset)], packed bytes,
    messages [[(wi, slab), ...]])``.

    A slab of ``DIRECT_BYTES`` or more is cut into parts (:func:`_split_direct`);
    then, when ``RUN_PIECE_BYTES`` is set, every part or smaller slab whose
    region is contiguous in the worker's parameter and that is smaller than
    ``RUN_PIECE_BYTES`` is chained with the
    ones that continue it there (same parameter, same wire dtype, the next
    element on): a chain of two or more with ``DIRECT_BYTES`` or more in all is
    a *run*, one message in the parameter's order, received zero-copy into the
    parameter's contiguous bytes and packed with one copy per part on the
    trainer. A gate half and an up half of one expert's ``w13_weight`` rows,
    and the next expert's, are such neighbours in vLLM's fused parameter
    (``FusedMoE.weight_loader``, vLLM ``model_executor/layers/fused_moe/layer.py``)
    while the trainer's ``[E, 2I, H]`` shard holds them apart: one message per
    pair and bucket instead of two per expert. Every other part is a message
    of its own (a one-element list), every other small slab goes into the
    packed message. The packed message (when not empty) goes first, then the
    others in the order of their first part in ``link_slabs`` order: both
    sides build and number them alike.
    """
    parts: list[tuple[int, Slab]] = []
    for wi, slab in items:
        if slab.nbytes >= DIRECT_BYTES:
            parts.extend((wi, part) for part in _split_direct(plan, wi, slab))
        else:
            parts.append((wi, slab))
    # Chain the parts that continue one another in a worker parameter.
    keyed = []
    for i, (wi, slab) in enumerate(parts):
        if slab.nbytes < RUN_PIECE_BYTES:
            flat = _flat_range(plan, slab)
            if flat is not None:
                keyed.append((flat[0], flat[1], flat[2], plan.wires[wi].meta.dtype, i))
    keyed.sort(key=lambda k: (k[0], k[1], k[4]))
    run_of: dict[int, list[int]] = {}
    chain: list = []

    def close():
        if len(chain) > 1 and sum(parts[i][1].nbytes for *_, i in chain) >= DIRECT_BYTES:
            members = [i for *_, i in chain]
            run_of[min(members)] = members
            for i in members:
                run_of.setdefault(i, None)
    for key in keyed:
        if chain and (chain[-1][0], chain[-1][2], chain[-1][3]) == (key[0], key[1], key[3]):
            chain.append(key)
            continue
        close()
        chain = [key]
    close()
    packed, msgs, at = [], [], 0
    for i, (wi, slab) in enumerate(parts):
        if i in run_of:
            if run_of[i] is not None:
                msgs.append([parts[j] for j in run_of[i]])     # a run, in the parameter's order
        elif slab.nbytes >= DIRECT_BYTES:      # _split_direct keeps every part this large
            msgs.append([(wi, slab)])
        else:
            packed.append((wi, slab, at))
            at += slab.nbytes
    return packed, at, msgs


def _box_shape(slab: Slab) -> tuple[int, ...]:
    """The slab's shape: its box's extents (what ``t[slab.src_region]`` and
    ``t[slab.dst_region]`` of a tensor that holds the box have)."""
    return tuple(b - a for a, b in slab.box)


class _SendBucket(NamedTuple):
    """One trainer rank's bucket, prepared once per plan: see :func:`_send_layout`."""

    # wire index -> [(dst, src region, pool offset or -1 (direct), nbytes, tag, slab shape,
    # whether the row completes its packed message, (first, end) byte of a direct row in the
    # planned local tensor or None, the text naming its message in errors)], in packing order
    rows: dict
    packed: dict        # (dst, tag) -> (pool offset, bytes) of each message copied together
    packed_end: int     # pool bytes of the packed messages; bounce copies start here
    need: int           # pool bytes: packed messages + expected bounce copies (aligned)
    wires: tuple        # (first, end) wire indices of the bucket


class _RecvBucket(NamedTuple):
    """One worker's bucket, prepared once per plan: see :func:`_recv_layout`."""

    # (src, tag, nbytes, direct row or None, packed rows, run or None, span, what); a row is
    # (vLLM name, region in it, dtype, offset in the message, bytes, slab shape); a run is
    # (vLLM name, wire dtype, first element, end element, parameter shape); span is
    # (first, end) byte of a direct row or a run in its planned parameter, or None where
    # it is not contiguous there; what names the message in errors
    msgs: list
    need: int           # pool bytes of the packed messages (bounce copies come on top)
    offsets: tuple      # per message: its pool offset if packed (``packed`` rows), else -1
    expected: tuple     # names of the bucket's wire tensors that send to this worker


def _cached(plan: Plan, key, build):
    cache = plan.__dict__.setdefault("_m2nkit_p2p_layouts", {})
    if key not in cache:
        cache[key] = build()
    return cache[key]


def _send_layout(plan: Plan, schedule: BucketSchedule, rank: int) -> list[_SendBucket]:
    """Trainer ``rank``'s messages of every bucket, with their tags (cached on the plan).

    Tags number each (trainer, worker) pair's messages through the round:
    per bucket the packed message first, then each direct part or run
    (:func:`_messages`), as :func:`_recv_layout` numbers them on the worker.
    """
    def build():
        out, tags = [], {}
        for k in range(len(schedule)):
            rows: dict[int, list] = {}
            packed_msgs: dict[tuple[int, int], tuple] = {}
            need = 0
            for dst, items in sorted(link_slabs(plan, schedule.wires(k), src=rank).items()):
                packed, nbytes, msgs = _messages(plan, items)
                t = tags.get(dst, 0)
                if nbytes:
                    packed_msgs[(dst, t)] = (nbytes, len(packed))
                    need += _aligned(nbytes)
                    for wi, slab, at in packed:
                        rows.setdefault(wi, []).append((dst, slab.src_region, at, slab.nbytes, t,
                                                        _box_shape(slab)))
                    t += 1
                for msg in msgs:
                    if len(msg) == 1:
                        wi, slab = msg[0]
                        shape = plan.wires[wi].local_shape(rank)
                        if shape is None or not region_is_contiguous(shape, slab.src_region):
                            need += _aligned(slab.nbytes)   # expected to need a bounce copy
                        rows.setdefault(wi, []).append((dst, slab.src_region, -1, slab.nbytes, t,
                                                        _box_shape(slab)))
                    else:                                   # a run: its parts copied together
                        at = 0
                        for wi, slab in msg:
                            rows.setdefault(wi, []).append((dst, slab.src_region, at,
                                                            slab.nbytes, t, _box_shape(slab)))
                            at += slab.nbytes
                        packed_msgs[(dst, t)] = (at, len(msg))
                        need += _aligned(at)
                    t += 1
                tags[dst] = t
            # Packed messages first in the pool, in this order (bounce copies after them);
            # each row's offset made absolute, and the row that completes its message
            # marked, in the order _bucket_sends copies them (manifest, then packing).
            base, cursor = {}, 0
            for key, (nbytes, _) in packed_msgs.items():
                base[key] = cursor
                cursor += _aligned(nbytes)
            # A direct row also gets its byte range in the planned local tensor (where it is
            # contiguous there), and every message the text that names it in errors.
            left = {key: count for key, (_, count) in packed_msgs.items()}
            final = {}
            for wi in sorted(rows):
                final[wi] = []
                wp = plan.wires[wi]
                for dst, region, at, nbytes, t, shape in rows[wi]:
                    last, span = False, None
                    if at >= 0:
                        left[(dst, t)] -= 1
                        last = not left[(dst, t)]
                        at += base[(dst, t)]
                        what = (f"trainer rank {rank}: send of bucket {k} (packed, tag {t}) "
                                f"to worker {dst}")
                    else:
                        span = _byte_range(wp.local_shape(rank), region, wp.itemsize)
                        what = (f"trainer rank {rank}: send of bucket {k} ('{wp.name}') "
                                f"to worker {dst}")
                    final[wi].append((dst, region, at, nbytes, t, shape, last, span, what))
            out.append(_SendBucket(final, {key: (base[key], nbytes) for key, (nbytes, _)
                                           in packed_msgs.items()}, cursor, need,
                                   (schedule.bounds[k], schedule.bounds[k + 1])))
        return out

    return _cached(plan, ("send", rank, schedule.bounds), build)


def _recv_layout(plan: Plan, schedule: BucketSchedule, worker: int) -> list[_RecvBucket]:
    """Worker ``worker``'s messages of every bucket, with their tags (cached on the plan)."""
    def build():
        out, tags = [], {}
        for k in range(len(schedule)):
            msgs, need = [], 0
            for src, items in sorted(link_slabs(plan, schedule.wires(k), dst=worker).items()):
                packed, nbytes, direct = _messages(plan, items)
                t = tags.get(src, 0)
                what = (f"worker {worker} (rank {plan.num_trainer_ranks + worker}): receive of "
                        f"bucket {k} from trainer rank {src}")
                if nbytes:
                    rows = [(slab.param, slab.dst_region, plan.wires[wi].meta.dtype, at,
                             slab.nbytes, _box_shape(slab)) for wi, slab, at in packed]
                    msgs.append((src, t, nbytes, None, rows, None, None, what))
                    need += _aligned(nbytes)
                    t += 1
                for msg in direct:
                    wi, slab = msg[0]
                    dtype = plan.wires[wi].meta.dtype
                    shape = _dst_shapes(plan).get((worker, slab.param))
                    if len(msg) == 1:
                        span = _byte_range(shape, slab.dst_region, dtype.itemsize)
                        msgs.append((src, t, slab.nbytes,
                                     (slab.param, slab.dst_region, dtype, 0, slab.nbytes,
                                      _box_shape(slab)), None, None, span, what))
                    else:                  # a run: contiguous in the parameter, in its order
                        rows, at = [], 0
                        for wj, part in msg:
                            rows.append((part.param, part.dst_region, dtype, at, part.nbytes,
                                         _box_shape(part)))
                            at += part.nbytes
                        first, end = _flat_range(plan, slab)[1], _flat_range(plan, msg[-1][1])[2]
                        run = (slab.param, dtype, first, end, shape)
                        span = (first * dtype.itemsize, end * dtype.itemsize)
                        msgs.append((src, t, at, None, rows, run, span, what))
                    t += 1
                tags[src] = t
            offsets, cursor = [], 0
            for _, _, nbytes, direct, _, run, _, _ in msgs:
                packed_msg = direct is None and run is None
                offsets.append(cursor if packed_msg else -1)
                cursor += _aligned(nbytes) if packed_msg else 0
            expected = tuple(plan.wires[wi].name for wi in schedule.wires(k)
                             if plan.wires[wi].sends_to(worker))
            out.append(_RecvBucket(msgs, need, tuple(offsets), expected))
        return out

    return _cached(plan, ("recv", worker, schedule.bounds), build)


def message_count(plan: Plan, schedule: BucketSchedule) -> int:
    """Messages one round of ``plan`` puts on the wire over all (trainer, worker) pairs.

    Counted from the workers' receive layouts (what :func:`recv_round`
    posts; :func:`send_round` posts the same messages), so the benchmarks
    can set it beside the floor's one message per link.
    """
    return sum(len(b.msgs) for w in range(plan.num_workers)
               for b in _recv_layout(plan, schedule, w))


class RoundMessage(NamedTuple):
    """One message of a torch_p2p round: bucket ``bucket``, trainer rank ``src`` to
    worker ``worker`` (group rank ``T + worker``) with ``tag``, ``nbytes`` bytes."""

    bucket: int
    src: int
    worker: int
    tag: int
    nbytes: int


def round_messages(plan: Plan, schedule: BucketSchedule) -> list[RoundMessage]:
    """Every message one round of ``plan`` puts on the wire, in each worker's posting order.

    What :func:`recv_round` posts and :func:`send_round` sends (the same
    layouts), so a benchmark can replay the round's message pattern from
    pre-filled buffers (``engine/tools/baseline.py``, ``message_pattern_round``)
    and tell gloo's per-message cost apart from the transport's copies.
    """
    return [RoundMessage(k, src, w, tag, nbytes) for w in range(plan.num_workers)
            for k, b in enumerate(_recv_layout(plan, schedule, w))
            for src, tag, nbytes, *_ in b.msgs]


def _post(group, op: str, buf: torch.Tensor, peer: int, tag: int, what: str):
    try:
        return (group.send if op == "send" else group.recv)([buf], peer, tag)
    except RuntimeError as e:
        raise TransferError(f"{what} failed: {error_gist(e)}") from e


class _Send(NamedTuple):
    """One message a trainer rank posts: to worker ``dst`` with ``tag``, the bytes ``buf``."""

    dst: int
    tag: int
    buf: torch.Tensor   # 1-D uint8: a view of the local tensor (zero-copy) or of the pool
    keep: object        # what a zero-copy ``buf`` reads from: alive until the send is done
    what: str           # names the message in errors
    nbytes: int         # bytes the round's count adds for it


def _send_views(plan: Plan, bucket: _SendBucket, arena: torch.Tensor):
    """The pool views of ``bucket``'s packed messages: ``({(dst, tag): message bytes},
    {wire index: [typed view of each packed row, in row order]})``.

    Made once per pool bytes (``BufferPool.views``) and reused every round,
    so a round's packing is one ``torch._foreach_copy_`` per local tensor.
    """
    bufs = {key: arena[off:off + n] for key, (off, n) in bucket.packed.items()}
    rows = {}
    for wi, items in bucket.rows.items():
        dtype = plan.wires[wi].meta.dtype
        views = [arena[off:off + n].view(dtype).view(shape)
                 for _, _, off, n, _, shape, *_ in items if off >= 0]
        if views:
            rows[wi] = views
    return bufs, rows


def _bucket_sends(plan: Plan, bucket: _SendBucket, k: int, rank: int, it, arena: torch.Tensor,
                  deadline: Deadline | None, error: type[Exception] = TransferError,
                  views=None):
    """Trainer ``rank``'s messages of bucket ``k``, each yielded as soon as it is complete.

    Pulls the rank's local tensors of the bucket from ``it`` (its
    ``iter_local()``) one at a time, in manifest order; packs the small
    slabs into the pool bytes ``arena`` (``bucket.need`` of them; ``views``
    are :func:`_send_views` of it, made here when not given) with one
    ``torch._foreach_copy_`` per local tensor, and yields each direct slab
    from the local tensor itself where it is contiguous there. The one
    message layout both :func:`send_round` and :func:`exchange_in_process` post.
    """
    bufs, row_views = views if views is not None else _send_views(plan, bucket, arena)
    cursor = bucket.packed_end
    for wi in range(*bucket.wires):
        wp = plan.wires[wi]
        if not wp.meta.holds(rank):
            continue
        local = next_local(it, wp, rank, error=error)
        if deadline is not None and deadline.expired():
            raise TransferError(f"trainer rank {rank}: the source's local tensor of '{wp.name}' "
                                f"came after {deadline.describe()}; the round is over")
        rows = bucket.rows.get(wi, ())
        packs = row_views.get(wi)
        if packs:                                         # into packed messages or runs
            torch._foreach_copy_(packs, [local[row[1]] for row in rows if row[2] >= 0])
        flat = _flat_view(local, wp.local_shape(rank))    # None: odd strides or a wider shape
        for dst, region, at, nbytes, tag, _, last, span, what in rows:
            if at >= 0:
                if last:                                  # its message is complete
                    buf = bufs[(dst, tag)]
                    yield _Send(dst, tag, buf, None, what, buf.numel())
                continue
            if flat is not None and span is not None:
                yield _Send(dst, tag, flat[span[0]:span[1]], local, what, nbytes)  # zero-copy
                continue
            piece = local[region]
            if piece.is_contiguous():
                buf = _flat_bytes(piece)                  # zero-copy
            else:
                if cursor + nbytes <= arena.numel():
                    buf = arena[cursor:cursor + nbytes]
                    cursor += _aligned(nbytes)
                else:                                     # a local tensor with odd strides
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=arena.device)
                buf.view(wp.meta.dtype).view(piece.shape).copy_(piece)
            yield _Send(dst, tag, buf, piece, what, nbytes)
        del local


def send_round(group, plan: Plan, schedule: BucketSchedule, rank: int,
               stream: Iterable[tuple[str, torch.Tensor]], *, timeout_s: float | None = None,
               deadline: Deadline | None = None, device: torch.device | str = "cpu",
               pool: BufferPool | None = None) -> int:
    """Send this trainer rank's slabs of one round. Returns bytes sent.

    ``stream`` is the rank's ``iter_local()``: one ``(name, local tensor)``
    per owned wire tensor in manifest order; each provider runs once.
    Per bucket and worker: one packed message of the small slabs, and one
    message per slab of ``DIRECT_BYTES`` or more (cut where that makes it
    contiguous on both sides, :func:`_split_direct`), sent from the local
    tensor itself when its region is contiguous there (zero-copy), else
    from a bounce copy. Every message is in the wire dtype (the manifest's);
    a worker whose parameter has another dtype casts on its side
    (:func:`recv_round`). One bucket is in flight at a time: the next
    bucket's providers run only once this one's sends are done, so a rank
    holds at most one bucket of staged bytes plus the local tensors its
    zero-copy sends still read. ``pool`` (kept by the caller across rounds)
    holds the staged bytes; without one a fresh pool serves this round.

    Every send is waited for until ``deadline`` (the round's), else
    ``timeout_s`` seconds from the call; a provider that returns after the
    deadline ends the round here too.

    Raises:
        TransferError: a stream out of manifest order or of the wrong shape,
            a provider that returned after the deadline, or a send that
            failed or was not done by the deadline (names the worker and bucket).
    """
    deadline = Deadline.of(deadline, timeout_s)
    pool = pool if pool is not None else BufferPool(device)
    it = iter(stream)
    in_flight: list[tuple[object, str, object]] = []
    sent = 0
    T = plan.num_trainer_ranks
    for k, bucket in enumerate(_send_layout(plan, schedule, rank)):
        # One bucket in flight: this one's sends end before the next is staged.
        for work, what, _ in in_flight:
            wait_work(work, deadline, what)
        in_flight = []
        arena = pool.reserve(bucket.need)
        views = pool.views(bucket, lambda buf, b=bucket: _send_views(plan, b, buf))
        for msg in _bucket_sends(plan, bucket, k, rank, it, arena, deadline, views=views):
            in_flight.append((_post(group, "send", msg.buf, T + msg.dst, msg.tag, msg.what),
                              msg.what, msg.keep))
            sent += msg.nbytes
    for work, what, _ in in_flight:
        wait_work(work, deadline, what)
    leftover = next(it, None)
    if leftover is not None:
        raise TransferError(f"trainer rank {rank}: source yielded '{leftover[0]}' after the last "
                            "wire tensor of the manifest")
    return sent


class _Recv(NamedTuple):
    """One message a worker posts: from trainer rank ``src`` with ``tag``, into ``target``."""

    src: int
    tag: int
    target: torch.Tensor  # 1-D uint8: the parameter's own bytes (zero-copy) or pool bytes
    unpack: object        # None (landed already) or (target, rows, source views or None)
    nbytes: int           # the message's size: the slabs' bytes in the wire dtype
    what: str


def _recv_targets(plan: Plan, bucket: _RecvBucket, k: int, worker: int,
                  storage: Mapping[str, torch.Tensor], pool: BufferPool) -> list[_Recv]:
    """Where worker ``worker``'s messages of bucket ``k`` land.

    A direct message lands in its parameter's own bytes only when its
    region is contiguous there *and* the parameter has the wire dtype:
    messages carry the wire dtype (the sender's), so a parameter in another
    dtype (an fp32 wire into a bf16 worker) would take a different number
    of bytes than are sent. Every other message lands in pool bytes and is
    cast into its parameter by ``copy_`` (:func:`_unpack`): the cast
    ``param.data.copy_(loaded_weight)`` that vLLM's weight loaders apply
    (vLLM ``model_executor/layers/linear.py``, ``weight_loader``;
    ``model_loader/weight_utils.py``, ``default_weight_loader``).
    """
    shapes = _dst_shapes(plan)
    flats: dict[str, torch.Tensor | None] = {}   # vLLM name -> its flat bytes, if in wire dtype
    views = []
    need = bucket.need
    for src, tag, nbytes, direct, packed, run, span, _ in bucket.msgs:
        view = None
        if direct is not None or run is not None:
            name, dtype = (direct[0], direct[2]) if direct is not None else run[:2]
            param = storage[name]
            if param.dtype == dtype:
                if span is not None:
                    if name not in flats:
                        flats[name] = _flat_view(param, shapes.get((worker, name)))
                    flat = flats[name]
                    if flat is not None:
                        view = flat[span[0]:span[1]]
                if view is None and direct is not None:   # a parameter with other strides
                    view = param[direct[1]]
                    view = _flat_bytes(view) if view.is_contiguous() else None
            if view is None:
                need += _aligned(nbytes)
        views.append(view)
    arena = pool.reserve(need)
    packs = pool.views(bucket, lambda buf: _recv_views(bucket, buf))
    cursor = bucket.need                  # packed messages first, at their layout offsets
    out = []
    for i, ((src, tag, nbytes, direct, packed, run, _, what), view) in enumerate(
            zip(bucket.msgs, views)):
        if view is not None:
            out.append(_Recv(src, tag, view, None, nbytes, what))  # zero-copy
            continue
        if i in packs:
            target, sources = packs[i]
            out.append(_Recv(src, tag, target, (target, packed, sources), nbytes, what))
            continue
        target = arena[cursor:cursor + nbytes]   # a bounce copy of a direct part or a run
        cursor += _aligned(nbytes)
        out.append(_Recv(src, tag, target, (target, packed if direct is None else [direct], None),
                         nbytes, what))
    return out


def _recv_views(bucket: _RecvBucket, arena: torch.Tensor) -> dict[int, tuple]:
    """``{message index: (its pool bytes, [typed view of each row])}`` of ``bucket``'s packed
    messages, made once per pool bytes (``BufferPool.views``) and reused every round."""
    out = {}
    for i, ((_, _, nbytes, _, rows, *_), off) in enumerate(zip(bucket.msgs, bucket.offsets)):
        if off >= 0:
            target = arena[off:off + nbytes]
            out[i] = (target, [target[at:at + n].view(dtype).view(shape)
                               for _, _, dtype, at, n, shape in rows])
    return out


def _unpack(storage: Mapping[str, torch.Tensor], unpack) -> None:
    """Copy a received message's slabs into their parameters (casting to the parameter's dtype).

    One ``torch._foreach_copy_`` per message: per slab ``param[region].copy_(slab)``, the
    cast vLLM's loaders apply. ``sources`` are the rows' typed views of ``buf`` when
    :func:`_recv_views` made them already.
    """
    buf, rows, sources = unpack
    if sources is None:
        sources = [buf[at:at + n].view(dtype).view(shape) for _, _, dtype, at, n, shape in rows]
    torch._foreach_copy_([storage[row[0]][row[1]] for row in rows], sources)


def _post_receives(group, plan: Plan, bucket: _RecvBucket, k: int, worker: int,
                   storage: Mapping[str, torch.Tensor], pool: BufferPool):
    """Post worker ``worker``'s receives of bucket ``k``: ``[(work, what, unpack, nbytes)]``.

    ``unpack`` is ``None`` for a message received straight into its
    parameter, else ``(buffer, rows)`` (:class:`_RecvBucket`) to copy out once it
    arrived. A module function, not a closure over ``group``: a failed
    round's traceback holds this frame, and ``traceback.clear_frames`` can
    drop a frame's locals but not the cells of a closure, which would keep
    the group (and its sockets) alive.
    """
    return [(_post(group, "recv", r.target, r.src, r.tag, r.what), r.what, r.unpack, r.nbytes)
            for r in _recv_targets(plan, bucket, k, worker, storage, pool)]


def recv_round(group, plan: Plan, schedule: BucketSchedule, worker: int,
               storage: Mapping[str, torch.Tensor], *, timeout_s: float | None = None,
               deadline: Deadline | None = None, device: torch.device | str = "cpu",
               pool: BufferPool | None = None) -> tuple[set[str], int]:
    """Receive this worker's slabs of one round straight into ``storage``.

    ``storage`` maps vLLM names to the tensors written: the live
    parameters (in-place) or a staging copy. A slab of ``DIRECT_BYTES`` or
    more whose region is contiguous in its parameter, and whose parameter
    has the wire dtype, is received into the parameter itself (zero-copy);
    the others land in ``pool``'s bytes and are copied out, cast to the
    parameter's dtype as vLLM's loaders cast (:func:`_recv_targets`). One
    bucket is posted at a time, so the staged bytes are at most one
    bucket's; ``pool`` (kept by the caller across rounds) is reused, a
    fresh one serves this round without it. A ``storage`` with a
    ``wires_received(names)`` method is told, after each bucket, the wire
    tensors of it that landed whole (a reload makes their layers live then:
    ``engine/receiver.py``, ``ReloadTarget``).

    Returns ``(names of wire tensors fully received, bytes received)``.
    Every receive is waited for until ``deadline`` (the round's), else
    ``timeout_s`` seconds from the call. On failure raises
    ``TransferError`` (naming the trainer rank and bucket) whose
    ``received`` attribute lists the wire tensors that did arrive whole and
    ``missing`` the others; the bucket's other receives stay posted, so the
    caller aborts the group.
    """
    deadline = Deadline.of(deadline, timeout_s)
    pool = pool if pool is not None else BufferPool(device)
    notify = getattr(storage, "wires_received", None)
    layout = _recv_layout(plan, schedule, worker)
    expected = {name for bucket in layout for name in bucket.expected}
    done: set[str] = set()
    got = 0
    try:
        for k, bucket in enumerate(layout):
            posted = _post_receives(group, plan, bucket, k, worker, storage, pool)
            for work, what, unpack, nbytes in posted:
                wait_work(work, deadline, what)
                got += nbytes
                if unpack is not None:
                    _unpack(storage, unpack)
            del posted
            whole = list(bucket.expected)
            done.update(whole)
            if whole and notify is not None:
                notify(whole)
    except TransferError as e:
        e.received = sorted(done)
        e.missing = sorted(expected - done)
        raise
    return done, got


def exchange_in_process(plan: Plan, streams: Mapping[int, Iterable[tuple[str, torch.Tensor]]],
                        storage: Mapping[int, Mapping[str, torch.Tensor]], *,
                        schedule: BucketSchedule | None = None,
                        error: type[Exception] = ValueError) -> int:
    """Run one round of ``plan`` inside this process through torch_p2p's own messages.

    Every trainer rank's messages are built exactly as :func:`send_round`
    builds them and every worker's receives exactly as :func:`recv_round`
    posts them (same buckets, packing, direct cuts, zero-copy targets and
    casts), bucket by bucket; each receive takes the message of its
    ``(trainer rank, worker, tag)`` with a plain byte copy instead of a
    process group. So ``m2nkit plan --verify`` runs the receive path the
    transport runs, and a message whose sizes disagree between its two
    sides (which gloo aborts on: "Received data size doesn't match expected
    size") fails here too.

    Args:
        plan: the plan.
        streams: trainer rank -> its ``iter_local()`` stream (manifest order).
        storage: worker -> ``{vLLM name: tensor}`` written in place.
        schedule: buckets (default ``BucketSchedule.build(plan)``).
        error: raised for a stream out of manifest order, of the wrong
            shape or dtype, or that yields more than the manifest.

    Returns:
        Bytes received by all workers.

    Raises:
        ``error``: as above (names the rank and the tensor).
        TransferError: a message whose two sides disagree on its size or
            that one side never posts (an m2nkit bug; names both ends).
    """
    schedule = schedule if schedule is not None else BucketSchedule.build(plan)
    T = plan.num_trainer_ranks
    its = {}
    for r in range(T):
        if r in streams:
            its[r] = iter(streams[r])
    pools = {r: BufferPool() for r in range(T)}
    recv_pools = {w: BufferPool() for w in range(plan.num_workers)}
    send_layouts = {r: _send_layout(plan, schedule, r) for r in range(T)}
    recv_layouts = {w: _recv_layout(plan, schedule, w) for w in range(plan.num_workers)}
    got = 0
    for k in range(len(schedule)):
        sent: dict[tuple[int, int, int], _Send] = {}
        for r in range(T):
            bucket = send_layouts[r][k]
            owned = [plan.wires[wi].name for wi in schedule.wires(k)
                     if plan.wires[wi].meta.holds(r)]
            if not owned:
                continue
            if r not in its:
                raise error(f"no local stream for trainer rank {r}, an owner of '{owned[0]}'")
            arena = pools[r].reserve(bucket.need)
            views = pools[r].views(bucket, lambda buf, b=bucket: _send_views(plan, b, buf))
            for msg in _bucket_sends(plan, bucket, k, r, its[r], arena, None, error, views):
                sent[(r, msg.dst, msg.tag)] = msg
        for w in range(plan.num_workers):
            if w not in storage:
                continue
            for rv in _recv_targets(plan, recv_layouts[w][k], k, w, storage[w], recv_pools[w]):
                msg = sent.pop((rv.src, w, rv.tag), None)
                if msg is None or msg.buf.numel() != rv.target.numel():
                    size = "nothing" if msg is None else f"{msg.buf.numel()} bytes"
                    raise TransferError(f"{rv.what} (tag {rv.tag}) expects "
                                        f"{rv.target.numel()} bytes; the trainer sends {size}")
                rv.target.copy_(msg.buf)
                got += rv.nbytes
                if rv.unpack is not None:
                    _unpack(storage[w], rv.unpack)
        stray = [key for key in sent if key[1] in storage]
        if stray:
            r, w, tag = stray[0]
            raise TransferError(f"trainer rank {r}: send of bucket {k} to worker {w} (tag {tag}) "
                                "has no matching receive")
    for r, it in its.items():
        extra = next(it, None)
        if extra is not None:
            raise error(f"trainer rank {r} yielded '{extra[0]}' after the last tensor of "
                        "the manifest")
    return got


@dataclass(frozen=True)
class P2PReport:
    """What one ``TorchP2PTransport`` round did on this rank: ``nbytes`` sent or received."""

    nbytes: int


class TorchP2PTransport:
    """The ``torch_p2p`` ``Transport`` (``m2nkit.engine.transports.base``) of one rank.

    Runs :func:`send_round` / :func:`recv_round` over ``group`` with the
    plan's buckets (``BucketSchedule.of(plan, bucket_bytes)``). With
    ``keep_buffers`` (what :meth:`connect` gives) the staged bytes come from
    one ``BufferPool`` kept across rounds, so after the first round no
    bucket allocates; without, each round stages in fresh bytes (what
    ``NcclM2NTransport`` uses for its point-to-point segments).

    Args:
        group: the session's process group (``control.create_group``).
        rank: this rank in the group.
        device: where staging buffers live (``"cpu"`` for gloo, ``cuda:i``
            for nccl).
        timeout_s: seconds a round may take when ``send_round`` /
            ``recv_round`` get no ``deadline``.
        bucket_bytes: ``BucketSchedule`` bucket size (bytes).
        keep_buffers: keep the staged bytes across rounds (until :meth:`close`).
    """

    name: ClassVar[str] = "torch_p2p"
    #: No rules: it carries any wire tensor (the planner records no verdict for it).
    can_carry: ClassVar[None] = None

    def __init__(self, group: Any, *, rank: int, device: torch.device | str = "cpu",
                 timeout_s: float, bucket_bytes: int = 64 << 20,
                 keep_buffers: bool = True) -> None:
        self.group = group
        self.rank = rank
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._pool = BufferPool(self.device) if keep_buffers else None

    @staticmethod
    def why_unavailable() -> str | None:
        """Always ``None``: gloo runs on any machine."""
        return None

    @staticmethod
    def check_source(source: Any, rank: int) -> None:
        """Accepts every source: a source's own collectives interleave with point-to-point sends."""

    @classmethod
    def connect(cls, store: Any, group: Any, rank: int, world_size: int, *,
                device: torch.device | str, timeout_s: float,
                bucket_bytes: int = 64 << 20) -> "TorchP2PTransport":
        """This rank's transport over ``group``; nothing to set up (not collective)."""
        return cls(group, rank=rank, device=device, timeout_s=timeout_s,
                   bucket_bytes=bucket_bytes)

    def schedule(self, plan: Plan) -> BucketSchedule:
        """The buckets of ``plan`` at this transport's ``bucket_bytes`` (cached on the plan)."""
        return BucketSchedule.of(plan, self.bucket_bytes)

    def send_round(self, plan: Plan, rank: int, stream: Iterable[tuple[str, torch.Tensor]], *,
                   deadline: Deadline | None = None) -> P2PReport:
        """:func:`send_round` of trainer ``rank`` over this transport's group."""
        return P2PReport(send_round(self.group, plan, self.schedule(plan), rank, stream,
                                    timeout_s=self.timeout_s, deadline=deadline,
                                    device=self.device, pool=self._pool))

    def recv_round(self, plan: Plan, worker: int, storage: Mapping[str, torch.Tensor], *,
                   deadline: Deadline | None = None) -> tuple[set[str], P2PReport]:
        """:func:`recv_round` of ``worker`` over this transport's group."""
        done, got = recv_round(self.group, plan, self.schedule(plan), worker, storage,
                               timeout_s=self.timeout_s, deadline=deadline, device=self.device,
                               pool=self._pool)
        return done, P2PReport(got)

    def close(self) -> None:
        """Drop the kept staging bytes; the group is the caller's (``control.release_group``)."""
        if self._pool is not None:
            self._pool.release()
