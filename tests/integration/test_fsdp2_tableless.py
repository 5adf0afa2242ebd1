"""Real ``fully_shard`` models, tableless and with a table, into traced vLLM layouts.

The trainer is transformers' own model of a tiny checkpoint, loaded with
``from_pretrained`` and sharded by FSDP2 in 4 forked gloo ranks, on a 1-D mesh
(``fully_shard`` per decoder layer, then the root) and on an HSDP mesh
``(dp_replicate=2, dp_shard=2)``. Each rank returns its ``fsdp2_source`` manifest
and local tensors; the parent plans them against the layout traced from vLLM
0.33.0's loaders and runs the plan in-process. The reference is vLLM itself: each
worker's model built on the CPU and filled from the checkpoint's files by vLLM's
``DefaultModelLoader`` (``engine/tools/vllm_workers.fresh_load``), compared bit for
bit.

The model is a hybrid Gated DeltaNet MoE (``Qwen3_5MoeForCausalLM``), which has a
family table since (``families/qwen3_5_moe.py``): ``fsdp2_source`` sends it under
the table's wire names (stacked experts ``...experts.gate_up_proj.weight``). The
tableless path (transformers' in-memory names, ``families.tableless``) is kept by
forcing it for the same model (``PATHS``), so both wire namings trace.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from _procs import gloo_rank, join_ranks, save_source
from tests.integration._fsdp2 import check_vllm_loads, load_sources, shard_layers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORLD = 4
TIMEOUT_S = 240
KINDS = ("fsdp", "hsdp")
#: the wire naming fsdp2_source uses: the family table's, or transformers' in-memory
#: names as for an architecture without a table (forced: ``_tableless_names``)
PATHS = ("table", "tableless")
SPECS = ("vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4", "vllm:tp=1,dp=2,ep")


def _tiny(tmp: Path) -> Path:
    """A tiny hybrid Gated DeltaNet MoE (``Qwen3_5MoeForCausalLM``), saved by transformers."""
    import transformers

    from integration.test_traced_plans import TINY_QWEN3_5_MOE

    config = transformers.Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"],
                                               **TINY_QWEN3_5_MOE)
    torch.manual_seed(1)
    transformers.Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    return tmp


def _tableless_names(model):
    """``fsdp2_source(model)`` as for an architecture without a table: the source asks
    ``family_or_tableless`` for the family; here it gets the tableless one."""
    from unittest import mock

    from m2nkit.adapters.families.tableless import tableless_family
    from m2nkit.adapters.fsdp2 import fsdp2_source

    with mock.patch("m2nkit.adapters.fsdp2.source.family_or_tableless", tableless_family):
        return fsdp2_source(model)


def _rank_main(rank, world, port, ckpt, out):
    import transformers

    from m2nkit.adapters.fsdp2 import fsdp2_source

    with gloo_rank(rank, world, port, TIMEOUT_S // 2):
        for kind in KINDS:
            model = shard_layers(transformers.Qwen3_5MoeForCausalLM.from_pretrained(ckpt), kind,
                                 world)
            for path in PATHS:
                src = fsdp2_source(model) if path == "table" else _tableless_names(model)
                save_source(src, world, Path(out) / f"{kind}.{path}.r{rank}.pt")


def test_fsdp2_meshes_into_traced_layouts_equal_vllm_loads(tmp_path):
    from m2nkit.engine.tools.procs import free_port

    ckpt = _tiny(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    join_ranks(mp.start_processes(_rank_main, args=(WORLD, free_port(), str(ckpt), str(out)),
                                  nprocs=WORLD, join=False, start_method="spawn"), TIMEOUT_S)
    loads: dict = {}           # (spec, worker) -> vLLM's fresh load, the same for every case
    wire_names = {}
    for kind in KINDS:
        for path in PATHS:
            metas, payloads = load_sources(out, f"{kind}.{path}", WORLD)
            wire_names[path] = {m.name for m in metas}
            check_vllm_loads(ckpt, metas, payloads, SPECS, loads, f"{kind} ({path} names)")
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert experts + ".weight" in wire_names["table"] and experts not in wire_names["table"]
    assert experts in wire_names["tableless"]
