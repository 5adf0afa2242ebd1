"""GLM-4.5 / GLM-4.6 / GLM-4.7 (``Glm4MoeForCausalLM``): everything m2nkit knows about the family.

Restated from vLLM 0.33.0 ``model_executor/models/glm4_moe.py`` and checked
against its real loaders (``tests/data/oracle/tiny-glm4-moe``) and against
the layout traced from them (``tests/integration/test_vllm_trace.py``).

**Attention** (``Glm4MoeAttention``): Llama's ``qkv_proj`` (``QKVParallelLinear``,
KV heads replicated when ``tp > num_key_value_heads``) with a q/k/v bias when
``attention_bias`` (``qkv_bias=config.attention_bias``), ``o_proj`` row
parallel without bias, and per-head ``q_norm``/``k_norm`` (size ``head_dim``,
replicated) only with ``use_qk_norm`` (GLM-4.5 and 4.6 set it). The partial
rotary factor only changes the rotary cache, which is no weight.

**Layers** (``Glm4MoeDecoderLayer``): layer ``L`` is MoE when
``n_routed_experts`` is set and ``L >= first_k_dense_replace`` (no
``moe_layer_freq``), else a dense SwiGLU MLP of ``intermediate_size``
(``Glm4MoeMLP``).

**MoE** (``Glm4MoE``), shared with GLM-4.7-Flash (``glm4_moe_lite.py``
subclasses it):

* the router ``mlp.gate.weight [E, H]`` is **float32** in vLLM
  (``GateLinear(params_dtype=torch.float32)``), while checkpoints store it in
  the model dtype (the loader casts on copy: ``Param.model_dtype_on_wire``);
* ``mlp.gate.e_score_correction_bias [E]`` float32, in **every** MoE layer
  (an ``nn.Parameter`` set unconditionally, whatever ``topk_method`` says;
  DeepSeek-V3 has it only with ``noaux_tc``); handed to ``FusedMoEFactory``,
  so vLLM exposes it again as ``mlp.experts.routed_experts.e_score_correction_bias``.
  The router weight itself is not handed over (no ``gate=``): no router alias;
* shared experts (``n_shared_experts`` not null) are a ``Glm4MoeMLP`` of
  ``moe_intermediate_size * n_shared_experts``: a plain merged-column /
  row-parallel pair, **split by TP in every layout** (DeepSeek-V3's shared
  experts are whole when vLLM runs the MoE sequence-parallel; GLM's MLP has no
  ``disable_tp``), aliased as ``mlp.experts._shared_experts._layer.*``;
* routed experts stacked into ``w13``/``w2`` like Qwen3-MoE's, with EP.

(ROCm AITER's fused shared experts are not modelled, as for DeepSeek-V3.)

**MTP**: ``Glm4MoeModel.load_weights`` drops the multi-token-prediction layers
(``skip_spec_layers``, ``models/utils.py``: layers ``num_hidden_layers ..
+ num_nextn_predict_layers - 1``), the rule DeepSeek-V3's table already holds
(``deepseek_v3.mtp_layers``). A config-only plan lists them as skipped, each a
decoder layer of this table plus the MTP module's own tensors
(``deepseek_v3.MTP_EXTRAS``: ``glm4_moe_mtp.py`` registers the same
``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``; not checked
against a published GLM index: its loader also takes the main ``lm_head`` and
``embed_tokens`` for them, so a checkpoint may lack the layer's own copies, which
only changes what is listed as skipped).
transformers' ``Glm4MoeConfig`` has no ``num_nextn_predict_layers``: a
``config.json`` without it has no MTP layer (published GLM-4.5 configs set 1).

**Names**: transformers 5 (``glm4_moe``) keeps the routed experts fused in
memory and writes them per expert on disk (``mlp.experts.{e}.gate_proj.weight``
...); ``e_score_correction_bias`` is a buffer there (``Glm4MoeTopkRouter``).

Refused: a ``quantization_config`` (GLM-4.5-FP8 and the like: no fixture pins
vLLM's quantized layers for this family; ``--layout traced`` plans them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .deepseek_v3 import MTP_EXTRAS, mtp_layers
from .kinds import MERGED, REPLICATED, ROW, VOCAB, W13, W2
from .llama import dense_mlp_params
from .qwen3 import attention_params
from .sizes import Sizes, base_sizes, cfg_get
from .table import (TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param, SkippedLayers, TinyModel,
                    alias, kv_heads, merged_feeds)

__all__ = ["ARCHITECTURE", "HF_NAMES", "EXPERTS_ON_DISK", "VLLM_PARAMS", "CONDITIONS",
           "TINY_MODELS", "FAMILY", "M", "moe_params", "MOE_CONDITIONS", "is_moe_layer",
           "mtp_skip", "no_quantization", "moe_conditions", "num_expert_group", "GlmSizes"]

ARCHITECTURE = "Glm4MoeForCausalLM"

#: Expert fusing: the stacked wire tensors are built from these per-expert
#: on-disk tensors (part -> pattern; ``{prefix}`` = ``model.layers.{L}.mlp``).
EXPERTS_ON_DISK = {
    "gate": "{prefix}.experts.{e}.gate_proj.weight",
    "up": "{prefix}.experts.{e}.up_proj.weight",
    "down": "{prefix}.experts.{e}.down_proj.weight",
}

M = "model.layers.{L}.mlp"
#: vLLM 0.33.0's second path to the shared experts (``FusedMoEFactory(shared_experts=...)``).
SHARED_ALIAS = M + ".experts._shared_experts._layer"

#: transformers 5: no renames; ``Glm4MoeMoE`` registers ``experts``, ``gate``,
#: ``shared_experts`` (vLLM: ``gate`` first), which orders the wire tensors. Config-only
#: plans read ``config.json`` with ``Glm4MoeConfig``'s defaults (transformers 5.12
#: ``configuration_glm4_moe.py``). ``head_dim`` is no field of it (transformers'
#: attention takes ``hidden_size // num_attention_heads`` without one), but vLLM's
#: ``Glm4MoeDecoderLayer`` reads ``config.head_dim``: :func:`sizes` refuses a config without.
HF_NAMES = HFNaming(
    fused_experts=TRANSFORMERS_FUSED_EXPERTS, experts_on_disk=EXPERTS_ON_DISK,
    child_order={M: ("experts", "gate", "shared_experts")},
    model_types=("glm4_moe",),
    config_defaults={
        "hidden_size": 4096, "vocab_size": 151552, "num_attention_heads": 96,
        "num_hidden_layers": 46, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "tie_word_embeddings": False,
        "attention_bias": False, "use_qk_norm": False,
        "num_key_value_heads": kv_heads(8),
        "n_routed_experts": alias("n_routed_experts", "num_local_experts", 128),
    },
    # an nn.Buffer of Glm4MoeTopkRouter (modeling_glm4_moe.py): whole on every FSDP2 rank
    buffers=(r"\.mlp\.gate\.e_score_correction_bias$",),
)


def moe_params() -> tuple[Param, ...]:
    """``Glm4MoE`` of one MoE layer (router, its bias, shared and routed experts), in
    vLLM's ``named_parameters()`` order; GLM-4.7-Flash reuses it."""
    return (
        Param(f"{M}.gate.weight", REPLICATED, ("E", "H"), when="moe_layer",
              dtype=torch.float32, model_dtype_on_wire=True),
        Param(f"{M}.gate.e_score_correction_bias", REPLICATED, ("E",), when="moe_layer",
              dtype=torch.float32, aliases=(f"{M}.{{experts}}.e_score_correction_bias",)),
        Param(f"{M}.shared_experts.gate_up_proj.weight", MERGED, ("Is", "H"),
              when="shared_experts",
              feeds=merged_feeds(f"{M}.shared_experts.gate_proj.weight",
                                 f"{M}.shared_experts.up_proj.weight"),
              aliases=(f"{SHARED_ALIAS}.gate_up_proj.weight",)),
        Param(f"{M}.shared_experts.down_proj.weight", ROW, ("H", "Is"), when="shared_experts",
              aliases=(f"{SHARED_ALIAS}.down_proj.weight",)),
        Param(f"{M}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"), when="moe_layer",
              feeds=((f"{M}.experts.gate_up_proj.weight", None),)),
        Param(f"{M}.{{experts}}.w2_weight", W2, ("E", "H", "Im"), when="moe_layer",
              feeds=((f"{M}.experts.down_proj.weight", None),)),
    )


def _attention() -> tuple[Param, ...]:
    """Qwen3's attention rows, the q/k norms only with ``use_qk_norm``."""
    return tuple(replace(p, when="qk_norm") if p.name.endswith(("q_norm.weight", "k_norm.weight"))
                 else p for p in attention_params())


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *_attention(),
    *dense_mlp_params(when="dense_layer", bias_when=None),
    *moe_params(),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def is_moe_layer(config: Any, layer: int) -> bool:
    """vLLM ``Glm4MoeDecoderLayer``: is layer ``layer`` MoE?"""
    return (cfg_get(config, "n_routed_experts", default=None) is not None
            and layer >= int(cfg_get(config, "first_k_dense_replace", default=0)))


def _shared(config: Any) -> int:
    return int(cfg_get(config, "n_shared_experts", default=0) or 0)


def moe_conditions(is_moe) -> dict:
    """The ``Glm4MoE`` conditions for a family's MoE-layer rule ``is_moe``."""
    return {
        "moe_layer": is_moe,
        "dense_layer": lambda c, L: not is_moe(c, L),
        "shared_experts": lambda c, L: is_moe(c, L) and _shared(c) > 0,
    }


MOE_CONDITIONS = moe_conditions(is_moe_layer)

#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "attention_bias": lambda c, L: bool(cfg_get(c, "attention_bias", default=False)),
    "qk_norm": lambda c, L: bool(cfg_get(c, "use_qk_norm", default=False)),
    **MOE_CONDITIONS,
}


def no_quantization(config: Any, architecture: str) -> None:
    """Refuse a ``quantization_config`` (the GLM tables are bf16 only).

    Raises:
        ValueError: naming the quantization method and ``--layout traced``.
    """
    q = cfg_get(config, "quantization_config", default=None)
    if q:
        method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", q)
        raise ValueError(
            f"{architecture} with quantization_config (quant_method={method!r}) is not "
            "supported by m2nkit's table (no vLLM dump pins its quantized layers); supported: "
            "unquantized (bf16/fp16/fp32) checkpoints; plan it with --layout traced")


@dataclass(frozen=True)
class GlmSizes(Sizes):
    """``Sizes`` plus ``Is``, the shared experts' intermediate
    (``moe_intermediate_size * n_shared_experts``)."""

    Is: int = 0


_GLM_KEYS = {"E": "n_routed_experts", "Is": "moe_intermediate_size*n_shared_experts"}


def sizes(config: Any) -> GlmSizes:
    """``GlmSizes`` of a GLM-4.5 config.

    Raises:
        ValueError: a ``quantization_config`` (:func:`no_quantization`); no
            ``head_dim`` (vLLM reads it, transformers' config class has none).
    """
    no_quantization(config, ARCHITECTURE)
    if cfg_get(config, "head_dim", default=None) is None:
        raise ValueError(
            f"{ARCHITECTURE} config has no head_dim, which vLLM 0.33.0's Glm4MoeDecoderLayer "
            "reads (config.head_dim; transformers' Glm4MoeConfig has no such field, the "
            "published GLM-4.5/4.6 config.json files set 128): add it to config.json")
    Im = int(cfg_get(config, "moe_intermediate_size", default=0))
    base = base_sizes(config, I=int(cfg_get(config, "intermediate_size")), Im=Im,
                      E=int(cfg_get(config, "n_routed_experts", default=0) or 0), keys=_GLM_KEYS)
    return GlmSizes(**{f.name: getattr(base, f.name) for f in fields(Sizes)},
                    Is=Im * _shared(config))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_skip(architecture: str, source: str):
    """``Family.skip`` for a family whose loader drops the MTP layers (``source``: where)."""
    def skip(config: Any, name: str) -> str | None:
        m = _LAYER.match(name)
        layers = mtp_layers(config)
        if not m or int(m.group(1)) not in layers:
            return None
        n = len(layers)
        return (f"multi-token-prediction layer {m.group(1)} (num_nextn_predict_layers={n}): "
                f"vLLM's {architecture} skips it ({source}, models/utils.py "
                "get_spec_layer_idx_from_weight_name); the MTP draft model loads it")
    return skip


def num_expert_group(config: Any) -> int | None:
    g = cfg_get(config, "n_group", default=None)
    return None if g is None else int(g)


#: Tiny test models (``m2nkit.adapters.tiny``): the shipped oracle checkpoint
#: (``tests/data/oracle/tiny-glm4-moe``): hidden 32, 4 heads over 2 KV heads of 16
#: (tp 4 shares them), QKV bias and q/k norms, layer 0 dense, layer 1 with 4 routed
#: and 1 shared expert.
TINY_MODELS = {
    "tiny-glm4-moe": TinyModel("glm4_moe", {
        "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 32, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "num_experts": 4, "num_local_experts": 4, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": True,
        "n_group": 1, "topk_group": 1}),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS,
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/glm4_moe.py", module=__name__,
    num_expert_group=num_expert_group,
    skip=mtp_skip(ARCHITECTURE, "glm4_moe.py Glm4MoeModel.load_weights, skip_spec_layers"),
    skipped_layers=SkippedLayers(mtp_layers, MTP_EXTRAS),
)
