"""Qwen3-Next (``Qwen3NextForCausalLM``), and the Gated DeltaNet pieces Qwen3.5 reuses.

Restated from vLLM 0.33.0 ``model_executor/models/qwen3_next.py`` and
``layers/mamba/gdn/qwen_gdn_linear_attn.py`` (``QwenGatedDeltaNetAttention``),
checked bit for bit against its real loaders (``tests/data/oracle/tiny-qwen3-next``)
and against the traced layout (``tests/integration/test_vllm_trace.py``).

**Layers** are of two kinds, ``config.layer_types[L]`` (transformers derives
it from ``full_attention_interval``, default 4: every 4th layer full):

* ``linear_attention``: Gated DeltaNet (``linear_attn.*``, ``QwenGatedDeltaNetAttention``
  with ``gqa_interleaved_layout=True``). Qwen3-Next's checkpoint holds
  ``in_proj_qkvz`` ``[2*kd + 2*vd, H]`` and ``in_proj_ba`` ``[2*nvh, H]`` fused
  already, interleaved per key-head group, and vLLM builds each as a
  ``MergedColumnParallelLinear`` with **one** output size (``create_qkvz_proj``,
  ``create_ba_proj``): plain column parallel, rank ``r`` one contiguous block of
  rows (kind ``COLUMN``). ``conv1d`` ``[2*kd + vd, 1, K]`` is split q, k, v
  section by section (``mamba_v2_sharded_weight_loader``; kind ``GDN_CONV``);
  ``dt_bias`` and ``A_log`` ``[nvh]`` by value head (``sharded_weight_loader(0)``;
  vLLM allocates ``A_log`` **float32**, ``dt_bias`` in the model dtype);
  ``norm`` (``RMSNormGated`` of one value head, ``[dv]``) whole on every
  worker; ``out_proj`` row parallel. (``kd = linear_num_key_heads *
  linear_key_head_dim``, ``vd = linear_num_value_heads * linear_value_head_dim``.)
* ``full_attention``: ``Qwen3NextAttention``, whose q rows are doubled by the
  output gate (``QKVParallelLinear`` with ``nh * (1 + attn_output_gate)``
  heads: kind ``QKV_GATED``; transformers always builds ``q_proj`` ``[2*nh*hd,
  H]``), ``o_proj`` row parallel, ``q_norm``/``k_norm`` ``[hd]`` whole.

**MLP**: layer ``L`` is MoE when ``L not in mlp_only_layers``, ``num_experts >
0`` and ``(L + 1) % decoder_sparse_step == 0`` (``Qwen3NextDecoderLayer``),
else a dense ``gate_up_proj``/``down_proj``. A MoE block
(``Qwen3NextSparseMoeBlock``) holds the router ``gate`` (aliased
``mlp.experts.gate.weight``), ``shared_expert_gate`` ``[1, H]`` (a
``ReplicatedLinear``, aliased ``shared_expert.expert_gate.weight`` and
``experts._shared_experts._layer.expert_gate.weight``), the shared expert
(``Qwen2MoeMLP``: ``shared_expert.gate_up_proj`` merged, ``down_proj`` row, both
whole under sequence-parallel MoE, ``disable_tp=is_sequence_parallel``: kinds
``SHARED_MERGED``/``SHARED_ROW``; aliased ``experts._shared_experts._layer.*``)
and the routed experts stacked like Qwen3-MoE's. vLLM refuses ``tp >
num_experts``.

**Refused**, naming the key: ``tie_word_embeddings`` (vLLM's Qwen3-Next builds
an untied ``ParallelLMHead`` a tied checkpoint does not fill),
``attention_bias`` (transformers gives q/k/v/o biases, vLLM reads ``qkv_bias``
and has no ``o_proj`` bias), ``attn_output_gate: false`` (transformers always
doubles ``q_proj``), a MoE without shared expert, and a
``quantization_config`` (the table has no quantized Gated DeltaNet).
ROCm AITER's fused shared experts and Quark OCP-MX replicated shared experts
are not modelled. The checkpoint's multi-token-prediction tensors (``mtp.*``)
are skipped, as vLLM's ``hf_to_vllm_mapper`` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .kinds import (COLUMN, GDN_CONV, QKV_GATED, REPLICATED, ROW, SHARED_MERGED, SHARED_ROW,
                    VOCAB, W13, W2)
from .llama import MLP as M
from .llama import dense_mlp_params
from .sizes import Sizes, base_sizes, cfg_get
from .table import (TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param, TinyModel,
                    merged_feeds, qkv_feeds)

__all__ = ["ARCHITECTURE", "HF_NAMES", "EXPERTS_ON_DISK", "VLLM_PARAMS", "CONDITIONS",
           "TINY_MODELS", "FAMILY", "GdnSizes", "gdn_sizes", "layer_types",
           "full_attention_params", "linear_attention_tail", "moe_params", "layer_norms",
           "MOE_CHILD_ORDER", "mtp_skip", "refuse", "tp_within_experts", "LA", "A",
           "gdn_config_defaults", "TINY_DERIVED", "TINY_LINEAR", "TINY_MOE_DERIVED"]

ARCHITECTURE = "Qwen3NextForCausalLM"

A = "model.layers.{L}.self_attn"
LA = "model.layers.{L}.linear_attn"
#: vLLM 0.33.0's second path to the shared expert (``FusedMoEFactory(shared_experts=...)``).
SHARED_ALIAS = M + ".experts._shared_experts._layer"

EXPERTS_ON_DISK = {
    "gate": "{prefix}.experts.{e}.gate_proj.weight",
    "up": "{prefix}.experts.{e}.up_proj.weight",
    "down": "{prefix}.experts.{e}.down_proj.weight",
}
#: transformers' MoE block registers ``gate``, ``experts``, ``shared_expert``,
#: ``shared_expert_gate`` (vLLM: ``shared_expert_gate`` before ``shared_expert``
#: and ``experts`` last); that orders the wire tensors.
MOE_CHILD_ORDER = {M: ("gate", "experts", "shared_expert", "shared_expert_gate")}


def layer_types(config: Any) -> list[str]:
    """``config.layer_types``, or transformers' rule from ``full_attention_interval``
    (default 4: layer ``L`` is full attention when ``(L + 1) % interval == 0``;
    ``Qwen3NextConfig.__post_init__``, ``Qwen3_5TextConfig`` likewise)."""
    types = cfg_get(config, "layer_types", default=None)
    if types:
        return list(types)
    every = int(cfg_get(config, "full_attention_interval", default=4))
    return ["linear_attention" if (i + 1) % every else "full_attention"
            for i in range(int(cfg_get(config, "num_hidden_layers")))]


def _layer_types_rule(c: dict) -> list[str]:
    return layer_types(c)


def gdn_config_defaults(**keys: Any) -> dict[str, Any]:
    """Config-class defaults shared by the Gated DeltaNet families, plus ``keys``."""
    return {"tie_word_embeddings": False, "attention_bias": False, "head_dim": 256,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, **keys, "layer_types": _layer_types_rule}


#: transformers 5 (``qwen3_next``): no renames; experts fused in memory, per
#: expert on disk; ``Qwen3NextConfig``'s defaults for config-only plans.
HF_NAMES = HFNaming(
    fused_experts=TRANSFORMERS_FUSED_EXPERTS, experts_on_disk=EXPERTS_ON_DISK,
    child_order=MOE_CHILD_ORDER,
    model_types=("qwen3_next",),
    config_defaults=gdn_config_defaults(
        hidden_size=2048, vocab_size=151936, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, decoder_sparse_step=1,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
        mlp_only_layers=lambda c: c.get("mlp_only_layers") or []),
)


def full_attention_params() -> tuple[Param, ...]:
    """``Qwen3NextAttention`` of a full-attention layer (Qwen3.5 reuses it)."""
    return (
        Param(f"{A}.qkv_proj.weight", QKV_GATED, ("H",), feeds=qkv_feeds(A), when="full"),
        Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd"), when="full"),
        Param(f"{A}.q_norm.weight", REPLICATED, ("hd",), when="full"),
        Param(f"{A}.k_norm.weight", REPLICATED, ("hd",), when="full"),
    )


def linear_attention_tail() -> tuple[Param, ...]:
    """``QwenGatedDeltaNetAttention`` after its input projections (both families)."""
    return (
        Param(f"{LA}.dt_bias", COLUMN, ("nvh",), when="linear"),
        Param(f"{LA}.A_log", COLUMN, ("nvh",), when="linear", dtype=torch.float32,
              model_dtype_on_wire=True),
        Param(f"{LA}.norm.weight", REPLICATED, ("dv",), when="linear"),
        Param(f"{LA}.out_proj.weight", ROW, ("H", "vd"), when="linear"),
    )


def moe_params(when: str = "moe_layer") -> tuple[Param, ...]:
    """``Qwen3NextSparseMoeBlock`` (Qwen3.5-MoE reuses it), in vLLM's module order."""
    return (
        Param(f"{M}.gate.weight", REPLICATED, ("E", "H"), when=when,
              aliases=(M + ".{router_alias}",)),
        Param(f"{M}.shared_expert_gate.weight", REPLICATED, ("1", "H"), when=when,
              aliases=(f"{M}.shared_expert.expert_gate.weight",
                       f"{SHARED_ALIAS}.expert_gate.weight")),
        Param(f"{M}.shared_expert.gate_up_proj.weight", SHARED_MERGED, ("Is", "H"), when=when,
              feeds=merged_feeds(f"{M}.shared_expert.gate_proj.weight",
                                 f"{M}.shared_expert.up_proj.weight"),
              aliases=(f"{SHARED_ALIAS}.gate_up_proj.weight",)),
        Param(f"{M}.shared_expert.down_proj.weight", SHARED_ROW, ("H", "Is"), when=when,
              aliases=(f"{SHARED_ALIAS}.down_proj.weight",)),
        Param(f"{M}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"), when=when,
              feeds=((f"{M}.experts.gate_up_proj.weight", None),)),
        Param(f"{M}.{{experts}}.w2_weight", W2, ("E", "H", "Im"), when=when,
              feeds=((f"{M}.experts.down_proj.weight", None),)),
    )


def layer_norms() -> tuple[Param, ...]:
    return (Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
            Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)))


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{LA}.conv1d.weight", GDN_CONV, ("conv", "1", "K"), when="linear"),
    Param(f"{LA}.in_proj_qkvz.weight", COLUMN, ("qkvz", "H"), when="linear"),
    Param(f"{LA}.in_proj_ba.weight", COLUMN, ("2*nvh", "H"), when="linear"),
    *linear_attention_tail(),
    *full_attention_params(),
    *moe_params(),
    *dense_mlp_params(when="dense_layer", bias_when=None),
    *layer_norms(),
    Param("model.norm.weight", REPLICATED, ("H",)),
    # never tied: vLLM's Qwen3NextForCausalLM builds its own ParallelLMHead
    Param("lm_head.weight", VOCAB, ("V", "H")),
)


def _num_experts(config: Any) -> int:
    return int(cfg_get(config, "num_experts", default=0) or 0)


def is_moe_layer(config: Any, layer: int) -> bool:
    """vLLM ``Qwen3NextDecoderLayer``: is layer ``layer`` sparse?"""
    only = cfg_get(config, "mlp_only_layers", default=[]) or []
    step = int(cfg_get(config, "decoder_sparse_step", default=1))
    return layer not in only and _num_experts(config) > 0 and (layer + 1) % step == 0


def _kind(config: Any, layer: int | None) -> str | None:
    return None if layer is None else layer_types(config)[layer]


#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "linear": lambda c, L: _kind(c, L) == "linear_attention",
    "full": lambda c, L: _kind(c, L) == "full_attention",
    "moe_layer": is_moe_layer,
    "dense_layer": lambda c, L: not is_moe_layer(c, L),
}


@dataclass(frozen=True)
class GdnSizes(Sizes):
    """``Sizes`` plus the Gated DeltaNet and shared-expert symbols of the tables.

    ``nkh``/``nvh`` linear key/value heads, ``dk``/``dv`` their head dims,
    ``K`` the conv kernel, ``Is`` the shared expert's intermediate size;
    derived: ``kd = nkh*dk``, ``vd = nvh*dv``, ``qkvz = 2*kd + 2*vd`` (rows of
    ``in_proj_qkvz``), ``conv = 2*kd + vd`` (rows of ``conv1d``).
    """

    nkh: int = 0
    nvh: int = 0
    dk: int = 0
    dv: int = 0
    K: int = 0
    Is: int = 0

    @property
    def kd(self) -> int:
        return self.nkh * self.dk

    @property
    def vd(self) -> int:
        return self.nvh * self.dv

    @property
    def qkvz(self) -> int:
        return 2 * self.kd + 2 * self.vd

    @property
    def conv(self) -> int:
        return 2 * self.kd + self.vd


_GDN_KEYS = {
    "nkh": "linear_num_key_heads", "nvh": "linear_num_value_heads",
    "dk": "linear_key_head_dim", "dv": "linear_value_head_dim", "K": "linear_conv_kernel_dim",
    "Is": "shared_expert_intermediate_size",
    "kd": "linear_num_key_heads*linear_key_head_dim",
    "vd": "linear_num_value_heads*linear_value_head_dim",
    "qkvz": "2*(linear_num_key_heads*linear_key_head_dim"
            "+linear_num_value_heads*linear_value_head_dim)",
    "conv": "(2*linear_num_key_heads*linear_key_head_dim"
            "+linear_num_value_heads*linear_value_head_dim)",
}


def refuse(config: Any, architecture: str, module: str, moe: bool) -> None:
    """The config variants the Gated DeltaNet tables do not cover (module docstring).

    Raises:
        ValueError: naming the key, its value and why.
    """
    def no(what: str) -> None:
        raise ValueError(f"{architecture} with {what} is not supported by m2nkit's table "
                         f"({module})")
    if cfg_get(config, "quantization_config", default=None):
        no("a quantization_config (the table has no quantized Gated DeltaNet layers)")
    if cfg_get(config, "attention_bias", default=False):
        no("attention_bias=True (transformers builds q/k/v/o biases; vLLM reads qkv_bias "
           "and has no o_proj bias)")
    if not cfg_get(config, "attn_output_gate", default=True):
        no("attn_output_gate=False (transformers always doubles q_proj for the output gate)")
    if moe and not int(cfg_get(config, "shared_expert_intermediate_size", default=0) or 0):
        no("shared_expert_intermediate_size=0 (vLLM then builds fused shared-expert slots "
           "the table does not model)")


def gdn_sizes(config: Any, *, I: int, Im: int = 0, E: int = 0) -> GdnSizes:
    """``GdnSizes`` of a Gated DeltaNet config with the given MLP sizes."""
    base = base_sizes(config, I=I, Im=Im, E=E, keys=_GDN_KEYS)
    return GdnSizes(
        **{f.name: getattr(base, f.name) for f in fields(Sizes)},
        nkh=int(cfg_get(config, "linear_num_key_heads")),
        nvh=int(cfg_get(config, "linear_num_value_heads")),
        dk=int(cfg_get(config, "linear_key_head_dim")),
        dv=int(cfg_get(config, "linear_value_head_dim")),
        K=int(cfg_get(config, "linear_conv_kernel_dim")),
        Is=int(cfg_get(config, "shared_expert_intermediate_size", default=0) or 0) if E else 0,
    )


def sizes(config: Any) -> GdnSizes:
    """``GdnSizes`` of a Qwen3-Next config.

    Raises:
        ValueError: a variant the table does not cover (:func:`refuse`), or
            ``tie_word_embeddings`` (vLLM's Qwen3-Next never ties its head).
    """
    E = _num_experts(config)
    refuse(config, ARCHITECTURE, __name__, moe=E > 0)
    if cfg_get(config, "tie_word_embeddings", default=False):
        raise ValueError(
            f"{ARCHITECTURE} with tie_word_embeddings=True is not supported by m2nkit's table "
            f"({__name__}): vLLM 0.33.0's Qwen3NextForCausalLM builds an untied lm_head "
            "(qwen3_next.py), which a tied checkpoint does not fill")
    return gdn_sizes(config, I=int(cfg_get(config, "intermediate_size", default=0) or 0),
                     Im=int(cfg_get(config, "moe_intermediate_size", default=0) or 0), E=E)


def tp_within_experts(s: Sizes, spec: Any) -> str | None:
    """vLLM ``Qwen3NextSparseMoeBlock`` refuses more tp ranks than experts."""
    if s.E and spec.tp > s.E:
        return (f"tp={spec.tp} is greater than num_experts={s.E} (vLLM "
                "Qwen3NextSparseMoeBlock refuses it)")
    return None


def mtp_skip(config: Any, name: str) -> str | None:
    """Why vLLM skips wire tensor ``name``: a multi-token-prediction tensor (``mtp.*``)."""
    if name.startswith("mtp."):
        return ("multi-token-prediction tensor: vLLM's main model drops 'mtp.*' "
                "(hf_to_vllm_mapper orig_to_new_prefix {'mtp.': None}); the MTP draft "
                "model loads it")
    return None


#: Tiny test model: the shipped ``tests/data/oracle/tiny-qwen3-next`` config (layer 0
#: linear attention with a dense MLP, layer 1 full attention with a MoE block):
#: hidden 64, 4 query heads of 16 over 2 KV heads, 4 key / 8 value heads of 8,
#: 4 experts of 8. The sizes ``TINY_SIZES`` would set are derived.
TINY_DERIVED = {"hidden_size": lambda c: 64, "num_attention_heads": lambda c: 4,
                "num_key_value_heads": lambda c: 2, "head_dim": lambda c: 16,
                "intermediate_size": lambda c: 32,
                "layer_types": lambda c: ["linear_attention", "full_attention"]}
TINY_LINEAR = {"linear_num_key_heads": 4, "linear_num_value_heads": 8,
               "linear_key_head_dim": 8, "linear_value_head_dim": 8,
               "linear_conv_kernel_dim": 4}
TINY_MOE_DERIVED = {**TINY_DERIVED, "num_experts": lambda c: 4,
                    "moe_intermediate_size": lambda c: 8}
TINY_MODELS = {
    "tiny-qwen3-next": TinyModel("qwen3_next", {
        **TINY_LINEAR, "shared_expert_intermediate_size": 8, "mlp_only_layers": [0],
        "decoder_sparse_step": 1,
    }, TINY_MOE_DERIVED),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, (tp_within_experts,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/qwen3_next.py", module=__name__,
    skip=mtp_skip,
)
