"""``ParamMeta``: the wire-level description of one tensor a trainer sends.

Identical on every trainer rank, so every rank derives the same plan with no
exchange. Rules from vLLM ``vllm/distributed/weight_transfer/base.py``
(``ParamMeta``); see docs/REFERENCE.md §1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import SourceLayout
from .placement import Placement

__all__ = ["ParamMeta"]


@dataclass(frozen=True)
class ParamMeta:
    """Name, dtype, global shape and source layout of one wire tensor.

    ``owners=None`` means every trainer rank holds the whole tensor;
    ``mesh_shape`` defaults to ``(len(owners),)``; one placement per mesh
    axis; all-``Replicate`` placements normalise to ``None``.

    Raises:
        ValueError: empty name, negative dims, mesh/placements without
            owners, repeated or negative owners, a mesh that does not cover
            its owners, a placement count that is not the mesh rank, a
            ``Shard.dim`` outside the tensor.
        TypeError: dtype is not a ``torch.dtype``; non-int owners, mesh
            sizes or dims (bools included); a placement that is not
            ``Shard``/``Replicate``.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Placement, ...] | None = None

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
        layout = SourceLayout(
            None if self.owners is None else tuple(self.owners),
            None if self.mesh_shape is None else tuple(self.mesh_shape),
            None if self.placements is None else tuple(self.placements),
            where=f"parameter '{self.name}'",
        )
        layout.check_tensor_rank(len(shape), self.name)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "owners", layout.owners)
        object.__setattr__(self, "mesh_shape", layout.mesh_shape)
        object.__setattr__(self, "placements", layout.placements)

    @property
    def layout(self) -> SourceLayout:
        """The source layout (owners, mesh, placements) as one value."""
        return SourceLayout(self.owners, self.mesh_shape, self.placements,
                            where=f"parameter '{self.name}'")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole global tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize
