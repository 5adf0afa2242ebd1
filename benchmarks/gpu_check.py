"""Does the nccl_m2n transport move the right bytes on real GPUs, and how fast?

Builds a tiny checkpoint (``m2nkit.adapters.tiny``), then for each scenario
``TRAINER/INFERENCE`` (e.g. ``fsdp:2/vllm:tp=2``) runs T trainer processes
and N worker processes, one communicator over all of them: ``nccl.m2n``
reshards for the wire tensors the plan allows, ``torch_p2p`` over an
``nccl``-backend group for the rest. Every worker byte is compared with
``m2nkit.adapters.vllm.reference_load`` (vLLM's loaders on the full
checkpoint) after every round, and once more after a round that sends
everything through ``torch_p2p`` alone, for comparison. Prints a table.

    python benchmarks/gpu_check.py                 # GPU machine, < 5 minutes
    python benchmarks/gpu_check.py --dry-run       # any machine, no GPU: plans, an
                                                   # in-process byte check, and the
                                                   # nccl.m2n descriptors if it imports

``--dry-run`` does everything that needs no GPU: it builds each scenario's
plan, prints which tensors each transport would carry (and why not
``nccl.m2n``), executes the plan in this process and compares every worker
byte with vLLM's loaders. Where ``nccl.m2n`` imports (``m2nkit[nccl]``; no
driver needed) it also builds the real descriptors and moves the m2n
tensors as they describe; where it does not, it says so and moves every
tensor slab by slab. It ends by listing what it skipped.

One rank per GPU when there are enough GPUs. With fewer (one H200, say)
``--share-gpu auto`` puts several ranks on one device: NCCL refuses two
ranks of one communicator on the same GPU of one host ("Duplicate GPU
detected"), so each rank gets its own ``NCCL_HOSTID`` (with
``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``) and NCCL treats the ranks
as separate hosts talking over its socket transport. That is
experimental — if nccl.m2n does not run that way, the scenario fails with
NCCL's message and the table says so. Exit status: 0 all verified, 1 a
failure, 2 bad arguments or nothing could run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

DEFAULT_SCENARIOS = (
    "replicated:1/vllm:tp=1",
    "fsdp:2/vllm:tp=2",
    "fsdp:2/vllm:tp=2,dp=2,ep",
    "hsdp:2,2/vllm:tp=2,dp=2",
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_s(s: float | None) -> str:
    return "-" if s is None else (f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s")


def _parse_scenario(text: str):
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import parse_inference_spec

    trainer, sep, inference = text.partition("/")
    if not sep or not trainer.strip() or not inference.strip():
        raise ValueError(f"scenario {text!r} must be TRAINER/INFERENCE, e.g. 'fsdp:2/vllm:tp=2'")
    return parse_trainer_spec(trainer.strip()), parse_inference_spec(inference.strip())


def _build(ckpt_dir: str, tspec, ispec):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import destination_layout
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest.serialize import manifest_digest

    ck = read_checkpoint(ckpt_dir)
    metas = checkpoint_metas(ck, tspec)
    dest = destination_layout(ck.config, metas, ispec)
    return ck, build_plan(metas, tspec.num_ranks, dest,
                          manifest_digest=manifest_digest(metas, tspec.num_ranks))


def _compare(ck, ispec, plan, worker: int, storage) -> list[str]:
    """Names of this worker's parameters that differ from vLLM's loaders."""
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.local import bitwise_equal

    ref = reference_load(ck.config, full_checkpoint_tensors(ck), ispec, worker)
    got = {k: v.cpu() for k, v in storage.items()}
    aliases = plan.destination.aliases
    return sorted(n for n, t in ref.items()
                  if n not in aliases and (n not in got or not bitwise_equal(got[n], t)))


# --------------------------------------------------------------------------
# dry run: plans, an in-process byte check, and descriptors where nccl.m2n imports (CPU)


def _simulate(ck, tspec, ispec, plan, calls) -> list[str]:
    """Move every m2n wire as its descriptors say and the rest by slabs, in one
    process; return the (worker, param) pairs that differ from vLLM's loaders."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest
    from m2nkit.engine.local import allocate_storage, execute_plan
    from m2nkit.engine.transports.nccl_m2n import destination_view, sub_plan

    T, N = plan.num_trainer_ranks, plan.num_workers
    storage = {w: allocate_storage(plan.destination, w) for w in range(N)}
    rest = [i for i in range(len(plan.wires)) if i not in calls]
    names = {plan.wires[i].name for i in rest}
    streams = {r: ((n, t) for n, t in checkpoint_manifest(ck, tspec, r).iter_local() if n in names)
               for r in range(T)}
    execute_plan(sub_plan(plan, rest), streams, storage)
    for wi, c in calls.items():
        full = ck.read_full(c.name)
        for rank in c.dst_ranks:
            view = destination_view(plan, wi, rank - T, storage[rank - T])
            view.copy_(full[tuple(slice(a, b) for a, b in c.dst_box(rank))])
    return [f"worker {w}: {n}" for w in range(N) for n in _compare(ck, ispec, plan, w, storage[w])]


def dry_run(ckpt_dir: str, scenarios, m2n=None) -> bool:
    """Plan, route and byte-check every scenario in this process; True when all verify.

    ``m2n`` is the imported ``nccl.m2n`` module, or ``None`` where it does
    not import: then no descriptor is built and every tensor, the m2n ones
    included, is moved slab by slab for the byte check.
    """
    from m2nkit.engine.transports.nccl_m2n import (CARRIER_M2N, CARRIER_P2P, m2n_descriptors,
                                                   plan_segments, wire_carrier)

    ok = True
    rows = []
    for text, tspec, ispec in scenarios:
        ck, plan = _build(ckpt_dir, tspec, ispec)
        if plan.problems:
            print(f"{text}: plan problems: {plan.problems[:3]}")
            ok = False
            continue
        m2n_wires = [i for i, w in enumerate(plan.wires) if wire_carrier(w) == CARRIER_M2N]
        calls = {} if m2n is None else {i: m2n_descriptors(plan, i, m2n=m2n) for i in m2n_wires}
        p2p = [w for w in plan.wires if wire_carrier(w) == CARRIER_P2P]
        bad = _simulate(ck, tspec, ispec, plan, calls)
        ok &= not bad
        label = text.replace("/", " -> ")
        rows.append((label, plan.num_trainer_ranks + plan.num_workers, len(m2n_wires),
                     _fmt_bytes(sum(plan.wires[i].nbytes_moved for i in m2n_wires)),
                     f"{len(calls)} checked" if m2n is not None else "skipped", len(p2p),
                     _fmt_bytes(sum(w.nbytes_moved for w in p2p)), len(plan_segments(plan)),
                     "ok" if not bad else f"{len(bad)} differ: {bad[:2]}"))
        reasons = sorted({w.verdict("nccl_m2n").reason for w in p2p})
        for r in reasons:
            print(f"  {label}: torch_p2p because {r}")
    head = ("scenario", "ranks", "nccl_m2n tensors", "nccl_m2n bytes", "descriptors",
            "torch_p2p tensors", "torch_p2p bytes", "segments", "in-process byte check")
    how = ("m2n tensors moved as their nccl.m2n descriptors say, the rest slab by slab"
           if m2n is not None else "every tensor moved slab by slab (no nccl.m2n descriptors)")
    _table(f"dry run (no GPU work): {how}; every worker byte vs vLLM's loaders", head, rows)
    return ok


# --------------------------------------------------------------------------
# GPU run: one process per rank


def _rank_main(cfg: dict) -> None:
    """One trainer or worker rank; writes ``{rank}.json`` into ``cfg['out']``."""
    os.environ.update(cfg["env"])          # before NCCL initialises in this process
    rank, world = cfg["rank"], cfg["world"]
    result: dict = {"rank": rank}
    try:
        import torch

        from m2nkit.adapters.hf_checkpoint import checkpoint_manifest
        from m2nkit.engine.local import allocate_storage
        from m2nkit.engine.transports import torch_p2p
        from m2nkit.engine.transports.nccl_m2n import NcclM2NTransport

        tspec, ispec = _parse_scenario(cfg["scenario"])
        dev = torch.device("cuda", cfg["device"])
        torch.cuda.set_device(dev)
        store, group = torch_p2p.create_group("127.0.0.1", cfg["port"], rank, world,
                                              timeout_s=cfg["timeout"], backend="nccl")
        ck, plan = _build(cfg["ckpt"], tspec, ispec)
        T = plan.num_trainer_ranks
        transport = NcclM2NTransport.connect(store, group, rank, world, device=dev,
                                             timeout_s=cfg["timeout"],
                                             bucket_bytes=cfg["bucket_bytes"])
        result["role"] = "trainer" if rank < T else "worker"

        def storage_on_gpu(w):
            return {k: v.to(dev) for k, v in allocate_storage(plan.destination, w).items()}

        rounds = []
        for _ in range(cfg["rounds"]):
            if rank < T:
                rep = transport.send_round(plan, rank, checkpoint_manifest(ck, tspec, rank).iter_local())
                rounds.append({**rep.__dict__, "bad": []})
            else:
                storage = storage_on_gpu(rank - T)
                _, rep = transport.recv_round(plan, rank - T, storage)
                rounds.append({**rep.__dict__, "bad": _compare(ck, ispec, plan, rank - T, storage)})
        result["rounds"] = rounds

        # The same plan through torch_p2p alone, for comparison.
        schedule = torch_p2p.BucketSchedule.build(plan, cfg["bucket_bytes"])
        t0 = time.perf_counter()
        if rank < T:
            n = torch_p2p.send_round(group, plan, schedule, rank,
                                     checkpoint_manifest(ck, tspec, rank).iter_local(),
                                     timeout_s=cfg["timeout"], device=dev)
            torch.cuda.synchronize(dev)
            result["p2p_only"] = {"seconds": time.perf_counter() - t0, "bytes": n, "bad": []}
        else:
            storage = storage_on_gpu(rank - T)
            t0 = time.perf_counter()
            _, n = torch_p2p.recv_round(group, plan, schedule, rank - T, storage,
                                        timeout_s=cfg["timeout"], device=dev)
            torch.cuda.synchronize(dev)
            result["p2p_only"] = {"seconds": time.perf_counter() - t0, "bytes": n,
                                  "bad": _compare(ck, ispec, plan, rank - T, storage)}
        transport.close()
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            shutdown()
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        Path(cfg["out"], f"{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_scenario(text, tspec, ispec, ckpt_dir, devices, env_per_rank, args, out_dir) -> list[dict]:
    import multiprocessing as mp

    world = tspec.num_ranks + ispec.num_workers
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = []
    for r in range(world):
        cfg = {"rank": r, "world": world, "scenario": text, "ckpt": ckpt_dir, "port": port,
               "device": devices[r], "env": env_per_rank[r], "timeout": args.timeout,
               "rounds": args.rounds, "bucket_bytes": args.bucket_bytes, "out": str(out_dir)}
        p = ctx.Process(target=_rank_main, args=(cfg,), daemon=True)
        p.start()
        procs.append(p)
    deadline = time.monotonic() + args.scenario_timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        killed = p.is_alive()
        if killed:             # a process this script started; stop only it
            p.kill()
            p.join()
        f = Path(out_dir, f"{r}.json")
        if f.exists():
            results.append(json.loads(f.read_text()))
        elif killed:
            results.append({"rank": r, "error": f"still running after --scenario-timeout "
                                                f"{args.scenario_timeout:g} s; killed"})
        else:
            results.append({"rank": r, "error": f"exited with code {p.exitcode} and no result"})
    return results


def _row(text, world, placement, results, T):
    errors = [f"rank {x['rank']}: {x['error']}" for x in results if "error" in x]
    if errors:
        return (text, world, placement, "-", "-", "-", "-", "-", "-", "-", f"FAILED {errors[0][:160]}"), errors
    workers = results[T:]
    first = [x["rounds"][0] for x in workers]
    rounds = len(results[0]["rounds"])
    secs = [max(x["rounds"][k]["seconds"] for x in results) for k in range(rounds)]
    bad = [(x["rank"], k, b) for x in workers for k, rd in enumerate(x["rounds"]) for b in rd["bad"]]
    bad += [(x["rank"], "p2p-only", b) for x in workers for b in x["p2p_only"]["bad"]]
    verified = f"{len(workers)}/{len(workers)} workers ok" if not bad else f"MISMATCH {bad[:3]}"
    return (text, world, placement, first[0]["m2n_tensors"], _fmt_bytes(sum(f["m2n_bytes"] for f in first)),
            first[0]["p2p_tensors"], _fmt_bytes(sum(f["p2p_bytes"] for f in first)),
            _fmt_s(secs[0]), _fmt_s(secs[-1]) if rounds > 1 else "-",
            _fmt_s(max(x["p2p_only"]["seconds"] for x in results)), verified), \
        [f"rank {r} round {k}: {b}" for r, k, b in bad]


def gpu_run(ckpt_dir: str, scenarios, args) -> bool:
    import torch

    from m2nkit.engine.transports.nccl_m2n import import_nccl_m2n

    gpus = torch.cuda.device_count()
    m2n, core = import_nccl_m2n()
    try:                     # the libraries load and a handle can be made on this driver
        handle = m2n.init()
        handle.destroy()
        print(f"nccl.m2n handle ok; NCCL {core.get_version()}; {gpus} GPU(s): "
              f"{torch.cuda.get_device_name(0)}")
    except Exception as e:
        print(f"nccl.m2n cannot initialise here: {type(e).__name__}: {e}")
        return False
    ok = True
    rows, notes = [], []
    for text, tspec, ispec in scenarios:
        world = tspec.num_ranks + ispec.num_workers
        if world <= gpus:
            devices, envs, placement = list(range(world)), [{} for _ in range(world)], "1 rank/GPU"
        elif args.share_gpu == "no":
            rows.append((text, world, f"needs {world} GPUs", *["-"] * 7, "SKIPPED (--share-gpu no)"))
            continue
        else:
            devices = [r % gpus for r in range(world)]
            # Each rank its own "host": NCCL then talks over sockets on loopback.
            envs = [{"NCCL_HOSTID": f"m2nkit-gpu-check-rank{r}", "NCCL_SOCKET_IFNAME": "lo",
                     "NCCL_IB_DISABLE": "1"} for r in range(world)]
            placement = f"{world} ranks on {gpus} GPU(s), NCCL_HOSTID per rank"
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            results = _run_scenario(text, tspec, ispec, ckpt_dir, devices, envs, args, out)
            row, problems = _row(text, world, placement, results, tspec.num_ranks)
            print(f"{text}: {time.perf_counter() - t0:.1f} s")
        rows.append(row)
        if problems:
            ok = False
            notes += [f"{text}: {p}" for p in problems[:5]]
            for x in results:
                if "traceback" in x:
                    notes.append(f"{text} rank {x['rank']} traceback:\n{x['traceback']}")
                    break
    head = ("scenario", "ranks", "placement", "nccl_m2n tensors", "nccl_m2n bytes (workers)",
            "torch_p2p tensors", "torch_p2p bytes (workers)", "round 1", "last round",
            "torch_p2p only", "verified")
    _table("GPU run: nccl_m2n + torch_p2p(nccl), every worker byte vs vLLM's loaders", head, rows)
    for n in notes:
        print(n)
    ran = [r for r in rows if not str(r[-1]).startswith("SKIPPED")]
    if not ran:
        print("nothing ran: every scenario needs more GPUs (try --share-gpu auto)")
        return False
    if ok and all(str(r[-1]).endswith("workers ok") for r in ran):
        print("every worker byte matches vLLM's loaders")
        return True
    return False


def _table(title, head, rows) -> None:
    cells = [tuple(str(c) for c in head)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    print(title)
    for k, r in enumerate(cells):
        print("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)))
        if k == 0:
            print("  " + "-+-".join("-" * w for w in widths))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU work, any machine: plans, an in-process byte check, and the "
                        "nccl.m2n descriptors where nccl.m2n imports")
    p.add_argument("--scenario", action="append", metavar="TRAINER/INFERENCE",
                   help=f"repeatable; default: {', '.join(DEFAULT_SCENARIOS)}")
    p.add_argument("--model", default="tiny-qwen3-moe", help="built-in tiny model (m2nkit.adapters.tiny)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any single wait may take")
    p.add_argument("--scenario-timeout", type=float, default=150.0,
                   help="seconds one scenario's processes may run in all")
    p.add_argument("--rounds", type=int, default=2, help="rounds per scenario (the first warms up)")
    p.add_argument("--bucket-bytes", type=int, default=1 << 20, help="torch_p2p bucket size")
    p.add_argument("--share-gpu", choices=("auto", "no"), default="auto",
                   help="auto: put several ranks on one GPU when there are too few (experimental)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    for name in ("timeout", "scenario_timeout", "rounds", "bucket_bytes"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    try:
        scenarios = [(t, *_parse_scenario(t)) for t in (args.scenario or DEFAULT_SCENARIOS)]
    except ValueError as e:
        p.error(str(e))
    from transformers.utils import logging as hf_logging

    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS, save_tiny_checkpoint
    from m2nkit.engine.transports.nccl_m2n import NcclM2NUnavailableError, import_nccl_m2n

    if args.model not in BUILTIN_TINY_MODELS:
        p.error(f"--model {args.model!r} is not a built-in tiny model; choose from "
                f"{sorted(BUILTIN_TINY_MODELS)}")
    try:
        m2n, _ = import_nccl_m2n()
        no_m2n = None
    except NcclM2NUnavailableError as e:
        if not args.dry_run:          # the GPU run needs it; say so before any work
            print(f"gpu_check: {e}", file=sys.stderr)
            return EXIT_USAGE
        m2n, no_m2n = None, str(e)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(save_tiny_checkpoint(args.model, Path(tmp) / args.model, seed=0))
        ok = dry_run(ckpt, scenarios, m2n)
        if args.dry_run:
            print("skipped (--dry-run): the GPU run (one process per rank, nccl.m2n reshards "
                  "and torch_p2p over NCCL); run without --dry-run on a GPU machine")
            if no_m2n:
                print(f"skipped: the nccl.m2n descriptors, because {no_m2n}")
            print("dry run: every worker byte matches vLLM's loaders" if ok else
                  "dry run: FAILED (see the table)")
            return EXIT_OK if ok else EXIT_FAILED
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: only --dry-run can run", file=sys.stderr)
            return EXIT_USAGE
        return EXIT_OK if gpu_run(ckpt, scenarios, args) and ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
