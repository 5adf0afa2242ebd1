"""What only the tests need of processes and threads; the rest is ``m2nkit.engine.tools.procs``.

``free_port``, starting and stopping ranks and reports come from the
toolkit, as the CLI, the demos and the benchmarks use them. Here: the
tests' ``forkserver`` (below) and :func:`in_threads`, which runs the ranks
of one test as threads of this process and fails the test when one hangs.

Fast child processes for the multi-process tests: one ``forkserver`` with the imports done.

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

import contextlib
import multiprocessing as mp
import threading

CTX = mp.get_context("forkserver")

#: Third-party modules only. m2nkit itself is imported by each child (about
#: 0.2 s), so a child always runs the source tree as it is when it starts,
#: never a copy the server loaded earlier in the session (with other work
#: changing the tree during a run, a preloaded m2nkit went stale).
PRELOAD = [
    "numpy", "torch", "torch.distributed", "transformers", "safetensors.torch",
    # the test modules whose functions the children run import it
    "pytest",
    # the demo's FSDP2 trainers (tests/engine/tools/test_demo_fsdp2.py)
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


def in_threads(fns: dict, timeout_s: float, what: str = "a thread") -> dict:
    """Run every callable in its own daemon thread; ``{key: ("ok", value) | ("err", exc)}``.

    Each thread is joined for up to ``timeout_s`` seconds after the ones
    before it; an exception is handed back for the test's assertions.

    Raises:
        AssertionError: a thread was still running after that (``what`` hung).
    """
    out: dict = {}

    def run(key, fn):
        try:
            out[key] = ("ok", fn())
        except BaseException as e:  # handed to the assertions
            out[key] = ("err", e)

    threads = [threading.Thread(target=run, args=kv, daemon=True) for kv in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), f"{what} hung"
    return out


def p2p_round_in_threads(plan, schedule, streams: dict, storage: dict,
                         timeout_s: float = 60.0, pools: dict | None = None) -> dict:
    """One real ``torch_p2p`` round over gloo on 127.0.0.1, one thread per rank.

    Trainer rank ``r`` sends ``streams[r]`` (its ``iter_local()`` list);
    worker ``w`` receives into ``storage[w]``; ``pools`` (group rank ->
    ``BufferPool``), when given, are the ranks' staging pools. Returns
    ``{group rank: bytes sent (trainer) or received (worker)}``; every group
    is aborted afterwards.

    Raises:
        AssertionError: a rank hung or failed (names the rank and its error).
    """
    from m2nkit.engine.control import create_group
    from m2nkit.engine.tools.procs import free_port
    from m2nkit.engine.transports.torch_p2p import recv_round, send_round

    T, N = plan.num_trainer_ranks, plan.num_workers
    port, groups = free_port(), []
    pools = pools or {}

    def rank_fn(rank):
        def run():
            store, group = create_group("127.0.0.1", port, rank, T + N, timeout_s=timeout_s)
            groups.append(group)
            if rank < T:
                return send_round(group, plan, schedule, rank, iter(streams[rank]),
                                  timeout_s=timeout_s, pool=pools.get(rank))
            return recv_round(group, plan, schedule, rank - T, storage[rank - T],
                              timeout_s=timeout_s, pool=pools.get(rank))[1]
        return run

    try:
        out = in_threads({r: rank_fn(r) for r in range(T + N)}, timeout_s + 30, "a rank")
    finally:
        for group in groups:
            group.abort()
    errors = {r: e for r, (kind, e) in out.items() if kind == "err"}
    assert not errors, errors
    return {r: out[r][1] for r in range(T + N)}


def join_ranks(ctx, timeout_s: float, label: str = "") -> float:
    """Wait for the processes of ``torch.multiprocessing.start_processes(..., join=False)``.

    Fails the test when they still run after ``timeout_s`` (a hang), raises
    a rank's exception (``ctx.join`` does), and kills and reaps every process
    on the way out. Returns the seconds waited. ``label`` starts the hang's message.
    """
    import time

    import pytest

    start = time.monotonic()
    deadline = start + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"{label + ': ' if label else ''}ranks still running after "
                            f"{timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    return time.monotonic() - start


def trainer_outcomes(ctx, target, args_of, num_ranks: int, timeout_s: float, *,
                     wait_s: float | None = None, on_report=None) -> dict[int, str]:
    """Run ``target(*args_of(rank, results))`` in ``num_ranks`` daemon processes of ``ctx``
    and collect what each reports on ``results`` (``demo_vllm.trainer_main``'s protocol):
    rank -> ``"done"`` or its error text. Every other report ``(kind, rank, a, b)`` goes
    to ``on_report(kind, rank, a)`` when given (in this process, as it arrives).

    Fails the test (``AssertionError``) when some rank reported neither within
    ``wait_s`` s (default ``3 * timeout_s + 30``: a hang); joins, and kills what still
    runs, on the way out.
    """
    import queue
    import time

    results = ctx.Queue()
    procs = [ctx.Process(target=target, daemon=True, args=args_of(r, results))
             for r in range(num_ranks)]
    for p in procs:
        p.start()
    outcome: dict[int, str] = {}
    deadline = time.monotonic() + (3 * timeout_s + 30 if wait_s is None else wait_s)
    try:
        while len(outcome) < num_ranks:
            try:
                kind, rank, a, _ = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"trainers hung: outcomes so far {outcome}") from None
            if kind in ("done", "error"):
                outcome[rank] = "done" if kind == "done" else a
            elif on_report is not None:
                on_report(kind, rank, a)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return outcome


def vllm_workers(timeout_s: float = 400.0):
    """The body of a module fixture: ``demo_vllm.VLLMWorkers`` started (after
    :func:`ensure_forkserver`), yielded, and stopped however the module ends.
    Use ``yield from vllm_workers()``."""
    from m2nkit.engine.tools.demo_vllm import VLLMWorkers

    ensure_forkserver()
    h = VLLMWorkers(timeout_s=timeout_s).start()
    try:
        yield h
    finally:
        h.stop()


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, timeout_s: float):
    """This process as rank ``rank`` of a gloo process group of ``world`` over
    ``tcp://127.0.0.1:port`` (``GLOO_SOCKET_IFNAME=lo`` unless set, one torch thread,
    ``timeout_s`` per collective) for the body; a barrier when the body returns, and the
    group destroyed however it ends."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_source(src, world: int, path) -> None:
    """What a trainer rank hands the test's parent: ``src``'s manifest
    (``manifest_to_json(src.metadata, world)``) and a copy of every ``(name, tensor)``
    its ``iter_local()`` yields, ``torch.save``d to ``path`` as
    ``{"manifest": ..., "locals": [...]}``."""
    import torch

    from m2nkit.manifest import manifest_to_json

    torch.save({"manifest": manifest_to_json(src.metadata, world),
                "locals": [(n, t.clone()) for n, t in src.iter_local()]}, path)
