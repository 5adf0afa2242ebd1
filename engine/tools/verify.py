"""``m2nkit plan --verify`` and ``--dump``: run a plan here on real bytes, check them, save them.

:func:`verify_plan` executes the plan in this process (``engine/local.py``)
on the checkpoint's own data and holds every worker's storage against an
independent restatement of vLLM's loaders (``reference_load``);
:func:`dump_storage` writes what the workers hold as safetensors, one file
per worker. Kept apart from the command line (``cli.py``), which only
decides when they run, and from the printing (``report.py``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from m2nkit.engine.tools.report import fmt_seconds

__all__ = ["verify_plan", "dump_storage"]


def verify_plan(console, ckpt, tspec, ispec, plan, layout: str = "tables"):
    """Execute ``plan`` in this process and compare every worker with vLLM's loaders.

    The reference is independent of the plan: for a layout from the tables,
    m2nkit's restatement of vLLM's loaders (``reference_load``); for a
    traced layout, vLLM itself: each worker's model built on the CPU and
    filled from the checkpoint's files by vLLM's ``DefaultModelLoader``
    (``engine/tools/vllm_workers.fresh_load``; needs vLLM, and memory for one
    worker's parameters at a time).

    Returns ``(ok, storage)``: whether every worker is bit-exact, and each
    worker's storage ``{worker: {vLLM param: tensor}}``.
    """
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, full_checkpoint_tensors
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan

    if layout == "traced":
        from m2nkit.engine.tools.vllm_workers import fresh_load

        def reference(w):
            return fresh_load(ckpt.root, ispec, w)
        what = ok_what = "vLLM's own loaders"
    else:
        from m2nkit.adapters.vllm import reference_load

        full = full_checkpoint_tensors(ckpt)

        def reference(w):
            return reference_load(ckpt.config, full, ispec, w)
        what, ok_what = "vLLM's loader semantics", "vLLM's loaders"

    workers = range(plan.num_workers)
    storage = {w: allocate_storage(plan.destination, w) for w in workers}
    sources = {r: checkpoint_manifest(ckpt, tspec, r) for r in range(tspec.num_ranks)}
    t0 = time.perf_counter()
    execute_plan(plan, {r: s.iter_local() for r, s in sources.items()}, storage)
    t1 = time.perf_counter()
    ok = True
    aliases = plan.destination.aliases
    for w in workers:
        ref = reference(w)
        got = storage[w]
        names = set(ref) - set(aliases)
        missing, extra = names - set(got), set(got) - names
        bad = sorted(n for n in names & set(got) if not bitwise_equal(got[n], ref[n]))
        for alias, target in aliases.items():
            if alias in ref and target in got and not bitwise_equal(got[target], ref[alias]):
                bad.append(alias)
        if missing or extra or bad:
            ok = False
            console.print(f"[red]worker {w}: {len(bad)} tensors differ from {what} "
                          f"{bad[:5]}, missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(extra)[:5]}[/red]")
    if ok:
        console.print(f"[green]verify: all {plan.num_workers} workers hold exactly what "
                      f"{ok_what} would ({len(names)} parameters each; executed "
                      f"{plan.num_slabs:,} slabs in {fmt_seconds(t1 - t0)})[/green]")
    return ok, storage


def dump_storage(console, directory: Path, storage, plan, ckpt, ispec) -> None:
    """Write each worker's storage as ``DIR/worker{w}.safetensors``.

    Tensors carry vLLM's parameter names, local shapes and dtypes, as the
    worker holds them. A parameter that shares storage with another (tied
    ``lm_head.weight``) is saved once, under the name it aliases; the
    ``aliases`` metadata lists it. Metadata (strings): ``worker``,
    ``tp_rank``, ``dp_rank``, ``ep_rank`` (``none`` without expert
    parallelism), ``inference``, ``model``, ``architecture``,
    ``plan_digest``, ``manifest_digest``, ``aliases`` (JSON ``{alias:
    parameter}``).
    """
    from safetensors.torch import save_file

    plan_digest = plan.digest()
    for w, tensors in storage.items():
        aliases = {a: t for a, t in plan.destination.aliases.items() if t in tensors}
        metadata = {
            "format": "pt",
            "worker": str(w),
            "tp_rank": str(ispec.tp_rank(w)),
            "dp_rank": str(ispec.dp_index(w)),
            "ep_rank": str(w) if ispec.ep else "none",
            "inference": str(ispec),
            "model": str(Path(ckpt.path).resolve()),
            "architecture": ckpt.architecture,
            "plan_digest": plan_digest,
            "manifest_digest": plan.manifest_digest,
            "aliases": json.dumps(aliases, sort_keys=True),
        }
        out = directory / f"worker{w}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items() if n not in aliases}, str(out),
                  metadata=metadata)
    console.print(f"wrote {len(storage)} worker files to {directory}/ "
                  f"(worker0.safetensors .. worker{len(storage) - 1}.safetensors)")
