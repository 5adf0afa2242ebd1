"""How long the traced vLLM layout takes (``adapters/vllm/trace.py``), with the breakdown.

Question: what does deriving the destination layout from vLLM's own loaders
cost, against the family tables, for a real config? For each case it reads
the config's wire tensors (no weights), then traces every worker: vLLM's
model class built on the meta device (``build``), its ``load_weights`` run on
fake wire tensors (``trace``), the copies turned into bindings (the rest),
and compares with ``destination_layout`` from the tables (``tables``): the
time, and whether the two layouts are the same (parameters, and bindings
after coalescing, as ``tests/integration/test_vllm_trace.py`` compares them).
Wall and CPU seconds of the trace are both given: on a shared machine the
CPU seconds are the fair figure. Needs vLLM installed (``scripts/setup.sh``).

    .venv/bin/python benchmarks/trace.py [--case NAME ...] [--json PATH]

Prints one row per case; ``--json`` writes the same figures. The first case
also pays vLLM's import (reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "examples" / "configs"

#: name -> (config, inference spec)
CASES = {
    "qwen3-30b-a3b tp4 ep": ("Qwen__Qwen3-30B-A3B", "vllm:tp=4,ep"),
    "qwen3-8b tp8": ("Qwen__Qwen3-8B", "vllm:tp=8"),
    "qwen3-235b-a22b tp8 ep": ("Qwen__Qwen3-235B-A22B", "vllm:tp=8,ep"),
    "kimi-k2 tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "vllm:tp=8,dp=8,ep"),
    # architectures without a table (families/tableless.py: wire tensors from
    # transformers' meta model; "tables" is then "-")
    "qwen3.5-27b tp8": ("Qwen__Qwen3.5-27B", "vllm:tp=8"),
    "qwen3.5-397b-a17b tp8 dp4 ep": ("Qwen__Qwen3.5-397B-A17B", "vllm:tp=8,dp=4,ep"),
    "qwen3-next-80b-a3b tp4 ep": ("Qwen__Qwen3-Next-80B-A3B-Instruct", "vllm:tp=4,ep"),
    "qwen3-vl-8b tp4": ("Qwen__Qwen3-VL-8B-Instruct", "vllm:tp=4"),
    "qwen3-vl-30b-a3b tp4 ep": ("Qwen__Qwen3-VL-30B-A3B-Instruct", "vllm:tp=4,ep"),
    "glm-4.7-flash tp4 ep": ("zai-org__GLM-4.7-Flash", "vllm:tp=4,ep"),
    "glm-5 tp8 dp2 ep": ("zai-org__GLM-5", "vllm:tp=8,dp=2,ep"),
    "deepseek-v3.2 tp8 dp2 ep": ("deepseek-ai__DeepSeek-V3.2", "vllm:tp=8,dp=2,ep"),
    "llama-4-scout tp8": ("meta-llama__Llama-4-Scout-17B-16E-Instruct", "vllm:tp=8"),
}


def _run(name: str) -> dict:
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.adapters.vllm import trace

    folder, spec_text = CASES[name]
    path = CONFIGS / folder / "config.json"
    t0 = time.perf_counter()
    ckpt = read_checkpoint(path)
    metas = checkpoint_metas(ckpt, "fsdp:8")
    spec = parse_inference_spec(spec_text)
    t1 = time.perf_counter()
    from m2nkit.adapters.families import has_table

    table = destination_layout(ckpt.config, metas, spec) if has_table(ckpt.architecture) else None
    t2 = time.perf_counter()
    spent = {"build": 0.0, "trace": 0.0}
    build, trace_worker = trace._build_meta_model, trace.trace_worker

    def timed(key, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return run

    trace._build_meta_model = timed("build", build)
    trace.trace_worker = timed("trace", trace_worker)
    c2 = time.process_time()
    try:
        traced = trace.trace_destination(path.parent, metas, spec)
    except Exception as e:      # a loader that does not trace: reported as the row's result
        return {"case": name, "spec": spec_text, "wire_tensors": len(metas),
                "workers": spec.num_workers, "error": f"{type(e).__name__}: {e}"[:200]}
    finally:
        trace._build_meta_model, trace.trace_worker = build, trace_worker
    t3 = time.perf_counter()
    c3 = time.process_time()
    from m2nkit.engine.plan import build_plan

    plan = build_plan(metas, 8, traced)
    return {"case": name, "spec": spec_text, "wire_tensors": len(metas),
            "workers": spec.num_workers, "read_s": t1 - t0, "tables_s": t2 - t1,
            "traced_s": t3 - t2, "traced_cpu_s": c3 - c2,
            "build_s": spent["build"], "trace_s": spent["trace"],
            "equals_tables": None if table is None else _canonical(table) == _canonical(traced),
            "bindings": sum(len(b) for b in traced.bindings.values()),
            "table_bindings": sum(len(b) for b in table.bindings.values()) if table else None,
            "problems": len(plan.problems),
            "bytes_moved_over_min": plan.nbytes_moved / plan.nbytes_min}


def _canonical(layout):
    """A layout as sets: parameters (worker, name, dtype, shape, zero boxes), coalesced bindings."""
    from m2nkit.adapters.vllm.trace import TracedCopy, merge_copies

    params = {(p.worker, p.name, p.dtype, p.shape, tuple(sorted(p.zero_boxes)))
              for p in layout.params}
    copies = [TracedCopy(b.name, f"{b.worker}:{b.param}", b.box,
                         tuple((o, o + hi - lo) for o, (lo, hi) in zip(b.offset, b.box)))
              for bs in layout.bindings.values() for b in bs]
    bindings = {(c.name, c.param, c.box, c.region) for c in merge_copies(copies)}
    return params, bindings, set(layout.skipped), dict(layout.aliases)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="a case to run (repeatable; default: all)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    load_start = os.getloadavg()[0]
    t = time.perf_counter()
    import vllm.config  # noqa: F401 - the import, apart from the cases
    import_s = time.perf_counter() - t
    rows = [_run(name) for name in (args.case or list(CASES))]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"traced vLLM layouts (vLLM import {import_s:.1f} s, load "
                        f"{load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)",
                  title_justify="left")
    for col in ("case", "workers", "wire tensors", "tables", "traced", "traced CPU", "build",
                "trace", "bindings (traced / tables)", "= tables", "plan problems",
                "moved / min"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["case"], str(r["workers"]), str(r["wire_tensors"]), "", r["error"])
            continue
        table.add_row(r["case"], str(r["workers"]), str(r["wire_tensors"]),
                      "-" if r["table_bindings"] is None else f"{r['tables_s']:.2f} s",
                      f"{r['traced_s']:.1f} s", f"{r['traced_cpu_s']:.1f} s",
                      f"{r['build_s']:.1f} s", f"{r['trace_s']:.1f} s",
                      f"{r['bindings']} / {r['table_bindings'] or '-'}",
                      {None: "-", True: "yes", False: "NO"}[r["equals_tables"]], str(r["problems"]),
                      f"{r['bytes_moved_over_min']:.3f}")
    Console(width=160).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm_import_s": import_s,
                                               "load_average_start": load_start,
                                               "load_average": os.getloadavg()[0],
                                               "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
