"""MixtralForCausalLM (vLLM 0.33.0 ``model_executor/models/mixtral.py``).

Every layer is sparse: router ``block_sparse_moe.gate`` (replicated; not
aliased, ``MixtralMoE`` does not hand it to ``FusedMoEFactory``) and experts
``w1`` (gate), ``w3`` (up), ``w2`` (down) of size ``intermediate_size``
(``ckpt_names=("w1", "w2", "w3")``). On the wire the experts arrive stacked:
``block_sparse_moe.experts.gate_up_proj.weight = cat(w1_e, w3_e)`` per
expert and ``block_sparse_moe.experts.down_proj.weight = w2_e``.
"""

from __future__ import annotations

from typing import Any

from .llama import A
from .table import (QKV, REPLICATED, ROW, VOCAB, W13, W2, Family, Param, base_sizes, cfg_get,
                    qkv_feeds)

__all__ = ["FAMILY", "PARAMS"]

B = "model.layers.{L}.block_sparse_moe"

PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    Param(f"{B}.gate.weight", REPLICATED, ("E", "H")),
    Param(f"{B}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"),
          feeds=((f"{B}.experts.gate_up_proj.weight", None),)),
    Param(f"{B}.{{experts}}.w2_weight", W2, ("E", "H", "Im"),
          feeds=((f"{B}.experts.down_proj.weight", None),)),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def sizes(config: Any):
    return base_sizes(
        config,
        Im=int(cfg_get(config, "intermediate_size")),
        E=int(cfg_get(config, "num_local_experts")),
        keys={"Im": "intermediate_size", "E": "num_local_experts"},
    )


FAMILY = Family("MixtralForCausalLM", PARAMS, sizes,
                source="vllm/model_executor/models/mixtral.py")
