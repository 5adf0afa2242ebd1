"""Re-fusing per-expert tensors into stacked wire tensors, lazily, by box.

Checkpoints store MoE experts one tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight [Im, H]``; Mixtral
``block_sparse_moe.experts.{e}.w1.weight``), while vLLM's routed-experts
contract and transformers 5's in-memory layout keep them stacked:
``experts.gate_up_proj [E, 2*Im, H]`` (expert ``e`` = its gate rows, then its
up rows) and ``experts.down_proj [E, H, Im]`` (docs/reference.md §3, §4;
transformers ``conversion_mapping.py``, ``MergeModulelist(dim=0)`` then
``Concatenate(dim=1)``).

This module describes such a stacked tensor and reads any box of it from
the per-expert slices the box touches: for a box covering part of an
expert only those rows and columns are read, and a stacked tensor is never
materialised to cut a box out of it. It knows no model family: the
per-expert name patterns come from the caller's table.

A pattern is a name with two fields, ``{prefix}`` (the MoE block, e.g.
``model.layers.3.mlp``) and ``{e}`` (the expert index):
``"{prefix}.experts.{e}.w1.weight"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

__all__ = [
    "expert_pattern_regex",
    "expert_name",
    "group_expert_tensors",
    "ExpertSlice",
    "StackedExperts",
    "stack_experts",
]

Box = tuple[tuple[int, int], ...]

#: ``read_slice(per_expert_name, (row_slice, col_slice)) -> Tensor``.
SliceReader = Callable[[str, tuple[slice, slice]], torch.Tensor]


def expert_pattern_regex(pattern: str) -> re.Pattern:
    """Compile a ``{prefix}``/``{e}`` pattern into a regex with those groups.

    Raises:
        ValueError: the pattern lacks ``{prefix}`` or ``{e}``.
    """
    if "{prefix}" not in pattern or "{e}" not in pattern:
        raise ValueError(f"expert pattern {pattern!r} must contain '{{prefix}}' and '{{e}}'")
    out = []
    for piece in re.split(r"(\{prefix\}|\{e\})", pattern):
        if piece == "{prefix}":
            out.append(r"(?P<prefix>.+?)")
        elif piece == "{e}":
            out.append(r"(?P<e>0|[1-9][0-9]*)")
        else:
            out.append(re.escape(piece))
    return re.compile("^" + "".join(out) + "$")


def expert_name(pattern: str, prefix: str, e: int) -> str:
    """The per-expert tensor name of expert ``e`` under ``prefix``."""
    return pattern.replace("{prefix}", prefix).replace("{e}", str(e))


def group_expert_tensors(
    names: Iterable[str], patterns: Mapping[str, str]
) -> dict[str, dict[int, dict[str, str]]]:
    """Group per-expert tensor names: ``prefix -> expert -> part -> name``.

    Args:
        names: tensor names (any order); names matching no pattern are
            ignored.
        patterns: part -> pattern, e.g. ``{"gate": "{prefix}.experts.{e}.w1.weight",
            "up": ..., "down": ...}``.

    Returns:
        Prefixes in order of first appearance; experts and parts as found
        (possibly incomplete: :func:`stack_experts` checks completeness).
    """
    compiled = [(part, expert_pattern_regex(p)) for part, p in patterns.items()]
    out: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        for part, rx in compiled:
            m = rx.match(name)
            if m:
                out.setdefault(m.group("prefix"), {}).setdefault(
                    int(m.group("e")), {})[part] = name
                break
    return out


@dataclass(frozen=True)
class ExpertSlice:
    """One read of a box of a stacked tensor: a 2-D slice of one per-expert tensor.

    ``source[rows[0]:rows[1], cols[0]:cols[1]]`` lands at
    ``out[expert, out_rows[0]:out_rows[1], :]`` of the box (box-local
    coordinates).
    """

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    expert: int
    out_rows: tuple[int, int]


@dataclass(frozen=True)
class StackedExperts:
    """A stacked wire tensor ``[E, P*R, C]`` made of per-expert ``[R, C]`` tensors.

    ``sources[e]`` lists the per-expert tensors of expert ``e`` in the
    order they are concatenated along rows (``(gate, up)`` for
    ``gate_up_proj``, ``(down,)`` for ``down_proj``); every one has shape
    ``part_shape = (R, C)``.
    """

    name: str
    dtype: torch.dtype
    sources: tuple[tuple[str, ...], ...]
    part_shape: tuple[int, int]

    @property
    def num_experts(self) -> int:
        return len(self.sources)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, P*R, C)``."""
        parts = len(self.sources[0]) if self.sources else 0
        return (self.num_experts, parts * self.part_shape[0], self.part_shape[1])

    def source_names(self) -> tuple[str, ...]:
        """Every per-expert tensor, expert-major, in concatenation order."""
        return tuple(n for names in self.sources for n in names)

    def slices(self, box: Box) -> list[ExpertSlice]:
        """The per-expert reads that make up ``box`` (none for an empty box).

        Only parts whose rows intersect the box's rows are read, and only
        the rows and columns inside the box.
        """
        (e0, e1), (r0, r1), (c0, c1) = box
        if e0 >= e1 or r0 >= r1 or c0 >= c1:
            return []
        rows = self.part_shape[0]
        out = []
        for e in range(e0, e1):
            for k, source in enumerate(self.sources[e]):
                off = k * rows
                lo, hi = max(r0, off), min(r1, off + rows)
                if lo < hi:
                    out.append(ExpertSlice(source, (lo - off, hi - off), (c0, c1),
                                           e - e0, (lo - r0, hi - r0)))
        return out

    def read_box(self, box: Box, read_slice: SliceReader) -> torch.Tensor:
        """Read ``box`` of the stacked tensor via ``read_slice`` (see :data:`SliceReader`).

        Returns a new contiguous tensor of the box's extents and ``dtype``.
        """
        out = torch.empty(tuple(b - a for a, b in box), dtype=self.dtype)
        for s in self.slices(box):
            piece = read_slice(s.source, (slice(*s.rows), slice(*s.cols)))
            out[s.expert, s.out_rows[0]:s.out_rows[1]] = piece
        return out


def stack_experts(
    name: str,
    experts: Mapping[int, Mapping[str, str]],
    parts: Sequence[str],
    num_experts: int,
    *,
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, torch.dtype],
    part_shape: Sequence[int] | None = None,
    expected_name: Callable[[int, str], str] | None = None,
) -> StackedExperts:
    """Describe stacked wire tensor ``name`` from one MoE block's per-expert tensors.

    Args:
        name: the wire name of the stacked tensor.
        experts: expert -> part -> per-expert tensor name (one prefix of
            :func:`group_expert_tensors`).
        parts: the parts concatenated along rows, in order (``("gate", "up")``).
        num_experts: ``E``; experts must be exactly ``0..E-1``.
        shapes, dtypes: of every per-expert tensor (from file headers).
        part_shape: the ``(R, C)`` every part must have; ``None`` takes
            the shape of expert 0's first part.
        expected_name: ``(expert, part) -> name`` the tensor should have,
            quoted when one is missing (e.g. formats the family's pattern).

    Raises:
        ValueError: an expert or part is missing ("expert 3 of 8 has no
            gate part ..."), an expert index is ``>= E``, a per-expert tensor
            is not 2-D or has the wrong shape, or the parts mix dtypes.
    """
    extra = sorted(e for e in experts if not 0 <= e < num_experts)
    if extra:
        some = next(iter(experts[extra[0]].values()))
        raise ValueError(
            f"stacked experts '{name}': found expert {extra[0]} ('{some}') but the "
            f"config has {num_experts} experts (valid indices 0..{num_experts - 1})"
        )
    sources = []
    for e in range(num_experts):
        have = experts.get(e, {})
        row = []
        for part in parts:
            if part not in have:
                want = f" '{expected_name(e, part)}'" if expected_name else ""
                present = sorted(have.values())
                raise ValueError(
                    f"stacked experts '{name}': expert {e} of {num_experts} is missing its "
                    f"{part} tensor{want}"
                    + (f" (it has {present})" if present else " (it has no tensors)")
                )
            row.append(have[part])
        sources.append(tuple(row))
    expected = tuple(part_shape) if part_shape is not None else None
    dtype = None
    for names in sources:
        for source in names:
            shape = tuple(shapes[source])
            if expected is None:
                expected = shape
            if len(shape) != 2 or shape != expected:
                raise ValueError(
                    f"per-expert tensor '{source}' has shape {list(shape)}, expected "
                    f"{list(expected)} (one part of stacked '{name}' "
                    f"[{num_experts}, {len(parts) * expected[0]}, {expected[1]}])"
                )
            if dtype is None:
                dtype = dtypes[source]
            elif dtypes[source] != dtype:
                raise ValueError(
                    f"per-expert tensor '{source}' has dtype {dtypes[source]}, but "
                    f"'{sources[0][0]}' of the same stacked tensor '{name}' has {dtype}"
                )
    assert expected is not None and dtype is not None, "num_experts must be > 0"
    return StackedExperts(name, dtype, tuple(sources), (expected[0], expected[1]))
