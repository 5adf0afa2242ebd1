"""destination_layout (the fast path) against reference_load (vLLM's loader semantics).

For every tiny model x tp 1/2/4/8 x dp 1/2 x EP on/off (MoE), every worker's
storage is filled from the wire tensors through the layout's bindings and
zero boxes and must equal ``reference_load`` of the on-disk checkpoint bit
for bit, with every parameter element written exactly once. The reference is
itself pinned to real vLLM 0.33.0 dumps in test_vllm_oracle.py; dp > 1 is
not covered by the oracle (it builds one TP group) and rests on the rules.
"""

from __future__ import annotations

import re
import time
from functools import lru_cache

from _oracle import _model
from _paths import ORACLE
import pytest
import torch

from m2nkit.adapters.vllm import (
    InferenceSpec,
    destination_layout,
    parse_inference_spec,
    reference_load,
    supported_architectures,
)
from m2nkit.manifest import ParamMeta

DATA = ORACLE
DENSE = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied", "tiny-gemma2", "tiny-gemma3"]
MOE = ["tiny-qwen3-moe", "tiny-mixtral"]
#: tiny-gpt-oss (nkv = 4, E = 4, I = 128): vLLM's GPT-OSS takes tp <= nkv and an EP size
#: dividing E (families/gpt_oss.py), so its layouts are listed: (tp, dp, ep).
GPT_OSS_LAYOUTS = [(1, 1, False), (2, 1, False), (4, 1, False), (1, 2, False), (2, 2, False),
                   (4, 2, False), (2, 1, True), (4, 1, True), (1, 2, True), (2, 2, True),
                   (1, 4, True)]
#: Llama-4 (4 query heads: tp 8 is refused; families/llama4.py, llama4_vl.py)
LLAMA4 = ["tiny-llama4", "tiny-llama4-vision"]


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def stack_experts(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On-disk names -> wire tensors: per-expert weights stacked per layer.

    ``gate_up_proj[e] = cat(gate_e, up_e)`` (Mixtral: ``cat(w1_e, w3_e)``),
    ``down_proj[e] = down_e`` (``w2_e``).
    """
    wire: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in ckpt.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            wire[name] = t
    for prefix, per in experts.items():
        gate, up, down = ("w1", "w3", "w2") if "w1" in per[0] else ("gate_proj", "up_proj", "down_proj")
        ids = range(len(per))
        wire[f"{prefix}.gate_up_proj.weight"] = torch.stack([torch.cat([per[e][gate], per[e][up]]) for e in ids])
        wire[f"{prefix}.down_proj.weight"] = torch.stack([per[e][down] for e in ids])
    return wire


@lru_cache(maxsize=None)
def load_model(model: str):
    """(config dict, on-disk tensors, wire tensors, wire ParamMetas) of a shipped checkpoint
    (``_oracle._model``: experts stacked, stored [E, in, out] ones permuted to the wire's)."""
    config, ckpt, wire = _model(model)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    return config, ckpt, wire, metas


def _slices(box):
    return tuple(slice(a, b) for a, b in box)


def fill_worker(layout, wire, worker: int):
    """Storage of ``worker`` filled via bindings + zero boxes, and a write count per element."""
    store = layout.allocate(worker, fill=float("nan"))
    count = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in store.items()}
    for p in layout.params:
        if p.worker == worker:
            for box in p.zero_boxes:
                store[p.name][_slices(box)] = 0
                count[p.name][_slices(box)] += 1
    for wname, bindings in layout.bindings.items():
        for b in bindings:
            if b.worker != worker:
                continue
            dst = tuple(slice(o, o + (hi - lo)) for o, (lo, hi) in zip(b.offset, b.box))
            store[b.param][dst] = wire[wname][_slices(b.box)]
            count[b.param][dst] += 1
    return store, count


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _cases():
    for model in DENSE + MOE:
        for tp in (1, 2, 4, 8):
            for dp in (1, 2):
                for ep in ((False, True) if model in MOE else (False,)):
                    yield pytest.param(model, tp, dp, ep, id=f"{model}-tp{tp}-dp{dp}{'-ep' if ep else ''}")
    for model in LLAMA4:
        for tp in (1, 2, 4):
            for dp in (1, 2):
                for ep in (False, True):
                    yield pytest.param(model, tp, dp, ep, id=f"{model}-tp{tp}-dp{dp}{'-ep' if ep else ''}")
    for tp, dp, ep in GPT_OSS_LAYOUTS:
        yield pytest.param("tiny-gpt-oss", tp, dp, ep,
                           id=f"tiny-gpt-oss-tp{tp}-dp{dp}{'-ep' if ep else ''}")


@pytest.mark.parametrize("model,tp,dp,ep", list(_cases()))
def test_layout_equals_reference(model, tp, dp, ep):
    config, ckpt, wire, metas = load_model(model)
    spec = InferenceSpec(tp, dp, ep)  # ep with tp*dp = 16: 8 workers hold no expert, as in vLLM
    layout = destination_layout(config, metas, spec)
    assert layout.num_workers == tp * dp and layout.spec == str(spec)
    assert not layout.unknown
    for worker in range(spec.num_workers):
        store, count = fill_worker(layout, wire, worker)
        ref = reference_load(config, ckpt, spec, worker)
        assert set(store) == set(ref) - set(layout.aliases)
        for alias, canonical in layout.aliases.items():
            assert ref[alias] is ref[canonical]
        for name, t in store.items():
            assert t.shape == ref[name].shape, name
            c = count[name]
            assert c.numel() == 0 or int(c.min()) == 1 and int(c.max()) == 1, (
                f"{name} on worker {worker}: {(c == 0).sum()} elements unwritten, "
                f"{(c > 1).sum()} written twice")
            assert torch.equal(bits(t), bits(ref[name])), f"{name} differs on worker {worker}"
        for p in layout.params:
            if p.worker == worker:
                for box in p.zero_boxes:
                    assert not store[p.name][_slices(box)].any()


def test_vocab_padding_rows_are_zero_boxes():
    config, _, _, metas = load_model("tiny-llama")  # V = 200 -> Vp = 256
    layout = destination_layout(config, metas, "vllm:tp=8")
    idx = layout.param_index()
    # per = 32 rows; rank 6 holds tokens 192..199 then 24 zero rows; rank 7 only zeros.
    assert idx[(6, "model.embed_tokens.weight")].zero_boxes == (((8, 32), (0, 128)),)
    assert idx[(7, "lm_head.weight")].zero_boxes == (((0, 32), (0, 128)),)
    assert idx[(5, "lm_head.weight")].zero_boxes == ()
    assert not [b for b in layout.bindings["lm_head.weight"] if b.worker == 7]
    one = destination_layout(config, metas, "vllm:tp=1")
    assert one.param_index()[(0, "lm_head.weight")].zero_boxes == (((200, 256), (0, 128)),)


def test_kv_heads_replicated_when_tp_exceeds_them():
    config, _, _, metas = load_model("tiny-qwen3")  # nh 8, nkv 2, hd 16
    layout = destination_layout(config, metas, "vllm:tp=8")
    k = {b.worker: b for b in layout.bindings["model.layers.0.self_attn.k_proj.weight"]}
    assert [k[w].box[0] for w in range(8)] == [(0, 16)] * 4 + [(16, 32)] * 4
    assert {k[w].offset for w in range(8)} == {(16, 0)}  # after one q head
    v = {b.worker: b for b in layout.bindings["model.layers.0.self_attn.v_proj.weight"]}
    assert {v[w].offset for w in range(8)} == {(32, 0)}


def test_experts_without_and_with_ep():
    config, _, _, metas = load_model("tiny-qwen3-moe")  # E 8, Im 32, H 128
    name = "model.layers.0.mlp.experts.gate_up_proj.weight"
    tpm = destination_layout(config, metas, "vllm:tp=2,dp=2")  # MoE tp = 4, Im/4 = 8
    w1 = [b for b in tpm.bindings[name] if b.worker == 1]
    assert [(b.box, b.offset) for b in w1] == [
        (((0, 8), (8, 16), (0, 128)), (0, 0, 0)),
        (((0, 8), (40, 48), (0, 128)), (0, 8, 0)),
    ]
    p = tpm.param_index()[(3, "model.layers.0.mlp.experts.routed_experts.w13_weight")]
    assert p.shape == (8, 16, 128)
    ep = destination_layout(config, metas, "vllm:tp=2,dp=2,ep")
    w3 = [b for b in ep.bindings[name] if b.worker == 3]
    assert [(b.box, b.offset) for b in w3] == [(((6, 8), (0, 64), (0, 128)), (0, 0, 0))]
    down = [b for b in ep.bindings["model.layers.0.mlp.experts.down_proj.weight"] if b.worker == 3]
    assert down[0].box == ((6, 8), (0, 128), (0, 32))
    assert ep.aliases["model.layers.1.mlp.experts.gate.weight"] == "model.layers.1.mlp.gate.weight"


def test_dense_tensors_are_replicated_across_dp():
    config, _, _, metas = load_model("tiny-llama")
    layout = destination_layout(config, metas, "vllm:tp=2,dp=3")
    by_worker = {b.worker: (b.box, b.offset, b.param)
                 for b in layout.bindings["model.layers.1.self_attn.o_proj.weight"]}
    assert sorted(by_worker) == list(range(6))
    for w in range(6):
        assert by_worker[w] == by_worker[w % 2]


def test_tied_lm_head_is_skipped_and_aliased():
    config, _, wire, metas = load_model("tiny-qwen3-tied")
    assert "lm_head.weight" not in wire  # transformers does not save a tied head
    extra = metas + [ParamMeta("lm_head.weight", torch.bfloat16, (200, 128))]
    layout = destination_layout(config, extra, "vllm:tp=2")
    assert "lm_head.weight" in layout.skipped and "lm_head.weight" not in layout.bindings
    assert layout.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert all(p.name != "lm_head.weight" for p in layout.params)


def test_unknown_wire_tensors_are_reported_not_raised():
    config, _, _, metas = load_model("tiny-qwen3-moe")
    extra = metas + [
        ParamMeta("model.layers.0.mlp.experts.3.gate_proj.weight", torch.bfloat16, (32, 128)),
        ParamMeta("model.layers.7.input_layernorm.weight", torch.bfloat16, (128,)),
        ParamMeta("model.layers.0.mlp.gate_proj.weight", torch.bfloat16, (96, 128)),
        ParamMeta("model.visual.patch_embed.weight", torch.bfloat16, (4, 4)),
        ParamMeta("model.layers.0.self_attn.rotary_emb.inv_freq", torch.float32, (8,)),
    ]
    layout = destination_layout(config, extra, "vllm:tp=2")
    assert "stacked" in layout.unknown["model.layers.0.mlp.experts.3.gate_proj.weight"]
    assert "num_hidden_layers=2" in layout.unknown["model.layers.7.input_layernorm.weight"]
    assert "dense_layer" in layout.unknown["model.layers.0.mlp.gate_proj.weight"]
    assert "Qwen3MoeForCausalLM" in layout.unknown["model.visual.patch_embed.weight"]
    assert "rotary" in layout.skipped["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert not set(layout.unknown) & set(layout.bindings)


def test_missing_wire_tensor_leaves_its_region_uncovered():
    config, _, wire, metas = load_model("tiny-llama")
    without_k = [m for m in metas if m.name != "model.layers.1.self_attn.k_proj.weight"]
    layout = destination_layout(config, without_k, "vllm:tp=2")
    _, count = fill_worker(layout, wire, 1)
    c = count["model.layers.1.self_attn.qkv_proj.weight"]  # rows [q 64 | k 16 | v 16]
    assert (c[64:80] == 0).all() and (c[:64] == 1).all() and (c[80:] == 1).all()


def _with_dense_layers(config: dict, ckpt: dict, **changes):
    """tiny-qwen3-moe with some layers dense: config + on-disk tensors to match.

    Dense layers carry ``mlp.gate_proj/up_proj/down_proj`` (what transformers'
    Qwen3MoeDecoderLayer saves for them), sparse ones the router and experts.
    """
    from m2nkit.adapters.families.qwen3_moe import is_moe_layer

    config = {**config, **changes}
    g = torch.Generator().manual_seed(0)
    H, I = config["hidden_size"], config["intermediate_size"]
    out = {}
    for name, t in ckpt.items():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= config["num_hidden_layers"]:
            continue
        if m and ".mlp." in name and not is_moe_layer(config, int(m.group(1))):
            continue
        out[name] = t
    for L in range(config["num_hidden_layers"]):
        if not is_moe_layer(config, L):
            for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                out[f"model.layers.{L}.mlp.{proj}.weight"] = torch.randn(
                    shape, generator=g).to(torch.bfloat16)
    return config, out


@pytest.mark.parametrize("changes", [
    {"mlp_only_layers": [1]},
    {"decoder_sparse_step": 2},
], ids=["mlp_only_layers", "decoder_sparse_step"])
def test_qwen3_moe_dense_layers(changes):
    base, ckpt0, _, _ = load_model("tiny-qwen3-moe")
    config, ckpt = _with_dense_layers(base, ckpt0, **changes)
    wire = stack_experts(ckpt)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]
    dense = 1 if "mlp_only_layers" in changes else 0
    sparse = 1 - dense
    for spec in (InferenceSpec(2, 2), InferenceSpec(2, 2, ep=True), InferenceSpec(4)):
        layout = destination_layout(config, metas, spec)
        assert not layout.unknown
        names = {p.name for p in layout.params if p.worker == 0}
        assert f"model.layers.{dense}.mlp.gate_up_proj.weight" in names
        assert f"model.layers.{dense}.mlp.gate.weight" not in names
        assert f"model.layers.{sparse}.mlp.experts.routed_experts.w13_weight" in names
        assert f"model.layers.{dense}.mlp.experts.gate.weight" not in layout.aliases
        for worker in range(spec.num_workers):
            store, count = fill_worker(layout, wire, worker)
            ref = reference_load(config, ckpt, spec, worker)
            assert set(store) == set(ref) - set(layout.aliases)
            for name, t in store.items():
                assert (count[name] == 1).all(), name
                assert torch.equal(bits(t), bits(ref[name])), name


def test_dict_and_pretrained_config_agree():
    from transformers import AutoConfig

    config, _, _, metas = load_model("tiny-mixtral")
    hf = AutoConfig.from_pretrained(DATA / "tiny-mixtral" / "checkpoint")
    a = destination_layout(config, metas, "vllm:tp=2,dp=2")
    b = destination_layout(hf, metas, "vllm:tp=2,dp=2")
    assert a == b


# -- errors -------------------------------------------------------------------

def _tiny_dict(model: str, **changes):
    config = dict(load_model(model)[0])
    config.update(changes)
    return config


@pytest.mark.parametrize("spec,match", [
    ("vllm:tp=3", r"num_attention_heads=8 is not divisible by tp=3.*valid tp with dp=1: \[1, 2, 4, 8\]"),
    ("vllm:tp=16", r"num_attention_heads=8 is not divisible by tp=16"),
])
def test_tp_not_dividing_heads(spec, match):
    config, _, _, metas = load_model("tiny-llama")
    with pytest.raises(ValueError, match=match):
        destination_layout(config, metas, spec)


def test_kv_heads_and_tp_must_divide_one_another():
    config = _tiny_dict("tiny-llama", num_attention_heads=12, num_key_value_heads=3,
                        head_dim=16, hidden_size=192, vocab_size=192)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 is not divisible by tp=2"):
        destination_layout(config, [], "vllm:tp=2")
    with pytest.raises(ValueError, match=r"tp=4 >= num_key_value_heads=3 must be a multiple.*valid tp with dp=1: \[1, 3, 6, 12\]"):
        destination_layout(config, [], "vllm:tp=4")


def test_intermediate_not_divisible():
    config = _tiny_dict("tiny-qwen3", intermediate_size=100)
    with pytest.raises(ValueError, match=r"intermediate_size=100 is not divisible by tp=8.*\[1, 2, 4\]"):
        destination_layout(config, [], "vllm:tp=8")


def test_moe_intermediate_not_divisible_by_flattened_tp():
    config, _, _, metas = load_model("tiny-qwen3-moe")  # Im 32
    with pytest.raises(ValueError, match=r"moe_intermediate_size=32 is not divisible by the MoE tensor-parallel size dp\*tp=64"):
        destination_layout(config, metas, "vllm:tp=2,dp=32")


def _experts_per_worker(layout, wire_name):
    """Global experts each worker's bindings of stacked ``wire_name`` take, in local order."""
    out = {w: [] for w in range(layout.num_workers)}
    for b in sorted(layout.bindings[wire_name], key=lambda b: (b.worker, b.offset)):
        out[b.worker] += list(range(*b.box[0]))
    return out


@pytest.mark.parametrize("model", MOE)
def test_ep_with_experts_not_divisible(model):
    """vLLM 0.33 accepts any E with EP: E // ep each, the remainder on the first ranks
    (pinned to real vLLM in test_vllm_oracle.py)."""
    config = _tiny_dict(model, num_local_experts=6)
    metas = [ParamMeta(n, torch.bfloat16, s) for n, s in _expert_wires(config)]
    layout = destination_layout(config, metas, "vllm:tp=4,ep")
    assert _experts_per_worker(layout, metas[0].name) == {0: [0, 1], 1: [2, 3], 2: [4], 3: [5]}
    shapes = {p.worker: p.shape for p in layout.params if p.name.endswith("w13_weight")
              and ".layers.0." in p.name}
    assert [s[0] for _, s in sorted(shapes.items())] == [2, 2, 1, 1]
    layout = destination_layout(config, metas, "vllm:tp=2,dp=4,ep")   # 6 experts, 8 workers
    assert _experts_per_worker(layout, metas[0].name) == {
        0: [0], 1: [1], 2: [2], 3: [3], 4: [4], 5: [5], 6: [], 7: []}


def _expert_wires(config):
    """``(name, shape)`` of layer 0's stacked expert wire tensors of a tiny MoE config dict."""
    E, H = config["num_local_experts"], config["hidden_size"]
    Im = config.get("moe_intermediate_size") if "moe_intermediate_size" in config \
        else config["intermediate_size"]
    block = "mlp" if "moe_intermediate_size" in config else "block_sparse_moe"
    prefix = f"model.layers.0.{block}.experts"
    return [(f"{prefix}.gate_up_proj.weight", (E, 2 * Im, H)),
            (f"{prefix}.down_proj.weight", (E, H, Im))]


def test_round_robin_placement_falls_back_for_models_without_expert_groups():
    """vLLM honours round robin only with num_expert_group > 1 (expert_map_manager.py);
    these families pass none, so the experts stay linear and the layout says why."""
    config = _tiny_dict("tiny-qwen3-moe", num_local_experts=8)
    metas = [ParamMeta(n, torch.bfloat16, s) for n, s in _expert_wires(config)]
    layout = destination_layout(config, metas, "vllm:tp=2,ep,placement=round_robin")
    assert _experts_per_worker(layout, metas[0].name) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert any("round_robin placement falls back to linear" in n and "num_expert_group" in n
               for n in layout.notes), layout.notes
    assert layout.spec == "vllm:tp=2,dp=1,ep,placement=round_robin"
    layout = destination_layout(config, metas, "vllm:tp=2,placement=round_robin")
    assert any("no expert parallelism" in n for n in layout.notes), layout.notes


def test_qwen3_moe_tp_above_experts():
    config = _tiny_dict("tiny-qwen3-moe", num_local_experts=4)
    with pytest.raises(ValueError, match=r"tp=8 is greater than num_experts=4"):
        destination_layout(config, [], "vllm:tp=8")


def test_unknown_architecture():
    config = _tiny_dict("tiny-llama", architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match=r"'FooForCausalLM'.*LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        destination_layout(config, [], "vllm:tp=1")
    assert "MixtralForCausalLM" in supported_architectures()


def test_wire_shape_mismatch_raises_and_params_keep_the_model_dtype():
    config, _, _, metas = load_model("tiny-llama")
    bad = [m if m.name != "model.norm.weight" else ParamMeta(m.name, m.dtype, (64,)) for m in metas]
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(64,\).*\(128,\)"):
        destination_layout(config, bad, "vllm:tp=1")
    mixed = [m if m.name != "model.layers.0.self_attn.k_proj.weight"
             else ParamMeta(m.name, torch.float32, m.shape) for m in metas]
    # vLLM allocates qkv_proj in the model dtype and casts what it loads.
    dest = destination_layout(config, mixed, "vllm:tp=1")
    assert {p.dtype for p in dest.params} == {torch.bfloat16}
    with pytest.raises(ValueError, match="listed twice"):
        destination_layout(config, metas + metas[:1], "vllm:tp=1")


@pytest.mark.parametrize("text,match", [
    ("", "must start with 'vllm:'"),
    ("sglang:tp=2", "must start with 'vllm:'"),
    ("vllm", r"has no settings: write them after 'vllm:', like vllm:tp=2"),
    (" VLLM ", r"has no settings: write them after 'vllm:'"),
    ("vllm:", "empty item"),
    ("vllm:tp=0", r"'tp=0' needs a positive int \(>= 1\)"),
    ("vllm:tp=-2", r"'tp=-2' needs a positive int"),
    ("vllm:tp=two", r"'tp=two' needs a positive int"),
    ("vllm:dp=2", "has no tp"),
    ("vllm:tp=2,tp=4", "gives 'tp' twice"),
    ("vllm:tp=2,pp=2", r"unknown key 'pp'; valid keys are tp, dp, ep"),
    ("vllm:tp=2,ep=maybe", "must be 'ep', 'ep=1' or 'ep=0'"),
    ("vllm:tp=2,ep=2", r"'ep=2' must be 'ep', 'ep=1' or 'ep=0' \(vLLM's expert parallelism is "
                       r"on or off \(--enable-expert-parallel\): its size is always tp\*dp\)"),
    ("vllm:tp=2,,dp=2", "empty item"),
    ("vllm:tp=2,placement=striped", "placement must be one of linear, round_robin"),
    ("vllm:tp=2,placement", "placement must be one of"),
    ("vllm:tp=2,dtype=fp8", "dtype must be one of auto, bfloat16, float16, half, float32, float"),
    ("vllm:tp=2,dtype=bf16", r"float32, float \(vLLM's --dtype values: write dtype=bfloat16\)$"),
    ("vllm:tp=2,dtype=FP32", r"float32, float \(vLLM's --dtype values: write dtype=float32\)$"),
    ("vllm:tp=2,all2all=nccl", "all2all must be one of allgather_reducescatter, naive"),
    ("vllm:tp=2,dtype=auto,dtype=half", "gives 'dtype' twice"),
])
def test_bad_spec_strings(text, match):
    with pytest.raises(ValueError, match=match):
        parse_inference_spec(text)


def test_spec_parsing_and_worker_numbering():
    assert parse_inference_spec("vllm:tp=4") == InferenceSpec(4, 1, False)
    s = parse_inference_spec(" vllm: dp=2 , tp=4 , ep ")
    assert s == InferenceSpec(4, 2, True) and str(s) == "vllm:tp=4,dp=2,ep"
    assert parse_inference_spec("vllm:tp=2,ep=0").ep is False
    assert s.num_workers == 8 and s.worker(1, 3) == 7 and (s.dp_index(7), s.tp_rank(7)) == (1, 3)
    with pytest.raises(ValueError, match="tp=0"):
        InferenceSpec(0)
    # vLLM engine options: canonical text round-trips; defaults are left out of it
    s = parse_inference_spec("vllm:tp=2,ep,PLACEMENT=Round_Robin,dtype=half,dp=2,"
                             "all2all=deepep_low_latency")
    assert (s.placement, s.dtype, s.all2all) == ("round_robin", "float16", "deepep_low_latency")
    assert str(s) == ("vllm:tp=2,dp=2,ep,placement=round_robin,all2all=deepep_low_latency,"
                      "dtype=float16")
    assert parse_inference_spec(str(s)) == s
    assert str(parse_inference_spec("vllm:tp=2,placement=linear,dtype=auto")) == "vllm:tp=2,dp=1"
    assert parse_inference_spec("vllm:tp=1,dtype=float").dtype == "float32"
    with pytest.raises(ValueError, match=r"placement='striped' is not one of linear, round_robin"):
        InferenceSpec(2, placement="striped")
    with pytest.raises(ValueError, match=r"dtype='half' is not one of auto, bfloat16"):
        InferenceSpec(2, dtype="half")              # the dataclass takes canonical names


# -- dtype as vLLM decides it (vllm/config/model.py _resolve_auto_dtype; the
#    oracle dumps pin the common cases in test_vllm_oracle.py) -----------------

@pytest.mark.parametrize("config_dtype,file_dtypes,spec_dtype,expected", [
    ("bfloat16", [torch.float32], "auto", torch.bfloat16),    # the config's dtype wins
    ("float16", [torch.bfloat16], "auto", torch.float16),
    ("float32", [torch.float32], "auto", torch.bfloat16),     # fp32 -> preferred bf16
    (None, [torch.bfloat16], "auto", torch.bfloat16),         # no config dtype: the files
    (None, [torch.float16], "auto", torch.float16),
    (None, [torch.float32], "auto", torch.bfloat16),
    (None, [torch.bfloat16, torch.float32], "auto", torch.bfloat16),  # common: fp32 -> bf16
    (None, [torch.float16, torch.float32], "auto", torch.bfloat16),
    (None, [torch.bfloat16, torch.int8], "auto", torch.bfloat16),     # int8 casts into bf16
    (None, [torch.int8], "auto", torch.bfloat16),              # not supported -> preferred
    (None, [], "auto", torch.bfloat16),                        # nothing to read: fp32 -> bf16
    ("bfloat16", [torch.bfloat16], "float16", torch.float16),  # --dtype overrides
    ("bfloat16", [torch.bfloat16], "float32", torch.float32),
    (None, [torch.float16, torch.bfloat16], "bfloat16", torch.bfloat16),
])
def test_model_dtype_follows_vllm_auto(config_dtype, file_dtypes, spec_dtype, expected):
    from m2nkit.adapters.vllm.dtype import model_dtype

    config = {"model_type": "qwen3", **({"dtype": config_dtype} if config_dtype else {})}
    got = model_dtype(config, spec_dtype, file_dtypes)
    assert got.dtype == expected
    assert (got.note is None) == (spec_dtype == "auto" and config_dtype is not None
                                  and getattr(torch, config_dtype) == expected)


def test_model_dtype_reads_torch_dtype_and_text_config_and_refuses_what_vllm_does():
    from m2nkit.adapters.vllm.dtype import model_dtype

    assert model_dtype({"torch_dtype": "float16"}).dtype == torch.float16
    assert model_dtype({"text_config": {"dtype": "float16"}}).dtype == torch.float16
    # float16 is not supported for gemma2: auto falls back, an explicit float16 is refused
    assert model_dtype({"model_type": "gemma2", "dtype": "float16"}).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype=float16: vLLM refuses float16 for model_type "
                                         r"'gemma2'"):
        model_dtype({"model_type": "gemma2"}, "float16")
    # fp16 and bf16 tensors, no config dtype: vLLM's choice depends on set order
    with pytest.raises(ValueError, match=r"names no dtype .* bfloat16, float16.*e\.g\. "
                                         r"dtype=bfloat16"):
        model_dtype({}, "auto", [torch.float16, torch.bfloat16])


def test_integer_or_fp8_wire_tensor_needs_a_quantization_config():
    config, _, _, metas = load_model("tiny-qwen3")
    name = "model.layers.0.mlp.down_proj.weight"
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn):
        bad = [m if m.name != name else ParamMeta(name, dtype, m.shape) for m in metas]
        short = str(dtype).removeprefix("torch.")
        with pytest.raises(ValueError, match=rf"wire tensor '{name}' is {short}, but the "
                                             r"Qwen3ForCausalLM config has no quantization_config"):
            destination_layout(config, bad, "vllm:tp=2")
        quantized = {**config, "quantization_config": {"quant_method": "fp8"}}
        destination_layout(quantized, bad, "vllm:tp=2")       # this rule leaves it to the family


# -- scale --------------------------------------------------------------------

#: Qwen/Qwen3-235B-A22B config.json (examples/configs/Qwen__Qwen3-235B-A22B), the sizes that matter.
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_experts": 128, "num_hidden_layers": 94,
    "vocab_size": 151936, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _qwen3_235b_wire():
    c = QWEN3_235B
    H, nh, nkv, hd, Im, E, V = (c[k] for k in ("hidden_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim",
                                               "moe_intermediate_size", "num_experts", "vocab_size"))
    bf = torch.bfloat16
    wire = [ParamMeta("model.embed_tokens.weight", bf, (V, H))]
    for L in range(c["num_hidden_layers"]):
        a, m = f"model.layers.{L}.self_attn", f"model.layers.{L}.mlp"
        wire += [
            ParamMeta(f"{a}.q_proj.weight", bf, (nh * hd, H)),
            ParamMeta(f"{a}.k_proj.weight", bf, (nkv * hd, H)),
            ParamMeta(f"{a}.v_proj.weight", bf, (nkv * hd, H)),
            ParamMeta(f"{a}.o_proj.weight", bf, (H, nh * hd)),
            ParamMeta(f"{a}.q_norm.weight", bf, (hd,)),
            ParamMeta(f"{a}.k_norm.weight", bf, (hd,)),
            ParamMeta(f"model.layers.{L}.input_layernorm.weight", bf, (H,)),
            ParamMeta(f"model.layers.{L}.post_attention_layernorm.weight", bf, (H,)),
            ParamMeta(f"{m}.gate.weight", bf, (E, H)),
            ParamMeta(f"{m}.experts.gate_up_proj.weight", bf, (E, 2 * Im, H)),
            ParamMeta(f"{m}.experts.down_proj.weight", bf, (E, H, Im)),
        ]
    return wire + [ParamMeta("model.norm.weight", bf, (H,)), ParamMeta("lm_head.weight", bf, (V, H))]


@pytest.mark.parametrize("spec", ["vllm:tp=8,dp=8", "vllm:tp=8,dp=8,ep"])
def test_qwen3_235b_at_64_workers_plans_in_seconds(spec):
    wire = _qwen3_235b_wire()
    t0 = time.perf_counter()
    layout = destination_layout(QWEN3_235B, wire, spec)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"{elapsed:.2f}s"
    assert layout.num_workers == 64 and not layout.unknown
    # MoE tp (or ep) spans all 64 workers: every (expert, row) lands exactly once.
    w13 = layout.bindings["model.layers.93.mlp.experts.gate_up_proj.weight"]
    rows = sum((e1 - e0) * (r1 - r0) for (e0, e1), (r0, r1), _ in (b.box for b in w13))
    assert rows == 128 * 2 * 1536
