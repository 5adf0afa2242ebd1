"""``m2nkit plan --layout traced`` on every published config shipped here.

The traced half of issue 16's "config-only plans" (the tables' half:
``tests/engine/tools/test_every_config.py``): every ``config.json`` of
``examples/configs`` (``../shared/models``' configs), at the layout of
``examples/configs/layouts.json``, traced from vLLM 0.33.0's own loaders on the meta
device, plans with no problem and moves exactly the minimum, counted off the traced
layout (``_every_config.element_bytes``). Kimi-K2.5's model class needs transformers
5.24+ (``Kimi_K25Config``): it runs as ``m2nkit plan`` under ``.venv-tf``
(``scripts/side_transformers.sh``), its published int4 config refused in one line, its
bf16 form planned. Timed as separate processes: ``benchmarks/plan_configs.py``.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from _every_config import (FOLDERS, INT4, LAYOUTS, assert_plans_every_element_once,
                           bf16_form, plan_in_process)
from _paths import CONFIGS, REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PYTHON_TF = REPO / ".venv-tf" / "bin" / "python"


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != INT4])
def test_every_published_config_traces_and_plans_the_minimum(folder, capsys):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    code, out, err, layout, plan, metas = plan_in_process(
        CONFIGS / folder / "config.json", folder, "traced", capsys)
    assert "traced from vLLM's own weight loaders (--layout traced)" in " ".join(out.split()), \
        out[-2000:] + err[-2000:]
    assert_plans_every_element_once(code, out, err, layout, plan, metas, folder)


def _plan_tf(config) -> subprocess.CompletedProcess:
    if not PYTHON_TF.exists():
        pytest.fail(f"{PYTHON_TF} is missing: vLLM 0.33.0's Kimi-K2.5 needs a transformers "
                    "with Kimi_K25Config (scripts/side_transformers.sh)")
    trainer, inference = LAYOUTS[INT4]
    return subprocess.run([str(PYTHON_TF), "-m", "m2nkit.engine.tools.cli", "plan", str(config),
                           "--trainer", trainer, "--inference", inference, "--layout", "traced"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "COLUMNS": "250"})


def test_kimi_k25_int4_is_refused_and_its_bf16_form_traces_the_minimum(tmp_path):
    refused = _plan_tf(CONFIGS / INT4 / "config.json")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert "int4" in line and "bf16" in line, line
    r = _plan_tf(bf16_form(INT4, tmp_path / "k25"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = " ".join(r.stdout.split())
    assert "traced from vLLM's own weight loaders (--layout traced)" in text
    assert "(ratio 1.000)" in text, text[-2000:]
    assert re.search(r"│ problems\s+│ none", r.stdout), r.stdout[-2000:]
