"""Mode 2's planning pieces: the spec's quant/wire, the block grid, the math, the exchange counts.

Expected values are worked out by hand in each test's docstring (vLLM
0.33.0's rule: ``per_block_cast_to_fp8``, 128 x 128 blocks of the
worker-local tensor). That the bytes equal vLLM's own is
``tests/integration/test_fp8_plan.py`` (a fresh vLLM fp8_per_block load).
"""

from __future__ import annotations

import json
import shutil

from _paths import CONFIGS, ORACLE
import pytest
import torch

from m2nkit.adapters.vllm.spec import parse_inference_spec
from m2nkit.engine.quant_fp8 import (Fp8Target, block_partial_amax, quantize_region,
                                     scale_of_amax)
from m2nkit.engine.tools.cli import main


def test_spec_quant_and_wire():
    spec = parse_inference_spec("vllm:tp=8,dp=8,ep,quant=FP8_PER_BLOCK,wire=fp8")
    assert (spec.quant, spec.wire) == ("fp8_per_block", "fp8")
    assert str(spec) == "vllm:tp=8,dp=8,ep,quant=fp8_per_block,wire=fp8"
    assert parse_inference_spec(str(spec)) == spec
    assert parse_inference_spec("vllm:tp=2,quant=fp8_per_block").wire == "bf16"
    assert str(parse_inference_spec("vllm:tp=2")) == "vllm:tp=2,dp=1"   # digests unchanged


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4", "fp8_per_tensor", "compressed-tensors"])
def test_spec_refuses_schemes_by_name(scheme):
    with pytest.raises(ValueError) as e:
        parse_inference_spec(f"vllm:tp=2,quant={scheme}")
    assert f"quant='{scheme}' is a quantization scheme m2nkit does not carry" in str(e.value)
    assert "supported: none, fp8_per_block" in str(e.value)


def test_spec_wire_fp8_needs_quant():
    with pytest.raises(ValueError, match="wire=fp8 needs quant=fp8_per_block"):
        parse_inference_spec("vllm:tp=2,wire=fp8")


def test_w13_rows_move_to_padded_shards():
    """w13 of 2 experts, Im_local = 40, H = 200 -> vLLM pads to [2, 2*128, 256]: gate rows
    0..39 stay, up rows 40..79 move to 128..167; a box over rows 30..50 splits in two."""
    t = Fp8Target(0, "w13_weight", "w13_weight_scale_inv", (2, 80, 200), (2, 256, 256), 2)
    assert t.block == (1, 128, 128) and t.grid == (2, 2, 2)
    assert t.map_region(((0, 2), (30, 50), (0, 200))) == [
        ((0, 2), (30, 40), (0, 200)), ((0, 2), (128, 138), (0, 200))]


def test_block_math_by_hand():
    """A [2, 130] bf16 piece: block (0, 0) has max |x| = 448, so its scale is 448/448 = 1
    and the e4m3 values are the inputs (1.5, -448, 0.25 are e4m3 values); block (0, 1)
    (columns 128..129) is all zeros: amax clamps at 1e-4, scale float32(1e-4) / 448."""
    x = torch.zeros(2, 130, dtype=torch.bfloat16)
    x[0, 0], x[1, 5], x[0, 127] = 1.5, -448.0, 0.25
    blocks, amax = block_partial_amax(x, ((0, 2), (0, 130)), (128, 128))
    assert blocks == (slice(0, 1), slice(0, 2))
    assert amax.tolist() == [[448.0, 0.0]]
    scale = scale_of_amax(amax)
    assert scale.dtype == torch.float32
    assert scale[0, 0].item() == 1.0
    assert scale[0, 1].item() == (torch.tensor(1e-4, dtype=torch.float32) / 448.0).item()
    q = quantize_region(x, ((0, 2), (0, 130)), scale, (128, 128))
    assert q.dtype == torch.float8_e4m3fn
    assert q.float()[0, 0].item() == 1.5 and q.float()[1, 5].item() == -448.0
    assert q.float()[0, 127].item() == 0.25 and q.float().abs().sum().item() == 1.5 + 448 + 0.25
    # a piece at an offset reads its own blocks' scales: columns 126..129 -> blocks 0 and 1
    q2 = quantize_region(x[:, 126:130], ((0, 2), (126, 130)), scale, (128, 128))
    assert torch.equal(q2.view(torch.uint8), q[:, 126:130].view(torch.uint8))


def test_exchange_counts_tiny_qwen3(tmp_path, capsys):
    """tiny-qwen3 (H 128, 8 q heads + 2 kv heads of 16, I 96, 2 layers), fsdp:4 -> vllm:tp=2.

    Per worker and layer every quantized parameter is one block (all local dims <= 128):
    qkv (64 q + 16 k + 16 v rows) and gate_up (48 + 48 rows) are fed by 2 FSDP ranks
    (row chunks of 32 / 8 / 24 rows) and span several wire tensors; o_proj and down_proj
    (rows of 128 in chunks of 32) by 4. Blocks 2*2*4 = 16, all shared; exchange
    2*(c-1) per block = (2 + 6 + 2 + 6) * 4 = 64 scalars; 8 blocks span wire tensors.
    Quantized elements (96*128 + 128*64 + 96*128 + 128*48) * 4 = 155 648 bytes leave the
    BF16 wire's second byte, plus 16 float32 scales: 416 512 - 155 648 + 64 = 260 928 B.
    Worker 0 receives embed_tokens and lm_head rows 0..127 (2 * 128*128*2 B), the norms
    (256 + 2 * (256 + 256 + 32 + 32) B), its e4m3 bytes (2 * 38 912) and 8 scales (32 B):
    144 800 B; worker 1 the rest (vocab rows 128..199), 116 128 B.
    """
    ckpt = tmp_path / "tiny-qwen3"
    ckpt.mkdir()
    shutil.copy(ORACLE / "tiny-qwen3" / "checkpoint" / "config.json", ckpt / "config.json")
    out = tmp_path / "plan.json"
    assert main(["plan", str(ckpt), "--trainer", "fsdp:4", "--inference",
                 "vllm:tp=2,quant=fp8_per_block,wire=fp8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "64 float32 scalars (256 B)" in text
    fp8 = json.loads(out.read_text())["fp8"]
    assert fp8 == {"wire": "fp8", "blocks": 16, "shared_blocks": 16, "multi_wire_blocks": 8,
                   "exchange_scalars": 64, "exchange_bytes": 256,
                   "bf16_wire_bytes": 416512, "fp8_wire_bytes": 260928,
                   "fp8_max_send_per_trainer_rank": fp8["fp8_max_send_per_trainer_rank"],
                   "fp8_max_receive_per_worker": 144800}


@pytest.mark.parametrize("config, says", [
    ("deepseek-ai__DeepSeek-V3", "already has quantization_config (quant_method 'fp8')"),
    ("moonshotai__Kimi-K2.5", "text_config.quantization_config is compressed-tensors (int4"),
    ("meta-llama__Llama-3.1-70B", "no fp8_per_block rule for this architecture; supported: "
                                  "DeepseekV3ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"),
])
def test_cli_refusals(capsys, config, says):
    code = main(["plan", str(CONFIGS / config), "--trainer", "fsdp:8", "--inference",
                 "vllm:tp=8,quant=fp8_per_block,wire=fp8"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err


def _fp8_names(model: str, spec: str) -> dict[str, tuple]:
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.adapters.vllm.fp8 import online_fp8_params

    ckpt = read_checkpoint(str(ORACLE / model / "checkpoint" / "config.json"))
    metas = checkpoint_metas(ckpt, parse_trainer_spec("fsdp:2"))
    dest = destination_layout(ckpt.config, metas, spec)
    return {p.param: p.fp8_shape for p in online_fp8_params(ckpt.config, dest)
            if p.worker == 0 and ".layers.1." in p.param}


def test_which_layers_vllm_quantizes():
    """vLLM 0.33.0 fp8_per_block, read off a fresh load (tests/integration/test_fp8_plan.py
    holds it against vLLM itself): Qwen3-MoE's router is fp8 (GateLinear built with
    quant_config), DeepSeek-V3's is not; norms, embeddings, lm_head, e_score_correction_bias
    never are; experts padded to 128 (Im 32 -> 128, DeepSeek H 64 -> 128; 4 experts at EP 2)."""
    L = "model.layers.1"
    assert _fp8_names("tiny-qwen3-moe", "vllm:tp=2,ep") == {
        f"{L}.self_attn.qkv_proj.weight": (96, 128), f"{L}.self_attn.o_proj.weight": (128, 64),
        f"{L}.mlp.gate.weight": (8, 128),
        f"{L}.mlp.experts.routed_experts.w13_weight": (4, 256, 128),
        f"{L}.mlp.experts.routed_experts.w2_weight": (4, 128, 128)}
    assert _fp8_names("tiny-deepseek-v3", "vllm:tp=2,ep") == {
        f"{L}.self_attn.fused_qkv_a_proj.weight": (72, 64),
        f"{L}.self_attn.q_b_proj.weight": (128, 32), f"{L}.self_attn.kv_b_proj.weight": (128, 32),
        f"{L}.self_attn.o_proj.weight": (64, 32),
        f"{L}.mlp.shared_experts.gate_up_proj.weight": (32, 64),
        f"{L}.mlp.shared_experts.down_proj.weight": (64, 16),
        f"{L}.mlp.experts.routed_experts.w13_weight": (4, 256, 128),
        f"{L}.mlp.experts.routed_experts.w2_weight": (4, 128, 128)}


def test_megatron_tp_matching_vllm_needs_no_exchange(tmp_path):
    """megatron:tp=2 -> vllm:tp=2: Megatron rank r holds exactly vLLM tp rank r's heads and
    columns/rows, so each of the 16 blocks of tiny-qwen3 (see above) has one feeder: no
    exchange; the 8 qkv / gate_up blocks still span two wire tensors (a rank-local
    combination of its q, k and v, or gate and up)."""
    ckpt = tmp_path / "tiny-qwen3"
    ckpt.mkdir()
    shutil.copy(ORACLE / "tiny-qwen3" / "checkpoint" / "config.json", ckpt / "config.json")
    out = tmp_path / "plan.json"
    assert main(["plan", str(ckpt), "--trainer", "megatron:tp=2,pp=1", "--inference",
                 "vllm:tp=2,quant=fp8_per_block,wire=fp8", "--json", str(out)]) == 0
    fp8 = json.loads(out.read_text())["fp8"]
    assert (fp8["blocks"], fp8["shared_blocks"], fp8["exchange_scalars"],
            fp8["multi_wire_blocks"]) == (16, 0, 0, 8)
    assert fp8["fp8_wire_bytes"] == 260928          # the same bytes as from fsdp:4


@pytest.mark.parametrize("trainer", ["fsdp:2", "megatron:tp=2,ep=2"])
def test_demo_refuses_quant_rather_than_moving_bf16_under_its_name(capsys, trainer):
    """The demo's workers hold BF16 storage: a quant= round would move BF16 and report it
    as the fp8 spec (found trying it as a user). Refused before torch loads, one line."""
    code = main(["demo", "--trainer", trainer, "--inference",
                 "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8", "--rounds", "1", "--no-baseline"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err.splitlines() == [
        "m2nkit: error: --inference vllm:tp=2,ep,quant=fp8_per_block,wire=fp8: m2nkit demo "
        "does not run fp8 rounds (quant=); plan and check mode 2 with m2nkit plan CHECKPOINT "
        "... --inference ...,quant=fp8_per_block,wire=fp8 --verify, and see docs/fp8.md for "
        "rounds into an fp8-served vLLM"]


def test_verify_with_the_bf16_wire_says_what_it_does_not_check(capsys):
    """wire=bf16 verifies the BF16 landing only (vLLM quantizes after loading): said, so a
    dump of BF16 weights under quant=fp8_per_block is not taken for vLLM's fp8 tensors."""
    ckpt = ORACLE / "tiny-qwen3" / "checkpoint"
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference",
                 "vllm:tp=2,quant=fp8_per_block", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify: all 2 workers hold exactly what vLLM's loaders would" in out
    assert ("verify: wire=bf16 checks the BF16 weights vLLM's loaders take (checkpoint format); "
            "vLLM quantizes them after loading, which is not run here (wire=fp8 runs the "
            "quantization)") in out


def test_plan_summary_shows_what_the_fp8_wire_carries(tmp_path, capsys):
    """With wire=fp8 the summary's bytes, busiest worker and time are the fp8 wire's
    (tiny-qwen3 at fsdp:4 -> vllm:tp=2, worked out in test_exchange_counts_tiny_qwen3:
    260 928 B to the workers + 256 B of exchange, worker 0 receives 144 800 B), with the
    BF16 wire's 416 512 B beside them; with wire=bf16 the BF16 figures, as before."""
    from m2nkit.engine.tools.report import fmt_bytes

    ckpt = tmp_path / "tiny-qwen3"
    ckpt.mkdir()
    shutil.copy(ORACLE / "tiny-qwen3" / "checkpoint" / "config.json", ckpt / "config.json")
    assert main(["plan", str(ckpt), "--trainer", "fsdp:4", "--inference",
                 "vllm:tp=2,quant=fp8_per_block,wire=fp8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (f"bytes moved (fp8 wire) │ {fmt_bytes(260928)} to the workers (e4m3 + float32 "
            f"scales) + {fmt_bytes(256)} amax exchange between trainer ranks; the bf16 wire: "
            f"{fmt_bytes(416512)} / {fmt_bytes(416512)}") in out, out
    assert f"max receive per worker │ {fmt_bytes(144800)}" in out, out
    assert "Gbit/s per rank (fp8 wire) │" in out, out
    assert main(["plan", str(ckpt), "--trainer", "fsdp:4", "--inference",
                 "vllm:tp=2,quant=fp8_per_block,wire=bf16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"bytes moved / minimum │ {fmt_bytes(416512)} / {fmt_bytes(416512)}" in out, out
    assert "(fp8 wire)" not in out and "live fp8 wire" not in out, out
