"""Architecture -> family table (``config.architectures[0]``).

Adding a model family is adding a module with a ``FAMILY`` and one line here.
"""

from __future__ import annotations

from typing import Any

from . import llama, mixtral, qwen2, qwen3, qwen3_moe
from .table import Family, cfg_get

__all__ = ["FAMILIES", "family_for", "supported_architectures"]

FAMILIES: dict[str, Family] = {
    m.FAMILY.architecture: m.FAMILY for m in (llama, qwen2, qwen3, qwen3_moe, mixtral)
}


def supported_architectures() -> list[str]:
    return sorted(FAMILIES)


def family_for(config: Any) -> Family:
    """The family of ``config.architectures[0]``.

    Raises:
        ValueError: no architectures, or one without a table (lists the
            supported ones).
    """
    archs = cfg_get(config, "architectures", default=None) or []
    if not archs:
        raise ValueError(
            f"model config has no 'architectures'; supported: {supported_architectures()}")
    arch = archs[0]
    try:
        return FAMILIES[arch]
    except KeyError:
        raise ValueError(
            f"architecture '{arch}' has no vLLM destination table; supported: "
            f"{supported_architectures()}") from None
