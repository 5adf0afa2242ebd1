"""What a new user meets first in ``m2nkit``: refusals, ``--version``, table widths,
``plan --bindings`` and ``plan --verify --dump``.

Fast refusals are asserted on imports (a fresh interpreter must not have
imported torch or transformers when it refuses), not on wall time. The
bindings expectations are computed here from the example's ``config.json``
(heads, KV heads, head size, experts, vocab), not from m2nkit's layout code;
the dumped storage is compared with ``reference_load``, the independent
restatement of vLLM's loaders (itself checked against real vLLM dumps in
``test_vllm_oracle.py``).
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from _paths import EXAMPLE
import pytest
import torch
from safetensors import safe_open

from m2nkit.engine.tools.cli import main

CONFIG = json.loads((EXAMPLE / "config.json").read_text())

#: Runs the CLI in a fresh interpreter and reports what it imported and whether it
#: started a process (the demo's supervisor starts its driver with subprocess.Popen).
_PROBE = """
import json, subprocess, sys
spawned = []
class _Popen(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        spawned.append(True)
        super().__init__(*args, **kwargs)
subprocess.Popen = _Popen
from m2nkit.engine.tools.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules, "spawned": bool(spawned)}))
"""


def _probe(*args):
    r = subprocess.run([sys.executable, "-c", _PROBE, *map(str, args)], capture_output=True,
                       text=True, timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _unsupported(tmp_path: Path, arch: str = "PhiForCausalLM") -> Path:
    d = tmp_path / "ck"
    shutil.copytree(EXAMPLE, d)
    cfg = dict(CONFIG, architectures=[arch])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# --------------------------------------------------------------------------
# refusals before torch


@pytest.mark.parametrize("case,needle", [
    ("trainer", "vpp > 1 needs pp > 1"),
    ("trainer_fsdp2", "'fsdp2' axis 'pp' is not supported"),
    ("inference", "unknown key 'pp'"),
    ("arch_dir", "architecture 'PhiForCausalLM' is not supported; supported: "),
    ("arch_config_file", "architecture 'GPT2LMHeadModel' is not supported; supported: "),
    ("dump_without_verify", "--dump writes the storage that --verify fills: add --verify"),
    ("demo_arch", "architecture 'PhiForCausalLM' is not supported; supported: "),
    ("demo_processes", "needs 42 processes"),
    ("demo_inference", "must start with 'vllm:'"),
    ("demo_sglang", "the demo into SGLang workers runs with --receiver sglang"),
    ("demo_receiver_sglang_vllm", "--receiver sglang needs --inference sglang:tp=T[,ep]"),
    ("demo_sglang_dp", "the demo runs one SGLang server (dp=1)"),
    # "sglang" without its colon was answered "must start with 'vllm:'" (a trial)
    ("plan_sglang_bare", "inference spec 'sglang' has no settings: write them after 'sglang:'"),
    # issue 21 item 8: refused before torch, as bad specs are
    ("plan_missing_checkpoint", "no such file or directory"),
    ("demo_misspelt_tiny", "--model 'tiny-lama' is neither a built-in tiny model (tiny-deepseek-v3"),
    ("plan_bridge", "bridge: is a trainer of m2nkit demo"),
    ("plan_megatron_heads", "num_attention_heads (6) must be a multiple of tp (4)"),
    ("demo_megatron_heads", "trainer spec 'megatron:tp=4': num_attention_heads (6) must be a "
                            "multiple of tp (4)"),
    ("demo_megatron_vocab", "vocab_size (200) must be divisible by tp (3)"),
    # issue 21 item 7: vLLM 0.33 builds no GPT-OSS MoE layer on CPU
    ("demo_vllm_gpt_oss", "No Unquantized MoE backend supports the deployment configuration"),
])
def test_refusals_come_before_torch_is_imported(tmp_path, case, needle):
    plan = ["plan", EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=2"]
    args = {
        "trainer": lambda: ["plan", EXAMPLE, "--trainer", "megatron:tp=2,vpp=2",
                            "--inference", "vllm:tp=2"],
        "inference": lambda: ["plan", EXAMPLE, "--trainer", "fsdp:2", "--inference", "vllm:tp=2,pp=2"],
        "trainer_fsdp2": lambda: ["plan", EXAMPLE, "--trainer", "fsdp2:dp_shard=2,pp=2",
                                  "--inference", "vllm:tp=2"],
        # an architecture without a table, where the tables were asked for (the
        # default, auto, traces it: tests/integration/test_traced_plans.py)
        "arch_dir": lambda: ["plan", _unsupported(tmp_path), "--trainer", "fsdp:2",
                             "--inference", "vllm:tp=2", "--layout", "tables"],
        "arch_config_file": lambda: ["plan", _unsupported(tmp_path, "GPT2LMHeadModel") / "config.json",
                                     "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                                     "--layout", "tables"],
        "dump_without_verify": lambda: [*plan, "--dump", tmp_path / "dump"],
        "demo_arch": lambda: ["demo", "--model", _unsupported(tmp_path)],
        "demo_processes": lambda: ["demo", "--trainer", "fsdp:40", "--inference", "vllm:tp=2"],
        "demo_inference": lambda: ["demo", "--inference", "tgi:tp=2"],
        "demo_sglang": lambda: ["demo", "--inference", "sglang:tp=2"],
        "plan_sglang_bare": lambda: ["plan", EXAMPLE, "--trainer", "fsdp:2", "--inference", "sglang"],
        "demo_receiver_sglang_vllm": lambda: ["demo", "--receiver", "sglang", "--inference",
                                              "vllm:tp=2"],
        "demo_sglang_dp": lambda: ["demo", "--receiver", "sglang", "--inference",
                                   "sglang:tp=2,dp=2"],
        "plan_missing_checkpoint": lambda: ["plan", tmp_path / "no-such-dir", "--trainer", "fsdp:2",
                                            "--inference", "vllm:tp=2"],
        "demo_misspelt_tiny": lambda: ["demo", "--model", "tiny-lama"],
        "plan_bridge": lambda: ["plan", EXAMPLE, "--trainer", "bridge:tp=2", "--inference",
                                "vllm:tp=2"],
        "plan_megatron_heads": lambda: ["plan", _llama_6_heads(tmp_path), "--trainer",
                                        "megatron:tp=4", "--inference", "vllm:tp=2"],
        "demo_megatron_heads": lambda: ["demo", "--model", _llama_6_heads(tmp_path), "--trainer",
                                        "megatron:tp=4", "--inference", "vllm:tp=2"],
        "demo_megatron_vocab": lambda: ["demo", "--model", _llama_6_heads(tmp_path, heads=6, kv=3,
                                                                          vocab=200),
                                        "--trainer", "bridge:tp=3", "--inference", "vllm:tp=1"],
        "demo_vllm_gpt_oss": lambda: ["demo", "--receiver", "vllm", "--model", "tiny-gpt-oss",
                                      "--trainer", "fsdp:2", "--inference", "vllm:tp=2"],
    }[case]()
    report, err = _probe(*args)
    # refused here, before torch and before any process (the demo's driver) starts
    assert report == {"rc": 2, "torch": False, "transformers": False, "spawned": False}, err
    assert err.startswith("m2nkit: error:") and err.count("\n") == 1, err
    assert needle in err
    if case.startswith("arch") or case == "demo_arch":
        # one format, naming every supported architecture
        listed = err.strip().split("supported: ")[-1].split("; ")[0].split(", ")
        assert "Qwen3MoeForCausalLM" in listed and "LlamaForCausalLM" in listed
        assert err.strip().endswith("--layout traced (needs vLLM installed)")
        assert all(re.fullmatch(r"[A-Za-z0-9_]+For(CausalLM|ConditionalGeneration)", a)
                   for a in listed), listed
    assert not (tmp_path / "dump").exists()


def _llama_6_heads(tmp_path: Path, heads: int = 6, kv: int = 2, vocab: int = 256) -> Path:
    """A Llama checkpoint directory (its config.json only) with 6 attention heads."""
    from _paths import CONFIGS

    d = tmp_path / f"llama-{heads}-heads-{kv}-kv-{vocab}"
    d.mkdir(exist_ok=True)
    cfg = json.loads((CONFIGS / "meta-llama__Llama-3.1-70B" / "config.json").read_text())
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=16 * heads,
               head_dim=16, intermediate_size=192, num_hidden_layers=2, vocab_size=vocab)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_a_closed_pipe_ends_quietly(tmp_path):
    """``m2nkit plan ... -v | head -1``: the reader goes away after one line; the command
    stops with 141 (128 + SIGPIPE, what a shell shows for a Unix tool there) or 0, and
    says nothing (no traceback, no "Exception ignored")."""
    import fcntl
    import os

    from _paths import CONFIGS

    r, w = os.pipe()
    try:
        fcntl.fcntl(w, 1031, 4096)      # F_SETPIPE_SZ: the output overflows it for sure
    except OSError:
        pass
    proc = subprocess.Popen([sys.executable, "-m", "m2nkit.engine.tools.cli", "plan",
                             str(CONFIGS / "Qwen__Qwen3-8B" / "config.json"), "--trainer", "fsdp:2",
                             "--inference", "vllm:tp=2", "-v", "--layout", "tables"],
                            stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    with os.fdopen(r, "rb") as reader:
        first = reader.readline()
    _, err = proc.communicate(timeout=120)
    assert first.startswith(b"m2nkit plan")
    assert proc.returncode in (0, 141), (proc.returncode, err)
    assert err == ""


class _ReaderGoneAfterOneLine(io.StringIO):
    """A stdout whose reader goes away once a line has been written (``| head -1``):
    every later write raises ``BrokenPipeError``, as a closed pipe's does."""

    def write(self, text):
        if "\n" in self.getvalue():
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


def test_a_closed_pipe_still_writes_the_json_and_dump_asked_for(tiny_checkpoints, tmp_path,
                                                                capsys, monkeypatch):
    """``m2nkit plan ... --verify --dump D --json F | head -1``: the tables stop at the closed
    pipe, the run goes on quietly and writes F and D whole, then exits 141; the same
    files as a run whose reader stays (whose dump is checked against vLLM's loaders in
    ``test_dump_writes_each_workers_storage_as_vllm_holds_it``). Without files to write,
    a closed pipe stops the run at once (141, no file)."""
    ckpt = tiny_checkpoints("tiny-qwen3-tied")
    args = ["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "vllm:tp=2", "-v", "--verify"]
    code = main(args + ["--json", str(tmp_path / "kept.json"), "--dump", str(tmp_path / "kept")])
    assert code == 0
    capsys.readouterr()

    closed = _ReaderGoneAfterOneLine()
    monkeypatch.setattr(sys, "stdout", closed)
    code = main(args + ["--json", str(tmp_path / "piped.json"), "--dump", str(tmp_path / "piped")])
    assert code == 141
    assert closed.getvalue().startswith("m2nkit plan") and "wrote" not in closed.getvalue()
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "piped.json").read_text()) == json.loads(
        (tmp_path / "kept.json").read_text())
    files = sorted(p.name for p in (tmp_path / "kept").iterdir())
    assert files == ["worker0.safetensors", "worker1.safetensors"]
    assert sorted(p.name for p in (tmp_path / "piped").iterdir()) == files
    for name in files:
        want, got = _load(tmp_path / "kept" / name), _load(tmp_path / "piped" / name)
        assert set(got) == set(want)
        assert all(torch.equal(got[k], want[k]) for k in want), name

    monkeypatch.setattr(sys, "stdout", _ReaderGoneAfterOneLine())
    assert main(["plan", str(ckpt), "--trainer", "fsdp:2", "--inference", "vllm:tp=2", "-v"]) == 141


@pytest.mark.parametrize("argv,first", [
    (["plan", "x", "--trainer", "fsdp:2", "--inference", "vllm:tp=2", "--layout", "trace"],
     "m2nkit plan: error: argument --layout: invalid choice: 'trace' (choose from 'tables', "
     "'traced', 'auto')"),
    (["demo", "--receiver", "vllmm"],
     "m2nkit demo: error: argument --receiver: invalid choice: 'vllmm' (choose from "
     "'stand-in', 'vllm', 'sglang')"),
    (["plan", "x"], "m2nkit plan: error: the following arguments are required: --trainer, "
                    "--inference"),
    ([], "m2nkit: error: the following arguments are required: command"),
    (["pla"], "m2nkit: error: argument command: invalid choice: 'pla' (choose from 'plan', "
              "'demo')"),
])
def test_usage_errors_are_one_line(capsys, argv, first):
    """A mistyped choice or a missing argument is one line on stderr, exit 2, like every
    other refusal (argparse alone prints its usage block first); ``--help`` keeps it."""
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err == f"{first} (see {first.split(': error')[0]} --help)\n"
    for command in ([], ["plan"], ["demo"]):
        code, out, _ = _cli(capsys, *command, "--help")
        assert code == 0 and out.startswith(" ".join(["usage: m2nkit", *command, "[-h]"]))


def _cli(capsys, *args):
    """``main(args)`` in this process: ``(exit code, stdout, stderr)``, argparse exits included."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ep_on_a_dense_model_gets_a_note(capsys, monkeypatch):
    from _paths import CONFIGS

    monkeypatch.setenv("COLUMNS", "400")
    dense = CONFIGS / "Qwen__Qwen3-8B" / "config.json"
    assert main(["plan", str(dense), "--trainer", "fsdp:2", "--inference", "vllm:tp=2,ep"]) == 0
    assert ("ep has no effect here: Qwen3ForCausalLM has no experts (a dense model), so "
            "every worker holds what tp=2 alone gives it") in capsys.readouterr().out
    assert main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=2,ep"]) == 0
    assert "ep has no effect" not in capsys.readouterr().out      # MoE: ep places experts


def test_progress_lines_are_not_wrapped_in_a_file(capsys, monkeypatch):
    """A progress line written to a file or pipe stays one line, whatever the width."""
    from m2nkit.engine.tools import cli

    monkeypatch.setenv("COLUMNS", "40")
    args = cli._parser().parse_args(["demo", "--model", "tiny-no-such-model", "--trainer",
                                     "fsdp:2", "--inference", "vllm:tp=2,dp=1", "--rounds", "3"])
    with pytest.raises(ValueError, match="neither a built-in tiny model"):
        cli._demo_here(args)        # the first lines, then the model is refused
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("] m2nkit demo: tiny-no-such-model, fsdp:2 -> vllm:tp=2,dp=1, "
                             "3 rounds (Ctrl-C stops it)"), lines
    assert all(line.startswith("[") for line in lines), lines


def test_a_good_spec_still_plans_in_process(capsys):
    # The light imports of the refusal path leave the real packages whole.
    assert main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=2"]) == 0
    assert "ratio 1.000" in capsys.readouterr().out


# --------------------------------------------------------------------------
# --version, COLUMNS


def test_version_comes_from_the_package_metadata():
    r = subprocess.run([sys.executable, "-m", "m2nkit.engine.tools.cli", "--version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"m2nkit {version('m2nkit')}\n"
    assert r.stdout == "m2nkit 0.1.0\n"


def test_piped_tables_honour_columns(capsys, monkeypatch):
    args = ["plan", str(EXAMPLE), "--trainer", "fsdp:3", "--inference", "vllm:tp=2", "-v"]
    monkeypatch.setenv("COLUMNS", "70")
    assert main(args) == 0
    narrow = capsys.readouterr().out.splitlines()
    assert max(map(len, narrow)) <= 70
    monkeypatch.delenv("COLUMNS")
    assert main(args) == 0
    wide = capsys.readouterr().out.splitlines()
    assert 80 < max(map(len, wide)) <= 200     # not rich's 80 columns when piped


# --------------------------------------------------------------------------
# --bindings


def _bindings(capsys, monkeypatch, inference: str) -> list[tuple[str, ...]]:
    monkeypatch.setenv("COLUMNS", "400")        # one table row per line
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:3", "--inference", inference,
                 "--bindings"])
    out = capsys.readouterr().out
    assert code == 0, out
    table = out[out.index("where each wire tensor lands"):]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5:
            rows.append(tuple(cells))
    return rows


def _sizes():
    """The example's sizes, from its config.json."""
    H, nh, nkv = CONFIG["hidden_size"], CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    hd = CONFIG.get("head_dim") or H // nh
    E = CONFIG.get("num_experts") or CONFIG["num_local_experts"]
    Im, V = CONFIG["moe_intermediate_size"], CONFIG["vocab_size"]
    return H, nh, nkv, hd, E, Im, V


def _rows_of(rows, wire):
    return [r[1:] for r in rows if r[0] == wire]


def test_bindings_tp2_name_rows_and_group_workers(capsys, monkeypatch):
    H, nh, nkv, hd, E, Im, V = _sizes()
    tp = 2
    q, kv = nh // tp * hd, nkv // tp * hd       # local rows of q and of k (and v) per rank
    rows = _bindings(capsys, monkeypatch, "vllm:tp=2")
    L0 = "model.layers.0."
    qkv = L0 + "self_attn.qkv_proj.weight"
    assert _rows_of(rows, L0 + "self_attn.q_proj.weight") == [
        (qkv, f"rows 0:{q}", "workers 0–1", f"rows 0:{q} (worker 0); rows {q}:{2 * q} (worker 1)")]
    assert _rows_of(rows, L0 + "self_attn.k_proj.weight") == [
        (qkv, f"rows {q}:{q + kv}", "workers 0–1",
         f"rows 0:{kv} (worker 0); rows {kv}:{2 * kv} (worker 1)")]
    assert _rows_of(rows, L0 + "self_attn.v_proj.weight") == [
        (qkv, f"rows {q + kv}:{q + 2 * kv}", "workers 0–1",
         f"rows 0:{kv} (worker 0); rows {kv}:{2 * kv} (worker 1)")]
    # row-parallel: each worker's whole o_proj, from its columns of the wire tensor
    assert _rows_of(rows, L0 + "self_attn.o_proj.weight") == [
        (L0 + "self_attn.o_proj.weight", "whole", "workers 0–1",
         f"cols 0:{nh * hd // 2} (worker 0); cols {nh * hd // 2}:{nh * hd} (worker 1)")]
    # experts without EP: tensor-parallel inside w13 = [gate rows | up rows] per rank
    im = Im // tp
    gate_up = _rows_of(rows, L0 + "mlp.experts.gate_up_proj.weight")
    assert [r[1:] for r in gate_up] == [
        (f"rows 0:{im}", "workers 0–1", f"rows 0:{im} (worker 0); rows {im}:{Im} (worker 1)"),
        (f"rows {im}:{Im}", "workers 0–1",
         f"rows {Im}:{Im + im} (worker 0); rows {Im + im}:{2 * Im} (worker 1)")]
    assert all(r[0].startswith(L0 + "mlp.experts.") and r[0].endswith(".w13_weight") for r in gate_up)
    down = _rows_of(rows, L0 + "mlp.experts.down_proj.weight")
    assert [r[1:] for r in down] == [
        ("whole", "workers 0–1", f"cols 0:{im} (worker 0); cols {im}:{Im} (worker 1)")]
    assert down[0][0].endswith(".w2_weight")
    # vocab padded to a multiple of 64, split evenly; the last rank holds fewer real rows
    per = math.ceil(V / 64) * 64 // tp
    assert _rows_of(rows, "model.embed_tokens.weight") == [
        ("model.embed_tokens.weight", "whole", "worker 0", f"rows 0:{per}"),
        ("model.embed_tokens.weight", f"rows 0:{V - per}", "worker 1", f"rows {per}:{V}")]
    assert _rows_of(rows, "model.norm.weight") == [("model.norm.weight", "whole", "workers 0–1", "whole")]


def test_bindings_tp4_replicates_kv_heads(capsys, monkeypatch):
    H, nh, nkv, hd, E, Im, V = _sizes()
    tp = 4
    assert tp > nkv                              # each KV head serves tp/nkv ranks
    q = nh // tp * hd
    reps = tp // nkv
    rows = _bindings(capsys, monkeypatch, "vllm:tp=4")
    takes = "; ".join(f"rows {h * hd}:{(h + 1) * hd} (workers {h * reps}–{(h + 1) * reps - 1})"
                      for h in range(nkv))
    assert _rows_of(rows, "model.layers.1.self_attn.k_proj.weight") == [
        ("model.layers.1.self_attn.qkv_proj.weight", f"rows {q}:{q + hd}", "workers 0–3", takes)]


def test_bindings_ep_names_experts_and_dp_replicas(capsys, monkeypatch):
    H, nh, nkv, hd, E, Im, V = _sizes()
    rows = _bindings(capsys, monkeypatch, "vllm:tp=2,dp=2,ep")
    n = 4                                        # ep = dp * tp workers, E / n experts each
    gate_up = _rows_of(rows, "model.layers.0.mlp.experts.gate_up_proj.weight")
    assert len(gate_up) == 1 and gate_up[0][0].endswith(".w13_weight")
    assert gate_up[0][1:] == ("whole", "workers 0–3", "; ".join(
        f"experts {w * E // n}:{(w + 1) * E // n} (worker {w})" for w in range(n)))
    # dense layers: tp within each dp replica, so workers 0 and 2 take the same rows
    q, kv = nh // 2 * hd, nkv // 2 * hd
    assert _rows_of(rows, "model.layers.0.self_attn.k_proj.weight") == [
        ("model.layers.0.self_attn.qkv_proj.weight", f"rows {q}:{q + kv}", "workers 0–3",
         f"rows 0:{kv} (workers 0, 2); rows {kv}:{2 * kv} (workers 1, 3)")]


@pytest.mark.parametrize("engine,spec", [("vLLM", "vllm:tp=2"), ("SGLang", "sglang:tp=2")])
def test_bindings_name_the_tied_head(tiny_checkpoints, capsys, monkeypatch, engine, spec):
    # tie_word_embeddings: the engine's lm_head.weight is embed_tokens' storage; the
    # checkpoint has no lm_head tensor, so the table says where it comes from, in the
    # destination engine's name (an SGLang plan said "vLLM parameter": a trial).
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["plan", str(tiny_checkpoints("tiny-qwen3-tied")), "--trainer", "fsdp:2",
                 "--inference", spec, "--bindings"]) == 0
    out = capsys.readouterr().out
    assert (f"{engine} parameter lm_head.weight is the storage of model.embed_tokens.weight "
            "(tied; filled through it)") in out
    assert f"HF name -> {engine} parameter" in out
    other = {"vLLM": "SGLang", "SGLang": "vLLM"}[engine]
    assert f"{other} parameter" not in out


# --------------------------------------------------------------------------
# --verify --dump


def _metadata(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("model,trainer,inference", [
    ("example", "fsdp:3", "vllm:tp=2,ep"),
    ("example", "hsdp:2,2", "vllm:tp=2,dp=2"),
    ("tiny-qwen3-tied", "fsdp:2", "vllm:tp=2"),
])
def test_dump_writes_each_workers_storage_as_vllm_holds_it(tiny_checkpoints, tmp_path, capsys,
                                                          model, trainer, inference):
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.adapters.vllm import parse_inference_spec, reference_load

    ckpt_dir = EXAMPLE if model == "example" else tiny_checkpoints(model)
    out = tmp_path / "dump" / "here"                 # created, parents too
    code = main(["plan", str(ckpt_dir), "--trainer", trainer, "--inference", inference,
                 "--verify", "--dump", str(out), "--json", str(tmp_path / "plan.json")])
    text = capsys.readouterr().out
    assert code == 0, text
    spec = parse_inference_spec(inference)
    n = spec.tp * spec.dp
    assert sorted(p.name for p in out.iterdir()) == sorted(f"worker{w}.safetensors" for w in range(n))
    ckpt = read_checkpoint(ckpt_dir)
    full = full_checkpoint_tensors(ckpt)
    plan_json = json.loads((tmp_path / "plan.json").read_text())["plan"]
    for w in range(n):
        path = out / f"worker{w}.safetensors"
        meta = _metadata(path)
        assert meta["worker"] == str(w)
        assert meta["tp_rank"] == str(w % spec.tp) and meta["dp_rank"] == str(w // spec.tp)
        assert meta["ep_rank"] == (str(w) if spec.ep else "none")
        assert meta["inference"] == str(spec) and meta["architecture"] == ckpt.architecture
        assert Path(meta["model"]) == Path(ckpt_dir).resolve()
        assert meta["plan_digest"] and meta["manifest_digest"] == plan_json["manifest_digest"]
        aliases = json.loads(meta["aliases"])
        got = _load(path)
        ref = reference_load(ckpt.config, full, spec, w)
        # every vLLM parameter once; an alias is saved under the name it shares storage with
        assert set(got) == set(ref) - set(aliases)
        assert all(target in got for target in aliases.values())
        for name, want in ref.items():
            t = got[aliases.get(name, name)]
            assert t.dtype == want.dtype and t.shape == want.shape, name
            assert torch.equal(t.view(torch.uint8) if t.numel() else t,
                               want.contiguous().view(torch.uint8) if want.numel() else want), name
    if model == "tiny-qwen3-tied":
        assert json.loads(_metadata(out / "worker0.safetensors")["aliases"]) == {
            "lm_head.weight": "model.embed_tokens.weight"}


def test_dump_to_an_unwritable_place_fails_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                 "--verify", "--dump", str(blocker / "sub")])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.startswith("m2nkit: error: --dump ") and out.err.count("\n") == 1


def test_dump_onto_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                 "--verify", "--dump", str(blocker)])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and blocker.read_text() == "mine"
    assert out.err == (f"m2nkit: error: --dump {blocker}: exists and is not a directory; give "
                       "a directory (created if missing)\n")


def test_dump_dir_created_for_a_run_that_fails_is_removed(tmp_path, capsys):
    out = tmp_path / "dump"
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=3",
                 "--verify", "--dump", str(out)])
    assert code == 2 and "tp=3" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_run_leaves_an_existing_json_file_untouched(tmp_path, capsys):
    out = tmp_path / "plan.json"
    out.write_text('{"mine": 1}')
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=3",
                 "--json", str(out)])
    assert code == 2 and out.read_text() == '{"mine": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]   # no temp file left
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                 "--json", str(out)])
    assert code == 0 and json.loads(out.read_text())["plan"]["problems"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    # a path that is not a regular file is refused, never replaced
    code = main(["plan", str(EXAMPLE), "--trainer", "fsdp:2", "--inference", "vllm:tp=2",
                 "--json", str(tmp_path)])
    assert code == 2 and "not a regular file" in capsys.readouterr().err


def test_words_for_boxes_and_reasons_follow_the_tensor():
    """Dim 0 of a 3-D tensor is "experts" only for stacked experts (a Gated DeltaNet conv1d
    [C, 1, K] is split by rows); reasons that differ only in numbers, whatever their
    digit counts (layer 0 and layer 10), are one row of the nccl_m2n summary."""
    from m2nkit.engine.tools.report import _describe_box, _reason_class

    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert _describe_box(((0, 16), (0, 1), (0, 4)), (32, 1, 4), conv) == "rows 0:16"
    assert _describe_box(((0, 16), (0, 1), (0, 2)), (32, 1, 4), conv) == "rows 0:16, dim2 0:2"
    assert _describe_box(((2, 4), (0, 8), (0, 6)), (4, 8, 6),
                         "model.layers.0.mlp.experts.gate_up_proj.weight") == "experts 2:4"
    assert _reason_class("3 pieces of model.layers.0.linear_attn.conv1d.weight") == \
        _reason_class("3 pieces of model.layers.10.linear_attn.conv1d.weight")
