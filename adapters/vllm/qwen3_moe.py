"""Qwen3MoeForCausalLM (vLLM 0.33.0 ``model_executor/models/qwen3_moe.py``).

Qwen3 attention; layer ``L`` is sparse (router ``mlp.gate`` replicated +
fused experts) when ``L not in mlp_only_layers and num_experts > 0 and
(L + 1) % decoder_sparse_step == 0`` (``Qwen3MoeDecoderLayer``), else a dense
MLP like Qwen3's. The router is handed to ``FusedMoEFactory(gate=...)``, so
vLLM 0.33 exposes it a second time as ``mlp.experts.gate.weight`` (an alias,
``names.py``). Experts arrive stacked on the wire and land in
``mlp.{experts}.w13_weight``/``w2_weight``. vLLM refuses ``tp >
num_experts`` (``Qwen3MoeSparseMoeBlock``); shared experts
(``shared_expert_intermediate_size > 0``) are not in this table.
"""

from __future__ import annotations

from typing import Any

from .llama import M, dense_layer_params
from .qwen3 import CONDITIONS as QWEN3_CONDITIONS
from .qwen3 import attention_params
from .table import REPLICATED, VOCAB, W13, W2, Family, Param, base_sizes, cfg_get

__all__ = ["FAMILY", "PARAMS", "is_moe_layer"]

PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *attention_params(),
    Param(f"{M}.gate.weight", REPLICATED, ("E", "H"), when="moe_layer",
          aliases=(M + ".{router_alias}",)),
    Param(f"{M}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"), when="moe_layer",
          feeds=((f"{M}.experts.gate_up_proj.weight", None),)),
    Param(f"{M}.{{experts}}.w2_weight", W2, ("E", "H", "Im"), when="moe_layer",
          feeds=((f"{M}.experts.down_proj.weight", None),)),
    *dense_layer_params(when="dense_layer", bias_when=None),
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


CONDITIONS = {
    **QWEN3_CONDITIONS,
    "moe_layer": is_moe_layer,
    "dense_layer": lambda c, L: not is_moe_layer(c, L),
}


def sizes(config: Any):
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


FAMILY = Family("Qwen3MoeForCausalLM", PARAMS, sizes, CONDITIONS, (_tp_within_experts,),
                source="vllm/model_executor/models/qwen3_moe.py")
