"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's architecture under GLM's names and sizes.

vLLM 0.33.0 serves it with the generic DeepSeek classes
(``model_executor/models/deepseek_v2.py``: ``GlmMoeDsaForCausalLM`` subclasses
``DeepseekV2ForCausalLM`` and adds nothing; ``vllm/models/deepseek_v32/__init__.py``
picks it on CPU and XPU), so the table is :mod:`.deepseek_v32`'s (MLA, the DSA
indexer with ``wk_weights_proj`` whole on every worker and ``k_norm`` float32,
MoE with shared experts, the float32 ``e_score_correction_bias``, dense first
layers, the skipped MTP layer ``num_hidden_layers``), composed, not copied;
checked against ``tests/data/oracle/tiny-glm-moe-dsa``. Its
``_get_moe_router_dtype`` makes GLM-5's routing float32, which changes the
router's output dtype, not its parameter (bf16 in the dumps).

What differs is transformers' side (``glm_moe_dsa``, ``GlmMoeDsaConfig``): its
own defaults (78 layers, 64 heads, ``index_n_heads`` 32, ``n_group`` 1),
``num_local_experts`` meaning ``n_routed_experts``, and per-layer
``indexer_types``: a ``"shared"`` layer has no indexer in transformers'
model, while vLLM 0.33.0 does not read ``indexer_types`` (only
``index_topk_freq`` / ``index_topk_pattern``), so such a config is planned
through transformers (``table_differs``). The published GLM-5 config is bf16
(no ``quantization_config``); an fp8 one is planned as DeepSeek-V3.2's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from . import deepseek_v3 as v3
from . import deepseek_v32 as v32
from .table import Family, SkippedLayers, TinyModel, alias

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS", "FAMILY",
           "indexer_types"]

ARCHITECTURE = "GlmMoeDsaForCausalLM"
VLLM_PARAMS = v32.VLLM_PARAMS
CONDITIONS = v32.CONDITIONS


def indexer_types(c: Any) -> list[str]:
    """``HFNaming.config_defaults`` rule of ``GlmMoeDsaConfig.__post_init__``: the file's
    ``indexer_types``, else from ``index_topk_pattern`` (``"F"``/``"S"``), else from
    ``index_topk_freq`` and ``index_skip_topk_offset``."""
    types = c.get("indexer_types")
    if types is not None:
        return types
    pattern = c.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[x] for x in pattern] if isinstance(pattern, str) \
            else list(pattern)
    freq = max(c.get("index_topk_freq", 1), 1)
    offset = c.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
            for i in range(c["num_hidden_layers"])]


def _table_differs(config: Any) -> str | None:
    types = v3.cfg_get(config, "indexer_types", default=None) or ()
    if "shared" in types:
        return ("indexer_types has 'shared' layers: transformers' GlmMoeDsa builds no indexer "
                "there, vLLM 0.33.0 ignores indexer_types")
    return v32.dsa_table_differs(config)


HF_NAMES = replace(
    v32.HF_NAMES, model_types=("glm_moe_dsa",),
    config_defaults={
        **v32.dsa_config_defaults(
            hidden_size=6144, vocab_size=154880, num_attention_heads=64, num_hidden_layers=78,
            intermediate_size=12288, moe_intermediate_size=2048, n_shared_experts=1,
            q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
            v_head_dim=256, n_group=1, first_k_dense_replace=3, tie_word_embeddings=False,
            index_topk=2048, index_head_dim=128, index_n_heads=32,
            num_attention_heads_default=64,
            # GlmMoeDsaConfig.attribute_map: num_local_experts is n_routed_experts
            n_routed_experts=alias("n_routed_experts", "num_local_experts", 256)),
        "indexer_types": indexer_types,
    },
    table_differs=_table_differs,
)

#: Tiny test model: DeepSeek-V3.2's (:mod:`.deepseek_v32`), as ``glm_moe_dsa``.
TINY_MODELS = {"tiny-glm-moe-dsa": TinyModel("glm_moe_dsa", v32._TINY, v3._TINY_DERIVED)}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, v32.dsa_sizes, CONDITIONS, (v3.mla_heads_divide_tp,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/deepseek_v2.py", module=__name__,
    num_expert_group=v3._n_group, skip=v32.dsa_skip, notes=v32.dsa_notes,
    skipped_layers=SkippedLayers(v3.mtp_layers, v3.MTP_EXTRAS),
)
