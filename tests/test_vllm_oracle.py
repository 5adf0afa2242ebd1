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
  Qwen3-MoE ``mlp.experts.gate.weight`` -> ``mlp.gate.weight``.
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

from m2nkit.adapters.vllm import InferenceSpec, destination_layout, reference_load
from m2nkit.manifest import ParamMeta

DATA = Path(__file__).parent / "data" / "oracle"
_LAYOUT_DIR = re.compile(r"^tp(\d+)(_ep)?$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def _fixtures():
    out = []
    for model_dir in sorted(p for p in DATA.iterdir() if p.is_dir()):
        for d in sorted(model_dir.iterdir()):
            m = _LAYOUT_DIR.match(d.name)
            if m:
                out.append(pytest.param(model_dir.name, int(m.group(1)), bool(m.group(2)),
                                        id=f"{model_dir.name}-{d.name}"))
    return out


FIXTURES = _fixtures()


@lru_cache(maxsize=None)
def _model(model: str):
    ckpt_dir = DATA / model / "checkpoint"
    config = json.loads((ckpt_dir / "config.json").read_text())
    ckpt = load_file(str(ckpt_dir / "model.safetensors"))
    # wire tensors: experts stacked per layer, gate rows then up rows per expert
    wire = {n: t for n, t in ckpt.items() if not _EXPERT.match(n)}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for n, t in ckpt.items():
        m = _EXPERT.match(n)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, per in groups.items():
        g, u, d = ("w1", "w3", "w2") if "w1" in per[0] else ("gate_proj", "up_proj", "down_proj")
        wire[f"{prefix}.gate_up_proj.weight"] = torch.stack(
            [torch.cat([per[e][g], per[e][u]]) for e in range(len(per))])
        wire[f"{prefix}.down_proj.weight"] = torch.stack([per[e][d] for e in range(len(per))])
    return config, ckpt, wire


def _oracle(model: str, tp: int, ep: bool, rank: int):
    path = DATA / model / (f"tp{tp}" + ("_ep" if ep else "")) / f"rank{rank}.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(ours: torch.Tensor, vllm: torch.Tensor, what: str) -> None:
    assert ours.shape == vllm.shape and ours.dtype == vllm.dtype, (
        f"{what}: {tuple(ours.shape)} {ours.dtype} vs vLLM {tuple(vllm.shape)} {vllm.dtype}")
    nan_o, nan_v = torch.isnan(ours.float()), torch.isnan(vllm.float())
    assert torch.equal(nan_o, nan_v), f"{what}: written elements differ from vLLM's"
    assert torch.equal(_bits(ours[~nan_o]), _bits(vllm[~nan_v])), f"{what}: values differ"


def test_fixtures_are_shipped():
    models = {p.values[0] for p in FIXTURES}
    assert models == {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied",
                      "tiny-qwen3-moe", "tiny-mixtral"}
    assert {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == "tiny-qwen3-moe"} >= {
        (1, False), (2, False), (8, False), (2, True), (4, True), (8, True)}


@pytest.mark.parametrize("model,tp,ep", FIXTURES)
def test_reference_load_equals_vllm(model, tp, ep):
    config, ckpt, _ = _model(model)
    spec = InferenceSpec(tp, 1, ep)
    for rank in range(tp):
        vllm, meta = _oracle(model, tp, ep, rank)
        assert meta["vllm_version"] == "0.33.0"
        assert (int(meta["tp_size"]), int(meta["tp_rank"])) == (tp, rank)
        assert meta["enable_expert_parallel"] == str(ep)
        assert json.loads(meta["not_fully_loaded"]) == {}, "vLLM left elements unwritten"
        ours = reference_load(config, ckpt, spec, rank, fill=float("nan"))
        assert set(ours) == set(vllm), set(ours) ^ set(vllm)
        for alias, canonical in json.loads(meta["aliases"]).items():
            assert ours[alias] is ours[canonical]
        for name in vllm:
            _same(ours[name], vllm[name], f"{model} tp={tp} ep={ep} rank {rank} {name}")


@pytest.mark.parametrize("model,tp,ep", FIXTURES)
def test_destination_layout_equals_vllm(model, tp, ep):
    config, _, wire = _model(model)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    layout = destination_layout(config, metas, InferenceSpec(tp, 1, ep))
    assert not layout.unknown
    for rank in range(tp):
        vllm, meta = _oracle(model, tp, ep, rank)
        assert layout.aliases == json.loads(meta["aliases"])
        store = layout.allocate(rank, fill=float("nan"))
        assert set(store) == set(vllm) - set(layout.aliases)
        for p in layout.params:
            if p.worker == rank:
                for box in p.zero_boxes:
                    sl = tuple(slice(a, b) for a, b in box)
                    assert not vllm[p.name][sl].any(), "vLLM's padding rows are zero"
                    store[p.name][sl] = 0
        for wname, bindings in layout.bindings.items():
            for b in bindings:
                if b.worker == rank:
                    src = wire[wname][tuple(slice(a, c) for a, c in b.box)]
                    dst = tuple(slice(o, o + (c - a)) for o, (a, c) in zip(b.offset, b.box))
                    store[b.param][dst] = src
        for name, t in store.items():
            _same(t, vllm[name], f"{model} tp={tp} ep={ep} rank {rank} {name}")
