"""local_box and the DTensor sources against real torch.distributed.tensor.

Two checks of m2nkit's layout rule (torch.chunk splits, two axes on one dim
outer-first) against torch's own code:

* in-process, hypothesis-driven: torch's pure layout function
  ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``
  (plain shapes and coordinates, no process group);
* multi-process: real gloo process groups of 4 and 6 ranks on 127.0.0.1,
  real ``DeviceMesh`` objects and ``distribute_tensor``; every rank asserts
  that ``dt.to_local()`` equals ``full[box]`` for its ``local_box``, and
  exercises ``DTensorModuleSource``/``ModuleSource``/``mesh_from_tensor``/
  ``placements_from_tensor`` on real DTensor parameters (Partial included).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from itertools import product

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from m2nkit.engine.tools.procs import free_port
from _procs import join_ranks
from m2nkit.manifest import (
    DTensorModuleSource,
    ModuleSource,
    Replicate,
    Shard,
    SourceLayout,
    layout_from_dtensor,
    local_box,
    mesh_from_tensor,
    owner_box,
    placements_from_tensor,
)

tdt = pytest.importorskip("torch.distributed.tensor")
try:  # torch's pure layout function (private; checked with torch 2.13)
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - a torch that moved it
    _compute_local_shape_and_global_offset = None

TIMEOUT_S = 120


def _to_torch(p):
    return tdt.Shard(p.dim) if isinstance(p, Shard) else tdt.Replicate()


def _slices(box):
    return tuple(slice(a, b) for a, b in box)


# --------------------------------------------------------------------------
# in-process: torch's layout function


@st.composite
def _cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = tuple(
        draw(st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1))))
        for _ in mesh_shape
    )
    return shape, mesh_shape, placements


@pytest.mark.skipif(_compute_local_shape_and_global_offset is None,
                    reason="this torch has no _compute_local_shape_and_global_offset")
@settings(max_examples=300, deadline=None)
@given(_cases())
def test_local_box_matches_torch_layout_function(case):
    shape, mesh_shape, placements = case
    torch_pl = [_to_torch(p) for p in placements]
    for coord in product(*(range(m) for m in mesh_shape)):
        box = local_box(shape, mesh_shape, placements, coord)
        t_shape, t_offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), torch_pl)
        assert tuple(b - a for a, b in box) == tuple(t_shape), (coord, box)
        for d, (a, b) in enumerate(box):
            if b > a:  # where an empty piece "starts" carries no data
                assert a == t_offset[d], (coord, box, t_offset)


# --------------------------------------------------------------------------
# multi-process: real process groups


SHAPES = [(7,), (13, 3), (5, 9), (3, 10), (2, 3, 7), (1, 5), (6,)]


def _placement_sets(ndim, mesh_ndim):
    options = [Replicate()] + [Shard(d) for d in range(ndim)]
    return list(product(options, repeat=mesh_ndim))


def _check_splits(rank, world, meshes):
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    checked = 0
    for mesh in meshes:
        mesh_shape = tuple(mesh.shape)
        coord = tuple(mesh.get_coordinate())
        for shape in SHAPES:
            full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            for placements in _placement_sets(len(shape), len(mesh_shape)):
                dt = distribute_tensor(full, mesh, [_to_torch(p) for p in placements])
                box = local_box(shape, mesh_shape, placements, coord)
                local = dt.to_local()
                where = (rank, mesh_shape, shape, placements, box)
                assert tuple(local.shape) == tuple(b - a for a, b in box), where
                assert torch.equal(local, full[_slices(box)]), where
                # the same box through owner_box (rank -> coordinate row-major)
                lay = SourceLayout(tuple(range(world)), mesh_shape, placements)
                assert owner_box(lay, shape, rank) == box, where
                t_shape, _ = compute_local_shape_and_global_offset(
                    shape, mesh, dt.placements)
                assert tuple(t_shape) == tuple(local.shape), where
                checked += 1
    assert checked >= 80  # every (mesh, shape, placements) case ran


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.arange(13 * 3, dtype=torch.float32).reshape(13, 3))
        self.proj = torch.nn.Linear(5, 7)
        self.norm = torch.nn.Parameter(torch.ones(4))


def _full_params():
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in _Model().named_parameters()}


def _dtensor_model(mesh1, mesh2, full, rank):
    from torch.distributed.tensor import distribute_tensor

    m = _Model()
    m.embed = torch.nn.Parameter(distribute_tensor(full["embed"], mesh1, [tdt.Shard(0)]))
    m.proj.weight = torch.nn.Parameter(
        distribute_tensor(full["proj.weight"], mesh2, [tdt.Shard(0), tdt.Shard(0)]))
    m.proj.bias = torch.nn.Parameter(
        distribute_tensor(full["proj.bias"], mesh2, [tdt.Replicate(), tdt.Shard(0)]))
    m.norm = torch.nn.Parameter(full["norm"].clone())  # plain: every rank holds it
    return m


def _check_sources(rank, world, mesh1, mesh2):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = _full_params()
    m = _dtensor_model(mesh1, mesh2, full, rank)
    params = dict(m.named_parameters())
    mesh2_shape = tuple(mesh2.shape)

    # mesh_from_tensor / placements_from_tensor / layout_from_dtensor
    assert mesh_from_tensor(m.embed, world) == (world,)
    assert mesh_from_tensor(m.proj.weight, world) == mesh2_shape
    assert placements_from_tensor(m.embed) == (Shard(0),)
    assert placements_from_tensor(m.proj.weight) == (Shard(0), Shard(0))
    assert placements_from_tensor(m.proj.bias) == (Replicate(), Shard(0))
    rep = distribute_tensor(full["norm"], mesh2, [tdt.Replicate(), tdt.Replicate()])
    assert placements_from_tensor(rep) is None
    assert layout_from_dtensor(m.proj.weight, world) == SourceLayout(
        tuple(range(world)), mesh2_shape, (Shard(0), Shard(0)))
    try:
        mesh_from_tensor(m.embed, world - 1)
        raise AssertionError("a mesh larger than the trainer ranks was accepted")
    except ValueError as e:
        assert f"only {world - 1} trainer ranks" in str(e)
    # a plain tensor: every trainer rank holds it (the seed's replicated mesh)
    assert mesh_from_tensor(full["norm"], world) == (world,)
    assert placements_from_tensor(full["norm"]) is None

    # DTensorModuleSource: metadata from the DTensors, iter_local = to_local()
    src = DTensorModuleSource(m, world, rank=rank)
    metas = {x.name: x for x in src.metadata}
    assert list(metas) == ["embed", "norm", "proj.weight", "proj.bias"]  # own params first
    assert metas["embed"].shape == (13, 3) and metas["embed"].owners == tuple(range(world))
    assert metas["proj.weight"].mesh_shape == mesh2_shape
    assert metas["proj.weight"].placements == (Shard(0), Shard(0))
    assert metas["proj.bias"].placements == (Replicate(), Shard(0))
    assert metas["norm"].owners is None and metas["norm"].placements is None
    assert src.owned_names() == list(metas)
    got = dict(src.iter_local())
    for name, meta in metas.items():
        box = owner_box(meta.layout, meta.shape, rank)
        assert torch.equal(got[name], full[name][_slices(box)]), (rank, name, box)
        p = params[name]
        expected = p.to_local() if isinstance(p, DTensor) else p
        assert torch.equal(got[name], expected), (rank, name)
    assert not src.implements_iter_full()

    # ModuleSource: same layouts for Shard/Replicate; iter_full gathers
    msrc = ModuleSource(m, rank=rank)
    assert [x.placements for x in msrc.metadata] == [x.placements for x in src.metadata]
    assert [x.owners for x in msrc.metadata] == [x.owners for x in src.metadata]
    local = dict(msrc.iter_local())
    assert all(torch.equal(local[n], got[n]) for n in metas)
    gathered = dict(msrc.iter_full())
    assert all(torch.equal(gathered[n], full[n]) for n in metas)

    # Partial: rejected by the m2n reader, declared replicated and gathered by ModuleSource
    part = DTensor.from_local(torch.full((2, 3), float(rank + 1)), mesh1, [tdt.Partial()])
    try:
        placements_from_tensor(part)
        raise AssertionError("Partial was accepted")
    except ValueError as e:
        assert "Partial" in str(e)
    pm = torch.nn.Module()
    pm.acc = torch.nn.Parameter(part)
    try:
        DTensorModuleSource(pm, world, rank=rank).metadata
        raise AssertionError("Partial parameter was accepted")
    except ValueError as e:
        assert "'acc'" in str(e) and "Partial" in str(e)
    pmeta = ModuleSource(pm, rank=rank).metadata[0]
    assert pmeta.owners == tuple(range(world)) and pmeta.placements is None
    (name, t), = ModuleSource(pm, rank=rank).iter_local()
    assert torch.equal(t, torch.full((2, 3), float(sum(range(1, world + 1)))))

    # a mesh whose ranks are not [0, n) row-major: DTensorModuleSource refuses,
    # ModuleSource takes the owners in mesh order
    rev = DeviceMesh("cpu", torch.arange(world).flip(0))
    # src_data_rank=None: every rank splits its own copy by its mesh coordinate.
    # (torch 2.13's scatter path, src_data_rank=0, hands the pieces of a
    # permuted mesh to the wrong ranks; the coordinate rule is what to_local()
    # and compute_local_shape_and_global_offset define.)
    rt = distribute_tensor(full["embed"], rev, [tdt.Shard(0)], src_data_rank=None)
    try:
        mesh_from_tensor(rt, world)
        raise AssertionError("reversed mesh accepted")
    except ValueError as e:
        assert "not the contiguous" in str(e)
    rm = torch.nn.Module()
    rm.embed = torch.nn.Parameter(rt)
    rmeta = ModuleSource(rm, rank=rank).metadata[0]
    assert rmeta.owners == tuple(reversed(range(world)))
    (_, rl), = ModuleSource(rm, rank=rank).iter_local()
    assert torch.equal(rl, full["embed"][_slices(owner_box(rmeta.layout, (13, 3), rank))])
    assert torch.equal(rl, rt.to_local())

    # a sub-mesh over ranks 0..1: other ranks own nothing and skip it
    sub = DeviceMesh("cpu", torch.arange(2))
    st_ = distribute_tensor(full["proj.bias"], sub, [tdt.Shard(0)])
    sm = torch.nn.Module()
    sm.b = torch.nn.Parameter(st_)
    ssrc = DTensorModuleSource(sm, world, rank=rank)
    assert ssrc.metadata[0].owners == (0, 1)
    items = list(ssrc.iter_local())
    if rank < 2:
        assert [n for n, _ in items] == ["b"]
        assert torch.equal(items[0][1], full["proj.bias"][_slices(((0, 4),) if rank == 0
                                                                  else ((4, 7),))])
    else:
        assert items == []

    # more than two mesh axes: DTensorModuleSource refuses, ModuleSource accepts
    if world % 4 == 0:
        m3 = DeviceMesh("cpu", torch.arange(world).reshape(world // 4, 2, 2))
        t3 = distribute_tensor(full["proj.weight"], m3,
                               [tdt.Replicate(), tdt.Shard(0), tdt.Shard(1)])
        try:
            mesh_from_tensor(t3, world)
            raise AssertionError("3-D mesh accepted")
        except ValueError as e:
            assert "at most 2" in str(e)
        mm = torch.nn.Module()
        mm.w = torch.nn.Parameter(t3)
        (_, l3), = ModuleSource(mm, rank=rank).iter_local()
        meta3 = ModuleSource(mm, rank=rank).metadata[0]
        assert torch.equal(l3, full["proj.weight"][_slices(owner_box(meta3.layout, (7, 5), rank))])


def _worker(rank, world, port):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S // 2))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh1 = init_device_mesh("cpu", (world,))
        mesh2s = [init_device_mesh("cpu", (2, world // 2))]
        if world // 2 != 2:
            mesh2s.append(init_device_mesh("cpu", (world // 2, 2)))
        _check_splits(rank, world, [mesh1, *mesh2s])
        _check_sources(rank, world, mesh1, mesh2s[0])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [4, 6])
def test_real_dtensors_match_local_box_and_sources(world):
    ctx = mp.start_processes(_worker, args=(world, free_port()), nprocs=world,
                             join=False, start_method="fork")
    join_ranks(ctx, TIMEOUT_S, f"world {world}")
