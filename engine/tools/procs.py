"""Processes on one machine, for the CLI, the demos, the benchmarks and the tests.

Everything m2nkit runs locally is a handful of processes: the trainer ranks
and stand-in workers of a demo, the ``T + N`` ranks of a benchmark, the demo
driver the CLI supervises, the ranks a test spawns. They all need the same
few things, and this module holds the one copy of each:

* a free TCP port for a rendezvous (:func:`free_port`);
* ranks started as daemon processes (:func:`start_ranks`), their reports
  heard with a deadline (:func:`wait_reports`, :func:`collect_ranks`) and
  every one of them reaped on the way out, killed if need be
  (:func:`stop_processes`);
* a child run in a session of its own, so that Ctrl-C reaches only its
  supervisor, and its whole process group stopped (:func:`supervise`,
  :func:`follow_supervisor`, :func:`reap_group`);
* a process's own memory: resident set and its high-water mark, in KiB
  (:func:`rss_kib`, :func:`reset_peak`, :func:`peak_kib`, :func:`trim_heap`).

It refuses to know what the processes do: report formats beyond the
``(kind, rank, ...)`` tuples described below, and every message a user
reads, belong to the callers. Importing it is cheap (standard library only),
so the CLI can use it before deciding anything is worth loading. Linux is
assumed where ``/proc`` is read; each such function says what it does
without it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, Sequence

__all__ = ["HEARTBEAT_S", "free_port", "start_ranks", "wait_reports", "collect_ranks",
           "stop_processes", "supervise", "follow_supervisor", "group_members", "reap_group",
           "rss_kib", "reset_peak", "peak_kib", "trim_heap"]

#: Seconds a wait may stay silent before ``log`` hears what it waits for.
HEARTBEAT_S = 10.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel picks it; another process may
    take it before it is bound again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# ranks: start, hear, stop


def start_ranks(target: Callable, args_of: Callable[[int], tuple], count: int, *,
                ctx=None, name: str | None = None, started: list | None = None) -> list:
    """Start ``count`` daemon processes ``target(*args_of(rank))``, rank 0 first.

    ``ctx``: a ``multiprocessing`` context (default ``"spawn"``); ``name``: a
    format string with ``{rank}`` for the process names; ``started``: a list
    each process is appended to as soon as it runs, so that a caller's
    ``finally`` can stop the ones started before a later start failed.
    Returns that list (a new one without ``started``).

    Every process starts with SIGINT ignored (an ignored signal stays
    ignored across the ``exec`` of a spawned interpreter, and Python keeps
    it so): a terminal's Ctrl-C reaches the whole process group, and a child
    still importing its target when it arrives would otherwise print a
    ``KeyboardInterrupt`` traceback; the parent tears its children down.
    """
    ctx = ctx or mp.get_context("spawn")
    procs = started if started is not None else []
    for r in range(count):
        p = ctx.Process(target=target, args=args_of(r), daemon=True,
                        name=None if name is None else name.format(rank=r))
        main = threading.current_thread() is threading.main_thread()  # signals: main only
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            p.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        procs.append(p)
    return procs


def wait_reports(results, count: int, deadline: float, what: str, log, on_error,
                 procs=()) -> list:
    """``count`` reports from the queue ``results`` before ``deadline`` (monotonic seconds).

    Every :data:`HEARTBEAT_S` without a report, ``log`` hears how many of
    ``what`` have arrived. An ``("error", rank, message, detail)`` report
    calls ``on_error(report)``, which raises.

    Raises:
        RuntimeError: the deadline passed (names ``what`` and the processes
            of ``procs`` that died).
    """
    got: list = []
    t0 = last = time.monotonic()
    while len(got) < count:
        now = time.monotonic()
        if now >= deadline:
            dead = [p.name for p in procs if not p.is_alive() and p.exitcode]
            raise RuntimeError(f"timed out waiting for {what} ({len(got)} of {count} arrived)"
                               + (f"; dead: {dead}" if dead else ""))
        try:
            msg = results.get(timeout=min(deadline - now, max(0.1, last + HEARTBEAT_S - now)))
        except queue.Empty:
            if time.monotonic() - last >= HEARTBEAT_S:
                log(f"  still waiting for {what}: {len(got)} of {count} after "
                    f"{time.monotonic() - t0:.0f} s")
                last = time.monotonic()
            continue
        if msg[0] == "error":
            on_error(msg)
        got.append(msg)
        last = time.monotonic()
    return got


def collect_ranks(target, args_of, world: int, deadline_s: float, label: str = "") -> dict:
    """Spawn ``world`` processes ``target(*args_of(rank), queue)``; ``{rank: payload}``.

    Each child puts ``(rank, "ok" | "error", payload)`` on the queue. Every
    child is reaped on the way out (given 30 s to exit after a full set of
    reports); one still alive is killed.

    Raises:
        RuntimeError: a rank failed (with its traceback), died silently, or
            did not report within ``deadline_s`` seconds (messages start with
            ``label``).
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), out), daemon=True)
             for r in range(world)]
    got: dict[int, dict] = {}
    finished = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(got))
                raise RuntimeError(f"{label}ranks {missing} did not finish within "
                                   f"{deadline_s:g} s")
            try:
                rank, status, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RuntimeError(f"{label}rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} without reporting") from None
                continue
            if status != "ok":
                raise RuntimeError(f"{label}rank {rank} failed:\n{payload}")
            got[rank] = payload
        finished = True
    finally:
        stop_processes(procs, grace_s=30.0 if finished else 0.0)
    return got


def stop_processes(procs: Iterable, grace_s: float = 0.0, *, until: float | None = None) -> list:
    """Reap every started process of ``procs``; kill the ones that do not exit in time.

    Each process gets ``grace_s`` seconds to exit on its own (one after the
    other), or, with ``until``, whatever is left of that shared deadline
    (monotonic seconds; at least 0.1 s each); then every one still alive is
    killed (SIGKILL) and joined for up to 5 s. Processes never started are
    skipped. Safe to call again on the same processes. Returns the processes
    that were killed.
    """
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        wait = grace_s if until is None else max(0.1, until - time.monotonic())
        if wait > 0:
            p.join(wait)
    killed = [p for p in procs if p.is_alive()]
    for p in killed:
        p.kill()
    for p in procs:
        p.join(5)
    return killed


# --------------------------------------------------------------------------
# a supervised child in a session of its own


def supervise(cmd: Sequence[str], *, grace_s: float, announce: Callable[[int], None] | None = None,
              cleanup: Callable[[], None] | None = None) -> tuple[int, int | None]:
    """Run ``cmd`` in a new session; on SIGINT or SIGTERM here, stop it and its group.

    A terminal's Ctrl-C signals every process of the foreground process
    group; a child that runs its own processes (which ``multiprocessing``
    cannot start in another group) would see each of them die with a
    traceback. Here the child gets a session and a process group of its
    own, and a pipe as stdin (:func:`follow_supervisor` on its side): Ctrl-C
    and SIGTERM reach only this process, which sends the child SIGTERM,
    waits up to ``grace_s`` seconds for it (a second signal cuts the wait
    short), then kills whatever is left of its group (:func:`reap_group`).
    The child's output goes straight to this process's stdout and stderr. If
    this process dies without cleaning up, the child sees its stdin close.

    ``announce(signum)`` runs once the child is stopped after a signal, and
    ``cleanup()`` on the way out, both while this process still catches the
    signals. Returns ``(the child's return code, the signal received or
    None)``; a negative return code is the signal that killed the child.
    """
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    proc = None
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, start_new_session=True)
        rc = None
        while not received:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        if received:
            _stop_child(proc, received, grace_s)
            if announce is not None:
                announce(received[0])
            return proc.returncode, received[0]
        reap_group(proc.pid, grace_s=5.0)
        return rc, None
    finally:
        if proc is not None and proc.poll() is None:   # an error in this function
            _stop_child(proc, received, grace_s)
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        if cleanup is not None:
            cleanup()
        for s, handler in old.items():
            signal.signal(s, handler)


def _stop_child(proc, received: list[int], grace_s: float) -> None:
    """SIGTERM the child, wait for it (a second signal cuts the wait short), then kill its group."""
    n_signals = len(received)
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and len(received) == n_signals:
        try:
            proc.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            continue
    reap_group(proc.pid, grace_s=5.0 if proc.poll() is not None else 0.0)
    proc.wait()


def follow_supervisor() -> None:
    """In a child started by :func:`supervise`: SIGTERM raises ``KeyboardInterrupt``
    (tear down, exit quietly), and the supervisor going away, however it went
    (stdin closes), sends this process SIGTERM. Call from the main thread."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)

    def watch_supervisor():
        while os.read(0, 1 << 10):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_supervisor, daemon=True, name="m2nkit-supervisor-watch").start()


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from ``/proc`` (Linux)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def reap_group(pgid: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` seconds for process group ``pgid`` to be gone, then SIGKILL
    what is left (without ``/proc``, which lists it: SIGKILL at once)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------
# memory, measured inside a process


def rss_kib() -> int:
    """This process's resident set size now (``VmRSS``), KiB; 0 where it is not listed."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset this process's RSS high-water mark (``VmHWM``) to its current RSS.

    Linux ``/proc/PID/clear_refs`` value 5 (``reset_mm_hiwater_rss``).
    Returns False where that is not allowed; the peak then also covers what
    came before.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_kib() -> int:
    """This process's peak RSS since the last :func:`reset_peak`, KiB.

    ``VmHWM``, the high-water mark behind ``ru_maxrss``. ``ru_maxrss``
    itself is not usable in a spawned child: Linux keeps the larger of the
    process's own mark and the mark of the memory image ``exec`` replaced
    (``getrusage``: ``signal->maxrss``), so every child would report at
    least the parent's RSS at fork time, and ``clear_refs`` cannot reset it.
    Falls back to ``ru_maxrss`` without ``/proc``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def trim_heap(collect: bool = True) -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), after a garbage
    collection unless ``collect`` is False, so that RSS is what is live. A no-op
    without glibc."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
