"""The SGLang destination layout without SGLang: spec, rules, and the real vLLM dumps renamed.

SGLang itself is the reference in tests/integration/test_sglang_layout.py
(its own loaders over gloo). Here, without it: the spec's errors; the
one-replica-per-engine rule (every replica holds replica 0's parameters and
bindings); SGLang's ``auto`` dtype; and, against the real vLLM 0.33.0 dumps
of tests/data/oracle, that the SGLang layout is vLLM's with exactly the
expert rename (``experts.routed_experts.*`` -> ``experts.*``) and without the
router alias.
"""

from __future__ import annotations

import json

import pytest

from _oracle import _model, _oracle, assert_layout_equals_dumps
from m2nkit.adapters.sglang import SGLangSpec, parse_sglang_spec, sglang_destination_layout
from m2nkit.adapters.sglang.rules import check_architecture, sglang_dtype
from m2nkit.engine.tools.cli import main
from m2nkit.manifest import ParamMeta


def _metas(wire):
    return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in wire.items()]


@pytest.mark.parametrize("text,want", [
    ("sglang:tp=2", SGLangSpec(2)),
    ("SGLang: ep , tp=4, dp=2", SGLangSpec(4, 2, True)),
    ("sglang:tp=2,ep=0,dtype=half", SGLangSpec(2, 1, False, "float16")),
])
def test_spec_parses(text, want):
    assert parse_sglang_spec(text) == want
    assert parse_sglang_spec(str(want)) == want


@pytest.mark.parametrize("text,words", [
    ("vllm:tp=2", "must start with 'sglang:'"),
    ("sglang", "has no settings: write them after 'sglang:', like sglang:tp=2"),
    ("sglang:dp=2", "has no tp"),
    ("sglang:tp=0", "'tp=0' needs a positive int"),
    ("sglang:tp=2,tp=4", "gives 'tp' twice"),
    ("sglang:tp=2,ep=2", "a smaller --ep-size is not planned"),
    ("sglang:tp=2,pp=2", "unknown key 'pp'"),
    ("sglang:tp=2,dtype=int8", "dtype must be one of"),
    ("sglang:tp=2,,dp=1", "empty item"),
])
def test_spec_errors_name_the_part(text, words):
    with pytest.raises(ValueError) as info:
        parse_sglang_spec(text)
    assert words in str(info.value) and text in str(info.value)


def test_auto_dtype_is_sglangs_rule():
    # configs/model_config.py _get_and_verify_dtype: float32 or none -> float16, gemma -> bfloat16
    assert sglang_dtype({"dtype": "bfloat16"}, "auto") == ("bfloat16", None)
    assert sglang_dtype({}, "auto")[0] == "float16"
    assert sglang_dtype({"torch_dtype": "float32", "model_type": "qwen3"}, "auto")[0] == "float16"
    assert sglang_dtype({"dtype": "float32", "model_type": "gemma2"}, "auto")[0] == "bfloat16"
    assert sglang_dtype({"dtype": "float32"}, "bfloat16") == ("bfloat16", None)


def _renamed_vllm(model, tp, ep, rank):
    """A real vLLM 0.33.0 dump under the names SGLang 0.5.23's own dumps showed
    (tests/integration/test_sglang_layout.py): experts on ``mlp.experts``, DeepSeek-V3's
    ``fused_qkv_a_proj_with_mqa``, and no alias but the tied ``lm_head``."""
    dump, meta = _oracle(model, tp, ep, rank)
    aliases = json.loads(meta["aliases"])
    kept = {a: c for a, c in aliases.items() if a == "lm_head.weight"}
    out = {n.replace(".experts.routed_experts.", ".experts.")
            .replace(".fused_qkv_a_proj.", ".fused_qkv_a_proj_with_mqa."): t
           for n, t in dump.items() if n not in aliases or n in kept}
    return out, {**meta, "aliases": json.dumps(kept)}


@pytest.mark.parametrize("model,tp,ep", [("tiny-qwen3", 2, False), ("tiny-qwen3-tied", 2, False),
                                         ("tiny-qwen3-moe", 2, True), ("tiny-qwen3-moe", 4, True),
                                         ("tiny-qwen3-moe", 2, False),
                                         ("tiny-deepseek-v3", 2, True), ("tiny-mixtral", 2, True)])
def test_layout_is_vllms_dump_with_sglangs_names(model, tp, ep, tmp_path):
    from safetensors.torch import save_file

    config, _, wire = _model(model)
    for rank in range(tp):
        dump, meta = _renamed_vllm(model, tp, ep, rank)
        folder = tmp_path / model / (f"tp{tp}" + ("_ep" if ep else ""))
        folder.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in dump.items()},
                  str(folder / f"rank{rank}.safetensors"), metadata=meta)
    layout = sglang_destination_layout(config, _metas(wire), SGLangSpec(tp, 1, ep))
    assert not any("routed_experts" in p.name for p in layout.params)
    assert_layout_equals_dumps(layout, wire, model, tp, ep, "linear", "auto", "SGLang ",
                               root=tmp_path)


def test_each_replica_holds_replica_zero():
    """dp replicas are separate engines: EP spans one replica's tp workers, not dp*tp."""
    config, _, wire = _model("tiny-qwen3-moe")
    one = sglang_destination_layout(config, _metas(wire), "sglang:tp=2,ep")
    two = sglang_destination_layout(config, _metas(wire), "sglang:tp=2,dp=2,ep")
    assert two.num_workers == 4 and two.spec == "sglang:tp=2,dp=2,ep"
    by = {(p.worker, p.name): p for p in two.params}
    for p in one.params:
        for k in (0, 1):
            q = by[(k * 2 + p.worker, p.name)]
            assert (q.shape, q.dtype, q.zero_boxes) == (p.shape, p.dtype, p.zero_boxes)
    assert len(two.params) == 2 * len(one.params)
    experts = "model.layers.0.mlp.experts.gate_up_proj.weight"
    # 8 experts: 4 per worker of a replica (vLLM's dp=2 EP would give each of 4 workers 2)
    for w in range(4):
        boxes = [b.box for b in two.bindings[experts] if b.worker == w]
        assert boxes == [((4 * (w % 2), 4 * (w % 2) + 4), (0, 64), (0, 128))], (w, boxes)


def test_refuses_unchecked_architecture():
    config, _, wire = _model("tiny-gemma2")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        sglang_destination_layout(config, _metas(wire), "sglang:tp=2")
    config, _, wire = _model("tiny-deepseek-v3-no-q-lora")
    with pytest.raises(ValueError, match="without q_lora_rank"):
        sglang_destination_layout(config, _metas(wire), "sglang:tp=2")


def test_cli_plan_sglang(capsys):
    from _paths import ORACLE

    ckpt = ORACLE / "tiny-qwen3-moe" / "checkpoint" / "config.json"   # config-only: fast
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "sglang:tp=2,ep"]) == 0
    out = capsys.readouterr().out
    assert "sglang:tp=2,ep: 2 workers" in out and "SGLang layout" in out
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "sglang:tp=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sglang:tp=3" in err and "Traceback" not in err
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "sglang:tp=2",
                 "--verify"]) == 2
    assert "--verify" in capsys.readouterr().err


def test_cli_sglang_size_error_speaks_of_sglang_replicas(capsys):
    """A bad tp under sglang:...,dp=2 named vLLM's dp=1 replica ("valid tp with dp=1",
    "MoE tensor-parallel size dp*tp=3"), which a user who gave dp=2 cannot act on (a
    trial). SGLang's replicas are their own TP groups: the valid tp hold for any dp."""
    from _paths import ORACLE

    ckpt = ORACLE / "tiny-qwen3-moe" / "checkpoint" / "config.json"
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "sglang:tp=3,dp=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be laid out as sglang:tp=3,dp=2:" in err, err
    assert ("valid tp (for any dp: each SGLang replica is its own TP group): [1, 2, 4, 8]"
            in err), err
    assert "MoE tensor-parallel size tp=3" in err and "dp=1" not in err and "dp*tp" not in err
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference",
                 "sglang:tp=16,dp=2,ep"]) == 2
    assert "valid tp with ep (for any dp: each SGLang replica is its own TP group): [1, 2, 4, 8]" \
        in capsys.readouterr().err


def test_demo_into_sglang_without_its_receiver_is_refused_naming_it(capsys):
    """``m2nkit demo --inference sglang:tp=2`` said "must start with 'vllm:'" (a trial):
    SGLang workers are real ones only (``--receiver sglang``); the refusal says so."""
    code = main(["demo", "--inference", "sglang:tp=2", "--rounds", "1", "--no-baseline"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err.splitlines() == [
        "m2nkit: error: --inference sglang:tp=2: the demo into SGLang workers runs with "
        "--receiver sglang (SGLang's own model classes under .venv-sglang); got --receiver "
        "stand-in"]


def test_quantized_checkpoint_is_refused_not_half_renamed(capsys):
    """An fp8 DeepSeek-V3 checkpoint planned into SGLang named its fused q_a/kv_a weight
    SGLang's way (fused_qkv_a_proj_with_mqa.weight) and its scale vLLM's way
    (fused_qkv_a_proj.weight_scale_inv), with exit 0 (a trial); no quantized checkpoint
    is compared with SGLang's loaders, so it is refused, naming the way out."""
    from _paths import ORACLE

    ckpt = ORACLE / "tiny-deepseek-v3-fp8" / "checkpoint"
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "sglang:tp=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("DeepseekV3ForCausalLM with a quantization_config (quant_method 'fp8'): SGLang's "
            "layout of a quantized checkpoint") in err, err
    assert "the same config without quantization_config" in err, err
    # the published config's form, and the same config without it passes
    cfg = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="with a quantization_config"):
        check_architecture("DeepseekV3ForCausalLM", cfg)
    cfg.pop("quantization_config")
    check_architecture("DeepseekV3ForCausalLM", cfg)
