"""Qwen3.5 and Qwen3.5-MoE wrappers from their tables (families/qwen3_5_vl.py, qwen3_5_moe_vl.py).

The shipped tiny checkpoints (tests/data/oracle/tiny-qwen3.5-vl, -moe-vl:
transformers' own classes, vision tower of 4 heads without deepstack
mergers) are read by ``read_checkpoint`` and planned with the composed
tables; every worker filled through the layout's bindings must equal real
vLLM 0.33.0's dump bit for bit. Hand-checked: the vision ``attn.qkv`` boxes,
the Gated DeltaNet fusions under the wrapper's prefixes, the skipped
top-level ``mtp.*``, no deepstack rows. The published configs plan from
their tables alone, moving the minimum. Table against vLLM's traced loaders:
tests/integration/test_vllm_trace.py.
"""

from __future__ import annotations

import json

from _oracle import ALL_FIXTURES, assert_layout_equals_dumps
from _paths import CONFIGS, ORACLE
import pytest

from m2nkit.adapters.families import family, family_for
from m2nkit.adapters.hf_checkpoint import read_checkpoint
from m2nkit.adapters.vllm import InferenceSpec, destination_layout
from m2nkit.engine.tools.cli import main

MODELS = {"tiny-qwen3.5-vl": "Qwen3_5ForConditionalGeneration",
          "tiny-qwen3.5-moe-vl": "Qwen3_5MoeForConditionalGeneration"}
FIXTURES = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
LA = "model.language_model.layers.0.linear_attn."
VLA = "language_model.model.layers.0.linear_attn."


def _read(model: str):
    ckpt = read_checkpoint(ORACLE / model / "checkpoint")
    return ckpt, {p.name: ckpt.read_full(p.name) for p in ckpt.params}


def _sources(layout, worker: int, param: str) -> list:
    """``(wire name, box, offset)`` of every binding into ``param`` of ``worker``, sorted."""
    return sorted((b.name, b.box, b.offset) for bs in layout.bindings.values() for b in bs
                  if b.worker == worker and b.param == param)


def test_every_dump_is_covered_and_read_with_the_wrapper_table():
    assert {(p.values[0], p.values[1], p.values[2]) for p in FIXTURES} == {
        *((m, tp, False) for m in MODELS for tp in (1, 2, 4)),
        *(("tiny-qwen3.5-moe-vl", tp, True) for tp in (2, 4))}
    for model, arch in MODELS.items():
        ckpt, _ = _read(model)
        assert family_for(ckpt.config).architecture == arch
        names = {p.name for p in ckpt.params}
        assert not any("deepstack" in n or ".experts.0." in n for n in names)
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj.weight" in \
        {p.name for p in _read("tiny-qwen3.5-moe-vl")[0].params}


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_checkpoint_planned_from_the_table_equals_vllm(model, tp, ep, placement, dtype):
    ckpt, wire = _read(model)
    layout = destination_layout(ckpt.config, ckpt.params,
                                InferenceSpec(tp, 1, ep, placement=placement, dtype=dtype))
    assert not layout.unknown and not layout.skipped
    assert "language_model.lm_head.weight" not in layout.aliases       # untied
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype, "table: ")


@pytest.mark.parametrize("model", MODELS)
def test_vision_qkv_is_split_by_heads_and_no_deepstack_merger_is_built(model):
    """attn.qkv [3*16, 16] (4 heads of 4): rank r of tp=2 takes heads 2r, 2r+1 of each of
    q, k, v (QKVParallelLinear.weight_loader, loaded_shard_id None); the merger's norm is
    over the tower's hidden; ``deepstack_visual_indexes: []`` gives no deepstack rows."""
    ckpt, _ = _read(model)
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2")
    qkv = "visual.blocks.1.attn.qkv.weight"
    assert _sources(layout, 1, qkv) == [
        ("model.visual.blocks.1.attn.qkv.weight", ((8, 16), (0, 16)), (0, 0)),
        ("model.visual.blocks.1.attn.qkv.weight", ((24, 32), (0, 16)), (8, 0)),
        ("model.visual.blocks.1.attn.qkv.weight", ((40, 48), (0, 16)), (16, 0))]
    assert _sources(layout, 0, "visual.blocks.0.attn.qkv.bias") == [
        ("model.visual.blocks.0.attn.qkv.bias", ((a, a + 8),), (o,))
        for a, o in ((0, 0), (16, 8), (32, 16))]
    shapes = {(p.worker, p.name): p.shape for p in layout.params}
    assert shapes[1, "visual.merger.norm.weight"] == (16,)
    assert shapes[1, "visual.merger.linear_fc2.weight"] == (64, 32)     # RowParallel of 64
    assert not any("deepstack" in name for _, name in shapes)
    fam = family(MODELS[model])
    assert fam.sizes(ckpt.config).extra["vdeep"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_gated_deltanet_is_fused_under_the_wrappers_prefixes(model):
    """Qwen3_5Model.hf_to_vllm_mapper under the wrapper's: ``in_proj_qkv`` (shards 0-2)
    and ``in_proj_z`` (shard 3) -> ``language_model.model.layers.0.linear_attn.in_proj_qkvz``
    (rank r of tp=4: its q, k, v rows, then its z rows); ``in_proj_b``/``in_proj_a`` ->
    ``in_proj_ba``; ``A_log`` by value head."""
    c = json.loads((ORACLE / model / "checkpoint" / "config.json").read_text())["text_config"]
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]          # 32
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]      # 64
    H, nv, tp = c["hidden_size"], c["linear_num_value_heads"], 4
    ckpt, _ = _read(model)
    layout = destination_layout(ckpt.config, ckpt.params, f"vllm:tp={tp}")
    k, v, n = kd // tp, vd // tp, nv // tp
    for r in range(tp):
        assert _sources(layout, r, VLA + "in_proj_qkvz.weight") == sorted([
            (LA + "in_proj_qkv.weight", ((r * k, (r + 1) * k), (0, H)), (0, 0)),
            (LA + "in_proj_qkv.weight", ((kd + r * k, kd + (r + 1) * k), (0, H)), (k, 0)),
            (LA + "in_proj_qkv.weight", ((2 * kd + r * v, 2 * kd + (r + 1) * v), (0, H)),
             (2 * k, 0)),
            (LA + "in_proj_z.weight", ((r * v, (r + 1) * v), (0, H)), (2 * k + v, 0))])
        assert _sources(layout, r, VLA + "in_proj_ba.weight") == sorted([
            (LA + "in_proj_b.weight", ((r * n, (r + 1) * n), (0, H)), (0, 0)),
            (LA + "in_proj_a.weight", ((r * n, (r + 1) * n), (0, H)), (n, 0))])
        assert _sources(layout, r, VLA + "A_log") == [
            (LA + "A_log", ((r * n, (r + 1) * n),), (0,))]


def test_moe_experts_and_shared_expert_under_the_wrapper():
    ckpt, _ = _read("tiny-qwen3.5-moe-vl")
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2,ep")
    w, v = "model.language_model.layers.0.mlp.", "language_model.model.layers.0.mlp."
    assert _sources(layout, 1, v + "experts.routed_experts.w13_weight") == [
        (w + "experts.gate_up_proj.weight", ((2, 4), (0, 16), (0, 64)), (0, 0, 0))]
    assert layout.aliases[v + "experts.gate.weight"] == v + "gate.weight"
    assert layout.aliases[v + "experts._shared_experts._layer.gate_up_proj.weight"] == \
        v + "shared_expert.gate_up_proj.weight"


@pytest.mark.parametrize("model", MODELS)
def test_top_level_mtp_tensors_are_skipped_and_deepstack_mergers_refused(model):
    """The published checkpoints hold the MTP layer at the top level (``mtp.*``), which
    the wrapper's mapper drops; a Qwen3.5 vision config with deepstack indexes is
    refused (transformers' Qwen3_5VisionModel has none)."""
    ckpt, _ = _read(model)
    fam = family(MODELS[model])
    assert "multi-token-prediction" in fam.skip(ckpt.config, "mtp.fc.weight")
    assert fam.skip(ckpt.config, "model.visual.pos_embed.weight") is None
    config = json.loads((ORACLE / model / "checkpoint" / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0]
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes=\[0\] is not supported "
                                         r"for Qwen3.5"):
        fam.sizes(config)


@pytest.mark.parametrize("model", MODELS)
def test_a_quantization_config_at_the_wrappers_top_level_is_refused(model):
    """The hub's quantized Qwen3.5 wrappers (FP8) hold ``quantization_config`` at the top
    level, not in ``text_config``: the table reads it there and refuses it."""
    config = json.loads((ORACLE / model / "checkpoint" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=rf"{MODELS[model]} with a quantization_config "
                                         r"\(quant_method 'fp8'\) is not supported"):
        family(MODELS[model]).sizes(config)


def _plan(capsys, config, trainer, inference) -> dict[str, str]:
    capsys.readouterr()
    code = main(["plan", str(config), "--trainer", trainer, "--inference", inference,
                 "--layout", "tables"])
    out = capsys.readouterr().out
    assert code == 0, out
    return {cells[1].strip(): cells[2].strip() for cells in
            (line.split("│") for line in out.splitlines()) if len(cells) > 3}


@pytest.mark.parametrize("name,trainer,inference,tensors", [
    ("Qwen__Qwen3.5-27B", "fsdp:64", "vllm:tp=8", 1184),
    ("Qwen__Qwen3.5-397B-A17B", "fsdp:256", "vllm:tp=8,dp=4,ep", 1371),
    ("Qwen__Qwen3.5-397B-A17B", "fsdp:64", "vllm:tp=8,ep", 1371)])
def test_published_configs_plan_from_tables_moving_the_minimum(capsys, name, trainer,
                                                              inference, tensors):
    """The text model's tensors (851 / 1038, tests/adapters/test_qwen_gdn.py) plus the
    tower's 333 (patch and position embeddings, the merger, 27 blocks of 12)."""
    rows = _plan(capsys, CONFIGS / name / "config.json", trainer, inference)
    assert "ratio 1.000" in rows["bytes moved / minimum"]
    assert rows["problems"] == "none"
    assert rows["vLLM layout"].startswith("m2nkit's family tables")
    assert rows["wire tensors"].startswith(f"{tensors} (0 skipped")
