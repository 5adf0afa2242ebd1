"""The gather-then-broadcast baseline and the raw floor, run for real.

Four processes (forked from the tests' forkserver; trainer ranks 0-1 holding ``fsdp:2`` shards of
examples/tiny-qwen3-moe, workers 2-3 holding ``vllm:tp=2`` storage) join
one stateless gloo group over 127.0.0.1, the trainers a second one for the
all-gather; then each process runs m2nkit's ``torch_p2p`` round, the
gather-then-broadcast round and the raw floor round on the same groups.
The parent builds the plan and the trainer shards once and checks every
worker's storage against ``reference_load`` (an independent restatement of
vLLM's loaders), so the children import torch and m2nkit only.
"""

from __future__ import annotations

import queue
import time
import traceback
from pathlib import Path

from _paths import REPO
import pytest
import torch

from _procs import CTX, ensure_forkserver
from m2nkit.engine.tools.baseline import (create_trainer_group, gather_then_broadcast_round,
                                          message_fill, message_pattern_buffers,
                                          message_pattern_round, raw_floor_buffers,
                                          raw_floor_round)
from m2nkit.engine.tools.procs import free_port

ROOT = REPO
CHECKPOINT = ROOT / "examples" / "tiny-qwen3-moe"
TRAINER, INFERENCE = "fsdp:2", "vllm:tp=2"
T, N = 2, 2
TIMEOUT_S = 30.0  # any single wait inside a child
DEADLINE_S = 60.0  # the whole multi-process run


def _to_bytes(storage: dict[str, torch.Tensor]) -> dict[str, tuple[bytes, torch.dtype, tuple]]:
    # Plain bytes through the queue: torch's shared-memory tensor pickling
    # would need the child alive until the parent has read the tensor.
    return {k: (v.contiguous().view(torch.uint8).numpy().tobytes(), v.dtype, tuple(v.shape))
            for k, v in storage.items()}


def _from_bytes(packed) -> dict[str, torch.Tensor]:
    return {k: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dt).view(shape)
            for k, (b, dt, shape) in packed.items()}


def _rank_main(rank: int, ports: tuple[int, int], plan, local, out) -> None:
    """One process: the three rounds on the same groups; results to ``out``."""
    try:
        torch.set_num_threads(1)
        from m2nkit.engine.in_process import allocate_storage
        from m2nkit.engine.control import agree_on_plan, create_group
        from m2nkit.engine.transports.torch_p2p import BucketSchedule, recv_round, send_round

        _, group = create_group("127.0.0.1", ports[0], rank, T + N, timeout_s=TIMEOUT_S)
        tgroup = None
        if rank < T:
            _, tgroup = create_trainer_group("127.0.0.1", ports[1], rank, T, timeout_s=TIMEOUT_S)
        agree_on_plan(group, rank, T + N, plan, timeout_s=TIMEOUT_S)
        result = {}

        sched = BucketSchedule.build(plan, 64 << 10)  # several buckets even for a tiny model
        if rank < T:
            result["m2nkit"] = send_round(group, plan, sched, rank, iter(local),
                                          timeout_s=TIMEOUT_S)
        else:
            storage = allocate_storage(plan.destination, rank - T)
            _, n = recv_round(group, plan, sched, rank - T, storage, timeout_s=TIMEOUT_S)
            result["m2nkit"] = (n, _to_bytes(storage))

        if rank < T:
            result["gather"] = gather_then_broadcast_round(group, tgroup, plan, rank,
                                                           stream=iter(local), timeout_s=TIMEOUT_S)
        else:
            storage = allocate_storage(plan.destination, rank - T)
            n = gather_then_broadcast_round(group, None, plan, rank, storage=storage,
                                            timeout_s=TIMEOUT_S)
            result["gather"] = (n, _to_bytes(storage))

        result["floor"] = raw_floor_round(group, plan, rank, raw_floor_buffers(plan, rank),
                                          timeout_s=TIMEOUT_S)

        bufs = message_pattern_buffers(plan, sched, rank)
        moved = message_pattern_round(group, plan, bufs, rank, timeout_s=TIMEOUT_S)
        # each receive buffer: (bucket, trainer rank, tag, bytes, its distinct byte values)
        landed = [(k, peer, tag, b.numel(), sorted(set(b.tolist()))) for (k, peer, tag), b
                  in bufs.items()] if rank >= T else None
        result["pattern"] = (moved, landed)
        out.put((rank, "ok", result))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def setup():
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, checkpoint_metas, read_checkpoint
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json

    ck = read_checkpoint(CHECKPOINT)
    manifest = manifest_to_json(checkpoint_metas(ck, TRAINER), T)
    plan, _ = plan_from_manifest(manifest, vllm_destination(ck.config, INFERENCE))
    assert not plan.problems
    locals_ = [[(n, t.clone()) for n, t in checkpoint_manifest(ck, TRAINER, r).iter_local()]
               for r in range(T)]
    return ck, plan, locals_


@pytest.fixture(scope="module")
def results(setup):
    """Run the four processes once; ``{rank: result}``. Children are always reaped."""
    _, plan, locals_ = setup
    ensure_forkserver()
    ctx = CTX
    out = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, ports, plan, locals_[r] if r < T else None, out))
             for r in range(T + N)]
    got: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < T + N:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"ranks {sorted(set(range(T + N)) - set(got))} did not report "
                            f"within {DEADLINE_S:g} s")
            try:
                rank, status, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    pytest.fail(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                "without reporting")
                continue
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return got


@pytest.fixture(scope="module")
def reference(setup):
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors
    from m2nkit.adapters.vllm import reference_load

    ck, _, _ = setup
    full = full_checkpoint_tensors(ck)
    return {w: reference_load(ck.config, full, INFERENCE, w) for w in range(N)}


def _model_bytes_on_disk() -> int:
    """Every tensor of the checkpoint file, numel × element size, read from the header."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(CHECKPOINT / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            numel = 1
            for n in t.get_shape():
                numel *= n
            itemsize = {"BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
            total += numel * itemsize
    return total


def _assert_bit_exact(storage: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str):
    from m2nkit.engine.in_process import bitwise_equal

    assert storage, what
    bad = [k for k in storage if not bitwise_equal(storage[k], ref[k])]
    assert not bad, f"{what}: {len(bad)} parameters differ from reference_load, e.g. {bad[:3]}"


@pytest.mark.timeout(120)
def test_gather_then_broadcast_is_bit_exact(results, reference):
    for w in range(N):
        _, packed = results[T + w]["gather"]
        _assert_bit_exact(_from_bytes(packed), reference[w], f"gather-then-broadcast worker {w}")


@pytest.mark.timeout(120)
def test_m2nkit_is_bit_exact_on_the_same_processes(results, reference):
    for w in range(N):
        _, packed = results[T + w]["m2nkit"]
        _assert_bit_exact(_from_bytes(packed), reference[w], f"m2nkit worker {w}")


@pytest.mark.timeout(120)
def test_gather_then_broadcast_sends_the_full_model_to_every_worker(results):
    model = _model_bytes_on_disk()
    assert results[0]["gather"].sent == N * model
    for r in range(1, T):
        assert results[r]["gather"].sent == 0
    for w in range(N):
        counts, _ = results[T + w]["gather"]
        assert counts.received == model
    # fsdp:2 splits every row count evenly here, so each rank's all-gather
    # share is half the model (0-d tensors would differ; this model has none).
    assert sum(results[r]["gather"].gathered for r in range(T)) == (T - 1) * model


@pytest.mark.timeout(120)
def test_m2nkit_moves_exactly_the_bytes_the_workers_hold(setup, results):
    _, plan, _ = setup
    dest = plan.destination
    held = 0  # from first principles: every worker element except vLLM's zero padding rows
    for p in dest.params:
        padding = 0
        for z in p.zero_boxes:
            v = 1
            for a, b in z:
                v *= b - a
            padding += v
        held += (p.dtype.itemsize * (torch.Size(p.shape).numel() - padding))
    assert plan.nbytes_min == held
    assert sum(plan.link_bytes.values()) == plan.nbytes_min
    sent = sum(results[r]["m2nkit"] for r in range(T))
    received = sum(results[T + w]["m2nkit"][0] for w in range(N))
    assert sent == received == plan.nbytes_min  # messages carry slab bytes only
    for r in range(T):
        assert results[r]["m2nkit"] == int(plan.send_bytes[r])
    assert plan.nbytes_min < N * _model_bytes_on_disk()


@pytest.mark.timeout(120)
def test_message_pattern_replays_the_transports_messages_with_their_bytes(setup, results):
    # The same buckets, pairs, tags and sizes as torch_p2p's round: per link the
    # bytes of the plan, and each receive holds exactly its own send's fill
    # byte (a tag or peer mixed up would land another message's byte).
    from m2nkit.engine.transports.torch_p2p import BucketSchedule, message_count

    _, plan, _ = setup
    sched = BucketSchedule.build(plan, 64 << 10)
    assert len(sched) > 1
    for r in range(T):
        assert results[r]["pattern"][0].sent == int(plan.send_bytes[r])
    per_link, count = {}, 0
    for w in range(N):
        moved, landed = results[T + w]["pattern"]
        assert moved.received == int(plan.recv_bytes[w])
        for k, src, tag, nbytes, values in landed:
            assert values == [message_fill(src, w, tag)], (k, src, w, tag)
            per_link[(src, w)] = per_link.get((src, w), 0) + nbytes
            count += 1
    assert per_link == dict(plan.link_bytes)
    assert count == message_count(plan, sched) > len(plan.link_bytes)


@pytest.mark.timeout(120)
def test_raw_floor_moves_the_plan_bytes_per_link(setup, results):
    _, plan, _ = setup
    for r in range(T):
        assert results[r]["floor"].sent == int(plan.send_bytes[r])
    for w in range(N):
        assert results[T + w]["floor"].received == int(plan.recv_bytes[w])


# --------------------------------------------------------------------------
# refusals before any byte moves (no processes needed)


@pytest.mark.timeout(30)
def test_floor_buffers_match_the_plan_links(setup):
    _, plan, _ = setup
    for r in range(T):
        bufs = raw_floor_buffers(plan, r)
        assert {w: b.numel() for w, b in bufs.items()} == \
            {d: n for (s, d), n in plan.link_bytes.items() if s == r}
    for w in range(N):
        bufs = raw_floor_buffers(plan, T + w)
        assert {s: b.numel() for s, b in bufs.items()} == \
            {s: n for (s, d), n in plan.link_bytes.items() if d == w}


@pytest.mark.timeout(30)
def test_refusals_name_the_rank_and_what_is_missing(setup):
    _, plan, _ = setup
    with pytest.raises(ValueError, match="rank 9 is not in the transfer group of 4 ranks"):
        gather_then_broadcast_round(None, None, plan, 9, timeout_s=1)
    with pytest.raises(ValueError, match="trainer rank 0 needs stream= and trainer_group="):
        gather_then_broadcast_round(None, None, plan, 0, timeout_s=1)
    with pytest.raises(ValueError, match=r"worker 1 \(rank 3\) needs storage="):
        gather_then_broadcast_round(None, None, plan, 3, timeout_s=1)
    with pytest.raises(ValueError, match="build them with raw_floor_buffers"):
        raw_floor_round(None, plan, 0, raw_floor_buffers(plan, 1), timeout_s=1)
    with pytest.raises(ValueError, match="rank 2 is not a trainer rank"):
        create_trainer_group("127.0.0.1", 1, 2, T, timeout_s=1)
