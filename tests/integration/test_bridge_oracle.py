"""Megatron-Bridge models into m2nkit, with Bridge itself as the oracle (issue "Megatron-Bridge…").

One launch of 4 gloo ranks builds tiny Llama, Qwen2, Qwen3 (tied) and
Qwen3-MoE checkpoints through ``AutoBridge.from_hf_pretrained`` at TP 2,
PP 2, EP 2, TP 2 x PP 2, TP 2 x EP 2 and query groups < tp (2 KV heads over
tp 4), and makes ``bridge_source`` in every mode on each. The parent then
checks, per case and mode:

* every rank declared the same manifest;
* every piece of every rank equals the same box of the wire tensor Bridge's
  own ``export_hf_weights`` gives (per-expert tensors stacked here, in the
  test, with ``torch.stack``/``torch.cat``), bit for bit and in dtype, and
  the pieces cover every element;
* tasks mode made no ``torch.distributed`` call while iterating; the
  ``gather`` mode (QKV and gated MLP forced through Bridge's own
  ``megatron_to_hf``) did, and names those wire tensors as gathered;
* a round planned into vLLM layouts fills every worker's storage exactly as
  the vLLM reference loader (``reference_load``) fills it from Bridge's
  export.

Mixtral is not in the matrix: Megatron-Bridge 0.6.2 has no bridge for
``MixtralForCausalLM`` (``AutoBridge`` refuses it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from m2nkit.adapters.vllm import destination_layout, reference_load
from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
from m2nkit.engine.plan import build_plan
from m2nkit.manifest import box_slices, manifest_from_json

from ._bridge import Case, launch

pytestmark = pytest.mark.integration

WORLD = 4
TIMEOUT_S = 420

#: (tiny model, tp, pp, ep, modes)
MATRIX = [
    ("tiny-llama", 2, 1, 1, ("tasks", "export")),
    ("tiny-llama", 2, 2, 1, ("tasks", "export")),
    ("tiny-qwen2", 4, 1, 1, ("tasks", "export")),      # 2 query groups < tp 4, qkv bias
    ("tiny-qwen3-tied", 1, 2, 1, ("tasks", "export")),  # tied embeddings over PP
    ("tiny-qwen3-tied", 2, 2, 1, ("tasks",)),
    ("tiny-qwen3-moe", 1, 1, 2, ("tasks", "export")),
    ("tiny-qwen3-moe", 2, 1, 2, ("tasks", "export", "gather")),
    ("tiny-qwen3-moe", 2, 2, 1, ("tasks",)),
    # GPT-OSS: stacked experts in HF's [E, in, out] order, attention sinks, biases (etp 1:
    # megatron-core refuses MoE biases with etp > 1); Bridge's expert mappings are grouped
    # exports (tasks mode refuses them, naming mode='export')
    ("tiny-gpt-oss", 2, 1, 2, ("export", "refuse:tasks")),
]

#: expert tensor-parallel size where megatron-core's default (tp) does not apply
ETP = {"tiny-gpt-oss": 1}

SPECS = {"dense": ("vllm:tp=2", "vllm:tp=4"), "moe": ("vllm:tp=2", "vllm:tp=2,ep")}


def _label(name, tp, pp, ep):
    return f"{name}-tp{tp}pp{pp}ep{ep}"


def _refusal(rank: int, out: Path) -> None:
    """Every rank: a Bridge model of an architecture m2nkit has no family for is refused
    before any torch.distributed call."""
    from megatron.bridge import AutoBridge

    from m2nkit.adapters.megatron.bridge import BridgeSourceError, bridge_source

    from ._bridge import CountCalls

    bridge = AutoBridge.from_hf_pretrained(str(out / "tiny-mistral"))
    with CountCalls() as cc:
        try:
            bridge_source(bridge, [])
            msg = "not refused"
        except BridgeSourceError as e:
            msg = str(e)
    (out / f"refusal.r{rank}.txt").write_text(f"{msg}\n{cc.counts}")


@pytest.fixture(scope="module")
def ran(tiny_checkpoints, tmp_path_factory):
    from transformers import MistralConfig

    from m2nkit.adapters.tiny import save_tiny_checkpoint

    out = tmp_path_factory.mktemp("bridge_oracle")
    save_tiny_checkpoint(MistralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       vocab_size=128, architectures=["MistralForCausalLM"]),
                         out / "tiny-mistral")
    cases = [Case(_label(n, tp, pp, ep), str(tiny_checkpoints(n)), tp, pp, ep, modes,
                  ETP.get(n)) for n, tp, pp, ep, modes in MATRIX]
    seconds = launch(WORLD, cases, out, TIMEOUT_S, extra=_refusal)
    print(f"bridge oracle: {len(cases)} cases on {WORLD} ranks in {seconds:.0f} s")
    return out, {c.label: c for c in cases}


def _wire_reference(name: str, shape, exported: dict) -> torch.Tensor:
    """The wire tensor from Bridge's export: as is, or its per-expert tensors stacked."""
    if name in exported:
        return exported[name]
    stacked = name.removesuffix(".weight")
    if stacked in exported:  # GPT-OSS: transformers' [E, in, out]; the wire is [E, out, in]
        return exported[stacked].permute(0, 2, 1)
    m = re.fullmatch(r"(.*)\.experts\.(gate_up_proj|down_proj)\.weight", name)
    assert m, f"Bridge's export has no '{name}'"
    prefix, leaf = m.groups()
    per = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    return torch.stack([torch.cat([exported[f"{prefix}.experts.{e}.{p}.weight"] for p in per])
                        for e in range(shape[0])])


def _check(out: Path, case: Case, mode: str, exported: dict) -> list:
    payloads = [torch.load(out / f"{case.label}.{mode}.r{r}.pt") for r in range(WORLD)]
    docs = [p["manifest"] for p in payloads]
    assert all(d == docs[0] for d in docs), f"{case.label} {mode}: ranks declared different manifests"
    metas, T = manifest_from_json(docs[0])
    assert T == WORLD
    locals_ = [dict(p["locals"]) for p in payloads]
    for m in metas:
        ref = _wire_reference(m.name, m.shape, exported)
        assert m.dtype == ref.dtype and tuple(m.shape) == tuple(ref.shape), (case.label, mode, m.name)
        covered = torch.zeros(m.shape, dtype=torch.bool)
        for p in m.source_pieces(T):
            got = locals_[p.rank][m.name][box_slices(p.local_box)]
            assert bitwise_equal(got, ref[box_slices(p.box)]), (case.label, mode, m.name, p)
            covered[box_slices(p.box)] = True
        assert bool(covered.all()), (case.label, mode, m.name, "elements no rank holds")
    calls = [p["calls"] for p in payloads]
    if mode == "tasks":
        assert calls == [{}] * WORLD, (case.label, "collectives while iterating", calls)
        assert payloads[0]["gathered"] == {}
    else:
        assert all(c for c in calls), (case.label, mode, "Bridge's path made no collective?")
    if mode == "gather":
        gathered = payloads[0]["gathered"]
        assert "model.layers.0.self_attn.k_proj.weight" in gathered
        assert "model.layers.1.mlp.experts.gate_up_proj.weight" in gathered
        assert "model.layers.0.self_attn.o_proj.weight" not in gathered  # still local
        assert any("QKVMapping" in n and "gather" in n for n in payloads[0]["notes"])
    if mode == "export":
        assert set(payloads[0]["gathered"]) == {m.name for m in metas}
        # replicas everywhere: the planner spreads the sends (checked in the round below)
    return metas


@pytest.mark.parametrize("label", [_label(n, tp, pp, ep) for n, tp, pp, ep, _ in MATRIX])
def test_wire_tensors_equal_bridge_export_and_rounds_equal_vllm_reference(ran, label):
    out, cases = ran
    case = cases[label]
    exported = torch.load(out / f"{label}.export.pt")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(case.ckpt)
    for mode in case.modes:
        if mode.startswith("refuse:"):
            texts = {(out / f"{label}.{mode.replace(':', '-')}.r{r}.txt").read_text()
                     for r in range(WORLD)}
            assert len(texts) == 1, texts  # every rank, the same message
            msg = texts.pop()
            assert "mode='tasks' cannot send GPTOSSMLP" in msg and "mode='export'" in msg, msg
            continue
        metas = _check(out, case, mode, exported)
        streams = {r: torch.load(out / f"{label}.{mode}.r{r}.pt")["locals"] for r in range(WORLD)}
        for spec in SPECS["moe" if "moe" in label or "gpt-oss" in label else "dense"]:
            dest = destination_layout(config, metas, spec)
            plan = build_plan(metas, WORLD, dest)
            assert plan.problems == [], (label, mode, spec, plan.problems[:3])
            storage = {w: allocate_storage(dest, w) for w in range(dest.num_workers)}
            execute_plan(plan, {r: iter(streams[r]) for r in range(WORLD)}, storage)
            for w, params in storage.items():
                ref = reference_load(config, exported, spec, w, fill=float("nan"))
                for pname, t in params.items():
                    assert bitwise_equal(t, ref[pname]), (label, mode, spec, w, pname)
            if mode == "export":  # every rank holds every tensor: replica balancing spreads
                sent = [sum(b for (s, _), b in plan.link_bytes.items() if s == r)
                        for r in range(WORLD)]
                assert max(sent) <= 2 * plan.nbytes_moved / WORLD, (label, spec, sent)


def test_architecture_without_family_refused_before_traffic(ran):
    out, _ = ran
    texts = [(out / f"refusal.r{r}.txt").read_text() for r in range(WORLD)]
    assert all(t == texts[0] for t in texts)
    msg, calls = texts[0].rsplit("\n", 1)
    assert "'MistralForCausalLM'" in msg and "no family" in msg, msg
    assert "supported: " in msg and "LlamaForCausalLM" in msg
    assert calls == "{}"
