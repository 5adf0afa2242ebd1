"""Fast child processes for the multi-process tests: one ``forkserver`` with the imports done.

Spawning a process re-imports torch and transformers (seconds on this
machine, more under load). A ``forkserver`` imports them once; every
child then forks from it in milliseconds, clean (the server runs no threads
and holds no process group). ``exit_with_parent`` still works: a forkserver
child's parent is the process that asked for it.

Call :func:`ensure_forkserver` once before the first child (outside any
timed part of a test); the first caller's preload list is the one used.
Children run functions of the test modules, which they import by name (the
server has the test session's ``sys.path``).
"""

from __future__ import annotations

import multiprocessing as mp

CTX = mp.get_context("forkserver")

#: Third-party modules only. m2nkit itself is imported by each child (about
#: 0.2 s), so a child always runs the source tree as it is when it starts,
#: never a copy the server loaded earlier in the session (with other work
#: changing the tree during a run, a preloaded m2nkit went stale).
PRELOAD = [
    "numpy", "torch", "torch.distributed", "transformers", "safetensors.torch",
    # the demo's FSDP2 trainers (tests/test_demo_fsdp2.py)
    "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint.state_dict",
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
