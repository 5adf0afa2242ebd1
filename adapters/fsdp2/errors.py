"""The one error of the FSDP2 source: a model it cannot send shard to shard.

Every part of :mod:`m2nkit.adapters.fsdp2` (the DTensor layout rules, the
names, the LoRA merge, the source) raises it, the same on every rank and
before any traffic, so a trainer catches one type.
"""

from __future__ import annotations

__all__ = ["FSDP2SourceError"]


class FSDP2SourceError(ValueError):
    """A model :func:`fsdp2_source` cannot send shard to shard (raised on every rank)."""

