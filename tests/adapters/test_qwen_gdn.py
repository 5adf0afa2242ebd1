"""The Gated DeltaNet family tables (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) without vLLM.

``families/qwen3_next.py``, ``qwen3_5.py`` and ``qwen3_5_moe.py`` restate vLLM
0.33.0's loaders; here they are held against the real vLLM dumps of the
shipped tiny checkpoints (``tests/data/oracle/tiny-qwen3-next``,
``tiny-qwen3.5``, ``tiny-qwen3.5-moe``) through m2nkit's own checkpoint
reader, and the special tensors are checked by hand: which wire tensors feed
which vLLM parameter, as how many boxes, where. The dumps are one TP group
(dp = 1); dp > 1 is checked against ``reference_load``. The table against
vLLM's traced loaders at tp 1/2/4/8, EP and dp 2 is
``tests/integration/test_vllm_trace.py``. The published configs (Qwen3-Next,
and the text models of the Qwen3.5 wrappers) plan from the tables alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from _oracle import ALL_FIXTURES, DATA, _oracle, assert_layout_equals_dumps
from _paths import CONFIGS
from _layouts import fill_worker
from m2nkit.adapters.families import family_for
from m2nkit.adapters.families.kinds import GDN_CONV, GDN_QKVZ, QKV_GATED, Geometry
from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
from m2nkit.adapters.vllm import InferenceSpec, destination_layout, reference_load

MODELS = {"tiny-qwen3-next": "Qwen3NextForCausalLM", "tiny-qwen3.5": "Qwen3_5ForCausalLM",
          "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM"}
FIXTURES = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
LA, SA = "model.layers.0.linear_attn.", "model.layers.1.self_attn."


def _ckpt(model: str):
    return read_checkpoint(DATA / model / "checkpoint")


def _wire(ck) -> dict[str, torch.Tensor]:
    return {p.name: ck.read_full(p.name) for p in ck.params}


def _config(model: str) -> dict:
    return json.loads((DATA / model / "checkpoint" / "config.json").read_text())


def _sources(layout, worker: int, param: str) -> list:
    """``(wire name, box, offset)`` of every binding into ``param`` of ``worker``, sorted."""
    return sorted((b.name, b.box, b.offset) for bs in layout.bindings.values() for b in bs
                  if b.worker == worker and b.param == param)


def test_every_model_is_shipped_and_read_with_its_table():
    assert {(p.values[0], p.values[1], p.values[2]) for p in FIXTURES} == {
        *((m, tp, False) for m in MODELS for tp in (1, 2, 4)),
        *((m, tp, True) for m in ("tiny-qwen3-next", "tiny-qwen3.5-moe") for tp in (2, 4))}
    for model, arch in MODELS.items():
        ck = _ckpt(model)
        assert family_for(ck.config).architecture == arch == _config(model)["architectures"][0]
        names = {p.name for p in ck.params}
        # the table's wire names: on-disk names, stacked experts with ".weight"
        if model != "tiny-qwen3.5":
            assert "model.layers.1.mlp.experts.gate_up_proj.weight" in names
        assert not any(".experts.0." in n for n in names)


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_table_plan_of_the_read_checkpoint_equals_vllm_dumps(model, tp, ep, placement, dtype):
    ck = _ckpt(model)
    spec = InferenceSpec(tp, 1, ep, placement=placement, dtype=dtype)
    layout = destination_layout(ck.config, ck.params, spec)
    assert not layout.unknown
    assert not layout.skipped        # a tied checkpoint holds no lm_head.weight
    if _config(model)["tie_word_embeddings"]:
        assert layout.aliases["lm_head.weight"] == "model.embed_tokens.weight"
    assert_layout_equals_dumps(layout, _wire(ck), model, tp, ep, placement, dtype, "table ")


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_qwen3_5_in_proj_qkv_lands_as_three_boxes_per_rank(model):
    """Qwen3.5: ``in_proj_qkv`` [2*kd + vd, H] feeds shards 0-2 of ``in_proj_qkvz``
    (output sizes [kd, kd, vd, vd]): rank r's q, k and v rows, each from its own
    section, then ``in_proj_z``'s rows; ``conv1d`` [2*kd + vd, 1, K] likewise, q, k,
    v. ``in_proj_b``/``in_proj_a`` are the halves of ``in_proj_ba``."""
    c, tp = _config(model), 4
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]          # 32
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]      # 64
    H, K, nv = c["hidden_size"], c["linear_conv_kernel_dim"], c["linear_num_value_heads"]
    ck = _ckpt(model)
    layout = destination_layout(ck.config, ck.params, f"vllm:tp={tp}")
    k, v = kd // tp, vd // tp
    for r in range(tp):
        assert _sources(layout, r, LA + "in_proj_qkvz.weight") == sorted([
            (LA + "in_proj_qkv.weight", ((r * k, (r + 1) * k), (0, H)), (0, 0)),
            (LA + "in_proj_qkv.weight", ((kd + r * k, kd + (r + 1) * k), (0, H)), (k, 0)),
            (LA + "in_proj_qkv.weight", ((2 * kd + r * v, 2 * kd + (r + 1) * v), (0, H)),
             (2 * k, 0)),
            (LA + "in_proj_z.weight", ((r * v, (r + 1) * v), (0, H)), (2 * k + v, 0))])
        assert _sources(layout, r, LA + "conv1d.weight") == sorted([
            (LA + "conv1d.weight", ((r * k, (r + 1) * k), (0, 1), (0, K)), (0, 0, 0)),
            (LA + "conv1d.weight", ((kd + r * k, kd + (r + 1) * k), (0, 1), (0, K)), (k, 0, 0)),
            (LA + "conv1d.weight", ((2 * kd + r * v, 2 * kd + (r + 1) * v), (0, 1), (0, K)),
             (2 * k, 0, 0))])
        n = nv // tp
        assert _sources(layout, r, LA + "in_proj_ba.weight") == sorted([
            (LA + "in_proj_b.weight", ((r * n, (r + 1) * n), (0, H)), (0, 0)),
            (LA + "in_proj_a.weight", ((r * n, (r + 1) * n), (0, H)), (n, 0))])
    dump, _ = _oracle(model, tp, False, 1)
    assert dump[LA + "in_proj_qkvz.weight"].shape == (2 * k + 2 * v, H)


def test_qwen3_next_fused_projections_are_one_block_per_rank():
    """Qwen3-Next's checkpoint fuses ``in_proj_qkvz``/``in_proj_ba`` per key-head group:
    plain column parallel (one output size), rank r one run of rows; conv1d as Qwen3.5's."""
    model, tp = "tiny-qwen3-next", 4
    c = _config(model)
    H = c["hidden_size"]
    ck = _ckpt(model)
    layout = destination_layout(ck.config, ck.params, f"vllm:tp={tp}")
    for name, rows in (("in_proj_qkvz.weight", 192), ("in_proj_ba.weight", 16)):
        n = rows // tp
        for r in range(tp):
            assert _sources(layout, r, LA + name) == [
                (LA + name, ((r * n, (r + 1) * n), (0, H)), (0, 0))], (name, r)
    assert len(_sources(layout, 2, LA + "conv1d.weight")) == 3
    # mlp_only_layers=[0]: layer 0 dense, layer 1 MoE
    params = {p.name for p in layout.params if p.worker == 0}
    assert "model.layers.0.mlp.gate_up_proj.weight" in params
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in params)
    assert "model.layers.1.mlp.experts.routed_experts.w13_weight" in params


@pytest.mark.parametrize("model", list(MODELS))
def test_gated_attention_norms_and_dtypes(model):
    """Full attention: ``q_proj`` [2*nh*hd, H] (query and gate rows per head), rank r
    its heads' 2*hd rows each, then the KV head it shares. ``A_log`` float32 in vLLM
    (bf16 on the wire, cast on arrival), ``dt_bias`` bf16, both by value head;
    ``norm`` [dv] whole on every worker."""
    c, tp = _config(model), 4
    nh, hd, nkv, H = c["num_attention_heads"], c["head_dim"], c["num_key_value_heads"], \
        c["hidden_size"]
    ck = _ckpt(model)
    layout = destination_layout(ck.config, ck.params, f"vllm:tp={tp}")
    q = 2 * nh * hd // tp
    for r in range(tp):
        kv = r // (tp // nkv)
        assert _sources(layout, r, SA + "qkv_proj.weight") == sorted([
            (SA + "q_proj.weight", ((r * q, (r + 1) * q), (0, H)), (0, 0)),
            (SA + "k_proj.weight", ((kv * hd, (kv + 1) * hd), (0, H)), (q, 0)),
            (SA + "v_proj.weight", ((kv * hd, (kv + 1) * hd), (0, H)), (q + hd, 0))])
        assert _sources(layout, r, LA + "norm.weight") == [
            (LA + "norm.weight", ((0, c["linear_value_head_dim"]),), (0,))]
    local = {(p.worker, p.name): p for p in layout.params}
    assert local[(0, LA + "A_log")].dtype == torch.float32
    assert local[(0, LA + "dt_bias")].dtype == torch.bfloat16
    assert local[(3, LA + "A_log")].shape == (c["linear_num_value_heads"] // tp,)
    assert {p.name: p.dtype for p in ck.params}[LA + "A_log"] == torch.bfloat16


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_shared_expert_aliases_and_sequence_parallel(model):
    """The MoE block: router aliased ``mlp.experts.gate``; ``shared_expert_gate`` [1, H]
    whole, aliased twice; the shared expert merged (gate rows, then up rows of the
    rank), aliased under ``experts._shared_experts._layer``, and whole on every worker
    when vLLM runs the MoE sequence-parallel (EP, tp > 1, dp > 1)."""
    M = "model.layers.1.mlp."
    ck = _ckpt(model)
    layout = destination_layout(ck.config, ck.params, "vllm:tp=2")
    S = M + "experts._shared_experts._layer."
    G = M + "shared_expert_gate.weight"
    for alias, canonical in {M + "experts.gate.weight": M + "gate.weight",
                             M + "shared_expert.expert_gate.weight": G,
                             S + "expert_gate.weight": G,
                             S + "gate_up_proj.weight": M + "shared_expert.gate_up_proj.weight",
                             S + "down_proj.weight": M + "shared_expert.down_proj.weight"}.items():
        assert layout.aliases[alias] == canonical
    Is, H = _config(model)["shared_expert_intermediate_size"], _config(model)["hidden_size"]
    n = Is // 2
    assert _sources(layout, 1, M + "shared_expert.gate_up_proj.weight") == [
        (M + "shared_expert.gate_proj.weight", ((n, 2 * n), (0, H)), (0, 0)),
        (M + "shared_expert.up_proj.weight", ((n, 2 * n), (0, H)), (n, 0))]
    sp = destination_layout(ck.config, ck.params, "vllm:tp=2,dp=2,ep")
    assert _sources(sp, 3, M + "shared_expert.down_proj.weight") == [
        (M + "shared_expert.down_proj.weight", ((0, H), (0, Is)), (0, 0))]


@pytest.mark.parametrize("model,tp,dp,ep", [
    ("tiny-qwen3.5", 2, 2, False), ("tiny-qwen3.5", 4, 2, False),
    ("tiny-qwen3.5-moe", 2, 2, True), ("tiny-qwen3.5-moe", 1, 4, False),
    ("tiny-qwen3-next", 4, 2, True), ("tiny-qwen3-next", 2, 2, False),
])
def test_layout_equals_reference_with_dp(model, tp, dp, ep):
    """dp > 1 (the dumps are one TP group): every worker filled through the bindings
    equals ``reference_load`` (the kinds' vLLM-style loads), every element once."""
    ck = _ckpt(model)
    spec = InferenceSpec(tp, dp, ep)
    layout = destination_layout(ck.config, ck.params, spec)
    wire, full = _wire(ck), full_checkpoint_tensors(ck)
    for w in range(spec.num_workers):
        store, count = fill_worker(layout, wire, w)
        ref = reference_load(ck.config, full, spec, w)
        assert set(store) == set(ref) - set(layout.aliases)
        for name, t in store.items():
            c = count[name]          # EP over more workers than experts leaves some none
            assert c.numel() == 0 or int(c.min()) == 1 == int(c.max()), (name, w)
            assert torch.equal(t, ref[name]), (name, w)


def test_sections_kind_rule_and_boxes():
    """``Sections``: each section split by tp on its own; the rule names the section."""
    from dataclasses import replace

    s = read_checkpoint(DATA / "tiny-qwen3.5" / "checkpoint").config
    sizes = family_for(s).sizes(s)
    assert GDN_QKVZ.violation("p", ("qkvz", "H"), sizes, 8, 1, False) is None
    bad = replace(sizes, nkh=3)                                   # kd = 24
    assert GDN_QKVZ.violation("p", ("qkvz", "H"), bad, 16, 1, False) == (
        "p: linear_num_key_heads*linear_key_head_dim=24 is not divisible by tp=16")
    assert GDN_CONV.violation("p", ("conv", "1", "K"), sizes, 3, 1, False).startswith(
        "p: linear_num_key_heads*linear_key_head_dim=32 is not divisible by tp=3")
    g = Geometry.of(sizes, 2, 1, False, 1)
    assert GDN_QKVZ.wire_shape((192, 64), (0, 3), sizes) == (128, 64)
    assert GDN_QKVZ.wire_shape((192, 64), (3, 4), sizes) == (64, 64)
    assert GDN_QKVZ.runs((0, 3), g) == [(16, 0, 16), (48, 16, 16), (96, 32, 32)]
    assert GDN_QKVZ.runs((3, 4), g) == [(32, 64, 32)]
    assert QKV_GATED.local_shape((64,), 3, g) == ((2 * 2 + 2 * 1) * 16, 64)


@pytest.mark.parametrize("model,changes,match", [
    ("tiny-qwen3-next", {"tie_word_embeddings": True}, "builds an untied lm_head"),
    ("tiny-qwen3.5", {"attention_bias": True}, "attention_bias=True"),
    ("tiny-qwen3.5", {"attn_output_gate": False}, "attn_output_gate=False"),
    ("tiny-qwen3.5-moe", {"shared_expert_intermediate_size": 0},
     "shared_expert_intermediate_size=0"),
    ("tiny-qwen3-next", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
])
def test_variants_the_tables_refuse(model, changes, match):
    config = {**_config(model), **changes}
    with pytest.raises(ValueError, match=match):
        family_for(config).sizes(config)


def test_tp_above_experts_and_heads_are_refused():
    ck = _ckpt("tiny-qwen3.5-moe")
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp=8"):
        destination_layout(ck.config, ck.params, "vllm:tp=8")
    config = {**_config("tiny-qwen3.5-moe"), "num_experts": 2}
    with pytest.raises(ValueError, match=r"tp=4 is greater than num_experts=2"):
        destination_layout(config, [], "vllm:tp=4")


def test_mtp_tensors_are_skipped():
    fam = family_for(_config("tiny-qwen3.5"))
    assert "multi-token-prediction" in fam.skip(None, "mtp.layers.0.mlp.gate_proj.weight")
    assert fam.skip(None, "model.layers.0.mlp.gate_proj.weight") is None


# --------------------------------------------------------------------------
# published configs, from the tables alone


def _plan(capsys, config, trainer: str, inference: str) -> dict:
    from m2nkit.engine.tools.cli import main

    capsys.readouterr()
    code = main(["plan", str(config), "--trainer", trainer, "--inference", inference,
                 "--layout", "tables"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    rows = {}
    for line in out.out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def _text_model(tmp_path, name: str, architecture: str):
    """A Qwen3.5 wrapper's ``text_config`` as a ``...ForCausalLM`` config.json."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**config["text_config"],
                                               "architectures": [architecture]}))
    return d / "config.json"


@pytest.mark.parametrize("inference", ["vllm:tp=4,ep", "vllm:tp=8,ep"])
def test_qwen3_next_published_config_plans_from_tables(capsys, inference):
    rows = _plan(capsys, CONFIGS / "Qwen__Qwen3-Next-80B-A3B-Instruct" / "config.json",
                 "fsdp:64", inference)
    assert "ratio 1.000" in rows["bytes moved / minimum"]
    assert rows["problems"] == "none"
    assert rows["vLLM layout"].startswith("m2nkit's family tables")
    assert rows["wire tensors"].startswith("759 (0 skipped")


@pytest.mark.parametrize("name,architecture,trainer,inference,tensors", [
    ("Qwen__Qwen3.5-27B", "Qwen3_5ForCausalLM", "fsdp:64", "vllm:tp=8", 851),
    ("Qwen__Qwen3.5-397B-A17B", "Qwen3_5MoeForCausalLM", "fsdp:256", "vllm:tp=8,dp=4,ep", 1038),
])
def test_qwen3_5_text_models_of_the_published_wrappers_plan_from_tables(
        tmp_path, capsys, name, architecture, trainer, inference, tensors):
    rows = _plan(capsys, _text_model(tmp_path, name, architecture), trainer, inference)
    assert "ratio 1.000" in rows["bytes moved / minimum"]
    assert rows["problems"] == "none"
    assert rows["wire tensors"].startswith(f"{tensors} (0 skipped")
