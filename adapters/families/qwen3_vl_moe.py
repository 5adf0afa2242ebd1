"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): Qwen3-MoE's table, Qwen3-VL's tower.

vLLM 0.33.0 ``model_executor/models/qwen3_vl_moe.py``:
``Qwen3VLMoeForConditionalGeneration`` (a ``Qwen3VLForConditionalGeneration``
with the same ``hf_to_vllm_mapper``) builds Qwen3-VL's vision tower
(``families/qwen3_vl.py``, :data:`~.qwen3_vl.VISION`) and ``language_model =
Qwen3MoeLLMForCausalLM(config.text_config)``, whose decoder layers are
``Qwen3VLMoeDecoderLayer(Qwen3MoeDecoderLayer)``: Qwen3-MoE's parameters
exactly (``families/qwen3_moe.py``: the router twice, experts under
``mlp.experts.routed_experts``, sparse layers by ``mlp_only_layers`` and
``decoder_sparse_step``), under Qwen3-VL's prefixes.

Experts: transformers 5 keeps them stacked in memory
(``mlp.experts.gate_up_proj`` ``[E, 2*Im, H]``, ``mlp.experts.down_proj``
``[E, H, Im]``) and the published checkpoints store them stacked too, but
``[E, in, out]``: transformers' ``conversion_mapping.py`` (``qwen3_vl_moe``:
``Transpose(1, 2)``) turns them as it loads, vLLM's ``RoutedExperts`` as it
reads (``Qwen3VLMoeDecoderLayer``: ``is_fused_checkpoint_transposed=True``).
The wire carries them ``[E, out, in]`` under the stacked wire names
(``mlp.experts.gate_up_proj.weight``) like every MoE family; the reader takes
the on-disk tensor as a permuted view (``HFNaming.stacked_order``).
transformers 5.12.1's ``save_pretrained`` writes them in the in-memory
order instead (tests/data/oracle/README.md); ``m2nkit.adapters.tiny`` turns
its tiny checkpoints to the published order.

``tie_word_embeddings``: vLLM copies the wrapper's top-level value into the
text config (``config/vllm.py``, ``VllmConfig.with_hf_config``), which has a
default of its own (``Qwen3VLMoeTextConfig``: ``True``); the table reads the
top level (``Part.inherit``), as vLLM does.
"""

from __future__ import annotations

from .qwen3_moe import FAMILY as QWEN3_MOE
from .qwen3_vl import TINY_VISION, VISION, WRAPPER_PREFIXES
from .table import TinyModel, alias, head_dim, kv_heads
from .wrapper import Part, wrapper_family

__all__ = ["ARCHITECTURE", "TEXT", "TEXT_DEFAULTS", "TINY_MODELS", "HF_NAMES", "VLLM_PARAMS",
           "CONDITIONS", "FAMILY"]

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"

#: ``Qwen3VLMoeTextConfig``'s defaults (transformers 5 ``configuration_qwen3_vl_moe.py``).
TEXT_DEFAULTS = {"hidden_size": 2048, "vocab_size": 151936, "num_attention_heads": 16,
                 "num_hidden_layers": 24, "intermediate_size": 5632, "attention_bias": False,
                 "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                 "num_experts": alias("num_experts", "num_local_experts", 60),
                 "mlp_only_layers": lambda c: c.get("mlp_only_layers") or [],
                 "num_key_value_heads": kv_heads(16), "head_dim": head_dim(None)}

TEXT = Part(QWEN3_MOE, "text_config", WRAPPER_PREFIXES["hf"], WRAPPER_PREFIXES["vllm"],
            inherit=("tie_word_embeddings",), config_defaults=TEXT_DEFAULTS)

#: Tiny test models (``m2nkit.adapters.tiny``): every layer sparse, untied.
TINY_MODELS = {
    "tiny-qwen3-vl-moe": TinyModel("qwen3_vl_moe", {
        "tie_word_embeddings": False, "vision_config": TINY_VISION,
        "text_config": {"decoder_sparse_step": 1, "mlp_only_layers": []}}),
}

FAMILY = wrapper_family(
    ARCHITECTURE, TEXT, (VISION,), model_types=("qwen3_vl_moe",),
    config_defaults={"tie_word_embeddings": False}, stacked_order=(0, 2, 1),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/qwen3_vl_moe.py",
    module=__name__,
)
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
