"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): DeepSeek-V3, DeepSeek-R1 and Kimi-K2.

Everything m2nkit knows about the family, restated from vLLM 0.33.0
``model_executor/models/deepseek_v2.py`` (``DeepseekV3ForCausalLM`` is
``DeepseekV2ForCausalLM``) and checked against its real loaders
(``tests/data/oracle/tiny-deepseek-v3*``).

**MLA attention** (``DeepseekV2MLAAttention``; vLLM uses it for every config
with ``kv_lora_rank`` and non-zero head dims, ``ModelConfig.use_mla``):

* ``q_a_proj [q_lora_rank, H]`` and ``kv_a_proj_with_mqa [kv_lora_rank +
  qk_rope_head_dim, H]`` fuse into ``fused_qkv_a_proj``, q rows then kv rows,
  **replicated** on every rank (``DeepSeekV2FusedQkvAProjLinear``: a
  ``MergedColumnParallelLinear`` with ``disable_tp=True``; kind
  ``REPLICATED_MERGED``); ``q_a_layernorm``, ``kv_a_layernorm`` replicated;
* ``q_b_proj [nh*(nope+rope), q_lora_rank]`` and ``kv_b_proj [nh*(nope+v),
  kv_lora_rank]`` column parallel (whole heads per rank), ``o_proj [H, nh*v]``
  row parallel;
* ``q_lora_rank: null`` (DeepSeek-V2-Lite style): plain ``q_proj`` (column)
  and ``kv_a_proj_with_mqa`` (``ReplicatedLinear``) instead.
* vLLM 0.33.0 registers the MLA modules a second time under
  ``self_attn.mla_attn.*`` (``MultiHeadLatentAttentionWrapper`` holds them),
  and ``kv_b_proj`` a third time (``self_attn.mla_attn.mla_attn.kv_b_proj``):
  aliases, same storage (read off the oracle's dumps).

**Layers**: layer ``L`` is MoE when ``n_routed_experts`` is set, ``L >=
first_k_dense_replace`` and ``L % moe_layer_freq == 0``, else a dense SwiGLU
MLP of ``intermediate_size`` (``DeepseekV2DecoderLayer``).

**MoE** (``DeepseekV2MoE``): router ``mlp.gate.weight [E, H]`` (``GateLinear``,
model dtype, unquantized) and, with ``topk_method: noaux_tc``,
``mlp.gate.e_score_correction_bias [E]`` kept **float32**; both are handed to
``FusedMoEFactory``, so vLLM 0.33.0 also exposes them as
``mlp.experts.gate.*`` and the bias as ``mlp.experts.routed_experts.e_score_correction_bias``.
Shared experts (``n_shared_experts``) are a dense MLP of
``moe_intermediate_size * n_shared_experts`` fused into
``mlp.shared_experts.gate_up_proj`` (merged column), aliased as
``mlp.experts._shared_experts._layer.*``. Routed experts are stacked into
``w13``/``w2`` like Qwen3-MoE's, with EP. (ROCm AITER's fused shared experts
are not modelled.)

**MTP**: the multi-token-prediction layers (``model.layers.{num_hidden_layers
+ i}.*``, ``i < num_nextn_predict_layers``) are skipped by vLLM's main model
(``load_weights``: ``get_spec_layer_idx_from_weight_name``, ``models/utils.py``);
a checkpoint's MTP tensors are planned as skipped with that reason. A
config-only plan lists them too, as the published DeepSeek-V3 checkpoint holds
layer 61 (``README_WEIGHTS.md``): a MoE decoder layer (fp8 weights with scales,
experts per expert) plus :data:`MTP_EXTRAS` (``SkippedLayers``). transformers
builds no MTP layer and reads a missing ``num_nextn_predict_layers`` as 1; so
does the config-only reader.

**FP8**: the published configs ship ``quantization_config: fp8,
weight_block_size [128, 128]``. Every linear layer and the routed experts
(``quantized=True`` below) then carry fp8 weights plus ``weight_scale_inv``
(``m2nkit.adapters.families.quant``); embeddings, ``lm_head``, norms and
the router stay in the model dtype, ``e_score_correction_bias`` float32.
Without ``quantization_config`` (bf16 checkpoints, the tiny models) every
parameter is in the model dtype but that bias. Config-only plans give each
wire tensor these dtypes, which are what the published checkpoints store;
transformers 5 allocates the router float32 in memory
(``DeepseekV3TopkRouter``), DeepSeek's own ``inference/model.py`` (``Gate``)
and vLLM (``GateLinear``) in the model dtype.

**Names**: transformers 5 (``deepseek_v3``) keeps the routed experts fused in
memory and writes them per expert on disk (``mlp.experts.{e}.gate_proj.weight``
...); ``e_score_correction_bias`` is a buffer there (saved, not a parameter);
transformers has no ``kimi_k2`` model type, whose ``config.json`` is read with
``DeepseekV3Config`` (Kimi-K2's own ``configuration_deepseek.py`` is that class,
``auto_map``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

import torch

from .kinds import (COLUMN, MERGED, REPLICATED, REPLICATED_MERGED, ROW, SHARED_MERGED, SHARED_ROW,
                    VOCAB, W13, W2)
from .sizes import Sizes, base_sizes, cfg_get
from .table import (ONLINE_FP8_FROM_TABLE, TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param,
                    SkippedLayers, TinyModel, alias, kv_heads, merged_feeds)

__all__ = ["ARCHITECTURE", "HF_NAMES", "EXPERTS_ON_DISK", "VLLM_PARAMS", "CONDITIONS",
           "TINY_MODELS", "FAMILY", "MlaSizes", "is_moe_layer", "mtp_layer",
           "mtp_layers", "MTP_EXTRAS"]

ARCHITECTURE = "DeepseekV3ForCausalLM"

#: Expert fusing: the stacked wire tensors are built from these per-expert
#: on-disk tensors (part -> pattern; ``{prefix}`` = ``model.layers.{L}.mlp``).
EXPERTS_ON_DISK = {
    "gate": "{prefix}.experts.{e}.gate_proj.weight",
    "up": "{prefix}.experts.{e}.up_proj.weight",
    "down": "{prefix}.experts.{e}.down_proj.weight",
}

#: transformers 5: no renames; experts fused in memory, per expert on disk;
#: Kimi-K2's ``kimi_k2`` config read with transformers' DeepSeek-V3 config class.
#: ``DeepseekV3Attention`` registers ``q_proj``/``q_a_proj``, ``q_a_layernorm``,
#: ``q_b_proj`` before ``kv_a_proj_with_mqa``, and ``DeepseekV3MoE`` ``experts``
#: before ``gate`` (vLLM: the fused ``q_a``/``kv_a`` first, ``gate`` first); that
#: orders the wire tensors.
HF_NAMES = HFNaming(
    fused_experts=TRANSFORMERS_FUSED_EXPERTS, experts_on_disk=EXPERTS_ON_DISK,
    config_classes={"kimi_k2": "deepseek_v3"},
    child_order={
        "model.layers.{L}.self_attn": ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj",
                                       "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                       "o_proj"),
        "model.layers.{L}.mlp": ("experts", "gate", "shared_experts"),
    },
    model_types=("deepseek_v3",),
    config_defaults={
        "hidden_size": 7168, "vocab_size": 129280, "num_attention_heads": 128,
        "num_hidden_layers": 61, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_shared_experts": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 8,
        "first_k_dense_replace": 3, "tie_word_embeddings": False,
        "num_key_value_heads": kv_heads(128),
        "n_routed_experts": alias("n_routed_experts", "num_local_experts", 256),
        "num_nextn_predict_layers": alias("num_nextn_predict_layers", "num_mtp_layers", 1),
        # DeepseekV3Config.__post_init__ sets qk_rope_head_dim; a head_dim in the file
        # (not a field of the class) is set after it and wins
        "head_dim": alias("head_dim", "qk_rope_head_dim", None),
    },
    table_differs=lambda c: _table_differs(c),
    # an nn.Buffer of DeepseekV3TopkRouter (modeling_deepseek_v3.py): whole on every FSDP2 rank
    buffers=(r"\.mlp\.gate\.e_score_correction_bias$",),
)

A = "model.layers.{L}.self_attn"
M = "model.layers.{L}.mlp"
#: vLLM 0.33.0's second path to the MLA modules (``MultiHeadLatentAttentionWrapper``).
MLA = A + ".mla_attn"
#: vLLM 0.33.0's second path to the shared experts (``FusedMoEFactory(shared_experts=...)``).
SHARED_ALIAS = M + ".experts._shared_experts._layer"


def _mla(leaf: str, *more: str) -> tuple[str, ...]:
    return (f"{MLA}.{leaf}", *more)


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    # MLA attention, q_lora_rank set
    Param(f"{A}.fused_qkv_a_proj.weight", REPLICATED_MERGED, ("qkva", "H"), when="q_lora",
          feeds=((f"{A}.q_a_proj.weight", ("qr",)),
                 (f"{A}.kv_a_proj_with_mqa.weight", ("qr", "kva"))),
          aliases=_mla("fused_qkv_a_proj.weight"), quantized=True),
    Param(f"{A}.q_a_layernorm.weight", REPLICATED, ("qr",), when="q_lora",
          aliases=_mla("q_a_layernorm.weight")),
    Param(f"{A}.q_b_proj.weight", COLUMN, ("nh*qhd", "qr"), when="q_lora",
          aliases=_mla("q_b_proj.weight"), quantized=True),
    # MLA attention, q_lora_rank null
    Param(f"{A}.kv_a_proj_with_mqa.weight", REPLICATED, ("kva", "H"), when="no_q_lora",
          aliases=_mla("kv_a_proj_with_mqa.weight"), quantized=True),
    Param(f"{A}.q_proj.weight", COLUMN, ("nh*qhd", "H"), when="no_q_lora",
          aliases=_mla("q_proj.weight"), quantized=True),
    Param(f"{A}.kv_a_layernorm.weight", REPLICATED, ("kvr",),
          aliases=_mla("kv_a_layernorm.weight")),
    Param(f"{A}.kv_b_proj.weight", COLUMN, ("nh*kvb", "kvr"),
          aliases=_mla("kv_b_proj.weight", f"{MLA}.mla_attn.kv_b_proj.weight"), quantized=True),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*vd"), aliases=_mla("o_proj.weight"),
          quantized=True),
    # dense MLP (the first first_k_dense_replace layers)
    Param(f"{M}.gate_up_proj.weight", MERGED, ("I", "H"), when="dense_layer",
          feeds=merged_feeds(f"{M}.gate_proj.weight", f"{M}.up_proj.weight"), quantized=True),
    Param(f"{M}.down_proj.weight", ROW, ("H", "I"), when="dense_layer", quantized=True),
    # MoE
    Param(f"{M}.gate.weight", REPLICATED, ("E", "H"), when="moe_layer",
          aliases=(M + ".{router_alias}",)),
    Param(f"{M}.gate.e_score_correction_bias", REPLICATED, ("E",), when="noaux_tc",
          dtype=torch.float32,
          aliases=(f"{M}.experts.gate.e_score_correction_bias",
                   f"{M}.{{experts}}.e_score_correction_bias")),
    Param(f"{M}.shared_experts.gate_up_proj.weight", SHARED_MERGED, ("Is", "H"),
          when="shared_experts",
          feeds=merged_feeds(f"{M}.shared_experts.gate_proj.weight",
                             f"{M}.shared_experts.up_proj.weight"),
          aliases=(f"{SHARED_ALIAS}.gate_up_proj.weight",), quantized=True),
    Param(f"{M}.shared_experts.down_proj.weight", SHARED_ROW, ("H", "Is"), when="shared_experts",
          aliases=(f"{SHARED_ALIAS}.down_proj.weight",), quantized=True),
    Param(f"{M}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"), when="moe_layer",
          feeds=((f"{M}.experts.gate_up_proj.weight", None),), quantized=True),
    Param(f"{M}.{{experts}}.w2_weight", W2, ("E", "H", "Im"), when="moe_layer",
          feeds=((f"{M}.experts.down_proj.weight", None),), quantized=True),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def _architecture(config: Any) -> str:
    """``config.architectures[0]`` (the families composing this module name their own in
    messages), else :data:`ARCHITECTURE`."""
    from .registry import architecture_name

    return architecture_name(config) or ARCHITECTURE


def _has_q_lora(config: Any) -> bool:
    return cfg_get(config, "q_lora_rank", default=None) is not None


def is_moe_layer(config: Any, layer: int) -> bool:
    """vLLM ``DeepseekV2DecoderLayer``: is layer ``layer`` MoE?"""
    if cfg_get(config, "n_routed_experts", default=None) is None:
        return False
    first = int(cfg_get(config, "first_k_dense_replace", default=0))
    freq = int(cfg_get(config, "moe_layer_freq", default=1))
    return layer >= first and layer % freq == 0


def _shared(config: Any) -> int:
    return int(cfg_get(config, "n_shared_experts", default=0) or 0)


#: ``Param.when`` conditions: ``(config, layer) -> bool``.
CONDITIONS = {
    "q_lora": lambda c, L: _has_q_lora(c),
    "no_q_lora": lambda c, L: not _has_q_lora(c),
    "moe_layer": is_moe_layer,
    "dense_layer": lambda c, L: not is_moe_layer(c, L),
    "noaux_tc": lambda c, L: (is_moe_layer(c, L)
                              and cfg_get(c, "topk_method", default=None) == "noaux_tc"),
    "shared_experts": lambda c, L: is_moe_layer(c, L) and _shared(c) > 0,
}


@dataclass(frozen=True)
class MlaSizes(Sizes):
    """``Sizes`` plus the MLA and shared-expert symbols of the table.

    ``qr`` q_lora_rank (0 when null), ``kvr`` kv_lora_rank, ``rope``
    qk_rope_head_dim, ``nope`` qk_nope_head_dim, ``vd`` v_head_dim, ``Is``
    shared experts' intermediate (``moe_intermediate_size * n_shared_experts``);
    derived: ``qhd = nope + rope`` (query head), ``kvb = nope + vd`` (kv_b_proj
    rows per head), ``kva = kvr + rope`` (kv_a_proj_with_mqa rows),
    ``qkva = qr + kva`` (fused_qkv_a_proj rows).
    """

    qr: int = 0
    kvr: int = 0
    rope: int = 0
    nope: int = 0
    vd: int = 0
    Is: int = 0

    @property
    def qhd(self) -> int:
        return self.nope + self.rope

    @property
    def kvb(self) -> int:
        return self.nope + self.vd

    @property
    def kva(self) -> int:
        return self.kvr + self.rope

    @property
    def qkva(self) -> int:
        return self.qr + self.kva


_MLA_KEYS = {
    "E": "n_routed_experts", "qr": "q_lora_rank", "kvr": "kv_lora_rank",
    "rope": "qk_rope_head_dim", "nope": "qk_nope_head_dim", "vd": "v_head_dim",
    "Is": "moe_intermediate_size*n_shared_experts",
    "qhd": "(qk_nope_head_dim+qk_rope_head_dim)", "kvb": "(qk_nope_head_dim+v_head_dim)",
    "kva": "(kv_lora_rank+qk_rope_head_dim)", "qkva": "(q_lora_rank+kv_lora_rank+qk_rope_head_dim)",
}


def sizes(config: Any) -> MlaSizes:
    """``MlaSizes`` of a DeepSeek-V3 / Kimi-K2 config.

    Raises:
        ValueError: a config vLLM does not serve with MLA (no
            ``kv_lora_rank``, or ``qk_nope_head_dim`` and ``qk_rope_head_dim``
            both 0: ``DeepseekAttention``, plain MHA, not in this table), or an
            unsupported ``quantization_config``
            (``m2nkit.adapters.families.quant.fp8_block``).
    """
    from .quant import fp8_block

    architecture = _architecture(config)
    kvr = cfg_get(config, "kv_lora_rank", default=None)
    nope = int(cfg_get(config, "qk_nope_head_dim", default=0))
    rope = int(cfg_get(config, "qk_rope_head_dim", default=0))
    if kvr is None or (nope == 0 and rope == 0):
        raise ValueError(
            f"{architecture} without MLA (kv_lora_rank={kvr}, qk_nope_head_dim={nope}, "
            f"qk_rope_head_dim={rope}) is not supported by m2nkit's table; supported: MLA "
            "configs (kv_lora_rank set, non-zero head dims), as DeepSeek-V2/V3 and Kimi-K2 ship")
    fp8_block(config, architecture)
    E = cfg_get(config, "n_routed_experts", default=None)
    Im = int(cfg_get(config, "moe_intermediate_size", default=0))
    base = base_sizes(config, I=int(cfg_get(config, "intermediate_size")), Im=Im,
                      E=int(E or 0), keys=_MLA_KEYS)
    q_lora = cfg_get(config, "q_lora_rank", default=None)
    return MlaSizes(
        **{f.name: getattr(base, f.name) for f in fields(Sizes)},
        qr=int(q_lora or 0), kvr=int(kvr), rope=rope, nope=nope,
        vd=int(cfg_get(config, "v_head_dim")), Is=Im * _shared(config),
    )


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layer(config: Any, name: str) -> str | None:
    """Why vLLM skips wire tensor ``name``: it belongs to an MTP layer (else ``None``).

    vLLM 0.33.0 ``models/utils.py`` ``get_spec_layer_idx_from_weight_name``:
    layers ``num_hidden_layers .. num_hidden_layers + num_nextn_predict_layers - 1``;
    ``deepseek_v2.py`` ``load_weights`` skips them (``continue``).
    """
    n = int(cfg_get(config, "num_nextn_predict_layers", default=0) or 0)
    m = _LAYER.match(name)
    if not n or not m:
        return None
    layers = int(cfg_get(config, "num_hidden_layers"))
    layer = int(m.group(1))
    if not layers <= layer < layers + n:
        return None
    return (f"multi-token-prediction layer {layer} (num_nextn_predict_layers={n}): vLLM's "
            f"{_architecture(config)} skips it (deepseek_v2.py load_weights, models/utils.py "
            "get_spec_layer_idx_from_weight_name); the MTP draft model loads it")


def mtp_layers(config: Any) -> range:
    """The MTP layer indices: ``num_hidden_layers + i``, ``i < num_nextn_predict_layers``."""
    n = int(cfg_get(config, "num_nextn_predict_layers", default=0) or 0)
    layers = int(cfg_get(config, "num_hidden_layers"))
    return range(layers, layers + n)


#: The MTP module's tensors besides its decoder layer, under ``model.layers.{L}``,
#: as DeepSeek-V3's checkpoint holds them (its ``README_WEIGHTS.md``, "MTP
#: Modules": ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``),
#: in the order vLLM 0.33.0's MTP model registers them (``deepseek_mtp.py``:
#: ``DeepSeekMultiTokenPredictor.embed_tokens``, then the layer's ``enorm``,
#: ``hnorm``, ``eh_proj``, ``shared_head`` and last its decoder block). ``eh_proj``
#: projects ``[embedding; hidden]`` (``nn.Linear(2*H, H)``, not quantized), so it is
#: stored in the model dtype without a scale, like the norms and the head.
MTP_EXTRAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("embed_tokens.weight", ("V", "H")),
    ("enorm.weight", ("H",)),
    ("hnorm.weight", ("H",)),
    ("eh_proj.weight", ("H", "2*H")),
    ("shared_head.norm.weight", ("H",)),
    ("shared_head.head.weight", ("V", "H")),
)


def _table_differs(config: Any) -> str | None:
    """Where transformers' DeepSeek-V3 builds other tensors than vLLM's (and the table):
    it makes every layer from ``first_k_dense_replace`` on MoE (no ``moe_layer_freq``),
    always has the ``e_score_correction_bias`` buffer and the shared experts."""
    if int(cfg_get(config, "moe_layer_freq", default=1)) != 1:
        return "moe_layer_freq != 1: transformers' DeepseekV3 ignores it, vLLM does not"
    if cfg_get(config, "topk_method", default=None) != "noaux_tc":
        return ("topk_method is not noaux_tc: transformers' router always has "
                "e_score_correction_bias, vLLM's only with noaux_tc")
    if not _shared(config):
        return "n_shared_experts=0: transformers' DeepseekV3MoE still builds shared experts"
    return None


def mla_heads_divide_tp(s: Sizes, spec: Any) -> str | None:
    """A ``Family.checks`` rule: each TP rank holds whole attention heads (vLLM
    ``DeepseekV2MLAAttention``: ``assert num_heads % tp_size == 0``; its config check,
    ``ModelConfig.verify_with_parallel_config``, refuses it first)."""
    if s.nh % spec.tp:
        return (f"num_attention_heads={s.nh} is not divisible by tp={spec.tp} (vLLM's MLA "
                "attention holds whole heads on each TP rank: DeepseekV2MLAAttention)")
    return None


def _n_group(config: Any) -> int | None:
    g = cfg_get(config, "n_group", default=None)
    return None if g is None else int(g)


#: Tiny test models (``m2nkit.adapters.tiny``): layer 0 dense, layer 1 MoE;
#: MLA dims small but distinct (q_lora 32, kv_lora 32, rope 8, nope 24,
#: v 8) so a swapped dim shows as a shape error. ``-fp8`` ships the
#: published quantization_config with a small, non-square block [32, 16]
#: (rows, columns: a swap of block_n and block_k shows) and sizes that split
#: on block boundaries at tp 1/2/4 (and not at tp 8);
#: ``-no-q-lora`` is the ``q_lora_rank: null`` variant.
_TINY_BASE = {
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 24,
    "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
    "n_routed_experts": 8, "n_shared_experts": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "num_nextn_predict_layers": 1,
}
#: Keys TINY_SIZES would otherwise set (derived from the shrunk config).
_TINY_DERIVED = {
    "hidden_size": lambda c: 64,
    "num_key_value_heads": lambda c: c.num_attention_heads,   # MLA: one kv per head
    "head_dim": lambda c: c.qk_rope_head_dim,                   # transformers' own rule
}
_FP8_DERIVED = {**_TINY_DERIVED,
                "intermediate_size": lambda c: 128, "moe_intermediate_size": lambda c: 128}
TINY_MODELS = {
    "tiny-deepseek-v3": TinyModel("deepseek_v3", _TINY_BASE, _TINY_DERIVED),
    "tiny-deepseek-v3-fp8": TinyModel("deepseek_v3", {
        **_TINY_BASE,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [32, 16]},
    }, _FP8_DERIVED),
    "tiny-deepseek-v3-no-q-lora": TinyModel("deepseek_v3", {**_TINY_BASE, "q_lora_rank": None},
                                            _TINY_DERIVED),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, (mla_heads_divide_tp,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/deepseek_v2.py", module=__name__,
    num_expert_group=_n_group, skip=mtp_layer,
    skipped_layers=SkippedLayers(mtp_layers, MTP_EXTRAS),    # fp8_per_block quantizes what its fp8 checkpoints quantize (the router,
    # built without quant_config, stays bf16): tests/integration/test_fp8_plan.py
    online_fp8=ONLINE_FP8_FROM_TABLE,
)
