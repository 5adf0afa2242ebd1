"""Process helpers for the Megatron-Core tests: real GPTModels built and loaded through Bridge.

One launch of ``world`` gloo processes runs many (model, layout) cases in
sequence, re-initialising megatron-core's parallel state between them (the
stack is imported once per process: tens of seconds on a loaded machine).
Layouts: ``tp``, ``pp``, ``vpp``, ``ep``, ``etp`` and uneven first/last
pipeline stages; the data-parallel size is what the world leaves. Each
rank writes, per case, the manifest ``megatron_source`` declared and its
local tensors; the parent process checks them against the HF checkpoint and
vLLM's reference loaders.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from m2nkit.engine.tools.procs import free_port, start_ranks, stop_processes


@dataclass(frozen=True)
class Layout:
    """One (model, layout) case."""

    label: str
    ckpt: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    first: int | None = None   # num_layers_in_first_pipeline_stage
    last: int | None = None    # num_layers_in_last_pipeline_stage


def init_megatron(c: Layout) -> None:
    """(Re)initialise megatron-core's model-parallel groups on the live gloo world (the demo's)."""
    from m2nkit.engine.tools.demo_bridge import init_megatron as init

    init(c.tp, c.pp, c.ep, c.etp, c.vpp)


def build_model(c: Layout):
    """``(bridge, model chunks)``: the checkpoint built and loaded through Bridge (the demo's)."""
    from m2nkit.engine.tools.demo_bridge import build_bridge_model

    return build_bridge_model(c.ckpt, c.tp, c.pp, c.ep, c.etp, c.vpp, first=c.first, last=c.last)


def dump_source(c: Layout, rank: int, out: Path) -> None:
    """Build the case, make ``megatron_source``, write its manifest and local tensors."""
    import torch.distributed as dist

    from m2nkit.adapters import megatron_source
    from m2nkit.manifest import manifest_to_json

    init_megatron(c)
    bridge, model = build_model(c)
    src = megatron_source(model, config=bridge.hf_pretrained.config)
    local = [(n, t.clone()) for n, t in src.iter_local()]
    names = [(sorted(e.megatron), e.rule.name, e.wires, e.norm, e.buffer) for e in src.names]
    torch.save({"manifest": manifest_to_json(src.metadata, dist.get_world_size()),
                "locals": local, "names": names, "names_from": src.names_from},
               out / f"{c.label}.r{rank}.pt")
    dist.barrier()


def rank_main(rank: int, world: int, port: int, work, out: str, timeout_s: float) -> None:
    """One trainer process: ``work(rank, out_path)``; on failure write the traceback and exit 1."""
    from m2nkit.adapters.megatron.compat import enable_cpu

    enable_cpu()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    outp = Path(out)
    try:
        work(rank, outp)
    except BaseException:
        (outp / f"error.r{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_layouts(cases, rank: int, out: Path) -> None:
    """``work`` for :func:`launch`: :func:`dump_source` for every case in order."""
    for c in cases:
        dump_source(c, rank, out)


def launch(world: int, work, out: Path, timeout_s: float) -> float:
    """Run ``world`` ranks of ``work(rank, out)`` (a picklable callable); wall seconds.

    Raises:
        AssertionError: a rank failed (its traceback), hung past ``timeout_s``
            (killed) or exited non-zero.
    """
    return run_ranks(world, rank_main, lambda r, port: (r, world, port, work, str(out), timeout_s),
                     out, timeout_s)


def run_ranks(world: int, target, args_of, out: Path, timeout_s: float) -> float:
    """Spawn ``target(*args_of(rank, port))`` for every rank (``port``: a free one for the
    group), wait at most ``timeout_s``, kill what is left; wall seconds.

    A rank reports a failure by writing ``out/error.r{rank}.txt``.

    Raises:
        AssertionError: a rank wrote an error (the first one is quoted), hung past
            ``timeout_s`` (killed) or exited non-zero.
    """
    port = free_port()
    start = time.monotonic()
    procs: list = []
    try:
        start_ranks(target, lambda r: args_of(r, port), world, started=procs)
    finally:
        alive = stop_processes(procs, until=start + timeout_s)
    errors = sorted(out.glob("error.r*.txt"))
    if errors:
        raise AssertionError(f"{errors[0].name}:\n{errors[0].read_text()[-4000:]}")
    if alive:
        raise AssertionError(f"ranks {[procs.index(p) for p in alive]} still running after "
                             f"{timeout_s} s")
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks {bad} exited with {[procs[r].exitcode for r in bad]}")
    return time.monotonic() - start
