"""The trainer engine against real receiver processes over the HTTP control plane.

Everything here is real: trainer processes, the inference server's worker
processes, gloo over 127.0.0.1, vLLM's weight-transfer routes. Faults are
injected from inside the trainer's own source (a provider that stalls, dies
or kills a worker when the engine reaches a given wire tensor), so
"mid-round" is exact, not a race; faults around rank 0's own calls to the
server come from its client (another session's id, a worker killed before
the commit). Expected bytes come from ``reference_load`` of the shifted
checkpoint, never from the planner.

Processes fork from a ``forkserver`` that has torch, transformers and m2nkit
loaded, so each starts in milliseconds instead of importing torch again;
``m2nkit demo`` itself (which spawns, and exits 0 only when every worker's
bytes verified) runs end to end in test_demo_ux.py. Timing
assertions check the documented bound (``timeout_s + REPORT_GRACE_S`` of a
rank's round start, measured inside that rank), never how idle the machine
is; one test holds it while CPU-burning processes compete.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from _paths import EXAMPLE
import pytest
import torch

from _procs import CTX, ensure_forkserver
from m2nkit.engine.deadline import REPORT_GRACE_S

TIMEOUT = 4.0  # seconds: the bound on each init and each round of these sessions
#: Where a failure must be found without waiting for the deadline (a death, a refusal):
#: a deadline this long shows it was not waited for, however loaded the machine.
LONG_TIMEOUT = 20.0


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    """Start the forkserver (with the heavy imports) once, before any test's clock runs."""
    ensure_forkserver()


def start_server(model_dir, inference: str):
    from m2nkit.engine.tools.server import InferenceServer

    srv = InferenceServer(model_dir, inference, timeout_s=10 * TIMEOUT, start_method="forkserver")
    srv.start()
    return srv


@pytest.fixture
def server():
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        yield srv
    finally:
        srv.stop()


# --------------------------------------------------------------------------
# trainer processes


def _trainer(rank, T, model_dir, trainer, inference, url, port, fault, results, rounds, go,
             timeout_s, reorder=False, extra=False, misorder=False, client_fault=None,
             transport="torch_p2p"):
    """A trainer process; ``fault`` = (round, wire index, action) or None.

    ``client_fault`` (rank 0) = (round, action): in that round its
    ``update_weights`` carries another session's id (``"stale session"``,
    which every worker refuses up front), or it SIGKILLs the worker process
    ``pid`` right before ``finish_weight_update`` (``("kill before commit", pid)``).

    Reports ``("ok", rank, {round, bytes, seconds})`` per round, ``("error",
    rank, {message, seconds})`` when ``send_weights`` (or init) raised, with
    the seconds measured around that call, here, in the rank itself.
    """
    from m2nkit.engine.tools.server import exit_with_parent

    exit_with_parent()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        from m2nkit.adapters.hf_checkpoint import read_checkpoint
        from m2nkit.adapters.trainer_spec import parse_trainer_spec
        from m2nkit.adapters.vllm import vllm_destination
        from m2nkit.engine.clients import HTTPClient
        from m2nkit.engine.tools.demo import shifted_source
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
                    elif action == "raise":
                        raise RuntimeError(f"provider of '{e.name}' broke (disk error)")
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
                                            SourceLayout(),
                                            lambda: torch.zeros(4, dtype=torch.bfloat16)))
        source = ManifestM2NWeightSource(entries, rank=rank)
        if misorder:                 # the stream, not the manifest, swaps wire tensors 5 and 6
            plain = source.iter_local

            def swapped():
                items = plain()
                for i, item in enumerate(items):
                    if i == 5:
                        later = next(items)
                        yield later
                    yield item
            source.iter_local = swapped
        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=T,
                                  destination=vllm_destination(ckpt.config, inference),
                                  master_port=port, timeout_s=timeout_s, bucket_bytes=16 << 10,
                                  transport=transport)
        client = HTTPClient(url, timeout_s=10 * timeout_s) if rank == 0 else None
        if client_fault is not None:
            f_round, action = client_fault
            update, commit = client.update_weights, client.finish_weight_update

            def faulty_update(info):
                if state["round"] == f_round and action == "stale session":
                    info = {**info, "session": "stale"}
                return update(info)

            def faulty_commit(version=None):
                if state["round"] == f_round and isinstance(action, tuple):
                    os.kill(action[1], signal.SIGKILL)
                    until = time.monotonic() + 5
                    while not _exited(action[1]) and time.monotonic() < until:
                        time.sleep(0.005)                 # dead before the call goes out
                return commit(version)
            client.update_weights, client.finish_weight_update = faulty_update, faulty_commit
        t0 = time.monotonic()
        engine = M2NTrainerEngine.trainer_init(info, client=client, source=source)
        for k in range(1, rounds + 1):
            if k > 1 and go is not None and go.get(timeout=30 * timeout_s) != k:
                raise RuntimeError("test driver out of step")
            state["round"] = k
            t0 = time.monotonic()
            try:
                stats = engine.send_weights(f"v{k}")
            except Exception as e:
                seconds = time.monotonic() - t0
                # A failed engine refuses further rounds at once (no RPC, no wait).
                t1 = time.monotonic()
                try:
                    engine.send_weights("again")
                except Exception as again:  # noqa: BLE001
                    results.put(("retry", rank, {"message": f"{type(again).__name__}: {again}",
                                                 "seconds": time.monotonic() - t1}))
                results.put(("error", rank, {"message": f"{type(e).__name__}: {e}",
                                             "seconds": seconds, "round": k,
                                             "at": t1}))
                return
            results.put(("ok", rank, {"round": k, "bytes": stats.bytes_sent,
                                      "seconds": time.monotonic() - t0}))
        engine.shutdown()
        try:
            engine.send_weights("after-shutdown")
        except ValueError as e:
            results.put(("after_shutdown", rank, {"message": str(e)}))
        results.put(("done", rank, {}))
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        results.put(("error", rank, {"message": f"{type(e).__name__}: {e}",
                                     "seconds": time.monotonic() - t0,
                                     "trace": traceback.format_exc()}))


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie its parent has not reaped counts; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _run_trainers(url, T, trainer, inference, *, model_dir=EXAMPLE, faults=None, rounds=1,
                  budget=60.0, hang=(), check=None, timeout_s=TIMEOUT, **kw):
    """Run T trainer processes; return ({rank: [(kind, payload)]}, seconds, exit codes, killed).

    ``check(k)``, when given, runs after every rank finished round ``k`` and
    before any starts round ``k + 1``. Waits until every rank not in
    ``hang`` has finished (done, error, or exited), then kills whatever is
    left. Never runs past ``budget`` seconds.
    """
    from m2nkit.engine.tools.procs import free_port

    results = CTX.Queue()
    gos = [CTX.Queue() for _ in range(T)] if check is not None else [None] * T
    port = free_port()
    procs = []
    for r in range(T):
        kwargs = {k: v for k, v in kw.items()
                  if k in ("reorder", "extra", "misorder", "client_fault")
                  and r in kw.get("ranks", ())}
        if "transport" in kw:
            kwargs["transport"] = kw["transport"]
        procs.append(CTX.Process(target=_trainer, daemon=True, kwargs=kwargs, args=(
            r, T, str(model_dir), trainer, inference, url, port, (faults or {}).get(r), results,
            rounds, gos[r], timeout_s)))
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + budget
    msgs: dict[int, list] = {r: [] for r in range(T)}
    checked = 0

    def finished(r):
        return any(k in ("done", "error") for k, _ in msgs[r]) or not procs[r].is_alive()

    try:
        while time.monotonic() < deadline and not all(finished(r) for r in range(T) if r not in hang):
            try:
                kind, rank, payload = results.get(timeout=0.1)
                msgs[rank].append((kind, payload))
            except queue.Empty:
                pass
            if check is not None:
                done = [{p["round"] for k, p in msgs[r] if k == "ok"} for r in range(T)]
                k = checked + 1
                if k < rounds and all(k in d for d in done):
                    check(k)
                    checked = k
                    for g in gos:
                        g.put(k + 1)
        seconds = time.monotonic() - t0
        for r, p in enumerate(procs):
            p.join(0.1 if r in hang else max(0.1, min(5.0, deadline - time.monotonic())))
    finally:
        killed = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    while True:
        try:
            kind, rank, payload = results.get(timeout=0.1)
        except queue.Empty:
            break
        msgs[rank].append((kind, payload))
    return msgs, seconds, [p.exitcode for p in procs], killed


def _errors(msgs):
    return {r: [p for k, p in m if k == "error"] for r, m in msgs.items()}


def _check_workers(server, tmp_path, round_index, model_dir=EXAMPLE, inference="vllm:tp=2"):
    """Every worker's live storage equals vLLM's loaders on the round's shifted checkpoint."""
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.adapters.vllm import reference_load
    from m2nkit.engine.tools.demo import shift
    from m2nkit.engine.in_process import bitwise_equal

    ck = read_checkpoint(model_dir)
    full = {n: shift(t, round_index) for n, t in full_checkpoint_tensors(ck).items()}
    for w in range(server.num_workers):
        got = server.storage(w, tmp_path / f"check{round_index}-{w}")
        ref = reference_load(ck.config, full, inference, w)
        # Saved once per storage; aliases (a tied lm_head, the MoE router's second name) not again.
        assert got and set(got) <= set(ref)
        bad = [name for name, t in got.items() if not bitwise_equal(t, ref[name])]
        assert not bad, f"worker {w} differs from reference_load in {bad}"


# --------------------------------------------------------------------------
# the matrix: dense and MoE, fsdp (uneven) and hsdp, tp 1/2/4, dp 2, ep


#: The slow cases carry ``integration`` (see pyproject.toml); the tied tp=1 one stays fast.
SPAWNS_FOR_SECONDS = pytest.mark.integration


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,trainer,inference", [
    # tp > 2 KV heads: replicated k/v rows
    pytest.param("tiny-llama", "fsdp:3", "vllm:tp=4", marks=SPAWNS_FOR_SECONDS),
    ("tiny-qwen3-tied", "fsdp:3", "vllm:tp=1"),     # tied embeddings, uneven fsdp
    # replicas balanced, dp replicas
    pytest.param("tiny-qwen3-moe", "hsdp:2,2", "vllm:tp=2,dp=2", marks=SPAWNS_FOR_SECONDS),
    # experts by ep, uneven fsdp
    pytest.param("tiny-mixtral", "fsdp:3", "vllm:tp=2,ep", marks=SPAWNS_FOR_SECONDS),
    # fp32 e_score_correction_bias in bf16 buckets, MLA, shared experts, MTP skipped
    pytest.param("tiny-deepseek-v3", "fsdp:2", "vllm:tp=2,ep", marks=SPAWNS_FOR_SECONDS),
    # transposed experts, biases, sinks
    pytest.param("tiny-gpt-oss", "fsdp:2", "vllm:tp=2", marks=SPAWNS_FOR_SECONDS),
])
def test_rounds_are_bit_exact_over_http(tiny_checkpoints, tmp_path, model, trainer, inference):
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    model_dir = tiny_checkpoints(model)
    tspec = parse_trainer_spec(trainer)
    ck = read_checkpoint(model_dir)
    plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, tspec), tspec.num_ranks),
                                 vllm_destination(ck.config, inference))
    srv = start_server(model_dir, inference)
    try:
        # After each round, before the next starts: every worker holds that round's bytes.
        msgs, _, _, _ = _run_trainers(
            srv.url, tspec.num_ranks, trainer, inference, model_dir=model_dir, rounds=2,
            timeout_s=4 * TIMEOUT, budget=90,
            check=lambda k: _check_workers(srv, tmp_path, k, model_dir, inference))
        assert not any(_errors(msgs).values()), msgs
        _check_workers(srv, tmp_path, 2, model_dir, inference)
        assert srv.weight_versions() == ["v2"] * plan.num_workers
    finally:
        srv.stop()
    # Accounting: every round sends exactly the minimum, each rank its plan bytes.
    for k in (1, 2):
        sent = {r: p["bytes"] for r in range(tspec.num_ranks) for kind, p in msgs[r]
                if kind == "ok" and p["round"] == k}
        assert sorted(sent) == list(range(tspec.num_ranks))
        assert sum(sent.values()) == plan.nbytes_min


# --------------------------------------------------------------------------
# fault injection: the deadline bound, the root cause, the version kept


def _assert_failed_within_bound(msgs, ranks, needle, timeout_s=TIMEOUT):
    """Each rank raised, naming ``needle``, within timeout_s + REPORT_GRACE_S of its call."""
    errors = _errors(msgs)
    for r in ranks:
        assert errors[r], msgs[r]
        e = errors[r][0]
        assert e["message"].startswith("TransferError"), e
        assert needle in e["message"], e
        assert e["seconds"] <= timeout_s + REPORT_GRACE_S, e
        retry = [p for k, p in msgs[r] if k == "retry"]
        assert retry and "broke in an earlier round" in retry[0]["message"], msgs[r]
        assert "build a fresh engine" in retry[0]["message"], msgs[r]
        assert retry[0]["seconds"] < 1.0, retry


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(300)
@pytest.mark.parametrize("action", ["die", "stall under load"])
def test_trainer_stall_or_death_mid_round_fails_everyone_and_keeps_the_version(
        server, tmp_path, action):
    # Round 1 succeeds; in round 2 trainer rank 1 stalls (or dies) when the engine
    # reaches wire tensor 10 of 25. A stall runs under load: CPU-burning processes compete
    # (load average heading for 8 on this 2-core machine) for the whole of round 2, so the
    # deadline bound is held where it is hardest to hold (the same stall on an idle
    # machine was a case of its own; its assertions are all here). Then, the burners
    # gone, a fresh engine takes over the same workers.
    timeout_s = LONG_TIMEOUT if action == "die" else TIMEOUT
    burners = []

    def load_round_2(k):
        # The burners start once round 1 is in (checked below), so the load falls on the
        # round whose deadline bound is under test, not on round 1's warm-up (which, on a
        # machine already busy, could miss its own deadline before the stall is reached).
        if action == "stall under load" and k == 1:
            burners.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           for _ in range(8))
    try:
        msgs, seconds, codes, killed = _run_trainers(
            server.url, 3, "fsdp:3", "vllm:tp=2", faults={1: (2, 10, action.split()[0])},
            rounds=2, budget=20 * TIMEOUT, hang=(1,), timeout_s=timeout_s, check=load_round_2)
        load = Path("/proc/loadavg").read_text().split()[:4]   # 1, 5, 15 min; running/total
        print(f"[{action}] load average {load[:3]}, runnable/total {load[3]}; raised after",
              {r: round(p["seconds"], 2) for r, ps in _errors(msgs).items() for p in ps[:1]})
        if action == "stall under load":
            assert burners, "round 1 did not finish: no load was started"
            assert all(b.poll() is None for b in burners), "a CPU burner stopped early"
            # They competed: together they took CPU seconds while the round ran.
            ticks = sum(int(Path(f"/proc/{b.pid}/stat").read_text().rsplit(")", 1)[1].split()[11])
                        for b in burners)
            assert ticks / os.sysconf("SC_CLK_TCK") > 2.0, ticks
    finally:
        for b in burners:
            b.kill()
            b.wait(10)
    assert [any(k == "ok" and p["round"] == 1 for k, p in msgs[r]) for r in range(3)] == \
        [True] * 3, msgs
    # Every other trainer raises within the bound, naming the root cause: rank 1.
    _assert_failed_within_bound(msgs, (0, 2), "trainer rank 1 sent no report", timeout_s)
    if action == "die":
        assert codes[1] == 17
        # Its connections closed: found at once, not at the deadline.
        assert all(_errors(msgs)[r][0]["seconds"] < timeout_s / 2 for r in (0, 2)), (msgs, load)
    else:
        assert killed == [1]  # only the staller was still there to kill
    # The workers refused to commit round 2: still at v1 with v1's bytes.
    assert server.weight_versions() == ["v1", "v1"]
    _check_workers(server, tmp_path, 1)
    if action == "die":
        return
    # A fresh engine (new trainer processes, new group) runs the next rounds.
    msgs, _, codes, _ = _run_trainers(server.url, 3, "fsdp:3", "vllm:tp=2", rounds=2)
    assert not any(_errors(msgs).values()), msgs
    for r in range(3):
        assert any(k == "after_shutdown" and "after shutdown()" in p["message"]
                   for k, p in msgs[r]), msgs[r]
    assert server.weight_versions() == ["v2", "v2"]
    _check_workers(server, tmp_path, 2)


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(120)
def test_worker_killed_mid_round_fails_every_trainer_at_once(tmp_path):
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        victim = srv.worker_pids[1]
        msgs, seconds, codes, killed = _run_trainers(srv.url, 2, "fsdp:2", "vllm:tp=2",
                                                     faults={0: (1, 12, ("kill", victim))},
                                                     timeout_s=LONG_TIMEOUT)
        # Its connections closed: every trainer names it, long before the deadline.
        _assert_failed_within_bound(msgs, (0, 1), "worker 1 (rank 3) sent no report",
                                    LONG_TIMEOUT)
        assert all(_errors(msgs)[r][0]["seconds"] < LONG_TIMEOUT / 2 for r in (0, 1)), msgs
        assert not killed
        # The surviving worker did not commit the broken round.
        with pytest.raises(Exception, match="worker 1"):
            srv.weight_versions()
    finally:
        srv.stop()
    # A fresh server and fresh engines run the next round.
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        msgs, _, _, _ = _run_trainers(srv.url, 2, "fsdp:2", "vllm:tp=2")
        assert not any(_errors(msgs).values()), msgs
        assert srv.weight_versions() == ["v1", "v1"]
        _check_workers(srv, tmp_path, 1)
    finally:
        srv.stop()


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,needle", [
    ("reorder", "wire tensor #3"),
    ("extra", "model.extra.weight"),
])
def test_one_rank_with_a_different_manifest_is_refused_everywhere(server, kind, needle):
    msgs, seconds, codes, killed = _run_trainers(server.url, 3, "fsdp:3", "vllm:tp=2",
                                                 ranks=(1,), timeout_s=LONG_TIMEOUT,
                                                 **{kind: True})
    errors = _errors(msgs)
    for r in range(3):
        assert errors[r], msgs[r]
        assert needle in errors[r][0]["message"], errors[r]
        assert "PlanMismatchError" in errors[r][0]["message"], errors[r]
        # Refused in the agreement, not at the deadline.
        assert errors[r][0]["seconds"] < LONG_TIMEOUT / 2, errors[r]
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
    dest = _FakeDestination()
    with pytest.raises(ValueError, match="'nccl_m2n' needs CUDA GPUs.*torch_p2p"):
        M2NTrainerInitInfo(rank=0, num_trainer_ranks=1, destination=dest, transport="nccl_m2n")
    with pytest.raises(ValueError, match=r"transport 'ucx' is not one of \['torch_p2p', 'nccl_m2n', 'ipc'\]"):
        M2NTrainerInitInfo(rank=0, num_trainer_ranks=1, destination=dest, transport="ucx")
    with pytest.raises(ValueError, match="destination is missing"):
        M2NTrainerInitInfo(rank=0, num_trainer_ranks=1)
    base = dict(master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2,
                backend="gloo", inference="vllm:tp=1", manifest={}, manifest_digest="x",
                plan_digest="y", timeout_s=5.0, bucket_bytes=1024)
    assert InitPayload.from_json(base).transport == "torch_p2p"
    with pytest.raises(ValueError, match="init payload transport 'nccl_m2n' needs CUDA"):
        InitPayload.from_json({**base, "transport": "nccl_m2n"})


class _FakeDestination:
    """Just the DestinationBuilder surface, for checks that never build a plan."""

    spec = "vllm:tp=1,dp=1"
    num_workers = 1

    def __call__(self, metas):
        raise AssertionError("not called in this test")


def test_demo_refuses_more_processes_than_one_machine_runs(capsys):
    from m2nkit.engine.tools.cli import main

    assert main(["demo", "--trainer", "fsdp:40", "--inference", "vllm:tp=2"]) == 2
    err = capsys.readouterr().err
    assert "needs 42 processes" in err and "at most 32" in err


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["provider raises", "stream out of order"])
def test_a_trainer_source_failure_is_named_on_every_rank(server, fault):
    # Trainer rank 1's provider raises on wire tensor 5 of 25 (or its stream yields
    # wire tensor 6 before 5). Every rank -- trainers and, through rank 0's error,
    # the workers -- names trainer rank 1 and its exception text, long before the
    # deadline; the workers keep their version.
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint

    names = [m.name for m in checkpoint_metas(read_checkpoint(EXAMPLE), "fsdp:3")]
    assert len(names) == 25
    if fault == "provider raises":
        kw = {"faults": {1: (1, 5, "raise")}}
        root = (f"first failure reported: trainer rank 1: RuntimeError: provider of "
                f"'{names[5]}' broke (disk error)")
    else:
        kw = {"ranks": (1,), "misorder": True}
        root = (f"first failure reported: trainer rank 1: TransferError: source yielded "
                f"'{names[6]}' where the manifest order expects '{names[5]}'")
    msgs, _, _, _ = _run_trainers(server.url, 3, "fsdp:3", "vllm:tp=2",
                                  timeout_s=LONG_TIMEOUT, **kw)
    errors = _errors(msgs)
    for r in range(3):
        assert errors[r], msgs[r]
        e = errors[r][0]
        assert e["message"].startswith("TransferError"), e
        assert root in e["message"], e
        assert "timed out" not in e["message"], e
        assert e["seconds"] < LONG_TIMEOUT / 2, e          # found at once, not at the deadline
    # Rank 0 also relays the workers' own errors: they name the same root cause.
    said = errors[0][0]["message"].split("the inference side said:", 1)
    assert len(said) == 2, errors[0]
    for w in (0, 1):
        assert f"worker {w}" in said[1] and root in said[1], said[1]
    assert server.weight_versions() == [None, None]


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(180)
def test_a_worker_refusal_mid_session_reaches_every_trainer_rank_at_once():
    # Issue 21, item 3. Between rounds 1 and 2 every worker's live w13_weight is
    # re-allocated with another shape, so round 2's start_weight_update (an RPC
    # only trainer rank 0 makes) is refused on every worker. Every trainer rank
    # must raise naming that refusal first, within moments of rank 0's failure,
    # not after its own timeout_s with "the session store stopped answering".
    timeout_s = 30.0
    name = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        msgs, _, _, killed = _run_trainers(
            srv.url, 3, "fsdp:3", "vllm:tp=2", rounds=2, timeout_s=timeout_s,
            budget=3 * timeout_s, check=lambda k: srv.reallocate(name, (8, 48, 128)))
        assert not killed, msgs
        assert all(any(k == "ok" and p["round"] == 1 for k, p in msgs[r])
                   for r in range(3)), msgs
        refusal = (f"start_weight_update failed on workers [0, 1]: workers 0, 1: ValueError: "
                   f"target parameter '{name}' is (8, 48, 128) torch.bfloat16; the plan writes "
                   "(8, 32, 128) torch.bfloat16")
        errors = _errors(msgs)
        print("raised after",
              {r: round(p["seconds"], 2) for r, ps in errors.items() for p in ps[:1]})
        for r in (2, 1, 0):
            assert errors[r], msgs[r]
            e = errors[r][0]
            assert e["round"] == 2 and e["message"].startswith("TransferError"), e
            # The root cause comes first: rank 0's failed RPC, with the workers' own words.
            cause = e["message"].split(f"trainer rank {r}: round 2 failed: ", 1)
            assert len(cause) == 2 and cause[1].startswith(
                "trainer rank 0: start_weight_update failed"), e
            assert refusal in e["message"], e
            assert "stopped answering" not in e["message"], e
            assert "sent no report" not in e["message"], e
            # Found at once, not at the deadline.
            assert e["seconds"] < timeout_s / 3 + REPORT_GRACE_S, e
            retry = [p for k, p in msgs[r] if k == "retry"]
            assert retry and "broke in an earlier round" in retry[0]["message"], msgs[r]
        first = min(errors[r][0]["at"] for r in range(3))
        assert all(errors[r][0]["at"] - first <= REPORT_GRACE_S for r in range(3)), errors
        # Nothing was sent in round 2: the workers keep round 1's version.
        assert srv.weight_versions() == ["v1", "v1"]
    finally:
        srv.stop()


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(180)
def test_an_update_weights_the_workers_refuse_mid_session_reaches_every_trainer_rank_at_once():
    # Issue 21, item 3, the call after start_weight_update that only trainer rank 0
    # makes. Round 1 succeeds; in round 2 every worker refuses update_weights before
    # it joins the round (it carries another session's id). Every trainer rank must
    # raise naming that refusal first, within moments; before, every rank waited out
    # timeout_s in sends no worker received, and only rank 0 heard the refusal.
    timeout_s = 30.0
    cause = "trainer rank 0: update_weights failed: "
    refusal = ("update_weights failed on workers [0, 1]: workers 0, 1: SupersededError: "
               "update_weights of session 'stale' refused")
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        msgs, _, _, killed = _run_trainers(
            srv.url, 3, "fsdp:3", "vllm:tp=2", rounds=2, timeout_s=timeout_s,
            budget=3 * timeout_s, client_fault=(2, "stale session"), ranks=(0,))
        assert not killed, msgs
        assert all(any(k == "ok" and p["round"] == 1 for k, p in msgs[r])
                   for r in range(3)), msgs
        errors = _errors(msgs)
        print("raised after",
              {r: round(p["seconds"], 2) for r, ps in errors.items() for p in ps[:1]})
        for r in (2, 1, 0):
            assert errors[r], msgs[r]
            e = errors[r][0]
            assert e["round"] == 2 and e["message"].startswith("TransferError"), e
            # The root cause comes first: rank 0's failed call, with the server's own words.
            assert e["message"].startswith(
                f"TransferError: trainer rank {r}: round 2 failed: {cause}"), e
            assert refusal in e["message"], e
            assert "stopped answering" not in e["message"], e
            assert "sent no report" not in e["message"], e
            assert e["seconds"] < timeout_s / 3 + REPORT_GRACE_S, e     # not at the deadline
        first = min(errors[r][0]["at"] for r in range(3))
        assert all(errors[r][0]["at"] - first <= REPORT_GRACE_S for r in range(3)), errors
        # Nothing was sent in round 2: the workers keep round 1's version.
        assert srv.weight_versions() == ["v1", "v1"]
    finally:
        srv.stop()


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(180)
def test_a_worker_lost_before_the_commit_fails_every_trainer_rank_at_once():
    # Issue 21, item 3, the commit: only trainer rank 0 calls finish_weight_update.
    # Round 1 succeeds; round 2 arrives whole, then worker 1's process is killed
    # before the commit, so finish_weight_update fails. Every trainer rank must
    # raise naming that failure first, within moments; before, ranks 1 and 2
    # returned success for a version the workers never all committed.
    timeout_s = 30.0
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        pid = srv.worker_pids[1]
        cause = "trainer rank 0: finish_weight_update failed: "
        refusal = (f"finish_weight_update failed on workers [1]: worker 1: worker 1 (pid {pid}) "
                   "died during finish_weight_update")
        msgs, _, _, killed = _run_trainers(
            srv.url, 3, "fsdp:3", "vllm:tp=2", rounds=2, timeout_s=timeout_s,
            budget=3 * timeout_s, client_fault=(2, ("kill before commit", pid)), ranks=(0,))
        assert not killed, msgs
        errors = _errors(msgs)
        print("raised after",
              {r: round(p["seconds"], 2) for r, ps in errors.items() for p in ps[:1]})
        for r in (2, 1, 0):
            assert any(k == "ok" and p["round"] == 1 for k, p in msgs[r]), msgs[r]
            assert errors[r], msgs[r]
            e = errors[r][0]
            assert e["round"] == 2, e
            assert e["message"].startswith(
                f"TransferError: trainer rank {r}: round 2 failed: {cause}"), e
            assert refusal in e["message"], e
            assert "stopped answering" not in e["message"], e
            assert e["seconds"] < timeout_s / 3 + REPORT_GRACE_S, e     # not at the deadline
        first = min(errors[r][0]["at"] for r in range(3))
        assert all(errors[r][0]["at"] - first <= REPORT_GRACE_S for r in range(3)), errors
    finally:
        srv.stop()


# --------------------------------------------------------------------------
# the ipc transport (issue 19): trainer and worker processes sharing memory


# Over the fast suite's budget (a server and its workers, trainer processes, a second
# round with a death): in the integration run, like the vLLM plugin's ipc round.
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_ipc_processes_bit_exact_then_a_worker_killed_mid_round_fails_everyone_at_once(tmp_path):
    """Trainer processes expose their shards, the server's worker processes map them and
    copy their boxes. Round 1: every worker bit-exact against ``reference_load``, each
    trainer rank sending exactly its plan bytes. Round 2: a worker dies while the trainers
    expose it; its connections close, so every trainer rank raises naming it long before
    the deadline (the transport's signals go over the group), and nobody commits v2."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    ck = read_checkpoint(EXAMPLE)
    plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(
        ck, parse_trainer_spec("fsdp:2")), 2), vllm_destination(ck.config, "vllm:tp=2"))
    srv = start_server(EXAMPLE, "vllm:tp=2")
    try:
        victim = srv.worker_pids[1]
        msgs, _, _, killed = _run_trainers(srv.url, 2, "fsdp:2", "vllm:tp=2", rounds=2,
                                           faults={0: (2, 12, ("kill", victim))},
                                           transport="ipc", timeout_s=LONG_TIMEOUT,
                                           check=lambda k: _check_workers(srv, tmp_path, k))
        sent = {r: p["bytes"] for r in (0, 1) for kind, p in msgs[r]
                if kind == "ok" and p["round"] == 1}
        assert sent == {r: int(plan.send_bytes[r]) for r in (0, 1)}, msgs
        assert sum(sent.values()) == plan.nbytes_min
        _assert_failed_within_bound(msgs, (0, 1), "worker 1 (rank 3)", LONG_TIMEOUT)
        assert all(_errors(msgs)[r][0]["round"] == 2 for r in (0, 1)), msgs
        took = {r: (round(_errors(msgs)[r][0]["seconds"], 2), _errors(msgs)[r][0]["message"])
                for r in (0, 1)}
        assert all(t < LONG_TIMEOUT / 2 for t, _ in took.values()), took
        assert not killed
        # Worker 0 answers and worker 1 is named: nobody committed "v2".
        with pytest.raises(Exception, match="worker 1") as e:
            srv.weight_versions()
        assert "worker 0" not in str(e.value)
    finally:
        srv.stop()
