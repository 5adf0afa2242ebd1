"""``nccl_m2n``: one ``nccl.m2n.reshard`` per wire tensor that it can carry.

NVIDIA's ``nccl.m2n`` (nccl-extensions, ``nccl_m2n/README.md``) moves a
global tensor between two disjoint groups of GPU ranks of one NCCL
communicator in a single call, from the source layout straight into the
destination layout, with no host involvement. This transport issues one such
call per wire tensor its own rules accept (``can_carry``, the planner's
``TRANSPORT_RULES`` entry: contiguous rank intervals, at most a 2-D mesh,
one sharded dim per side, even division, 1-D to 3-D, one piece per rank, a
contiguous destination region, the fan limits) and sends every other wire
tensor through ``torch_p2p`` over the same ranks, so any plan runs whole;
nothing is ever gathered on the trainer.

Ranks follow vLLM's ``m2n_common.py``: trainer ranks ``[0, T)``, workers
``[T, T+N)``, one nccl4py communicator over all of them, bootstrapped through
the ``TCPStore`` of the ``torch_p2p`` group.

Ordering is what keeps this deadlock-free. The manifest is cut into
*segments*: maximal runs of consecutive wire tensors with the same carrier.
Every rank walks the same segments in the same order: an ``nccl_m2n``
segment issues its reshards in manifest order on every rank of the
communicator (ranks outside a side pass ``None`` for it, as nccl.m2n
requires); a ``torch_p2p`` segment runs ``torch_p2p.send_round`` /
``recv_round`` on a sub-plan of just that segment and completes before the
next segment starts. A trainer's providers are still called once per owned
wire tensor, in manifest order.

Timeouts: every wait for GPU completion of a reshard (and the end-of-round
fence) polls a CUDA event against ``timeout_s`` and, on expiry or on an
asynchronous NCCL error, aborts the communicator and raises
``TransferError``. Not covered: a host-blocking step inside
``ncclReshard`` itself (its first call per communicator sets up a staging
pool and may wait for peers) and ``ncclCommInitRank``; ``torch_p2p``
segments keep ``torch_p2p``'s own timeouts. See docs/nccl_m2n.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from m2nkit.engine.plan import Plan, SlabTable, Verdict, WirePlan, next_local
from m2nkit.engine.transports import torch_p2p
from m2nkit.engine.transports.torch_p2p import BucketSchedule, TransferError
from m2nkit.manifest.destination import DestinationParam
from m2nkit.manifest.pieces import Box, box_slices, full_box

__all__ = [
    "M2N_DTYPES",
    "M2N_MAX_FAN_IN",
    "M2N_MAX_FAN_OUT",
    "M2NEncoding",
    "M2NRoute",
    "m2n_encoding",
    "region_is_contiguous",
    "can_carry",
    "INSTALL_HINT",
    "CARRIER_M2N",
    "CARRIER_P2P",
    "CARRIER_NONE",
    "NcclM2NUnavailableError",
    "import_nccl_m2n",
    "wire_carrier",
    "Segment",
    "plan_segments",
    "sub_plan",
    "M2NCall",
    "m2n_descriptors",
    "m2n_local_box",
    "destination_view",
    "Resharder",
    "NcclResharder",
    "RoundReport",
    "NcclM2NTransport",
]

#: What to install when ``nccl.m2n`` or nccl4py does not import.
INSTALL_HINT = "install m2nkit[nccl] (nccl4py, nccl-extensions, cuda-bindings)"

CARRIER_M2N = "nccl_m2n"
CARRIER_P2P = "torch_p2p"
#: A wire tensor that moves no bytes (skipped by vLLM): no transport carries it.
CARRIER_NONE = "none"


class NcclM2NUnavailableError(ImportError):
    """``nccl.m2n`` or nccl4py does not import in this environment."""


def import_nccl_m2n() -> tuple[Any, Any]:
    """Import ``nccl.m2n`` and nccl4py's ``nccl.core``, only when needed.

    Importing them does not need a GPU; creating a handle or a communicator
    does (``libnccl.so.2`` and the NVIDIA driver).

    Returns:
        ``(nccl.m2n, nccl.core)``.

    Raises:
        NcclM2NUnavailableError: either does not import; the message says
            what to install.
    """
    try:
        m2n = importlib.import_module("nccl.m2n")
        core = importlib.import_module("nccl.core")
    except ImportError as e:
        raise NcclM2NUnavailableError(
            f"the nccl_m2n transport needs nccl.m2n and nccl4py, which do not import here "
            f"({e}); {INSTALL_HINT}") from e
    return m2n, core


# --------------------------------------------------------------------------
# rules: can nccl.m2n carry a wire tensor, and if not, why

#: dtypes nccl.m2n can move (vLLM ``m2n_common.py``, mirrored from nccl_m2n).
M2N_DTYPES = frozenset({
    torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16,
    torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.int64,
    torch.uint64, torch.float64,
})
#: At most this many source shards may feed one destination shard (vLLM ``m2n_common.py``).
M2N_MAX_FAN_IN = 16
#: At most this many destination shards may be fed by one source shard.
M2N_MAX_FAN_OUT = 64


@dataclass(frozen=True)
class M2NEncoding:
    """One side of an ``nccl.m2n.reshard`` call.

    ``mesh_dims`` is 2-D ``(outer, inner)``; ``start_rank`` is the first rank
    of the contiguous interval (relative to the side); ``placements`` holds an
    m2n code per axis: ``-1`` = replicate, ``k >= 0`` = shards tensor dim k
    (vLLM ``m2n_common.py``). A fully replicated tensor uses the size-1-axis
    encoding ``(n, 1)`` with ``(-1, 0)``: m2n cannot express two replicate
    axes.
    """

    mesh_dims: tuple[int, int]
    start_rank: int
    placements: tuple[int, int]


@dataclass(frozen=True)
class M2NRoute:
    """The ``Verdict.detail`` of a wire tensor nccl.m2n carries: both sides' encodings."""

    src: M2NEncoding
    dst: M2NEncoding


def m2n_encoding(boxes: Sequence[tuple[int, Box]], shape: Sequence[int]) -> M2NEncoding | str:
    """Encode ``(rank, box)`` pairs as an m2n mesh, or say why it cannot be.

    Rules (nccl-extensions ``nccl_m2n/README.md`` preconditions): ranks form
    a contiguous interval; every box is the full tensor except along at most
    one dim; along that dim the distinct boxes split it evenly into ``k``
    chunks; the chunk index follows either the inner or the outer axis of a
    2-D mesh over the ranks (the other axis replicates).

    Returns:
        An ``M2NEncoding``, or a one-line reason string.
    """
    ranks = sorted(r for r, _ in boxes)
    if not ranks:
        return "no ranks hold it"
    box_of = dict(boxes)
    if len(box_of) != len(boxes):  # before the interval test, which duplicates also fail
        return "a rank holds two separate boxes"
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''} are not a contiguous interval"
    n = len(ranks)
    full = full_box(shape)
    varying = {d for _, b in boxes for d in range(len(shape)) if b[d] != full[d]}
    if not varying:
        return M2NEncoding((n, 1), ranks[0], (-1, 0))
    if len(varying) > 1:
        return f"sharded along more than one dim {sorted(varying)}"
    d = varying.pop()
    chunks = sorted({box_of[r][d] for r in ranks})
    k = len(chunks)
    size = shape[d] // k
    if shape[d] % k or any(iv != (i * size, (i + 1) * size) for i, iv in enumerate(chunks)):
        lengths = sorted({b - a for a, b in (box_of[r][d] for r in ranks)})
        empty = sum(1 for r in ranks if box_of[r][d][0] == box_of[r][d][1])
        return (f"dim {d} of size {shape[d]} is not split evenly over {n} ranks "
                f"(chunk lengths {lengths}" + (f", {empty} ranks hold nothing)" if empty else ")"))
    pos = {iv: i for i, iv in enumerate(chunks)}
    idx = [pos[box_of[r][d]] for r in ranks]
    if n % k:
        return f"{n} ranks do not form a mesh with a {k}-way sharded axis"
    rep = n // k
    if idx == [i % k for i in range(n)]:
        return M2NEncoding((rep, k), ranks[0], (-1, d))
    if idx == [i // rep for i in range(n)]:
        return M2NEncoding((k, rep), ranks[0], (d, -1))
    return f"chunk order over ranks {idx[:8]} is not a row-major 2-D mesh"


def region_is_contiguous(shape: Sequence[int], box: Box) -> bool:
    """True when ``box`` of a row-major tensor of ``shape`` is one memory run.

    Leading dims of extent 1 are free; the first dim of larger extent may be
    a sub-range; every dim after it must be whole.
    """
    ext = [b - a for a, b in box]
    if any(e == 0 for e in ext):
        return True
    i = 0
    while i < len(ext) and ext[i] == 1:
        i += 1
    return all(ext[j] == shape[j] for j in range(i + 1, len(ext)))


@functools.lru_cache(maxsize=4096)
def _source_side(pieces: tuple, shape: tuple[int, ...]) -> tuple[M2NEncoding | str, np.ndarray]:
    """The source encoding of ``pieces`` (or why not, prefixed ``source:``) and each
    piece's shard index (replicas of one box share it). Cached: layouts repeat."""
    per_rank: dict[int, int] = {}
    for p in pieces:
        per_rank[p.rank] = per_rank.get(p.rank, 0) + 1
    boxes: dict = {}
    shard_of = np.array([boxes.setdefault(p.box, len(boxes)) for p in pieces], dtype=np.int64)
    split = next(((r, n) for r, n in per_rank.items() if n > 1), None)
    if split:
        return (f"source: trainer rank {split[0]} holds {split[1]} separate boxes of it "
                "(nccl.m2n takes one buffer per rank)"), shard_of
    if any(any(p.local_start) for p in pieces):
        return ("source: a trainer rank holds its piece inside a larger local tensor "
                "(nccl.m2n takes the local tensor as it is)"), shard_of
    src = m2n_encoding([(p.rank, p.box) for p in pieces], shape)
    return (f"source: {src}" if isinstance(src, str) else src), shard_of


def can_carry(wp: WirePlan, params: Mapping[tuple[int, str], DestinationParam]) -> Verdict:
    """Can one ``nccl.m2n.reshard`` carry wire tensor ``wp``? A ``Verdict``.

    ``ok`` with an ``M2NRoute`` (both encodings, ranks relative to each
    side) when every precondition holds; otherwise the first that fails:

    * the worker parameters are in the wire dtype (nccl.m2n cannot cast) and
      the dtype is one nccl.m2n moves; 1-D to 3-D;
    * each trainer rank holds one piece, at the start of its local tensor
      (``nccl_m2n/README.md``: one local buffer per rank, its local shape);
    * the pieces and the workers' boxes each form an m2n mesh
      (``m2n_encoding``); each worker takes one region, contiguous in its
      parameter;
    * at most ``M2N_MAX_FAN_IN`` source shards per destination shard and
      ``M2N_MAX_FAN_OUT`` destination shards per source shard, counted per
      shard (replicas are one shard), so the verdict follows the layouts,
      not the replica choice (vLLM ``m2n_common.py``).

    ``params`` maps ``(worker, param name)`` to its ``DestinationParam``.
    The planner calls this for every wire tensor (``TRANSPORT_RULES``).
    """
    meta = wp.meta
    if not wp.bindings:
        return Verdict(False, "skipped" if wp.skipped else "no destination")
    cast = {params[(b.worker, b.param)].dtype for b in wp.bindings} - {meta.dtype}
    if cast:
        return Verdict(False, f"wire dtype {str(meta.dtype).removeprefix('torch.')} is cast to "
                              f"vLLM's {str(cast.pop()).removeprefix('torch.')} on arrival "
                              "(nccl.m2n moves bytes as they are)")
    if meta.dtype not in M2N_DTYPES:
        return Verdict(False, f"dtype {meta.dtype} is not an nccl.m2n dtype")
    if not 1 <= len(meta.shape) <= 3:
        return Verdict(False, f"{len(meta.shape)}-D tensor (nccl.m2n moves 1-D to 3-D)")
    src, shard_of = _source_side(wp.pieces, tuple(meta.shape))
    if isinstance(src, str):
        return Verdict(False, src)
    per_worker: dict[int, list] = {}
    for b in wp.bindings:
        per_worker.setdefault(b.worker, []).append(b)
    for w, bs in per_worker.items():
        if len(bs) > 1:
            return Verdict(False, f"worker {w} takes {len(bs)} separate pieces of it "
                                  f"(fused halves into {bs[0].param})")
        b = bs[0]
        if not region_is_contiguous(params[(w, b.param)].shape, b.region):
            return Verdict(False, f"its region in worker {w}'s {b.param} is not contiguous")
    dst = m2n_encoding([(w, bs[0].box) for w, bs in per_worker.items()], meta.shape)
    if isinstance(dst, str):
        return Verdict(False, f"destination: {dst}")
    if len(wp.table):
        shards = shard_of[wp.table[:, SlabTable.PIECE]]
        linked = np.zeros((int(shard_of.max()) + 1, int(wp.table[:, SlabTable.DST].max()) + 1),
                          dtype=bool)
        linked[shards, wp.table[:, SlabTable.DST]] = True
        fan_in = int(linked.sum(axis=0).max())
        fan_out = int(linked.sum(axis=1).max())
        if fan_in > M2N_MAX_FAN_IN:
            return Verdict(False, f"{fan_in} source shards feed one destination shard "
                                  f"(nccl.m2n allows {M2N_MAX_FAN_IN})")
        if fan_out > M2N_MAX_FAN_OUT:
            return Verdict(False, f"one source shard feeds {fan_out} destination shards "
                                  f"(nccl.m2n allows {M2N_MAX_FAN_OUT})")
    return Verdict(True, "", M2NRoute(src, dst))


# --------------------------------------------------------------------------
# routing: which transport carries which wire tensor


def wire_carrier(wp: WirePlan) -> str:
    """``CARRIER_M2N`` when the plan's verdict is ok, ``CARRIER_NONE`` when the
    wire tensor moves nothing (skipped), else ``CARRIER_P2P``."""
    if not len(wp.table):
        return CARRIER_NONE
    return CARRIER_M2N if wp.verdict(CARRIER_M2N).ok else CARRIER_P2P


@dataclass(frozen=True)
class Segment:
    """A run of consecutive wire tensors (indices into ``plan.wires``) with one carrier.

    Wire tensors that move nothing join the segment they fall in (or the
    first one), so they never split a run.
    """

    carrier: str
    wires: tuple[int, ...]


def plan_segments(plan: Plan) -> list[Segment]:
    """Cut ``plan.wires`` into segments; every rank derives the same list.

    Every wire index appears exactly once, in manifest order. A plan that
    moves nothing is one ``torch_p2p`` segment (which still walks the
    trainer's providers).
    """
    segments: list[tuple[str, list[int]]] = []
    leading: list[int] = []
    for wi, wp in enumerate(plan.wires):
        c = wire_carrier(wp)
        if c == CARRIER_NONE:
            (segments[-1][1] if segments else leading).append(wi)
        elif segments and segments[-1][0] == c:
            segments[-1][1].append(wi)
        else:
            segments.append((c, leading + [wi]))
            leading = []
    if leading:
        segments.append((CARRIER_P2P, leading))
    return [Segment(c, tuple(w)) for c, w in segments]


def sub_plan(plan: Plan, wires: Sequence[int]) -> Plan:
    """The plan restricted to ``plan.wires[i] for i in wires`` (for ``torch_p2p``).

    Byte accounting is recomputed for the subset; ``problems`` is empty
    (the whole plan is checked before a round starts). Its ``digest()``
    differs from the whole plan's: sub-plans drive one segment, they are
    never agreed on.
    """
    ws = [plan.wires[i] for i in wires]
    T, N = plan.num_trainer_ranks, plan.num_workers
    link = np.zeros((T, N), dtype=np.int64)
    for w in ws:
        if len(w.table):
            np.add.at(link, (w.table[:, SlabTable.SRC], w.table[:, SlabTable.DST]), w.slab_nbytes())
    nz = np.nonzero(link)
    return dataclasses.replace(
        plan, wires=ws, problems=[], send_bytes=link.sum(axis=1), recv_bytes=link.sum(axis=0),
        link_bytes={(int(s), int(d)): int(link[s, d]) for s, d in zip(*nz)})


# --------------------------------------------------------------------------
# descriptors


def m2n_local_box(mesh_dims: Sequence[int], codes: Sequence[int], shape: Sequence[int],
                  index: int) -> Box:
    """The global box the rank at row-major position ``index`` of an m2n mesh holds.

    ``codes`` are nccl.m2n placement integers per mesh axis (``-1``
    replicate, ``k >= 0`` shards tensor dim ``k``); a sharded axis of size
    ``s`` gives rank coordinate ``c`` the ``c``-th of ``s`` equal chunks
    (nccl-extensions ``nccl_m2n/README.md``: "Each localShape[shard_dim] ×
    shard count divides cleanly into the global tensor dim").
    """
    coord = (index // mesh_dims[1], index % mesh_dims[1])
    box = [[0, n] for n in shape]
    for axis, code in enumerate(codes):
        if code >= 0:
            lo, hi = box[code]
            size = (hi - lo) // mesh_dims[axis]
            box[code] = [lo + coord[axis] * size, lo + (coord[axis] + 1) * size]
    return tuple((a, b) for a, b in box)


@dataclass(frozen=True)
class M2NCall:
    """Everything one ``nccl.m2n.reshard`` of a wire tensor needs but the buffers.

    Attributes:
        name: the wire tensor's name; ``index``: its position in the plan.
        dtype, shape: the wire tensor (global shape).
        src_mesh, dst_mesh: real ``nccl.m2n.Mesh`` objects over absolute
            communicator ranks: trainer side from ``src.start_rank``, worker
            side from ``T + dst.start_rank``. 2-D ``(outer, inner)``.
        src_placements, dst_placements: one ``nccl.m2n.Shard(d)`` /
            ``Replicate()`` per mesh axis, from the plan's codes. A fully
            replicated side is the size-1-axis encoding: mesh ``(n, 1)``,
            ``(Replicate(), Shard(0))``.
        src_local_shape, dst_local_shape: each participating rank's buffer
            shape (elements); every rank passes them, in or out of a side.
        codes: ``(src codes, dst codes)`` as the plan's ``M2NEncoding`` has them.
    """

    name: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    src_mesh: Any
    src_placements: tuple[Any, ...]
    src_local_shape: tuple[int, ...]
    dst_mesh: Any
    dst_placements: tuple[Any, ...]
    dst_local_shape: tuple[int, ...]
    codes: tuple[tuple[int, int], tuple[int, int]]

    @property
    def src_ranks(self) -> range:
        """Absolute communicator ranks of the trainer side."""
        return range(self.src_mesh.start_rank, self.src_mesh.start_rank + math.prod(self.src_mesh.dims))

    @property
    def dst_ranks(self) -> range:
        """Absolute communicator ranks of the worker side."""
        return range(self.dst_mesh.start_rank, self.dst_mesh.start_rank + math.prod(self.dst_mesh.dims))

    def src_box(self, rank: int) -> Box:
        """Global box trainer ``rank`` (absolute) passes, by nccl.m2n's rules."""
        return m2n_local_box(self.src_mesh.dims, self.codes[0], self.shape,
                             rank - self.src_mesh.start_rank)

    def dst_box(self, rank: int) -> Box:
        """Global box worker rank ``rank`` (absolute, ``T + worker``) receives."""
        return m2n_local_box(self.dst_mesh.dims, self.codes[1], self.shape,
                             rank - self.dst_mesh.start_rank)


def _local_shape(shape: Sequence[int], dims: Sequence[int], codes: Sequence[int],
                 wire: str, side: str) -> tuple[int, ...]:
    out = list(shape)
    for axis, code in enumerate(codes):
        if code >= 0:
            if out[code] % dims[axis]:
                raise ValueError(f"wire tensor '{wire}': {side} dim {code} of size {shape[code]} "
                                 f"does not split evenly over mesh axis {axis} of size {dims[axis]}")
            out[code] //= dims[axis]
    return tuple(out)


def m2n_descriptors(plan: Plan, wire_index: int, *, m2n: Any = None) -> M2NCall:
    """Turn one wire tensor's verdict encodings into real ``nccl.m2n`` descriptors.

    ``M2NEncoding`` ranks are relative to their side; the trainer side
    starts at communicator rank ``src.start_rank`` and the worker side at
    ``T + dst.start_rank`` (vLLM ``m2n_common.py`` numbering). The result is
    checked against the plan: every trainer rank's box under nccl.m2n's
    rules must be the box the plan says it holds, and every worker's the box
    its binding takes, so a descriptor can never move a byte the plan would
    not.

    Args:
        plan: a plan from ``build_plan``.
        wire_index: index into ``plan.wires``.
        m2n: the ``nccl.m2n`` module (default: imported lazily).

    Raises:
        ValueError: the plan does not mark the wire tensor ``m2n.ok`` (the
            message gives the verdict's reason), or the encodings disagree
            with the plan's boxes (an internal inconsistency).
        NcclM2NUnavailableError: ``nccl.m2n`` does not import.
    """
    if m2n is None:
        m2n, _ = import_nccl_m2n()
    wp = plan.wires[wire_index]
    verdict = wp.verdict(CARRIER_M2N)
    if not verdict.ok:
        raise ValueError(f"wire tensor '{wp.name}' cannot go through nccl.m2n: "
                         f"{verdict.reason or 'not planned'}")
    src, dst = verdict.detail.src, verdict.detail.dst
    T, N = plan.num_trainer_ranks, plan.num_workers
    shape = tuple(wp.meta.shape)
    for side, enc, limit in (("source", src, T), ("destination", dst, N)):
        if enc.start_rank < 0 or enc.start_rank + math.prod(enc.mesh_dims) > limit:
            raise ValueError(f"wire tensor '{wp.name}': {side} mesh {enc.mesh_dims} at "
                             f"{enc.start_rank} does not fit the {limit} ranks of its side")

    def placements(codes):
        return tuple(m2n.Replicate() if c < 0 else m2n.Shard(c) for c in codes)

    call = M2NCall(
        name=wp.name, index=wire_index, dtype=wp.meta.dtype, shape=shape,
        src_mesh=m2n.Mesh(src.mesh_dims, src.start_rank),
        src_placements=placements(src.placements),
        src_local_shape=_local_shape(shape, src.mesh_dims, src.placements, wp.name, "source"),
        dst_mesh=m2n.Mesh(dst.mesh_dims, T + dst.start_rank),
        dst_placements=placements(dst.placements),
        dst_local_shape=_local_shape(shape, dst.mesh_dims, dst.placements, wp.name, "destination"),
        codes=(tuple(src.placements), tuple(dst.placements)),
    )
    held = {p.rank: p.box for p in wp.pieces}
    if set(held) != set(call.src_ranks):
        raise ValueError(f"wire tensor '{wp.name}': owners {sorted(held)[:8]} are not the source "
                         f"mesh ranks {call.src_ranks}")
    for r, box in held.items():
        if call.src_box(r) != box:
            raise ValueError(f"wire tensor '{wp.name}': trainer rank {r} holds {box} but the m2n "
                             f"source descriptor gives it {call.src_box(r)}")
    taken = {b.worker: b.box for b in wp.bindings}
    if {T + w for w in taken} != set(call.dst_ranks):
        raise ValueError(f"wire tensor '{wp.name}': workers {sorted(taken)[:8]} are not the "
                         f"destination mesh ranks {call.dst_ranks} - {T}")
    for w, box in taken.items():
        if call.dst_box(T + w) != box:
            raise ValueError(f"wire tensor '{wp.name}': worker {w} takes {box} but the m2n "
                             f"destination descriptor gives it {call.dst_box(T + w)}")
    return call


def destination_view(plan: Plan, wire_index: int, worker: int,
                     storage: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The region of ``worker``'s vLLM parameter that wire tensor ``wire_index`` fills.

    A view (no copy) into ``storage[binding.param]`` at the binding's
    offset, shaped like the binding's wire box; ``None`` when the worker
    takes nothing of it. For ``m2n.ok`` wire tensors the plan guarantees one
    binding per worker and a contiguous region.

    Raises:
        TransferError: the worker takes several pieces (not an m2n tensor),
            its storage lacks the parameter, or the view is not contiguous.
    """
    wp = plan.wires[wire_index]
    mine = [b for b in wp.bindings if b.worker == worker]
    if not mine:
        return None
    if len(mine) > 1:
        raise TransferError(f"worker {worker}: '{wp.name}' lands in {len(mine)} places; "
                            "only a single region can be an nccl.m2n destination")
    b = mine[0]
    if b.param not in storage:
        raise TransferError(f"worker {worker}: storage has no parameter '{b.param}' for "
                            f"'{wp.name}'")
    view = storage[b.param][box_slices(b.region)]
    if not view.is_contiguous():
        raise TransferError(f"worker {worker}: the region of '{wp.name}' in '{b.param}' is not "
                            "contiguous in its storage")
    return view


# --------------------------------------------------------------------------
# issuing reshards


class Resharder(Protocol):
    """What ``NcclM2NTransport`` needs to move one m2n wire tensor.

    ``NcclResharder`` is the real one. Every rank calls ``issue`` for every
    m2n wire tensor in the same order.
    """

    def issue(self, call: M2NCall, src: torch.Tensor | None, dst: torch.Tensor | None) -> None:
        """Start one reshard (asynchronous); keep ``src``/``dst`` alive until it completes."""

    def drain(self, max_pending_bytes: int = 0) -> list[str]:
        """Wait until at most ``max_pending_bytes`` are in flight; return finished wire names."""

    def fence(self) -> None:
        """Wait until all work this rank enqueued on its current stream completed."""

    def close(self) -> None:
        """Release resources (collective: every rank calls it)."""


def _poll(done: Callable[[], bool], timeout_s: float, on_timeout: Callable[[], None],
          check: Callable[[], None] = lambda: None) -> None:
    """Poll ``done()`` until true; after ``timeout_s`` call ``on_timeout`` (which raises).

    ``check`` runs between polls (an async-error probe). Sleeps back off
    from 0.1 ms to 10 ms, so short waits stay short.
    """
    deadline = time.monotonic() + timeout_s
    delay = 1e-4
    while not done():
        check()
        if time.monotonic() > deadline:
            on_timeout()
            raise AssertionError("on_timeout must raise")
        time.sleep(delay)
        delay = min(delay * 2, 1e-2)


class NcclResharder:
    """Issues ``nccl.m2n.reshard`` on one nccl4py communicator, with deadlines.

    Each reshard is enqueued on the device's current CUDA stream
    (``torch.cuda.current_stream``) with an explicit ``nccl.m2n.Handle``
    (nccl-extensions ``nccl_m2n/README.md``: the call follows CUDA stream
    semantics; keep buffers alive until the work completes). A CUDA event
    recorded after each call tracks completion; ``drain`` polls the oldest
    events so that at most ``max_pending_bytes`` of buffers stay referenced.

    Args:
        comm: an initialised ``nccl.core.Communicator`` over trainer and
            worker ranks (owned from now on: ``close`` destroys it).
        rank: this rank in ``comm`` (for messages).
        device: the CUDA device of ``comm``.
        timeout_s: seconds any single wait may take.
        max_cta: ``nccl.m2n.Config(max_cta=...)``; ``None`` keeps the
            library default (8, or ``NCCL_RESHARD_MAX_CTA``).

    Raises:
        NcclM2NUnavailableError: nccl.m2n does not import.
    """

    def __init__(self, comm: Any, *, rank: int, device: torch.device | str | int,
                 timeout_s: float, max_cta: int | None = None) -> None:
        self.m2n, self.core = import_nccl_m2n()
        self.comm = comm
        self.rank = rank
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.timeout_s = timeout_s
        Result = importlib.import_module("nccl.bindings.nccl").Result   # nccl4py's ncclResult_t
        self._healthy = {int(Result.Success), int(Result.InProgress)}
        self.handle = self.m2n.init(self.m2n.Config(max_cta=max_cta)) if max_cta else self.m2n.init()
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._aborted = False
        #: The current round's ``Deadline`` (set by ``NcclM2NTransport``); ``None``: per-wait ``timeout_s``.
        self.deadline = None

    def _stream(self):
        return torch.cuda.current_stream(self.device)

    def _check_buffer(self, t: torch.Tensor | None, call: M2NCall, side: str) -> None:
        if t is None:
            return
        if t.device != self.device:
            raise TransferError(f"rank {self.rank}: {side} buffer of '{call.name}' is on "
                                f"{t.device}; nccl.m2n needs it on {self.device}")
        if not t.is_contiguous():
            raise TransferError(f"rank {self.rank}: {side} buffer of '{call.name}' is not contiguous")

    def issue(self, call: M2NCall, src: torch.Tensor | None, dst: torch.Tensor | None) -> None:
        if self._aborted:
            raise TransferError(f"rank {self.rank}: the nccl_m2n communicator was aborted; "
                                "build a new transport")
        self._check_buffer(src, call, "source")
        self._check_buffer(dst, call, "destination")
        stream = self._stream()
        try:
            self.m2n.reshard(
                src, dst, self.comm, stream,
                src_mesh=call.src_mesh, src_placements=call.src_placements,
                src_local_shape=call.src_local_shape, src_dtype=call.dtype,
                dst_mesh=call.dst_mesh, dst_placements=call.dst_placements,
                dst_local_shape=call.dst_local_shape, dst_dtype=call.dtype,
                handle=self.handle)
        except Exception as e:  # NcclReshardError, NcclInvalid, NCCLError, ValueError...
            raise TransferError(f"rank {self.rank}: nccl.m2n.reshard of '{call.name}' failed: "
                                f"{type(e).__name__}: {e}") from e
        event = torch.cuda.Event()
        event.record(stream)
        nbytes = sum(t.numel() * t.element_size() for t in (src, dst) if t is not None)
        self._pending.append((event, call.name, (src, dst), nbytes))
        self._pending_bytes += nbytes

    def _check_async(self, what: str) -> None:
        result = self.comm.get_async_error()
        if int(result) not in self._healthy:
            msg = self.core.get_error_string(int(result))
            self.abort()
            raise TransferError(f"rank {self.rank}: {what} failed: NCCL reports {msg}; the "
                                "communicator was aborted")

    def _wait(self, event, what: str) -> None:
        timeout_s = self.timeout_s if self.deadline is None else self.deadline.left()

        def expire():
            self.abort()
            raise TransferError(f"rank {self.rank}: {what} did not complete within "
                                f"{timeout_s:g} s; the nccl_m2n communicator was aborted "
                                "(every rank must build a new transport)")

        _poll(event.query, timeout_s, expire, lambda: self._check_async(what))

    def drain(self, max_pending_bytes: int = 0) -> list[str]:
        finished = []
        while self._pending and self._pending_bytes > max_pending_bytes:
            event, wire, _, nbytes = self._pending[0]
            self._wait(event, f"nccl.m2n.reshard of '{wire}'")
            self._pending.popleft()
            self._pending_bytes -= nbytes
            finished.append(wire)
        return finished

    def fence(self) -> None:
        event = torch.cuda.Event()
        event.record(self._stream())
        self._wait(event, "the end of the round (reshards and torch_p2p copies)")
        self._pending.clear()
        self._pending_bytes = 0

    def abort(self) -> None:
        """Abort the communicator: in-flight NCCL work on this rank ends, buffers are released."""
        if self._aborted:
            return
        self._aborted = True
        self._pending.clear()
        self._pending_bytes = 0
        try:
            self.comm.abort()
        except Exception:  # best effort: we are already reporting a failure
            pass

    def close(self) -> None:
        """Finish pending work, finalize the handle, then destroy the communicator.

        nccl.m2n must be finalized before its communicator is destroyed
        (nccl-extensions README, "Lifecycle"); ``Communicator.destroy`` is
        collective on a node, so every rank calls ``close``. After an abort
        nothing is released here: the handle's state refers to the aborted
        communicator and to work that never completed, which the README
        does not allow finalizing; the process should exit or rebuild.
        """
        if self._aborted:
            return
        self.fence()
        try:
            self.handle.destroy()
        finally:
            self.comm.destroy()


# --------------------------------------------------------------------------
# the transport


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

    Build it with :meth:`connect` (real NCCL) or directly from a group and
    any ``Resharder``. Every rank of the communicator calls ``send_round``
    (trainer ranks ``0..T-1``) or ``recv_round`` (worker ranks ``T..T+N-1``)
    once per round with the same plan, and ``close`` at the end.

    Args:
        group: the ``torch_p2p`` process group over the same ``T+N`` ranks.
        resharder: issues the reshards (``NcclResharder``).
        rank: this rank in both the group and the communicator.
        device: where staging buffers and trainer copies live (``cuda:i``).
        timeout_s: seconds any single wait may take (torch_p2p waits, and
            every reshard completion wait).
        bucket_bytes: ``torch_p2p`` bucket size within a segment.
        max_pending_bytes: bytes of reshard buffers kept referenced while
            their reshards run; beyond it the oldest is waited for.
    """

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
        # Derived from the last plan object seen; a round with another plan rebuilds them.
        self._prepared: tuple[Plan, list[Segment], dict[int, M2NCall]] | None = None
        self._p2p_cache: dict[Segment, tuple[Plan, BucketSchedule]] = {}

    @classmethod
    def connect(cls, store: Any, group: Any, rank: int, world_size: int, *,
                device: torch.device | str | int, timeout_s: float,
                bucket_bytes: int = 64 << 20, max_pending_bytes: int = 256 << 20,
                max_cta: int | None = None, key: str = "nccl_m2n/unique_id") -> "NcclM2NTransport":
        """Create the nccl4py communicator over all ranks and wrap it.

        Rank 0 creates the NCCL unique id and puts its 128 bytes into
        ``store`` (the ``TCPStore`` from ``torch_p2p.create_group``) under
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
            self._p2p_cache = {}
        report = RoundReport(m2n_tensors=len(calls),
                             p2p_tensors=sum(1 for w in plan.wires if wire_carrier(w) == CARRIER_P2P),
                             segments=len(segments))
        return segments, calls, report

    def _p2p(self, plan: Plan, seg: Segment):
        """The sub-plan of a torch_p2p segment and its buckets (cached with the plan)."""
        cache = self._p2p_cache
        if seg not in cache:
            sub = sub_plan(plan, seg.wires)
            cache[seg] = (sub, BucketSchedule.build(sub, self.bucket_bytes))
        return cache[seg]

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
                sub, schedule = self._p2p(plan, seg)
                report.p2p_bytes += torch_p2p.send_round(
                    self.group, sub, schedule, rank, cursor.segment(plan, seg.wires),
                    timeout_s=self.timeout_s, deadline=deadline, device=self.device)
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
        try:
            for seg in segments:
                if seg.carrier == CARRIER_P2P:
                    sub, schedule = self._p2p(plan, seg)
                    names, n = torch_p2p.recv_round(self.group, sub, schedule, worker, storage,
                                                    timeout_s=self.timeout_s, deadline=deadline,
                                                    device=self.device)
                    done |= names
                    report.p2p_bytes += n
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
                    done |= set(self.resharder.drain(self.max_pending_bytes)) & expected
            done |= set(self.resharder.drain(0)) & expected
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
