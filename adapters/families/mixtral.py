"""Mixtral (``MixtralForCausalLM``): everything m2nkit knows about the family.

Every layer is sparse (vLLM 0.33.0 ``model_executor/models/mixtral.py``):
router ``block_sparse_moe.gate`` (replicated; not aliased, ``MixtralMoE``
does not hand it to ``FusedMoEFactory``) and experts ``w1`` (gate), ``w3``
(up), ``w2`` (down) of size ``intermediate_size``
(``ckpt_names=("w1", "w2", "w3")``); attention has no biases.

Names: transformers 5 calls the MoE block ``mlp`` in memory but
``block_sparse_moe`` on disk, keeps the experts fused in memory and writes
them per expert on disk (``block_sparse_moe.experts.{e}.w1.weight`` ...;
the published Mixtral-8x7B index agrees). The wire carries them stacked:
``block_sparse_moe.experts.gate_up_proj.weight = cat(w1_e, w3_e)`` per
expert and ``block_sparse_moe.experts.down_proj.weight = w2_e``.
"""

from __future__ import annotations

from typing import Any

from .kinds import QKV, REPLICATED, ROW, VOCAB, W13, W2
from .llama import ATTENTION as A
from .llama import ATTENTION_TP, EMBEDDINGS_TP
from .sizes import base_sizes, cfg_get
from .table import (TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param, TinyModel, TPPlan,
                    alias, kv_heads, qkv_feeds)

__all__ = ["ARCHITECTURE", "HF_NAMES", "EXPERTS_ON_DISK", "VLLM_PARAMS", "CONDITIONS",
           "TINY_MODELS", "FAMILY", "TP_PLAN"]

ARCHITECTURE = "MixtralForCausalLM"

#: Expert fusing: the stacked wire tensors are built from these per-expert
#: on-disk tensors (part -> pattern; ``{prefix}`` = ``model.layers.{L}.block_sparse_moe``).
EXPERTS_ON_DISK = {
    "gate": "{prefix}.experts.{e}.w1.weight",
    "up": "{prefix}.experts.{e}.w3.weight",
    "down": "{prefix}.experts.{e}.w2.weight",
}

#: transformers 5: the in-memory ``mlp`` block is ``block_sparse_moe`` on disk.
#: Config-only plans read ``config.json`` with ``MixtralConfig``'s defaults
#: (transformers 5 ``configuration_mixtral.py``).
HF_NAMES = HFNaming(
    renames=((r"^(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe."),),
    fused_experts=TRANSFORMERS_FUSED_EXPERTS,
    experts_on_disk=EXPERTS_ON_DISK,
    model_types=("mixtral",),
    config_defaults={"hidden_size": 4096, "vocab_size": 32000, "num_attention_heads": 32,
                     "num_hidden_layers": 32, "intermediate_size": 14336, "head_dim": None,
                     "tie_word_embeddings": False, "num_key_value_heads": kv_heads(8),
                     "num_local_experts": alias("num_local_experts", "num_experts", 8)},
)

B = "model.layers.{L}.block_sparse_moe"

#: Tensor parallelism as trainers apply it: Llama's attention and embeddings
#: (``MixtralConfig.base_model_tp_plan`` lists the same attention modules);
#: routers and experts stay whole on every TP rank.
TP_PLAN = TPPlan(ATTENTION_TP, untied=EMBEDDINGS_TP)

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(A)),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd")),
    Param(f"{B}.gate.weight", REPLICATED, ("E", "H")),
    Param(f"{B}.{{experts}}.w13_weight", W13, ("E", "2*Im", "H"),
          feeds=((f"{B}.experts.gate_up_proj.weight", None),)),
    Param(f"{B}.{{experts}}.w2_weight", W2, ("E", "H", "Im"),
          feeds=((f"{B}.experts.down_proj.weight", None),)),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

#: ``Param.when`` conditions: none (every layer is sparse).
CONDITIONS: dict = {}


def sizes(config: Any):
    """``Sizes`` of a Mixtral config (``Im`` = ``intermediate_size``, ``E`` = ``num_local_experts``)."""
    return base_sizes(
        config,
        Im=int(cfg_get(config, "intermediate_size")),
        E=int(cfg_get(config, "num_local_experts")),
        keys={"Im": "intermediate_size", "E": "num_local_experts"},
    )


#: Tiny test models (``m2nkit.adapters.tiny``).
TINY_MODELS = {"tiny-mixtral": TinyModel("mixtral")}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/mixtral.py",
    module=__name__, tp_plan=TP_PLAN,
)
