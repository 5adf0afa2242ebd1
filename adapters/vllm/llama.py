"""LlamaForCausalLM (vLLM 0.33.0 ``model_executor/models/llama.py``).

Attention ``q/k/v_proj -> qkv_proj``, MLP ``gate_proj/up_proj ->
gate_up_proj`` (``LlamaModel.hf_to_vllm_mapper``). Biases follow the config:
``attention_bias`` (or ``bias``) gives q/k/v and o_proj biases, ``qkv_bias``
overrides the q/k/v one (InternLM3), ``mlp_bias`` gives gate_up/down biases
(``LlamaDecoderLayer.__init__``). A row-parallel bias is replicated.
"""

from __future__ import annotations

from typing import Any

from .table import (MERGED, QKV, REPLICATED, ROW, VOCAB, Family, Param, base_sizes, cfg_get,
                    merged_feeds, qkv_feeds)

__all__ = ["FAMILY", "PARAMS", "dense_layer_params"]

A = "model.layers.{L}.self_attn"
M = "model.layers.{L}.mlp"


def dense_layer_params(mlp: str = M, when: str | None = None,
                       bias_when: str | None = "mlp_bias") -> tuple[Param, ...]:
    """The dense (SwiGLU) MLP of one layer under ``mlp``; shared by families."""
    out = (
        Param(f"{mlp}.gate_up_proj.weight", MERGED, ("I", "H"), when=when,
              feeds=merged_feeds(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")),
        Param(f"{mlp}.down_proj.weight", ROW, ("H", "I"), when=when),
    )
    if bias_when is None:
        return out
    return (
        out[0],
        Param(f"{mlp}.gate_up_proj.bias", MERGED, ("I",), when=bias_when,
              feeds=merged_feeds(f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias")),
        out[1],
        Param(f"{mlp}.down_proj.bias", REPLICATED, ("H",), when=bias_when),
    )


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias"), when="qkv_bias"),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    Param(f"{A}.o_proj.bias", REPLICATED, ("H",), when="o_proj_bias"),
    *dense_layer_params(),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def _attention_bias(config: Any) -> bool:
    return bool(cfg_get(config, "attention_bias", default=False)
                or cfg_get(config, "bias", default=False))


CONDITIONS = {
    "qkv_bias": lambda c, L: bool(cfg_get(c, "qkv_bias", default=_attention_bias(c))),
    "o_proj_bias": lambda c, L: _attention_bias(c),
    "mlp_bias": lambda c, L: bool(cfg_get(c, "mlp_bias", default=False)),
}


def sizes(config: Any):
    return base_sizes(config, I=int(cfg_get(config, "intermediate_size")))


FAMILY = Family("LlamaForCausalLM", PARAMS, sizes, CONDITIONS,
                source="vllm/model_executor/models/llama.py")
