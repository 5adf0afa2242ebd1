"""FSDP2 trainer ranks of a tiny checkpoint into traced vLLM layouts, against vLLM's own load.

For the tests that shard transformers' own model with ``fully_shard`` in gloo
ranks (``test_fsdp2_llama4.py``, ``test_fsdp2_tableless.py``): the mesh and the
sharding each rank does (:func:`shard_layers`), and the parent's check of what the
ranks saved (``_procs.save_source``) against every layout (:func:`check_vllm_loads`).
"""

from __future__ import annotations

from pathlib import Path

import torch


def shard_layers(model, kind: str, world: int, layers=None):
    """``model`` sharded by FSDP2 in this rank: ``fully_shard`` per layer of ``layers``
    (default: the decoder layers ``model.model.layers``), then the root, on a 1-D mesh
    ``(dp_shard=world,)`` (``kind="fsdp"``) or an HSDP mesh ``(dp_replicate=2,
    dp_shard=world // 2)`` (``kind="hsdp"``). Needs the process group (``_procs.gloo_rank``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if kind == "hsdp" else
            init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    for layer in model.model.layers if layers is None else layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_sources(out: Path, stem: str, world: int) -> tuple[list, list[dict]]:
    """``(metas, payloads)``: what ranks ``0..world-1`` saved to ``out / f"{stem}.r{rank}.pt"``
    and rank 0's manifest read back (``manifest_from_json``)."""
    from m2nkit.manifest import manifest_from_json

    payloads = [torch.load(out / f"{stem}.r{r}.pt") for r in range(world)]
    metas, _ = manifest_from_json(payloads[0]["manifest"])
    return metas, payloads


def check_vllm_loads(ckpt: Path, metas, payloads: list[dict], specs, loads: dict,
                     label: str) -> list:
    """For each vLLM layout of ``specs`` (spec strings), traced from vLLM's loaders of
    ``ckpt`` (``trace_destination``): plan ``metas`` from ``len(payloads)`` trainer ranks
    (no problem allowed), run the plan in-process from each rank's saved tensors into
    NaN-filled storage, and assert every worker holds exactly vLLM's own load's names
    (less the layout's aliases), each bit for bit (``fresh_load``, cached in ``loads`` by
    ``(spec, worker)``). ``label`` starts the failure messages. Returns the plans.

    Raises:
        AssertionError: a plan problem, a name set or a parameter that differs.
    """
    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.adapters.vllm.trace import trace_destination
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
    from m2nkit.engine.plan import build_plan
    from m2nkit.engine.tools.vllm_workers import fresh_load

    plans = []
    for text in specs:
        spec = parse_inference_spec(text)
        layout = trace_destination(ckpt, metas, spec)
        plan = build_plan(metas, len(payloads), layout)
        assert not plan.problems, plan.problems[:3]
        plans.append(plan)
        storage = {w: allocate_storage(layout, w, fill=float("nan"))
                   for w in range(spec.num_workers)}
        execute_plan(plan, {r: iter(p["locals"]) for r, p in enumerate(payloads)}, storage)
        for w in range(spec.num_workers):
            if (text, w) not in loads:
                loads[text, w] = fresh_load(ckpt, spec, w)
            vllm = loads[text, w]
            names = set(vllm) - set(layout.aliases)
            assert set(storage[w]) == names, (label, text, w)
            bad = sorted(n for n in names if not bitwise_equal(storage[w][n], vllm[n]))
            assert not bad, f"{label} -> {text} worker {w}: differ from vLLM's load {bad[:5]}"
    return plans
