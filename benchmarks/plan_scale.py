"""How long does planning a real-size model take, and how much memory?

Plans the real public configs shipped in examples/configs (config.json
only: names and shapes come from transformers on the meta device, no weights
exist) for large trainer and inference layouts. Each case runs in its own
process so its peak RSS is its own. Prints a table.

    python benchmarks/plan_scale.py [--models DIR] [--case NAME ...]

``--models DIR`` takes any folder laid out the same way,
``<org>__<name>/config.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: ``<org>__<name>/config.json`` for every model in CASES, shipped with the repo.
DEFAULT_MODELS = HERE.parent / "examples" / "configs"

CASES = {
    "qwen3-30b-a3b fsdp:256 -> tp8 ep": ("Qwen__Qwen3-30B-A3B", "fsdp:256", "vllm:tp=8,ep"),
    "qwen3-235b-a22b fsdp:256 -> tp8 ep": ("Qwen__Qwen3-235B-A22B", "fsdp:256", "vllm:tp=8,ep"),
    "qwen3-235b-a22b hsdp:4,64 -> tp8 dp2 ep": ("Qwen__Qwen3-235B-A22B", "hsdp:4,64", "vllm:tp=8,dp=2,ep"),
    "mixtral-8x7b fsdp:64 -> tp8": ("mistralai__Mixtral-8x7B-v0.1", "fsdp:64", "vllm:tp=8"),
    "llama-3.1-70b fsdp:128 -> tp8 dp2": ("meta-llama__Llama-3.1-70B", "fsdp:128", "vllm:tp=8,dp=2"),
}


def run_case(models: Path, model: str, trainer: str, inference: str) -> dict:
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.engine.plan import build_plan

    t0 = time.perf_counter()
    tspec = parse_trainer_spec(trainer)
    ckpt = read_checkpoint(models / model / "config.json")
    metas = checkpoint_metas(ckpt, tspec)
    t1 = time.perf_counter()
    dest = destination_layout(ckpt.config, metas, parse_inference_spec(inference))
    t2 = time.perf_counter()
    plan = build_plan(metas, tspec.num_ranks, dest)
    t3 = time.perf_counter()
    return {
        "wire": len(metas), "slabs": plan.num_slabs, "moved": plan.nbytes_moved,
        "min": plan.nbytes_min, "problems": len(plan.problems),
        "m2n_share": plan.carried_share("nccl_m2n"),
        "read_s": t1 - t0, "dest_s": t2 - t1, "plan_s": t3 - t2, "total_s": t3 - t0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=DEFAULT_MODELS,
                   help="folder of <org>__<name>/config.json (default: examples/configs)")
    p.add_argument("--case", action="append", choices=sorted(CASES))
    p.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._one:
        print(json.dumps(run_case(args.models, *args._one)))
        return
    if not args.models.is_dir():
        sys.exit(f"plan_scale: no model configs at {args.models}; pass --models DIR "
                 "(a folder of <org>__<name>/config.json)")
    rows = []
    for name in args.case or CASES:
        model, trainer, inference = CASES[name]
        out = subprocess.run(
            [sys.executable, __file__, "--models", str(args.models), "--_one", model, trainer, inference],
            capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
        )
        if out.returncode:
            sys.exit(f"case {name} failed:\n{out.stderr}")
        rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
    head = f"{'case':40} {'wire':>5} {'slabs':>10} {'moved/min':>9} {'m2n':>6} {'read s':>7} {'dest s':>7} {'plan s':>7} {'total s':>8} {'peak RSS':>10}"
    print(head)
    print("-" * len(head))
    for name, r in rows:
        print(f"{name:40} {r['wire']:>5} {r['slabs']:>10,} {r['moved'] / r['min']:>9.3f} "
              f"{r['m2n_share']:>6.1%} {r['read_s']:>7.2f} {r['dest_s']:>7.2f} {r['plan_s']:>7.2f} "
              f"{r['total_s']:>8.2f} {r['peak_rss_mib']:>7.0f} MiB")


if __name__ == "__main__":
    main()
