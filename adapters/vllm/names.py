"""vLLM parameter names that differ between vLLM versions (the table is the families').

The table completes the family tables' vLLM names, and the trainer side reads
it too, so it lives in :mod:`m2nkit.adapters.families.vllm_names`; this module
keeps the vLLM side's name for it.
"""

from __future__ import annotations

from ..families.vllm_names import DEFAULT_VLLM_VERSION, VLLM_NAMES, vllm_names

__all__ = ["VLLM_NAMES", "DEFAULT_VLLM_VERSION", "vllm_names"]
