"""Traced layouts of Llama-4, MiniMax-M2 and Olmo3 against vLLM 0.33.0's own loaders.

MiniMax-M2 and Olmo3 have no m2nkit family table (Llama-4 has one since,
families/llama4.py, llama4_vl.py; it is traced here as before), so the wire is
transformers 5's in-memory model: ``from_pretrained`` of the shipped
checkpoint (``tests/data/oracle/tiny-{llama4,llama4-vision,minimax-m2,olmo3}``,
written by transformers' own ``save_pretrained``), its ``state_dict()`` under
transformers' names. The layout is ``trace_destination``'s (vLLM's loaders on
fake tensors); the dumps are vLLM's loaders on the checkpoint's bytes. What
each family showed, read off the dumps by hand and asserted below:

* **MiniMax-M2** traces whole. transformers keeps ``.block_sparse_moe.`` as
  ``.mlp.`` in memory and fuses ``experts.{e}.w1/w2/w3``; vLLM's loader takes
  only the checkpoint's names (``ckpt_names=("w1", "w2", "w3")``), which the
  tracer derives from transformers' own conversion rules. ``q_norm``/``k_norm``
  (full width in the checkpoint) are split by heads, ``k_norm`` by KV head
  groups at tp 4; ``gate.weight`` and ``e_score_correction_bias`` are float32
  (the bias cast by its loader, and aliased under the experts).
* **Olmo3** traces whole. vLLM's Transformers backend *fuses* ``q/k/v_proj``
  into ``qkv_proj`` (``models/transformers/fusers/qkv.py``) and keeps
  ``q_norm``/``k_norm`` full width on every rank.
* **Llama-4** (text, and the Scout wrapper with its vision tower): everything
  traces and equals the dumps. ``permute_qk_weight_for_rotary``
  (``models/llama4.py``) moves row ``2i+t`` of each q/k head to row
  ``t*hd/2+i``: the dumps show no two rows of a head adjacent in the wire
  staying adjacent, and the trace binds exactly that chain one row per
  binding (about 6100 a layer for Llama-4-Scout, 290 000 in all); any other
  chain stays refused. The routed experts, stacked ``[E, H, 2*I]`` in memory
  and on disk and transposed by the loader into ``w13_weight [E, 2*I, H]``,
  travel ``[E, out, in]`` under ``<name>.weight`` (``_carried``); under
  transformers' own names they are refused.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache

import pytest
import torch

from _oracle import ALL_FIXTURES, DATA, _oracle, _same, assert_layout_equals_dumps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

TRACED = ("tiny-minimax-m2", "tiny-olmo3")
LLAMA4 = ("tiny-llama4", "tiny-llama4-vision")


@lru_cache(maxsize=None)
def _wire(model: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors of the shipped checkpoint (the independent reference)."""
    import transformers

    ckpt = DATA / model / "checkpoint"
    arch = json.loads((ckpt / "config.json").read_text())["architectures"][0]
    return dict(getattr(transformers, arch).from_pretrained(ckpt).state_dict())


@lru_cache(maxsize=None)
def _config(model: str) -> dict:
    config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
    return config.get("text_config", config)


#: Llama-4's stacked experts as transformers keeps them ([E, in, out], no ".weight")
LLAMA4_EXPERTS = re.compile(r"\.feed_forward\.experts\.(gate_up|down)_proj$")


@lru_cache(maxsize=None)
def _carried(model: str) -> dict[str, torch.Tensor]:
    """The wire m2nkit carries: transformers' tensors, but Llama-4's stacked experts
    ``[E, in, out]`` transposed to ``[E, out, in]`` under ``<name>.weight`` (the
    layout vLLM's ``w13_weight``/``w2_weight`` hold; families/llama4.py)."""
    return {(n + ".weight" if LLAMA4_EXPERTS.search(n) else n):
            (t.transpose(1, 2) if LLAMA4_EXPERTS.search(n) else t)
            for n, t in _wire(model).items()}


def _metas(model: str, drop: str | None = None, carried: bool = True):
    from m2nkit.manifest import ParamMeta

    wire = _carried(model) if carried else _wire(model)
    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()
            if drop is None or not re.search(drop, n)]


def _trace(model: str, tp: int, ep: bool = False, drop: str | None = None,
           carried: bool = True):
    from m2nkit.adapters.vllm import InferenceSpec
    from m2nkit.adapters.vllm.trace import trace_destination

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return trace_destination(DATA / model / "checkpoint", _metas(model, drop, carried),
                             InferenceSpec(tp, 1, ep))


@lru_cache(maxsize=None)
def _traced(model: str, tp: int, ep: bool = False, drop: str | None = None):
    return _trace(model, tp, ep, drop)


def _dump(model: str, tp: int, rank: int, ep: bool = False) -> dict[str, torch.Tensor]:
    return _oracle(model, tp, ep, rank)[0]


def _bindings(layout, name: str, worker: int) -> list[tuple]:
    return sorted((b.param, b.box, b.offset) for b in layout.bindings[name] if b.worker == worker)


# --------------------------------------------------------------------------
# MiniMax-M2 and Olmo3: the whole traced layout equals vLLM's dumps

DUMPS = [p for p in ALL_FIXTURES if p.values[0] in TRACED]


def test_the_dumps_are_shipped():
    layouts = {(p.values[0], p.values[1], p.values[2]) for p in ALL_FIXTURES}
    moe = {(1, False), (2, False), (4, False), (2, True), (4, True)}
    for model, want in [("tiny-minimax-m2", moe), ("tiny-llama4", moe),
                        ("tiny-olmo3", {(1, False), (2, False), (4, False)}),
                        ("tiny-llama4-vision", {(1, False), (2, False), (4, False)})]:
        assert {(tp, ep) for m, tp, ep in layouts if m == model} == want, model


@pytest.mark.parametrize("model,tp,ep,placement,dtype", DUMPS)
def test_traced_layout_equals_vllm_dumps(model, tp, ep, placement, dtype):
    layout = _traced(model, tp, ep)
    assert layout.notes == ("layout traced from vLLM's own weight loaders",)
    assert not layout.skipped and not layout.unknown
    assert_layout_equals_dumps(layout, _wire(model), model, tp, ep, placement, dtype, "traced ")


def test_minimax_m2_splits_q_norm_and_k_norm_by_heads():
    wire = _wire("tiny-minimax-m2")
    hd = _config("tiny-minimax-m2")["head_dim"]
    q, k = (wire[f"model.layers.1.self_attn.{n}_norm.weight"] for n in "qk")
    for tp in (2, 4):
        layout = _traced("tiny-minimax-m2", tp)
        for r in range(tp):
            got = _dump("tiny-minimax-m2", tp, r)
            nq, kv = q.numel() // tp, r * 2 // tp     # 4 q heads, 2 KV heads
            assert torch.equal(got["model.layers.1.self_attn.q_norm.weight"],
                               q[r * nq:(r + 1) * nq]), (tp, r)
            k_rows = k[r * k.numel() // tp:(r + 1) * k.numel() // tp] if tp <= 2 \
                else k[kv * hd:(kv + 1) * hd]         # tp 4: the KV head's group of 2 ranks
            assert torch.equal(got["model.layers.1.self_attn.k_norm.weight"], k_rows), (tp, r)
            assert _bindings(layout, "model.layers.1.self_attn.q_norm.weight", r) == [
                ("model.layers.1.self_attn.q_norm.weight", ((r * nq, (r + 1) * nq),), (0,))]


def test_minimax_m2_router_bias_and_experts_land_under_vllm_names_in_float32():
    wire = _wire("tiny-minimax-m2")
    layout = _traced("tiny-minimax-m2", 2, True)
    bias = "model.layers.0.block_sparse_moe.e_score_correction_bias"
    for r in range(2):
        got = _dump("tiny-minimax-m2", 2, r, ep=True)
        assert got[bias].dtype == torch.float32
        assert torch.equal(got[bias], wire["model.layers.0.mlp.e_score_correction_bias"].float())
        assert got["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
        # EP 2: experts [2r, 2r+2) whole, gate rows then up rows, as transformers fuses them
        w13 = got["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"]
        assert torch.equal(w13, wire["model.layers.0.mlp.experts.gate_up_proj"][2 * r:2 * r + 2])
        assert _bindings(layout, "model.layers.0.mlp.experts.gate_up_proj", r) == [
            ("model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight",
             ((2 * r, 2 * r + 2), (0, 64), (0, 64)), (0, 0, 0))]
    assert layout.aliases[
        "model.layers.0.block_sparse_moe.experts.routed_experts.e_score_correction_bias"] == bias
    assert _bindings(layout, "model.layers.0.mlp.e_score_correction_bias", 0) == [
        (bias, ((0, 4),), (0,))]


def test_olmo3_transformers_backend_fuses_qkv_and_keeps_the_norms_whole():
    wire = _wire("tiny-olmo3")
    layout = _traced("tiny-olmo3", 4)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for r in range(4):
        got = _dump("tiny-olmo3", 4, r)
        assert "model.layers.0.self_attn.q_proj.weight" not in got
        # 4 q heads of 16, 2 KV heads shared by ranks {0, 1} and {2, 3}
        kv = r // 2
        want = torch.cat([wire["model.layers.0.self_attn.q_proj.weight"][16 * r:16 * (r + 1)],
                          wire["model.layers.0.self_attn.k_proj.weight"][16 * kv:16 * (kv + 1)],
                          wire["model.layers.0.self_attn.v_proj.weight"][16 * kv:16 * (kv + 1)]])
        assert torch.equal(got[qkv], want), r
        for n in ("q_norm", "k_norm"):
            name = f"model.layers.0.self_attn.{n}.weight"
            assert torch.equal(got[name], wire[name]), (r, n)
            assert _bindings(layout, name, r) == [(name, ((0, wire[name].numel()),), (0,))]
        assert _bindings(layout, "model.layers.0.self_attn.k_proj.weight", r) == [
            (qkv, ((16 * kv, 16 * (kv + 1)), (0, 64)), (16, 0))]


def test_checkpoint_names_revert_transformers_renames():
    from m2nkit.adapters.vllm.trace import checkpoint_names, experts_on_disk

    ckpt = DATA / "tiny-minimax-m2" / "checkpoint"
    names = checkpoint_names(ckpt, list(_wire("tiny-minimax-m2")))
    assert names["model.layers.1.mlp.gate.weight"] == "model.layers.1.block_sparse_moe.gate.weight"
    assert names["model.layers.1.mlp.e_score_correction_bias"] == \
        "model.layers.1.block_sparse_moe.e_score_correction_bias"
    assert names["model.layers.1.mlp.experts.gate_up_proj"] == \
        "model.layers.1.block_sparse_moe.experts.gate_up_proj"
    assert "model.layers.1.self_attn.q_proj.weight" not in names
    # the per-expert tensors vLLM's loader takes, under the renamed block
    assert experts_on_disk(ckpt)["gate"] == "{prefix}.experts.{e}.w1.weight"
    # no renames in transformers for Llama-4 and Olmo3; a family table's wire is on-disk already
    for model in ("tiny-llama4-vision", "tiny-olmo3"):
        assert checkpoint_names(DATA / model / "checkpoint", list(_wire(model))) == {}
    assert checkpoint_names(DATA / "tiny-mixtral" / "checkpoint",
                            ["model.layers.0.block_sparse_moe.gate.weight"]) == {}


def test_the_live_minimax_m2_worker_checks_the_traced_plan_under_checkpoint_names():
    """What the vLLM plugin runs at init (``M2NVLLMEngine._traced_problems``): the live
    worker's loaders, traced on the wire under its checkpoint names, agree with the
    traced layout; under transformers' in-memory names vLLM's loader finds no module."""
    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.adapters.vllm.trace import (TraceError, checkpoint_names, experts_on_disk,
                                            traced_problems)
    from m2nkit.engine.tools.vllm_workers import build_cpu_worker

    layout = _traced("tiny-minimax-m2", 2, True)
    live, vllm_config = build_cpu_worker(DATA / "tiny-minimax-m2" / "checkpoint",
                                         parse_inference_spec("vllm:tp=2,ep"), 1)
    hf = vllm_config.model_config.hf_config
    wire = _metas("tiny-minimax-m2")
    names = checkpoint_names(hf, [m.name for m in wire])
    assert names == checkpoint_names(DATA / "tiny-minimax-m2" / "checkpoint",
                                     [m.name for m in wire])
    assert traced_problems(live, layout, 1, wire, vllm_config, experts_on_disk(hf),
                           names=names) == []
    with pytest.raises(TraceError, match=r"There is no module or parameter named "
                                         r"'layers\.0\.mlp'"):
        traced_problems(live, layout, 1, wire, vllm_config, experts_on_disk(hf))


# --------------------------------------------------------------------------
# Llama-4: the rotary permutation and the transposed experts are refused; the rest traces

def _rotary_toy(view):
    """A toy loader that hands its q weight [nh*hd, H] = [8, 3] on through ``view`` (nh 2, hd 4)."""
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Parameter(torch.empty(4, 3, dtype=torch.bfloat16, device="meta"))
            self.qkv.weight_loader = lambda p, w: p.data.copy_(view(w).narrow(0, 4, 4))

        def load_weights(self, weights):
            for name, w in weights:
                self.qkv.weight_loader(self.qkv, w)

    return Toy()


def test_llama4_rotary_chain_is_bound_row_by_row_and_a_near_miss_is_refused():
    """vLLM's exact chain (``permute_qk_weight_for_rotary``) becomes one copy per wire row
    (head 1 of 2, hd 4: reordered rows 4..7 are wire rows 4, 6, 5, 7); the same view with
    another transpose (``transpose(0, 1)``: heads swapped with half-heads) is not that
    chain and stays refused as a mixing reshape."""
    from m2nkit.adapters.vllm.trace import Feed, TraceError, trace_worker
    from m2nkit.manifest import ParamMeta

    feed = Feed.whole(ParamMeta("q_proj.weight", torch.bfloat16, (8, 3)))
    rotary = _rotary_toy(lambda w: w.view(2, 2, 2, 3).transpose(1, 2).reshape(8, 3))
    copies, _, _ = trace_worker(rotary, [feed])
    assert sorted((c.box, c.region) for c in copies) == sorted(
        (((w, w + 1), (0, 3)), ((r, r + 1), (0, 3))) for r, w in enumerate((4, 6, 5, 7)))
    swapped = _rotary_toy(lambda w: w.view(2, 2, 2, 3).transpose(0, 1).reshape(8, 3))
    with pytest.raises(TraceError, match=re.escape(
            "wire tensor 'q_proj.weight' into parameter 'qkv': vLLM's loader applies "
            "view(2, 2, 2, 3) (a reshape that mixes dims)")):
        trace_worker(swapped, [feed])


def _row_sources(rows: torch.Tensor, source: torch.Tensor) -> list[int]:
    """For each row of ``rows``, the row of ``source`` it equals (random rows are unique)."""
    index = {bytes(r.view(torch.int16).numpy()): i for i, r in enumerate(source)}
    assert len(index) == len(source)
    return [index[bytes(r.view(torch.int16).numpy())] for r in rows]


@pytest.mark.parametrize("model", LLAMA4)
def test_llama4_rotary_permutation_moves_every_row_on_its_own(model):
    """The evidence for binding it row by row, element by element from vLLM's dumps:
    within each head, vLLM's q/k rows are the checkpoint's even rows then its odd rows,
    so within a head no two rows adjacent in the wire stay adjacent (as boxes: one
    binding per row but at head boundaries, about (nh + nkv) * hd per layer; 6144 for
    Llama-4-Scout)."""
    wire = _wire(model)
    config = _config(model)
    lm = "language_model." if model.endswith("vision") else ""
    nh, nkv, hd = (config["num_attention_heads"], config["num_key_value_heads"],
                   config["head_dim"])
    for tp in (1, 2, 4):
        for r in range(tp):
            qkv = _dump(model, tp, r)[f"{lm}model.layers.0.self_attn.qkv_proj.weight"]
            heads = [r * nh // tp + h for h in range(nh // tp)]
            kv_heads = [r * nkv // tp + h for h in range(nkv // tp)] if tp <= nkv \
                else [r // (tp // nkv)]
            for part, hs, at in (("q", heads, 0), ("k", kv_heads, len(heads) * hd)):
                src = _row_sources(qkv[at:at + len(hs) * hd],
                                   wire[f"{lm}model.layers.0.self_attn.{part}_proj.weight"])
                want = [h * hd + 2 * (j % (hd // 2)) + j // (hd // 2) for h in hs
                        for j in range(hd)]
                assert src == want, (tp, r, part)
                # maximal runs of rows adjacent on both sides: single rows, except the
                # last row of a head with the first of the next (hd-1 bindings a head)
                runs = 1 + sum(b != a + 1 for a, b in zip(src, src[1:]))
                assert runs == len(src) - (len(hs) - 1), (tp, r, part, runs)


def test_llama4_experts_under_transformers_names_are_refused():
    """transformers' in-memory ``[E, in, out]`` experts, which vLLM's loader transposes,
    are refused by name (no box carries a transpose); square ones (tiny-llama4's
    ``gate_up_proj [4, 64, 64]``) would otherwise trace into wrong bindings."""
    from m2nkit.adapters.vllm.trace import TraceError

    for ep in (False, True):
        with pytest.raises(TraceError, match=re.escape(
                "Llama4ForCausalLM: wire tensor 'model.layers.1.feed_forward.experts."
                "gate_up_proj' is stacked experts under transformers' in-memory name, stored "
                "[E, in, out], which vLLM's loader transposes into [E, out, in]")):
            _trace("tiny-llama4", 2, ep, carried=False)


LLAMA4_DUMPS = [p for p in ALL_FIXTURES if p.values[0] in LLAMA4]


@pytest.mark.parametrize("model,tp,ep,placement,dtype", LLAMA4_DUMPS)
def test_llama4_traced_layout_equals_vllm_dumps(model, tp, ep, placement, dtype):
    """Every wire tensor of Llama-4 (text, and the wrapper with its vision tower) traced,
    bit for bit against vLLM's dump of every worker: q/k through the rotary reordering
    (one binding per row), the routed experts carried ``[E, out, in]`` (``_carried``),
    under EP each worker's own experts."""
    layout = _traced(model, tp, ep)
    assert not layout.skipped and not layout.unknown
    assert_layout_equals_dumps(layout, _carried(model), model, tp, ep, placement, dtype,
                               "traced ")


def test_llama4_vision_tower_and_shared_expert_trace_split_by_tp():
    wire = _wire("tiny-llama4-vision")
    layout = _traced("tiny-llama4-vision", 2, False)
    v = "vision_model.model.layers.1.self_attn"
    qkv = f"{v}.qkv_proj.weight"
    shared = "language_model.model.layers.0.feed_forward.shared_expert.gate_up_proj.weight"
    for r in range(2):
        got = _dump("tiny-llama4-vision", 2, r)
        # 4 vision heads of 8: rank r holds heads 2r, 2r+1 of q, k and v (no rotary permutation)
        assert torch.equal(got[qkv], torch.cat([wire[f"{v}.{p}_proj.weight"][16 * r:16 * (r + 1)]
                                                for p in "qkv"]))
        assert _bindings(layout, f"{v}.k_proj.weight", r) == [
            (qkv, ((16 * r, 16 * (r + 1)), (0, 32)), (16, 0))]
        assert _bindings(layout, f"{v}.q_proj.bias", r) == [
            (f"{v}.qkv_proj.bias", ((16 * r, 16 * (r + 1)),), (0,))]
        patch = "vision_model.patch_embedding.linear.weight"
        assert _bindings(layout, patch, r) == [(patch, ((16 * r, 16 * (r + 1)), (0, 588)), (0, 0))]
        assert torch.equal(got[patch], wire[patch][16 * r:16 * (r + 1)])
        # the shared expert beside the routed ones: gate rows then up rows of rank r
        sh = "language_model.model.layers.0.feed_forward.shared_expert"
        assert torch.equal(got[shared], torch.cat(
            [wire[f"{sh}.{p}_proj.weight"][16 * r:16 * (r + 1)] for p in ("gate", "up")]))
        assert layout.aliases[
            "language_model.model.layers.0.feed_forward.experts._shared_experts._layer."
            "gate_up_proj.weight"] == shared


# --------------------------------------------------------------------------
# the tracer's cast rule, on a loader of our own (no vLLM loader casts to another dtype)

def test_a_cast_is_bound_only_where_it_is_the_copy_into_the_parameter():
    """MiniMax-M2's router-bias loader (``param.data.copy_(w.to(torch.float32))`` into a
    float32 parameter) is covered above by the real one; a cast to any other dtype than
    the parameter's would round twice, and is refused naming tensor, parameter and cast."""
    from m2nkit.adapters.vllm.trace import Feed, TraceError, trace_worker
    from m2nkit.manifest import ParamMeta

    class Toy(torch.nn.Module):
        def __init__(self, cast):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.empty(4, dtype=torch.float32, device="meta"))
            self.bias.weight_loader = lambda p, w: p.data.copy_(w.to(cast))

        def load_weights(self, weights):
            for name, w in weights:
                self.bias.weight_loader(self.bias, w)

    feed = Feed.whole(ParamMeta("mlp.bias", torch.bfloat16, (4,)))
    copies, _, _ = trace_worker(Toy(torch.float32), [feed])
    assert [(c.name, c.param, c.box, c.region) for c in copies] == [
        ("mlp.bias", "bias", ((0, 4),), ((0, 4),))]
    with pytest.raises(TraceError, match=re.escape(
            "wire tensor 'mlp.bias' into parameter 'bias' (torch.float32): vLLM's loader casts it "
            ".to(torch.float16), which is not the cast copy_ into the parameter makes")):
        trace_worker(Toy(torch.float16), [feed])
