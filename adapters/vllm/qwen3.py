"""Qwen3ForCausalLM (vLLM 0.33.0 ``model_executor/models/qwen3.py``).

Llama's layout plus per-head ``q_norm``/``k_norm`` (size ``head_dim``,
replicated); ``attention_bias`` gives q/k/v biases only (``o_proj`` has
none). Tied (``tie_word_embeddings``) and untied checkpoints both occur
(Qwen3-0.6B is tied, Qwen3-8B is not).
"""

from __future__ import annotations

from typing import Any

from .llama import A, dense_layer_params
from .table import (QKV, REPLICATED, ROW, VOCAB, Family, Param, base_sizes, cfg_get, qkv_feeds)

__all__ = ["FAMILY", "PARAMS", "attention_params"]


def attention_params() -> tuple[Param, ...]:
    """Qwen3 attention of one layer; shared with Qwen3-MoE."""
    return (
        Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
        Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias"), when="attention_bias"),
        Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
        Param(f"{A}.q_norm.weight", REPLICATED, ("hd",)),
        Param(f"{A}.k_norm.weight", REPLICATED, ("hd",)),
    )


PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *attention_params(),
    *dense_layer_params(bias_when=None),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

CONDITIONS = {
    "attention_bias": lambda c, L: bool(cfg_get(c, "attention_bias", default=False)),
}


def sizes(config: Any):
    return base_sizes(config, I=int(cfg_get(config, "intermediate_size")))


FAMILY = Family("Qwen3ForCausalLM", PARAMS, sizes, CONDITIONS,
                source="vllm/model_executor/models/qwen3.py")
