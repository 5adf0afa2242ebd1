"""Qwen3.5, Qwen3-Next and Qwen3-VL: the layout traced from vLLM 0.33.0's loaders, bit for bit.

m2nkit has no family table for these architectures, so their wire tensors
are transformers 5's in-memory tensors (``named_parameters()`` plus
persistent buffers of transformers' own class, loaded by its own
``from_pretrained`` from the shipped checkpoint: the reference here, not
m2nkit's reading of the files) and their destination layout is what
``adapters/vllm/trace.py`` traces from vLLM's own loaders. Each traced
layout, applied to those tensors, must give every worker exactly what real
vLLM wrote in the dumps of ``tests/data/oracle/tiny-qwen3.5*``,
``tiny-qwen3-next`` and ``tiny-qwen3-vl*`` (``regenerate.py``; README
there). The family facts below are read off the dumps by hand, so a
binding into the wrong parameter fails with the parameter's name.

Covered: ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``,
``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``
(with their vision towers), ``Qwen3NextForCausalLM``,
``Qwen3VLForConditionalGeneration`` and ``Qwen3VLMoeForConditionalGeneration``,
at tp 1/2/4, and with EP at tp 2/4 for the MoE models.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import pytest
import torch

from _oracle import ALL_FIXTURES, DATA, _oracle, assert_layout_equals_dumps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

#: tiny model -> transformers class (config.json's architecture)
MODELS = {
    "tiny-qwen3.5": "Qwen3_5ForCausalLM",
    "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM",
    "tiny-qwen3.5-vl": "Qwen3_5ForConditionalGeneration",
    "tiny-qwen3.5-moe-vl": "Qwen3_5MoeForConditionalGeneration",
    "tiny-qwen3-next": "Qwen3NextForCausalLM",
    "tiny-qwen3-vl": "Qwen3VLForConditionalGeneration",
    "tiny-qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration",
}
MOE = {"tiny-qwen3.5-moe", "tiny-qwen3.5-moe-vl", "tiny-qwen3-next", "tiny-qwen3-vl-moe"}
FIXTURES = [p for p in ALL_FIXTURES if p.values[0] in MODELS]
#: (wire prefix, vLLM prefix) of the text model's layers
PREFIX = {m: (("model.language_model.", "language_model.model.") if "vl" in m
              else ("model.", "model.")) for m in MODELS}


@lru_cache(maxsize=None)
def _wire(model: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors of the shipped checkpoint (its own from_pretrained)."""
    import transformers

    ckpt = DATA / model / "checkpoint"
    arch = json.loads((ckpt / "config.json").read_text())["architectures"][0]
    assert arch == MODELS[model]
    ref = getattr(transformers, arch).from_pretrained(ckpt, dtype=torch.bfloat16)
    params = dict(ref.named_parameters())
    every = {n for n, _ in ref.named_parameters(remove_duplicate=False)}
    buffers = {n: b for n, b in ref.state_dict().items() if n not in every}
    return {n: t.detach() for n, t in {**params, **buffers}.items()}


@lru_cache(maxsize=None)
def _layout(model: str, tp: int, ep: bool):
    from m2nkit.adapters.vllm import InferenceSpec
    from m2nkit.adapters.vllm.trace import trace_destination
    from m2nkit.manifest import ParamMeta

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in _wire(model).items()]
    return trace_destination(DATA / model / "checkpoint", metas, InferenceSpec(tp, 1, ep))


def _config(model: str) -> dict:
    config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
    return config.get("text_config", config)


def _sources(layout, worker: int, param: str) -> set[str]:
    """The wire tensors the layout binds into ``param`` of ``worker``."""
    return {b.name for bs in layout.bindings.values() for b in bs
            if b.worker == worker and b.param == param}


def _rows(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    n = t.shape[0] // parts
    return t[part * n:(part + 1) * n]


def test_every_family_is_shipped_at_every_layout():
    layouts = {m: {(p.values[1], p.values[2]) for p in FIXTURES if p.values[0] == m}
               for m in MODELS}
    for model in MODELS:
        want = {(1, False), (2, False), (4, False)} | ({(2, True), (4, True)} if model in MOE
                                                       else set())
        assert layouts[model] == want, model


@pytest.mark.parametrize("model,tp,ep,placement,dtype", FIXTURES)
def test_traced_layout_equals_vllm_dumps(model, tp, ep, placement, dtype):
    wire = _wire(model)
    layout = _layout(model, tp, ep)
    assert layout.notes == ("layout traced from vLLM's own weight loaders",)
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype, "traced ")
    # every wire tensor lands somewhere but a tied lm_head
    tied = {"lm_head.weight"} if _config(model).get("tie_word_embeddings") else set()
    assert set(layout.skipped) == tied & set(wire)


# --------------------------------------------------------------------------
# what vLLM did, read off the dumps by hand


QWEN35 = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3.5-vl", "tiny-qwen3.5-moe-vl"]


@pytest.mark.parametrize("model", QWEN35)
def test_qwen3_5_gated_deltanet_is_fused_and_split_by_heads(model):
    """Qwen3.5's linear attention (vLLM ``Qwen3_5Model.hf_to_vllm_mapper``,
    ``QwenGatedDeltaNetAttention``): ``in_proj_qkv`` + ``in_proj_z`` ->
    ``in_proj_qkvz`` (rank r: its q, k, v heads, then its z rows),
    ``in_proj_b`` + ``in_proj_a`` -> ``in_proj_ba``; ``conv1d`` [C, 1, K] split
    like q, k, v; ``A_log`` (vLLM keeps it float32) and ``dt_bias`` by value
    head; ``norm`` (one head's width) whole."""
    wire, (w, v) = _wire(model), PREFIX[model]
    c = _config(model)
    qk, vd = c["linear_num_key_heads"] * c["linear_key_head_dim"], \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    la, va = f"{w}layers.0.linear_attn.", f"{v}layers.0.linear_attn."
    qkv, conv = wire[la + "in_proj_qkv.weight"], wire[la + "conv1d.weight"]
    tp = 4
    layout = _layout(model, tp, False)
    for r in range(tp):
        dump, _ = _oracle(model, tp, False, r)

        def heads(t):        # rank r's q, k and v rows of a [2*qk + vd, ...] tensor
            return torch.cat([_rows(t[:qk], r, tp), _rows(t[qk:2 * qk], r, tp),
                              _rows(t[2 * qk:], r, tp)])

        assert torch.equal(dump[va + "in_proj_qkvz.weight"],
                           torch.cat([heads(qkv), _rows(wire[la + "in_proj_z.weight"], r, tp)]))
        assert torch.equal(dump[va + "in_proj_ba.weight"],
                           torch.cat([_rows(wire[la + "in_proj_b.weight"], r, tp),
                                      _rows(wire[la + "in_proj_a.weight"], r, tp)]))
        assert torch.equal(dump[va + "conv1d.weight"], heads(conv))
        assert dump[va + "A_log"].dtype == torch.float32
        assert torch.equal(dump[va + "A_log"], _rows(wire[la + "A_log"], r, tp).float())
        assert torch.equal(dump[va + "dt_bias"], _rows(wire[la + "dt_bias"], r, tp))
        assert torch.equal(dump[va + "norm.weight"], wire[la + "norm.weight"])
        assert _sources(layout, r, va + "in_proj_qkvz.weight") == {la + "in_proj_qkv.weight",
                                                                   la + "in_proj_z.weight"}
        assert _sources(layout, r, va + "in_proj_ba.weight") == {la + "in_proj_b.weight",
                                                                 la + "in_proj_a.weight"}


@pytest.mark.parametrize("model", QWEN35 + ["tiny-qwen3-next"])
def test_gated_full_attention_doubles_the_q_rows(model):
    """``attn_output_gate``: ``q_proj`` is [2 * nh * hd, H] (each head's query, then
    its gate); ``qkv_proj`` of rank r holds its heads' q + gate rows, then the K/V
    head it shares (2 KV heads over tp 4: ranks 0-1 head 0, ranks 2-3 head 1)."""
    wire, (w, v) = _wire(model), PREFIX[model]
    c = _config(model)
    at, vt = f"{w}layers.1.self_attn.", f"{v}layers.1.self_attn."
    assert wire[at + "q_proj.weight"].shape[0] == 2 * c["num_attention_heads"] * c["head_dim"]
    tp = 4
    for r in range(tp):
        dump, _ = _oracle(model, tp, False, r)
        kv = r // (tp // c["num_key_value_heads"])
        want = torch.cat([_rows(wire[at + "q_proj.weight"], r, tp),
                          _rows(wire[at + "k_proj.weight"], kv, c["num_key_value_heads"]),
                          _rows(wire[at + "v_proj.weight"], kv, c["num_key_value_heads"])])
        assert torch.equal(dump[vt + "qkv_proj.weight"], want), r


@pytest.mark.parametrize("model", ["tiny-qwen3.5-moe", "tiny-qwen3.5-moe-vl", "tiny-qwen3-next"])
def test_shared_expert_is_merged_and_aliased(model):
    """Qwen3.5-MoE / Qwen3-Next MoE blocks: ``shared_expert.gate_up_proj`` (rank r:
    its gate rows, then its up rows), ``shared_expert_gate`` [1, H] whole; vLLM
    exposes them again under ``mlp.experts._shared_experts._layer.*`` and the
    router under ``mlp.experts.gate``; routed experts ``w13`` per expert gate
    rows then up rows of transformers' ``experts.gate_up_proj``."""
    wire, (w, v) = _wire(model), PREFIX[model]
    layer = 1      # MoE in every model (tiny-qwen3-next's layer 0 is dense)
    mw, mv = f"{w}layers.{layer}.mlp.", f"{v}layers.{layer}.mlp."
    tp = 2
    layout = _layout(model, tp, False)
    for r in range(tp):
        dump, meta = _oracle(model, tp, False, r)
        aliases = json.loads(meta["aliases"])
        assert aliases[mv + "experts._shared_experts._layer.gate_up_proj.weight"] == \
            mv + "shared_expert.gate_up_proj.weight"
        assert aliases[mv + "experts._shared_experts._layer.expert_gate.weight"] == \
            mv + "shared_expert_gate.weight"
        assert aliases[mv + "experts.gate.weight"] == mv + "gate.weight"
        assert torch.equal(dump[mv + "shared_expert.gate_up_proj.weight"],
                           torch.cat([_rows(wire[mw + "shared_expert.gate_proj.weight"], r, tp),
                                      _rows(wire[mw + "shared_expert.up_proj.weight"], r, tp)]))
        assert torch.equal(dump[mv + "shared_expert_gate.weight"],
                           wire[mw + "shared_expert_gate.weight"])
        gate_up = wire[mw + "experts.gate_up_proj"]            # [E, 2*Im, H], gate then up
        w13 = dump[mv + "experts.routed_experts.w13_weight"]
        for e in range(gate_up.shape[0]):
            g, u = gate_up[e].chunk(2)
            assert torch.equal(w13[e], torch.cat([_rows(g, r, tp), _rows(u, r, tp)])), e
        assert _sources(layout, r, mv + "experts.routed_experts.w13_weight") == \
            {mw + "experts.gate_up_proj"}


def test_qwen3_next_in_proj_is_fused_per_key_head_group_and_layer_0_is_dense():
    """Qwen3-Next's checkpoint (and transformers' class) fuse ``in_proj_qkvz`` and
    ``in_proj_ba`` per key-head group already: rank r takes one contiguous block of
    rows of each (``gqa_interleaved_layout``); ``mlp_only_layers=[0]`` gives layer 0
    a dense ``gate_up_proj`` and no experts."""
    model, tp = "tiny-qwen3-next", 4
    wire = _wire(model)
    la = "model.layers.0.linear_attn."
    for r in range(tp):
        dump, _ = _oracle(model, tp, False, r)
        for name in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
            assert torch.equal(dump[la + name], _rows(wire[la + name], r, tp)), (name, r)
        assert torch.equal(dump["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat([_rows(wire["model.layers.0.mlp.gate_proj.weight"], r, tp),
                                      _rows(wire["model.layers.0.mlp.up_proj.weight"], r, tp)]))
        assert not any(n.startswith("model.layers.0.mlp.experts") for n in dump)


VISION = ["tiny-qwen3.5-vl", "tiny-qwen3.5-moe-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"]


@pytest.mark.parametrize("model", VISION)
def test_the_vision_tower_is_traced_and_split_by_tp(model):
    """The wrappers carry their vision tower (vLLM ``Qwen3_VisionTransformer``):
    ``visual.blocks.N.attn.qkv`` [3 * W, W] and its bias split by heads (rank r:
    its q, k, v rows), ``attn.proj`` and ``mlp.linear_fc2`` by columns, the
    mergers' ``linear_fc1`` by rows and ``linear_fc2`` by columns, patch and
    position embeddings whole; Qwen3-VL's ``deepstack_merger_list`` likewise."""
    wire = _wire(model)
    tp = 4
    layout = _layout(model, tp, False)
    mergers = ["merger"] + (["deepstack_merger_list.0"] if "qwen3-vl" in model else [])
    for r in range(tp):
        dump, _ = _oracle(model, tp, False, r)
        for block in range(2):
            b, vb = f"model.visual.blocks.{block}.", f"visual.blocks.{block}."
            for kind in ("weight", "bias"):
                qkv = wire[b + f"attn.qkv.{kind}"]
                want = torch.cat([_rows(part, r, tp) for part in qkv.chunk(3)])
                assert torch.equal(dump[vb + f"attn.qkv.{kind}"], want), (block, kind, r)
            for name in ("attn.proj.weight", "mlp.linear_fc2.weight"):
                assert torch.equal(dump[vb + name], _rows(wire[b + name].t(), r, tp).t())
            assert _sources(layout, r, vb + "attn.qkv.weight") == {b + "attn.qkv.weight"}
        for m in mergers:
            p, vp = f"model.visual.{m}.", f"visual.{m}."
            assert torch.equal(dump[vp + "linear_fc1.weight"],
                               _rows(wire[p + "linear_fc1.weight"], r, tp))
            assert torch.equal(dump[vp + "linear_fc2.weight"],
                               _rows(wire[p + "linear_fc2.weight"].t(), r, tp).t())
        for name in ("patch_embed.proj.weight", "pos_embed.weight"):
            assert torch.equal(dump["visual." + name], wire["model.visual." + name])


def test_qwen3_vl_moe_experts_are_stored_in_on_disk_order_and_traced_in_memory_order():
    """Qwen3-VL-MoE's published checkpoints stack experts ``[E, in, out]``
    (``gate_up_proj`` [E, H, 2*Im]); transformers 5.12.1 transposes them on load
    (its ``Transpose`` conversion) and its ``save_pretrained`` writes them back in
    its in-memory ``[E, out, in]``, so the shipped checkpoint was turned to the hub's
    order (regenerate.py). vLLM reads them transposed
    (``is_fused_checkpoint_transposed``); the tracer hands it the wire's transpose
    and its ``transpose(-1, -2)`` undoes it: the bindings are boxes of the in-memory
    tensors, and ``w13`` of rank r holds each expert's gate rows then up rows."""
    from safetensors.torch import load_file

    model = "tiny-qwen3-vl-moe"
    wire = _wire(model)
    disk = load_file(str(DATA / model / "checkpoint" / "model.safetensors"))
    gu, dn = "model.language_model.layers.0.mlp.experts.gate_up_proj", \
        "model.language_model.layers.0.mlp.experts.down_proj"
    c = _config(model)
    H, Im, E = c["hidden_size"], c["moe_intermediate_size"], c["num_local_experts"]
    assert tuple(disk[gu].shape) == (E, H, 2 * Im) and tuple(wire[gu].shape) == (E, 2 * Im, H)
    assert torch.equal(wire[gu], disk[gu].transpose(1, 2))
    assert torch.equal(wire[dn], disk[dn].transpose(1, 2))
    tp = 2
    layout = _layout(model, tp, False)
    for r in range(tp):
        dump, _ = _oracle(model, tp, False, r)
        w13 = dump["language_model.model.layers.0.mlp.experts.routed_experts.w13_weight"]
        w2 = dump["language_model.model.layers.0.mlp.experts.routed_experts.w2_weight"]
        for e in range(E):
            g, u = wire[gu][e].chunk(2)
            assert torch.equal(w13[e], torch.cat([_rows(g, r, tp), _rows(u, r, tp)]))
            assert torch.equal(w2[e], _rows(wire[dn][e].t(), r, tp).t())
        # one box of the wire per gate/up part: rows of the in-memory [E, 2*Im, H]
        boxes = sorted(b.box for b in layout.bindings[gu] if b.worker == r)
        assert boxes == [((0, E), (r * Im // tp, (r + 1) * Im // tp), (0, H)),
                         ((0, E), (Im + r * Im // tp, Im + (r + 1) * Im // tp), (0, H))]


# --------------------------------------------------------------------------
# the tracer's rules for transposed feeds (adapters/vllm/trace.py)


def test_a_transpose_that_undoes_a_transposed_feed_is_a_box_and_a_lone_one_is_refused():
    from m2nkit.adapters.vllm.trace import TraceError, chain_box

    # vLLM's fused-MoE loader on an [E, in, out] feed of an [E, out, in] wire
    # (routed_experts.py: _orient_fused_weight, chunk(2, dim=1)[1], unbind, [e], narrow)
    ops = [("transpose", (-1, -2), ()), ("chunk", (2,), (("dim", 1),)), ("__getitem__", (1,), ()),
           ("unbind", (), ()), ("__getitem__", (3,), ()), ("narrow", (0, 4, 4), ())]
    box, kept = chain_box("w", (4, 64, 16), ops, dims=(0, 2, 1))
    assert box == ((3, 4), (0, 64), (12, 16)) and kept == [2, 1]
    # in the wire's terms (Feed.to_wire): expert 3, rows 12:16 of 2*Im = 16, all of H
    with pytest.raises(TraceError, match=r"wire tensor 'w': vLLM's loader applies "
                                         r"transpose\(-1, -2\) \(a transpose of the tensor's dims\)"):
        chain_box("w", (4, 16, 64), ops)
    with pytest.raises(TraceError, match=r"applies no transpose \(the tensor is handed to it with "
                                         r"its dims in the order \(0, 2, 1\)"):
        chain_box("w", (4, 64, 16), [("unbind", (), ()), ("__getitem__", (0,), ())],
                  dims=(0, 2, 1))
    assert chain_box("w", (8, 6), [("t", (), ()), ("t", (), ())]) == (((0, 8), (0, 6)), [0, 1])


def test_moe_layers_that_disagree_on_the_fused_order_are_refused():
    from m2nkit.adapters.vllm.trace import TraceError, _fused_experts_read_transposed

    class Experts(torch.nn.Module):
        def __init__(self, transposed):
            super().__init__()
            self.is_fused_checkpoint_transposed = transposed

    model = torch.nn.Sequential(Experts(True), Experts(True))
    assert _fused_experts_read_transposed(model)
    assert not _fused_experts_read_transposed(torch.nn.Sequential(Experts(False)))
    with pytest.raises(TraceError, match=r"Sequential: some of vLLM's MoE layers read fused "
                                         r"experts \[E, in, out\] and others \[E, out, in\]"):
        _fused_experts_read_transposed(torch.nn.Sequential(Experts(True), Experts(False)))
