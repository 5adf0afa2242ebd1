"""Clients the trainer drives the inference side with: in-process and HTTP.

The trainer-side engine talks to workers only through the four calls of
``VLLMWeightSyncClient`` (``m2nkit.manifest.protocol``; vLLM
``weight_transfer/base.py``). Two implementations:

* ``InProcessClient`` calls ``M2NReceiver`` objects of this process, each
  in its own thread (the receives of one round must run concurrently, and
  concurrently with the trainer's send). Every join has a timeout, so a
  receiver stuck in a collective is an error, not a hang.
* ``HTTPClient`` speaks vLLM's weight-transfer routes (vLLM 0.33
  ``vllm/entrypoints/rl/online/api_router.py``; served here by
  ``m2nkit.engine.tools.server``) with the standard library only, so using it
  adds no dependency. vLLM's own ``HTTPVLLMWeightSyncClient`` works as well
  (``requests``); what this one adds: no dependency, the server's error text
  in the exception (vLLM's raises ``requests.HTTPError``, whose message has
  only the status line), and ``get_world_size``/``weight_versions``:

  =========================================  =============================================================
  ``POST /init_weight_transfer_engine``      ``{"init_info": InitPayload.to_json()}``
  ``POST /start_weight_update``              ``{}`` (vLLM's client: no body)
  ``POST /update_weights``                   ``{"update_info": {"round": k, "version": v, "session": s}}``
  ``POST /finish_weight_update``             ``{"weight_version": v}``
  ``POST /shutdown_weight_transfer_engine``  no body: each worker drops its group
  ``GET /get_world_size``                    -> ``{"world_size": N}`` (``?include_dp=`` accepted)
  ``GET /weight_version``                    -> ``{"versions": [v per worker]}`` (m2nkit)
  =========================================  =============================================================

  Errors come back as HTTP 400 (bad input, plan mismatch) or 500
  (transfer failure) with ``{"error": "..."}``.

Both raise ``WeightSyncError`` carrying the message and the status.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence

from m2nkit.engine.control import PlanMismatchError
from m2nkit.manifest.protocol import WeightTransferUpdatePayload

__all__ = ["WeightSyncError", "InProcessClient", "HTTPClient", "error_status"]


class WeightSyncError(RuntimeError):
    """A control-plane call failed on the inference side.

    Attributes:
        status: 400 (bad input or plan mismatch: nothing moved), 500
            (transfer failure, dead or silent worker), or ``None`` (the
            server could not be reached).
        errors: worker index -> the exception it raised (in-process only).
    """

    def __init__(self, message: str, *, status: int | None = 500,
                 errors: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.errors = errors or {}


def error_status(e: BaseException) -> int:
    """400 for what the caller sent (ValueError, TypeError, PlanMismatchError), else 500."""
    return 400 if isinstance(e, (ValueError, TypeError, PlanMismatchError)) else 500


class InProcessClient:
    """Drive receivers of this process concurrently, one thread each.

    Args:
        receivers: ``M2NReceiver`` objects (anything with the worker-side
            methods and a ``worker`` attribute).
        timeout_s: how long one call may wait for every receiver (seconds).

    Every method raises ``WeightSyncError`` naming each failing worker and
    its error (``errors`` holds the exceptions); a receiver still running
    after ``timeout_s`` is reported as timed out (its thread is a daemon).
    """

    def __init__(self, receivers: Sequence[Any], timeout_s: float = 600.0) -> None:
        if not receivers:
            raise ValueError("InProcessClient needs at least one receiver")
        self.receivers = list(receivers)
        self.timeout_s = timeout_s

    def _fan_out(self, call: str, fn: Callable[[Any], None]) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def run(i: int, r: Any) -> None:
            try:
                results[i] = fn(r)
            except BaseException as e:  # reported below, per worker
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i, r), daemon=True,
                                    name=f"m2nkit-{call}-{i}")
                   for i, r in enumerate(self.receivers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s
        for i, t in enumerate(threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                errors[i] = TimeoutError(f"did not finish {call} within {self.timeout_s:g} s")
        if errors:
            named = {getattr(self.receivers[i], "worker", i): e for i, e in sorted(errors.items())}
            status = 400 if all(error_status(e) == 400 for e in named.values()) else 500
            detail = "; ".join(f"worker {w}: {type(e).__name__}: {e}" for w, e in named.items())
            raise WeightSyncError(f"{call} failed on workers {sorted(named)}: {detail}",
                                  status=status, errors=named)
        return [results.get(i) for i in range(len(self.receivers))]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._fan_out("init_weight_transfer_engine",
                      lambda r: r.init_transfer_engine(r.parse_init_info(init_info)))

    def start_weight_update(self) -> None:
        self._fan_out("start_weight_update", lambda r: r.start_weight_update())

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._fan_out("update_weights", lambda r: r.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._fan_out("finish_weight_update", lambda r: r.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._fan_out("shutdown_weight_transfer_engine", lambda r: r.shutdown())

    def get_world_size(self) -> int:
        return len(self.receivers)

    def weight_versions(self) -> list[str | None]:
        return [r.weight_version for r in self.receivers]


class HTTPClient:
    """``VLLMWeightSyncClient`` over vLLM's weight-transfer HTTP routes (urllib).

    Args:
        base_url: ``http://host:port`` of the inference server.
        timeout_s: socket timeout per request (seconds); must exceed the
            longest call, i.e. the server's own wait for a round.

    Raises (every method):
        WeightSyncError: an HTTP error (``status`` 400/500/..., message from
            the server's ``{"error": ...}``) or an unreachable server
            (``status`` None).
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _request(self, method: str, route: str, body: dict | None = None) -> dict:
        url = self.base_url + route
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                message = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                message = text or e.reason
            raise WeightSyncError(f"{method} {route} -> HTTP {e.code}: {message}",
                                  status=e.code) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise WeightSyncError(f"{method} {url} failed: {reason}", status=None) from None
        return json.loads(raw) if raw else {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update", {})

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._request("POST", "/finish_weight_update", {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._request("POST", "/shutdown_weight_transfer_engine")

    def get_world_size(self) -> int:
        return int(self._request("GET", "/get_world_size")["world_size"])

    def weight_versions(self) -> list[str | None]:
        return list(self._request("GET", "/weight_version")["versions"])
