"""The framework stacks scripts/setup.sh installs: present, at the pinned versions, and runnable on CPU.

These are the ground every other integration test stands on; when one of them
fails the others fail too, and this file says why in one line. Each check
runs in a fresh interpreter, so the process-wide CPU shims
(``m2nkit.adapters.megatron.compat``) never leak into the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import patch_stacks  # noqa: E402  (scripts/ is not a package)

pytestmark = pytest.mark.integration


def _run(code: str, timeout: float = 240) -> dict:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=timeout, cwd=REPO, env={"VLLM_TARGET_DEVICE": "cpu",
                                                                    "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
import json, typing, importlib.metadata as md
import torch
before = hasattr(typing, "override")
from m2nkit.adapters.megatron.compat import enable_cpu
enable_cpu()
from megatron.bridge import AutoBridge
from megatron.bridge.peft import lora_layers as L
from megatron.core.models.gpt import GPTModel
import megatron.core.pipeline_parallel.schedules  # imports the MoE paged-stash kernels
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient
from vllm.model_executor.layers.linear import QKVParallelLinear
t = torch.ones(3)
print(json.dumps({
    "versions": {p: md.version(p) for p in ("torch", "transformers", "vllm", "megatron-core",
                                            "megatron-bridge", "ray")},
    "triton": __import__("importlib.util").util.find_spec("triton") is not None,
    "override_before": before, "device": str(torch.cuda.current_device()), "same": t.cuda() is t,
    "names": [AutoBridge.__name__, GPTModel.__name__, HTTPVLLMWeightSyncClient.__name__,
              RayVLLMWeightSyncClient.__name__, QKVParallelLinear.__name__],
    "register": hasattr(WeightTransferEngineFactory, "register_engine"),
    "te_linear": isinstance(torch.nn.Linear(2, 2), (L.te.Linear, L.te.LayerNormLinear)),
}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    """One fresh interpreter that applies the shims and imports all three stacks."""
    return _run(PROBE)


def test_pinned_versions_are_installed(probe):
    got = probe["versions"]
    assert got["torch"].startswith("2.13.0") and "+cpu" in got["torch"], got
    assert got["transformers"] == "5.12.1", got
    assert got["vllm"] == "0.33.0", got
    assert got["megatron-core"].startswith("0.19.2"), got
    assert got["megatron-bridge"] == "0.6.2", got
    # not installed: torch would import it in every process, and its bindings
    # print leak warnings at exit (m2nkit.adapters.megatron.compat)
    assert probe["triton"] is False


def test_megatron_and_bridge_run_on_cpu_with_the_shims(probe):
    """Without the shims the imports fail (typing.override on 3.11) or
    ``torch.cuda.current_device()`` raises; with them ``.cuda()`` leaves a
    tensor on the CPU, and the framework classes import."""
    assert probe["override_before"] is False
    assert (probe["device"], probe["same"]) == ("cpu", True)
    assert probe["names"] == ["AutoBridge", "GPTModel", "HTTPVLLMWeightSyncClient",
                              "RayVLLMWeightSyncClient", "QKVParallelLinear"]


def test_vllm_has_its_weight_transfer_extension_point(probe):
    assert probe["register"] is True


def test_guarded_bridge_lora_module_matches_no_module(probe):
    assert probe["te_linear"] is False


def test_bridge_lora_import_guard_is_applied_once(tmp_path):
    """scripts/patch_stacks.py: the installed file carries the guard, and on
    the original text it patches once, then recognises its own work."""
    installed = Path(sysconfig.get_paths()["purelib"]) / patch_stacks.TARGET
    text = installed.read_text()
    assert text.count(patch_stacks.MARKER + ": TransformerEngine has no CPU build") == 1
    original = text.replace(patch_stacks.GUARDED, patch_stacks.ORIGINAL)
    assert patch_stacks.MARKER not in original
    copy = tmp_path / "lora_layers.py"
    copy.write_text(original)
    assert patch_stacks.apply(copy) == "patched"
    assert copy.read_text() == text
    assert patch_stacks.apply(copy) == "already"
    assert copy.read_text() == text
    copy.write_text(original.replace(patch_stacks.ORIGINAL, ""))
    with pytest.raises(SystemExit, match="found it 0 times"):
        patch_stacks.apply(copy)
