"""Qwen3 (``Qwen3ForCausalLM``): everything m2nkit knows about the family.

Llama's layout plus per-head ``q_norm``/``k_norm`` (size ``head_dim``,
replicated); ``attention_bias`` gives q/k/v biases only (``o_proj`` has
none) (vLLM 0.33.0 ``model_executor/models/qwen3.py``). Tied
(``tie_word_embeddings``) and untied checkpoints both occur (Qwen3-0.6B is
tied, Qwen3-8B is not), so there are two tiny models. transformers 5 names
every tensor the same in memory and on disk.
"""

from __future__ import annotations

from typing import Any

from .kinds import QKV, REPLICATED, ROW, VOCAB
from .llama import ATTENTION as A
from .llama import TP_PLAN, dense_mlp_params
from .sizes import base_sizes, cfg_get
from .table import Family, HFNaming, Param, TinyModel, qkv_feeds

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "MEGATRON_NAMES", "FAMILY", "attention_params"]

ARCHITECTURE = "Qwen3ForCausalLM"

#: transformers 5: in-memory names are the on-disk names; no experts.
HF_NAMES = HFNaming()


def attention_params() -> tuple[Param, ...]:
    """Qwen3 attention of one layer; Qwen3-MoE reuses it."""
    return (
        Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
        Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias"), when="attention_bias"),
        Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
        Param(f"{A}.q_norm.weight", REPLICATED, ("hd",)),
        Param(f"{A}.k_norm.weight", REPLICATED, ("hd",)),
    )


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *attention_params(),
    *dense_mlp_params(bias_when=None),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "attention_bias": lambda c, L: bool(cfg_get(c, "attention_bias", default=False)),
}


def sizes(config: Any):
    """``Sizes`` of a Qwen3 config (``I`` = ``intermediate_size``)."""
    return base_sizes(config, I=int(cfg_get(config, "intermediate_size")))


#: Tiny test models (``m2nkit.adapters.tiny``): untied and tied embeddings.
TINY_MODELS = {
    "tiny-qwen3": TinyModel("qwen3", {"tie_word_embeddings": False}),
    "tiny-qwen3-tied": TinyModel("qwen3", {"tie_word_embeddings": True}),
}

MEGATRON_NAMES: tuple = ()
"""Megatron-Core parameter names -> wire tensors: empty until the Megatron
adapter fills it."""

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    megatron_names=MEGATRON_NAMES, vllm_source="vllm/model_executor/models/qwen3.py",
    module=__name__, tp_plan=TP_PLAN,  # Llama's: the same modules
)
