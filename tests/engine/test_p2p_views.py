"""torch_p2p's zero-copy messages: byte ranges worked out once per plan, and their fallbacks.

A direct message (a slab of ``DIRECT_BYTES`` or more, cut per expert where
that makes it contiguous on both sides) is sent as one slice of the trainer
local tensor's flat bytes and received into one slice of the worker
parameter's flat bytes, at offsets the layout computed from the plan's
shapes (``_byte_range``). That holds only for a local tensor and a
parameter that are C-contiguous with the planned shape; any other strides
must take the bounce copies, not the precomputed offsets.

The layout is the fused-MoE one of ``test_p2p_runs.py`` (``[E, 2I, H]``
experts, ``Shard(0)`` over 2 trainer ranks, into ``w13_weight`` of 2
workers), runs off (the library default), ``DIRECT_BYTES`` lowered so the
512-byte halves take the path 256 KiB halves take at real sizes. Expected
bytes come from the bindings alone (``fill_worker``), never from the
transport; rounds run over real gloo groups, one thread per rank.
"""

from __future__ import annotations

import pytest
import torch

from _layouts import fill_worker, fused_moe_destination
from _procs import p2p_round_in_threads
from m2nkit.engine.in_process import allocate_storage, bitwise_equal
from m2nkit.engine.plan import build_plan
from m2nkit.engine.transports import torch_p2p
from m2nkit.engine.transports.torch_p2p import BucketSchedule, BufferPool, message_count
from m2nkit.manifest import ParamMeta, Shard

T, N = 2, 2
E, I, H = 4, 16, 32
HALF = I // N
PART = HALF * H * 2      # bytes of one expert's gate (or up) half for one worker, bf16


@pytest.fixture(autouse=True)
def _small_direct(monkeypatch):
    monkeypatch.setattr(torch_p2p, "DIRECT_BYTES", PART)


def _fused_moe():
    g = torch.Generator().manual_seed(5)
    full = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    meta = ParamMeta("experts.gate_up_proj", torch.bfloat16, (E, 2 * I, H),
                     owners=tuple(range(T)), placements=(Shard(0),))
    dest = fused_moe_destination(meta.name, N, E, I, H, torch.bfloat16)
    plan = build_plan([meta], T, dest)
    assert plan.problems == []
    return full, plan, dest


def _local(full, r):
    return full.chunk(T, 0)[r].clone()


def _restrided(t):
    """``t``'s values and shape in storage laid out hidden-first: not C-contiguous."""
    out = t.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert bitwise_equal(out, t) and not out.is_contiguous()
    return out


def _within(buf, t):
    lo, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    return lo <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= lo + n


def _assert_landed(full, dest, storage):
    for w in range(N):
        want, count = fill_worker(dest, {"experts.gate_up_proj": full}, w)
        assert (count["w13_weight"] == 1).all()
        assert bitwise_equal(storage[w]["w13_weight"], want["w13_weight"]), w


def test_direct_messages_go_from_the_local_tensors_bytes_into_the_parameters_bytes(monkeypatch):
    full, plan, dest = _fused_moe()
    schedule = BucketSchedule.build(plan)
    assert message_count(plan, schedule) == T * N * 4   # each expert half its own message
    locals_ = {r: _local(full, r) for r in range(T)}
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    pools = {r: BufferPool() for r in range(T + N)}
    posted = []
    real_post = torch_p2p._post

    def spy(group, op, buf, peer, tag, what):
        posted.append((op, buf, peer))
        return real_post(group, op, buf, peer, tag, what)

    monkeypatch.setattr(torch_p2p, "_post", spy)
    streams = {r: [("experts.gate_up_proj", locals_[r])] for r in range(T)}
    p2p_round_in_threads(plan, schedule, streams, storage, timeout_s=30, pools=pools)
    _assert_landed(full, dest, storage)
    assert all(pool.nbytes == 0 for pool in pools.values())   # nothing staged on any rank
    sends = [(buf, peer) for op, buf, peer in posted if op == "send"]
    recvs = [(buf, peer) for op, buf, peer in posted if op == "recv"]
    assert len(sends) == len(recvs) == T * N * 4
    assert all(b.numel() == PART for b, _ in sends + recvs)
    # every send reads its trainer's local tensor; every receive writes a w13_weight
    assert all(any(_within(b, locals_[r]) for r in range(T)) for b, _ in sends)
    assert all(any(_within(b, storage[w]["w13_weight"]) for w in range(N)) for b, _ in recvs)


def test_a_local_tensor_with_other_strides_is_sent_from_bounce_copies():
    full, plan, dest = _fused_moe()
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    streams = {r: [("experts.gate_up_proj", _restrided(_local(full, r)))] for r in range(T)}
    p2p_round_in_threads(plan, BucketSchedule.build(plan), streams, storage, timeout_s=30)
    _assert_landed(full, dest, storage)


def test_a_parameter_with_other_strides_is_received_through_bounce_copies():
    full, plan, dest = _fused_moe()
    storage = {w: {"w13_weight": _restrided(torch.full((E, I, H), float("nan"),
                                                       dtype=torch.bfloat16))}
               for w in range(N)}
    streams = {r: [("experts.gate_up_proj", _local(full, r))] for r in range(T)}
    p2p_round_in_threads(plan, BucketSchedule.build(plan), streams, storage, timeout_s=30)
    _assert_landed(full, dest, storage)
    assert not storage[0]["w13_weight"].is_contiguous()     # written in place, strides kept
