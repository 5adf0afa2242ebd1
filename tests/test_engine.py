"""The trainer engine against real receiver processes over the HTTP control plane.

Everything here is real: trainer processes (spawned), the inference server's
worker processes, gloo over 127.0.0.1, vLLM's weight-transfer routes. Faults
are injected from inside the trainer's own source (a provider that stalls,
dies or kills a worker when the engine reaches a given wire tensor), so
"mid-round" is exact, not a race. Expected bytes come from
``reference_load`` of the shifted checkpoint, never from the planner.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-qwen3-moe"
TIMEOUT = 8.0  # seconds: every wait in these sessions


# --------------------------------------------------------------------------
# demo matrix: dense and MoE, fsdp (uneven) and hsdp, tp 1/2/4, dp 2, ep


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model,trainer,inference", [
    ("tiny-llama", "fsdp:3", "vllm:tp=4"),          # tp > 2 KV heads: replicated k/v rows
    ("tiny-qwen3-tied", "fsdp:3", "vllm:tp=1"),     # tied embeddings, uneven fsdp
    ("tiny-qwen3-moe", "hsdp:2,2", "vllm:tp=2,dp=2"),  # replicas balanced, dp replicas
    ("tiny-mixtral", "fsdp:3", "vllm:tp=2,ep"),     # experts by ep, uneven fsdp
])
def test_demo_rounds_are_bit_exact_over_http(tmp_path, model, trainer, inference):
    from m2nkit.engine.demo import run_demo

    result = run_demo(model, trainer, inference, rounds=2, timeout_s=30, bucket_bytes=64 << 10,
                      workdir=str(tmp_path), baseline=False, log=lambda *a: None)
    # run_demo raises if any worker's bytes or version are wrong; check the
    # accounting too: every round sends exactly the minimum.
    assert [r.index for r in result.rounds] == [1, 2]
    for r in result.rounds:
        assert sum(r.bytes_per_rank) == result.nbytes_min
        assert r.verified_workers == (4 if "dp=2" in inference or "tp=4" in inference else
                                      1 if "tp=1" in inference else 2)


# --------------------------------------------------------------------------
# fault injection


def _trainer(rank, T, model_dir, trainer, inference, url, port, fault, results, rounds=1,
             reorder=False, extra=False):
    """A trainer process; ``fault`` = (round, wire index, action) or None."""
    from m2nkit.engine.server import exit_with_parent

    exit_with_parent()
    torch.set_num_threads(1)
    try:
        from m2nkit.adapters.hf_checkpoint import read_checkpoint
        from m2nkit.adapters.trainer_spec import parse_trainer_spec
        from m2nkit.engine.clients import HTTPClient
        from m2nkit.engine.demo import shifted_source
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo
        from m2nkit.manifest import M2NManifestEntry, ManifestM2NWeightSource

        ckpt = read_checkpoint(model_dir)
        state = {"round": 0}
        src = shifted_source(ckpt, parse_trainer_spec(trainer), rank, state)
        entries = list(src.entries)
        if fault is not None:
            f_round, f_wire, action = fault
            e = entries[f_wire]

            def provider(e=e):
                if state["round"] == f_round:
                    if action == "stall":
                        time.sleep(3600)
                    elif action == "die":
                        os._exit(17)
                    elif isinstance(action, tuple) and action[0] == "kill":
                        os.kill(action[1], signal.SIGKILL)
                return e.local_tensor()

            entries[f_wire] = M2NManifestEntry(e.name, e.dtype, e.global_shape, e.source_layout,
                                               provider)
        if reorder:
            entries[3], entries[4] = entries[4], entries[3]
        if extra:
            from m2nkit.manifest.layout import SourceLayout
            entries.append(M2NManifestEntry("model.extra.weight", torch.bfloat16, (4,),
                                            SourceLayout(), lambda: torch.zeros(4, dtype=torch.bfloat16)))
        source = ManifestM2NWeightSource(entries, rank=rank)
        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=T, inference=inference,
                                  model_config=ckpt.config, master_port=port, timeout_s=TIMEOUT,
                                  bucket_bytes=16 << 10)
        client = HTTPClient(url, timeout_s=6 * TIMEOUT) if rank == 0 else None
        engine = M2NTrainerEngine.trainer_init(info, client=client, source=source)
        for k in range(1, rounds + 1):
            state["round"] = k
            try:
                engine.send_weights(f"v{k}")
            except Exception as e:
                # A failed engine refuses further rounds at once (no RPC, no wait).
                t0 = time.monotonic()
                try:
                    engine.send_weights("again")
                except Exception as again:  # noqa: BLE001
                    results.put(("retry", rank, (f"{type(again).__name__}: {again}",
                                                 time.monotonic() - t0)))
                raise e
            results.put(("ok", rank, k))
        engine.shutdown()
        try:
            engine.send_weights("after-shutdown")
        except ValueError as e:
            results.put(("after_shutdown", rank, str(e)))
        results.put(("done", rank, None))
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        results.put(("error", rank, f"{type(e).__name__}: {e}"))


def _run_trainers(url, T, trainer, inference, faults=None, rounds=1, budget=None, hang=(), **kw):
    """Spawn T trainers; return ({rank: [messages]}, seconds, exit codes, killed).

    Waits until every rank not in ``hang`` has finished (reported done or an
    error, or exited), then kills whatever is left. Never hangs past ``budget``.
    """
    from m2nkit.engine.demo import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    for r in range(T):
        args = (r, T, str(EXAMPLE), trainer, inference, url, port, (faults or {}).get(r), results,
                rounds)
        kwargs = {k: v for k, v in kw.items() if k in ("reorder", "extra") and r in kw.get("ranks", ())}
        procs.append(ctx.Process(target=_trainer, args=args, kwargs=kwargs, daemon=True))
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + (budget or 60)
    msgs: dict[int, list] = {r: [] for r in range(T)}

    def finished(r):
        return any(k in ("done", "error") for k, _ in msgs[r]) or not procs[r].is_alive()

    try:
        while time.monotonic() < deadline and not all(finished(r) for r in range(T) if r not in hang):
            try:
                kind, rank, payload = results.get(timeout=0.2)
                msgs[rank].append((kind, payload))
            except queue.Empty:
                pass
        seconds = time.monotonic() - t0
        for p in procs:
            p.join(max(0.1, min(5.0, deadline - time.monotonic())))
    finally:
        killed = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    while True:
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            break
        msgs[rank].append((kind, payload))
    return msgs, seconds, [p.exitcode for p in procs], killed


@pytest.fixture
def server():
    from m2nkit.engine.server import InferenceServer

    srv = InferenceServer(EXAMPLE, "vllm:tp=2", timeout_s=6 * TIMEOUT)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _check_workers(server, tmp_path, round_index):
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.demo import shift
    from m2nkit.engine.local import bitwise_equal

    ck = read_checkpoint(EXAMPLE)
    full = {n: shift(t, round_index) for n, t in full_checkpoint_tensors(ck).items()}
    for w in range(server.num_workers):
        got = server.storage(w, tmp_path / f"check{round_index}-{w}")
        ref = reference_load(ck.config, full, "vllm:tp=2", w)
        assert set(got) <= set(ref)
        for name, t in got.items():
            assert bitwise_equal(t, ref[name]), (w, name)


def _errors(msgs):
    return {r: [p for k, p in m if k == "error"] for r, m in msgs.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("action", ["stall", "die"])
def test_trainer_stall_or_death_mid_round_fails_everyone_and_keeps_the_version(server, tmp_path, action):
    # Round 1 succeeds; in round 2 trainer rank 1 stalls (or dies) when the
    # engine reaches wire tensor 10 of 25.
    msgs, seconds, codes, killed = _run_trainers(server.url, 3, "fsdp:3", "vllm:tp=2",
                                                 faults={1: (2, 10, action)}, rounds=2,
                                                 budget=10 * TIMEOUT, hang=(1,))
    errors = _errors(msgs)
    assert [("ok", 1) in msgs[r] for r in range(3)] == [True] * 3
    # Every other trainer ends with a clear error within the bound (no hang).
    for r in (0, 2):
        assert errors[r], msgs[r]
        assert "TransferError" in errors[r][0] or "WeightSyncError" in errors[r][0], errors[r]
    if action == "die":
        assert codes[1] == 17
    else:
        assert killed == [1]  # only the staller was still there to kill
    # Errors arrive within the bound: a wait times out after TIMEOUT, the
    # end-of-round verdict after at most another TIMEOUT.
    assert seconds < 4 * TIMEOUT
    for r in (0, 2):
        retry = [p for k, p in msgs[r] if k == "retry"]
        assert retry and "build a fresh engine" in retry[0][0] and retry[0][1] < 1.0, msgs[r]
    # The workers refused to commit round 2: still at v1 with v1's bytes.
    assert server.weight_versions() == ["v1", "v1"]
    _check_workers(server, tmp_path, 1)
    # A fresh engine (new trainer processes, new group) runs the next round.
    msgs, _, codes, _ = _run_trainers(server.url, 3, "fsdp:3", "vllm:tp=2", rounds=2,
                                      budget=10 * TIMEOUT)
    assert not any(_errors(msgs).values()), msgs
    for r in range(3):
        assert any(k == "after_shutdown" and "after shutdown()" in p for k, p in msgs[r]), msgs[r]
    assert server.weight_versions() == ["v2", "v2"]
    _check_workers(server, tmp_path, 2)


@pytest.mark.timeout(300)
def test_worker_killed_mid_round_fails_every_trainer_within_the_timeout(tmp_path):
    from m2nkit.engine.server import InferenceServer

    with InferenceServer(EXAMPLE, "vllm:tp=2", timeout_s=6 * TIMEOUT) as srv:
        victim = srv.worker_pids[1]
        msgs, seconds, codes, killed = _run_trainers(srv.url, 2, "fsdp:2", "vllm:tp=2",
                                                     faults={0: (1, 12, ("kill", victim))},
                                                     budget=10 * TIMEOUT)
        errors = _errors(msgs)
        assert all(errors[r] for r in range(2)), msgs
        assert not killed and seconds < 4 * TIMEOUT
        # The surviving worker did not commit the broken round.
        with pytest.raises(Exception, match="worker 1"):
            srv.weight_versions()
    # A fresh server and fresh engines run the next round.
    with InferenceServer(EXAMPLE, "vllm:tp=2", timeout_s=6 * TIMEOUT) as srv:
        msgs, _, _, _ = _run_trainers(srv.url, 2, "fsdp:2", "vllm:tp=2", budget=10 * TIMEOUT)
        assert not any(_errors(msgs).values()), msgs
        assert srv.weight_versions() == ["v1", "v1"]
        _check_workers(srv, tmp_path, 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,needle", [
    ("reorder", "wire tensor #3"),
    ("extra", "model.extra.weight"),
])
def test_one_rank_with_a_different_manifest_is_refused_everywhere(server, kind, needle):
    msgs, seconds, codes, killed = _run_trainers(server.url, 3, "fsdp:3", "vllm:tp=2",
                                                 budget=10 * TIMEOUT, ranks=(1,), **{kind: True})
    errors = _errors(msgs)
    for r in range(3):
        assert errors[r], msgs[r]
        assert needle in errors[r][0], errors[r]
        assert "PlanMismatchError" in errors[r][0], errors[r]
    assert seconds < 4 * TIMEOUT
    # The workers refused too, and nothing moved.
    assert server.weight_versions() == [None, None]


def test_nccl_m2n_transport_is_refused_clearly_without_cuda():
    # The GPU path itself is exercised by benchmarks/gpu_check.py on a GPU
    # machine; here: choosing it where it cannot run is a clear error before
    # any rendezvous, on the trainer and in the payload a worker parses.
    from m2nkit.engine.session import InitPayload
    from m2nkit.engine.trainer import M2NTrainerInitInfo

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="'nccl_m2n' needs CUDA GPUs.*torch_p2p"):
        M2NTrainerInitInfo(rank=0, num_trainer_ranks=1, model_config={}, transport="nccl_m2n")
    with pytest.raises(ValueError, match=r"transport 'ucx' is not one of \['torch_p2p', 'nccl_m2n'\]"):
        M2NTrainerInitInfo(rank=0, num_trainer_ranks=1, model_config={}, transport="ucx")
    base = dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2,
                backend="gloo", inference="vllm:tp=1", manifest={}, manifest_digest="x",
                plan_digest="y", timeout_s=5.0, bucket_bytes=1024)
    assert InitPayload.from_json(base).transport == "torch_p2p"
    with pytest.raises(ValueError, match="init payload transport 'nccl_m2n' needs CUDA"):
        InitPayload.from_json({**base, "transport": "nccl_m2n"})


def test_demo_refuses_more_processes_than_one_machine_runs(capsys):
    from m2nkit.engine.cli import main

    assert main(["demo", "--trainer", "fsdp:40", "--inference", "vllm:tp=2"]) == 2
    err = capsys.readouterr().err
    assert "needs 42 processes" in err and "at most 32" in err
