"""An inference-side server for tests and the demo: N worker processes behind HTTP.

It stands in for a vLLM server where vLLM cannot run (no GPU): each worker
is a separate process holding one ``M2NReceiver`` and its vLLM-layout
storage, as a vLLM worker would, and a stdlib ``ThreadingHTTPServer``
exposes vLLM's weight-transfer routes (vLLM 0.33
``vllm/entrypoints/rl/online/api_router.py``; bodies in
``m2nkit.engine.clients``), fanning each call out to every worker at once.
vLLM's own ``HTTPVLLMWeightSyncClient``
(``vllm/distributed/weight_transfer/clients.py``) drives it as it drives a
vLLM server: ``tests/integration/test_vllm_http_client.py``. What it adds over vLLM is only what tests
need: ``GET /weight_version`` (every worker's committed version) and
``POST /m2nkit/save_storage`` (each worker writes its live storage to a
safetensors file, to be compared with ``reference_load``).

No call can hang: a worker that dies is noticed at once (its process
sentinel) and named in the error; one that stays silent is reported after
``timeout_s``. Late replies are matched by sequence number and dropped.

Run standalone (serves until killed, prints the URL)::

    python -m m2nkit.engine.tools.server --model examples/tiny-qwen3-moe --inference vllm:tp=2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from m2nkit.engine.clients import WeightSyncError

__all__ = ["InferenceServer", "load_model_config"]

_BAD_INPUT = 400


def load_model_config(source: str | os.PathLike):
    """The HF config of a checkpoint directory or a ``config.json`` path.

    Reads only ``config.json`` (transformers ``AutoConfig``, offline), never
    safetensors data or the model registry, so it is cheap in every process.

    Raises:
        ValueError: no readable ``config.json``, or an architecture without
            a vLLM destination table (lists the supported ones).
    """
    from m2nkit.adapters.vllm import family_for

    path = Path(source)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ValueError(f"{config_path} does not exist: the server needs the model's "
                         "config.json (a checkpoint directory or the file itself)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")    # nothing may come from the Hub
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(config_path), local_files_only=True)
    except Exception as e:
        raise ValueError(f"transformers cannot read {config_path}: {e}") from None
    family_for(config)
    return config


# --------------------------------------------------------------------------
# worker process


def exit_with_parent() -> None:
    """In a spawned child: exit as soon as the parent process is gone.

    ``daemon=True`` children are only reaped when the parent exits normally;
    this also covers a parent killed by a signal or the OOM killer, so no
    orphan keeps holding memory or ports.
    """
    import threading
    from multiprocessing.connection import wait

    parent = mp.parent_process()
    if parent is None:
        return

    def watch():
        wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="m2nkit-parent-watch").start()


def _worker_main(conn, destination: Any, worker: int) -> None:
    """One worker: build the receiver, then serve ``(seq, command, arg)`` until told to stop.

    ``destination`` (the ``DestinationBuilder``, holding the config the
    server validated) arrives pickled, which spares each worker
    transformers' model registry.
    """
    import torch

    from m2nkit.engine.clients import error_status
    from m2nkit.engine.receiver import M2NReceiver

    exit_with_parent()
    torch.set_num_threads(1)
    try:
        receiver = M2NReceiver(destination, worker)
    except Exception as e:
        conn.send((0, False, (500, f"worker {worker} failed to start: {e}")))
        return
    conn.send((0, True, os.getpid()))

    def save(path: str) -> str:
        from safetensors.torch import save_file

        if receiver.model is None:
            raise ValueError(f"worker {worker}: no storage to save yet: it is allocated by "
                             "init_weight_transfer_engine; call that first")
        # Aliases share storage, which safetensors refuses: save unique names.
        save_file({n: p.detach().contiguous() for n, p in receiver.model.named_parameters()}, path)
        return path

    def reallocate(arg) -> None:
        # What vLLM does when it rebuilds a layer: the parameter gets new storage,
        # here of another shape, so the session's plan no longer fits it.
        import torch

        name, shape = arg
        params = dict(receiver.model.named_parameters(remove_duplicate=False))
        if name not in params:
            raise ValueError(f"worker {worker}: no parameter '{name}' to re-allocate")
        p = params[name]
        p.data = torch.zeros(tuple(shape), dtype=p.dtype, device=p.device)

    commands = {
        "init_weight_transfer_engine":
            lambda a: receiver.init_transfer_engine(receiver.parse_init_info(a)),
        "start_weight_update": lambda a: receiver.start_weight_update(),
        "update_weights": lambda a: receiver.update_weights(a),
        "finish_weight_update": lambda a: receiver.finish_weight_update(a),
        "shutdown_weight_transfer_engine": lambda a: receiver.shutdown(),
        "weight_version": lambda a: receiver.weight_version,
        "save_storage": save,
        "reallocate": reallocate,
    }
    while True:
        try:
            seq, cmd, arg = conn.recv()
        except (EOFError, OSError):
            break                                   # the server went away
        if cmd == "stop":
            receiver.shutdown()
            conn.send((seq, True, None))
            break
        try:
            conn.send((seq, True, commands[cmd](arg)))
        except Exception as e:
            conn.send((seq, False, (error_status(e), f"{type(e).__name__}: {e}")))
    receiver.shutdown()
    # Skip interpreter teardown (about a second with torch loaded): the
    # group is aborted and nothing else of this process needs flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# server


class InferenceServer:
    """N receiver processes (one per vLLM worker) behind vLLM's weight-transfer routes.

    Args:
        model: checkpoint directory or ``config.json`` path (only the
            config is read).
        inference: ``"vllm:tp=T[,dp=D][,ep]"``; one worker process per
            ``dp * tp``.
        host, port: where to listen (``port=0``: any free port).
        timeout_s: how long one call waits for every worker (seconds);
            must exceed a round's receive time.
        start_timeout_s: how long worker processes may take to start.
        start_method: ``multiprocessing`` start method of the workers:
            ``"spawn"`` (default: a fresh interpreter each) or
            ``"forkserver"`` (forked from a server that may have torch
            preloaded; tests use it to start workers in milliseconds).

    ``start()`` returns the URL; ``stop()`` always terminates and joins
    every worker. Usable as a context manager. ``worker_pids`` lists the
    worker processes; ``save_storage(dir)`` / ``storage(worker, dir)`` give
    a worker's live storage for verification. Calls reach the workers one
    at a time (a ``GET /weight_version`` during a round waits for it).
    Errors answer HTTP 400 (every worker refused the input: bad payload,
    plan mismatch), 500 (transfer failure, dead or silent worker) or 404,
    with ``{"error": message naming each worker}``.

    Raises:
        ValueError: a bad inference spec or model config.
    """

    def __init__(self, model: str | os.PathLike, inference: str, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 600.0, start_timeout_s: float = 120.0,
                 start_method: str = "spawn") -> None:
        from m2nkit.adapters.vllm import parse_inference_spec, vllm_destination

        self.model = str(model)
        self.spec = parse_inference_spec(inference)
        self.inference = str(self.spec)
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method '{start_method}' is not 'spawn' or 'forkserver'")
        self.start_method = start_method
        self.model_config = load_model_config(self.model)   # fail here, not in N processes
        self.destination = vllm_destination(self.model_config, self.spec)
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    @property
    def num_workers(self) -> int:
        return self.spec.num_workers

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, in worker order."""
        return [p.pid for p in self._procs]

    # -- lifecycle --------------------------------------------------------

    def start(self) -> str:
        """Spawn the workers, wait until each is ready, start serving; returns the URL.

        Raises:
            WeightSyncError: a worker failed to start or did not within
                ``start_timeout_s`` (everything started is stopped).
        """
        ctx = mp.get_context(self.start_method)
        self._stopping = False
        try:
            for w in range(self.num_workers):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, name=f"m2nkit-worker-{w}", daemon=True,
                                args=(child, self.destination, w))
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            self._gather(0, "startup", self.start_timeout_s)
            self._httpd = _QuietHTTPServer((self.host, self.port), _handler(self))
            self._httpd.daemon_threads = True
            self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,),
                                            name="m2nkit-http", daemon=True)
            self._thread.start()
        except BaseException:
            self.stop()
            raise
        host, port = self._httpd.server_address[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self) -> None:
        """Stop serving, ask every worker to stop, then terminate/kill and join. Idempotent.

        A call in flight meanwhile answers 503 ("the server is stopping"), never a traceback.
        """
        self._stopping = True
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        for conn in self._conns:
            try:
                conn.send((-1, "stop", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self.url = [], [], None

    def __enter__(self) -> "InferenceServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- fan-out ----------------------------------------------------------

    def _describe(self, w: int) -> str:
        p = self._procs[w]
        return f"worker {w} (pid {p.pid})"

    def _gather(self, seq: int, cmd: str, timeout_s: float) -> list[Any]:
        """Wait for every worker's reply to ``seq``; raise naming each worker that failed."""
        results: dict[int, Any] = {}
        errors: dict[int, tuple[int, str]] = {}
        pending = set(range(len(self._procs)))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {}
            for w in pending:
                waitables[self._conns[w]] = w
                waitables[self._procs[w].sentinel] = w
            for ready in mp_wait(list(waitables), timeout=left):
                w = waitables[ready]
                if w not in pending:
                    continue
                conn = self._conns[w]
                try:
                    while conn.poll():
                        rseq, ok, value = conn.recv()
                        if rseq != seq:
                            continue                # a late reply to an earlier call
                        if ok:
                            results[w] = value
                        else:
                            errors[w] = value
                        pending.discard(w)
                        break
                except (EOFError, OSError):
                    self._procs[w].join(1.0)        # the pipe closed: it is dying
                if w in pending and not self._procs[w].is_alive():
                    errors[w] = (500, f"{self._describe(w)} died during {cmd} "
                                      f"(exit code {self._procs[w].exitcode})")
                    pending.discard(w)
        for w in pending:
            errors[w] = (500, f"{self._describe(w)} did not answer {cmd} within {timeout_s:g} s")
        if errors:
            status = _BAD_INPUT if all(s == _BAD_INPUT for s, _ in errors.values()) else 500
            by_message: dict[str, list[int]] = {}
            for w, (_, msg) in sorted(errors.items()):
                # Workers that failed alike are listed once ("workers 0, 1: ...").
                by_message.setdefault(msg.replace(f": worker {w}: ", ": ", 1), []).append(w)
            detail = "; ".join(
                f"worker{'s' if len(ws) > 1 else ''} {', '.join(map(str, ws))}: {msg}"
                for msg, ws in by_message.items())
            raise WeightSyncError(f"{cmd} failed on workers {sorted(errors)}: {detail}",
                                  status=status)
        return [results[w] for w in range(len(self._procs))]

    def call(self, cmd: str, arg: Any = None, *, per_worker: list | None = None,
             timeout_s: float | None = None) -> list[Any]:
        """Send ``cmd`` to every worker at once; their results in worker order.

        ``arg`` goes to every worker, or ``per_worker[w]`` to worker ``w``.

        Raises:
            WeightSyncError: any worker failed (``status`` 400 when every
                failure is bad input, else 500), died or stayed silent
                within ``timeout_s``; the message names each worker; 503
                when another call held the workers for ``timeout_s``.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._stopping:
            raise WeightSyncError(f"{cmd}: the server is stopping", status=503)
        if not self._lock.acquire(timeout=timeout_s):
            raise WeightSyncError(f"{cmd}: another call kept the workers busy for {timeout_s:g} s",
                                  status=503)
        try:
            self._seq += 1
            for w, conn in enumerate(self._conns):
                try:
                    conn.send((self._seq, cmd, arg if per_worker is None else per_worker[w]))
                except (OSError, ValueError):
                    pass                            # dead: _gather names it (sentinel)
            try:
                return self._gather(self._seq, cmd, timeout_s)
            except WeightSyncError:
                if self._stopping:
                    raise WeightSyncError(f"{cmd}: the server stopped during the call",
                                          status=503) from None
                raise
            except (OSError, ValueError, EOFError, IndexError) as e:
                if self._stopping:                  # stop() closed the pipes under us
                    raise WeightSyncError(f"{cmd}: the server stopped during the call",
                                          status=503) from None
                raise WeightSyncError(f"{cmd}: lost the workers: {e}", status=500) from None
        finally:
            self._lock.release()

    # -- verification helpers (tests, demo) --------------------------------

    def weight_versions(self) -> list[str | None]:
        """Every worker's committed version."""
        return self.call("weight_version")

    def save_storage(self, directory: str | os.PathLike) -> list[str]:
        """Each worker writes its live storage to ``directory/worker{w}.safetensors``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        paths = [str(d / f"worker{w}.safetensors") for w in range(self.num_workers)]
        return self.call("save_storage", per_worker=paths)

    def storage(self, worker: int, directory: str | os.PathLike) -> dict:
        """Worker ``worker``'s live storage ``{vLLM name: tensor}`` (unique names), via files."""
        from safetensors.torch import load_file

        return load_file(self.save_storage(directory)[worker])

    def reallocate(self, name: str, shape: tuple[int, ...]) -> None:
        """Fault injection: every worker replaces its live parameter ``name`` (zeros of ``shape``).

        Stands in for vLLM re-allocating a layer between rounds (a rebuilt
        model, a resized expert tensor): the next ``start_weight_update``
        of the session refuses, since the target no longer fits its plan.
        """
        self.call("reallocate", (name, list(shape)))


# --------------------------------------------------------------------------
# HTTP


class _QuietHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that prints no traceback when a client hangs up.

    A client that disconnects mid-call, or a ``stop()`` that closes the
    socket under a handler, is normal for this server; anything else is
    still reported (one line, not a traceback).
    """

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, OSError)):
            return
        print(f"m2nkit server: request from {client_address[0]}:{client_address[1]} failed: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _http_error(status: int, message: str) -> WeightSyncError:
    return WeightSyncError(message, status=status)


#: POST route -> (body field, allowed types, required). The worker command
#: has the route's name. ``/start_weight_update`` and
#: ``/shutdown_weight_transfer_engine`` read no field: vLLM 0.33's
#: ``HTTPVLLMWeightSyncClient`` posts them without a body (older vLLM sent
#: ``{"is_checkpoint_format": bool}``, which is accepted and ignored), and
#: ``/finish_weight_update`` without a body when it has no version.
_POST_ROUTES: dict[str, tuple[str | None, tuple[type, ...], bool]] = {
    "/init_weight_transfer_engine": ("init_info", (dict,), True),
    "/start_weight_update": (None, (), False),
    "/shutdown_weight_transfer_engine": (None, (), False),
    "/update_weights": ("update_info", (dict, list), True),
    "/finish_weight_update": ("weight_version", (str, type(None)), False),
    "/m2nkit/save_storage": ("dir", (str,), True),
}


def _body_field(route: str, doc: Any, key: str, kinds: tuple[type, ...], required: bool) -> Any:
    """``doc[key]`` after checking the body has exactly that field, of the right type."""
    if not isinstance(doc, dict):
        raise _http_error(_BAD_INPUT, f"{route}: the body must be a JSON object")
    extra = sorted(set(doc) - {key})
    if extra:
        raise _http_error(_BAD_INPUT, f"{route}: unknown fields {extra}; expected '{key}'")
    if key not in doc:
        if required:
            raise _http_error(_BAD_INPUT, f"{route}: the body needs '{key}'")
        return None
    v = doc[key]
    if not isinstance(v, kinds) or (isinstance(v, list)
                                    and not all(isinstance(x, dict) for x in v)):
        raise _http_error(_BAD_INPUT, f"{route}: '{key}' must be "
                                      f"{' or '.join(k.__name__ for k in kinds)} (of objects), "
                                      f"got {type(v).__name__}")
    return v


def _handler(server: InferenceServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:      # quiet: errors go to the client
            pass

        def _reply(self, status: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                self.close_connection = True        # the client left mid-call: nobody to tell

        def _answer(self, method: str) -> dict:
            # vLLM's GET /get_world_size takes ?include_dp=...: every worker
            # here is one (dp * tp) rank, so both answers are the worker count.
            route = self.path.split("?", 1)[0]
            if method == "GET" and route == "/get_world_size":
                return {"world_size": server.num_workers}
            if method == "GET" and route == "/weight_version":
                return {"versions": server.weight_versions()}
            if method != "POST" or route not in _POST_ROUTES:
                raise _http_error(404, f"no route {method} {route}")
            n = int(self.headers.get("Content-Length") or 0)
            try:
                doc = json.loads(self.rfile.read(n)) if n else {}
            except ValueError as e:
                raise _http_error(_BAD_INPUT, f"{route}: the body is not JSON: {e}") from None
            key, kinds, required = _POST_ROUTES[route]
            if key is None:
                server.call(route[1:])
                return {"ok": True}
            value = _body_field(route, doc, key, kinds, required)
            if route == "/m2nkit/save_storage":
                return {"files": server.save_storage(value)}
            server.call(route[1:], value)
            return {"ok": True}

        def _route(self, method: str) -> None:
            try:
                self._reply(200, self._answer(method))
            except WeightSyncError as e:
                self._reply(e.status or 500, {"error": str(e)})
            except Exception as e:                  # a server bug: still answer
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m m2nkit.engine.tools.server",
                                 description="Serve vLLM's weight-transfer routes from N "
                                             "m2nkit receiver processes (until killed).")
    ap.add_argument("--model", required=True, help="checkpoint directory or config.json")
    ap.add_argument("--inference", required=True, help="vllm:tp=T[,dp=D][,ep]")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per call")
    args = ap.parse_args(argv)
    try:
        server = InferenceServer(args.model, args.inference, args.host, args.port, args.timeout)
    except ValueError as e:
        print(f"error: {e}", flush=True)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(server.start(), flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
        return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
