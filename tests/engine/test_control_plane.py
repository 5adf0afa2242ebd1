"""The HTTP control plane: InferenceServer (worker processes) driven by HTTPClient.

Workers are real processes, each with an ``M2NReceiver`` (forked from the
tests' forkserver, ``_procs.py``; ``test_module_entry_serves_until_terminated``
runs the real entry point); trainer ranks are threads of the test process
using ``torch_p2p`` directly, joined in one gloo group over 127.0.0.1. Routes and bodies are vLLM's
(``vllm/entrypoints/serve/dev/rlhf/api_router.py``); a real vLLM server
is not run here (no GPU, no vLLM install).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from _paths import EXAMPLE
import pytest
import torch

from _procs import ensure_forkserver, in_threads
from m2nkit.adapters.hf_checkpoint import (
    checkpoint_manifest,
    checkpoint_metas,
    full_checkpoint_tensors,
    read_checkpoint,
)
from m2nkit.adapters.vllm import reference_load, vllm_destination
from m2nkit.engine.clients import HTTPClient, WeightSyncError
from m2nkit.engine.deadline import REPORT_GRACE_S
from m2nkit.engine.in_process import bitwise_equal
from m2nkit.engine.tools.procs import free_port
from m2nkit.engine.tools.server import InferenceServer
from m2nkit.engine.session import InitPayload, plan_from_manifest
from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo
from m2nkit.engine.control import agree_on_plan, create_group
from m2nkit.manifest.protocol import VLLMWeightSyncClient
from m2nkit.manifest.serialize import manifest_to_json

CHECKPOINT = EXAMPLE
TRAINER, INFERENCE, T, N = "fsdp:2", "vllm:tp=2", 2, 2


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Trainers:
    """T trainer ranks (threads) that join a session through torch_p2p and then send nothing."""

    def __init__(self, ck, timeout_s: float):
        self.ck, self.timeout_s = ck, timeout_s
        manifest = manifest_to_json(checkpoint_metas(ck, TRAINER), T)
        self.plan, digest = plan_from_manifest(manifest, vllm_destination(ck.config, INFERENCE))
        self.payload = InitPayload(
            master_address="127.0.0.1", master_port=free_port(), rank_offset=T,
            world_size=T + N, backend="gloo", inference=self.plan.destination.spec,
            manifest=manifest,
            manifest_digest=digest, plan_digest=self.plan.digest(), timeout_s=timeout_s,
            bucket_bytes=16 << 10).to_json()
        self.groups: dict[int, object] = {}

    def join(self, client) -> dict:
        def rank(r):
            store, group = create_group("127.0.0.1", self.payload["master_port"], r, T + N,
                                        timeout_s=self.timeout_s)
            self.groups[r] = (store, group)
            agree_on_plan(group, r, T + N, self.plan, timeout_s=self.timeout_s)
        return in_threads({0: lambda: rank(0), 1: lambda: rank(1),
                           "client": lambda: client.init_weight_transfer_engine(self.payload)},
                          4 * self.timeout_s)

    def close(self) -> None:
        for _, group in self.groups.values():
            group.abort()


@pytest.fixture(scope="module")
def ck():
    ensure_forkserver()          # the servers' workers fork from it: milliseconds, not an import
    return read_checkpoint(CHECKPOINT)


@pytest.mark.timeout(60)
def test_http_round_bit_exact(ck, tmp_path):
    with InferenceServer(CHECKPOINT, INFERENCE, timeout_s=30, start_method="forkserver") as server:
        client = HTTPClient(server.url, timeout_s=60)
        assert isinstance(client, VLLMWeightSyncClient)
        assert client.get_world_size() == N
        assert client.weight_versions() == [None, None]

        # Bad input: HTTP 400 with the message; nothing else changes.
        bad = {"init_info": {"master_port": 1}}
        status, doc = post(server.url + "/init_weight_transfer_engine", json.dumps(bad).encode())
        assert status == 400 and "missing fields" in doc["error"] and "workers 0, 1" in doc["error"]
        with pytest.raises(WeightSyncError, match="missing fields") as e:
            client.init_weight_transfer_engine({"master_port": 1})
        assert e.value.status == 400
        status, doc = post(server.url + "/update_weights", b"{not json")
        assert status == 400 and "not JSON" in doc["error"]
        status, doc = post(server.url + "/update_weights", b'{"updates": {}}')
        assert status == 400 and "unknown fields ['updates']" in doc["error"]
        status, doc = post(server.url + "/no_such_route", b"{}")
        assert status == 404

        # The trainer side is m2nkit's own engine; rank 0 drives this client.
        def trainers(inference: str, version: str) -> dict:
            port = free_port()

            def rank(r):
                info = M2NTrainerInitInfo(rank=r, num_trainer_ranks=T,
                                          destination=vllm_destination(ck.config, inference),
                                          master_port=port,
                                          timeout_s=10.0, bucket_bytes=16 << 10)
                engine = M2NTrainerEngine.trainer_init(
                    info, client=client if r == 0 else None,
                    source=checkpoint_manifest(ck, TRAINER, r))
                try:
                    return engine.send_weights(version)
                finally:
                    engine.shutdown()
            return in_threads({r: (lambda r=r: rank(r)) for r in range(T)}, 60)

        # Trainers that plan for another layout: the workers refuse, every trainer
        # rank fails at once with their reason, HTTP says 400, nothing changes.
        t0 = time.monotonic()
        out = trainers("vllm:tp=2,ep", "v0")
        assert time.monotonic() - t0 < 10.0
        for r in range(T):
            assert out[r][0] == "err" and "refused the session" in str(out[r][1]), out[r]
            assert "this worker serves 'vllm:tp=2,dp=1'" in str(out[r][1])
        assert client.weight_versions() == [None, None]

        status, _ = post(server.url + "/start_weight_update", b'{"is_checkpoint_format": true}')
        assert status == 400                    # vLLM's body is accepted; no session yet

        out = trainers(INFERENCE, "v1")
        assert all(v[0] == "ok" for v in out.values()), out
        assert client.weight_versions() == ["v1", "v1"]

        full = full_checkpoint_tensors(ck)
        status, doc = post(server.url + "/m2nkit/save_storage",
                           json.dumps({"dir": str(tmp_path / "http")}).encode())
        assert status == 200 and len(doc["files"]) == N
        for w in range(N):
            got = server.storage(w, tmp_path)
            ref = reference_load(ck.config, full, INFERENCE, w)
            aliases = {f"model.layers.{i}.mlp.experts.gate.weight" for i in (0, 1)}
            assert set(ref) - set(got) == aliases        # saved once, under the router's name
            bad_names = [k for k in got if not bitwise_equal(got[k], ref[k])]
            assert not bad_names, f"worker {w} differs in {bad_names}"
            assert all(not torch.isnan(t).any() for t in got.values())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(60)
def test_killed_worker_is_named_not_a_hang(ck):
    server = InferenceServer(CHECKPOINT, INFERENCE, timeout_s=30, start_method="forkserver")
    tr = None
    try:
        client = HTTPClient(server.start(), timeout_s=60)
        pids = server.worker_pids
        tr = Trainers(ck, timeout_s=3.0)
        out = tr.join(client)
        assert all(v[0] == "ok" for v in out.values()), out
        client.start_weight_update()
        # The trainers never send: worker 0 waits (bounded by timeout_s), worker 1 is killed.
        def kill():
            time.sleep(0.5)
            os.kill(pids[1], signal.SIGKILL)

        t0 = time.monotonic()
        update = {"round": 1, "version": "v1"}
        pending = in_threads({"update": lambda: client.update_weights(update), "kill": kill}, 30)
        took = time.monotonic() - t0
        kind, err = pending["update"]
        assert kind == "err" and isinstance(err, WeightSyncError) and err.status == 500
        assert f"worker 1 (pid {pids[1]}) died during update_weights" in str(err)
        assert "worker 0" in str(err) and "missing" in str(err)
        # Worker 0 names who never reported (the trainers sent nothing, worker 1 is dead)
        # and keeps the documented bound: timeout_s + REPORT_GRACE_S after update_weights.
        assert "trainer rank 0, trainer rank 1, worker 1 (rank 3) sent no report" in str(err)
        after = re.search(r"worker 0: TransferError: round 1 failed after ([0-9.]+) s", str(err))
        assert after and float(after.group(1)) <= tr.timeout_s + REPORT_GRACE_S, str(err)
        assert took < tr.timeout_s + REPORT_GRACE_S + 2.0, f"update took {took:.1f} s"
        with pytest.raises(WeightSyncError, match=r"worker 1 \(pid \d+\) died") as e:
            client.weight_versions()
        assert e.value.status == 500
    finally:
        if tr is not None:
            tr.close()
        server.stop()
    assert all(_gone(p) for p in pids)


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(60)
def test_module_entry_serves_until_terminated():
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2nkit.engine.tools.server", "--model", str(CHECKPOINT),
         "--inference", "vllm:tp=1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 40
        while not line.startswith("http://") and time.monotonic() < deadline:
            line = proc.stdout.readline().strip()
            assert line or proc.poll() is None, proc.stderr.read()
        client = HTTPClient(line, timeout_s=10)
        assert client.get_world_size() == 1
        assert client.weight_versions() == [None]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.timeout(90)
def test_server_hangups_and_stop_mid_call_leave_no_traceback(ck, capfd):
    import struct

    server = InferenceServer(CHECKPOINT, INFERENCE, timeout_s=30, start_method="forkserver")
    tr = None
    try:
        url = server.start()
        client = HTTPClient(url, timeout_s=60)
        # Saving before any session: a clear refusal, not an AttributeError text.
        status, doc = post(url + "/m2nkit/save_storage", json.dumps({"dir": "/tmp/x"}).encode())
        assert status == 400, doc
        assert doc["error"] == (
            "save_storage failed on workers [0, 1]: workers 0, 1: ValueError: no storage to "
            "save yet: it is allocated by init_weight_transfer_engine; call that first"), doc
        assert "AttributeError" not in doc["error"]

        # A client that hangs up mid-call: update_weights waits for trainers that never
        # send (about timeout_s), while the client has already reset its connection.
        tr = Trainers(ck, timeout_s=2.0)
        assert all(v[0] == "ok" for v in tr.join(client).values())
        client.start_weight_update()
        host, port = url[len("http://"):].split(":")
        body = json.dumps({"update_info": {"round": 1, "version": "v1"}}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
            time.sleep(0.3)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        # The server finished the call (the round failed: nobody sent) and answered nobody.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:
                assert client.weight_versions() == [None, None]
                break
            except WeightSyncError as e:                     # busy with the call: 503 or wait
                assert e.status == 503, e
        else:
            raise AssertionError("the server stayed busy")

        # stop() while a call is in flight: workers blocked in a rendezvous nobody hosts.
        lonely = Trainers(ck, timeout_s=20.0)
        result = {}

        def call():
            try:
                client.init_weight_transfer_engine(lonely.payload)
                result["ok"] = True
            except WeightSyncError as e:
                result["err"] = e

        th = threading.Thread(target=call, daemon=True)
        th.start()
        time.sleep(1.0)
        server.stop()
        th.join(30)
        assert not th.is_alive(), "the call hung after stop()"
        err = result.get("err")
        assert err is not None, result
        assert err.status in (503, None), err             # "stopping", or the socket closed
        if err.status == 503:
            assert "the server stopped during the call" in str(err), err
    finally:
        if tr is not None:
            tr.close()
        server.stop()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "BrokenPipeError" not in captured.err, captured.err
    assert "ConnectionResetError" not in captured.err, captured.err
