"""Trainer specs: parsing, and boxes that match torch.chunk and real FSDP2 sharding."""

from __future__ import annotations

import pytest
import torch

from m2nkit.adapters.trainer_spec import TrainerSpec, parse_trainer_spec
from m2nkit.manifest.layout import local_box, rank_boxes
from m2nkit.manifest.placement import Replicate, Shard


@pytest.mark.parametrize("text, kind, mesh, placements", [
    ("replicated:1", "replicated", (1,), (Replicate(),)),
    ("replicated:4", "replicated", (4,), (Replicate(),)),
    ("fsdp:1", "fsdp", (1,), (Shard(0),)),
    ("fsdp:7", "fsdp", (7,), (Shard(0),)),
    ("hsdp:2,3", "hsdp", (2, 3), (Replicate(), Shard(0))),
    (" HSDP : 4 , 64 ", "hsdp", (4, 64), (Replicate(), Shard(0))),
    ("FSDP:256", "fsdp", (256,), (Shard(0),)),
])
def test_parse_valid(text, kind, mesh, placements):
    spec = parse_trainer_spec(text)
    assert (spec.kind, spec.mesh_shape, spec.placements) == (kind, mesh, placements)
    assert spec.num_ranks == torch.Size(mesh).numel()
    assert spec.owners == tuple(range(spec.num_ranks))
    assert parse_trainer_spec(str(spec)) == spec
    assert parse_trainer_spec(spec) is spec


@pytest.mark.parametrize("text, why", [
    ("fsdp", "expected KIND:SIZES"),
    ("", "expected KIND:SIZES"),
    ("fsdp:0", "size '0' is not a positive integer"),
    ("fsdp:-2", "size '-2' is not a positive integer"),
    ("fsdp:2.5", "size '2.5' is not a positive integer"),
    ("fsdp:", "size '' is not a positive integer"),
    ("fsdp:2,3", "'fsdp' takes one size N, got 2"),
    ("replicated:2,2", "'replicated' takes one size N, got 2"),
    ("hsdp:4", "'hsdp' takes two sizes R,S (replicas, shards), got 1"),
    ("hsdp:2,0", "size '0' is not a positive integer"),
    ("hsdp:2,3,4", "'hsdp' takes two sizes R,S (replicas, shards), got 3"),
    ("tp:2", "unknown kind 'tp'"),
    ("fsdp:2:3", "expected KIND:SIZES"),
    (4, "expected a string, got int"),
])
def test_parse_invalid_names_the_valid_forms(text, why):
    with pytest.raises(ValueError) as info:
        parse_trainer_spec(text)
    msg = str(info.value)
    assert why in msg
    assert repr(text) in msg
    assert "replicated:N, fsdp:N, hsdp:R,S" in msg


def test_layout_for_shapes():
    fsdp = parse_trainer_spec("fsdp:3")
    lay = fsdp.layout_for((8, 4))
    assert (lay.owners, lay.mesh_shape, lay.placements) == ((0, 1, 2), (3,), (Shard(0),))
    hsdp = parse_trainer_spec("hsdp:2,3")
    lay = hsdp.layout_for((5,))
    assert (lay.owners, lay.mesh_shape, lay.placements) == (
        (0, 1, 2, 3, 4, 5), (2, 3), (Replicate(), Shard(0)))
    rep = parse_trainer_spec("replicated:2").layout_for((3, 3))
    assert (rep.owners, rep.mesh_shape, rep.placements) == ((0, 1), (2,), None)
    # 0-d tensors have no dim 0: replicated on every rank of the mesh
    for spec in (fsdp, hsdp):
        scalar = spec.layout_for(())
        assert scalar.owners == spec.owners and scalar.placements is None
        assert all(box == () for _, box in rank_boxes(scalar, ()))


def test_coord_is_row_major_and_checked():
    spec = parse_trainer_spec("hsdp:2,3")
    assert [spec.coord(r) for r in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for bad in (-1, 6, True, 1.0):
        with pytest.raises(ValueError, match=r"valid ranks are 0\.\.5"):
            spec.coord(bad)


def _chunk_reference(spec: TrainerSpec, full: torch.Tensor, rank: int) -> torch.Tensor:
    """What a rank holds, from torch.chunk alone (FSDP2's rule), independent of layout.py."""
    if spec.kind == "replicated":
        return full
    shards = spec.mesh_shape[-1]
    index = rank % shards  # hsdp: the inner axis shards
    chunks = torch.chunk(full, shards, dim=0)
    if index < len(chunks):
        return chunks[index]
    return full[full.shape[0]:]


@pytest.mark.parametrize("text", ["replicated:2", "fsdp:1", "fsdp:3", "fsdp:5", "fsdp:7",
                                  "fsdp:16", "hsdp:2,3", "hsdp:3,2", "hsdp:2,5"])
@pytest.mark.parametrize("shape", [(1,), (5,), (8, 3), (13, 2), (7, 4, 3)])
def test_boxes_match_torch_chunk(text, shape):
    spec = parse_trainer_spec(text)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    lay = spec.layout_for(shape)
    for rank, box in rank_boxes(lay, shape):
        got = full[tuple(slice(a, b) for a, b in box)]
        want = _chunk_reference(spec, full, rank)
        assert got.shape == want.shape and torch.equal(got, want), (text, shape, rank, box)
        assert box == local_box(shape, lay.mesh_shape, lay.placements, spec.coord(rank))


def test_boxes_match_real_fsdp2_fully_shard():
    """fully_shard itself shards a module; every rank's local piece equals our box.

    Runs FSDP2 in one process over torch's fake process group, one rank at a
    time: sharding is rank-local (FSDP2 chunks the full parameter on dim 0),
    so no collective is needed to see each rank's ``to_local()``.
    """
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 13),
                                   torch.nn.Embedding(8, 3))

    checked = 0
    for text in ("fsdp:3", "fsdp:7", "hsdp:2,3", "hsdp:3,2"):
        spec = parse_trainer_spec(text)
        names = ("shard",) if len(spec.mesh_shape) == 1 else ("replicate", "shard")
        for rank in range(spec.num_ranks):
            dist.init_process_group("fake", rank=rank, world_size=spec.num_ranks,
                                    store=fake_pg.FakeStore())
            try:
                module = build()
                full = {n: p.detach().clone() for n, p in module.named_parameters()}
                mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)
                fully_shard(module, mesh=mesh)
                for name, p in module.named_parameters():
                    ours = tuple(Shard(pl.dim) if isinstance(pl, TShard) else Replicate()
                                 for pl in p.placements
                                 if isinstance(pl, (TShard, TReplicate)))
                    assert ours == spec.placements, (text, name, p.placements)
                    lay = spec.layout_for(tuple(p.shape))
                    box = local_box(p.shape, lay.mesh_shape, lay.placements, spec.coord(rank))
                    want = full[name][tuple(slice(a, b) for a, b in box)]
                    local = p.to_local()
                    assert local.shape == want.shape and torch.equal(local, want), (
                        text, rank, name, box)
                    checked += 1
            finally:
                dist.destroy_process_group()
    assert checked == 5 * (3 + 7 + 6 + 6)  # 5 parameters, every rank of every spec


def test_every_element_held_by_the_right_number_of_ranks():
    for text, copies in (("fsdp:5", 1), ("hsdp:2,3", 2), ("hsdp:3,2", 3), ("replicated:4", 4)):
        spec = parse_trainer_spec(text)
        for shape in ((11, 3), (2,), (0, 4)):
            count = torch.zeros(shape, dtype=torch.int64)
            for _, box in rank_boxes(spec.layout_for(shape), shape):
                count[tuple(slice(a, b) for a, b in box)] += 1
            assert bool((count == copies).all()), (text, shape)

