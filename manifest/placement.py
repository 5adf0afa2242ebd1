"""Placements: how one mesh axis lays a tensor out over its ranks.

Only the two placements that every transport can reproduce exist here.
``Partial`` (pending reductions) and strided shards are trainer-internal
states; a source holding them must resolve them before declaring a layout
(vLLM ``weight_transfer/base.py``, ``Shard``/``Replicate``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shard", "Replicate", "Placement", "check_placement"]


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` over one mesh axis like ``torch.chunk``.

    Chunk size is ``ceil(n / k)`` for a dim of ``n`` elements over ``k``
    ranks; trailing ranks may hold fewer elements or none. When two mesh
    axes shard the same dim, the outer (earlier) axis splits first and the
    inner axis splits each outer chunk (``torch.distributed.tensor`` rule).

    Raises:
        TypeError: ``dim`` is not an int (bools are rejected).
        ValueError: ``dim`` is negative.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard.dim must be an int, got {self.dim!r}")
        if self.dim < 0:
            raise ValueError(f"Shard.dim must be >= 0, got {self.dim}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh axis holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


Placement = Shard | Replicate


def check_placement(placement: object, where: str) -> Placement:
    """Return ``placement`` if it is a ``Shard`` or ``Replicate``.

    Raises:
        TypeError: anything else (a ``Partial``, a string, a DTensor
            placement object), naming ``where``.
    """
    if isinstance(placement, (Shard, Replicate)):
        return placement
    raise TypeError(
        f"{where}: placement {placement!r} is not supported; use "
        "m2nkit.manifest.Shard(dim) or Replicate()"
    )
