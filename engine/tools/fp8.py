"""``m2nkit plan ... quant=fp8_per_block``: the fp8 wire's plan, its report, and ``--verify``.

The BF16 plan (``build_plan``) says which slab goes where; vLLM's rule of
which parameters it quantizes (``m2nkit.adapters.vllm.fp8``) turns the
quantized ones into ``engine.quant_fp8.Fp8Target``; ``plan_fp8`` reads the
block feeders and the amax exchange from the slab tables. ``--verify``
runs the trainer-side quantization in this process and holds each
worker's e4m3 bytes and scales against vLLM's own ``per_block_cast_to_fp8``
on the worker-local BF16 tensors (vLLM must be installed).
"""

from __future__ import annotations

import os
import time

from m2nkit.engine.tools.report import fmt_bytes, fmt_seconds

__all__ = ["plan_fp8_wire", "fp8_rows", "print_fp8", "run_fp8_in_process", "verify_fp8",
           "vllm_reference_fp8"]


def plan_fp8_wire(config, plan, *, with_leaders: bool = False):
    """The ``Fp8Plan`` of ``plan`` for a worker serving ``quantization="fp8_per_block"``.

    Raises:
        ValueError: ``config`` has a ``quantization_config`` already, or an
            architecture without an fp8_per_block rule
            (``adapters.vllm.fp8.online_fp8_params``).
    """
    from m2nkit.adapters.vllm.fp8 import online_fp8_params
    from m2nkit.engine.quant_fp8 import Fp8Target, plan_fp8

    targets = [Fp8Target(*p) for p in online_fp8_params(config, plan.destination)]
    return plan_fp8(plan, targets, with_leaders=with_leaders)


def fp8_rows(plan, fp8, wire: str, link_gbps: float) -> list[tuple[str, str]]:
    """``(what, value)`` rows of the fp8 section: both wires' bytes and times, the exchange."""
    bf16_t = plan.estimated_seconds(link_gbps)
    fp8_t = fp8.estimated_seconds(link_gbps)
    mark = {"bf16": " (chosen)" if wire == "bf16" else "", "fp8": " (chosen)" if wire == "fp8" else ""}
    n_params = len({p for _, p in fp8.targets})
    return [
        ("quantization", f"fp8_per_block (vLLM online, 128x128 blocks): {n_params} parameters "
                         f"per model quantized, {fp8.blocks:,} scale blocks over all workers"),
        (f"bf16 wire{mark['bf16']}", f"{fmt_bytes(fp8.bf16_bytes)}, busiest rank "
                                      f"{fmt_seconds(bf16_t)} @ {link_gbps:g} Gbit/s "
                                      "(vLLM quantizes after loading)"),
        (f"fp8 wire{mark['fp8']}", f"{fmt_bytes(fp8.fp8_bytes)} (e4m3 + float32 scales, "
                                    f"{fp8.fp8_bytes / fp8.bf16_bytes:.3f} of bf16), busiest rank "
                                    f"{fmt_seconds(fp8_t)} @ {link_gbps:g} Gbit/s"
         if fp8.bf16_bytes else "-"),
        ("fp8 amax exchange", f"{fp8.shared_blocks:,} blocks fed by several trainer ranks: "
                              f"{fp8.exchange_scalars:,} float32 scalars "
                              f"({fmt_bytes(fp8.exchange_bytes)}) between trainer ranks before "
                              f"the bytes move; {fp8.multi_wire_blocks:,} blocks span two wire "
                              "tensors of a fused parameter"),
    ]



def print_fp8(console, plan, fp8, wire: str, link_gbps: float) -> None:
    from rich.table import Table

    t = Table(title="fp8 (quant=fp8_per_block)", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value", overflow="fold")
    for what, value in fp8_rows(plan, fp8, wire, link_gbps):
        t.add_row(what, value)
    console.print(t)


def vllm_reference_fp8(bf16: dict, targets) -> dict:
    """vLLM's quantization of one worker's BF16 parameters: ``per_block_cast_to_fp8``.

    Each target's BF16 tensor is zero-padded to its ``fp8_shape`` (row
    shards padded on their own) and cast with vLLM's own function
    (``vllm/utils/deep_gemm.py``, ``use_ue8m0=False`` as both online
    methods call it; experts one at a time, as
    ``Fp8PerBlockOnlineMoEMethod.process_weights_after_loading``).
    Returns ``{name: tensor}`` of the e4m3 weights and float32 scales.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from m2nkit.engine.quant_fp8 import pad_experts

    out = {}
    for t in targets:
        padded = pad_experts(bf16[t.param], t.fp8_shape, t.row_shards)
        if padded.dim() == 2:
            q, s = per_block_cast_to_fp8(padded, block_size=[128, 128], use_ue8m0=False)
        else:
            pairs = [per_block_cast_to_fp8(e, block_size=[128, 128], use_ue8m0=False)
                     for e in padded]
            q = torch.stack([a for a, _ in pairs]) if pairs else padded.to(torch.float8_e4m3fn)
            s = torch.stack([b for _, b in pairs]) if pairs else torch.zeros(t.grid)
        out[t.param], out[t.scale] = q, s
    return out


def run_fp8_in_process(ckpt, tspec, plan, fp8):
    """Every worker's parameters after a mode-2 round from trainer ranks holding ``ckpt``.

    The BF16 plan runs first (``execute_plan``: the unquantized parameters,
    norms, embeddings), then every trainer rank quantizes what it sends
    (``quant_fp8.execute_fp8_in_process``). Returns ``(storage, (t0, t1,
    t2))``: ``{worker: {vLLM name: tensor}}`` and the clock around both.
    """
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest
    from m2nkit.engine.in_process import allocate_storage, execute_plan
    from m2nkit.engine.quant_fp8 import execute_fp8_in_process

    storage = {w: allocate_storage(plan.destination, w) for w in range(plan.num_workers)}
    sources = {r: checkpoint_manifest(ckpt, tspec, r) for r in range(tspec.num_ranks)}
    t0 = time.perf_counter()
    execute_plan(plan, {r: s.iter_local() for r, s in sources.items()}, storage)
    t1 = time.perf_counter()
    execute_fp8_in_process(plan, fp8, lambda r: sources[r].iter_local(), storage)
    return storage, (t0, t1, time.perf_counter())


def verify_fp8(console, ckpt, tspec, ispec, plan, fp8):
    """Run the BF16 plan and the trainer-side fp8 quantization here; compare with vLLM's.

    Every worker's quantized ``weight`` (e4m3 bytes) and ``weight_scale_inv``
    (float32) must be bit-identical to :func:`vllm_reference_fp8` of the
    BF16 parameters ``reference_load`` gives (vLLM's loader semantics); every
    other parameter bit-identical to ``reference_load``.

    Returns ``(ok, storage)``, storage as vLLM holds it after quantization.
    """
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.in_process import bitwise_equal

    workers = range(plan.num_workers)
    storage, (t0, t1, t2) = run_fp8_in_process(ckpt, tspec, plan, fp8)
    full = full_checkpoint_tensors(ckpt)
    by_worker: dict[int, list] = {}
    for t in fp8.targets.values():
        by_worker.setdefault(t.worker, []).append(t)
    ok = True
    aliases = plan.destination.aliases
    n_checked = 0
    for w in workers:
        ref = {n: v for n, v in reference_load(ckpt.config, full, ispec, w).items()
               if n not in aliases}
        ref.update(vllm_reference_fp8(ref, by_worker.get(w, [])))
        got = storage[w]
        missing, extra = set(ref) - set(got), set(got) - set(ref)
        bad = sorted(n for n in set(ref) & set(got) if not bitwise_equal(got[n], ref[n]))
        n_checked = len(ref)
        if missing or extra or bad:
            ok = False
            console.print(f"[red]worker {w}: {len(bad)} tensors differ from vLLM's fp8 "
                          f"quantization {bad[:5]}, missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(extra)[:5]}[/red]")
    if ok:
        console.print(f"[green]verify: all {plan.num_workers} workers hold exactly what vLLM's "
                      f"fp8_per_block quantization gives ({n_checked} tensors each; e4m3 bytes "
                      f"and scales bit-identical; slabs {fmt_seconds(t1 - t0)}, trainer-side "
                      f"quantization {fmt_seconds(t2 - t1)})[/green]")
    return ok, storage
