"""Fast child processes for the multi-process tests: one ``forkserver`` with the imports done.

Spawning a process re-imports torch, transformers and m2nkit (seconds each on
this machine, more under load). A ``forkserver`` imports them once; every
child then forks from it in milliseconds, clean (the server runs no threads
and holds no process group). ``exit_with_parent`` still works: a forkserver
child's parent is the process that asked for it.

Call :func:`ensure_forkserver` once before the first child (outside any
timed part of a test); the first caller's preload list is the one used.
"""

from __future__ import annotations

import multiprocessing as mp

CTX = mp.get_context("forkserver")

PRELOAD = [
    "torch", "transformers", "safetensors.torch",
    "m2nkit.manifest", "m2nkit.adapters.hf_checkpoint", "m2nkit.adapters.trainer_spec",
    "m2nkit.adapters.vllm", "m2nkit.engine.trainer", "m2nkit.engine.receiver",
    "m2nkit.engine.server", "m2nkit.engine.clients", "m2nkit.engine.baseline",
    "m2nkit.engine.local", "m2nkit.engine.demo",
] + [
    # read_checkpoint builds the model on the meta device: its transformers classes.
    f"transformers.models.{m}.modeling_{m}"
    for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
]


def _ready() -> None:
    pass


def ensure_forkserver(timeout_s: float = 180.0) -> None:
    """Start the forkserver with :data:`PRELOAD` (no-op when it runs already).

    Raises:
        RuntimeError: a first child did not start and exit within ``timeout_s``.
    """
    CTX.set_forkserver_preload(PRELOAD)
    p = CTX.Process(target=_ready, daemon=True)
    p.start()
    p.join(timeout_s)
    if p.exitcode != 0:
        if p.is_alive():
            p.kill()
        raise RuntimeError(f"the forkserver's first child did not exit cleanly "
                           f"(exit code {p.exitcode})")
