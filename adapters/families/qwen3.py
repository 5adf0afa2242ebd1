"""Qwen3 (``Qwen3ForCausalLM``): everything m2nkit knows about the family.

Llama's layout plus per-head ``q_norm``/``k_norm`` (size ``head_dim``,
replicated); ``attention_bias`` gives q/k/v biases only (``o_proj`` has
none) (vLLM 0.33.0 ``model_executor/models/qwen3.py``). Tied
(``tie_word_embeddings``) and untied checkpoints both occur (Qwen3-0.6B is
tied, Qwen3-8B is not), so there are two tiny models. transformers 5 names
every tensor the same in memory and on disk.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .kinds import QKV, REPLICATED, ROW, VOCAB
from .llama import ATTENTION as A
from .llama import TP_PLAN as LLAMA_TP_PLAN
from .llama import dense_mlp_params
from .sizes import base_sizes, cfg_get
from .table import Family, HFNaming, Param, TinyModel, kv_heads, qkv_feeds

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "FAMILY", "attention_params", "TP_PLAN"]

ARCHITECTURE = "Qwen3ForCausalLM"

def o_proj_bias_differs(config: Any) -> str | None:
    """transformers' Qwen3 attention gives ``o_proj`` a bias with ``attention_bias``;
    vLLM's ``Qwen3Attention`` never has one."""
    if cfg_get(config, "attention_bias", default=False):
        return ("attention_bias=True: transformers' Qwen3 attention has an o_proj bias that "
                "vLLM's Qwen3Attention lacks")
    return None


#: Config-only plans read ``config.json`` with ``Qwen3Config``'s defaults
#: (transformers 5 ``configuration_qwen3.py``).
QWEN3_DEFAULTS = {"hidden_size": 4096, "vocab_size": 151936, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "intermediate_size": 22016, "head_dim": 128,
                  "tie_word_embeddings": False, "attention_bias": False,
                  "num_key_value_heads": kv_heads(32)}

#: transformers 5: in-memory names are the on-disk names; no experts.
HF_NAMES = HFNaming(model_types=("qwen3",), config_defaults=QWEN3_DEFAULTS,
                    table_differs=o_proj_bias_differs)


#: Tensor parallelism as trainers apply it: Llama's plan, plus the per-head
#: ``q_norm``/``k_norm``, whole on every TP rank but fed only that rank's
#: heads, so their gradients are summed over TP (``Qwen3Config.base_model_tp_plan``:
#: ``replicated_with_grad_allreduce``).
TP_PLAN = replace(LLAMA_TP_PLAN, grad_allreduce=(f"{A}.q_norm", f"{A}.k_norm"))


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

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/qwen3.py",
    module=__name__, tp_plan=TP_PLAN,    # vLLM's fp8_per_block quantizes every LinearBase built with quant_config
    # (m2nkit.adapters.vllm.fp8): Qwen3Attention's and Qwen3MLP's four
    online_fp8=(".self_attn.qkv_proj.weight", ".self_attn.o_proj.weight",
                ".mlp.gate_up_proj.weight", ".mlp.down_proj.weight"),
)
