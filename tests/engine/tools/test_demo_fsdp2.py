"""``m2nkit demo --trainer fsdp2:...``: real FSDP2 trainers that train between rounds.

``run_demo`` end to end, its processes forked from the preloaded forkserver
(tests/_procs.py) so that a run costs seconds, not an import of torch per
process: trainers build the model with transformers, apply the family's TP
plan, ``fully_shard`` it, take one AdamW step on random tokens per round and
send through ``fsdp2_source``; every worker must be bit-exact against the
trained parameters (gathered by the harness, saved with ``save_pretrained``,
loaded by ``reference_load``) after each round. The live manifest must match
the dry run of the same spec. The CLI path (spawned processes, progress
lines, Ctrl-C) is tests/engine/tools/test_demo_ux.py's.
"""

from __future__ import annotations

import pytest
import torch

from _procs import ensure_forkserver


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    ensure_forkserver()


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
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


def test_baseline_moves_what_the_fsdp2_trainer_holds(tmp_path):
    """The demo's gather-then-broadcast baseline reads the trainers' parameters saved after
    the step (``held_stream``) in the live manifest's layout and wire dtypes: every rank's
    stream equals ``fsdp2_source(...).iter_local()`` of the real ``fully_shard`` model, bit
    for bit (HSDP (2, 2), fp32 masters with values bf16 cannot hold, bf16 policy, so the
    cast is exercised). One process, torch's fake process group, one rank at a time."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed import fake_pg
    from transformers import AutoModelForCausalLM

    from m2nkit.adapters.fsdp2 import fsdp2_source
    from m2nkit.adapters.hf_checkpoint import read_checkpoint
    from m2nkit.adapters.tiny import tiny_config
    from m2nkit.engine.in_process import bitwise_equal
    from m2nkit.engine.tools.baseline import held_stream

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    torch.manual_seed(5)
    trained = AutoModelForCausalLM.from_config(tiny_config("tiny-qwen3-moe"), dtype=torch.float32)
    trained.save_pretrained(tmp_path)  # what _save_trained writes after the step
    ckpt = read_checkpoint(tmp_path)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=fake_pg.FakeStore())
        try:
            model = copy.deepcopy(trained)
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            src = fsdp2_source(model)
            live = list(src.iter_local())
            held = list(held_stream(ckpt, src.metadata, 4, rank))
            assert [n for n, _ in held] == [n for n, _ in live]
            assert {t.dtype for _, t in held} == {torch.bfloat16}
            for (name, a), (_, b) in zip(held, live):
                assert bitwise_equal(a, b), (rank, name)
        finally:
            dist.destroy_process_group()


# Over the fast suite's budget (FSDP2 trainer and worker processes): in the integration run.
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_colocated_fsdp2_trainers_expose_their_shards_and_every_worker_is_bit_exact(tmp_path):
    """``m2nkit demo --colocated --trainer fsdp2:...``: the ``ipc`` transport from real
    ``fully_shard`` trainers (bf16 casts of fp32 masters, fresh each round: exposed once per
    round) into the workers, bit-exact against the trained parameters after each step."""
    from m2nkit.engine.tools.demo import run_demo

    lines: list[str] = []
    result = run_demo("tiny-qwen3-moe", "fsdp2:dp_shard=2", "vllm:tp=2", rounds=2, timeout_s=60,
                      baseline=False, workdir=str(tmp_path), log=lines.append,
                      start_method="forkserver", colocated=True)
    assert result.transport == "ipc"
    assert [r.index for r in result.rounds] == [1, 2]
    for r in result.rounds:
        assert r.verified_workers == 2
        assert sum(r.bytes_per_rank) == result.nbytes_min
    text = "\n".join(lines)
    assert "round 2: one AdamW step" in text and "against the trained parameters" in text
