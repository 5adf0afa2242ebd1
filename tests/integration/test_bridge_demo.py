"""``m2nkit demo --trainer bridge:tp=2,ep=2 --bridge-mode export``, end to end, as a user runs it.

The real CLI (its supervisor, the driver, four Megatron-Bridge trainer
processes on gloo building tiny Qwen3-MoE with ``AutoBridge.from_hf_pretrained``,
two stand-in vLLM workers behind the HTTP routes): exit status 0, both
rounds verified by the driver against ``reference_load`` of Bridge's own
``export_hf_weights`` after the weights changed, and the session's note
naming the wire tensors that went through Bridge's gather.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TIMEOUT_S = 540


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_bridge_demo_tp2_ep2_export_rounds_bit_exact():
    cmd = [sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--trainer",
           "bridge:tp=2,ep=2", "--inference", "vllm:tp=2,ep", "--bridge-mode", "export",
           "--rounds", "2", "--timeout", "90"]
    env = {**os.environ, "COLUMNS": "240"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:   # the supervisor's group is killed with it
        raise AssertionError(f"the demo did not finish in {TIMEOUT_S} s:\n{e.stdout}") from None
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    for k in (1, 2):
        assert (f"round {k}: weights changed" in out and f"all 2 workers bit-exact at version "
                f"v{k} against Bridge's export_hf_weights" in out), out[-4000:]
    assert "bridge:tp=2,pp=1,ep=2,dp=2, bridge_source mode='export'" in out
    assert ("25 wire tensor(s) went through Bridge's gather (mode='export': Bridge's "
            "export_hf_weights gathers every tensor onto every rank)") in out, out[-4000:]
    assert "Traceback" not in out and "nanobind" not in out, out[-4000:]
