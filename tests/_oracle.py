"""The real vLLM 0.33.0 dumps in tests/data/oracle, as the tests read them.

Each model folder holds the checkpoint vLLM loaded (``checkpoint/``) and one
folder per layout, ``tp<T>[_ep][_round_robin][_<dtype>]``, with one
safetensors file per TP rank (vLLM's ``named_parameters()`` after its
loaders, NaN where nothing was written). ``_model`` gives the checkpoint as
m2nkit's wire tensors (experts stacked, gate rows then up rows); ``_same``
compares bit for bit, NaN-safe.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from _paths import ORACLE
from m2nkit.adapters.families import family, supported_architectures

DATA = ORACLE
_LAYOUT_DIR = re.compile(r"^tp(\d+)(_ep)?(_round_robin)?(?:_(bfloat16|float16|float32))?$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
#: fp8 block scales of per-expert weights (DeepSeek-V3 fp8): stacked like the weights
_EXPERT_SCALE = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight_scale_inv$")
_STACKED = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))$")  # transformers' in-memory names


def _layout_dir(tp: int, ep: bool, placement: str = "linear", dtype: str = "auto") -> str:
    return (f"tp{tp}" + ("_ep" if ep else "") + ("_round_robin" if placement != "linear" else "")
            + (f"_{dtype}" if dtype != "auto" else ""))


def _all_fixtures():
    out = []
    for model_dir in sorted(p for p in DATA.iterdir() if p.is_dir()):
        for d in sorted(model_dir.iterdir()):
            m = _LAYOUT_DIR.match(d.name)
            if m:
                placement = "round_robin" if m.group(3) else "linear"
                out.append(pytest.param(model_dir.name, int(m.group(1)), bool(m.group(2)),
                                        placement, m.group(4) or "auto",
                                        id=f"{model_dir.name}-{d.name}"))
    return out


def _architecture(model: str) -> str:
    return json.loads((DATA / model / "checkpoint" / "config.json").read_text())["architectures"][0]


ALL_FIXTURES = _all_fixtures()
#: Dumps of the architectures m2nkit supports, checked whole below (a dump of an
#: architecture without a family yet is only checked where this file says so;
#: the experts of tiny-deepseek-v3-groups always are, by
#: test_round_robin_with_expert_groups_matches_vllm).
FIXTURES = [p for p in ALL_FIXTURES if _architecture(p.values[0]) in supported_architectures()]


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
    scales: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for n, t in ckpt.items():
        m = _EXPERT_SCALE.match(n)
        if m:
            del wire[n]
            scales.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, per in scales.items():
        wire[f"{prefix}.gate_up_proj.weight_scale_inv"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in range(len(per))])
        wire[f"{prefix}.down_proj.weight_scale_inv"] = torch.stack(
            [per[e]["down_proj"] for e in range(len(per))])
    hf = family(config["architectures"][0]).hf if config["architectures"][
        0] in supported_architectures() else None
    if hf is not None and hf.permuted:
        # stored in another dim order than the wire's (HFNaming.permuted): GPT-OSS's and
        # Llama-4's stacked experts [E, in, out] travel [E, out, in]
        wire = {n: (t.permute(hf.permuted[leaf][1]) if (leaf := hf.permuted_leaf(n)) else t)
                for n, t in wire.items()}
    order = hf.stacked_order if hf is not None else ()
    if order:
        # stored stacked [E, in, out] (Qwen3-VL-MoE, HFNaming.stacked_order); the wire [E, out, in]
        wire = {n: (t.permute(order) if _STACKED.match(n) else t) for n, t in wire.items()}
    # experts stacked on disk already: the wire name adds ".weight"
    wire = {(n + ".weight" if _STACKED.match(n) else n): t for n, t in wire.items()}
    return config, ckpt, wire


def _oracle(model: str, tp: int, ep: bool, rank: int, placement: str = "linear",
            dtype: str = "auto", root=None):
    path = (DATA if root is None else root) / model / _layout_dir(tp, ep, placement, dtype) / f"rank{rank}.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16}.get(t.element_size(), torch.int32))


def _same(ours: torch.Tensor, vllm: torch.Tensor, what: str) -> None:
    assert ours.shape == vllm.shape and ours.dtype == vllm.dtype, (
        f"{what}: {tuple(ours.shape)} {ours.dtype} vs vLLM {tuple(vllm.shape)} {vllm.dtype}")
    nan_o, nan_v = torch.isnan(ours.float()), torch.isnan(vllm.float())
    assert torch.equal(nan_o, nan_v), f"{what}: written elements differ from vLLM's"
    assert torch.equal(_bits(ours[~nan_o]), _bits(vllm[~nan_v])), f"{what}: values differ"


def assert_layout_equals_dumps(layout, wire, model: str, tp: int, ep: bool, placement: str,
                               dtype: str, what: str = "", root=None) -> None:
    """Every worker filled through ``layout``'s bindings from ``wire`` equals vLLM's dump.

    Checks, per rank of the dump: the aliases, the parameter names, that the
    declared zero boxes are zero in vLLM's dump, and every parameter bit for
    bit (NaN where vLLM wrote nothing must be NaN here too). ``root``: a
    folder of dumps in the same format other than ``DATA`` (SGLang's,
    tests/integration/sglang_oracle.py).
    """
    for rank in range(tp):
        vllm, meta = _oracle(model, tp, ep, rank, placement, dtype, root)
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
            _same(t, vllm[name], f"{what}{model} tp={tp} ep={ep} rank {rank} {name}")

