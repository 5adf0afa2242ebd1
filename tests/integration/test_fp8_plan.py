"""Mode 2 (fp8 wire, quantized on the trainer) against a fresh vLLM 0.33.0 load with fp8_per_block.

The reference is vLLM itself: each worker's model built on the CPU with
``quantization="fp8_per_block"``, loaded from the same BF16 checkpoint by
``DefaultModelLoader`` and finished by ``finalize_layerwise_processing``
(``engine/tools/vllm_workers.fresh_fp8_load``; only the matmul kernel
choice is replaced, ``no_fp8_kernels``). m2nkit's side is the plan's slabs
and the trainer ranks' own quantization with the planned amax exchange
(``engine/tools/fp8.run_fp8_in_process``). Every parameter a worker holds
must be bit-identical to vLLM's, e4m3 bytes and float32 scales included,
and vLLM must quantize exactly the parameters m2nkit's rule names.

Sizes where blocks matter: ``qwen3-blocks`` (H = 320, I = 400, 4 heads of
80: no dim a multiple of 128; at tp 2 the local ``qkv_proj`` is q 160 + k
80 + v 80 rows, so its second block spans q and k, and ``gate_up_proj``'s
second block spans gate and up; FSDP over 3 ranks cuts rows at 107), the
shipped Qwen3-MoE (EP; ``Im = 32`` and ``H = 128`` padded to whole blocks)
and DeepSeek-V3 (MLA: ``fused_qkv_a_proj`` 32 q + 40 kv rows in one block;
H = 64 padded in the experts).
"""

from __future__ import annotations

import os

import pytest
import torch

from _oracle import DATA

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def qwen3_blocks(tmp_path_factory):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    config = tiny_config("tiny-qwen3", hidden_size=320, intermediate_size=400,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=80)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("qwen3-blocks"), seed=3)


def _m2nkit(ckpt_dir, trainer: str, inference: str):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.engine.plan import build_plan
    from m2nkit.engine.tools.fp8 import plan_fp8_wire, run_fp8_in_process

    tspec, ispec = parse_trainer_spec(trainer), parse_inference_spec(inference)
    ckpt = read_checkpoint(str(ckpt_dir))
    metas = checkpoint_metas(ckpt, tspec)
    plan = build_plan(metas, tspec.num_ranks, destination_layout(ckpt.config, metas, ispec))
    assert not plan.problems
    fp8 = plan_fp8_wire(ckpt.config, plan)
    storage, _ = run_fp8_in_process(ckpt, tspec, plan, fp8)
    return ispec, plan, fp8, storage


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _check_against_vllm(ckpt_dir, trainer, inference):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from m2nkit.engine.tools.vllm_workers import fresh_fp8_load

    ispec, plan, fp8, storage = _m2nkit(ckpt_dir, trainer, inference)
    aliases = plan.destination.aliases
    for w in range(plan.num_workers):
        vllm = fresh_fp8_load(ckpt_dir, ispec, w)
        ours = storage[w]
        # every parameter vLLM holds (aliases through their target, scales too)
        for name, ref in vllm.items():
            base = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name
            target = aliases.get(base, base) + name[len(base):]
            assert target in ours, f"worker {w}: vLLM holds {name}, m2nkit has no {target}"
            assert _same(ours[target], ref), (
                f"worker {w}: {name} differs from vLLM's fp8_per_block load "
                f"({ours[target].dtype}{tuple(ours[target].shape)} vs {ref.dtype}{tuple(ref.shape)})")
        # and vLLM quantized exactly what m2nkit's rule says
        vllm_fp8 = {n for n, t in vllm.items() if t.dtype == torch.float8_e4m3fn
                    and aliases.get(n, n) == n}
        assert vllm_fp8 == {t.param for t in fp8.targets.values() if t.worker == w}
        assert set(ours) <= {aliases.get(n, n) for n in vllm} | {
            aliases.get(n[:-10], n[:-10]) + "_scale_inv" for n in vllm if n.endswith("_scale_inv")}
    return fp8


def test_qwen3_blocks_fsdp_tp2(qwen3_blocks):
    fp8 = _check_against_vllm(qwen3_blocks, "fsdp:3", "vllm:tp=2,quant=fp8_per_block,wire=fp8")
    # the exchange and the fused-parameter blocks are exercised, not only whole blocks
    assert fp8.shared_blocks > 0 and fp8.multi_wire_blocks > 0 and fp8.exchange_scalars > 0


def test_qwen3_blocks_fsdp2_tp(qwen3_blocks):
    # a trainer TP split of its own (columns and rows cut at other places than vLLM's)
    fp8 = _check_against_vllm(qwen3_blocks, "fsdp2:dp_shard=2,tp=2",
                              "vllm:tp=4,quant=fp8_per_block,wire=fp8")
    assert fp8.shared_blocks > 0


def test_qwen3_moe_ep():
    fp8 = _check_against_vllm(DATA / "tiny-qwen3-moe" / "checkpoint", "fsdp:3",
                              "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8")
    assert any(t.row_shards == 2 and t.fp8_shape != t.shape for t in fp8.targets.values())


def test_deepseek_v3_mla_tp2():
    _check_against_vllm(DATA / "tiny-deepseek-v3" / "checkpoint", "fsdp:4",
                        "vllm:tp=2,quant=fp8_per_block,wire=fp8")


def test_deepseek_v3_ep():
    _check_against_vllm(DATA / "tiny-deepseek-v3" / "checkpoint", "fsdp:2",
                        "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8")


def test_cli_verify_dump_holds_vllms_tensors(qwen3_blocks, tmp_path, capsys):
    """``m2nkit plan --verify --dump``: each worker file holds, under vLLM's names, exactly
    the tensors vLLM's own fp8_per_block load holds (e4m3 weights, float32 scales)."""
    from safetensors.torch import load_file

    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.engine.tools.cli import main
    from m2nkit.engine.tools.vllm_workers import fresh_fp8_load

    inference = "vllm:tp=2,quant=fp8_per_block,wire=fp8"
    assert main(["plan", str(qwen3_blocks), "--trainer", "hsdp:2,2", "--inference", inference,
                 "--verify", "--dump", str(tmp_path)]) == 0
    assert "e4m3 bytes and scales bit-identical" in capsys.readouterr().out
    for w in range(2):
        dumped = load_file(str(tmp_path / f"worker{w}.safetensors"))
        vllm = fresh_fp8_load(qwen3_blocks, parse_inference_spec(inference), w)
        assert set(dumped) == set(vllm)
        assert dumped["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
        assert dumped["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (3, 3)
        for name, ref in vllm.items():
            assert _same(dumped[name], ref), f"worker {w}: dumped {name} differs from vLLM's"
