"""Does shard-to-shard beat gather-then-broadcast, and how close is it to the wire?

Runs three ways of moving one checkpoint from ``T`` trainer ranks into ``N``
vLLM-layout workers, each on ``T + N`` freshly spawned processes joined in
one stateless gloo group over 127.0.0.1 (the trainers also in a gloo group of
their own for the baseline's all-gather):

* ``m2nkit``   — ``torch_p2p``: ``agree_on_plan``, then ``send_round`` /
  ``recv_round`` (each slab once, straight from shard to worker storage);
* ``gather``   — ``m2nkit.engine.tools.baseline.gather_then_broadcast_round``: per
  tensor, all-gather among the trainer ranks, rank 0 sends the full tensor to
  every worker, each worker keeps its part (what RL frameworks do today);
* ``floor``    — ``raw_floor_round``: the plan's bytes per (trainer, worker)
  link as one raw message each, from buffers filled in advance.

Every trainer rank holds its ``--trainer`` shard in memory before the first
round (read once from the checkpoint, as a trainer holds its weights), every
worker its vLLM-layout storage; both are excluded from the transfer's memory
delta. Rounds are fenced by barriers on the whole group; a round's time is
the slowest rank's. After the rounds each worker's storage is compared bit
for bit with ``reference_load`` (an independent restatement of vLLM's
loaders); a method that moves wrong bytes fails the benchmark.

    python benchmarks/transfer.py [--model tiny-qwen3-moe|DIR] [--trainer fsdp:4]
        [--inference vllm:tp=2] [--rounds 3] [--scale N]

``--model NAME`` (a built-in tiny architecture) builds, once, a larger
randomly initialised checkpoint of that architecture (``BENCH_SIZES``,
``4 * scale`` layers) under the system temp dir; ``--model DIR`` uses a
checkpoint directory as is.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

from m2nkit.engine.tools.procs import collect_ranks, free_port, peak_kib, reset_peak, rss_kib

METHODS = ("m2nkit", "gather", "floor")
LABELS = {
    "m2nkit": "m2nkit torch_p2p",
    "gather": "gather-then-broadcast",
    "floor": "raw gloo floor",
}

#: The default benchmark model: big enough that a round takes long enough to
#: time on 2 cores (354 MB of bf16 for Qwen3-MoE at scale 1), small
#: enough that 6 processes plus the reference check stay well under 24 GiB.
#: Keys a family's config does not have are left out.
BENCH_SIZES = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 16,
    "num_local_experts": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
BENCH_LAYERS = 4


# --------------------------------------------------------------------------
# one process


def _rank_main(method: str, rank: int, cfg: dict, out) -> None:
    """Run ``cfg['rounds']`` rounds of ``method`` as ``rank``; report to ``out``."""
    try:
        out.put((rank, "ok", _run_rank(method, rank, cfg)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def _run_rank(method: str, rank: int, cfg: dict) -> dict:
    import gc

    phases = {"start": time.time()}

    import torch

    torch.set_num_threads(1)  # T + N processes share the machine's cores
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, checkpoint_metas
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.engine.tools.baseline import (create_trainer_group, gather_then_broadcast_round,
                                        raw_floor_buffers, raw_floor_round)
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.control import agree_on_plan, create_group, wait_work
    from m2nkit.engine.transports.torch_p2p import BucketSchedule, recv_round, send_round
    from m2nkit.manifest.serialize import manifest_to_json

    phases["imports"] = time.time()
    timeout_s = cfg["timeout_s"]
    T, N = cfg["T"], cfg["N"]
    world = T + N
    is_trainer = rank < T

    # Every rank builds its own plan from the manifest, as in a session. The
    # checkpoint's headers were read once by the parent (``read_checkpoint``
    # builds the model on the meta device: seconds of CPU per process on a
    # shared 2-core machine); this rank reopens the files to read its data.
    ck = cfg["checkpoint"]
    tspec = parse_trainer_spec(cfg["trainer"])
    manifest = manifest_to_json(checkpoint_metas(ck, tspec), T)
    from m2nkit.adapters.vllm import vllm_destination

    plan, _ = plan_from_manifest(manifest, vllm_destination(ck.config, cfg["inference"]))
    _, group = create_group("127.0.0.1", cfg["ports"][0], rank, world, timeout_s=timeout_s)
    tgroup = None
    if method == "gather" and is_trainer:
        _, tgroup = create_trainer_group("127.0.0.1", cfg["ports"][1], rank, T, timeout_s=timeout_s)
    agree_on_plan(group, rank, world, plan, timeout_s=timeout_s)
    schedule = BucketSchedule.build(plan, cfg["bucket_bytes"])
    phases["plan"] = time.time()
    rss_idle = rss_kib()  # imports, checkpoint headers, plan, groups: an idle process

    local = storage = buffers = None
    if method == "floor":
        buffers = raw_floor_buffers(plan, rank)
    elif is_trainer:
        # clone(): the shard in anonymous memory, every page written, as a
        # trainer holds its weights. The provider's tensors can still be
        # backed by the checkpoint's memory map, whose pages would only come
        # in when round 1 reads them and be counted as the transfer's memory.
        local = [(name, t.clone()) for name, t in checkpoint_manifest(ck, tspec, rank).iter_local()]
    else:
        storage = allocate_storage(plan.destination, rank - T)
    ck.close()  # drop the safetensors memory maps: only the shard stays resident
    gc.collect()

    def barrier(what: str) -> None:
        wait_work(group.barrier(), timeout_s, f"rank {rank}: barrier {what}")

    peak_reset = reset_peak()
    rss_ready = rss_kib()
    times, cpus, counts = [], [], []

    def cpu_s() -> float:  # all threads of this process, gloo's included
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    for k in range(cfg["rounds"]):
        if storage is not None:
            for t in storage.values():  # every round must write every byte again
                if t.dtype.is_floating_point:
                    t.fill_(float("nan"))
            for p in plan.destination.params:  # vLLM's padding rows stay zero
                if p.worker == rank - T:
                    for z in p.zero_boxes:
                        storage[p.name][tuple(slice(a, b) for a, b in z)] = 0
        barrier(f"before round {k}")
        t0, c0 = time.perf_counter(), cpu_s()
        if method == "m2nkit":
            if is_trainer:
                n = send_round(group, plan, schedule, rank, iter(local), timeout_s=timeout_s)
                c = {"sent": n, "received": 0, "gathered": 0}
            else:
                _, n = recv_round(group, plan, schedule, rank - T, storage, timeout_s=timeout_s)
                c = {"sent": 0, "received": n, "gathered": 0}
        elif method == "gather":
            r = gather_then_broadcast_round(group, tgroup, plan, rank,
                                            stream=iter(local) if is_trainer else None,
                                            storage=storage, timeout_s=timeout_s)
            c = {"sent": r.sent, "received": r.received, "gathered": r.gathered}
        else:
            r = raw_floor_round(group, plan, rank, buffers, timeout_s=timeout_s)
            c = {"sent": r.sent, "received": r.received, "gathered": 0}
        barrier(f"after round {k}")
        times.append(time.perf_counter() - t0)
        cpus.append(cpu_s() - c0)
        counts.append(c)
    peak = peak_kib()
    phases["rounds"] = time.time()

    exact = None  # the floor moves filler bytes: nothing to check
    if storage is not None:
        from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
        from m2nkit.adapters.vllm import reference_load

        ref = reference_load(ck.config, full_checkpoint_tensors(ck), cfg["inference"], rank - T)
        bad = [name for name in storage if not bitwise_equal(storage[name], ref[name])]
        exact = {"ok": not bad, "params": len(storage), "bad": bad[:3]}
    phases["verify"] = time.time()
    return {"times": times, "cpus": cpus, "counts": counts, "rss_idle": rss_idle,
            "rss_ready": rss_ready,
            "peak": peak, "peak_reset": peak_reset, "exact": exact, "phases": phases}


# --------------------------------------------------------------------------
# the parent


def run_method(method: str, cfg: dict, deadline_s: float) -> dict[int, dict]:
    """Spawn ``T + N`` processes for ``method``; ``{rank: report}``.

    Children are always reaped: on an error, a timeout or Ctrl-C every one
    still alive is killed.

    Raises:
        RuntimeError: a rank failed (with its traceback), died silently, or
            did not report within ``deadline_s``.
    """
    cfg = {**cfg, "ports": (free_port(), free_port())}
    return collect_ranks(_rank_main, lambda r: (method, r, cfg), cfg["T"] + cfg["N"],
                         deadline_s, f"{method}: ")


def ensure_model(name_or_dir: str, scale: int) -> tuple[Path, bool]:
    """``(checkpoint directory, built now)``: ``name_or_dir``, or a built-in model built once."""
    path = Path(name_or_dir)
    if path.is_dir():
        return path, False
    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS, save_tiny_checkpoint, tiny_config

    if name_or_dir not in BUILTIN_TINY_MODELS:
        sys.exit(f"--model {name_or_dir!r} is neither a checkpoint directory nor a built-in "
                 f"model ({', '.join(sorted(BUILTIN_TINY_MODELS))})")
    if scale < 1:
        sys.exit(f"--scale must be >= 1, got {scale}")
    base = tiny_config(name_or_dir)
    sizes = {k: v for k, v in BENCH_SIZES.items() if hasattr(base, k)}
    sizes["num_hidden_layers"] = BENCH_LAYERS * scale
    out = Path(tempfile.gettempdir()) / "m2nkit-bench" / f"{name_or_dir}-x{scale}-seed0"
    if (out / "model.safetensors").is_file():
        return out, False
    print(f"building {name_or_dir} at bench sizes ({sizes['num_hidden_layers']} layers) "
          f"in {out} ...",
          file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny_checkpoint(tiny_config(name_or_dir, **sizes), tmp, seed=0)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, True


def _mib(kib: float) -> str:
    return f"{kib / 1024:,.0f} MiB"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def summarize(method: str, reports: dict[int, dict], T: int, N: int, payload_bytes: int) -> dict:
    """One table row: median round time, bytes, throughput, memory, exactness."""
    rounds = len(reports[0]["times"])
    per_round = [max(r["times"][k] for r in reports.values()) for k in range(rounds)]
    last = {rank: r["counts"][-1] for rank, r in reports.items()}
    sent = [last[r]["sent"] + last[r]["gathered"] for r in range(T)]
    received = [last[T + w]["received"] for w in range(N)]
    for rank, r in reports.items():  # every round moves the same bytes
        if any(c != r["counts"][0] for c in r["counts"]):
            raise RuntimeError(f"{method}: rank {rank} moved different bytes in different rounds")
    exact = [reports[T + w]["exact"] for w in range(N)]
    median = statistics.median(per_round)
    cpu = statistics.median(sum(r["cpus"][k] for r in reports.values()) for k in range(rounds))
    trainers = [reports[r] for r in range(T)]
    workers = [reports[T + w] for w in range(N)]
    return {
        "method": method, "round_s": median, "rounds_s": per_round, "cpu_s": cpu,
        "sent_max": max(sent), "sent_total": sum(sent), "recv_max": max(received),
        "recv_total": sum(received),
        "p2p_sent": [last[r]["sent"] for r in range(T)],
        "gathered": [last[r]["gathered"] for r in range(T)],
        "gbps": payload_bytes / median / 1e9,
        "t_peak": max(r["peak"] for r in trainers),
        "t_delta": max(r["peak"] - r["rss_ready"] for r in trainers),
        "t_over_idle": max(r["peak"] - r["rss_idle"] for r in trainers),
        "w_peak": max(r["peak"] for r in workers),
        "w_delta": max(r["peak"] - r["rss_ready"] for r in workers),
        "w_over_idle": max(r["peak"] - r["rss_idle"] for r in workers),
        "rss_idle": max(r["rss_idle"] for r in reports.values()),
        "peak_reset": all(r["peak_reset"] for r in reports.values()),
        "exact": "n/a" if exact[0] is None else ("yes" if all(e["ok"] for e in exact) else "NO"),
        "exact_detail": exact,
    }


def check_bytes(rows: list[dict], payload: int, model_bytes: int, N: int) -> list[str]:
    """What each method must move, from first principles; a list of failures."""
    failures = []
    for row in rows:
        if row["exact"] == "NO":
            failures.append(f"{LABELS[row['method']]} wrote wrong bytes: {row['exact_detail']}")
        if row["method"] == "m2nkit" and not row["sent_total"] == row["recv_total"] == payload:
            failures.append(f"m2nkit sent {row['sent_total']} and received {row['recv_total']} "
                            f"bytes; plan.nbytes_min is {payload}")
        if row["method"] == "gather" and row["p2p_sent"][0] != N * model_bytes:
            failures.append(f"gather-then-broadcast rank 0 sent {row['p2p_sent'][0]} bytes, "
                            f"expected N x model = {N * model_bytes}")
        if row["method"] == "floor" and row["sent_total"] != payload:
            failures.append(f"raw floor sent {row['sent_total']} bytes, plan moves {payload}")
    return failures


def _table(columns: list[tuple[str, int]], rows: list[list[str]]) -> None:
    head = " ".join(f"{name:{'<' if i == 0 else '>'}{w}}" for i, (name, w) in enumerate(columns))
    print()
    print(head)
    print("-" * len(head))
    for row in rows:
        print(" ".join(f"{v:{'<' if i == 0 else '>'}{w}}"
                       for i, (v, (_, w)) in enumerate(zip(row, columns))))


def print_tables(rows: list[dict]) -> None:
    """The time/bytes table and the memory table."""
    _table([("method", 22), ("round s", 8), ("CPU s", 6), ("sent/trainer max", 17),
            ("sent total", 12), ("recv/worker max", 16), ("GB/s", 6), ("bit-exact", 9)],
           [[LABELS[r["method"]], f"{r['round_s']:.3f}", f"{r['cpu_s']:.2f}", _mb(r["sent_max"]),
             _mb(r["sent_total"]), _mb(r["recv_max"]), f"{r['gbps']:.2f}", r["exact"]]
            for r in rows])
    _table([("method", 22), ("trainer peak", 13), ("Δ idle", 9), ("Δ ready", 9),
            ("worker peak", 12), ("Δ idle", 9), ("Δ ready", 9)],
           [[LABELS[r["method"]], _mib(r["t_peak"]), _mib(r["t_over_idle"]), _mib(r["t_delta"]),
             _mib(r["w_peak"]), _mib(r["w_over_idle"]), _mib(r["w_delta"])] for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen3-moe",
                   help="built-in tiny model name (built at bench sizes) or checkpoint directory")
    p.add_argument("--trainer", default="fsdp:4",
                   help="trainer layout (fsdp:N, hsdp:R,S, replicated:N)")
    p.add_argument("--inference", default="vllm:tp=2", help="vLLM layout (vllm:tp=T[,dp=D][,ep])")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=int, default=1, help="built-in model: 4*scale layers")
    p.add_argument("--bucket-mb", type=float, default=64.0,
                   help="torch_p2p bucket size, MiB (BucketSchedule; the library default is 64)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        sys.exit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if args.rounds < 1:
        sys.exit(f"--rounds must be >= 1, got {args.rounds}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # children inherit it

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    t_build = time.perf_counter()
    checkpoint, built = ensure_model(args.model, args.scale)
    t_build = time.perf_counter() - t_build
    try:
        tspec = parse_trainer_spec(args.trainer)
        ck = read_checkpoint(checkpoint)
        from m2nkit.adapters.vllm import vllm_destination

        plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, tspec), tspec.num_ranks),
                                     vllm_destination(ck.config, args.inference))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if plan.problems:
        sys.exit(f"error: the plan cannot run: {plan.problems[0]}")
    T, N = plan.num_trainer_ranks, plan.num_workers
    model_bytes = sum(wp.meta.nbytes for wp in plan.wires if not wp.skipped)
    payload = plan.nbytes_min
    assert sum(plan.link_bytes.values()) == payload, "plan payload differs from nbytes_min"
    ck.close()  # the children reopen the files; the handles do not pickle
    cfg = {"checkpoint": ck, "trainer": str(tspec), "inference": args.inference,
           "T": T, "N": N, "rounds": args.rounds, "bucket_bytes": int(args.bucket_mb * 2**20),
           "timeout_s": args.timeout}
    print(f"model {checkpoint} ({ck.architecture}, {len(plan.wires)} wire tensors, "
          f"{_mb(model_bytes)}), trainer {tspec} -> {plan.destination.spec}: T={T}, N={N}, "
          f"{args.rounds} rounds, buckets {args.bucket_mb:g} MiB, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start", flush=True)

    load_start = os.getloadavg()[0]
    rows = []
    for method in methods:
        t0 = time.perf_counter()
        try:
            reports = run_method(method, cfg, deadline_s=args.timeout * 5 + 60 * args.rounds)
        except RuntimeError as e:
            sys.exit(f"error: {e}")
        row = summarize(method, reports, T, N, payload)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        ph = [r["phases"] for r in reports.values()]
        spans = {k: max(p[k] for p in ph) - min(p["start"] for p in ph)
                 for k in ("imports", "plan", "rounds", "verify")}
        print(f"  {LABELS[method]}: rounds {', '.join(f'{s:.3f}' for s in row['rounds_s'])} s, "
              f"bit-exact {row['exact']} ({row['wall_s']:.0f} s in all; ranks done with imports "
              f"{spans['imports']:.0f} s, plan {spans['plan']:.0f} s, "
              f"rounds {spans['rounds']:.0f} s, "
              f"checks {spans['verify']:.0f} s after the first started)",
              file=sys.stderr, flush=True)

    failures = check_bytes(rows, payload, model_bytes, N)
    print_tables(rows)
    print()
    notes = [
        f"bytes the workers need (plan.nbytes_min): {payload:,} = {payload / model_bytes:.3f} x "
        f"the model ({model_bytes:,} B). GB/s = nbytes_min / round s for every method; round s "
        f"= the slowest rank's, median of rounds; CPU s = user+system seconds of all {T + N} "
        "ranks in a round, median (less sensitive than wall time to other load).",
    ]
    for r in rows:
        if r["method"] == "m2nkit":
            notes.append(f"m2nkit: trainers sent {r['sent_total']:,} B and workers received "
                         f"{r['recv_total']:,} B in {plan.num_slabs:,} slabs; == plan.nbytes_min: "
                         f"{r['sent_total'] == r['recv_total'] == payload}")
        if r["method"] == "gather":
            notes.append(f"gather-then-broadcast: rank 0 sent {r['p2p_sent'][0]:,} B to workers "
                         f"(= {N} x model: {r['p2p_sent'][0] == N * model_bytes}); all-gather "
                         "sends "
                         f"per trainer rank {', '.join(f'{g:,}' for g in r['gathered'])} B (ring: "
                         "T-1 padded chunks per tensor), counted in 'sent'")
    reset = "" if all(r["peak_reset"] for r in rows) else " and setup (reset unavailable)"
    notes.append(
        f"peak = VmHWM, the high-water mark ru_maxrss reads, inside each process over the "
        f"rounds{reset}, max over ranks (not ru_maxrss itself: a spawned child's starts at its "
        "parent's mark). Δ idle = over the process's RSS when idle after imports, checkpoint "
        f"headers, plan and groups (at most {_mib(max(r['rss_idle'] for r in rows))}). Δ ready "
        "= over its RSS just before round 1, shard (trainer) or vLLM storage (worker) "
        "resident: what the transfer itself costs.")
    notes.append(f"load average {os.getloadavg()[0]:.1f} at the end (other processes share "
                 "these CPUs: compare rows of one run, not runs)")
    for note in notes:
        print(textwrap.fill(note, width=100, subsequent_indent="  "))
    if built:
        print(f"(model built in {t_build:.0f} s, kept for the next run)")
    if args.json:
        import json

        names = {"m2nkit": "m2nkit", "gather": "gather_broadcast", "floor": "floor"}
        doc = {"methods": {names[r["method"]]: {
            "round_s": r["round_s"], "rounds_s": r["rounds_s"], "cpu_s": r["cpu_s"],
            "bytes_sent_total": r["sent_total"], "bytes_received_total": r["recv_total"],
            "trainer_extra_mib": r["t_delta"] / 1024, "worker_extra_mib": r["w_delta"] / 1024,
            "bit_exact": {"yes": True, "NO": False}.get(r["exact"]),
        } for r in rows}, "load_average": [load_start, os.getloadavg()[0]],
            "model": str(checkpoint), "trainer": str(tspec), "inference": args.inference,
            "bucket_mib": args.bucket_mb, "rounds": args.rounds, "payload_bytes": payload}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
