"""Real vLLM workers on CPU for ``m2nkit demo --receiver vllm`` and the plugin's tests.

Each worker is a separate process holding vLLM's own model class for the
checkpoint, built as that tp/dp/ep rank would build it and loaded by vLLM's
``DefaultModelLoader`` (``m2nkit.engine.tools.vllm_workers.build_cpu_worker``),
with m2nkit's engine created the way a vLLM worker creates it: through
``WeightTransferEngineFactory.create_engine`` with backend ``"m2nkit"``. The
workers receive straight into those live parameters; afterwards each worker
loads the round's checkpoint into a fresh model of the same class with
vLLM's loader and compares every parameter bit for bit (and checks that no
parameter moved in memory).

Processes: importing vLLM costs 10-20 s here, so one *host* process
(started with ``start_method``) imports it once and forks the workers of
each layout from itself (milliseconds). The host also plays vLLM's engine
core: it serves the four weight-transfer calls to any number of clients
over ``multiprocessing.connection`` (127.0.0.1, an authkey) and fans each
call out to every worker at once, as vLLM's ``collective_rpc`` does.
:class:`WorkersClient` is a picklable ``VLLMWeightSyncClient`` for it, so
trainer rank 0 can drive the workers from its own process.

The trainers (:func:`trainer_main`) hold one checkpoint directory per round
(each rank reads only its own box, ``checkpoint_manifest``) and send with
``M2NTrainerEngine``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any, Callable, Sequence

from m2nkit.engine.clients import WeightSyncError, error_status

__all__ = ["VLLMWorkers", "WorkersClient", "serve_host", "round_source", "trainer_main",
           "destination_for", "run_vllm_demo",
           "vllm_available", "write_shifted_checkpoint"]


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it:
    ``adapters.vllm.builder.vllm_importable``)."""
    from m2nkit.adapters.vllm.builder import vllm_importable

    return vllm_importable()


# --------------------------------------------------------------------------
# worker processes (forked from the host)


def _worker_main(conn, checkpoint: str, spec_text: str, worker: int,
                 layout: str = "auto", quantization: str | None = None,
                 fp8_kernel: str = "triton") -> None:
    """One vLLM worker: build, load, create the engine, then serve ``(cmd, arg)`` until told to stop.

    ``layout``: the plugin's ``M2NKIT_LAYOUT`` in this worker (``auto``, ``tables``, ``traced``).
    ``quantization``: vLLM's ``--quantization`` for the served model and the fresh loads
    ``verify`` compares with (``build_cpu_worker``); ``fp8_kernel``: the block fp8
    kernels vLLM picks for both (``vllm_workers.cpu_quantized_kernels``).
    """
    import torch

    from m2nkit.engine.plugins.vllm import LAYOUT_ENV

    os.environ[LAYOUT_ENV] = layout

    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.engine.tools.vllm_workers import (
        build_cpu_worker,
        create_engine,
        fresh_load,
        parameters_of,
        set_current_config,
    )
    from m2nkit.engine.in_process import bitwise_equal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    spec = parse_inference_spec(spec_text)
    try:
        t0 = time.perf_counter()
        model, vllm_config = build_cpu_worker(checkpoint, spec, worker,
                                              quantization=quantization,
                                              fp8_kernel=fp8_kernel)
        engine = create_engine(model, vllm_config, "cpu")
        before = {n: t.clone() for n, t in parameters_of(model).items()}
        addresses = {n: t.data_ptr() for n, t in parameters_of(model).items()}
        state = {"model": model, "vllm_config": vllm_config, "engine": engine, "spec": spec,
                 "worker": worker}
        conn.send((True, {"seconds": time.perf_counter() - t0, "pid": os.getpid(),
                          "engine": type(engine).__module__ + "." + type(engine).__name__,
                          "model": type(model).__name__, "parameters": len(before)}))
    except BaseException as e:  # noqa: BLE001 - reported to the host
        conn.send((False, (500, f"worker {worker} failed to start: {type(e).__name__}: {e}")))
        return

    def verify(ckpt: str) -> dict:
        live = parameters_of(model)
        ref = fresh_load(ckpt, spec, worker, quantization, fp8_kernel)
        return {
            "compared": len(ref),
            "names_only_live": sorted(set(live) - set(ref)),
            "names_only_fresh": sorted(set(ref) - set(live)),
            "differ": sorted(n for n in ref if n in live and not bitwise_equal(live[n], ref[n])),
            "unchanged_since_start": sorted(n for n, t in live.items()
                                            if n in before and bitwise_equal(t, before[n])),
            "moved": sorted(n for n, t in live.items() if addresses.get(n) != t.data_ptr()),
            "version": engine.weight_version,
        }

    with set_current_config(vllm_config):
        calls: dict[str, Callable[[Any], Any]] = {
            "init_weight_transfer_engine":
                lambda arg: engine.init_transfer_engine(engine.parse_init_info(arg)),
            "start_weight_update": lambda arg: engine.start_weight_update(),
            "update_weights": lambda arg: engine.update_weights(arg),
            "finish_weight_update": lambda arg: engine.finish_weight_update(),
            "shutdown_weight_transfer_engine": lambda arg: engine.shutdown(),
            "weight_version": lambda arg: engine.weight_version,
            "verify": verify,
            "collective_rpc": lambda arg: arg[0](state, *arg[1]),
        }
        while True:
            try:
                cmd, arg = conn.recv()
            except EOFError:
                return
            if cmd == "stop":
                engine.shutdown()
                conn.send((True, None))
                return
            try:
                conn.send((True, calls[cmd](arg)))
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                traceback.clear_frames(e.__traceback__)
                conn.send((False, (error_status(e), f"{type(e).__name__}: {e}")))


# --------------------------------------------------------------------------
# the host process


class WorkerHost:
    """Inside the host: the forked workers of the current layout, one call at a time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.workers: list[tuple[Any, Any]] = []   # (process, connection)

    def start_workers(self, checkpoint: str, spec_text: str, layout: str = "auto",
                      quantization: str | None = None,
                      fp8_kernel: str = "triton") -> list[dict]:
        from m2nkit.adapters.vllm import parse_inference_spec

        self.stop_workers()
        ctx = mp.get_context("fork")
        n = parse_inference_spec(spec_text).num_workers
        for w in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker_main,
                            args=(theirs, checkpoint, spec_text, w, layout, quantization,
                                  fp8_kernel),
                            name=f"m2nkit-vllm-worker-{w}", daemon=True)
            p.start()
            theirs.close()
            self.workers.append((p, mine))
        return self._gather("start", self.timeout_s)

    def _gather(self, what: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, Any] = {}
        errors: dict[int, tuple[int, str]] = {}
        pending = dict(enumerate(self.workers))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                for w in pending:
                    errors[w] = (500, f"did not answer {what} within {timeout_s:g} s")
                break
            ready = mp_wait([c for _, c in pending.values()]
                            + [p.sentinel for p, _ in pending.values()], left)
            for w, (p, c) in list(pending.items()):
                if c in ready or c.poll():
                    try:
                        ok, value = c.recv()
                    except EOFError:
                        ok, value = False, (500, f"died (exit code {p.exitcode})")
                    (replies if ok else errors)[w] = value
                    del pending[w]
                elif p.sentinel in ready:
                    p.join(1)
                    errors[w] = (500, f"died during {what} (exit code {p.exitcode})")
                    del pending[w]
        if errors:
            status = 400 if all(s == 400 for s, _ in errors.values()) else 500
            detail = "; ".join(f"worker {w}: {m}" for w, (_, m) in sorted(errors.items()))
            raise WeightSyncError(f"{what} failed on workers {sorted(errors)}: {detail}",
                                  status=status)
        return [replies[w] for w in range(len(self.workers))]

    def call(self, cmd: str, arg: Any, timeout_s: float | None) -> list[Any]:
        with self.lock:
            if not self.workers:
                raise WeightSyncError(f"{cmd}: no workers are running (start_workers first)",
                                      status=400)
            for _, c in self.workers:
                c.send((cmd, arg))
            return self._gather(cmd, timeout_s or self.timeout_s)

    def stop_workers(self) -> None:
        workers, self.workers = self.workers, []
        for p, c in workers:
            try:
                c.send(("stop", None))
            except (OSError, ValueError):
                pass
        for p, c in workers:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
            c.close()


def quiet_vllm_loggers() -> None:
    """vLLM's and torch's notes about this CPU platform, off in the host and its workers.

    Building a vLLM model on CPU logs, in every worker, what this platform lacks
    ("Failed to import from vllm._C", "Triton is not installed", "Model Runner V2
    requires Triton", "Reset SSM cache type ...", torch's "Triton not available").
    None of it concerns the transfer, and the demo's screen is m2nkit's lines. Used
    this way (no engine, no ``vllm serve``) vLLM 0.33 installs no handler of its
    own, so ``VLLM_LOGGING_LEVEL`` alone does not reach these loggers: Python's last
    resort handler prints their warnings bare. The host is the one process that
    imports vLLM and forks every worker, so their levels are set here, once: the
    ``VLLM_LOGGING_LEVEL`` the user set (ERROR by default, see :func:`_host_main`).
    """
    import logging

    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper())
    logging.getLogger("vllm").setLevel(level if isinstance(level, int) else logging.ERROR)
    logging.getLogger("torch._library").setLevel(logging.ERROR)
    # Logged at ERROR on import when triton_kernels is installed without a Triton this
    # platform runs; the CPU MoE path never uses those kernels.
    logging.getLogger("vllm.model_executor.layers.fused_moe.config").setLevel(logging.CRITICAL)


def serve_host(listener: Listener, host: "WorkerHost", *, name: str,
               extra: Callable[[str, Any], tuple[bool, Any]] | None = None,
               answer_unreadable: bool = False) -> None:
    """Answer ``(cmd, arg, timeout)`` requests on ``listener``, one thread per client.

    ``start_workers``/``stop_workers`` go to ``host``'s methods, anything
    ``extra`` claims (it returns ``(True, value)``; ``(False, None)`` for
    not mine) to it, the rest to ``host.call``. Each answer is ``(True,
    value)``, or ``(False, (status, message))``: a ``WeightSyncError``'s own
    status, 500 for any other error. With ``answer_unreadable`` a request
    that cannot be unpickled is answered 400 instead of ending the client's
    thread. Returns once the accepting thread (``name``) runs."""

    def serve(client) -> None:
        with client:
            while True:
                try:
                    cmd, arg, timeout = client.recv()
                except (EOFError, OSError):
                    return
                except Exception as e:  # noqa: BLE001 - e.g. a function this host cannot import
                    if not answer_unreadable:
                        raise
                    client.send((False, (400, "the host cannot read the request: "
                                              f"{type(e).__name__}: {e}")))
                    continue
                try:
                    if cmd == "start_workers":
                        value = host.start_workers(*arg)
                    elif cmd == "stop_workers":
                        value = host.stop_workers()
                    else:
                        claimed, value = extra(cmd, arg) if extra else (False, None)
                        if not claimed:
                            value = host.call(cmd, arg, timeout)
                    client.send((True, value))
                except WeightSyncError as e:
                    client.send((False, (e.status, str(e))))
                except BaseException as e:  # noqa: BLE001 - reported to the client
                    client.send((False, (500, f"{type(e).__name__}: {e}")))

    def accept() -> None:
        while True:
            try:
                client = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True, name=name).start()


def _host_main(conn, authkey: bytes, timeout_s: float) -> None:
    """The host: import vLLM once (CPU platform), then serve clients until the parent says stop."""
    from m2nkit.engine.tools.server import exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # ERROR: vLLM's CPU platform warns on every model build about a GPU-only
    # cache setting ("Reset SSM cache type ..."), which says nothing here.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        torch.set_num_threads(1)
        import m2nkit.engine.tools.vllm_workers  # noqa: F401 - vLLM's import, once for every fork

        quiet_vllm_loggers()
        host = WorkerHost(timeout_s)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, listener.address))

    serve_host(listener, host, name="m2nkit-vllm-host-accept")
    try:
        conn.recv()          # "stop", or EOF when the parent goes
    except EOFError:
        pass
    host.stop_workers()
    listener.close()


class WorkersClient:
    """A ``VLLMWeightSyncClient`` for the workers of a :class:`VLLMWorkers` host.

    Picklable (address and authkey only), so trainer rank 0 can use it from
    its own process. Each call fans out to every worker and returns when all
    answered, like vLLM's ``collective_rpc``.

    Raises (every call):
        WeightSyncError: some worker raised (``status`` 400 for bad input
            or a refused plan, else 500; the message names each worker and
            its error), or the host cannot be reached (``status`` None).
    """

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout_s: float = 600.0) -> None:
        self.address, self.authkey, self.timeout_s = address, authkey, timeout_s
        self._conn = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"address": self.address, "authkey": self.authkey, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["address"], state["authkey"], state["timeout_s"])

    def request(self, cmd: str, arg: Any = None, timeout_s: float | None = None) -> Any:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = Client(self.address, authkey=self.authkey)
                self._conn.send((cmd, arg, timeout_s))
                if not self._conn.poll(timeout_s or self.timeout_s):
                    raise TimeoutError(f"no answer to {cmd} within {timeout_s or self.timeout_s:g} s")
                ok, value = self._conn.recv()
            except (OSError, EOFError, TimeoutError) as e:
                self._conn = None
                raise WeightSyncError(f"{cmd}: the vLLM worker host at {self.address} failed: {e}",
                                      status=None) from None
        if not ok:
            status, message = value
            raise WeightSyncError(message, status=status)
        return value

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.request("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.request("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.request("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.request("shutdown_weight_transfer_engine")

    def weight_versions(self) -> list[str | None]:
        return self.request("weight_version")

    def verify(self, checkpoint: str | os.PathLike) -> list[dict]:
        """Every worker against a fresh vLLM load of ``checkpoint`` (see the module docstring)."""
        return self.request("verify", str(checkpoint))

    def collective_rpc(self, fn: Callable, *args: Any) -> list[Any]:
        """``fn(state, *args)`` in every worker (``state``: model, vllm_config, engine, spec, worker).

        ``fn`` must be importable by name (a module-level function).
        """
        return self.request("collective_rpc", (fn, args))


class VLLMWorkers:
    """The host process and the client that drives it (see the module docstring).

    Use::

        with VLLMWorkers(timeout_s=120) as host:
            host.start_workers(checkpoint_v0, "vllm:tp=2,ep")   # forks 2 workers, loads v0
            ... trainers send with host.client ...
            reports = host.client.verify(checkpoint_v1)

    Args:
        timeout_s: the bound on each call (seconds), worker start included.
        start_method: how the host process starts (``multiprocessing``).
    """

    def __init__(self, timeout_s: float = 300.0, start_method: str = "spawn") -> None:
        self.timeout_s = timeout_s
        self.start_method = start_method
        self._proc = None
        self._conn = None
        self.client: WorkersClient | None = None

    def start(self) -> "VLLMWorkers":
        """Start the host (imports vLLM: seconds to tens of seconds).

        Raises:
            RuntimeError: the host did not come up within ``timeout_s`` (its error).
        """
        ctx = mp.get_context(self.start_method)
        authkey = secrets.token_bytes(16)
        mine, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_host_main, args=(theirs, authkey, self.timeout_s),
                                 name="m2nkit-vllm-host", daemon=False)
        # Not a daemon: it forks the workers. It exits with this process anyway
        # (exit_with_parent), and stop() joins or kills it.
        self._proc.start()
        theirs.close()
        self._conn = mine
        if not mine.poll(self.timeout_s):
            self.stop()
            raise RuntimeError(f"the vLLM worker host did not start within {self.timeout_s:g} s")
        try:
            ok, value = mine.recv()
        except EOFError:
            ok, value = False, f"it exited with code {self._proc.exitcode}"
        if not ok:
            self.stop()
            raise RuntimeError(f"the vLLM worker host failed to start: {value}")
        self.client = WorkersClient(tuple(value), authkey, self.timeout_s)
        return self

    def start_workers(self, checkpoint: str | os.PathLike, spec: str,
                      layout: str = "auto", quantization: str | None = None,
                      fp8_kernel: str = "triton") -> list[dict]:
        """Fork one worker per ``spec`` worker (stopping earlier ones); each loads ``checkpoint``.

        ``layout``: each worker's ``M2NKIT_LAYOUT`` (the plugin's destination layout).
        ``quantization``: vLLM's ``--quantization`` (``"fp8_per_block"``; ``None``:
        the checkpoint's own quantization config, if any). ``fp8_kernel``: the
        block fp8 kernels vLLM picks on the workers and their fresh loads
        (``vllm_workers.cpu_quantized_kernels``: ``"triton"``, ``"deep_gemm_e8m0"``).
        Returns per worker ``{"seconds", "pid", "engine", "model", "parameters"}``.
        """
        return self.client.request("start_workers",
                                   (str(Path(checkpoint).resolve()), str(spec), layout,
                                    quantization, fp8_kernel))

    def stop_workers(self) -> None:
        self.client.request("stop_workers")

    def stop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.send("stop")
            except (OSError, ValueError):
                pass
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if conn is not None:
            conn.close()

    def __enter__(self) -> "VLLMWorkers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------
# trainers


def round_source(checkpoints: Sequence[str | os.PathLike], trainer_spec: str, rank: int,
                 state: dict):
    """This rank's source that sends checkpoint ``state["round"]`` of ``checkpoints`` (1-based).

    Every checkpoint must hold the same wire tensors (names, shapes, dtypes);
    each provider reads only this rank's box of the round's checkpoint.

    Raises:
        ValueError: the checkpoints' wire tensors differ (names the first).
    """
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest, read_checkpoint
    from m2nkit.manifest import M2NManifestEntry, ManifestM2NWeightSource

    manifests = [checkpoint_manifest(read_checkpoint(c), trainer_spec, rank) for c in checkpoints]
    first = manifests[0].entries
    for c, m in zip(checkpoints[1:], manifests[1:]):
        for a, b in zip(first, m.entries):
            if (a.name, a.dtype, tuple(a.global_shape)) != (b.name, b.dtype, tuple(b.global_shape)):
                raise ValueError(f"checkpoint {c}: wire tensor '{b.name}' differs from "
                                 f"'{a.name}' of {checkpoints[0]}")

    def provider(i: int):
        return lambda: manifests[state["round"] - 1].entries[i].local_tensor()

    entries = [M2NManifestEntry(e.name, e.dtype, e.global_shape, e.source_layout, provider(i))
               for i, e in enumerate(first)]
    return ManifestM2NWeightSource(entries, rank=rank)


def destination_for(config, inference: str, layout: str = "auto"):
    """The trainers' ``DestinationBuilder`` for ``inference``: ``sglang_destination`` for an
    ``sglang:`` spec (SGLang's tables; ``layout`` does not apply), else ``vllm_destination``."""
    from m2nkit.adapters.sglang.spec import is_sglang_spec

    if is_sglang_spec(inference):
        from m2nkit.adapters.sglang.destination import sglang_destination

        return sglang_destination(config, inference)
    from m2nkit.adapters.vllm import vllm_destination

    return vllm_destination(config, inference, layout)


def trainer_main(rank: int, num_ranks: int, checkpoints: Sequence[str], trainer: str,
                 inference: str, client, port: int, timeout_s: float, results,
                 layout: str = "auto", transport: str = "torch_p2p", checked=None) -> None:
    """One trainer process: ``trainer_init``, one ``send_weights(f"v{k}")`` per checkpoint, report.

    Puts ``("init", rank, seconds, None)``, ``("round", rank, k, (bytes, seconds))``
    per round and finally ``("done", rank, None, None)`` on ``results``; a
    failure puts ``("error", rank, "Type: message", traceback)`` instead.
    ``client`` (rank 0 only) drives the workers, e.g. :class:`WorkersClient`.
    ``layout``: the trainers' destination layout (``vllm_destination``'s);
    ``transport``: the session's (``"ipc"``: colocated, docs/colocated.md).
    ``checked``: a semaphore the driver releases once per trainer rank after
    it has checked a round; before round ``k > 1`` each rank acquires it, so
    no round starts while the workers' previous one is being compared
    (``None``: rounds follow one another at once).

    Raises (reported as ``"error"``): TimeoutError: the driver did not check
    round ``k - 1`` within ``4 * timeout_s``.
    """
    from m2nkit.engine.tools.server import exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    try:
        import torch
        from transformers.utils import logging as hf_logging

        from m2nkit.adapters.hf_checkpoint import read_checkpoint
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        torch.set_num_threads(1)
        hf_logging.set_verbosity_error()
        state = {"round": 1}
        source = round_source(checkpoints, trainer, rank, state)
        config = read_checkpoint(checkpoints[0]).config
        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=num_ranks,
                                  destination=destination_for(config, inference, layout),
                                  master_port=port, timeout_s=timeout_s, transport=transport)
        t0 = time.perf_counter()
        engine = M2NTrainerEngine.trainer_init(info, client=client if rank == 0 else None,
                                               source=source)
        results.put(("init", rank, time.perf_counter() - t0, None))
        for k in range(1, len(checkpoints) + 1):
            if k > 1 and checked is not None and not checked.acquire(timeout=4 * timeout_s):
                raise TimeoutError(f"trainer rank {rank}: round {k - 1} was not checked by the "
                                   f"driver within {4 * timeout_s:.0f} s")
            state["round"] = k
            stats = engine.send_weights(f"v{k}")
            results.put(("round", rank, k, (stats.bytes_sent, stats.seconds)))
        engine.shutdown()
        results.put(("done", rank, None, None))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


def fsdp2_trainer_main(rank: int, num_ranks: int, checkpoint: str, trainer: str, inference: str,
                       client, port: int, dist_port: int, timeout_s: float, results) -> None:
    """One FSDP2 trainer process: ``checkpoint`` as an FSDP2 trainer holds it, one round ``v1``.

    The model is built by transformers and sharded by ``fully_shard`` over the
    ``trainer`` spec's mesh (``fsdp2:dp_shard=2``: fp32 masters, bf16
    ``MixedPrecisionPolicy``; ``demo.build_fsdp2_model``) on a gloo default
    group at ``dist_port``, and sent through ``fsdp2_source`` with
    ``send_weights("v1")``. Reports on ``results`` as :func:`trainer_main` does.
    """
    from m2nkit.engine.tools.server import exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        from m2nkit.adapters.fsdp2 import fsdp2_source
        from m2nkit.adapters.trainer_spec import parse_trainer_spec
        from m2nkit.engine.tools.demo import build_fsdp2_model
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        torch.set_num_threads(1)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                                world_size=num_ranks, timeout=timedelta(seconds=timeout_s))
        try:
            model, _ = build_fsdp2_model(checkpoint, parse_trainer_spec(trainer))
            config = AutoConfig.from_pretrained(checkpoint)
            info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=num_ranks,
                                      destination=destination_for(config, inference),
                                      master_port=port, timeout_s=timeout_s)
            engine = M2NTrainerEngine.trainer_init(info, client=client if rank == 0 else None,
                                                   source=fsdp2_source(model))
            stats = engine.send_weights("v1")
            results.put(("round", rank, 1, (stats.bytes_sent, stats.seconds)))
            engine.shutdown()
        finally:
            dist.destroy_process_group()
        results.put(("done", rank, None, None))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


# --------------------------------------------------------------------------
# the demo


def write_shifted_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, round_index: int) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with every floating tensor shifted for ``round_index``.

    File by file (``config.json``, the index, each safetensors file with its
    metadata), each tensor through ``m2nkit.engine.tools.demo.shift``: the
    same tensor names vLLM's loader reads, new values.
    """
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from m2nkit.engine.tools.demo import shift

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as h:
                meta = h.metadata()
                tensors = {k: shift(h.get_tensor(k), round_index).contiguous() for k in h.keys()}
            save_file(tensors, str(dst / f.name), metadata=meta)
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def run_vllm_demo(model: str, trainer: str, inference: str, *, rounds: int = 2,
                  timeout_s: float = 60.0, workdir: str | None = None, log=print,
                  start_method: str = "spawn", sglang_workers=None):
    """``m2nkit demo --receiver vllm`` or ``--receiver sglang``: trainers -> real workers,
    verified per round.

    ``inference`` picks the engine: ``vllm:...`` runs vLLM workers
    (:class:`VLLMWorkers`), ``sglang:tp=T[,ep]`` SGLang TP workers under
    ``.venv-sglang`` (``sglang_workers.SGLangWorkers``: SGLang's model class,
    parallel state and weight-update path, m2nkit's custom weight loader; each
    round is checked against SGLang's own ``load_weights`` of the round's
    checkpoint, and SGLang's ``weight_version`` must be the round's), made by
    ``sglang_workers(timeout_s=...)``, which the CLI passes
    (``sglang_workers.SGLangWorkers``; taken as an argument because that module
    builds on this one's ``WorkerHost`` and ``WorkersClient``).

    The workers load the checkpoint (v0) with vLLM; round ``k`` sends the
    checkpoint shifted by ``0.5*k`` (``demo.shift``), written to disk first;
    after each round every worker must hold exactly what vLLM's loader
    makes of that file in a fresh model, in the same memory, at version ``vk``.

    Returns a ``m2nkit.engine.tools.demo.DemoResult`` (one ``DemoRound`` per
    verified round; no baseline), which the CLI prints as for the stand-in.

    Raises:
        ValueError: a bad model or spec, an ``fsdp2:`` trainer (use
            ``--receiver stand-in``), a plan with problems.
        RuntimeError: a process failed, or a worker differs after a round
            (names the worker and the parameters).
    """
    import queue
    import tempfile

    from m2nkit.adapters.hf_checkpoint import checkpoint_metas, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.sglang.spec import is_sglang_spec, parse_sglang_spec
    from m2nkit.adapters.vllm import parse_inference_spec
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.tools.demo import MAX_DEMO_PROCESSES, DemoResult, demo_checkpoint
    from m2nkit.engine.tools.procs import free_port, start_ranks, stop_processes
    from m2nkit.manifest.serialize import manifest_to_json

    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    sglang = is_sglang_spec(inference)
    engine = "SGLang" if sglang else "vLLM"
    tspec = parse_trainer_spec(trainer)
    ispec = parse_sglang_spec(inference) if sglang else parse_inference_spec(inference)
    if tspec.kind == "fsdp2":
        raise ValueError(f"--receiver {engine.lower()} runs checkpoint trainers (replicated:N, fsdp:N, "
                         "hsdp:R,S); fsdp2: trainers run with --receiver stand-in")
    T, N = tspec.num_ranks, ispec.num_workers
    if T + N > MAX_DEMO_PROCESSES:
        raise ValueError(f"{trainer} -> {inference} needs {T + N} processes; the demo runs at most "
                         f"{MAX_DEMO_PROCESSES} on one machine")
    tmp = tempfile.TemporaryDirectory(prefix="m2nkit-demo-vllm-") if workdir is None else None
    work = Path(workdir or tmp.name)
    try:
        v0 = demo_checkpoint(model, work / "v0", log)
        ckpt = read_checkpoint(v0)
        if not ckpt.has_data:
            raise ValueError(f"--model {v0} has only a config; the demo needs tensor data")
        plan, _ = plan_from_manifest(manifest_to_json(checkpoint_metas(ckpt, tspec), T),
                                     destination_for(ckpt.config, str(ispec)))
        if plan.problems:
            raise ValueError("the plan has problems: " + "; ".join(map(str, plan.problems[:5])))
        versions = [write_shifted_checkpoint(v0, work / f"v{k}", k) for k in range(1, rounds + 1)]
        log(f"model {ckpt.architecture}; {T} trainer ranks ({tspec}) -> {N} {engine} workers "
            f"({ispec}); {len(plan.wires)} wire tensors; rounds send v1..v{rounds} (+0.5 per round)")
        log(f"starting the {engine} host process (imports {engine} once; 10-60 s on a busy "
            "machine)")
        out = DemoResult(str(model), str(tspec), str(ispec), plan.nbytes_min)
        if sglang:
            if sglang_workers is None:
                raise ValueError("an sglang: demo needs sglang_workers "
                                 "(m2nkit.engine.tools.sglang_workers.SGLangWorkers)")
            workers = sglang_workers(timeout_s=max(4 * timeout_s, 300.0))
        else:
            workers = VLLMWorkers(timeout_s=max(4 * timeout_s, 120.0), start_method=start_method)
        with workers as host:
            started = host.start_workers(v0, str(ispec))
            if sglang:
                log(f"{N} SGLang TP workers ({started[0]['model']}, SGLang's parallel state over "
                    "gloo) loaded v0 with SGLang's load_weights; rounds go through SGLang's "
                    "update_weights_from_tensor into m2nkit's custom weight loader")
            else:
                log(f"{N} vLLM workers ({started[0]['model']}, engine {started[0]['engine']} "
                    "from vLLM's WeightTransferEngineFactory) loaded v0 with DefaultModelLoader")
            ctx = mp.get_context(start_method)
            results = ctx.Queue()
            # round k + 1 starts only after round k's workers were compared
            checked = ctx.Semaphore(0)
            port = free_port()
            procs: list = []
            per_round: dict[int, list] = {}
            done = 0
            try:
                start_ranks(trainer_main, lambda r: (
                    r, T, [str(v) for v in versions], str(tspec), str(ispec),
                    host.client if r == 0 else None, port, timeout_s, results, "auto",
                    "torch_p2p", checked),
                    T, ctx=ctx, name="m2nkit-trainer-{rank}", started=procs)
                deadline = time.monotonic() + (rounds + 2) * 4 * timeout_s + 60
                while done < T:
                    try:
                        kind, rank, a, b = results.get(timeout=max(0.1, deadline - time.monotonic()))
                    except queue.Empty:
                        raise RuntimeError("the trainers did not finish in time") from None
                    if kind == "error":
                        raise RuntimeError(f"trainer rank {rank} failed: {a}")
                    if kind == "init" and rank == 0:
                        log(f"trainers joined the workers in {a:.1f} s (plan agreed)")
                    if kind == "round":
                        per_round.setdefault(a, {})[rank] = b
                        if len(per_round[a]) == T:
                            stats = [per_round[a][r] for r in range(T)]
                            out.rounds.append(_check_round(host.client, a, versions[a - 1],
                                                           stats, log, engine))
                            for _ in range(T):
                                checked.release()
                    if kind == "done":
                        done += 1
            finally:
                stop_processes(procs, grace_s=5.0)
        return out
    finally:
        if tmp is not None:
            tmp.cleanup()


def _check_round(client: WorkersClient, k: int, checkpoint: Path, stats: list, log,
                 engine: str = "vLLM"):
    from m2nkit.engine.tools.demo import DemoRound

    reports = client.verify(checkpoint)
    bad = []
    for w, r in enumerate(reports):
        what = [f"{key} {r[key][:3]}" for key in ("names_only_live", "names_only_fresh", "differ",
                                                   "moved") if r[key]]
        if r["version"] != f"v{k}":
            what.append(f"version {r['version']!r}, expected 'v{k}'")
        if r.get("sglang_version", f"v{k}") != f"v{k}":
            what.append(f"SGLang's weight_version {r['sglang_version']!r}, expected 'v{k}'")
        if what:
            bad.append(f"worker {w}: " + "; ".join(what))
    if bad:
        raise RuntimeError(f"round {k}: " + " | ".join(bad))
    nbytes = sum(b for b, _ in stats)
    seconds = max(s for _, s in stats)
    log(f"round {k}: {nbytes / 1e6:.2f} MB in {seconds:.2f} s; every parameter of all "
        f"{len(reports)} workers equals a fresh {engine} load of v{k} ({reports[0]['compared']} "
        "parameters each), same memory, version committed")
    return DemoRound(k, [b for b, _ in stats], seconds, len(reports))
