"""``m2nkit plan`` end to end: plan + --verify across models and layouts, JSON, errors.

``--verify`` compares every worker with ``reference_load`` (checked against
real vLLM dumps in test_vllm_oracle.py); these tests additionally assert the
byte accounting from first principles (the workers' local parameter sizes)
and that user errors exit 2 with one line and no traceback.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from _paths import CONFIGS, EXAMPLE, ORACLE
import pytest
import torch
from safetensors.torch import load_file, save_file

from m2nkit.engine.tools.cli import main


DENSE = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-tied"]
MOE = ["tiny-qwen3-moe", "tiny-mixtral"]
TRAINERS = ["replicated:2", "fsdp:3", "fsdp:5", "hsdp:2,3"]
DENSE_INFERENCE = ["vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,dp=2"]
MOE_INFERENCE = DENSE_INFERENCE + ["vllm:tp=2,ep", "vllm:tp=4,ep", "vllm:tp=2,dp=2,ep", "vllm:tp=8,ep"]


def run_plan(capsys, *args):
    code = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


#: FSDP2 specs with tensor parallelism (the family's TP plan; strided pieces), a few
#: layouts each: their boxes are checked against real fully_shard in test_trainer_spec.py.
FSDP2_TP_CASES = [
    ("tiny-llama", "fsdp2:dp_shard=3,tp=2", "vllm:tp=2,dp=2"),
    ("tiny-qwen3-tied", "fsdp2:dp_shard=2,tp=2", "vllm:tp=4"),
    ("tiny-qwen3-moe", "fsdp2:dp_replicate=2,dp_shard=2,tp=2", "vllm:tp=2,ep"),
    ("tiny-mixtral", "fsdp2:dp_shard=3,tp=2", "vllm:tp=4"),
]


def cases():
    for model in DENSE + MOE:
        for trainer in TRAINERS:
            for inference in (MOE_INFERENCE if model in MOE else DENSE_INFERENCE):
                yield model, trainer, inference
    yield from FSDP2_TP_CASES


@lru_cache(maxsize=None)
def _checkpoint_tensors(path: Path):
    """``(read_checkpoint(path), its full tensors)``, read once per checkpoint (the tests
    only read them)."""
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint

    ck = read_checkpoint(path)
    return ck, full_checkpoint_tensors(ck)


@pytest.mark.parametrize("model,trainer,inference", list(cases()))
def test_plan_verify_bit_exact_and_minimal_bytes(tiny_checkpoints, tmp_path, capsys,
                                                 model, trainer, inference):
    ckpt = tiny_checkpoints(model, sharded=(trainer == "fsdp:5"))
    out_json = tmp_path / "plan.json"
    code, out, err = run_plan(capsys, ckpt, "--trainer", trainer, "--inference", inference,
                              "--verify", "--json", out_json)
    assert code == 0, out + err
    assert "verify: all" in out and "ratio 1.000" in out
    plan = json.loads(out_json.read_text())["plan"]
    assert plan["problems"] == []
    # Minimum from first principles: the worker parameters' own sizes, minus
    # the vocab padding rows nobody sends. Tied models count embed once.
    from m2nkit.adapters.vllm import parse_inference_spec, reference_load

    ck, full = _checkpoint_tensors(ckpt)
    spec = parse_inference_spec(inference)
    expected = 0
    for w in range(spec.tp * spec.dp):
        local = reference_load(ck.config, full, spec, w)
        seen = set()
        for name, t in local.items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            if "embed_tokens" in name or "lm_head" in name:
                # rows holding real tokens only
                vocab = ck.config.vocab_size
                per = math.ceil(vocab / 64) * 64 // spec.tp
                r = w % spec.tp
                rows = max(0, min((r + 1) * per, vocab) - r * per)
                expected += rows * t.shape[1] * t.element_size()
            else:
                expected += t.numel() * t.element_size()
    assert plan["bytes_moved"] == plan["bytes_min"] == expected
    assert sum(plan["send_bytes"]) == sum(plan["recv_bytes"]) == expected


def test_json_holds_manifest_digest_and_every_slab(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    code, out, _ = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:4", "--inference", "vllm:tp=2",
                            "--json", out_json, "-v")
    assert code == 0
    data = json.loads(out_json.read_text())
    from m2nkit.manifest.serialize import manifest_digest, manifest_from_json

    metas, n = manifest_from_json(data["manifest"])
    assert n == 4 and data["plan"]["manifest_digest"] == manifest_digest(metas, n)
    # Slabs written by rank: their bytes add up to send_bytes.
    per_rank = [0] * 4
    for wire in data["plan"]["wires"]:
        for src, dst, param, box, src_start, dst_start, nbytes in wire["slabs"]:
            per_rank[src] += nbytes
            vol = math.prod(b - a for a, b in box)
            assert nbytes == vol * torch.tensor([], dtype=getattr(torch, wire["dtype"])).element_size()
    assert per_rank == data["plan"]["send_bytes"]
    # -v prints one row per wire tensor.
    assert "model.layers.1.mlp.experts.down_proj.weight" in out


def test_real_size_config_plans_in_seconds(capsys):
    cfg = CONFIGS / "Qwen__Qwen3-30B-A3B" / "config.json"
    code, out, _ = run_plan(capsys, cfg, "--trainer", "fsdp:64", "--inference", "vllm:tp=4,ep")
    assert code == 0 and "ratio 1.000" in out
    # --verify needs data: a config-only checkpoint refuses it clearly.
    code, out, err = run_plan(capsys, cfg, "--trainer", "fsdp:2", "--inference", "vllm:tp=4,ep", "--verify")
    assert code == 2 and "only a config" in err


def _cli(capsys, *args):
    """``main(args)`` in this process: ``(exit code, stdout, stderr)``, argparse exits included."""
    capsys.readouterr()                # drop what came before (a fixture's progress bars)
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _corrupt_header(d: Path):
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:8] + b"{not json" + data[17:])


def _missing_shard(d: Path):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[0]).unlink()


def _unknown_arch(d: Path):
    # m2nkit has no table for it, and without vLLM (the fast suite: conftest.py) nothing
    # can trace it (one that transformers knows is planned from vLLM's loaders:
    # tests/integration/test_traced_plans.py)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))


def _wrong_shape(d: Path):
    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :64].contiguous()
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


def _bad_dtype(d: Path):
    t = load_file(d / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.float64)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage,sharded,inference,needle", [
    (_corrupt_header, False, "vllm:tp=2", "model.safetensors"),
    (_missing_shard, True, "vllm:tp=2", "does not exist"),
    (_unknown_arch, False, "vllm:tp=2", "'FooForCausalLM' is not supported"),
    (_wrong_shape, False, "vllm:tp=2", "o_proj.weight"),
    (_bad_dtype, False, "vllm:tp=2", "F64"),
    (None, False, "vllm:tp=3", "tp=3"),
    (None, False, "vllm:tp=2,bogus=1", "bogus"),
])
def test_bad_input_exits_2_with_one_clear_line(tiny_checkpoints, tmp_path, capsys, damage,
                                               sharded, inference, needle):
    # In process: an uncaught exception would fail the test as surely as a traceback.
    d = _copy(tiny_checkpoints("tiny-qwen3", sharded=sharded), tmp_path / "ck")
    if damage:
        damage(d)
    code, out, err = _cli(capsys, "plan", d, "--trainer", "fsdp:2", "--inference", inference)
    assert code == 2, out + err
    assert err.startswith("m2nkit: error:") and needle in err
    assert len(err.strip().splitlines()) == 1, err


def test_bad_trainer_spec_and_missing_path(tmp_path, capsys):
    code, _, err = _cli(capsys, "plan", EXAMPLE, "--trainer", "fsdp:0", "--inference", "vllm:tp=2")
    assert code == 2 and "fsdp:0" in err
    code, _, err = _cli(capsys, "plan", tmp_path / "nope", "--trainer", "fsdp:2",
                        "--inference", "vllm:tp=2")
    assert code == 2 and "nope" in err


def test_entry_point_exits_2_with_one_line_and_no_traceback(tmp_path):
    # The one subprocess: the real entry point, exit status and stderr as a shell sees
    # them (a spec refused before torch loads, so it costs an interpreter start only).
    r = subprocess.run([sys.executable, "-m", "m2nkit.engine.tools.cli", "plan", str(EXAMPLE),
                        "--trainer", "fsdp:2", "--inference", "vllm:tp=2,bogus=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("m2nkit: error:") and "bogus" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("which", ["router", "all", "q_proj"])
def test_wire_dtype_other_than_vllms_is_cast_on_arrival(tiny_checkpoints, tmp_path, capsys, which):
    # vLLM allocates every parameter in the config's dtype (bf16 here) and its
    # loaders cast on copy; so must m2nkit: the plan is clean, --verify is
    # bit-exact against the reference (which casts like vLLM), and the plan
    # says nccl.m2n cannot carry a tensor that needs a cast.
    d = _copy(tiny_checkpoints("tiny-qwen3-moe"), tmp_path / "ck")
    t = load_file(d / "model.safetensors")
    for name in t:
        if which == "all" or (which == "router" and name.endswith("mlp.gate.weight")) or \
                (which == "q_proj" and name == "model.layers.0.self_attn.q_proj.weight"):
            t[name] = t[name].to(torch.float32)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    out_json = tmp_path / "p.json"
    code, out, err = run_plan(capsys, d, "--trainer", "fsdp:2", "--inference", "vllm:tp=2,ep",
                              "--verify", "--json", out_json)
    assert code == 0, out + err
    assert "verify: all 2 workers" in out
    wires = {w["name"]: w for w in json.loads(out_json.read_text())["plan"]["wires"]}
    router = wires["model.layers.0.mlp.gate.weight"]["transports"]["nccl_m2n"]
    if which in ("router", "all"):
        assert not router["ok"] and "cast to vLLM's bfloat16" in router["reason"]
    else:
        assert "cast" not in (router["reason"] or "")


@pytest.mark.parametrize("args,needle", [
    (["--json", "/proc/m2nkit-cannot-write.json"], "--json /proc/m2nkit-cannot-write.json: cannot write"),
    (["--json", ""], "--json needs a file path"),
    (["--link-gbps", "inf"], "--link-gbps must be a finite number > 0, got inf"),
    (["--link-gbps", "nan"], "--link-gbps must be a finite number > 0, got nan"),
])
def test_bad_flags_fail_before_any_work(capsys, args, needle):
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=2", *args)
    assert code == 2 and needle in err
    assert out == ""  # nothing was planned or printed first


def test_failed_run_leaves_no_json_behind(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    code, _, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=3",
                            "--json", out_json)
    assert code == 2 and "tp=3" in err and not out_json.exists()


@pytest.mark.parametrize("trainer,inference,needle", [
    ("fsdp:99999999999", "vllm:tp=2", "more than m2nkit plans for (65536)"),
    ("fsdp:\u00b2", "vllm:tp=2", "is not a positive integer"),
    ("fsdp:2", "vllm:tp=1,dp=100000", "more than m2nkit plans for (16384)"),
])
def test_absurd_sizes_are_refused(capsys, trainer, inference, needle):
    code, _, err = run_plan(capsys, EXAMPLE, "--trainer", trainer, "--inference", inference)
    assert code == 2 and needle in err


# --------------------------------------------------------------------------
# checkpoints as they exist in the field (issue 11); the vLLM behaviour each
# test relies on is pinned to real vLLM 0.33.0 dumps in test_vllm_oracle.py



def _one_line(out: str) -> str:
    return " ".join(out.split())  # rich wraps long table cells


@pytest.mark.parametrize("inference,dtype", [("vllm:tp=2", "bfloat16"),
                                             ("vllm:tp=2,dtype=float16", "float16")])
def test_config_without_dtype_plans_and_verifies(tmp_path, capsys, inference, dtype):
    """No dtype in config.json: planner and reference both follow vLLM's dtype=auto."""
    d = _copy(ORACLE / "tiny-qwen3-nodtype" / "checkpoint", tmp_path / "ck")
    code, out, err = run_plan(capsys, d, "--trainer", "fsdp:2", "--inference", inference,
                              "--verify", "--dump", tmp_path / "dump")
    assert code == 0, out + err
    assert "verify: all 2 workers" in out
    assert "note" in out and f"parameters are {dtype}" in _one_line(out)
    stored = load_file(tmp_path / "dump" / "worker0.safetensors")
    assert {t.dtype for t in stored.values()} == {getattr(torch, dtype)}


def test_integer_weight_without_quantization_config_is_refused(tiny_checkpoints, tmp_path,
                                                                capsys):
    d = _copy(tiny_checkpoints("tiny-qwen3"), tmp_path / "ck")
    name = "model.layers.1.mlp.down_proj.weight"
    t = load_file(d / "model.safetensors")
    t[name] = t[name].to(torch.int8)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_plan(capsys, d, "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                              "--verify")
    assert code == 2, out + err
    assert f"wire tensor '{name}' is int8" in err and "no quantization_config" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("inference", ["vllm:tp=2", "vllm:tp=4,ep", "vllm:tp=2,dp=2"])
def test_experts_stacked_on_disk_plan_and_verify(tmp_path, capsys, inference):
    d = ORACLE / "tiny-qwen3-moe-stacked" / "checkpoint"
    out_json = tmp_path / "p.json"
    code, out, err = run_plan(capsys, d, "--trainer", "fsdp:3", "--inference", inference,
                              "--verify", "--json", out_json)
    assert code == 0, out + err
    assert "verify: all" in out and "ratio 1.000" in out
    names = [w["name"] for w in json.loads(out_json.read_text())["plan"]["wires"]]
    assert "model.layers.1.mlp.experts.down_proj.weight" in names


def test_round_robin_request_says_it_falls_back(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference",
                              "vllm:tp=2,ep,placement=round_robin", "--verify",
                              "--json", out_json)
    assert code == 0, out + err
    assert "round_robin placement falls back" in _one_line(out)
    notes = json.loads(out_json.read_text())["notes"]
    assert len(notes) == 1 and "passes no num_expert_group" in notes[0]


def test_uneven_expert_parallel_plans_and_verifies(tmp_path, capsys):
    code, out, err = run_plan(capsys, ORACLE / "tiny-qwen3-moe-e10" / "checkpoint",
                              "--trainer", "fsdp:3", "--inference", "vllm:tp=2,dp=2,ep",
                              "--verify")
    assert code == 0, out + err
    assert "verify: all 4 workers" in out


@pytest.mark.parametrize("inference,needle", [
    ("vllm:tp=2,placement=rr", "placement must be one of linear, round_robin"),
    ("vllm:tp=2,dtype=int8", "dtype must be one of auto, bfloat16, float16"),
    ("vllm:tp=2,all2all=mpi", "all2all must be one of allgather_reducescatter"),
])
def test_bad_inference_options_are_refused(capsys, inference, needle):
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference", inference)
    assert code == 2 and needle in err and out == ""


def test_layout_traced_without_vllm_is_refused_naming_the_way_out(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "vllm" else real(name, *a, **k))
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                              "--layout", "traced")
    assert code == 2
    assert err.strip() == ("m2nkit: error: --layout traced needs vLLM installed (it runs vLLM's "
                           "own weight loaders); without vLLM use --layout tables")
    # auto falls back to the tables, and says so
    code, out, _ = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                            "--layout", "auto")
    assert code == 0 and "m2nkit's family tables (no vLLM needed)" in " ".join(out.split())


def test_the_default_layout_is_traced_where_vllm_is_importable(capsys, monkeypatch):
    """Issue 16: ``m2nkit plan`` traces vLLM's loaders by default where vLLM is importable,
    else plans from the tables; online quantization (``quant=``) is planned from the tables
    only; an explicit ``--layout`` wins; the report says which and why."""
    from m2nkit.adapters.vllm import builder, parse_inference_spec
    from m2nkit.engine.tools.cli import plan_layout

    plain = parse_inference_spec("vllm:tp=2")
    fp8 = parse_inference_spec("vllm:tp=2,quant=fp8_per_block")
    table, tableless = "Qwen3ForCausalLM", "Olmo3ForCausalLM"
    monkeypatch.setattr(builder, "vllm_importable", lambda: True)
    assert [plan_layout(None, table, plain), plan_layout(None, tableless, plain)] == \
        ["traced", "traced"]
    assert plan_layout(None, table, fp8) == "tables"
    assert [plan_layout("auto", table, plain), plan_layout("auto", tableless, plain)] == \
        ["tables", "traced"]
    assert plan_layout("tables", tableless, plain) == "tables"
    monkeypatch.setattr(builder, "vllm_importable", lambda: False)
    assert [plan_layout(None, table, plain), plan_layout(None, tableless, plain)] == \
        ["tables", "tables"]
    assert plan_layout("traced", table, plain) == "traced"   # refused later, naming the way out
    code, out, _ = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=2")
    assert code == 0
    assert "m2nkit's family tables (no vLLM needed) (the default without vLLM)" in \
        " ".join(out.split())


def test_traced_online_quantization_is_refused_from_the_arguments_alone(capsys):
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:2", "--inference",
                              "vllm:tp=2,quant=fp8_per_block", "--layout", "traced")
    assert (code, out) == (2, "")
    assert err.strip() == ("m2nkit: error: --inference vllm:tp=2,quant=fp8_per_block: quant= is "
                           "planned with --layout tables (vLLM's online fp8 rule, "
                           "m2nkit.adapters.vllm.fp8)")


def test_a_refusal_from_vllms_config_checks_reads_as_one_line():
    """vLLM refuses a configuration with a pydantic ``ValidationError`` whose text spans
    lines (the input's repr, a link); the trace's refusal keeps its messages only."""
    from m2nkit.adapters.vllm.trace import one_line_reason

    class ValidationError(ValueError):
        def errors(self):
            return [{"msg": "Value error, Total number of attention heads (32) must be "
                            "divisible by tensor parallel size (3).", "type": "value_error"}]

    e = ValidationError("1 validation error for VllmConfig\n  Value error, Total ...\n"
                        "    For further information visit https://errors.pydantic.dev")
    assert one_line_reason(e) == ("Total number of attention heads (32) must be divisible by "
                                  "tensor parallel size (3).")
    assert one_line_reason(RuntimeError("two\n   lines")) == "two lines"


def test_plan_nodes_reports_the_ipc_transports_bytes_each_way(tmp_path, capsys):
    """``--nodes 2``: trainer ranks 0-1 and worker 0 on one node, ranks 2-3 and worker 1
    on the other; the split is recounted here from the JSON's slab rows."""
    out_json = tmp_path / "p.json"
    code, out, _ = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:4", "--inference",
                            "vllm:tp=2", "--json", out_json, "--nodes", "2")
    assert code == 0
    data = json.loads(out_json.read_text())
    same = other = 0
    for wire in data["plan"]["wires"]:
        for src, dst, *_, nbytes in wire["slabs"]:
            if src // 2 == dst:
                same += nbytes
            else:
                other += nbytes
    routes = data["ipc_routes"]
    assert (routes["nodes"], routes["ipc"], routes["p2p"]) == (2, same, other)
    assert same and other
    assert "ipc transport over 2 nodes:" in " ".join(out.split())
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:4", "--inference",
                              "vllm:tp=2", "--nodes", "3")
    assert code == 2 and out == ""
    assert ("--nodes 3: each node holds an equal run of the 4 trainer ranks and of the 2 "
            "workers, so the count must divide both; valid: 1, 2") in err
    # a count within range that divides one side only: no equal runs (fsdp:6, tp=4)
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:6", "--inference",
                              "vllm:tp=4", "--nodes", "3")
    assert code == 2 and out == ""
    assert "--nodes 3: each node holds an equal run of the 6 trainer ranks and of the 4 " \
           "workers, so the count must divide both; valid: 1, 2" in err
    # the fp8 wire has no ipc route yet: refused rather than reported in BF16 bytes
    code, out, err = run_plan(capsys, EXAMPLE, "--trainer", "fsdp:4", "--inference",
                              "vllm:tp=2,quant=fp8_per_block,wire=fp8", "--nodes", "2")
    assert code == 2 and out == ""
    assert "the ipc transport carries the BF16 wire only" in err


@pytest.mark.parametrize("path", ["meta-llama__Llama-4-Scout-17B-16E-Instruct",
                                  "meta-llama__Llama-4-Scout-17B-16E-Instruct/config.json"])
def test_verify_on_a_config_is_refused_before_the_layout_is_built(capsys, monkeypatch, path):
    """``m2nkit plan <Llama-4 config> --verify`` traced vLLM's loaders for about 10 minutes
    on 2 busy cores, then said --verify needs tensor data (a trial). Refused first now."""
    from m2nkit.engine.tools import cli

    def built(*_):
        raise AssertionError("the layout was built before --verify was refused")

    monkeypatch.setattr(cli, "_build", built)
    code = main(["plan", str(CONFIGS / path), "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                 "--verify"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--verify needs tensor data, but" in err and "has only a config" in err, err


def test_the_summary_says_why_tensors_are_skipped(capsys, tmp_path, monkeypatch):
    """DeepSeek-V3.2's published config has one multi-token-prediction layer after its
    ``num_hidden_layers`` (index 61), which vLLM's main model skips: the summary says so
    and counts exactly that layer's tensors (named in the plan's json)."""
    monkeypatch.setenv("COLUMNS", "400")
    cfg = CONFIGS / "deepseek-ai__DeepSeek-V3.2" / "config.json"
    layers = json.loads(cfg.read_text())["num_hidden_layers"]
    code, out, _ = run_plan(capsys, cfg, "--trainer", "fsdp:8", "--inference", "vllm:tp=8,ep",
                            "--json", tmp_path / "plan.json")
    wires = json.loads((tmp_path / "plan.json").read_text())["plan"]["wires"]
    mtp = sum(w["name"].startswith(f"model.layers.{layers}.") for w in wires)
    assert code == 0 and mtp > 1000
    assert (f"{len(wires)} ({mtp} skipped by vLLM: multi-token-prediction layer {layers} "
            "(num_nextn_predict_layers=1)), ") in out


def test_several_skip_reasons_are_counted_most_first():
    from types import SimpleNamespace

    from m2nkit.engine.tools.report import skipped_why

    def plan(*reasons):
        return SimpleNamespace(wires=[SimpleNamespace(skipped=r) for r in reasons])

    assert skipped_why(plan("", "")) == ""
    assert skipped_why(plan("tied: details", "")) == ": tied"
    assert skipped_why(plan("a: x", "b: y", "b: z", "")) == ": 2 b; 1 a"
