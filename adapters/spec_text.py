"""The text form both inference specs share: ``ENGINE:key=value,flag,...``.

``vllm:tp=2,dp=4,ep`` (``m2nkit.adapters.vllm.spec``) and ``sglang:tp=2,ep``
(``m2nkit.adapters.sglang.spec``) are one grammar with different keys: an
engine prefix, then comma-separated items, each ``key=value`` or a bare flag
(``ep``). This module owns that grammar and the errors about it (prefix,
empty or repeated items, sizes, flags, the worker-count guard); each spec
module owns its keys, their values and its own words for them. Checked
without torch, so a typo is refused at once.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["SpecItem", "spec_items", "positive_size", "flag", "check_sizes", "MAX_WORKERS"]

_INT = re.compile(r"^[0-9]+$")
#: Largest inference world m2nkit plans for (dp * tp workers).
MAX_WORKERS = 1 << 14


class SpecItem(NamedTuple):
    """One item of a spec: ``key`` (lower-case), ``value`` (stripped; ``""``
    for a bare flag), ``has_value`` (an ``=`` was written) and ``part``, the
    item as written, for error messages."""

    key: str
    value: str
    has_value: bool
    part: str


def spec_items(text: object, engine: str, label: str, syntax: str) -> list[SpecItem]:
    """Split ``"ENGINE:item,item,..."`` into its items, in order.

    Args:
        text: the spec as given.
        engine: the prefix it must have (``"vllm"``, ``"sglang"``; case-insensitive).
        label: the spec's name in messages (``"vLLM spec"``).
        syntax: the valid syntax, quoted in every error.

    Raises:
        ValueError: not a string; the engine name without ``:`` and settings;
            another prefix; an empty item; a key given twice.
    """
    if not isinstance(text, str):
        raise ValueError(f"{label} {text!r} is not a string; expected {syntax}")
    name, sep, body = text.strip().partition(":")
    if not sep and name.strip().lower() == engine:
        raise ValueError(f"inference spec {text!r} has no settings: write them after "
                         f"'{engine}:', like {engine}:tp=2; expected {syntax}")
    if not sep or name.strip().lower() != engine:
        raise ValueError(f"inference spec {text!r} must start with '{engine}:'; expected {syntax}")
    items: list[SpecItem] = []
    for raw in body.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"{label} {text!r} has an empty item; expected {syntax}")
        key, eq, value = (x.strip() for x in part.partition("="))
        key = key.lower()
        if any(i.key == key for i in items):
            raise ValueError(f"{label} {text!r} gives '{key}' twice; expected {syntax}")
        items.append(SpecItem(key, value, bool(eq), part))
    return items


def positive_size(item: SpecItem, text: str, label: str, syntax: str) -> int:
    """``tp=2`` -> 2. Raises ValueError naming the item unless the value is an int >= 1."""
    if not item.has_value or not _INT.match(item.value):
        raise ValueError(f"{label} {text!r}: '{item.part}' needs a positive int, like "
                         f"{item.key}=2; expected {syntax}")
    n = int(item.value)
    if n <= 0:
        raise ValueError(f"{label} {text!r}: '{item.part}' needs a positive int (>= 1), like "
                         f"{item.key}=2; expected {syntax}")
    return n


def flag(item: SpecItem, text: str, label: str, why: str = "") -> bool:
    """``ep``, ``ep=1``, ``ep=true`` -> True; ``ep=0``, ``ep=false`` -> False.

    Raises ValueError naming the item for any other value (``why``, if given,
    is added in parentheses)."""
    value = item.value.lower() if item.has_value else "true"
    if value not in ("1", "0", "true", "false"):
        k = item.key
        raise ValueError(f"{label} {text!r}: '{item.part}' must be '{k}', '{k}=1' or '{k}=0'"
                         + (f" ({why})" if why else ""))
    return value in ("1", "true")


def check_sizes(values: dict, text: str, label: str, syntax: str) -> None:
    """A spec names ``tp`` and plans at most ``MAX_WORKERS`` workers (``tp * dp``).

    Raises ValueError otherwise."""
    if "tp" not in values:
        raise ValueError(f"{label} {text!r} has no tp=...; expected {syntax}")
    workers = values["tp"] * values.get("dp", 1)
    if workers > MAX_WORKERS:
        raise ValueError(f"{label} {text!r}: tp*dp = {workers} workers is more than m2nkit "
                         f"plans for ({MAX_WORKERS})")
