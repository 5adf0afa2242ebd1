"""Qwen2 (``Qwen2ForCausalLM``): everything m2nkit knows about the family.

Llama's layout (vLLM 0.33.0 ``model_executor/models/qwen2.py``), except that
``qkv_proj`` always has a bias (q/k/v biases split by heads exactly like the
weights, ``QKVParallelLinear(bias=True)``), ``o_proj`` and the MLP never do,
and ``head_dim`` is always ``hidden_size // num_attention_heads``: vLLM's
``Qwen2Attention`` ignores ``config.head_dim``. transformers 5 names every
tensor the same in memory and on disk.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .kinds import QKV, REPLICATED, ROW, VOCAB
from .llama import ATTENTION as A
from .llama import TP_PLAN, dense_mlp_params
from .sizes import base_sizes, cfg_get
from .table import Family, HFNaming, Param, TinyModel, kv_heads, qkv_feeds

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "FAMILY"]

ARCHITECTURE = "Qwen2ForCausalLM"

#: transformers 5: in-memory names are the on-disk names; no experts. Config-only
#: plans read ``config.json`` with ``Qwen2Config``'s defaults (transformers 5
#: ``configuration_qwen2.py``).
HF_NAMES = HFNaming(
    model_types=("qwen2",),
    config_defaults={"hidden_size": 4096, "vocab_size": 151936, "num_attention_heads": 32,
                     "num_hidden_layers": 32, "intermediate_size": 22016,
                     "tie_word_embeddings": False, "num_key_value_heads": kv_heads(32)},
)

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias")),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    *dense_mlp_params(bias_when=None),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

#: ``Param.when`` conditions: none (every parameter always exists).
CONDITIONS: dict = {}


def sizes(config: Any):
    """``Sizes`` of a Qwen2 config; ``hd`` is ``hidden_size // num_attention_heads``."""
    s = base_sizes(config, I=int(cfg_get(config, "intermediate_size")))
    return replace(s, hd=s.H // s.nh)  # vLLM Qwen2Attention ignores config.head_dim


def _head_dim(config: Any) -> int:
    return config.hidden_size // config.num_attention_heads


#: Tiny test models (``m2nkit.adapters.tiny``). transformers' config carries a
#: ``head_dim``; keep it equal to what vLLM uses when sizes are overridden.
TINY_MODELS = {"tiny-qwen2": TinyModel("qwen2", derived={"head_dim": _head_dim})}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/qwen2.py",
    module=__name__, tp_plan=TP_PLAN,  # Llama's: the same modules
)
