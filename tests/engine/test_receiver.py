"""M2NReceiver and InProcessClient against real torch_p2p groups (gloo, 127.0.0.1).

Trainer ranks are threads of the test process that use ``torch_p2p``
directly (the trainer-side engine is tested elsewhere); each receiver runs
in its own thread through ``InProcessClient``. Every gloo group is its own
``ProcessGroupGloo`` over its own ``TCPStore``, so threads of one process
make a real multi-rank group. Storage is compared bit-exact with
``reference_load`` (vLLM 0.33.0's loaders restated, oracle-checked).
"""

from __future__ import annotations

import copy
import re
import threading
import time
import traceback
from pathlib import Path

from _paths import EXAMPLE
import pytest
import torch

from _procs import in_threads
from m2nkit.adapters.hf_checkpoint import (
    checkpoint_manifest,
    checkpoint_metas,
    full_checkpoint_tensors,
    read_checkpoint,
)
from m2nkit.adapters.vllm import reference_load, vllm_destination
from m2nkit.engine.clients import InProcessClient, WeightSyncError
from m2nkit.engine.deadline import REPORT_GRACE_S, Deadline
from m2nkit.engine.in_process import bitwise_equal
from m2nkit.engine.receiver import IncompleteRoundError, M2NReceiver, build_vllm_storage
from m2nkit.engine.session import InitPayload, plan_from_manifest
from m2nkit.engine.tools.procs import free_port
from m2nkit.engine.control import (
    PlanMismatchError,
    TransferError,
    agree_on_plan,
    create_group,
    finish_round,
)
from m2nkit.engine.transports.torch_p2p import BucketSchedule, send_round
from m2nkit.manifest.protocol import VLLMWeightSyncClient
from m2nkit.manifest.serialize import manifest_digest, manifest_from_json, manifest_to_json

CHECKPOINT = EXAMPLE
TRAINER, INFERENCE, T, N = "fsdp:2", "vllm:tp=2", 2, 2


def receivers_for(ck, n: int = N) -> list[M2NReceiver]:
    dest = vllm_destination(ck.config, INFERENCE)
    return [M2NReceiver(dest, w) for w in range(n)]


@pytest.fixture(scope="module")
def ck():
    return read_checkpoint(CHECKPOINT)


def reference(ck, scale: float, worker: int) -> dict[str, torch.Tensor]:
    full = {k: v * scale for k, v in full_checkpoint_tensors(ck).items()}
    return reference_load(ck.config, full, INFERENCE, worker)


def assert_storage(receiver: M2NReceiver, ref: dict[str, torch.Tensor]) -> None:
    st = receiver.storage
    assert sorted(st) == sorted(ref)
    bad = [k for k in ref if not bitwise_equal(st[k], ref[k])]
    assert not bad, f"worker {receiver.worker}: differs from reference_load in {bad}"


class Trainers:
    """T trainer ranks as threads, one torch_p2p session (fresh port) per instance.

    Follows the control-plane protocol: rank 0 calls ``client.init_...`` in a
    thread while every rank joins the group and agrees on the plan; per
    round rank 0 calls ``start``, ``update`` in a thread while every rank
    sends, then ``finish``.
    """

    def __init__(self, ck, *, timeout_s: float = 10.0, bucket_bytes: int = 16 << 10,
                 manifest: dict | None = None, plan_for_rank: dict | None = None):
        self.ck, self.timeout_s, self.bucket_bytes = ck, timeout_s, bucket_bytes
        self.manifest = manifest or manifest_to_json(checkpoint_metas(ck, TRAINER), T)
        self.plan, self.digest = plan_from_manifest(self.manifest,
                                                    vllm_destination(ck.config, INFERENCE))
        self.plans = {r: (plan_for_rank or {}).get(r, self.plan) for r in range(T)}
        self.port = free_port()
        self.groups: dict[int, tuple] = {}

    def payload(self) -> dict:
        return InitPayload(
            master_address="127.0.0.1", master_port=self.port, rank_offset=T, world_size=T + N,
            backend="gloo", inference=self.plan.destination.spec, manifest=self.manifest,
            manifest_digest=self.digest, plan_digest=self.plan.digest(),
            timeout_s=self.timeout_s, bucket_bytes=self.bucket_bytes).to_json()

    def _ranks(self, body, client_call) -> dict:
        """Run ``body(rank)`` on every rank; ``client_call`` in a thread beside rank 0."""
        out: dict = {}

        def run(key, fn):
            try:
                out[key] = ("ok", fn())
            except BaseException as e:
                out[key] = ("err", e)

        threads = [threading.Thread(target=run, args=(r, lambda r=r: body(r)), daemon=True)
                   for r in range(T)]
        if client_call is not None:
            threads.append(threading.Thread(target=run, args=("client", client_call), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * self.timeout_s)
            assert not t.is_alive(), "a trainer thread hung"
        return out

    def join(self, client, payload: dict | None = None) -> dict:
        def body(r):
            store, group = create_group("127.0.0.1", self.port, r, T + N, timeout_s=self.timeout_s)
            self.groups[r] = (store, group)
            agree_on_plan(group, r, T + N, self.plans[r], timeout_s=self.timeout_s)
        payload = payload or self.payload()
        return self._ranks(body, lambda: client.init_weight_transfer_engine(payload))

    def round(self, client, k: int, version: str, scale: float, fail: str | None = None) -> dict:
        """One round. ``fail``: halfway through, trainer rank 1's source ``"raises"``,
        or it ``"stalls"`` (stops sending, alive, past the timeout), or it ``"dies"``
        (its connections close, no report); or it sends everything and ``"reports"``
        an error in the end-of-round verdict."""
        schedule = BucketSchedule.build(self.plan, self.bucket_bytes)
        client.start_weight_update()

        half = len(self.plan.wires) // 2

        def drop_group(r):
            """Close rank r's connections as a failed engine does: gloo closes on release."""
            store, group = self.groups[r]
            self.groups[r] = (store, None)
            group.abort()                 # the last reference goes: its sockets close

        def stream(r):
            for i, (name, t) in enumerate(checkpoint_manifest(self.ck, TRAINER, r).iter_local()):
                if r == 1 and i == half and fail in ("raises", "stalls", "dies"):
                    if fail == "stalls":      # silent until every other rank gave up on it
                        time.sleep(self.timeout_s + REPORT_GRACE_S + 0.5)
                    elif fail == "dies":      # its connections close, as when a process dies
                        drop_group(r)
                    raise RuntimeError(f"trainer rank 1: source {fail}")
                yield name, t * scale

        def body(r):
            # As the trainer engine does: one deadline for the round; send; then one
            # end-of-round verdict on every rank, a failed rank closing its connections
            # once its report is in. The traceback's frames hold the group: cleared.
            deadline = Deadline(self.timeout_s)
            error, sent = None, 0
            try:
                sent = send_round(self.groups[r][1], self.plan, schedule, r, stream(r),
                                  deadline=deadline)
            except Exception as e:
                traceback.clear_frames(e.__traceback__)
                if fail == "dies" and r == 1:
                    raise                           # no report at all
                error = str(e)
            if error is None and fail == "reports" and r == 1:
                error = "trainer rank 1: refused after sending (say, a NaN check)"
            finish_round(self.groups[r][0], r, T + N, num_trainer_ranks=T, round_id=k,
                         error=error, deadline=deadline,
                         on_reported=(lambda: drop_group(r)) if error else None)
            return sent
        out = self._ranks(body, lambda: client.update_weights({"round": k, "version": version}))
        if out["client"][0] == "ok":
            client.finish_weight_update(version)
        return out

    def close(self) -> None:
        for _, group in self.groups.values():
            if group is not None:
                group.abort()
        self.groups.clear()


def ok(out: dict) -> None:
    errs = {k: v[1] for k, v in out.items() if v[0] != "ok"}
    assert not errs, errs


@pytest.fixture
def session(ck):
    """Two receivers behind an InProcessClient; closes every group after the test."""
    receivers = receivers_for(ck)
    client = InProcessClient(receivers, timeout_s=60)
    trainers: list[Trainers] = []
    yield receivers, client, trainers
    for tr in trainers:
        tr.close()
    for r in receivers:
        r.shutdown()


@pytest.mark.timeout(60)
def test_full_rounds_bit_exact(ck, session):
    receivers, client, trainers = session
    assert isinstance(client, VLLMWeightSyncClient)
    tr = Trainers(ck)
    trainers.append(tr)
    ok(tr.join(client))
    # Storage is a module with vLLM names, allocated at init, zero (NaN-free).
    module = receivers[0].model
    assert isinstance(module, torch.nn.Module)
    names = dict(module.named_parameters(remove_duplicate=False))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    alias, router = "model.layers.0.mlp.experts.gate.weight", "model.layers.0.mlp.gate.weight"
    assert names[alias] is names[router]
    assert all(not torch.isnan(t).any() for t in receivers[0].storage.values())
    assert client.weight_versions() == [None, None]

    ok(tr.round(client, 1, "v1", 1.0))
    assert client.weight_versions() == ["v1", "v1"]
    for r in receivers:
        assert_storage(r, reference(ck, 1.0, r.worker))
    # A second round on the same group replaces every byte.
    ok(tr.round(client, 2, "v2", 2.0))
    assert client.weight_versions() == ["v2", "v2"]
    for r in receivers:
        assert_storage(r, reference(ck, 2.0, r.worker))
    # Same parameter objects as before: the commit copied in place.
    assert dict(receivers[0].model.named_parameters(remove_duplicate=False))[
        "model.embed_tokens.weight"] is names["model.embed_tokens.weight"]


def _lose_the_weights(receiver: M2NReceiver, how: str) -> dict[str, int]:
    """What vLLM's ``sleep(level=2)`` + ``wake_up`` leaves (docs/colocated.md, "Sleep mode"):
    ``"in place"`` every byte lost, same storage; ``"new storage"`` every parameter's
    ``.data`` replaced by new storage of NaN (vocab padding included). Its addresses."""
    for _, p in receiver.model.named_parameters():
        if how == "in place":
            p.data.fill_(float("nan"))
        else:
            p.data = torch.full_like(p.data, float("nan"))
    return {n: t.data_ptr() for n, t in receiver.storage.items()}


@pytest.mark.timeout(60)
def test_rounds_after_the_weights_were_lost_or_reallocated_are_bit_exact(ck, session):
    """The receiver's side of vLLM's sleep mode: each round resolves the live parameters
    again and zeroes the vocab padding no slab writes (worker 1's embedding rows 72..127
    here), so the round after a wake equals reference_load everywhere, in the storage
    the wake left."""
    receivers, client, trainers = session
    tr = Trainers(ck)
    trainers.append(tr)
    ok(tr.join(client))
    assert any(p.zero_boxes for p in tr.plan.destination.params if p.worker == 1)
    ok(tr.round(client, 1, "v1", 1.0))
    for k, how in ((2, "new storage"), (3, "in place"), (4, "new storage")):
        woke = [_lose_the_weights(r, how) for r in receivers]
        ok(tr.round(client, k, f"v{k}", float(k)))
        assert client.weight_versions() == [f"v{k}"] * N
        for r, addresses in zip(receivers, woke):
            assert_storage(r, reference(ck, float(k), r.worker))
            moved = [n for n, t in r.storage.items() if t.data_ptr() != addresses[n]]
            assert moved == [], f"round {k} ({how}): not in the storage the wake left: {moved}"


def test_build_vllm_storage_matches_reference_names(ck):
    tr = Trainers(ck)
    module = build_vllm_storage(tr.plan.destination, 1)
    got = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters(remove_duplicate=False)}
    ref = reference(ck, 1.0, 1)
    assert got == {n: (tuple(t.shape), t.dtype) for n, t in ref.items()}
    assert not any(p.requires_grad for p in module.parameters())


@pytest.fixture(scope="module")
def committed(ck):
    """Receivers that committed round 1 ("v1"), shared by the refusal tests (which change
    nothing)."""
    receivers = receivers_for(ck)
    client = InProcessClient(receivers, timeout_s=60)
    tr = Trainers(ck)
    ok(tr.join(client))
    ok(tr.round(client, 1, "v1", 1.0))
    yield receivers, tr
    tr.close()
    for r in receivers:
        r.shutdown()


def _extra_tensor(p: dict) -> None:
    metas, t = manifest_from_json(p["manifest"])
    from m2nkit.manifest.meta import ParamMeta
    metas.append(ParamMeta("model.layers.0.mlp.extra_proj.weight", torch.bfloat16, (4, 128)))
    p["manifest"] = manifest_to_json(metas, t)
    p["manifest_digest"] = manifest_digest(metas, t)


#: Payloads that do not parse: refused at once, without joining (no rendezvous is known).
UNPARSEABLE = {
    "missing field": (lambda p: p.pop("plan_digest"), "missing fields ['plan_digest']"),
    "unknown field": (lambda p: p.update(colour="red"), "unknown fields ['colour']"),
    "bad port": (lambda p: p.update(master_port=0), "'master_port'"),
    "manifest not an object": (lambda p: p.update(manifest=[]), "'manifest'"),
    "destination not an object": (lambda p: p.update(destination=[1]), "'destination'"),
    # a worker of schema 2 would trace every worker's model instead of reading the payload's
    "older protocol": (lambda p: p.update(schema_version=2),
                       "schema_version 2 is not supported; this m2nkit speaks 3"),
}

#: Payloads that parse but are refused: the worker joins only to tell every rank why.
REFUSED = {
    "not a spec": (lambda p: p.update(inference="sglang:tp=2"), ValueError, "'inference'"),
    "other spec": (lambda p: p.update(inference="vllm:tp=2,ep"), ValueError,
                   "'vllm:tp=2,ep' but this worker serves 'vllm:tp=2,dp=1'"),
    "manifest digest": (lambda p: p.update(manifest_digest="0" * 64), ValueError,
                        "'manifest_digest'"),
    "changed manifest": (lambda p: p["manifest"]["params"][0].update(dtype="float32"), ValueError,
                         "manifest hashes to"),
    "plan digest": (lambda p: p.update(plan_digest="0" * 64), PlanMismatchError, "'plan_digest'"),
    "extra tensor": (_extra_tensor, ValueError, "model.layers.0.mlp.extra_proj.weight"),
}


def assert_unchanged(ck, receivers) -> None:
    for r in receivers:
        assert r.weight_version == "v1"
        assert_storage(r, reference(ck, 1.0, r.worker))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(UNPARSEABLE))
def test_unparseable_payload_refused_at_once(ck, committed, case):
    receivers, tr = committed
    mutate, words = UNPARSEABLE[case]
    payload = copy.deepcopy(tr.payload())
    mutate(payload)
    for r in receivers:
        t0 = time.monotonic()
        with pytest.raises(ValueError) as e:
            r.init_transfer_engine(r.parse_init_info(payload))
        assert time.monotonic() - t0 < 5, "refused only after trying to join a group"
        assert words in str(e.value) and f"worker {r.worker}" in str(e.value)
    assert_unchanged(ck, receivers)
    with pytest.raises(WeightSyncError) as e:
        InProcessClient(receivers, timeout_s=30).init_weight_transfer_engine(payload)
    assert e.value.status == 400 and sorted(e.value.errors) == [0, 1]
    assert "workers [0, 1]" in str(e.value) and words in str(e.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_payload_fails_every_rank_before_any_data_moves(ck, committed, case):
    receivers, _ = committed
    mutate, kind, words = REFUSED[case]
    tr = Trainers(ck, timeout_s=10.0)          # a new session on a fresh port
    payload = copy.deepcopy(tr.payload())
    mutate(payload)
    try:
        t0 = time.monotonic()
        out = tr.join(InProcessClient(receivers, timeout_s=30), payload)
        assert time.monotonic() - t0 < tr.timeout_s, "a rank waited for the timeout"
    finally:
        tr.close()
    # Every trainer rank learns the worker's reason at once (not a timeout).
    for r in range(T):
        assert out[r][0] == "err" and isinstance(out[r][1], PlanMismatchError), out[r]
        assert "refused the session" in str(out[r][1]) and words in str(out[r][1])
    err = out["client"][1]
    assert isinstance(err, WeightSyncError) and err.status == 400
    assert all(isinstance(e, kind) and words in str(e) for e in err.errors.values())
    assert sorted(err.errors) == [0, 1]
    assert_unchanged(ck, receivers)


@pytest.mark.timeout(60)
def test_ranks_that_disagree_on_the_plan_refuse_before_any_data_moves(ck, session):
    receivers, client, trainers = session
    other, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, TRAINER), T),
                                  vllm_destination(ck.config, "vllm:tp=2,ep"))
    tr = Trainers(ck, plan_for_rank={1: other})
    trainers.append(tr)
    out = tr.join(client)
    for key in (0, 1, "client"):
        assert out[key][0] == "err", key
    assert isinstance(out[1][1], PlanMismatchError)
    err = out["client"][1]
    assert isinstance(err, WeightSyncError) and err.status == 400
    assert all(isinstance(e, PlanMismatchError) for e in err.errors.values())
    assert "plans differ" in str(err)
    assert client.weight_versions() == [None, None]
    assert all(not t.any() for r in receivers for t in r.storage.values())
    with pytest.raises(WeightSyncError, match="before init_transfer_engine"):
        client.start_weight_update()


#: What every rank's error must say, per fault of trainer rank 1: the root cause and its rank.
ROOT_CAUSE = {
    "raises": "first failure reported: trainer rank 1: source raises",
    "stalls": "trainer rank 1 sent no report",
    "dies": "trainer rank 1 sent no report",
    "reports": "first failure reported: trainer rank 1: refused after sending",
}


def failed_after(e: BaseException) -> float:
    """The ``failed after X s`` a receiver's round error states."""
    return float(re.search(r"failed after ([0-9.]+) s", str(e)).group(1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail", [
    "raises",
    # waits for the deadline: see pyproject.toml on integration
    pytest.param("stalls", marks=pytest.mark.integration),
    "dies", "reports"])
def test_failed_round_commits_nothing_then_reinit_succeeds(ck, session, fail):
    receivers, client, trainers = session
    # A stall is found by the deadline; every other fault closes connections and is
    # found at once, so there a long timeout shows the error did not wait for it.
    tr = Trainers(ck, timeout_s=3.0 if fail == "stalls" else 30.0)
    trainers.append(tr)
    ok(tr.join(client))
    ok(tr.round(client, 1, "v1", 1.0))

    t0 = time.monotonic()
    out = tr.round(client, 2, "v2", 2.0, fail=fail)
    if fail != "stalls":    # found through closed connections: no rank waited for the deadline
        assert time.monotonic() - t0 < tr.timeout_s / 2, out
    err = out["client"][1]
    assert isinstance(err, WeightSyncError) and err.status == 500, out
    assert sorted(err.errors) == [0, 1]
    # Every rank names the root cause and its rank; trainer rank 0 too.
    assert out[0][0] == "err" and ROOT_CAUSE[fail] in str(out[0][1]), out[0]
    for w, e in err.errors.items():
        assert isinstance(e, TransferError) and f"worker {w}" in str(e)
        assert ROOT_CAUSE[fail] in str(e), e
        # The documented bound: timeout_s + REPORT_GRACE_S after update_weights.
        assert failed_after(e) <= tr.timeout_s + REPORT_GRACE_S, e
        if fail == "reports":       # every byte arrived, but the verdict says the round failed
            assert not e.missing and "another rank failed" in str(e)
        else:
            assert e.missing and "missing" in str(e)
    # finish refuses, naming the missing tensors (or the failure elsewhere); nothing changed.
    with pytest.raises(WeightSyncError) as fin:
        client.finish_weight_update("v2")
    for w, e in fin.value.errors.items():
        assert isinstance(e, IncompleteRoundError)
        assert e.missing == err.errors[w].missing
        assert all(f"'{name}'" in str(e) for name in e.missing)
        assert e.missing or "failed elsewhere" in str(e)
    assert client.weight_versions() == ["v1", "v1"]
    for r in receivers:
        assert_storage(r, reference(ck, 1.0, r.worker))
    # The group is broken: a new round is refused until a fresh init.
    with pytest.raises(WeightSyncError, match="broken group"):
        client.start_weight_update()
    tr.close()

    # A round that must succeed: a long deadline (it bounds, it is not waited for), as
    # 5 s failed this round at a load average of 9.
    fresh = Trainers(ck, timeout_s=30.0)
    trainers.append(fresh)
    assert fresh.port != tr.port
    ok(fresh.join(client))
    ok(fresh.round(client, 3, "v3", 2.0))
    assert client.weight_versions() == ["v3", "v3"]
    for r in receivers:
        assert_storage(r, reference(ck, 2.0, r.worker))


def test_call_order_and_update_info_errors(ck):
    r = receivers_for(ck, 1)[0]
    with pytest.raises(ValueError, match="before init_transfer_engine"):
        r.start_weight_update()
    with pytest.raises(ValueError, match="without start_weight_update"):
        r.finish_weight_update("v")
    with pytest.raises(ValueError, match="'round'"):
        r.parse_update_info({"round": -1})
    with pytest.raises(ValueError, match="M2NReceiver"):
        r.parse_update_info({"round": 1, "colour": "red"})
    with pytest.raises(ValueError, match="worker 2 is not in 0..1"):
        M2NReceiver(vllm_destination(ck.config, INFERENCE), 2)
    with pytest.raises(ValueError, match="must be a DestinationBuilder"):
        M2NReceiver(INFERENCE, 0)
    r.shutdown()
    r.shutdown()                               # idempotent


# --------------------------------------------------------------------------
# receive modes: staged (copy at commit) and in-place (into the live parameters)


def _addresses(receiver: M2NReceiver) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in receiver.model.named_parameters(remove_duplicate=False)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("direct", [None, 64], ids=["tiny-slabs-packed", "direct-64B"])
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_modes_bit_exact_and_parameter_addresses_never_change(ck, monkeypatch, mode, direct):
    # direct=64: every slab of 64 B or more travels alone, so zero-copy sends and
    # receives, the cut of stacked experts and the bounce copies of non-contiguous
    # regions all run (the tiny model's slabs are all below the default 256 KiB).
    from m2nkit.engine.transports import torch_p2p

    if direct is not None:
        monkeypatch.setattr(torch_p2p, "DIRECT_BYTES", direct)
    dest = vllm_destination(ck.config, INFERENCE)
    targets = [build_vllm_storage(dest(checkpoint_metas(ck, TRAINER)), w) for w in range(N)]
    receivers = [M2NReceiver(dest, w, target=targets[w], mode=mode) for w in range(N)]
    client = InProcessClient(receivers, timeout_s=60)
    tr = Trainers(ck)
    try:
        before = [_addresses(r) for r in receivers]
        ok(tr.join(client))
        for k, scale in ((1, 1.0), (2, 3.0)):
            ok(tr.round(client, k, f"v{k}", scale))
            assert client.weight_versions() == [f"v{k}"] * N
            for r in receivers:
                assert r.model is targets[r.worker] and not r.weights_mixed
                assert_storage(r, reference(ck, scale, r.worker))
                # CUDA graphs hold parameter addresses: never reallocated, in either mode.
                assert _addresses(r) == before[r.worker]
    finally:
        tr.close()
        for r in receivers:
            r.shutdown()


@pytest.mark.timeout(60)
def test_in_place_failed_round_says_the_weights_are_mixed(ck):
    receivers = [M2NReceiver(vllm_destination(ck.config, INFERENCE), w, mode="in_place")
                 for w in range(N)]
    client = InProcessClient(receivers, timeout_s=60)
    tr = Trainers(ck, timeout_s=30.0)
    fresh = Trainers(ck, timeout_s=10.0)
    try:
        ok(tr.join(client))
        ok(tr.round(client, 1, "v1", 1.0))
        out = tr.round(client, 2, "v2", 2.0, fail="raises")
        err = out["client"][1]
        assert isinstance(err, WeightSyncError) and sorted(err.errors) == [0, 1]
        for w, e in err.errors.items():
            assert "first failure reported: trainer rank 1: source raises" in str(e)
            assert ("in-place mode: the live weights are now mixed (round 2 wrote part of them, "
                    "the rest is older), the version stays 'v1'; run a new complete round "
                    "before serving them") in str(e), e
        with pytest.raises(WeightSyncError) as fin:
            client.finish_weight_update("v2")
        for e in fin.value.errors.values():
            assert isinstance(e, IncompleteRoundError)
            assert "not committing" in str(e) and "the live weights are now mixed" in str(e)
        assert client.weight_versions() == ["v1", "v1"]
        assert all(r.weights_mixed for r in receivers)
        # Mixed, really: some tensors already hold round 2's bytes, others round 1's.
        ref1 = [reference(ck, 1.0, w) for w in range(N)]
        ref2 = [reference(ck, 2.0, w) for w in range(N)]
        new = [n for r in receivers for n, t in r.storage.items()
               if not bitwise_equal(t, ref1[r.worker][n]) and bitwise_equal(t, ref2[r.worker][n])]
        old = [n for r in receivers for n, t in r.storage.items()
               if bitwise_equal(t, ref1[r.worker][n]) and not bitwise_equal(t, ref2[r.worker][n])]
        assert new and old
        tr.close()
        # A new complete round (fresh session) makes them whole again.
        ok(fresh.join(client))
        ok(fresh.round(client, 3, "v3", 2.0))
        assert client.weight_versions() == ["v3", "v3"]
        assert not any(r.weights_mixed for r in receivers)
        for r in receivers:
            assert_storage(r, ref2[r.worker])
    finally:
        tr.close()
        fresh.close()
        for r in receivers:
            r.shutdown()


def test_receive_mode_is_checked(ck):
    with pytest.raises(ValueError, match=r"mode 'inplace' is not one of \['staged', 'in_place'\]"):
        M2NReceiver(vllm_destination(ck.config, INFERENCE), 0, mode="inplace")


# --------------------------------------------------------------------------
# a second init while a session is live: it replaces the session


class Engines:
    """T trainer engines (threads) of one session, each with the checkpoint scaled by ``scale``."""

    def __init__(self, ck, client, timeout_s: float = 20.0):
        from m2nkit.engine.trainer import M2NTrainerInitInfo

        self.ck, self.client, self.scale = ck, client, 1.0
        port = free_port()
        self.infos = [M2NTrainerInitInfo(rank=r, num_trainer_ranks=T,
                                         destination=vllm_destination(ck.config, INFERENCE),
                                         master_port=port, timeout_s=timeout_s,
                                         bucket_bytes=16 << 10) for r in range(T)]
        self.engines: dict = {}

    def _source(self, r):
        from m2nkit.manifest import ManifestM2NWeightSource

        base = checkpoint_manifest(self.ck, TRAINER, r)
        src = self

        class Scaled(ManifestM2NWeightSource):
            def iter_local(self):
                for name, t in base.iter_local():
                    yield name, t * src.scale
        return Scaled(list(base.entries), rank=r)

    def _each(self, fn, timeout_s=60) -> dict:
        return in_threads({r: (lambda r=r: fn(r)) for r in range(T)}, timeout_s)

    def init(self) -> dict:
        from m2nkit.engine.trainer import M2NTrainerEngine

        def one(r):
            self.engines[r] = M2NTrainerEngine.trainer_init(
                self.infos[r], client=self.client if r == 0 else None, source=self._source(r))
        return self._each(one)

    def send(self, version: str, scale: float) -> dict:
        """One round on every rank; ``self.took[r]``: seconds rank r spent in ``send_weights``."""
        self.scale, self.took = scale, {}

        def one(r):
            t0 = time.monotonic()
            try:
                return self.engines[r].send_weights(version)
            finally:
                self.took[r] = time.monotonic() - t0
        return self._each(one)

    def shutdown(self) -> None:
        for e in self.engines.values():
            e.shutdown()


@pytest.mark.timeout(120)
def test_second_init_supersedes_the_live_session(ck):
    receivers = receivers_for(ck)
    client = InProcessClient(receivers, timeout_s=60)
    a, b = Engines(ck, client), Engines(ck, client)
    try:
        ok(a.init())
        ok(a.send("a1", 1.0))
        assert client.weight_versions() == ["a1", "a1"]
        # Session B inits while A is live: B takes the workers over.
        ok(b.init())
        ok(b.send("b1", 2.0))
        assert client.weight_versions() == ["b1", "b1"]
        # A's next round fails on every rank, naming the cause, before anything is sent
        # (found through the session store, well before A's 20 s deadline).
        t0 = time.monotonic()
        out = a.send("a2", 3.0)
        assert time.monotonic() - t0 < 10
        for r in range(T):
            kind, e = out[r]
            assert kind == "err" and isinstance(e, TransferError), out[r]
            assert "this session was superseded by the session at 127.0.0.1:" \
                   f"{b.infos[0].master_port}" in str(e), e
            assert "build a fresh engine with trainer_init" in str(e), e
        # The workers kept B's round, and B goes on undisturbed.
        assert client.weight_versions() == ["b1", "b1"]
        for r in receivers:
            assert_storage(r, reference(ck, 2.0, r.worker))
        ok(b.send("b2", 1.0))
        assert client.weight_versions() == ["b2", "b2"]
        for r in receivers:
            assert_storage(r, reference(ck, 1.0, r.worker))
        # An update_weights that still carries A's session id is refused as superseded.
        client.start_weight_update()
        with pytest.raises(WeightSyncError) as e:
            client.update_weights({"round": 99, "version": "a3",
                                   "session": a.engines[0].payload.session})
        assert "superseded by a newer init_weight_transfer_engine" in str(e.value)
        assert "the older trainer must call trainer_init again" in str(e.value)
        assert client.weight_versions() == ["b2", "b2"]
    finally:
        a.shutdown()
        b.shutdown()
        for r in receivers:
            r.shutdown()


class _AddsField:
    """A client that adds ``extra`` to the init payload (a newer trainer's field, say)."""

    def __init__(self, inner: InProcessClient, extra: dict) -> None:
        self.inner, self.extra = inner, extra

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.inner.init_weight_transfer_engine({**init_info, **self.extra})

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra,words", [
    ({"colour": "red"}, "init payload has unknown fields ['colour']"),
    ({"world_size": "four"}, "init payload field 'world_size' must be a positive int, got 'four'"),
])
def test_payload_a_worker_cannot_parse_fails_every_trainer_at_once(ck, extra, words):
    # Both workers refuse the payload before they could join its group. Every
    # trainer rank (rank 1 too, which has no RPC to hear it from) raises at
    # once, long before its 40 s init deadline, with each worker's own reason;
    # the workers stay as they were.
    receivers = receivers_for(ck)
    eng = Engines(ck, _AddsField(InProcessClient(receivers, timeout_s=60), extra),
                  timeout_s=40.0)
    try:
        t0 = time.monotonic()
        out = eng.init()
        took = time.monotonic() - t0
        for r in range(T):
            kind, e = out[r]
            assert kind == "err" and isinstance(e, PlanMismatchError), out[r]
            msg = str(e)
            assert msg.startswith(f"rank {r}: "), msg
            for w in range(N):
                assert (f"worker {w} (rank {T + w}) refused the session: worker {w}: "
                        f"{words}") in msg, msg
            assert msg.endswith("nothing was sent") or "the inference side said" in msg, msg
        assert took < 15, f"the trainers learned the refusal only after {took:.1f} s"
        for r in receivers:
            assert r.weight_version is None and r.plan is None
    finally:
        eng.shutdown()
        for r in receivers:
            r.shutdown()


class _Refusing:
    """Rank 0's client, with one call refused as the inference side can refuse it.

    ``"workers refuse"``: ``update_weights`` reaches the workers with another
    session's id, and each refuses it up front (``SupersededError``), before it
    joins the round. ``"server gone"``: the call goes to a server that is gone
    (nothing listens on its port). Every other call reaches the workers.
    """

    def __init__(self, inner: InProcessClient, call: str, how: str) -> None:
        self.inner, self.call, self.how = inner, call, how
        self.url = f"http://127.0.0.1:{free_port()}"

    def __getattr__(self, name):
        if name != self.call:
            return getattr(self.inner, name)
        if self.how == "server gone":
            from m2nkit.engine.clients import HTTPClient

            return getattr(HTTPClient(self.url, timeout_s=10), name)
        return lambda info: self.inner.update_weights({**info, "session": "stale"})


def _assert_every_rank_raised_first(out: dict, took: dict, cause: str, words: list[str],
                                    timeout_s: float) -> None:
    """Every trainer rank raised ``"trainer rank r: round 1 failed: " + cause ...``,
    quoting ``words``, long before ``timeout_s``."""
    for r in range(T):
        kind, e = out[r]
        assert kind == "err" and isinstance(e, TransferError), out[r]
        msg = str(e)
        assert msg.startswith(f"trainer rank {r}: round 1 failed: {cause}"), msg
        for w in words:
            assert w in msg, msg
        for stale in ("stopped answering", "dead or gone", "sent no report",
                      "did not complete by the deadline"):
            assert stale not in msg, msg
        # At once, not at the deadline: a bound far below timeout_s, however loaded the machine.
        assert took[r] < timeout_s / 4, (r, took[r])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["workers refuse", "server gone"])
def test_update_weights_refused_before_the_workers_join_fails_every_trainer_rank_at_once(ck, how):
    # Issue 21, item 3: rank 0's update_weights call is refused before any worker
    # joined the round (the workers refuse it up front, or the server is gone).
    # Every trainer rank, rank 1 too (it makes no client call), must raise with
    # that refusal first, at once; before, every rank waited in a send no worker
    # would receive until its 40 s deadline, and only rank 0 heard the refusal.
    timeout_s = 40.0
    receivers = receivers_for(ck)
    client = _Refusing(InProcessClient(receivers, timeout_s=60), "update_weights", how)
    eng = Engines(ck, client, timeout_s=timeout_s)
    try:
        ok(eng.init())
        out = eng.send("v1", 2.0)
        if how == "server gone":
            words = [f"POST {client.url}/update_weights failed"]
        else:
            words = [f"worker {w}: SupersededError: worker {w}: update_weights of session "
                     "'stale' refused" for w in range(N)]
        _assert_every_rank_raised_first(out, eng.took, "trainer rank 0: update_weights failed: ",
                                        words, timeout_s)
        for r in range(T):
            assert "nothing was sent" in str(out[r][1]), out[r]
        assert client.weight_versions() == [None, None]
    finally:
        eng.shutdown()
        for r in receivers:
            r.shutdown()


@pytest.mark.timeout(90)
def test_a_failed_commit_fails_every_trainer_rank_with_its_reason(ck):
    # Issue 21, item 3: the round arrived whole on every worker, but rank 0's
    # finish_weight_update (a call only it makes) fails: the server is gone.
    # Every trainer rank must raise that reason; before, rank 1 returned success
    # for a version no worker committed.
    timeout_s = 40.0
    receivers = receivers_for(ck)
    inner = InProcessClient(receivers, timeout_s=60)
    client = _Refusing(inner, "finish_weight_update", "server gone")
    eng = Engines(ck, client, timeout_s=timeout_s)
    try:
        ok(eng.init())
        out = eng.send("v1", 2.0)
        _assert_every_rank_raised_first(
            out, eng.took, "trainer rank 0: finish_weight_update failed: ",
            [f"POST {client.url}/finish_weight_update failed"], timeout_s)
        assert inner.weight_versions() == [None, None]      # never committed
    finally:
        eng.shutdown()
    # The workers are not left stuck in the uncommitted round: a fresh session commits.
    fresh = Engines(ck, inner)
    try:
        ok(fresh.init())
        ok(fresh.send("v2", 3.0))
        assert inner.weight_versions() == ["v2", "v2"]
        for r in receivers:
            assert_storage(r, reference(ck, 3.0, r.worker))
    finally:
        fresh.shutdown()
        for r in receivers:
            r.shutdown()


@pytest.mark.parametrize("bucket_bytes", [4 << 10, 16 << 10, 100 << 10])
def test_no_bucket_holds_more_than_bucket_bytes_for_any_rank(ck, bucket_bytes):
    # Issue 8: a rank's staged bytes stay within one bucket. Per bucket, the bytes
    # each trainer sends and each worker receives, summed here from the slabs
    # themselves, never pass bucket_bytes unless the bucket is one wire tensor;
    # and a bucket closes only when the next tensor would pass it.
    plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ck, TRAINER), T),
                                 vllm_destination(ck.config, INFERENCE))
    sched = BucketSchedule.build(plan, bucket_bytes)
    assert sched.bounds[0] == 0 and sched.bounds[-1] == len(plan.wires)

    def per_rank(wires) -> int:
        send, recv = [0] * T, [0] * N
        for wi in wires:
            for s in plan.wires[wi].slabs():
                send[s.src] += s.nbytes
                recv[s.dst] += s.nbytes
        return max(send + recv)

    sizes = [per_rank(sched.wires(k)) for k in range(len(sched))]
    over = [k for k in range(len(sched)) if sizes[k] > bucket_bytes and len(sched.wires(k)) > 1]
    assert not over, [(k, sizes[k]) for k in over]
    for k in range(len(sched) - 1):      # closed only because the next tensor would not fit
        nxt = range(sched.bounds[k], sched.bounds[k + 1] + 1)
        assert per_rank(nxt) > bucket_bytes or per_rank(sched.wires(k + 1)[:1]) == 0, k
    assert len(sched) > 2                # the sizes above really cut this model



class _RecordingReload:
    """A ``ReloadTarget`` over a plain storage: the round lands in ``shadow`` (zeros at each
    ``begin``, looked up lazily), and ``commit`` copies it into the live parameters."""

    def __init__(self, live: torch.nn.Module) -> None:
        self.live, self.calls, self.looked_up, self.heard = live, [], set(), []
        self.live_changed = False
        self.shadow = {n: torch.zeros_like(p) for n, p in live.named_parameters()}

    def params(self):
        return dict(self.live.named_parameters())

    def begin(self, plan, worker):
        self.calls.append("begin")
        self.heard = []
        for t in self.shadow.values():
            t.zero_()
        reload = self

        class Lazy(dict):
            def __getitem__(self, name):
                reload.looked_up.add(name)
                return reload.shadow[name]

            def wires_received(self, names):
                reload.heard.extend(names)

        return Lazy((n, None) for n in self.shadow)

    def commit(self):
        self.calls.append("commit")
        with torch.no_grad():
            for n, p in self.live.named_parameters():
                p.copy_(self.shadow[n])

    def abort(self):
        self.calls.append("abort")


@pytest.mark.timeout(60)
def test_a_reload_target_gets_the_round_and_makes_it_live_only_at_commit(ck):
    """``M2NReceiver(reload=...)`` (the vLLM plugin's path into a quantized model): slabs
    land in the reload's tensors, ``commit`` runs once the round is whole; a failed round
    is aborted: the live weights keep the last committed round, whole, and are not mixed."""
    dest = vllm_destination(ck.config, INFERENCE)
    targets = [build_vllm_storage(dest(checkpoint_metas(ck, TRAINER)), w) for w in range(N)]
    reloads = [_RecordingReload(t) for t in targets]
    receivers = [M2NReceiver(dest, w, target=targets[w], mode="in_place", reload=reloads[w])
                 for w in range(N)]
    client = InProcessClient(receivers, timeout_s=60)
    tr = Trainers(ck, timeout_s=30.0)
    try:
        ok(tr.join(client))
        ok(tr.round(client, 1, "v1", 1.0))
        assert [r.calls for r in reloads] == [["begin", "commit"]] * N
        assert all(r.looked_up == set(r.shadow) for r in reloads)   # every slab went there
        # told of every wire tensor it was sent, once, as each bucket landed
        assert [sorted(r.heard) for r in reloads] == [
            sorted(receivers[w]._expected) for w in range(N)]
        for r in receivers:
            assert_storage(r, reference(ck, 1.0, r.worker))
        out = tr.round(client, 2, "v2", 2.0, fail="raises")
        assert isinstance(out["client"][1], WeightSyncError)
        with pytest.raises(WeightSyncError) as fin:
            client.finish_weight_update("v2")
        for e in fin.value.errors.values():
            assert "not committing" in str(e) and "mixed" not in str(e), e
        assert [r.calls for r in reloads] == [["begin", "commit", "begin", "abort"]] * N
        assert client.weight_versions() == ["v1", "v1"]
        for r in receivers:
            assert not r.weights_mixed
            assert_storage(r, reference(ck, 1.0, r.worker))
    finally:
        tr.close()
        for r in receivers:
            r.shutdown()
    with pytest.raises(ValueError, match=r"reload= needs the live target it reloads and "
                                         r"mode='in_place' \(got target=NoneType, mode='staged'\)"):
        M2NReceiver(dest, 0, reload=reloads[0])
