"""``ParamMeta``: the wire-level description of one tensor a trainer sends.

Identical on every trainer rank, so every rank derives the same plan with no
exchange. Rules from vLLM ``vllm/distributed/weight_transfer/base.py``
(``ParamMeta``); see docs/reference.md §1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from typing import Sequence

from .layout import SourceLayout, _pieces_cached
from .pieces import Piece, PieceLayout
from .placement import Placement

__all__ = ["ParamMeta"]


@dataclass(frozen=True)
class ParamMeta:
    """Name, dtype, global shape and source layout of one wire tensor.

    The layout is given one of two ways:

    * placements (the seed's way, and the common one): ``owners=None`` means
      every trainer rank holds the whole tensor; ``mesh_shape`` defaults to
      ``(len(owners),)``; one placement per mesh axis; all-``Replicate``
      placements normalise to ``None``. They compile to one piece per owner
      (``SourceLayout.pieces``).
    * explicit ``pieces`` (``m2nkit.manifest.Piece``): any set of (rank, box,
      local start), several per rank, replicas, padding rows in no piece.
      ``owners`` is then derived (the ranks holding a piece) and
      ``mesh_shape``/``placements`` stay ``None``.

    Raises:
        ValueError: empty name, negative dims, ``pieces`` together with
            owners/mesh/placements, a piece outside the shape, mesh/placements without
            owners, repeated, negative or bool owners (vLLM ``base.py``: a
            bool is a bad rank), a bool mesh size, a mesh that does not cover
            its owners, a placement count that is not the mesh rank, a
            ``Shard.dim`` outside the tensor.
        TypeError: dtype is not a ``torch.dtype``; non-int owners, mesh
            sizes or dims; a placement that is not ``Shard``/``Replicate``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Placement, ...] | None = None
    pieces: tuple[Piece, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"parameter name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"parameter '{self.name}': dtype {self.dtype!r} is not a torch.dtype")
        shape = tuple(self.shape)
        for n in shape:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(
                    f"parameter '{self.name}': shape {shape} must hold non-negative ints"
                )
        object.__setattr__(self, "shape", shape)
        if self.pieces is not None:
            if not (self.owners is None and self.mesh_shape is None and self.placements is None):
                raise ValueError(
                    f"parameter '{self.name}': give either pieces or owners/mesh_shape/"
                    "placements, not both")
            layout = PieceLayout(tuple(self.pieces), where=f"parameter '{self.name}'")
            layout.check_shape(shape, self.name)
            object.__setattr__(self, "pieces", layout.pieces)
            object.__setattr__(self, "owners", layout.owners)
            return
        layout = SourceLayout(
            None if self.owners is None else tuple(self.owners),
            None if self.mesh_shape is None else tuple(self.mesh_shape),
            None if self.placements is None else tuple(self.placements),
            where=f"parameter '{self.name}'",
        )
        layout.check_shape(shape, self.name)
        object.__setattr__(self, "owners", layout.owners)
        object.__setattr__(self, "mesh_shape", layout.mesh_shape)
        object.__setattr__(self, "placements", layout.placements)

    @property
    def layout(self) -> SourceLayout | PieceLayout:
        """The source layout: placements (``SourceLayout``) or explicit pieces."""
        if self.pieces is not None:
            return PieceLayout(self.pieces, where=f"parameter '{self.name}'")
        return SourceLayout(self.owners, self.mesh_shape, self.placements,
                            where=f"parameter '{self.name}'")

    def source_pieces(self, num_trainer_ranks: int) -> tuple[Piece, ...]:
        """Every piece of this tensor with ``owners=None`` resolved over ``T`` ranks.

        Raises:
            ValueError: an owner is not below ``num_trainer_ranks``.
        """
        if self.pieces is not None:
            bad = sorted({p.rank for p in self.pieces if p.rank >= num_trainer_ranks})
            if bad:
                raise ValueError(
                    f"parameter '{self.name}': piece ranks {bad} are not trainer ranks; valid "
                    f"ranks are 0..{num_trainer_ranks - 1}")
            return self.pieces
        if self.owners is None:
            return _pieces_cached(self.shape, tuple(range(num_trainer_ranks)), (num_trainer_ranks,),
                                  None)
        if max(self.owners) >= num_trainer_ranks:
            self.layout.resolve(num_trainer_ranks)  # raises, naming the owners
        return _pieces_cached(self.shape, self.owners, self.mesh_shape, self.placements)

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        """Shape of ``rank``'s local tensor: exact for placements, the least
        shape holding every piece for explicit pieces; ``None`` if ``rank``
        holds nothing."""
        if self.pieces is not None:
            return self.layout.local_shape(rank)
        return self.layout.local_shape(self.shape, rank)

    @property
    def exact_local_shape(self) -> bool:
        """True when the local tensor must be exactly :meth:`local_shape`
        (placements); explicit pieces allow a larger tensor (padding rows)."""
        return self.pieces is None

    def holds(self, rank: int) -> bool:
        """Whether trainer ``rank`` holds any of this tensor."""
        return self.owners is None or rank in self.owners

    @property
    def nbytes(self) -> int:
        """Bytes of the whole global tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize
