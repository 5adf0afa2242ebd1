"""Boxes and pieces: which part of a wire tensor a trainer rank holds, and where.

A *box* is a tuple of half-open index ranges, one ``(start, stop)`` per
tensor dim, in the global coordinates of a wire tensor.

A *piece* says that trainer rank ``rank`` holds box ``box`` of the wire
tensor, and that the box's first element sits at ``local_start`` of the
tensor the rank's provider returns (``M2NManifestEntry.local_tensor``,
``WeightSource.iter_local``). Any source layout is a set of pieces:

* ``Shard``/``Replicate`` placements (the seed's ``ParamMeta``) compile to
  one piece per owner at ``local_start = 0`` (``SourceLayout.pieces``);
* a rank may hold several pieces of one wire tensor: Megatron expert tensor
  parallelism keeps ``[gate rows r; up rows r]`` in one local tensor (two
  boxes of the stacked ``gate_up_proj``), FSDP2 on top of TP
  (``_StridedShard``) holds non-contiguous row sets, a Megatron fused QKV
  shard holds the q rows of several query groups;
* a local tensor may hold rows that belong to no wire element (Megatron's
  padded vocabulary: ``Vp/tp`` rows, the padding in no piece);
* replicas are pieces with the same box on several ranks; the planner
  picks one per slab and balances the load. Pieces of different ranks may
  also overlap partly; every element some worker needs must be in at least
  one piece.

This module is pure index arithmetic: it knows no transport and no model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Iterable, Sequence

__all__ = [
    "Box",
    "Piece",
    "PieceLayout",
    "PieceGrid",
    "box_volume",
    "box_intersect",
    "box_shape",
    "box_slices",
    "full_box",
    "piece_grid",
]

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_volume(box: Box) -> int:
    """Elements in ``box`` (0 when any extent is empty)."""
    v = 1
    for a, b in box:
        v *= max(0, b - a)
    return v


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of ``box`` per dim."""
    return tuple(b - a for a, b in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    """``box`` as an index for a tensor: ``t[box_slices(box)]``."""
    return tuple(slice(a, b) for a, b in box)


def box_intersect(x: Box, y: Box) -> Box | None:
    """The common box of ``x`` and ``y``, or ``None`` when it is empty."""
    out = []
    for (a, b), (c, d) in zip(x, y):
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _int(v: object, what: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{where}: {what} must be an int, got {v!r}")
    return v


@dataclass(frozen=True)
class Piece:
    """Trainer ``rank`` holds ``box`` of a wire tensor, at ``local_start`` locally.

    Attributes:
        rank: the trainer rank (``>= 0``).
        box: ``((start, stop), ...)`` per dim of the wire tensor, global
            coordinates, ``0 <= start <= stop``.
        local_start: index in the rank's local tensor where ``box``'s first
            element sits, one int per dim (default: all 0). The box's
            elements sit at ``local[local_start + (i - box start)]``.

    Raises:
        TypeError: a non-int rank, bound or start (bools included).
        ValueError: a negative rank or start, a bound with ``start > stop``
            or ``start < 0``, ``local_start`` of another tensor rank.
    """

    rank: int
    box: Box
    local_start: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        where = f"piece of rank {self.rank!r}"
        rank = _int(self.rank, "rank", where)
        if rank < 0:
            raise ValueError(f"{where}: rank must be >= 0")
        box = []
        for iv in self.box:
            try:
                a, b = iv
            except (TypeError, ValueError):
                raise ValueError(f"{where}: box {self.box!r} must hold (start, stop) pairs") from None
            a, b = _int(a, "box bounds", where), _int(b, "box bounds", where)
            if not 0 <= a <= b:
                raise ValueError(f"{where}: box {self.box!r} has a bound with start {a} > "
                                 f"stop {b} or start < 0")
            box.append((a, b))
        start = (0,) * len(box) if self.local_start is None else tuple(
            _int(s, "local_start", where) for s in self.local_start)
        if len(start) != len(box):
            raise ValueError(f"{where}: local_start {start} has {len(start)} dims; its box has "
                             f"{len(box)}")
        if any(s < 0 for s in start):
            raise ValueError(f"{where}: local_start {start} must be >= 0")
        object.__setattr__(self, "box", tuple(box))
        object.__setattr__(self, "local_start", start)
        # Planner caches key on tuples of thousands of pieces: hash once.
        object.__setattr__(self, "_hash", hash((rank, self.box, start)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def checked_box(cls, rank: int, box: Box) -> "Piece":
        """``Piece(rank, box)`` for a ``box`` already checked (a tuple of int
        pairs ``0 <= start <= stop``, as ``local_box`` returns): the rank is
        checked, the box is not re-checked. For layouts of thousands of ranks."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            return cls(rank, box)   # raises, naming the rank
        p = object.__new__(cls)
        start = (0,) * len(box)
        object.__setattr__(p, "rank", rank)
        object.__setattr__(p, "box", box)
        object.__setattr__(p, "local_start", start)
        object.__setattr__(p, "_hash", hash((rank, box, start)))
        return p

    @property
    def local_box(self) -> Box:
        """Where ``box`` sits in the rank's local tensor (local coordinates)."""
        return tuple((s, s + b - a) for s, (a, b) in zip(self.local_start, self.box))

    def local_region(self, sub: Box) -> Box:
        """Where a sub-box ``sub`` of :attr:`box` sits in the local tensor."""
        return tuple((s + lo - a, s + hi - a)
                     for s, (lo, hi), (a, _) in zip(self.local_start, sub, self.box))

    def to_json(self) -> list:
        return [self.rank, [list(iv) for iv in self.box], list(self.local_start)]


@dataclass(frozen=True)
class PieceLayout:
    """A source layout given as explicit pieces (any set, any ranks).

    ``pieces`` may hold several pieces per rank and the same box on several
    ranks (replicas). Empty pieces are dropped. Pieces of one rank must not
    overlap in the local tensor unless they are the same box (one local
    element, one wire element).

    Attributes:
        pieces: the pieces, in a canonical order (rank, then box).
        owners: the distinct ranks holding a piece, ascending.

    Raises:
        TypeError: an entry is not a ``Piece``.
        ValueError: no pieces; two pieces of one rank at overlapping local
            regions; the same piece twice (names the rank and boxes).
    """

    pieces: tuple[Piece, ...]
    where: str = "piece layout"

    def __post_init__(self) -> None:
        ps = []
        for p in self.pieces:
            if not isinstance(p, Piece):
                raise TypeError(f"{self.where}: pieces must be m2nkit.manifest.Piece, got "
                                f"{type(p).__name__}")
            if box_volume(p.box) or not p.box:
                ps.append(p)
        if not ps:
            raise ValueError(f"{self.where}: no non-empty pieces; a wire tensor needs at least "
                             "one rank holding it")
        ps.sort(key=lambda p: (p.rank, p.box, p.local_start))
        for p, q in zip(ps, ps[1:]):
            if p == q:
                raise ValueError(f"{self.where}: rank {p.rank} lists piece {p.box} twice")
        by_rank: dict[int, list[Piece]] = {}
        for p in ps:
            by_rank.setdefault(p.rank, []).append(p)
        for rank, mine in by_rank.items():
            for i, p in enumerate(mine):
                for q in mine[i + 1:]:
                    if box_intersect(p.local_box, q.local_box) is not None:
                        raise ValueError(
                            f"{self.where}: rank {rank} places boxes {p.box} and {q.box} at "
                            f"overlapping local regions {p.local_box} and {q.local_box}")
        object.__setattr__(self, "pieces", tuple(ps))

    @property
    def owners(self) -> tuple[int, ...]:
        return tuple(sorted({p.rank for p in self.pieces}))

    def check_shape(self, shape: Sequence[int], name: str) -> None:
        """Raise ``ValueError`` if a piece does not fit a tensor of ``shape``."""
        shape = tuple(shape)
        for p in self.pieces:
            if len(p.box) != len(shape) or any(b > n for (_, b), n in zip(p.box, shape)):
                raise ValueError(
                    f"parameter '{name}': piece {p.box} of rank {p.rank} is outside its "
                    f"global shape {shape}")

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        """The least local shape that holds every piece of ``rank`` (``None``: no piece)."""
        mine = [p for p in self.pieces if p.rank == rank]
        if not mine:
            return None
        return tuple(max(s for _, s in dim) for dim in zip(*(p.local_box for p in mine)))

    def to_json(self) -> dict:
        return {"pieces": [p.to_json() for p in self.pieces]}


@dataclass(frozen=True)
class PieceGrid:
    """The pieces of one wire tensor as a grid of elementary cells.

    Every dim is cut at its ends and at every piece boundary, so the cells
    tile the tensor and each piece is a union of whole cells; a cell no piece
    covers has no holders. ``intervals[d]`` lists the cells along dim ``d`` (sorted,
    non-empty); ``holders[cell]`` the indices (into ``pieces``) of the pieces
    covering that cell, replicas included. The planner intersects a
    destination box with the cells by bisection, so its cost follows the
    number of slabs, not of (piece, box) pairs.
    """

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    intervals: tuple[tuple[tuple[int, int], ...], ...]
    holders: dict

    def overlapping(self, box: Box) -> Iterable[tuple[Box, tuple[int, ...]]]:
        """Yield ``(cell ∩ box, holder piece indices)`` for every touched cell."""
        per_dim = []
        for d, (lo, hi) in enumerate(box):
            ivs = self.intervals[d]
            starts = [iv[0] for iv in ivs]
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            hits = []
            while i < len(ivs) and ivs[i][0] < hi:
                a, b = ivs[i]
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    hits.append((i, (s, e)))
                i += 1
            if not hits:
                return
            per_dim.append(hits)
        for combo in product(*per_dim):
            held = self.holders.get(tuple(c[0] for c in combo))
            if held:
                yield tuple(c[1] for c in combo), held


@lru_cache(maxsize=4096)
def piece_grid(pieces: tuple[Piece, ...], shape: tuple[int, ...]) -> PieceGrid:
    """The cell grid of ``pieces`` of a tensor of ``shape`` (cached: layouts repeat)."""
    cuts: list[set[int]] = [{0, n} for n in shape]  # cells tile the whole tensor
    for p in pieces:
        for d, (a, b) in enumerate(p.box):
            cuts[d].update((a, b))
    intervals = []
    for d in range(len(shape)):
        c = sorted(cuts[d])
        intervals.append(tuple((a, b) for a, b in zip(c, c[1:]) if a < b))
    index = [{iv[0]: i for i, iv in enumerate(ivs)} for ivs in intervals]
    stops = [[iv[1] for iv in ivs] for ivs in intervals]
    holders: dict = {}
    for k, p in enumerate(pieces):
        ranges = []
        for d, (a, b) in enumerate(p.box):
            i0 = index[d][a]
            i1 = bisect.bisect_left(stops[d], b) + 1
            ranges.append(range(i0, i1))
        for cell in product(*ranges):
            holders.setdefault(cell, []).append(k)
    return PieceGrid(tuple(shape), pieces, tuple(intervals),
                     {c: tuple(v) for c, v in holders.items()})
