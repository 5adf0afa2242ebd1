"""DeepSeek-V3.2 and GLM-5 (DSA: MLA + MoE + the indexer) from their family tables.

``test_vllm_oracle.py`` pins ``destination_layout`` and ``reference_load`` to the
real vLLM 0.33.0 dumps of ``tests/data/oracle/tiny-deepseek-v32`` and
``tiny-glm-moe-dsa`` (tp 1/2/4, EP 2/4) with the wire built by hand. Here the
wire is ``read_checkpoint``'s (the table's names, experts re-stacked from disk),
the indexer's tensors are checked by hand against the dumps, and the published
configs are planned from their ``config.json`` alone. The tables against vLLM's
own loaders at tp 8, dp 2 and under fp8: ``tests/integration/test_vllm_trace.py``.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from _oracle import ALL_FIXTURES, DATA, _oracle, assert_layout_equals_dumps
from _paths import REPO
from m2nkit.adapters.hf_checkpoint import CheckpointError, full_checkpoint_tensors, read_checkpoint
from m2nkit.adapters.vllm import InferenceSpec, destination_layout, reference_load

MODELS = ("tiny-deepseek-v32", "tiny-glm-moe-dsa")
FIXTURES = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
CONFIGS = REPO / "examples" / "configs"
IDX = "model.layers.1.self_attn.indexer."


def _ckpt(model):
    return read_checkpoint(DATA / model / "checkpoint")


def test_every_layout_is_shipped():
    for model in MODELS:
        assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == model} == {
            (1, False), (2, False), (4, False), (2, True), (4, True)}


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_read_checkpoint_planned_by_the_table_equals_vllm(model, tp, ep, placement, dtype):
    ck = _ckpt(model)
    assert "model.layers.1.mlp.experts.gate_up_proj.weight" in ck.names    # the table's wire
    layout = destination_layout(ck.config, ck.params, InferenceSpec(tp, 1, ep))
    assert not layout.unknown and not layout.skipped and layout.notes == ()
    wire = {p.name: ck.read_full(p.name) for p in ck.params}
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype, "table ")


@pytest.mark.parametrize("model", MODELS)
def test_the_indexer_as_vllm_holds_it(model):
    """``wk_weights_proj`` = wk rows, then weights_proj rows, whole on every worker (not split
    by TP); ``wq_b`` whole; ``k_norm`` float32 (weight and bias); aliased twice under
    ``self_attn.mla_attn``: the dumps, and the table's bindings that say so."""
    ck = _ckpt(model)
    cfg = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
    ihd, inh, H = cfg["index_head_dim"], cfg["index_n_heads"], cfg["hidden_size"]
    wk, wp = ck.read_full(IDX + "wk.weight"), ck.read_full(IDX + "weights_proj.weight")
    layout = destination_layout(ck.config, ck.params, "vllm:tp=4,ep")
    fused = IDX + "wk_weights_proj.weight"
    assert {(b.worker, b.box, b.param, b.offset) for b in layout.bindings[IDX + "wk.weight"]} \
        == {(w, ((0, ihd), (0, H)), fused, (0, 0)) for w in range(4)}
    assert {(b.worker, b.box, b.param, b.offset)
            for b in layout.bindings[IDX + "weights_proj.weight"]} \
        == {(w, ((0, inh), (0, H)), fused, (ihd, 0)) for w in range(4)}
    params = {(p.worker, p.name): p for p in layout.params}
    for w in range(4):
        dump, meta = _oracle(model, 4, True, w)
        assert torch.equal(dump[fused], torch.cat([wk, wp])), f"rank {w}: [wk | weights_proj]"
        assert params[(w, fused)].shape == (ihd + inh, H)
        assert torch.equal(dump[IDX + "wq_b.weight"], ck.read_full(IDX + "wq_b.weight"))
        for leaf in ("k_norm.weight", "k_norm.bias"):
            assert dump[IDX + leaf].dtype == params[(w, IDX + leaf)].dtype == torch.float32
            assert torch.equal(dump[IDX + leaf], ck.read_full(IDX + leaf).float())
        aliases = json.loads(meta["aliases"])
        for via in ("mla_attn.", "mla_attn.mla_attn."):
            name = IDX.replace("indexer.", via + "indexer.") + "wk_weights_proj.weight"
            assert aliases[name] == layout.aliases[name] == fused


@pytest.mark.parametrize("model,tp,dp,ep", [(m, 2, 2, ep) for m in MODELS for ep in (False, True)])
def test_layout_equals_reference_with_dp(model, tp, dp, ep):
    """dp replicas (the oracle builds one TP group): every worker filled through the bindings
    equals reference_load, each element written once."""
    ck = _ckpt(model)
    spec = InferenceSpec(tp, dp, ep)
    layout = destination_layout(ck.config, ck.params, spec)
    wire = {p.name: ck.read_full(p.name) for p in ck.params}
    full = full_checkpoint_tensors(ck)
    for w in range(spec.num_workers):
        store = layout.allocate(w, fill=float("nan"))
        count = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in store.items()}
        for p in layout.params:
            if p.worker == w:
                for box in p.zero_boxes:
                    sl = tuple(slice(a, c) for a, c in box)
                    store[p.name][sl] = 0
                    count[p.name][sl] += 1
        for name, bindings in layout.bindings.items():
            for b in bindings:
                if b.worker == w:
                    dst = tuple(slice(o, o + (c - a)) for o, (a, c) in zip(b.offset, b.box))
                    store[b.param][dst] = wire[name][tuple(slice(a, c) for a, c in b.box)].to(
                        store[b.param].dtype)
                    count[b.param][dst] += 1
        ref = reference_load(ck.config, full, spec, w)
        for name, t in store.items():
            assert bool((count[name] == 1).all()), f"{name} on worker {w}: not written once"
            assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name


def test_layers_without_an_indexer_drop_its_tensors(tmp_path):
    """vLLM's IndexCache rule (index_topk_freq 2, offset 1: layer 1 has none): its indexer
    tensors are skipped as vLLM's load_weights drops them; transformers' DeepseekV32 builds
    one in every layer, so a config-only read goes through transformers."""
    from m2nkit.adapters.families import family

    d = tmp_path / "ck"
    shutil.copytree(DATA / "tiny-deepseek-v32" / "checkpoint", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(
        dict(cfg, index_topk_freq=2, index_skip_topk_offset=1)))
    ck = read_checkpoint(d)
    layout = destination_layout(ck.config, ck.params, "vllm:tp=2")
    assert not layout.unknown
    dropped = {n for n in ck.names if n.startswith(IDX)}
    assert len(dropped) == 5 and set(layout.skipped) == dropped
    assert "layer 1 has no DSA indexer in vLLM" in layout.skipped[IDX + "wk.weight"]
    assert not any(p.name.startswith(IDX) for p in layout.params)
    assert any(p.name.startswith("model.layers.0.self_attn.indexer.") for p in layout.params)
    assert "index_topk_freq" in family("DeepseekV32ForCausalLM").hf.table_differs(ck.config)


def test_an_fp8_wk_is_refused_naming_vllms_dequantization(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(DATA / "tiny-deepseek-v32" / "checkpoint", d)
    tensors = load_file(d / "model.safetensors")
    tensors[IDX + "wk.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"indexer\.wk\.weight_scale_inv.*"
                                              r"_try_load_fp8_indexer_wk"):
        read_checkpoint(d)


def test_q_lora_rank_null_is_refused():
    cfg = json.loads((DATA / "tiny-deepseek-v32" / "checkpoint" / "config.json").read_text())
    with pytest.raises(ValueError, match="DeepseekV32ForCausalLM with q_lora_rank null"):
        destination_layout(dict(cfg, q_lora_rank=None), [], "vllm:tp=1")


@pytest.mark.parametrize("config,inference", [
    (c, i) for c in ("deepseek-ai__DeepSeek-V3.2", "zai-org__GLM-5")
    for i in ("vllm:tp=8,ep", "vllm:tp=8,dp=2,ep")])
def test_published_config_plans_from_the_table_at_the_minimum(config, inference):
    """fsdp:64 -> vLLM from config.json alone: no problems, bytes moved == minimum; the MTP
    layer (with its indexer) listed as skipped; DeepSeek-V3.2 in fp8 as published: wq_b fp8
    with block scales, wk and weights_proj bf16 (vLLM's unquantized wk_weights_proj),
    k_norm float32."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.engine.plan import build_plan

    t0 = time.perf_counter()
    ck = read_checkpoint(CONFIGS / config / "config.json")
    tspec = parse_trainer_spec("fsdp:64")
    metas = checkpoint_metas(ck, tspec)
    layout = destination_layout(ck.config, metas, inference)
    plan = build_plan(metas, tspec.num_ranks, layout)
    assert time.perf_counter() - t0 < 60      # seconds on a loaded machine (about 1 s idle)
    assert plan.problems == [] and not layout.unknown
    assert plan.nbytes_moved == plan.nbytes_min
    mtp = ck.config["num_hidden_layers"]
    assert set(layout.skipped) == {m.name for m in metas
                                   if m.name.startswith(f"model.layers.{mtp}.")}
    assert f"model.layers.{mtp}.self_attn.indexer.wk.weight" in layout.skipped
    meta = {m.name: m for m in metas}
    L = "model.layers.0.self_attn.indexer."
    fp8 = config.startswith("deepseek")
    assert meta[L + "wq_b.weight"].dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert (L + "wq_b.weight_scale_inv" in meta) == fp8
    assert meta[L + "wk.weight"].dtype == meta[L + "weights_proj.weight"].dtype == torch.bfloat16
    assert L + "wk.weight_scale_inv" not in meta
    assert meta[L + "k_norm.weight"].dtype == torch.float32
    assert any("indexer.wk is planned in bfloat16" in n for n in layout.notes) == fp8


@pytest.mark.parametrize("model", MODELS)
def test_tp_must_divide_the_heads(model):
    """4 heads over tp 8: vLLM refuses it (whole heads per TP rank), so does the table."""
    ck = _ckpt(model)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp=8 .*"
                                         r"valid tp with dp=1, ep: \[1, 2, 4\]"):
        destination_layout(ck.config, ck.params, "vllm:tp=8,ep")
