"""Shared fixtures, and the rule for ``integration`` tests.

``tiny_checkpoints`` builds each tiny model (``m2nkit.adapters.tiny``) at
most once per test session, on first use, with seed 0. Tests that change
files must copy the directory first (``shutil.copytree``): the directories
are shared by every test of the session.

A test marked ``integration`` needs a real framework stack (Megatron-Core,
Megatron-Bridge or vLLM). Where that stack is missing it must fail, not
skip: a green run that skipped the only test of a real integration proves
nothing. So a skip of such a test (``pytest.skip``, ``importorskip`` in the
test or a fixture, a ``skipif`` mark) is reported as a failure here. Import
the stack inside the test or a fixture, not with a module-level
``importorskip``, which would skip the whole module before any test exists.
``pytest -m "not integration"`` leaves these tests out.

Every process of the suite runs torch with one intra-op thread
(``OMP_NUM_THREADS=1``, set here before anything imports torch, and inherited
by every process the tests start) unless the caller set it. The tests move
and compare small tensors; on this 2-core machine with another process busy,
torch's default of one thread per core made each small op wait for a thread
that was not scheduled: the oracle comparisons (test_vllm_oracle.py) took
three times the CPU, a loop of them ten times. Results do not depend on it
(copies and comparisons are exact at any thread count).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:      # imported before this file (by a plugin): its pool is made
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

#: ``max_shard_size`` of the sharded variants: small enough that every tiny
#: model spans several shards and expert sets cross shard boundaries.
SHARDED_MAX_SIZE = "60KB"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """``tiny_checkpoints(name, sharded=False) -> Path`` of a saved tiny checkpoint.

    ``name`` is a key of ``m2nkit.adapters.tiny.BUILTIN_TINY_MODELS``
    (``tiny-llama``, ``tiny-qwen2``, ``tiny-qwen3``, ``tiny-qwen3-tied``,
    ``tiny-qwen3-moe``, ``tiny-mixtral``). ``sharded=False`` gives one
    ``model.safetensors``; ``sharded=True`` gives
    ``model.safetensors.index.json`` plus shards of at most
    :data:`SHARDED_MAX_SIZE`. Both hold the same tensors (seed 0). The
    callable has a ``names`` attribute listing the models.
    """
    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS, save_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[tuple[str, bool], Path] = {}

    def get(name: str, sharded: bool = False) -> Path:
        key = (name, bool(sharded))
        if key not in built:
            out = root / (name + ("-sharded" if sharded else ""))
            save_tiny_checkpoint(name, out, seed=0,
                                 max_shard_size=SHARDED_MAX_SIZE if sharded else None)
            built[key] = out
        return built[key]

    get.names = tuple(BUILTIN_TINY_MODELS)
    return get


@pytest.fixture(autouse=True)
def _fast_tests_run_as_without_vllm(request, monkeypatch):
    """Outside ``integration``, m2nkit sees no vLLM (``adapters.vllm.builder.vllm_importable``
    is false), as on a machine without it: ``m2nkit plan``'s default layout is then the
    tables, and only the integration tests run vLLM's loaders. A fast test that starts
    ``m2nkit plan`` in a process of its own passes ``--layout tables``."""
    if request.node.get_closest_marker("integration") is None:
        from m2nkit.adapters.vllm import builder

        monkeypatch.setattr(builder, "vllm_importable", lambda: False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Report a skipped ``integration`` test as failed (see the module docstring)."""
    report = yield
    if (report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("integration") is not None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reason = str(reason).removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (f"integration test {item.nodeid} was skipped ({reason}); integration "
                           "tests fail instead: install the stack it needs, or leave integration "
                           "tests out with -m 'not integration'")
    return report
