"""Qwen3-VL and Qwen3-VL-MoE under the ``megatron:`` dry run (fast; no megatron import).

``names.QWEN3_VL`` / ``names.QWEN3_VL_MOE`` lay the shipped tiny checkpoints
(tests/data/oracle/tiny-qwen3-vl[-moe]/checkpoint) out as Bridge's
``Qwen3VLModel`` holds them: the vision tower (``vision_model.*``, first stage
only) and the language model (``language_model.*``). Each trainer rank's local
tensors are filled from the checkpoint through the declared pieces (NaN
elsewhere), the plan into every dumped vLLM layout is executed, and every
worker's storage must equal the real vLLM 0.33.0 dump beside the checkpoint bit
for bit (vLLM's own loaders: the oracle). Where the pieces sit locally is checked
against Megatron's fused ``linear_qkv`` built independently (``_fused_qkv``,
every vision head its own query group, then ``torch.chunk`` over tp).
The tiny dense model is tied (``tie_word_embeddings: true``, no ``lm_head.weight``
on disk): the field report Megatron-Bridge#4883 (a tied ``lm_head`` under a
prefixed VLM name) is held here.
"""

from __future__ import annotations

import json

import pytest
import torch

from _layouts import megatron_fused_qkv as _fused_qkv

DENSE, MOE = "tiny-qwen3-vl", "tiny-qwen3-vl-moe"

# (model, trainer spec, dumped vLLM layouts: (tp, enable_expert_parallel))
CASES = [
    (DENSE, "megatron:tp=2", ((1, False), (2, False), (4, False))),
    (DENSE, "megatron:tp=2,pp=2", ((1, False), (2, False), (4, False))),
    (DENSE, "megatron:tp=4", ((2, False), (4, False))),
    (MOE, "megatron:tp=2,ep=2", ((1, False), (2, False), (2, True), (4, True))),
    (MOE, "megatron:tp=2,ep=2,etp=1", ((2, False), (4, True))),
    (MOE, "megatron:tp=2,pp=2,ep=2", ((2, True), (4, False))),
]


def _layout(model: str, spec: str):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec

    ckpt = read_checkpoint(f"tests/data/oracle/{model}/checkpoint")
    tspec = parse_trainer_spec(spec)
    return ckpt, tspec, checkpoint_metas(ckpt, tspec)


def _locals(ckpt, metas, world: int) -> dict[int, list]:
    """Every rank's local tensors, NaN-filled, with each declared piece copied from the
    checkpoint (manifest order, as ``iter_local`` yields them)."""
    from m2nkit.manifest.pieces import box_slices

    out: dict[int, list] = {r: [] for r in range(world)}
    for m in metas:
        full = ckpt.read_full(m.name)
        for r in range(world):
            shape = m.local_shape(r)
            if shape is None:
                continue
            t = torch.full(shape, float("nan"), dtype=full.dtype)
            for p in m.source_pieces(world):
                if p.rank == r:
                    t[box_slices(p.local_box)] = full[box_slices(p.box)]
            out[r].append((m.name, t))
    return out


@pytest.mark.parametrize("model,spec,dumps", CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
def test_dry_run_rounds_equal_the_vllm_dumps(model, spec, dumps):
    from _oracle import _oracle, _same

    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.in_process import allocate_storage, execute_plan
    from m2nkit.engine.plan import build_plan

    ckpt, tspec, metas = _layout(model, spec)
    assert [m.name for m in metas] == ckpt.names  # vision tower included
    world = tspec.num_ranks
    for tp, ep in dumps:
        vspec = f"vllm:tp={tp}" + (",ep" if ep else "")
        dest = destination_layout(ckpt.config, metas, vspec)
        plan = build_plan(metas, world, dest)
        assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min, (vspec, plan.problems)
        storage = {w: allocate_storage(dest, w) for w in range(tp)}
        execute_plan(plan, {r: iter(s) for r, s in _locals(ckpt, metas, world).items()}, storage)
        for w in range(tp):
            vllm, vmeta = _oracle(model, tp, ep, w)
            aliases = set(json.loads(vmeta["aliases"]))
            assert set(storage[w]) == set(vllm) - aliases, (spec, vspec, w)
            for name, t in storage[w].items():
                _same(t, vllm[name], f"{model} {spec} -> {vspec} worker {w} {name}")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vision_qkv_pieces_sit_where_megatron_fuses_them(tp):
    """The vision ``attn.qkv`` ``[q; k; v]`` (all heads each): rank r's local ``linear_qkv``
    is rows r of ``chunk(tp)`` of Megatron's per-head ``[q_h; k_h; v_h]`` (weight and bias)."""
    ckpt, tspec, metas = _layout(DENSE, f"megatron:tp={tp}")
    heads = ckpt.config.vision_config.num_heads
    loc = _locals(ckpt, metas, tspec.num_ranks)
    for suffix in ("weight", "bias"):
        name = f"model.visual.blocks.1.attn.qkv.{suffix}"
        full = ckpt.read_full(name)
        two_d = full if full.dim() == 2 else full[:, None]
        q, k, v = two_d.chunk(3)
        fused = _fused_qkv(q, k, v, ng=heads).reshape(full.shape)
        for r, want in enumerate(fused.chunk(tp)):
            got = dict(loc[r])[name]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tp, r, name)


def test_vision_tower_is_sent_by_the_first_stage_only():
    """Bridge builds ``vision_model`` where ``pre_process`` (model.py), with pp 1: at tp2pp2
    (ranks 0-1 stage 0, 2-3 stage 1) every ``model.visual.*`` piece is on ranks 0-1; the
    language model's layer 1 and final norm on stage 1."""
    _, _, metas = _layout(DENSE, "megatron:tp=2,pp=2")
    by = {m.name: m for m in metas}
    for name, m in by.items():
        if name.startswith("model.visual."):
            assert {p.rank for p in m.pieces} == {0, 1}, name
    assert {p.rank for p in by["model.language_model.layers.1.mlp.down_proj.weight"].pieces} == \
        {2, 3}
    assert {p.rank for p in by["model.language_model.norm.weight"].pieces} == {2, 3}
    # deepstack merger 0 and block 1 of the tower, although "layer" 1 of the LM is on stage 1
    assert {p.rank for p in by["model.visual.blocks.1.attn.qkv.weight"].pieces} == {0, 1}


def test_tied_lm_head_under_the_vlm_prefix_megatron_bridge_4883():
    """Megatron-Bridge#4883: export detected a tied embedding by the literal
    ``model.embed_tokens.weight``, so a VLM's ``model.language_model.embed_tokens.weight``
    missed it. Here the tied tiny Qwen3-VL's wire carries the prefixed embedding once,
    from the first stage, and no ``lm_head.weight`` (the checkpoint has none; the last
    stage's ``output_layer`` is a replica, not sent); vLLM's ``language_model.lm_head``
    is its alias in every dump, filled by the rounds above. The untied MoE sends its own
    ``lm_head.weight`` from the last stage."""
    from _oracle import _oracle

    ckpt, _, metas = _layout(DENSE, "megatron:tp=2,pp=2")
    assert ckpt.config.tie_word_embeddings is True
    by = {m.name: m for m in metas}
    assert "lm_head.weight" not in by and "lm_head.weight" not in ckpt.names
    emb = by["model.language_model.embed_tokens.weight"]
    assert {p.rank for p in emb.pieces} == {0, 1}
    assert sum(p.box[0][1] - p.box[0][0] for p in emb.pieces) == emb.shape[0]  # once, no padding
    for tp in (1, 2, 4):
        _, vmeta = _oracle(DENSE, tp, False, 0)
        assert "language_model.lm_head.weight" in json.loads(vmeta["aliases"]), tp
    _, _, moe = _layout(MOE, "megatron:tp=2,pp=2,ep=2")
    head = {m.name: m for m in moe}["lm_head.weight"]
    assert {p.rank for p in head.pieces} == {4, 5, 6, 7}  # dp 2: stage 1 is ranks 4-7


def test_qwen3_vl_tables_prefix_the_language_model():
    """The VLM tables are the GPTModel tables under ``language_model.`` /
    ``model.language_model.`` plus the tower; nothing of the text table is lost."""
    from m2nkit.adapters.megatron import names

    for vl, text in ((names.QWEN3_VL, names.QWEN3), (names.QWEN3_VL_MOE, names.QWEN3_MOE)):
        lm = [e for e in vl if e.megatron[0].startswith("language_model.")]
        assert len(lm) == len(text)
        for e, t in zip(lm, text):
            assert e.megatron == tuple("language_model." + m for m in t.megatron)
            assert e.rule is t.rule
            for part, w in t.wires.items():
                assert e.wires[part] == (w.replace("model.", "model.language_model.", 1)
                                         if w.startswith("model.") else w)
        assert all(e.megatron[0].startswith(("language_model.", "vision_model.")) for e in vl)
    assert names.megatron_names("Qwen3VLForConditionalGeneration") is names.QWEN3_VL
    assert names.megatron_names("Qwen3VLMoeForConditionalGeneration") is names.QWEN3_VL_MOE
