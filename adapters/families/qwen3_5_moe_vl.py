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
from .qwen3_5_vl import qwen3_5_wrapper

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "FAMILY"]

ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"

FAMILY = qwen3_5_wrapper(ARCHITECTURE, QWEN3_5_MOE, "qwen3_5_moe", __name__)
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
