"""FSDP2 trainers: shard to shard vs what RL frameworks do today, time, bytes and memory.

One model, one layout (``fsdp2:dp_shard=4`` trainers -> ``vllm:tp=2``
workers), three ways of getting a live FSDP2 model's weights into vLLM-layout
worker storage, each measured in the same ``T + N`` spawned processes:

* ``m2nkit``      -- ``fsdp2_source(model)`` and ``torch_p2p``: every trainer
  rank sends its own bf16-cast shard's slabs straight to the workers that
  need them (``send_round`` / ``recv_round``); nothing is gathered;
* ``full_tensor`` -- per parameter ``DTensor.full_tensor()`` (an all-gather
  over the FSDP group, on every rank), cast to bf16, trainer rank 0 sends the
  full tensor to every worker, each worker keeps its boxes (what verl and
  OpenRLHF do); the previous tensor's sends stay in flight while the next
  one is gathered;
* ``state_dict``  -- ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)``: the whole model gathered to trainer rank 0, which
  casts and sends tensor after tensor as above.

The trainers are real FSDP2 trainers: the checkpoint loaded with transformers
(fp32 masters), every decoder layer and the root ``fully_shard``-ed over 4
ranks with ``MixedPrecisionPolicy(param_dtype=bf16)`` on the default gloo
group (the gathers of the two baselines run there); transfers run on a
separate stateless gloo group over all ``T + N`` ranks. The workers build
their plan from the dry run of the same spec (``checkpoint_metas`` with
``fsdp2:dp_shard=4``) and the trainers from the live ``fsdp2_source``
manifest; ``agree_on_plan`` proves they are the same before anything moves.

Measured per method, in every process: round time (barriers on the transfer
group around each round; the slowest rank's, median of rounds), bytes on the
wire (point to point, plus the all-gather bytes of the baselines counted as
a ring all-gather sends them: ``T - 1`` padded chunks per tensor, in the
parameters' fp32), and the trainer's **peak extra memory**: ``VmHWM`` over
the rounds minus the RSS just before them (the resident shard, after
``malloc_trim``), the high-water mark reset per method after its first
round (``clear_refs``), so one-time setup (gloo pairs, plan caches) of the
warm-up round is not counted.
After each method every worker's storage is compared bit for bit with
``reference_load`` of the checkpoint (the trainers' fp32 masters are the
bf16 checkpoint upcast, so the bf16 wire must give the checkpoint back).

Goals (issue "FSDP2 trainers"): trainer extra memory of m2nkit at most one
bucket plus one layer's cast copies (the bound printed is computed from the
plan: ``bucket_bytes`` + the largest layer group of this rank's bf16 local
bytes, ``layerwise_groups``); m2nkit at least 3x faster than
``full_tensor``.

    python benchmarks/fsdp2.py [--rounds 3] [--layers 10] [--bucket-mib 16] [--json PATH]

The model (Qwen3, dense, untied, :data:`SIZES`) is built once, randomly
initialised, under the system temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from m2nkit.engine.tools.procs import (collect_ranks, free_port, peak_kib, reset_peak, rss_kib,
                                       trim_heap)

METHODS = ("m2nkit", "full_tensor", "state_dict")
LABELS = {
    "m2nkit": "m2nkit fsdp2_source",
    "full_tensor": "full_tensor/param, rank 0 sends",
    "state_dict": "full state dict on rank 0",
}

#: Qwen3 at about 190 M parameters (10 layers): a round of the slowest
#: method stays within seconds on 2 busy cores, 4 trainers and 2 workers fit
#: in a few GiB. The vocabulary keeps the embedding about one layer's size.
SIZES = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 16384,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
TRAINER = "fsdp2:dp_shard=4"
INFERENCE = "vllm:tp=2"


# --------------------------------------------------------------------------
# one process


def _rank_main(rank: int, cfg: dict, out) -> None:
    try:
        out.put((rank, "ok", _run_rank(rank, cfg)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def _run_rank(rank: int, cfg: dict) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # T + N processes share the machine's cores
    from transformers.utils import logging as hf_logging

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, full_checkpoint_tensors, read_checkpoint
    from m2nkit.adapters.vllm import reference_load, vllm_destination
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.control import agree_on_plan, create_group, wait_work
    from m2nkit.engine.transports.torch_p2p import BucketSchedule
    from m2nkit.manifest.serialize import manifest_to_json

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    T, N, timeout_s = cfg["T"], cfg["N"], cfg["timeout_s"]
    is_trainer = rank < T
    ck = read_checkpoint(cfg["checkpoint"])
    destination = vllm_destination(ck.config, INFERENCE)
    model = source = storage = None
    if is_trainer:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['ports'][1]}",
                                rank=rank, world_size=T, timeout=timedelta(seconds=timeout_s))
        model = _fsdp2_model(cfg["checkpoint"], T)
        from m2nkit.adapters.fsdp2 import fsdp2_source

        source = fsdp2_source(model)
        manifest = manifest_to_json(source.metadata, T)           # the live FSDP2 manifest
    else:
        manifest = manifest_to_json(checkpoint_metas(ck, TRAINER), T)  # the dry run
    plan, _ = plan_from_manifest(manifest, destination)
    _, group = create_group("127.0.0.1", cfg["ports"][0], rank, T + N, timeout_s=timeout_s)
    agree_on_plan(group, rank, T + N, plan, timeout_s=timeout_s)
    schedule = BucketSchedule.build(plan, cfg["bucket_bytes"])
    if not is_trainer:
        storage = allocate_storage(plan.destination, rank - T)
        reference = reference_load(ck.config, full_checkpoint_tensors(ck), INFERENCE, rank - T)
    ck.close()

    def barrier(what: str) -> None:
        wait_work(group.barrier(), timeout_s, f"rank {rank}: barrier {what}")

    report: dict = {"methods": {}}
    if is_trainer:
        report["shard_bytes"] = sum(p.to_local().numel() * p.element_size()
                                    for p in model.parameters())
        report["bound_bytes"] = _memory_bound(plan, rank, cfg["bucket_bytes"])
        report["in_flight_bytes"] = _in_flight_bound(plan, schedule, rank)
    for method in cfg["methods"]:
        times, counts = [], []
        for k in range(cfg["rounds"]):
            if storage is not None:
                for t in storage.values():  # every round must write every byte again
                    if t.dtype.is_floating_point:
                        t.fill_(float("nan"))
                for p in plan.destination.params:  # vLLM's padding rows stay zero
                    if p.worker == rank - T:
                        for z in p.zero_boxes:
                            storage[p.name][tuple(slice(a, b) for a, b in z)] = 0
            trim_heap()
            barrier(f"{method} before round {k}")
            if k == min(1, cfg["rounds"] - 1):  # after a warm-up round (one-time setup)
                peak_reset = reset_peak()
                rss_ready = rss_kib()
            t0 = time.perf_counter()
            with torch.no_grad():
                c = _round(method, group, plan, schedule, rank, model, source, storage,
                           timeout_s)
            barrier(f"{method} after round {k}")
            times.append(time.perf_counter() - t0)
            counts.append(c)
        peak = peak_kib()
        exact = None
        if storage is not None:
            bad = [n for n in storage if not bitwise_equal(storage[n], reference[n])]
            exact = {"ok": not bad, "bad": bad[:3]}
        report["methods"][method] = {"times": times, "counts": counts, "peak": peak,
                                     "rss_ready": rss_ready, "peak_reset": peak_reset,
                                     "exact": exact}
    if is_trainer:
        dist.destroy_process_group()
    return report


def _round(method, group, plan, schedule, rank, model, source, storage, timeout_s) -> dict:
    """One round of ``method`` on this rank; the bytes it moved."""
    from m2nkit.engine.transports.torch_p2p import recv_round, send_round

    T = plan.num_trainer_ranks
    if method == "m2nkit":
        if rank < T:
            return {"sent": send_round(group, plan, schedule, rank, source.iter_local(),
                                       timeout_s=timeout_s), "gathered": 0}
        return {"received": recv_round(group, plan, schedule, rank - T, storage,
                                       timeout_s=timeout_s)[1]}
    if rank < T:
        return _send_gathered(method, group, plan, rank, model, source, timeout_s)
    return {"received": _receive_full(group, plan, rank - T, storage, timeout_s)}


def _fsdp2_model(checkpoint: str, T: int):
    """The checkpoint as an FSDP2 trainer holds it: fp32 masters, bf16 policy, ``fully_shard``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (T,), mesh_dim_names=("dp_shard",))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _memory_bound(plan, rank: int, bucket_bytes: int) -> int:
    """The goal: one bucket plus the largest layer group of this rank's bf16 local bytes."""
    from m2nkit.manifest.groups import layerwise_groups

    local = {}
    for wp in plan.wires:
        shape = wp.meta.local_shape(rank)
        local[wp.name] = 0 if shape is None else _prod(shape) * wp.itemsize
    groups = layerwise_groups(list(local))
    return bucket_bytes + max(sum(local[n] for n in g) for g in groups)


def _in_flight_bound(plan, schedule, rank: int) -> int:
    """What ``send_round`` holds by design: one bucket of this rank's slabs (one
    bucket in flight: staged bytes, or the cast copies its zero-copy sends still
    read) plus the largest cast copy (the provider's bf16 local tensor)."""
    from m2nkit.engine.transports.torch_p2p import link_slabs

    per = []
    for k in range(len(schedule)):
        links = link_slabs(plan, schedule.wires(k), src=rank)
        per.append(sum(s.nbytes for items in links.values() for _, s in items))
    cast = max(_prod(wp.meta.local_shape(rank) or (0,)) * wp.itemsize for wp in plan.wires)
    return max(per, default=0) + cast


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _send_gathered(method: str, group, plan, rank: int, model, source, timeout_s: float) -> dict:
    """A trainer rank's round of ``full_tensor`` or ``state_dict`` (module docstring)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from m2nkit.engine.control import wait_work

    T, N = plan.num_trainer_ranks, plan.num_workers
    params = dict(model.named_parameters())
    gathered = sent = 0
    full_sd = None
    if method == "state_dict":
        full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    in_flight, keep = [], None
    for wi, wp in enumerate(plan.wires):
        name = source.module_names[wp.name][0]
        p = params[name]
        chunk = max(_prod(wp.meta.local_shape(r) or (0,)) for r in range(T)) * p.element_size()
        gathered += (T - 1) * chunk
        if method == "full_tensor":
            full = p.full_tensor().to(wp.meta.dtype)   # every rank: the all-gather
        else:
            full = full_sd[name].to(wp.meta.dtype) if rank == 0 else None
        for work, what in in_flight:
            wait_work(work, timeout_s, what)
        in_flight, keep = [], None
        if rank != 0 or wp.skipped:
            continue
        payload = full.contiguous().reshape(-1).view(torch.uint8)
        for w in range(N):
            in_flight.append((group.send([payload], T + w, wi), f"send of '{wp.name}' to worker {w}"))
            sent += payload.numel()
        keep = payload  # the buffer must outlive its sends
    for work, what in in_flight:
        wait_work(work, timeout_s, what)
    del keep, full_sd
    return {"sent": sent, "gathered": gathered}


def _receive_full(group, plan, worker: int, storage, timeout_s: float) -> int:
    """A worker's round of the two baselines: full tensors from trainer rank 0, keep the boxes."""
    from m2nkit.engine.tools.baseline import gather_then_broadcast_round

    return gather_then_broadcast_round(group, None, plan, plan.num_trainer_ranks + worker,
                                       storage=storage, timeout_s=timeout_s).received


# --------------------------------------------------------------------------
# the parent


def ensure_model(layers: int) -> Path:
    """The benchmark checkpoint (Qwen3 at :data:`SIZES`, ``layers`` layers, seed 0), built once."""
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    out = Path(tempfile.gettempdir()) / "m2nkit-bench" / f"fsdp2-qwen3-{layers}l-seed0"
    if (out / "model.safetensors").is_file():
        return out
    print(f"building the Qwen3 benchmark checkpoint ({layers} layers) in {out} ...",
          file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny_checkpoint(tiny_config("tiny-qwen3", num_hidden_layers=layers, **SIZES), tmp, seed=0)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def run(cfg: dict, deadline_s: float) -> dict[int, dict]:
    """Spawn the ``T + N`` ranks; ``{rank: report}``. Children are always reaped."""
    return collect_ranks(_rank_main, lambda r: (r, cfg), cfg["T"] + cfg["N"], deadline_s)


def summarize(reports: dict[int, dict], method: str, T: int, N: int, payload: int) -> dict:
    """One table row."""
    rs = {r: rep["methods"][method] for r, rep in reports.items()}
    rounds = len(rs[0]["times"])
    per_round = [max(x["times"][k] for x in rs.values()) for k in range(rounds)]
    last = {r: x["counts"][-1] for r, x in rs.items()}
    sent = [last[r]["sent"] for r in range(T)]
    gathered = [last[r]["gathered"] for r in range(T)]
    extra = [(rs[r]["peak"] - rs[r]["rss_ready"]) * 1024 for r in range(T)]
    exact = [rs[T + w]["exact"]["ok"] for w in range(N)]
    median = statistics.median(per_round)
    return {
        "method": method, "label": LABELS[method], "round_s": median, "rounds_s": per_round,
        "p2p_bytes": sum(sent), "gather_bytes": sum(gathered),
        "wire_bytes": sum(sent) + sum(gathered), "p2p_sent_per_rank": sent,
        "received_per_worker": [last[T + w]["received"] for w in range(N)],
        "trainer_extra_bytes": extra, "trainer_extra_max": max(extra),
        "worker_extra_max": max((rs[T + w]["peak"] - rs[T + w]["rss_ready"]) * 1024
                                for w in range(N)),
        "peak_reset": all(x["peak_reset"] for x in rs.values()),
        "bit_exact": all(exact), "useful_gbps": payload / median / 1e9,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=10, help="decoder layers (default 10: ~190 M params)")
    p.add_argument("--bucket-mib", type=float, default=16.0, help="torch_p2p bucket, MiB (default 16)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}, run in this order")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any single wait may take")
    p.add_argument("--json", metavar="PATH", help="write the rows and the setup as JSON")
    args = p.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        sys.exit(f"--methods: choose from {', '.join(METHODS)}")
    if args.rounds < 2 or args.layers < 1:
        sys.exit("--rounds must be >= 2 (the first is a warm-up for the memory peak) and "
                 "--layers >= 1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # a fixed mmap threshold: large buffers come from mmap and go back when freed,
    # so RSS follows what is live (glibc would raise the threshold as they are freed)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    checkpoint = ensure_model(args.layers)
    ck = read_checkpoint(checkpoint)
    plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, TRAINER), 4),
                                 vllm_destination(ck.config, INFERENCE))
    params = sum(wp.meta.nbytes for wp in plan.wires) // 2  # bf16 checkpoint
    T, N = plan.num_trainer_ranks, plan.num_workers
    ck.close()
    cfg = {"checkpoint": str(checkpoint), "T": T, "N": N, "rounds": args.rounds,
           "bucket_bytes": int(args.bucket_mib * 2**20), "timeout_s": args.timeout,
           "methods": methods, "ports": (free_port(), free_port())}
    print(f"Qwen3 {params / 1e6:.0f} M parameters ({args.layers} layers, fp32 masters, bf16 "
          f"wire: {plan.nbytes_min / 1e6:.0f} MB), {TRAINER} -> {INFERENCE}, {args.rounds} "
          f"rounds per method, buckets {args.bucket_mib:g} MiB; load average "
          f"{load_start[0]:.1f} at start, {os.cpu_count()} CPUs", file=sys.stderr, flush=True)
    try:
        reports = run(cfg, deadline_s=args.timeout * (2 + len(methods) * args.rounds))
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    rows = [summarize(reports, m, T, N, plan.nbytes_min) for m in methods]
    bound = max(reports[r]["bound_bytes"] for r in range(T))
    in_flight = max(reports[r]["in_flight_bytes"] for r in range(T))
    shard = max(reports[r]["shard_bytes"] for r in range(T))
    load_end = os.getloadavg()

    print(f"\n{'method':<32} {'round s':>8} {'wire MB':>9} {'p2p MB':>8} {'gather MB':>10} "
          f"{'trainer extra MiB':>18} {'bit-exact':>9}")
    print("-" * 100)
    for r in rows:
        print(f"{r['label']:<32} {r['round_s']:>8.3f} {r['wire_bytes'] / 1e6:>9.1f} "
              f"{r['p2p_bytes'] / 1e6:>8.1f} {r['gather_bytes'] / 1e6:>10.1f} "
              f"{r['trainer_extra_max'] / 2**20:>18.1f} {'yes' if r['bit_exact'] else 'NO':>9}")
    by = {r["method"]: r for r in rows}
    goals = {}
    if "m2nkit" in by:
        goals["memory"] = {"m2nkit_extra_bytes": by["m2nkit"]["trainer_extra_max"],
                           "bound_bytes": bound,
                           "met": by["m2nkit"]["trainer_extra_max"] <= bound}
        print(f"\ntrainer resident shard {shard / 2**20:.0f} MiB (fp32 masters); goal: m2nkit's "
              f"extra <= one bucket + one layer's cast copies = {bound / 2**20:.1f} MiB: "
              f"{by['m2nkit']['trainer_extra_max'] / 2**20:.1f} MiB, "
              f"{'met' if goals['memory']['met'] else 'NOT met'}")
        goals["memory"]["in_flight_bytes"] = in_flight
        print(f"  torch_p2p by design holds one bucket in flight plus the cast copy being "
              f"sent: {in_flight / 2**20:.1f} MiB on the busiest rank for this plan")
    if "m2nkit" in by and "full_tensor" in by:
        speedup = by["full_tensor"]["round_s"] / by["m2nkit"]["round_s"]
        goals["time"] = {"speedup_vs_full_tensor": speedup, "met": speedup >= 3}
        print(f"goal: m2nkit >= 3x faster than full_tensor per parameter: {speedup:.1f}x, "
              f"{'met' if goals['time']['met'] else 'NOT met'}")
    print(f"load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at the end; "
          f"{time.perf_counter() - t_start:.0f} s in all")
    if not all(r["bit_exact"] for r in rows):
        sys.exit("error: a method left a worker different from reference_load")
    if args.json:
        doc = {"model": {"family": "Qwen3ForCausalLM", "parameters": params, "layers": args.layers,
                         "sizes": SIZES, "checkpoint": str(checkpoint)},
               "trainer": TRAINER, "inference": INFERENCE, "rounds": args.rounds,
               "bucket_bytes": cfg["bucket_bytes"], "payload_bytes": plan.nbytes_min,
               "trainer_shard_bytes": shard, "load_average": [load_start[0], load_end[0]],
               "cpus": os.cpu_count(), "rows": rows, "goals": goals}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
