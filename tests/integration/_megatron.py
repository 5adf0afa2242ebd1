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


def dump_source(c: Layout, rank: int, out: Path, export: bool = False) -> None:
    """Build the case, make ``megatron_source``, write its manifest and local tensors
    (with ``export``: also Bridge's own ``export_hf_weights``, from rank 0, and
    ``bridge_source(mode="tasks")``'s manifest and local tensors as ``bridge-<label>``)."""
    import torch.distributed as dist

    from m2nkit.adapters import megatron_source
    from m2nkit.manifest import manifest_to_json

    init_megatron(c)
    bridge, model = build_model(c)
    src = megatron_source(model, config=bridge.hf_pretrained.config)
    local = [(n, t.clone()) for n, t in src.iter_local()]
    names = [(sorted(e.megatron), e.rule.name, e.wires, e.norm, e.buffer) for e in src.names]
    payload = {"manifest": manifest_to_json(src.metadata, dist.get_world_size()),
               "locals": local, "names": names, "names_from": src.names_from,
               "module_names": src.module_names, "left_out": list(src.left_out)}
    if export:
        from m2nkit.engine.tools.demo_bridge import exported_tensors

        exported = exported_tensors(bridge, model)  # collective: every rank
        if rank == 0:
            payload["export"] = exported
    torch.save(payload, out / f"{c.label}.r{rank}.pt")
    if export:  # and Bridge's own tasks through bridge_source (tasks mode)
        from m2nkit.adapters import bridge_source

        bsrc = bridge_source(bridge, model, mode="tasks")
        torch.save({"manifest": manifest_to_json(bsrc.metadata, dist.get_world_size()),
                    "locals": [(n, t.clone()) for n, t in bsrc.iter_local()],
                    "gathered": dict(bsrc.gathered)}, out / f"bridge-{c.label}.r{rank}.pt")
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


def run_layouts(cases, rank: int, out: Path, export: bool = False) -> None:
    """``work`` for :func:`launch`: :func:`dump_source` for every case in order."""
    for c in cases:
        dump_source(c, rank, out, export)


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


def check_pieces_and_rounds(out: Path, label: str, ckpt_dir, specs, world: int) -> None:
    """The parent's checks of one dumped case.

    Every rank declared the same manifest, whose wire tensors are the HF
    checkpoint's in its order; every piece a rank declares equals the
    checkpoint's slice bit for bit; the plan into each vLLM layout of
    ``specs`` moves exactly the minimum and fills vLLM-layout storage equal to
    ``reference_load`` (vLLM's loaders, pinned to real vLLM 0.33.0 dumps).
    """
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.adapters.vllm import destination_layout, reference_load
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
    from m2nkit.engine.plan import build_plan
    from m2nkit.manifest import manifest_from_json
    from m2nkit.manifest.pieces import box_slices

    WORLD = world
    payloads = [torch.load(out / f"{label}.r{r}.pt") for r in range(WORLD)]
    docs = [p["manifest"] for p in payloads]
    assert all(d == docs[0] for d in docs), f"{label}: metadata differs between ranks"
    metas, T = manifest_from_json(docs[0])
    assert T == WORLD
    ckpt = read_checkpoint(ckpt_dir)
    assert [m.name for m in metas] == ckpt.names
    full = {m.name: ckpt.read_full(m.name) for m in metas}
    checked = 0
    for r, p in enumerate(payloads):
        stream = dict(p["locals"])
        for m in metas:
            assert m.dtype == full[m.name].dtype, (label, m.name)
            for piece in m.source_pieces(WORLD):
                if piece.rank == r:
                    got = stream[m.name][box_slices(piece.local_box)]
                    assert bitwise_equal(got, full[m.name][box_slices(piece.box)]), \
                        (label, m.name, r, piece)
                    checked += 1
    assert checked >= len(metas)
    if "export" in payloads[0]:  # Bridge's own export_hf_weights: every wire tensor, the same bytes
        exported = stacked_export(payloads[0]["export"])
        for m in metas:
            assert m.name in exported, (label, m.name, "not in Bridge's export")
            assert bitwise_equal(exported[m.name], full[m.name]), (label, m.name, "export")
    tensors = full_checkpoint_tensors(ckpt)
    for spec in specs:
        dest = destination_layout(ckpt.config, metas, spec)
        plan = build_plan(metas, WORLD, dest)
        assert plan.problems == [], (label, spec, plan.problems[:3])
        assert plan.nbytes_moved == plan.nbytes_min, (label, spec)
        storage = {w: allocate_storage(dest, w) for w in range(dest.num_workers)}
        execute_plan(plan, {r: iter(payloads[r]["locals"]) for r in range(WORLD)}, storage)
        for w, params in storage.items():
            ref = reference_load(ckpt.config, tensors, spec, w, fill=float("nan"))
            for pname, t in params.items():
                assert bitwise_equal(t, ref[pname]), (label, spec, w, pname)




def stacked_export(exported: dict) -> dict:
    """Bridge's per-expert export (``<p>.experts.<e>.gate_proj/up_proj/down_proj.weight``)
    with each layer's experts stacked as the wire carries them (``<p>.experts.gate_up_proj.
    weight [E, 2*Im, H]``: expert ``e``'s gate rows then its up rows; ``down_proj [E, H, Im]``)."""
    import re

    out, per = {}, {}
    for name, t in exported.items():
        m = re.match(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, experts in per.items():
        order = sorted(experts)
        assert order == list(range(len(order))), (prefix, order)
        out[f"{prefix}.gate_up_proj.weight"] = torch.stack(
            [torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in order])
        out[f"{prefix}.down_proj.weight"] = torch.stack([experts[e]["down"] for e in order])
    return out


def check_names_equal_table(out: Path, label: str, ckpt_dir) -> None:
    """The live source's names came from Bridge's registry, and the hand table of
    ``names.py`` says the same for every Megatron spelling the registry gives (rule, wire
    tensors, norm, buffer) and names every wire tensor of the manifest; a drift names
    the tensor."""
    import json

    from m2nkit.adapters.megatron.compat import enable_cpu
    from m2nkit.adapters.megatron.names import megatron_names
    from m2nkit.adapters.megatron.registry import bridge_registry

    enable_cpu()  # megatron-core imports triton for a GPU kernel; CPU stand-in
    arch = json.loads((Path(ckpt_dir) / "config.json").read_text())["architectures"][0]
    p = torch.load(out / f"{label}.r0.pt")
    bridge = bridge_registry(arch)[0]
    assert p["names_from"] == f"Megatron-Bridge {bridge}.mapping_registry()", p["names_from"]
    hand = {}
    for e in megatron_names(arch):
        for m in e.megatron:
            hand[m] = (e.rule.name, e.wires, e.norm, e.buffer)
    live_wires = set()
    for spellings, rule, wires, norm, buffer in p["names"]:
        wires = {None if k in (None, "null") else k: v for k, v in wires.items()}
        live_wires |= set(wires.values())
        for m in spellings:
            assert m in hand, \
                f"{label} ({arch}): Bridge's {bridge} maps {m!r}; the hand table lacks it"
            assert hand[m] == (rule, wires, norm, buffer), (
                f"{label} ({arch}): {m!r} drifted: Bridge {(rule, wires, norm, buffer)}, "
                f"table {hand[m]}")
    # every wire tensor of this model (manifest) is named by the live table
    from m2nkit.adapters.megatron.layout import match_wire
    from m2nkit.manifest import manifest_from_json

    for m in manifest_from_json(p["manifest"])[0]:
        assert match_wire(megatron_names(arch), m.name) is not None, (label, m.name)
        assert any(_re_match(t, m.name) for t in live_wires), (label, m.name)


def _re_match(template: str, name: str) -> bool:
    from m2nkit.adapters.megatron.layout import _template_regex

    return bool(_template_regex(template).match(name))
