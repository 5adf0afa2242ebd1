"""In-memory parameter names -> wire names (Hugging Face checkpoint names), by the family.

After the wrapper prefixes are stripped (``m2nkit.adapters.module_names``),
the model's family (``m2nkit.adapters.families``: ``HFNaming``) renames,
re-fuses per-expert modules and permutes what it stores in another dim
order; a name must then be one vLLM takes or skips for the config, read
from the family table expanded by ``m2nkit.adapters.families.expand`` (the
expansion ``destination_layout`` binds), without importing the vLLM side.
This module holds no family knowledge.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..experts import expert_pattern_regex
from ..families.expand import expand
from ..families.table import Family, SplitOnLoad
from .errors import FSDP2SourceError
from .params import Weight

__all__ = ["known_wire_names", "wire_names", "SplitGroup"]


class SplitGroup(NamedTuple):
    """The in-memory parameters of one wire tensor transformers split as it loaded
    (``HFNaming.split_on_load``): ``parts[j]`` is part ``j`` of ``rule.parts``."""

    rule: SplitOnLoad
    parts: dict[int, Weight]


def known_wire_names(family: Family, config: Any) -> set[str]:
    """Wire names vLLM takes or skips for this config (the family table, expanded)."""
    ex = expand(family, config, family.sizes(config))
    return set(ex.feeds) | set(ex.skipped)


def wire_names(params: Sequence[Weight], family: Family, known: set[str]):
    """Each parameter's wire name, in ``named_parameters()`` order.

    Returns ``(order, groups)``: ``order`` lists ``(wire name, Weight)``, or
    ``(wire name, None)`` for a stacked tensor re-fused from per-expert
    parameters or from parameters transformers split as it loaded (at the
    place of its first part); ``groups[wire] = ({expert: {part: Weight}},
    parts)`` for the former, a :class:`SplitGroup` for the latter. Names
    follow the family's ``HFNaming``: in-memory fused experts
    (``fused_leaf``), per-expert names (``experts_on_disk``), renames
    (``disk_name``), split tensors (``split_on_load``).

    Raises:
        FSDP2SourceError: a name vLLM takes no tensor for (names the first,
            the count of others and the closest known name).
    """
    hf = family.hf
    permuted = getattr(hf, "permuted", None) or {}
    refusal = getattr(hf, "refusal", lambda name: None)
    split_part = getattr(hf, "split_part", lambda name: None)
    expert_rx = [(part, expert_pattern_regex(pat)) for part, pat in hf.experts_on_disk.items()]
    wire_of_part = {part: (leaf, parts) for leaf, parts in hf.fused_experts.values()
                    for part in parts}
    order: list[tuple[str, Weight | None]] = []
    groups: dict[str, tuple[dict[int, dict[str, Weight]], tuple[str, ...]]] = {}
    unknown: list[tuple[str, str]] = []
    for x in params:
        leaf = hf.fused_leaf(x.clean)
        if leaf is not None:
            wire_leaf, _ = hf.fused_experts[leaf]
            wire = f"{hf.disk_name(x.clean)[: -len(leaf) - 1]}.{wire_leaf}"
        else:
            disk = hf.disk_name(x.clean)
            why = refusal(disk)
            if why:
                raise FSDP2SourceError(f"fsdp2_source: parameter '{x.name}' cannot be sent: {why}")
            split = split_part(disk)
            if split is not None:  # one of the rows of a tensor transformers cut as it loaded
                rule, wire, j = split
                if wire not in groups:
                    groups[wire] = SplitGroup(rule, {})
                    order.append((wire, None))
                groups[wire].parts[j] = x
                continue
            leaf = next((leaf for leaf in permuted if disk.endswith("." + leaf)), None)
            if leaf is not None:  # the wire holds it in another dim order
                wire_leaf, x.order = permuted[leaf][0], tuple(permuted[leaf][1])
                wire = disk[: -len(leaf)] + wire_leaf
                if wire not in known:
                    unknown.append((x.name, wire))
                else:
                    order.append((wire, x))
                continue
            hit = next(((part, m) for part, rx in expert_rx if (m := rx.match(disk))), None)
            if hit is not None and hit[0] in wire_of_part:
                part, m = hit
                wire_leaf, parts = wire_of_part[part]
                wire = f"{m.group('prefix')}.{wire_leaf}"
                if wire not in groups:
                    groups[wire] = ({}, parts)
                    order.append((wire, None))
                groups[wire][0].setdefault(int(m.group("e")), {})[part] = x
                continue
            wire = disk
        if wire not in known:
            if not x.buffer:  # a persistent buffer no vLLM parameter takes is not a weight
                unknown.append((x.name, wire))
            continue
        order.append((wire, x))
    unknown += [(wire, wire) for wire in groups if wire not in known]
    if unknown:
        name, wire = unknown[0]
        close = difflib.get_close_matches(wire, sorted(known), n=1, cutoff=0.0)
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        shown = f"'{name}'" + (f" (wire name '{wire}')" if wire != name else "")
        raise FSDP2SourceError(
            f"fsdp2_source: parameter {shown}{more} maps to no {family.architecture} tensor "
            f"vLLM takes; the closest known name is '{close[0] if close else '?'}' "
            f"({family.module})")
    return order, groups

