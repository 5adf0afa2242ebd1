"""``benchmarks/gpu_check.py --dry-run`` works on a machine without a GPU.

It builds each scenario's plan, routes the tensors, executes the plan in
this process and compares every worker byte with vLLM's loaders; where
``nccl.m2n`` imports it also builds the real descriptors. With
``--vllm-serve also`` it prepares the ``vllm serve`` RL loop: writes the
served checkpoint and the update (every tensor different, a tokenizer that
round-trips the prompt), byte-checks the update's plan and prints the server's
command line and environment. What it cannot do here (the GPU run, the
server, and the descriptors without ``m2nkit[nccl]``) it names as skipped.
The GPU run itself is covered by the CUDA-only test at the bottom of
``tests/engine/test_nccl_m2n.py``, which runs the script without ``--dry-run``; the
integration test here checks the printed command line with vLLM's own
``vllm serve`` argument parser.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from _paths import REPO
import pytest
import torch

from m2nkit.engine.tools.procs import free_port
from m2nkit.engine.transports.nccl_m2n_runtime import NcclM2NUnavailableError, import_nccl_m2n

ROOT = REPO
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
#: FSDP, FSDP into dp replicas with EP, HSDP into dp replicas; with the serve check's
#: round, the rows the one dry run below prints, and their ranks (trainers + workers).
SCENARIOS = ("fsdp:2/vllm:tp=2", "fsdp:2/vllm:tp=2,dp=2,ep", "hsdp:2,2/vllm:tp=2,dp=2")
RANKS = {"fsdp:2 -> vllm:tp=2": 4, "fsdp:2 -> vllm:tp=2,dp=2,ep": 6,
         "hsdp:2,2 -> vllm:tp=2,dp=2": 8, "fsdp:2 -> vllm:tp=1,dp=1": 3}

pytestmark = pytest.mark.timeout(180)


def _has_m2n() -> bool:
    try:
        import_nccl_m2n()
    except NcclM2NUnavailableError:
        return False
    return True


def _gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU_CHECK), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=150)


SERVE_ROW = "fsdp:2 -> vllm:tp=1,dp=1"     # the serve check's round (--serve-trainer, --serve-tp)


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_dry_run_plans_checks_bytes_and_names_what_it_skipped():
    args = [a for s in SCENARIOS for a in ("--scenario", s)]
    proc = _gpu_check("--dry-run", "--vllm-serve", "also", *args)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")]
            for line in out.splitlines() if " -> vllm:" in line and "|" in line}
    assert set(rows) == {s.replace("/", " -> ") for s in SCENARIOS} | {SERVE_ROW} == set(RANKS), out
    for label, row in rows.items():
        assert row[-1] == "ok", f"{label}: {row}"
        assert int(row[1]) == RANKS[label], f"{label}: {row}"
        if label == SERVE_ROW:      # its round is torch_p2p over gloo: no descriptors
            assert row[4] == "skipped", row
            continue
        assert int(row[2]) > 0, f"{label}: no tensor routed to nccl_m2n: {row}"
        assert int(row[5]) > 0, f"{label}: no tensor left to torch_p2p: {row}"
        assert row[4] == (f"{row[2]} checked" if _has_m2n() else "skipped"), row
    # fsdp:2 into tp=2 sends the padded embedding through torch_p2p, and says why.
    assert "fsdp:2 -> vllm:tp=2: torch_p2p because destination: dim 0" in out
    assert "skipped (--dry-run): the GPU run" in out
    assert ("skipped: the nccl.m2n descriptors" in out) == (not _has_m2n()), out
    assert out.rstrip().endswith("dry run: every worker byte matches vLLM's loaders"), out
    # The serve loop, prepared: the checkpoints (v1 differs from v0 in every tensor), the
    # server's environment and command line with the plugin's backend.
    assert "(serve-v0, serve-v1: every tensor differs)" in out, out
    (plan,) = [line for line in out.splitlines() if line.startswith("vllm serve plan: ")]
    env, command = _split_plan(plan)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["M2NKIT_RECEIVE_MODE"] == "in_place", env
    assert command[command.index("serve") + 1].endswith("serve-v0"), command
    flags = dict(zip(command[command.index("serve") + 2::2], command[command.index("serve") + 3::2]))
    assert flags["--weight-transfer-config"] == '{"backend": "m2nkit"}', command
    assert flags["--tensor-parallel-size"] == "1" and flags["--host"] == "127.0.0.1", command
    assert "skipped (--dry-run): vllm serve (start it, generate, pause, m2nkit round fsdp:2 -> " \
           "vllm:tp=1,dp=1 through HTTPVLLMWeightSyncClient" in out, out


def _split_plan(line: str) -> tuple[dict, list[str]]:
    """``vllm serve plan: K=V ... CMD`` -> ({K: V}, argv) (shell quoting undone)."""
    import shlex

    words = shlex.split(line.removeprefix("vllm serve plan: "))
    env = {}
    while words and "=" in words[0] and not words[0].startswith(("/", "-")):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return env, words


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_gpu_run_is_refused_without_cuda_with_a_reason():
    proc = _gpu_check("--scenario", SCENARIOS[0])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    reason = ("no CUDA device here: only --dry-run can run" if _has_m2n()
              else "gpu_check: the nccl_m2n transport needs nccl.m2n")
    assert reason in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_options_are_checked_before_any_work():
    proc = _gpu_check("--dry-run", "--vllm-serve", "only", "--serve-trainer", "fsdp:x")
    assert proc.returncode == 2 and "trainer spec" in proc.stderr, proc.stderr
    proc = _gpu_check("--dry-run", "--vllm-serve", "only", "--serve-tp", "0")
    assert proc.returncode == 2 and "--serve-tp must be > 0" in proc.stderr, proc.stderr


_PARSE_WITH_VLLM = r"""
import json, runpy, sys
from pathlib import Path
gpu_check = runpy.run_path(sys.argv[1])
command = gpu_check["serve_command"](Path(sys.argv[2]), 8123, 2, ["--enforce-eager"])
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
args = parser.parse_args(command[command.index("serve"):])
args.model = args.model_tag          # as ServeSubcommand.cmd does
engine = AsyncEngineArgs.from_cli_args(args)
print(json.dumps({"model": engine.model, "tp": engine.tensor_parallel_size,
                  "backend": engine.weight_transfer_config.backend,
                  "served": engine.served_model_name, "eager": engine.enforce_eager,
                  "port": args.port, "host": args.host,
                  "gpu_memory_utilization": engine.gpu_memory_utilization}))
"""


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_serve_command_line_is_what_vllm_serve_parses(tmp_path):
    """vLLM 0.33's own ``vllm serve`` parser reads the command gpu_check would start
    (the model directory must exist: vLLM takes anything else for a Hub repo id)."""
    import json
    import os

    model = tmp_path / "v0"
    model.mkdir()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-c", _PARSE_WITH_VLLM, str(GPU_CHECK), str(model)],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"model": str(model), "tp": 2, "backend": "m2nkit",
                   "served": ["m2nkit-gpu-check"], "eager": True, "port": 8123,
                   "host": "127.0.0.1", "gpu_memory_utilization": 0.25}


def _gpu_check_module() -> dict:
    import runpy

    return runpy.run_path(str(GPU_CHECK), run_name="gpu_check")   # stdlib and m2nkit.engine.tools.procs only


@pytest.fixture
def without_requests(monkeypatch):
    """``import requests`` fails, as after ``scripts/setup.sh --core`` (vLLM brings
    ``requests``; m2nkit[dev,nccl] does not): the serve helpers use the standard library."""
    monkeypatch.setitem(sys.modules, "requests", None)


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
def test_the_server_process_group_is_stopped_when_it_never_becomes_ready(tmp_path,
                                                                        without_requests):
    """What the serve check does with a server that hangs: a named timeout, then the whole
    process group it started (the server and its children) is gone."""
    import os
    import signal

    g = _gpu_check_module()
    # A "server" that never answers /health and has a child of its own, as vllm serve does.
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              "print('child', c.pid, flush=True); time.sleep(120)")
    server = g["_Server"]([sys.executable, "-c", script], dict(os.environ), tmp_path / "log",
                          free_port())
    try:
        with pytest.raises(g["ServeFailed"], match=r"vllm serve was not ready within 3 s; its "
                                                   r"log ends:\nchild \d+"):
            server.wait_ready(3.0)
    finally:
        server.stop()
    assert server.proc.returncode == -signal.SIGTERM
    child = int((tmp_path / "log").read_text().split()[1])
    with pytest.raises(ProcessLookupError):     # the server's own child went with its group
        for _ in range(100):                    # (reaped by init within moments)
            os.kill(child, 0)
            time.sleep(0.1)


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path, without_requests):
    import os

    g = _gpu_check_module()
    server = g["_Server"]([sys.executable, "-c", "print('no such model: /x'); raise SystemExit(3)"],
                          dict(os.environ), tmp_path / "log", free_port())
    try:
        with pytest.raises(g["ServeFailed"], match=r"vllm serve exited with code 3 before it was "
                                                   r"ready; its log ends:\nno such model: /x"):
            server.wait_ready(60.0)
    finally:
        server.stop()


# --------------------------------------------------------------------------
# the colocated case (--colocated): its CPU parts


def test_the_colocated_case_is_planned_in_a_dry_run(capsys):
    g = _gpu_check_module()
    assert g["main"](["--dry-run", "--colocated", "only"]) == 0
    out = capsys.readouterr().out
    # the round it sends, byte-checked in this process (replicated:1 -> tp=1), and no scenario
    rows = [line for line in out.splitlines() if " -> vllm:" in line and "|" in line]
    assert [r.split("|")[0].strip() for r in rows] == ["replicated:1 -> vllm:tp=1,dp=1"], out
    assert rows[0].split("|")[-1].strip() == "ok", rows
    (plan,) = [line for line in out.splitlines() if line.startswith("colocated plan: ")]
    env, command = _split_plan(plan.replace("colocated plan: ", "vllm serve plan: "))
    assert env["VLLM_SERVER_DEV_MODE"] == "1", env      # the sleep and weight-transfer routes
    assert "--enable-sleep-mode" in command, command
    flags = dict(zip(command[command.index("serve") + 2::2], command[command.index("serve") + 3::2]))
    assert flags["--weight-transfer-config"] == '{"backend": "m2nkit"}', command
    assert flags["--tensor-parallel-size"] == "1", command
    # the loop's steps, in the order colocated RL stacks take them
    steps = [line.split(":", 2)[1].strip() for line in out.splitlines()
             if line.startswith("  colocated step ")]
    assert steps == ["generate", "sleep", "train", "wake weights", "update", "wake kv_cache",
                     "generate", "fresh load"], out
    assert "skipped (--dry-run): colocated" in out, out
    # the command to run it names --colocated's value (a bare --colocated is an argparse error)
    assert "run with --colocated only on a GPU machine" in out, out
    assert "skipped (--dry-run): the GPU run" not in out, out     # --colocated only: no scenarios


def test_colocated_options_are_checked_and_the_gpu_run_is_refused_without_cuda(capsys):
    g = _gpu_check_module()
    with pytest.raises(SystemExit) as e:
        g["main"](["--colocated", "sometimes"])
    assert e.value.code == 2 and "--colocated: invalid choice" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert g["main"](["--colocated", "only"]) == 2
        assert "no CUDA device here: only --dry-run can run" in capsys.readouterr().err


def test_the_colocated_trainer_sends_its_own_trained_tensors(tmp_path):
    """On CPU: one train step changes every parameter, and the source the trainer sends
    from yields the model's own storage (nothing copied), holding what it saved."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    g = _gpu_check_module()
    v0 = save_tiny_checkpoint(tiny_config(g["SERVE_BASE_MODEL"], **g["SERVE_SIZES"]),
                              tmp_path / "v0", seed=0)
    model = AutoModelForCausalLM.from_pretrained(v0, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = g["colocated_train_step"](model)
    assert loss > 0
    same = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert same == [], f"one step left {same[:3]} unchanged"
    model.save_pretrained(tmp_path / "trained")
    saved = load_file(str(tmp_path / "trained" / "model.safetensors"))
    params = dict(model.named_parameters())
    got = list(g["colocated_source"](model, tmp_path / "trained").iter_local())
    assert sorted(n for n, _ in got) == sorted(saved), sorted(set(saved) ^ {n for n, _ in got})
    for name, t in got:
        assert t.untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr(), name
        assert torch.equal(t.view(torch.uint8), saved[name].view(torch.uint8)), name


class _StubVLLM:
    """An HTTP stand-in for ``vllm serve --enable-sleep-mode`` with m2nkit's backend: the
    routes the colocated loop calls, in order, and weights that a level-2 sleep loses, an
    update (``POST /stub_update``, from the stub trainer) or a reload restores."""

    def __init__(self):
        import http.server
        import json
        import threading
        import urllib.parse

        self.calls, self.weights, self.version, self.asleep = [], "v0", None, False
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stub.calls.append(f"GET {self.path}")
                path = urllib.parse.urlparse(self.path).path
                self._answer({"is_sleeping": stub.asleep} if path == "/is_sleeping"
                             else {"weight_version": stub.version})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                stub.calls.append(f"POST {self.path}")
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query)
                w = stub.weights
                if url.path == "/v1/completions":
                    ids = [hash((w, i)) % 512 for i in range(body["max_tokens"])]
                    self._answer({"choices": [{"text": f"text of {w}", "token_ids": ids,
                                               "weight_versions": [stub.version]}]})
                    return
                if url.path == "/weight_checker":
                    self._answer({"checksums": {f"tp0:p{i}": f"{w}-{i}" for i in range(3)}})
                    return
                if url.path == "/sleep":
                    stub.asleep, stub.weights = True, "lost"       # level 2: nothing kept
                elif url.path == "/wake_up" and query.get("tags") == ["kv_cache"]:
                    stub.asleep = False
                    self._answer({"status": "awake"})
                    return
                elif url.path == "/wake_up":
                    self._answer({"status": "sleeping"})
                    return
                elif url.path == "/stub_update":
                    stub.weights, stub.version = "v1", "v1"
                elif url.path == "/collective_rpc":
                    stub.weights = "v1"                              # vLLM's own reload
                self._answer({})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _stub_trainer(v0, saved, base, port, timeout_s, results, woken, update=True):
    """The colocated trainer's protocol without a GPU: trained, (woken) round, done."""
    import urllib.request

    results.put(("trained", 0, 2.5, None))
    if not woken.wait(timeout_s):
        results.put(("error", 0, "TimeoutError: never woken", ""))
        return
    if update:
        urllib.request.urlopen(urllib.request.Request(f"{base}/stub_update", data=b"{}",
                                                      method="POST"), timeout=10).read()
    results.put(("round", 0, 1, (4096, 0.01)))
    results.put(("done", 0, None, None))


def _stub_trainer_without_update(*args):
    _stub_trainer(*args, update=False)


@pytest.mark.parametrize("update", [True, False], ids=["updates", "never-resyncs"])
def test_the_colocated_loop_takes_its_steps_in_order_and_catches_weights_not_resynced(update):
    """The loop against a stand-in server: its HTTP calls in COLOCATED_STEPS' order, and a
    trainer whose round never reaches the woken weights (TRL#5312) fails every check."""
    import multiprocessing as mp

    g = _gpu_check_module()
    stub = _StubVLLM()
    try:
        bad = g["colocated_loop"](stub.base, {"v0": "/v0", "saved": "/trained"}, 10.0,
                                  time.monotonic() + 60, log=lambda *a: None,
                                  trainer_main=_stub_trainer if update
                                  else _stub_trainer_without_update,
                                  ctx=mp.get_context("fork"))
    finally:
        stub.close()
    assert stub.calls == [
        "POST /v1/completions", "POST /weight_checker",                 # generate (v0)
        "POST /sleep?level=2", "GET /is_sleeping",                      # sleep
        "POST /wake_up?tags=weights",                                   # (trained) wake weights
        *(["POST /stub_update"] if update else []),                     # the round
        "POST /wake_up?tags=kv_cache",                                  # wake kv_cache
        "POST /v1/completions", "GET /weight_info", "POST /weight_checker",     # generate
        "POST /pause?mode=wait", "POST /collective_rpc", "POST /resume",        # fresh load
        "POST /weight_checker", "POST /v1/completions"], stub.calls
    if update:
        assert bad == [], bad
    else:       # the woken weights hold what the sleep left: garbage, served as such
        assert len(bad) == 3, bad
        assert bad[0] == "the served weight_version is None, expected 'v1'", bad
        assert bad[1].startswith("3 parameters differ from vLLM's own load of the trainer's "
                                 "weights"), bad
        assert bad[2].startswith("generation after vLLM's own load"), bad
