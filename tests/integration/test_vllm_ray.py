"""vLLM's own ``RayVLLMWeightSyncClient`` drives an m2nkit round into vLLM workers in Ray actors.

The way verl, OpenRLHF and NeMo-RL orchestrate vLLM: each data-parallel
replica of vLLM is an ``LLM`` in a Ray actor, and the trainer holds their
handles. vLLM 0.33's ``RayVLLMWeightSyncClient(handles)``
(``vllm/distributed/weight_transfer/clients.py``) calls, on every handle and
waiting for all, ``init_weight_transfer_engine.remote(WeightTransferInitRequest)``,
``start_weight_update.remote()``, ``update_weights.remote(WeightTransferUpdateRequest)``,
``finish_weight_update.remote()`` and, with a version,
``update_weight_version.remote(v)``. ``LLM`` implements them in
``RLOfflineMixin`` (``vllm/entrypoints/rl/offline.py``) as
``llm_engine.collective_rpc(...)`` to each worker's same-named ``Worker``
method (``vllm/v1/worker/gpu_worker.py``), which calls the engine vLLM's
factory built: for backend ``"m2nkit"``, ``M2NVLLMEngine``. m2nkit needs
nothing Ray-specific for this; the test shows that the path works end to end.

A real ``LLM`` cannot be the target on CPU (vLLM's CPU platform repacks
linear weights after loading, docs/vllm_plugin.md), so each actor here is
``LLM`` minus generation, with vLLM's own code on both sides of the
collective_rpc: the actor's RL methods are ``RLOfflineMixin``'s (subclassed),
its engine core runs each ``collective_rpc`` on the worker in-process (as
vLLM's ``UniProcExecutor`` does at tp=1), and the worker's weight-transfer
methods are ``gpu_worker.Worker``'s own functions (``start_weight_update``,
``update_weights`` with its list-payload indexing, ...), on a worker that
holds vLLM's model class for the checkpoint (``vllm_workers.build_cpu_worker``,
loaded from v0 by ``DefaultModelLoader``) and the engine from
``WeightTransferEngineFactory.create_engine`` (``vllm_workers.create_engine``).

The case: Qwen3-MoE served as two DP replicas with expert parallelism
(``vllm:tp=1,dp=2,ep``: each actor holds half of the experts), two FSDP
trainer processes holding v1 (seed 1); trainer rank 0 joins the Ray
cluster as a driver and builds the client from the actors' names. After
``send_weights("v1")`` every parameter of both actors equals vLLM's fresh
load of v1 bit for bit, in the same memory, the engine committed ``v1``,
the ``LLM`` served version is ``v1`` (set by the client's
``update_weight_version``), and the actors saw exactly the client's calls.
"""

from __future__ import annotations

import os
import queue
import sys
import time
import uuid

import pytest

from _procs import CTX, ensure_forkserver

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MODEL, TRAINER, INFERENCE = "tiny-qwen3-moe", "fsdp:2", "vllm:tp=1,dp=2,ep"
NUM_ACTORS = 2                  # dp=2 at tp=1: one LLM actor per replica
ROUND_TIMEOUT_S = 90.0          # m2nkit's round and init deadline (loaded machine)
ACTOR_START_S = 240.0           # importing vLLM in each actor: 20-40 s under load
NAMESPACE = "m2nkit-test-" + uuid.uuid4().hex[:8]


# --------------------------------------------------------------------------
# The actor: vLLM's LLM weight-sync surface over one CPU worker (runs in Ray)


class CPULLMActor:
    """One vLLM data-parallel replica at tp=1, as a Ray actor hosts ``LLM``.

    Public methods are the ones ``RayVLLMWeightSyncClient`` calls (each
    delegating to vLLM's ``RLOfflineMixin``) plus ``get_weight_version``
    and the test's probes (``info``, ``verify``, ``calls``).
    """

    def __init__(self, checkpoint: str, spec_text: str, dp_index: int) -> None:
        for key, value in (("VLLM_TARGET_DEVICE", "cpu"), ("HF_HUB_OFFLINE", "1"),
                           ("VLLM_LOGGING_LEVEL", "WARNING"), ("TOKENIZERS_PARALLELISM", "false")):
            os.environ.setdefault(key, value)      # before vLLM's first import here
        import types

        import torch

        torch.set_num_threads(1)
        from vllm.entrypoints.rl.offline import RLOfflineMixin
        from vllm.v1.worker.gpu_worker import Worker

        from m2nkit.adapters.vllm import parse_inference_spec
        from m2nkit.engine.tools.vllm_workers import (
            build_cpu_worker,
            create_engine,
            parameters_of,
            set_current_config,
        )

        self.spec = parse_inference_spec(spec_text)
        self.worker_index = dp_index * self.spec.tp          # tp rank 0 of this replica
        self.checkpoint = checkpoint
        model, vllm_config = build_cpu_worker(checkpoint, self.spec, self.worker_index)
        self.model, self.vllm_config = model, vllm_config

        class CPUWorker:
            """vLLM's ``Worker`` weight-transfer methods, on a worker holding a CPU model."""

            _check_weight_transfer_engine = Worker._check_weight_transfer_engine
            init_weight_transfer_engine = Worker.init_weight_transfer_engine
            shutdown_weight_transfer_engine = Worker.shutdown_weight_transfer_engine
            start_weight_update = Worker.start_weight_update
            _start_weight_update = Worker._start_weight_update
            update_weights = Worker.update_weights
            finish_weight_update = Worker.finish_weight_update

            def __init__(self) -> None:
                self.vllm_config = vllm_config
                self.rank = vllm_config.parallel_config.rank
                # As Worker.load_model: the engine from vLLM's factory, on the live model.
                self.weight_transfer_engine = create_engine(model, vllm_config, "cpu")
                self._weight_update_active = False
                self._weight_update_is_draft = False
                # No LoRA and no draft model here: what finish_weight_update calls of them.
                self.model_runner = types.SimpleNamespace(reset_lora_state=lambda: None)

            def get_draft_model(self):
                return None

        worker = CPUWorker()
        calls = self._calls = []

        class EngineCore:
            """``LLMEngine``'s collective_rpc and weight version, at tp=1 in-process."""

            version = None

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                calls.append(method)
                with set_current_config(vllm_config):
                    return [getattr(worker, method)(*args, **(kwargs or {}))]

            def set_weight_version(self, v):
                calls.append("set_weight_version")
                self.version = v

            def get_weight_version(self):
                return self.version

        class LLM(RLOfflineMixin):
            def __init__(self) -> None:
                self.llm_engine = EngineCore()

        self._worker, self._llm = worker, LLM()
        self._before = {n: t.clone() for n, t in parameters_of(model).items()}
        self._addresses = {n: t.data_ptr() for n, t in parameters_of(model).items()}

    # ---- what RayVLLMWeightSyncClient calls (vLLM's LLM methods)
    def init_weight_transfer_engine(self, request) -> None:
        self._llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        self._llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self._llm.start_weight_update()

    def update_weights(self, request) -> None:
        self._llm.update_weights(request)

    def finish_weight_update(self, weight_version=None) -> None:
        self._llm.finish_weight_update(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self._llm.update_weight_version(new_version)

    def get_weight_version(self):
        return self._llm.get_weight_version()

    # ---- the test's probes
    def info(self) -> dict:
        engine = self._worker.weight_transfer_engine
        return {"pid": os.getpid(), "worker": self.worker_index,
                "engine": type(engine).__module__ + "." + type(engine).__name__,
                "model": type(self.model).__name__, "parameters": len(self._before)}

    def calls(self) -> list[str]:
        return list(self._calls)

    def verify(self, checkpoint: str) -> dict:
        """This worker's live parameters against vLLM's fresh load of ``checkpoint``."""
        from m2nkit.engine.tools.vllm_workers import fresh_load, parameters_of
        from m2nkit.engine.in_process import bitwise_equal

        live = parameters_of(self.model)
        ref = fresh_load(checkpoint, self.spec, self.worker_index)
        return {
            "compared": len(ref),
            "names_only_live": sorted(set(live) - set(ref)),
            "names_only_fresh": sorted(set(ref) - set(live)),
            "differ": sorted(n for n in ref if n in live and not bitwise_equal(live[n], ref[n])),
            "unchanged_since_v0": sorted(n for n, t in live.items()
                                         if n in self._before and bitwise_equal(t, self._before[n])),
            "moved": sorted(n for n, t in live.items() if self._addresses.get(n) != t.data_ptr()),
            "engine_version": self._worker.weight_transfer_engine.weight_version,
        }


# --------------------------------------------------------------------------
# Trainers (forkserver processes); rank 0 drives the actors through Ray


def _trainer(rank, ray_address, namespace, actor_names, checkpoints, port, results) -> None:
    """Trainer ``rank`` of 2: rank 0 joins the Ray cluster and drives the actors with
    vLLM's ``RayVLLMWeightSyncClient``; both send with ``M2NTrainerEngine``."""
    from m2nkit.engine.tools.demo_vllm import trainer_main

    client = None
    if rank == 0:
        try:
            ray = _import_ray_on_loopback()
            from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

            ray.init(address=ray_address, namespace=namespace, include_dashboard=False,
                     log_to_driver=False, _node_ip_address=LOOPBACK)
            client = RayVLLMWeightSyncClient([ray.get_actor(n) for n in actor_names])
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results.put(("error", rank, f"joining Ray: {type(e).__name__}: {e}", None))
            return
    trainer_main(rank, 2, checkpoints, TRAINER, INFERENCE, client, port, ROUND_TIMEOUT_S, results)


def _run_trainers(ray_address, actor_names, checkpoints) -> dict:
    from m2nkit.engine.tools.procs import free_port

    results = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_trainer, daemon=True,
                         args=(r, ray_address, NAMESPACE, actor_names,
                               [str(c) for c in checkpoints], port, results))
             for r in range(2)]
    for p in procs:
        p.start()
    outcome: dict[int, str] = {}
    deadline = time.monotonic() + 3 * ROUND_TIMEOUT_S + 30
    try:
        while len(outcome) < 2:
            try:
                kind, rank, a, b = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"trainers hung: outcomes so far {outcome}") from None
            if kind == "done":
                outcome[rank] = "done"
            elif kind == "error":
                outcome[rank] = f"{a}\n{b or ''}"
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)
    return outcome


# --------------------------------------------------------------------------
# Fixtures


#: Test processes talk over loopback only; left alone, Ray picks the machine's
#: outward address for its node (and the trainer cannot always reach it), and
#: ``_node_ip_address="127.0.0.1"`` alone does not stop it: Ray 2.60 turns a
#: loopback address back into that outward one (``resolve_ip_for_localhost``)
#: unless its cluster mode is off, as on macOS and Windows
#: (``ray_constants.ENABLE_RAY_CLUSTER``, read when ray is imported).
LOOPBACK = "127.0.0.1"
#: Ray 2.60 also switches token authentication on for a cluster it starts when
#: it finds a token, and a driver joining by explicit address does not send it
#: ("Failed to connect to Ray cluster"): a loopback-only test cluster opts out.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def _import_ray_on_loopback():
    import os

    os.environ.update(RAY_LOOPBACK_ENV)
    import ray

    assert not ray._private.ray_constants.ENABLE_RAY_CLUSTER, \
        "ray was imported before its loopback setting"
    return ray

#: No idle Python workers started ahead of the actors: they would only add load.
RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh local Ray (never one already running here); shut down afterwards.

    Ray gives its raylet a fixed 30 s to register (``ray/_private/node.py``);
    on a machine loaded by other test runs that can pass, so a failed start
    is retried once after ``ray.shutdown()``.
    """
    ray = _import_ray_on_loopback()
    from ray import cloudpickle

    # Ray workers cannot import this test module by name: ship its actor class by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        for attempt in (1, 2):
            try:
                ctx = ray.init(address="local", num_cpus=NUM_ACTORS + 2, include_dashboard=False,
                               namespace=NAMESPACE, log_to_driver=False,
                               _node_ip_address=LOOPBACK, _system_config=RAY_SYSTEM_CONFIG)
                break
            except Exception:
                ray.shutdown()
                if attempt == 2:
                    raise
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_ray_client_drives_a_full_round_into_vllm_actors(ray_cluster, tiny_checkpoints, tmp_path):
    import ray

    from m2nkit.adapters.tiny import save_tiny_checkpoint

    ensure_forkserver()
    v0 = tiny_checkpoints(MODEL)
    v1 = save_tiny_checkpoint(MODEL, tmp_path / "v1", seed=1)

    names = [f"m2nkit-llm-dp{d}" for d in range(NUM_ACTORS)]
    Actor = ray.remote(num_cpus=1, max_restarts=0)(CPULLMActor)
    actors = [Actor.options(name=n).remote(str(v0), INFERENCE, d) for d, n in enumerate(names)]
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=ACTOR_START_S)
        # Two processes, each vLLM's own model class with m2nkit's engine from vLLM's factory.
        assert len({i["pid"] for i in infos}) == NUM_ACTORS
        assert [i["worker"] for i in infos] == [0, 1]
        assert {i["engine"] for i in infos} == {"m2nkit.engine.plugins.vllm.M2NVLLMEngine"}
        assert {i["model"] for i in infos} == {"Qwen3MoeForCausalLM"}

        outcome = _run_trainers(ray_cluster, names, [v1])
        assert outcome == {0: "done", 1: "done"}, outcome

        reports = ray.get([a.verify.remote(str(v1)) for a in actors], timeout=120)
        for w, r in enumerate(reports):
            assert r["compared"] == infos[w]["parameters"] > 0
            assert (r["names_only_live"], r["names_only_fresh"]) == ([], []), (w, r)
            assert r["differ"] == [], f"actor {w}: differs from vLLM's fresh load of v1: {r['differ']}"
            assert r["unchanged_since_v0"] == [], f"actor {w}: still v0: {r['unchanged_since_v0']}"
            assert r["moved"] == [], f"actor {w}: parameters re-allocated: {r['moved']}"
            assert r["engine_version"] == "v1"
        # The served version, as the client set it after the commit.
        assert ray.get([a.get_weight_version.remote() for a in actors], timeout=30) == ["v1", "v1"]
        # Exactly the client's round reached each worker, through vLLM's LLM and Worker code.
        assert ray.get([a.calls.remote() for a in actors], timeout=30) == [
            ["init_weight_transfer_engine", "start_weight_update", "update_weights",
             "finish_weight_update", "set_weight_version"]] * NUM_ACTORS
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
