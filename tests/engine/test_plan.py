"""Planner and in-process executor, on synthetic layouts (no model family).

Destinations here are built from plain mesh/placement layouts (each worker
holds its box of the wire tensor in a param of exactly that shape), plus a
fused case (two wire tensors stacked into one param). Expected values come
from slicing the full tensor directly, never from the planner.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
from m2nkit.engine.plan import build_plan, count_coverage
from m2nkit.manifest import (
    Binding,
    DestinationLayout,
    DestinationParam,
    ParamMeta,
    Replicate,
    Shard,
    local_box,
)
from m2nkit.manifest.layout import SourceLayout
from itertools import product


def _coords(mesh):
    return list(product(*(range(m) for m in mesh)))


def placement_destination(name, shape, dtype, mesh, placements, *, spec="test"):
    """Each worker holds its box of ``name`` as param ``name`` at offset 0."""
    params, bindings = [], []
    for w, coord in enumerate(_coords(mesh)):
        box = local_box(shape, mesh, placements, coord)
        local = tuple(b - a for a, b in box)
        params.append(DestinationParam(w, name, dtype, local))
        bindings.append(Binding(name, w, box, name, tuple(0 for _ in shape)))
    return DestinationLayout(spec, math.prod(mesh), tuple(params), {name: tuple(bindings)})


def local_streams(metas, fulls, num_ranks):
    """rank -> iter of (name, local tensor) like WeightSource.iter_local."""
    streams = {}
    for r in range(num_ranks):
        items = []
        for m in metas:
            lay = m.layout.resolve(num_ranks)
            if r not in lay.owners:
                continue
            coord = _coords(lay.mesh_shape)[lay.owners.index(r)]
            box = local_box(m.shape, lay.mesh_shape, lay.placements, coord)
            items.append((m.name, fulls[m.name][tuple(slice(a, b) for a, b in box)]))
        streams[r] = iter(items)
    return streams


placement_st = st.one_of(st.just(Replicate()), st.integers(0, 2).map(Shard))


@st.composite
def layout_case(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
    def mesh_and_placements():
        axes = draw(st.integers(1, 3))
        mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=axes, max_size=axes)))
        pl = tuple(draw(st.lists(placement_st, min_size=axes, max_size=axes)))
        pl = tuple(Shard(p.dim % nd) if isinstance(p, Shard) else p for p in pl)
        return mesh, pl
    src_mesh, src_pl = mesh_and_placements()
    dst_mesh, dst_pl = mesh_and_placements()
    extra = draw(st.integers(0, 3))  # trainer ranks that own nothing
    return shape, src_mesh, src_pl, dst_mesh, dst_pl, extra


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_case())
def test_random_layouts_cover_every_destination_element_exactly_once(case):
    shape, src_mesh, src_pl, dst_mesh, dst_pl, extra = case
    n_src = math.prod(src_mesh)
    first = extra  # owners start after `extra` idle ranks: a non-zero interval
    owners = tuple(range(first, first + n_src))
    meta = ParamMeta("w", torch.float32, shape, owners=owners, mesh_shape=src_mesh,
                     placements=src_pl)
    dest = placement_destination("w", shape, torch.float32, dst_mesh, dst_pl)
    plan = build_plan([meta], first + n_src, dest)
    assert plan.problems == []
    counts = count_coverage(plan)
    for key, c in counts.items():
        assert bool((c == 1).all()), key
    assert plan.nbytes_moved == plan.nbytes_min
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    storage = {w: allocate_storage(dest, w) for w in range(dest.num_workers)}
    execute_plan(plan, local_streams([meta], {"w": full}, first + n_src), storage)
    for w, coord in enumerate(_coords(dst_mesh)):
        box = local_box(shape, dst_mesh, dst_pl, coord)
        assert bitwise_equal(storage[w]["w"], full[tuple(slice(a, b) for a, b in box)])
    # Nobody outside the owners sends.
    assert plan.send_bytes[:first].sum() == 0


def test_fused_destination_two_wire_tensors_into_one_param():
    # q [6, 4] and k [2, 4] land in one "qkv" [8/2 rows..] per worker: worker w
    # holds q rows [3w, 3w+3) then k rows [w, w+1).
    q = ParamMeta("q", torch.bfloat16, (6, 4), owners=(0, 1, 2), placements=(Shard(0),))
    k = ParamMeta("k", torch.bfloat16, (2, 4), owners=(0, 1, 2), placements=(Shard(1),))
    params = tuple(DestinationParam(w, "qkv", torch.bfloat16, (4, 4)) for w in range(2))
    bindings = {
        "q": tuple(Binding("q", w, ((3 * w, 3 * w + 3), (0, 4)), "qkv", (0, 0)) for w in range(2)),
        "k": tuple(Binding("k", w, ((w, w + 1), (0, 4)), "qkv", (3, 0)) for w in range(2)),
    }
    dest = DestinationLayout("fused", 2, params, bindings)
    plan = build_plan([q, k], 3, dest)
    assert plan.problems == []
    fq = torch.randn(6, 4).to(torch.bfloat16)
    fk = torch.randn(2, 4).to(torch.bfloat16)
    storage = {w: allocate_storage(dest, w) for w in range(2)}
    execute_plan(plan, local_streams([q, k], {"q": fq, "k": fk}, 3), storage)
    for w in range(2):
        expect = torch.cat([fq[3 * w:3 * w + 3], fk[w:w + 1]])
        assert bitwise_equal(storage[w]["qkv"], expect)
    # k is sharded on columns over 3 ranks (4 = 2+2+0): rank 2 sends nothing of k.
    assert plan.wires[1].table[:, 0].tolist().count(2) == 0
    assert plan.wires[0].verdict("nccl_m2n").ok
    # 4 columns = 2+2+0 over 3 ranks: the ranks holding a piece (0, 1) form an
    # even 1x2 source mesh; rank 2 holds nothing and stays out of the reshard.
    route = plan.wires[1].verdict("nccl_m2n").detail
    assert (route.src.mesh_dims, route.src.start_rank, route.src.placements) == ((1, 2), 0, (-1, 1))


def test_replicas_share_the_send_load():
    # 4 replicas of a 16x8 fp32 tensor, 8 workers each needing it whole.
    meta = ParamMeta("w", torch.float32, (16, 8), owners=(0, 1, 2, 3), placements=(Replicate(),))
    dest = placement_destination("w", (16, 8), torch.float32, (8,), (Replicate(),))
    plan = build_plan([meta], 4, dest)
    assert plan.send_bytes.tolist() == [2 * 16 * 8 * 4] * 4
    assert plan.recv_bytes.tolist() == [16 * 8 * 4] * 8
    assert plan.nbytes_moved == plan.nbytes_min == 8 * 16 * 8 * 4


def test_hsdp_replica_groups_balance_and_bytes_are_minimal():
    # hsdp 2x3: mesh (2, 3), (Replicate, Shard(0)); 12 rows -> 4 per shard.
    meta = ParamMeta("w", torch.float32, (12, 5), owners=tuple(range(6)), mesh_shape=(2, 3),
                     placements=(Replicate(), Shard(0)))
    dest = placement_destination("w", (12, 5), torch.float32, (2,), (Shard(1),))
    plan = build_plan([meta], 6, dest)
    assert plan.problems == []
    assert plan.nbytes_moved == plan.nbytes_min == 12 * 5 * 4
    # Both replicas of every shard are used: no rank idles while its twin sends twice.
    assert (plan.send_bytes > 0).all()


def test_uncovered_param_and_unknown_tensor_are_problems():
    meta = ParamMeta("w", torch.float32, (4, 4))
    extra = ParamMeta("stray", torch.float32, (2,))
    params = (DestinationParam(0, "w", torch.float32, (4, 4)),
              DestinationParam(0, "missing", torch.float32, (3,)))
    dest = DestinationLayout("t", 1, params,
                             {"w": (Binding("w", 0, ((0, 4), (0, 4)), "w", (0, 0)),)})
    plan = build_plan([meta, extra], 2, dest)
    subjects = sorted(p.subject for p in plan.problems)
    assert subjects == ["stray", "worker 0 missing"]
    assert "written by no wire tensor" in str([p for p in plan.problems if "missing" in p.subject][0])


def test_overlapping_bindings_are_a_problem():
    meta = ParamMeta("w", torch.float32, (4,))
    params = (DestinationParam(0, "p", torch.float32, (4,)),)
    dest = DestinationLayout("t", 1, params, {"w": (
        Binding("w", 0, ((0, 3),), "p", (0,)), Binding("w", 0, ((2, 3),), "p", (2,)))})
    plan = build_plan([meta], 1, dest)
    assert any("overlap" in p.message for p in plan.problems)


def test_skipped_tensor_moves_nothing():
    meta = ParamMeta("lm_head.weight", torch.float32, (4, 4))
    dest = DestinationLayout("t", 1, (), {}, skipped={"lm_head.weight": "tied"})
    plan = build_plan([meta], 2, dest)
    assert plan.problems == [] and plan.nbytes_moved == 0 and plan.wires[0].skipped == "tied"


def test_digest_is_deterministic_and_sensitive():
    def make(rows):
        meta = ParamMeta("w", torch.float32, (rows, 4), owners=(0, 1, 2), placements=(Shard(0),))
        return build_plan([meta], 3, placement_destination("w", (rows, 4), torch.float32, (2,), (Shard(0),)))
    assert make(10).digest() == make(10).digest()
    assert make(10).digest() != make(11).digest()


def test_digest_counts_a_skip_not_how_it_is_worded():
    """The tables and the trace word one skip differently (an MTP layer): the same plan."""
    meta = ParamMeta("model.layers.1.mlp.weight", torch.float32, (4, 4))
    def plan(skipped):
        return build_plan([meta], 2, DestinationLayout("t", 1, (), {}, skipped=skipped))
    by_table = plan({meta.name: "multi-token-prediction layer 1: vLLM skips it"})
    by_trace = plan({meta.name: "vLLM's load_weights writes none of it on any worker (traced)"})
    assert by_table.digest() == by_trace.digest()
    taken = build_plan([meta], 2, placement_destination(meta.name, (4, 4), torch.float32, (1,),
                                                        (Shard(0),)))
    assert taken.digest() != by_table.digest()


def test_executor_refuses_out_of_order_streams():
    a = ParamMeta("a", torch.float32, (2,))
    b = ParamMeta("b", torch.float32, (2,))
    dest = DestinationLayout("t", 1, (DestinationParam(0, "a", torch.float32, (2,)),
                                      DestinationParam(0, "b", torch.float32, (2,))),
                             {"a": (Binding("a", 0, ((0, 2),), "a", (0,)),),
                              "b": (Binding("b", 0, ((0, 2),), "b", (0,)),)})
    plan = build_plan([a, b], 1, dest)
    storage = {0: allocate_storage(dest, 0)}
    with pytest.raises(ValueError, match="yielded 'b' where the manifest order expects 'a'"):
        execute_plan(plan, {0: iter([("b", torch.zeros(2)), ("a", torch.zeros(2))])}, storage)
    with pytest.raises(ValueError, match=r"has shape \(3,\); its box needs \(2,\)"):
        execute_plan(plan, {0: iter([("a", torch.zeros(3))])}, storage)


def test_m2n_verdicts_follow_the_preconditions():
    def verdict(shape, src_mesh, src_pl, dst_mesh, dst_pl, dtype=torch.bfloat16):
        meta = ParamMeta("w", dtype, shape, owners=tuple(range(math.prod(src_mesh))),
                         mesh_shape=src_mesh, placements=src_pl)
        dest = placement_destination("w", shape, dtype, dst_mesh, dst_pl)
        return build_plan([meta], math.prod(src_mesh), dest).wires[0].verdict("nccl_m2n")
    assert verdict((8, 4), (4,), (Shard(0),), (2,), (Shard(0),)).ok
    assert verdict((8, 4), (2, 2), (Replicate(), Shard(0)), (2,), (Shard(1),)).ok
    v = verdict((10, 4), (4,), (Shard(0),), (2,), (Shard(0),))   # 3+3+3+1 rows
    assert not v.ok and "source" in v.reason and "evenly" in v.reason
    # 9 rows = 3+3+3+0: the three ranks holding rows form an even source mesh
    # (rank 3 holds nothing and stays out); 9 rows over 2 workers do not.
    v = verdict((9, 4), (4,), (Shard(0),), (2,), (Shard(0),))
    assert not v.ok and v.reason.startswith("destination:") and "evenly" in v.reason
    v = verdict((8, 4), (2, 2), (Shard(0), Shard(1)), (2,), (Shard(0),))
    assert not v.ok and "more than one" in v.reason
    v = verdict((8, 4, 2, 2), (2,), (Shard(0),), (2,), (Shard(0),))
    assert not v.ok and "4-D" in v.reason
    v = verdict((64, 4), (32,), (Shard(0),), (1,), (Replicate(),))
    assert not v.ok and "32 source shards" in v.reason
    v = verdict((8,), (2,), (Shard(0),), (2,), (Shard(0),), dtype=torch.bool)
    assert not v.ok and "dtype" in v.reason
    ok = verdict((8,), (2,), (Shard(0),), (1,), (Replicate(),))
    assert ok.ok and ok.detail.dst.mesh_dims == (1, 1) and ok.detail.dst.placements == (-1, 0)


def test_m2n_fan_out_is_a_property_of_the_layouts_not_the_replica_choice():
    # One source shard held by 3 replicas feeds 128 (then 64) destination
    # shards: nccl.m2n allows 64 per source shard, whichever replicas send.
    meta = ParamMeta("w", torch.bfloat16, (16,), owners=(0, 1, 2))
    for workers, ok in ((128, False), (64, True)):
        dest = placement_destination("w", (16,), torch.bfloat16, (workers,), (Replicate(),))
        verdict = build_plan([meta], 3, dest).wires[0].verdict("nccl_m2n")
        assert verdict.ok is ok, verdict
        if not ok:
            assert f"one source shard feeds {workers} destination shards" in verdict.reason


def _layers(n, *, mesh=(2,), placements=(Shard(0),)):
    """``n`` layers of ``a`` and ``b`` [8, 6] (fp32), fused side by side in each layer's
    ``fused`` [4, 12] on 2 workers: worker w takes rows [4w, 4w+4) of both, ``a`` in
    columns 0..6 and ``b`` in 6..12 (a region that is not one memory run)."""
    metas, params, bindings = [], [], {}
    owners = tuple(range(math.prod(mesh)))
    for layer in range(n):
        fused = f"layer.{layer}.fused"
        for part, name in enumerate((f"layer.{layer}.a", f"layer.{layer}.b")):
            metas.append(ParamMeta(name, torch.float32, (8, 6), owners=owners, mesh_shape=mesh,
                                   placements=placements))
            bindings[name] = tuple(Binding(name, w, ((4 * w, 4 * w + 4), (0, 6)), fused,
                                           (0, 6 * part)) for w in range(2))
        params += [DestinationParam(w, fused, torch.float32, (4, 12)) for w in range(2)]
    return metas, DestinationLayout("layers", 2, tuple(params), bindings)


def test_repeated_layers_plan_like_each_layer_alone():
    """Every layer of a model has the same pieces and bindings: the planner intersects
    once and shares the slabs; each tensor's table, bytes and verdict are those it has
    when planned alone, and a verdict naming a parameter names that tensor's own."""
    metas, dest = _layers(4)
    plan = build_plan(metas, 2, dest)
    assert plan.problems == []
    assert plan.nbytes_moved == plan.nbytes_min == 4 * 2 * 8 * 6 * 4
    for i, wp in enumerate(plan.wires):
        alone = build_plan(metas[i:i + 1], 2, DestinationLayout(
            "one", 2, dest.params, {wp.name: dest.bindings[wp.name]})).wires[0]
        assert np.array_equal(wp.table, alone.table), wp.name
        assert (wp.nbytes_moved, wp.nbytes_min) == (alone.nbytes_moved, alone.nbytes_min)
        assert wp.verdict("nccl_m2n") == alone.verdict("nccl_m2n"), wp.name
        layer = wp.name.split(".")[1]
        assert f"worker 0's layer.{layer}.fused is not contiguous" in wp.verdict("nccl_m2n").reason
    assert plan.send_bytes.sum() == plan.nbytes_moved
    full = {m.name: torch.randn(8, 6) for m in metas}
    storage = {w: allocate_storage(dest, w) for w in range(2)}
    execute_plan(plan, local_streams(metas, full, 2), storage)
    for m in metas:
        layer, part = m.name.split(".")[1], "ab".index(m.name[-1])
        for w in range(2):
            got = storage[w][f"layer.{layer}.fused"][:, 6 * part:6 * part + 6]
            assert bitwise_equal(got, full[m.name][4 * w:4 * w + 4])


def test_repeated_layers_with_replicas_balance_across_layers():
    """hsdp replicas: which replica sends depends on what earlier tensors sent, so twin
    tensors need not share one table, and over the layers every rank sends."""
    metas, dest = _layers(4, mesh=(2, 2), placements=(Replicate(), Shard(0)))
    plan = build_plan(metas, 4, dest)
    assert plan.problems == []
    assert plan.nbytes_moved == plan.nbytes_min
    assert (plan.send_bytes > 0).all()
    assert any(not np.array_equal(plan.wires[0].table, w.table) for w in plan.wires[1:])
