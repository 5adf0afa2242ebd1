"""torch_p2p *runs*: one message for a pair's slabs that continue one another in a worker parameter.

vLLM's fused MoE parameter ``w13_weight`` ``[E, 2I/tp, H]`` holds, per
expert, the worker's gate rows and then its up rows
(``FusedMoE.weight_loader``, vLLM ``model_executor/layers/fused_moe/layer.py``);
the trainer's ``[E, 2I, H]`` shard holds a worker's gate half and up half
apart, with the other worker's rows between them. So no two of a pair's
per-expert halves are adjacent on the trainer, while all of them are, in
order, on the worker: issue 20's "fewer, bigger messages". The transport
sends them as one message, packed on the trainer (a copy per part) and
received straight into the parameter's bytes. Runs are off by default
(``RUN_PIECE_BYTES = 0``: on gloo they did not measure faster, issue 20);
these tests turn them on.

The layout is built by hand (``Binding`` boxes, as ``tests/_layouts.py``
does), at sizes that keep each test under a second: ``DIRECT_BYTES`` is
lowered so the 1 KiB halves take the path 256 KiB halves take at real
sizes. Expected bytes come from the bindings alone (``fill_worker``: each
binding's box of the full tensor copied into its region, cast as vLLM's
``copy_`` casts), never from the transport. Rounds run over real gloo
groups (one thread per rank, 127.0.0.1) with deadlines; a trainer that
fails before its run's last part must end the worker's round with an error
naming it, not a hang.
"""

from __future__ import annotations

import time

import pytest
import torch

from _layouts import fill_worker, fused_moe_destination
from _procs import in_threads, p2p_round_in_threads
from m2nkit.engine.control import TransferError, create_group
from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
from m2nkit.engine.plan import build_plan
from m2nkit.engine.tools.procs import free_port
from m2nkit.engine.transports import torch_p2p
from m2nkit.engine.transports.torch_p2p import (BucketSchedule, BufferPool, message_count,
                                                recv_round, send_round)
from m2nkit.manifest import ParamMeta, Shard

T, N = 2, 2          # fsdp:2 trainer ranks, tp=2 workers
E, I, H = 4, 16, 32  # experts, intermediate, hidden: each trainer holds 2 experts
HALF = I // N        # rows of one gate (or up) half a worker takes
PART = HALF * H * 2  # bytes of one expert's half in bf16: 512


@pytest.fixture(autouse=True)
def _small_direct(monkeypatch):
    # The halves are PART bytes here; at real sizes (Qwen3-MoE, H 1024, I 512,
    # tp 2) they are 256 KiB, the library's DIRECT_BYTES. Runs are off by
    # default (RUN_PIECE_BYTES = 0); on, as benchmarks/transfer.py --runs sets them.
    monkeypatch.setattr(torch_p2p, "DIRECT_BYTES", PART)
    monkeypatch.setattr(torch_p2p, "RUN_PIECE_BYTES", 4 << 20)


def _fused_moe(param_dtype=torch.bfloat16):
    """``experts.gate_up_proj`` [E, 2I, H] bf16, Shard(0) over T ranks, into ``w13`` [E, I, H]."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    meta = ParamMeta("experts.gate_up_proj", torch.bfloat16, (E, 2 * I, H),
                     owners=tuple(range(T)), placements=(Shard(0),))
    dest = fused_moe_destination(meta.name, N, E, I, H, param_dtype)
    plan = build_plan([meta], T, dest)
    assert plan.problems == []
    return full, plan, dest


def _streams(full):
    return {r: [("experts.gate_up_proj", full.chunk(T, 0)[r].clone())] for r in range(T)}


def test_a_pairs_expert_halves_travel_as_one_message_per_pair(monkeypatch):
    full, plan, _ = _fused_moe()
    # The plan's slabs: per pair a gate slab and an up slab, each 2 experts deep.
    assert sum(len(list(w.slabs())) for w in plan.wires) == T * N * 2
    # Each pair: 2 experts x (gate, up) = 4 halves of PART bytes, all adjacent
    # in w13_weight rows [2r, 2r+2) x [0, I): one message; 4 pairs.
    assert message_count(plan, BucketSchedule.build(plan)) == T * N
    # Runs off (the library default): each half is its own message (cut per
    # expert, contiguous on both sides): 4 per pair.
    monkeypatch.setattr(torch_p2p, "RUN_PIECE_BYTES", 0)
    _, plan, _ = _fused_moe()
    assert message_count(plan, BucketSchedule.build(plan)) == T * N * 4


def test_gloo_round_lands_every_run_byte_in_place_without_staging():
    full, plan, dest = _fused_moe()
    schedule = BucketSchedule.build(plan)
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    pools = {T + w: BufferPool() for w in range(N)}
    got = p2p_round_in_threads(plan, schedule, _streams(full), storage, timeout_s=30,
                               pools=pools)
    for w in range(N):
        want, count = fill_worker(dest, {"experts.gate_up_proj": full}, w)
        assert (count["w13_weight"] == 1).all()
        assert bitwise_equal(storage[w]["w13_weight"], want["w13_weight"]), w
        assert got[T + w] == E * I * H * 2             # the worker's bytes, sent once
        assert pools[T + w].nbytes == 0                # received into w13_weight itself
    assert [got[r] for r in range(T)] == [N * E * I * H * 2 // T] * T   # half the experts each


def test_a_run_into_a_parameter_of_another_dtype_is_staged_and_cast():
    # fp32 parameters for a bf16 wire: the run's bytes cannot land in place;
    # they are staged and cast per part, as vLLM's copy_ casts.
    full, plan, dest = _fused_moe(torch.float32)
    schedule = BucketSchedule.build(plan)
    assert message_count(plan, schedule) == T * N
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    got = p2p_round_in_threads(plan, schedule, _streams(full), storage, timeout_s=30)
    for w in range(N):
        want, _ = fill_worker(dest, {"experts.gate_up_proj": full}, w)
        assert storage[w]["w13_weight"].dtype == torch.float32
        assert bitwise_equal(storage[w]["w13_weight"], want["w13_weight"]), w
        assert got[T + w] == E * I * H * 2             # bf16 on the wire


def test_in_process_executor_runs_the_same_run_messages():
    full, plan, dest = _fused_moe()
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    execute_plan(plan, _streams(full), storage)
    for w in range(N):
        want, _ = fill_worker(dest, {"experts.gate_up_proj": full}, w)
        assert bitwise_equal(storage[w]["w13_weight"], want["w13_weight"]), w


def test_a_trainer_that_fails_before_its_run_is_sent_ends_the_workers_round_naming_it():
    full, plan, dest = _fused_moe()
    schedule = BucketSchedule.build(plan)
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    port, groups = free_port(), []
    wrong = {0: _streams(full)[0], 1: [("experts.other", full.chunk(T, 0)[1])]}

    def rank_fn(rank):
        def run():
            _, group = create_group("127.0.0.1", port, rank, T + N, timeout_s=30)
            groups.append(group)
            if rank < T:
                return send_round(group, plan, schedule, rank, iter(wrong[rank]), timeout_s=1.5)
            return recv_round(group, plan, schedule, rank - T, storage[rank - T],
                              timeout_s=1.5)
        return run

    start = time.monotonic()
    try:
        out = in_threads({r: rank_fn(r) for r in range(T + N)}, 30, "a rank")
    finally:
        for group in groups:
            group.abort()
    assert time.monotonic() - start < 20
    kind, err = out[1]
    assert kind == "err" and isinstance(err, TransferError)
    assert "trainer rank 1" in str(err) and "experts.other" in str(err)
    for w in range(N):
        kind, err = out[T + w]
        assert kind == "err" and isinstance(err, TransferError), (w, out[T + w])
        assert "from trainer rank 1" in str(err), str(err)
        assert err.missing == ["experts.gate_up_proj"] and err.received == []


def test_pool_views_are_made_once_per_pool_bytes_and_again_after_it_grows():
    pool, layout, built = BufferPool(), object(), []

    def build(buf):
        built.append(buf.numel())
        return buf[:4]

    pool.reserve(16)
    first = pool.views(layout, build)
    assert pool.views(layout, build) is first and built == [16]
    pool.reserve(8)                                   # fits: same bytes, same views
    assert pool.views(layout, build) is first and built == [16]
    pool.reserve(64)                                  # grown: the old views are stale
    again = pool.views(layout, build)
    assert built == [16, 64] and again.data_ptr() == pool.reserve(1).data_ptr()
    pool.release()
    pool.reserve(16)
    pool.views(layout, build)
    assert built == [16, 64, 16]


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_rounds_with_kept_pools_land_each_rounds_bytes(monkeypatch, param_dtype):
    # Every slab packed (DIRECT_BYTES above the tensor, no runs): both sides
    # copy through views of their kept pools, made in round 1 and reused in
    # round 2, which carries other bytes; fp32 parameters take the cast.
    monkeypatch.setattr(torch_p2p, "DIRECT_BYTES", 1 << 30)
    monkeypatch.setattr(torch_p2p, "RUN_PIECE_BYTES", 0)
    full, plan, dest = _fused_moe(param_dtype)
    schedule = BucketSchedule.build(plan)
    assert message_count(plan, schedule) == T * N     # one packed message per pair
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    pools = {r: BufferPool() for r in range(T + N)}
    for round_ in range(2):
        full = full * 2 + 1 if round_ else full
        streams = _streams(full)
        port, groups = free_port(), []

        def rank_fn(rank):
            def run():
                _, group = create_group("127.0.0.1", port, rank, T + N, timeout_s=30)
                groups.append(group)
                if rank < T:
                    return send_round(group, plan, schedule, rank, iter(streams[rank]),
                                      timeout_s=30, pool=pools[rank])
                return recv_round(group, plan, schedule, rank - T, storage[rank - T],
                                  timeout_s=30, pool=pools[rank])[1]
            return run

        try:
            out = in_threads({r: rank_fn(r) for r in range(T + N)}, 60, "a rank")
        finally:
            for group in groups:
                group.abort()
        assert all(kind == "ok" for kind, _ in out.values()), out
        for w in range(N):
            want, _ = fill_worker(dest, {"experts.gate_up_proj": full}, w)
            assert bitwise_equal(storage[w]["w13_weight"], want["w13_weight"]), (round_, w)
        assert all(len(pools[r]._views) == 1 for r in range(T + N))   # one bucket's views
