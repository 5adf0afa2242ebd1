"""Llama (``LlamaForCausalLM``): everything m2nkit knows about the family.

The dense decoder the Qwen families build on: attention ``q/k/v_proj`` fused
into vLLM's ``qkv_proj``, MLP ``gate_proj/up_proj`` into ``gate_up_proj``
(vLLM 0.33.0 ``model_executor/models/llama.py``, ``stacked_params_mapping``).
Biases follow the config: ``attention_bias`` (or ``bias``) gives q/k/v and
``o_proj`` biases, ``qkv_bias`` overrides the q/k/v one (InternLM3),
``mlp_bias`` gives ``gate_up_proj``/``down_proj`` biases
(``LlamaDecoderLayer.__init__``); a row-parallel bias is replicated.
transformers 5 names every tensor the same in memory and on disk.
"""

from __future__ import annotations

from typing import Any

from .kinds import MERGED, QKV, REPLICATED, ROW, VOCAB
from .sizes import base_sizes, cfg_get
from .table import (COLWISE, ROWWISE, Family, HFNaming, Param, TinyModel, TPPlan, head_dim,
                    kv_heads, merged_feeds, qkv_feeds)

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "FAMILY", "dense_mlp_params", "ATTENTION", "MLP", "ATTENTION_TP", "MLP_TP",
           "EMBEDDINGS_TP", "TP_PLAN"]

ARCHITECTURE = "LlamaForCausalLM"

def _bias_differs(config: Any) -> str | None:
    """transformers' Llama gives q/k/v and ``o_proj`` biases by ``attention_bias`` alone;
    vLLM also reads ``bias`` and ``qkv_bias`` (``LlamaDecoderLayer``)."""
    attention = bool(cfg_get(config, "attention_bias", default=False))
    vllm = (CONDITIONS["qkv_bias"](config, None), CONDITIONS["o_proj_bias"](config, None))
    if vllm != (attention, attention):
        return ("'bias'/'qkv_bias' disagree with attention_bias: transformers' LlamaAttention "
                "follows attention_bias only, vLLM's also reads them")
    return None


#: transformers 5: in-memory names are the on-disk names; no experts. Config-only
#: plans read ``config.json`` with ``LlamaConfig``'s defaults (transformers 5
#: ``configuration_llama.py``: dataclass fields and ``__post_init__``).
HF_NAMES = HFNaming(
    model_types=("llama",),
    config_defaults={"hidden_size": 4096, "vocab_size": 32000, "num_attention_heads": 32,
                     "num_hidden_layers": 32, "intermediate_size": 11008,
                     "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                     "head_dim": head_dim(None), "num_key_value_heads": kv_heads(None)},
    table_differs=_bias_differs,
)

#: Name prefixes of one layer's attention and MLP (``{L}``: the layer).
ATTENTION = "model.layers.{L}.self_attn"
MLP = "model.layers.{L}.mlp"


def dense_mlp_params(mlp: str = MLP, when: str | None = None,
                     bias_when: str | None = "mlp_bias") -> tuple[Param, ...]:
    """The dense (SwiGLU) MLP of one layer under ``mlp``; Qwen2/Qwen3/Qwen3-MoE reuse it.

    ``when``: condition for the whole MLP (Qwen3-MoE dense layers);
    ``bias_when``: condition for the biases, ``None`` for a family without.
    """
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


A = ATTENTION

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias"), when="qkv_bias"),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    Param(f"{A}.o_proj.bias", REPLICATED, ("H",), when="o_proj_bias"),
    *dense_mlp_params(),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


#: Tensor parallelism as trainers apply it (torchtitan ``parallelize_llama``;
#: transformers ``LlamaConfig.base_model_tp_plan`` lists the same layer
#: modules): q/k/v column-parallel (heads split), ``o_proj`` row-parallel;
#: the SwiGLU MLP ``gate``/``up`` column-, ``down`` row-parallel; the
#: embedding row-parallel (vocab rows) and the LM head column-parallel when
#: not tied. Norms stay whole on every TP rank. The Qwen families reuse the parts.
ATTENTION_TP = {f"{A}.q_proj": COLWISE, f"{A}.k_proj": COLWISE, f"{A}.v_proj": COLWISE,
                f"{A}.o_proj": ROWWISE}
MLP_TP = {f"{MLP}.gate_proj": COLWISE, f"{MLP}.up_proj": COLWISE, f"{MLP}.down_proj": ROWWISE}
EMBEDDINGS_TP = {"model.embed_tokens": ROWWISE, "lm_head": COLWISE}
#: ``divides``: whole heads per TP rank, and the MLP's intermediate size split evenly.
TP_PLAN = TPPlan({**ATTENTION_TP, **MLP_TP}, untied=EMBEDDINGS_TP,
                 divides={"nkv": None, "nh": None, "I": None})


def _attention_bias(config: Any) -> bool:
    return bool(cfg_get(config, "attention_bias", default=False)
                or cfg_get(config, "bias", default=False))


#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "qkv_bias": lambda c, L: bool(cfg_get(c, "qkv_bias", default=_attention_bias(c))),
    "o_proj_bias": lambda c, L: _attention_bias(c),
    "mlp_bias": lambda c, L: bool(cfg_get(c, "mlp_bias", default=False)),
}


def sizes(config: Any):
    """``Sizes`` of a Llama config (``I`` = ``intermediate_size``)."""
    return base_sizes(config, I=int(cfg_get(config, "intermediate_size")))


#: Tiny test models (``m2nkit.adapters.tiny``).
TINY_MODELS = {"tiny-llama": TinyModel("llama")}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/llama.py",
    module=__name__, tp_plan=TP_PLAN,
)
