"""The fp8 wire's plan pieces (mode 2 live): which wires carry e4m3, the exchange lists, refusals.

That a live round's bytes equal vLLM's own quantization is
``tests/integration/test_vllm_plugin_fp8.py`` (FSDP2 trainers into vLLM
workers, against a fresh vLLM fp8_per_block load).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _plan(tiny_checkpoints, name: str, trainer: str, inference: str):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.plan import build_plan

    ckpt = read_checkpoint(str(tiny_checkpoints(name)))
    tspec = parse_trainer_spec(trainer)
    metas = checkpoint_metas(ckpt, tspec)
    builder = vllm_destination(ckpt.config, inference)
    plan = build_plan(metas, tspec.num_ranks, builder(metas))
    assert not plan.problems
    return builder, plan


def test_bf16_wire_has_no_fp8_plan(tiny_checkpoints):
    from m2nkit.engine.fp8_wire import fp8_wire_plan

    for inference in ("vllm:tp=2", "vllm:tp=2,quant=fp8_per_block"):
        builder, plan = _plan(tiny_checkpoints, "tiny-qwen3", "fsdp:2", inference)
        assert fp8_wire_plan(builder, plan) is None


def test_wire_plan_carries_quantized_wires_as_e4m3(tiny_checkpoints):
    """Same slabs; the wire tensors landing in quantized linear weights (q/k/v/o, gate/up/
    down) travel as e4m3, one byte an element: half their BF16 bytes. Embeddings, norms and
    lm_head stay BF16 (vLLM quantizes no embedding, norm or ParallelLMHead)."""
    from m2nkit.engine.fp8_wire import fp8_wire_plan, wire_plan

    builder, plan = _plan(tiny_checkpoints, "tiny-qwen3", "fsdp:2",
                          "vllm:tp=2,quant=fp8_per_block,wire=fp8")
    wp = wire_plan(plan, fp8_wire_plan(builder, plan))
    assert wp is wire_plan(plan, fp8_wire_plan(builder, plan))       # cached
    for a, b in zip(plan.wires, wp.wires):
        assert a.name == b.name and (a.table == b.table).all()
        linear = a.name.endswith(("_proj.weight",))
        assert b.meta.dtype == (torch.float8_e4m3fn if linear else torch.bfloat16), a.name
        assert b.nbytes_moved * (2 if linear else 1) == a.nbytes_moved, a.name


def test_exchange_lists_agree_between_ranks(tiny_checkpoints):
    """What a rank sends its leader is, in the same order, what the leader expects from it;
    the exchange sends ``Fp8Plan.exchange_scalars`` scalars in all (each way once)."""
    from m2nkit.engine.fp8_wire import _exchange_lists, fp8_wire_plan

    builder, plan = _plan(tiny_checkpoints, "tiny-qwen3", "fsdp:4",
                          "vllm:tp=2,quant=fp8_per_block,wire=fp8")
    fp8 = fp8_wire_plan(builder, plan)
    assert fp8.shared_blocks > 0
    lists = {r: _exchange_lists(fp8, r) for r in range(plan.num_trainer_ranks)}
    sent = 0
    for r, (to_leader, _) in lists.items():
        for leader, items in to_leader.items():
            assert leader < r and lists[leader][1][r] == items
            sent += 2 * len(items)
    assert sent == fp8.exchange_scalars


def test_fp8_wire_refuses_experts_vllm_pads(tiny_checkpoints):
    """tiny-qwen3-moe's expert dims are not whole 128-blocks: vLLM pads them, the fp8 wire
    does not carry that yet."""
    from m2nkit.engine.fp8_wire import fp8_wire_plan

    builder, plan = _plan(tiny_checkpoints, "tiny-qwen3-moe", "fsdp:2",
                          "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8")
    with pytest.raises(ValueError, match=r"wire=fp8: '.*w(13|2)_weight' \(worker \d\) is stacked "
                                         r"experts of shape .* which vLLM pads .* serve this model with wire=bf16"):
        fp8_wire_plan(builder, plan)


def test_trainer_refuses_fp8_wire_over_nccl_m2n(tiny_checkpoints):
    from m2nkit.engine.trainer import _fp8_wire_of

    builder, plan = _plan(tiny_checkpoints, "tiny-qwen3", "fsdp:2",
                          "vllm:tp=2,quant=fp8_per_block,wire=fp8")
    info = SimpleNamespace(destination=builder, transport="nccl_m2n", rank=1)
    with pytest.raises(ValueError, match="trainer rank 1: wire=fp8 runs over the torch_p2p "
                                         "transport only, not 'nccl_m2n'"):
        _fp8_wire_of(info, plan)
    info.transport = "torch_p2p"
    assert _fp8_wire_of(info, plan) is not None
