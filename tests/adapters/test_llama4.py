"""Llama-4 from its tables (families/llama4.py, llama4_vl.py), against real vLLM 0.33.0 dumps.

The shipped tiny checkpoints (tests/data/oracle/tiny-llama4: layer 0 dense, layer 1
MoE with 4 routed experts stacked on disk ``[E, H, 2*I]`` and a shared expert;
tiny-llama4-vision: Scout's wrapper, one MoE text layer, a 2-layer vision tower of
4 heads and the projector; both written by transformers' ``save_pretrained``) are read
by ``read_checkpoint`` and planned with the tables; every worker filled through the
layout's bindings must equal vLLM's own dump bit for bit, at tp 1/2/4 and EP 2/4.
Hand-checked: the rotary q/k rows (``permute_qk_weight_for_rotary``) and the experts
read transposed from disk. The published Llama-4-Scout config plans from the table
alone, moving the minimum. Table against vLLM's traced loaders:
tests/integration/test_vllm_trace.py.
"""

from __future__ import annotations

import json

from _oracle import ALL_FIXTURES, assert_layout_equals_dumps
from _paths import CONFIGS, ORACLE
import pytest
from safetensors.torch import load_file

from m2nkit.adapters.families import family_for
from m2nkit.adapters.hf_checkpoint import read_checkpoint
from m2nkit.adapters.vllm import InferenceSpec, destination_layout
from m2nkit.engine.tools.cli import main

MODELS = {"tiny-llama4": "Llama4ForCausalLM",
          "tiny-llama4-vision": "Llama4ForConditionalGeneration"}
FIXTURES = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
SCOUT = CONFIGS / "meta-llama__Llama-4-Scout-17B-16E-Instruct" / "config.json"


def _read(model: str):
    ckpt = read_checkpoint(ORACLE / model / "checkpoint")
    return ckpt, {p.name: ckpt.read_full(p.name) for p in ckpt.params}


def _sources(layout, worker: int, param: str) -> list:
    """``(wire name, box, offset)`` of every binding into ``param`` of ``worker``, sorted."""
    return sorted((b.name, b.box, b.offset) for bs in layout.bindings.values() for b in bs
                  if b.worker == worker and b.param == param)


def test_every_dump_is_covered_and_the_experts_are_read_transposed():
    assert {(p.values[0], p.values[1], p.values[2]) for p in FIXTURES} == {
        *((m, tp, False) for m in MODELS for tp in (1, 2, 4)),
        *(("tiny-llama4", tp, True) for tp in (2, 4))}
    ckpt, wire = _read("tiny-llama4")
    assert family_for(ckpt.config).architecture == "Llama4ForCausalLM"
    disk = load_file(str(ORACLE / "tiny-llama4" / "checkpoint" / "model.safetensors"))
    e = "model.layers.1.feed_forward.experts."
    # on disk [E, H, 2*I] and [E, I, H]; on the wire [E, out, in], the same bytes transposed
    assert tuple(disk[e + "gate_up_proj"].shape) == (4, 64, 64)
    assert tuple(wire[e + "gate_up_proj.weight"].shape) == (4, 64, 64)
    assert tuple(wire[e + "down_proj.weight"].shape) == (4, 64, 32)
    assert wire[e + "gate_up_proj.weight"].equal(disk[e + "gate_up_proj"].transpose(1, 2))
    assert wire[e + "down_proj.weight"].equal(disk[e + "down_proj"].transpose(1, 2))
    assert e + "down_proj" not in wire and e + "gate_up_proj" not in wire


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_checkpoint_planned_from_the_table_equals_vllm(model, tp, ep, placement, dtype):
    ckpt, wire = _read(model)
    layout = destination_layout(ckpt.config, ckpt.params,
                                InferenceSpec(tp, 1, ep, placement=placement, dtype=dtype))
    assert not layout.unknown and not layout.skipped
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype, "table: ")


def test_rotary_rows_are_bound_as_vllm_reorders_them():
    """tp=2, worker 1, layer 0: q heads 2 and 3 (hd 16) and KV head 1. Within a head vLLM
    takes the even wire rows, then the odd ones (``permute_qk_weight_for_rotary``), so
    every row is its own box, except a head's last row and the next head's first; v
    is one box."""
    ckpt, _ = _read("tiny-llama4")
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2")
    a = "model.layers.0.self_attn."
    got = _sources(layout, 1, a + "qkv_proj.weight")
    head = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    q = [(32 + w, 32 + w + 1, at) for at, w in enumerate(head)] + \
        [(48 + w, 48 + w + 1, 16 + at) for at, w in enumerate(head)]
    q = q[:15] + [(47, 49, 15)] + q[17:]          # rows 47 and 48: adjacent on both sides
    k = [(16 + w, 16 + w + 1, 32 + at) for at, w in enumerate(head)]
    want = sorted([(a + "q_proj.weight", ((lo, hi), (0, 64)), (at, 0)) for lo, hi, at in q]
                  + [(a + "k_proj.weight", ((lo, hi), (0, 64)), (at, 0)) for lo, hi, at in k]
                  + [(a + "v_proj.weight", ((16, 32), (0, 64)), (48, 0))])
    assert got == want


def test_a_vision_tower_whose_heads_do_not_divide_tp_is_refused(tmp_path):
    config = json.loads((ORACLE / "tiny-llama4-vision" / "checkpoint" / "config.json")
                        .read_text())
    config["vision_config"]["num_attention_heads"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"vision_config.num_attention_heads=2 is not "
                                         r"divisible by tp=4"):
        destination_layout(ckpt.config, ckpt.params, "vllm:tp=4")
    assert destination_layout(ckpt.config, ckpt.params, "vllm:tp=2").num_workers == 2


def test_attention_bias_is_refused_naming_the_key(tmp_path):
    config = json.loads((ORACLE / "tiny-llama4" / "checkpoint" / "config.json").read_text())
    config["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attention_bias=true is not supported: vLLM 0.33.0's "
                                         "Llama4Attention builds q/k/v/o without biases"):
        ckpt = read_checkpoint(tmp_path / "config.json")
        destination_layout(ckpt.config, ckpt.params, "vllm:tp=2")


def _plan(capsys, config, trainer, inference) -> dict[str, str]:
    capsys.readouterr()
    code = main(["plan", str(config), "--trainer", trainer, "--inference", inference])
    out = capsys.readouterr().out
    assert code == 0, out
    return {cells[1].strip(): cells[2].strip() for cells in
            (line.split("│") for line in out.splitlines()) if len(cells) > 3}


@pytest.mark.parametrize("inference", ["vllm:tp=8", "vllm:tp=8,ep"])
def test_scout_plans_from_its_table_moving_the_minimum(capsys, inference):
    """``--layout auto`` takes the table: 1133 wire tensors (48 MoE layers of 12, the
    tower's 34 layers of 16 and its 9 others, the projector, embeddings, norm, head)."""
    rows = _plan(capsys, SCOUT, "fsdp:64", inference)
    assert "ratio 1.000" in rows["bytes moved / minimum"]
    assert rows["problems"] == "none"
    assert rows["vLLM layout"].startswith("m2nkit's family tables")
    assert rows["wire tensors"].startswith("1133 (0 skipped")
