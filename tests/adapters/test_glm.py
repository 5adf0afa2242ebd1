"""GLM-4.5 (``Glm4MoeForCausalLM``) and GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``) tables.

No vLLM here: the shipped checkpoints (``tests/data/oracle/tiny-glm4-moe[-lite]``) read
by ``read_checkpoint`` (which now names them by the tables: on-disk names, stacked
experts ``...experts.gate_up_proj.weight``), planned with the family tables, must give
every worker of every shipped vLLM 0.33.0 dump its bytes exactly; and the family's
special tensors are checked by hand against those dumps, so a wrong name or place
fails saying which. ``tests/integration/test_vllm_trace.py`` holds the tables against
the trace at tp 1/2/4/8, EP and dp 2.
"""

from __future__ import annotations

import json

import pytest
import torch

from _oracle import ALL_FIXTURES, DATA, _oracle, assert_layout_equals_dumps
from _paths import REPO
from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
from m2nkit.adapters.vllm import InferenceSpec, destination_layout

MODELS = {"tiny-glm4-moe": "Glm4MoeForCausalLM", "tiny-glm4-moe-lite": "Glm4MoeLiteForCausalLM"}
GLM = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
FLASH = REPO / "examples" / "configs" / "zai-org__GLM-4.7-Flash" / "config.json"


def _wire(model: str) -> dict[str, torch.Tensor]:
    """The checkpoint's wire tensors as ``read_checkpoint`` names and reads them."""
    ckpt = read_checkpoint(DATA / model / "checkpoint")
    assert ckpt.architecture == MODELS[model]
    return {n: ckpt.read_full(n) for n in ckpt.names}


def _layout(model: str, spec: str):
    ckpt = read_checkpoint(DATA / model / "checkpoint")
    return destination_layout(ckpt.config, ckpt.params, spec)


def test_both_models_ship_tp_1_2_4_and_ep_2_4():
    for model in MODELS:
        assert {(p.values[1], p.values[2]) for p in GLM if p.values[0] == model} == {
            (1, False), (2, False), (4, False), (2, True), (4, True)}


@pytest.mark.parametrize("model,tp,ep,placement,dtype", GLM)
def test_table_plan_of_read_checkpoint_equals_every_dump(model, tp, ep, placement, dtype):
    wire = _wire(model)
    assert "model.layers.1.mlp.experts.gate_up_proj.weight" in wire, "stacked on the wire"
    assert not any(".experts.0." in n for n in wire), "no per-expert wire tensors"
    layout = _layout(model, str(InferenceSpec(tp, 1, ep, placement=placement, dtype=dtype)))
    assert not layout.unknown and layout.skipped == {}
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype, "table ")


@pytest.mark.parametrize("model", list(MODELS))
def test_router_weight_is_float32_in_vllm_and_cast_on_arrival(model):
    """``GateLinear(params_dtype=torch.float32)``: the bf16 wire router lands in a float32
    parameter (the plan casts it); ``e_score_correction_bias`` float32 on both sides,
    aliased only under ``experts.routed_experts`` (GLM hands vLLM no ``gate=``)."""
    wire = _wire(model)
    assert wire["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert wire["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    layout = _layout(model, "vllm:tp=2")
    params = {(p.worker, p.name): p for p in layout.params}
    assert params[1, "model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params[1, "model.layers.1.mlp.gate.weight"].shape == (4, 32)
    assert params[1, "model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    for rank in range(2):
        dump, _ = _oracle(model, 2, False, rank)
        assert torch.equal(dump["model.layers.1.mlp.gate.weight"],
                           wire["model.layers.1.mlp.gate.weight"].float())
    assert {a: c for a, c in layout.aliases.items() if ".gate." in a or "score" in a} == {
        "model.layers.1.mlp.experts.routed_experts.e_score_correction_bias":
            "model.layers.1.mlp.gate.e_score_correction_bias"}


@pytest.mark.parametrize("model", list(MODELS))
def test_shared_experts_are_split_by_tp_even_with_ep_and_dp(model):
    """GLM's shared experts are a plain ``Glm4MoeMLP`` (no ``disable_tp``): with EP, tp 2
    and dp 2 each worker still holds half of the gate rows and half of the up rows
    (DeepSeek-V3's are whole there: ``SHARED_MERGED``)."""
    layout = _layout(model, "vllm:tp=2,dp=2,ep")
    pre = "model.layers.1.mlp.shared_experts."
    got = {(b.worker, b.box, b.offset) for b in layout.bindings[pre + "up_proj.weight"]}
    assert got == {(w, ((16 * (w % 2), 16 * (w % 2) + 16), (0, 32)), (16, 0)) for w in range(4)}
    assert {p.shape for p in layout.params if p.name == pre + "gate_up_proj.weight"} == {(32, 32)}


def test_glm4_moe_qkv_bias_shares_kv_heads_at_tp4():
    """At tp 4 the 2 KV heads of 16 serve 2 workers each: worker w's ``qkv_proj.bias`` is
    q rows ``[16w, 16w + 16)``, then k and v rows of head ``w // 2``."""
    layout = _layout("tiny-glm4-moe", "vllm:tp=4")
    pre = "model.layers.0.self_attn."
    for part, width in (("q", 16), ("k", 16), ("v", 16)):
        got = {(b.worker, b.box, b.param, b.offset)
               for b in layout.bindings[pre + f"{part}_proj.bias"]}
        rows = {"q": lambda w: 16 * w, "k": lambda w: 16 * (w // 2), "v": lambda w: 16 * (w // 2)}
        at = {"q": 0, "k": 16, "v": 32}[part]
        assert got == {(w, ((rows[part](w), rows[part](w) + width),), pre + "qkv_proj.bias", (at,))
                       for w in range(4)}, part
    # q_norm/k_norm exist only with use_qk_norm (the tiny config sets it)
    assert {p.name for p in layout.params if p.worker == 0 and "norm" in p.name
            and "self_attn" in p.name} == {pre + "q_norm.weight", pre + "k_norm.weight",
                                           "model.layers.1.self_attn.q_norm.weight",
                                           "model.layers.1.self_attn.k_norm.weight"}


def test_glm4_moe_lite_mla_rows_are_deepseek_v3s():
    """GLM-4.7-Flash's attention is DeepSeek-V3's MLA: ``kv_a_proj_with_mqa`` lands whole
    after the ``q_a_proj`` rows of ``fused_qkv_a_proj`` on every worker, aliased under
    ``self_attn.mla_attn``; ``kv_b_proj`` column-split by heads."""
    layout = _layout("tiny-glm4-moe-lite", "vllm:tp=4,ep")
    pre = "model.layers.1.self_attn."
    assert {(b.worker, b.box, b.param, b.offset)
            for b in layout.bindings[pre + "kv_a_proj_with_mqa.weight"]} == {
        (w, ((0, 24), (0, 32)), pre + "fused_qkv_a_proj.weight", (16, 0)) for w in range(4)}
    assert {(b.worker, b.box) for b in layout.bindings[pre + "kv_b_proj.weight"]} == {
        (w, ((32 * w, 32 * w + 32), (0, 16))) for w in range(4)}
    assert layout.aliases[pre + "mla_attn.mla_attn.kv_b_proj.weight"] == pre + "kv_b_proj.weight"


def test_configs_vllm_cannot_load_are_refused_naming_the_key(tmp_path):
    base = json.loads((DATA / "tiny-glm4-moe" / "checkpoint" / "config.json").read_text())
    for model, key in (("tiny-glm4-moe", "head_dim"), ("tiny-glm4-moe-lite",
                                                         "first_k_dense_replace")):
        config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
        del config[key]
        with pytest.raises(ValueError, match=f"config has no {key}, which vLLM 0.33.0's"):
            destination_layout(config, [], "vllm:tp=1")
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp=8 .*"
                                         r"valid tp with dp=1, ep: \[1, 2, 4\]"):
        _layout("tiny-glm4-moe-lite", "vllm:tp=8,ep")
    quantized = {**base, "quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ValueError, match=r"quant_method='fp8'.*--layout traced"):
        destination_layout(quantized, [], "vllm:tp=1")
    lite = json.loads((DATA / "tiny-glm4-moe-lite" / "checkpoint" / "config.json").read_text())
    with pytest.raises(ValueError, match="Glm4MoeLiteForCausalLM without MLA"):
        destination_layout({**lite, "kv_lora_rank": None}, [], "vllm:tp=1")


def test_config_only_plan_of_the_tiny_glm4_moe_config_moves_the_minimum(tmp_path):
    """GLM-4.5 ships no config here (examples/configs): its tiny config.json alone, planned
    from the table with the MTP layer a published GLM-4.5 config declares."""
    from m2nkit.engine.plan import build_plan

    config = json.loads((DATA / "tiny-glm4-moe" / "checkpoint" / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ckpt = read_checkpoint(path)
    assert not ckpt.has_data
    assert "model.layers.2.eh_proj.weight" in ckpt.names     # the MTP layer, listed
    for spec in ("vllm:tp=4,ep", "vllm:tp=2,dp=2", "vllm:tp=1,dp=4,ep"):
        metas = checkpoint_metas(ckpt, "fsdp:8")
        layout = destination_layout(ckpt.config, metas, spec)
        assert not layout.unknown
        assert set(layout.skipped) == {n for n in ckpt.names if n.startswith("model.layers.2.")}
        plan = build_plan(metas, 8, layout)
        assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min, spec


@pytest.mark.parametrize("spec", ["vllm:tp=4,ep", "vllm:tp=4,dp=2,ep", "vllm:tp=2"])
def test_config_only_plan_of_glm_4_7_flash_moves_the_minimum(spec):
    """The published GLM-4.7-Flash config, planned from the table alone (fsdp:64): every
    byte moved once, no problem; its MTP layer 47 is listed and skipped. Its 20 heads
    do not split over tp 8: vLLM refuses that, and so does the table."""
    from m2nkit.engine.plan import build_plan

    ckpt = read_checkpoint(FLASH)
    assert any(n.startswith("model.layers.47.") for n in ckpt.names), "the MTP layer"
    metas = checkpoint_metas(ckpt, "fsdp:64")
    layout = destination_layout(ckpt.config, metas, spec)
    assert not layout.unknown and layout.skipped
    assert all(n.startswith("model.layers.47.") for n in layout.skipped)
    plan = build_plan(metas, 64, layout)
    assert plan.problems == []
    assert plan.nbytes_moved == plan.nbytes_min
    with pytest.raises(ValueError, match="num_attention_heads=20 is not divisible by tp=8"):
        destination_layout(ckpt.config, metas, "vllm:tp=8,ep")
