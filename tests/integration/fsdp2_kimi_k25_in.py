"""Kimi-K2.5 from real ``fully_shard`` ranks into traced vLLM layouts, in ``.venv-tf``.

vLLM 0.33.0's ``models/kimi_k25.py`` and transformers' own
``Kimi_K25ForConditionalGeneration`` both need transformers 5.24+, so
``test_fsdp2_kimi_k25.py`` runs this script with ``.venv-tf/bin/python``
(``scripts/side_transformers.sh``):

  .venv-tf/bin/python tests/integration/fsdp2_kimi_k25_in.py OUT

It spawns ``WORLD`` gloo ranks; each loads the shipped tiny checkpoint
(tests/data/oracle/tiny-kimi-k25) with transformers' ``from_pretrained``,
shards it with ``fully_shard`` (per vision block and decoder layer, then
the root; a 1-D mesh and an HSDP mesh ``(2, 2)``) and saves what
``fsdp2_source`` sends. transformers holds each vision block's ``wqkv`` as
``attn.q_proj``/``k_proj``/``v_proj``, q's and k's rows reordered per head
for its rotary embedding, and the routed experts fused; the wire is the
checkpoint's ``wqkv`` and stacked experts. Then, per mesh and per layout of
``SPECS`` (traced from vLLM's own loaders), the parent plans the ranks'
manifest, runs the plan from the saved tensors and asserts every worker
holds exactly what vLLM's own ``DefaultModelLoader`` loads from the
checkpoint, bit for bit (``_fsdp2.check_vllm_loads``). ``OUT/result.json``
records what the test asserts on: the wire shapes, rank 0's pieces of
block 0's ``wqkv``, the bytes each plan moves and how many parameters each
worker compared. A failed check exits non-zero with the assertion.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

WORLD = 4
TIMEOUT_S = 420
KINDS = ("fsdp", "hsdp")
SPECS = ("vllm:tp=2", "vllm:tp=2,ep", "vllm:tp=4,ep")
CKPT = HERE.parent / "data" / "oracle" / "tiny-kimi-k25" / "checkpoint"
WQKV = "vision_tower.encoder.blocks.0.wqkv.weight"


def _rank_main(rank, world, port, ckpt, out):
    import transformers

    from _procs import gloo_rank, save_source
    from m2nkit.adapters.fsdp2 import fsdp2_source
    from tests.integration._fsdp2 import shard_layers

    with gloo_rank(rank, world, port, TIMEOUT_S // 2):
        for kind in KINDS:
            model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(ckpt)
            inner = model.model
            shard_layers(model, kind, world,
                         layers=[*inner.vision_tower.layers, *inner.language_model.layers])
            save_source(fsdp2_source(model), world, Path(out) / f"{kind}.r{rank}.pt")


def main(out: str) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch.multiprocessing as mp

    from _procs import join_ranks
    from m2nkit.engine.tools.procs import free_port
    from tests.integration._fsdp2 import check_vllm_loads, load_sources

    join_ranks(mp.start_processes(_rank_main, args=(WORLD, free_port(), str(CKPT), out),
                                  nprocs=WORLD, join=False, start_method="spawn"), TIMEOUT_S)
    loads: dict = {}
    result: dict = {}
    for kind in KINDS:
        metas, payloads = load_sources(Path(out), kind, WORLD)
        wqkv = next(m for m in metas if m.name == WQKV)
        plans = check_vllm_loads(CKPT, metas, payloads, SPECS, loads, kind)
        result[kind] = {
            "shapes": {m.name: list(m.shape) for m in metas},
            "wqkv_rank0_pieces": [list(map(list, p.box)) for p in wqkv.pieces
                                  if p.rank == 0],
            "plans": {spec: [plan.nbytes_moved, plan.nbytes_min]
                      for spec, plan in zip(SPECS, plans)},
        }
    result["compared"] = {f"{spec} worker {w}": len(params) for (spec, w), params in loads.items()}
    Path(out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
