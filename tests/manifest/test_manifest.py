"""Manifest entries and sources, layer-wise groups, manifest JSON/digest, contracts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import FrozenInstanceError, dataclass
from functools import cached_property

import pytest
import torch

from m2nkit.manifest import (
    SCHEMA_VERSION,
    M2NManifestEntry,
    M2NWeightSource,
    ManifestM2NWeightSource,
    ModuleSource,
    ParamMeta,
    Replicate,
    Shard,
    SourceLayout,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
    layerwise_groups,
    manifest_digest,
    manifest_from_json,
    manifest_to_json,
    materialize_full_tensor,
    owner_box,
)

# --------------------------------------------------------------------------
# M2NManifestEntry


def _entry(key="w", dtype=torch.float32, shape=(4, 6), layout=None, provider=None, **kw):
    layout = SourceLayout((0, 1), placements=(Shard(0),)) if layout is None else layout
    provider = (lambda: torch.zeros(2, 6)) if provider is None else provider
    return M2NManifestEntry(key, dtype, shape, layout, provider, **kw)


def test_entry_metadata_and_defaults():
    e = _entry(shape=[4, 6])
    assert e.global_shape == (4, 6)
    assert e.key == e.name == "w"  # the seed API's spelling still reads
    assert e.metadata == ParamMeta("w", torch.float32, (4, 6), (0, 1), (2,), (Shard(0),))
    with pytest.raises(FrozenInstanceError):
        e.name = "v"


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(key=""), ValueError, "non-empty"),
    (dict(dtype="float32"), TypeError, "not a torch.dtype"),
    (dict(dtype=float), TypeError, "not a torch.dtype"),
    (dict(layout=((0, 1), (2,))), TypeError, "must be a SourceLayout"),
    (dict(layout=ParamMeta("w", torch.float32, (4, 6))), TypeError, "must be a SourceLayout"),
    (dict(provider=torch.zeros(2, 6)), TypeError, "callable"),
    (dict(shape=(4, -1)), ValueError, "non-negative"),
    (dict(shape=(4, True)), ValueError, "non-negative"),
    (dict(shape=(6,), layout=SourceLayout((0, 1), placements=(Shard(1),))), ValueError,
     r"Shard\(1\) is outside its 1-D shape"),
])
def test_entry_validation_names_the_key(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        _entry(**kwargs)
    if kwargs.get("key", "w"):
        assert "'w'" in str(info.value)


# --------------------------------------------------------------------------
# ManifestM2NWeightSource


def _tracked(calls, k, tensor):
    def provider():
        calls.append(k)
        return tensor
    return provider


def test_manifest_source_is_lazy_one_at_a_time_and_reruns():
    calls: list[int] = []
    entries = [
        _entry(f"p{k}", shape=(3,), layout=SourceLayout(),
               provider=_tracked(calls, k, torch.full((3,), float(k))))
        for k in range(4)
    ]
    src = ManifestM2NWeightSource(entries, rank=0)
    assert [m.name for m in src.metadata] == ["p0", "p1", "p2", "p3"]
    assert calls == []  # neither construction nor metadata runs a provider
    it = src.iter_local()
    assert calls == []  # generators start lazily
    for k in range(4):
        name, t = next(it)
        # provider k ran only now, after entry k-1 was handed over
        assert calls == list(range(k + 1))
        assert name == f"p{k}" and torch.equal(t, torch.full((3,), float(k)))
    with pytest.raises(StopIteration):
        next(it)
    list(src.iter_local())  # every iteration calls every provider again
    assert calls == [0, 1, 2, 3, 0, 1, 2, 3]


def test_manifest_source_ownership_and_boxes():
    full = torch.arange(7 * 4, dtype=torch.float32).reshape(7, 4)
    lay = SourceLayout((1, 2, 3), placements=(Shard(0),))  # rows 0-2, 3-5, 6
    calls = []

    def entries_for(rank):
        box = owner_box(lay, (7, 4), rank)
        return [
            _entry("sharded", shape=(7, 4), layout=lay,
                   provider=_tracked(calls, "sharded", full[box[0][0]:box[0][1]] if box else None)),
            _entry("everyone", shape=(2,), layout=SourceLayout(),
                   provider=_tracked(calls, "everyone", torch.ones(2))),
            _entry("rank0", shape=(2,), layout=SourceLayout((0,)),
                   provider=_tracked(calls, "rank0", torch.ones(2))),
        ]

    src0 = ManifestM2NWeightSource(entries_for(0), rank=0)
    assert src0.owned_names() == ["everyone", "rank0"]
    assert src0.owned_names(3) == ["sharded", "everyone"]
    assert [n for n, _ in src0.iter_local()] == ["everyone", "rank0"]
    assert "sharded" not in calls  # providers of entries this rank does not own never run

    src3 = ManifestM2NWeightSource(entries_for(3), rank=3)
    got = dict(src3.iter_local())
    assert list(got) == ["sharded", "everyone"]
    assert torch.equal(got["sharded"], full[6:7])


def test_manifest_source_entries_are_immutable_and_ordered():
    es = [_entry(f"k{i}", shape=(2,), layout=SourceLayout()) for i in range(3)]
    source_list = list(es)
    src = ManifestM2NWeightSource(source_list, rank=0)
    source_list.reverse()  # the caller's list changing does not change the source
    assert isinstance(src.entries, tuple)
    assert [e.key for e in src.entries] == ["k0", "k1", "k2"]
    assert src.metadata is src.metadata  # cached


def test_manifest_source_rejects_duplicates_and_non_entries():
    with pytest.raises(ValueError, match="'dup' appears more than once"):
        ManifestM2NWeightSource([_entry("dup"), _entry("x"), _entry("dup")], rank=0)
    with pytest.raises(TypeError, match="entry 1 must be an M2NManifestEntry"):
        ManifestM2NWeightSource([_entry("a"), ParamMeta("b", torch.float32, (2,))], rank=0)


def test_manifest_source_checks_local_shape_and_dtype():
    lay = SourceLayout((0, 1), placements=(Shard(0),))
    # 5 rows over 2 ranks: rank 0 holds rows 0..2 (3 rows), rank 1 rows 3..4 (2 rows)
    ok = ManifestM2NWeightSource(
        [_entry("w", shape=(5, 6), layout=lay, provider=lambda: torch.zeros(2, 6))], rank=1)
    assert [tuple(t.shape) for _, t in ok.iter_local()] == [(2, 6)]

    src = ManifestM2NWeightSource(
        [_entry("w", shape=(5, 6), layout=lay, provider=lambda: torch.zeros(2, 6))], rank=0)
    with pytest.raises(ValueError) as info:
        list(src.iter_local())
    msg = str(info.value)
    assert "'w'" in msg and "rank 0" in msg and "(2, 6)" in msg and "expected (3, 6)" in msg

    wrong_dtype = ManifestM2NWeightSource(
        [_entry("w", shape=(4, 6), layout=lay, provider=lambda: torch.zeros(2, 6,
                                                                         dtype=torch.bfloat16))],
        rank=0)
    with pytest.raises(ValueError, match=r"'w' on rank 0: local tensor has dtype "
                                         r"torch.bfloat16, expected torch.float32"):
        list(wrong_dtype.iter_local())


def test_manifest_source_is_m2n_only():
    src = ManifestM2NWeightSource([_entry()], rank=0)
    assert src.implements_iter_local() is True
    assert src.implements_iter_full() is False
    with pytest.raises(NotImplementedError, match="local shards"):
        next(iter(src.iter_full()))


def test_rank_defaults_and_validation():
    assert ManifestM2NWeightSource([]).rank == 0  # no process group here
    with pytest.raises(ValueError, match="rank must be >= 0"):
        ManifestM2NWeightSource([], rank=-1)
    with pytest.raises(TypeError, match="rank must be an int"):
        ManifestM2NWeightSource([], rank=True)


# --------------------------------------------------------------------------
# WeightSource contract


def test_metadata_must_be_cached_property():
    with pytest.raises(TypeError, match="MethodSource.metadata must be a functools.cached_property"):
        class MethodSource(WeightSource):
            def metadata(self):
                return []

    with pytest.raises(TypeError, match="PropSource.metadata must be a functools.cached_property"):
        class PropSource(WeightSource):
            @property
            def metadata(self):
                return []

    with pytest.raises(TypeError, match="ListSource.metadata"):
        class ListSource(WeightSource):
            metadata = []


def test_weight_source_is_abstract_until_metadata_defined():
    class NoMeta(WeightSource):
        pass

    with pytest.raises(TypeError, match="abstract"):
        NoMeta()

    class Local(M2NWeightSource):
        @cached_property
        def metadata(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Local()  # iter_local is abstract on M2NWeightSource


def test_m2n_source_may_not_override_iter_full():
    with pytest.raises(TypeError, match="Gathering.*local shards only"):
        class Gathering(M2NWeightSource):
            @cached_property
            def metadata(self):
                return []

            def iter_local(self):
                yield from ()

            def iter_full(self):
                yield from ()


class _Counting(WeightSource):
    """A minimal source: metadata counts its evaluations."""

    def __init__(self, metas, **kw):
        super().__init__(**kw)
        self._metas = metas
        self.evaluations = 0

    @cached_property
    def metadata(self):
        self.evaluations += 1
        return list(self._metas)

    def iter_full(self):
        for name in self.owned_names():
            yield name, torch.zeros(1)


def test_owned_names_and_implements_flags():
    metas = [
        ParamMeta("all", torch.float32, (2,)),
        ParamMeta("r1", torch.float32, (2,), owners=(1,)),
        ParamMeta("r02", torch.float32, (4,), owners=(0, 2), placements=(Shard(0),)),
    ]
    src = _Counting(metas, rank=2)
    assert src.owned_names() == ["all", "r02"]
    assert src.owned_names(1) == ["all", "r1"]
    assert src.owned_names(7) == ["all"]
    assert [n for n, _ in src.iter_full()] == ["all", "r02"]
    assert src.evaluations == 1  # cached across calls
    assert _Counting.implements_iter_full() and not _Counting.implements_iter_local()
    with pytest.raises(NotImplementedError, match="iter_local"):
        next(iter(src.iter_local()))


def test_materialize_full_tensor_plain_and_duck():
    t = torch.ones(3)
    assert materialize_full_tensor(t) is t

    class Sharded:
        def full_tensor(self):
            return torch.arange(4)

    assert torch.equal(materialize_full_tensor(Sharded()), torch.arange(4))


def test_module_source_plain_module():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    src = ModuleSource(m, rank=5)
    names = [n for n, _ in m.named_parameters()]
    assert [x.name for x in src.metadata] == names
    assert all(x.owners is None for x in src.metadata)
    assert [x.shape for x in src.metadata] == [tuple(p.shape) for p in m.parameters()]
    assert src.owned_names() == names
    for (n, t), (n2, p) in zip(src.iter_local(), m.named_parameters()):
        assert n == n2 and torch.equal(t, p) and not t.requires_grad
    assert [n for n, _ in src.iter_full()] == names


# --------------------------------------------------------------------------
# layerwise_groups (docs/reference.md §1)


def test_groups_pre_layers_post():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert layerwise_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"],
        ["model.layers.1.self_attn.q_proj.weight"],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_groups_key_on_outermost_index():
    names = [
        "model.layers.3.mlp.experts.7.w1",
        "model.layers.3.mlp.experts.0.w1",
        "model.layers.3.mlp.gate.weight",
    ]
    assert layerwise_groups(names) == [names]


def test_groups_post_is_last_and_layers_sorted():
    # a pipeline source may stream its output block before its layers
    names = [
        "model.layers.2.a",
        "model.norm.weight",
        "model.layers.0.a",
        "lm_head.weight",
        "model.layers.1.a",
        "model.layers.0.b",
    ]
    assert layerwise_groups(names) == [
        ["model.layers.0.a", "model.layers.0.b"],
        ["model.layers.1.a"],
        ["model.layers.2.a"],
        ["model.norm.weight", "lm_head.weight"],
    ]


def test_groups_stacks_by_first_appearance_of_prefix_then_index():
    names = [
        "visual.blocks.1.w",
        "model.layers.1.w",
        "visual.blocks.0.w",
        "model.layers.0.w",
        "visual.merger.w",
    ]
    assert layerwise_groups(names) == [
        ["visual.blocks.0.w"],
        ["visual.blocks.1.w"],
        ["model.layers.0.w"],
        ["model.layers.1.w"],
        ["visual.merger.w"],
    ]


def test_groups_edge_cases():
    assert layerwise_groups([]) == []
    assert layerwise_groups(["a", "b"]) == [["a", "b"]]  # nothing indexed: all pre
    # "weight3" is not an index segment; only ASCII digits count
    assert layerwise_groups(["x.weight3", "x.\u00b2.y"]) == [["x.weight3", "x.\u00b2.y"]]
    with pytest.raises(TypeError, match="strings"):
        layerwise_groups(["a", 3])


# --------------------------------------------------------------------------
# manifest JSON and digest


METAS = [
    ParamMeta("model.embed_tokens.weight", torch.bfloat16, (10, 4), owners=(0, 1),
              placements=(Shard(0),)),
    ParamMeta("model.layers.0.w", torch.float32, (4, 6), owners=(0, 1, 2, 3),
              mesh_shape=(2, 2), placements=(Replicate(), Shard(1))),
    ParamMeta("model.norm.weight", torch.float32, (4,)),
    ParamMeta("router.bias", torch.float32, (3,), owners=(2, 3)),
]


def test_manifest_round_trip():
    doc = manifest_to_json(METAS, 4)
    assert doc["schema_version"] == SCHEMA_VERSION == 2
    assert doc["params"][0]["dtype"] == "bfloat16"
    text = json.dumps(doc)
    metas, t = manifest_from_json(json.loads(text))
    assert t == 4
    assert metas == METAS


def _digest_variants():
    base = list(METAS)
    m0, m1 = base[0], base[1]
    yield "name", [ParamMeta("model.embed.weight", m0.dtype, m0.shape, m0.owners,
                             m0.mesh_shape, m0.placements)] + base[1:], 4
    yield "dtype", [ParamMeta(m0.name, torch.float16, m0.shape, m0.owners,
                              m0.mesh_shape, m0.placements)] + base[1:], 4
    yield "shape", [ParamMeta(m0.name, m0.dtype, (11, 4), m0.owners,
                              m0.mesh_shape, m0.placements)] + base[1:], 4
    yield "owners", [ParamMeta(m0.name, m0.dtype, m0.shape, (1, 0),
                               m0.mesh_shape, m0.placements)] + base[1:], 4
    yield "mesh", [m0, ParamMeta(m1.name, m1.dtype, m1.shape, m1.owners, (4, 1),
                                 (Replicate(), Shard(1)))] + base[2:], 4
    yield "placement", [m0, ParamMeta(m1.name, m1.dtype, m1.shape, m1.owners, (2, 2),
                                      (Shard(0), Shard(1)))] + base[2:], 4
    yield "order", [base[1], base[0]] + base[2:], 4
    yield "ranks", base, 5


def test_digest_changes_with_every_field():
    ref = manifest_digest(METAS, 4)
    assert len(ref) == 64 and int(ref, 16) >= 0
    seen = {ref}
    for what, metas, t in _digest_variants():
        d = manifest_digest(metas, t)
        assert d != ref, what
        seen.add(d)
    assert len(seen) == 9  # all variants differ from each other too


def test_digest_equal_for_equal_manifests_and_normalised_forms():
    again = [ParamMeta(m.name, m.dtype, list(m.shape), m.owners, m.mesh_shape, m.placements)
             for m in METAS]
    assert manifest_digest(again, 4) == manifest_digest(METAS, 4)
    # explicit default mesh and all-Replicate placements normalise away
    a = [ParamMeta("x", torch.float32, (2,), owners=(0, 1))]
    b = [ParamMeta("x", torch.float32, (2,), owners=(0, 1), mesh_shape=(2,),
                   placements=(Replicate(),))]
    assert manifest_digest(a, 2) == manifest_digest(b, 2)


def test_digest_is_stable_across_processes():
    code = (
        "import torch\n"
        "from m2nkit.manifest import ParamMeta, Shard, manifest_digest\n"
        "m = [ParamMeta('a', torch.bfloat16, (4, 2), owners=(0, 1), placements=(Shard(0),)),"
        " ParamMeta('b', torch.float32, (3,))]\n"
        "print(manifest_digest(m, 2))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    here = manifest_digest(
        [ParamMeta("a", torch.bfloat16, (4, 2), owners=(0, 1), placements=(Shard(0),)),
         ParamMeta("b", torch.float32, (3,))], 2)
    assert out == here
    # pinned: the canonical text of this manifest is fixed by the format
    import hashlib
    text = ('{"num_trainer_ranks":2,"params":[{"dtype":"bfloat16","mesh_shape":[2],'
            '"name":"a","owners":[0,1],"placements":[{"shard":0}],"shape":[4,2]},'
            '{"dtype":"float32","mesh_shape":null,"name":"b","owners":null,'
            '"placements":null,"shape":[3]}],"schema_version":2}')
    assert here == hashlib.sha256(text.encode()).hexdigest()


def _doc():
    return json.loads(json.dumps(manifest_to_json(METAS, 4)))


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(schema_version=3), "schema_version 3"),
    (lambda d: d.pop("schema_version"), "schema_version None"),
    (lambda d: d.update(num_trainer_ranks=0), "num_trainer_ranks"),
    (lambda d: d.update(params={}), "params must be a list"),
    (lambda d: d["params"][1].update(dtype="bfloat17"), r"entry 1 \('model.layers.0.w'\)"),
    (lambda d: d["params"][2].pop("shape"), r"entry 2 \('model.norm.weight'\).*missing"),
    (lambda d: d["params"][2].update(colour="red"), "unknown keys"),
    (lambda d: d["params"][0].update(placements=[{"shard": 5}]), r"entry 0 .*Shard\(5\)"),
    (lambda d: d["params"][0].update(placements=[{"partial": "sum"}]), "entry 0"),
    (lambda d: d["params"][0].update(owners=[0, 9]), r"entry 0 .*not trainer ranks"),
    (lambda d: d["params"][3].update(owners=[2, 2]), r"entry 3 .*distinct"),
    (lambda d: d["params"][3].update(shape="3"), r"entry 3 .*shape"),
    (lambda d: d["params"][3].update(name="model.norm.weight"), "more than once"),
    (lambda d: d["params"].append(7), "entry 4 must be an object"),
])
def test_manifest_from_json_rejects(mutate, match):
    d = _doc()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        manifest_from_json(d)


def test_manifest_to_json_rejects():
    with pytest.raises(ValueError, match="not trainer ranks"):
        manifest_to_json(METAS, 3)  # layer 0 is owned by rank 3
    with pytest.raises(ValueError, match="'model.norm.weight' appears more than once"):
        manifest_to_json(METAS + [METAS[2]], 4)
    with pytest.raises(TypeError, match="entry 0 must be a ParamMeta"):
        manifest_to_json([{"name": "x"}], 4)


# --------------------------------------------------------------------------
# protocol


@dataclass
class _P2PInit(TrainerInitInfo):
    backend = "test_p2p"
    address: str = "127.0.0.1"


def test_trainer_init_info():
    assert _P2PInit(rank=0).is_sender is True
    assert _P2PInit("h", rank=3).is_sender is False
    assert _P2PInit.backend == "test_p2p"
    with pytest.raises(TypeError):
        _P2PInit("h", 0)  # rank is keyword-only
    with pytest.raises(ValueError, match="rank must be >= 0"):
        _P2PInit(rank=-1)
    with pytest.raises(TypeError, match="rank must be an int"):
        _P2PInit(rank=False)
    with pytest.raises(TypeError, match="NoBackend must set a class-level `backend`"):
        @dataclass
        class NoBackend(TrainerInitInfo):
            pass


@dataclass
class _Init(WeightTransferInitInfo):
    address: str
    world_size: int


@dataclass
class _Update(WeightTransferUpdateInfo):
    names: list


class _Receiver(WeightTransferEngine[_Init, _Update]):
    init_info_cls = _Init
    update_info_cls = _Update

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.received = []

    def init_transfer_engine(self, init_info):
        self.init = init_info

    def start_weight_update(self):
        pass

    def receive_weights(self, update_info):
        self.received.append(update_info)

    def finish_weight_update(self, weight_version=None):
        self.version = weight_version

    def shutdown(self):
        pass


def test_worker_engine_parse_converts_type_error():
    eng = _Receiver(model="model-a", model_config="cfg-a")
    assert eng.parse_init_info({"address": "x", "world_size": 2}) == _Init("x", 2)
    with pytest.raises(ValueError, match="invalid init_info for _Receiver") as info:
        eng.parse_init_info({"address": "x"})  # missing key
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(ValueError, match="invalid init_info"):
        eng.parse_init_info({"address": "x", "world_size": 2, "extra": 1})
    with pytest.raises(ValueError, match="invalid update_info for _Receiver"):
        eng.parse_update_info({"nam": []})
    eng.update_weights({"names": ["a"]})
    eng.update_weights([{"names": ["b"]}, {"names": ["c"]}])
    assert eng.received == [_Update(["a"]), _Update(["b"]), _Update(["c"])]
    with pytest.raises(ValueError, match="invalid update_info"):
        eng.update_weights({"bogus": 1})
    assert eng.defers_processing is False
    eng.drain_pending()  # no-op, callable


def test_worker_engine_target_switch():
    eng = _Receiver(model="model-a", model_config="cfg-a")
    eng.set_weight_update_target("draft", "draft-cfg")
    assert (eng.model, eng.model_config) == ("draft", "draft-cfg")
    eng.reset_weight_update_target()
    assert (eng.model, eng.model_config) == ("model-a", "cfg-a")


def test_engines_are_abstract():
    with pytest.raises(TypeError, match="abstract"):
        WeightTransferEngine()

    class Partial(WeightTransferEngine):
        def init_transfer_engine(self, init_info): ...

    with pytest.raises(TypeError, match="receive_weights"):
        Partial()
    with pytest.raises(TypeError, match="abstract"):
        TrainerWeightTransferEngine(client=None)

    class NoSend(TrainerWeightTransferEngine):
        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            return cls(client=client, source=source, is_sender=init_info.is_sender)

    with pytest.raises(TypeError, match="send_weights"):
        NoSend.trainer_init(_P2PInit(rank=0), client=None)

    class Full(NoSend):
        def send_weights(self):
            return "sent"

    eng = Full.trainer_init(_P2PInit(rank=2), client="c")
    assert eng.is_sender is False and eng.client == "c" and eng.send_weights() == "sent"
    eng.shutdown()


def test_sync_client_protocol_is_structural():
    class Client:
        def init_weight_transfer_engine(self, init_info): ...
        def start_weight_update(self): ...
        def update_weights(self, update_info): ...
        def finish_weight_update(self, weight_version=None): ...

    class MissingFinish:
        def init_weight_transfer_engine(self, init_info): ...
        def start_weight_update(self): ...
        def update_weights(self, update_info): ...

    assert isinstance(Client(), VLLMWeightSyncClient)
    assert not isinstance(MissingFinish(), VLLMWeightSyncClient)


def test_requests():
    assert WeightTransferInitRequest().init_info == {}
    assert WeightTransferUpdateRequest([{"a": 1}]).update_info == [{"a": 1}]
    with pytest.raises(TypeError, match="init_info must be a dict"):
        WeightTransferInitRequest([1])
    with pytest.raises(TypeError, match="update_info must be a dict or a list of dicts"):
        WeightTransferUpdateRequest([1])
