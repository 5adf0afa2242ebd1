"""``m2nkit demo --trainer megatron:...``, end to end, for the four layouts issue 9 names.

Each case is a real CLI run (``python -m m2nkit.engine.tools.cli demo``):
the trainer processes (4; 2 for pp=2,vpp=2, where dp is 1) build GPTModels
with megatron-core, load the checkpoint
through Megatron-Bridge, change every parameter each round and send with
``megatron_source`` through ``M2NTrainerEngine`` (torch_p2p, gloo) into the
stand-in vLLM workers; the demo driver compares every worker bit for bit
with vLLM's loaders on Bridge's own ``export_hf_weights`` of that round's
weights. Each must exit 0 and print, for both rounds, the bit-exact line,
and send exactly the minimum.

The runs are sized to the machine, not to an idle one: one demo is about 7
CPU-bound processes (trainers, workers, driver), so :func:`concurrency` lets
one run per :data:`CORES_PER_DEMO` cores go at a time (one at a time on 2
cores; four at once asked for 28 processes there and starved the workers'
start-up). Each run's deadline starts when that run starts, and the test's
own timeout is the sum over the waves, so a slow machine makes the test
slower, never red.

Layouts: tp=2,pp=2 (tiny Qwen3, tied embeddings over PP); tp=2,ep=2 (tiny
Qwen3-MoE into vllm:tp=2,ep); tp=4 on tiny Llama with 2 KV heads (query
groups < tp: ranks hold arbitrary qkv row ranges); pp=2,vpp=2 (a 4-layer
Qwen3, 4 chunks whose layer numbers interleave).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

#: Seconds one demo run may take from its own start (about a minute on 2 idle cores).
DEADLINE_S = 420.0
#: Cores one demo run keeps busy (its trainers import megatron-core and build at once).
CORES_PER_DEMO = 4
CASES = 4


def concurrency(cores: int | None = None) -> int:
    """How many demo runs go at once on ``cores`` CPUs (this machine's by default): at least 1."""
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    return max(1, min(CASES, cores // CORES_PER_DEMO))


#: Waves of runs, each with its own deadline; plus a minute for the fixture.
TEST_TIMEOUT_S = DEADLINE_S * -(-CASES // concurrency()) + 60


@pytest.fixture(scope="module")
def qwen3_4_layers(tmp_path_factory):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    d = tmp_path_factory.mktemp("megatron-demo") / "tiny-qwen3-4l"
    return str(save_tiny_checkpoint(tiny_config("tiny-qwen3", num_hidden_layers=4), d, seed=5))


def _run_wave(wave, env) -> list[tuple]:
    """Start every demo of ``wave`` at once; ``[(process, output)]``, each given
    :data:`DEADLINE_S` from the wave's start (then its whole session is killed)."""
    procs = []
    t0 = time.monotonic()
    try:
        for model, trainer, inference, _ in wave:
            cmd = [sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--model", model,
                   "--trainer", trainer, "--inference", inference, "--rounds", "2",
                   "--timeout", "120"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env=env, start_new_session=True))
        outs = []
        for p in procs:
            left = max(1.0, DEADLINE_S - (time.monotonic() - t0))
            try:
                outs.append(p.communicate(timeout=left)[0])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)   # past the deadline: the run's whole session
                outs.append(p.communicate()[0] + f"\n[killed after {DEADLINE_S:g} s]")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return list(zip(procs, outs))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_demo_four_layouts_bit_exact(qwen3_4_layers):
    cases = [
        ("tiny-qwen3", "megatron:tp=2,pp=2", "vllm:tp=2", 2),
        ("tiny-qwen3-moe", "megatron:tp=2,ep=2", "vllm:tp=2,ep", 2),
        ("tiny-llama", "megatron:tp=4", "vllm:tp=2", 2),
        (qwen3_4_layers, "megatron:pp=2,vpp=2", "vllm:tp=1", 1),
    ]
    assert len(cases) == CASES
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    n = concurrency()
    t0 = time.monotonic()
    ran = []
    for i in range(0, len(cases), n):
        ran += _run_wave(cases[i:i + n], env)
    print(f"four megatron demos, {n} at a time: {time.monotonic() - t0:.0f} s")
    for (model, trainer, inference, workers), (p, out) in zip(cases, ran):
        assert p.returncode == 0, f"{trainer}: exit {p.returncode}\n{out[-3000:]}"
        assert re.search(r"\d Megatron trainer ranks loaded by Megatron-Bridge \(megatron:"
                         r"[^)]*, megatron_source\)", out), out[-3000:]
        for k in (1, 2):
            line = re.search(rf"round {k}: weights changed, (\d+) bytes .* all {workers} workers? "
                             rf"bit-exact at version v{k} against Bridge's export_hf_weights", out)
            assert line, f"{trainer}: no bit-exact line for round {k}\n{out[-3000:]}"
        assert out.count(", = minimum") == 2, f"{trainer}: not the minimum bytes\n{out[-3000:]}"


@pytest.mark.timeout(DEADLINE_S + 60)
def test_demo_deepseek_v3_mla_bit_exact_and_q_lora_null_refused():
    """MLA through the demo (tiny DeepSeek-V3, tp2 ep2, stand-in core attention on CPU);
    the q_lora_rank null variant, which megatron-core 0.19.2 cannot build here, is refused
    before any trainer starts: exit 2, one line naming the module, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    ((p, out),) = _run_wave([("tiny-deepseek-v3", "megatron:tp=2,ep=2", "vllm:tp=2,ep", 2)], env)
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}"
    for k in (1, 2):
        assert re.search(rf"round {k}: weights changed, (\d+) bytes .* all 2 workers bit-exact "
                         rf"at version v{k} against Bridge's export_hf_weights", out), out[-3000:]
    assert out.count(", = minimum") == 2, out[-3000:]
    bad = subprocess.run([sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--model",
                          "tiny-deepseek-v3-no-q-lora", "--trainer", "megatron:tp=2",
                          "--inference", "vllm:tp=2"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert bad.returncode != 0
    assert "Traceback" not in bad.stdout + bad.stderr
    assert ("MLA with q_lora_rank null: megatron-core 0.19.2 builds linear_q_proj as "
            "TransformerEngine's fused layer-norm linear") in bad.stderr, bad.stderr[-2000:]


@pytest.mark.timeout(DEADLINE_S + 60)
def test_demo_glm47_flash_bit_exact():
    """GLM-4.7-Flash (MLA + MoE, GLM47FlashBridge) through the demo at tp2 ep2 into
    vllm:tp=2,ep: both rounds bit-exact against Bridge's export, the minimum bytes
    (the built-in tiny model: its legacy num_experts follows n_routed_experts, which
    Bridge reads for num_moe_experts)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    ((p, out),) = _run_wave([("tiny-glm4-moe-lite", "megatron:tp=2,ep=2", "vllm:tp=2,ep", 2)],
                            env)
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}"
    assert "model Glm4MoeLiteForCausalLM" in out, out[-3000:]
    for k in (1, 2):
        assert re.search(rf"round {k}: weights changed, (\d+) bytes .* all 2 workers bit-exact "
                         rf"at version v{k} against Bridge's export_hf_weights", out), out[-3000:]
    assert out.count(", = minimum") == 2, out[-3000:]


@pytest.mark.timeout(DEADLINE_S + 60)
def test_colocated_demo_from_megatron_core_trainers_is_bit_exact():
    """``m2nkit demo --colocated --trainer megatron:tp=2,ep=2`` (issue 19): Megatron-Core
    GPTModels loaded by Bridge expose their shards over the ``ipc`` transport (expert and
    tensor parallel, MoE); every worker bit-exact against Bridge's export each round, the
    minimum bytes, rounds labelled ``m2nkit ipc``."""
    cmd = [sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--colocated", "--model",
           "tiny-qwen3-moe", "--trainer", "megatron:tp=2,ep=2", "--inference", "vllm:tp=2,ep",
           "--rounds", "2", "--timeout", "120"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, start_new_session=True)
    try:
        out = p.communicate(timeout=DEADLINE_S)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, out[-3000:]
    for k in (1, 2):
        assert re.search(rf"round {k}: weights changed, \d+ bytes .* all 2 workers bit-exact at "
                         rf"version v{k} against Bridge's export_hf_weights", out), out[-3000:]
    assert out.count(", = minimum") == 2 and out.count("│ m2nkit ipc ") == 2, out[-3000:]
