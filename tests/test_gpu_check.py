"""``benchmarks/gpu_check.py --dry-run`` works on a machine without a GPU.

It builds each scenario's plan, routes the tensors, executes the plan in
this process and compares every worker byte with vLLM's loaders; where
``nccl.m2n`` imports it also builds the real descriptors. What it cannot do
here (the GPU run, and the descriptors without ``m2nkit[nccl]``) it names as
skipped. The GPU run itself is covered by the CUDA-only test at the bottom of
``tests/test_nccl_m2n.py``, which runs the script without ``--dry-run``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m2nkit.engine.transports.nccl_m2n import NcclM2NUnavailableError, import_nccl_m2n

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
SCENARIOS = ("fsdp:2/vllm:tp=2", "fsdp:2/vllm:tp=2,dp=2,ep")

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


def test_dry_run_plans_checks_bytes_and_names_what_it_skipped():
    args = [a for s in SCENARIOS for a in ("--scenario", s)]
    proc = _gpu_check("--dry-run", *args)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")]
            for line in out.splitlines() if " -> vllm:" in line and "|" in line}
    assert set(rows) == {s.replace("/", " -> ") for s in SCENARIOS}, out
    for label, row in rows.items():
        assert row[-1] == "ok", f"{label}: {row}"
        assert int(row[2]) > 0, f"{label}: no tensor routed to nccl_m2n: {row}"
        assert row[4] == (f"{row[2]} checked" if _has_m2n() else "skipped"), row
    # fsdp:2 into tp=2 sends the padded embedding through torch_p2p, and says why.
    assert "fsdp:2 -> vllm:tp=2: torch_p2p because destination: dim 0" in out
    assert "skipped (--dry-run): the GPU run" in out
    assert ("skipped: the nccl.m2n descriptors" in out) == (not _has_m2n()), out
    assert out.rstrip().endswith("dry run: every worker byte matches vLLM's loaders"), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_gpu_run_is_refused_without_cuda_with_a_reason():
    proc = _gpu_check("--scenario", SCENARIOS[0])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    reason = ("no CUDA device here: only --dry-run can run" if _has_m2n()
              else "gpu_check: the nccl_m2n transport needs nccl.m2n")
    assert reason in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
