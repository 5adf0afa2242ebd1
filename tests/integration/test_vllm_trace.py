"""The destination layout traced from vLLM 0.33.0's own loaders (``adapters/vllm/trace.py``).

Two checks, each against something m2nkit did not compute:

* bit-exact against the real vLLM dumps in ``tests/data/oracle`` (vLLM's own
  loaders on the shipped checkpoints, NaN-filled so unwritten elements show):
  the traced bindings, applied to the checkpoint's bytes, give every worker
  exactly what vLLM's loaders wrote;
* the family tables against the trace, at tp 1/2/4/8, with and without EP
  and with dp replicas: the tables are the vLLM-free dry run, and this test
  is what makes them fail the moment they drift from the installed vLLM.

vLLM is imported here: these tests run in the integration pytest process.
"""

from __future__ import annotations

import os

import pytest
import torch

from _oracle import FIXTURES, _model, assert_layout_equals_dumps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

#: Families whose vLLM 0.33.0 loaders do not trace as boxes of the wire tensors, and why.
#: None: GPT-OSS's loader (``GptOssModel._load_weights_other``) is handed its stacked experts
#: as the checkpoint holds them ([E, in, out], the wire's HFNaming.permuted transposed back)
#: and permutes them itself, and its ``w2_bias.zero_()`` on tp ranks other than 0 is a zero
#: box (trace._fake_class).
UNTRACEABLE: dict[str, str] = {}


def _metas(wire):
    from m2nkit.manifest import ParamMeta

    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]


#: Architectures vLLM 0.33.0 cannot build here to trace. Kimi-K2.5: its kimi_k25.py imports
#: ``transformers.Kimi_K25Config`` (transformers 5.24; this venv has 5.12.1), and vLLM has no
#: config of its own to stand in: its registry maps ``kimi_k25`` to that same upstream class
#: (``transformers_utils/config.py`` ``_CONFIG_REGISTRY``, resolved through
#: ``transformers_utils/configs/__init__.py`` ``_CLASS_TO_MODULE["Kimi_K25Config"] =
#: "transformers"``, ahead of any remote code), and kimi_k25_vit.py imports
#: ``transformers.Kimi_K25VisionConfig`` at module level. It is traced under .venv-tf
#: instead (tests/integration/test_traced_kimi_k25.py: against the dumps, the table, vLLM's
#: own load and Kimi-K2's trace).
NOT_BUILT_HERE = {"KimiK25ForConditionalGeneration": "Kimi_K25Config"}


def _traceable(model):
    config, _, _ = _model(model)
    arch = config["architectures"][0]
    return arch not in UNTRACEABLE and arch not in NOT_BUILT_HERE


def _trace(model, spec):
    from _oracle import DATA
    from m2nkit.adapters.vllm.trace import trace_destination

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _, _, wire = _model(model)
    return trace_destination(DATA / model / "checkpoint", _metas(wire), spec)


TRACED = [p for p in FIXTURES if _traceable(p.values[0])]


@pytest.mark.parametrize("model,tp,ep,placement,dtype", TRACED)
def test_traced_layout_equals_vllm_dumps(model, tp, ep, placement, dtype):
    from m2nkit.adapters.vllm import InferenceSpec

    _, _, wire = _model(model)
    layout = _trace(model, InferenceSpec(tp, 1, ep, placement=placement, dtype=dtype))
    assert layout.notes == ("layout traced from vLLM's own weight loaders",)
    assert_layout_equals_dumps(layout, wire, model, tp, ep, placement, dtype, "traced ")


def _canonical(layout):
    from m2nkit.adapters.vllm.trace import TracedCopy, merge_copies

    params = {(p.worker, p.name): (p.dtype, p.shape, tuple(sorted(p.zero_boxes)))
              for p in layout.params}
    copies = [TracedCopy(b.name, f"{b.worker}:{b.param}", b.box,
                         tuple((o, o + hi - lo) for o, (lo, hi) in zip(b.offset, b.box)))
              for bs in layout.bindings.values() for b in bs]
    bindings = {(c.name, c.param, c.box, c.region) for c in merge_copies(copies)}
    return params, bindings, set(layout.skipped), layout.aliases


#: (model, specs) of the tables-versus-trace matrix: every traceable family with a table.
MATRIX = [(m, s) for m in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied",
                           "tiny-gemma2", "tiny-gemma3")
          for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,dp=2")] + \
         [(m, s) for m in ("tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3", "tiny-deepseek-v3-fp8",
                           "tiny-deepseek-v3-no-q-lora", "tiny-qwen3-moe-e10")
          for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,ep",
                    "vllm:tp=4,ep", "vllm:tp=8,ep", "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep")]
#: The multimodal wrappers (families/wrapper.py): Qwen3-VL (vision tower of 4 heads: tp 8
#: is refused by both) and Qwen3-VL-MoE.
MATRIX += [("tiny-qwen3-vl", s) for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8",
                                           "vllm:tp=2,dp=2")] + \
          [("tiny-qwen3-vl-moe", s) for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8",
                                               "vllm:tp=2,ep", "vllm:tp=4,ep", "vllm:tp=8,ep",
                                               "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep")]
#: GLM-4.5 and GLM-4.7-Flash (families/glm4_moe.py, glm4_moe_lite.py)
MATRIX += [(m, s) for m in ("tiny-glm4-moe", "tiny-glm4-moe-lite")
           for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,ep",
                     "vllm:tp=4,ep", "vllm:tp=8,ep", "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep")]


#: DeepSeek-V3.2 and GLM-5 (DSA indexer), MoE: with and without EP, dp replicas.
MATRIX += [(m, s) for m in ("tiny-deepseek-v32", "tiny-glm-moe-dsa")
           for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,ep",
                     "vllm:tp=4,ep", "vllm:tp=8,ep", "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep")]

#: The Gated DeltaNet families (families/qwen3_next.py, qwen3_5.py, qwen3_5_moe.py): tp 8
#: exceeds their 4 query heads, which table and trace both refuse.
MATRIX += [(m, s) for m in ("tiny-qwen3.5",)
           for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,dp=2")] + \
          [(m, s) for m in ("tiny-qwen3.5-moe", "tiny-qwen3-next")
           for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,ep",
                     "vllm:tp=4,ep", "vllm:tp=8,ep", "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep")]

#: The Qwen3.5 wrappers (families/qwen3_5_vl.py, qwen3_5_moe_vl.py): GDN text tables and
#: Qwen3-VL's tower (4 heads) composed; tp 8 is refused by both.
MATRIX += [("tiny-qwen3.5-vl", s) for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8",
                                            "vllm:tp=2,dp=2")] + \
          [("tiny-qwen3.5-moe-vl", s) for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4",
                                                "vllm:tp=8", "vllm:tp=2,ep", "vllm:tp=4,ep",
                                                "vllm:tp=8,ep", "vllm:tp=2,dp=2",
                                                "vllm:tp=2,dp=2,ep")]


#: Llama-4 (families/llama4.py, llama4_vl.py): rotary q/k rows, shared beside routed experts
#: stored stacked [E, in, out], the Scout wrapper's vision tower; 4 query heads (tp 8 is
#: refused by both).
MATRIX += [(m, s) for m in ("tiny-llama4", "tiny-llama4-vision")
           for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,ep",
                     "vllm:tp=4,ep", "vllm:tp=2,dp=2", "vllm:tp=2,dp=2,ep")]

#: GPT-OSS (families/gpt_oss.py): stacked experts [E, in, out] on disk, interleaved gate/up,
#: carried [E, out, in] (HFNaming.permuted); w2_bias on moe rank 0 only (zeros elsewhere,
#: flattened over dp without EP); 4 KV heads, not replicated (tp 8 is refused by both).
MATRIX += [("tiny-gpt-oss", s) for s in ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8",
                                         "vllm:tp=2,ep", "vllm:tp=4,ep", "vllm:tp=2,dp=2",
                                         "vllm:tp=2,dp=2,ep")]


@pytest.mark.parametrize("model,spec", MATRIX, ids=[f"{m}-{s[5:]}" for m, s in MATRIX])
def test_family_tables_equal_the_trace(model, spec):
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec

    config, _, wire = _model(model)
    inference = parse_inference_spec(spec)
    try:
        table = destination_layout(config, _metas(wire), inference)
    except ValueError as e:    # the table refuses the size: vLLM must refuse it too
        with pytest.raises(Exception):
            _trace(model, inference)
        pytest.xfail(f"not a valid layout for {model}: {e}")   # both refuse
    traced = _trace(model, inference)
    t_params, t_bind, t_skip, t_alias = _canonical(table)
    r_params, r_bind, r_skip, r_alias = _canonical(traced)
    assert r_params == t_params, sorted(set(r_params.items()) ^ set(t_params.items()))[:4]
    assert r_bind == t_bind, (sorted(r_bind - t_bind)[:3], sorted(t_bind - r_bind)[:3])
    assert (r_skip, r_alias) == (t_skip, t_alias)


#: dp-replicated layouts: MoE with the experts flattened over dp * tp (no EP), with EP, and
#: EP that leaves 2 experts per worker; dense (no MoE layer to re-place); MLA with shared experts.
REPLICAS = [("tiny-qwen3-moe", "vllm:tp=2,dp=2"), ("tiny-qwen3-moe", "vllm:tp=2,dp=2,ep"),
            ("tiny-mixtral", "vllm:tp=1,dp=4,ep"), ("tiny-llama", "vllm:tp=2,dp=2"),
            ("tiny-deepseek-v3", "vllm:tp=2,dp=2,ep")]


@pytest.mark.parametrize("model,spec", REPLICAS, ids=[f"{m}-{s[5:]}" for m, s in REPLICAS])
def test_replicas_re_placed_like_vllms_elastic_ep_trace_as_fresh_builds(model, spec, monkeypatch):
    """dp replicas' models are re-placed (``_replace_for_worker``: vLLM's own elastic-EP
    steps), not built: tp builds, not dp * tp; the layout is the fresh builds' exactly."""
    from m2nkit.adapters.vllm import parse_inference_spec, trace

    inference = parse_inference_spec(spec)
    builds = []
    build = trace._build_meta_model
    monkeypatch.setattr(trace, "_build_meta_model",
                        lambda d, s, w: (builds.append(w), build(d, s, w))[1])
    replaced = _canonical(_trace(model, inference))
    # dp group 0's only (worker 0's twice where its loaders refuse stacked experts: the
    # per-expert retry gets a fresh model)
    assert set(builds) == set(range(inference.tp)), builds
    monkeypatch.setattr(trace, "REPLACE_REPLICAS", False)
    builds.clear()
    fresh = _canonical(_trace(model, inference))
    assert set(builds) == set(range(inference.num_workers))
    assert replaced == fresh


#: EP layouts whose expert copies are derived from worker 0's (trace._ExpertSlots): dp
#: replicas, tp alone, round-robin placement, fp8 block scales, MLA with shared experts, a
#: loader taking the stacked experts whole (Qwen3-MoE) and ones taking them per expert.
DERIVED = [("tiny-qwen3-moe", "vllm:tp=2,dp=2,ep"), ("tiny-qwen3-moe", "vllm:tp=4,ep"),
           ("tiny-qwen3-moe", "vllm:tp=2,dp=2,ep,placement=round_robin"),
           ("tiny-mixtral", "vllm:tp=1,dp=4,ep"), ("tiny-deepseek-v3", "vllm:tp=2,dp=2,ep"),
           ("tiny-deepseek-v3-fp8", "vllm:tp=2,dp=2,ep"), ("tiny-qwen3-moe-e10", "vllm:tp=2,ep")]
#: ... and where the experts do not split evenly over the EP ranks (10 over 4, 6 over 4):
#: every worker's experts are traced by its own loaders.
NOT_DERIVED = [("tiny-qwen3-moe-e10", "vllm:tp=2,dp=2,ep"),
               ("tiny-mixtral-e6", "vllm:tp=1,dp=4,ep")]


def _expert_traces(monkeypatch):
    """Count the loader runs handed any stacked expert wire tensor."""
    from m2nkit.adapters.vllm import trace

    calls = []
    real = trace.trace_worker

    def spy(model, feeds, vllm_config=None):
        calls.append(any(".experts.gate_up_proj" in f.wire.name
                         or ".experts.down_proj" in f.wire.name for f in feeds))
        return real(model, feeds, vllm_config)
    monkeypatch.setattr(trace, "trace_worker", spy)
    return calls


@pytest.mark.parametrize("model,spec,derived", [(*c, True) for c in DERIVED]
                         + [(*c, False) for c in NOT_DERIVED],
                         ids=[f"{m}-{s[5:]}" for m, s in DERIVED + NOT_DERIVED])
def test_derived_expert_copies_equal_every_workers_own_trace(model, spec, derived, monkeypatch):
    """EP workers' expert copies are worker 0's relabelled by their own expert maps; the
    layout equals the one where every worker is built afresh and its loaders run on
    every expert it holds. Uneven splits are traced worker by worker."""
    from m2nkit.adapters.vllm import parse_inference_spec, trace

    inference = parse_inference_spec(spec)
    calls = _expert_traces(monkeypatch)
    quick = _canonical(_trace(model, inference))
    with_experts = sum(calls)
    samples = len({inference.tp - 1, inference.num_workers - 1} - {0})
    if derived:     # worker 0 (twice where its loader refuses the stacked tensors whole)
        assert with_experts in (1 + samples, 2 + samples), calls
    else:
        assert with_experts >= inference.num_workers, calls
    monkeypatch.setattr(trace, "DERIVE_EXPERTS", False)
    monkeypatch.setattr(trace, "REPLACE_REPLICAS", False)
    calls.clear()
    fresh = _canonical(_trace(model, inference))
    assert sum(calls) >= inference.num_workers
    assert quick == fresh


def test_derived_expert_copies_that_drift_from_a_sample_workers_trace_fail_loudly(monkeypatch):
    from m2nkit.adapters.vllm import trace
    from m2nkit.adapters.vllm.trace import TraceError, TracedCopy

    real = trace._ExpertSlots.copies_for

    def shifted(self, model):     # the last slot's expert one further on: a wrong byte range
        out = real(self, model)
        c = out[-1]
        (a, b), rest = c.box[0], c.box[1:]
        out[-1] = TracedCopy(c.name, c.param, ((a + 1, b + 1),) + rest, c.region)
        return out
    monkeypatch.setattr(trace._ExpertSlots, "copies_for", shifted)
    with pytest.raises(TraceError, match=r"worker 1: the expert copies derived from worker 0's "
                                         r"trace differ from its own loaders' .*DERIVE_EXPERTS"):
        _trace("tiny-qwen3-moe", "vllm:tp=2,ep")


#: Deeper copies of the tiny checkpoints' configs (config only: the wire from the family
#: table), so that layers repeat: (model, config changes, spec, layers derived, not traced).
#: Llama: dense; Qwen3-MoE: stacked experts taken whole; DeepSeek-V3: a dense first layer,
#: MLA, shared experts, experts taken per expert, dp replicas; Qwen3-Next: linear and full
#: attention layers and a dense first layer (full attention at 3 and 6: each traced).
LAYERED = [("tiny-llama", {"num_hidden_layers": 5}, "vllm:tp=2", {1, 2, 3}),
           ("tiny-qwen3-moe", {"num_hidden_layers": 5}, "vllm:tp=2,ep", {1, 2, 3}),
           ("tiny-deepseek-v3", {"num_hidden_layers": 6}, "vllm:tp=2,dp=2,ep", {2, 3, 4}),
           ("tiny-qwen3-next", {"num_hidden_layers": 7, "layer_types": [
               "linear_attention", "linear_attention", "linear_attention", "full_attention",
               "linear_attention", "linear_attention", "full_attention"]}, "vllm:tp=2,ep",
            {2, 4}),
           # GPT-OSS: sliding and full attention layers alternate (two groups), experts fed
           # transposed, w2_bias zeroed on flat moe ranks 1-3 (zero copies re-indexed)
           ("tiny-gpt-oss", {"num_hidden_layers": 6, "layer_types": [
               "sliding_attention", "full_attention"] * 3}, "vllm:tp=2,dp=2", {2, 3})]


def _layered(tmp_path, model, changes):
    """A config-only checkpoint of ``model`` with ``changes``, and its wire tensors."""
    import json

    from _oracle import DATA
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint

    config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return checkpoint_metas(read_checkpoint(tmp_path / "config.json"), "fsdp:1")


def _layers_traced(monkeypatch):
    """Per loader run: the layer indices of the wire tensors it was handed."""
    from m2nkit.adapters.vllm import trace

    runs = []
    real = trace.trace_worker

    def spy(model, feeds, vllm_config=None):
        runs.append({int(f.name.split("layers.")[1].split(".")[0])
                     for f in feeds if "layers." in f.name})
        return real(model, feeds, vllm_config)
    monkeypatch.setattr(trace, "trace_worker", spy)
    return runs


@pytest.mark.parametrize("model,changes,spec,derived", LAYERED, ids=[c[0] for c in LAYERED])
def test_identical_layers_traced_once_equal_the_full_trace(tmp_path, monkeypatch, model,
                                                           changes, spec, derived):
    """Layers the live meta model shows identical are traced once (and one sample) and
    re-indexed (trace._trace_layers): the layout equals every layer traced."""
    from m2nkit.adapters.vllm import trace

    wire = _layered(tmp_path, model, changes)
    runs = _layers_traced(monkeypatch)
    quick = _canonical(trace.trace_destination(tmp_path, wire, spec))
    # every layer on the wire (DeepSeek-V3's MTP layer too: no decoder layer of vLLM's)
    layers = {int(m.name.split("layers.")[1].split(".")[0]) for m in wire if "layers." in m.name}
    assert layers >= set(range(changes["num_hidden_layers"]))
    assert runs and set().union(*runs) == layers - derived, runs
    monkeypatch.setattr(trace, "DEDUPE_LAYERS", False)
    runs.clear()
    full = _canonical(trace.trace_destination(tmp_path, wire, spec))
    assert set().union(*runs) == layers
    assert quick == full


def test_a_layer_the_live_model_shows_different_is_traced_on_its_own(tmp_path, monkeypatch):
    """One layer of the built model differing (an attribute its loaders could read) leaves
    its group: it is traced in full, the others still re-indexed, the layout unchanged."""
    from m2nkit.adapters.vllm import trace

    wire = _layered(tmp_path, "tiny-llama", {"num_hidden_layers": 5})
    build = trace._build_meta_model

    def deviating(d, s, w):
        model, config = build(d, s, w)
        model.model.layers[2].mlp.gate_up_proj.tp_rank = 7
        return model, config
    monkeypatch.setattr(trace, "_build_meta_model", deviating)
    runs = _layers_traced(monkeypatch)
    quick = _canonical(trace.trace_destination(tmp_path, wire, "vllm:tp=2"))
    assert set().union(*runs) == {0, 2, 4}, runs       # 1 and 3 re-indexed from 0, 4 sampled
    monkeypatch.setattr(trace, "DEDUPE_LAYERS", False)
    assert quick == _canonical(trace.trace_destination(tmp_path, wire, "vllm:tp=2"))


def test_a_sample_layer_that_disagrees_falls_back_to_the_full_trace(tmp_path, monkeypatch):
    """The sample layer's own copies are held to the re-indexed ones: a difference (here a
    re-indexed copy shifted by one row) traces every layer instead."""
    from m2nkit.adapters.vllm import trace

    wire = _layered(tmp_path, "tiny-llama", {"num_hidden_layers": 5})
    real = trace.trace_worker
    runs = []

    def shifted(model, feeds, vllm_config=None):
        copies, touched, copied = real(model, feeds, vllm_config)
        runs.append(len(feeds))
        if len(runs) == 1:      # the shortcut's run: the sample layer's first copy moved
            k = next(i for i, c in enumerate(copies) if ".layers.4." in c.param)
            c = copies[k]
            copies[k] = trace.TracedCopy(c.name, c.param, ((c.box[0][0] + 1, c.box[0][1] + 1),)
                                         + c.box[1:], c.region)
        return copies, touched, copied
    monkeypatch.setattr(trace, "trace_worker", shifted)
    trace.trace_destination(tmp_path, wire, "vllm:tp=1")
    assert len(runs) == 2 and runs[1] == len(wire) > runs[0], runs


def _loader_that_fails_on_the_fakes(monkeypatch):
    """vLLM's Llama ``load_weights`` replaced by one that expects another layout than the
    wire's: it narrows each tensor one row past its end (a RuntimeError on the fake's meta
    geometry, as a loader reading an on-disk order the wire does not have fails)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.model_executor.models.llama import LlamaForCausalLM

    def load_weights(self, weights):
        for _, weight in weights:
            weight.narrow(0, 0, weight.shape[0] + 1)
        return set()
    monkeypatch.setattr(LlamaForCausalLM, "load_weights", load_weights)


def test_an_untraceable_loader_is_refused_naming_the_model_and_the_reason(monkeypatch):
    from m2nkit.adapters.vllm.trace import TraceError

    _loader_that_fails_on_the_fakes(monkeypatch)
    with pytest.raises(TraceError, match=r"^LlamaForCausalLM: vLLM's load_weights failed on "
                                         r"the fake wire tensors \(the last one handed to it: "
                                         r"wire tensor '[^']+'\) "
                                         r"\(RuntimeError: .*\); use the family table "
                                         r"\(--layout tables\)$"):
        _trace("tiny-llama", "vllm:tp=2")


def test_kimi_k25_cannot_be_built_with_this_transformers():
    """When this fails, vLLM's Kimi-K2.5 builds here: add tiny-kimi-k25 to MATRIX. Until
    then a trace of it is refused naming the class this transformers lacks (the CLI's
    one line: test_traced_kimi_k25.py)."""
    from m2nkit.adapters.vllm.trace import TraceError

    with pytest.raises(TraceError, match=r"KimiK25ForConditionalGeneration: vLLM could not "
                                         r"build its model for worker 0 of vllm:tp=1,dp=1 on "
                                         r"the meta device: transformers \S+ has no "
                                         + NOT_BUILT_HERE["KimiK25ForConditionalGeneration"]):
        _trace("tiny-kimi-k25", "vllm:tp=1")


def test_op_chains_that_are_not_boxes_are_refused_naming_the_op():
    from m2nkit.adapters.vllm.trace import TraceError, chain_box

    assert chain_box("w", (8, 6), [("narrow", (0, 2, 4), ()), ("__getitem__", (1,), ())]) == \
        (((3, 4), (0, 6)), [1])
    assert chain_box("w", (4, 8, 6), [("chunk", (2,), (("dim", 1),)), ("__getitem__", (1,), ()),
                                      ("unbind", (), ()), ("__getitem__", (3,), ())]) == \
        (((3, 4), (4, 8), (0, 6)), [1, 2])
    with pytest.raises(TraceError, match=r"wire tensor 'w': vLLM's loader applies "
                                         r"__getitem__ with step 2"):
        chain_box("w", (8, 6), [("__getitem__", ((Ellipsis, slice(None, None, 2)),), ())])
    with pytest.raises(TraceError, match=r"applies view\(\(48,\)\,?\) \(a reshape that mixes dims\)"):
        chain_box("w", (8, 6), [("view", ((48,),), ())])
    with pytest.raises(TraceError, match=r"applies transpose"):
        chain_box("w", (8, 6), [("transpose", (0, 1), ())])


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "m2nkit.engine.tools.cli", "plan", *map(str, args)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})


def test_plan_layout_traced_verifies_and_says_so():
    from _paths import EXAMPLE

    r = _cli(EXAMPLE, "--trainer", "fsdp:3", "--inference", "vllm:tp=2,ep", "--layout", "traced",
             "--verify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "traced from vLLM's own weight loaders" in r.stdout
    # traced: the reference is vLLM's own DefaultModelLoader on the checkpoint's files
    assert "verify: all 2 workers hold exactly what vLLM's own loaders would" in r.stdout
    # the default where vLLM is importable (issue 16), and the tables when asked for
    default = _cli(EXAMPLE, "--trainer", "fsdp:3", "--inference", "vllm:tp=2,ep")
    assert default.returncode == 0, default.stdout + default.stderr
    assert ("traced from vLLM's own weight loaders (the default with vLLM importable; "
            "--layout tables for m2nkit's tables)") in " ".join(default.stdout.split())
    tables = _cli(EXAMPLE, "--trainer", "fsdp:3", "--inference", "vllm:tp=2,ep", "--layout",
                  "tables")
    assert "m2nkit's family tables (no vLLM needed) (--layout tables)" in tables.stdout


def test_a_size_vllm_refuses_is_refused_by_the_default_layout_in_one_line():
    """The default (traced) asks vLLM's own config checks: 32 heads over tp 3, and EP on a
    dense model, are refused in vLLM's words, one line, no traceback."""
    from _paths import CONFIGS

    config = CONFIGS / "Qwen__Qwen3-8B" / "config.json"
    for inference, words in (("vllm:tp=3", "Total number of attention heads (32) must be "
                                           "divisible by tensor parallel size (3)."),
                             ("vllm:tp=2,ep", "Number of experts in the model must be greater "
                                              "than 0 when expert parallelism is enabled.")):
        r = _cli(config, "--trainer", "fsdp:8", "--inference", inference)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith("m2nkit: error: --layout traced: Qwen3ForCausalLM: vLLM "
                                   "could not build its model for worker 0 of vllm:tp="), lines[0]
        assert f"(ValidationError: {words})" in lines[0], lines[0]


def test_plan_layout_traced_refuses_an_untraceable_loader_in_one_line(monkeypatch, capsys):
    """The CLI's own ``main`` in this process (the loader is patched here, so not in a
    subprocess): the refusal is one line naming the model and the reason."""
    from _paths import ORACLE
    from m2nkit.engine.tools.cli import main

    _loader_that_fails_on_the_fakes(monkeypatch)
    capsys.readouterr()
    code = main(["plan", str(ORACLE / "tiny-llama" / "checkpoint"), "--trainer", "fsdp:2",
                 "--inference", "vllm:tp=2", "--layout", "traced"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    line = err.strip().splitlines()[-1]
    assert line.startswith("m2nkit: error: --layout traced: LlamaForCausalLM: vLLM's "
                           "load_weights failed on the fake wire tensors (the last one handed "
                           "to it: wire tensor '"), line
    assert "(RuntimeError: start (0) + length " in line, line
    assert line.endswith("; use the family table (--layout tables)"), line
    assert "Traceback" not in err


@pytest.mark.parametrize("model,spec,worker", [("tiny-qwen3-moe", "vllm:tp=2,ep", 1),
                                               ("tiny-llama", "vllm:tp=4", 3),
                                               ("tiny-deepseek-v3", "vllm:tp=2", 0),
                                               ("tiny-llama4", "vllm:tp=2,ep", 1)])
def test_the_live_models_loaders_check_the_plan_and_leave_its_bytes(model, spec, worker):
    """What the plugin runs at init: the live (loaded) model's own loaders, traced,
    against the plan's bindings for its worker; no parameter changes. Llama-4's experts
    travel in another dim order than on disk (``HFNaming.permuted``): fed as the
    on-disk tensors its loader reads, as the plugin feeds them."""
    from dataclasses import replace

    from _oracle import DATA
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.adapters.vllm.trace import experts_on_disk, permuted_on_disk, traced_problems
    from m2nkit.engine.tools.vllm_workers import build_cpu_worker

    config, _, wire = _model(model)
    permuted = permuted_on_disk(config, list(wire))
    assert bool(permuted) == (model == "tiny-llama4")
    ispec = parse_inference_spec(spec)
    live, vllm_config = build_cpu_worker(DATA / model / "checkpoint", ispec, worker)
    before = {n: p.detach().clone() for n, p in live.named_parameters()}
    layout = destination_layout(config, _metas(wire), ispec)
    problems = traced_problems(live, layout, worker, _metas(wire), vllm_config,
                               experts_on_disk(config), permuted=permuted)
    assert problems == []
    for n, p in live.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8), before[n].view(torch.uint8)), n
    # a table that puts a box one row off is caught, naming the tensor and the parameter
    name = "model.layers.0.self_attn.o_proj.weight"
    wrong = [replace(b, offset=(b.offset[0] + 1, *b.offset[1:])) if b.worker == worker else b
             for b in layout.bindings[name]]
    bad = replace(layout, bindings={**layout.bindings, name: tuple(wrong)})
    problems = traced_problems(live, bad, worker, _metas(wire), vllm_config,
                               experts_on_disk(config), permuted=permuted)
    assert any(p.startswith(f"the plan writes box") and f"of '{name}'" in p for p in problems), \
        problems
    assert any(p.startswith("vLLM's loaders write box") and f"of '{name}'" in p for p in problems)


@pytest.mark.parametrize("model", ["tiny-deepseek-v32", "tiny-glm-moe-dsa"])
@pytest.mark.parametrize("spec", ["vllm:tp=1", "vllm:tp=2,ep", "vllm:tp=2,dp=2,ep"])
def test_dsa_tables_equal_the_trace_under_fp8_blocks(tmp_path, model, spec):
    """The DSA indexer under an fp8 block quantization_config (DeepSeek-V3.2 ships one), from
    config.json alone: vLLM quantizes wq_b (a ReplicatedLinear with the model's quant_config:
    fp8 weight + weight_scale_inv, whole on every worker) and builds wk_weights_proj with
    quant_config=None (bf16); the table's wire and layout equal the trace of vLLM's loaders."""
    import json

    import torch

    from _oracle import DATA
    from m2nkit.adapters.hf_checkpoint import read_checkpoint
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.adapters.vllm.trace import trace_destination

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    config = json.loads((DATA / model / "checkpoint" / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(tmp_path / "config.json")
    table = destination_layout(ckpt.config, ckpt.params, spec)
    traced = trace_destination(tmp_path, ckpt.params, spec)
    t_params, t_bind, t_skip, t_alias = _canonical(table)
    r_params, r_bind, r_skip, r_alias = _canonical(traced)
    assert r_params == t_params, sorted(set(r_params.items()) ^ set(t_params.items()))[:4]
    assert r_bind == t_bind, (sorted(r_bind - t_bind)[:3], sorted(t_bind - r_bind)[:3])
    assert (r_skip, r_alias) == (t_skip, t_alias)
    idx = "model.layers.1.self_attn.indexer."
    dtypes = {name: dtype for (w, name), (dtype, _, _) in r_params.items() if w == 0}
    assert dtypes[idx + "wq_b.weight"] == torch.float8_e4m3fn
    assert dtypes[idx + "wq_b.weight_scale_inv"] == torch.float32
    assert dtypes[idx + "wk_weights_proj.weight"] == torch.bfloat16
    assert idx + "wk_weights_proj.weight_scale_inv" not in dtypes
    assert dtypes[idx + "k_norm.weight"] == torch.float32


def _payload(metas, layout, inference):
    from m2nkit.engine.plan import build_plan
    from m2nkit.engine.session import InitPayload
    from m2nkit.manifest.destination import layout_to_json
    from m2nkit.manifest.serialize import manifest_digest, manifest_to_json

    plan = build_plan(metas, 2, layout, manifest_digest=manifest_digest(metas, 2))
    return InitPayload(master_address="127.0.0.1", master_port=1, rank_offset=2,
                       world_size=2 + layout.num_workers, backend="gloo", inference=inference,
                       manifest=manifest_to_json(metas, 2), manifest_digest=manifest_digest(metas, 2),
                       plan_digest=plan.digest(), timeout_s=5.0, bucket_bytes=1 << 20,
                       destination=layout_to_json(layout))


def test_a_traced_layout_from_the_trainers_is_held_against_each_workers_own_loaders(monkeypatch):
    """A worker of a traced layout (no table: MiniMax-M2) plans from the layout the trainers
    traced, sent in the init payload, and traces no model but its own: its live model's
    loaders against its part of the plan. A layout one row off for it is refused, naming the
    tensor; the same layout off for another worker is that worker's to refuse."""
    from dataclasses import replace

    from _oracle import DATA
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import parse_inference_spec, trace
    from m2nkit.engine.control import PlanMismatchError
    from m2nkit.engine.tools.vllm_workers import build_cpu_worker, create_engine

    model, inference, worker = "tiny-minimax-m2", "vllm:tp=2,ep", 1
    ckpt = DATA / model / "checkpoint"
    metas = checkpoint_metas(read_checkpoint(ckpt), "fsdp:2")
    layout = trace.trace_destination(ckpt, metas, inference)       # the trainers' trace
    live, vllm_config = build_cpu_worker(ckpt, parse_inference_spec(inference), worker)
    engine = create_engine(live, vllm_config, "cpu")
    assert engine.destination.layout == "traced"
    inference = engine.destination.spec          # canonical: "vllm:tp=2,dp=1,ep"

    def no_full_trace(*args, **kwargs):
        raise AssertionError("the worker traced every worker's model")

    monkeypatch.setattr(trace, "trace_destination", no_full_trace)
    assert engine._problems(_payload(metas, layout, inference)) == []
    assert engine.traced_own_loaders

    name = "model.layers.0.self_attn.o_proj.weight"
    def off_for(w):
        wrong = tuple(replace(b, offset=(b.offset[0] + 1, *b.offset[1:])) if b.worker == w
                      else b for b in layout.bindings[name])
        return replace(layout, bindings={**layout.bindings, name: wrong})

    reported = []
    monkeypatch.setattr(engine, "_refuse_everywhere", lambda p, m: reported.append(m))
    with pytest.raises(PlanMismatchError, match=rf"worker {worker}.*does not match m2nkit's "
                                                rf"layout for {inference}.*'{name}'"):
        engine.init_transfer_engine(_payload(metas, off_for(worker), inference))
    assert len(reported) == 1 and name in reported[0]
    assert engine._problems(_payload(metas, off_for(0), inference)) == []


def test_the_plugin_plans_each_init_once_and_the_receiver_still_checks_that_plan(monkeypatch):
    """The plugin's own checks (live model, traced loaders) need the payload's plan; the
    receiver is handed that plan instead of building it again, and holds it to the
    payload as its own: a plan digest that differs is still refused, naming the field."""
    from dataclasses import replace

    from _oracle import DATA
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.engine import receiver, session
    from m2nkit.engine.control import PlanMismatchError
    from m2nkit.engine.plugins import vllm as plugin
    from m2nkit.engine.tools.vllm_workers import build_cpu_worker, create_engine

    model, inference, worker = "tiny-qwen3-moe", "vllm:tp=2,ep", 1
    ckpt = DATA / model / "checkpoint"
    metas = checkpoint_metas(read_checkpoint(ckpt), "fsdp:2")
    live, vllm_config = build_cpu_worker(ckpt, parse_inference_spec(inference), worker)
    engine = create_engine(live, vllm_config, "cpu")
    payload = _payload(metas, engine.destination(metas), engine.destination.spec)
    built = []

    def counted(*args, **kwargs):
        built.append(args[1])
        return session.plan_from_manifest(*args, **kwargs)
    monkeypatch.setattr(plugin, "plan_from_manifest", counted)
    monkeypatch.setattr(receiver, "plan_from_manifest", counted)
    monkeypatch.setattr(receiver.M2NReceiver, "_report_refusal", lambda *a, **k: None)
    with pytest.raises(PlanMismatchError, match=rf"worker {worker}: init payload field "
                                                r"'plan_digest' is 0000000000000000\.\.\. but"):
        engine.init_transfer_engine(replace(payload, plan_digest="0" * 64))
    assert len(built) == 1, built


@pytest.mark.parametrize("spec", ["vllm:tp=8,ep", "vllm:tp=4,dp=2,ep"])
def test_llama4_scout_table_equals_the_trace_at_its_published_sizes(tmp_path, spec):
    """Llama-4-Scout's published config (examples/configs) cut to 2 text layers and 1 vision
    layer, every size else as published (40 heads of 128 over 8 KV heads, 16 experts, the
    vision tower of 16 heads): the table equals vLLM's traced loaders with EP, dp replicas
    included (sequence-parallel MoE: the shared expert whole), rotary rows and all."""
    import json

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.adapters.vllm.trace import trace_destination

    from _paths import CONFIGS

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    config = json.loads((CONFIGS / "meta-llama__Llama-4-Scout-17B-16E-Instruct"
                         / "config.json").read_text())
    text = config["text_config"]
    text["num_hidden_layers"] = 2
    for key in ("no_rope_layers", "moe_layers", "layer_types"):
        if key in text:
            text[key] = text[key][:2]
    config["vision_config"]["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = read_checkpoint(tmp_path / "config.json")
    metas = checkpoint_metas(ckpt, "fsdp:8")
    inference = parse_inference_spec(spec)
    table = _canonical(destination_layout(ckpt.config, metas, inference))
    traced = _canonical(trace_destination(tmp_path, metas, inference))
    assert traced[0] == table[0], sorted(set(traced[0].items()) ^ set(table[0].items()))[:4]
    assert traced[1] == table[1], (sorted(traced[1] - table[1])[:3], sorted(table[1] - traced[1])[:3])
    assert traced[2:] == table[2:]
