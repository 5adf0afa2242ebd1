"""The ``ipc`` transport (issue 19): shard to shard over shared memory, handles as data.

Each rank here is a thread of this process with its own gloo group member
over 127.0.0.1 and the session's store, running ``IpcTransport`` as the
engine and the receiver do; the multi-process rounds (trainer processes,
the inference server's worker processes, rounds checked against
``reference_load``) are in test_engine.py (``transport="ipc"``). Expected
bytes come from the full tensors directly (slicing, torch's ``copy_``
cast), never from the planner. Two "nodes" are simulated by the node
names the transport is given (what ``M2NKIT_NODE`` sets per process).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from _layouts import own_param_destination
from _procs import in_threads
from m2nkit.engine.control import TransferError, create_group
from m2nkit.engine.in_process import allocate_storage, bitwise_equal
from m2nkit.engine.plan import build_plan
from m2nkit.engine.tools.procs import free_port
from m2nkit.engine.transports.ipc import (HandleError, IpcTransport, StaleHandleError,
                                          check_handle, expose, open_handle, route_bytes)
from m2nkit.manifest import ParamMeta, Shard
from m2nkit.manifest.destination import DestinationLayout

T, N = 2, 2
SHAPES = {"big": (256, 512), "small": (8, 16)}   # big: 128 KiB slabs; small: packed on p2p


def _case(dtype=torch.float32, param_dtype=torch.float32):
    """Wire tensors row-sharded over 2 trainer ranks (``fsdp:2``); each worker holds a
    column half, so every trainer rank has a slab for every worker."""
    g = torch.Generator().manual_seed(3)
    fulls = {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}
    metas = [ParamMeta(n, dtype, tuple(t.shape), owners=tuple(range(T)),
                       placements=(Shard(0),)) for n, t in fulls.items()]
    parts = {}
    for n, t in fulls.items():
        cols = t.shape[1] // N
        boxes = [[((0, t.shape[0]), (w * cols, (w + 1) * cols))] for w in range(N)]
        parts[n] = own_param_destination(n, tuple(t.shape), param_dtype, boxes)
    dest = DestinationLayout("test", N, sum((d.params for d in parts.values()), ()),
                             {n: d.bindings[n] for n, d in parts.items()})
    plan = build_plan(metas, T, dest)
    assert plan.problems == []
    return fulls, plan, dest


def _expected(fulls, worker, dtype):
    out = {}
    for n, t in fulls.items():
        cols = t.shape[1] // N
        dst = torch.empty((t.shape[0], cols), dtype=dtype)
        dst.copy_(t[:, worker * cols:(worker + 1) * cols])      # vLLM's loader cast
        out[f"{n}.0"] = dst
    return out


def _round(plan, streams, storage, nodes, *, rounds=1, timeout_s=20.0, bucket_bytes=64 << 20,
           fault=None):
    """``rounds`` rounds of IpcTransport, one thread per rank; ``{rank: [result or exc]}``."""
    port, groups = free_port(), []
    world = T + N

    def rank_fn(rank):
        def run():
            store, group = create_group("127.0.0.1", port, rank, world, timeout_s=timeout_s)
            groups.append(group)
            tr = IpcTransport(store, group, rank=rank, nodes=nodes, timeout_s=timeout_s,
                              bucket_bytes=bucket_bytes)
            out = []
            try:
                for k in range(rounds):
                    if fault is not None:
                        fault(rank, k, tr)
                    try:
                        if rank < T:
                            out.append(tr.send_round(plan, rank, iter(streams(rank, k))))
                        else:
                            out.append(tr.recv_round(plan, rank - T, storage[rank - T])[1])
                    except TransferError as e:
                        out.append(e)
                        break
            finally:
                tr.close()
            return out
        return run

    try:
        res = in_threads({r: rank_fn(r) for r in range(world)}, timeout_s + 30, "a rank")
    finally:
        for group in groups:
            group.abort()
    errors = {r: e for r, (kind, e) in res.items() if kind == "err"}
    assert not errors, errors
    return {r: v for r, (_, v) in res.items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire,param", [(torch.float32, torch.float32),
                                        (torch.float32, torch.bfloat16)])
def test_one_node_rounds_copy_each_workers_boxes_from_the_trainers_own_shards(wire, param):
    fulls, plan, dest = _case(wire, param)
    # Round k's local tensors are the trainer's own row shards, shifted in place each round.
    shards = {r: {n: t.chunk(T, 0)[r].clone() for n, t in fulls.items()} for r in range(T)}
    ptrs = {}

    def streams(rank, k):
        for n, t in shards[rank].items():
            if k:
                t.add_(1.0)
            ptrs.setdefault((rank, n, k), t.data_ptr())
            yield n, t

    storage = {w: allocate_storage(dest, w) for w in range(N)}
    res = _round(plan, streams, storage, ("a",) * (T + N), rounds=3)
    final = {n: torch.cat([shards[r][n] for r in range(T)]) for n in fulls}   # as trained
    assert not bitwise_equal(final["big"], fulls["big"])
    for w in range(N):
        want = _expected(final, w, param)
        for name, t in want.items():
            assert storage[w][name].dtype == param
            assert bitwise_equal(storage[w][name], t), (w, name)
    per_worker = sum(t.numel() for t in fulls.values()) * fulls["big"].element_size() // N
    for r in range(T, T + N):
        assert [x.ipc_bytes for x in res[r]] == [per_worker] * 3
        assert [x.p2p_bytes for x in res[r]] == [0, 0, 0]
    for r in range(T):
        assert [x.nbytes for x in res[r]] == [per_worker] * 3
    # The shard itself was exposed: moved into shared memory in the first round, in place,
    # then stable (same address, nothing copied or bounced in later rounds).
    for r in range(T):
        for n in fulls:
            assert ptrs[(r, n, 1)] == ptrs[(r, n, 2)]
            assert shards[r][n].untyped_storage().is_shared()


@pytest.mark.timeout(60)
def test_two_nodes_send_the_other_nodes_slabs_by_torch_p2p_in_the_same_round():
    fulls, plan, dest = _case()
    nodes = ("a", "b", "a", "b")         # trainer 0 and worker 0 on a; trainer 1, worker 1 on b
    el = fulls["big"].element_size()
    quarter = sum(t.numel() for t in fulls.values()) * el // (T * N)
    assert route_bytes(plan, nodes) == {"ipc": 2 * quarter, "p2p": 2 * quarter,
                                        "ipc_slabs": 4, "p2p_slabs": 4}
    assert route_bytes(plan, ("a",) * 4)["p2p"] == 0
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    res = _round(plan, lambda r, k: [(n, t.chunk(T, 0)[r].clone()) for n, t in fulls.items()],
                 storage, nodes)
    for w in range(N):
        for name, t in _expected(fulls, w, torch.float32).items():
            assert bitwise_equal(storage[w][name], t), (w, name)
    for r in range(T + N):
        (rep,) = res[r]
        assert (rep.ipc_bytes, rep.p2p_bytes) == (quarter, quarter), r


@pytest.mark.timeout(60)
def test_a_trainer_that_fails_mid_round_fails_every_worker_at_once_naming_it():
    fulls, plan, dest = _case()

    def streams(rank, k):
        yield "big", fulls["big"].chunk(T, 0)[rank].clone()
        if rank == 1:
            raise TransferError("trainer rank 1: provider of 'small' broke")
        yield "small", fulls["small"].chunk(T, 0)[rank].clone()

    storage = {w: allocate_storage(dest, w) for w in range(N)}
    # one bucket per wire tensor: 'big' is copied, then trainer 1 fails in 'small'
    res = _round(plan, streams, storage, ("a",) * 4, timeout_s=30,
                 bucket_bytes=4 << 10)
    for w in range(N):
        (err,) = res[T + w]
        assert isinstance(err, TransferError) and "provider of 'small' broke" in str(err)
        assert err.received == ["big"] and err.missing == ["small"]
    assert "provider of 'small' broke" in str(res[1][0])


@pytest.mark.timeout(90)
def test_a_worker_past_the_bucket_where_a_trainer_failed_hears_it_with_the_connections_open():
    """Worker 1 fails in bucket 0 (its storage cannot take the slab), so both trainer
    ranks fail after publishing bucket 0; worker 0 has copied bucket 0 and waits for
    bucket 1, which no trainer will expose. The groups stay referenced (this test holds
    them), so no connection closes: worker 0 must still fail at once, naming worker 1's
    failure, not at the deadline (the CI failure of stop 26: a trainer whose sockets
    outlived its failure left a worker waiting for a later bucket until the deadline)."""
    import time

    fulls, plan, dest = _case()

    def streams(rank, k):
        for n in SHAPES:
            yield n, fulls[n].chunk(T, 0)[rank].clone()

    storage = {w: allocate_storage(dest, w) for w in range(N)}
    storage[1]["big.0"] = torch.empty(1, 1)          # no slab fits: worker 1 fails in bucket 0
    timeout_s = 40.0
    t0 = time.monotonic()
    res = _round(plan, streams, storage, ("a",) * 4, timeout_s=timeout_s, bucket_bytes=4 << 10)
    took = time.monotonic() - t0
    (err,) = res[T + 0]
    assert isinstance(err, TransferError), err
    assert "worker 1 (rank 3)" in str(err) and "did not complete by" not in str(err), err
    assert err.received == ["big"] and err.missing == ["small"], err
    for r in range(T):
        (e,) = res[r]
        assert isinstance(e, TransferError) and "worker 1 (rank 3)" in str(e), e
    assert took < timeout_s / 2, (took, res)


def test_a_handle_whose_storage_was_freed_or_reallocated_is_refused_never_read():
    t = torch.arange(64, dtype=torch.float32)
    h = expose(t)
    assert h["kind"] == "shm" and json.loads(json.dumps(h)) == h      # plain data
    assert bitwise_equal(open_handle(h, "x"), t)
    del t
    gc.collect()                           # freed: its shared file is gone
    with pytest.raises(StaleHandleError, match=r"x: the handle \(/torch_.*256 bytes\) no longer "
                                               r"maps: the trainer freed or re-allocated"):
        open_handle(h, "x")
    # re-allocated: a handle claiming another size than its storage's is refused too
    u = torch.zeros(16)
    h2 = {**expose(u), "storage_nbytes": 128}
    with pytest.raises(StaleHandleError, match=r"y: the handle \(/torch_.*\) says 128 bytes and "
                                               r"its shared file holds 64: the storage was "
                                               r"re-allocated"):
        open_handle(h2, "y")
    with pytest.raises(HandleError, match="is not a shared-memory name"):
        open_handle({**h2, "file": "/../etc/passwd"}, "z")


def test_handles_are_checked_against_the_plan_before_use():
    _, plan, _ = _case()
    wi = [w.name for w in plan.wires].index("big")
    local = torch.zeros(128, 512)
    good = {**expose(local), "name": "big", "generation": 3}
    check_handle(good, plan, wi, 0, 3, "h")
    for bad, needle in [
        ({**good, "generation": 2}, "generation 2, this round is 3"),
        ({**good, "name": "small"}, "handle names 'small'; the plan has 'big'"),
        ({**good, "dtype": "bfloat16"}, "dtype 'bfloat16', the manifest says float32"),
        ({**good, "shape": [64, 512]}, r"shape \[64, 512\].*local shape is \(128, 512\)"),
        ({**good, "offset": 10}, "reaches byte 262184 of a 262144-byte storage"),
        ({k: v for k, v in good.items() if k != "stride"}, r"lacks \['stride'\]"),
        ("not a dict", "a handle must be an object"),
    ]:
        with pytest.raises(HandleError, match=needle):
            check_handle(bad, plan, wi, 0, 3, "h")


@pytest.mark.timeout(60)
def test_a_stale_handle_in_a_round_is_refused_and_every_rank_fails():
    """A trainer whose published handle names storage it has freed: the worker refuses it
    and says so, so the trainer fails too; nothing is read."""
    fulls, plan, dest = _case()

    def fault(rank, k, tr):
        if rank == 0:
            real = tr._share

            def stale(local):
                tmp = local.clone()
                h = real(tmp)
                del tmp
                gc.collect()
                return h
            tr._share = stale

    storage = {w: allocate_storage(dest, w) for w in range(N)}
    res = _round(plan, lambda r, k: [(n, t.chunk(T, 0)[r].clone()) for n, t in fulls.items()],
                 storage, ("a",) * 4, fault=fault)
    for w in range(N):
        (err,) = res[T + w]
        assert isinstance(err, StaleHandleError), err
        assert f"worker {w} (rank {T + w}): trainer rank 0's handle of 'big'" in str(err)
        assert "no longer maps" in str(err)
        assert torch.isnan(storage[w]["big.0"]).all() or not storage[w]["big.0"][:128].any()
    (err0,) = res[0]
    assert "no longer maps" in str(err0)


@pytest.mark.timeout(60)
def test_the_full_tensor_baseline_maps_each_full_tensor_and_keeps_each_workers_slice():
    """The colocated baseline (vLLM ipc's way): all-gather, rank 0 exposes every full
    tensor, each worker maps it and keeps its boxes; bit-exact, and the bytes it copies
    are the full tensors' (what m2nkit's shard IPC avoids)."""
    from m2nkit.engine.tools.baseline import create_trainer_group
    from m2nkit.engine.tools.colocated_baseline import SharedPool, full_tensor_ipc_round

    fulls, plan, dest = _case()
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    port, tport, groups = free_port(), free_port(), []

    def rank_fn(rank):
        def run():
            store, group = create_group("127.0.0.1", port, rank, T + N, timeout_s=20)
            groups.append(group)
            if rank >= T:
                return full_tensor_ipc_round(store, None, plan, rank, 1,
                                             storage=storage[rank - T], timeout_s=20)
            _, tgroup = create_trainer_group("127.0.0.1", tport, rank, T, timeout_s=20)
            groups.append(tgroup)
            return full_tensor_ipc_round(
                store, tgroup, plan, rank, 1, pool=SharedPool(), timeout_s=20,
                stream=iter([(n, t.chunk(T, 0)[rank].clone()) for n, t in fulls.items()]))
        return run

    try:
        res = in_threads({r: rank_fn(r) for r in range(T + N)}, 50, "a rank")
    finally:
        for g in groups:
            g.abort()
    assert all(kind == "ok" for kind, _ in res.values()), res
    for w in range(N):
        for name, t in _expected(fulls, w, torch.float32).items():
            assert bitwise_equal(storage[w][name], t), (w, name)
    model = sum(t.numel() * t.element_size() for t in fulls.values())
    for r in range(T):
        assert res[r][1].assembled == model and res[r][1].gathered == model // T
    for w in range(N):
        assert res[T + w][1].copied == model // N


@pytest.mark.timeout(60)
def test_connect_is_collective_and_every_rank_learns_every_ranks_node(monkeypatch):
    import socket
    import threading

    from m2nkit.engine.transports import ipc

    monkeypatch.setenv("M2NKIT_NODE", "box7")
    assert ipc.node_id() == "box7"
    monkeypatch.delenv("M2NKIT_NODE")
    assert ipc.node_id() == socket.gethostname()
    me = threading.local()          # the ranks are threads here: each says its own node
    monkeypatch.setattr(ipc, "node_id", lambda: f"n{me.rank % 2}")
    port, groups = free_port(), []

    def rank_fn(rank):
        def run():
            me.rank = rank
            store, group = create_group("127.0.0.1", port, rank, 3, timeout_s=20)
            groups.append(group)
            return IpcTransport.connect(store, group, rank, 3, device="cpu", timeout_s=20).nodes
        return run

    try:
        res = in_threads({r: rank_fn(r) for r in range(3)}, 50, "a rank")
    finally:
        for g in groups:
            g.abort()
    assert {r: v for r, (_, v) in res.items()} == {r: ("n0", "n1", "n0") for r in range(3)}
