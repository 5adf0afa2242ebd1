"""HF safetensors checkpoints as wire tensors.

References are computed here independently of ``hf_checkpoint``/``experts``:
tensors loaded whole with ``safetensors.torch.load_file`` and experts
stacked with ``torch.stack``/``torch.cat``, and transformers' own loader
(``from_pretrained``, which fuses experts in memory).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections import defaultdict
from pathlib import Path

from _paths import REPO
import pytest
import torch
from safetensors import safe_open as real_safe_open
from safetensors.torch import load_file, save_file

from m2nkit.adapters import hf_checkpoint
from m2nkit.adapters.families import ARCHITECTURES
from m2nkit.adapters.hf_checkpoint import (
    CheckpointError,
    checkpoint_manifest,
    checkpoint_metas,
    full_checkpoint_tensors,
    read_checkpoint,
)
from m2nkit.adapters.trainer_spec import parse_trainer_spec

MODELS = REPO / "examples" / "configs"  # real public configs, shipped
EXAMPLE = REPO / "examples" / "tiny-qwen3-moe"

ALL = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe",
       "tiny-mixtral", "tiny-gemma2", "tiny-gemma3"]  # tiny-gpt-oss: tests/adapters/test_gpt_oss.py
MOE = ["tiny-qwen3-moe", "tiny-mixtral"]
# Gated DeltaNet families (families/qwen3_next.py, qwen3_5.py, qwen3_5_moe.py)
ALL += ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]


# --------------------------------------------------------------------------
# independent references


_EXPERT_RE = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
         "down_proj": "down", "w2": "down"}


def disk_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def reference_wire(disk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On-disk tensors with per-expert ones stacked: gate_up[e] = cat(gate_e, up_e)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict] = defaultdict(dict)
    for name, t in disk.items():
        m = _EXPERT_RE.match(name)
        if m:
            experts[m["prefix"]][(int(m["e"]), _ROLE[m["proj"]])] = t
        else:
            out[name] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.experts.gate_up_proj.weight"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0) for e in range(n)])
        out[f"{prefix}.experts.down_proj.weight"] = torch.stack(
            [parts[(e, "down")] for e in range(n)])
    return out


def sl(box):
    return tuple(slice(a, b) for a, b in box)


def chunk_reference(spec, full: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank's piece by torch.chunk on dim 0 (FSDP2's rule), without layout.py."""
    if spec.kind == "replicated" or full.dim() == 0:
        return full
    shards = spec.mesh_shape[-1]
    chunks = torch.chunk(full, shards, dim=0)
    index = rank % shards
    return chunks[index] if index < len(chunks) else full[full.shape[0]:]


def copy_ckpt(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def rewrite(file: Path, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


# --------------------------------------------------------------------------
# wire tensors


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("model", ALL)
def test_wire_tensors_equal_the_files(tiny_checkpoints, model, sharded):
    d = tiny_checkpoints(model, sharded=sharded)
    ckpt = read_checkpoint(d)
    disk = disk_tensors(d)
    ref = reference_wire(disk)
    assert {p.name: (p.shape, p.dtype) for p in ckpt.params} == {
        n: (tuple(t.shape), t.dtype) for n, t in ref.items()}
    assert len(ckpt.params) == len(ref)
    for name, want in ref.items():
        got = ckpt.read_full(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    full = full_checkpoint_tensors(ckpt)
    assert full.keys() == disk.keys()
    assert all(torch.equal(full[n], disk[n]) for n in disk)
    assert ckpt.files == tuple(sorted(d.glob("*.safetensors")))
    assert ckpt.has_data and ckpt.dtype == torch.bfloat16
    if sharded:
        assert len(ckpt.files) > 1
        single = read_checkpoint(tiny_checkpoints(model))
        assert ckpt.params == single.params  # same wire order from either layout
    if model in MOE:
        assert any(".experts.gate_up_proj.weight" in n for n in ckpt.names)
        assert not any(re.search(r"\.experts\.\d+\.", n) for n in ckpt.names)


def _to_memory_name(wire: str) -> str:
    """Wire name -> transformers 5 in-memory name (stated here, not taken from the families)."""
    name = wire.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(gate_up_proj|down_proj)\.weight$", r".experts.\1", name)


@pytest.mark.parametrize("model", ALL)
def test_wire_order_and_fused_values_match_transformers_loader(tiny_checkpoints, model):
    """transformers' own loader fuses experts; wire tensors equal its parameters, in order."""
    from transformers import AutoModelForCausalLM

    d = tiny_checkpoints(model)
    ckpt = read_checkpoint(d)
    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    assert [_to_memory_name(n) for n in ckpt.names] == list(params)
    for name in ckpt.names:
        assert torch.equal(ckpt.read_full(name), params[_to_memory_name(name)].detach()), name


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("model", MOE + ["tiny-qwen2"])
def test_read_box_equals_slice_of_reference(tiny_checkpoints, model, sharded):
    d = tiny_checkpoints(model, sharded=sharded)
    ckpt = read_checkpoint(d)
    ref = reference_wire(disk_tensors(d))
    rng = random.Random(f"{model}-{sharded}")
    boxes_checked = 0
    for p in ckpt.params:
        boxes = []
        for _ in range(6):
            box = []
            for n in p.shape:
                a = rng.randrange(n + 1)
                b = rng.randrange(a, n + 1)
                box.append((a, b))
            boxes.append(tuple(box))
        if len(p.shape) == 3:  # stacked experts: rows across the gate/up boundary
            e, rows, cols = p.shape
            half = rows // 2
            boxes += [((1, 3), (half - 3, half + 2), (5, cols - 1)),
                      ((0, e), (half, rows), (0, cols)),
                      ((e - 1, e), (0, 1), (cols - 1, cols)),
                      ((2, 2), (0, rows), (0, cols))]
        for box in boxes:
            got = ckpt.read_box(p.name, box)
            want = ref[p.name][sl(box)]
            assert got.shape == want.shape and torch.equal(got, want), (p.name, box)
            boxes_checked += 1
    assert boxes_checked >= 6 * len(ckpt.params)


# --------------------------------------------------------------------------
# what is read, and when


class _Log:
    def __init__(self):
        self.opens: list[str] = []
        self.reads: list[tuple] = []


class _SpySlice:
    def __init__(self, real, name, log):
        self._real, self._name, self._log = real, name, log

    def get_shape(self):
        return self._real.get_shape()

    def get_dtype(self):
        return self._real.get_dtype()

    def __getitem__(self, index):
        self._log.reads.append(("slice", self._name, index))
        return self._real[index]


class _SpyHandle:
    def __init__(self, real, log):
        self._real, self._log = real, log

    def keys(self):
        return self._real.keys()

    def metadata(self):
        return self._real.metadata()

    def get_slice(self, name):
        return _SpySlice(self._real.get_slice(name), name, self._log)

    def get_tensor(self, name):
        self._log.reads.append(("tensor", name, None))
        return self._real.get_tensor(name)


@pytest.fixture
def spy(monkeypatch):
    """Wrap the real ``safe_open`` used by hf_checkpoint and log every data access."""
    log = _Log()

    def opener(filename, framework, device="cpu"):
        log.opens.append(str(filename))
        return _SpyHandle(real_safe_open(filename, framework=framework, device=device), log)

    monkeypatch.setattr(hf_checkpoint.files, "safe_open", opener)  # where open_safetensors looks it up
    return log


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen3"])
def test_planning_reads_no_tensor_data_and_opens_each_file_once(tiny_checkpoints, spy, model):
    d = tiny_checkpoints(model, sharded=True)
    ckpt = read_checkpoint(d)
    metas = checkpoint_metas(ckpt, "fsdp:3")
    sources = [checkpoint_manifest(ckpt, "fsdp:3", r) for r in range(3)]
    assert len(metas) == len(ckpt.params) > 0
    assert spy.reads == []  # headers only: no get_tensor, no slice read
    files = sorted(str(f) for f in d.glob("*.safetensors"))
    assert sorted(spy.opens) == files
    pieces = 0
    for src in sources:
        for _name, t in src.iter_local():
            pieces += t.numel() > 0
    assert pieces > 0 and len(spy.reads) > 0  # the spy does see reads
    assert all(kind == "slice" for kind, _, _ in spy.reads)  # never a whole get_tensor
    assert sorted(spy.opens) == files  # handles cached per Checkpoint, not reopened


def test_read_box_reads_only_the_needed_expert_rows(tiny_checkpoints, spy):
    ckpt = read_checkpoint(tiny_checkpoints("tiny-qwen3-moe", sharded=True))
    name = "model.layers.1.mlp.experts.gate_up_proj.weight"
    e, rows, cols = ckpt.meta(name).shape
    im = rows // 2
    spy.reads.clear()
    ckpt.read_box(name, ((2, 4), (im + 1, im + 5), (3, 10)))  # up rows only
    assert [(n, idx) for _, n, idx in spy.reads] == [
        (f"model.layers.1.mlp.experts.{x}.up_proj.weight", (slice(1, 5), slice(3, 10)))
        for x in (2, 3)]
    spy.reads.clear()
    ckpt.read_box(name, ((5, 6), (im - 2, im + 1), (0, cols)))  # gate tail + up head
    assert [(n, idx) for _, n, idx in spy.reads] == [
        ("model.layers.1.mlp.experts.5.gate_proj.weight", (slice(im - 2, im), slice(0, cols))),
        ("model.layers.1.mlp.experts.5.up_proj.weight", (slice(0, 1), slice(0, cols)))]
    spy.reads.clear()
    empty = ckpt.read_box(name, ((3, 3), (0, rows), (0, cols)))
    assert empty.shape == (0, rows, cols) and spy.reads == []


# --------------------------------------------------------------------------
# config-only


@pytest.mark.parametrize("model", ALL)
def test_config_only_gives_the_same_metas(tiny_checkpoints, tmp_path, model):
    d = tiny_checkpoints(model)
    ckpt = read_checkpoint(d)
    only = tmp_path / "only-config"
    only.mkdir()
    shutil.copy(d / "config.json", only / "config.json")
    for path in (d / "config.json", only):
        cfg = read_checkpoint(path)
        assert not cfg.has_data and cfg.files == ()
        assert cfg.params == ckpt.params
        assert cfg.architecture == ckpt.architecture and cfg.dtype == ckpt.dtype
        assert checkpoint_metas(cfg, "hsdp:2,3") == checkpoint_metas(ckpt, "hsdp:2,3")
        # the naming table predicts exactly the on-disk tensors
        assert [cfg.disk_names(n) for n in cfg.names] == [ckpt.disk_names(n) for n in ckpt.names]
        with pytest.raises(CheckpointError, match="config-only"):
            cfg.read_box(cfg.names[0], tuple((0, 1) for _ in cfg.params[0].shape))
    assert sorted(n for w in ckpt.names for n in ckpt.disk_names(w)) == sorted(disk_tensors(d))


def _real_config(model: str) -> Path:
    path = MODELS / model / "config.json"
    assert path.is_file(), f"{path} is shipped with the repository"
    return path


def test_real_size_qwen3_30b_a3b_config_only():
    # (speed is benchmarks/plan_scale.py's business, not an assertion here)
    ckpt = read_checkpoint(_real_config("Qwen__Qwen3-30B-A3B"))
    metas = checkpoint_metas(ckpt, "fsdp:256")
    shapes = {p.name: p.shape for p in ckpt.params}
    assert len(shapes) == 48 * 11 + 3
    assert shapes["model.layers.0.mlp.experts.gate_up_proj.weight"] == (128, 1536, 2048)
    assert shapes["model.layers.47.mlp.experts.down_proj.weight"] == (128, 2048, 768)
    assert shapes["model.layers.5.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (151936, 2048)
    assert ckpt.names[-1] == "lm_head.weight" and ckpt.dtype == torch.bfloat16
    assert sum(m.nbytes for m in metas) == 2 * 30_532_122_624  # 30.5B bf16 parameters
    assert len(ckpt.disk_names("model.layers.3.mlp.experts.gate_up_proj.weight")) == 256


def test_real_size_mixtral_config_only_matches_published_index():
    path = _real_config("mistralai__Mixtral-8x7B-v0.1")
    ckpt = read_checkpoint(path)
    shapes = {p.name: p.shape for p in ckpt.params}
    assert shapes["model.layers.0.block_sparse_moe.experts.gate_up_proj.weight"] == (8, 28672, 4096)
    assert shapes["model.layers.31.block_sparse_moe.experts.down_proj.weight"] == (8, 4096, 14336)
    assert shapes["model.layers.0.block_sparse_moe.gate.weight"] == (8, 4096)
    assert shapes["model.layers.0.self_attn.v_proj.weight"] == (1024, 4096)
    # the published checkpoint's index: our names for every on-disk tensor are its names
    index = json.loads((path.parent / "model.safetensors.index.json").read_text())
    ours = [n for w in ckpt.names for n in ckpt.disk_names(w)]
    assert len(ours) == len(set(ours)) and set(ours) == set(index["weight_map"])
    assert sum(p.nbytes for p in ckpt.params) == index["metadata"]["total_size"]
    assert ckpt.disk_names("model.layers.2.block_sparse_moe.experts.gate_up_proj.weight")[:2] == (
        "model.layers.2.block_sparse_moe.experts.0.w1.weight",
        "model.layers.2.block_sparse_moe.experts.0.w3.weight")


# --------------------------------------------------------------------------
# trainer layouts


@pytest.mark.parametrize("spec_text", ["fsdp:3", "fsdp:5", "fsdp:7", "hsdp:2,3", "replicated:2"])
@pytest.mark.parametrize("model, sharded", [("tiny-qwen3-moe", True), ("tiny-mixtral", False),
                                            ("tiny-qwen2", True)])
def test_provider_returns_exactly_the_rank_box(tiny_checkpoints, model, sharded, spec_text):
    d = tiny_checkpoints(model, sharded=sharded)
    ckpt = read_checkpoint(d)
    ref = reference_wire(disk_tensors(d))
    spec = parse_trainer_spec(spec_text)
    metas = checkpoint_metas(ckpt, spec)
    empty_pieces = 0
    for rank in range(spec.num_ranks):
        src = checkpoint_manifest(ckpt, spec_text, rank)
        assert src.metadata == metas
        got = list(src.iter_local())
        assert [n for n, _ in got] == ckpt.names
        for name, t in got:
            want = chunk_reference(spec, ref[name], rank)
            assert t.dtype == want.dtype and t.shape == want.shape, (name, rank)
            assert torch.equal(t, want), (spec_text, rank, name)
            empty_pieces += t.numel() == 0
    if spec_text == "fsdp:7" and model in MOE:  # 8 experts over 7 ranks: chunks of 2, ranks 4..6 hold none
        assert empty_pieces > 0


def test_manifest_rejects_rank_outside_spec(tiny_checkpoints):
    ckpt = read_checkpoint(tiny_checkpoints("tiny-llama"))
    with pytest.raises(ValueError, match=r"trainer rank 4 .* valid ranks are 0\.\.3"):
        checkpoint_manifest(ckpt, "hsdp:2,2", 4)


# --------------------------------------------------------------------------
# the shipped example


def test_shipped_example_is_the_tiny_qwen3_moe(tiny_checkpoints):
    files = sorted(p.name for p in EXAMPLE.iterdir())
    assert "model.safetensors" in files and "config.json" in files
    assert "generation_config.json" not in files
    assert sum(p.stat().st_size for p in EXAMPLE.iterdir()) < 1_000_000
    ckpt = read_checkpoint(EXAMPLE)
    fresh = read_checkpoint(tiny_checkpoints("tiny-qwen3-moe"))
    assert ckpt.architecture == "Qwen3MoeForCausalLM"
    assert ckpt.params == fresh.params
    norm = ckpt.read_full("model.norm.weight")
    assert not torch.equal(norm, torch.ones_like(norm))  # randomised, so misplacement shows


# --------------------------------------------------------------------------
# errors


def _raises(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    msg = str(info.value)
    for f in fragments:
        assert str(f) in msg, (f, msg)
    return msg


def test_error_path_missing(tmp_path):
    _raises(tmp_path / "nope", "checkpoint path", tmp_path / "nope", "does not exist")


def test_error_nothing_to_read(tmp_path):
    (tmp_path / "README.md").write_text("x")
    _raises(tmp_path, "holds no model.safetensors, model.safetensors.index.json or config.json",
            "README.md")


def test_error_not_a_directory_or_config(tiny_checkpoints):
    f = tiny_checkpoints("tiny-llama") / "model.safetensors"
    _raises(f, str(f), "is a file; pass a checkpoint directory")


def test_error_safetensors_without_config(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-llama"), tmp_path)
    (d / "config.json").unlink()
    _raises(d, d / "config.json", "does not exist", "needs the model's config.json")


@pytest.mark.parametrize("damage, reason", [
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "invalid header length"),
    (lambda f: f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a json head!"), "invalid JSON"),
    (lambda f: f.write_bytes(b"\x01\x02"), "header too small"),
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "file not fully covered"),
], ids=["truncated-header", "garbage-header", "tiny-file", "truncated-data"])
def test_error_corrupt_safetensors_names_the_file(tiny_checkpoints, tmp_path, damage, reason):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    damage(d / "model.safetensors")
    _raises(d, "cannot read safetensors file", d / "model.safetensors", reason)


def test_error_corrupt_shard_names_the_shard(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe", sharded=True), tmp_path)
    shard = shard_of(d, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:50])
    _raises(d, "cannot read safetensors file", shard)


def test_error_missing_shard_names_index_and_shard(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe", sharded=True), tmp_path)
    shard = shard_of(d, "model.norm.weight")
    shard.unlink()
    _raises(d, d / "model.safetensors.index.json", f"names shard '{shard.name}'", shard,
            "does not exist")


def test_error_index_lists_tensor_missing_from_its_shard(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-llama", sharded=True), tmp_path)
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"]["model.norm.weight"]
    data["weight_map"]["model.layers.0.mlp.bogus.weight"] = shard
    index.write_text(json.dumps(data))
    _raises(d, "lists tensor 'model.layers.0.mlp.bogus.weight'", f"in shard '{shard}'",
            d / shard, "does not contain it")


def test_error_shard_holds_tensor_the_index_does_not_list(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-llama", sharded=True), tmp_path)
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"].pop("model.norm.weight")
    index.write_text(json.dumps(data))
    _raises(d, d / shard, "holds tensor 'model.norm.weight'", "the index and the shards disagree")


def test_error_unreadable_index(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-llama", sharded=True), tmp_path)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    _raises(d, "cannot read", d / "model.safetensors.index.json", "weight_map")


def test_error_an_architecture_transformers_lacks_lists_the_tables(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _raises(d, d / "config.json")
    import transformers

    assert msg == (f"{d / 'config.json'}: architecture 'FooForCausalLM': transformers "
                   f"{transformers.__version__} has no such model class and m2nkit has no table "
                   "for it; tables: " + ", ".join(sorted(ARCHITECTURES)))


@pytest.mark.parametrize("arch,model_type", [
    ("PhiForCausalLM", "phi"),                      # known to transformers, no family
    ("GPT2LMHeadModel", "gpt2"),                    # dense, known to transformers, no family
])
def test_an_architecture_without_a_table_is_read_as_transformers_builds_it(arch, model_type,
                                                                           tmp_path):
    """No table: the wire tensors are transformers' own (names, shapes, dtypes, data),
    loaded by from_pretrained; checked against safetensors' own read of the files."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=96, hidden_size=32, n_embd=32, num_hidden_layers=2, n_layer=2,
        num_attention_heads=4, n_head=4, intermediate_size=64, architectures=[arch])
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ckpt = read_checkpoint(tmp_path)
    assert ckpt.architecture == arch and ckpt.has_data
    names = [n for n, _ in model.named_parameters()]
    assert ckpt.names[:len(names)] == names
    for name in ckpt.names:
        got = ckpt.read_full(name)
        assert torch.equal(got, on_disk[name]), name      # these two save names as held
        box = tuple((0, max(1, n // 2)) for n in got.shape)
        assert torch.equal(ckpt.read_box(name, box), got[tuple(slice(a, b) for a, b in box)])
    config_only = read_checkpoint(tmp_path / "config.json")
    assert not config_only.has_data
    assert [(p.name, p.shape, p.dtype) for p in config_only.params] == \
        [(p.name, p.shape, p.dtype) for p in ckpt.params]


def test_error_unknown_model_type(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "not_a_model_type"
    (d / "config.json").write_text(json.dumps(cfg))
    _raises(d, "is not built into transformers", d / "config.json", "not_a_model_type")


def test_error_bad_config_value_is_one_line(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = "128"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(d)
    assert "\n" not in str(e.value) and "hidden_size" in str(e.value)


def test_error_architectures_not_a_list(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = "Qwen3ForCausalLM"
    (d / "config.json").write_text(json.dumps(cfg))
    _raises(d, "'architectures' must be a list")


def test_error_architecture_contradicts_model_type(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    _raises(d, "architectures says LlamaForCausalLM", "builds Qwen3ForCausalLM")


def test_error_wrong_shape_names_tensor_got_and_expected(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    rewrite(d / "model.safetensors", lambda t: t.update({name: t[name].reshape(64, 256)}))
    _raises(d, f"tensor '{name}' in {d / 'model.safetensors'}", "has shape [64, 256]",
            "the config (Qwen3ForCausalLM) expects [128, 128]")


def test_error_wrong_expert_shape(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    rewrite(d / "model.safetensors", lambda t: t.update({name: t[name].reshape(16, 256)}))
    _raises(d, f"per-expert tensor '{name}' has shape [16, 256], expected [32, 128]",
            "model.layers.0.mlp.experts.gate_up_proj.weight' [8, 64, 128]")


def test_error_missing_tensor(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen2", sharded=True), tmp_path)
    shard = shard_of(d, "model.layers.1.self_attn.k_proj.bias")
    rewrite(shard, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    index.write_text(json.dumps(data))
    _raises(d, "lacks 1 tensor(s) the config (Qwen2ForCausalLM) expects",
            "'model.layers.1.self_attn.k_proj.bias'")


def test_error_extra_tensor(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-llama"), tmp_path)
    rewrite(d / "model.safetensors",
            lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    _raises(d, "holds 1 tensor(s) the config (LlamaForCausalLM) does not expect",
            "'model.layers.0.mlp.extra.weight'", d / "model.safetensors")


def test_tied_lm_head_in_files_is_kept_as_a_wire_tensor(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-tied"), tmp_path)
    without = read_checkpoint(d).names
    assert "lm_head.weight" not in without
    rewrite(d / "model.safetensors",
            lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    ckpt = read_checkpoint(d)
    assert ckpt.names == without + ["lm_head.weight"]
    assert torch.equal(ckpt.read_full("lm_head.weight"), ckpt.read_full("model.embed_tokens.weight"))
    assert "lm_head.weight" not in read_checkpoint(d / "config.json").names
    rewrite(d / "model.safetensors",
            lambda t: t.update({"lm_head.weight": torch.zeros(100, 128, dtype=torch.bfloat16)}))
    _raises(d, "tensor 'lm_head.weight'", "has shape [100, 128]", "expects [200, 128]")


@pytest.mark.parametrize("dtype, code", [(torch.float64, "F64"), (torch.bool, "BOOL"),
                                         (torch.int16, "I16")])
def test_error_unsupported_dtype(tiny_checkpoints, tmp_path, dtype, code):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite(d / "model.safetensors", lambda t: t.update({name: t[name].to(dtype)}))
    _raises(d, f"tensor '{name}' in {d / 'model.safetensors'} has dtype {code}",
            "supported dtypes: BF16, F16, F32, F8_E4M3, F8_E5M2, I8, U8, I32, I64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.float16])
def test_other_supported_dtypes_travel_as_stored(tiny_checkpoints, tmp_path, dtype):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3"), tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    rewrite(d / "model.safetensors", lambda t: t.update({name: t[name].to(dtype)}))
    ckpt = read_checkpoint(d)
    assert ckpt.meta(name).dtype == dtype and ckpt.dtype == torch.bfloat16
    want = load_file(d / "model.safetensors")[name][10:20, 3:7]
    got = ckpt.read_box(name, ((10, 20), (3, 7)))
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_error_expert_missing_a_part_qwen3_moe(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)
    rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.experts.3.gate_proj.weight"))
    _raises(d, "expert 3 of 8 is missing its gate tensor "
               "'model.layers.0.mlp.experts.3.gate_proj.weight'",
            "'model.layers.0.mlp.experts.gate_up_proj.weight'",
            "model.layers.0.mlp.experts.3.up_proj.weight")


def test_error_expert_missing_a_part_mixtral_sharded(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-mixtral", sharded=True), tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    rewrite(shard_of(d, name), lambda t: t.pop(name))
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][name]
    index.write_text(json.dumps(data))
    _raises(d, f"expert 5 of 8 is missing its up tensor '{name}'")


def test_error_extra_expert(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)
    rewrite(d / "model.safetensors", lambda t: t.update(
        {"model.layers.1.mlp.experts.8.down_proj.weight":
         t["model.layers.1.mlp.experts.7.down_proj.weight"].clone()}))
    _raises(d, "found expert 8 ('model.layers.1.mlp.experts.8.down_proj.weight')",
            "config has 8 experts (valid indices 0..7)")


def test_error_all_experts_of_a_block_missing(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)

    def drop(t):
        for n in [n for n in t if n.startswith("model.layers.1.mlp.experts.")]:
            del t[n]

    rewrite(d / "model.safetensors", drop)
    _raises(d, "lacks 2 tensor(s)", "'model.layers.1.mlp.experts.0.gate_proj.weight'",
            "'model.layers.1.mlp.experts.0.down_proj.weight'")


def test_error_experts_mixing_dtypes(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    rewrite(d / "model.safetensors", lambda t: t.update({name: t[name].float()}))
    _raises(d, f"per-expert tensor '{name}' has dtype torch.float32",
            "'model.layers.0.mlp.experts.0.gate_proj.weight'", "has torch.bfloat16")


def test_read_box_rejects_bad_requests(tiny_checkpoints):
    ckpt = read_checkpoint(tiny_checkpoints("tiny-qwen3-moe"))
    name = "model.layers.0.mlp.experts.down_proj.weight"
    for box in (((0, 9), (0, 1), (0, 1)), ((0, 1), (0, 1)), ((2, 1), (0, 1), (0, 1))):
        with pytest.raises(CheckpointError, match=r"does not fit wire tensor .* \[8, 128, 32\]"):
            ckpt.read_box(name, box)
    with pytest.raises(CheckpointError, match="has no wire tensor 'model.layers.0.mlp.experts.0"):
        ckpt.read_box("model.layers.0.mlp.experts.0.down_proj.weight", ((0, 1), (0, 1)))


# --------------------------------------------------------------------------
# experts stored stacked on disk (as RL frameworks write transformers' fused
# parameters); vLLM loads them like per-expert ones (test_vllm_oracle.py)


def _stack_on_disk(t: dict, suffix: str = "", layers=None) -> None:
    """Replace per-expert tensors by stacked ones named ``<block>.experts.gate_up_proj``
    (+ ``suffix``): gate rows then up rows per expert (Mixtral: w1 then w3)."""
    per: dict = defaultdict(dict)
    for name in list(t):
        m = _EXPERT_RE.match(name)
        if m and (layers is None or f".layers.{layers}." in name):
            per[m["prefix"]][(int(m["e"]), _ROLE[m["proj"]])] = t.pop(name)
    for prefix, parts in per.items():
        n = 1 + max(e for e, _ in parts)
        t[f"{prefix}.experts.gate_up_proj{suffix}"] = torch.stack(
            [torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        t[f"{prefix}.experts.down_proj{suffix}"] = torch.stack([parts[e, "down"] for e in range(n)])


@pytest.mark.parametrize("suffix", ["", ".weight"], ids=["in-memory-name", "wire-name"])
@pytest.mark.parametrize("model", MOE)
def test_experts_stacked_on_disk_are_the_wire_tensors(tiny_checkpoints, tmp_path, model, suffix):
    d = copy_ckpt(tiny_checkpoints(model), tmp_path)
    per_expert = read_checkpoint(d)
    ref = reference_wire(disk_tensors(d))
    rewrite(d / "model.safetensors", lambda t: _stack_on_disk(t, suffix))
    ckpt = read_checkpoint(d)
    assert ckpt.params == per_expert.params                    # same names, shapes, order
    block = "mlp" if model == "tiny-qwen3-moe" else "block_sparse_moe"
    wire = f"model.layers.1.{block}.experts.gate_up_proj.weight"
    assert ckpt.disk_names(wire) == (f"model.layers.1.{block}.experts.gate_up_proj{suffix}",)
    for name, want in ref.items():
        assert torch.equal(ckpt.read_full(name), want), name
    box = ((2, 5), (7, 40), (3, 100))
    assert torch.equal(ckpt.read_box(wire, box), ref[wire][sl(box)])
    assert read_checkpoint(d / "config.json").params == ckpt.params


def test_experts_stacked_in_one_layer_per_expert_in_the_other(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)
    ref = reference_wire(disk_tensors(d))
    rewrite(d / "model.safetensors", lambda t: _stack_on_disk(t, layers=0))
    ckpt = read_checkpoint(d)
    assert ckpt.disk_names("model.layers.0.mlp.experts.down_proj.weight") == (
        "model.layers.0.mlp.experts.down_proj",)
    assert len(ckpt.disk_names("model.layers.1.mlp.experts.down_proj.weight")) == 8
    assert all(torch.equal(ckpt.read_full(n), t) for n, t in ref.items())


def test_error_experts_both_stacked_and_per_expert(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)

    def both(t):
        keep = dict(t)
        _stack_on_disk(t, layers=1)
        t.update({n: v for n, v in keep.items() if ".layers.1.mlp.experts.3." in n})

    rewrite(d / "model.safetensors", both)
    _raises(d, "tensor 'model.layers.1.mlp.experts.gate_up_proj'", "holds the experts stacked",
            "also holds 'model.layers.1.mlp.experts.3.gate_proj.weight'", "one form per MoE block")


def test_error_experts_stacked_transposed(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)

    def transposed(t):
        _stack_on_disk(t)
        name = "model.layers.0.mlp.experts.gate_up_proj"
        t[name] = t[name].transpose(1, 2).contiguous()

    rewrite(d / "model.safetensors", transposed)
    _raises(d, "tensor 'model.layers.0.mlp.experts.gate_up_proj'", "has shape [8, 128, 64]",
            "expects stacked experts [8, 64, 128]", "gate rows then its up rows")


def test_error_missing_experts_mentions_the_stacked_form(tiny_checkpoints, tmp_path):
    d = copy_ckpt(tiny_checkpoints("tiny-qwen3-moe"), tmp_path)

    def drop(t):
        for n in [n for n in t if n.startswith("model.layers.1.mlp.experts.")]:
            del t[n]

    rewrite(d / "model.safetensors", drop)
    _raises(d, "'model.layers.1.mlp.experts.0.gate_proj.weight'",
            "experts may also be stored stacked per layer, e.g. "
            "'model.layers.1.mlp.experts.gate_up_proj'")
