"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``): the Gated DeltaNet MoE text model.

Restated from vLLM 0.33.0 ``model_executor/models/qwen3_5.py``
(``Qwen3_5MoeForCausalLM``; ``Qwen3_5DecoderLayer`` gives **every** layer a
``Qwen3NextSparseMoeBlock`` when ``model_type == "qwen3_5_moe_text"``,
whatever ``mlp_only_layers`` says), checked bit for bit against its real
loaders (``tests/data/oracle/tiny-qwen3.5-moe``) and against the traced layout.

Linear attention is Qwen3.5's (``m2nkit.adapters.families.qwen3_5``), full
attention and the MoE block (router, shared expert and its gate with their
aliases, routed experts) Qwen3-Next's (``m2nkit.adapters.families.qwen3_next``),
including vLLM's refusal of ``tp > num_experts``. The multimodal wrapper
(``Qwen3_5MoeForConditionalGeneration``, e.g. Qwen3.5-397B-A17B) serves this
text model; its :data:`FAMILY` uses ``model.`` prefixes for a wrapper table
to compose.
"""

from __future__ import annotations

from typing import Any

from .kinds import REPLICATED, VOCAB
from .qwen3_5 import LINEAR_ATTENTION_CHILD_ORDER, layer_conditions, linear_attention_params
from .qwen3_next import (EXPERTS_ON_DISK, MOE_CHILD_ORDER, TINY_LINEAR, TINY_MOE_DERIVED,
                         full_attention_params, gdn_config_defaults, gdn_sizes, layer_norms,
                         moe_params, mtp_skip, refuse, tp_within_experts)
from .sizes import cfg_get
from .table import TRANSFORMERS_FUSED_EXPERTS, Family, HFNaming, Param, TinyModel

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS", "FAMILY"]

ARCHITECTURE = "Qwen3_5MoeForCausalLM"

#: transformers 5 (``qwen3_5_moe_text``, ``Qwen3_5MoeTextConfig``'s defaults): no
#: renames; experts fused in memory, per expert on disk.
HF_NAMES = HFNaming(
    fused_experts=TRANSFORMERS_FUSED_EXPERTS, experts_on_disk=EXPERTS_ON_DISK,
    child_order={**LINEAR_ATTENTION_CHILD_ORDER, **MOE_CHILD_ORDER},
    model_types=("qwen3_5_moe_text",),
    config_defaults=gdn_config_defaults(
        hidden_size=2048, vocab_size=248320, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts=256),
)

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *linear_attention_params(),
    *full_attention_params(),
    *moe_params(),
    *layer_norms(),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)

CONDITIONS = layer_conditions(moe=True)


def sizes(config: Any):
    """``GdnSizes`` of a Qwen3.5-MoE text config.

    Raises:
        ValueError: a variant the table does not cover (``qwen3_next.refuse``).
    """
    refuse(config, ARCHITECTURE, __name__, moe=True)
    return gdn_sizes(config, I=0, Im=int(cfg_get(config, "moe_intermediate_size")),
                     E=int(cfg_get(config, "num_experts")))


#: Tiny test model: the shipped ``tests/data/oracle/tiny-qwen3.5-moe`` config (both
#: layers MoE; layer 0 linear attention, layer 1 full; untied).
TINY_MODELS = {
    "tiny-qwen3.5-moe": TinyModel("qwen3_5_moe_text", {
        **TINY_LINEAR, "shared_expert_intermediate_size": 8, "attn_output_gate": True,
    }, TINY_MOE_DERIVED),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, (tp_within_experts,),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/qwen3_5.py", module=__name__,
    skip=mtp_skip,
)
