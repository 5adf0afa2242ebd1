"""The seed's layout vocabulary: ``M2NMesh``, ``M2NLayout``, ``REPLICATE``, ``REPLICATED``.

vLLM's ``nccl_m2n`` backend describes how the trainer holds a tensor in the
words of ``ncclMesh_t`` (vLLM 0.33 ``weight_transfer/m2n_common.py``, which
the seed ``m2n_source.py`` builds its ``M2NManifestEntry`` on): a 2-axis mesh
over the contiguous ranks ``[start_rank, start_rank + dims[0] * dims[1])``
and one integer code per axis, ``REPLICATE`` (``-1``) or the tensor dim the
axis shards; ``REPLICATED`` (``None``) instead of the codes says every rank
of the mesh holds the whole tensor.

A trainer written against the seed hands m2nkit these objects; m2nkit keeps
its own layout types (``SourceLayout``: owners, mesh, ``Shard``/``Replicate``;
``PieceLayout``), so this module only restates the seed's rules and converts
(:func:`layout_from_m2n`). It never imports vLLM: vLLM's own ``M2NLayout``
objects (same field names) convert too, read by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import SourceLayout
from .placement import Replicate, Shard

__all__ = ["REPLICATE", "REPLICATED", "M2NMesh", "M2NLayout", "layout_from_m2n",
           "is_m2n_layout"]

#: Placement code of a mesh axis that replicates; a code ``k >= 0`` shards tensor dim ``k``.
REPLICATE = -1

#: The placements of a tensor every rank of the mesh holds in full.
REPLICATED = None


def _rank_int(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{what} must be an int, got {v!r}")
    return v


@dataclass(frozen=True)
class M2NMesh:
    """A 2-axis mesh over the contiguous trainer ranks ``[start_rank, start_rank + size)``.

    Row-major: the rank at coordinate ``(i, j)`` is ``start_rank + i * dims[1] + j``.
    A 1-axis topology is spelled with a second axis of size 1 (vLLM
    ``m2n_common.py`` ``M2NMesh``, mirroring ``ncclMesh_t``).

    Raises:
        ValueError: ``dims`` is not two positive ints (bools included) or
            ``start_rank`` is not a non-negative int.
    """

    dims: tuple[int, int]
    start_rank: int = 0

    def __post_init__(self) -> None:
        try:
            dims = tuple(self.dims)
        except TypeError:
            raise ValueError(f"M2NMesh dims {self.dims!r} must be two positive ints") from None
        if len(dims) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0
                                 for d in dims):
            raise ValueError(f"M2NMesh dims {dims!r} must be two positive ints (a 1-axis mesh "
                             "of n ranks is (n, 1))")
        start = _rank_int(self.start_rank, "M2NMesh start_rank")
        if start < 0:
            raise ValueError(f"M2NMesh start_rank must be >= 0, got {start}")
        object.__setattr__(self, "dims", dims)

    @property
    def size(self) -> int:
        """Ranks in the mesh."""
        return self.dims[0] * self.dims[1]

    @property
    def ranks(self) -> tuple[int, ...]:
        """The mesh's ranks in row-major order."""
        return tuple(range(self.start_rank, self.start_rank + self.size))


def _check_codes(placements: Any) -> tuple[int, int]:
    try:
        codes = tuple(placements)
    except TypeError:
        raise ValueError(f"M2NLayout placements {placements!r} must be two codes (REPLICATE=-1 "
                         "or the tensor dim the axis shards), or REPLICATED (None)") from None
    if len(codes) != 2 or any(isinstance(c, bool) or not isinstance(c, int) for c in codes):
        raise ValueError(f"M2NLayout placements {codes!r} must be two int codes, one per mesh "
                         "axis (REPLICATE=-1 or a tensor dim >= 0)")
    bad = [c for c in codes if c < REPLICATE]
    if bad:
        raise ValueError(f"M2NLayout placements {codes!r}: code {bad[0]} is invalid; valid "
                         f"codes are {REPLICATE} (REPLICATE) and tensor dims >= 0")
    sharded = sum(c != REPLICATE for c in codes)
    if sharded == 0:
        raise ValueError(f"M2NLayout placements {codes!r} replicate on both axes; a tensor "
                         "every rank holds in full is placements=REPLICATED (None)")
    if sharded == 2:
        raise ValueError(f"M2NLayout placements {codes!r} shard on both axes; nccl_m2n needs "
                         "one REPLICATE axis (use m2nkit's SourceLayout or pieces for more)")
    return codes


@dataclass(frozen=True)
class M2NLayout:
    """A tensor's mesh and placement codes on the trainer side (the seed's ``M2NLayout``).

    Attributes:
        mesh: an :class:`M2NMesh`.
        placements: ``(code0, code1)``, one per mesh axis, exactly one of
            them a tensor dim (the axis that shards) and the other
            :data:`REPLICATE`; or :data:`REPLICATED` (``None``): every rank
            of the mesh holds the whole tensor. Rules of vLLM
            ``m2n_common.py`` ``check_placements``.

    Raises:
        TypeError: ``mesh`` is not an ``M2NMesh``.
        ValueError: placements that are not two int codes, a code below
            ``REPLICATE``, both axes replicating (say ``REPLICATED``), or both
            sharding.
    """

    mesh: M2NMesh
    placements: tuple[int, int] | None = REPLICATED

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, M2NMesh):
            raise TypeError(f"M2NLayout mesh must be an M2NMesh, got {type(self.mesh).__name__}")
        if self.placements is not None:
            object.__setattr__(self, "placements", _check_codes(self.placements))

    def to_source_layout(self) -> SourceLayout:
        """The same layout as m2nkit's ``SourceLayout`` (see :func:`layout_from_m2n`)."""
        return layout_from_m2n(self)


def is_m2n_layout(obj: object) -> bool:
    """True for an :class:`M2NLayout` or an object of the same shape (vLLM's own class)."""
    if isinstance(obj, M2NLayout):
        return True
    mesh = getattr(obj, "mesh", None)
    return (type(obj).__name__ == "M2NLayout" and hasattr(obj, "placements")
            and hasattr(mesh, "dims") and hasattr(mesh, "start_rank"))


def layout_from_m2n(layout: Any, where: str = "source layout") -> SourceLayout:
    """Convert the seed's ``M2NLayout`` (m2nkit's or vLLM's) to a ``SourceLayout``.

    Owners are the mesh's ranks ``start_rank ..`` in row-major order over
    ``mesh_shape = dims``; code ``k >= 0`` on an axis becomes ``Shard(k)``,
    ``REPLICATE`` becomes ``Replicate()``; ``REPLICATED`` becomes a layout
    whose every owner holds the whole tensor (``placements=None``).

    Raises:
        TypeError: ``layout`` is not an M2NLayout.
        ValueError: the seed's rules (see :class:`M2NLayout`), naming ``where``.
    """
    if not is_m2n_layout(layout):
        raise TypeError(f"{where}: expected an M2NLayout, got {type(layout).__name__}")
    try:
        mine = layout if isinstance(layout, M2NLayout) else M2NLayout(
            M2NMesh(tuple(layout.mesh.dims), layout.mesh.start_rank), layout.placements)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    placements = None
    if mine.placements is not None:
        placements = tuple(Replicate() if c == REPLICATE else Shard(c) for c in mine.placements)
    return SourceLayout(mine.mesh.ranks, mine.mesh.dims, placements, where=where)
