"""``m2nkit demo --trainer fsdp2:...``: real FSDP2 trainers that train between rounds.

``run_demo`` end to end, its processes forked from the preloaded forkserver
(tests/_procs.py) so that a run costs seconds, not an import of torch per
process: trainers build the model with transformers, apply the family's TP
plan, ``fully_shard`` it, take one AdamW step on random tokens per round and
send through ``fsdp2_source``; every worker must be bit-exact against the
trained parameters (gathered by the harness, saved with ``save_pretrained``,
loaded by ``reference_load``) after each round. The live manifest must match
the dry run of the same spec. The CLI path (spawned processes, progress
lines, Ctrl-C) is tests/test_demo_ux.py's.
"""

from __future__ import annotations

import pytest
import torch

from _procs import ensure_forkserver


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    ensure_forkserver()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,trainer,inference", [
    ("tiny-qwen3-moe", "fsdp2:dp_shard=2,tp=2", "vllm:tp=2"),        # FSDP + TP, MoE
    ("tiny-llama", "fsdp2:dp_replicate=2,dp_shard=2", "vllm:tp=1"),  # HSDP, dense
])
def test_fsdp2_trainers_train_and_every_worker_is_bit_exact(tmp_path, model, trainer, inference):
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.engine.tools.demo import run_demo

    lines: list[str] = []
    result = run_demo(model, trainer, inference, rounds=2, timeout_s=60, baseline=False,
                      workdir=str(tmp_path), log=lines.append, start_method="forkserver")
    assert [r.index for r in result.rounds] == [1, 2]
    for r in result.rounds:
        assert r.verified_workers == (2 if inference == "vllm:tp=2" else 1)
        assert sum(r.bytes_per_rank) == result.nbytes_min
        assert r.loss is not None and r.loss > 0
    text = "\n".join(lines)
    assert f"the live FSDP2 manifest matches the dry run of {trainer}" in text
    assert "round 2: one AdamW step" in text and "against the trained parameters" in text
    # the steps changed the weights, round after round
    start = full_checkpoint_tensors(read_checkpoint(tmp_path / model))
    one, two = (full_checkpoint_tensors(read_checkpoint(tmp_path / f"trained-v{k}"))
                for k in (1, 2))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(one[name].to(start[name].dtype), start[name])
    assert not torch.equal(one[name], two[name])
