"""Qwen3-MoE (``Qwen3MoeForCausalLM``): everything m2nkit knows about the family.

Qwen3 attention. Layer ``L`` is sparse (router ``mlp.gate`` replicated +
routed experts) when ``L not in mlp_only_layers and num_experts > 0 and
(L + 1) % decoder_sparse_step == 0`` (vLLM 0.33.0
``model_executor/models/qwen3_moe.py``, ``Qwen3MoeDecoderLayer``), else a
dense MLP like Qwen3's. The router is handed to
``FusedMoEFactory(gate=...)``, so vLLM 0.33 exposes it a second time as
``mlp.experts.gate.weight`` (an alias, ``{router_alias}`` in
``m2nkit.adapters.families.vllm_names``). vLLM refuses ``tp > num_experts``
(``Qwen3MoeSparseMoeBlock``). Shared experts
(``shared_expert_intermediate_size > 0``) are not in this table.

Experts: transformers 5 keeps them fused in memory
(``mlp.experts.gate_up_proj`` ``[E, 2*Im, H]``, ``mlp.experts.down_proj``
``[E, H, Im]``) and writes them per expert on disk
(``mlp.experts.{e}.gate_proj.weight`` ...); the wire carries them stacked
(``mlp.experts.gate_up_proj.weight``, ``mlp.experts.down_proj.weight``) and
vLLM holds them in ``mlp.{experts}.w13_weight``/``w2_weight``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .kinds import REPLICATED, VOCAB, W13, W2
from .llama import MLP as M
from .llama import dense_mlp_params
from .qwen3 import CONDITIONS as QWEN3_CONDITIONS
from .qwen3 import TP_PLAN, attention_params, o_proj_bias_differs
from .sizes import base_sizes, cfg_get
from .table import TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param, TinyModel, alias

__all__ = ["ARCHITECTURE", "HF_NAMES", "EXPERTS_ON_DISK", "VLLM_PARAMS", "CONDITIONS",
           "TINY_MODELS", "FAMILY", "is_moe_layer"]

ARCHITECTURE = "Qwen3MoeForCausalLM"

#: Expert fusing: the stacked wire tensors are built from these per-expert
#: on-disk tensors (part -> pattern; ``{prefix}`` = ``model.layers.{L}.mlp``).
EXPERTS_ON_DISK = {
    "gate": "{prefix}.experts.{e}.gate_proj.weight",
    "up": "{prefix}.experts.{e}.up_proj.weight",
    "down": "{prefix}.experts.{e}.down_proj.weight",
}

#: transformers 5: no renames; experts fused in memory, per expert on disk;
#: ``Qwen3MoeSparseMoeBlock`` registers ``experts`` before ``gate`` (vLLM: gate
#: first), which orders the wire tensors. Config-only plans read ``config.json``
#: with ``Qwen3MoeConfig``'s defaults (transformers 5 ``configuration_qwen3_moe.py``).
HF_NAMES = HFNaming(
    fused_experts=TRANSFORMERS_FUSED_EXPERTS, experts_on_disk=EXPERTS_ON_DISK,
    child_order={M: ("experts", "gate")},
    model_types=("qwen3_moe",),
    config_defaults={"hidden_size": 2048, "vocab_size": 151936, "num_attention_heads": 32,
                     "num_hidden_layers": 24, "intermediate_size": 6144,
                     "num_key_value_heads": 4, "tie_word_embeddings": False,
                     "attention_bias": False, "decoder_sparse_step": 1,
                     "moe_intermediate_size": 768,
                     "num_experts": alias("num_experts", "num_local_experts", 128),
                     "mlp_only_layers": lambda c: c.get("mlp_only_layers") or []},
    table_differs=o_proj_bias_differs,
)

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *attention_params(),
    Param(f"{M}.gate.weight", REPLICATED, ("E", "H"), when="moe_layer",
          aliases=(M + ".{router_alias}",)),
    Param(f"{M}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"), when="moe_layer",
          feeds=((f"{M}.experts.gate_up_proj.weight", None),)),
    Param(f"{M}.{{experts}}.w2_weight", W2, ("E", "H", "Im"), when="moe_layer",
          feeds=((f"{M}.experts.down_proj.weight", None),)),
    *dense_mlp_params(when="dense_layer", bias_when=None),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def _num_experts(config: Any) -> int:
    return int(cfg_get(config, "num_experts", "num_local_experts", default=0))


def is_moe_layer(config: Any, layer: int) -> bool:
    """vLLM ``Qwen3MoeDecoderLayer``: is layer ``layer`` sparse?"""
    only = cfg_get(config, "mlp_only_layers", default=[]) or []
    step = int(cfg_get(config, "decoder_sparse_step", default=1))
    return layer not in only and _num_experts(config) > 0 and (layer + 1) % step == 0


#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    **QWEN3_CONDITIONS,
    "moe_layer": is_moe_layer,
    "dense_layer": lambda c, L: not is_moe_layer(c, L),
}


def sizes(config: Any):
    """``Sizes`` of a Qwen3-MoE config.

    Raises:
        ValueError: ``shared_expert_intermediate_size > 0`` (shared experts).
    """
    if int(cfg_get(config, "shared_expert_intermediate_size", default=0)):
        raise ValueError(
            "Qwen3MoeForCausalLM with shared_expert_intermediate_size > 0 is not supported "
            "by m2nkit's table (shared experts); supported: plain Qwen3-MoE")
    return base_sizes(
        config,
        I=int(cfg_get(config, "intermediate_size", default=0)),
        Im=int(cfg_get(config, "moe_intermediate_size")),
        E=_num_experts(config),
    )


def _tp_within_experts(s, spec) -> str | None:
    if s.E and spec.tp > s.E:
        return (f"tp={spec.tp} is greater than num_experts={s.E} (vLLM "
                "Qwen3MoeSparseMoeBlock refuses it)")
    return None


#: Tiny test models (``m2nkit.adapters.tiny``): every layer sparse.
TINY_MODELS = {
    "tiny-qwen3-moe": TinyModel("qwen3_moe", {"decoder_sparse_step": 1, "mlp_only_layers": []}),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, (_tp_within_experts,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/qwen3_moe.py", module=__name__,
    # Qwen3's (dense layers' MLP: intermediate_size counts only when some layer is dense);
    # experts and routers stay whole on each TP rank
    tp_plan=replace(TP_PLAN, divides={"nkv": None, "nh": None, "I": "dense_layer"}),    # fp8_per_block (m2nkit.adapters.vllm.fp8): Qwen3's four, the router
    # (GateLinear(quant_config=quant_config) in models/qwen3_moe.py) and the experts
    online_fp8=(".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight",
                ".mlp.gate_up_proj.weight", ".mlp.down_proj.weight",
                ".mlp.gate.weight", ".w13_weight", ".w2_weight"),
)
