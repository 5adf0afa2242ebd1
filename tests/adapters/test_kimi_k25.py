"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``): the table, the int4 form refused.

``tests/data/oracle/tiny-kimi-k25`` is a bf16 tiny checkpoint with real vLLM
0.33.0 loader dumps (tp 1/2/4, EP 2/4; README there). Read by the checkpoint
reader from the table (transformers 5.12.1 has no Kimi-K2.5 class) and laid
out by the table, every worker equals vLLM's dump bit for bit; the facts the
dumps showed about the vision tower and the wrapper's names are written out
by hand. The published config carries an int4 compressed-tensors
``text_config.quantization_config``: m2nkit lays out no packed int4
weights, so every path refuses it with one message naming the quantization
and what is supported (``families.quant.compressed_tensors_refusal``), never
a bf16 plan of an int4 checkpoint; the same config without it (bf16) plans
from the table with bytes moved equal to the minimum.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

from _paths import CONFIGS, ORACLE
import pytest
import torch

from m2nkit.adapters.families import family
from m2nkit.adapters.families.kimi_k25 import VISION_DEFAULTS
from m2nkit.adapters.families.quant import compressed_tensors_refusal
from m2nkit.adapters.hf_checkpoint import CheckpointError, checkpoint_metas, read_checkpoint
from m2nkit.adapters.trainer_spec import parse_trainer_spec
from m2nkit.adapters.vllm import InferenceSpec, destination_layout
from m2nkit.engine.plan import build_plan
from m2nkit.engine.tools.cli import main

from _oracle import FIXTURES, assert_layout_equals_dumps

PUBLISHED = CONFIGS / "moonshotai__Kimi-K2.5" / "config.json"
TINY = ORACLE / "tiny-kimi-k25" / "checkpoint"

#: The words every refusal of the published int4 form carries.
INT4_WORDS = ("KimiK25ForConditionalGeneration", "text_config.quantization_config",
              "compressed-tensors", "int4 weights", "group size 32", "pack-quantized",
              "supported: the unquantized (bf16) form, the same config without "
              "text_config.quantization_config")


def _published() -> dict:
    return json.loads(PUBLISHED.read_text())


def _bf16(config: dict) -> dict:
    out = copy.deepcopy(config)
    del out["text_config"]["quantization_config"]
    return out


def test_published_int4_is_named_and_bf16_is_not_refused():
    why = compressed_tensors_refusal(_published(), "KimiK25ForConditionalGeneration")
    assert why is not None and all(w in why for w in INT4_WORDS), why
    assert compressed_tensors_refusal(_bf16(_published())) is None


def test_read_checkpoint_refuses_int4_config_and_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(PUBLISHED)
    assert all(w in str(e.value) for w in INT4_WORDS), e.value
    # a checkpoint with data: the bf16 tiny tensors under an int4 config
    ckpt = tmp_path / "int4"
    shutil.copytree(TINY, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["quantization_config"] = _published()["text_config"][
        "quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(ckpt)
    assert all(w in str(e.value) for w in INT4_WORDS), e.value


@pytest.mark.parametrize("layout", ["tables", "traced", "auto"])
def test_plan_refuses_int4_on_every_layout(capsys, layout):
    code = main(["plan", str(PUBLISHED), "--trainer", "fsdp:256",
                 "--inference", "vllm:tp=8,dp=8,ep", "--layout", layout])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert all(w in err for w in INT4_WORDS), err


# --------------------------------------------------------------------------
# the bf16 form: the table against vLLM's dumps

KIMI_DUMPS = [p for p in FIXTURES if p.values[0] == "tiny-kimi-k25"]
A = "KimiK25ForConditionalGeneration"


def test_every_layout_is_dumped():
    assert {(p.values[1], p.values[2]) for p in KIMI_DUMPS} == {
        (1, False), (2, False), (4, False), (2, True), (4, True)}


@pytest.fixture(scope="module")
def tiny():
    """The shipped checkpoint as the reader gives it (from the table) and its tensors."""
    ckpt = read_checkpoint(TINY)
    return ckpt, {m.name: ckpt.read_full(m.name) for m in ckpt.params}


@pytest.mark.parametrize("model,tp,ep,placement,dtype", KIMI_DUMPS)
def test_table_equals_every_vllm_dump(tiny, model, tp, ep, placement, dtype):
    ckpt, tensors = tiny
    layout = destination_layout(ckpt.config, ckpt.params, InferenceSpec(tp, 1, ep))
    assert not layout.unknown and not layout.skipped
    assert_layout_equals_dumps(layout, tensors, model, tp, ep, placement, dtype)


def test_wire_tensors_are_the_published_names(tiny):
    ckpt, _ = tiny
    names = [p.name for p in ckpt.params]
    assert ckpt.architecture == A
    assert names[:3] == ["vision_tower.patch_embed.proj.weight",
                         "vision_tower.patch_embed.proj.bias",
                         "vision_tower.patch_embed.pos_emb.weight"]
    assert "mm_projector.proj.0.weight" in names and "mm_projector.linear_1.weight" not in names
    assert "language_model.model.layers.1.mlp.experts.gate_up_proj.weight" in names
    assert "language_model.lm_head.weight" == names[-1]
    assert not any(n.startswith("model.") or ".experts.0." in n for n in names)


def _bindings(layout, wire, worker):
    return [(b.param, b.box, b.offset) for b in layout.bindings[wire] if b.worker == worker]


def test_vision_tower_split_by_heads_or_whole_as_vllm(tiny):
    """wqkv [3*D, D] of 2 heads of 8: tp 2 gives rank r its q, k and v head rows; at tp 4
    the heads do not divide and vLLM runs the tower data-parallel: whole everywhere."""
    ckpt, _ = tiny
    q = "vision_tower.encoder.blocks.0.wqkv.weight"
    tp2 = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2")
    assert _bindings(tp2, q, 1) == [(q, ((8, 16), (0, 16)), (0, 0)),
                                    (q, ((24, 32), (0, 16)), (8, 0)),
                                    (q, ((40, 48), (0, 16)), (16, 0))]
    fc1 = "vision_tower.encoder.blocks.1.mlp.fc1.weight"
    assert _bindings(tp2, fc1, 1) == [(fc1, ((0, 16), (16, 32)), (0, 0))]
    tp4 = destination_layout(ckpt.config, ckpt.params, "vllm:tp=4,dp=2")
    for w in range(8):
        assert _bindings(tp4, q, w) == [(q, ((0, 48), (0, 16)), (0, 0))]
        assert _bindings(tp4, fc1, w) == [(fc1, ((0, 16), (0, 32)), (0, 0))]


def test_projector_and_text_names_as_vllms_mapper(tiny):
    ckpt, _ = tiny
    layout = destination_layout(ckpt.config, ckpt.params, "vllm:tp=2,ep")
    assert _bindings(layout, "mm_projector.proj.0.weight", 1) == [
        ("mm_projector.linear_1.weight", ((0, 64), (0, 64)), (0, 0))]
    assert _bindings(layout, "mm_projector.proj.2.weight", 0) == [
        ("mm_projector.linear_2.weight", ((0, 32), (0, 64)), (0, 0))]
    a = "language_model.model.layers.0.self_attn."
    assert _bindings(layout, a + "kv_a_proj_with_mqa.weight", 1) == [
        (a + "fused_qkv_a_proj.weight", ((0, 24), (0, 32)), (16, 0))]     # after q_a's 16 rows
    m = "language_model.model.layers.1.mlp."
    assert _bindings(layout, m + "experts.gate_up_proj.weight", 1) == [
        (m + "experts.routed_experts.w13_weight", ((2, 4), (0, 64), (0, 32)), (0, 0, 0))]
    assert layout.aliases[m + "experts.gate.weight"] == m + "gate.weight"


def test_published_vision_sizes_are_the_config_class_defaults():
    """vLLM reads hidden_size, ... through transformers 5.24's Kimi_K25VisionConfig; the
    published config.json spells them vt_* (which that class does not read), so vLLM
    builds the class's defaults: they must be the published sizes."""
    vc = _published()["vision_config"]
    assert (vc["vt_hidden_size"], vc["vt_num_attention_heads"], vc["vt_num_hidden_layers"],
            vc["vt_intermediate_size"], vc["patch_size"], vc["merge_kernel_size"]) == (
        VISION_DEFAULTS["hidden_size"], VISION_DEFAULTS["num_attention_heads"],
        VISION_DEFAULTS["num_hidden_layers"], VISION_DEFAULTS["intermediate_size"],
        VISION_DEFAULTS["patch_size"], VISION_DEFAULTS["merge_kernel_size"])


def test_published_bf16_config_plans_from_tables_at_the_minimum(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_bf16(_published())))
    ckpt = read_checkpoint(config)
    s = family(A).sizes(ckpt.config)
    assert (s.layers, s.E, s.H, s.vH, s.vnh, s.vdepth, s.vGH) == (61, 384, 7168, 1152, 16, 27, 64)
    tspec = parse_trainer_spec("fsdp:64")
    metas = checkpoint_metas(ckpt, tspec)
    layout = destination_layout(ckpt.config, metas, "vllm:tp=8,ep")
    plan = build_plan(metas, tspec.num_ranks, layout)
    assert not plan.problems and not layout.unknown
    assert plan.nbytes_moved == plan.nbytes_min
    assert sum(m.dtype.itemsize * math.prod(m.shape) for m in metas) > 2 ** 40   # ~1 T params, bf16


def test_the_int4_config_is_refused_by_the_table_itself():
    with pytest.raises(ValueError) as e:
        family(A).sizes(_published())
    assert all(w in str(e.value) for w in INT4_WORDS), e.value


def test_text_heads_must_divide_by_tp_as_vllm_says(tiny):
    """The tiny text model's 4 heads at tp 8: MLA's column splits would divide (4 heads x
    24 rows), vLLM's ModelConfig refuses it; checked with vLLM's trace under transformers
    5.24 (see families/kimi_k25.py)."""
    ckpt, _ = tiny
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp=8"):
        destination_layout(ckpt.config, ckpt.params, "vllm:tp=8,ep")


def test_plan_verify_of_the_tiny_checkpoint(capsys):
    """The user's path: read from the table, planned, executed, every worker checked
    against the reference loader (itself pinned to the dumps in test_vllm_oracle.py);
    tp 4 with dp 2 holds the vision tower whole on all 8 workers."""
    code = main(["plan", str(TINY), "--trainer", "fsdp:3", "--inference", "vllm:tp=4,dp=2",
                 "--verify"])
    out = capsys.readouterr().out
    assert code == 0 and "verify: all 8 workers hold exactly what vLLM's loaders would" in out
    assert "ratio 1.000" in out


def test_a_sharded_checkpoint_reads_the_same(tmp_path, tiny):
    """Two shards and an index, as the published checkpoint is stored."""
    from safetensors.torch import load_file, save_file

    ckpt, _ = tiny
    tensors = load_file(str(TINY / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    sharded = read_checkpoint(tmp_path)
    assert sharded.params == ckpt.params
    for m in ckpt.params[::7]:
        assert sharded.read_full(m.name).equal(ckpt.read_full(m.name))


@pytest.mark.parametrize("rows,heads", [(16, 2), (8, 1), (24, 3), (4, 2)])
def test_split_rows_invert_transformers_permute_for_rope(rows, heads):
    """``SplitOnLoad.wire_row`` against transformers' own ``PermuteForRope`` (what it
    applies to q and k of each vision block as it loads): in-memory row ``m`` of the
    permuted checkpoint rows ``arange(rows)`` holds checkpoint row ``wire_row(m)``. Biases
    are held bit for bit against vLLM in ``tests/integration/test_fsdp2_kimi_k25.py``."""
    from types import SimpleNamespace

    from m2nkit.adapters.families.kimi_k25 import WQKV_SPLIT

    rows_in = torch.arange(rows).repeat(3, 1).T.contiguous()     # [rows, 3]: row r holds r
    memory = _permute_for_rope(rows_in, heads)
    assert [WQKV_SPLIT.wire_row(m, rows, heads) for m in range(rows)] == memory[:, 0].tolist()
    config = SimpleNamespace(vision_config=SimpleNamespace(num_attention_heads=heads))
    assert WQKV_SPLIT.heads(config) == heads


def test_split_rows_refuse_odd_head_dims():
    from m2nkit.adapters.families.kimi_k25 import WQKV_SPLIT

    with pytest.raises(ValueError, match="6 rows are not 2 heads of an even head dim"):
        WQKV_SPLIT.wire_row(0, 6, 2)


#: transformers 5.25's ``Kimi_K25ForConditionalGeneration.named_parameters()`` of the tiny
#: checkpoint (recorded; block and layer 0, the MoE layer's router) -> the published names.
_IN_MEMORY = {
    "model.vision_tower.patch_embed.proj.weight": "vision_tower.patch_embed.proj.weight",
    "model.vision_tower.patch_embed.pos_emb.position_embeddings":
        "vision_tower.patch_embed.pos_emb.weight",
    "model.vision_tower.layers.0.norm1.weight": "vision_tower.encoder.blocks.0.norm0.weight",
    "model.vision_tower.layers.0.norm2.bias": "vision_tower.encoder.blocks.0.norm1.bias",
    "model.vision_tower.layers.0.attn.proj.weight": "vision_tower.encoder.blocks.0.wo.weight",
    "model.vision_tower.layers.0.mlp.fc1.weight": "vision_tower.encoder.blocks.0.mlp.fc0.weight",
    "model.vision_tower.layers.0.mlp.fc2.bias": "vision_tower.encoder.blocks.0.mlp.fc1.bias",
    "model.vision_tower.final_layernorm.weight": "vision_tower.encoder.final_layernorm.weight",
    "model.language_model.embed_tokens.weight": "language_model.model.embed_tokens.weight",
    "model.language_model.layers.1.mlp.gate.weight":
        "language_model.model.layers.1.mlp.gate.weight",
    "model.language_model.norm.weight": "language_model.model.norm.weight",
    "model.mm_projector.pre_norm.weight": "mm_projector.pre_norm.weight",
    "model.mm_projector.in_proj.bias": "mm_projector.proj.0.bias",
    "model.mm_projector.out_proj.weight": "mm_projector.proj.2.weight",
    "lm_head.weight": "language_model.lm_head.weight",
}


def test_in_memory_names_are_the_published_ones():
    from m2nkit.adapters.families.kimi_k25 import FAMILY, WQKV_SPLIT

    hf = FAMILY.hf
    assert {n: hf.disk_name(n) for n in _IN_MEMORY} == _IN_MEMORY
    for published in _IN_MEMORY.values():          # a checkpoint name is left alone
        assert hf.disk_name(published) == published
    for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
        disk = hf.disk_name(f"model.vision_tower.layers.3.attn.{part}.bias")
        assert hf.split_part(disk) == (WQKV_SPLIT, "vision_tower.encoder.blocks.3.wqkv.bias", j)
    assert hf.split_part("language_model.model.layers.0.self_attn.q_proj.weight") is None


def _permute_for_rope(rows: "torch.Tensor", heads: int) -> "torch.Tensor":
    """transformers' own ``PermuteForRope`` of ``rows`` ``[R, C]`` (what it applies to q and k
    as it loads), through 5.12.1's ``_apply`` or 5.24+'s ``_permute_for_rope``."""
    from types import SimpleNamespace

    from transformers.core_model_loading import PermuteForRope

    op = PermuteForRope()
    if hasattr(op, "_permute_for_rope"):
        return op._permute_for_rope(rows, SimpleNamespace(num_attention_heads=heads))
    op.config = SimpleNamespace(getattr=lambda key, default: {"num_attention_heads": heads}
                                .get(key, default))
    return op._apply(rows)


def _vision_block(parts):
    """A module tree named as transformers 5.24+ names Kimi-K2.5's vision block 0."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.vision_tower = torch.nn.Module()
    layer = torch.nn.Module()
    root.model.vision_tower.layers = torch.nn.ModuleList([layer])
    layer.attn = torch.nn.Module()
    for name, (w, b) in parts.items():
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        linear.weight.data.copy_(w)
        linear.bias.data.copy_(b)
        setattr(layer.attn, name, linear)
    return root


def _tiny_config():
    import transformers

    return transformers.PretrainedConfig.from_dict(
        json.loads((TINY / "config.json").read_text()))


def test_plain_model_sends_the_checkpoints_wqkv():
    """The checkpoint's ``wqkv`` cut and permuted by transformers' own ops, as it loads;
    ``fsdp2_source`` of the resulting (unsharded) q/k/v sends the checkpoint's bytes."""
    from m2nkit.adapters.fsdp2 import fsdp2_source

    torch.manual_seed(0)
    D, heads = 16, 2                                    # the tiny tower's sizes
    wqkv, bias = torch.randn(3 * D, D), torch.randn(3 * D)
    parts = {}
    for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
        w, b = wqkv[j * D:(j + 1) * D], bias[j * D:(j + 1) * D]
        if name != "v_proj":
            w, b = _permute_for_rope(w, heads), _permute_for_rope(b[:, None], heads)[:, 0]
        parts[name] = (w, b)
    got = dict(fsdp2_source(_vision_block(parts), config=_tiny_config()).iter_local())
    prefix = "vision_tower.encoder.blocks.0.wqkv"
    assert set(got) == {f"{prefix}.weight", f"{prefix}.bias"}
    assert torch.equal(got[f"{prefix}.weight"], wqkv)
    assert torch.equal(got[f"{prefix}.bias"], bias)


def test_missing_split_part_is_named():
    from m2nkit.adapters.fsdp2 import FSDP2SourceError, fsdp2_source

    parts = {n: (torch.zeros(16, 16), torch.zeros(16)) for n in ("q_proj", "k_proj")}
    with pytest.raises(FSDP2SourceError, match=r"wqkv.weight' is re-fused from .*'v_proj' part "
                                               "is not among the model's parameters"):
        fsdp2_source(_vision_block(parts), config=_tiny_config())
