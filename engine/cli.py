"""``m2nkit`` command line: see the plan before renting a GPU.

``m2nkit plan CHECKPOINT --trainer SPEC --inference SPEC`` reads a
checkpoint's safetensors headers (or just its ``config.json``), lays the
tensors out as the trainer holds them, lays vLLM's storage out as the
workers will, and prints what moves where, what ``nccl.m2n`` cannot carry
and why, and how long it should take. ``--verify`` runs the plan in this
process on the checkpoint's real bytes and checks every worker against an
independent reference of vLLM's loaders.

Built on argparse (standard library) and rich (tables). User errors print
one line, no traceback, and exit 2; a plan with problems or a failed
verification exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _build(args):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import destination_layout, parse_inference_spec
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest.serialize import manifest_digest

    tspec = parse_trainer_spec(args.trainer)
    ispec = parse_inference_spec(args.inference)
    t0 = time.perf_counter()
    ckpt = read_checkpoint(args.checkpoint)
    metas = checkpoint_metas(ckpt, tspec)
    t1 = time.perf_counter()
    dest = destination_layout(ckpt.config, metas, ispec)
    digest = manifest_digest(metas, tspec.num_ranks)
    plan = build_plan(metas, tspec.num_ranks, dest, manifest_digest=digest)
    t2 = time.perf_counter()
    return ckpt, tspec, ispec, metas, plan, (t1 - t0, t2 - t1)


def _print_summary(console, args, ckpt, metas, plan, timings):
    from rich.table import Table

    t = Table(title="m2nkit plan", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    n_skipped = sum(1 for w in plan.wires if w.skipped)
    send, recv = plan.send_bytes, plan.recv_bytes
    mean_send = send.mean() if len(send) else 0
    m2n_ok = sum(1 for w in plan.wires if w.m2n.ok)
    t.add_row("model", f"{ckpt.architecture} ({ckpt.path})")
    t.add_row("trainer", f"{args.trainer}: {plan.num_trainer_ranks} ranks")
    t.add_row("inference", f"{args.inference}: {plan.num_workers} workers")
    t.add_row("wire tensors", f"{len(plan.wires)} ({n_skipped} skipped by vLLM), "
                              f"{_fmt_bytes(sum(m.nbytes for m in metas))}")
    t.add_row("slabs", f"{plan.num_slabs:,}")
    ratio = plan.nbytes_moved / plan.nbytes_min if plan.nbytes_min else 1.0
    t.add_row("bytes moved / minimum",
              f"{_fmt_bytes(plan.nbytes_moved)} / {_fmt_bytes(plan.nbytes_min)} (ratio {ratio:.3f})")
    t.add_row("max send per trainer rank", _fmt_bytes(send.max(initial=0)))
    t.add_row("max receive per worker", _fmt_bytes(recv.max(initial=0)))
    t.add_row("send imbalance (max/mean)", f"{send.max() / mean_send:.3f}" if mean_send else "-")
    t.add_row("fan-in / fan-out (max)", f"{plan.fan_in().max(initial=0)} / {plan.fan_out().max(initial=0)}")
    t.add_row("nccl_m2n expressible", f"{plan.m2n_share():.1%} of bytes, "
                                      f"{m2n_ok} of {len(plan.wires) - n_skipped} tensors")
    t.add_row(f"estimated time @ {args.link_gbps:g} Gbit/s per rank",
              _fmt_seconds(plan.estimated_seconds(args.link_gbps)))
    t.add_row("planning time", f"read {_fmt_seconds(timings[0])}, plan {_fmt_seconds(timings[1])}")
    t.add_row("problems", str(len(plan.problems)) if plan.problems else "none")
    console.print(t)

    reasons = Counter()
    example = {}
    for w in plan.wires:
        if not w.skipped and w.bindings and not w.m2n.ok:
            key = _reason_class(w.m2n.reason)
            reasons[key] += 1
            example.setdefault(key, (w.name, w.m2n.reason))
    if reasons:
        r = Table(title="not carried by nccl_m2n (sent by torch_p2p)", title_justify="left")
        r.add_column("tensors", justify="right")
        r.add_column("reason", overflow="fold")
        r.add_column("example", overflow="fold")
        for key, n in reasons.most_common():
            name, reason = example[key]
            r.add_row(str(n), reason, name)
        console.print(r)


def _reason_class(reason: str) -> str:
    """Group reasons that differ only in numbers."""
    return "".join("#" if c.isdigit() else c for c in reason)


def _print_tensors(console, plan):
    from rich.table import Table

    t = Table(title="wire tensors", title_justify="left")
    for col in ("name", "dtype", "shape", "bytes moved", "slabs", "nccl_m2n"):
        t.add_column(col, overflow="fold")
    for w in plan.wires:
        m2n = "skipped: " + w.skipped if w.skipped else ("yes" if w.m2n.ok else "no: " + w.m2n.reason)
        t.add_row(w.name, str(w.meta.dtype).removeprefix("torch."), str(list(w.meta.shape)),
                  _fmt_bytes(w.nbytes_moved), str(len(w.table)), m2n)
    console.print(t)


def _verify(console, ckpt, tspec, ispec, plan) -> bool:
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, full_checkpoint_tensors
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.local import allocate_storage, bitwise_equal, execute_plan

    workers = range(plan.num_workers)
    storage = {w: allocate_storage(plan.destination, w) for w in workers}
    sources = {r: checkpoint_manifest(ckpt, tspec, r) for r in range(tspec.num_ranks)}
    t0 = time.perf_counter()
    execute_plan(plan, {r: s.iter_local() for r, s in sources.items()}, storage)
    t1 = time.perf_counter()
    full = full_checkpoint_tensors(ckpt)
    ok = True
    aliases = plan.destination.aliases
    for w in workers:
        ref = reference_load(ckpt.config, full, ispec, w)
        got = storage[w]
        names = set(ref) - set(aliases)
        missing, extra = names - set(got), set(got) - names
        bad = sorted(n for n in names & set(got) if not bitwise_equal(got[n], ref[n]))
        for alias, target in aliases.items():
            if alias in ref and target in got and not bitwise_equal(got[target], ref[alias]):
                bad.append(alias)
        if missing or extra or bad:
            ok = False
            console.print(f"[red]worker {w}: {len(bad)} tensors differ from vLLM's loader "
                          f"semantics {bad[:5]}, missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(extra)[:5]}[/red]")
    if ok:
        console.print(f"[green]verify: all {plan.num_workers} workers hold exactly what vLLM's "
                      f"loaders would ({len(names)} parameters each; executed "
                      f"{plan.num_slabs:,} slabs in {_fmt_seconds(t1 - t0)})[/green]")
    return ok


def _open_json(path: str | None):
    """Open ``--json PATH`` for writing before any work, so a bad path fails first."""
    if path is None:
        return None
    if not path.strip():
        raise UserError("--json needs a file path, got an empty string")
    try:
        return open(path, "w")
    except OSError as e:
        raise UserError(f"--json {path}: cannot write there ({e.strerror or e})") from None


def _cmd_plan(args) -> int:
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # Piped output (logs, CI) gets wide tables instead of rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    json_file = _open_json(args.json)
    written = False
    try:
        status = _plan_and_report(args, console, json_file)
        written = True
        return status
    finally:
        if json_file is not None:
            json_file.close()
            if not written:  # no half-written or empty file left behind
                Path(args.json).unlink(missing_ok=True)


def _plan_and_report(args, console, json_file) -> int:
    ckpt, tspec, ispec, metas, plan, timings = _build(args)
    if args.verify and not ckpt.has_data:
        raise UserError(f"--verify needs tensor data, but {ckpt.path} has only a config")
    _print_summary(console, args, ckpt, metas, plan, timings)
    if args.verbose:
        _print_tensors(console, plan)
    if json_file is not None:
        from m2nkit.manifest.serialize import manifest_to_json

        out = {"manifest": manifest_to_json(metas, tspec.num_ranks), "plan": plan.to_json()}
        json.dump(out, json_file)
        json_file.flush()
        console.print(f"wrote {args.json}")
    status = EXIT_OK
    for p in plan.problems:
        console.print(f"[red]problem: {p}[/red]")
        status = EXIT_PROBLEMS
    if args.verify:
        if plan.problems:
            console.print("[red]verify skipped: the plan has problems[/red]")
        elif not _verify(console, ckpt, tspec, ispec, plan):
            status = EXIT_PROBLEMS
    return status


def _cmd_demo(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from transformers.utils import logging as hf_logging

    from m2nkit.engine.demo import run_demo

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        result = run_demo(args.model, args.trainer, args.inference, rounds=args.rounds,
                          timeout_s=args.timeout, bucket_bytes=int(args.bucket_mib * (1 << 20)),
                          log=console.print)
    except RuntimeError as e:
        # A failed transfer or check (not a usage error): say what broke, exit 1.
        print(f"m2nkit: demo failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_PROBLEMS
    t = Table(title=f"m2nkit demo: {result.model}, {result.trainer} -> {result.inference}",
              title_justify="left")
    for col in ("method", "round", "bytes sent (total)", "max per trainer rank",
                "time", "useful throughput", "check"):
        t.add_column(col)
    for r in result.rounds:
        total = sum(r.bytes_per_rank)
        t.add_row("m2nkit torch_p2p", str(r.index), _fmt_bytes(total),
                  _fmt_bytes(max(r.bytes_per_rank)), _fmt_seconds(r.seconds),
                  f"{_fmt_bytes(result.nbytes_min / r.seconds)}/s" if r.seconds else "-",
                  f"bit-exact on {r.verified_workers} workers, = minimum"
                  if total == result.nbytes_min else f"{total - result.nbytes_min} bytes over the minimum")
    b = result.baseline
    if b:
        t.add_row("gather-then-broadcast", "-", _fmt_bytes(b["bytes_total"]),
                  _fmt_bytes(b["bytes_max_rank"]), _fmt_seconds(b["seconds"]),
                  f"{_fmt_bytes(result.nbytes_min / b['seconds'])}/s" if b["seconds"] else "-",
                  "bit-exact" if b.get("verified") else "not verified")
    console.print(t)
    console.print(f"minimum bytes (what the workers hold): {_fmt_bytes(result.nbytes_min)}; "
                  "useful throughput = that / time")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="m2nkit",
        description="Plan and run shard-to-shard weight transfers from RL trainers into vLLM workers.")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="dry-run: what moves where, and how long it takes")
    plan.add_argument("checkpoint", help="HF checkpoint directory (safetensors) or a config.json")
    plan.add_argument("--trainer", required=True,
                      help="how the trainer holds it: replicated:N, fsdp:N or hsdp:R,S")
    plan.add_argument("--inference", required=True, help="vllm:tp=T[,dp=D][,ep]")
    plan.add_argument("--json", metavar="PATH", help="write the manifest and plan as JSON")
    plan.add_argument("--verify", action="store_true",
                      help="execute in-process on the checkpoint's data and check every worker")
    plan.add_argument("--link-gbps", type=float, default=400.0,
                      help="per-rank link bandwidth for the time estimate (default 400)")
    plan.add_argument("-v", "--verbose", action="store_true", help="print the per-tensor table")
    plan.set_defaults(func=_cmd_plan)
    demo = sub.add_parser("demo", help="real multi-process transfer on this machine, verified")
    demo.add_argument("--model", default="tiny-qwen3-moe",
                      help="built-in tiny model (tiny-llama, tiny-qwen2, tiny-qwen3, tiny-qwen3-tied, "
                           "tiny-qwen3-moe, tiny-mixtral) or a checkpoint directory (default tiny-qwen3-moe)")
    demo.add_argument("--trainer", default="fsdp:4", help="replicated:N, fsdp:N or hsdp:R,S (default fsdp:4)")
    demo.add_argument("--inference", default="vllm:tp=2,dp=1", help="vllm:tp=T[,dp=D][,ep] (default vllm:tp=2,dp=1)")
    demo.add_argument("--rounds", type=int, default=2, help="update rounds, weights changed each round (default 2)")
    demo.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, seconds (default 60)")
    demo.add_argument("--bucket-mib", type=float, default=4.0, help="transport bucket size in MiB (default 4)")
    demo.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("link_gbps", "timeout", "bucket_mib"):
        value = getattr(args, flag, 1.0)
        if not (value > 0 and math.isfinite(value)):  # also refuses NaN and inf
            print(f"m2nkit: error: --{flag.replace('_', '-')} must be a finite number > 0, "
                  f"got {value}", file=sys.stderr)
            return EXIT_USAGE
    try:
        return args.func(args)
    except (UserError, ValueError, OSError) as e:
        print(f"m2nkit: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
