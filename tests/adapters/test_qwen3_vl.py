"""Qwen3-VL and Qwen3-VL-MoE from their tables (families/qwen3_vl.py, qwen3_vl_moe.py, wrapper.py).

The shipped tiny checkpoints (tests/data/oracle/tiny-qwen3-vl, -moe: made by
transformers' own classes, the MoE one with its experts in the published
``[E, in, out]`` order) are read by ``read_checkpoint`` and planned with the
tables; every worker filled through the layout's bindings must equal real
vLLM 0.33.0's dump bit for bit. A few facts of the wrapper are written out
by hand (which vLLM parameter takes which wire tensor, where), so a wrong
prefix, kind or dim order fails with a message that names it. The published
configs plan from their tables alone, moving the minimum.
"""

from __future__ import annotations

import json

from _paths import CONFIGS, ORACLE
import pytest
import torch
from safetensors.torch import load_file, save_file

from m2nkit.adapters.families import family
from m2nkit.adapters.hf_checkpoint import CheckpointError, read_checkpoint
from m2nkit.adapters.vllm import destination_layout
from m2nkit.engine.tools.cli import main

from _oracle import assert_layout_equals_dumps

VL, VL_MOE = "tiny-qwen3-vl", "tiny-qwen3-vl-moe"
LAYOUTS = [(VL, 1, False), (VL, 2, False), (VL, 4, False),
           (VL_MOE, 1, False), (VL_MOE, 2, False), (VL_MOE, 4, False),
           (VL_MOE, 2, True), (VL_MOE, 4, True)]


def _read(model: str):
    ckpt = read_checkpoint(ORACLE / model / "checkpoint")
    return ckpt, {p.name: ckpt.read_full(p.name) for p in ckpt.params}


def _bindings(layout, wire: str, worker: int):
    return sorted((b.param, b.box, b.offset) for b in layout.bindings[wire] if b.worker == worker)


@pytest.mark.parametrize("model,tp,ep", LAYOUTS, ids=lambda x: str(x))
def test_checkpoint_planned_from_the_table_equals_vllm(model, tp, ep):
    ckpt, wire = _read(model)
    layout = destination_layout(ckpt.config, ckpt.params, f"vllm:tp={tp}" + (",ep" if ep else ""))
    assert not layout.unknown, layout.unknown
    assert_layout_equals_dumps(layout, wire, model, tp, ep, "linear", "auto", "table: ")


def test_wire_names_are_the_checkpoints_and_vllm_names_the_mappers():
    """transformers 5's on-disk names on the wire; vLLM's hf_to_vllm_mapper targets on the
    workers (model.visual. -> visual., model.language_model. -> language_model.model.,
    lm_head. -> language_model.lm_head.)."""
    ckpt, _ = _read(VL)
    names = [p.name for p in ckpt.params]
    assert names[:3] == ["model.visual.patch_embed.proj.weight",
                         "model.visual.patch_embed.proj.bias", "model.visual.pos_embed.weight"]
    assert "lm_head.weight" not in names          # tied: the tiny checkpoint does not hold it
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2")
    assert layout.aliases == {"language_model.lm_head.weight":
                              "language_model.model.embed_tokens.weight"}
    # Qwen3's q/k/v fused into qkv_proj under the language model's prefix
    assert {b.param for b in layout.bindings[
        "model.language_model.layers.1.self_attn.k_proj.weight"]} == {
        "language_model.model.layers.1.self_attn.qkv_proj.weight"}


def test_vision_qkv_is_one_fused_tensor_split_by_heads():
    """attn.qkv [3*H, H] (H = 16, 4 heads of 4): rank r of tp=2 takes heads 2r, 2r+1 of each
    of q, k and v (QKVParallelLinear.weight_loader, loaded_shard_id None)."""
    ckpt, _ = _read(VL)
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2")
    qkv = "visual.blocks.1.attn.qkv.weight"
    assert _bindings(layout, "model.visual.blocks.1.attn.qkv.weight", 1) == [
        (qkv, ((8, 16), (0, 16)), (0, 0)), (qkv, ((24, 32), (0, 16)), (8, 0)),
        (qkv, ((40, 48), (0, 16)), (16, 0))]
    assert _bindings(layout, "model.visual.blocks.1.attn.qkv.bias", 0) == [
        ("visual.blocks.1.attn.qkv.bias", ((a, a + 8),), (o,)) for a, o in
        ((0, 0), (16, 8), (32, 16))]
    # the mergers: linear_fc1 column, linear_fc2 row; the merger's norm is over the
    # tower's hidden (16), a deepstack merger's over the merged hidden (16 * 2**2)
    shapes = {(p.worker, p.name): p.shape for p in layout.params}
    assert shapes[1, "visual.merger.norm.weight"] == (16,)
    assert shapes[1, "visual.deepstack_merger_list.0.norm.weight"] == (64,)
    assert _bindings(layout, "model.visual.deepstack_merger_list.0.linear_fc2.weight", 1) == [
        ("visual.deepstack_merger_list.0.linear_fc2.weight", ((0, 64), (32, 64)), (0, 0))]


def test_vision_heads_bound_tp():
    ckpt, _ = _read(VL)
    with pytest.raises(ValueError, match=r"visual\.blocks\.0\.attn\.qkv\.weight: "
                       r"vision_config\.num_heads=4 heads are not divisible by tp=8; "
                       r"valid tp with dp=1: \[1, 2, 4\]"):
        destination_layout(ckpt.config, ckpt.params, "vllm:tp=8")


def test_moe_experts_are_read_from_the_published_in_out_order():
    """On disk ``experts.gate_up_proj`` [E, H, 2*Im] (the published order); on the wire
    ``experts.gate_up_proj.weight`` [E, 2*Im, H], a permuted view of it; with EP 2,
    worker 1 holds experts 2 and 3 whole."""
    ckpt, wire = _read(VL_MOE)
    disk = load_file(str(ORACLE / VL_MOE / "checkpoint" / "model.safetensors"))
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert disk[name].shape == (4, 64, 16)
    assert ckpt.meta(name + ".weight").shape == (4, 16, 64)
    assert torch.equal(wire[name + ".weight"], disk[name].transpose(1, 2))
    assert ckpt.disk_names(name + ".weight") == (name,)
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2,ep")
    w13 = "language_model.model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert _bindings(layout, name + ".weight", 1) == [(w13, ((2, 4), (0, 16), (0, 64)), (0, 0, 0))]
    assert layout.aliases["language_model.model.layers.0.mlp.experts.gate.weight"] == \
        "language_model.model.layers.0.mlp.gate.weight"
    assert "lm_head.weight" in layout.bindings          # untied: a wire tensor of its own


def test_moe_experts_in_transformers_save_order_are_refused(tmp_path):
    """transformers 5.12.1's save_pretrained writes the in-memory [E, out, in]; the table
    reads the published [E, in, out] only, and says so."""
    src = ORACLE / VL_MOE / "checkpoint"
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors = {n: (t.transpose(1, 2).contiguous() if n.endswith("experts.gate_up_proj") else t)
               for n, t in tensors.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj' .* has shape \[4, 16, 64\], "
                       r"but the config \(Qwen3VLMoeForConditionalGeneration\) expects stacked "
                       r"experts \[4, 64, 16\]: \[experts, in, out\]"):
        read_checkpoint(tmp_path)


def test_tied_embeddings_are_read_at_the_wrappers_top_level():
    """vLLM copies the wrapper's tie_word_embeddings into its text config (config/vllm.py,
    with_hf_config); Qwen3VLMoeTextConfig's own default (True) does not count."""
    data = json.loads((CONFIGS / "Qwen__Qwen3-VL-30B-A3B-Instruct" / "config.json").read_text())
    assert "tie_word_embeddings" not in data["text_config"]
    fam = family("Qwen3VLMoeForConditionalGeneration")
    assert fam.sizes(data).tied is False
    assert fam.sizes({**data, "tie_word_embeddings": True}).tied is True


def _plan(capsys, config, inference):
    capsys.readouterr()
    code = main(["plan", str(config), "--trainer", "fsdp:64", "--inference", inference,
                 "--layout", "tables"])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name,inference", [
    ("Qwen__Qwen3-VL-8B-Instruct", "vllm:tp=4"), ("Qwen__Qwen3-VL-8B-Instruct", "vllm:tp=8"),
    ("Qwen__Qwen3-VL-30B-A3B-Instruct", "vllm:tp=4,ep"),
    ("Qwen__Qwen3-VL-30B-A3B-Instruct", "vllm:tp=8,ep")])
def test_published_configs_plan_from_tables_moving_the_minimum(capsys, name, inference):
    code, out = _plan(capsys, CONFIGS / name / "config.json", inference)
    assert code == 0, out
    assert "(ratio 1.000)" in out and "m2nkit's family tables" in out
    assert [line for line in out.splitlines() if "problems" in line][0].split("│")[2].strip() \
        == "none"
