"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): everything m2nkit knows about the family.

Restated from vLLM 0.33.0 ``model_executor/models/glm4_moe_lite.py`` and checked
against its real loaders (``tests/data/oracle/tiny-glm4-moe-lite``) and against
the layout traced from them (``tests/integration/test_vllm_trace.py``). The
family is composed of two others, and so is this module:

* **attention** is DeepSeek-V3's MLA: ``Glm4MoeLiteMLAAttention`` subclasses
  ``DeepseekV2MLAAttention`` (``deepseek_v2.py``), so the rows are
  ``deepseek_v3``'s (``fused_qkv_a_proj`` whole on every worker, ``q_b_proj``/
  ``kv_b_proj`` column, ``o_proj`` row, the ``self_attn.mla_attn.*`` aliases; the
  ``q_lora_rank: null`` variant too), and so are its sizes (``MlaSizes``);
* the **MoE block** is GLM-4.5's: ``Glm4MoeLite`` subclasses ``Glm4MoE``
  (``glm4_moe.py``), so the rows are ``glm4_moe.moe_params()``: a float32
  router weight (``GateLinear(params_dtype=torch.float32)``, stored in the
  model dtype), ``e_score_correction_bias`` float32 in every MoE layer whatever
  ``topk_method`` says, shared experts split by TP in every layout (no
  sequence-parallel wholeness as in DeepSeek-V3), no router alias;
* the **layers** follow DeepSeek-V3's rule (``Glm4MoeLiteDecoderLayer``): MoE
  when ``n_routed_experts`` is set, ``L >= first_k_dense_replace`` and ``L %
  moe_layer_freq == 0``; vLLM reads ``first_k_dense_replace`` unconditionally,
  and transformers' ``Glm4MoeLiteConfig`` has no such field (it keeps
  ``mlp_layer_types``, default ``["dense", "sparse", ...]``), so a config
  without it is refused (vLLM fails on it); a config whose ``mlp_layer_types``
  disagrees with vLLM's rule goes through transformers (``table_differs``);
* **MTP** layers are dropped by ``Glm4MoeLiteModel.load_weights``
  (``get_spec_layer_idx_from_weight_name``) and planned as skipped, as for
  DeepSeek-V3 (``glm4_moe_lite_mtp.py`` registers the same extra tensors).

vLLM's per-expert-only loader (``fused_moe_make_expert_params_mapping``) does
not matter to the table: the wire carries the experts stacked, and the table
says where each box lands. Refused: a ``quantization_config``, a config
vLLM does not serve with MLA (``DeepseekV2Attention``, plain MHA), and a tp
that does not divide the heads (``deepseek_v3.mla_heads_divide_tp``: vLLM refuses it
before it builds the model; MLA's row counts alone may still split).
"""

from __future__ import annotations

from typing import Any

from . import deepseek_v3 as ds
from . import glm4_moe as glm
from .kinds import REPLICATED, VOCAB
from .sizes import cfg_get
from .table import (TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param, SkippedLayers, TinyModel,
                    alias)

__all__ = ["ARCHITECTURE", "HF_NAMES", "EXPERTS_ON_DISK", "VLLM_PARAMS", "CONDITIONS",
           "TINY_MODELS", "FAMILY"]

ARCHITECTURE = "Glm4MoeLiteForCausalLM"

EXPERTS_ON_DISK = glm.EXPERTS_ON_DISK
M = glm.M


def _mlp_layer_types(c) -> list[str]:
    """``Glm4MoeLiteConfig.__post_init__``: the first layer dense, every other sparse."""
    types = c.get("mlp_layer_types")
    return types if types is not None else ["dense"] + ["sparse"] * (c["num_hidden_layers"] - 1)


#: transformers 5: no renames; DeepSeek-V3's attention order, GLM's MoE block order
#: (``experts``, ``gate``, ``shared_experts``). Config-only plans read ``config.json``
#: with ``Glm4MoeLiteConfig``'s defaults (transformers 5.12 ``configuration_glm4_moe_lite.py``;
#: ``head_dim`` is ``qk_rope_head_dim`` there, an ``attribute_map``).
HF_NAMES = HFNaming(
    fused_experts=TRANSFORMERS_FUSED_EXPERTS, experts_on_disk=EXPERTS_ON_DISK,
    child_order={**ds.HF_NAMES.child_order, M: ("experts", "gate", "shared_experts")},
    model_types=("glm4_moe_lite",),
    config_defaults={
        "hidden_size": 2048, "vocab_size": 154880, "num_attention_heads": 20,
        "num_key_value_heads": 20, "num_hidden_layers": 47, "intermediate_size": 10240,
        "moe_intermediate_size": 1536, "n_shared_experts": 1, "kv_lora_rank": 512,
        "q_lora_rank": 768, "v_head_dim": 256,
        "qk_nope_head_dim": 192, "n_group": 1, "tie_word_embeddings": False,
        "attention_bias": False,
        "n_routed_experts": alias("n_routed_experts", "num_local_experts", 64),
        # head_dim is an attribute_map alias of qk_rope_head_dim: a head_dim in the
        # file (null too) sets it
        "qk_rope_head_dim": alias("head_dim", "qk_rope_head_dim", 64),
        "head_dim": lambda c: c["qk_rope_head_dim"],
        "mlp_layer_types": _mlp_layer_types,
    },
    table_differs=lambda c: _table_differs(c),
    buffers=glm.HF_NAMES.buffers,
)

_ATTENTION = "model.layers.{L}.self_attn."

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``):
#: DeepSeek-V3's MLA rows, GLM-4.5's MoE rows.
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *(p for p in ds.VLLM_PARAMS if p.name.startswith(_ATTENTION)),
    *(p for p in ds.VLLM_PARAMS if p.when == "dense_layer"),
    *glm.moe_params(),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

#: ``Param.when`` conditions: MLA's from DeepSeek-V3, the MoE block's from GLM-4.5
#: with DeepSeek-V3's layer rule (``moe_layer_freq`` included).
CONDITIONS = {
    "q_lora": ds.CONDITIONS["q_lora"],
    "no_q_lora": ds.CONDITIONS["no_q_lora"],
    **glm.moe_conditions(ds.is_moe_layer),
}


def sizes(config: Any) -> ds.MlaSizes:
    """DeepSeek-V3's ``MlaSizes`` of a GLM-4.7-Flash config.

    Raises:
        ValueError: a ``quantization_config``; no ``first_k_dense_replace``
            (vLLM's ``Glm4MoeLiteDecoderLayer`` reads it); a config vLLM does not
            serve with MLA.
    """
    glm.no_quantization(config, ARCHITECTURE)
    if cfg_get(config, "first_k_dense_replace", default=None) is None:
        raise ValueError(
            f"{ARCHITECTURE} config has no first_k_dense_replace, which vLLM 0.33.0's "
            "Glm4MoeLiteDecoderLayer reads (transformers' Glm4MoeLiteConfig drops it; the "
            "published GLM-4.7-Flash config.json sets 1): add it to config.json")
    # MHA configs are refused by DeepSeek-V3's sizes, naming this architecture
    return ds.sizes(config)


def _table_differs(config: Any) -> str | None:
    """transformers' Glm4MoeLite makes layer ``L`` sparse by ``mlp_layer_types[L]``;
    vLLM by ``first_k_dense_replace`` and ``moe_layer_freq``."""
    types = cfg_get(config, "mlp_layer_types", default=None)
    if types is None or cfg_get(config, "first_k_dense_replace", default=None) is None:
        return None
    vllm = ["sparse" if ds.is_moe_layer(config, L) else "dense" for L in range(len(types))]
    if list(types) != vllm:
        return (f"mlp_layer_types {list(types)} disagrees with vLLM's first_k_dense_replace/"
                "moe_layer_freq rule: transformers' Glm4MoeLite follows mlp_layer_types")
    return None


#: Tiny test models (``m2nkit.adapters.tiny``): the shipped oracle checkpoint
#: (``tests/data/oracle/tiny-glm4-moe-lite``): hidden 32, 4 heads, MLA with
#: q_lora 16, kv_lora 16, rope 8, nope 16, v 16; layer 0 dense, layer 1 with 4
#: routed and 1 shared expert; ``noaux_tc`` (vLLM's router ignores it).
TINY_MODELS = {
    "tiny-glm4-moe-lite": TinyModel("glm4_moe_lite", {
        "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 32, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "num_experts": 4, "num_local_experts": 4, "n_shared_experts": 1,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "first_k_dense_replace": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.8}, {
        # transformers 5.12.1's Glm4MoeLiteConfig keeps a legacy num_experts field beside
        # n_routed_experts; vLLM reads n_routed_experts (glm4_moe_lite.py), Megatron-Bridge
        # reads num_experts first for num_moe_experts (conversion/model_bridge.py
        # CONFIG_MAPPING): TINY_SIZES' 8 would disagree with the 4 routed experts
        "num_experts": lambda c: c.n_routed_experts}),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, (ds.mla_heads_divide_tp,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/glm4_moe_lite.py",
    module=__name__, num_expert_group=glm.num_expert_group,
    skip=glm.mtp_skip(ARCHITECTURE, "glm4_moe_lite.py Glm4MoeLiteModel.load_weights"),
    skipped_layers=SkippedLayers(ds.mtp_layers, ds.MTP_EXTRAS),
)
