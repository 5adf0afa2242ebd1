"""Gemma 2 and Gemma 3 text: what vLLM stores for their norms and embedding, and their plans.

The layouts are pinned bit for bit to real vLLM 0.33.0 dumps in
test_vllm_oracle.py (tiny-gemma2, tiny-gemma3 at tp 1/2/4) and, for dp > 1,
to the reference in test_vllm_layout.py. This file states by hand what the
dumps showed about Gemma's particulars (norm weights kept as the
checkpoint's gamma, embedding not scaled, no lm_head in Gemma 2), then
plans the tiny models with --verify and the real gemma-2-2b-it config.
"""

from __future__ import annotations

import json
from pathlib import Path

from _paths import REPO
import pytest
import torch
from safetensors.torch import load_file

from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
from m2nkit.adapters.vllm import destination_layout
from m2nkit.engine.tools.cli import main

ORACLE = REPO / "tests" / "data" / "oracle"
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-gemma3"])
def test_vllm_keeps_gamma_and_the_unscaled_embedding(model):
    """GemmaRMSNorm computes x * (1 + w) at run time and the embedding is multiplied by
    sqrt(hidden_size) at run time: vLLM's parameters are the checkpoint's tensors as stored."""
    ck = load_file(str(ORACLE / model / "checkpoint" / "model.safetensors"))
    got = load_file(str(ORACLE / model / "tp1" / "rank0.safetensors"))
    for layer in range(2):
        for norm in NORMS:
            name = f"model.layers.{layer}.{norm}.weight"
            assert torch.equal(got[name], ck[name]), name          # not 1 + gamma
    assert torch.equal(got["model.norm.weight"], ck["model.norm.weight"])
    emb = ck["model.embed_tokens.weight"]
    assert torch.equal(got["model.embed_tokens.weight"][: emb.shape[0]], emb)  # not * sqrt(H)
    if model == "tiny-gemma3":
        assert torch.equal(got["model.layers.0.self_attn.q_norm.weight"],
                           ck["model.layers.0.self_attn.q_norm.weight"])
        assert "lm_head.weight" in got                             # tied: an alias
    else:
        assert not any("lm_head" in n for n in got)                # Gemma 2 has no lm_head


@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-gemma3"])
@pytest.mark.parametrize("inference", ["vllm:tp=2", "vllm:tp=4,dp=2"])
def test_plan_verify(tiny_checkpoints, capsys, model, inference):
    d = tiny_checkpoints(model)
    code = main(["plan", str(d), "--trainer", "fsdp:3", "--inference", inference, "--verify"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verify: all" in out and "ratio 1.000" in out


def _config(model: str, **changes) -> dict:
    config = json.loads((ORACLE / model / "checkpoint" / "config.json").read_text())
    return {**config, **changes}


@pytest.mark.parametrize("model,changes,message", [
    ("tiny-gemma2", {"tie_word_embeddings": False}, r"Gemma2ForCausalLM with "
     r"tie_word_embeddings=False is not supported: vLLM's Gemma2ForCausalLM has no lm_head"),
    ("tiny-gemma3", {"quantization_config": {"quant_method": "fp8"}},
     r"Gemma3ForCausalLM with a quantization_config is not supported"),
])
def test_refused_variants(model, changes, message):
    with pytest.raises(ValueError, match=message):
        destination_layout(_config(model, **changes), [], "vllm:tp=1")


def test_untied_gemma3_has_its_own_lm_head():
    config = _config("tiny-gemma3", tie_word_embeddings=False)
    layout = destination_layout(config, [], "vllm:tp=2")
    assert not layout.aliases
    assert {p.name for p in layout.params if p.worker == 0} >= {"lm_head.weight",
                                                                "model.embed_tokens.weight"}


def test_real_gemma_2_2b_config_plans():
    ckpt = read_checkpoint(REPO / "examples" / "configs" / "google__gemma-2-2b-it" / "config.json")
    shapes = {p.name: p.shape for p in ckpt.params}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2048, 2304)   # 8 heads x 256
    assert shapes["model.layers.25.self_attn.k_proj.weight"] == (1024, 2304)  # 4 KV heads
    assert "lm_head.weight" not in shapes                                     # tied
    layout = destination_layout(ckpt.config, checkpoint_metas(ckpt, "fsdp:8"), "vllm:tp=8")
    assert not layout.unknown and not layout.aliases
    idx = layout.param_index()
    assert idx[(0, "model.layers.0.self_attn.qkv_proj.weight")].shape == ((1 + 2) * 256, 2304)
    assert idx[(7, "model.layers.0.post_feedforward_layernorm.weight")].shape == (2304,)
