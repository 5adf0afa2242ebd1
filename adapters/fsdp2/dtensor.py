"""Which box of each tensor every rank holds: FSDP2's and DTensor's placement rules.

Pure arithmetic on the ``DTensor`` spec (global shape, device mesh,
placements), identical on every rank and without a collective: the source
reads its metadata from here, and the ``fsdp2:`` dry-run trainer spec
(``m2nkit.adapters.trainer_spec``) applies :func:`dtensor_box` to a
checkpoint, so the two agree by construction.

FSDP2 shards the tensor it is given (a plain parameter, or the local tensor
of a TP/EP ``DTensor``) on its shard dim with ``torch.chunk`` and pads the
*storage* to ``ceil(n/k)`` rows per rank, but the ``DTensor``'s local tensor
is the unpadded ``narrow`` (torch ``distributed/fsdp/_fully_shard/_fsdp_param.py``,
``FSDPParam._init_sharded_param``, ``_chunk_with_empty`` in
``_fsdp_common.py``): rank ``i`` of ``k`` holds rows ``[i*c, min((i+1)*c, n))``,
``c = ceil(n/k)``. On top of tensor parallelism FSDP2 shards each TP rank's
local rows, right to left, and marks the data-parallel axis
``_StridedShard(dim, split_factor=<TP shards of that dim>)``
(``FSDPParam._init_sharding_spec_tp``); :func:`dtensor_box` applies that
order. Parameters on a sub-mesh are replicated over the other axes of the
root mesh (``DeviceMesh._get_root_mesh``). The package docstring
(:mod:`m2nkit.adapters.fsdp2`) has the whole rule with its uneven cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from m2nkit.manifest import Piece, PieceLayout, Replicate, Shard, SourceLayout, chunk_bounds
from m2nkit.manifest.pieces import Box, box_volume

from .errors import FSDP2SourceError

if TYPE_CHECKING:
    from .params import Weight

__all__ = ["dtensor_box", "mesh_of", "weight_layout"]


def _placement_kind(p: object) -> tuple[str, int, int]:
    """``(kind, dim, split_factor)`` of a torch placement; kind in shard/strided/replicate/other."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # not a Shard subclass in torch 2.13; test it first anyway
        return "strided", int(p.dim), int(p.split_factor)
    if isinstance(p, TShard):
        return "shard", int(p.dim), 1
    if isinstance(p, TReplicate):
        return "replicate", -1, 1
    return "other", -1, 1


def _split_order(axes: list[tuple[int, str, int]]) -> list[int]:
    """Order in which mesh axes split one tensor dim (``axes``: ``(axis, kind, sf)`` in mesh order).

    Plain ``Shard`` axes split left to right (outer axis first, DTensor's
    rule); a ``_StridedShard`` axis splits after every later axis on the
    same dim (FSDP2's right-to-left sharding over TP/EP).
    """
    if not axes:
        return []
    rest = _split_order(axes[1:])
    first = axes[0][0]
    return rest + [first] if axes[0][1] == "strided" else [first] + rest


def dtensor_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[object],
                coord: Sequence[int], *, name: str = "tensor") -> Box:
    """The box of a ``DTensor``'s global ``shape`` that the rank at mesh ``coord`` holds.

    ``placements`` are torch placements (``Shard``, ``Replicate``,
    ``_StridedShard``), one per mesh axis. Each dim is split with
    ``torch.chunk`` bounds (:func:`m2nkit.manifest.chunk_bounds`), by the
    axes that shard it, in :func:`_split_order`: plain shards outer axis
    first (torch ``distributed/tensor/_utils.py``,
    ``compute_local_shape_and_global_offset``), a ``_StridedShard`` after the
    later axes on its dim (FSDP2 shards a TP/EP local tensor: torch
    ``fsdp/_fully_shard/_fsdp_param.py``, ``_init_sharding_spec_tp``).

    Returns:
        One ``(start, stop)`` per dim; a rank past the end of a dim holds an
        empty range.

    Raises:
        FSDP2SourceError: a ``Partial`` (or unknown) placement; a
            ``_StridedShard`` whose ``split_factor`` is not the product of the
            later axes sharding its dim (a layout FSDP2 does not make); naming
            ``name``.
    """
    kinds = _checked_kinds(len(shape), tuple(mesh_shape), placements, name)
    return _box(tuple(shape), tuple(mesh_shape), kinds, tuple(coord))


def _checked_kinds(ndim: int, mesh_shape: tuple[int, ...], placements: Sequence[object],
                   name: str) -> tuple[tuple[str, int, int], ...]:
    """``_placement_kind`` of each placement (dims normalised), checked (see ``dtensor_box``)."""
    kinds = []
    for axis, p in enumerate(placements):
        kind, dim, sf = _placement_kind(p)
        if kind == "other":
            raise FSDP2SourceError(
                f"parameter '{name}': placement {p!r} on mesh axis {axis} cannot be sent shard "
                "to shard (a Partial holds pending sums: reduce it first); supported: Shard, "
                "Replicate, _StridedShard")
        kinds.append((kind, dim + ndim if dim < 0 else dim, sf))
    for axis, (kind, dim, sf) in enumerate(kinds):
        if kind == "strided":
            later = math.prod(mesh_shape[a] for a in range(axis + 1, len(kinds))
                              if kinds[a][0] != "replicate" and kinds[a][1] == dim)
            if sf != later:
                raise FSDP2SourceError(
                    f"parameter '{name}': _StridedShard(dim={dim}, split_factor={sf}) on mesh "
                    f"axis {axis} of mesh {mesh_shape} with placements {tuple(placements)}: the "
                    f"later axes shard dim {dim} {later} ways; FSDP2 makes split_factor equal to "
                    "that (only FSDP2's strided layouts are supported)")
    return tuple(kinds)


@lru_cache(maxsize=1 << 16)
def _box(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
         kinds: tuple[tuple[str, int, int], ...], coord: tuple[int, ...]) -> Box:
    per_dim: dict[int, list[tuple[int, str, int]]] = {}
    for axis, (kind, dim, sf) in enumerate(kinds):
        if kind != "replicate":
            per_dim.setdefault(dim, []).append((axis, kind, sf))
    bounds = [[0, n] for n in shape]
    for dim, axes in per_dim.items():
        for axis in _split_order(axes):
            lo, hi = bounds[dim]
            s, e = chunk_bounds(hi - lo, mesh_shape[axis], coord[axis])
            bounds[dim] = [lo + s, lo + e]
    return tuple((a, b) for a, b in bounds)


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


@dataclass(frozen=True)
class _Root:
    """The trainer's root device mesh: its ranks (row-major) and shape."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    names: tuple[str, ...] | None

    @property
    def coords(self) -> dict[int, tuple[int, ...]]:
        return {r: _unravel(i, self.shape) for i, r in enumerate(self.ranks)}


def mesh_of(mesh: Any) -> _Root:
    t = mesh.mesh
    return _Root(tuple(int(r) for r in t.flatten().tolist()), tuple(int(s) for s in t.shape),
                 tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None)


def _sub_coords(root: _Root, sub: _Root, name: str) -> dict[int, tuple[int, ...]]:
    """For every root rank, its coordinate in the (sub-)mesh of the same kind as ``sub``.

    ``sub`` is this rank's slice of a sub-mesh: the root ranks with some
    root axes fixed. Its copies on the other slices hold the same layout, so
    a root rank's coordinate in its own slice follows from its root
    coordinate on the axes ``sub`` spans (flattened row-major, then
    unravelled over ``sub``'s shape).

    Raises:
        FSDP2SourceError: ``sub`` is not such a slice of ``root``.
    """
    if set(sub.ranks) == set(root.ranks):
        return {r: _unravel(i, sub.shape) for i, r in enumerate(sub.ranks)}
    coords = root.coords
    missing = [r for r in sub.ranks if r not in coords]
    if not missing:
        mine = [coords[r] for r in sub.ranks]
        spans = [a for a in range(len(root.shape)) if len({c[a] for c in mine}) > 1]
        fixed = {a: mine[0][a] for a in range(len(root.shape)) if a not in spans}
        enum = [r for r, c in coords.items() if all(c[a] == v for a, v in fixed.items())]
        span_shape = [root.shape[a] for a in spans]
        if enum == list(sub.ranks) and math.prod(span_shape) == len(sub.ranks):
            out = {}
            for r, c in coords.items():
                flat = 0
                for a in spans:
                    flat = flat * root.shape[a] + c[a]
                out[r] = _unravel(flat, sub.shape)
            return out
    raise FSDP2SourceError(
        f"parameter '{name}': its device mesh (ranks {list(sub.ranks)}) is not a slice of the "
        f"root mesh (ranks {list(root.ranks)}, shape {root.shape}), so the ranks holding its "
        "other copies are unknown; pass mesh=<the trainer's world DeviceMesh> to fsdp2_source")


@lru_cache(maxsize=256)
def _sub_coords_cached(root: _Root, sub: _Root) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    try:
        return tuple(_sub_coords(root, sub, "").items())
    except FSDP2SourceError:
        return None


def weight_layout(x: Weight, root: _Root, num_trainer_ranks: int
                  ) -> tuple[dict[int, Box], SourceLayout | PieceLayout]:
    """Every root rank's box of one weight (in wire dim order), and the layout declaring them.

    Read off the ``DTensor`` spec only: identical on every rank, no
    collective. A persistent buffer (never sharded by FSDP2) is whole on
    every root rank.

    Raises:
        FSDP2SourceError: see :func:`dtensor_box` and :func:`_sub_coords`,
            naming the parameter.
    """
    shape = tuple(int(n) for n in x.param.shape)
    if x.whole:   # in wire dim order: the whole tensor, on every rank
        return _layout_cached(x.wire_shape, None, root, None, None, num_trainer_ranks)
    sub = mesh_of(x.param.device_mesh)
    if _sub_coords_cached(root, sub) is None:
        _sub_coords(root, sub, x.name)  # raises, naming the parameter
    kinds = _checked_kinds(len(shape), sub.shape, x.param.placements, x.name)
    return _layout_cached(shape, sub, root, kinds, x.order, num_trainer_ranks)


@lru_cache(maxsize=4096)
def _layout_cached(shape: tuple[int, ...], sub: _Root | None, root: _Root,
                   kinds: tuple | None, order: tuple[int, ...] | None, num_trainer_ranks: int):
    """``weight_layout`` for hashable facts: a model's layers repeat, so does this."""
    if sub is None:
        boxes = {r: tuple((0, n) for n in shape) for r in root.ranks}
    else:
        coords = _sub_coords_cached(root, sub)
        boxes = {r: _box(shape, sub.shape, kinds, c) for r, c in coords}
    if order is not None:
        shape = tuple(shape[d] for d in order)
        boxes = {r: tuple(b[d] for d in order) for r, b in boxes.items()}
    full = tuple((0, n) for n in shape)
    if all(b == full for b in boxes.values()):
        if root.ranks == tuple(range(num_trainer_ranks)):
            return boxes, SourceLayout()
        return boxes, SourceLayout(root.ranks)
    pieces = tuple(Piece(r, b) for r, b in boxes.items() if box_volume(b) or not shape)
    candidate = None if sub is None else _root_placements(sub, root, kinds, order)
    if candidate is not None:
        lay = SourceLayout(root.ranks, root.shape, candidate)
        if set(lay.pieces(shape)) == set(pieces):
            return boxes, lay
    return boxes, PieceLayout(pieces)


def _root_placements(sub: _Root, root: _Root, kinds: tuple,
                     order: tuple[int, ...] | None) -> tuple | None:
    """The placements on the root mesh's axes, when ``sub`` maps axis to axis (else None).

    ``order``: the wire tensor is the parameter permuted (``Shard(d)``
    becomes ``Shard(order.index(d))``)."""
    if any(k not in ("shard", "replicate") for k, _, _ in kinds):
        return None
    if sub.ranks == root.ranks and sub.shape == root.shape:
        axes = list(range(len(root.shape)))
    elif sub.names and root.names and all(n in root.names for n in sub.names):
        axes = [root.names.index(n) for n in sub.names]
    else:
        return None
    out: list = [Replicate()] * len(root.shape)
    for a, (kind, dim, _) in zip(axes, kinds):
        if kind == "shard":
            out[a] = Shard(dim if order is None else order.index(dim))
    return tuple(out)
