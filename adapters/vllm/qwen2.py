"""Qwen2ForCausalLM (vLLM 0.33.0 ``model_executor/models/qwen2.py``).

Like Llama, but ``qkv_proj`` always has a bias (q/k/v biases split by heads
exactly like the weights, ``QKVParallelLinear(bias=True)``), ``o_proj`` and
the MLP never do, and ``head_dim`` is always ``hidden_size //
num_attention_heads`` (``Qwen2Attention``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .llama import A, dense_layer_params
from .table import (QKV, REPLICATED, ROW, VOCAB, Family, Param, base_sizes, cfg_get, qkv_feeds)

__all__ = ["FAMILY", "PARAMS"]

PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias")),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    *dense_layer_params(bias_when=None),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def sizes(config: Any):
    s = base_sizes(config, I=int(cfg_get(config, "intermediate_size")))
    # vLLM Qwen2Attention ignores config.head_dim.
    return replace(s, hd=s.H // s.nh)


FAMILY = Family("Qwen2ForCausalLM", PARAMS, sizes,
                source="vllm/model_executor/models/qwen2.py")
