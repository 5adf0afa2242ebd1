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
