"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``) beyond the oracle dumps.

``test_vllm_oracle.py`` pins ``destination_layout`` and ``reference_load`` to
real vLLM 0.33.0 dumps of the three tiny models shipped in
``tests/data/oracle`` (bf16, fp8 blocks [32, 16], ``q_lora_rank: null``; tp
1/2/4, EP 2/4; fp8 dumped through ``oracle_fp8.py``). Here, with the real
checkpoint reader: dp > 1 (the oracle builds one TP group), the fp8 block
rules and their messages (written out by hand from
``quantization/utils/fp8_utils.py``), the MTP layer, and the published
DeepSeek-V3 / Kimi-K2 configs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _paths import REPO
import pytest
import torch
from safetensors.torch import load_file, save_file

from m2nkit.adapters.families.kinds import COLUMN, W13, Geometry
from m2nkit.adapters.families.quant import BlockScale, Fp8Block
from m2nkit.adapters.families.sizes import Sizes
from m2nkit.adapters.hf_checkpoint import (CheckpointError, full_checkpoint_tensors,
                                           read_checkpoint)
from m2nkit.adapters.vllm import InferenceSpec, destination_layout, reference_load
from _layouts import fill_worker

ORACLE = REPO / "tests" / "data" / "oracle"
CONFIGS = REPO / "examples" / "configs"


def _ckpt(model: str):
    return read_checkpoint(ORACLE / model / "checkpoint")


def _config(model: str) -> dict:
    return json.loads((ORACLE / model / "checkpoint" / "config.json").read_text())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16}.get(t.element_size(), torch.int32))


@pytest.mark.parametrize("model,tp,dp,ep", [
    ("tiny-deepseek-v3", 2, 2, False),              # MoE tp = dp*tp = 4
    ("tiny-deepseek-v3", 2, 2, True),               # 8 experts over ep 4
    ("tiny-deepseek-v3-fp8", 2, 2, True),
    ("tiny-deepseek-v3-fp8", 1, 2, False),          # Im 128 / 2: scales split by block
    ("tiny-deepseek-v3-no-q-lora", 4, 2, True),
])
def test_layout_equals_reference_with_dp(model, tp, dp, ep):
    """Every worker filled through the bindings equals reference_load, each element once."""
    ck = _ckpt(model)
    spec = InferenceSpec(tp, dp, ep)
    layout = destination_layout(ck.config, ck.params, spec)
    assert not layout.unknown and not layout.skipped
    full = full_checkpoint_tensors(ck)
    wire = {p.name: ck.read_full(p.name) for p in ck.params}
    for w in range(spec.num_workers):
        store, count = fill_worker(layout, wire, w)
        ref = reference_load(ck.config, full, spec, w)
        assert set(store) == set(ref) - set(layout.aliases)
        for name, t in store.items():
            assert bool((count[name] == 1).all()), f"{name} on worker {w}: not written once"
            assert t.dtype == ref[name].dtype and torch.equal(_bits(t), _bits(ref[name])), name


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-deepseek-v3-fp8"])
@pytest.mark.parametrize("spec,whole", [
    ("vllm:tp=2,dp=2,ep", True),                               # sequence-parallel MoE
    ("vllm:tp=2,dp=2,ep,all2all=flashinfer_all2allv", False),  # a backend that is not
    ("vllm:tp=2,dp=2", False),                                 # no EP
    ("vllm:tp=2,ep", False),                                   # dp = 1
])
def test_shared_experts_are_whole_under_sequence_parallel_moe(model, spec, whole):
    # vLLM 0.33.0 builds DeepseekV2MoE's shared experts with disable_tp when
    # ParallelConfig.use_sequence_parallel_moe (default all2all backend, EP,
    # tp > 1, dp > 1): the table missed it until the traced layout
    # (tests/integration/test_vllm_trace.py) disagreed.
    ck = _ckpt(model)
    cfg = _config(model)
    H, Is = cfg["hidden_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    layout = destination_layout(ck.config, ck.params, spec)
    shapes = {(p.worker, p.name): p.shape for p in layout.params}
    gate_up = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    down = "model.layers.1.mlp.shared_experts.down_proj.weight"
    split = 1 if whole else 2                                  # tp = 2
    for w in range(layout.num_workers):
        assert shapes[(w, gate_up)] == (2 * Is // split, H)
        assert shapes[(w, down)] == (H, Is // split)


def test_fp8_and_bf16_params_as_vllm_allocates_them():
    """fp8 weights + fp32 scales where vLLM quantizes; router, norms, embeddings in bf16;
    e_score_correction_bias fp32 in both (vLLM DeepseekV2MoE)."""
    for model, fp8 in (("tiny-deepseek-v3", False), ("tiny-deepseek-v3-fp8", True)):
        ck = _ckpt(model)
        layout = destination_layout(ck.config, ck.params, "vllm:tp=2")
        dtype = {p.name: p.dtype for p in layout.params if p.worker == 0}
        L = "model.layers.1"
        assert dtype[f"{L}.mlp.gate.e_score_correction_bias"] == torch.float32
        assert dtype[f"{L}.mlp.gate.weight"] == torch.bfloat16
        assert dtype["model.embed_tokens.weight"] == dtype["lm_head.weight"] == torch.bfloat16
        assert dtype[f"{L}.self_attn.kv_a_layernorm.weight"] == torch.bfloat16
        weight = torch.float8_e4m3fn if fp8 else torch.bfloat16
        for leaf in ("self_attn.fused_qkv_a_proj.weight", "self_attn.o_proj.weight",
                     "mlp.experts.routed_experts.w13_weight",
                     "mlp.shared_experts.down_proj.weight"):
            assert dtype[f"{L}.{leaf}"] == weight, leaf
            assert (f"{L}.{leaf}_scale_inv" in dtype) == fp8, leaf
        assert (layout.aliases.get(f"{L}.self_attn.mla_attn.mla_attn.kv_b_proj.weight")
                == f"{L}.self_attn.kv_b_proj.weight")


def test_block_scale_boxes_by_hand():
    """A scale is its weight's kind in block units (block [16, 8]: rows by 16, columns by 8)."""
    s = Sizes(H=32, V=64, nh=4, nkv=4, hd=8, I=64, Im=32, E=2, layers=1, tied=False,
              dtype=torch.bfloat16)
    block = Fp8Block(16, 8)
    col = BlockScale(COLUMN, block)
    assert col.wire_shape((64, 32), None, s) == (4, 4)              # [64, 32] -> [4, 4]
    g = Geometry.of(s, 2, 1, False, 1)                               # tp rank 1 of 2
    assert col.local_shape((64, 32), 1, g) == (2, 4)
    assert col.boxes((4, 4), None, g) == [(((2, 4), (0, 4)), (0, 0))]
    w13 = BlockScale(W13, block)                                     # Im 32 over moe tp 2
    assert w13.wire_shape((2, 64, 32), None, s) == (2, 4, 4)         # gate 2 rows, up 2 rows
    assert w13.local_shape((2, 64, 32), 1, g) == (2, 2, 4)
    assert w13.boxes((2, 4, 4), None, g) == [(((0, 2), (1, 2), (0, 4)), (0, 0, 0)),
                                             (((0, 2), (3, 4), (0, 4)), (0, 1, 0))]
    assert w13.violation("w", ("E", "2*Im", "H"), s, 2, 1, False) is None
    assert "block_n=16" in w13.violation("w", ("E", "2*Im", "H"), s, 4, 1, False)


@pytest.mark.parametrize("model,spec,needles", [
    # o_proj [64, nh*v = 64] row-parallel over 8: 8 columns per rank, block_k 16
    ("tiny-deepseek-v3-fp8", "vllm:tp=8",
     ["o_proj.weight_scale_inv: fp8 weight_block_size [32, 16] needs "
      "num_attention_heads*v_head_dim=64/tp=8=8 to be a multiple of block_k=16",
      "valid tp with dp=1: [1, 2, 4]"]),
    # without EP the experts split over dp*tp = 8: 16 rows of Im each, block_n 32
    ("tiny-deepseek-v3-fp8", "vllm:tp=4,dp=2",
     ["w13_weight_scale_inv: fp8 weight_block_size [32, 16] needs "
      "moe_intermediate_size=128/(dp*tp)=8=16 to be a multiple of block_n=32",
      "valid tp with dp=2: [1, 2]"]),
])
def test_fp8_splits_off_block_boundaries_are_refused(model, spec, needles):
    ck = _ckpt(model)
    with pytest.raises(ValueError) as e:
        destination_layout(ck.config, ck.params, spec)
    for needle in needles:
        assert needle in str(e.value)
    destination_layout(ck.config, ck.params, spec + ",ep" if "dp=2" in spec else "vllm:tp=4")


def test_unsupported_quantization_is_named():
    config = _config("tiny-deepseek-v3-fp8")
    for q, needle in (({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not supported"),
                      ({"quant_method": "fp8", "activation_scheme": "dynamic"},
                       "without weight_block_size")):
        with pytest.raises(ValueError, match=needle):
            destination_layout(dict(config, quantization_config=q), [], "vllm:tp=1")


def test_mtp_layer_is_planned_as_skipped(tmp_path):
    """A checkpoint with the MTP layer (index num_hidden_layers = 2): its tensors are wire
    tensors that vLLM's main model skips; with num_nextn_predict_layers 0 they are refused."""
    d = tmp_path / "ck"
    shutil.copytree(ORACLE / "tiny-deepseek-v3" / "checkpoint", d)
    tensors = load_file(d / "model.safetensors")
    mtp = {"model.layers.2.enorm.weight": torch.ones(64, dtype=torch.bfloat16),
           "model.layers.2.eh_proj.weight": torch.ones(64, 128, dtype=torch.bfloat16),
           "model.layers.2.self_attn.o_proj.weight": torch.ones(64, 64, dtype=torch.bfloat16),
           "model.layers.2.mlp.experts.0.gate_proj.weight":
               torch.ones(32, 64, dtype=torch.bfloat16)}
    save_file({**tensors, **mtp}, d / "model.safetensors", metadata={"format": "pt"})
    ck = read_checkpoint(d)
    assert set(mtp) <= set(ck.names)
    layout = destination_layout(ck.config, ck.params, "vllm:tp=2,ep")
    assert not layout.unknown
    for name in mtp:
        assert layout.skipped[name].startswith("multi-token-prediction layer 2 "
                                               "(num_nextn_predict_layers=1): vLLM's")
    ref = reference_load(ck.config, full_checkpoint_tensors(ck), "vllm:tp=2,ep", 1)
    assert not any(n.startswith("model.layers.2.") for n in ref)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with pytest.raises(CheckpointError, match="holds 4 tensor.* not expect: 'model.layers.2"):
        read_checkpoint(d)


def test_published_configs_plan():
    """DeepSeek-V3 (fp8 as shipped) and Kimi-K2 (model_type kimi_k2, unknown to transformers)
    from their config.json alone: every wire tensor bound, fp8 scales included."""
    ds = read_checkpoint(CONFIGS / "deepseek-ai__DeepSeek-V3" / "config.json")
    meta = {p.name: p for p in ds.params}
    L = "model.layers.3.mlp.experts"
    assert meta[f"{L}.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(meta[f"{L}.gate_up_proj.weight_scale_inv"].shape) == (256, 32, 56)
    kv_a = meta["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert tuple(kv_a.shape) == (5, 56)                 # ceil(576/128), 7168/128
    layout = destination_layout(ds.config, ds.params, "vllm:tp=8,ep")
    assert not layout.unknown and len(layout.bindings) + len(layout.skipped) == len(ds.params)
    assert all(n.startswith("model.layers.61.") for n in layout.skipped)   # the MTP layer
    kimi = read_checkpoint(CONFIGS / "moonshotai__Kimi-K2-Instruct" / "config.json")
    assert kimi.config.model_type == "kimi_k2" and kimi.config.n_routed_experts == 384
    layout = destination_layout(kimi.config, kimi.params, "vllm:tp=8,ep")
    assert not layout.unknown and len(layout.bindings) == len(kimi.params)
    with pytest.raises(ValueError, match=r"valid tp with dp=1: \[1, 2, 4, 8, 16\]"):
        destination_layout(ds.config, ds.params, "vllm:tp=32")


@pytest.mark.parametrize("model,sharded", [
    ("tiny-deepseek-v3", False),
    ("tiny-deepseek-v3-fp8", True),          # scales stacked across shard files
    ("tiny-deepseek-v3-no-q-lora", False),
])
def test_cli_plan_verify(tiny_checkpoints, capsys, model, sharded):
    """``m2nkit plan <tiny DeepSeek-V3> --trainer fsdp:3 --inference vllm:tp=2,ep --verify``."""
    from m2nkit.engine.tools.cli import main

    ckpt = tiny_checkpoints(model, sharded=sharded)
    code = main(["plan", str(ckpt), "--trainer", "fsdp:3", "--inference", "vllm:tp=2,ep",
                 "--verify"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "verify: all 2 workers hold exactly what vLLM's loaders would" in out.out


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-deepseek-v3-fp8",
                                  "tiny-deepseek-v3-no-q-lora"])
def test_tiny_deepseek_stores_a_nonzero_fp32_score_correction_bias(tiny_checkpoints, name):
    """As the published checkpoints do (issue 21): float32, not zeros, so a bias sent to the
    wrong place or through a lossy cast shows in a byte comparison."""
    tensors = load_file(str(tiny_checkpoints(name) / "model.safetensors"))
    bias = {n: t for n, t in tensors.items() if n.endswith("e_score_correction_bias")}
    assert list(bias) == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    t = bias["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert t.dtype == torch.float32 and t.shape == (8,)
    assert torch.unique(t).numel() == 8 and not torch.equal(t, t.to(torch.bfloat16).float())
    # everything else stays in the checkpoint dtype (bf16; fp8 weights and their fp32
    # scales), except what transformers' model class keeps in fp32 (its
    # _keep_in_fp32_modules_strict: the router, from transformers 5.24 on)
    from transformers import DeepseekV3ForCausalLM

    keep = tuple(getattr(DeepseekV3ForCausalLM, "_keep_in_fp32_modules_strict", None) or ())
    rest = {n: v.dtype for n, v in tensors.items() if n not in bias}
    fp32 = {n for n, d in rest.items() if d == torch.float32}
    allowed = {n for n in fp32 if n.endswith(keep) or (name.endswith("fp8")
                                                          and n.endswith("weight_scale_inv"))}
    assert fp32 == allowed, sorted(fp32 - allowed)
    assert set(rest.values()) <= {torch.bfloat16, torch.float8_e4m3fn, torch.float32}
