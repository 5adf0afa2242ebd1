"""Real ``fully_shard`` models into every vLLM layout the planner supports, bit-exact.

The trainer weights are the oracle checkpoints (``tests/data/oracle/<model>/checkpoint``,
the files vLLM 0.33.0 loaded to make the dumps beside them), loaded with
transformers' ``from_pretrained``. One gloo process group of 4 forked ranks
shards each model once per mesh kind:

* ``fsdp``: ``fully_shard`` on a 1-D mesh of 4 (bf16 parameters);
* ``hsdp``: ``(dp_replicate=2, dp_shard=2)``, fp32 masters under a bf16
  ``MixedPrecisionPolicy`` (bf16 -> fp32 -> bf16 is exact, so still the
  checkpoint's bytes);
* ``tp``: the family's TP plan over ``tp=2``, then ``fully_shard`` over
  ``dp_shard=2`` (``_StridedShard`` pieces);
* ``experts``: ``shard_placement_fn`` puts the stacked experts on dim 1 (MoE
  families only: a dense model has no 3-D parameter, so it would be ``fsdp``).

Each rank returns its ``fsdp2_source`` manifest and the tensors ``iter_local``
yields; the parent plans each against every vLLM layout below and runs the
plan in-process (``engine/in_process.py``). Every worker parameter is compared bit
for bit with the real vLLM loader dump of that layout where one exists
(``vllm:tp=T`` and ``vllm:tp=T,ep`` of ``tests/data/oracle``), else with
``reference_load`` of the same checkpoint (dense ``tp=4``, Mixtral ``tp=4``
without EP, and every ``dp=2`` layout: the oracle holds one TP group).
Uneven shards are ``tests/adapters/test_fsdp2.py``'s (world 3 and 6, a few layouts
each); here world 4 keeps one process group for every kind.
"""

from __future__ import annotations

import copy
import json
import time
from functools import lru_cache
from pathlib import Path

from _paths import ORACLE
import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file

from _procs import gloo_rank, join_ranks, save_source
from test_fsdp2 import Case, _mesh, _shard

from m2nkit.adapters.fsdp2 import fsdp2_source
from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
from m2nkit.adapters.vllm import destination_layout, parse_inference_spec, reference_load
from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
from m2nkit.engine.plan import build_plan
from m2nkit.engine.tools.procs import free_port
from m2nkit.manifest import manifest_from_json

WORLD = 4
TIMEOUT_S = 150
DENSE = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
MOE = ("tiny-qwen3-moe", "tiny-mixtral")
#: Every layout the planner supports for 8 heads / 2 KV heads / 8 experts: tp 1, 2, 4, 8
#: (vLLM replicates KV heads past 2), dp 2, and EP for MoE.
DENSE_SPECS = ("vllm:tp=1", "vllm:tp=2", "vllm:tp=4", "vllm:tp=8", "vllm:tp=2,dp=2",
               "vllm:tp=1,dp=2")
MOE_SPECS = DENSE_SPECS + ("vllm:tp=2,ep", "vllm:tp=4,ep", "vllm:tp=8,ep", "vllm:tp=2,dp=2,ep",
                           "vllm:tp=1,dp=2,ep")
KINDS = ("fsdp", "hsdp", "tp", "experts")


def _families(kind: str) -> tuple[str, ...]:
    return MOE if kind == "experts" else DENSE + MOE


def _rank_main(rank, world, port, models, out):
    with gloo_rank(rank, world, port, TIMEOUT_S // 2):
        for kind in KINDS:
            mesh = _mesh(kind, world)
            for name in _families(kind):
                model = copy.deepcopy(models[name])
                if kind == "hsdp":
                    model = model.float()  # fp32 masters; _shard adds the bf16 policy
                sharded = _shard(kind, Case(name, model, Path(), None, ()), mesh)
                save_source(fsdp2_source(sharded), world, Path(out) / f"{kind}.{name}.r{rank}.pt")


@lru_cache(maxsize=None)
def _checkpoint(name: str):
    ckpt = read_checkpoint(ORACLE / name / "checkpoint")
    return ckpt, full_checkpoint_tensors(ckpt)


def _dump_dir(name: str, spec) -> Path | None:
    """The oracle's dump of this layout (one TP group, dp 1, linear placement), if any."""
    if spec.dp != 1:
        return None
    d = ORACLE / name / (f"tp{spec.tp}" + ("_ep" if spec.ep else ""))
    return d if d.is_dir() else None


@lru_cache(maxsize=None)
def _expected(name: str, text: str, worker: int) -> tuple[str, dict[str, torch.Tensor]]:
    """(``"vllm"`` or ``"reference_load"``, the worker's parameters)."""
    spec = parse_inference_spec(text)
    d = _dump_dir(name, spec)
    if d is not None:
        path = d / f"rank{worker}.safetensors"
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert (meta["vllm_version"], int(meta["tp_size"]), int(meta["tp_rank"])) == (
            "0.33.0", spec.tp, worker)
        assert meta["enable_expert_parallel"] == str(spec.ep)
        return "vllm", load_file(str(path))
    ckpt, tensors = _checkpoint(name)
    return "reference_load", reference_load(ckpt.config, tensors, spec, worker,
                                            fill=float("nan"))


def _run_ranks(models, out: Path) -> float:
    import torch.distributed.fsdp  # noqa: F401  (once here, not once per forked rank)
    import torch.distributed.tensor.parallel  # noqa: F401

    return join_ranks(mp.start_processes(_rank_main, args=(WORLD, free_port(), models, str(out)),
                                         nprocs=WORLD, join=False, start_method="fork"), TIMEOUT_S)


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(300)
def test_every_mesh_kind_into_every_vllm_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    models = {n: AutoModelForCausalLM.from_pretrained(ORACLE / n / "checkpoint",
                                                      dtype=torch.bfloat16)
              for n in DENSE + MOE}
    seconds = _run_ranks(models, tmp_path)
    checked: dict[str, set] = {"vllm": set(), "reference_load": set()}
    t0 = time.monotonic()
    for kind in KINDS:
        for name in _families(kind):
            payloads = [torch.load(tmp_path / f"{kind}.{name}.r{r}.pt") for r in range(WORLD)]
            docs = [p["manifest"] for p in payloads]
            assert all(d == docs[0] for d in docs), (kind, name, "metadata differs between ranks")
            metas, T = manifest_from_json(docs[0])
            ckpt, _ = _checkpoint(name)
            assert [m.name for m in metas] == ckpt.names, (kind, name)
            assert {m.dtype for m in metas} == {torch.bfloat16}, (kind, name)
            for text in (MOE_SPECS if name in MOE else DENSE_SPECS):
                dest = destination_layout(ckpt.config, metas, text)
                plan = build_plan(metas, T, dest)
                assert plan.problems == [], (kind, name, text, plan.problems[:3])
                storage = {w: allocate_storage(dest, w) for w in range(dest.num_workers)}
                execute_plan(plan, {r: iter(payloads[r]["locals"]) for r in range(T)}, storage)
                for w, params in storage.items():
                    source, want = _expected(name, text, w)
                    checked[source].add((name, text))
                    if source == "vllm":  # the dump also lists aliases (same storage)
                        assert set(want) - set(params) == set(dest.aliases), (name, text)
                    assert set(params) <= set(want), (name, text, set(params) - set(want))
                    for pname, t in params.items():
                        assert bitwise_equal(t, want[pname]), (kind, name, text, w, pname, source)
    # the oracle covered what it has: tp 1/2/8 for every family, EP and tp 4 for MoE
    assert {(n, t) for n, t in checked["vllm"] if n == "tiny-llama"} == {
        ("tiny-llama", f"vllm:tp={t}") for t in (1, 2, 8)}
    assert ("tiny-qwen3-moe", "vllm:tp=8,ep") in checked["vllm"]
    assert ("tiny-mixtral", "vllm:tp=4") in checked["reference_load"]
    print(f"ranks {seconds:.1f} s, plans and checks {time.monotonic() - t0:.1f} s; "
          f"{len(checked['vllm'])} (model, layout) pairs against vLLM dumps, "
          f"{len(checked['reference_load'])} against reference_load")
