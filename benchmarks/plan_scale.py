"""How long does ``m2nkit plan`` take on a real-size model, and how much memory?

Runs the real command, ``m2nkit plan <config.json> --trainer T --inference I``,
once per case (and ``--repeat`` times), each in its own process, on the public
configs shipped in examples/configs (config.json only: no weights exist, the
wire tensors come from the family tables). For each run it records the wall
time of the whole command (interpreter start to exit, imports included), its
peak RSS and CPU time (``wait4`` rusage of the child: what ``/usr/bin/time -v``
reports), and the breakdown the command prints in its "planning time" row:
imports (torch and m2nkit), read (config.json, wire tensors, trainer layout),
vLLM layout, plan (intersection, replica choice, nccl.m2n verdicts, coverage
proof); "rest" is everything else (interpreter start, printing, exit). The
load average before and after each case goes with it: the machine is shared,
and wall time follows the load. Prints a table; ``--json PATH`` writes it all.

    python benchmarks/plan_scale.py [--case NAME ...] [--repeat N] [--json PATH]
                                    [--models DIR]

``--models DIR`` takes any folder laid out the same way,
``<org>__<name>/config.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: ``<org>__<name>/config.json`` for every model in CASES, shipped with the repo.
DEFAULT_MODELS = HERE.parent / "examples" / "configs"

CASES = {
    "kimi-k2 fsdp:256 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "fsdp:256", "vllm:tp=8,dp=8,ep"),
    "deepseek-v3 fsdp:256 -> tp8 dp8 ep": ("deepseek-ai__DeepSeek-V3", "fsdp:256", "vllm:tp=8,dp=8,ep"),
    "qwen3-235b-a22b fsdp:256 -> tp8 ep": ("Qwen__Qwen3-235B-A22B", "fsdp:256", "vllm:tp=8,ep"),
    "qwen3-235b-a22b hsdp:4,64 -> tp8 dp2 ep": ("Qwen__Qwen3-235B-A22B", "hsdp:4,64", "vllm:tp=8,dp=2,ep"),
    "qwen3-30b-a3b fsdp:256 -> tp8 ep": ("Qwen__Qwen3-30B-A3B", "fsdp:256", "vllm:tp=8,ep"),
    "mixtral-8x7b fsdp:64 -> tp8": ("mistralai__Mixtral-8x7B-v0.1", "fsdp:64", "vllm:tp=8"),
    "llama-3.1-70b fsdp:128 -> tp8 dp2": ("meta-llama__Llama-3.1-70B", "fsdp:128", "vllm:tp=8,dp=2"),
}

#: Phases of the command's "planning time" row, in order.
PHASES = ("imports", "read", "vLLM layout", "plan")


def _command(config: Path, trainer: str, inference: str) -> list[str]:
    """``m2nkit plan ...`` with the console script next to this interpreter, else ``-m``."""
    script = Path(sys.executable).parent / "m2nkit"
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "m2nkit.engine.tools.cli"]
    return head + ["plan", str(config), "--trainer", trainer, "--inference", inference]


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) / (1000 if unit == "ms" else 1)


def _row(out: str, label: str) -> str:
    """The value column of summary row ``label`` (rich box table, one line per row)."""
    m = re.search(rf"│ {re.escape(label)}\s*│ (.*?)\s*│", out)
    if m is None:
        raise RuntimeError(f"no '{label}' row in the output of m2nkit plan:\n{out[-2000:]}")
    return m.group(1)


def run_once(cmd: list[str]) -> dict:
    """Run ``cmd`` once: wall time, the child's rusage, and the parsed summary."""
    env = {**os.environ, "COLUMNS": "250"}        # one line per table row
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # rusage of this child alone
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{errors}")
    phases = {}
    for item in _row(text, "planning time").split(", "):
        name, value, unit = item.rsplit(" ", 2)
        phases[name] = _seconds(f"{value} {unit}")
    ratio = re.search(r"ratio ([0-9.]+)", _row(text, "bytes moved / minimum"))
    return {
        "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "phases_s": {k: phases.get(k, 0.0) for k in PHASES},
        "rest_s": wall - sum(phases.get(k, 0.0) for k in PHASES),
        "wire": int(_row(text, "wire tensors").split()[0]),
        "slabs": int(_row(text, "slabs").replace(",", "")),
        "moved_over_min": float(ratio.group(1)) if ratio else None,
        "m2n": _row(text, "nccl_m2n expressible"),
        "problems": _row(text, "problems"),
        "load_before": load, "load_after": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=DEFAULT_MODELS,
                   help="folder of <org>__<name>/config.json (default: examples/configs)")
    p.add_argument("--case", action="append", choices=sorted(CASES),
                   help="run only this case (repeatable; default: all)")
    p.add_argument("--repeat", type=int, default=1, help="runs per case; the table shows the "
                   "median wall time and the run that had it (default 1)")
    p.add_argument("--json", type=Path, help="also write every run as JSON here")
    args = p.parse_args()
    if not args.models.is_dir():
        sys.exit(f"plan_scale: no model configs at {args.models}; pass --models DIR "
                 "(a folder of <org>__<name>/config.json)")
    if args.repeat < 1:
        sys.exit(f"plan_scale: --repeat must be >= 1, got {args.repeat}")
    results = []
    for name in args.case or CASES:
        model, trainer, inference = CASES[name]
        cmd = _command(args.models / model / "config.json", trainer, inference)
        runs = [run_once(cmd) for _ in range(args.repeat)]
        median = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
        results.append({"case": name, "command": " ".join(["m2nkit"] + cmd[-6:]), "runs": runs,
                        "median": median,
                        "wall_s_all": [round(r["wall_s"], 2) for r in runs]})
    head = (f"{'case':40} {'wire':>5} {'slabs':>11} {'m2n':>6} {'imports':>8} {'read':>6} "
            f"{'layout':>7} {'plan':>6} {'rest':>6} {'wall s':>7} {'cpu s':>6} {'peak RSS':>9} "
            f"{'load':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        m = r["median"]
        ph = m["phases_s"]
        print(f"{r['case']:40} {m['wire']:>5} {m['slabs']:>11,} {m['m2n'].split()[0]:>6} "
              f"{ph['imports']:>8.2f} "
              f"{ph['read']:>6.2f} {ph['vLLM layout']:>7.2f} {ph['plan']:>6.2f} {m['rest_s']:>6.2f} "
              f"{m['wall_s']:>7.2f} {m['cpu_s']:>6.2f} {m['peak_rss_mib']:>5.0f} MiB "
              f"{m['load_before']:>4.1f}->{m['load_after']:<4.1f}")
    if args.repeat > 1:
        for r in results:
            print(f"  {r['case']}: wall s of the {args.repeat} runs {r['wall_s_all']}")
    print("m2n: share of the bytes one nccl.m2n reshard per tensor carries (torch_p2p the rest)\n"
          "wall: the whole command, interpreter start to exit; imports, read, layout, plan: the\n"
          "  command's own 'planning time' row; rest: start, printing, exit\n"
          "cpu: user+system seconds of the command; peak RSS: its ru_maxrss\n"
          "load: 1-minute load average before -> after the case")
    bad = [r["case"] for r in results
           if r["median"]["moved_over_min"] != 1.0 or r["median"]["problems"] != "none"]
    if bad:  # every plan moves exactly the bytes the workers hold
        print(f"plans with problems or moving more than the minimum: {bad}")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "results": results}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
