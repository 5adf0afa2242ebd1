"""Llama-4 (``Llama4ForCausalLM``, ``Llama4ForConditionalGeneration``): the wire, no table yet.

Llama-4 has no m2nkit family table: its destination layout is traced from
vLLM's loaders (``m2nkit.adapters.vllm.trace``), and the trainer side is
transformers' own model (``families.tableless``) but for one thing
transformers does not say and a trace cannot run without: the dim order of
the routed experts on the wire.

transformers 5.12.1 keeps Llama-4's routed experts stacked ``[E, in, out]``
(``models/llama4/modeling_llama4.py``, ``Llama4TextExperts``:
``gate_up_proj [E, H, 2*I]``, ``down_proj [E, I, H]``; the checkpoints
store them so), while vLLM 0.33.0 holds them ``[E, out, in]``
(``w13_weight [E, 2*I, H]``, ``w2_weight [E, H, I]``) and transposes each
3-D fused tensor it is handed (``Llama4Model.load_moe_expert_weights``,
``models/llama4.py``: ``loaded_weight.transpose(-1, -2)``). A binding (a box
of the wire landing at an offset, same dim order) cannot express that
transpose except one row at a time, so, as for GPT-OSS
(``families/gpt_oss.py``), the experts travel transposed:
``<block>.experts.gate_up_proj.weight [E, 2*I, H]`` and
``<block>.experts.down_proj.weight [E, H, I]`` (``HFNaming.permuted``, order
``(0, 2, 1)``; an FSDP2 rank's piece is its local box transposed, a view;
the checkpoint reader reads the permuted box from disk). The trace hands
vLLM the transpose back (``trace._whole_feed``), which its own
``transpose(-1, -2)`` undoes.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "PERMUTED"]

#: transformers' and vLLM's names of the text model and its multimodal wrapper.
ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")

#: ``HFNaming.permuted`` of both architectures: on-disk leaf -> (wire leaf, order).
PERMUTED = {
    "feed_forward.experts.gate_up_proj": ("feed_forward.experts.gate_up_proj.weight", (0, 2, 1)),
    "feed_forward.experts.down_proj": ("feed_forward.experts.down_proj.weight", (0, 2, 1)),
}
