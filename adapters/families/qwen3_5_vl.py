"""Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3.5's GDN table and Qwen3-VL's tower.

This module holds the dense wrapper and what the MoE one
(``Qwen3_5MoeForConditionalGeneration``, ``families/qwen3_5_moe_vl.py``)
shares with it.

vLLM 0.33.0 ``model_executor/models/qwen3_5.py``: both wrappers build
``visual = Qwen3_VisionTransformer(config.vision_config)`` (``qwen3_vl.py``)
and then ``language_model = Qwen3_5ForCausalLM`` (resp.
``Qwen3_5MoeForCausalLM``) of the text config; ``hf_to_vllm_mapper`` is
``Qwen3VLForConditionalGeneration``'s (``model.visual.`` -> ``visual.``,
``model.language_model.`` -> ``language_model.model.``, ``lm_head.`` ->
``language_model.lm_head.``) plus ``mtp.`` -> dropped (the MTP draft model
loads it). So the tables are composed (``families/wrapper.py``), not
written again:

* the text part is the Gated DeltaNet table of ``families/qwen3_5.py``
  (:data:`~.qwen3_5.FAMILY`) or ``families/qwen3_5_moe.py``
  (:data:`~.qwen3_5_moe.FAMILY`) under Qwen3-VL's prefixes
  (:data:`~.qwen3_vl.WRAPPER_PREFIXES`), plus ``mtp.`` kept as is on the wire
  so that the text family's ``mtp.*`` skip (``qwen3_next.mtp_skip``) names
  the published checkpoints' top-level MTP tensors; the text sub-config's
  class is the text family's own (``Qwen3_5TextConfig``,
  ``Qwen3_5MoeTextConfig``), so its defaults are;
* the vision tower is Qwen3-VL's (:data:`~.qwen3_vl.VISION`) with the
  defaults of ``Qwen3_5VisionConfig`` / ``Qwen3_5MoeVisionConfig``
  (transformers 5 ``configuration_qwen3_5*.py``), which have **no
  ``deepstack_visual_indexes``**: vLLM's tower then builds no
  ``deepstack_merger_list`` (``hasattr(vision_config, ...)``, else ``[]``),
  and the published configs spell it ``[]``. transformers'
  ``Qwen3_5VisionModel`` has no deepstack mergers at all, so a config that
  lists some is refused (vLLM would build parameters no checkpoint holds).

``tie_word_embeddings``: vLLM copies the wrapper's top-level value into the
text config (``config/vllm.py``, ``VllmConfig.with_hf_config``); the table
reads the top level (``Part.inherit``; ``Qwen3_5Config``'s default
``False``). MoE experts: per expert on disk (``experts.N.gate_proj``), stacked
on the wire (``mlp.experts.gate_up_proj.weight``), as the text family's.
Refused as the text families refuse (quantized configs, the
``quantization_config`` read at the wrapper's top level too, attention biases,
no output gate, ``tp > num_experts``); the vision heads bound tp as
Qwen3-VL's (``mm_encoder_tp_mode="data"`` is not in the table).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .qwen3_5 import FAMILY as QWEN3_5
from .qwen3_vl import VISION, VISION_DEFAULTS, WRAPPER_PREFIXES, vision_symbols
from .qwen3_next import TINY_LINEAR
from .sizes import cfg_get
from .table import Family, TinyModel
from .wrapper import Part, Tower, wrapper_family

__all__ = ["ARCHITECTURE", "VISION_35", "VISION_35_DEFAULTS", "TEXT_PREFIXES",
           "qwen3_5_wrapper", "TINY_TEXT", "TINY_VISION", "TINY_TOKENS", "TINY_MODELS",
           "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "FAMILY"]

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"

#: ``Qwen3_5VisionConfig``'s defaults (``Qwen3_5MoeVisionConfig`` has the same): Qwen3-VL's
#: but no ``deepstack_visual_indexes``.
VISION_35_DEFAULTS = {k: v for k, v in VISION_DEFAULTS.items() if k != "deepstack_visual_indexes"}


def _vision_symbols(vc: Any) -> dict[str, int]:
    """Qwen3-VL's tower symbols (``qwen3_vl.vision_symbols``), with no deepstack merger.

    Raises:
        ValueError: ``deepstack_visual_indexes`` non-empty (transformers'
            ``Qwen3_5VisionModel`` has no deepstack mergers), or what
            ``vision_symbols`` refuses.
    """
    deep = cfg_get(vc, "deepstack_visual_indexes", default=()) or ()
    if deep:
        raise ValueError(f"vision_config deepstack_visual_indexes={list(deep)!r} is not "
                         "supported for Qwen3.5 (transformers' Qwen3_5VisionModel has no "
                         "deepstack mergers, vLLM's Qwen3_VisionTransformer would build "
                         "them); supported: [] or absent, as Qwen3.5 ships")
    return vision_symbols(vc)


#: Qwen3-VL's vision tower with Qwen3.5's vision-config defaults.
VISION_35: Tower = replace(VISION, name="Qwen3.5 vision tower", symbols=_vision_symbols,
                           config_defaults=VISION_35_DEFAULTS)

#: Wire prefixes: Qwen3-VL's, plus the top-level ``mtp.`` (skipped by the text family).
TEXT_PREFIXES = {"hf": {**WRAPPER_PREFIXES["hf"], "mtp.": "mtp."},
                 "vllm": WRAPPER_PREFIXES["vllm"]}


#: The tiny test models' sub-configs: the shipped tests/data/oracle/tiny-qwen3.5-vl's
#: (text: hidden 64, 4 query heads of 16 over 2 KV heads, 4 key / 8 value heads of 8,
#: layer 0 linear attention, layer 1 full; vision: 2 blocks of 4 heads of 4, untied).
TINY_TEXT = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 32, **TINY_LINEAR,
             "full_attention_interval": 2, "attn_output_gate": True,
             "mamba_ssm_dtype": "float32",
             "rope_parameters": {"mrope_interleaved": True, "mrope_section": [1, 1, 0],
                                 "rope_type": "default", "rope_theta": 10000000,
                                 "partial_rotary_factor": 0.25}}
TINY_VISION = {"depth": 2, "hidden_size": 16, "num_heads": 4, "intermediate_size": 32,
               "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
               "num_position_embeddings": 16, "out_hidden_size": 64, "in_channels": 3,
               "deepstack_visual_indexes": []}
#: The multimodal token ids, inside the tiny vocab (200).
TINY_TOKENS = {"image_token_id": 196, "video_token_id": 197, "vision_start_token_id": 198,
               "vision_end_token_id": 199}


def qwen3_5_wrapper(architecture: str, text: Family, model_type: str, module: str,
                    tiny: dict[str, TinyModel]) -> Family:
    """The wrapper family of Qwen3.5 text family ``text``: its table under
    :data:`TEXT_PREFIXES`, then :data:`VISION_35` before it (vLLM builds the tower
    first). The text family reads ``text_config``, and at the top level
    ``tie_word_embeddings`` (vLLM copies it into the text config) and
    ``quantization_config`` (where the hub's quantized wrappers hold it: the text
    family refuses it)."""
    part = Part(text, "text_config", TEXT_PREFIXES["hf"], TEXT_PREFIXES["vllm"],
                inherit=("tie_word_embeddings", "quantization_config"))
    fam = wrapper_family(
        architecture, part, (VISION_35,), model_types=(model_type,),
        config_defaults={"tie_word_embeddings": False}, tiny=tiny,
        vllm_source="vllm/model_executor/models/qwen3_5.py", module=module)

    def sizes(config: Any):
        """The text family's sizes of ``text_config`` plus the tower's symbols.

        Raises:
            ValueError: a ``quantization_config`` (at the top level or in
                ``text_config``), or what the text family or the tower refuse.
        """
        q = cfg_get(config, "quantization_config", default=None) or cfg_get(
            cfg_get(config, "text_config", default={}) or {}, "quantization_config",
            default=None)
        if q:
            method = q.get("quant_method") if hasattr(q, "get") else getattr(
                q, "quant_method", q)
            raise ValueError(f"{architecture} with a quantization_config (quant_method "
                             f"{method!r}) is not supported by m2nkit's table ({module}: the "
                             "Gated DeltaNet tables have no quantized layers); supported: the "
                             "unquantized (bf16) form, the same config without "
                             "quantization_config")
        return fam.sizes(config)

    return replace(fam, sizes=sizes)


#: Tiny test model (``m2nkit.adapters.tiny``): the shipped fixture's sizes.
TINY_MODELS = {
    "tiny-qwen3.5-vl": TinyModel("qwen3_5", {"tie_word_embeddings": False, **TINY_TOKENS,
                                             "text_config": TINY_TEXT,
                                             "vision_config": TINY_VISION}),
}

FAMILY = qwen3_5_wrapper(ARCHITECTURE, QWEN3_5, "qwen3_5", __name__, TINY_MODELS)
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
