"""The transfer plan: which slab goes from which trainer rank to which worker.

Every source box (a piece of a wire tensor some trainer ranks hold) is
intersected with every destination binding (a box some worker needs, and
where it lands in that worker's vLLM storage). Each non-empty intersection
is a *slab*. Where several trainer ranks hold the same piece (replicas), one
is chosen per slab, greedily, to balance bytes sent per rank. Nothing is
ever gathered: bytes moved equal the bytes the workers hold, exactly.

The plan proves its own coverage: per worker parameter, the regions written
by bindings plus the declared zero regions (vocab padding) are disjoint and
fill it; per wire tensor, the source pieces tile it. It also says, per wire
tensor, whether ``nccl.m2n.reshard`` can carry it (NVIDIA nccl-extensions
``nccl_m2n/README.md`` preconditions; vLLM ``m2n_common.py`` limits) and, if
not, why — such tensors go through the ``torch_p2p`` transport.

Slabs are kept as one int64 table per wire tensor (numpy), so a plan for a
235B-parameter MoE over 256 trainer ranks (about a million slabs) builds in
seconds on two cores.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from m2nkit.manifest.destination import Binding, DestinationLayout, DestinationParam
from m2nkit.manifest.layout import (
    Box,
    M2NEncoding,
    SourceLayout,
    box_volume,
    m2n_encoding,
    rank_boxes,
    region_is_contiguous,
    source_pieces,
)
from m2nkit.manifest.meta import ParamMeta

__all__ = [
    "M2N_DTYPES",
    "M2N_MAX_FAN_IN",
    "M2N_MAX_FAN_OUT",
    "Slab",
    "Problem",
    "M2NVerdict",
    "WirePlan",
    "Plan",
    "build_plan",
    "count_coverage",
    "next_local",
]

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


class Slab(NamedTuple):
    """One contiguous-in-index-space box copied from a trainer rank to a worker.

    ``box`` is in global wire coordinates; ``src_start`` is where it begins in
    the source rank's local tensor, ``dst_start`` where it begins in the
    worker's local parameter ``param``. ``nbytes`` = volume × itemsize.
    """

    wire: str
    src: int
    dst: int
    box: Box
    src_start: tuple[int, ...]
    param: str
    dst_start: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Problem:
    """Something that stops the transfer: ``subject`` (a tensor or param) and why."""

    subject: str
    message: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.message}"


@dataclass(frozen=True)
class M2NVerdict:
    """Whether ``nccl.m2n.reshard`` can carry one wire tensor, and how.

    ``src``/``dst`` are the encodings (ranks relative to each side) when
    ``ok``; otherwise ``reason`` says which precondition fails.
    """

    ok: bool
    reason: str = ""
    src: M2NEncoding | None = None
    dst: M2NEncoding | None = None


@dataclass
class WirePlan:
    """The plan for one wire tensor.

    ``table`` is an int64 array ``[n_slabs, 3 + 2*ndim]``: columns ``src``,
    ``dst``, ``binding`` (index into ``bindings``), then the box starts and
    stops in global coordinates.
    """

    meta: ParamMeta
    layout: SourceLayout
    bindings: tuple[Binding, ...]
    table: np.ndarray
    skipped: str = ""
    m2n: M2NVerdict = field(default_factory=lambda: M2NVerdict(False, "not planned"))

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def itemsize(self) -> int:
        return self.meta.dtype.itemsize

    def slab_nbytes(self) -> np.ndarray:
        """Bytes of every slab, ``[n_slabs]`` int64."""
        nd = len(self.meta.shape)
        if nd == 0:
            return np.full(len(self.table), self.itemsize, dtype=np.int64)
        ext = self.table[:, 3 + nd:3 + 2 * nd] - self.table[:, 3:3 + nd]
        return ext.prod(axis=1) * self.itemsize

    @property
    def nbytes_moved(self) -> int:
        return int(self.slab_nbytes().sum())

    @property
    def nbytes_min(self) -> int:
        """Bytes the workers hold of this tensor: every element once per binding."""
        return sum(box_volume(b.wire_box) for b in self.bindings) * self.itemsize

    def src_starts(self) -> dict[int, tuple[int, ...]]:
        """Start of each owner's local box in global coordinates."""
        return {r: tuple(a for a, _ in box) for r, box in rank_boxes(self.layout, self.meta.shape)}

    def slabs(self) -> Iterator[Slab]:
        """Every slab as a ``Slab`` (for executors, tests and JSON)."""
        nd = len(self.meta.shape)
        starts = self.src_starts()
        sizes = self.slab_nbytes()
        for row, nbytes in zip(self.table.tolist(), sizes.tolist()):
            src, dst, bi = row[0], row[1], row[2]
            lo, hi = row[3:3 + nd], row[3 + nd:3 + 2 * nd]
            b = self.bindings[bi]
            s0 = starts[src]
            yield Slab(
                self.meta.name, src, dst, tuple(zip(lo, hi)),
                tuple(x - o for x, o in zip(lo, s0)), b.param,
                tuple(off + x - w for off, x, (w, _) in zip(b.offset, lo, b.wire_box)),
                nbytes,
            )


@dataclass
class Plan:
    """A complete transfer plan and its accounting.

    Attributes:
        num_trainer_ranks: trainer ranks ``0..T-1``.
        destination: the inference side (workers ``0..N-1``).
        wires: one ``WirePlan`` per wire tensor, in manifest (send) order.
        problems: everything that prevents the transfer; empty when it can run.
        send_bytes: ``[T]`` bytes each trainer rank sends.
        recv_bytes: ``[N]`` bytes each worker receives.
        link_bytes: ``{(src, dst): bytes}``.
        manifest_digest: digest of the manifest the plan was built from.
    """

    num_trainer_ranks: int
    destination: DestinationLayout
    wires: list[WirePlan]
    problems: list[Problem]
    send_bytes: np.ndarray
    recv_bytes: np.ndarray
    link_bytes: dict[tuple[int, int], int]
    manifest_digest: str = ""

    @property
    def num_workers(self) -> int:
        return self.destination.num_workers

    @property
    def nbytes_moved(self) -> int:
        return int(self.send_bytes.sum())

    @property
    def nbytes_min(self) -> int:
        return sum(w.nbytes_min for w in self.wires if not w.skipped)

    @property
    def num_slabs(self) -> int:
        return sum(len(w.table) for w in self.wires)

    def fan_in(self) -> np.ndarray:
        """``[N]`` distinct trainer ranks sending to each worker."""
        out = np.zeros(self.num_workers, dtype=np.int64)
        for _, d in self.link_bytes:
            out[d] += 1
        return out

    def fan_out(self) -> np.ndarray:
        """``[T]`` distinct workers each trainer rank sends to."""
        out = np.zeros(self.num_trainer_ranks, dtype=np.int64)
        for s, _ in self.link_bytes:
            out[s] += 1
        return out

    def m2n_share(self) -> float:
        """Fraction of moved bytes in wire tensors ``nccl.m2n`` can carry."""
        total = self.nbytes_moved
        ok = sum(w.nbytes_moved for w in self.wires if w.m2n.ok)
        return ok / total if total else 1.0

    def estimated_seconds(self, link_gbps: float) -> float:
        """Transfer time if every rank has its own ``link_gbps`` Gbit/s link.

        The busiest rank bounds the transfer: ``max(max send, max receive) /
        (link_gbps * 1e9 / 8)`` seconds. A lower bound: latency, per-slab
        overhead and shared links are not modelled.
        """
        busiest = max(int(self.send_bytes.max(initial=0)), int(self.recv_bytes.max(initial=0)))
        return busiest / (link_gbps * 1e9 / 8)

    def digest(self) -> str:
        """sha256 of everything that decides which byte goes where."""
        h = hashlib.sha256()
        h.update(json.dumps({
            "manifest": self.manifest_digest,
            "destination": self.destination.spec,
            "trainer_ranks": self.num_trainer_ranks,
        }, sort_keys=True).encode())
        for w in self.wires:
            h.update(json.dumps([w.name, w.skipped, [
                [b.worker, b.param, b.wire_box, b.offset] for b in w.bindings
            ]]).encode())
            h.update(np.ascontiguousarray(w.table, dtype="<i8").tobytes())
        return h.hexdigest()

    def to_json(self, *, with_slabs: bool = True) -> dict:
        """A JSON-ready description (slabs as rows when ``with_slabs``)."""
        wires = []
        for w in self.wires:
            entry = {
                "name": w.name,
                "dtype": str(w.meta.dtype).removeprefix("torch."),
                "shape": list(w.meta.shape),
                "skipped": w.skipped or None,
                "bytes_moved": w.nbytes_moved,
                "bytes_min": w.nbytes_min,
                "nccl_m2n": {"ok": w.m2n.ok, "reason": w.m2n.reason or None},
                "bindings": [
                    {"worker": b.worker, "param": b.param, "wire_box": [list(x) for x in b.wire_box],
                     "offset": list(b.offset)} for b in w.bindings
                ],
            }
            if with_slabs:
                entry["slab_columns"] = ["src", "dst", "param", "box", "src_start", "dst_start", "bytes"]
                entry["slabs"] = [
                    [s.src, s.dst, s.param, [list(x) for x in s.box], list(s.src_start),
                     list(s.dst_start), s.nbytes] for s in w.slabs()
                ]
            wires.append(entry)
        return {
            "digest": self.digest(),
            "manifest_digest": self.manifest_digest,
            "trainer_ranks": self.num_trainer_ranks,
            "inference": self.destination.spec,
            "workers": self.num_workers,
            "bytes_moved": self.nbytes_moved,
            "bytes_min": self.nbytes_min,
            "send_bytes": self.send_bytes.tolist(),
            "recv_bytes": self.recv_bytes.tolist(),
            "links": [[s, d, b] for (s, d), b in sorted(self.link_bytes.items())],
            "problems": [{"subject": p.subject, "message": p.message} for p in self.problems],
            "wires": wires,
        }


# --------------------------------------------------------------------------
# building


class _Grid:
    """Numpy view of ``SourcePieces``: interval bounds per dim and holder ranks."""

    def __init__(self, layout: SourceLayout, shape: tuple[int, ...]):
        pieces = source_pieces(layout, shape)
        self.starts = [np.array([a for a, _ in ivs], dtype=np.int64) for ivs in pieces.intervals]
        self.stops = [np.array([b for _, b in ivs], dtype=np.int64) for ivs in pieces.intervals]
        reps = {len(r) for r in pieces.holders.values()}
        self.rep = max(reps) if reps else 0
        grid_shape = tuple(len(ivs) for ivs in pieces.intervals)
        self.holders = np.full(grid_shape + (max(self.rep, 1),), -1, dtype=np.int64)
        for key, ranks in pieces.holders.items():
            self.holders[key][: len(ranks)] = ranks
        self.uniform = len(reps) <= 1


def _intersect(grid: _Grid, box: Box):
    """Grid cells a box touches: ``(holders [n, rep], starts [n, nd], stops [n, nd])``."""
    los, his, idx = [], [], []
    for d, (lo, hi) in enumerate(box):
        i0 = int(np.searchsorted(grid.stops[d], lo, side="right"))
        i1 = int(np.searchsorted(grid.starts[d], hi, side="left"))
        if i1 <= i0:
            return None
        r = np.arange(i0, i1)
        idx.append(r)
        los.append(np.maximum(grid.starts[d][r], lo))
        his.append(np.minimum(grid.stops[d][r], hi))
    mesh_idx = np.meshgrid(*idx, indexing="ij")
    mesh_lo = np.meshgrid(*los, indexing="ij")
    mesh_hi = np.meshgrid(*his, indexing="ij")
    holders = grid.holders[tuple(m.reshape(-1) for m in mesh_idx)]
    starts = np.stack([m.reshape(-1) for m in mesh_lo], axis=1)
    stops = np.stack([m.reshape(-1) for m in mesh_hi], axis=1)
    return holders, starts, stops


def _regions_disjoint_and_fill(shape: tuple[int, ...], regions: list[Box]) -> str:
    """'' when ``regions`` lie inside ``shape``, are disjoint and fill it; else why."""
    total = math.prod(shape)
    for r in regions:
        if any(a < 0 or b > n or a > b for (a, b), n in zip(r, shape)):
            return f"region {r} is outside the local shape {shape}"
    vol = sum(box_volume(r) for r in regions)
    for i in range(len(regions)):
        for j in range(i + 1, len(regions)):
            a, b = regions[i], regions[j]
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                return f"regions {a} and {b} overlap (an element would be written twice)"
    if vol != total:
        return f"{total - vol} of {total} elements are written by no wire tensor"
    return ""


def _m2n_verdict(wp: WirePlan, params: dict[tuple[int, str], DestinationParam],
                 num_workers: int) -> M2NVerdict:
    meta = wp.meta
    cast = {params[(b.worker, b.param)].dtype for b in wp.bindings} - {meta.dtype}
    if cast:
        return M2NVerdict(False, f"wire dtype {str(meta.dtype).removeprefix('torch.')} is cast to "
                                 f"vLLM's {str(cast.pop()).removeprefix('torch.')} on arrival "
                                 "(nccl.m2n moves bytes as they are)")
    if meta.dtype not in M2N_DTYPES:
        return M2NVerdict(False, f"dtype {meta.dtype} is not an nccl.m2n dtype")
    if not 1 <= len(meta.shape) <= 3:
        return M2NVerdict(False, f"{len(meta.shape)}-D tensor (nccl.m2n moves 1-D to 3-D)")
    src_boxes = [(r, b) for r, b in rank_boxes(wp.layout, meta.shape)]
    if wp.layout.mesh_shape is not None and len(wp.layout.mesh_shape) > 2:
        return M2NVerdict(False, f"source mesh {wp.layout.mesh_shape} has more than 2 axes")
    shard_axes = [p for p in (wp.layout.placements or ())
                  if type(p).__name__ == "Shard"]
    if len(shard_axes) > 1:
        return M2NVerdict(False, "source shards on more than one mesh axis")
    src = m2n_encoding(src_boxes, meta.shape)
    if isinstance(src, str):
        return M2NVerdict(False, f"source: {src}")
    per_worker: dict[int, list[Binding]] = {}
    for b in wp.bindings:
        per_worker.setdefault(b.worker, []).append(b)
    for w, bs in per_worker.items():
        if len(bs) > 1:
            return M2NVerdict(False, f"worker {w} takes {len(bs)} separate pieces of it "
                                     f"(fused halves into {bs[0].param})")
        b = bs[0]
        p = params[(w, b.param)]
        region = tuple((o, o + (hi - lo)) for o, (lo, hi) in zip(b.offset, b.wire_box))
        if not region_is_contiguous(p.shape, region):
            return M2NVerdict(False, f"its region in worker {w}'s {b.param} is not contiguous")
    dst = m2n_encoding([(w, bs[0].wire_box) for w, bs in per_worker.items()], meta.shape)
    if isinstance(dst, str):
        return M2NVerdict(False, f"destination: {dst}")
    if len(wp.table):
        # Per shard, not per rank: replicas of one source box are one source
        # shard, so the verdict follows the layouts, not the replica choice.
        piece_of, boxes = {}, {}
        for r, box in src_boxes:
            piece_of[r] = boxes.setdefault(box, len(boxes))
        pieces = np.array([piece_of[r] for r in wp.table[:, 0].tolist()], dtype=np.int64)
        pairs = np.unique(np.stack([pieces, wp.table[:, 1]], axis=1), axis=0)
        fan_in = np.bincount(pairs[:, 1]).max()
        fan_out = np.bincount(pairs[:, 0]).max()
        if fan_in > M2N_MAX_FAN_IN:
            return M2NVerdict(False, f"{fan_in} source shards feed one destination shard "
                                     f"(nccl.m2n allows {M2N_MAX_FAN_IN})")
        if fan_out > M2N_MAX_FAN_OUT:
            return M2NVerdict(False, f"one source shard feeds {fan_out} destination shards "
                                     f"(nccl.m2n allows {M2N_MAX_FAN_OUT})")
    return M2NVerdict(True, "", src, dst)


def build_plan(
    metas: Sequence[ParamMeta],
    num_trainer_ranks: int,
    destination: DestinationLayout,
    *,
    manifest_digest: str = "",
) -> Plan:
    """Plan the transfer of ``metas`` (manifest order) into ``destination``.

    Args:
        metas: wire tensors in send order; layouts with ``owners=None`` mean
            every one of ``num_trainer_ranks`` ranks.
        num_trainer_ranks: trainer ranks ``0..T-1``.
        destination: what every worker holds (``m2nkit.adapters.vllm``).
        manifest_digest: recorded in the plan digest (``manifest_digest`` of
            ``m2nkit.manifest.serialize``).

    Returns:
        A ``Plan``; ``plan.problems`` lists everything that blocks the
        transfer (a tensor nobody takes, a parameter nothing fills,
        overlapping writes). Deterministic: same inputs, same digest.

    Raises:
        ValueError: an owner outside ``0..T-1`` (names the tensor).
    """
    problems: list[Problem] = []
    params = destination.param_index()
    wires: list[WirePlan] = []
    send = np.zeros(num_trainer_ranks, dtype=np.int64)
    recv = np.zeros(destination.num_workers, dtype=np.int64)
    link = np.zeros((num_trainer_ranks, destination.num_workers), dtype=np.int64)
    seen = set()
    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"wire tensor '{meta.name}' appears twice in the manifest")
        seen.add(meta.name)
        layout = meta.layout.resolve(num_trainer_ranks)
        nd = len(meta.shape)
        skipped = destination.skipped.get(meta.name, "")
        bindings = tuple(destination.bindings.get(meta.name, ()))
        empty = np.zeros((0, 3 + 2 * nd), dtype=np.int64)
        if skipped:
            wires.append(WirePlan(meta, layout, (), empty, skipped, M2NVerdict(False, "skipped")))
            continue
        if not bindings:
            reason = getattr(destination, "unknown", {}).get(
                meta.name, "no vLLM parameter takes this tensor")
            problems.append(Problem(meta.name, reason))
            wires.append(WirePlan(meta, layout, (), empty, "", M2NVerdict(False, "no destination")))
            continue
        for b in bindings:
            p = params.get((b.worker, b.param))
            if p is None:  # a destination adapter bug, not user input
                raise RuntimeError(f"binding of '{meta.name}' names unknown parameter "
                                   f"'{b.param}' on worker {b.worker}")
        grid = _Grid(layout, meta.shape)
        if not grid.uniform:
            raise AssertionError(f"non-uniform replica count for '{meta.name}'")
        chunks = []
        for bi, b in enumerate(bindings):
            if nd == 0:
                holders = grid.holders.reshape(1, -1)
                starts = stops = np.zeros((1, 0), dtype=np.int64)
            else:
                hit = _intersect(grid, b.wire_box)
                if hit is None:
                    continue
                holders, starts, stops = hit
            keep = holders[:, 0] >= 0
            if not keep.all():
                problems.append(Problem(meta.name, f"part of box {b.wire_box} is held by no trainer rank"))
                holders, starts, stops = holders[keep], starts[keep], stops[keep]
            n = len(holders)
            vol = ((stops - starts).prod(axis=1) if nd else np.ones(n, dtype=np.int64)) \
                * meta.dtype.itemsize
            if grid.rep <= 1:
                src = holders[:, 0]
            else:
                # Greedy: each slab goes to the replica that has sent least so far.
                load = send.tolist()
                src_list = []
                for cand, v in zip(holders.tolist(), vol.tolist()):
                    best = min(cand, key=lambda r: (load[r], r))
                    src_list.append(best)
                    load[best] += v
                src = np.array(src_list, dtype=np.int64)
            np.add.at(send, src, vol)
            recv[b.worker] += int(vol.sum())
            np.add.at(link[:, b.worker], src, vol)
            rows = np.empty((n, 3 + 2 * nd), dtype=np.int64)
            rows[:, 0] = src
            rows[:, 1] = b.worker
            rows[:, 2] = bi
            rows[:, 3:3 + nd] = starts
            rows[:, 3 + nd:] = stops
            chunks.append(rows)
        table = np.concatenate(chunks) if chunks else empty
        wp = WirePlan(meta, layout, bindings, table, "")
        if wp.nbytes_moved != wp.nbytes_min:
            problems.append(Problem(meta.name, f"slabs carry {wp.nbytes_moved} bytes but the "
                                               f"workers hold {wp.nbytes_min}"))
        wp.m2n = _m2n_verdict(wp, params, destination.num_workers)
        wires.append(wp)

    # Coverage of every worker parameter: bindings + zero regions, once each.
    regions: dict[tuple[int, str], list[Box]] = {k: list(p.zero_boxes) for k, p in params.items()}
    for wp in wires:
        for b in wp.bindings:
            regions[(b.worker, b.param)].append(
                tuple((o, o + hi - lo) for o, (lo, hi) in zip(b.offset, b.wire_box)))
    for (worker, name), regs in regions.items():
        why = _regions_disjoint_and_fill(params[(worker, name)].shape, regs)
        if why:
            problems.append(Problem(f"worker {worker} {name}", why))
    nz = np.nonzero(link)
    link_bytes = {(int(s), int(d)): int(link[s, d]) for s, d in zip(*nz)}
    return Plan(num_trainer_ranks, destination, wires, problems, send, recv, link_bytes,
                manifest_digest)


def count_coverage(plan: Plan) -> dict[tuple[int, str], torch.Tensor]:
    """Brute-force check: how many times each worker element is written.

    Returns ``{(worker, param): int32 tensor of the local shape}`` counting
    slab writes plus zero regions. A correct plan has all ones. For tests
    and small plans only (one counter per element).
    """
    counts = {
        (p.worker, p.name): torch.zeros(p.shape, dtype=torch.int32)
        for p in plan.destination.params
    }
    for p in plan.destination.params:
        for z in p.zero_boxes:
            counts[(p.worker, p.name)][tuple(slice(a, b) for a, b in z)] += 1
    for wp in plan.wires:
        for s in wp.slabs():
            region = tuple(slice(o, o + hi - lo) for o, (lo, hi) in zip(s.dst_start, s.box))
            counts[(s.dst, s.param)][region] += 1
    return counts


def next_local(it, wp: WirePlan, rank: int, box: Box | None = None, *,
               error: type[Exception] = ValueError) -> torch.Tensor:
    """Take wire tensor ``wp``'s local piece from a rank's ``iter_local()`` stream.

    Every executor and transport pulls a trainer rank's stream through this
    one check (``WeightSource.iter_local`` contract: owned tensors, manifest
    order, each of its box's shape and the manifest dtype). ``box`` is the
    rank's box of ``wp``; ``None`` skips the shape check.

    Raises:
        ``error`` (``ValueError`` by default; transports pass
        ``TransferError``): the stream ended early, yielded another name,
        or a piece of the wrong shape or dtype (names rank and tensor).
    """
    try:
        name, local = next(it)
    except StopIteration:
        raise error(f"trainer rank {rank}: source ended before '{wp.name}'") from None
    if name != wp.name:
        raise error(f"trainer rank {rank}: source yielded '{name}' where the manifest "
                    f"order expects '{wp.name}'")
    if box is not None:
        want = tuple(b - a for a, b in box)
        if tuple(local.shape) != want:
            raise error(f"trainer rank {rank}: local '{name}' has shape {tuple(local.shape)}; "
                        f"its box needs {want}")
    if local.dtype != wp.meta.dtype:
        raise error(f"trainer rank {rank}: local '{name}' is {local.dtype}; the manifest "
                    f"says {wp.meta.dtype}")
    return local
