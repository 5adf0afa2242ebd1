"""Process helpers for the Megatron-Bridge tests: tiny HF checkpoints loaded through Bridge on gloo.

One launch of ``world`` processes runs many (model, layout) cases in
sequence, re-initialising megatron-core's parallel state between them, so
the stack is imported once per process (tens of seconds on a loaded 2-core
machine) rather than once per case. Each rank writes, per case and mode, the
manifest it declared, its local tensors, what ``torch.distributed`` calls it
made while iterating, and (rank 0) Bridge's own ``export_hf_weights``: the
oracle the tests compare against in the parent process.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch


#: torch.distributed calls counted while a source is iterated (top level only).
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "all_reduce", "reduce", "scatter", "gather",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")


@dataclass(frozen=True)
class Case:
    """One (model, layout): tiny model name, checkpoint dir, parallel sizes, modes to run."""

    label: str
    ckpt: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    #: ``"tasks"``, ``"export"``, ``"gather"`` (tasks mode with :data:`GATHER` forced
    #: through Bridge's own ``megatron_to_hf``), or ``"refuse:<mode>"`` (that mode must be
    #: refused with ``BridgeSourceError``; its message is written instead)
    modes: tuple[str, ...] = ("tasks", "export")
    #: expert tensor-parallel size (``None``: tp, megatron-core's default)
    etp: int | None = None


#: mapping kinds the ``"gather"`` mode sends through Bridge's fallback path
GATHER = ("QKVMapping", "GatedMLPMapping")


class CountCalls:
    """Count top-level ``torch.distributed`` collective and p2p calls made inside the block."""

    def __enter__(self):
        import torch.distributed as dist

        self.counts: dict[str, int] = {}
        self._saved = {}
        depth = [0]
        for n in COLLECTIVES:
            f = getattr(dist, n, None)
            if f is None:
                continue
            self._saved[n] = f

            def wrap(*a, _n=n, _f=f, **k):
                if depth[0] == 0:
                    self.counts[_n] = self.counts.get(_n, 0) + 1
                depth[0] += 1
                try:
                    return _f(*a, **k)
                finally:
                    depth[0] -= 1

            setattr(dist, n, wrap)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, f in self._saved.items():
            setattr(dist, n, f)


def init_megatron(tp: int, pp: int, ep: int, etp: int | None = None) -> None:
    """(Re)initialise megatron-core's model-parallel groups (the demo's own helper)."""
    from m2nkit.engine.tools.demo_bridge import init_megatron as init

    init(tp, pp, ep, etp)


def build_bridge_model(ckpt: str, tp: int, pp: int, ep: int, etp: int | None = None):
    """``(bridge, model chunks)`` through Bridge on CPU (the demo's own helper)."""
    from m2nkit.engine.tools.demo_bridge import build_bridge_model as build

    return build(ckpt, tp, pp, ep, etp)


def run_case(case: Case, rank: int, out: Path) -> None:
    """Build the case's model, make each mode's source, iterate it; write what the parent checks."""
    from m2nkit.adapters.megatron.bridge import bridge_source
    from m2nkit.manifest import manifest_to_json

    import torch.distributed as dist

    world = dist.get_world_size()
    init_megatron(case.tp, case.pp, case.ep, case.etp)
    bridge, model = build_bridge_model(case.ckpt, case.tp, case.pp, case.ep, case.etp)
    for mode in case.modes:
        if mode.startswith("refuse:"):
            from m2nkit.adapters.megatron.bridge import BridgeSourceError

            try:
                bridge_source(bridge, model, mode=mode.partition(":")[2])
                msg = "not refused"
            except BridgeSourceError as e:
                msg = str(e)
            (out / f"{case.label}.{mode.replace(':', '-')}.r{rank}.txt").write_text(msg)
            continue
        t0 = time.monotonic()
        src = (bridge_source(bridge, model, gather=GATHER) if mode == "gather"
               else bridge_source(bridge, model, mode=mode))
        t1 = time.monotonic()
        with CountCalls() as cc:
            local = [(n, t.clone()) for n, t in src.iter_local()]
        torch.save({"manifest": manifest_to_json(src.metadata, world), "locals": local,
                    "calls": cc.counts, "gathered": src.gathered, "notes": src.notes,
                    "seconds": (t1 - t0, time.monotonic() - t1)},
                   out / f"{case.label}.{mode}.r{rank}.pt")
    exported = {n: t.clone() for n, t in bridge.export_hf_weights(model, cpu=True,
                                                                    show_progress=False)}
    if rank == 0:
        torch.save(exported, out / f"{case.label}.export.pt")
    dist.barrier()


def run_cases(cases: list, extra, rank: int, out: Path) -> None:
    """``work`` for ``_megatron.rank_main``: every case in order, then ``extra(rank, out)``."""
    for case in cases:
        run_case(case, rank, out)
    if extra is not None:
        extra(rank, out)


def launch(world: int, cases: list, out: Path, timeout_s: float, extra=None) -> float:
    """Run ``world`` ranks of :func:`run_cases`; wall seconds. Fails with the first rank's error."""
    from tests.integration._megatron import launch as launch_ranks

    return launch_ranks(world, functools.partial(run_cases, cases, extra), out, timeout_s)
