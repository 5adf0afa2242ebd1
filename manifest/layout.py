"""Layout math: which box of a global tensor each rank holds.

A *box* is a tuple of half-open index ranges, one ``(start, stop)`` per
tensor dim, in global coordinates. A *source layout* (owners, a row-major
mesh over them, one placement per mesh axis) decides the box of every owner
with ``torch.chunk`` semantics, uneven and empty chunks included, two axes on
one dim split outer-first — the rules of ``torch.distributed.tensor``
(``_utils.compute_local_shape_and_global_offset``), which the tests check
against real DTensors.

Placements compile to pieces (``SourceLayout.pieces``): one per owner, at
the start of its local tensor (``m2nkit.manifest.pieces``). Transports
decide for themselves which layouts they can carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from typing import Sequence

from .pieces import Box, Piece, box_intersect, box_volume, full_box
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
]


def _check_rank_list(values: Sequence[int], what: str, where: str) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool):  # a bad value, not a bad type (vLLM base.py ParamMeta)
            raise ValueError(f"{where}: {what} must be ints, got {v!r} (a bool is not a rank "
                             "or a size)")
        if not isinstance(v, int):
            raise TypeError(f"{where}: {what} must be ints, got {v!r}")
        out.append(v)
    return values if type(values) is tuple else tuple(out)


#: Owner tuples that passed :meth:`SourceLayout.__post_init__`'s checks, by ``id``
#: (holding them keeps the ids unique). Every tensor of an ``fsdp:256`` manifest
#: shares one owners tuple; checking its 256 ranks once instead of per tensor
#: and per copy of the layout saves about a second on a 1.5k-tensor model.
_CHECKED_OWNERS: dict[int, tuple[int, ...]] = {}


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
        ValueError: mesh or placements given without owners; repeated,
            negative or bool owners; a non-positive or bool mesh size; a mesh
            whose product is not ``len(owners)``; a placement count that is
            not the mesh rank.
        TypeError: non-int owners or mesh sizes, or a placement that is not
            ``Shard``/``Replicate``.
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
        owners = self.owners
        if _CHECKED_OWNERS.get(id(owners)) is not owners:
            owners = _check_rank_list(owners, "owners", w)
            if not owners:
                raise ValueError(f"{w}: owners must not be empty")
            if any(o < 0 for o in owners):
                raise ValueError(f"{w}: owners must be >= 0, got {owners}")
            if len(set(owners)) != len(owners):
                raise ValueError(f"{w}: owners must be distinct, got {owners}")
            if len(_CHECKED_OWNERS) >= 1024:
                _CHECKED_OWNERS.clear()
            _CHECKED_OWNERS[id(owners)] = owners
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

    def check_shape(self, shape: Sequence[int], name: str) -> None:
        """Raise ``ValueError`` if a ``Shard.dim`` is outside a tensor of ``shape``."""
        ndim = len(shape)
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

    def pieces(self, shape: Sequence[int]) -> tuple[Piece, ...]:
        """One ``Piece`` per owner holding a non-empty box, at local start 0.

        The layout must be resolved (explicit owners). Cached per (layout, shape).
        """
        assert self.owners is not None, "resolve the layout first"
        return _pieces_cached(tuple(shape), self.owners, self.mesh_shape, self.placements)

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...] | None:
        """The shape of ``rank``'s local tensor: its box's extent (``None``: not an owner)."""
        owners = self.owners
        if owners is None:
            return tuple(shape)
        if rank not in owners:
            return None
        flat, coord = owners.index(rank), []
        for size in reversed(self.mesh_shape):
            coord.append(flat % size)
            flat //= size
        box = local_box(shape, self.mesh_shape, self.placements, tuple(reversed(coord)))
        return tuple(b - a for a, b in box)


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


@lru_cache(maxsize=4096)
def _pieces_cached(shape, owners, mesh_shape, placements) -> tuple[Piece, ...]:
    # A box depends only on the coordinates along sharding axes: replicas
    # (HSDP's outer axis) share it, so each box is computed once.
    sharded = [a for a, p in enumerate(placements or ()) if isinstance(p, Shard)]
    boxes: dict[tuple[int, ...], Box | None] = {}
    out = []
    for rank, coord in zip(owners, _coords(mesh_shape)):
        k = tuple(coord[a] for a in sharded)
        if k not in boxes:
            box = local_box(shape, mesh_shape, placements, coord)
            boxes[k] = box if len(shape) == 0 or box_volume(box) else None
        box = boxes[k]
        if box is not None:
            out.append(Piece.checked_box(rank, box))
    return tuple(out)
