"""GLM-4.5, GLM-4.7-Flash, GLM-5 and DeepSeek-V3.2 traced from vLLM 0.33.0's own loaders.

Here these architectures (``Glm4MoeForCausalLM``, ``Glm4MoeLiteForCausalLM``,
``GlmMoeDsaForCausalLM``, ``DeepseekV32ForCausalLM``) are planned by the trace alone
(GLM-4.5 and GLM-4.7-Flash have family tables now, pinned by tests/adapters/test_glm.py;
this file keeps their traced path): their wire tensors are transformers 5's in-memory tensors (``state_dict()`` of
transformers' own class after ``from_pretrained`` of the shipped checkpoint:
stacked experts ``mlp.experts.gate_up_proj`` [E, 2*Im, H] without ``.weight``,
the fp32 router buffer ``e_score_correction_bias``), and their destination
layout is ``trace_destination``'s alone. Each layout is checked bit for bit
against the real vLLM dumps in ``tests/data/oracle/tiny-{glm4-moe, glm4-moe-lite,
glm-moe-dsa, deepseek-v32}`` (``shared/tools/vllm_oracle/oracle.py``), and the
family's special tensors are checked by hand against those dumps, so a wrong
name or place fails with a message that says which.

Two tracer rules these families need are pinned here too: the per-expert
feeds read off transformers' conversion rules (vLLM's DeepSeek-V2 and
GLM-4.7-Flash loaders take no stacked experts) and the GPU sparse attention
stand-in (vLLM's CPU platform refuses to build DSA layers).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import pytest
import torch

from _oracle import ALL_FIXTURES, DATA, _oracle, assert_layout_equals_dumps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


#: tiny model -> its architecture (transformers' class, vLLM's architecture name)
MODELS = {
    "tiny-glm4-moe": "Glm4MoeForCausalLM",
    "tiny-glm4-moe-lite": "Glm4MoeLiteForCausalLM",
    "tiny-glm-moe-dsa": "GlmMoeDsaForCausalLM",
    "tiny-deepseek-v32": "DeepseekV32ForCausalLM",
}
MLA = ("tiny-glm4-moe-lite", "tiny-glm-moe-dsa", "tiny-deepseek-v32")
DSA = ("tiny-glm-moe-dsa", "tiny-deepseek-v32")
FIXTURES = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
LAYOUTS = {(1, False), (2, False), (4, False), (2, True), (4, True)}


@lru_cache(maxsize=None)
def _wire(model: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors of the shipped checkpoint: the independent reference."""
    import transformers

    ckpt = DATA / model / "checkpoint"
    hf = getattr(transformers, MODELS[model]).from_pretrained(ckpt)
    return dict(hf.state_dict())


def _metas(wire):
    from m2nkit.manifest import ParamMeta

    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]


@lru_cache(maxsize=None)
def _trace(model: str, tp: int, ep: bool):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from m2nkit.adapters.vllm import InferenceSpec
    from m2nkit.adapters.vllm.trace import trace_destination

    return trace_destination(DATA / model / "checkpoint", _metas(_wire(model)),
                             InferenceSpec(tp, 1, ep))


def test_every_family_ships_all_layouts():
    for model, arch in MODELS.items():
        config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
        assert config["architectures"] == [arch]
        assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == model} == LAYOUTS
    for model in MLA:   # transformers' config classes drop these; vLLM reads them
        config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
        assert (config["first_k_dense_replace"], config["topk_method"]) == (1, "noaux_tc")


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_traced_layout_equals_vllm_dumps(model, tp, ep, placement, dtype):
    layout = _trace(model, tp, ep)
    assert layout.notes == ("layout traced from vLLM's own weight loaders",)
    assert layout.skipped == {}, "every wire tensor lands somewhere"
    assert_layout_equals_dumps(layout, _wire(model), model, tp, ep, placement, dtype, "traced ")


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t[lo:hi]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("model", list(MODELS))
def test_router_bias_is_fp32_and_the_first_layer_dense(model):
    """``e_score_correction_bias``: fp32 on the wire (transformers keeps it so), non-zero,
    and fp32, whole and equal on every vLLM worker; layer 0 is a dense MLP
    (``first_k_dense_replace``), layer 1 has routed experts and a shared expert."""
    wire = _wire(model)
    bias = wire["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0, "a random fp32 bias"
    for rank in range(4):
        dump, meta = _oracle(model, 4, True, rank)
        got = dump["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert _bits_equal(got, bias), f"{model} rank {rank}: the bias is not the wire's fp32"
        assert "model.layers.0.mlp.gate_up_proj.weight" in dump, f"{model}: layer 0 dense"
        assert "model.layers.0.mlp.gate.weight" not in dump, f"{model}: layer 0 has no router"
        assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in dump
        # EP 4 over 4 experts: worker r holds expert r whole (gate rows, then up rows)
        w13 = dump["model.layers.1.mlp.experts.routed_experts.w13_weight"]
        assert _bits_equal(w13, wire["model.layers.1.mlp.experts.gate_up_proj"][rank:rank + 1])


def test_glm4_moe_qkv_bias_and_shared_kv_heads():
    """GLM-4.5: q/k/v biases fuse into ``qkv_proj.bias`` as the weights do; at tp 4 the
    2 KV heads are shared by 2 workers each; ``q_norm``/``k_norm`` (head_dim) replicated;
    the router weight is fp32 in vLLM (``GateLinear(params_dtype=float32)``)."""
    wire = _wire("tiny-glm4-moe")
    hd, nh, nkv = 16, 4, 2
    pre = "model.layers.1.self_attn."
    for rank in range(4):
        dump, _ = _oracle("tiny-glm4-moe", 4, False, rank)
        bias = dump[pre + "qkv_proj.bias"]
        kv = rank // (4 // nkv)
        q = wire[pre + "q_proj.bias"][rank * hd:(rank + 1) * hd]
        k = wire[pre + "k_proj.bias"][kv * hd:(kv + 1) * hd]
        v = wire[pre + "v_proj.bias"][kv * hd:(kv + 1) * hd]
        assert bias.shape == (nh // 4 * hd + 2 * hd,)
        assert torch.equal(bias, torch.cat([q, k, v])), f"rank {rank}: [q | k | v] bias rows"
        for norm in ("q_norm.weight", "k_norm.weight"):
            assert _bits_equal(dump[pre + norm], wire[pre + norm]), f"{norm} replicated"
        gate = dump["model.layers.1.mlp.gate.weight"]
        assert gate.dtype == torch.float32
        assert torch.equal(gate, wire["model.layers.1.mlp.gate.weight"].float())


@pytest.mark.parametrize("model", MLA)
def test_fused_qkv_a_proj_is_whole_on_every_worker(model):
    """MLA: vLLM's ``fused_qkv_a_proj`` = ``q_a_proj`` rows, then ``kv_a_proj_with_mqa``
    rows, whole on every worker (``DeepSeekV2FusedQkvAProjLinear``, not split by TP);
    ``q_b_proj``/``kv_b_proj`` column-split; aliased under ``self_attn.mla_attn.*``."""
    wire = _wire(model)
    pre = "model.layers.1.self_attn."
    qa, kva = wire[pre + "q_a_proj.weight"], wire[pre + "kv_a_proj_with_mqa.weight"]
    for rank in range(4):
        dump, meta = _oracle(model, 4, False, rank)
        fused = dump[pre + "fused_qkv_a_proj.weight"]
        assert torch.equal(fused, torch.cat([qa, kva])), f"{model} rank {rank}"
        q_b = wire[pre + "q_b_proj.weight"]
        per = q_b.shape[0] // 4
        assert torch.equal(dump[pre + "q_b_proj.weight"], _rows(q_b, rank * per, (rank + 1) * per))
        assert json.loads(meta["aliases"])[pre + "mla_attn.fused_qkv_a_proj.weight"] == \
            pre + "fused_qkv_a_proj.weight"
    layout = _trace(model, 4, False)
    assert {(b.worker, b.box, b.param, b.offset)
            for b in layout.bindings[pre + "kv_a_proj_with_mqa.weight"]} == {
        (w, ((0, kva.shape[0]), (0, kva.shape[1])), pre + "fused_qkv_a_proj.weight",
         (qa.shape[0], 0)) for w in range(4)}


@pytest.mark.parametrize("model", DSA)
def test_indexer_wk_weights_proj_fuses_wk_then_weights_proj_unsplit(model):
    """DSA indexer: vLLM's ``indexer.wk_weights_proj`` holds ``wk`` rows then
    ``weights_proj`` rows, whole on every worker (``MergedColumnParallelLinear(...,
    disable_tp=True)``, ``model_executor/models/deepseek_v2.py``, ``Indexer``);
    ``wq_b`` is replicated; ``k_norm`` (a LayerNorm with bias) is fp32 in vLLM."""
    wire = _wire(model)
    pre = "model.layers.1.self_attn.indexer."
    wk, wp = wire[pre + "wk.weight"], wire[pre + "weights_proj.weight"]
    for tp, ep in ((2, False), (4, True)):
        for rank in range(tp):
            dump, meta = _oracle(model, tp, ep, rank)
            fused = dump[pre + "wk_weights_proj.weight"]
            assert fused.shape == (wk.shape[0] + wp.shape[0], wk.shape[1]), \
                f"{model} tp {tp}: wk_weights_proj must not be split by TP"
            assert torch.equal(fused, torch.cat([wk, wp.to(fused.dtype)])), \
                f"{model} tp {tp} rank {rank}: [wk | weights_proj] rows"
            assert torch.equal(dump[pre + "wq_b.weight"], wire[pre + "wq_b.weight"])
            for leaf in ("k_norm.weight", "k_norm.bias"):
                assert dump[pre + leaf].dtype == torch.float32
                assert torch.equal(dump[pre + leaf], wire[pre + leaf].float())
    layout = _trace(model, 4, True)
    assert {(b.worker, b.param, b.offset) for b in layout.bindings[pre + "weights_proj.weight"]} \
        == {(w, pre + "wk_weights_proj.weight", (wk.shape[0], 0)) for w in range(4)}


def test_tableless_experts_are_fed_per_expert_by_transformers_rules():
    """vLLM's DeepSeek-V2 loader (GLM-5, DeepSeek-V3.2) and GLM-4.7-Flash's take only
    per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj.weight``): the tracer
    reads those names off transformers' own conversion rule for the config's
    ``model_type`` (``conversion_mapping.py``: ``MergeModulelist(dim=0)`` then
    ``Concatenate(dim=1)``) and feeds expert ``e``'s gate and up rows of the stacked
    wire tensor under them. A fusion that is not that rule gives no pattern."""
    from m2nkit.adapters.vllm.trace import per_expert_feeds, transformers_experts_on_disk
    from m2nkit.manifest import ParamMeta

    patterns = {"gate": "{prefix}.experts.{e}.gate_proj.weight",
                "up": "{prefix}.experts.{e}.up_proj.weight",
                "down": "{prefix}.experts.{e}.down_proj.weight"}
    for model in MODELS:
        config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
        assert transformers_experts_on_disk(config) == patterns, model
    # the same rule gives the patterns m2nkit's tables hold where a table exists
    from m2nkit.adapters.families import family

    for arch, model_type in (("DeepseekV3ForCausalLM", "deepseek_v3"),
                             ("Qwen3MoeForCausalLM", "qwen3_moe"),
                             ("MixtralForCausalLM", "mixtral")):
        assert transformers_experts_on_disk({"model_type": model_type}) == \
            dict(family(arch).hf.experts_on_disk), arch
    # Qwen3-VL-MoE stacks experts on disk, transposed: no per-expert names to guess
    assert transformers_experts_on_disk({"model_type": "qwen3_vl_moe"}) == {}
    assert transformers_experts_on_disk({"model_type": "llama"}) == {}
    meta = ParamMeta("model.layers.1.mlp.experts.gate_up_proj", torch.bfloat16, (4, 64, 32))
    feeds = per_expert_feeds(meta, patterns)
    assert [(f.name, f.shape, f.offset) for f in feeds[2:4]] == [
        ("model.layers.1.mlp.experts.1.gate_proj.weight", (32, 32), (1, 0, 0)),
        ("model.layers.1.mlp.experts.1.up_proj.weight", (32, 32), (1, 32, 0))]
    layout = _trace("tiny-glm4-moe-lite", 2, False)
    wire = _wire("tiny-glm4-moe-lite")
    assert {(b.worker, b.box) for b in layout.bindings["model.layers.1.mlp.experts.gate_up_proj"]
            if b.offset == (0, 0, 0)} == {(0, ((0, 4), (0, 16), (0, 32))),
                                          (1, ((0, 4), (16, 32), (0, 32)))}, \
        "at tp 2 worker w holds gate rows [16w, 16w + 16) of every expert, first"
    assert wire["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 32)


def test_sparse_attention_stand_in_is_scoped():
    """Off the context vLLM's CPU platform refuses DSA layers as it always does, and no
    workspace stand-in or cached sparse backend choice is left behind."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm.v1.worker import workspace

    from m2nkit.adapters.vllm.stand_in import gpu_sparse_attention

    assert current_platform.is_cpu()
    sparse = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                     block_size=64, use_mla=True, use_sparse=True)
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        current_platform.get_attn_backend_cls(None, sparse)
    before = workspace._manager
    with gpu_sparse_attention():
        assert current_platform.get_attn_backend_cls(None, sparse).endswith(
            "flashmla_sparse.FlashMLASparseBackend")
        assert workspace._manager is not None
    assert workspace._manager is before
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        current_platform.get_attn_backend_cls(None, sparse)
