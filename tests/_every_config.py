"""``m2nkit plan`` on every published config of ``examples/configs``, at the layout of
``examples/configs/layouts.json`` (issue 16: "succeeds on every config in
``../shared/models`` at realistic layouts, traced and from tables, with bytes moved
equal to the minimum"). For ``tests/engine/tools/test_every_config.py`` (tables) and
``tests/integration/test_every_config_traced.py`` (traced); ``benchmarks/plan_configs.py``
times the same runs as separate processes.

The minimum is not taken from the planner: :func:`element_bytes` counts it off the
layout the command built (every element of every vLLM parameter of every worker, in
the dtype of the wire tensor feeding it, less the padding its loader leaves zero), and
the bindings must write exactly that many bytes, once each.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

from _paths import CONFIGS

#: folder -> [trainer spec, inference spec]
LAYOUTS: dict[str, list[str]] = json.loads((CONFIGS / "layouts.json").read_text())["layouts"]
#: every folder of examples/configs holding a config.json
FOLDERS = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())
#: published with an int4 compressed-tensors quantization_config (text_config): refused;
#: its bf16 form is planned instead (issue 16, section 2)
INT4 = "moonshotai__Kimi-K2.5"


def bf16_form(folder: str, out_dir: Path) -> Path:
    """``folder``'s config.json without ``text_config.quantization_config``, in ``out_dir``."""
    doc = json.loads((CONFIGS / folder / "config.json").read_text())
    doc["text_config"].pop("quantization_config")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(doc))
    return out_dir / "config.json"


def plan_in_process(config: Path, folder: str, layout: str, capsys):
    """``m2nkit plan CONFIG --trainer T --inference S --layout LAYOUT`` in this process.

    Returns ``(exit code, stdout, stderr, vLLM layout, plan, metas)``: the layout and the
    plan are the very objects the command built (the functions it calls, wrapped), or
    ``None`` where it stopped before them.
    """
    from m2nkit.adapters import hf_checkpoint, vllm
    from m2nkit.adapters.vllm import trace
    from m2nkit.engine import plan as plan_module
    from m2nkit.engine.tools.cli import main

    seen: dict = {}

    def keep(key, fn):
        def run(*a, **k):
            seen[key] = fn(*a, **k)
            return seen[key]
        return run

    trainer, inference = LAYOUTS[folder]
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(
            vllm, "destination_layout", keep("layout", vllm.destination_layout)))
        stack.enter_context(mock.patch.object(
            trace, "trace_destination", keep("layout", trace.trace_destination)))
        stack.enter_context(mock.patch.object(
            plan_module, "build_plan", keep("plan", plan_module.build_plan)))
        stack.enter_context(mock.patch.object(
            hf_checkpoint, "checkpoint_metas", keep("metas", hf_checkpoint.checkpoint_metas)))
        code = main(["plan", str(config), "--trainer", trainer, "--inference", inference,
                     "--layout", layout])
    out = capsys.readouterr()
    return code, out.out, out.err, seen.get("layout"), seen.get("plan"), seen.get("metas")


def element_bytes(layout, metas) -> tuple[int, int]:
    """``(bytes the bindings write, bytes of every parameter element less zero padding)``,
    each element in the dtype of the wire tensor that feeds its parameter."""
    itemsize = {m.name: m.dtype.itemsize for m in metas}
    feeds: dict[tuple[int, str], set[int]] = {}
    bound = 0
    for name, bindings in layout.bindings.items():
        for b in bindings:
            bound += math.prod(hi - lo for lo, hi in b.box) * itemsize[name]
            feeds.setdefault((b.worker, b.param), set()).add(itemsize[name])
    params = 0
    for p in layout.params:
        sizes = feeds.get((p.worker, p.name))
        assert sizes is not None and len(sizes) == 1, (p.worker, p.name, sizes)
        zero = sum(math.prod(hi - lo for lo, hi in z) for z in p.zero_boxes)
        params += (math.prod(p.shape) - zero) * next(iter(sizes))
    return bound, params


def assert_plans_every_element_once(code, out, err, layout, plan, metas, what: str) -> None:
    """The command succeeded, its report says so, and its plan moves the minimum: the
    bytes of every element of every worker's parameters, each written once."""
    assert code == 0, f"{what}: exit {code}: {err[-2000:]}"
    text = " ".join(out.split())
    assert "(ratio 1.000)" in text and not plan.problems, (what, plan.problems[:3])
    bound, params = element_bytes(layout, metas)
    assert bound == params == plan.nbytes_moved == plan.nbytes_min, \
        (what, bound, params, plan.nbytes_moved, plan.nbytes_min)
