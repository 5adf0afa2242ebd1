"""DeepSeek-V3 (MLA) through ``megatron_source``: real Megatron-Core GPTModels on CPU, gloo.

One launch of 4 gloo processes builds the tiny DeepSeek-V3 checkpoints through
Megatron-Bridge's ``DeepSeekV3Bridge`` (``AutoBridge.from_hf_pretrained`` +
``load_hf_weights``) in every layout below and dumps what ``megatron_source``
declares and holds, and Bridge's own ``export_hf_weights``. The model is
megatron-core's ``MLASelfAttention`` with the local decoder block spec (layer
0 a dense MLP, layer 1 MoE with a shared expert and ``router.expert_bias``);
the one thing replaced is the parameterless core attention, which the local
spec cannot build for MLA (``compat.with_mla_stand_in``, docs/megatron.md), and
the MTP block is not built (Bridge builds it with TransformerEngine only).

The same model also goes through ``bridge_source(mode="tasks")``: no gather,
the same checks. Checked per layout (``_megatron.check_pieces_and_rounds``): identical
manifests on every rank; every piece equal to the HF checkpoint's slice bit for
bit; Bridge's export equal to the checkpoint; rounds into ``vllm:tp=1/2/4[,ep]``
equal vLLM's reference loaders (real vLLM 0.33 dumps:
tests/data/oracle/tiny-deepseek-v3*). Field reports, each a test:

* a PP stage publishes global layer indices (NeMo-RL#3259);
* MLA with ``q_lora_rank: null``: megatron-core 0.19.2 builds ``linear_q_proj``
  as TransformerEngine's fused norm+linear, an unmapped layer-norm parameter
  (Megatron-Bridge#5261/#5585), so that variant cannot be built on CPU (the demo
  refuses it, naming the module); its parameter, put on one rank, is refused by
  every rank naming it (the dry run of ``q_lora_rank: null`` is in
  tests/adapters/test_megatron_layout.py);
* the routed experts' ``e_score_correction_bias`` outside MTP layers is sent,
  as fp32 (Megatron-Bridge#4657).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.integration._megatron import (Layout, check_names_equal_table,
                                         check_pieces_and_rounds, launch, run_layouts)

pytestmark = pytest.mark.integration

WORLD = 4
EP_SPECS = ("vllm:tp=1", "vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep")

# (label, tiny model, layers, layout kwargs, vLLM specs)
CASES = [
    ("tp2", "tiny-deepseek-v3", 2, dict(tp=2), ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4")),
    ("tp2pp2", "tiny-deepseek-v3", 2, dict(tp=2, pp=2), ("vllm:tp=2", "vllm:tp=4,ep")),
    ("pp2vpp2", "tiny-deepseek-v3", 4, dict(pp=2, vpp=2), ("vllm:tp=2",)),
    ("tp2ep2", "tiny-deepseek-v3", 2, dict(tp=2, ep=2), EP_SPECS),
    ("tp2ep2etp1", "tiny-deepseek-v3", 2, dict(tp=2, ep=2, etp=1), ("vllm:tp=2", "vllm:tp=4,ep")),
]


def _work(cases, rank, out):
    """Every case (with Bridge's export), then the q-norm-without-q-LoRA refusal."""
    import json

    from m2nkit.adapters import megatron_source
    from m2nkit.adapters.megatron.source import MegatronSourceError
    from tests.integration._megatron import build_model, init_megatron

    run_layouts(cases, rank, out, export=True)
    c = cases[0]
    init_megatron(c)
    bridge, model = build_model(c)
    if rank == 2:  # what megatron-core builds for q_lora_rank null with qk_layernorm
        gpt = model[0]
        while not hasattr(gpt, "decoder"):  # Float16Module / DDP wrappers
            gpt = gpt.module
        attn = gpt.decoder.layers[0].self_attention
        fused = torch.nn.Module()
        fused.layer_norm_weight = torch.nn.Parameter(torch.ones(64))
        attn.linear_q_proj = fused
    try:
        megatron_source(model, config=bridge.hf_pretrained.config)
        got = "ok"
    except MegatronSourceError as e:
        got = str(e)
    (out / f"qnorm.r{rank}.json").write_text(json.dumps(got))


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config
    from tests.integration.test_megatron_source import _nontrivial_norms

    root = tmp_path_factory.mktemp("mla")
    layouts, meta = [], {}
    for label, name, layers, kw, specs in CASES:
        ckpt = root / f"{name}-{layers}"
        if not ckpt.exists():
            save_tiny_checkpoint(tiny_config(name, num_hidden_layers=layers), ckpt, seed=7)
            _nontrivial_norms(ckpt)
        layouts.append(Layout(label, str(ckpt), **kw))
        meta[label] = (ckpt, specs)
    out = root / "out"
    out.mkdir()
    launch(WORLD, functools.partial(_work, layouts), out, timeout_s=900)
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
    """DeepSeekV3Bridge's registry (the live names) and names.DEEPSEEK_V3 (the dry run's) agree."""
    out, meta = dumped
    check_names_equal_table(out, label, meta[label][0])


def test_names_come_from_deepseek_v3_bridge(dumped):
    p = _payload(dumped, "tp2")
    assert p["names_from"] == "Megatron-Bridge DeepSeekV3Bridge.mapping_registry()"
    kinds = {m: rule for ms, rule, *_ in p["names"] for m in ms}
    at = "decoder.layers.{L}.self_attention."
    # megatron-core's local spec builds the MLA down projections as ColumnParallelLinear
    # (multi_latent_attention.py, gather_output=False): Bridge's AutoMapping says column
    assert kinds[at + "linear_q_down_proj.weight"] == "column"
    assert kinds[at + "linear_kv_down_proj.weight"] == "column"
    assert kinds[at + "linear_kv_up_proj.weight"] == "column"
    assert kinds["decoder.layers.{L}.mlp.shared_experts.linear_fc1.weight"] == "gated_fc1"


def test_pp_stage_publishes_global_layer_indices(dumped):
    """NeMo-RL#3259: stage 1 holds layer 1 as its local layer 0; the wire says layer 1."""
    m = _metas(dumped, "tp2pp2")
    q = m["model.layers.1.self_attn.q_b_proj.weight"]
    assert {p.rank for p in q.pieces} == {2, 3}
    assert not any(name.startswith("model.layers.0.") and any(p.rank in (2, 3) for p in t.pieces)
                   for name, t in m.items())
    mods = _payload(dumped, "tp2pp2", rank=2)["module_names"]
    assert mods["model.layers.1.self_attn.q_b_proj.weight"] == (
        "chunk0.decoder.layers.0.self_attention.linear_q_up_proj.weight",)
    # the MoE layer's wire names on stage 1 carry layer 1, its experts global numbers
    e = m["model.layers.1.mlp.experts.gate_up_proj.weight"]
    assert {p.rank for p in e.pieces} == {2, 3}
    # pp2vpp2: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (dp 2)
    v = _metas(dumped, "pp2vpp2")
    assert {p.rank for p in v["model.layers.2.self_attn.kv_b_proj.weight"].pieces} == {0, 1}
    assert {p.rank for p in v["model.layers.3.self_attn.kv_b_proj.weight"].pieces} == {2, 3}


def test_q_norm_without_q_lora_is_refused_naming_it(dumped):
    """Megatron-Bridge#5261/#5585: for ``q_lora_rank: null`` with ``qk_layernorm``,
    megatron-core 0.19.2 builds ``linear_q_proj`` as TransformerEngine's fused
    norm+linear (``mla_qk_norm_config.py`` ``_resolve_mla_qk_layernorm``): a
    ``linear_q_proj.layer_norm_weight`` that HF lacks and Bridge's registry does not
    map. Put on one rank's model, every rank refuses it, naming it and rank 2."""
    import json

    from m2nkit.adapters.megatron.compat import enable_cpu
    from m2nkit.adapters.megatron.registry import registry_rows
    from m2nkit.adapters.families import family_for

    out, _ = dumped
    got = [json.loads((out / f"qnorm.r{r}.json").read_text()) for r in range(WORLD)]
    assert len(set(got)) == 1, got
    msg = got[0]
    assert msg.startswith("megatron_source: refused by rank 2 of 4"), msg
    assert ("parameter 'decoder.layers.0.self_attention.linear_q_proj.layer_norm_weight' "
            "(rank 2, chunk 0) has no mapping in Megatron-Bridge "
            "DeepSeekV3Bridge.mapping_registry()") in msg, msg
    enable_cpu()
    fam = family_for({"architectures": ["DeepseekV3ForCausalLM"]})
    table = registry_rows("DeepseekV3ForCausalLM", fam)
    assert table.row_of("decoder.layers.0.self_attention.linear_q_proj.layer_norm_weight") is None
    assert table.row_of("decoder.layers.0.self_attention.linear_q_proj.weight") is not None


def test_expert_bias_sent_as_fp32_outside_mtp_layers(dumped):
    """Megatron-Bridge#4657: the MoE layer's router.expert_bias is the fp32
    e_score_correction_bias, sent (pieces checked bit for bit above) on every layout."""
    for label in ("tp2", "tp2pp2", "tp2ep2", "tp2ep2etp1"):
        m = _metas(dumped, label)
        b = m["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert b.dtype == torch.float32, (label, b.dtype)
        assert b.pieces, label
        assert "model.layers.0.mlp.gate.e_score_correction_bias" not in m  # layer 0 is dense
        exported = _payload(dumped, label)["export"]
        assert exported["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
