"""GPT-OSS: what vLLM does with its tensors, the wire form m2nkit gives them, MXFP4 refused.

The shard rules are pinned bit for bit to real vLLM 0.33.0 dumps in
test_vllm_oracle.py (tiny-gpt-oss, tp 1/2/4, EP 2/4) and, for dp > 1, to the
reference in test_vllm_layout.py. This file states what the dumps showed,
written out by hand from the checkpoint (so a reader sees the rules without
the code under test), then checks the pieces around the layout: the wire
form (experts transposed to ``[E, out, in]``, gate/up still interleaved),
that a trainer rank's piece is a local transpose of its own box, the
published MXFP4 checkpoint's tensors being refused by name, the real
gpt-oss-20b config planning in bf16 with a note, and vLLM's GPT-OSS limits.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from _paths import REPO
import pytest
import torch
from safetensors.torch import load_file, save_file

from m2nkit.adapters.families.gpt_oss import HF_NAMES, MXFP4_NOTE, MXFP4_REFUSAL
from m2nkit.adapters.hf_checkpoint import (CheckpointError, checkpoint_manifest,
                                           checkpoint_metas, read_checkpoint)
from m2nkit.adapters.vllm import destination_layout
from m2nkit.engine.tools.cli import main

ORACLE = REPO / "tests" / "data" / "oracle" / "tiny-gpt-oss"
REAL = REPO / "examples" / "configs" / "openai__gpt-oss-20b"
L0 = "model.layers.0"
#: on-disk stacked experts, [E, in, out]
STACKED = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))$")


def _dump(layout: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(ORACLE / layout / f"rank{rank}.safetensors"))


# --------------------------------------------------------------------------
# what vLLM 0.33.0 showed (tests/data/oracle/tiny-gpt-oss), by hand


def test_vllm_keeps_gate_up_interleaved_and_only_transposes():
    ck = load_file(str(ORACLE / "checkpoint" / "model.safetensors"))
    gate_up = ck[f"{L0}.mlp.experts.gate_up_proj"]        # [E, H, 2I], col 2i gate i, 2i+1 up i
    down = ck[f"{L0}.mlp.experts.down_proj"]              # [E, I, H]
    gate_up_bias = ck[f"{L0}.mlp.experts.gate_up_proj_bias"]
    down_bias = ck[f"{L0}.mlp.experts.down_proj_bias"]
    E, H, I2 = gate_up.shape
    assert down_bias.abs().sum() > 0        # randomised: a zero would prove nothing
    X = f"{L0}.mlp.experts.routed_experts"
    for rank in range(2):                   # tp=2: moe rank r, columns [r*I, (r+1)*I) of 2I
        got, n, half = _dump("tp2", rank), I2 // 2, I2 // 4
        rows = slice(rank * n, (rank + 1) * n)
        assert torch.equal(got[f"{X}.w13_weight"], gate_up[:, :, rows].transpose(1, 2))
        assert torch.equal(got[f"{X}.w13_bias"], gate_up_bias[:, rows])
        cols = slice(rank * half, (rank + 1) * half)
        assert torch.equal(got[f"{X}.w2_weight"], down[:, cols].transpose(1, 2))
        # the down bias is added once: rank 0 holds it, the others zeros
        bias = down_bias if rank == 0 else torch.zeros_like(down_bias)
        assert torch.equal(got[f"{X}.w2_bias"], bias)
        # sinks split by heads; router replicated
        sinks = ck[f"{L0}.self_attn.sinks"]
        assert torch.equal(got[f"{L0}.attn.sinks"], sinks.chunk(2)[rank])
        assert torch.equal(got[f"{L0}.mlp.router.bias"], ck[f"{L0}.mlp.router.bias"])
    for rank in range(2):                                 # EP 2: whole experts, biases included
        got, e = _dump("tp2_ep", rank), slice(rank * E // 2, (rank + 1) * E // 2)
        assert torch.equal(got[f"{X}.w13_weight"], gate_up[e].transpose(1, 2))
        assert torch.equal(got[f"{X}.w2_bias"], down_bias[e])


# --------------------------------------------------------------------------
# the wire form


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_wire_form_is_the_checkpoint_with_experts_transposed(tiny_checkpoints, sharded):
    d = tiny_checkpoints("tiny-gpt-oss", sharded=sharded)
    ckpt = read_checkpoint(d)
    disk = {}
    for f in sorted(d.glob("*.safetensors")):
        disk.update(load_file(f))
    want = {}
    for name, t in disk.items():
        m = STACKED.match(name)
        want[f"{name}.weight" if m else name] = t.transpose(1, 2) if m else t
    assert set(ckpt.names) == set(want)
    for name in ckpt.names:
        assert torch.equal(ckpt.read_full(name), want[name]), name
    gu = f"{L0}.mlp.experts.gate_up_proj.weight"
    assert ckpt.meta(gu).shape == (4, 256, 64) and ckpt.disk_names(gu) == (
        f"{L0}.mlp.experts.gate_up_proj",)
    box = ((1, 3), (40, 200), (5, 60))     # any box: the permuted box is read, then permuted
    assert torch.equal(ckpt.read_box(gu, box), want[gu][1:3, 40:200, 5:60])


def test_wire_order_follows_transformers_and_a_rank_piece_is_its_local_transpose(tiny_checkpoints):
    """transformers' parameters, in order; fsdp:3's piece of a wire tensor = the rank's own
    chunk of transformers' ``[E, H, 2I]`` parameter, transposed (no gather)."""
    from transformers import AutoModelForCausalLM

    d = tiny_checkpoints("tiny-gpt-oss")
    ckpt = read_checkpoint(d)
    params = dict(AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).named_parameters())
    memory = [n.removesuffix(".weight") if ".experts." in n and n.endswith("proj.weight") else n
              for n in ckpt.names]
    assert memory == list(params)
    for rank in range(3):
        source = checkpoint_manifest(ckpt, "fsdp:3", rank)
        for entry in source.entries:
            if STACKED.match(entry.key.removesuffix(".weight")) and entry.key.endswith(".weight"):
                mine = params[entry.key.removesuffix(".weight")].detach().chunk(3, dim=0)
                piece = mine[rank] if rank < len(mine) else mine[0][:0]
                assert torch.equal(entry.local_tensor(), piece.transpose(1, 2)), (rank, entry.key)


@pytest.mark.parametrize("inference", ["vllm:tp=2", "vllm:tp=4", "vllm:tp=2,dp=2,ep"])
def test_plan_verify(tiny_checkpoints, capsys, inference):
    d = tiny_checkpoints("tiny-gpt-oss")
    code = main(["plan", str(d), "--trainer", "fsdp:3", "--inference", inference, "--verify"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verify: all" in out and "ratio 1.000" in out


# --------------------------------------------------------------------------
# MXFP4 and the real config


def test_mxfp4_checkpoint_is_refused_naming_the_tensor(tiny_checkpoints, tmp_path, capsys):
    d = tmp_path / "mxfp4"
    shutil.copytree(tiny_checkpoints("tiny-gpt-oss"), d)
    tensors = load_file(d / "model.safetensors")
    for name in [n for n in tensors if STACKED.match(n)]:  # as the published files store them
        E, a, b = tensors.pop(name).shape
        rows, cols = (b, a)                                  # [E, out, in] packed, blocks of 32
        tensors[f"{name}_blocks"] = torch.zeros(E, rows, cols // 32, 16, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.zeros(E, rows, cols // 32, dtype=torch.uint8)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.\d\.mlp\.experts\."
                                              r"(gate_up|down)_proj_(blocks|scales)' in .*: MXFP4"):
        read_checkpoint(d)
    code = main(["plan", str(d), "--trainer", "fsdp:2", "--inference", "vllm:tp=2"])
    err = capsys.readouterr().err
    assert code == 2 and "MXFP4 experts" in err and "dequantize" in err.lower()


def test_real_gpt_oss_20b_config_plans_the_bf16_form_and_says_so():
    ckpt = read_checkpoint(REAL / "config.json")
    assert ckpt.meta(f"{L0}.mlp.experts.gate_up_proj.weight").shape == (32, 5760, 2880)
    assert ckpt.meta(f"{L0}.mlp.experts.down_proj.weight").shape == (32, 2880, 2880)
    layout = destination_layout(ckpt.config, checkpoint_metas(ckpt, "fsdp:8"), "vllm:tp=8")
    assert not layout.unknown and MXFP4_NOTE in layout.notes
    # The published (MXFP4) index: every tensor is one we read, or an expert
    # tensor refused as MXFP4 whose bf16 form is a wire tensor.
    index = json.loads((REAL / "model.safetensors.index.json").read_text())["weight_map"]
    ours = {n for w in ckpt.names for n in ckpt.disk_names(w)}
    refused = {n for n in index if n not in ours}
    assert ours - set(index) == {n for n in ours if STACKED.match(n)}
    assert {re.sub(r"_(blocks|scales)$", "", n) for n in refused} == ours - set(index)
    assert refused and all(HF_NAMES.refusal(n) == MXFP4_REFUSAL for n in refused)
    assert not any(HF_NAMES.refusal(n) for n in ours)


# --------------------------------------------------------------------------
# vLLM's GPT-OSS limits


def _config(**changes) -> dict:
    config = json.loads((ORACLE / "checkpoint" / "config.json").read_text())
    return {**config, **changes}


@pytest.mark.parametrize("changes,spec,message", [
    ({}, "vllm:tp=8", r"tp=8 is greater than num_key_value_heads=4: vLLM's GPT-OSS attention"),
    ({}, "vllm:tp=1,dp=3,ep", r"num_local_experts=4 is not divisible by the expert-parallel "
                              r"size ep=dp\*tp=3"),
    ({"tie_word_embeddings": True}, "vllm:tp=1", r"never ties lm_head"),
    ({"quantization_config": {"quant_method": "fp8"}}, "vllm:tp=1",
     r"quant_method='fp8' is not supported; supported: no quantization_config"),
])
def test_vllm_gpt_oss_limits(changes, spec, message):
    with pytest.raises(ValueError, match=message):
        destination_layout(_config(**changes), [], spec)
