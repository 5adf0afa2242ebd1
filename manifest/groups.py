"""Layer-wise groups of wire names: the unit a trainer gathers, frees and sends.

Engines that bound their buffers per group (and clients that report
progress per layer) need a partition of the model that every trainer rank
and every receiver derives identically from the metadata alone, without a
per-architecture naming table. Keying on the outermost integer segment of a
name does that for ``model.layers.N``, ``transformer.h.N``,
``decoder.layers.N`` and a vision tower's ``visual.blocks.N`` alike. Rules
from vLLM ``vllm/distributed/weight_transfer/base.py`` (``layerwise_groups``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["layerwise_groups", "stack_key"]

_INDEX = re.compile(r"[0-9]+")


def stack_key(name: str) -> tuple[str, int] | None:
    """``(prefix, index)`` of the outermost all-digit segment of ``name``, or ``None``.

    ``model.layers.3.mlp.experts.7.w1`` -> ``("model.layers", 3)``: the
    outermost index keeps a MoE layer (and its experts) in one group.
    Only ASCII digits count (``weight3`` is not an index segment).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if _INDEX.fullmatch(part):
            return ".".join(parts[:i]), int(part)
    return None


def layerwise_groups(names: Iterable[str]) -> list[list[str]]:
    """Partition wire names into the pre group, one group per stack index, the post group.

    * A name with an integer segment joins the group of its outermost
      ``(prefix, index)`` (see ``stack_key``).
    * Un-indexed names split by *position*: those before the first indexed
      name form the pre group (embeddings), every later un-indexed name goes
      to the post group (final norm, ``lm_head``), which comes last however
      early it arrived (a pipeline source may stream its last stage's output
      block before its layers).
    * Stack groups are ordered by first appearance of their prefix, then by
      ascending index; names inside a group keep their input order.

    Returns:
        ``list[list[str]]``: non-empty groups, each a list of names; every
        input name appears exactly once. Flattening it reproduces the input
        order when the input is already pre / layers ascending / post.

    Raises:
        TypeError: a name is not a string.
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"layerwise_groups: names must be strings, got {name!r}")
        key = stack_key(name)
        if key is None:
            (post if stacks else pre).append(name)
        else:
            stacks.setdefault(key, []).append(name)
    prefix_order: dict[str, int] = {}
    for prefix, _ in stacks:  # dict order = first appearance
        prefix_order.setdefault(prefix, len(prefix_order))
    ordered = sorted(stacks, key=lambda k: (prefix_order[k[0]], k[1]))
    groups = [pre] if pre else []
    groups += [stacks[k] for k in ordered]
    if post:
        groups.append(post)
    return groups
