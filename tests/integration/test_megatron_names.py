"""The Megatron name tables (``m2nkit.adapters.megatron.names``) against Megatron-Bridge 0.6.2's
own mapping registries.

Every Megatron-Core name a family lists (local and TransformerEngine spellings,
at layer 3 and local expert 5) that Bridge's registry resolves must resolve to
the same Hugging Face tensors (Bridge names experts per expert; m2nkit's wire
stacks them under ``<block>.experts.gate_up_proj/down_proj.weight``). Names
Bridge does not list are exactly the ones named below (biases these models do
not have, and the dense-MLP TE norm of a MoE model), so a renamed or dropped
name shows up here.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.integration

BRIDGES = {
    "LlamaForCausalLM": ("megatron.bridge.models.llama.llama_bridge", "LlamaBridge"),
    "Qwen2ForCausalLM": ("megatron.bridge.models.qwen.qwen2_bridge", "Qwen2Bridge"),
    "Qwen3ForCausalLM": ("megatron.bridge.models.qwen.qwen3_bridge", "Qwen3Bridge"),
    "Qwen3MoeForCausalLM": ("megatron.bridge.models.qwen.qwen3_moe_bridge", "Qwen3MoEBridge"),
}


def _stacked(hf: str) -> str:
    """Bridge's per-expert HF name -> m2nkit's stacked wire name."""
    m = re.match(r"^(.*\.experts)\.\d+\.(gate|up|down)_proj\.weight$", hf)
    if not m:
        return hf
    return f"{m.group(1)}.{'down_proj' if m.group(2) == 'down' else 'gate_up_proj'}.weight"


@pytest.mark.parametrize("arch", sorted(BRIDGES))
def test_megatron_names_resolve_like_bridge(arch):
    import importlib

    from m2nkit.adapters.megatron.compat import enable_cpu
    from m2nkit.adapters.megatron.names import megatron_names

    enable_cpu()
    mod, cls = BRIDGES[arch]
    registry = getattr(importlib.import_module(mod), cls)().mapping_registry()
    unresolved = []
    for entry in megatron_names(arch):
        want = {p: w.replace("{L}", "3") for p, w in entry.wires.items()}
        for template in entry.megatron:
            name = template.replace("{L}", "3").replace("{i}", "5")
            m = registry.megatron_to_hf_lookup(name)
            if m is None:
                unresolved.append(template)
                continue
            hf = m.hf_param
            if isinstance(hf, str):
                assert set(want.values()) == {_stacked(hf)}, (arch, name, hf, want)
            elif None in want:  # experts: Bridge's gate and up both stack into gate_up_proj
                assert {_stacked(v) for v in hf.values()} == {want[None]}, (arch, name, hf)
                assert set(hf) == {"gate", "up"}, (arch, name, hf)
            else:
                assert {k: _stacked(v) for k, v in hf.items()} == want, (arch, name, hf, want)
    biases = {"decoder.layers.{L}.self_attention.linear_proj.bias",
              "decoder.layers.{L}.mlp.linear_fc1.bias", "decoder.layers.{L}.mlp.linear_fc2.bias"}
    if arch != "Qwen2ForCausalLM":  # Qwen2 has q/k/v biases; the others have none
        biases.add("decoder.layers.{L}.self_attention.linear_qkv.bias")
    expected = set(biases)
    if arch == "Qwen3MoeForCausalLM":  # MoE layers: a separate pre_mlp_layernorm in both specs
        expected |= {"decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight",
                     "decoder.layers.{L}.mlp.linear_fc1.weight", "decoder.layers.{L}.mlp.linear_fc2.weight"}
    assert set(unresolved) <= expected, (arch, sorted(set(unresolved) - expected))
    assert not (set(unresolved) & {"decoder.layers.{L}.self_attention.linear_qkv.weight",
                                   "embedding.word_embeddings.weight"})
