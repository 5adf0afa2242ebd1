"""Qwen3.5 (``Qwen3_5ForCausalLM``): the dense Gated DeltaNet text model.

Restated from vLLM 0.33.0 ``model_executor/models/qwen3_5.py``
(``Qwen3_5ForCausalLM``, ``Qwen3_5Model``, ``Qwen3_5DecoderLayer``), which
builds on ``qwen3_next.py``; checked bit for bit against its real loaders
(``tests/data/oracle/tiny-qwen3.5``) and against the traced layout.

Layer kinds, full attention, norms and the ``mtp.*`` skip are Qwen3-Next's
(``m2nkit.adapters.families.qwen3_next``). What differs:

* **linear attention** (``gqa_interleaved_layout=False``): the checkpoint
  holds the input projections separately, and ``Qwen3_5Model.hf_to_vllm_mapper``
  fuses ``in_proj_qkv`` (shards 0, 1, 2) and ``in_proj_z`` (shard 3) into
  ``in_proj_qkvz``, a ``MergedColumnParallelLinear`` of output sizes ``[kd,
  kd, vd, vd]``: rank ``r`` holds its rows of q, of k, of v, then of z
  (kind ``GDN_QKVZ``: ``in_proj_qkv`` lands as three boxes per rank), and
  ``in_proj_b`` (shard 0) and ``in_proj_a`` (shard 1) into ``in_proj_ba``
  (``[nvh, nvh]``, kind ``MERGED``). ``maybe_disable_tp`` (a replicated
  ``in_proj_ba`` for AWQ/GPTQ/INC on CUDA) does not apply: quantized configs
  are refused;
* **MLP**: every layer is dense (``config.model_type == "qwen3_5_text"``);
* **lm_head**: tied to the embedding with ``tie_word_embeddings``
  (``Qwen3_5ForCausalLMBase``: ``lm_head.tie_weights``).

The multimodal wrapper (``Qwen3_5ForConditionalGeneration``) serves this
text model under ``language_model.``; this module's :data:`FAMILY` is what
a wrapper table composes (its parameters under ``model.``).
"""

from __future__ import annotations

from typing import Any

from .kinds import GDN_CONV, GDN_QKVZ, MERGED, REPLICATED, VOCAB
from .llama import dense_mlp_params
from .qwen3_next import (LA, TINY_DERIVED, TINY_LINEAR, full_attention_params,
                         gdn_config_defaults, gdn_sizes, layer_norms, layer_types,
                         linear_attention_tail, mtp_skip, refuse)
from .sizes import cfg_get
from .table import Family, HFNaming, Param, TinyModel, merged_feeds

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS", "FAMILY",
           "LINEAR_ATTENTION_CHILD_ORDER", "linear_attention_params", "layer_conditions"]

ARCHITECTURE = "Qwen3_5ForCausalLM"

#: transformers' ``Qwen3_5GatedDeltaNet`` registers ``conv1d``, ``norm``, ``out_proj``
#: before its input projections (vLLM: ``conv1d``, ``in_proj_qkvz``, ``in_proj_ba``
#: first); its own ``dt_bias``/``A_log`` come before every child in both.
LINEAR_ATTENTION_CHILD_ORDER = {
    LA: ("conv1d", "norm", "out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}

#: transformers 5 (``qwen3_5_text``, ``Qwen3_5TextConfig``'s defaults): no renames.
HF_NAMES = HFNaming(
    child_order=LINEAR_ATTENTION_CHILD_ORDER,
    model_types=("qwen3_5_text",),
    config_defaults=gdn_config_defaults(
        hidden_size=4096, vocab_size=248320, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4),
)


def linear_attention_params() -> tuple[Param, ...]:
    """Qwen3.5's ``QwenGatedDeltaNetAttention`` (``gqa_interleaved_layout=False``)."""
    return (
        Param(f"{LA}.conv1d.weight", GDN_CONV, ("conv", "1", "K"), when="linear"),
        Param(f"{LA}.in_proj_qkvz.weight", GDN_QKVZ, ("qkvz", "H"), when="linear",
              feeds=((f"{LA}.in_proj_qkv.weight", (0, 3)), (f"{LA}.in_proj_z.weight", (3, 4)))),
        Param(f"{LA}.in_proj_ba.weight", MERGED, ("nvh", "H"), when="linear",
              feeds=merged_feeds(f"{LA}.in_proj_b.weight", f"{LA}.in_proj_a.weight")),
        *linear_attention_tail(),
    )


def _kind(config: Any, layer: int | None) -> str | None:
    return None if layer is None else layer_types(config)[layer]


def layer_conditions(moe: bool) -> dict:
    """``Param.when`` conditions of a Qwen3.5 table: layer kinds, and every layer MoE
    (``moe``) or every layer dense (``Qwen3_5DecoderLayer``, by ``model_type``)."""
    return {
        "linear": lambda c, L: _kind(c, L) == "linear_attention",
        "full": lambda c, L: _kind(c, L) == "full_attention",
        "moe_layer": lambda c, L: moe,
        "dense_layer": lambda c, L: not moe,
    }


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *linear_attention_params(),
    *full_attention_params(),
    *dense_mlp_params(when="dense_layer", bias_when=None),
    *layer_norms(),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

CONDITIONS = layer_conditions(moe=False)


def sizes(config: Any):
    """``GdnSizes`` of a Qwen3.5 text config.

    Raises:
        ValueError: a variant the table does not cover (``qwen3_next.refuse``).
    """
    refuse(config, ARCHITECTURE, __name__, moe=False)
    return gdn_sizes(config, I=int(cfg_get(config, "intermediate_size")))


#: Tiny test model: the shipped ``tests/data/oracle/tiny-qwen3.5`` config (layer 0
#: linear attention, layer 1 full; tied embeddings).
TINY_MODELS = {
    "tiny-qwen3.5": TinyModel("qwen3_5_text", {**TINY_LINEAR, "tie_word_embeddings": True,
                                               "attn_output_gate": True},
                              TINY_DERIVED),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS,
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/qwen3_5.py", module=__name__,
    skip=mtp_skip,
)
