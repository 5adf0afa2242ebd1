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
    ("fsdp2:dp_shard=4", "fsdp2", (4,), (Shard(0),)),
    ("fsdp2:dp_replicate=2,dp_shard=3", "fsdp2", (2, 3), (Replicate(), Shard(0))),
    ("fsdp2:dp_shard=3,tp=2", "fsdp2", (3, 2), (Shard(0), Replicate())),
    (" FSDP2 : tp=2 , dp_shard=2, dp_replicate=2", "fsdp2", (2, 2, 2),
     (Replicate(), Shard(0), Replicate())),
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
    ("fsdp2:dp_shard=2,pp=2", "'fsdp2' axis 'pp' is not supported; axes are dp_replicate, "
                              "dp_shard, tp (torchtitan ParallelDims names)"),
    ("fsdp2:tp=2", "'fsdp2' needs dp_shard"),
    ("fsdp2:dp_shard=2,dp_shard=3", "'fsdp2' axis 'dp_shard' is given twice"),
    ("fsdp2:dp_shard", "'fsdp2' takes AXIS=SIZE pairs, got 'dp_shard'"),
    ("fsdp2:dp_shard=0", "size '0' is not a positive integer"),
    ("fsdp2:4", "'fsdp2' takes AXIS=SIZE pairs, got '4'"),
])
def test_parse_invalid_names_the_valid_forms(text, why):
    with pytest.raises(ValueError) as info:
        parse_trainer_spec(text)
    msg = str(info.value)
    assert why in msg
    assert repr(text) in msg
    assert "replicated:N, fsdp:N, hsdp:R,S" in msg
    # every Megatron size the parser accepts is in the valid forms it lists
    assert "megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D][,first=N][,last=N]" in msg


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
                                  "fsdp:16", "hsdp:2,3", "hsdp:3,2", "hsdp:2,5",
                                  "fsdp2:dp_shard=5", "fsdp2:dp_replicate=3,dp_shard=2"])
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



def test_parsing_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from m2nkit.adapters.trainer_spec import parse_trainer_spec as p; "
            "p('fsdp2:dp_replicate=2,dp_shard=3,tp=2'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_tp_plan_names_are_wire_names():
    """The families' TP plans name in-memory modules; the dry run looks wire names up in
    them, which holds because each planned module's tensors keep their name on disk."""
    from m2nkit.adapters.families import ARCHITECTURES, family
    from m2nkit.adapters.tiny import build_model, tiny_config

    planned = 0
    for arch in ARCHITECTURES:
        fam = family(arch)
        if fam.tp_plan is None:
            continue
        for name in fam.tiny:
            cfg = tiny_config(name)
            with torch.device("meta"):
                model = build_model(cfg)
            for pname, _ in model.named_parameters():
                module = pname.rpartition(".")[0]
                if fam.tp_plan.style(module, cfg) is not None:
                    assert fam.hf.disk_name(pname) == pname, (arch, pname)
                    planned += 1
    assert planned > 0


def test_tp_needs_a_family_plan(tiny_checkpoints):
    from m2nkit.adapters.families import ARCHITECTURES, family
    from m2nkit.adapters.tiny import tiny_config

    no_plan = [n for a in ARCHITECTURES if family(a).tp_plan is None for n in family(a).tiny]
    if not no_plan:
        pytest.skip("every family has a TP plan")
    spec = parse_trainer_spec("fsdp2:dp_shard=2,tp=2")
    with pytest.raises(ValueError, match=r"has no tensor-parallel plan .*families with one: "
                                         r".*LlamaForCausalLM"):
        spec.tp_dims(tiny_config(no_plan[0]))
    assert parse_trainer_spec("fsdp2:dp_shard=2").tp_dims(tiny_config(no_plan[0]))("x") is None


@pytest.mark.parametrize("text", ["fsdp2:dp_shard=3", "fsdp2:dp_replicate=2,dp_shard=3",
                                  "fsdp2:dp_shard=3,tp=2", "fsdp2:dp_replicate=2,dp_shard=2,tp=2"])
def test_fsdp2_specs_match_real_fully_shard_and_tp(text, tmp_path):
    """What ``m2nkit plan --trainer fsdp2:...`` lays out (``checkpoint_metas`` of the
    saved checkpoint) is what real FSDP2 (``fully_shard`` per layer and root, after the
    family's TP plan with ``parallelize_module``) leaves in every rank's ``to_local()``,
    on shapes that split unevenly (vocab 200 -> 100 per TP rank -> 34/34/32; 32 KV rows
    -> 16 -> 6/6/4). One process, torch's fake process group, one rank at a time: both
    FSDP2 and TP (``src_data_rank=None``) cut a rank's shard locally."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed import fake_pg
    from transformers import AutoModelForCausalLM

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.tensor_parallel import apply_tp_plan
    from m2nkit.adapters.tiny import tiny_config
    from m2nkit.manifest import box_slices

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    spec = parse_trainer_spec(text)
    names = spec.mesh_dim_names
    dp = tuple(n for n in names if n != "tp")
    checked = 0
    for model_name in ("tiny-llama", "tiny-qwen3-moe"):
        cfg = tiny_config(model_name)
        torch.manual_seed(0)
        built = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        built.save_pretrained(tmp_path / model_name)
        full = {n: p.detach().clone() for n, p in built.named_parameters()}
        metas = {m.name: m for m in checkpoint_metas(read_checkpoint(tmp_path / model_name), spec)}
        for rank in range(spec.num_ranks):
            dist.init_process_group("fake", rank=rank, world_size=spec.num_ranks,
                                    store=fake_pg.FakeStore())
            try:
                model = copy.deepcopy(built)
                mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)
                if spec.tp > 1:
                    apply_tp_plan(model, mesh["tp"], src_data_rank=None)
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh[dp])
                fully_shard(model, mesh=mesh[dp])
                for name, p in model.named_parameters():
                    meta = metas[name] if name in metas else metas[name + ".weight"]  # fused experts
                    mine = [x for x in meta.source_pieces(spec.num_ranks) if x.rank == rank]
                    local = p.to_local()
                    if not mine:
                        assert local.numel() == 0, (text, rank, name)
                        continue
                    (piece,) = mine
                    want = full[name][box_slices(piece.box)]
                    assert local.shape == want.shape and torch.equal(local, want), (
                        text, rank, name, piece.box, tuple(local.shape))
                    checked += 1
            finally:
                dist.destroy_process_group()
    assert checked > 0
