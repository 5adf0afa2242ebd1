"""vLLM's own ``HTTPVLLMWeightSyncClient`` drives m2nkit's trainer engine (vLLM 0.33).

Rank 0 of m2nkit's ``M2NTrainerEngine`` gets vLLM's client
(``vllm.distributed.weight_transfer.clients``, ``requests`` underneath) in
place of m2nkit's ``HTTPClient``; the other side is m2nkit's stand-in server
(``m2nkit.engine.tools.server``: worker processes behind vLLM's routes of
``vllm/entrypoints/rl/online/api_router.py``). What vLLM's client sends,
read from its source: ``POST /init_weight_transfer_engine {"init_info"}``,
``POST /start_weight_update`` and ``POST /shutdown_weight_transfer_engine``
with no body, ``POST /update_weights {"update_info"}``, ``POST
/finish_weight_update {"weight_version"}`` (no body without a version);
errors are ``requests.HTTPError`` from ``raise_for_status`` (status line
only). The server lacked ``/shutdown_weight_transfer_engine``; the rest was
already vLLM's shape.

Two rounds with different weights (v1 = the checkpoint, v2 = 2x), every
worker bit-exact against ``reference_load`` of the scaled checkpoint and
committed; a refusal (trainers planned for another layout) named on every
trainer rank even though vLLM's client drops the server's error text; and
``shutdown_weight_transfer_engine`` ends the session on the workers.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from _procs import ensure_forkserver, in_threads
from m2nkit.engine.tools.procs import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CHECKPOINT = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3-moe"
TRAINER, INFERENCE, T, N = "fsdp:2", "vllm:tp=2", 2, 2


def test_vllm_http_client_drives_full_rounds(tmp_path):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from m2nkit.adapters.hf_checkpoint import (checkpoint_manifest, full_checkpoint_tensors,
                                               read_checkpoint)
    from m2nkit.adapters.vllm import reference_load, vllm_destination
    from m2nkit.engine.in_process import bitwise_equal
    from m2nkit.engine.tools.server import InferenceServer
    from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo
    from m2nkit.engine.control import PlanMismatchError
    from m2nkit.manifest import ManifestM2NWeightSource

    ensure_forkserver()
    ck = read_checkpoint(CHECKPOINT)
    full = full_checkpoint_tensors(ck)
    scale = {"now": 1.0}

    def source(r):
        base = checkpoint_manifest(ck, TRAINER, r)

        class Scaled(ManifestM2NWeightSource):
            def iter_local(self):
                for name, t in base.iter_local():
                    yield name, t * scale["now"]
        return Scaled(list(base.entries), rank=r)

    with InferenceServer(CHECKPOINT, INFERENCE, timeout_s=30,
                         start_method="forkserver") as server:
        client = HTTPVLLMWeightSyncClient(server.url, timeout=30)

        def engines(inference: str) -> dict:
            port = free_port()

            def init(r):
                info = M2NTrainerInitInfo(rank=r, num_trainer_ranks=T,
                                          destination=vllm_destination(ck.config, inference),
                                          master_port=port, timeout_s=20.0,
                                          bucket_bytes=16 << 10)
                return M2NTrainerEngine.trainer_init(info, client=client if r == 0 else None,
                                                     source=source(r))
            return in_threads({r: (lambda r=r: init(r)) for r in range(T)}, 40,
                              what="a trainer thread")

        def check_workers(version: str, factor: float) -> None:
            assert server.weight_versions() == [version] * N
            ref_full = {k: v * factor for k, v in full.items()}
            for w in range(N):
                got = server.storage(w, tmp_path / version)
                ref = reference_load(ck.config, ref_full, INFERENCE, w)
                assert got and set(got) <= set(ref)
                bad = [k for k in got if not bitwise_equal(got[k], ref[k])]
                assert not bad, f"worker {w} differs from reference_load in {bad}"

        # A refusal: the trainers planned for another layout. vLLM's client
        # raises requests.HTTPError (status line only), yet every trainer rank
        # names the worker's own reason, at once.
        t0 = time.monotonic()
        out = engines("vllm:tp=2,ep")
        assert time.monotonic() - t0 < 15
        for r in range(T):
            kind, e = out[r]
            assert kind == "err" and isinstance(e, PlanMismatchError), out[r]
            assert "refused the session" in str(e), e
            assert ("worker 0: init payload field 'inference' is 'vllm:tp=2,dp=1,ep' but this "
                    "worker serves 'vllm:tp=2,dp=1'") in str(e), e
        assert server.weight_versions() == [None, None]

        # Two full rounds, driven through vLLM's client by rank 0.
        out = engines(INFERENCE)
        assert all(kind == "ok" for kind, _ in out.values()), out
        eng = {r: out[r][1] for r in range(T)}
        try:
            for version, factor in (("v1", 1.0), ("v2", 2.0)):
                scale["now"] = factor
                sent = in_threads({r: (lambda r=r: eng[r].send_weights(version))
                                   for r in range(T)}, 40, what="a trainer thread")
                assert all(kind == "ok" for kind, _ in sent.values()), sent
                assert sum(s.bytes_sent for _, s in sent.values()) == eng[0].plan.nbytes_min
                check_workers(version, factor)
        finally:
            for e in eng.values():
                e.shutdown()

        # vLLM's shutdown route ends the session on every worker: a round
        # started after it is refused (HTTP 400) and the version stays.
        client.shutdown_weight_transfer_engine()
        import requests

        with pytest.raises(requests.HTTPError) as e:
            client.start_weight_update()
        assert e.value.response.status_code == 400
        assert "before init_transfer_engine" in e.value.response.json()["error"]
        assert server.weight_versions() == ["v2", "v2"]
        assert all(not torch.isnan(t).any() for t in server.storage(0, tmp_path / "end").values())
