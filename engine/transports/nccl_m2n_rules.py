"""What ``nccl.m2n`` can carry, and the order every rank walks a plan in: pure rules.

NVIDIA's ``nccl.m2n`` (nccl-extensions, ``nccl_m2n/README.md``) moves a
global tensor between two disjoint groups of GPU ranks of one NCCL
communicator in a single ``reshard`` call, from the source layout straight
into the destination layout. It accepts only some layouts; this module says
which, per wire tensor, without NCCL, CUDA or a GPU, so the planner, the
dry run (``m2nkit plan``) and the tests judge a plan anywhere:

* :func:`can_carry` (the ``nccl_m2n`` transport's ``can_carry``, recorded by
  the planner in ``WirePlan.verdicts["nccl_m2n"]``): contiguous rank
  intervals, at most a 2-D mesh, one sharded dim per side, even division,
  1-D to 3-D, one piece per rank, a contiguous destination region, no cast,
  the dtypes and fan limits (:data:`M2N_DTYPES`, :data:`M2N_MAX_FAN_IN`,
  :data:`M2N_MAX_FAN_OUT`, vLLM ``weight_transfer/m2n_common.py``);
* :func:`m2n_encoding` / :func:`m2n_local_box`: a layout as an m2n mesh and
  back;
* routing (:func:`wire_carrier`, :func:`plan_segments`, :func:`sub_plan`):
  the manifest cut into *segments*, maximal runs of consecutive wire tensors
  with the same carrier, which every rank walks in the same order (that
  order is what keeps the transport deadlock-free, ``nccl_m2n.py``).

The NCCL binding is ``nccl_m2n_runtime.py``, the transport ``nccl_m2n.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from m2nkit.engine.plan_types import Plan, SlabTable, Verdict, WirePlan
from m2nkit.manifest.destination import DestinationParam
from m2nkit.manifest.pieces import Box, full_box

__all__ = [
    "M2N_DTYPES",
    "M2N_MAX_FAN_IN",
    "M2N_MAX_FAN_OUT",
    "M2NEncoding",
    "M2NRoute",
    "m2n_encoding",
    "m2n_local_box",
    "region_is_contiguous",
    "can_carry",
    "CARRIER_M2N",
    "CARRIER_P2P",
    "CARRIER_NONE",
    "wire_carrier",
    "Segment",
    "plan_segments",
    "sub_plan",
]

#: The carrier of a wire tensor nccl.m2n moves: the transport's name, under
#: which the planner records :func:`can_carry`'s verdict.
CARRIER_M2N = "nccl_m2n"
#: The carrier of every other wire tensor that moves bytes.
CARRIER_P2P = "torch_p2p"
#: A wire tensor that moves no bytes (skipped by vLLM): no transport carries it.
CARRIER_NONE = "none"


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
    The planner calls this for every wire tensor (``NcclM2NTransport.can_carry``,
    in ``registry.TRANSPORT_RULES``).
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
                                  f"(fused into {bs[0].param})")
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


#: The verdict reads the slab table only through each piece's shard (replicas
#: are one shard) and each slab's worker: which replica sends never changes
#: it, so the planner judges tensors that differ only in that choice once.
can_carry.replica_blind = True


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
