#!/usr/bin/env python
"""Regenerate the vLLM oracle fixtures in this folder (needs the oracle venv).

For each built-in tiny model: save the checkpoint (seed 0; config.json +
model.safetensors only), then run vLLM 0.33.0's real loaders through
``shared/tools/vllm_oracle/oracle.py`` for every layout in ``LAYOUTS`` and
keep one safetensors dump per rank. Run with the m2nkit venv:

    /work/venv/bin/python tests/data/oracle/regenerate.py \
        [--oracle-python /tmp/oracle/venv/bin/python] \
        [--oracle /work/shared/tools/vllm_oracle/oracle.py] [--out DIR] [--jobs N] \
        [--models tiny-gpt-oss ...]

Layouts are chosen to keep the folder under ~25 MB: tp 1, 2, 8 for dense
models (tp 2 covers one KV head per rank, tp 8 four ranks sharing a KV head;
tp 4 adds no new rule), all of tp 1/2/4/8 and EP 2/4/8 for Qwen3-MoE, and
tp 1/2/8 plus EP 2/4/8 for Mixtral, tp 1/2/4 for Gemma 2/3, tp 1/2/4 plus
EP 2/4 for GPT-OSS (bf16; the tiny model's gate/up/down biases are random,
so the rank-0-only ``w2_bias`` is visible).

Besides the built-in tiny models, ``CHECKPOINTS`` builds variants that pin
vLLM's expert placement and dtype rules: an expert count EP does not divide
(``-e10``, ``-e6``), experts stored stacked on disk (``-stacked``), configs
without a dtype or with float32 (``tiny-qwen3-nodtype*``, ``-fp32``), and a
DeepSeek-V3 with two expert groups (round-robin placement), and tiny GLM-4.5,
GLM-4.7-Flash, GLM-5 and DeepSeek-V3.2 from transformers' own config classes
(``_glm``; no m2nkit family table). A layout may add
options after ``(tp, ep)``: ``"round_robin"`` (``--expert-placement``) or a
dtype (``--dtype``); without one vLLM's default ``--dtype auto`` is passed.
The folder is named ``tp<T>[_ep][_<option>...]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent

DENSE = [(1, False), (2, False), (8, False)]
LAYOUTS: dict[str, list[tuple]] = {  # (tp, ep, *options)
    "tiny-llama": DENSE,
    "tiny-qwen2": DENSE,
    "tiny-qwen3": DENSE,
    "tiny-qwen3-tied": DENSE,
    "tiny-qwen3-moe": [(1, False), (2, False), (4, False), (8, False),
                       (2, True), (4, True), (8, True)],
    "tiny-mixtral": [(1, False), (2, False), (8, False), (2, True), (4, True), (8, True)],
    # GPT-OSS (4 KV heads: vLLM does not replicate them; I = 128, at tp 4 32
    # rows per rank, the fewest vLLM's CPU MoE kernel takes with swigluoai):
    # tp 1/2/4 and EP 2/4. Gemma (2 KV heads): tp 4 shares KV heads.
    "tiny-gpt-oss": [(1, False), (2, False), (4, False), (2, True), (4, True)],
    "tiny-gemma2": [(1, False), (2, False), (4, False)],
    "tiny-gemma3": [(1, False), (2, False), (4, False)],
    # expert placement (checkpoints from CHECKPOINTS below): E=10 over ep 4 is
    # 3,3,2,2; over ep 8 2,2,1,...; E=6 over ep 8 leaves two ranks without
    # experts; round robin falls back to linear without expert groups and
    # is honoured with DeepSeek-V3's n_group=2
    "tiny-qwen3-moe-e10": [(4, True), (8, True), (4, True, "round_robin")],
    "tiny-mixtral-e6": [(8, True)],
    "tiny-deepseek-v3-groups": [(4, True), (4, True, "round_robin")],
    "tiny-qwen3-moe-stacked": [(2, False), (4, True)],
    # dtype="auto" and --dtype (tp 1: the dtype does not depend on the layout)
    "tiny-qwen3-nodtype": [(1, False), (1, False, "float16")],
    "tiny-qwen3-nodtype-fp32": [(1, False)],
    "tiny-qwen3-nodtype-fp16": [(1, False)],
    "tiny-qwen3-fp32": [(1, False)],
    # MLA + MoE (layer 0 dense, layer 1 MoE), bf16 and fp8 blocks [32, 16]
    # (through oracle_fp8.py), tp 1/2/4 and EP 2/4; q_lora_rank null at tp 1/2
    "tiny-deepseek-v3": [(1, False), (2, False), (4, False), (2, True), (4, True)],
    "tiny-deepseek-v3-fp8": [(1, False), (2, False), (4, False), (2, True), (4, True)],
    "tiny-deepseek-v3-no-q-lora": [(1, False), (2, False)],
    # GLM-4.5 (QKV bias, q/k norms, 2 KV heads: tp 4 shares them), GLM-4.7-Flash
    # (MLA), GLM-5 and DeepSeek-V3.2 (MLA + DSA indexer); layer 0 dense, layer 1 MoE
    # (4 routed + 1 shared expert); tp 1/2/4 and EP 2/4 (checkpoints: _glm below)
    **{m: [(1, False), (2, False), (4, False), (2, True), (4, True)]
       for m in ("tiny-glm4-moe", "tiny-glm4-moe-lite", "tiny-glm-moe-dsa", "tiny-deepseek-v32")},
}

PLACEMENTS = ("round_robin",)


def _tiny(name: str, **changes):
    """A built-in tiny model with config changes."""
    def build(d: Path) -> None:
        from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

        save_tiny_checkpoint(tiny_config(name, **changes), d, seed=0)
    return build


def _stacked(name: str):
    """A built-in tiny MoE model with its experts stacked on disk, under transformers'
    in-memory names (``<block>.experts.gate_up_proj`` [E, 2*Im, H], gate rows then
    up rows per expert; ``<block>.experts.down_proj`` [E, H, Im])."""
    def build(d: Path) -> None:
        import re

        import torch
        from safetensors.torch import load_file, save_file

        from m2nkit.adapters.tiny import save_tiny_checkpoint

        save_tiny_checkpoint(name, d, seed=0)
        tensors = load_file(d / "model.safetensors")
        per: dict = {}
        out = {}
        for n, t in tensors.items():
            m = re.match(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$", n)
            if m:
                per.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
            else:
                out[n] = t
        for prefix, parts in per.items():
            count = 1 + max(e for e, _ in parts)
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(count)])
            out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
        save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    return build


def _dtype_variant(name: str, config_dtype: str | None, tensor_dtype: str):
    """A built-in tiny model whose config.json names ``config_dtype`` (None: no dtype key)
    and whose tensors are stored as ``tensor_dtype``."""
    def build(d: Path) -> None:
        import json

        import torch
        from safetensors.torch import load_file, save_file

        from m2nkit.adapters.tiny import save_tiny_checkpoint

        save_tiny_checkpoint(name, d, seed=0)
        config = json.loads((d / "config.json").read_text())
        config.pop("dtype", None)
        config.pop("torch_dtype", None)
        if config_dtype:
            config["dtype"] = config_dtype
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        dtype = getattr(torch, tensor_dtype)
        tensors = {n: t.to(dtype) for n, t in load_file(d / "model.safetensors").items()}
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return build


def _deepseek_v3_groups(d: Path) -> None:
    """A tiny DeepSeek-V3 with n_group=2 (grouped routing: vLLM honours round robin)
    and 10 experts (uneven over ep 4). Its family need not be in m2nkit."""
    from transformers import AutoConfig

    from m2nkit.adapters.tiny import save_tiny_checkpoint, shrink_config

    config = shrink_config(
        AutoConfig.for_model("deepseek_v3", architectures=["DeepseekV3ForCausalLM"]), derived={},
        n_routed_experts=10, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="noaux_tc")
    save_tiny_checkpoint(config, d, seed=0)


#: Sizes the tiny GLM / DeepSeek-V3.2 models share: hidden 32 (no layout rule splits
#: it; 4 checkpoints and 20 layouts take 4.3 MB), 4 heads (one per rank at tp 4), vocab 200
#: (vLLM pads it to 256), layer 0 dense (``first_k_dense_replace``), layer 1 MoE with
#: 4 routed experts (ep 4: one per rank) and 1 shared expert.
_GLM_SIZES = dict(hidden_size=32, num_attention_heads=4, intermediate_size=32,
                  moe_intermediate_size=32, n_routed_experts=4, num_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, num_hidden_layers=2,
                  first_k_dense_replace=1, vocab_size=200)
#: MLA (GLM-4.7-Flash, GLM-5, DeepSeek-V3.2): q_lora_rank set, so vLLM fuses
#: q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj; head_dim is the rope dim
#: (as GLM-5's config has it). ``topk_method``/``scoring_func`` as the published
#: configs: transformers' config classes drop them, and vLLM's DeepSeek-V2 MoE makes
#: no ``e_score_correction_bias`` without ``noaux_tc`` (REFERENCE.md section 9).
_MLA_SIZES = dict(_GLM_SIZES, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, qk_head_dim=24, v_head_dim=16,
                  head_dim=8, mlp_layer_types=["dense", "sparse"], topk_method="noaux_tc",
                  scoring_func="sigmoid")
#: The DSA indexer: wq_b [n*d, q_lora], wk [d, H], weights_proj [n, H], k_norm [d]
_DSA_SIZES = dict(_MLA_SIZES, index_n_heads=4, index_head_dim=16, index_topk=16)


def _glm(model_type: str, architecture: str, **sizes):
    """A tiny GLM-4.5 / GLM-4.7-Flash / GLM-5 / DeepSeek-V3.2 from transformers' own config
    class (``save_tiny_checkpoint``: seed 0, bf16, non-zero fp32 ``e_score_correction_bias``).
    Their families need not be in m2nkit."""
    def build(d: Path) -> None:
        from transformers import AutoConfig

        from m2nkit.adapters.tiny import save_tiny_checkpoint, shrink_config

        config = shrink_config(AutoConfig.for_model(model_type, architectures=[architecture]),
                               derived={}, **sizes)
        save_tiny_checkpoint(config, d, seed=0)
    return build


#: Checkpoints that are not a built-in tiny model: name -> builder(directory).
CHECKPOINTS = {
    "tiny-qwen3-moe-e10": _tiny("tiny-qwen3-moe", num_local_experts=10),
    "tiny-mixtral-e6": _tiny("tiny-mixtral", num_local_experts=6),
    "tiny-deepseek-v3-groups": _deepseek_v3_groups,
    "tiny-qwen3-moe-stacked": _stacked("tiny-qwen3-moe"),
    "tiny-qwen3-nodtype": _dtype_variant("tiny-qwen3", None, "bfloat16"),
    "tiny-qwen3-nodtype-fp32": _dtype_variant("tiny-qwen3", None, "float32"),
    "tiny-qwen3-nodtype-fp16": _dtype_variant("tiny-qwen3", None, "float16"),
    "tiny-qwen3-fp32": _dtype_variant("tiny-qwen3", "float32", "float32"),
    # GLM-4.5/4.6: QKV bias and q/k norms (attention_bias, use_qk_norm: GLM-4.5's and
    # 4.6's configs set both; shared/models has neither); 2 KV heads of head_dim 16
    "tiny-glm4-moe": _glm("glm4_moe", "Glm4MoeForCausalLM", **_GLM_SIZES, num_key_value_heads=2,
                          head_dim=16, attention_bias=True, use_qk_norm=True),
    "tiny-glm4-moe-lite": _glm("glm4_moe_lite", "Glm4MoeLiteForCausalLM", **_MLA_SIZES),
    "tiny-glm-moe-dsa": _glm("glm_moe_dsa", "GlmMoeDsaForCausalLM", **_DSA_SIZES,
                             indexer_types=["full", "full"], indexer_rope_interleave=True),
    # DeepSeek-V3.2 as published but bf16 (its config is fp8): two expert groups
    "tiny-deepseek-v32": _glm("deepseek_v32", "DeepseekV32ForCausalLM", **_DSA_SIZES, n_group=2,
                              topk_group=1),
}


# --------------------------------------------------------------------------
# Qwen3.5 (dense, MoE, and their multimodal wrappers), Qwen3-Next, Qwen3-VL
# (dense, MoE): architectures without an m2nkit family table, checked by
# tests/integration/test_traced_qwen.py against the layout traced from vLLM's
# loaders. Built from transformers' own classes here (adapters/tiny builds
# only families m2nkit has). Sizes: hidden 64, 4 query heads over 2 KV heads
# of 16 (tp 4 replicates them), vocab 200 (vLLM pads to 256), 4 experts of
# 8 (EP 4: one each; tp 4: 2 rows), Gated DeltaNet with 4 key / 8 value heads of 8 (tp 4:
# one key head per rank), a 2-block vision tower of width 16 with 4 heads.

_QWEN_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=32, vocab_size=200, max_position_embeddings=256,
                  num_hidden_layers=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: Gated DeltaNet; full_attention_interval 2: layer 0 linear attention, layer 1 full
_QWEN_LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                 shared_expert_intermediate_size=8)
#: keys of the published Qwen3.5 text configs that vLLM reads (attn_output_gate,
#: mamba_ssm_dtype) or that describe them (mtp, mrope); rotary dim 16 * 0.25 = 4, so
#: the mrope sections sum to 2
_QWEN35_KEYS = dict(attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
                    mtp_use_dedicated_embeddings=False,
                    rope_parameters=dict(mrope_interleaved=True, mrope_section=[1, 1, 0],
                                         rope_type="default", rope_theta=10000000,
                                         partial_rotary_factor=0.25))
_QWEN_VISION = dict(depth=2, hidden_size=16, num_heads=4, intermediate_size=32, patch_size=4,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                    out_hidden_size=64, in_channels=3, hidden_act="gelu_pytorch_tanh")
#: multimodal token ids inside the tiny vocab
_QWEN_MM = dict(image_token_id=196, video_token_id=197, vision_start_token_id=198,
                vision_end_token_id=199)
_QWEN3_VL_ROPE = dict(rope_parameters=dict(mrope_interleaved=True, mrope_section=[3, 3, 2],
                                           rope_type="default", rope_theta=5000000))


def _transformers_tiny(model_type: str, arch: str, *, tie: bool = False,
                       hub_expert_layout: bool = False, **keys):
    """A tiny ``arch`` built by transformers' own class and saved by its ``save_pretrained``.

    ``keys`` are the config's keys (``text_config``/``vision_config`` dicts for
    a multimodal wrapper); ``tie`` sets ``tie_word_embeddings`` at both levels.
    Weights: seed 0, bf16; 1-D parameters and biases drawn from randn (a norm
    at exactly 1.0 would pass a byte comparison anywhere). ``hub_expert_layout``:
    the fused experts are rewritten ``[E, in, out]`` as the published
    checkpoints hold them (Qwen3-VL-MoE): transformers 5.12.1's
    ``save_pretrained`` writes its in-memory ``[E, out, in]``, which vLLM's
    loader (``is_fused_checkpoint_transposed``) would read transposed.
    """
    def build(d: Path) -> None:
        import torch
        import transformers
        from safetensors.torch import load_file, save_file

        config = transformers.AutoConfig.for_model(model_type, architectures=[arch], **keys)
        config.tie_word_embeddings = tie
        if hasattr(config, "text_config"):
            config.text_config.tie_word_embeddings = tie
        config.dtype = torch.bfloat16
        torch.manual_seed(0)
        model = getattr(transformers, arch)._from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("bias"):
                    p.copy_(torch.randn_like(p))
        model.save_pretrained(d)
        if hub_expert_layout:
            file = d / "model.safetensors"
            tensors = load_file(str(file))
            for name, t in tensors.items():
                if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                    tensors[name] = t.transpose(1, 2).contiguous()
            save_file(tensors, str(file), metadata={"format": "pt"})
    return build


def _qwen35(moe: bool, vision: bool):
    text = {**_QWEN_TEXT, **_QWEN_LINEAR, **_QWEN35_KEYS, **(_QWEN_MOE if moe else {})}
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    if not vision:
        arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
        # the dense text model ties its embeddings (lm_head skipped), the MoE does not
        return _transformers_tiny(f"{kind}_text", arch, tie=not moe, **text)
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return _transformers_tiny(kind, arch, text_config=text, **_QWEN_MM,
                              vision_config={**_QWEN_VISION, "deepstack_visual_indexes": []})


def _qwen3_vl(moe: bool):
    text = {**_QWEN_TEXT, **_QWEN3_VL_ROPE,
            **({**_QWEN_MOE, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": []} if moe else {})}
    text.pop("shared_expert_intermediate_size", None)     # Qwen3-VL-MoE has no shared expert
    vision = {**_QWEN_VISION, "deepstack_visual_indexes": [0]}   # one deepstack merger
    if moe:
        return _transformers_tiny("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
                                  hub_expert_layout=True, text_config=text,
                                  vision_config=vision, **_QWEN_MM)
    return _transformers_tiny("qwen3_vl", "Qwen3VLForConditionalGeneration", tie=True,
                              text_config=text, vision_config=vision, **_QWEN_MM)


_QWEN_DENSE_LAYOUTS = [(1, False), (2, False), (4, False)]
_QWEN_MOE_LAYOUTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]
CHECKPOINTS.update({
    "tiny-qwen3.5": _qwen35(moe=False, vision=False),
    "tiny-qwen3.5-moe": _qwen35(moe=True, vision=False),
    "tiny-qwen3.5-vl": _qwen35(moe=False, vision=True),
    "tiny-qwen3.5-moe-vl": _qwen35(moe=True, vision=True),
    # layer 0: linear attention with a dense MLP (mlp_only_layers), layer 1: full + MoE
    "tiny-qwen3-next": _transformers_tiny(
        "qwen3_next", "Qwen3NextForCausalLM", **_QWEN_TEXT, **_QWEN_LINEAR, **_QWEN_MOE,
        norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[0], partial_rotary_factor=0.25),
    "tiny-qwen3-vl": _qwen3_vl(moe=False),
    "tiny-qwen3-vl-moe": _qwen3_vl(moe=True),
})
LAYOUTS.update({
    "tiny-qwen3.5": _QWEN_DENSE_LAYOUTS, "tiny-qwen3.5-vl": _QWEN_DENSE_LAYOUTS,
    "tiny-qwen3-vl": _QWEN_DENSE_LAYOUTS,
    "tiny-qwen3.5-moe": _QWEN_MOE_LAYOUTS, "tiny-qwen3.5-moe-vl": _QWEN_MOE_LAYOUTS,
    "tiny-qwen3-next": _QWEN_MOE_LAYOUTS, "tiny-qwen3-vl-moe": _QWEN_MOE_LAYOUTS,
})


# --- Llama-4, MiniMax-M2, Olmo3: architectures without a family table (traced layouts,
# tests/integration/test_traced_misc.py). transformers' own classes and save_pretrained;
# config keys from the published configs (Llama-4-Scout: shared/models; MiniMax-M2: the
# keys vLLM reads that transformers' config drops, REFERENCE.md section 9).

def _random_tiny(cls, config):
    """transformers' ``cls`` built from ``config`` (seed 0, bf16); 1-D parameters, biases and
    persistent float buffers randomised as ``save_tiny_checkpoint`` does, so a norm sent to
    the wrong place fails a byte comparison."""
    import torch

    torch.manual_seed(0)
    model = cls._from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if (buf is not None and name not in module._non_persistent_buffers_set
                        and buf.dtype.is_floating_point):
                    module._buffers[name] = torch.randn(buf.shape).to(buf.dtype)
    return model


def _misc_tiny(architecture: str, make_config):
    """transformers' ``architecture`` class built from ``make_config()`` by ``_random_tiny``
    and saved by its own ``save_pretrained``."""
    def build(d: Path) -> None:
        import transformers

        config = make_config()
        config.architectures = [architecture]
        _random_tiny(getattr(transformers, architecture), config).save_pretrained(d)
    return build


#: Llama-4-Scout's text_config, shrunk: 4 heads over 2 KV heads (tp 4 replicates them),
#: layer 0 dense (intermediate_size_mlp) and layer 1 MoE (interleave_moe_layer_step 2,
#: as Maverick; Scout's 1 makes every layer MoE): 4 routed experts of I = 32, stacked on
#: disk as [E, H, 2*I] / [E, I, H], beside a shared expert; qk norm without weights;
#: max_position_embeddings above the llama3 rope's original 8192.
LLAMA4_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
                   vocab_size=200, num_local_experts=4, num_experts_per_tok=1,
                   interleave_moe_layer_step=2, max_position_embeddings=16384,
                   attention_chunk_size=8192, use_qk_norm=True, attention_bias=False,
                   rms_norm_eps=1e-5, hidden_act="silu", router_aux_loss_coef=0.001,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                    "factor": 16.0, "high_freq_factor": 1.0,
                                    "low_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192})
#: Llama-4-Scout's vision_config, shrunk: 4 heads of 8 over hidden 32 (tp 4: one head
#: per rank), 2 layers, 56 px images of 14 px patches (16 patches, pixel shuffle 0.5),
#: intermediate_size = 4 * hidden as Scout's (1408 -> 5632) for the pixel-shuffle MLP.
LLAMA4_VISION = dict(hidden_size=32, intermediate_size=128, num_attention_heads=4,
                     num_hidden_layers=2, image_size=56, patch_size=14, num_channels=3,
                     pixel_shuffle_ratio=0.5, projector_input_dim=64, projector_output_dim=64,
                     vision_output_dim=64, hidden_act="gelu", norm_eps=1e-5,
                     multi_modal_projector_bias=False, vision_feature_layer=-1,
                     vision_feature_select_strategy="default",
                     rope_parameters={"rope_type": "default", "rope_theta": 10000})


def _llama4_text():
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**LLAMA4_TEXT)


def _llama4_vision():
    """The Scout wrapper: its language model as Scout's (every layer MoE,
    ``interleave_moe_layer_step`` 1; one layer, tiny-llama4 has the dense one) and the
    vision tower + projector above."""
    from transformers import Llama4Config

    text = {**LLAMA4_TEXT, "num_hidden_layers": 1, "interleave_moe_layer_step": 1}
    return Llama4Config(text_config=text, vision_config=LLAMA4_VISION,
                        boi_token_index=197, eoi_token_index=198, image_token_index=199)


def _minimax_m2():
    """MiniMax-M2 shrunk: 4 heads of 16 over 2 KV heads, q_norm/k_norm over the full width
    (vLLM splits them by heads), partial rotary (``rotary_dim`` 8 of 16, as 64 of 128),
    sigmoid routing with ``e_score_correction_bias`` (``use_routing_bias``), 4 experts."""
    from transformers import MiniMaxM2Config

    config = MiniMaxM2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, num_hidden_layers=2, vocab_size=200, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None,
        eos_token_id=None, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                         "partial_rotary_factor": 0.5})
    # read by vLLM's minimax_m2.py, dropped by transformers' config class's own fields
    config.rotary_dim = 8
    config.scoring_func = "sigmoid"
    config.use_routing_bias = True
    return config


def _olmo3():
    """Olmo3 shrunk: 4 heads over 2 KV heads (Olmo-3-32B is GQA), q_norm/k_norm over the
    full width, a sliding and a full attention layer."""
    from transformers import Olmo3Config

    return Olmo3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=96, num_hidden_layers=2, vocab_size=200,
                       max_position_embeddings=256, sliding_window=32,
                       layer_types=["sliding_attention", "full_attention"],
                       pad_token_id=None, bos_token_id=None, eos_token_id=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


CHECKPOINTS.update({
    "tiny-llama4": _misc_tiny("Llama4ForCausalLM", _llama4_text),
    "tiny-llama4-vision": _misc_tiny("Llama4ForConditionalGeneration", _llama4_vision),
    "tiny-minimax-m2": _misc_tiny("MiniMaxM2ForCausalLM", _minimax_m2),
    "tiny-olmo3": _misc_tiny("Olmo3ForCausalLM", _olmo3),
})
_MOE_TP_EP = [(1, False), (2, False), (4, False), (2, True), (4, True)]
LAYOUTS.update({
    "tiny-llama4": _MOE_TP_EP,
    "tiny-llama4-vision": [(1, False), (2, False), (4, False)],   # EP: tiny-llama4's
    "tiny-minimax-m2": _MOE_TP_EP,
    "tiny-olmo3": [(1, False), (2, False), (4, False)],
})


# --- Kimi-K2.5 (KimiK25ForConditionalGeneration): transformers' own
# Kimi_K25ForConditionalGeneration (5.24 and later; the project's 5.12.1 has no Kimi-K2.5
# class), built from a tiny Kimi_K25Config and saved by its own save_pretrained, so this
# runs under .venv-tf (scripts/side_transformers.sh): ``.venv-tf/bin/python
# tests/data/oracle/regenerate.py --models tiny-kimi-k25 --oracle-python
# .venv-tf/bin/python``. vLLM's kimi_k25.py imports
# transformers' ``Kimi_K25Config`` too, so the oracle runs there as well.
#
# transformers keeps the model under other names in memory (conversion_mapping.py,
# ``kimi_k25``: ``model.language_model.layers.N``, ``model.vision_tower.layers.N.attn.
# {q,k,v}_proj`` split from ``wqkv`` and q/k permuted for its rotary (PermuteForRope),
# ``norm1/norm2``, ``mlp.fc1/fc2``, ``attn.proj``, ``mm_projector.{in,out}_proj``, fused
# ``experts.gate_up_proj``), and save_pretrained writes them back through the reverse of
# that mapping. transformers 5.25.0's reverse writes three groups under names neither the
# published checkpoint (the source patterns of that mapping, which transformers reads from
# moonshotai/Kimi-K2.5) nor vLLM 0.33.0's loader (kimi_k25.py: ``AutoWeightsLoader`` with
# ``hf_to_vllm_mapper``, which renames only ``language_model.layers.`` and
# ``mm_projector.proj.0/2``) takes: its ``blocks`` -> ``layers`` renaming, reversed, turns
# the text layers into ``language_model.model.blocks.N``; ``vision_tower.encoder`` ->
# ``model.vision_tower``, reversed, puts the patch embedding under
# ``vision_tower.encoder.patch_embed``; and no rule covers the projector's ``pre_norm``
# (``model.mm_projector.pre_norm``). The oracle on that file fails on each (tried one
# renaming at a time: ``KeyError: 'blocks.0.input_layernorm.weight'`` from DeepseekV2's
# loader, "There is no module or parameter named 'model'" and "... named
# 'vision_tower.encoder.patch_embed'" from AutoWeightsLoader), so ``_PUBLISHED_NAMES``
# renames those three prefixes to the published ones after save_pretrained; every other
# name, every shape, dtype (the router ``gate.weight`` and ``e_score_correction_bias`` in
# float32, as transformers keeps them: ``_keep_in_fp32_modules_strict``) and byte is
# save_pretrained's.
# transformers' from_pretrained reads the renamed file back into the same in-memory
# tensors (checked by ``_kimi_k25``), so it is a checkpoint transformers itself loads.

#: The text part: MLA sizes of the GLM tinies (hidden 32, 4 heads), layer 0 dense, layer 1
#: MoE with 4 routed experts + 1 shared, noaux_tc, one expert group as Kimi-K2.5 has;
#: no MTP layer (Kimi-K2.5: num_nextn_predict_layers 0). ``qk_head_dim`` is given: the
#: config class derives it from its default head dims, and vLLM's column loader would
#: take the first rows of a too-large ``q_b_proj``.
KIMI_TEXT = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=32, moe_intermediate_size=32, n_routed_experts=4,
                 n_shared_experts=1, num_experts_per_tok=2, num_hidden_layers=2,
                 first_k_dense_replace=1, vocab_size=200, q_lora_rank=16, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, qk_head_dim=24, v_head_dim=16,
                 head_dim=8, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1,
                 topk_group=1, num_nextn_predict_layers=0, routed_scaling_factor=2.827,
                 norm_topk_prob=True, max_position_embeddings=256, bos_token_id=None,
                 eos_token_id=None, pad_token_id=None)
#: The MoonViT tower: 2 blocks of width 16 with 2 heads of 8 (tp 2 splits them; at tp 4
#: vLLM falls back to a data-parallel, unsplit tower: heads % tp != 0), MLP 32, 14 px
#: patches, a 4 x 4 learned position grid (spelt ``init_pos_emb_*`` as the published
#: config does, which vLLM reads first, and ``pos_emb_*`` as transformers'
#: Kimi_K25VisionConfig does), 2 x 2 patch merge (projector width 64).
KIMI_VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=32, patch_size=14, init_pos_emb_height=4,
                   init_pos_emb_width=4, init_pos_emb_time=4, pos_emb_height=4,
                   pos_emb_width=4, pos_emb_time=4, merge_kernel_size=[2, 2],
                   merge_type="sd2_tpool", mm_projector_type="patchmerger",
                   pos_emb_type="divided_fixed", video_attn_type="spatial_temporal",
                   projector_hidden_act="gelu", projector_ln_eps=1e-5,
                   hidden_act="gelu_pytorch_tanh")
#: Keys of the published top-level config vLLM reads (kimi_k25.py: ``image_token_id``,
#: ``media_placeholder_token_id``, ``use_unified_vision_chunk``), inside the tiny vocab.
KIMI_TOP = dict(image_token_id=199, media_placeholder_token_id=199,
                use_unified_vision_chunk=True, tie_word_embeddings=False)
#: (prefix save_pretrained writes, the published checkpoint's): see the block comment.
_PUBLISHED_NAMES = (("language_model.model.blocks.", "language_model.model.layers."),
                    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
                    ("model.mm_projector.pre_norm.", "mm_projector.pre_norm."))


def kimi_k25_config():
    """The tiny ``Kimi_K25Config`` (transformers 5.24+): KIMI_TEXT / KIMI_VISION / KIMI_TOP,
    the projector's ``pre_norm`` over the vision width (``projection_hidden_size``)."""
    from transformers import Kimi_K25Config

    config = Kimi_K25Config(text_config={**KIMI_TEXT, "model_type": "deepseek_v3"},
                            vision_config=KIMI_VISION,
                            projection_hidden_size=KIMI_VISION["hidden_size"], **KIMI_TOP)
    config.text_config.tie_word_embeddings = False
    return config


def _kimi_k25(d: Path) -> None:
    """The tiny Kimi-K2.5 (bf16, no quantization_config): see the block comment above."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if not hasattr(transformers, "Kimi_K25ForConditionalGeneration"):
        raise SystemExit(f"tiny-kimi-k25: transformers {transformers.__version__} has no "
                         "Kimi_K25ForConditionalGeneration; run regenerate.py under .venv-tf")
    cls = transformers.Kimi_K25ForConditionalGeneration
    model = _random_tiny(cls, kimi_k25_config())
    model.save_pretrained(d)
    file = d / "model.safetensors"
    tensors = {}
    for name, t in load_file(str(file)).items():
        for old, new in _PUBLISHED_NAMES:
            if name.startswith(old):
                name = new + name[len(old):]
        tensors[name] = t
    save_file(tensors, str(file), metadata={"format": "pt"})
    # as published: the architecture vLLM's registry knows (save_pretrained writes its
    # class name, ``Kimi_K25ForConditionalGeneration``, which vLLM would serve through its
    # generic Transformers backend) and the text config's model_type (the config class
    # maps it back)
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["text_config"]["model_type"] = "kimi_k2"
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # the published names load back into transformers' own model, byte for byte
    want = model.state_dict()
    have = cls.from_pretrained(d, dtype=torch.bfloat16).state_dict()
    assert set(have) == set(want), sorted(set(have) ^ set(want))[:4]
    bad = [n for n in want if have[n].dtype != want[n].dtype or not torch.equal(
        have[n].view(torch.uint8), want[n].view(torch.uint8))]
    assert not bad, f"from_pretrained of the renamed checkpoint differs at {bad[:4]}"


CHECKPOINTS["tiny-kimi-k25"] = _kimi_k25
LAYOUTS["tiny-kimi-k25"] = [(1, False), (2, False), (4, False), (2, True), (4, True)]


def layout_dir(tp: int, ep: bool, *options: str) -> str:
    return f"tp{tp}" + ("_ep" if ep else "") + "".join(f"_{o}" for o in options)


def option_flags(options) -> list[str]:
    """oracle.py flags for a layout's options (vLLM's default ``--dtype auto`` if none is given)."""
    flags = []
    for o in options:
        flags += ["--expert-placement", o] if o in PLACEMENTS else ["--dtype", o]
    return flags if "--dtype" in flags else flags + ["--dtype", "auto"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle-python", default="/tmp/oracle/venv/bin/python")
    ap.add_argument("--oracle", default="/work/shared/tools/vllm_oracle/oracle.py")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--extra-path", default="/tmp/oracle/extra",
                    help="PYTHONPATH entry holding compressed-tensors + loguru, for fp8 "
                         "checkpoints (run through oracle_fp8.py, see there)")
    ap.add_argument("--models", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS),
                    help="regenerate only these tiny models (default: all)")
    args = ap.parse_args(argv)

    from m2nkit.adapters.tiny import save_tiny_checkpoint

    out = Path(args.out)
    runs = []
    for model in args.models:
        layouts = LAYOUTS[model]
        ckpt = out / model / "checkpoint"
        with tempfile.TemporaryDirectory() as tmp:
            if model in CHECKPOINTS:
                CHECKPOINTS[model](Path(tmp))
            else:
                save_tiny_checkpoint(model, tmp, seed=0)
            if ckpt.exists():
                shutil.rmtree(ckpt)
            ckpt.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copy(Path(tmp) / name, ckpt / name)
        for tp, ep, *options in layouts:
            dest = out / model / layout_dir(tp, ep, *options)
            if dest.exists():
                shutil.rmtree(dest)
            fp8 = "quantization_config" in (ckpt / "config.json").read_text()
            oracle = ([f"PYTHONPATH={args.extra_path}", args.oracle_python,
                       str(HERE / "oracle_fp8.py"), args.oracle] if fp8
                      else [args.oracle_python, args.oracle])
            cmd = ["env", *oracle, str(ckpt), "--tp", str(tp),
                   *(["--ep"] if ep else []), *option_flags(options), "--all-ranks",
                   "--out", str(dest / "rank{rank}.safetensors"), "--quiet"]
            runs.append(cmd)

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stdout + r.stderr)
        return r.returncode

    with ThreadPoolExecutor(args.jobs) as pool:
        codes = list(pool.map(run, runs))
    print(f"{len(runs)} oracle runs, {sum(c != 0 for c in codes)} failed")
    return int(any(codes))


if __name__ == "__main__":
    sys.exit(main())
