"""Llama-4 from real ``fully_shard`` ranks into traced vLLM layouts, against vLLM's own load.

The trainer is transformers' ``Llama4ForCausalLM`` of the shipped tiny checkpoint
(tests/data/oracle/tiny-llama4: 2 layers, the second MoE with 4 routed experts and
a shared expert), loaded with ``from_pretrained`` and sharded by FSDP2 in 4 spawned
gloo ranks (``fully_shard`` per decoder layer, then the root, on a 1-D mesh and on
an HSDP mesh ``(2, 2)``). ``fsdp2_source`` sends
transformers' tensors, but the routed experts ``[E, in, out]`` transposed to
``...experts.gate_up_proj.weight [E, 2*I, H]`` (``families/llama4.py``), each
rank's piece its local box transposed. The reference is vLLM itself: each
worker's model built on the CPU and filled from the checkpoint's files by vLLM's
``DefaultModelLoader`` (``engine/tools/vllm_workers.fresh_load``), bit for bit,
q/k rows (vLLM's rotary reordering) and experts (with and without EP) included.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from _paths import ORACLE
from _procs import gloo_rank, join_ranks, save_source
from tests.integration._fsdp2 import check_vllm_loads, load_sources, shard_layers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORLD = 4
TIMEOUT_S = 240
KINDS = ("fsdp", "hsdp")
SPECS = ("vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep")
CKPT = ORACLE / "tiny-llama4" / "checkpoint"


def _rank_main(rank, world, port, ckpt, out):
    import transformers

    from m2nkit.adapters.fsdp2 import fsdp2_source

    with gloo_rank(rank, world, port, TIMEOUT_S // 2):
        for kind in KINDS:
            model = shard_layers(transformers.Llama4ForCausalLM.from_pretrained(ckpt), kind, world)
            save_source(fsdp2_source(model), world, Path(out) / f"{kind}.r{rank}.pt")


def test_llama4_fsdp2_ranks_into_traced_layouts_equal_vllm_loads(tmp_path):
    from m2nkit.engine.tools.procs import free_port

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    join_ranks(mp.start_processes(_rank_main, args=(WORLD, free_port(), str(CKPT), str(tmp_path)),
                                  nprocs=WORLD, join=False, start_method="spawn"), TIMEOUT_S)
    loads: dict = {}
    for kind in KINDS:
        metas, payloads = load_sources(tmp_path, kind, WORLD)
        shapes = {m.name: tuple(m.shape) for m in metas}
        # transformers holds them [E, H, 2*I] and [E, I, H]; the wire [E, out, in]
        assert shapes["model.layers.1.feed_forward.experts.gate_up_proj.weight"] == (4, 64, 64)
        assert shapes["model.layers.1.feed_forward.experts.down_proj.weight"] == (4, 64, 32)
        assert "model.layers.1.feed_forward.experts.down_proj" not in shapes
        for plan in check_vllm_loads(CKPT, metas, payloads, SPECS, loads, kind):
            assert plan.nbytes_moved == plan.nbytes_min
