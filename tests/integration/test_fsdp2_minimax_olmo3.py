"""MiniMax-M2 and Olmo3 from real ``fully_shard`` ranks into traced vLLM layouts.

The trainer is transformers' own model of the shipped tiny checkpoint
(``tests/data/oracle/tiny-{minimax-m2,olmo3}``, written by transformers'
``save_pretrained``; ``MiniMaxM2ForCausalLM`` and ``Olmo3ForCausalLM``, the
class named in its config.json), loaded with ``from_pretrained`` and sharded by
FSDP2 in 4 spawned gloo ranks, on a 1-D mesh (``fully_shard`` per decoder layer,
then the root) and on an HSDP mesh ``(dp_replicate=2, dp_shard=2)``. Neither
architecture has an m2nkit family table, so ``fsdp2_source`` sends transformers'
in-memory names (``families.tableless``): MiniMax-M2's experts fused and stacked,
``...mlp.experts.gate_up_proj [E, 2*I, H]`` (no ``.weight``; the checkpoint has
``...block_sparse_moe.experts.{e}.w1/w2/w3``), Olmo3's ``q/k/v_proj`` apart. Each
rank saves its manifest and local tensors; the parent plans them against the
layout traced from vLLM 0.33.0's own loaders and runs the plan in-process. The
reference is vLLM itself: each worker's model built on the CPU and filled from the
checkpoint's files by vLLM's ``DefaultModelLoader``
(``engine/tools/vllm_workers.fresh_load``), compared bit for bit
(``_fsdp2.check_vllm_loads``). Beyond that, facts read off by hand from
config.json: the wire names and shapes, MiniMax-M2's ``q_norm``/``k_norm`` split
by heads on the workers (full width on the wire), Olmo3's ``q/k/v_proj`` landing
in vLLM's fused ``qkv_proj``, and every plan moving exactly the minimum.

Olmo3 is served by vLLM's generic Transformers backend, whose fusers rewrite
transformers' module classes in the process that builds the vLLM model
(``model_executor/models/transformers/fusers``); transformers' own Olmo3 cannot
be built correctly in that process afterwards. The ranks (fresh spawned
processes) build only transformers' model; the parent side of Olmo3 (trace, plan,
``fresh_load``) runs in one more spawned process (``OWN_PROCESS``), so this
pytest process never builds a vLLM Olmo3 and the tests after this one
(test_traced_misc.py builds transformers' Olmo3 in-process) are unaffected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from _paths import ORACLE
from _procs import gloo_rank, join_ranks, save_source
from tests.integration._fsdp2 import check_vllm_loads, load_sources, shard_layers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORLD = 4
TIMEOUT_S = 240
#: the parent side of a model checked in a spawned process (``OWN_PROCESS``)
CHECK_TIMEOUT_S = 600
KINDS = ("fsdp", "hsdp")
#: tiny-minimax-m2: 4 q heads, 2 KV heads, 4 experts (config.json). tp 4 takes the
#: 4 q heads one a rank and replicates each KV head on 2 ranks; with EP the expert
#: parallel size is tp*dp (2 or 4), which divides the 4 experts; so every spec
#: asked for fits and none is dropped. tiny-olmo3: 4 q heads, 2 KV heads (dense).
SPECS = {
    "tiny-minimax-m2": ("vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep", "vllm:tp=1,dp=2,ep"),
    "tiny-olmo3": ("vllm:tp=2", "vllm:tp=4", "vllm:tp=1,dp=2"),
}
#: vLLM builds these through its Transformers backend (see the module docstring)
OWN_PROCESS = {"tiny-olmo3"}


def _ckpt(model: str) -> Path:
    return ORACLE / model / "checkpoint"


def _config(model: str) -> dict:
    return json.loads((_ckpt(model) / "config.json").read_text())


def _sizes(spec: str) -> tuple[int, int, bool]:
    """``(tp, dp, ep)`` of a spec string, read here rather than by m2nkit's parser."""
    keys = dict(kv.partition("=")[::2] for kv in spec.removeprefix("vllm:").split(","))
    return int(keys["tp"]), int(keys.get("dp") or 1), "ep" in keys


def _rank_main(rank, world, port, ckpt, out):
    import transformers

    from m2nkit.adapters.fsdp2 import fsdp2_source

    arch = json.loads((Path(ckpt) / "config.json").read_text())["architectures"][0]
    with gloo_rank(rank, world, port, TIMEOUT_S // 2):
        for kind in KINDS:
            model = shard_layers(getattr(transformers, arch).from_pretrained(ckpt), kind, world)
            save_source(fsdp2_source(model), world, Path(out) / f"{kind}.r{rank}.pt")


def _checkpoint_tensor(model: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(_ckpt(model) / "model.safetensors"), "pt") as f:
        return f.get_tensor(name)


def _worker_shapes(plan) -> dict[tuple[int, str], tuple[int, ...]]:
    return {(p.worker, p.name): tuple(p.shape) for p in plan.destination.params}


def _minimax_facts(metas, plans, loads) -> None:
    model = "tiny-minimax-m2"
    c = _config(model)
    E, H, inter = c["num_local_experts"], c["hidden_size"], c["intermediate_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    shapes = {m.name: tuple(m.shape) for m in metas}
    # the wire: transformers' fused, stacked experts under the in-memory names
    for i in range(c["num_hidden_layers"]):
        experts = f"model.layers.{i}.mlp.experts"
        assert shapes[f"{experts}.gate_up_proj"] == (E, 2 * inter, H)
        assert shapes[f"{experts}.down_proj"] == (E, H, inter)
    assert not any(".block_sparse_moe." in n or ".experts.0." in n
                   or (".experts." in n and n.endswith(".weight")) for n in shapes)
    q_name, k_name = (f"model.layers.1.self_attn.{n}_norm.weight" for n in "qk")
    assert shapes[q_name] == (nh * hd,) and shapes[k_name] == (nkv * hd,)   # full width
    q_full, k_full = _checkpoint_tensor(model, q_name), _checkpoint_tensor(model, k_name)
    w13 = "model.layers.1.block_sparse_moe.experts.routed_experts.w13_weight"
    for text, plan in zip(SPECS[model], plans):
        tp, dp, ep = _sizes(text)
        worker = _worker_shapes(plan)
        assert {b.param for b in plan.destination.bindings[
            "model.layers.1.mlp.experts.gate_up_proj"]} == {w13}, text
        for w in range(tp * dp):
            r = w % tp                                # the worker's tp rank
            # q heads split nh/tp a rank; k: nkv/tp heads, or one KV head per tp/nkv ranks
            nq, kv = nh * hd // tp, (r * nkv // tp if tp <= nkv else r // (tp // nkv))
            k_rows = (slice(r * nkv * hd // tp, (r + 1) * nkv * hd // tp) if tp <= nkv
                      else slice(kv * hd, (kv + 1) * hd))
            assert worker[w, q_name] == (nq,), (text, w)
            assert worker[w, k_name] == (max(nkv // tp, 1) * hd,), (text, w)
            assert torch.equal(loads[text, w][q_name], q_full[r * nq:(r + 1) * nq]), (text, w)
            assert torch.equal(loads[text, w][k_name], k_full[k_rows]), (text, w)
            # with EP each worker holds E/(tp*dp) whole experts; without, all, rows split by tp
            assert worker[w, w13] == ((E // (tp * dp), 2 * inter, H) if ep
                                      else (E, 2 * inter // tp, H)), (text, w)


def _olmo3_facts(metas, plans, loads) -> None:
    model = "tiny-olmo3"
    c = _config(model)
    H, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = H // nh
    shapes = {m.name: tuple(m.shape) for m in metas}
    attn = "model.layers.0.self_attn"
    # the wire: q, k and v apart; vLLM's Transformers backend fuses them into qkv_proj
    assert shapes[f"{attn}.q_proj.weight"] == (nh * hd, H)
    assert shapes[f"{attn}.k_proj.weight"] == shapes[f"{attn}.v_proj.weight"] == (nkv * hd, H)
    assert not any("qkv" in n for n in shapes)
    qkv = f"{attn}.qkv_proj.weight"
    for text, plan in zip(SPECS[model], plans):
        tp, dp, _ = _sizes(text)
        worker = _worker_shapes(plan)
        assert not any(n.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight"))
                       for _, n in worker), text
        for p in "qkv":
            assert {b.param for b in plan.destination.bindings[f"{attn}.{p}_proj.weight"]} \
                == {qkv}, (text, p)
        for w in range(tp * dp):
            # nh/tp q heads, then max(nkv/tp, 1) k heads and as many v heads, hd rows each
            assert worker[w, qkv] == ((nh // tp + 2 * max(nkv // tp, 1)) * hd, H), (text, w)
            assert qkv in loads[text, w], (text, w)
            # the backend keeps q_norm/k_norm whole on every rank
            assert worker[w, f"{attn}.q_norm.weight"] == (nh * hd,), (text, w)
            assert worker[w, f"{attn}.k_norm.weight"] == (nkv * hd,), (text, w)


def _check(model: str, out: str) -> None:
    """The parent's side: every mesh's ranks planned into every layout of the model,
    executed and held against vLLM's own load (``check_vllm_loads``), then the facts."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    loads: dict = {}           # (spec, worker) -> vLLM's fresh load, the same for every mesh
    for kind in KINDS:
        metas, payloads = load_sources(Path(out), kind, WORLD)
        plans = check_vllm_loads(_ckpt(model), metas, payloads, SPECS[model], loads,
                                 f"{model} {kind}")
        for text, plan in zip(SPECS[model], plans):
            assert plan.nbytes_moved == plan.nbytes_min > 0, (model, kind, text)
        (_minimax_facts if model == "tiny-minimax-m2" else _olmo3_facts)(metas, plans, loads)


def _check_main(_index, model, out):
    _check(model, out)


@pytest.mark.parametrize("model", list(SPECS))
def test_fsdp2_ranks_into_traced_layouts_equal_vllm_loads(model, tmp_path):
    from m2nkit.engine.tools.procs import free_port

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    assert _config(model)["architectures"] == [
        {"tiny-minimax-m2": "MiniMaxM2ForCausalLM", "tiny-olmo3": "Olmo3ForCausalLM"}[model]]
    join_ranks(mp.start_processes(_rank_main,
                                  args=(WORLD, free_port(), str(_ckpt(model)), str(tmp_path)),
                                  nprocs=WORLD, join=False, start_method="spawn"), TIMEOUT_S)
    if model in OWN_PROCESS:
        join_ranks(mp.start_processes(_check_main, args=(model, str(tmp_path)), nprocs=1,
                                      join=False, start_method="spawn"), CHECK_TIMEOUT_S,
                   f"{model}'s check")
    else:
        _check(model, str(tmp_path))
