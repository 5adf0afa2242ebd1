"""vLLM's sleep mode between rounds (issue 19, TRL#5312), on vLLM 0.33's own model objects (CPU).

What ``sleep(level=2)`` + ``wake_up(tags=["weights"])`` does to the weights in
vLLM 0.33.0: ``Worker.sleep`` (``v1/worker/gpu_worker.py``) saves only the
buffers (and any ``sleep_preserve_parameter_names``) to the CPU, then the
default sleep-mode backend (``CuMemBackend.suspend``,
``device_allocator/sleep_mode_backend.py``) offloads only the ``runtime`` and
``cudagraph`` tags at level 2: ``CuMemAllocator.sleep``
(``device_allocator/cumem.py``) unmaps and releases the physical memory of
every ``weights`` allocation without a backup. ``wake_up`` creates new
physical memory and maps it at the allocation's reserved virtual address
again (``create_and_map(handle)``, ``handle[2]`` being the same ``d_mem``
pointer); ``Worker.wake_up`` copies the saved buffers back. So the same
``Parameter`` objects, the same tensors and addresses come back, with new
memory whose bytes are undefined (zeroed on ROCm): the weights must be sent
again, in full, before anything is generated. Sleep mode needs CUDA, so here
a worker does to its live model between rounds what that leaves:

* ``"cumem"``: every parameter keeps its tensor and address, its bytes are
  overwritten with garbage (CuMemAllocator's level 2 + wake);
* ``"new storage"``: every parameter gets **new storage** (``param.data =``
  a fresh tensor of garbage; the ``Parameter`` object, its ``weight_loader``
  and a tie's sharing stay), the harder case a sleep-mode backend of the
  registry other than ``cumem``, or a wake through a reload path, may leave
  (``SleepModeBackendFactory`` takes third-party backends). The old storage
  is kept alive by the test, holding the bytes it had, to prove no round
  writes into memory the model let go of.

Trainer processes send v1..v4 (random seeds 1..4) in one session over
``torch_p2p`` and over ``ipc``; between rounds the workers go through
"new storage", "cumem", "new storage" (three cycles, two with new storage).
After every round every parameter equals, bit for bit, vLLM's fresh load of
that version, sits at the address the wake left it at, and no old storage
changed; the version is committed. And a parameter that came back another
shape (worker 1) or dtype (worker 0) refuses the next round on every
trainer rank before any byte moves, naming the parameter; the version and
the live bytes stay.
"""

from __future__ import annotations

import pytest

from _procs import CTX, trainer_outcomes, vllm_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TRAINER = "fsdp:2"
ROUND_TIMEOUT_S = 90.0
#: (transport, tiny model, vLLM layout): tied embeddings over torch_p2p (the tie must
#: survive the re-allocation), MoE with EP over ipc (the colocated transport)
CASES = [("torch_p2p", "tiny-qwen3-tied", "vllm:tp=2"),
         ("ipc", "tiny-qwen3-moe", "vllm:tp=2,ep")]
#: what the workers go through after round k (k = 1, 2, 3); round 4 is the last
CYCLES = {1: "new storage", 2: "cumem", 3: "new storage"}


@pytest.fixture(scope="module")
def host():
    yield from vllm_workers()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory, tiny_checkpoints):
    """``seeds(name, n) -> [v0, ..., vn]``: seed k of the tiny model's config."""
    from m2nkit.adapters.tiny import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("seeds")
    made: dict = {}

    def get(name, n):
        while len(made.setdefault(name, [tiny_checkpoints(name)])) <= n:
            k = len(made[name])
            made[name].append(save_tiny_checkpoint(name, root / f"{name}-seed{k}", seed=k))
        return made[name][:n + 1]

    return get


# --------------------------------------------------------------------------
# in the workers (collective_rpc)


def _garbage(t) -> None:
    """Overwrite ``t``'s bytes: what freshly mapped device memory holds (undefined)."""
    import torch

    if t.is_contiguous():
        t.view(torch.uint8).random_(0, 256)
    else:
        t.fill_(float("nan"))


def _sleep_level2_then_wake(state, how: str) -> int:
    """Leave the live weights as level-2 sleep + wake does (module docstring); returns how many."""
    import torch

    model = state["model"]
    torch.manual_seed(1000 + state["worker"])
    old = []
    with torch.no_grad():
        for _, p in model.named_parameters():     # a tied Parameter once
            if how == "cumem":
                _garbage(p.data)
            else:
                new = torch.empty_like(p.data)
                _garbage(new)
                old.append((p.data, p.data.clone()))     # the let-go storage, and its bytes
                p.data = new
    addresses = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    by_address: dict[int, list] = {}
    for n, a in addresses.items():
        by_address.setdefault(a, []).append(n)
    state["woke"] = {"addresses": addresses, "old": old,
                     "ties": [names for names in by_address.values() if len(names) > 1]}
    return len(list(model.named_parameters()))


def _where_the_round_landed(state) -> dict:
    """Parameters not at the address the wake left them at; let-go storage written since."""
    from m2nkit.engine.in_process import bitwise_equal

    woke = state["woke"]
    live = dict(state["model"].named_parameters(remove_duplicate=False))
    ties = woke.get("ties", [])
    tied = all(len({live[n].data_ptr() for n in names}) == 1 for names in ties)
    return {"elsewhere": sorted(n for n, p in live.items() if woke["addresses"][n] != p.data_ptr()),
            "old_written": sum(not bitwise_equal(t, snap) for t, snap in woke["old"]),
            "tied": tied, "ties": len(ties)}


RESHAPED = "model.layers.0.mlp.experts.routed_experts.w13_weight"
RETYPED = "model.layers.0.self_attn.o_proj.weight"


def _wake_unlike_the_layout(state) -> list | None:
    """Worker 1: one expert tensor comes back padded; worker 0: o_proj comes back float32."""
    import torch

    params = dict(state["model"].named_parameters())
    name = RESHAPED if state["worker"] == 1 else RETYPED
    p = params[name]
    if state["worker"] == 1:
        e, rows, h = p.shape
        p.data = torch.zeros(e, rows + 32, h, dtype=p.dtype)
    else:
        p.data = p.data.float()
    state["woke"] = {"addresses": {n: q.data_ptr() for n, q in
                                   state["model"].named_parameters(remove_duplicate=False)},
                     "old": [(p.data, p.data.clone())]}
    return [name, list(p.shape), str(p.dtype)]


# --------------------------------------------------------------------------
# the driver


def _rounds(host, checkpoints, inference, transport, after_round, timeout_s=ROUND_TIMEOUT_S):
    """Two trainer processes send ``checkpoints`` in one session, round k = ``checkpoints[k-1]``;
    ``after_round(k)`` runs once both ranks finished round k (round k + 1 waits for it).
    Returns rank -> ``"done"`` or its error text."""
    from m2nkit.engine.tools.demo_vllm import trainer_main
    from m2nkit.engine.tools.procs import free_port

    checked, port = CTX.Semaphore(0), free_port()
    per_round: dict[int, set] = {}

    def on_report(kind, rank, k):
        if kind == "round":
            per_round.setdefault(k, set()).add(rank)
            if len(per_round[k]) == 2:
                after_round(k)
                checked.release()
                checked.release()

    return trainer_outcomes(CTX, trainer_main, lambda r, results: (
        r, 2, [str(c) for c in checkpoints], TRAINER, inference,
        host.client if r == 0 else None, port, timeout_s, results, "auto", transport, checked),
        2, timeout_s, wait_s=(len(checkpoints) + 2) * 2 * timeout_s, on_report=on_report)


def _assert_fresh_load(host, checkpoint, k, started):
    reports = host.client.verify(checkpoint)
    assert len(reports) == len(started)
    for w, r in enumerate(reports):
        assert r["compared"] == started[w]["parameters"] > 0
        assert (r["names_only_live"], r["names_only_fresh"]) == ([], []), (w, r)
        assert r["differ"] == [], f"round {k}, worker {w}: differs from vLLM's fresh load: " \
                                  f"{r['differ'][:5]}"
        assert r["version"] == f"v{k}", (k, w, r["version"])


@pytest.mark.parametrize("transport,name,inference", CASES, ids=[c[0] for c in CASES])
def test_rounds_after_sleep_and_wake_land_in_the_live_storage(host, seeds, transport, name,
                                                              inference):
    versions = seeds(name, 4)
    started = host.start_workers(versions[0], inference)
    assert {s["engine"] for s in started} == {"m2nkit.engine.plugins.vllm.M2NVLLMEngine"}
    landed: dict[int, list] = {}
    problems: list[str] = []

    def after_round(k):
        try:
            if k > 1:       # the round after a sleep/wake: where did it land?
                landed[k] = host.client.collective_rpc(_where_the_round_landed)
            _assert_fresh_load(host, versions[k], k, started)
            if k in CYCLES:
                counts = host.client.collective_rpc(_sleep_level2_then_wake, CYCLES[k])
                assert all(c > 0 for c in counts), counts
                # the wake left garbage: nothing equals v_k any more
                for w, r in enumerate(host.client.verify(versions[k])):
                    assert len(r["differ"]) == r["compared"], (k, w, len(r["differ"]))
        except AssertionError as e:     # reported after the trainers finish
            problems.append(f"after round {k}: {e}")

    outcome = _rounds(host, versions[1:], inference, transport, after_round)
    assert problems == [], problems
    assert outcome == {0: "done", 1: "done"}, outcome
    assert sorted(landed) == [2, 3, 4]
    for k, per_worker in landed.items():
        for w, r in enumerate(per_worker):
            assert r["elsewhere"] == [], f"round {k} (after {CYCLES[k - 1]}), worker {w}: " \
                                         f"parameters not in the storage the wake left: " \
                                         f"{r['elsewhere'][:5]}"
            assert r["old_written"] == 0, f"round {k}, worker {w}: {r['old_written']} let-go " \
                                          "storages were written"
            assert r["tied"], f"round {k}, worker {w}: a tie no longer shares storage"
    if name == "tiny-qwen3-tied":       # the tie (lm_head is embed_tokens) came through
        assert all(r["ties"] for r in landed[4]), landed[4]


def test_a_parameter_that_wakes_another_shape_or_dtype_refuses_the_round(host, seeds):
    name, inference = "tiny-qwen3-moe", "vllm:tp=2,ep"
    versions = seeds(name, 2)
    host.start_workers(versions[0], inference)
    woke: list = []

    def after_round(k):
        if k == 1:
            woke.extend(host.client.collective_rpc(_wake_unlike_the_layout))

    outcome = _rounds(host, versions[1:3], inference, "ipc", after_round, timeout_s=30.0)
    assert [w[0] for w in woke] == [RETYPED, RESHAPED] and woke[0][2] == "torch.float32", woke
    assert woke[1][1] == [4, 96, 128], woke
    retyped = woke[0][1]
    for rank in (0, 1):
        msg = outcome[rank]
        assert "the live model changed since the session's init" in msg, msg
        assert (f"'{RESHAPED}': vLLM's model holds [4, 96, 128] bfloat16, m2nkit's table "
                "declares [4, 64, 128] bfloat16" in msg
                or f"'{RETYPED}': vLLM's model holds {retyped} float32, m2nkit's table "
                   f"declares {retyped} bfloat16" in msg), msg
        assert "nothing was written" in msg, msg
    # nothing moved: the version stays v1, every other parameter still holds v1, the
    # re-allocated ones still hold what they woke with
    for w, (r, where) in enumerate(zip(host.client.verify(versions[1]),
                                       host.client.collective_rpc(_where_the_round_landed))):
        assert r["version"] == "v1", (w, r["version"])
        assert r["differ"] == [[RETYPED], [RESHAPED]][w], (w, r["differ"])
        assert where["elsewhere"] == [] and where["old_written"] == 0, (w, where)
