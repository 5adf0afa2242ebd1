"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 plus the DSA indexer.

vLLM 0.33.0 serves it with the classes of DeepSeek-V3
(``model_executor/models/deepseek_v2.py``: the registry maps
``DeepseekV32ForCausalLM`` to ``DeepseekV3ForCausalLM``), so everything of
:mod:`.deepseek_v3` holds (MLA, MoE with shared experts, the float32
``e_score_correction_bias``, dense first layers, the skipped MTP layer, fp8
blocks) and is composed here, not copied. What DeepSeek Sparse Attention adds
(``DeepseekV2MLAAttention`` builds an ``Indexer`` when the config has
``index_topk``; checked against ``tests/data/oracle/tiny-deepseek-v32``):

* ``indexer.wq_b [index_n_heads*index_head_dim, q_lora_rank]``: a
  ``ReplicatedLinear`` (whole on every worker) built with the model's
  ``quant_config``, so fp8 with a ``weight_scale_inv`` under an fp8 block
  ``quantization_config``;
* ``indexer.wk [index_head_dim, H]`` and ``indexer.weights_proj
  [index_n_heads, H]`` fuse into ``indexer.wk_weights_proj``, wk rows then
  weights_proj rows, **not split by TP** (``MergedColumnParallelLinear(...,
  disable_tp=True)``, kind ``REPLICATED_MERGED``, as ``fused_qkv_a_proj``)
  and built with ``quant_config=None``: bf16 even in an fp8 model
  (``load_weights``: ``("wk_weights_proj", "wk", 0)``, ``("wk_weights_proj",
  "weights_proj", 1)`` in ``stacked_params_mapping``);
* ``indexer.k_norm`` a ``LayerNorm`` (weight and bias) allocated **float32**
  (``LayerNorm(head_dim, eps=1e-6, dtype=torch.float32)``); the published
  checkpoint stores it float32 as well (DeepSeek's reference
  ``inference/model.py``, ``LayerNorm``), so config-only plans give the wire
  tensor float32; a bf16 one (transformers' model, the tiny checkpoints) is
  cast on arrival;
* the indexer modules are aliased under ``self_attn.mla_attn.indexer.*`` and
  ``self_attn.mla_attn.mla_attn.indexer.*`` (read off the dumps).

**Which layers have an indexer** (``DeepseekV2MLAAttention.__init__``, vLLM's
IndexCache rule): every layer unless the config sets ``index_topk_pattern``
(``"S"`` at a layer: none) or ``index_topk_freq > 1`` (a layer ``L`` has one
when ``max(L - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``,
offset default 2); MTP layers always do. ``load_weights`` drops the
checkpoint's indexer tensors of a layer without one: the plan lists them as
skipped, with that reason.

**Refused**: an fp8 ``indexer.wk`` (a checkpoint holding
``indexer.wk.weight_scale_inv``). vLLM upcasts it at load time to fit the
bf16 fused parameter (``_try_load_fp8_indexer_wk``: ``scaled_dequantize`` of
weight and scale, then the loader of shard 0), which is arithmetic, not a
copy of a box; send ``wk`` in bf16 (what vLLM holds), as the table's wire
does (config-only plans of the published fp8 config say so in a note).
``q_lora_rank: null`` is refused too: vLLM asserts a q LoRA rank for the
indexer.

**Names**: transformers 5 (``deepseek_v32``, ``DeepseekV32Config``) names the
indexer tensors as the checkpoint does and registers them after ``o_proj``
in the order ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``; its
``DeepseekV32NaiveMoe`` sizes the stacked experts by ``num_experts``
(``num_local_experts``), not ``n_routed_experts``, and its ``head_dim`` is
always ``qk_rope_head_dim``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from . import deepseek_v3 as v3
from .kinds import REPLICATED, REPLICATED_MERGED
from .sizes import cfg_get
from .table import Family, Param, SkippedLayers, TinyModel, alias, kv_heads

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS", "FAMILY",
           "DsaSizes", "INDEXER_PARAMS", "has_indexer", "indexer_params", "dsa_sizes",
           "dsa_skip", "dsa_notes", "dsa_table_differs", "dsa_config_defaults",
           "mlp_layer_types"]

ARCHITECTURE = "DeepseekV32ForCausalLM"

IDX = v3.A + ".indexer"
#: vLLM 0.33.0's second and third paths to the indexer (``MultiHeadLatentAttentionWrapper``).
_IDX_ALIASES = (v3.MLA + ".indexer", v3.MLA + ".mla_attn.indexer")


def _aliases(leaf: str) -> tuple[str, ...]:
    return tuple(f"{a}.{leaf}" for a in _IDX_ALIASES)


#: The indexer's vLLM parameters, in ``named_parameters()`` order (``Indexer.__init__``).
INDEXER_PARAMS: tuple[Param, ...] = (
    Param(f"{IDX}.wq_b.weight", REPLICATED, ("inh*ihd", "qr"), when="indexer",
          aliases=_aliases("wq_b.weight"), quantized=True),
    Param(f"{IDX}.wk_weights_proj.weight", REPLICATED_MERGED, ("iwk", "H"), when="indexer",
          feeds=((f"{IDX}.wk.weight", ("ihd",)), (f"{IDX}.weights_proj.weight", ("ihd", "inh"))),
          aliases=_aliases("wk_weights_proj.weight")),
    Param(f"{IDX}.k_norm.weight", REPLICATED, ("ihd",), when="indexer", dtype=torch.float32,
          aliases=_aliases("k_norm.weight")),
    Param(f"{IDX}.k_norm.bias", REPLICATED, ("ihd",), when="indexer", dtype=torch.float32,
          aliases=_aliases("k_norm.bias")),
)


def indexer_params(base: tuple[Param, ...] = v3.VLLM_PARAMS) -> tuple[Param, ...]:
    """DeepSeek-V3's table with :data:`INDEXER_PARAMS` after the attention's ``o_proj``
    (vLLM registers ``self.indexer`` after ``o_proj`` in ``DeepseekV2MLAAttention``)."""
    at = next(i for i, p in enumerate(base) if p.name == f"{v3.A}.o_proj.weight") + 1
    return (*base[:at], *INDEXER_PARAMS, *base[at:])


VLLM_PARAMS = indexer_params()


def has_indexer(config: Any, layer: int | None) -> bool:
    """vLLM ``DeepseekV2MLAAttention``: does layer ``layer`` build an ``Indexer``?"""
    if cfg_get(config, "index_topk", default=None) is None or layer is None:
        return False
    if layer >= int(cfg_get(config, "num_hidden_layers")):
        return True                                    # MTP layers always do
    pattern = cfg_get(config, "index_topk_pattern", default=None)
    if pattern is not None:
        return not (0 <= layer < len(pattern) and pattern[layer] == "S")
    freq = int(cfg_get(config, "index_topk_freq", default=1))
    offset = int(cfg_get(config, "index_skip_topk_offset", default=2))
    return max(layer - offset + 1, 0) % freq == 0


CONDITIONS = {**v3.CONDITIONS, "indexer": has_indexer}


@dataclass(frozen=True)
class DsaSizes(v3.MlaSizes):
    """``MlaSizes`` plus the indexer's: ``ihd`` index_head_dim, ``inh`` index_n_heads;
    derived ``iwk = ihd + inh`` (``wk_weights_proj`` rows)."""

    ihd: int = 0
    inh: int = 0

    @property
    def iwk(self) -> int:
        return self.ihd + self.inh


_DSA_KEYS = {"ihd": "index_head_dim", "inh": "index_n_heads",
             "iwk": "(index_head_dim+index_n_heads)"}


def dsa_sizes(config: Any) -> DsaSizes:
    """``DsaSizes`` of a DeepSeek-V3.2 / GLM-5 config (DeepSeek-V3's rules, then the indexer's).

    Raises:
        ValueError: what :func:`.deepseek_v3.sizes` refuses, or ``q_lora_rank:
            null`` (vLLM asserts a q LoRA rank for the indexer).
    """
    base = v3.sizes(config)
    arch = v3._architecture(config)
    if not base.qr:
        raise ValueError(f"{arch} with q_lora_rank null is not supported: vLLM's DSA indexer "
                         "needs the q LoRA rank (DeepseekV2MLAAttention asserts it); supported: "
                         "q_lora_rank set, as the published configs have it")
    return DsaSizes(**{f.name: getattr(base, f.name) for f in fields(v3.MlaSizes)
                       if f.name != "keys"},
                    keys={**base.keys, **_DSA_KEYS},
                    ihd=int(cfg_get(config, "index_head_dim")),
                    inh=int(cfg_get(config, "index_n_heads")))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.self_attn\.indexer\.")


def dsa_skip(config: Any, name: str) -> str | None:
    """Why vLLM skips wire tensor ``name``: an MTP layer's (DeepSeek-V3's rule), or the
    indexer of a layer vLLM builds none for (``load_weights``: "this layer has no
    indexer; drop its checkpoint weights")."""
    why = v3.mtp_layer(config, name)
    if why is not None:
        return why
    m = _LAYER.match(name)
    if m is None or has_indexer(config, int(m.group(1))):
        return None
    return (f"layer {m.group(1)} has no DSA indexer in vLLM (index_topk_freq="
            f"{cfg_get(config, 'index_topk_freq', default=1)}, index_topk_pattern="
            f"{cfg_get(config, 'index_topk_pattern', default=None)!r}): deepseek_v2.py "
            "load_weights drops its indexer tensors")


def dsa_notes(config: Any) -> tuple[str, ...]:
    """With fp8 blocks: ``indexer.wk`` travels in bf16 (vLLM's parameter), not fp8."""
    from .quant import fp8_block

    if fp8_block(config, v3._architecture(config)) is None:
        return ()
    return ("indexer.wk is planned in bfloat16, the dtype of vLLM's unquantized "
            "wk_weights_proj; vLLM dequantizes an fp8 wk checkpoint tensor at load time "
            "(deepseek_v2.py _try_load_fp8_indexer_wk), which is arithmetic, not a copy",)


def mlp_layer_types(c: Any) -> list[str]:
    """``HFNaming.config_defaults`` rule of transformers' DSA config classes
    (``__post_init__``): the file's ``mlp_layer_types``, else ``first_k_dense_replace``
    dense layers, then sparse ones."""
    types = c.get("mlp_layer_types")
    if types is not None:
        return types
    n = c["num_hidden_layers"]
    dense = min(c["first_k_dense_replace"], n)
    return ["dense"] * dense + ["sparse"] * (n - dense)


def dsa_table_differs(config: Any) -> str | None:
    """Where transformers' DSA model has other tensors than vLLM's: DeepSeek-V3's cases,
    MoE layers from ``mlp_layer_types`` where vLLM reads ``first_k_dense_replace`` and
    ``moe_layer_freq``, and an indexer in every layer (vLLM's IndexCache rule builds
    fewer)."""
    why = v3._table_differs(config)
    if why is not None:
        return why
    layers = int(cfg_get(config, "num_hidden_layers"))
    types = cfg_get(config, "mlp_layer_types", default=None)
    if types is not None and [t == "sparse" for t in types] != [
            v3.is_moe_layer(config, L) for L in range(layers)]:
        return "mlp_layer_types disagrees with first_k_dense_replace: vLLM reads the latter"
    if not all(has_indexer(config, L) for L in range(layers)):
        return ("index_topk_freq/index_topk_pattern: vLLM builds no indexer in some layers, "
                "transformers' DeepseekV32 builds one in every layer")
    return None


def _v32_table_differs(config: Any) -> str | None:
    experts = cfg_get(config, "num_experts", default=None)
    if experts is not None and experts != cfg_get(config, "n_routed_experts", default=None):
        return ("num_experts != n_routed_experts: transformers' DeepseekV32 stacks num_experts "
                "experts, vLLM builds n_routed_experts")
    return dsa_table_differs(config)


def dsa_config_defaults(**values: Any) -> dict[str, Any]:
    """``HFNaming.config_defaults`` of transformers 5.12's DSA config classes
    (``DeepseekV32Config``, ``GlmMoeDsaConfig``): the class's field ``values`` plus the
    rules both ``__post_init__`` apply (``head_dim`` is ``qk_rope_head_dim`` whatever the
    file says; ``mlp_layer_types`` from ``first_k_dense_replace``). Neither class has
    ``num_nextn_predict_layers``: a file without it has no MTP layer (0), as transformers
    reads it; the published configs set 1."""
    heads = values.pop("num_attention_heads_default")
    return {**values, "num_key_value_heads": kv_heads(heads),
            "num_nextn_predict_layers": 0,
            "head_dim": lambda c: c["qk_rope_head_dim"],
            "mlp_layer_types": mlp_layer_types}


#: transformers 5: DeepSeek-V3's names and rules, the ``deepseek_v32`` config class,
#: and the indexer registered after ``o_proj`` (``wq_b``, ``wk``, ``k_norm``,
#: ``weights_proj``; vLLM: ``wq_b``, the fused ``wk_weights_proj``, ``k_norm``).
HF_NAMES = replace(
    v3.HF_NAMES, config_classes={}, model_types=("deepseek_v32",),
    refused=((r"\.self_attn\.indexer\.wk\.weight_scale_inv$",
              "an fp8 indexer.wk: vLLM dequantizes it into its bf16 wk_weights_proj at load "
              "time (deepseek_v2.py _try_load_fp8_indexer_wk: scaled_dequantize), which is "
              "arithmetic, not a copy m2nkit can plan; send indexer.wk in bfloat16"),),
    child_order={**v3.HF_NAMES.child_order,
                 v3.A: (*v3.HF_NAMES.child_order[v3.A], "indexer"),
                 IDX: ("wq_b", "wk", "k_norm", "weights_proj")},
    config_defaults=dsa_config_defaults(
        hidden_size=7168, vocab_size=129280, num_attention_heads=128, num_hidden_layers=61,
        intermediate_size=18432, moe_intermediate_size=2048, n_shared_experts=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_group=8, first_k_dense_replace=3, tie_word_embeddings=False,
        index_topk=2048, index_head_dim=128, index_n_heads=64, n_routed_experts=256,
        num_attention_heads_default=128,
        # DeepseekV32Config.attribute_map: num_local_experts is num_experts
        num_experts=alias("num_experts", "num_local_experts", 256)),
    table_differs=_v32_table_differs,
)

#: Tiny test model (``m2nkit.adapters.tiny``): DeepSeek-V3's tiny sizes (layer 0
#: dense, layer 1 MoE with 8 routed experts in 2 groups and a shared expert) plus an
#: indexer of 4 heads of 16. (The oracle dumps are of a checkpoint transformers built
#: by itself, ``tests/data/oracle/tiny-deepseek-v32``.)
_TINY = {**{k: v for k, v in v3._TINY_BASE.items() if k != "num_nextn_predict_layers"},
         "index_head_dim": 16, "index_n_heads": 4, "index_topk": 16}
TINY_MODELS = {"tiny-deepseek-v32": TinyModel("deepseek_v32", {**_TINY, "num_experts": 8},
                                              v3._TINY_DERIVED)}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, dsa_sizes, CONDITIONS, (v3.mla_heads_divide_tp,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/deepseek_v2.py", module=__name__,
    num_expert_group=v3._n_group, skip=dsa_skip, notes=dsa_notes,
    skipped_layers=SkippedLayers(v3.mtp_layers, v3.MTP_EXTRAS),
)
