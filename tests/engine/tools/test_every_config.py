"""``m2nkit plan`` from the family tables on every published config shipped here.

Issue 16's "config-only plans": every ``config.json`` of ``examples/configs`` (the
configs of ``../shared/models``, byte for byte) plans from m2nkit's tables at the layout
``examples/configs/layouts.json`` gives it, with no problem and exactly the minimum moved,
counted off the layout (``_every_config.element_bytes``), not taken from the planner.
Kimi-K2.5 as published (int4 ``compressed-tensors``) is refused naming what is
supported; its bf16 form plans. The same configs traced from vLLM's loaders:
``tests/integration/test_every_config_traced.py``; timed: ``benchmarks/plan_configs.py``.
"""

from __future__ import annotations

import pytest

from _every_config import (FOLDERS, INT4, LAYOUTS, assert_plans_every_element_once,
                           bf16_form, plan_in_process)
from _paths import CONFIGS, REPO


def test_every_config_has_a_layout_and_is_the_published_file():
    assert set(LAYOUTS) == set(FOLDERS), set(LAYOUTS) ^ set(FOLDERS)
    shared = REPO.parent / "shared" / "models"
    if not shared.is_dir():
        pytest.skip(f"no {shared} to compare with (the configs' SOURCE.txt say where they are from)")
    published = sorted(p.name for p in shared.iterdir() if (p / "config.json").is_file())
    assert published == FOLDERS
    for folder in FOLDERS:
        assert (CONFIGS / folder / "config.json").read_bytes() == \
            (shared / folder / "config.json").read_bytes(), folder


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != INT4])
def test_every_published_config_plans_from_the_tables_moving_the_minimum(folder, capsys):
    code, out, err, layout, plan, metas = plan_in_process(
        CONFIGS / folder / "config.json", folder, "tables", capsys)
    assert "m2nkit's family tables (no vLLM needed) (--layout tables)" in " ".join(out.split())
    assert_plans_every_element_once(code, out, err, layout, plan, metas, folder)


def test_kimi_k25_int4_is_refused_and_its_bf16_form_plans_from_the_tables(tmp_path, capsys):
    code, out, err, *_ = plan_in_process(CONFIGS / INT4 / "config.json", INT4, "tables", capsys)
    assert code == 2 and "Traceback" not in err
    line = err.strip()
    assert len(line.splitlines()) == 1, err
    assert "compressed-tensors" in line and "int4" in line, line
    assert "bf16" in line, line                       # what is supported instead
    result = plan_in_process(bf16_form(INT4, tmp_path / "k25"), INT4, "tables", capsys)
    assert_plans_every_element_once(*result, f"{INT4} (bf16 form)")
