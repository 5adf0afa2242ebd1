"""Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``): Qwen3.5-MoE's GDN table, Qwen3-VL's tower.

vLLM 0.33.0 ``model_executor/models/qwen3_5.py``:
``Qwen3_5MoeForConditionalGeneration`` (a ``Qwen3_5ForConditionalGeneration``
with the same ``hf_to_vllm_mapper``) builds Qwen3-VL's vision tower and
``language_model = Qwen3_5MoeForCausalLM(config.text_config)``: the table of
``families/qwen3_5_moe.py`` (every layer a ``Qwen3NextSparseMoeBlock``;
router, shared expert and its gate with their aliases, routed experts;
``tp > num_experts`` refused) under the prefixes and with the tower of
``families/qwen3_5_vl.py`` (e.g. Qwen3.5-397B-A17B). Experts are per expert
on disk (transformers 5's ``save_pretrained`` and the hub's checkpoints:
``experts.N.gate_proj.weight``), stacked on the wire as every MoE family's.
"""

from __future__ import annotations

from .qwen3_5_moe import FAMILY as QWEN3_5_MOE
from .qwen3_5_vl import TINY_TEXT, TINY_TOKENS, TINY_VISION, qwen3_5_wrapper
from .table import TinyModel

__all__ = ["ARCHITECTURE", "TINY_MODELS", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "FAMILY"]

ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"

#: Tiny test model (``m2nkit.adapters.tiny``): the shipped tests/data/oracle/tiny-qwen3.5-moe-vl's
#: sizes (every layer MoE: 4 experts of 8, a shared expert of 8; untied).
TINY_MODELS = {
    "tiny-qwen3.5-moe-vl": TinyModel("qwen3_5_moe", {
        "tie_word_embeddings": False, **TINY_TOKENS, "vision_config": TINY_VISION,
        "text_config": {**TINY_TEXT, "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}}),
}

FAMILY = qwen3_5_wrapper(ARCHITECTURE, QWEN3_5_MOE, "qwen3_5_moe", __name__, TINY_MODELS)
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
