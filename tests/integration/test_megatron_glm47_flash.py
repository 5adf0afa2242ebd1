"""GLM-4.7-Flash (MLA + MoE) through ``megatron_source`` and ``bridge_source``: real
Megatron-Core GPTModels on CPU, gloo.

One launch of 4 gloo processes builds the tiny ``Glm4MoeLiteForCausalLM``
checkpoint through Megatron-Bridge's ``GLM47FlashBridge``
(``glm/glm47_flash_bridge.py``: ``AutoBridge.from_hf_pretrained`` +
``load_hf_weights``) in every layout below and dumps what ``megatron_source``
and ``bridge_source(mode="tasks")`` declare and hold, and Bridge's own
``export_hf_weights``. The model is DeepSeek-V3's as megatron-core builds it
(``MLASelfAttention`` with q LoRA and q/kv norms, layer 0 a dense MLP, the
others MoE with a shared expert and ``router.expert_bias``) with the local
decoder block spec; as for DeepSeek-V3, the parameterless core attention is
the CPU stand-in (``compat.with_mla_stand_in``) and no MTP block is built.
Checked per layout (``_megatron.check_pieces_and_rounds``): identical manifests on
every rank; every piece equal to the HF checkpoint's slice bit for bit; Bridge's
export equal to the checkpoint; rounds into ``vllm:tp=1/2/4[,ep]`` equal vLLM's
reference loaders. Two more cases load the shipped checkpoint itself
(tests/data/oracle/tiny-glm4-moe-lite/checkpoint, tp2 and tp2ep2): their rounds into
``vllm:tp=1/2/4[,ep]`` are compared with the real vLLM 0.33.0 dumps beside it
(``<model>/tp<T>[_ep]/rank<r>.safetensors``) directly, bit for bit.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tests.integration._megatron import (Layout, check_names_equal_table,
                                         check_pieces_and_rounds, launch, run_layouts)

pytestmark = pytest.mark.integration

WORLD = 4
NAME = "tiny-glm4-moe-lite"
EP_SPECS = ("vllm:tp=1", "vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep")
#: the shipped checkpoint's vLLM dumps: spec -> (tp, enable_expert_parallel)
DUMPS = {"vllm:tp=1": (1, False), "vllm:tp=2": (2, False), "vllm:tp=2,ep": (2, True),
         "vllm:tp=4": (4, False), "vllm:tp=4,ep": (4, True)}
#: (label, layout kwargs) built from the shipped checkpoint, unchanged
SHIPPED = [("dumps-tp2", dict(tp=2)), ("dumps-tp2ep2", dict(tp=2, ep=2))]

# (label, layers, layout kwargs, vLLM specs)
CASES = [
    ("tp2", 2, dict(tp=2), ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4")),
    ("tp2pp2", 2, dict(tp=2, pp=2), ("vllm:tp=2", "vllm:tp=4,ep")),
    ("pp2vpp2", 4, dict(pp=2, vpp=2), ("vllm:tp=2",)),
    ("tp2ep2", 2, dict(tp=2, ep=2), EP_SPECS),
    ("tp2ep2etp1", 2, dict(tp=2, ep=2, etp=1), ("vllm:tp=2", "vllm:tp=4,ep")),
]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config
    from tests.integration.test_megatron_source import _nontrivial_norms

    root = tmp_path_factory.mktemp("glm47")
    layouts, meta = [], {}
    for label, layers, kw, specs in CASES:
        ckpt = root / f"{NAME}-{layers}"
        if not ckpt.exists():
            cfg = tiny_config(NAME, num_hidden_layers=layers)
            # the legacy num_experts Bridge reads for num_moe_experts follows
            # n_routed_experts (families/glm4_moe_lite.py TINY_MODELS)
            assert cfg.num_experts == cfg.n_routed_experts == 4
            save_tiny_checkpoint(cfg, ckpt, seed=7)
            _nontrivial_norms(ckpt)
        layouts.append(Layout(label, str(ckpt), **kw))
        meta[label] = (ckpt, specs)
    from _oracle import DATA

    for label, kw in SHIPPED:
        layouts.append(Layout(label, str(DATA / NAME / "checkpoint"), **kw))
        meta[label] = (DATA / NAME / "checkpoint", tuple(DUMPS))
    out = root / "out"
    out.mkdir()
    launch(WORLD, functools.partial(run_layouts, layouts, export=True), out, timeout_s=900)
    return out, meta


def _payload(dumped, label, rank=0):
    out, _ = dumped
    return torch.load(out / f"{label}.r{rank}.pt")


def _metas(dumped, label):
    from m2nkit.manifest import manifest_from_json

    return {m.name: m for m in manifest_from_json(_payload(dumped, label)["manifest"])[0]}


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_pieces_equal_the_checkpoint_bridge_export_and_land_like_vllm(dumped, label):
    out, meta = dumped
    ckpt_dir, specs = meta[label]
    check_pieces_and_rounds(out, label, ckpt_dir, specs, WORLD)


@pytest.mark.parametrize("label", [c[0] for c in SHIPPED])
@pytest.mark.parametrize("source", ["megatron", "bridge"])
def test_rounds_from_the_shipped_checkpoint_equal_the_vllm_dumps(dumped, label, source):
    """megatron_source and bridge_source(mode="tasks") pieces of the shipped checkpoint,
    planned into each dumped vLLM layout and executed: every worker's storage equals
    the real vLLM 0.33.0 dump bit for bit (NaN-filled first, so a missed element shows)."""
    from _oracle import _oracle, _same

    from m2nkit.adapters.hf_checkpoint import read_checkpoint
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.in_process import allocate_storage, execute_plan
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest import manifest_from_json

    out, meta = dumped
    ckpt_dir, specs = meta[label]
    check_pieces_and_rounds(out, label, ckpt_dir, specs, WORLD)
    name = label if source == "megatron" else f"bridge-{label}"
    payloads = [_payload(dumped, name, r) for r in range(WORLD)]
    metas, _ = manifest_from_json(payloads[0]["manifest"])
    config = read_checkpoint(ckpt_dir).config
    for spec, (tp, ep) in DUMPS.items():
        dest = destination_layout(config, metas, spec)
        plan = build_plan(metas, WORLD, dest)
        assert plan.problems == [] and dest.num_workers == tp, (spec, plan.problems[:3])
        storage = {w: allocate_storage(dest, w) for w in range(tp)}
        execute_plan(plan, {r: iter(payloads[r]["locals"]) for r in range(WORLD)}, storage)
        for w in range(tp):
            vllm, vmeta = _oracle(NAME, tp, ep, w)
            aliases = set(json.loads(vmeta["aliases"]))
            assert set(storage[w]) == set(vllm) - aliases, (spec, w)
            for pname, t in storage[w].items():
                _same(t, vllm[pname], f"{name} {spec} worker {w} {pname}")


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_bridge_source_tasks_mode_sends_shards_without_a_gather(dumped, label):
    """bridge_source(mode="tasks") on the same model: no wire tensor through Bridge's
    gather, every piece equal to the checkpoint, rounds equal to vLLM's loaders."""
    out, meta = dumped
    ckpt_dir, specs = meta[label]
    for r in range(WORLD):
        assert _payload(dumped, f"bridge-{label}", r)["gathered"] == {}, (label, r)
    check_pieces_and_rounds(out, f"bridge-{label}", ckpt_dir, specs, WORLD)


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_live_names_equal_the_hand_table(dumped, label):
    """GLM47FlashBridge's registry (the live names) and names.GLM4_MOE_LITE agree."""
    out, meta = dumped
    check_names_equal_table(out, label, meta[label][0])


def test_names_come_from_glm47_flash_bridge(dumped):
    p = _payload(dumped, "tp2")
    assert p["names_from"] == "Megatron-Bridge GLM47FlashBridge.mapping_registry()"
    kinds = {m: rule for ms, rule, *_ in p["names"] for m in ms}
    at = "decoder.layers.{L}.self_attention."
    assert kinds[at + "linear_q_down_proj.weight"] == "column"
    assert kinds[at + "linear_q_up_proj.weight"] == "column"
    assert kinds[at + "linear_kv_up_proj.weight"] == "column"
    assert kinds[at + "linear_proj.weight"] == "row"
    assert kinds["decoder.layers.{L}.mlp.shared_experts.linear_fc1.weight"] == "gated_fc1"


def test_pp_stage_publishes_global_layer_indices(dumped):
    """Stage 1 holds layer 1 (the MoE one) as its local layer 0; the wire says layer 1."""
    m = _metas(dumped, "tp2pp2")
    assert {p.rank for p in m["model.layers.1.self_attn.q_b_proj.weight"].pieces} == {2, 3}
    assert {p.rank for p in m["model.layers.1.mlp.experts.gate_up_proj.weight"].pieces} == {2, 3}
    mods = _payload(dumped, "tp2pp2", rank=2)["module_names"]
    assert mods["model.layers.1.self_attn.q_b_proj.weight"] == (
        "chunk0.decoder.layers.0.self_attention.linear_q_up_proj.weight",)
    v = _metas(dumped, "pp2vpp2")
    assert {p.rank for p in v["model.layers.2.self_attn.kv_b_proj.weight"].pieces} == {0, 1}
    assert {p.rank for p in v["model.layers.3.self_attn.kv_b_proj.weight"].pieces} == {2, 3}


def test_expert_bias_sent_as_fp32(dumped):
    """The MoE layer's router.expert_bias is the fp32 e_score_correction_bias; layer 0
    (``first_k_dense_replace: 1``) is dense and has none."""
    for label in ("tp2", "tp2pp2", "tp2ep2", "tp2ep2etp1"):
        m = _metas(dumped, label)
        b = m["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert b.dtype == torch.float32, (label, b.dtype)
        assert b.pieces, label
        assert "model.layers.0.mlp.gate.e_score_correction_bias" not in m
        exported = _payload(dumped, label)["export"]
        assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
