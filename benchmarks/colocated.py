"""Colocated weight updates: m2nkit's shard IPC against full tensors per parameter over IPC.

Two ways of moving one checkpoint from ``T`` trainer ranks into ``N``
vLLM-layout workers that share the machine's memory, each on ``T + N``
freshly spawned processes (a stateless gloo group and the session's
``TCPStore`` over 127.0.0.1):

* ``m2nkit_ipc`` — the ``ipc`` transport (``m2nkit.engine.transports.ipc``):
  every trainer rank exposes its own shard as shared-memory handles, each
  worker copies exactly its boxes from the mapped shards into its storage;
* ``full_ipc``  — ``m2nkit.engine.tools.colocated_baseline``: per parameter,
  the trainer ranks all-gather the full tensor into shared memory, rank 0
  publishes its handle, every worker maps the full tensor and keeps its
  slice (what vLLM 0.33's ``ipc`` backend does with CUDA IPC handles,
  ``vllm/distributed/weight_transfer/ipc_engine.py``).

One warm-up round first (m2nkit: each shard moves into shared memory, in
place, once per session; the baseline: its shared buffer is allocated),
then ``--rounds`` timed rounds fenced by barriers; a round's time is the
slowest rank's (median). ``bytes_copied``: every byte a copy wrote in a
round, all ranks (m2nkit: the slabs the workers copy, plus any bounce;
baseline: the all-gather, the full tensors assembled, the workers'
slices). Extra memory, MiB, the largest rank's: peak over the timed
rounds minus before the warm-up (``*_extra_mib``), and peak over the
warm-up alone (``first_round_*``: the shards' one move into shared
memory), freed heap pages returned first (``malloc_trim``), sampled every
2 ms from ``/proc/self/status``: a trainer's private plus shared-memory pages
(``RssAnon + RssShmem``: its gathered full tensors are extra, its shard
moved into shared memory is not), a worker's private pages (``RssAnon``:
the trainer pages it maps are the trainer's). After the rounds every
worker's storage is compared bit for bit with ``reference_load``.

    python benchmarks/colocated.py [--model tiny-qwen3-moe|DIR] [--trainer fsdp:2]
        [--inference vllm:tp=2] [--rounds 3] [--scale 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from m2nkit.engine.tools.procs import collect_ranks, free_port, trim_heap  # noqa: E402

METHODS = ("m2nkit_ipc", "full_ipc")
LABELS = {"m2nkit_ipc": "m2nkit shard IPC", "full_ipc": "full tensors per param"}


def _status_kib(*keys: str) -> int:
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in keys:
                total += int(line.split()[1])
    return total


class _Peak:
    """A thread sampling ``keys`` of /proc/self/status every 2 ms; ``peak`` in KiB."""

    def __init__(self, keys):
        self.keys, self.peak, self._stop = keys, _status_kib(*keys), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_kib(*self.keys))

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, _status_kib(*self.keys))


def _rank_main(method: str, rank: int, cfg: dict, out) -> None:
    try:
        out.put((rank, "ok", _run_rank(method, rank, cfg)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def _run_rank(method: str, rank: int, cfg: dict) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    from m2nkit.adapters.hf_checkpoint import (checkpoint_manifest, checkpoint_metas,
                                               full_checkpoint_tensors)
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import reference_load, vllm_destination
    from m2nkit.engine.control import create_group, wait_work
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.tools.baseline import create_trainer_group
    from m2nkit.engine.tools.colocated_baseline import SharedPool, full_tensor_ipc_round
    from m2nkit.engine.transports.ipc import IpcTransport
    from m2nkit.manifest.serialize import manifest_to_json

    timeout_s, T, N = cfg["timeout_s"], cfg["T"], cfg["N"]
    world, trainer = T + N, rank < T
    ck = cfg["checkpoint"]
    tspec = parse_trainer_spec(cfg["trainer"])
    plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, tspec), T),
                                 vllm_destination(ck.config, cfg["inference"]))
    store, group = create_group("127.0.0.1", cfg["ports"][0], rank, world, timeout_s=timeout_s)
    tgroup = transport = pool = None
    if method == "full_ipc" and trainer:
        _, tgroup = create_trainer_group("127.0.0.1", cfg["ports"][1], rank, T,
                                         timeout_s=timeout_s)
        pool = SharedPool()
    if method == "m2nkit_ipc":
        transport = IpcTransport.connect(store, group, rank, world, device="cpu",
                                         timeout_s=timeout_s, bucket_bytes=cfg["bucket_bytes"])
    local = storage = None
    if trainer:   # the shard in anonymous memory, as a trainer holds its weights
        local = [(n, t.clone()) for n, t in checkpoint_manifest(ck, tspec, rank).iter_local()]
    else:
        storage = allocate_storage(plan.destination, rank - T)
    ck.close()
    gc.collect()
    keys = ("RssAnon", "RssShmem") if trainer else ("RssAnon",)
    trim_heap()
    ready = _status_kib(*keys)
    sampler = _Peak(keys)
    first = None
    times, copied = [], []
    for k in range(cfg["rounds"] + 1):               # round 0: warm-up
        if storage is not None:
            for t in storage.values():
                if t.dtype.is_floating_point:
                    t.fill_(float("nan"))
            for p in plan.destination.params:
                if p.worker == rank - T:
                    for z in p.zero_boxes:
                        storage[p.name][tuple(slice(a, b) for a, b in z)] = 0
        wait_work(group.barrier(), timeout_s, f"rank {rank}: barrier before round {k}")
        t0 = time.perf_counter()
        if method == "m2nkit_ipc":
            if trainer:
                transport.send_round(plan, rank, iter(local))
                n = transport.bounced
            else:
                n = transport.recv_round(plan, rank - T, storage)[1].ipc_bytes
        else:
            r = full_tensor_ipc_round(store, tgroup, plan, rank, k,
                                      stream=iter(local) if trainer else None, storage=storage,
                                      pool=pool, timeout_s=timeout_s)
            n = r.gathered + r.assembled + r.copied
        wait_work(group.barrier(), timeout_s, f"rank {rank}: barrier after round {k}")
        if k:
            times.append(time.perf_counter() - t0)
            copied.append(n)
        else:       # the warm-up's peak; then freed heap pages go back before the timed rounds
            first = sampler.stop()
            trim_heap()
            sampler = _Peak(keys)
    peak = sampler.stop()
    exact = None
    if storage is not None:
        ref = reference_load(ck.config, full_checkpoint_tensors(ck), cfg["inference"], rank - T)
        bad = [name for name in storage if not bitwise_equal(storage[name], ref[name])]
        exact = {"ok": not bad, "bad": bad[:3]}
    if transport is not None:
        transport.close()
    return {"times": times, "copied": copied, "extra_kib": peak - ready,
            "first_extra_kib": first - ready, "exact": exact}


def run_method(method: str, cfg: dict) -> dict[int, dict]:
    cfg = {**cfg, "ports": (free_port(), free_port())}
    return collect_ranks(_rank_main, lambda r: (method, r, cfg), cfg["T"] + cfg["N"],
                         cfg["timeout_s"] * 5 + 60 * cfg["rounds"], f"{method}: ")


def summarize(reports: dict[int, dict], T: int, N: int) -> dict:
    rounds = len(reports[0]["times"])
    per_round = [max(r["times"][k] for r in reports.values()) for k in range(rounds)]
    return {
        "round_s": statistics.median(per_round),
        "rounds_s": per_round,
        "bytes_copied": sum(r["copied"][-1] for r in reports.values()),
        "trainer_extra_mib": max(reports[r]["extra_kib"] for r in range(T)) / 1024,
        "worker_extra_mib": max(reports[T + w]["extra_kib"] for w in range(N)) / 1024,
        "first_round_trainer_extra_mib": max(reports[r]["first_extra_kib"]
                                             for r in range(T)) / 1024,
        "first_round_worker_extra_mib": max(reports[T + w]["first_extra_kib"]
                                            for w in range(N)) / 1024,
        "bit_exact": all(reports[T + w]["exact"]["ok"] for w in range(N)),
    }


def main() -> None:
    from transfer import ensure_model   # benchmarks/transfer.py: the bench-size checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen3-moe",
                   help="built-in tiny model name (built at bench sizes) or checkpoint directory")
    p.add_argument("--trainer", default="fsdp:2", help="trainer layout (fsdp:N, hsdp:R,S, ...)")
    p.add_argument("--inference", default="vllm:tp=2", help="vLLM layout (vllm:tp=T[,dp=D][,ep])")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=int, default=1, help="built-in model: 4*scale layers")
    p.add_argument("--bucket-mib", type=float, default=64.0, help="ipc bucket size, MiB")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        sys.exit(f"--methods: choose from {', '.join(METHODS)}")
    if args.rounds < 1:
        sys.exit(f"--rounds must be >= 1, got {args.rounds}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    checkpoint, _ = ensure_model(args.model, args.scale)
    try:
        tspec = parse_trainer_spec(args.trainer)
        ck = read_checkpoint(checkpoint)
        plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, tspec),
                                                      tspec.num_ranks),
                                     vllm_destination(ck.config, args.inference))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if plan.problems:
        sys.exit(f"error: the plan cannot run: {plan.problems[0]}")
    T, N = plan.num_trainer_ranks, plan.num_workers
    model_bytes = sum(wp.meta.nbytes for wp in plan.wires if not wp.skipped)
    ck.close()
    cfg = {"checkpoint": ck, "trainer": str(tspec), "inference": args.inference, "T": T, "N": N,
           "rounds": args.rounds, "bucket_bytes": int(args.bucket_mib * 2**20),
           "timeout_s": args.timeout}
    load_start = os.getloadavg()[0]
    print(f"model {checkpoint} ({ck.architecture}, {model_bytes / 1e6:,.1f} MB), trainer {tspec} "
          f"-> {plan.destination.spec}: T={T}, N={N}, {args.rounds} rounds after a warm-up, "
          f"{os.cpu_count()} CPUs, load average {load_start:.1f} at start", flush=True)
    rows = {}
    for method in methods:
        try:
            rows[method] = summarize(run_method(method, cfg), T, N)
        except RuntimeError as e:
            sys.exit(f"error: {e}")
    load_end = os.getloadavg()[0]
    head = (f"{'method':<24}{'round s':>9}{'bytes copied':>15}{'trainer extra':>15}"
            f"{'worker extra':>14}{'1st round t/w extra':>22}{'bit-exact':>11}")
    print()
    print(head)
    print("-" * len(head))
    for m, r in rows.items():
        print(f"{LABELS[m]:<24}{r['round_s']:>9.3f}{r['bytes_copied'] / 1e6:>12,.1f} MB"
              f"{r['trainer_extra_mib']:>11,.1f} MiB{r['worker_extra_mib']:>10,.1f} MiB"
              f"{r['first_round_trainer_extra_mib']:>11,.1f} / "
              f"{r['first_round_worker_extra_mib']:,.1f} MiB"
              f"{'yes' if r['bit_exact'] else 'NO':>11}")
    print(f"\nbytes the workers need (plan.nbytes_min): {plan.nbytes_min / 1e6:,.1f} MB; "
          f"load average {load_start:.1f} -> {load_end:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "methods": rows, "load_average": [load_start, load_end],
            "model": str(checkpoint), "trainer": str(tspec), "inference": plan.destination.spec,
            "nbytes_min": plan.nbytes_min, "model_bytes": model_bytes}, indent=2))
    if not all(r["bit_exact"] for r in rows.values()):
        sys.exit("error: a method wrote wrong bytes")


if __name__ == "__main__":
    main()
