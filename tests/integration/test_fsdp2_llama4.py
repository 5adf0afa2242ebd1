"""Llama-4 from real ``fully_shard`` ranks into traced vLLM layouts, against vLLM's own load.

The trainer is transformers' ``Llama4ForCausalLM`` of the shipped tiny checkpoint
(tests/data/oracle/tiny-llama4: 2 layers, the second MoE with 4 routed experts and
a shared expert), loaded with ``from_pretrained`` and sharded by FSDP2 in 4 spawned
gloo ranks (``fully_shard`` per decoder layer, then the root, on a 1-D mesh and on
an HSDP mesh ``(2, 2)``). Llama-4 has no table: ``fsdp2_source`` sends
transformers' tensors, but the routed experts ``[E, in, out]`` transposed to
``...experts.gate_up_proj.weight [E, 2*I, H]`` (``families/llama4.py``), each
rank's piece its local box transposed. The reference is vLLM itself: each
worker's model built on the CPU and filled from the checkpoint's files by vLLM's
``DefaultModelLoader`` (``engine/tools/vllm_workers.fresh_load``), bit for bit,
q/k rows (vLLM's rotary reordering) and experts (with and without EP) included.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from _paths import ORACLE
from _procs import join_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORLD = 4
TIMEOUT_S = 240
KINDS = ("fsdp", "hsdp")
SPECS = ("vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep")
CKPT = ORACLE / "tiny-llama4" / "checkpoint"


def _rank_main(rank, world, port, ckpt, out):
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from m2nkit.adapters.fsdp2 import fsdp2_source
    from m2nkit.manifest import manifest_to_json

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S // 2))
    try:
        for kind in KINDS:
            mesh = (init_device_mesh("cpu", (2, world // 2),
                                     mesh_dim_names=("dp_replicate", "dp_shard"))
                    if kind == "hsdp" else
                    init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
            model = transformers.Llama4ForCausalLM.from_pretrained(ckpt)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            src = fsdp2_source(model)
            torch.save({"manifest": manifest_to_json(src.metadata, world),
                        "locals": [(n, t.clone()) for n, t in src.iter_local()]},
                       Path(out) / f"{kind}.r{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_llama4_fsdp2_ranks_into_traced_layouts_equal_vllm_loads(tmp_path):
    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.adapters.vllm.trace import trace_destination
    from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
    from m2nkit.engine.plan import build_plan
    from m2nkit.engine.tools.procs import free_port
    from m2nkit.engine.tools.vllm_workers import fresh_load
    from m2nkit.manifest import manifest_from_json

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    join_ranks(mp.start_processes(_rank_main, args=(WORLD, free_port(), str(CKPT), str(tmp_path)),
                                  nprocs=WORLD, join=False, start_method="spawn"), TIMEOUT_S)
    loads: dict = {}
    for kind in KINDS:
        payloads = [torch.load(tmp_path / f"{kind}.r{r}.pt") for r in range(WORLD)]
        metas, _ = manifest_from_json(payloads[0]["manifest"])
        shapes = {m.name: tuple(m.shape) for m in metas}
        # transformers holds them [E, H, 2*I] and [E, I, H]; the wire [E, out, in]
        assert shapes["model.layers.1.feed_forward.experts.gate_up_proj.weight"] == (4, 64, 64)
        assert shapes["model.layers.1.feed_forward.experts.down_proj.weight"] == (4, 64, 32)
        assert "model.layers.1.feed_forward.experts.down_proj" not in shapes
        for text in SPECS:
            spec = parse_inference_spec(text)
            layout = trace_destination(CKPT, metas, spec)
            plan = build_plan(metas, WORLD, layout)
            assert not plan.problems, plan.problems[:3]
            assert plan.nbytes_moved == plan.nbytes_min
            storage = {w: allocate_storage(layout, w, fill=float("nan"))
                       for w in range(spec.num_workers)}
            execute_plan(plan, {r: iter(p["locals"]) for r, p in enumerate(payloads)}, storage)
            for w in range(spec.num_workers):
                if (text, w) not in loads:
                    loads[text, w] = fresh_load(CKPT, spec, w)
                vllm = loads[text, w]
                names = set(vllm) - set(layout.aliases)
                assert set(storage[w]) == names, (kind, text, w)
                bad = sorted(n for n in names if not bitwise_equal(storage[w][n], vllm[n]))
                assert not bad, f"{kind} -> {text} worker {w}: differ from vLLM's load {bad[:5]}"
