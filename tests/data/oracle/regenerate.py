#!/usr/bin/env python
"""Regenerate the vLLM oracle fixtures in this folder (needs the oracle venv).

For each built-in tiny model: save the checkpoint (seed 0; config.json +
model.safetensors only), then run vLLM 0.33.0's real loaders through
``shared/tools/vllm_oracle/oracle.py`` for every layout in ``LAYOUTS`` and
keep one safetensors dump per rank. Run with the m2nkit venv:

    /work/venv/bin/python tests/data/oracle/regenerate.py \
        [--oracle-python /tmp/oracle/venv/bin/python] \
        [--oracle /work/shared/tools/vllm_oracle/oracle.py] [--out DIR] [--jobs N]

Layouts are chosen to keep the folder under ~25 MB: tp 1, 2, 8 for dense
models (tp 2 covers one KV head per rank, tp 8 four ranks sharing a KV head;
tp 4 adds no new rule), all of tp 1/2/4/8 and EP 2/4/8 for Qwen3-MoE, and
tp 1/2/8 plus EP 2/4/8 for Mixtral.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent

DENSE = [(1, False), (2, False), (8, False)]
LAYOUTS: dict[str, list[tuple[int, bool]]] = {
    "tiny-llama": DENSE,
    "tiny-qwen2": DENSE,
    "tiny-qwen3": DENSE,
    "tiny-qwen3-tied": DENSE,
    "tiny-qwen3-moe": [(1, False), (2, False), (4, False), (8, False),
                       (2, True), (4, True), (8, True)],
    "tiny-mixtral": [(1, False), (2, False), (8, False), (2, True), (4, True), (8, True)],
}


def layout_dir(tp: int, ep: bool) -> str:
    return f"tp{tp}" + ("_ep" if ep else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--oracle-python", default="/tmp/oracle/venv/bin/python")
    ap.add_argument("--oracle", default="/work/shared/tools/vllm_oracle/oracle.py")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)

    from m2nkit.adapters.tiny import save_tiny_checkpoint

    out = Path(args.out)
    runs = []
    for model, layouts in LAYOUTS.items():
        ckpt = out / model / "checkpoint"
        with tempfile.TemporaryDirectory() as tmp:
            save_tiny_checkpoint(model, tmp, seed=0)
            if ckpt.exists():
                shutil.rmtree(ckpt)
            ckpt.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copy(Path(tmp) / name, ckpt / name)
        for tp, ep in layouts:
            dest = out / model / layout_dir(tp, ep)
            if dest.exists():
                shutil.rmtree(dest)
            cmd = [args.oracle_python, args.oracle, str(ckpt), "--tp", str(tp),
                   *(["--ep"] if ep else []), "--all-ranks",
                   "--out", str(dest / "rank{rank}.safetensors"), "--quiet"]
            runs.append(cmd)

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stdout + r.stderr)
        return r.returncode

    with ThreadPoolExecutor(args.jobs) as pool:
        codes = list(pool.map(run, runs))
    print(f"{len(runs)} oracle runs, {sum(c != 0 for c in codes)} failed")
    return int(any(codes))


if __name__ == "__main__":
    sys.exit(main())
