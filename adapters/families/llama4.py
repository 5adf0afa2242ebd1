"""Llama-4 (``Llama4ForCausalLM``; ``Llama4ForConditionalGeneration``, Scout/Maverick): the table.

vLLM 0.33.0 ``model_executor/models/llama4.py`` (text) and ``mllama4.py``
(the multimodal wrapper), checked bit for bit with its real loaders
(``tests/data/oracle/tiny-llama4``, ``tiny-llama4-vision``):

* **Attention** (``Llama4Attention``): ``QKVParallelLinear`` and a
  row-parallel ``o_proj``, never a bias (``bias=False`` whatever the config
  says: a config with ``attention_bias`` is refused, transformers would give
  the model biases vLLM drops). vLLM's ``load_weights`` reorders every
  layer's q and k rows for its rotary embedding before slicing them
  (``permute_qk_weight_for_rotary``; NoPE layers too): kind ``ROTARY_QKV``
  (``families/kinds.py``), one box per row. The qk norm
  (``use_qk_norm``) is an ``RMSNorm(has_weight=False)``: no parameter.
  Chunked and full attention layers (``layer_types``, ``no_rope_layers``,
  ``attention_chunk_size``) hold the same parameters.
* **MoE layers** (``Llama4DecoderLayer``: layer ``L`` is MoE when
  ``interleave_moe_layer_step > 0 and (L + 1) % interleave_moe_layer_step ==
  0``; transformers reads ``moe_layers`` instead, and a config where the two
  disagree is planned through transformers' model, :func:`_moe_layers_differ`).
  ``Llama4MoE``: the router a ``GateLinear``, whole, not handed to
  ``FusedMoEFactory`` (no alias); a shared expert (``LlamaMLP`` of
  ``intermediate_size``, ``disable_tp`` under sequence-parallel MoE: kinds
  ``SHARED_MERGED``/``SHARED_ROW``), aliased under
  ``feed_forward.experts._shared_experts._layer.*``; the routed experts in
  ``feed_forward.experts.routed_experts.w13_weight``/``w2_weight``
  (``W13``/``W2``, EP included). Dense layers: a ``LlamaMLP`` of
  ``intermediate_size_mlp``.
* **Routed experts on the wire.** transformers 5.12.1 keeps them stacked
  ``[E, in, out]`` (``models/llama4/modeling_llama4.py``,
  ``Llama4TextExperts``: ``gate_up_proj [E, H, 2*I]``, ``down_proj [E, I,
  H]``; the checkpoints store them so), while vLLM holds them ``[E, out,
  in]`` and transposes each 3-D fused tensor it is handed
  (``Llama4Model.load_moe_expert_weights``: ``loaded_weight.transpose(-1,
  -2)``). A binding (a box of the wire landing at an offset, same dim
  order) cannot express that transpose except one row at a time, so, as for
  GPT-OSS (``families/gpt_oss.py``), the experts travel transposed:
  ``<block>.experts.gate_up_proj.weight [E, 2*I, H]`` (gate rows, then up
  rows, per expert) and ``<block>.experts.down_proj.weight [E, H, I]``
  (:data:`PERMUTED`, ``HFNaming.permuted``; an FSDP2 rank's piece is its
  local box transposed, a view; the checkpoint reader reads the permuted box
  from disk). The trace hands vLLM the transpose back
  (``trace._whole_feed``), which its own ``transpose(-1, -2)`` undoes.
* **The wrapper**: ``families/llama4_vl.py``.
"""

from __future__ import annotations

from typing import Any

from .kinds import MERGED, REPLICATED, ROTARY_QKV, ROW, SHARED_MERGED, SHARED_ROW, VOCAB, W13, W2
from .sizes import base_sizes, cfg_get
from .table import Family, HFNaming, Param, TinyModel, head_dim, kv_heads, merged_feeds, qkv_feeds

__all__ = ["ARCHITECTURES", "ARCHITECTURE", "PERMUTED", "HF_NAMES", "VLLM_PARAMS",
           "CONDITIONS", "TEXT_DEFAULTS", "TINY_MODELS", "FAMILY", "is_moe_layer"]

#: transformers' and vLLM's names of the text model and its multimodal wrapper.
ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
ARCHITECTURE = ARCHITECTURES[0]

#: ``HFNaming.permuted`` of both architectures: on-disk leaf -> (wire leaf, order).
PERMUTED = {
    "feed_forward.experts.gate_up_proj": ("feed_forward.experts.gate_up_proj.weight", (0, 2, 1)),
    "feed_forward.experts.down_proj": ("feed_forward.experts.down_proj.weight", (0, 2, 1)),
}

A = "model.layers.{L}.self_attn"
F = "model.layers.{L}.feed_forward"


def is_moe_layer(config: Any, layer: int) -> bool:
    """vLLM ``Llama4DecoderLayer``: is layer ``layer`` a MoE layer?"""
    step = int(cfg_get(config, "interleave_moe_layer_step", default=1))
    return step > 0 and (layer + 1) % step == 0


def _transformers_moe_layers(config: Any) -> list[int]:
    """``Llama4TextConfig.__post_init__``: ``moe_layers``, else every ``interleave_moe_layer_step``-th."""
    layers = cfg_get(config, "moe_layers", default=None)
    if layers is not None:
        return sorted(int(L) for L in layers)
    step = int(cfg_get(config, "interleave_moe_layer_step", default=1))
    return list(range(step - 1, int(cfg_get(config, "num_hidden_layers")), step))


def _moe_layers_differ(config: Any) -> str | None:
    """transformers builds MoE layers by ``moe_layers``, vLLM by ``interleave_moe_layer_step``."""
    n = int(cfg_get(config, "num_hidden_layers"))
    vllm = [L for L in range(n) if is_moe_layer(config, L)]
    if _transformers_moe_layers(config) != vllm:
        return (f"moe_layers={_transformers_moe_layers(config)} is not what vLLM builds from "
                f"interleave_moe_layer_step ({vllm}: vLLM Llama4DecoderLayer)")
    return None


#: transformers 5: in-memory names are the on-disk names; the routed experts
#: travel transposed (:data:`PERMUTED`). transformers registers a MoE block's
#: ``experts`` first, then ``router`` and ``shared_expert`` (``Llama4TextMoe``).
#: Config-only plans read ``config.json`` with ``Llama4TextConfig``'s defaults
#: (transformers 5 ``configuration_llama4.py``).
TEXT_DEFAULTS = {"hidden_size": 5120, "vocab_size": 202048, "intermediate_size": 8192,
                 "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
                 "num_attention_heads": 40, "tie_word_embeddings": False,
                 "num_local_experts": 16, "interleave_moe_layer_step": 1,
                 "attention_bias": False, "num_key_value_heads": kv_heads(8),
                 "head_dim": head_dim(128)}
HF_NAMES = HFNaming(
    permuted=PERMUTED, model_types=("llama4_text",), config_defaults=TEXT_DEFAULTS,
    child_order={F: ("experts", "router", "shared_expert")},
    table_differs=_moe_layers_differ,
)

S = f"{F}.shared_expert"

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", ROTARY_QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    Param(f"{F}.router.weight", REPLICATED, ("E", "H"), when="moe_layer"),
    Param(f"{S}.gate_up_proj.weight", SHARED_MERGED, ("Im", "H"), when="moe_layer",
          feeds=merged_feeds(f"{S}.gate_proj.weight", f"{S}.up_proj.weight"),
          aliases=(f"{F}.experts._shared_experts._layer.gate_up_proj.weight",)),
    Param(f"{S}.down_proj.weight", SHARED_ROW, ("H", "Im"), when="moe_layer",
          aliases=(f"{F}.experts._shared_experts._layer.down_proj.weight",)),
    Param(f"{F}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"), when="moe_layer",
          feeds=((f"{F}.experts.gate_up_proj.weight", None),)),
    Param(f"{F}.{{experts}}.w2_weight", W2, ("E", "H", "Im"), when="moe_layer",
          feeds=((f"{F}.experts.down_proj.weight", None),)),
    Param(f"{F}.gate_up_proj.weight", MERGED, ("I", "H"), when="dense_layer",
          feeds=merged_feeds(f"{F}.gate_proj.weight", f"{F}.up_proj.weight")),
    Param(f"{F}.down_proj.weight", ROW, ("H", "I"), when="dense_layer"),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "moe_layer": is_moe_layer,
    "dense_layer": lambda c, L: not is_moe_layer(c, L),
}


def sizes(config: Any):
    """``Sizes`` of a Llama-4 text config: ``I`` = ``intermediate_size_mlp`` (dense layers),
    ``Im`` = ``intermediate_size`` (each routed expert and the shared one), ``E`` =
    ``num_local_experts``.

    Raises:
        ValueError: ``attention_bias`` (vLLM's ``Llama4Attention`` has no bias); an odd
            ``head_dim`` (the rotary reordering pairs rows).
    """
    if cfg_get(config, "attention_bias", default=False):
        raise ValueError("Llama-4 with attention_bias=true is not supported: vLLM 0.33.0's "
                         "Llama4Attention builds q/k/v/o without biases (models/llama4.py), "
                         "so transformers' biases would have nowhere to go; supported: "
                         "attention_bias=false")
    s = base_sizes(config, I=int(cfg_get(config, "intermediate_size_mlp", default=0)),
                   Im=int(cfg_get(config, "intermediate_size")),
                   E=int(cfg_get(config, "num_local_experts", default=0)),
                   keys={"I": "intermediate_size_mlp", "Im": "intermediate_size",
                         "E": "num_local_experts"})
    if s.hd % 2:
        raise ValueError(f"Llama-4 with head_dim={s.hd}: vLLM's rotary reordering of q/k rows "
                         "(permute_qk_weight_for_rotary) pairs rows, so head_dim must be even")
    return s


#: Tiny test models (``m2nkit.adapters.tiny``): layer 0 dense, layer 1 MoE (as Maverick).
TINY_MODELS = {
    "tiny-llama4": TinyModel("llama4_text", {
        "intermediate_size": 32, "intermediate_size_mlp": 64, "num_local_experts": 4,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/llama4.py", module=__name__,
)
