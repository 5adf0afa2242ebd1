"""reference_load and destination_layout against real vLLM 0.33.0 dumps.

The dumps in tests/data/oracle were made by vLLM's own model classes and
weight loaders (``shared/tools/vllm_oracle/oracle.py``; regenerate with
``tests/data/oracle/regenerate.py``), one safetensors file per TP rank, every
parameter pre-filled with NaN so an element vLLM did not write stays NaN. CI
has no vLLM; these files are the real run. The oracle covers one TP group
(dp = 1); dp > 1 is covered by test_vllm_layout.py against the reference.

What vLLM showed (and these tests pin):
* every element of every parameter is written (no NaN left), vocab padding
  rows included: ``VocabParallelEmbedding.weight_loader`` fills them with 0;
* expert names ``...experts.routed_experts.w13_weight``/``w2_weight``;
* aliases (same storage): tied ``lm_head.weight`` -> ``model.embed_tokens.weight``,
  Qwen3-MoE ``mlp.experts.gate.weight`` -> ``mlp.gate.weight``;
* with EP, an expert count the EP size does not divide is accepted: E // ep
  experts per rank, one more on the first E % ep ranks (10 over ep 4: 3,3,2,2),
  ranks past E hold none; round-robin placement is honoured for a model with
  expert groups (DeepSeek-V3 n_group=2) and falls back to linear without;
* experts stored stacked on disk (``experts.gate_up_proj``) load like per-expert ones;
* DeepSeek-V3 (MLA + MoE, bf16 and fp8 blocks): ``fused_qkv_a_proj`` replicated,
  q rows then kv rows; MLA modules aliased under ``self_attn.mla_attn.*``; fp8
  ``weight_scale_inv`` split like its weight in block units; the router's
  ``e_score_correction_bias`` float32 (tests/data/oracle/README.md lists the rest);
* ``--dtype auto`` (vLLM's default): a float32 config dtype becomes bfloat16;
  without a config dtype the checkpoint's tensor dtype decides (bfloat16 and
  float32 give bfloat16, float16 gives float16); ``--dtype float16`` overrides.

A layout folder is ``tp<T>[_ep][_round_robin][_<dtype>]``: the spec options
the dump was made with (dtype ``auto`` when none is named).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from m2nkit.adapters.families import supported_architectures
from m2nkit.adapters.vllm import InferenceSpec, destination_layout, reference_load
from m2nkit.manifest import ParamMeta

from _oracle import (ALL_FIXTURES, DATA, FIXTURES, _architecture, _layout_dir,  # noqa: F401
                     _model, _oracle, _same, assert_layout_equals_dumps)


def test_fixtures_are_shipped():
    models = {p.values[0] for p in ALL_FIXTURES}
    assert models >= {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied",
                      "tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen3-moe-e10", "tiny-mixtral-e6",
                      "tiny-deepseek-v3-groups", "tiny-qwen3-moe-stacked", "tiny-qwen3-nodtype",
                      "tiny-qwen3-nodtype-fp32", "tiny-qwen3-nodtype-fp16", "tiny-qwen3-fp32",
                      "tiny-deepseek-v3", "tiny-deepseek-v3-fp8", "tiny-deepseek-v3-no-q-lora",
                      "tiny-deepseek-v32", "tiny-glm-moe-dsa"}
    for model in ("tiny-deepseek-v3", "tiny-deepseek-v3-fp8"):   # MLA + MoE, bf16 and fp8 blocks
        assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == model} == {
            (1, False), (2, False), (4, False), (2, True), (4, True)}
    assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == "tiny-qwen3-moe"} >= {
        (1, False), (2, False), (8, False), (2, True), (4, True), (8, True)}
    assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == "tiny-gpt-oss"} == {
        (1, False), (2, False), (4, False), (2, True), (4, True)}
    for gemma in ("tiny-gemma2", "tiny-gemma3"):
        assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == gemma} == {
            (1, False), (2, False), (4, False)}


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_reference_load_equals_vllm(model, tp, ep, placement, dtype):
    config, ckpt, _ = _model(model)
    spec = InferenceSpec(tp, 1, ep, placement=placement, dtype=dtype)
    for rank in range(tp):
        vllm, meta = _oracle(model, tp, ep, rank, placement, dtype)
        assert meta["vllm_version"] == "0.33.0"
        assert (int(meta["tp_size"]), int(meta["tp_rank"])) == (tp, rank)
        assert meta["enable_expert_parallel"] == str(ep)
        assert meta.get("expert_placement_strategy", "linear") == placement
        assert json.loads(meta["not_fully_loaded"]) == {}, "vLLM left elements unwritten"
        ours = reference_load(config, ckpt, spec, rank, fill=float("nan"))
        assert set(ours) == set(vllm), set(ours) ^ set(vllm)
        for alias, canonical in json.loads(meta["aliases"]).items():
            assert ours[alias] is ours[canonical]
        for name in vllm:
            _same(ours[name], vllm[name], f"{model} tp={tp} ep={ep} rank {rank} {name}")


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_destination_layout_equals_vllm(model, tp, ep, placement, dtype):
    config, _, wire = _model(model)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    layout = destination_layout(config, metas, InferenceSpec(tp, 1, ep, placement=placement,
                                                             dtype=dtype))
    assert not layout.unknown
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype)


# --------------------------------------------------------------------------
# what vLLM did, written out by hand, and m2nkit doing the same


def _experts_per_rank(model: str, layout: str, param: str) -> list[int]:
    """Local expert count of ``param`` in each rank's dump of ``layout``."""
    out = []
    for f in sorted((DATA / model / layout).glob("rank*.safetensors"),
                    key=lambda p: int(p.stem[4:])):
        with safe_open(str(f), "pt") as h:
            out.append(h.get_slice(param).get_shape()[0])
    return out


def test_vllm_places_an_uneven_expert_count_remainder_first():
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert _experts_per_rank("tiny-qwen3-moe-e10", "tp4_ep", w13) == [3, 3, 2, 2]
    assert _experts_per_rank("tiny-qwen3-moe-e10", "tp8_ep", w13) == [2, 2, 1, 1, 1, 1, 1, 1]
    w13 = "model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"
    assert _experts_per_rank("tiny-mixtral-e6", "tp8_ep", w13) == [1, 1, 1, 1, 1, 1, 0, 0]
    # and m2nkit plans the same local shapes (the full comparison is test_destination_layout_*)
    config, _, wire = _model("tiny-qwen3-moe-e10")
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    layout = destination_layout(config, metas, "vllm:tp=4,ep")
    assert [p.shape[0] for p in layout.params if p.name.endswith("layers.0.mlp.experts."
                                                                   "routed_experts.w13_weight")] \
        == [3, 3, 2, 2]


def test_round_robin_falls_back_to_linear_without_expert_groups():
    """Qwen3-MoE passes no num_expert_group: vLLM places linearly (identical dumps)."""
    for rank in range(4):
        rr, meta = _oracle("tiny-qwen3-moe-e10", 4, True, rank, "round_robin")
        linear, _ = _oracle("tiny-qwen3-moe-e10", 4, True, rank)
        assert meta["expert_placement_strategy"] == "round_robin"
        assert rr.keys() == linear.keys() and all(torch.equal(rr[n], linear[n]) for n in rr)
    config, _, wire = _model("tiny-qwen3-moe-e10")
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    layout = destination_layout(config, metas, "vllm:tp=4,ep,placement=round_robin")
    assert len(layout.notes) == 1 and layout.notes[0].startswith(
        "round_robin placement falls back to linear, as vLLM 0.33.0 does: "
        "Qwen3MoeForCausalLM passes no num_expert_group")


def _deepseek_groups():
    """Config, per-layer stacked expert wire tensors, and m2nkit ``Sizes`` of the tiny
    DeepSeek-V3 with expert groups (built by hand, so that the expert kinds and the
    placement rule are checked apart from the family module)."""
    from m2nkit.adapters.families.sizes import Sizes

    config, _, wire = _model("tiny-deepseek-v3-groups")
    s = Sizes(H=config["hidden_size"], V=config["vocab_size"], nh=config["num_attention_heads"],
              nkv=config["num_key_value_heads"], hd=16, I=config["intermediate_size"],
              Im=config["moe_intermediate_size"], E=config["n_routed_experts"],
              layers=config["num_hidden_layers"], tied=False, dtype=torch.bfloat16)
    return config, wire, s


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_round_robin_with_expert_groups_matches_vllm(placement):
    """DeepSeek-V3 with n_group=2: vLLM honours round robin (rank r: r, r+4, r+8) with
    10 experts over ep 4; the expert kinds' boxes and loads equal its w13/w2 bit for bit."""
    from m2nkit.adapters.families.kinds import W13, W2, Geometry

    config, wire, s = _deepseek_groups()
    by_hand = {"linear": [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]],
               "round_robin": [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]}[placement]
    for rank in range(4):
        vllm, meta = _oracle("tiny-deepseek-v3-groups", 4, True, rank, placement)
        assert json.loads(meta["not_fully_loaded"]) == {}
        g = Geometry.of(s, 4, 1, True, rank, placement)
        assert list(g.experts) == by_hand[rank]
        for layer in range(s.layers):
            prefix = f"model.layers.{layer}.mlp.experts"
            for kind, leaf, param in ((W13, "gate_up_proj", "w13_weight"),
                                      (W2, "down_proj", "w2_weight")):
                full = wire[f"{prefix}.{leaf}.weight"]
                want = vllm[f"{prefix}.routed_experts.{param}"]
                assert torch.equal(want, full[by_hand[rank]])          # vLLM, stated by hand
                shape = kind.local_shape(tuple(full.shape), 1, g)
                loaded = torch.full(shape, float("nan"), dtype=full.dtype)
                kind.load(loaded, full, None, g)
                bound = torch.full(shape, float("nan"), dtype=full.dtype)
                for box, off in kind.boxes(tuple(full.shape), None, g):
                    bound[tuple(slice(o, o + b - a) for o, (a, b) in zip(off, box))] = \
                        full[tuple(slice(a, b) for a, b in box)]
                _same(loaded, want, f"rank {rank} {param} (load)")
                _same(bound, want, f"rank {rank} {param} (boxes)")


def test_round_robin_decision_follows_vllm():
    """vLLM's rule (expert_map_manager.py determine_expert_placement_strategy): round robin
    needs EP, num_expert_group > 1, and with dp > 1 an all2all backend with round-robin
    routing tables. The oracle builds one TP group (dp = 1); dp > 1 rests on the rule."""
    from m2nkit.adapters.families.table import Family, HFNaming
    from m2nkit.adapters.vllm.expert_placement import expert_placement
    from m2nkit.adapters.vllm.spec import parse_inference_spec as spec

    config, _, s = _deepseek_groups()
    grouped = Family("DeepseekV3ForCausalLM", HFNaming(), (), lambda c: s,
                     num_expert_group=lambda c: c["n_group"])
    ungrouped = Family("DeepseekV3ForCausalLM", HFNaming(), (), lambda c: s)
    assert expert_placement(grouped, config, spec("vllm:tp=4,ep,placement=round_robin")) \
        .strategy == "round_robin"                             # the dump above
    assert expert_placement(grouped, config, spec("vllm:tp=4,ep")).strategy == "linear"
    for text, why in [("vllm:tp=4,placement=round_robin", "no expert parallelism"),
                      ("vllm:tp=2,dp=2,ep,placement=round_robin", "all2all=allgather_reducescatter"),
                      ("vllm:tp=2,dp=2,ep,placement=round_robin,all2all=deepep_high_throughput",
                       "deepep_low_latency or nixl_ep")]:
        p = expert_placement(grouped, config, spec(text))
        assert p.strategy == "linear" and why in p.note, (text, p)
    p = expert_placement(grouped, config,
                         spec("vllm:tp=2,dp=2,ep,placement=round_robin,all2all=deepep_low_latency"))
    assert (p.strategy, p.note) == ("round_robin", None)
    from m2nkit.adapters.families import family_for

    assert expert_placement(family_for(config), config, spec(
        "vllm:tp=4,ep,placement=round_robin")).strategy == "round_robin"   # the family's n_group
    p = expert_placement(ungrouped, config, spec("vllm:tp=4,ep,placement=round_robin"))
    assert p.strategy == "linear" and "passes no num_expert_group" in p.note
    one_group = Family("X", HFNaming(), (), lambda c: s, num_expert_group=lambda c: 1)
    assert "num_expert_group=1" in expert_placement(
        one_group, config, spec("vllm:tp=4,ep,placement=round_robin")).note


def test_experts_stacked_on_disk_read_and_laid_out_like_vllm():
    """A checkpoint with experts stacked on disk (``experts.gate_up_proj``), read by
    read_checkpoint, planned by destination_layout, equals vLLM's dump of it."""
    from m2nkit.adapters.hf_checkpoint import read_checkpoint

    ckpt = read_checkpoint(DATA / "tiny-qwen3-moe-stacked" / "checkpoint")
    names = ckpt.names
    assert "model.layers.0.mlp.experts.gate_up_proj.weight" in names
    assert ckpt.disk_names("model.layers.0.mlp.experts.gate_up_proj.weight") == (
        "model.layers.0.mlp.experts.gate_up_proj",)
    wire = {n: ckpt.read_full(n) for n in names}
    for tp, ep in ((2, False), (4, True)):
        layout = destination_layout(ckpt.config, list(ckpt.params), InferenceSpec(tp, 1, ep))
        assert not layout.unknown and not layout.notes
        for rank in range(tp):
            vllm, _ = _oracle("tiny-qwen3-moe-stacked", tp, ep, rank)
            store = layout.allocate(rank, fill=float("nan"))
            for p in layout.params:
                if p.worker == rank:
                    for box in p.zero_boxes:
                        store[p.name][tuple(slice(a, b) for a, b in box)] = 0
            for wname, bindings in layout.bindings.items():
                for b in bindings:
                    if b.worker == rank:
                        dst = tuple(slice(o, o + (c - a)) for o, (a, c) in zip(b.offset, b.box))
                        store[b.param][dst] = wire[wname][tuple(slice(a, c) for a, c in b.box)]
            for name, t in store.items():
                _same(t, vllm[name], f"stacked tp={tp} ep={ep} rank {rank} {name}")
        # the same bytes vLLM loads from the per-expert checkpoint of the same weights
        per_expert, _ = _oracle("tiny-qwen3-moe", tp, ep, 0)
        stacked, _ = _oracle("tiny-qwen3-moe-stacked", tp, ep, 0)
        assert all(torch.equal(per_expert[n], stacked[n]) for n in per_expert)


@pytest.mark.parametrize("model,layout,vllm_dtype", [
    ("tiny-qwen3-nodtype", "tp1", torch.bfloat16),          # no config dtype, bf16 tensors
    ("tiny-qwen3-nodtype-fp32", "tp1", torch.bfloat16),     # no config dtype, fp32 tensors
    ("tiny-qwen3-nodtype-fp16", "tp1", torch.float16),      # no config dtype, fp16 tensors
    ("tiny-qwen3-fp32", "tp1", torch.bfloat16),             # config float32
    ("tiny-qwen3-nodtype", "tp1_float16", torch.float16),   # --dtype float16
])
def test_model_dtype_is_vllms(model, layout, vllm_dtype):
    """What vLLM 0.33.0 allocated (stated by hand from the dumps), and m2nkit the same."""
    f = DATA / model / layout / "rank0.safetensors"
    with safe_open(str(f), "pt") as h:
        assert h.metadata()["dtype"] == str(vllm_dtype).removeprefix("torch.")
        assert {h.get_slice(n).get_dtype() for n in h.keys()} == {
            {torch.bfloat16: "BF16", torch.float16: "F16"}[vllm_dtype]}
    config, ckpt, wire = _model(model)
    dtype = "float16" if layout.endswith("float16") else "auto"
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    layout_ = destination_layout(config, metas, InferenceSpec(1, dtype=dtype))
    assert {p.dtype for p in layout_.params} == {vllm_dtype}
    ref = reference_load(config, ckpt, InferenceSpec(1, dtype=dtype), 0)
    assert {t.dtype for t in ref.values()} == {vllm_dtype}
    # none of these is simply the config's dtype: the plan says how it was decided
    assert len(layout_.notes) == 1 and layout_.notes[0].startswith(
        f"parameters are {str(vllm_dtype).removeprefix('torch.')}"), layout_.notes
