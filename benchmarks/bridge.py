"""Megatron-Bridge trainers into vLLM-layout workers: m2nkit's two modes vs rank 0 sending.

One MoE model (Qwen3-MoE, randomly initialised, sizes from the flags) loaded
through ``AutoBridge.from_hf_pretrained`` on 4 gloo trainer ranks at TP 2 x
EP 2, sent to ``vllm:tp=2,ep`` stand-in workers (``engine/tools/server.py``,
their own processes, driven over HTTP by trainer rank 0), three ways, all
with m2nkit's ``M2NTrainerEngine`` (torch_p2p, gloo):

* ``bridge tasks``  -- ``bridge_source(bridge, model)``: each rank sends its
  local Megatron shards, no collective;
* ``bridge export`` -- ``bridge_source(bridge, model, mode="export")``:
  Bridge's ``export_hf_weights`` streamed inside the send loop, every tensor
  a replica on every rank, the planner spreading the sends;
* ``Bridge export_hf_weights, rank 0 sends`` -- what RL frameworks do with
  Bridge today: every rank runs ``export_hf_weights`` (every rank receives
  every full tensor), trainer rank 0 stacks each MoE layer's experts into
  the wire tensor and sends everything; the other ranks send nothing. Here
  rank 0 collects the whole export before its first send (a streaming
  sender would hold about one layer's experts instead), so its memory is an
  upper bound of that path.

Measured per method over ``--rounds`` rounds after one warm-up round, the
weights changed in place before each (``perturb``): round time
(``send_weights``, the slowest rank, median of rounds); bytes on the wire,
point to point (``RoundStats.bytes_sent``) plus what Bridge's collectives
deliver (per call, the bytes a rank receives: ``all_gather`` outputs but its
own, ``all_gather_into_tensor`` likewise, ``broadcast`` on non-source ranks),
summed over ranks; and the trainer's peak extra memory: ``VmHWM`` during the
round minus the RSS just before it (after ``malloc_trim``; the high-water
mark reset with ``/proc/self/clear_refs``), the largest over rounds and
ranks. After each method every worker's storage is compared bit for bit with
``reference_load`` of Bridge's own export of the final weights.

    python benchmarks/bridge.py [--rounds 2] [--layers 4] [--hidden 512] [--experts 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from m2nkit.engine.tools.procs import (free_port, peak_kib, reset_peak, rss_kib, start_ranks,
                                       stop_processes, trim_heap, wait_reports)

METHODS = ("bridge tasks", "bridge export", "Bridge export_hf_weights, rank 0 sends")
WORLD = 4
TP, EP = 2, 2
INFERENCE = "vllm:tp=2,ep"


class _CollectiveBytes:
    """Bytes this rank receives through ``torch.distributed`` collectives inside the block."""

    def __enter__(self):
        import torch.distributed as dist

        self.nbytes = 0
        self._saved = {n: getattr(dist, n) for n in ("all_gather", "all_gather_into_tensor",
                                                      "broadcast")}
        me = dist.get_rank()

        def all_gather(tensor_list, tensor, *a, **k):
            self.nbytes += sum(t.nbytes for t in tensor_list) - tensor.nbytes
            return self._saved["all_gather"](tensor_list, tensor, *a, **k)

        def all_gather_into_tensor(out, inp, *a, **k):
            self.nbytes += out.nbytes - inp.nbytes
            return self._saved["all_gather_into_tensor"](out, inp, *a, **k)

        def broadcast(tensor, src=None, *a, **k):
            group_src = k.get("group_src")
            if src is not None and src != me or (src is None and group_src is not None):
                self.nbytes += tensor.nbytes
            return self._saved["broadcast"](tensor, src, *a, **k)

        dist.all_gather, dist.all_gather_into_tensor, dist.broadcast = (
            all_gather, all_gather_into_tensor, broadcast)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, f in self._saved.items():
            setattr(dist, n, f)


def _rank_zero_source(bridge, model, template, rank: int):
    """Bridge's export on every rank, rank 0 the only sender (metadata from ``template``)."""
    import torch

    from m2nkit.engine.tools.demo_bridge import exported_tensors
    from m2nkit.manifest import M2NManifestEntry, ManifestM2NWeightSource, Piece, PieceLayout

    held: dict = {}

    def provider(name, shape):
        def get():
            if name in held:
                return held.pop(name)
            prefix, _, leaf = name.rpartition(".experts.")
            parts = ("gate_proj", "up_proj") if leaf.startswith("gate_up") else ("down_proj",)
            stacked = torch.stack([torch.cat([held.pop(f"{prefix}.experts.{e}.{p}.weight")
                                              for p in parts]) for e in range(shape[0])])
            return stacked
        return get

    entries = [M2NManifestEntry(e.name, e.dtype, e.global_shape,
                                PieceLayout((Piece(0, tuple((0, n) for n in e.global_shape)),),
                                            where=f"wire tensor '{e.name}'"),
                                provider(e.name, e.global_shape))
               for e in template.entries]

    class RankZeroExport(ManifestM2NWeightSource):
        def iter_local(self):
            full = exported_tensors(bridge, model)   # every rank: Bridge's gathers
            if rank == 0:
                held.update(full)
            del full
            yield from super().iter_local()
            held.clear()

    return RankZeroExport(entries, rank=rank)


def _trainer(rank: int, cfg: dict, results, go) -> None:
    from m2nkit.engine.tools.demo_bridge import (build_bridge_model, exported_tensors,
                                                 init_megatron, perturb)
    from m2nkit.adapters.megatron.compat import enable_cpu

    enable_cpu()
    import logging
    import traceback
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    try:
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from m2nkit.adapters import bridge_source
        from m2nkit.adapters.vllm import vllm_destination
        from m2nkit.engine.clients import HTTPClient
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                                rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=cfg["timeout"]))
        init_megatron(TP, 1, EP)
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            bridge, model = build_bridge_model(cfg["ckpt"], TP, 1, EP)
        dest = vllm_destination(AutoConfig.from_pretrained(cfg["ckpt"]), INFERENCE)
        template = bridge_source(bridge, model, mode="export")
        step = 0
        for mi, method in enumerate(METHODS):
            if go.get(timeout=cfg["timeout"]) != method:
                raise RuntimeError("benchmark driver out of step")
            if method == "bridge tasks":
                src = bridge_source(bridge, model)
            elif method == "bridge export":
                src = bridge_source(bridge, model, mode="export")
            else:
                src = _rank_zero_source(bridge, model, template, rank)
            info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=WORLD, destination=dest,
                                      master_port=cfg["ports"][mi], timeout_s=cfg["timeout"],
                                      bucket_bytes=cfg["bucket_bytes"])
            client = HTTPClient(cfg["url"], timeout_s=4 * cfg["timeout"]) if rank == 0 else None
            engine = M2NTrainerEngine.trainer_init(info, client=client, source=src)
            rows = []
            for r in range(cfg["rounds"] + 1):
                step += 1
                perturb(model, step)
                dist.barrier()
                trim_heap(collect=False)
                reset_peak()
                rss0 = rss_kib()
                with _CollectiveBytes() as cb:
                    t0 = time.perf_counter()
                    stats = engine.send_weights(f"{method}-{r}")
                    seconds = time.perf_counter() - t0
                peak = max(0, peak_kib() - rss0) * 1024
                if r:                                     # round 0 warms up
                    rows.append({"p2p": stats.bytes_sent, "collective": cb.nbytes,
                                 "seconds": seconds, "peak_extra": peak})
            engine.shutdown()
            exported = exported_tensors(bridge, model)
            if rank == 0:
                save_file(exported, str(Path(cfg["work"]) / f"check-{mi}.safetensors"))
            del exported, src, engine
            results.put(("method", rank, method, rows))
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        sys.stdout.flush()
        os._exit(0)


def _model(work: Path, args) -> Path:
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    config = tiny_config("tiny-qwen3-moe", hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_experts=args.experts, moe_intermediate_size=args.hidden // 2,
                         intermediate_size=args.hidden * 2, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=args.hidden // 8, vocab_size=4096)
    return save_tiny_checkpoint(config, work / "model", seed=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--bucket-mib", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any single wait may take")
    p.add_argument("--json", metavar="PATH", help="write the rows and the setup as JSON")
    args = p.parse_args()

    from m2nkit.adapters.megatron.compat import enable_py311

    enable_py311()
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.in_process import bitwise_equal
    from m2nkit.engine.tools.server import InferenceServer

    t_start = time.monotonic()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="m2nkit-bench-bridge-") as tmp:
        work = Path(tmp)
        ckpt = _model(work, args)
        config = AutoConfig.from_pretrained(ckpt)
        payload = sum(t.nbytes for t in load_file(str(ckpt / "model.safetensors")).values())
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        gos = [ctx.Queue() for _ in range(WORLD)]
        server = InferenceServer(ckpt, INFERENCE, timeout_s=4 * args.timeout)
        url = server.start()
        try:
            cfg = {"ckpt": str(ckpt), "url": url, "dist_port": free_port(),
                   "ports": [free_port() for _ in METHODS], "rounds": args.rounds,
                   "bucket_bytes": int(args.bucket_mib * (1 << 20)), "timeout": args.timeout,
                   "work": str(work)}
            procs = start_ranks(_trainer, lambda r: (r, cfg, results, gos[r]), WORLD, ctx=ctx)

            def failed(msg):
                raise RuntimeError(f"trainer rank {msg[1]} failed: {msg[2]}\n{msg[3]}")

            rows = []
            try:
                for mi, method in enumerate(METHODS):
                    for q in gos:
                        q.put(method)
                    got = wait_reports(results, WORLD, time.monotonic() + 2 * args.timeout,
                                       f"{method} reports", print, failed, procs)
                    exported = load_file(str(work / f"check-{mi}.safetensors"))
                    ok = all(bitwise_equal(t, ref[n]) for w in range(2)
                             for ref in [reference_load(config, exported, INFERENCE, w)]
                             for n, t in server.storage(w, work / f"s{mi}").items())
                    per = {m[1]: m[3] for m in got}
                    n = len(per[0])
                    row = {
                        "method": method,
                        "round_s": statistics.median(max(per[r][i]["seconds"] for r in per)
                                                     for i in range(n)),
                        "p2p_bytes": sum(per[r][-1]["p2p"] for r in per),
                        "rank0_p2p_bytes": per[0][-1]["p2p"],
                        "collective_bytes": sum(per[r][-1]["collective"] for r in per),
                        "peak_extra_bytes": max(x["peak_extra"] for r in per for x in per[r]),
                        "peak_extra_rank0": max(x["peak_extra"] for x in per[0]),
                        "verified": ok,
                    }
                    row["wire_bytes"] = row["p2p_bytes"] + row["collective_bytes"]
                    rows.append(row)
                    print(f"  {method}: done, bit-exact={ok}", flush=True)
            finally:
                stop_processes(procs, grace_s=10.0)
        finally:
            server.stop()
    mib = 1 << 20
    print(f"\nQwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts: "
          f"{payload / mib:.1f} MiB bf16; bridge tp={TP},ep={EP} (4 ranks) -> {INFERENCE}; "
          f"bucket {args.bucket_mib:g} MiB; load average {load[0]:.1f} at start; "
          f"{time.monotonic() - t_start:.0f} s in all\n")
    print(f"| method | round time | bytes on the wire (p2p + Bridge collectives) | rank 0 sends "
          f"| trainer peak extra memory (max rank / rank 0) | workers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['round_s'] * 1e3:.0f} ms | {r['wire_bytes'] / mib:.1f} MiB "
              f"({r['p2p_bytes'] / mib:.1f} + {r['collective_bytes'] / mib:.1f}) | "
              f"{r['rank0_p2p_bytes'] / mib:.1f} MiB | {r['peak_extra_bytes'] / mib:.1f} / "
              f"{r['peak_extra_rank0'] / mib:.1f} MiB | "
              f"{'bit-exact' if r['verified'] else 'NOT bit-exact'} |")
    if args.json:
        doc = {"model": {"family": "Qwen3MoeForCausalLM", "layers": args.layers,
                         "hidden": args.hidden, "experts": args.experts, "bytes": payload},
               "trainer": f"bridge:tp={TP},ep={EP}", "inference": INFERENCE,
               "rounds": args.rounds, "load_average": load, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
