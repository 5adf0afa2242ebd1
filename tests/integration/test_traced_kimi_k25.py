"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``) traced from vLLM 0.33.0's own loaders.

vLLM's ``models/kimi_k25.py`` and ``kimi_k25_vit.py`` import ``Kimi_K25Config``
and ``Kimi_K25VisionConfig`` from transformers, which this process's
transformers (5.12.1, the pin Megatron-Bridge 0.6.2 needs) lacks; so the
traces run in a process of ``.venv-tf`` (``scripts/side_transformers.sh``, a
newer transformers in front of .venv; CI makes it before the integration
run) through ``trace_in.py``, and the layouts come back here. Checked
against what m2nkit did not compute:

* the tiny checkpoint's traced layout against the real vLLM dumps in
  ``tests/data/oracle/tiny-kimi-k25`` (tp 1/2/4, EP 2/4), bit for bit;
* the family table (``families/kimi_k25.py``) against the trace, at tp
  1/2/4, EP, dp 2 (tp 8 exceeds the tiny model's 4 heads: both refuse);
* the user's command under .venv-tf, ``m2nkit plan --layout traced --verify``,
  every worker held against vLLM's own ``DefaultModelLoader``;
* the published bf16 config (two text layers, one vision block) at
  ``vllm:tp=8,ep``: the bytes moved are the minimum and every element of
  vLLM's parameters is written once, a handful of vLLM parameters have the
  local shapes the config's arithmetic (written here) gives, and the language
  model is Kimi-K2's (DeepSeek-V3) trace exactly, under ``language_model.``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys

import pytest

from _oracle import DATA, _model, assert_layout_equals_dumps
from _paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

#: The interpreter with a transformers that has Kimi_K25Config (repo-root-relative).
PYTHON_TF = REPO / ".venv-tf" / "bin" / "python"
SCRIPT = REPO / "tests" / "integration" / "trace_in.py"
PUBLISHED = REPO / "examples" / "configs"
TINY = "tiny-kimi-k25"
#: Layouts of the tiny model: the dumps' (tests/data/oracle/tiny-kimi-k25), and the
#: table-versus-trace matrix (tp 8 > 4 heads: refused by both).
DUMPS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
MATRIX = ["vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=2,ep", "vllm:tp=4,ep",
          "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep", "vllm:tp=8"]
#: The published config planned at realistic size, cut as other tests cut big configs.
TEXT_LAYERS, VISION_BLOCKS, SPEC, TRAINERS = 2, 1, "vllm:tp=8,ep", 8


def _env():
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "COLUMNS": "250"}


def _python_tf():
    if not PYTHON_TF.exists():
        pytest.fail(f"{PYTHON_TF} is missing: vLLM 0.33.0's Kimi-K2.5 needs a transformers "
                    "with Kimi_K25Config, which scripts/side_transformers.sh installs there "
                    "(CI runs it before the integration tests)")
    return str(PYTHON_TF)


def _metas(wire):
    from m2nkit.manifest import ParamMeta

    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]


def _bf16_cut(src, dst, text_key=None):
    """``src``'s published config without its quantization, cut to few layers, into ``dst``."""
    config = json.loads((PUBLISHED / src / "config.json").read_text())
    text = config[text_key] if text_key else config
    text.pop("quantization_config")
    text["num_hidden_layers"] = TEXT_LAYERS
    if text_key:
        config["vision_config"]["num_hidden_layers"] = VISION_BLOCKS
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _config_metas(folder):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint

    return checkpoint_metas(read_checkpoint(folder / "config.json"), f"fsdp:{TRAINERS}")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Every Kimi-K2.5 layout of this file, traced in one .venv-tf process."""
    python = _python_tf()
    tmp = tmp_path_factory.mktemp("kimi-k25")
    published = _bf16_cut("moonshotai__Kimi-K2.5", tmp / "published", "text_config")
    _, _, wire = _model(TINY)
    tiny = (str(DATA / TINY / "checkpoint"), _metas(wire))
    jobs = [(spec, *tiny, spec) for spec in
            sorted({*MATRIX, *(f"vllm:tp={t}" + (",ep" if ep else "") for t, ep in DUMPS)})]
    jobs.append(("published", str(published), _config_metas(published), SPEC))
    (tmp / "jobs.pkl").write_bytes(pickle.dumps(jobs))
    r = subprocess.run([python, str(SCRIPT), str(tmp / "jobs.pkl"), str(tmp / "out.pkl")],
                       capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = pickle.loads((tmp / "out.pkl").read_bytes())
    out["published_dir"] = published
    return out


def test_the_traces_ran_under_a_transformers_with_kimi_k25_config(traced):
    import transformers

    assert not hasattr(transformers, "Kimi_K25Config"), (
        "this process's transformers has Kimi_K25Config now: trace Kimi-K2.5 here "
        "(tests/integration/test_vllm_trace.py NOT_BUILT_HERE)")
    assert tuple(int(x) for x in traced["transformers"].split(".")[:2]) > (5, 12)


@pytest.mark.parametrize("tp,ep", DUMPS, ids=[f"tp{t}" + ("_ep" if e else "") for t, e in DUMPS])
def test_traced_kimi_k25_equals_vllm_dumps(traced, tp, ep):
    layout = traced[f"vllm:tp={tp}" + (",ep" if ep else "")]
    _, _, wire = _model(TINY)
    assert not isinstance(layout, Exception), layout
    assert layout.notes == ("layout traced from vLLM's own weight loaders",)
    assert_layout_equals_dumps(layout, wire, TINY, tp, ep, "linear", "auto", "traced ")


@pytest.mark.parametrize("spec", MATRIX)
def test_kimi_k25_table_equals_the_trace(traced, spec):
    from .test_vllm_trace import _canonical

    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec

    config, _, wire = _model(TINY)
    layout = traced[spec]
    try:
        table = destination_layout(config, _metas(wire), parse_inference_spec(spec))
    except ValueError as e:         # the table refuses the size: vLLM must have refused too
        assert isinstance(layout, Exception), f"the table refuses {spec} ({e}), vLLM not"
        assert "not divisible" in str(e) and "divisible" in str(layout), (e, layout)
        return
    assert not isinstance(layout, Exception), layout
    t_params, t_bind, t_skip, t_alias = _canonical(table)
    r_params, r_bind, r_skip, r_alias = _canonical(layout)
    assert r_params == t_params, sorted(set(r_params.items()) ^ set(t_params.items()))[:4]
    assert r_bind == t_bind, (sorted(r_bind - t_bind)[:3], sorted(t_bind - r_bind)[:3])
    assert (r_skip, r_alias) == (t_skip, t_alias)


def test_plan_traced_verify_under_newer_transformers_equals_vllms_own_load():
    """The user's path: the tiny checkpoint read, traced, executed, and each worker held
    against vLLM's own DefaultModelLoader filling Kimi-K2.5's model from the files."""
    r = subprocess.run([_python_tf(), "-m", "m2nkit.engine.tools.cli", "plan",
                        str(DATA / TINY / "checkpoint"), "--trainer", "fsdp:3", "--inference",
                        "vllm:tp=2,ep", "--layout", "traced", "--verify"],
                       capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "traced from vLLM's own weight loaders" in r.stdout
    assert "(ratio 1.000)" in r.stdout
    assert "verify: all 2 workers hold exactly what vLLM's own loaders would" in r.stdout


def _bytes_of_every_element(layout, metas):
    """Bytes the bindings write, and bytes of vLLM's parameters less their padding."""
    itemsize = {m.name: m.dtype.itemsize for m in metas}
    bound = sum(math.prod(hi - lo for lo, hi in b.box) * itemsize[n]
                for n, bs in layout.bindings.items() for b in bs)
    feeds = {}
    for n, bs in layout.bindings.items():
        for b in bs:
            feeds.setdefault((b.worker, b.param), set()).add(itemsize[n])
    assert all(len(s) == 1 for s in feeds.values())
    params = sum((math.prod(p.shape) - sum(math.prod(hi - lo for lo, hi in z)
                                           for z in p.zero_boxes))
                 * next(iter(feeds[p.worker, p.name]))
                 for p in layout.params)
    return bound, params


def test_published_kimi_k25_bf16_traced_at_tp8_ep_moves_the_minimum(traced):
    from m2nkit.engine.plan import build_plan

    layout = traced["published"]
    assert not isinstance(layout, Exception), layout
    metas = _config_metas(traced["published_dir"])
    plan = build_plan(metas, TRAINERS, layout)
    assert not plan.problems, plan.problems[:3]
    bound, params = _bytes_of_every_element(layout, metas)
    assert bound == params
    assert plan.nbytes_moved == plan.nbytes_min == bound
    assert not layout.skipped                   # an untied head, no MTP layer: all of it lands


def test_published_kimi_k25_vllm_parameters_have_the_configs_local_shapes(traced):
    """Local shapes from the published config's numbers, at tp 8 with EP over 8 workers."""
    import torch

    config = json.loads((PUBLISHED / "moonshotai__Kimi-K2.5" / "config.json").read_text())
    t, v = config["text_config"], config["vision_config"]
    tp = 8
    H, nh, E = t["hidden_size"], t["num_attention_heads"], t["n_routed_experts"]
    nope, rope, vd = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    ql, kvl, I, mI = t["q_lora_rank"], t["kv_lora_rank"], t["intermediate_size"], \
        t["moe_intermediate_size"]
    # the published vision_config spells its sizes vt_*; vLLM reads Kimi_K25VisionConfig's
    # keys, whose defaults they equal (families/kimi_k25.py)
    D, vI, patch = v["vt_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    gh, gw = v["init_pos_emb_height"], v["init_pos_emb_width"]
    kh, kw = v["merge_kernel_size"]
    L, A, M, V = ("language_model.model.layers.", ".self_attn.", ".mlp.", "vision_tower.")
    want = {
        "language_model.model.embed_tokens.weight": (t["vocab_size"] // tp, H),
        "language_model.lm_head.weight": (t["vocab_size"] // tp, H),
        f"{L}0{A}fused_qkv_a_proj.weight": (ql + kvl + rope, H),
        f"{L}0{A}q_b_proj.weight": (nh // tp * (nope + rope), ql),
        f"{L}0{A}kv_b_proj.weight": (nh // tp * (nope + vd), kvl),
        f"{L}0{A}o_proj.weight": (H, nh // tp * vd),
        f"{L}0{M}gate_up_proj.weight": (2 * I // tp, H),
        f"{L}0{M}down_proj.weight": (H, I // tp),
        f"{L}1{M}experts.routed_experts.w13_weight": (E // tp, 2 * mI, H),
        f"{L}1{M}experts.routed_experts.w2_weight": (E // tp, H, mI),
        f"{L}1{M}gate.weight": (E, H),
        f"{L}1{M}gate.e_score_correction_bias": (E,),
        f"{L}1{M}shared_experts.gate_up_proj.weight": (2 * mI * t["n_shared_experts"] // tp, H),
        f"{V}patch_embed.proj.weight": (D, 3, patch, patch),
        f"{V}patch_embed.pos_emb.weight": (gh, gw, D),
        f"{V}encoder.blocks.0.wqkv.weight": (3 * D // tp, D),
        f"{V}encoder.blocks.0.wo.weight": (D, D // tp),
        f"{V}encoder.blocks.0.mlp.fc0.weight": (vI // tp, D),
        f"{V}encoder.blocks.0.mlp.fc1.weight": (D, vI // tp),
        "mm_projector.linear_1.weight": (D * kh * kw, D * kh * kw),
        "mm_projector.linear_2.weight": (H, D * kh * kw),
    }
    layout = traced["published"]
    for w in (0, tp - 1):
        have = {p.name: (p.shape, p.dtype) for p in layout.params if p.worker == w}
        for name, shape in want.items():
            assert name in have, f"worker {w}: vLLM has no parameter {name}"
            assert have[name][0] == shape, (w, name, have[name][0], shape)
        assert have[f"{L}1{M}gate.e_score_correction_bias"][1] == torch.float32
        assert have[f"{V}encoder.blocks.0.wqkv.weight"][1] == torch.bfloat16
    # worker 3's slot 0..E/8 of the stacked experts is experts [3E/8, 4E/8) (linear EP
    # placement), whole; its fused vision qkv rows are its q, k and v heads' rows
    by = {(b.worker, b.param): b for bs in layout.bindings.values() for b in bs}
    w13 = [b for b in layout.bindings[f"{L}1{M}experts.gate_up_proj.weight"] if b.worker == 3]
    assert [(b.box, b.offset) for b in w13] == [
        (((3 * E // tp, 4 * E // tp), (0, 2 * mI), (0, H)), (0, 0, 0))]
    qkv = sorted((b.offset, b.box) for b in layout.bindings[f"{V}encoder.blocks.0.wqkv.weight"]
                 if b.worker == 3)
    r = D // tp
    assert qkv == [((k * r, 0), ((k * D + 3 * r, k * D + 4 * r), (0, D))) for k in range(3)]
    assert by[3, "mm_projector.linear_1.weight"].box == ((0, D * kh * kw), (0, D * kh * kw))


def test_published_kimi_k25_language_model_is_kimi_k2s_trace(traced, tmp_path):
    """The text part is vLLM's DeepseekV2ForCausalLM on ``text_config``: Kimi-K2's (its
    published config has the same sizes), traced in this process, under ``language_model.``."""
    from m2nkit.adapters.vllm.trace import trace_destination

    k2 = _bf16_cut("moonshotai__Kimi-K2-Instruct", tmp_path / "k2")
    ref = trace_destination(k2, _config_metas(k2), SPEC)
    layout = traced["published"]
    lm = "language_model."

    def wire(name):
        return ("model." + name[len(lm + "model."):] if name.startswith(lm + "model.")
                else name[len(lm):])

    mine = {(p.worker, p.name[len(lm):], p.dtype, p.shape, p.zero_boxes)
            for p in layout.params if p.name.startswith(lm)}
    theirs = {(p.worker, p.name, p.dtype, p.shape, p.zero_boxes) for p in ref.params}
    assert mine == theirs, (sorted(mine - theirs)[:3], sorted(theirs - mine)[:3])
    rest = {p.name.split(".")[0] for p in layout.params if not p.name.startswith(lm)}
    assert rest == {"vision_tower", "mm_projector"}
    mine_b = {(wire(n), b.worker, b.box, b.param[len(lm):], b.offset)
              for n, bs in layout.bindings.items() if n.startswith(lm) for b in bs}
    theirs_b = {(n, b.worker, b.box, b.param, b.offset)
                for n, bs in ref.bindings.items() for b in bs}
    assert mine_b == theirs_b, (sorted(mine_b - theirs_b)[:3], sorted(theirs_b - mine_b)[:3])
    assert set(ref.bindings) == {m.name for m in _config_metas(k2)}      # all of it, bound
    aliases = {(a[len(lm):], b[len(lm):]) for a, b in layout.aliases.items()}
    assert aliases == set(ref.aliases.items())          # MLA's mla_attn.* views


def test_kimi_k25_traced_here_is_refused_in_one_line_and_auto_uses_the_table():
    """Under this process's transformers (no Kimi_K25Config) ``--layout traced`` refuses in
    one line naming the missing class, vLLM's declared transformers range and .venv-tf;
    ``--layout auto`` plans from the table (docs/families.md)."""
    from importlib import metadata

    import transformers

    def plan(layout):
        return subprocess.run([sys.executable, "-m", "m2nkit.engine.tools.cli", "plan",
                               str(DATA / TINY / "checkpoint"), "--trainer", "fsdp:2",
                               "--inference", "vllm:tp=2", "--layout", layout],
                              capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)

    r = plan("traced")
    assert r.returncode == 2, r.stdout + r.stderr
    wanted = next(x.replace(" ", "") for x in metadata.requires("vllm")
                  if x.startswith("transformers"))
    assert r.stderr.strip() == (
        "m2nkit: error: --layout traced: KimiK25ForConditionalGeneration: vLLM could not build "
        "its model for worker 0 of vllm:tp=2,dp=1 on the meta device: transformers "
        f"{transformers.__version__} has no Kimi_K25Config, which vLLM "
        f"{metadata.version('vllm')}'s model class imports (vLLM {metadata.version('vllm')} "
        f"declares {wanted}); trace it under a transformers that has Kimi_K25Config (this "
        "repository's .venv-tf, made by scripts/side_transformers.sh), or use the family "
        "table (--layout tables)"), r.stderr
    r = plan("auto")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "m2nkit's family tables (no vLLM needed)" in r.stdout
    assert "(ratio 1.000)" in r.stdout
