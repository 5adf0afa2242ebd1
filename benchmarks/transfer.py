"""Does shard-to-shard beat gather-then-broadcast, and how close is it to the wire?

Moves one checkpoint from ``T`` trainer ranks into ``N`` vLLM-layout workers
three ways, all in the same ``T + N`` spawned processes, joined in one
stateless gloo group over 127.0.0.1 (the trainers also in a gloo group of
their own for the baseline's all-gather):

* ``m2nkit``   — ``TorchP2PTransport`` (what a session runs): ``agree_on_plan``,
  then ``send_round`` / ``recv_round`` (each slab once, straight from shard
  to worker storage; its staging pool kept across rounds);
* ``gather``   — ``m2nkit.engine.tools.baseline.gather_then_broadcast_round``: per
  tensor, all-gather among the trainer ranks, rank 0 sends the full tensor to
  every worker, each worker keeps its part (what RL frameworks do today);
* ``floor``    — ``raw_floor_round``: the plan's bytes per (trainer, worker)
  link as one raw message each, from buffers filled in advance;
* ``messages`` — ``message_pattern_round``: the same bytes in exactly
  torch_p2p's messages (its buckets, pairs, tags and sizes), from buffers
  filled in advance: no copies, no layouts. Its ratio to the floor is what
  gloo's per-message cost alone takes for the transport's message pattern,
  so the m2nkit / floor ratio splits into that and the transport's own
  copies and bookkeeping (m2nkit / messages).

With ``--wire fp8`` a fourth method runs beside them, in the same processes:

* ``fp8``      — m2nkit on the fp8 wire (mode 2, ``engine/fp8_wire.py``): the
  same checkpoint into workers serving ``quant=fp8_per_block``; the trainer
  ranks take per-block partial maxima, exchange the shared blocks' maxima,
  send the scales and then e4m3 bytes through the same ``TorchP2PTransport``.
  Reported: its bytes (checked against ``plan_fp8``'s), round time, and the
  trainers' quantization time per GB of BF16 quantized; each worker's e4m3
  weights, scales and other parameters are compared bit for bit with
  m2nkit's in-process mode 2 (``execute_fp8_in_process``, itself held against
  vLLM's own ``fp8_per_block`` load in ``tests/integration/test_fp8_plan.py``).
  Experts whose dims vLLM pads to whole 128-blocks are refused on the fp8
  wire so far (the bench sizes' are whole blocks at ``tp=2``).

The methods run **interleaved**, round by round: m2nkit and the floor in
every round (alternating which goes first), gather-then-broadcast last in
the first ``--gather-rounds`` rounds, after ``--warmup`` unrecorded rounds.
So both sides of a ratio see the same processes and, within a fraction of
a second, the same load from whatever else shares the machine; the script
prints each round's m2nkit / floor ratio, their median and the load
average. ``--cases all`` runs the named cases (``CASES``: the default, the
1 GB ``fsdp:8 -> vllm:tp=4 --scale 4``, and HSDP replicas) one after
another and prints their ratios side by side.

Every trainer rank holds its ``--trainer`` shard in memory before the first
round (read once from the checkpoint, as a trainer holds its weights), every
worker its vLLM-layout storage; both are excluded from the transfer's memory
delta. Slots are fenced by barriers on the whole group; a slot's time is
the slowest rank's. After every m2nkit and gather-then-broadcast slot each
worker's storage is compared bit for bit with ``reference_load`` (an
independent restatement of vLLM's loaders, computed once); a method that
moves wrong bytes fails the benchmark.

    python benchmarks/transfer.py [--model tiny-qwen3-moe|DIR] [--trainer fsdp:4]
        [--inference vllm:tp=2] [--rounds 5] [--scale N] [--cases all] [--wire fp8]
        [--json PATH]

``--model NAME`` (a built-in tiny architecture) builds, once, a larger
randomly initialised checkpoint of that architecture (``BENCH_SIZES``,
``4 * scale`` layers) under the system temp dir; ``--model DIR`` uses a
checkpoint directory as is. ``--json`` writes the first case's figures at
the top level (the one-case schema, with ``ratio_to_floor`` added) and every
case under ``cases``.
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

METHODS = ("m2nkit", "gather", "floor", "messages")
LABELS = {
    "m2nkit": "m2nkit torch_p2p",
    "fp8": "m2nkit fp8 wire",
    "gather": "gather-then-broadcast",
    "floor": "raw gloo floor",
    "messages": "m2nkit's messages, raw",
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


def _rank_main(rank: int, cfg: dict, out) -> None:
    """Run every round of every method as ``rank``; report to ``out``."""
    try:
        out.put((rank, "ok", _run_rank(rank, cfg)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def slot_order(methods: list[str], k: int) -> list[str]:
    """The methods of round ``k`` in the order they run.

    m2nkit, the floor and m2nkit's raw messages take turns going first
    (the order rotates by one each round: with two of them, they alternate),
    so none always runs right after another's traffic or right after the
    barrier; gather-then-broadcast (and the fp8 wire) run last, in slots of
    their own, once those are done.
    """
    core = [m for m in ("m2nkit", "floor", "messages") if m in methods]
    if core:
        shift = k % len(core)
        core = core[shift:] + core[:shift]
    return core + [m for m in methods if m not in ("m2nkit", "floor", "messages")]


def _run_rank(rank: int, cfg: dict) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)  # T + N processes share the machine's cores
    if cfg["runs"]:           # --runs: torch_p2p's run messages (off by default)
        from m2nkit.engine.transports import torch_p2p

        torch_p2p.RUN_PIECE_BYTES = RUNS_PIECE_BYTES
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, checkpoint_metas
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.engine.tools.baseline import (create_trainer_group, gather_then_broadcast_round,
                                              message_pattern_buffers, message_pattern_round,
                                              raw_floor_buffers, raw_floor_round)
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.control import agree_on_plan, create_group, wait_work
    from m2nkit.engine.transports.torch_p2p import TorchP2PTransport
    from m2nkit.manifest.serialize import manifest_to_json

    methods = cfg["methods"]
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
    if "gather" in methods and is_trainer:
        _, tgroup = create_trainer_group("127.0.0.1", cfg["ports"][1], rank, T, timeout_s=timeout_s)
    agree_on_plan(group, rank, world, plan, timeout_s=timeout_s)
    # The transport a session runs (its staging pool kept across rounds).
    p2p = TorchP2PTransport(group, rank=rank, timeout_s=timeout_s,
                            bucket_bytes=cfg["bucket_bytes"])
    plan8 = fp8 = None
    if "fp8" in methods:    # --wire fp8: the same checkpoint into fp8_per_block workers
        from m2nkit.engine.fp8_wire import fp8_wire_plan

        builder8 = vllm_destination(ck.config, cfg["inference_fp8"])
        plan8, _ = plan_from_manifest(manifest, builder8)
        fp8 = fp8_wire_plan(builder8, plan8)
    rss_idle = rss_kib()  # imports, checkpoint headers, plan, groups: an idle process

    # Everything every method needs, resident before the first round.
    local = storage = ref = buffers = None
    if "floor" in methods:
        buffers = raw_floor_buffers(plan, rank)
    pattern = message_pattern_buffers(plan, p2p.schedule(plan), rank) \
        if "messages" in methods else None
    if is_trainer:
        # clone(): the shard in anonymous memory, every page written, as a
        # trainer holds its weights. The provider's tensors can still be
        # backed by the checkpoint's memory map, whose pages would only come
        # in when a round reads them and be counted as the transfer's memory.
        local = [(name, t.clone()) for name, t in checkpoint_manifest(ck, tspec, rank).iter_local()]
    else:
        storage = allocate_storage(plan.destination, rank - T)
        from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
        from m2nkit.adapters.vllm import reference_load

        # vLLM's loaders on the full checkpoint: every slot that writes the
        # storage is compared with it bit for bit.
        ref = reference_load(ck.config, full_checkpoint_tensors(ck), cfg["inference"], rank - T)
        ref = {name: ref[name].clone() for name in storage}
        if fp8 is not None:
            # the fp8 wire's reference: m2nkit's in-process mode 2 (held bit for bit against
            # vLLM's own fp8_per_block load in tests/integration/test_fp8_plan.py)
            from m2nkit.engine.quant_fp8 import execute_fp8_in_process

            ref8 = dict(ref)
            execute_fp8_in_process(plan8, fp8, lambda r: checkpoint_manifest(ck, tspec, r)
                                   .iter_local(), {w: ref8 if w == rank - T else {}
                                                   for w in range(N)})
    ck.close()  # drop the safetensors memory maps: only the shard stays resident
    gc.collect()

    def barrier(what: str) -> None:
        wait_work(group.barrier(), timeout_s, f"rank {rank}: barrier {what}")

    def cpu_s() -> float:  # all threads of this process, gloo's included
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def scrub() -> None:
        for t in storage.values():  # every slot must write every byte again
            if t.dtype.is_floating_point:
                t.fill_(float("nan"))
        for p in plan.destination.params:  # vLLM's padding rows stay zero
            if p.worker == rank - T:
                for z in p.zero_boxes:
                    storage[p.name][tuple(slice(a, b) for a, b in z)] = 0

    slots = []
    peak_reset = True
    warmup = cfg["warmup"]
    for k in range(-warmup, cfg["rounds"]):   # k < 0: warm-up rounds, not recorded
        for method in slot_order(methods, k):
            if method == "gather" and (k >= cfg["gather_rounds"] or k < 0):
                continue
            if storage is not None and method not in ("floor", "messages"):
                scrub()
            gc.collect()
            barrier(f"before {method} round {k}")
            peak_reset &= reset_peak()
            rss_ready = rss_kib()
            t0, c0 = time.perf_counter(), cpu_s()
            if method == "m2nkit":
                if is_trainer:
                    n = p2p.send_round(plan, rank, iter(local)).nbytes
                    c = {"sent": n, "received": 0, "gathered": 0}
                else:
                    _, rep = p2p.recv_round(plan, rank - T, storage)
                    n = rep.nbytes
                    c = {"sent": 0, "received": n, "gathered": 0}
            elif method == "fp8":
                if is_trainer:
                    sender = _Fp8Sender(p2p, plan8, fp8, local)
                    n = sender.send_round(plan8, rank, iter(local)).nbytes
                    c = {"sent": n, "received": 0, "gathered": 0,
                         "quantize_s": sender.quantize_seconds}
                else:
                    got = _Fp8Got()
                    _, rep = _Fp8Receiver(p2p, plan8, fp8, got).recv_round(plan8, rank - T,
                                                                            storage)
                    n = rep.nbytes
                    c = {"sent": 0, "received": n, "gathered": 0}
            elif method == "gather":
                r = gather_then_broadcast_round(group, tgroup, plan, rank,
                                                stream=iter(local) if is_trainer else None,
                                                storage=storage, timeout_s=timeout_s)
                c = {"sent": r.sent, "received": r.received, "gathered": r.gathered}
            elif method == "messages":
                r = message_pattern_round(group, plan, pattern, rank, timeout_s=timeout_s)
                c = {"sent": r.sent, "received": r.received, "gathered": 0}
            else:
                r = raw_floor_round(group, plan, rank, buffers, timeout_s=timeout_s)
                c = {"sent": r.sent, "received": r.received, "gathered": 0}
            barrier(f"after {method} round {k}")
            dt, dc = time.perf_counter() - t0, cpu_s() - c0
            exact = None  # the floor and the raw messages move filler bytes: nothing to check
            if storage is not None and method == "fp8":
                held = {**storage, **got.held}
                bad = [name for name in ref8 if not bitwise_equal(held[name], ref8[name])]
                exact = {"ok": not bad, "params": len(ref8), "bad": bad[:3]}
            elif storage is not None and method not in ("floor", "messages"):
                bad = [name for name in storage if not bitwise_equal(storage[name], ref[name])]
                exact = {"ok": not bad, "params": len(storage), "bad": bad[:3]}
            if k < 0:
                continue
            quantize_s = c.pop("quantize_s", 0.0)
            slots.append({"method": method, "round": k, "time": dt, "cpu": dc,
                          "counts": c, "rss_ready": rss_ready, "peak": peak_kib(),
                          "exact": exact, "quantize_s": quantize_s})
    # torch_p2p's staging pool, kept across rounds (grown in the first one): what the
    # transport holds between rounds, on top of each round's Δ ready.
    pool = p2p._pool.nbytes if p2p._pool is not None else 0
    return {"slots": slots, "rss_idle": rss_idle, "peak_reset": peak_reset, "pool": pool}


class _LocalSource:
    """A trainer rank's shard as an ``M2NWeightSource`` for the fp8 wire (read twice a round)."""

    def __init__(self, local) -> None:
        self.local = local

    def iter_local(self):
        return iter(self.local)


def _Fp8Sender(p2p, plan8, fp8, local):
    from m2nkit.engine.fp8_wire import Fp8WireSender

    return Fp8WireSender(p2p, plan8, fp8, _LocalSource(local))


def _Fp8Receiver(p2p, plan8, fp8, got):
    from m2nkit.engine.fp8_wire import Fp8WireReceiver

    return Fp8WireReceiver(p2p, plan8, fp8, got)


class _Fp8Got:
    """Stands in for vLLM's reload on a benchmark worker: keeps what the fp8 wire hands it
    (``LayerwiseReload.prequantize``: the e4m3 weight and its scales, under vLLM's names)."""

    def __init__(self) -> None:
        self.held = {}

    def prequantize(self, name, weight, scale) -> None:
        self.held[name] = weight
        self.held[name + "_scale_inv"] = scale


# --------------------------------------------------------------------------
# the parent


def run_case(cfg: dict, deadline_s: float) -> dict[int, dict]:
    """Spawn ``T + N`` processes that run every method, interleaved; ``{rank: report}``.

    Children are always reaped: on an error, a timeout or Ctrl-C every one
    still alive is killed.

    Raises:
        RuntimeError: a rank failed (with its traceback), died silently, or
            did not report within ``deadline_s``.
    """
    cfg = {**cfg, "ports": (free_port(), free_port())}
    return collect_ranks(_rank_main, lambda r: (r, cfg), cfg["T"] + cfg["N"], deadline_s)


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
    """One table row from ``method``'s slots: median round time, bytes, memory, exactness."""
    slots = {rank: [s for s in r["slots"] if s["method"] == method] for rank, r in reports.items()}
    rounds = [s["round"] for s in slots[0]]
    per_round = [max(sl[i]["time"] for sl in slots.values()) for i in range(len(rounds))]
    last = {rank: sl[-1]["counts"] for rank, sl in slots.items()}
    sent = [last[r]["sent"] + last[r]["gathered"] for r in range(T)]
    received = [last[T + w]["received"] for w in range(N)]
    for rank, sl in slots.items():  # every round moves the same bytes
        if any(s["counts"] != sl[0]["counts"] for s in sl):
            raise RuntimeError(f"{method}: rank {rank} moved different bytes in different rounds")
    exact = [s["exact"] for w in range(N) for s in slots[T + w]]
    median = statistics.median(per_round)
    cpu = statistics.median(sum(sl[i]["cpu"] for sl in slots.values())
                            for i in range(len(rounds)))
    trainers = [(reports[r]["rss_idle"], slots[r]) for r in range(T)]
    workers = [(reports[T + w]["rss_idle"], slots[T + w]) for w in range(N)]

    def most(ranks, f):
        return max(f(idle, s) for idle, sl in ranks for s in sl)

    return {
        "method": method, "round_s": median, "rounds_s": per_round, "rounds": rounds,
        "cpu_s": cpu,
        "sent_max": max(sent), "sent_total": sum(sent), "recv_max": max(received),
        "recv_total": sum(received),
        "p2p_sent": [last[r]["sent"] for r in range(T)],
        "gathered": [last[r]["gathered"] for r in range(T)],
        "gbps": payload_bytes / median / 1e9,
        "t_peak": most(trainers, lambda idle, s: s["peak"]),
        "t_delta": most(trainers, lambda idle, s: s["peak"] - s["rss_ready"]),
        "t_over_idle": most(trainers, lambda idle, s: s["peak"] - idle),
        "w_peak": most(workers, lambda idle, s: s["peak"]),
        "w_delta": most(workers, lambda idle, s: s["peak"] - s["rss_ready"]),
        "w_over_idle": most(workers, lambda idle, s: s["peak"] - idle),
        "rss_idle": max(r["rss_idle"] for r in reports.values()),
        "peak_reset": all(r["peak_reset"] for r in reports.values()),
        "exact": "n/a" if exact[0] is None else ("yes" if all(e["ok"] for e in exact) else "NO"),
        "exact_detail": [e for e in exact if e is not None and not e["ok"]][:3],
        "t_pool": max(reports[r]["pool"] for r in range(T)) if method == "m2nkit" else 0,
        "w_pool": max(reports[T + w]["pool"] for w in range(N)) if method == "m2nkit" else 0,
    }


def ratios(rows: list[dict], num: str, den: str) -> list[float]:
    """Per round: ``num``'s round time over ``den``'s, rounds both ran (same processes, same round)."""
    by = {r["method"]: dict(zip(r["rounds"], r["rounds_s"])) for r in rows}
    if num not in by or den not in by:
        return []
    return [by[num][k] / by[den][k] for k in sorted(set(by[num]) & set(by[den]))]


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
        if row["method"] in ("floor", "messages") and row["sent_total"] != payload:
            failures.append(f"{LABELS[row['method']]} sent {row['sent_total']} bytes, plan "
                            f"moves {payload}")
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


#: ``torch_p2p.RUN_PIECE_BYTES`` under ``--runs``.
RUNS_PIECE_BYTES = 4 << 20

#: The named cases of ``--cases``: ``name -> (trainer, inference, scale)``.
#: ``default`` is the script's default layout (353.5 MB); ``1gb`` 8 trainer
#: ranks into 4 workers (1,020.9 MB, 12 processes); ``hsdp`` two replicas of
#: 4 FSDP shards into 2 workers, so each worker's bytes come from both
#: replicas (10 processes).
CASES = {
    "default": ("fsdp:4", "vllm:tp=2", 1),
    "1gb": ("fsdp:8", "vllm:tp=4", 4),
    "hsdp": ("hsdp:2,4", "vllm:tp=2", 1),
}


def _fmt_ratios(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def run_one(args, methods: list[str], trainer: str, inference: str, scale: int) -> dict:
    """Build the plan of one case, run its interleaved rounds, print its tables; its JSON doc."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.transports.torch_p2p import BucketSchedule, message_count
    from m2nkit.manifest.serialize import manifest_to_json

    t_build = time.perf_counter()
    checkpoint, built = ensure_model(args.model, scale)
    t_build = time.perf_counter() - t_build
    try:
        tspec = parse_trainer_spec(trainer)
        ck = read_checkpoint(checkpoint)
        from m2nkit.adapters.vllm import vllm_destination

        plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, tspec), tspec.num_ranks),
                                     vllm_destination(ck.config, inference))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if plan.problems:
        sys.exit(f"error: the plan cannot run: {plan.problems[0]}")
    T, N = plan.num_trainer_ranks, plan.num_workers
    model_bytes = sum(wp.meta.nbytes for wp in plan.wires if not wp.skipped)
    payload = plan.nbytes_min
    assert sum(plan.link_bytes.values()) == payload, "plan payload differs from nbytes_min"
    bucket_bytes = int(args.bucket_mb * 2**20)
    if args.runs:
        from m2nkit.engine.transports import torch_p2p

        torch_p2p.RUN_PIECE_BYTES = RUNS_PIECE_BYTES
    messages = {"m2nkit": message_count(plan, BucketSchedule.build(plan, bucket_bytes)),
                "floor": len(plan.link_bytes)}
    messages["messages"] = messages["m2nkit"]
    fp8 = None
    inference_fp8 = f"{inference},quant=fp8_per_block,wire=fp8"
    if "fp8" in methods:
        from m2nkit.engine.fp8_wire import fp8_wire_plan, wire_plan

        try:
            builder8 = vllm_destination(ck.config, inference_fp8)
            plan8, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, tspec),
                                                           tspec.num_ranks), builder8)
            fp8 = fp8_wire_plan(builder8, plan8)
        except ValueError as e:
            sys.exit(f"error: --wire fp8: {e}")
        wp8 = wire_plan(plan8, fp8)
        # BF16 bytes the trainers quantize a round (the wire tensors carried as e4m3)
        quantized_bf16 = sum(a.nbytes_moved for a, b in zip(plan8.wires, wp8.wires)
                             if b.meta.dtype != a.meta.dtype)
        messages["fp8"] = message_count(wp8, BucketSchedule.build(wp8, bucket_bytes))
    ck.close()  # the children reopen the files; the handles do not pickle
    gather_rounds = min(args.rounds, args.gather_rounds)
    cfg = {"checkpoint": ck, "trainer": str(tspec), "inference": inference, "methods": methods,
           "inference_fp8": inference_fp8,
           "T": T, "N": N, "rounds": args.rounds, "gather_rounds": gather_rounds,
           "warmup": args.warmup, "runs": args.runs,
           "bucket_bytes": bucket_bytes, "timeout_s": args.timeout}
    load_start = os.getloadavg()
    print(f"\n== trainer {tspec} -> {plan.destination.spec}: model {checkpoint} "
          f"({ck.architecture}, {len(plan.wires)} wire tensors, {_mb(model_bytes)}), T={T}, N={N}, "
          f"{args.warmup} warm-up + {args.rounds} rounds (gather-then-broadcast in "
          f"{gather_rounds}), buckets "
          f"{args.bucket_mb:g} MiB, {os.cpu_count()} CPUs, load average "
          f"{load_start[0]:.1f} at start", flush=True)

    t0 = time.perf_counter()
    n_slots = (args.rounds + args.warmup) * len([m for m in methods if m != "gather"]) + \
        (gather_rounds if "gather" in methods else 0)
    try:
        reports = run_case(cfg, deadline_s=args.timeout * (5 + n_slots) + 120)
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    wall = time.perf_counter() - t0
    load_end = os.getloadavg()
    rows = [summarize(m, reports, T, N, payload) for m in methods]
    for row in rows:
        print(f"  {LABELS[row['method']]}: rounds {', '.join(f'{s:.3f}' for s in row['rounds_s'])}"
              f" s, bit-exact {row['exact']}", file=sys.stderr, flush=True)

    failures = check_bytes(rows, payload, model_bytes, N)
    for row in rows:
        if row["method"] == "fp8":
            # the transport's own counts against plan_fp8's (e4m3 + scales + exchange)
            want = (int(fp8.send_bytes.sum()), int(fp8.recv_bytes.sum()))
            if (row["sent_total"], row["recv_total"]) != want:
                failures.append(f"fp8 wire sent {row['sent_total']} / received "
                                f"{row['recv_total']} bytes; plan_fp8 says {want}")
            per_round = [sum(s["quantize_s"] for r in range(T) for s in reports[r]["slots"]
                             if s["method"] == "fp8" and s["round"] == k) for k in row["rounds"]]
            row["quantize_s"] = statistics.median(per_round)
            row["quantize_s_per_gb"] = row["quantize_s"] / (quantized_bf16 / 1e9)
    print_tables(rows)
    print()
    floor_ratio = ratios(rows, "m2nkit", "floor")
    pattern_ratio = ratios(rows, "messages", "floor")
    gather_ratio = ratios(rows, "gather", "m2nkit")
    notes = []
    if floor_ratio:
        notes.append(f"m2nkit / floor per round (same processes, same round): "
                     f"{_fmt_ratios(floor_ratio)}; median {statistics.median(floor_ratio):.2f}x "
                     f"(goal <= 1.25x). Messages a round: m2nkit {messages['m2nkit']:,}, floor "
                     f"{messages['floor']:,}")
    if pattern_ratio:
        notes.append(f"m2nkit's messages, raw / floor per round: {_fmt_ratios(pattern_ratio)}; "
                     f"median {statistics.median(pattern_ratio):.2f}x: what gloo's per-message "
                     "cost alone takes for torch_p2p's message pattern (no copies, no layouts)")
    if gather_ratio:
        notes.append(f"gather-then-broadcast / m2nkit per round: {_fmt_ratios(gather_ratio)}; "
                     f"median {statistics.median(gather_ratio):.1f}x (goal >= 5x)")
    notes += [
        f"bytes the workers need (plan.nbytes_min): {payload:,} = {payload / model_bytes:.3f} x "
        f"the model ({model_bytes:,} B). GB/s = nbytes_min / round s for every method; round s "
        f"= the slowest rank's, median of rounds; CPU s = user+system seconds of all {T + N} "
        "ranks in a round, median (less sensitive than wall time to other load).",
    ]
    for r in rows:
        if r["method"] == "m2nkit":
            notes.append(f"m2nkit staging pool kept across rounds (on top of Δ ready): "
                         f"{r['t_pool'] / 2**20:.1f} MiB per trainer, {r['w_pool'] / 2**20:.1f} "
                         f"MiB per worker at most; buckets {args.bucket_mb:g} MiB")
            notes.append(f"m2nkit: trainers sent {r['sent_total']:,} B and workers received "
                         f"{r['recv_total']:,} B in {plan.num_slabs:,} slabs; == plan.nbytes_min: "
                         f"{r['sent_total'] == r['recv_total'] == payload}")
        if r["method"] == "fp8":
            notes.append(f"fp8 wire ({inference_fp8}): trainers sent {r['sent_total']:,} B "
                         f"(BF16 wire: {payload:,} B; {fp8.exchange_bytes:,} B of it the amax "
                         f"exchange between trainer ranks, {fp8.shared_blocks:,} shared of "
                         f"{fp8.blocks:,} blocks); trainer quantization (partial maxima + e4m3) "
                         f"{r['quantize_s']:.3f} s a round, all ranks, = "
                         f"{r['quantize_s_per_gb']:.2f} s per GB of BF16 quantized "
                         f"({quantized_bf16:,} B); bit-exact against m2nkit's in-process "
                         "mode 2 (itself held against vLLM's fp8_per_block load, "
                         "tests/integration/test_fp8_plan.py)")
        if r["method"] == "gather":
            notes.append(f"gather-then-broadcast: rank 0 sent {r['p2p_sent'][0]:,} B to workers "
                         f"(= {N} x model: {r['p2p_sent'][0] == N * model_bytes}); all-gather "
                         "sends "
                         f"per trainer rank {', '.join(f'{g:,}' for g in r['gathered'])} B (ring: "
                         "T-1 padded chunks per tensor), counted in 'sent'")
    reset = "" if all(r["peak_reset"] for r in rows) else " (reset unavailable: since start)"
    notes.append(
        f"All methods run in the same {T + N} processes, round by round (m2nkit, the floor "
        "and m2nkit's raw messages take turns going first; gather-then-broadcast last), after "
        f"{args.warmup} unrecorded warm-up round(s) of all but gather-then-broadcast. "
        f"peak = VmHWM, reset before every slot{reset}, max over ranks and slots. Δ idle = "
        "over the process's RSS when idle after imports, checkpoint headers, plan and groups "
        "(at most "
        f"{_mib(max(r['rss_idle'] for r in rows))}). Δ ready = over its RSS just before the "
        "slot, everything the methods hold between rounds resident (shard, vLLM storage, the "
        "floor's buffers): what one round of the method itself costs.")
    notes.append(f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end "
                 f"({wall:.0f} s; other processes share these CPUs)")
    for note in notes:
        print(textwrap.fill(note, width=100, subsequent_indent="  "))
    if built:
        print(f"(model built in {t_build:.0f} s, kept for the next run)")
    names = {"m2nkit": "m2nkit", "gather": "gather_broadcast", "floor": "floor",
             "fp8": "m2nkit_fp8_wire", "messages": "message_pattern"}
    doc = {"methods": {names[r["method"]]: {
        "round_s": r["round_s"], "rounds_s": r["rounds_s"], "cpu_s": r["cpu_s"],
        "bytes_sent_total": r["sent_total"], "bytes_received_total": r["recv_total"],
        "trainer_extra_mib": r["t_delta"] / 1024, "worker_extra_mib": r["w_delta"] / 1024,
        "trainer_pool_mib": r["t_pool"] / 2**20, "worker_pool_mib": r["w_pool"] / 2**20,
        "bit_exact": {"yes": True, "NO": False}.get(r["exact"]),
        **({"messages": messages[r["method"]]} if r["method"] in messages else {}),
        **({"trainer_quantize_s": r["quantize_s"], "trainer_quantize_s_per_gb":
            r["quantize_s_per_gb"]} if r["method"] == "fp8" else {}),
    } for r in rows}, "load_average": [load_start[0], load_end[0]],
        "model": str(checkpoint), "trainer": str(tspec), "inference": inference,
        "scale": scale, "bucket_mib": args.bucket_mb, "rounds": args.rounds,
        "warmup_rounds": args.warmup, "p2p_runs": args.runs,
        "gather_rounds": gather_rounds, "payload_bytes": payload, "interleaved": True,
        "ratio_to_floor": {"rounds": floor_ratio,
                           "median": statistics.median(floor_ratio) if floor_ratio else None},
        "message_pattern_to_floor": {"rounds": pattern_ratio, "median":
                                     statistics.median(pattern_ratio) if pattern_ratio
                                     else None},
        "gather_over_m2nkit": {"rounds": gather_ratio,
                               "median": statistics.median(gather_ratio) if gather_ratio
                               else None},
        "failures": failures}
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen3-moe",
                   help="built-in tiny model name (built at bench sizes) or checkpoint directory")
    p.add_argument("--trainer", default="fsdp:4",
                   help="trainer layout (fsdp:N, hsdp:R,S, replicated:N)")
    p.add_argument("--inference", default="vllm:tp=2", help="vLLM layout (vllm:tp=T[,dp=D][,ep])")
    p.add_argument("--cases", metavar="NAMES",
                   help=f"comma-separated named cases, or 'all' ({', '.join(CASES)}): each "
                        "case's trainer, inference and scale instead of --trainer/--inference/"
                        "--scale, one after another, then their ratios side by side")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1,
                   help="unrecorded rounds of m2nkit and the floor first (the first round "
                        "builds torch_p2p's cached message layouts and grows its staging pool, "
                        "once per session)")
    p.add_argument("--gather-rounds", type=int, default=2,
                   help="rounds that also run gather-then-broadcast (its slot is the round's "
                        "last; it takes seconds a round)")
    p.add_argument("--scale", type=int, default=1, help="built-in model: 4*scale layers")
    p.add_argument("--bucket-mb", type=float, default=64.0,
                   help="torch_p2p bucket size, MiB (BucketSchedule; the library default is 64)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    p.add_argument("--runs", action="store_true",
                   help="torch_p2p with run messages (torch_p2p.RUN_PIECE_BYTES = 4 MiB; off "
                        "by default): a pair's slabs adjacent in a worker parameter as one "
                        "message, for comparison")
    p.add_argument("--wire", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: also run m2nkit on the fp8 wire (mode 2: the trainers quantize "
                        "in each worker's 128x128 grid, e4m3 + fp32 scales) beside the BF16 "
                        "round, into workers serving quant=fp8_per_block (experts whose dims "
                        "vLLM pads to 128-blocks are not on the fp8 wire yet)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        sys.exit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if args.wire == "fp8":
        methods.insert(methods.index("gather") if "gather" in methods else len(methods), "fp8")
    if args.rounds < 1:
        sys.exit(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmup < 0:
        sys.exit(f"--warmup must be >= 0, got {args.warmup}")
    if args.gather_rounds < 0:
        sys.exit(f"--gather-rounds must be >= 0, got {args.gather_rounds}")
    if args.gather_rounds == 0 and "gather" in methods:
        methods.remove("gather")     # no slot of its own left
    if args.cases:
        names = list(CASES) if args.cases.strip() == "all" else \
            [c.strip() for c in args.cases.split(",") if c.strip()]
        bad = [c for c in names if c not in CASES]
        if bad or not names:
            sys.exit(f"--cases: unknown {bad}; choose from {', '.join(CASES)} or 'all'")
        cases = [(c, *CASES[c]) for c in names]
    else:
        cases = [(None, args.trainer, args.inference, args.scale)]
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # children inherit it

    docs = []
    for name, trainer, inference, scale in cases:
        doc = run_one(args, methods, trainer, inference, scale)
        doc["case"] = name
        docs.append(doc)

    if len(docs) > 1 or docs[0]["ratio_to_floor"]["rounds"]:
        print()
        _table([("case", 30), ("m2nkit s", 9), ("floor s", 8), ("/ floor, per round", 32),
                ("median", 7), ("msgs/floor", 10), ("gather/m2n", 10), ("load", 10)],
               [[f"{d['case'] or 'given'}: {d['trainer']} -> {d['inference']}",
                 f"{d['methods']['m2nkit']['round_s']:.3f}" if "m2nkit" in d["methods"] else "-",
                 f"{d['methods']['floor']['round_s']:.3f}" if "floor" in d["methods"] else "-",
                 _fmt_ratios(d["ratio_to_floor"]["rounds"]) or "-",
                 f"{d['ratio_to_floor']['median']:.2f}x" if d["ratio_to_floor"]["median"]
                 else "-",
                 f"{d['message_pattern_to_floor']['median']:.2f}x"
                 if d["message_pattern_to_floor"]["median"] else "-",
                 f"{d['gather_over_m2nkit']['median']:.1f}x" if d["gather_over_m2nkit"]["median"]
                 else "-",
                 f"{d['load_average'][0]:.1f}-{d['load_average'][1]:.1f}"] for d in docs])
    if args.json:
        import json

        # The first case's figures at the top level (the schema of one case),
        # every case under "cases".
        Path(args.json).write_text(json.dumps({**docs[0], "cases": docs}, indent=1) + "\n")
    failures = [f for d in docs for f in d["failures"]]
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
