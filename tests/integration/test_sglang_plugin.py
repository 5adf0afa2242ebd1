"""m2nkit inside SGLang 0.5.23's workers (its custom weight loader), on SGLang's own model objects (CPU).

Each TP worker is a process under ``.venv-sglang`` holding SGLang's own model
class for the checkpoint, built in SGLang's parallel state over real gloo
groups and loaded by SGLang's ``load_weights`` from v0; every weight-sync
call goes through SGLang's own weight-update path with that live model
(``SchedulerWeightUpdaterManager`` -> ``WeightUpdater.update_weights_from_tensor``
-> ``dynamic_import(load_format)(model, named_tensors)``), as requests the
real ``SGLangClient`` builds from SGLang's ``io_struct`` classes
(``m2nkit.engine.tools.sglang_workers``). The trainers are FSDP2 processes in
``.venv`` (transformers' model, ``fully_shard`` over gloo, fp32 masters with a
bf16 ``MixedPrecisionPolicy``: ``demo_vllm.fsdp2_trainer_main``) that send one
round of v1 (another seed). Then every parameter of every worker must equal,
bit for bit, what SGLang's ``load_weights`` makes of v1 in a fresh model (names,
dtypes, bytes), none may keep its v0 value or move in memory, and the version
is committed in m2nkit's receiver and in SGLang's own ``weight_version``. The
expected values come from SGLang's loader, never from m2nkit.

Plus the refusal: a live parameter whose shape differs from the plan on one
worker is refused on every trainer rank naming the worker, the parameter and
both shapes, and nothing is written.
"""

from __future__ import annotations

import pytest

from _procs import CTX, trainer_outcomes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

FSDP2 = "fsdp2:dp_shard=2"
CASES = [  # (tiny model, SGLang layout, what it covers)
    ("tiny-qwen3", "sglang:tp=2", "dense Qwen3 (8 query / 2 KV heads)"),
    ("tiny-qwen3-moe", "sglang:tp=2,ep", "Qwen3-MoE with expert parallelism"),
    ("tiny-qwen3-tied", "sglang:tp=2", "tied embeddings"),
]
ROUND_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def host():
    from m2nkit.engine.tools.sglang_workers import SGLangWorkers, sglang_python

    if not sglang_python().exists():
        pytest.fail(f"{sglang_python()} is missing: scripts/setup.sh installs SGLang's stack "
                    "there (scripts/side_sglang.sh)")
    with SGLangWorkers(timeout_s=600) as h:
        yield h


@pytest.fixture(scope="module")
def versions(tmp_path_factory, tiny_checkpoints):
    """``versions(name) -> (v0, v1)``: seed 0 (shared fixture) and seed 1 of the same config."""
    from m2nkit.adapters.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("v1")
    made = {}

    def get(name):
        if name not in made:
            made[name] = (tiny_checkpoints(name), save_tiny_checkpoint(name, root / name, seed=1))
        return made[name]

    return get


def _run_fsdp2_trainers(client, checkpoint, inference, timeout_s=ROUND_TIMEOUT_S) -> dict:
    from m2nkit.engine.tools.demo_vllm import fsdp2_trainer_main
    from m2nkit.engine.tools.procs import free_port

    port, dist_port = free_port(), free_port()
    return trainer_outcomes(CTX, fsdp2_trainer_main, lambda r, results: (
        r, 2, str(checkpoint), FSDP2, inference, client if r == 0 else None, port, dist_port,
        timeout_s, results), 2, timeout_s)


@pytest.mark.parametrize("name,inference,covers", CASES, ids=[c[0] for c in CASES])
def test_fsdp2_round_into_live_sglang_model_equals_fresh_sglang_load(host, versions, name,
                                                                      inference, covers):
    v0, v1 = versions(name)
    started = host.start_workers(v0, inference)
    assert all(s["model"].endswith("ForCausalLM") for s in started), started
    outcome = _run_fsdp2_trainers(host.client, v1, inference)
    assert outcome == {0: "done", 1: "done"}, outcome
    reports = host.client.verify(v1)
    assert len(reports) == len(started) == 2
    for w, r in enumerate(reports):
        assert r["compared"] == started[w]["parameters"] > 0
        assert (r["names_only_live"], r["names_only_fresh"]) == ([], []), (w, r)
        assert r["differ"] == [], f"worker {w}: differs from SGLang's fresh load of v1: {r['differ']}"
        assert r["unchanged_since_start"] == [], f"worker {w}: still v0: {r['unchanged_since_start']}"
        assert r["moved"] == [], f"worker {w}: parameters re-allocated: {r['moved']}"
        assert (r["version"], r["sglang_version"]) == ("v1", "v1"), (w, r)
    if "tied" in name:
        assert host.client.collective_rpc(_tied_storage) == [True, True]


def _tied_storage(state) -> bool:
    params = dict(state["model"].named_parameters(remove_duplicate=False))
    return params["lm_head.weight"].data_ptr() == params["model.embed_tokens.weight"].data_ptr()


PADDED = "model.layers.0.mlp.experts.w13_weight"


def _pad_experts_on_worker_1(state) -> list[int] | None:
    """TP rank 1 only: pad the expert tensor's row dim by 32, as a GPU MoE kernel's
    allocation might; returns the new shape."""
    import torch

    if state["worker"] != 1:
        return None
    p = dict(state["model"].named_parameters())[PADDED]
    e, rows, h = p.shape
    p.data = torch.zeros(e, rows + 32, h, dtype=p.dtype)
    return list(p.shape)


def test_live_sglang_model_unlike_the_plan_is_refused_on_every_rank(host, versions):
    name, inference = "tiny-qwen3-moe", "sglang:tp=2,ep"
    v0, v1 = versions(name)
    host.start_workers(v0, inference)
    shapes = host.client.collective_rpc(_pad_experts_on_worker_1)
    assert shapes[0] is None and shapes[1] == [4, 96, 128], shapes
    outcome = _run_fsdp2_trainers(host.client, v1, inference, timeout_s=40.0)
    # Worker 1 is rank 3 (2 trainer ranks); every trainer rank names it, the parameter and
    # both shapes, before any byte moved.
    for rank in (0, 1):
        msg = outcome[rank]
        assert "PlanMismatchError" in msg, msg
        assert "rank 3 refused" in msg and "worker 1" in msg, msg
        assert f"'{PADDED}': SGLang's model holds [4, 96, 128] bfloat16, m2nkit's table " \
               "declares [4, 64, 128] bfloat16" in msg, msg
    reports = host.client.verify(v0)
    assert reports[0]["differ"] == [] and reports[0]["version"] is None   # still v0, untouched
    assert reports[0]["sglang_version"] != "v1"
