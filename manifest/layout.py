"""Layout math: which box of a global tensor each rank holds.

A *box* is a tuple of half-open index ranges, one ``(start, stop)`` per
tensor dim, in global coordinates. A *source layout* (owners, a row-major
mesh over them, one placement per mesh axis) decides the box of every owner
with ``torch.chunk`` semantics, uneven and empty chunks included, two axes on
one dim split outer-first — the rules of ``torch.distributed.tensor``
(``_utils.compute_local_shape_and_global_offset``), which the tests check
against real DTensors.

This module also encodes layouts for ``nccl.m2n`` (NVIDIA nccl-extensions,
``nccl_m2n/README.md``): contiguous rank intervals, at most a 2-D mesh, at
most one sharded axis, even division. Anything else is reported with the
reason, never silently approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from typing import Sequence

from .placement import Placement, Replicate, Shard, check_placement

__all__ = [
    "Box",
    "SourceLayout",
    "chunk_bounds",
    "local_box",
    "rank_boxes",
    "box_volume",
    "box_intersect",
    "full_box",
    "SourcePieces",
    "source_pieces",
    "M2NEncoding",
    "m2n_encoding",
    "region_is_contiguous",
]

Box = tuple[tuple[int, int], ...]


def _check_rank_list(values: Sequence[int], what: str, where: str) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{where}: {what} must be ints, got {v!r}")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class SourceLayout:
    """How the trainer holds one wire tensor: owners, mesh and placements.

    ``owners`` are trainer ranks listed in mesh order (row-major over
    ``mesh_shape``); ``None`` means every trainer rank, resolved when the
    number of trainer ranks is known. ``mesh_shape`` defaults to
    ``(len(owners),)``. ``placements`` has one ``Shard``/``Replicate`` per
    mesh axis; ``None`` (or all ``Replicate``) means every owner holds the
    whole tensor. Rules from vLLM ``weight_transfer/base.py`` ``ParamMeta``.

    Raises:
        ValueError: mesh or placements given without owners; repeated or
            negative owners; a non-positive mesh size; a mesh whose product
            is not ``len(owners)``; a placement count that is not the mesh
            rank.
        TypeError: non-int owners or mesh sizes (bools included), or a
            placement that is not ``Shard``/``Replicate``.
    """

    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Placement, ...] | None = None
    # Only labels error messages: two layouts that differ in ``where`` alone
    # are the same layout (equal, same hash).
    where: str = field(default="source layout", compare=False)

    def __post_init__(self) -> None:
        w = self.where
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(
                    f"{w}: mesh_shape/placements need explicit owners "
                    "(owners=None means 'every trainer rank, replicated')"
                )
            return
        owners = _check_rank_list(self.owners, "owners", w)
        if not owners:
            raise ValueError(f"{w}: owners must not be empty")
        if any(o < 0 for o in owners):
            raise ValueError(f"{w}: owners must be >= 0, got {owners}")
        if len(set(owners)) != len(owners):
            raise ValueError(f"{w}: owners must be distinct, got {owners}")
        mesh = (len(owners),) if self.mesh_shape is None else _check_rank_list(
            self.mesh_shape, "mesh_shape sizes", w)
        if not mesh or any(m <= 0 for m in mesh):
            raise ValueError(f"{w}: mesh_shape {mesh} must be non-empty and positive")
        if math.prod(mesh) != len(owners):
            raise ValueError(
                f"{w}: mesh_shape {mesh} does not cover its {len(owners)} owners "
                f"(product {math.prod(mesh)})"
            )
        placements = None
        if self.placements is not None:
            placements = tuple(
                check_placement(p, w) for p in self.placements
            )
            if len(placements) != len(mesh):
                raise ValueError(
                    f"{w}: {len(placements)} placements for a {len(mesh)}-D mesh "
                    f"{mesh}; give one Shard/Replicate per mesh axis"
                )
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "placements", placements)

    def check_tensor_rank(self, ndim: int, name: str) -> None:
        """Raise ``ValueError`` if a ``Shard.dim`` is outside a rank-``ndim`` tensor."""
        for p in self.placements or ():
            if isinstance(p, Shard) and p.dim >= ndim:
                raise ValueError(
                    f"parameter '{name}': Shard({p.dim}) is outside its "
                    f"{ndim}-D shape; valid dims are 0..{ndim - 1}"
                )

    def resolve(self, num_ranks: int) -> "SourceLayout":
        """The layout with ``owners=None`` replaced by ``range(num_ranks)``.

        Raises:
            ValueError: an owner is not below ``num_ranks``.
        """
        if self.owners is None:
            return SourceLayout(tuple(range(num_ranks)), where=self.where)
        bad = [o for o in self.owners if o >= num_ranks]
        if bad:
            raise ValueError(
                f"{self.where}: owners {bad} are not trainer ranks; valid ranks "
                f"are 0..{num_ranks - 1}"
            )
        return self

    def to_json(self) -> dict:
        return {
            "owners": None if self.owners is None else list(self.owners),
            "mesh_shape": None if self.mesh_shape is None else list(self.mesh_shape),
            "placements": None if self.placements is None else [
                {"shard": p.dim} if isinstance(p, Shard) else {"replicate": True}
                for p in self.placements
            ],
        }

    @classmethod
    def from_json(cls, data: dict, where: str = "source layout") -> "SourceLayout":
        placements = data.get("placements")
        if placements is not None:
            placements = tuple(
                Shard(p["shard"]) if "shard" in p else Replicate() for p in placements
            )
        return cls(
            None if data.get("owners") is None else tuple(data["owners"]),
            None if data.get("mesh_shape") is None else tuple(data["mesh_shape"]),
            placements,
            where=where,
        )


def chunk_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    """Index range ``[start, stop)`` of chunk ``i`` of ``n`` elements split in ``k``.

    ``torch.chunk`` semantics: chunk size ``ceil(n / k)``; chunks past the
    end are empty (``start == stop == n``).
    """
    size = -(-n // k) if n else 0
    start = min(i * size, n)
    return start, min(start + size, n)


def local_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement] | None,
    coord: Sequence[int],
) -> Box:
    """The global box held by the rank at mesh coordinate ``coord``.

    Mesh axes apply in order, so with two axes sharding one dim the outer
    axis chunks first and the inner axis chunks that chunk.
    """
    bounds = [[0, n] for n in shape]
    for axis, p in enumerate(placements or ()):
        if isinstance(p, Shard):
            lo, hi = bounds[p.dim]
            s, e = chunk_bounds(hi - lo, mesh_shape[axis], coord[axis])
            bounds[p.dim] = [lo + s, lo + e]
    return tuple((a, b) for a, b in bounds)


def _coords(mesh_shape: Sequence[int]):
    return product(*(range(m) for m in mesh_shape))


def rank_boxes(layout: SourceLayout, shape: Sequence[int]) -> list[tuple[int, Box]]:
    """``(rank, box)`` for every owner of a resolved layout, in owner order."""
    assert layout.owners is not None, "resolve the layout first"
    return [
        (rank, local_box(shape, layout.mesh_shape, layout.placements, coord))
        for rank, coord in zip(layout.owners, _coords(layout.mesh_shape))
    ]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def box_volume(box: Box) -> int:
    v = 1
    for a, b in box:
        v *= max(0, b - a)
    return v


def box_intersect(x: Box, y: Box) -> Box | None:
    """The common box of ``x`` and ``y``, or ``None`` when it is empty."""
    out = []
    for (a, b), (c, d) in zip(x, y):
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


@dataclass(frozen=True)
class SourcePieces:
    """The disjoint non-empty boxes of a source layout and who holds each.

    Boxes under ``Shard``/``Replicate`` placements form a grid: the product
    over dims of a partition of each dim into intervals. ``intervals[d]`` is
    that partition (sorted, non-empty intervals); ``holders`` maps a grid
    index tuple to the owner ranks holding exactly that box (replicas), in
    owner order. ``overlapping(box)`` finds the pieces a box touches by
    bisection, so planning cost follows the number of slabs, not of pairs.
    """

    shape: tuple[int, ...]
    intervals: tuple[tuple[tuple[int, int], ...], ...]
    holders: dict

    def overlapping(self, box: Box):
        """Yield ``(piece_box ∩ box, holder ranks)`` for every touched piece."""
        import bisect

        per_dim = []
        for d, (lo, hi) in enumerate(box):
            ivs = self.intervals[d]
            starts = [iv[0] for iv in ivs]
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            hits = []
            while i < len(ivs) and ivs[i][0] < hi:
                a, b = ivs[i]
                s, e = max(a, lo), min(b, hi)
                if s < e:  # an empty query extent touches nothing
                    hits.append((i, (s, e)))
                i += 1
            if not hits:
                return
            per_dim.append(hits)
        for combo in product(*per_dim):
            key = tuple(c[0] for c in combo)
            ranks = self.holders.get(key)
            if ranks:
                yield tuple(c[1] for c in combo), ranks


@lru_cache(maxsize=4096)
def _pieces_cached(shape, owners, mesh_shape, placements) -> SourcePieces:
    per_dim_sets: list[set] = [set() for _ in shape]
    by_rank = []
    for rank, coord in zip(owners, _coords(mesh_shape)):
        box = local_box(shape, mesh_shape, placements, coord)
        if box_volume(box) == 0 and len(shape) > 0:
            continue
        by_rank.append((rank, box))
        for d, iv in enumerate(box):
            per_dim_sets[d].add(iv)
    intervals = tuple(tuple(sorted(s)) for s in per_dim_sets)
    index = [{iv: i for i, iv in enumerate(ivs)} for ivs in intervals]
    holders: dict = {}
    for rank, box in by_rank:
        key = tuple(index[d][iv] for d, iv in enumerate(box))
        holders.setdefault(key, []).append(rank)
    return SourcePieces(tuple(shape), intervals, {k: tuple(v) for k, v in holders.items()})


def source_pieces(layout: SourceLayout, shape: Sequence[int]) -> SourcePieces:
    """The pieces of a resolved layout (cached: many tensors share a layout)."""
    assert layout.owners is not None, "resolve the layout first"
    return _pieces_cached(tuple(shape), layout.owners, layout.mesh_shape, layout.placements)


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
