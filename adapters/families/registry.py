"""Architecture -> model family: the one registry.

``config.architectures[0]`` names the family; :data:`ARCHITECTURES` maps it
to the module of this package that holds everything m2nkit knows about it.
Adding a family is adding that module and one line here.

The table is plain strings and family modules are imported only when a
family is asked for, so a tool can check an architecture, and refuse a bad
one with :func:`unsupported_architecture`, without importing torch or
transformers (a refusal in well under a second). Every place that refuses
an architecture uses that one message.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # the import would pull in torch
    from .table import Family

__all__ = [
    "ARCHITECTURES",
    "TINY_MODEL_ARCHITECTURES",
    "UnsupportedArchitecture",
    "supported_architectures",
    "unsupported_architecture",
    "check_architecture",
    "architecture_of",
    "family",
    "family_for",
    "has_table",
    "architecture_name",
    "TRACED_HINT",
]

#: ``config.architectures[0]`` -> module of ``m2nkit.adapters.families``.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5_vl",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_vl",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4_vl",
}


#: Built-in tiny models (``m2nkit.adapters.tiny.BUILTIN_TINY_MODELS``, from each family's
#: ``TINY_MODELS``) -> their architecture, as plain strings: the command line refuses a
#: misspelt name, or a tiny model a receiver cannot run, before torch is imported.
#: tests/adapters/test_families.py checks it against the families.
TINY_MODEL_ARCHITECTURES: dict[str, str] = {
    "tiny-llama": "LlamaForCausalLM",
    "tiny-qwen2": "Qwen2ForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-qwen3-tied": "Qwen3ForCausalLM",
    "tiny-qwen3-moe": "Qwen3MoeForCausalLM",
    "tiny-mixtral": "MixtralForCausalLM",
    "tiny-gpt-oss": "GptOssForCausalLM",
    "tiny-gemma2": "Gemma2ForCausalLM",
    "tiny-gemma3": "Gemma3ForCausalLM",
    "tiny-deepseek-v3": "DeepseekV3ForCausalLM",
    "tiny-deepseek-v3-fp8": "DeepseekV3ForCausalLM",
    "tiny-deepseek-v3-no-q-lora": "DeepseekV3ForCausalLM",
    "tiny-deepseek-v32": "DeepseekV32ForCausalLM",
    "tiny-glm-moe-dsa": "GlmMoeDsaForCausalLM",
    "tiny-qwen3-vl": "Qwen3VLForConditionalGeneration",
    "tiny-qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration",
    "tiny-glm4-moe": "Glm4MoeForCausalLM",
    "tiny-glm4-moe-lite": "Glm4MoeLiteForCausalLM",
    "tiny-qwen3-next": "Qwen3NextForCausalLM",
    "tiny-qwen3.5": "Qwen3_5ForCausalLM",
    "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM",
    "tiny-qwen3.5-vl": "Qwen3_5ForConditionalGeneration",
    "tiny-qwen3.5-moe-vl": "Qwen3_5MoeForConditionalGeneration",
    "tiny-llama4": "Llama4ForCausalLM",
    "tiny-llama4-vision": "Llama4ForConditionalGeneration",
}


class UnsupportedArchitecture(ValueError):
    """An architecture m2nkit has no family for (the message lists the supported ones)."""


def supported_architectures() -> list[str]:
    """The architectures m2nkit supports, sorted."""
    return sorted(ARCHITECTURES)


#: The second sentence of every refusal of an architecture without a table.
TRACED_HINT = ("an architecture without an m2nkit table is planned from vLLM's own weight "
               "loaders: --layout traced (needs vLLM installed)")


def unsupported_architecture(architecture: Any) -> str:
    """The one message refusing ``architecture`` where a family table is needed.

    ``architecture 'PhiForCausalLM' is not supported; supported:
    LlamaForCausalLM, MixtralForCausalLM, ...; an architecture without an
    m2nkit table is planned from vLLM's own weight loaders: --layout traced
    (needs vLLM installed)``.
    """
    return (f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}; {TRACED_HINT}")


def has_table(architecture: Any) -> bool:
    """Whether m2nkit has a family table for ``architecture`` (no import needed)."""
    return isinstance(architecture, str) and architecture in ARCHITECTURES


def check_architecture(architecture: Any) -> str:
    """``architecture`` if m2nkit supports it.

    Raises:
        UnsupportedArchitecture: otherwise (:func:`unsupported_architecture`).
    """
    if not isinstance(architecture, str) or architecture not in ARCHITECTURES:
        raise UnsupportedArchitecture(unsupported_architecture(architecture))
    return architecture


def architecture_name(config: Any) -> str | None:
    """``config.architectures[0]`` of a config object or ``config.json`` dict, unchecked (or ``None``)."""
    archs = config.get("architectures") if isinstance(config, Mapping) else getattr(
        config, "architectures", None)
    if isinstance(archs, str):
        return archs
    return archs[0] if isinstance(archs, (list, tuple)) and archs and isinstance(archs[0], str) \
        else None


def architecture_of(config: Any) -> str:
    """``config.architectures[0]`` of a config object or ``config.json`` dict, checked.

    Raises:
        UnsupportedArchitecture: no ``architectures``, or an unsupported one.
    """
    archs = config.get("architectures") if isinstance(config, Mapping) else getattr(
        config, "architectures", None)
    if not archs:
        raise UnsupportedArchitecture(
            "model config has no 'architectures' (a list like [\"Qwen3ForCausalLM\"]); "
            f"supported: {', '.join(supported_architectures())}")
    if isinstance(archs, str):
        archs = [archs]
    return check_architecture(archs[0])


def family(architecture: str) -> "Family":
    """The family of ``architecture`` (imports its module on first use).

    Raises:
        UnsupportedArchitecture: an architecture without a family.
    """
    check_architecture(architecture)
    module = importlib.import_module(f"{__package__}.{ARCHITECTURES[architecture]}")
    fam = module.FAMILY
    if fam.architecture != architecture:  # a registry typo, not user input
        raise RuntimeError(f"registry maps {architecture} to {module.__name__}, whose FAMILY "
                           f"is {fam.architecture}")
    return fam


def family_for(config: Any) -> "Family":
    """The family of ``config.architectures[0]`` (config object or ``config.json`` dict).

    (An architecture without a table: ``tableless.family_or_tableless``.)

    Raises:
        UnsupportedArchitecture: no ``architectures``, or one without a family
            (lists the supported ones).
    """
    return family(architecture_of(config))
