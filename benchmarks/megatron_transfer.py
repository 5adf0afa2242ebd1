"""Megatron-Core trainers: shard to shard vs gather-per-tensor-then-send, time, bytes and memory.

One MoE model (Qwen3-MoE, :data:`SIZES`; ``--model deepseek-v3``: DeepSeek-V3 with
MLA, :data:`DEEPSEEK_SIZES`), real Megatron-Core ``GPTModel``
trainers built and loaded through Megatron-Bridge (4 gloo ranks, local layer
spec, CPU), ``vllm:tp=2,ep`` stand-in workers, and a list of methods
(:data:`METHODS`; each is a row, and a row is a trainer function and a worker
function, so more can be appended):

* ``m2nkit``  -- ``megatron_source(model)`` and torch_p2p: every trainer rank
  sends the slabs of its own local tensors (fused QKV rows, ``[gate_r;
  up_r]``, local experts) straight to the workers that need them; nothing
  is gathered;
* ``export``  -- what RL stacks on Megatron do today: Megatron-Bridge's
  ``export_hf_weights`` on every trainer rank (a gather over TP, EP and a
  broadcast over PP per tensor, Bridge ``model_bridge.py``), and trainer rank 0
  sends each full tensor to every worker as it comes out (experts of one
  layer are stacked into the wire tensor first); the workers keep their boxes.

Both run in the same ``T + N`` spawned processes, over one stateless gloo
group for the transfers (the trainers' default group carries Megatron's own
collectives). Per method and round: round time (barriers around it; the
slowest rank, median of rounds), bytes on the wire (point to point, plus
the bytes the export's collectives move: ``(k-1) * bytes`` per all-gather
contribution and per broadcast root, counted by wrapping
``torch.distributed``'s calls during the export), and the trainer's peak
extra memory (``VmHWM`` over the measured rounds minus the RSS just before,
after a warm-up round; ``m2nkit.engine.tools.procs.peak_kib``). After each method every
worker's storage is compared bit for bit with ``reference_load`` of the
checkpoint (the trainers send the weights Bridge loaded, unchanged).

    python benchmarks/megatron_transfer.py [--model qwen3-moe|deepseek-v3] [--layouts tp2pp2,tp2ep2]
        [--rounds 3] [--json PATH]

The checkpoint is built once, randomly initialised, under the system temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from m2nkit.engine.tools.procs import (collect_ranks, free_port, peak_kib, reset_peak, rss_kib,
                                       trim_heap)

INFERENCE = "vllm:tp=2,ep"
#: layout label -> (trainer spec, tp, pp, ep)
LAYOUTS = {"tp2pp2": ("megatron:tp=2,pp=2", 2, 2, 1),
           "tp2ep2": ("megatron:tp=2,ep=2", 2, 1, 2)}

#: Qwen3-MoE at about 100 M parameters: 4 layers of 32 experts (75 M), a
#: 16 K vocabulary (untied: 17 M), attention 3 M. (transformers 5 names the
#: expert count ``num_local_experts`` for Qwen3-MoE.)
SIZES = {
    "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "moe_intermediate_size": 384, "intermediate_size": 1024, "num_local_experts": 32,
    "num_experts_per_tok": 4, "vocab_size": 16384,
}
LAYERS = 4

#: DeepSeek-V3 (MLA, layer 0 dense, 3 MoE layers of 32 experts and a shared expert, the
#: fp32 expert bias) at about 100 M parameters too; built on CPU with the stand-in for
#: MLA's parameterless core attention (docs/megatron.md, Limits).
DEEPSEEK_SIZES = {
    "hidden_size": 512, "num_attention_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128,
    "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "qk_head_dim": 96, "v_head_dim": 64,
    "moe_intermediate_size": 384, "intermediate_size": 1024, "n_routed_experts": 32,
    "num_experts_per_tok": 4, "vocab_size": 16384,
}
#: --model -> (tiny model it is built from, sizes, architecture, label)
MODELS = {"qwen3-moe": ("tiny-qwen3-moe", SIZES, "Qwen3MoeForCausalLM", "Qwen3-MoE"),
          "deepseek-v3": ("tiny-deepseek-v3", DEEPSEEK_SIZES, "DeepseekV3ForCausalLM",
                          "DeepSeek-V3 (MLA)")}


@dataclass(frozen=True)
class Method:
    """A row: ``trainer(ctx) -> {"sent", "gathered"}`` and ``worker(ctx) -> {"received"}``."""

    name: str
    label: str
    trainer: Callable
    worker: Callable


# --------------------------------------------------------------------------
# methods


def _m2nkit_trainer(ctx) -> dict:
    from m2nkit.engine.transports.torch_p2p import send_round

    return {"sent": send_round(ctx.group, ctx.plan, ctx.schedule, ctx.rank,
                               ctx.source.iter_local(), timeout_s=ctx.timeout_s), "gathered": 0}


def _m2nkit_worker(ctx) -> dict:
    from m2nkit.engine.transports.torch_p2p import recv_round

    return {"received": recv_round(ctx.group, ctx.plan, ctx.schedule, ctx.rank - ctx.T,
                                   ctx.storage, timeout_s=ctx.timeout_s)[1]}


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _export_trainer(ctx) -> dict:
    """Bridge's export on every rank; rank 0 sends each full wire tensor to every worker."""
    import torch

    from m2nkit.engine.control import wait_work

    index = {wp.name: wi for wi, wp in enumerate(ctx.plan.wires)}
    pending: dict[str, dict] = {}
    sent = 0
    in_flight: list = []
    with _CountCollectives() as counted:
        for name, t in ctx.bridge.export_hf_weights(ctx.model, cpu=True, show_progress=False):
            if ctx.rank != 0:
                continue
            m = _EXPERT.match(name)
            if m:  # Bridge names experts one by one; the wire stacks them per layer
                block, e, part = m.group(1), int(m.group(2)), m.group(3)
                wire = f"{block}.{'down_proj' if part == 'down' else 'gate_up_proj'}.weight"
                got = pending.setdefault(wire, {})
                got[(e, part)] = t
                E = ctx.plan.wires[index[wire]].meta.shape[0]
                if len(got) < E * (1 if part == "down" else 2):
                    continue
                full = torch.stack([got[(i, "down")] if part == "down" else
                                    torch.cat([got[(i, "gate")], got[(i, "up")]])
                                    for i in range(E)])
                del pending[wire]
            else:
                wire, full = name, t
            wi = index[wire]
            wp = ctx.plan.wires[wi]
            payload = full.to(wp.meta.dtype).contiguous().reshape(-1).view(torch.uint8)
            done = [w for w in in_flight if w[0].is_completed()]
            for work, what, _ in done:
                wait_work(work, ctx.timeout_s, what)
            in_flight = [w for w in in_flight if w not in done]
            for w in range(ctx.N):
                in_flight.append((ctx.group.send([payload], ctx.T + w, wi),
                                  f"send of '{wire}' to worker {w}", payload))
                sent += payload.numel()
    for work, what, _ in in_flight:
        wait_work(work, ctx.timeout_s, what)
    if pending:
        raise RuntimeError(f"export left experts unstacked: {sorted(pending)[:3]}")
    return {"sent": sent, "gathered": counted.bytes}


def _export_worker(ctx) -> dict:
    """Every wire tensor in full from trainer rank 0, in whatever order it comes; keep the boxes."""
    import torch

    from m2nkit.engine.control import wait_work
    from m2nkit.manifest.pieces import box_slices

    worker = ctx.rank - ctx.T
    posted = []
    for wi, wp in enumerate(ctx.plan.wires):
        if wp.skipped:
            continue
        buf = torch.empty(wp.meta.nbytes, dtype=torch.uint8)
        posted.append((wi, buf, ctx.group.recv([buf], 0, wi)))
    received = 0
    for wi, buf, work in posted:
        wp = ctx.plan.wires[wi]
        wait_work(work, ctx.timeout_s, f"worker {worker}: receive of '{wp.name}'")
        received += buf.numel()
        full = buf.view(wp.meta.dtype).view(wp.meta.shape)
        for b in wp.bindings:
            if b.worker == worker:
                ctx.storage[b.param][box_slices(b.region)].copy_(full[box_slices(b.box)])
    return {"received": received}


class _CountCollectives:
    """Bytes this rank's ``torch.distributed`` collectives send, as flat algorithms do:
    ``(k-1) * input`` per all-gather, ``(k-1) * tensor`` per broadcast root."""

    NAMES = ("all_gather", "all_gather_into_tensor", "broadcast")

    def __enter__(self):
        import torch.distributed as dist

        self.bytes = 0
        self._saved = {n: getattr(dist, n) for n in self.NAMES}

        def count(name, f):
            def wrapped(*a, **k):
                group = k.get("group")
                size = dist.get_world_size(group)
                if name == "broadcast":
                    t, src = a[0], k.get("src", a[1] if len(a) > 1 else None)
                    if src == dist.get_rank():
                        self.bytes += (size - 1) * t.numel() * t.element_size()
                else:
                    t = a[1] if len(a) > 1 else k.get("tensor", k.get("input_tensor"))
                    self.bytes += (size - 1) * t.numel() * t.element_size()
                return f(*a, **k)
            return wrapped

        for n, f in self._saved.items():
            setattr(dist, n, count(n, f))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, f in self._saved.items():
            setattr(dist, n, f)


METHODS: list[Method] = [
    Method("m2nkit", "m2nkit megatron_source", _m2nkit_trainer, _m2nkit_worker),
    Method("export", "export_hf_weights, rank 0 sends", _export_trainer, _export_worker),
]


# --------------------------------------------------------------------------
# one process


@dataclass
class _Ctx:
    rank: int
    T: int
    N: int
    group: object
    plan: object
    schedule: object
    timeout_s: float
    bridge: object = None
    model: object = None
    source: object = None
    storage: dict | None = None


def _rank_main(rank: int, cfg: dict, out) -> None:
    try:
        out.put((rank, "ok", _run_rank(rank, cfg)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


def _run_rank(rank: int, cfg: dict) -> dict:
    import contextlib
    import logging
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from m2nkit.adapters.megatron.compat import enable_cpu

    torch.set_num_threads(1)
    enable_cpu()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from m2nkit.adapters.hf_checkpoint import (checkpoint_metas, full_checkpoint_tensors,
                                               read_checkpoint)
    from m2nkit.adapters.vllm import reference_load, vllm_destination
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.control import agree_on_plan, create_group, wait_work
    from m2nkit.engine.transports.torch_p2p import BucketSchedule
    from m2nkit.manifest.serialize import manifest_to_json

    T, N, timeout_s = cfg["T"], cfg["N"], cfg["timeout_s"]
    spec, tp, pp, ep = LAYOUTS[cfg["layout"]]
    ck = read_checkpoint(cfg["checkpoint"])
    destination = vllm_destination(ck.config, INFERENCE)
    ctx_extra: dict = {}
    if rank < T:
        from m2nkit.adapters import megatron_source
        from m2nkit.engine.tools.demo_bridge import build_bridge_model, init_megatron

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['ports'][1]}",
                                rank=rank, world_size=T, timeout=timedelta(seconds=timeout_s))
        init_megatron(tp, pp, ep)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            bridge, model = build_bridge_model(cfg["checkpoint"], tp, pp, ep)
        source = megatron_source(model, config=bridge.hf_pretrained.config)
        manifest = manifest_to_json(source.metadata, T)              # the live manifest
        ctx_extra = {"bridge": bridge, "model": model, "source": source}
    else:
        manifest = manifest_to_json(checkpoint_metas(ck, spec), T)  # the dry run
    plan, _ = plan_from_manifest(manifest, destination)
    _, group = create_group("127.0.0.1", cfg["ports"][0], rank, T + N, timeout_s=timeout_s)
    agree_on_plan(group, rank, T + N, plan, timeout_s=timeout_s)  # live == dry run, or refuse
    schedule = BucketSchedule.build(plan, cfg["bucket_bytes"])
    if rank >= T:
        ctx_extra["storage"] = allocate_storage(plan.destination, rank - T)
        reference = reference_load(ck.config, full_checkpoint_tensors(ck), INFERENCE, rank - T)
    ck.close()
    ctx = _Ctx(rank, T, N, group, plan, schedule, timeout_s, **ctx_extra)

    def barrier(what: str) -> None:
        wait_work(group.barrier(), timeout_s, f"rank {rank}: barrier {what}")

    report: dict = {"methods": {}}
    if rank < T:
        report["shard_bytes"] = sum(p.numel() * p.element_size() for c in ctx.model
                                    for p in c.parameters())
    methods = {m.name: m for m in METHODS}
    for name in cfg["methods"]:
        m = methods[name]
        times, counts, rss_ready, peak_reset = [], [], 0, False
        for k in range(cfg["rounds"]):
            if ctx.storage is not None:
                for t in ctx.storage.values():  # every round must write every byte again
                    if t.dtype.is_floating_point:
                        t.fill_(float("nan"))
                for p in plan.destination.params:  # vLLM's padding rows stay zero
                    if p.worker == rank - T:
                        for z in p.zero_boxes:
                            ctx.storage[p.name][tuple(slice(a, b) for a, b in z)] = 0
            trim_heap()
            barrier(f"{name} before round {k}")
            if k == min(1, cfg["rounds"] - 1):  # after a warm-up round (one-time setup)
                peak_reset = reset_peak()
                rss_ready = rss_kib()
            t0 = time.perf_counter()
            with torch.no_grad():
                c = m.trainer(ctx) if rank < T else m.worker(ctx)
            barrier(f"{name} after round {k}")
            times.append(time.perf_counter() - t0)
            counts.append(c)
        exact = None
        if ctx.storage is not None:
            bad = [n for n in ctx.storage if not bitwise_equal(ctx.storage[n], reference[n])]
            exact = {"ok": not bad, "bad": bad[:3]}
        report["methods"][name] = {"times": times, "counts": counts, "peak": peak_kib(),
                                   "rss_ready": rss_ready, "peak_reset": peak_reset,
                                   "exact": exact}
    if rank < T:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return report


# --------------------------------------------------------------------------
# the parent


def ensure_model(model: str = "qwen3-moe") -> Path:
    """The benchmark checkpoint (:data:`MODELS`: its sizes, :data:`LAYERS` layers, seed 0)."""
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    tiny, sizes, _, label = MODELS[model]
    name = "qwen3moe" if model == "qwen3-moe" else model
    out = Path(tempfile.gettempdir()) / "m2nkit-bench" / f"megatron-{name}-{LAYERS}l-seed0"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    print(f"building the {label} benchmark checkpoint in {out} ...", file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny_checkpoint(tiny_config(tiny, num_hidden_layers=LAYERS, **sizes), tmp, seed=0)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def summarize(reports: dict[int, dict], method: Method, layout: str, T: int, N: int,
              payload: int) -> dict:
    """One table row."""
    rs = {r: rep["methods"][method.name] for r, rep in reports.items()}
    rounds = len(rs[0]["times"])
    per_round = [max(x["times"][k] for x in rs.values()) for k in range(rounds)]
    last = {r: x["counts"][-1] for r, x in rs.items()}
    sent = [last[r]["sent"] for r in range(T)]
    gathered = [last[r]["gathered"] for r in range(T)]
    extra = [(rs[r]["peak"] - rs[r]["rss_ready"]) * 1024 for r in range(T)]
    median = statistics.median(per_round)
    return {
        "layout": layout, "trainer": LAYOUTS[layout][0], "method": method.name,
        "label": method.label, "round_s": median, "rounds_s": per_round,
        "p2p_bytes": sum(sent), "gather_bytes": sum(gathered),
        "wire_bytes": sum(sent) + sum(gathered), "p2p_sent_per_rank": sent,
        "received_per_worker": [last[T + w]["received"] for w in range(N)],
        "trainer_extra_bytes": extra, "trainer_extra_max": max(extra),
        "peak_reset": all(x["peak_reset"] for x in rs.values()),
        "bit_exact": all(rs[T + w]["exact"]["ok"] for w in range(N)),
        "payload_bytes": payload,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated subset of {','.join(LAYOUTS)}")
    p.add_argument("--methods", default=",".join(m.name for m in METHODS),
                   help="comma-separated subset of the methods, run in this order")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mib", type=float, default=16.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any single wait may take")
    p.add_argument("--json", metavar="PATH", help="write the rows and the setup as JSON")
    p.add_argument("--model", default="qwen3-moe", choices=sorted(MODELS),
                   help="the benchmark model (default: qwen3-moe)")
    args = p.parse_args()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    names = [x.strip() for x in args.methods.split(",") if x.strip()]
    known = {m.name: m for m in METHODS}
    if not layouts or any(x not in LAYOUTS for x in layouts):
        sys.exit(f"--layouts: choose from {', '.join(LAYOUTS)}")
    if not names or any(x not in known for x in names):
        sys.exit(f"--methods: choose from {', '.join(known)}")
    if args.rounds < 2:
        sys.exit("--rounds must be >= 2 (the first is a warm-up for the memory peak)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # RSS follows live buffers

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    checkpoint = ensure_model(args.model)
    _, sizes, arch, model_label = MODELS[args.model]
    rows = []
    for layout in layouts:
        ck = read_checkpoint(checkpoint)
        plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, LAYOUTS[layout][0]), 4),
                                     vllm_destination(ck.config, INFERENCE))
        params = sum(wp.meta.nbytes for wp in plan.wires) // 2  # bf16
        ck.close()
        T, N = plan.num_trainer_ranks, plan.num_workers
        cfg = {"checkpoint": str(checkpoint), "layout": layout, "T": T, "N": N,
               "rounds": args.rounds, "bucket_bytes": int(args.bucket_mib * 2**20),
               "timeout_s": args.timeout, "methods": names,
               "ports": (free_port(), free_port())}
        print(f"{model_label} {params / 1e6:.0f} M parameters ({plan.nbytes_min / 1e6:.0f} MB bf16), "
              f"{LAYOUTS[layout][0]} -> {INFERENCE}, {args.rounds} rounds per method; load "
              f"average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        try:
            reports = collect_ranks(_rank_main, lambda r, c=cfg: (r, c), T + N,
                                    args.timeout * (3 + len(names) * args.rounds))
        except RuntimeError as e:
            sys.exit(f"error: {e}")
        rows += [summarize(reports, known[n], layout, T, N, plan.nbytes_min) for n in names]
    load_end = os.getloadavg()
    print(f"\n{'layout':<8} {'method':<34} {'round s':>8} {'wire MB':>9} {'p2p MB':>8} "
          f"{'gather MB':>10} {'trainer extra MiB':>18} {'bit-exact':>9}")
    print("-" * 110)
    for r in rows:
        print(f"{r['layout']:<8} {r['label']:<34} {r['round_s']:>8.3f} "
              f"{r['wire_bytes'] / 1e6:>9.1f} {r['p2p_bytes'] / 1e6:>8.1f} "
              f"{r['gather_bytes'] / 1e6:>10.1f} {r['trainer_extra_max'] / 2**20:>18.1f} "
              f"{'yes' if r['bit_exact'] else 'NO':>9}")
    print(f"load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at the end; "
          f"{time.perf_counter() - t_start:.0f} s in all, {os.cpu_count()} CPUs")
    if not all(r["bit_exact"] for r in rows):
        sys.exit("error: a method left a worker different from reference_load")
    if args.json:
        doc = {"model": {"family": arch, "layers": LAYERS, "sizes": sizes,
                         "checkpoint": str(checkpoint)},
               "inference": INFERENCE, "rounds": args.rounds,
               "bucket_bytes": int(args.bucket_mib * 2**20),
               "load_average": [load_start[0], load_end[0]], "cpus": os.cpu_count(),
               "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
