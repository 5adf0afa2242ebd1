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


def test_fp8_wire_plans_experts_vllm_pads(tiny_checkpoints):
    """tiny-qwen3-moe (H 128, Im 32, 8 experts) at tp=2,ep: each worker's w13 [4, 64, 128]
    is quantized in vLLM's padded grid [4, 2*128, 128] (gate and up rows rounded up on
    their own), so 4 x 2 x 1 scale blocks; w2 [4, 128, 32] in [4, 128, 128], 4 x 1 x 1;
    the experts' wire tensors travel as e4m3 in their unpadded shape."""
    from m2nkit.engine.fp8_wire import fp8_wire_plan, wire_plan

    builder, plan = _plan(tiny_checkpoints, "tiny-qwen3-moe", "fsdp:2",
                          "vllm:tp=2,ep,quant=fp8_per_block,wire=fp8")
    fp8 = fp8_wire_plan(builder, plan)
    w13 = fp8.targets[(0, "model.layers.0.mlp.experts.routed_experts.w13_weight")]
    w2 = fp8.targets[(1, "model.layers.1.mlp.experts.routed_experts.w2_weight")]
    assert (w13.shape, w13.fp8_shape, w13.grid) == ((4, 64, 128), (4, 256, 128), (4, 2, 1))
    assert (w2.shape, w2.fp8_shape, w2.grid) == ((4, 128, 32), (4, 128, 128), (4, 1, 1))
    carried = {w.name: w.meta for w in wire_plan(plan, fp8).wires}
    experts = carried["model.layers.0.mlp.experts.gate_up_proj.weight"]
    assert (experts.dtype, tuple(experts.shape)) == (torch.float8_e4m3fn, (8, 64, 128))


def test_fp8_wire_plan_of_a_megatron_layout_keeps_its_pieces(tiny_checkpoints):
    """Megatron-Core's manifest gives its fused QKV and [gate; up] shards as explicit pieces
    (``megatron_source``); the fp8 wire carries the same pieces in e4m3 (a live
    megatron:tp=2,dp=2 round failed here, naming q_proj: 'give either pieces or owners')."""
    from m2nkit.engine.fp8_wire import fp8_wire_plan, wire_plan

    builder, plan = _plan(tiny_checkpoints, "tiny-qwen3", "megatron:tp=2,dp=2",
                          "vllm:tp=2,quant=fp8_per_block,wire=fp8")
    q = next(w for w in plan.wires if w.name == "model.layers.0.self_attn.q_proj.weight")
    assert q.meta.pieces is not None
    carried = {w.name: w.meta for w in wire_plan(plan, fp8_wire_plan(builder, plan)).wires}
    e4m3 = carried["model.layers.0.self_attn.q_proj.weight"]
    assert (e4m3.dtype, e4m3.pieces, e4m3.shape) == (torch.float8_e4m3fn, q.meta.pieces,
                                                     q.meta.shape)


def test_pad_experts_puts_each_row_shard_where_vllms_loaders_do():
    """w13 [E, 2*r, c] into [E, 2*R, C]: gate rows at 0, up rows at R, columns from 0, zero
    elsewhere (RoutedExperts._load_w13 narrows each shard on its own)."""
    from m2nkit.engine.quant_fp8 import pad_experts

    x = torch.arange(1, 13, dtype=torch.bfloat16).reshape(1, 4, 3)     # rows g0 g1 u0 u1
    out = pad_experts(x, (1, 8, 5), 2)
    want = torch.zeros(1, 8, 5, dtype=torch.bfloat16)
    want[0, 0, :3], want[0, 1, :3] = torch.tensor([1., 2, 3]), torch.tensor([4., 5, 6])
    want[0, 4, :3], want[0, 5, :3] = torch.tensor([7., 8, 9]), torch.tensor([10., 11, 12])
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match=r"cannot pad a \[1, 4, 3\] tensor to \[1, 2, 5\]"):
        pad_experts(x, (1, 2, 5), 2)


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
