"""Qwen3-VL and Qwen3-VL-MoE through ``megatron_source`` and ``bridge_source``: Bridge's
``Qwen3VLModel`` on CPU, gloo, the language model without the vision tower.

Megatron-Bridge 0.6.2 builds Qwen3-VL only with TransformerEngine (the provider's
language layer spec and the whole vision tower: ``compat.vlm_language_model_only``
says where and why). So one launch of 4 gloo processes builds the shipped tiny
checkpoints (tests/data/oracle/tiny-qwen3-vl[-moe]/checkpoint, the dense one with
tied embeddings) through ``AutoBridge`` as ``Qwen3VLModel(add_encoder=False)`` with
megatron-core's local language spec, loads them with Bridge's ``Qwen3VLBridge`` /
``Qwen3VLMoEBridge`` and dumps what ``megatron_source`` and
``bridge_source(mode="tasks")`` declare and hold, and Bridge's own
``export_hf_weights``. Checked per layout: identical manifests on every rank; the
wire tensors are the checkpoint's minus exactly the tower (``left_out``); every
piece equal to the checkpoint's slice bit for bit; Bridge's export equal to the
checkpoint; and rounds into the dumped ``vllm:tp=1/2/4[,ep]`` layouts, with the
tower's pieces laid out by the ``megatron:`` dry run (names.QWEN3_VL) beside the live
language model's, equal to the real vLLM 0.33.0 dumps bit for bit.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from tests.integration._megatron import Layout, launch, run_layouts, stacked_export

pytestmark = pytest.mark.integration

WORLD = 4
DENSE, MOE = "tiny-qwen3-vl", "tiny-qwen3-vl-moe"
# (label, model, layout kwargs, dumped vLLM layouts (tp, ep))
CASES = [
    ("tp2", DENSE, dict(tp=2), ((1, False), (2, False), (4, False))),
    ("tp2pp2", DENSE, dict(tp=2, pp=2), ((2, False), (4, False))),
    # 2 KV heads over tp 4: a rank holds part of a query group (num_query_groups < tp)
    ("tp4", DENSE, dict(tp=4), ((2, False), (4, False))),
    ("moe-tp2ep2", MOE, dict(tp=2, ep=2), ((1, False), (2, False), (2, True), (4, True))),
    ("moe-tp2ep2etp1", MOE, dict(tp=2, ep=2, etp=1), ((2, True), (4, False))),
    # a 4-layer tiny Qwen3-VL made here (no dumps: rounds against vLLM's reference loaders)
    ("pp2vpp2", DENSE, dict(pp=2, vpp=2), None),
]
#: label -> checkpoint directory (the fixture fills it)
CKPT: dict = {}
#: rounds of a case without dumps: vLLM layouts checked against reference_load
REFERENCE_SPECS = ("vllm:tp=1", "vllm:tp=2")


def _spec(kw: dict) -> str:
    """The dry-run spec of a live layout: the data-parallel size is what the world leaves."""
    dp = WORLD // (kw.get("tp", 1) * kw.get("pp", 1))
    return "megatron:" + ",".join(f"{k}={v}" for k, v in {**kw, "dp": dp}.items())


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    from _oracle import DATA

    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config
    from tests.integration.test_megatron_source import _nontrivial_norms

    root = tmp_path_factory.mktemp("qwen3vl")
    out = root / "out"
    out.mkdir()
    for label, model, _, dumps in CASES:
        CKPT[label] = DATA / model / "checkpoint"
        if dumps is None:
            CKPT[label] = root / f"{model}-4"
            cfg = tiny_config(model)
            cfg.text_config.num_hidden_layers = 4  # the wrapper's own key is not the model's
            save_tiny_checkpoint(cfg, CKPT[label], seed=7)
            _nontrivial_norms(CKPT[label])
    layouts = [Layout(label, str(CKPT[label]), **kw) for label, _, kw, _ in CASES]
    launch(WORLD, functools.partial(run_layouts, layouts, export=True), out, timeout_s=900)
    return out


def _payloads(out, label):
    return [torch.load(out / f"{label}.r{r}.pt") for r in range(WORLD)]


def _ckpt(label):
    from m2nkit.adapters.hf_checkpoint import read_checkpoint

    return read_checkpoint(CKPT[label])


CASE = {c[0]: c for c in CASES}


def _check(out, label, name):
    """Manifest, pieces, Bridge's export and vLLM rounds of one dumped case (``name``:
    ``label`` or ``bridge-<label>``)."""
    from _oracle import _oracle, _same

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
    from m2nkit.adapters.vllm import destination_layout, reference_load
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest import manifest_from_json
    from m2nkit.manifest.pieces import box_slices
    from tests.adapters.test_megatron_qwen3_vl import _locals

    _, model, kw, dumps = CASE[label]
    ckpt = _ckpt(label)
    payloads = _payloads(out, name)
    docs = [p["manifest"] for p in payloads]
    assert all(d == docs[0] for d in docs), f"{name}: metadata differs between ranks"
    metas, T = manifest_from_json(docs[0])
    assert T == WORLD
    tower = [n for n in ckpt.names if n.startswith("model.visual.")]
    assert tower and [m.name for m in metas] == [n for n in ckpt.names if n not in tower]
    checked = 0
    for r, p in enumerate(payloads):
        stream = dict(p["locals"])
        for m in metas:
            full = ckpt.read_full(m.name)
            assert m.dtype == full.dtype, (name, m.name)
            for piece in m.source_pieces(WORLD):
                if piece.rank == r:
                    got = stream[m.name][box_slices(piece.local_box)]
                    assert bitwise_equal(got, full[box_slices(piece.box)]), (name, m.name, r)
                    checked += 1
    assert checked >= len(metas)
    # the tower from the dry run of the same layout, beside the live language model
    tspec = parse_trainer_spec(_spec(kw))
    assert tspec.num_ranks == WORLD
    dry = [m for m in checkpoint_metas(ckpt, tspec) if m.name in tower]
    dry_locals = _locals(ckpt, dry, WORLD)
    order = {n: i for i, n in enumerate(ckpt.names)}
    both = sorted(metas + dry, key=lambda m: order[m.name])
    tensors = full_checkpoint_tensors(ckpt) if dumps is None else None
    for tp, ep in dumps or [(int(v.partition("=")[2]), False) for v in REFERENCE_SPECS]:
        vspec = f"vllm:tp={tp}" + (",ep" if ep else "")
        dest = destination_layout(ckpt.config, both, vspec)
        plan = build_plan(both, WORLD, dest)
        assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min, (name, vspec)
        streams = {r: iter(sorted(payloads[r]["locals"] + dry_locals[r],
                                  key=lambda x: order[x[0]])) for r in range(WORLD)}
        storage = {w: allocate_storage(dest, w) for w in range(tp)}
        execute_plan(plan, streams, storage)
        for w in range(tp):
            if dumps is None:  # vLLM's loaders (reference_load, pinned to real dumps)
                ref = reference_load(ckpt.config, tensors, vspec, w, fill=float("nan"))
                for pname, t in storage[w].items():
                    assert bitwise_equal(t, ref[pname]), (name, vspec, w, pname)
                continue
            vllm, vmeta = _oracle(model, tp, ep, w)
            assert set(storage[w]) == set(vllm) - set(json.loads(vmeta["aliases"])), (vspec, w)
            for pname, t in storage[w].items():
                _same(t, vllm[pname], f"{name} {vspec} worker {w} {pname}")


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_megatron_source_pieces_and_rounds_equal_the_checkpoint_and_vllm(dumped, label):
    _check(dumped, label, label)
    p = torch.load(dumped / f"{label}.r0.pt")
    tower = [n for n in _ckpt(label).names if n.startswith("model.visual.")]
    assert p["names_from"] == ("Megatron-Bridge Qwen3VLBridge.mapping_registry()"
                               if CASE[label][1] == DENSE else
                               "Megatron-Bridge Qwen3VLMoEBridge.mapping_registry()")
    assert p["left_out"] == tower


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_bridge_source_tasks_mode_sends_shards_without_a_gather(dumped, label):
    for r in range(WORLD):
        assert torch.load(dumped / f"bridge-{label}.r{r}.pt")["gathered"] == {}, (label, r)
    _check(dumped, label, f"bridge-{label}")


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_bridge_export_equals_the_checkpoint(dumped, label):
    """Bridge's own export_hf_weights of the same model: the language model's tensors
    equal the checkpoint bit for bit (the oracle the pieces are held to, too)."""
    from m2nkit.engine.in_process import bitwise_equal

    ckpt = _ckpt(label)
    exported = stacked_export(torch.load(dumped / f"{label}.r0.pt")["export"])
    for n in ckpt.names:
        if n.startswith("model.visual."):
            continue
        want = ckpt.read_full(n)
        packed = n.endswith((".experts.gate_up_proj.weight", ".experts.down_proj.weight"))
        if packed and n not in exported:
            # Qwen3-VL-MoE: Bridge exports the packed experts as the checkpoint stores
            # them, [E, in, out] under the name without ".weight" (transpose_on_export);
            # the wire is [E, out, in] (families/qwen3_vl_moe.py)
            assert n.removesuffix(".weight") in exported, (label, n)
            got = exported[n.removesuffix(".weight")]
            assert got.shape == (want.shape[0], want.shape[2], want.shape[1]), (label, n)
            want = want.transpose(1, 2)
        else:
            assert n in exported, (label, n)
            got = exported[n]
        assert bitwise_equal(got, want), (label, n)


def test_live_names_equal_the_hand_table(dumped):
    """Every Megatron spelling Bridge's registry gives for the language model resolves in
    names.QWEN3_VL / QWEN3_VL_MOE to the same rule and wire tensors, and the kinds
    Bridge's AutoMapping resolved on the live modules are the table's."""
    from m2nkit.adapters.megatron.names import megatron_names

    for label, model in (("tp2", DENSE), ("moe-tp2ep2", MOE)):
        arch = json.loads((CKPT[label] / "config.json").read_text())["architectures"][0]
        hand = {m: (e.rule.name, e.wires) for e in megatron_names(arch) for m in e.megatron}
        p = torch.load(dumped / f"{label}.r0.pt")
        assert p["names"], label
        for spellings, rule, wires, _norm, _buffer in p["names"]:
            wires = {None if k in (None, "null") else k: v for k, v in wires.items()}
            for m in spellings:
                assert m in hand, f"{label}: Bridge maps {m!r}; names.py lacks it"
                assert hand[m] == (rule, wires), (label, m, hand[m], (rule, wires))


def test_tied_lm_head_under_the_vlm_prefix_megatron_bridge_4883(dumped):
    """Megatron-Bridge#4883 (a tied ``lm_head`` under a prefixed VLM name): the tied dense
    model's last stage holds ``language_model.output_layer.weight``, a replica of the
    embedding; megatron_source sends the first stage's ``model.language_model.
    embed_tokens.weight`` once and no ``lm_head.weight`` (vLLM ties it: its
    ``language_model.lm_head`` is an alias in the dumps the rounds equal)."""
    from m2nkit.manifest import manifest_from_json

    pay = _payloads(dumped, "tp2pp2")
    assert "chunk0.language_model.output_layer.weight" not in json.dumps(pay[2]["module_names"])
    metas = {m.name: m for m in manifest_from_json(pay[0]["manifest"])[0]}
    assert "lm_head.weight" not in metas
    emb = metas["model.language_model.embed_tokens.weight"]
    assert {p.rank for p in emb.pieces} == {0, 1}
    assert pay[0]["module_names"]["model.language_model.embed_tokens.weight"] == (
        "chunk0.language_model.embedding.word_embeddings.weight",)


def test_pp2vpp2_chunks_publish_global_layers(dumped):
    """pp2vpp2, 4 layers (dp 2: ranks 0-1 stage 0, 2-3 stage 1): stage 0's chunks hold
    layers 0 and 2, stage 1's layers 1 and 3, each as its chunk's local layer 0; the
    wire says the global layer (NeMo-RL#3259)."""
    from m2nkit.manifest import manifest_from_json

    pay = _payloads(dumped, "pp2vpp2")
    metas = {m.name: m for m in manifest_from_json(pay[0]["manifest"])[0]}
    for L, ranks in ((0, {0, 1}), (1, {2, 3}), (2, {0, 1}), (3, {2, 3})):
        m = metas[f"model.language_model.layers.{L}.self_attn.o_proj.weight"]
        assert {p.rank for p in m.pieces} == ranks, L
    assert pay[2]["module_names"]["model.language_model.layers.3.self_attn.o_proj.weight"] == (
        "chunk1.language_model.decoder.layers.0.self_attention.linear_proj.weight",)
