"""Gemma 2 (``Gemma2ForCausalLM``): everything m2nkit knows about the family.

Llama's fused ``qkv_proj`` and ``gate_up_proj`` (vLLM 0.33.0
``model_executor/models/gemma2.py``, ``hf_to_vllm_mapper``
``orig_to_new_stacked``), with Gemma's differences, checked bit for bit
with vLLM's real loaders (``tests/data/oracle/tiny-gemma2``):

* **Four norms per layer**, all ``GemmaRMSNorm`` and replicated:
  ``input_layernorm``, ``post_attention_layernorm``,
  ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``, and
  ``model.norm``. vLLM stores the checkpoint's ``gamma`` as it is and adds
  the 1 at run time (``layers/layernorm.py`` ``GemmaRMSNorm``: ``x * (1 +
  w)``; its loader is the default copy), so the wire carries the
  checkpoint's tensor unchanged. (A trainer holding ``1 + gamma``, as
  Megatron's non-zero-centred norms do, must subtract 1 on its side.)
* **Embedding.** Stored unscaled: vLLM multiplies by ``sqrt(hidden_size)``
  at run time (``Gemma2Model.normalizer`` buffer, ``embed_input_ids``), so
  the wire carries ``embed_tokens`` as stored.
* **Always tied, no ``lm_head``.** ``Gemma2ForCausalLM`` computes logits
  with ``model.embed_tokens`` and has no ``lm_head`` parameter at all; a
  checkpoint holding ``lm_head.weight`` makes vLLM's loader fail ("There is
  no module or parameter named 'lm_head'"). So ``tie_word_embeddings=False``
  is refused, and a wire ``lm_head.weight`` is reported as taken by no
  parameter.
* **Biases.** ``attention_bias`` gives ``qkv_proj`` and ``o_proj`` biases
  (``Gemma2Attention``); the MLP has none. ``head_dim`` comes from the
  config (``num_attention_heads * head_dim`` need not be ``hidden_size``:
  gemma-2-2b has 8 x 256 over 2304).

transformers 5 names every tensor the same in memory and on disk.
"""

from __future__ import annotations

from typing import Any

from .kinds import QKV, REPLICATED, ROW, VOCAB
from .llama import ATTENTION as A
from .llama import dense_mlp_params
from .sizes import base_sizes, cfg_get
from .table import Family, HFNaming, Param, TinyModel, qkv_feeds

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "FAMILY", "attention_params", "layer_norm_params", "sizes_of"]

ARCHITECTURE = "Gemma2ForCausalLM"

#: ``Gemma2Config``'s defaults (transformers 5 ``configuration_gemma2.py``) for
#: the keys the table reads; Gemma 3 text shares them but for the vocabulary.
GEMMA_DEFAULTS = {"hidden_size": 2304, "vocab_size": 256000, "num_attention_heads": 8,
                  "num_hidden_layers": 26, "intermediate_size": 9216, "num_key_value_heads": 4,
                  "head_dim": 256, "tie_word_embeddings": True, "attention_bias": False}

#: transformers 5: in-memory names are the on-disk names; no experts.
HF_NAMES = HFNaming(model_types=("gemma2",), config_defaults=GEMMA_DEFAULTS)


def attention_params() -> tuple[Param, ...]:
    """Gemma attention of one layer (no q/k norms); Gemma 3 adds its norms after ``o_proj``."""
    return (
        Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
        Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(A, "bias"), when="attention_bias"),
        Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
        Param(f"{A}.o_proj.bias", REPLICATED, ("H",), when="attention_bias"),
    )


def layer_norm_params() -> tuple[Param, ...]:
    """The four ``GemmaRMSNorm`` of one layer, in vLLM's order; Gemma 3 reuses them."""
    return tuple(Param(f"model.layers.{{L}}.{n}.weight", REPLICATED, ("H",)) for n in (
        "input_layernorm", "post_attention_layernorm",
        "pre_feedforward_layernorm", "post_feedforward_layernorm"))


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *attention_params(),
    *dense_mlp_params(bias_when=None),
    *layer_norm_params(),
    Param("model.norm.weight", REPLICATED, ("H",)),
)

#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "attention_bias": lambda c, L: bool(cfg_get(c, "attention_bias", default=False)),
}


def sizes_of(config: Any, architecture: str):
    """``Sizes`` of a Gemma 2/3 text config (``I`` = ``intermediate_size``).

    Raises:
        ValueError: a quantized config (``quantization_config``).
    """
    if cfg_get(config, "quantization_config", default=None):
        raise ValueError(f"{architecture} with a quantization_config is not supported; "
                         "supported: unquantized (bf16, fp16, fp32) checkpoints")
    return base_sizes(config, I=int(cfg_get(config, "intermediate_size")))


def sizes(config: Any):
    """``Sizes`` of a Gemma 2 config.

    Raises:
        ValueError: ``tie_word_embeddings=False`` (vLLM's Gemma 2 has no
            ``lm_head``), or a quantized config.
    """
    if not cfg_get(config, "tie_word_embeddings", default=True):
        raise ValueError("Gemma2ForCausalLM with tie_word_embeddings=False is not supported: "
                         "vLLM's Gemma2ForCausalLM has no lm_head (it computes logits with "
                         "model.embed_tokens) and refuses a checkpoint's lm_head.weight "
                         "(models/gemma2.py); supported: tie_word_embeddings=True")
    return sizes_of(config, ARCHITECTURE)


#: Tiny test models (``m2nkit.adapters.tiny``): tied, as every Gemma 2 is.
TINY_MODELS = {"tiny-gemma2": TinyModel("gemma2", {"tie_word_embeddings": True})}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/gemma2.py",
    module=__name__,
)
