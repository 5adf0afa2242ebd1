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

For each case it also plans twice more in this process (after all the timed
runs) and measures the send balance and that the two digests agree: the busiest link (the most bytes one trainer
rank sends), ``mean`` = bytes moved / the trainer ranks that hold data, and
``bound`` = the per-replica-group lower bound, computed from the layouts
alone (not from the planner's choice): the bytes that the ranks of one holder
set (the ranks holding one box, e.g. the replicas of one HSDP shard) alone
hold must leave from those ranks, so one of them sends at least that share;
``bound`` is the largest such share over all holder sets (and never below
``mean``). No plan can send less from its busiest rank than ``bound``; a
split that does not divide evenly (``torch.chunk`` over 256 shards) puts it
above ``mean``, for any sender choice (``fsdp:256`` has no choice at all).
``--no-balance`` skips it.

    python benchmarks/plan_scale.py [--case NAME ...] [--match TEXT] [--repeat N]
                                    [--json PATH] [--models DIR] [--no-balance]

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
    # HSDP and FSDP2 with dp_replicate: which replica sends each slab is the planner's choice.
    "kimi-k2 hsdp:2,128 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "hsdp:2,128", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 hsdp:8,256 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "hsdp:8,256", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 hsdp:16,128 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "hsdp:16,128", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 hsdp:2,1024 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "hsdp:2,1024", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 hsdp:64,32 -> tp8 dp8 ep": ("moonshotai__Kimi-K2-Instruct", "hsdp:64,32", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 fsdp2:dp_replicate=8,dp_shard=256 -> tp8 dp8 ep": (
        "moonshotai__Kimi-K2-Instruct", "fsdp2:dp_replicate=8,dp_shard=256", "vllm:tp=8,dp=8,ep"),
    "kimi-k2 fsdp2:dp_replicate=4,dp_shard=512 -> tp8 dp8 ep": (
        "moonshotai__Kimi-K2-Instruct", "fsdp2:dp_replicate=4,dp_shard=512", "vllm:tp=8,dp=8,ep"),
}

#: Phases of the command's "planning time" row, in order.
PHASES = ("imports", "read", "vLLM layout", "plan")


def _command(config: Path, trainer: str, inference: str) -> list[str]:
    """``m2nkit plan ... --layout tables`` with the console script next to this interpreter,
    else ``-m`` (the tables: the layout traced from vLLM's loaders, the default where vLLM
    is importable, is ``benchmarks/trace.py``'s and ``plan_configs.py``'s)."""
    script = Path(sys.executable).parent / "m2nkit"
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "m2nkit.engine.tools.cli"]
    return head + ["plan", str(config), "--trainer", trainer, "--inference", inference,
                   "--layout", "tables"]


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


def balance(config: Path, trainer: str, inference: str) -> dict:
    """Plan in this process; the busiest link against ``mean`` and ``bound``.

    ``bound`` comes from the layouts alone: per wire tensor, each binding's
    box (what a worker needs) is intersected with each piece's box, and the
    bytes of elements held by exactly the ranks ``H`` are added to ``H``.
    Every byte of ``H``'s leaves from a rank of ``H``, so one of them sends
    at least ``bytes(subsets of H) / |H|``.
    """
    import numpy as np

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.engine.plan import build_plan

    tspec = parse_trainer_spec(trainer)
    ckpt = read_checkpoint(config)
    metas = checkpoint_metas(ckpt, tspec)
    dest = destination_layout(ckpt.config, metas, parse_inference_spec(inference))
    t0 = time.perf_counter()
    plan = build_plan(metas, tspec.num_ranks, dest)
    again = build_plan(metas, tspec.num_ranks, dest).digest()
    plan_s = time.perf_counter() - t0
    held: dict[frozenset, int] = {}
    holding: set[int] = set()
    for meta in metas:
        bindings = dest.bindings.get(meta.name, ())
        if meta.name in dest.skipped or not bindings:
            continue
        pieces = meta.source_pieces(tspec.num_ranks)
        boxes: dict[tuple, set[int]] = {}   # box -> the ranks holding exactly it
        for p in pieces:
            boxes.setdefault(p.box, set()).add(p.rank)
        if len(boxes) * len(bindings) == 0:
            continue
        # vectorised box overlaps: [boxes, bindings] volume of each intersection
        pb = np.array(list(boxes), dtype=np.int64).reshape(len(boxes), len(meta.shape), 2)
        bb = np.array([b.box for b in bindings], dtype=np.int64).reshape(
            len(bindings), len(meta.shape), 2)
        lo = np.maximum(pb[:, None, :, 0], bb[None, :, :, 0])
        hi = np.minimum(pb[:, None, :, 1], bb[None, :, :, 1])
        vol = np.clip(hi - lo, 0, None).prod(axis=2).sum(axis=1) * meta.dtype.itemsize
        for ranks, v in zip(boxes.values(), vol.tolist()):
            if v:
                key = frozenset(ranks)
                held[key] = held.get(key, 0) + v
                holding |= ranks
    # Pieces of different boxes may overlap (not under fsdp/hsdp): then the
    # bytes of their common elements were counted for both, and the bound
    # would not be one. Check it against the plan's own total.
    sets = list(held)
    total = plan.nbytes_moved
    counted = sum(held.values())
    mean = total / len(holding) if holding else 0.0
    bound = max([mean] + [sum(held[t] for t in sets if t <= h) / len(h) for h in sets])
    busiest = int(plan.send_bytes.max(initial=0))
    return {"busiest_send_bytes": busiest, "mean_send_bytes": mean, "bound_send_bytes": bound,
            "busiest_over_bound": busiest / bound if bound else None,
            "busiest_over_mean": busiest / mean if mean else None,
            "bound_is_exact": counted == total, "holder_sets": len(sets),
            "ranks_holding": len(holding), "deterministic": again == plan.digest(),
            "moved_is_min": plan.nbytes_moved == plan.nbytes_min,
            "problems": len(plan.problems), "digest": plan.digest(),
            "two_plans_in_process_s": plan_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=DEFAULT_MODELS,
                   help="folder of <org>__<name>/config.json (default: examples/configs)")
    p.add_argument("--case", action="append", choices=sorted(CASES),
                   help="run only this case (repeatable; default: all)")
    p.add_argument("--repeat", type=int, default=1, help="runs per case; the table shows the "
                   "median wall time and the run that had it (default 1)")
    p.add_argument("--match", help="run only the cases whose name contains this text")
    p.add_argument("--json", type=Path, help="also write every run as JSON here")
    p.add_argument("--no-balance", action="store_true",
                   help="skip the in-process plan that measures the send balance")
    args = p.parse_args()
    if not args.models.is_dir():
        sys.exit(f"plan_scale: no model configs at {args.models}; pass --models DIR "
                 "(a folder of <org>__<name>/config.json)")
    if args.repeat < 1:
        sys.exit(f"plan_scale: --repeat must be >= 1, got {args.repeat}")
    results = []
    names = [n for n in (args.case or CASES) if args.match is None or args.match in n]
    if not names:
        sys.exit(f"plan_scale: no case matches {args.match!r}")
    for name in names:
        model, trainer, inference = CASES[name]
        config = args.models / model / "config.json"
        cmd = _command(config, trainer, inference)
        runs = [run_once(cmd) for _ in range(args.repeat)]
        median = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
        results.append({"case": name, "command": " ".join(["m2nkit"] + cmd[-8:]), "runs": runs,
                        "median": median,
                        "wall_s_all": [round(r["wall_s"], 2) for r in runs],
                        "balance": None, "_args": (config, trainer, inference)})
    # After every timed run: a child's ru_maxrss starts from this process's
    # size at fork (Linux keeps the high-water mark across exec).
    for r in results:
        args3 = r.pop("_args")
        if not args.no_balance:
            r["balance"] = balance(*args3)
    head = (f"{'case':56} {'wire':>5} {'slabs':>11} {'m2n':>6} {'imports':>8} {'read':>6} "
            f"{'layout':>7} {'plan':>6} {'rest':>6} {'wall s':>7} {'cpu s':>6} {'peak RSS':>9} "
            f"{'load':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        m = r["median"]
        ph = m["phases_s"]
        print(f"{r['case']:56} {m['wire']:>5} {m['slabs']:>11,} {m['m2n'].split()[0]:>6} "
              f"{ph['imports']:>8.2f} "
              f"{ph['read']:>6.2f} {ph['vLLM layout']:>7.2f} {ph['plan']:>6.2f} {m['rest_s']:>6.2f} "
              f"{m['wall_s']:>7.2f} {m['cpu_s']:>6.2f} {m['peak_rss_mib']:>5.0f} MiB "
              f"{m['load_before']:>4.1f}->{m['load_after']:<4.1f}")
    if args.repeat > 1:
        for r in results:
            print(f"  {r['case']}: wall s of the {args.repeat} runs {r['wall_s_all']}")
    if not args.no_balance:
        head = (f"\n{'case':56} {'busiest send':>13} {'mean':>11} {'bound':>11} "
                f"{'/bound':>7} {'/mean':>6} {'sets':>5} {'same digest':>11}")
        print(head)
        print("-" * len(head.strip()))
        mib = 2 ** 20
        for r in results:
            b = r["balance"]
            print(f"{r['case']:56} {b['busiest_send_bytes'] / mib:>9.1f} MiB "
                  f"{b['mean_send_bytes'] / mib:>7.1f} MiB {b['bound_send_bytes'] / mib:>7.1f} MiB "
                  f"{b['busiest_over_bound']:>7.4f} {b['busiest_over_mean']:>6.3f} "
                  f"{b['holder_sets']:>5} {'yes' if b['deterministic'] else 'NO':>11}")
    print("m2n: share of the bytes one nccl.m2n reshard per tensor carries (torch_p2p the rest)\n"
          "wall: the whole command, interpreter start to exit; imports, read, layout, plan: the\n"
          "  command's own 'planning time' row; rest: start, printing, exit\n"
          "cpu: user+system seconds of the command; peak RSS: its ru_maxrss\n"
          "load: 1-minute load average before -> after the case")
    if not args.no_balance:
        print("busiest send: the most bytes one trainer rank sends; mean: bytes moved / ranks\n"
              "  holding data; bound: the per-replica-group lower bound (no plan does better);\n"
              "  sets: holder sets (ranks holding one box); same digest: two plans in one\n"
              "  process have one digest")
    bad = [r["case"] for r in results
           if r["median"]["moved_over_min"] != 1.0 or r["median"]["problems"] != "none"
           or (r["balance"] and (not r["balance"]["moved_is_min"] or r["balance"]["problems"]
                                 or not r["balance"]["deterministic"]
                                 or not r["balance"]["bound_is_exact"]))]
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
