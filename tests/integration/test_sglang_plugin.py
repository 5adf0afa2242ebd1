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
    ("tiny-qwen3", "sglang:tp=4", "2 KV heads < tp=4 (SGLang replicates them)"),
]
ROUND_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def host():
    from m2nkit.engine.tools.sglang_workers import SGLangWorkers, sglang_python

    if not sglang_python().exists():
        pytest.fail(f"{sglang_python()} is missing: scripts/setup.sh installs SGLang's stack "
                    "there (scripts/side_sglang.sh)")
    from _paths import REPO

    tests = REPO / "tests"
    with SGLangWorkers(timeout_s=600, path=(tests / "integration", tests)) as h:
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


@pytest.mark.parametrize("name,inference,covers", CASES,
                         ids=[f"{c[0]}-{c[1].split(':')[1]}" for c in CASES])
def test_fsdp2_round_into_live_sglang_model_equals_fresh_sglang_load(host, versions, name,
                                                                      inference, covers):
    v0, v1 = versions(name)
    started = host.start_workers(v0, inference)
    assert all(s["model"].endswith("ForCausalLM") for s in started), started
    outcome = _run_fsdp2_trainers(host.client, v1, inference)
    assert outcome == {0: "done", 1: "done"}, outcome
    reports = host.client.verify(v1)
    assert len(reports) == len(started) == int(inference.split("tp=")[1][0])
    for w, r in enumerate(reports):
        assert r["compared"] == started[w]["parameters"] > 0
        assert (r["names_only_live"], r["names_only_fresh"]) == ([], []), (w, r)
        assert r["differ"] == [], f"worker {w}: differs from SGLang's fresh load of v1: {r['differ']}"
        assert r["unchanged_since_start"] == [], f"worker {w}: still v0: {r['unchanged_since_start']}"
        assert r["moved"] == [], f"worker {w}: parameters re-allocated: {r['moved']}"
        assert (r["version"], r["sglang_version"]) == ("v1", "v1"), (w, r)
    if "tied" in name:
        assert host.client.collective_rpc(_tied_storage) == [True] * len(started)


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


def _deepseek(checkpoint, out):
    """``checkpoint`` with the two config keys SGLang reads on CPU (same weights; see
    ``test_sglang_layout.DEEPSEEK_CPU_KEYS``)."""
    import json

    from tests.integration.test_sglang_layout import DEEPSEEK_CPU_KEYS

    out.mkdir(parents=True)
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(DEEPSEEK_CPU_KEYS)
    config["rope_parameters"] = {**config.get("rope_parameters", {}),
                                 **DEEPSEEK_CPU_KEYS["rope_scaling"]}
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    return out


def test_deepseek_v3_round_equals_fresh_sglang_load_with_mla_post_load(host, versions,
                                                                       tmp_path):
    """DeepSeek-V3 (MLA with q_lora, MoE with a shared expert and a dense first layer) at
    tp 2 with EP, from checkpoint trainers (``fsdp:2``, each rank its own box): every
    parameter equals SGLang's fresh load, and the MLA ``w_kc``/``w_vc`` SGLang derives
    from ``kv_b_proj`` (``post_load_weights``, which the plugin runs after the commit)
    equal those of the fresh load."""
    from m2nkit.engine.tools.demo_vllm import trainer_main
    from m2nkit.engine.tools.procs import free_port

    v0, v1 = versions("tiny-deepseek-v3")
    v0, v1 = _deepseek(v0, tmp_path / "v0"), _deepseek(v1, tmp_path / "v1")
    inference = "sglang:tp=2,ep"
    started = host.start_workers(v0, inference)
    port = free_port()
    outcome = trainer_outcomes(CTX, trainer_main, lambda r, results: (
        r, 2, [str(v1)], "fsdp:2", inference, host.client if r == 0 else None, port,
        ROUND_TIMEOUT_S, results), 2, ROUND_TIMEOUT_S)
    assert outcome == {0: "done", 1: "done"}, outcome
    for w, r in enumerate(host.client.verify(v1)):
        assert r["compared"] == started[w]["parameters"] > 0
        assert (r["names_only_live"], r["names_only_fresh"], r["differ"]) == ([], [], []), (w, r)
        assert (r["unchanged_since_start"], r["moved"]) == ([], []), (w, r)
        assert r["derived"] > 0 and r["derived_differ"] == [], (w, r)
        assert (r["version"], r["sglang_version"]) == ("v1", "v1"), (w, r)


def test_demo_with_sglang_receiver_verifies_every_round(tmp_path):
    """``m2nkit demo --receiver sglang``: 2 rounds from checkpoint trainers into real SGLang
    TP workers, each round checked inside against SGLang's own fresh load of that round's
    checkpoint and SGLang's weight_version (the demo raises otherwise)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", "--receiver",
                          "sglang", "--model", "tiny-qwen3-moe", "--trainer", "fsdp:2",
                          "--inference", "sglang:tp=2,ep", "--rounds", "2", "--timeout", "120"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for k in (1, 2):
        assert f"round {k}: " in run.stdout and f"equals a fresh SGLang load of v{k}" \
            in run.stdout, run.stdout[-3000:]


def _megatron_trainer_main(rank: int, world: int, checkpoint: str, inference: str, client,
                           port: int, dist_port: int, timeout_s: float, results) -> None:
    """One Megatron-Core trainer rank (tp=2 over gloo): ``checkpoint`` built and loaded
    through Megatron-Bridge (``demo_bridge.build_bridge_model``), sent by
    ``megatron_source`` in one round ``v1``; reports as ``demo_vllm.trainer_main`` does."""
    import contextlib
    import os
    import traceback
    from datetime import timedelta

    try:
        import torch.distributed as dist
        from transformers import AutoConfig

        from m2nkit.adapters import megatron_source
        from m2nkit.engine.tools.demo_bridge import _setup_child, build_bridge_model, init_megatron
        from m2nkit.engine.tools.demo_vllm import destination_for
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        _setup_child()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=6 * timeout_s))
        init_megatron(world, 1)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            bridge, model = build_bridge_model(checkpoint, world, 1)
        source = megatron_source(model, config=bridge.hf_pretrained.config)
        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=world, master_port=port,
                                  destination=destination_for(
                                      AutoConfig.from_pretrained(checkpoint), inference),
                                  timeout_s=timeout_s)
        engine = M2NTrainerEngine.trainer_init(info, client=client, source=source)
        engine.send_weights("v1")
        engine.shutdown()
        results.put(("done", rank, None, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


def test_megatron_core_tp2_round_equals_fresh_sglang_load(host, versions):
    """Megatron-Core trainers (GPTModel at tp=2, built and loaded from v1 through
    Megatron-Bridge, ``megatron_source``'s local shards) into SGLang tp=2: every parameter
    equals SGLang's own fresh load of v1."""
    from m2nkit.engine.tools.procs import free_port

    v0, v1 = versions("tiny-qwen3")
    inference = "sglang:tp=2"
    started = host.start_workers(v0, inference)
    port, dist_port = free_port(), free_port()
    outcome = trainer_outcomes(CTX, _megatron_trainer_main, lambda r, results: (
        r, 2, str(v1), inference, host.client if r == 0 else None, port, dist_port,
        ROUND_TIMEOUT_S, results), 2, ROUND_TIMEOUT_S, wait_s=900)
    assert outcome == {0: "done", 1: "done"}, outcome
    for w, r in enumerate(host.client.verify(v1)):
        assert r["compared"] == started[w]["parameters"] > 0
        assert (r["names_only_live"], r["names_only_fresh"], r["differ"]) == ([], [], []), (w, r)
        assert (r["unchanged_since_start"], r["moved"]) == ([], []), (w, r)
        assert (r["version"], r["sglang_version"]) == ("v1", "v1"), (w, r)
