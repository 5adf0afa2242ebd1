"""The seed API's behaviour (vLLM ``m2n_source.py``, ``m2n_common.py``, ``base.py``) where
m2nkit used to differ: plain tensors in ``mesh_from_tensor``/``placements_from_tensor``,
bool owners, the ``M2NLayout``/``M2NMesh`` vocabulary, ``DTensorModuleSource`` over a
plain module (docs/reference.md §1). vLLM is not installed here; an object shaped like
vLLM's ``M2NLayout`` stands in for it where the conversion reads by attribute.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m2nkit.manifest import (
    REPLICATE,
    REPLICATED,
    DTensorModuleSource,
    M2NLayout,
    M2NManifestEntry,
    M2NMesh,
    ManifestM2NWeightSource,
    ParamMeta,
    Replicate,
    Shard,
    SourceLayout,
    layout_from_dtensor,
    layout_from_m2n,
    mesh_from_tensor,
    placements_from_tensor,
)


def test_plain_tensors_are_replicated_over_every_trainer_rank():
    t = torch.zeros(3, 2)
    assert mesh_from_tensor(t, 4) == (4,)
    assert placements_from_tensor(t) is None is REPLICATED
    assert layout_from_dtensor(t, 4) == SourceLayout((0, 1, 2, 3), (4,))
    with pytest.raises(ValueError, match="num_trainer_ranks must be >= 1"):
        mesh_from_tensor(t, 0)


def test_dtensor_module_source_over_a_plain_module():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    src = DTensorModuleSource(m, 3, rank=2)
    assert [(x.name, x.owners, x.placements) for x in src.metadata] == [
        ("0.weight", None, None), ("0.bias", None, None),
        ("1.weight", None, None), ("1.bias", None, None)]
    got = dict(src.iter_local())
    assert all(torch.equal(got[n], p) for n, p in m.named_parameters())
    assert not any(t.requires_grad for t in got.values())


@pytest.mark.parametrize("owners", [(True,), (0, False)])
def test_bool_owners_are_a_value_error(owners):
    with pytest.raises(ValueError, match="a bool is not a rank"):
        ParamMeta("w", torch.float32, (4,), owners=owners)


def test_m2n_layout_converts_to_source_layout():
    # (dp=2, tp=3) over ranks 4..9: axis 0 replicates, axis 1 shards dim 0
    lay = layout_from_m2n(M2NLayout(M2NMesh((2, 3), 4), (REPLICATE, 0)))
    assert lay == SourceLayout((4, 5, 6, 7, 8, 9), (2, 3), (Replicate(), Shard(0)))
    assert layout_from_m2n(M2NLayout(M2NMesh((3, 1)), REPLICATED)) == SourceLayout((0, 1, 2), (3, 1))
    assert M2NLayout(M2NMesh((2, 2)), (1, REPLICATE)).to_source_layout().placements == (
        Shard(1), Replicate())
    # vLLM's own M2NLayout (vLLM is not installed here) converts by its fields
    theirs = type("M2NLayout", (), {})()
    theirs.mesh, theirs.placements = SimpleNamespace(dims=(2, 2), start_rank=0), (-1, 1)
    assert layout_from_m2n(theirs) == SourceLayout((0, 1, 2, 3), (2, 2), (Replicate(), Shard(1)))
    with pytest.raises(TypeError, match="expected an M2NLayout"):
        layout_from_m2n(SimpleNamespace(mesh=theirs.mesh, placements=(-1, 1)))


@pytest.mark.parametrize("make,exc,match", [
    (lambda: M2NMesh((4,)), ValueError, "two positive ints"),
    (lambda: M2NMesh((2, 0)), ValueError, "two positive ints"),
    (lambda: M2NMesh((2, True)), ValueError, "two positive ints"),
    (lambda: M2NMesh((2, 2), -1), ValueError, "start_rank must be >= 0"),
    (lambda: M2NLayout((2, 2), REPLICATED), TypeError, "must be an M2NMesh"),
    (lambda: M2NLayout(M2NMesh((2, 2)), (REPLICATE, REPLICATE)), ValueError, "REPLICATED"),
    (lambda: M2NLayout(M2NMesh((2, 2)), (0, 1)), ValueError, "shard on both axes"),
    (lambda: M2NLayout(M2NMesh((2, 2)), (0,)), ValueError, "two int codes"),
    (lambda: M2NLayout(M2NMesh((2, 2)), (-2, 0)), ValueError, "code -2 is invalid"),
])
def test_m2n_layout_rules(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_manifest_entry_takes_the_seed_layout():
    full = torch.arange(24.0).reshape(6, 4)
    T = 4  # M2NMesh((2, 2)) over ranks 0..3, rows sharded over axis 1, axis 0 replicates

    def entry(rank):
        half = (rank % 2) * 3
        return M2NManifestEntry("w", torch.float32, (6, 4),
                                M2NLayout(M2NMesh((2, 2), 0), (REPLICATE, 0)),
                                lambda: full[half:half + 3])

    e = entry(0)
    assert isinstance(e.source_layout, SourceLayout)
    assert e.metadata == ParamMeta("w", torch.float32, (6, 4), (0, 1, 2, 3), (2, 2),
                                   (Replicate(), Shard(0)))
    for rank in range(T):
        (name, t), = ManifestM2NWeightSource([entry(rank)], rank=rank).iter_local()
        assert torch.equal(t, full[(rank % 2) * 3:(rank % 2) * 3 + 3])
    rep = M2NManifestEntry("b", torch.float32, (4,), M2NLayout(M2NMesh((T, 1)), REPLICATED),
                           lambda: full[0])
    assert rep.metadata.owners == (0, 1, 2, 3) and rep.metadata.placements is None
    with pytest.raises(ValueError, match="'w': Shard\\(3\\) is outside"):
        M2NManifestEntry("w", torch.float32, (6, 4), M2NLayout(M2NMesh((2, 2)), (REPLICATE, 3)),
                         lambda: full)
    with pytest.raises(TypeError, match="SourceLayout, PieceLayout or M2NLayout"):
        M2NManifestEntry("w", torch.float32, (6, 4), (REPLICATE, 0), lambda: full)
