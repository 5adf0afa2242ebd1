"""``m2nkit demo`` as a user runs it: progress lines, the baseline announced, Ctrl-C.

Each test runs the real CLI in its own session and process group (as a
shell runs a job), with its own ``TMPDIR`` and an environment marker that
every descendant inherits, so "nothing left behind" is checked directly: no
live process carrying the marker, nothing of the demo's in ``TMPDIR``. Waits are deadlines
on output lines, never sleeps. The smallest layouts keep the process count
(and the time on a 2-core machine) down.

The three runs that start trainers and workers carry the ``integration``
marker: they need no framework stack, but each spawns up to six fresh
processes that import torch and transformers (30-37 s on 2 cores), which put
the fast suite over its 5-minute budget with one core busy (6 min 05 s,
docs/benchmarks.md); they run in the integration run, as the multi-process
``ipc`` tests do. Ctrl-C while torch loads stays in the fast suite.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="finds leftover processes through /proc")


class Demo:
    """``m2nkit demo ARGS`` in a new session, its output read line by line."""

    def __init__(self, tmp_path: Path, *args: str):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        self.mark = f"m2nkit-demo-test-{uuid.uuid4().hex}"
        env = dict(os.environ, TMPDIR=str(self.tmp), M2NKIT_TEST_MARK=self.mark,
                   COLUMNS="200", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "m2nkit.engine.tools.cli", "demo", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(f, sink), daemon=True)
                         for f, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    def _read(self, f, sink):
        for line in f:
            sink.append(line)
            self.lines.put(line)

    def wait_for(self, needle: str, deadline_s: float) -> float:
        """Seconds until a line containing ``needle`` appeared (fails at the deadline)."""
        t0 = time.monotonic()
        while True:
            left = t0 + deadline_s - time.monotonic()
            if left <= 0:
                self.kill()
                pytest.fail(f"no line with {needle!r} within {deadline_s} s; output:\n"
                            + "".join(self.out + self.err))
            try:
                if needle in self.lines.get(timeout=left):
                    return time.monotonic() - t0
            except queue.Empty:
                continue

    def finish(self, deadline_s: float) -> int:
        try:
            rc = self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the demo did not exit in time; output:\n" + "".join(self.out + self.err))
        for t in self._readers:
            t.join(10)
        return rc

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.leftovers():
            os.kill(pid, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """Live (not zombie) processes whose environment carries this run's marker."""
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry.name}/environ").read_bytes()
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            state = stat[stat.rfind(")") + 2:].split()[0]
            if f"M2NKIT_TEST_MARK={self.mark}".encode() in environ.split(b"\0") and state != "Z":
                pids.append(int(entry.name))
        return pids

    def assert_nothing_left(self):
        deadline = time.monotonic() + 10          # a last child may be mid-exit
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.leftovers() == [], "processes left behind"
        # torch keeps its own caches there (torchinductor_<user>); the demo's
        # work directory is m2nkit-demo-*.
        assert [p.name for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_")] \
            == [], "files left in TMPDIR"


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_demo_reports_progress_and_announces_the_baseline(tmp_path):
    demo = Demo(tmp_path, "--model", "tiny-llama", "--trainer", "fsdp:1",
                "--inference", "vllm:tp=1", "--rounds", "1", "--timeout", "60")
    # The first line comes before torch is even imported.
    demo.wait_for("m2nkit demo: tiny-llama, fsdp:1 -> vllm:tp=1, 1 round (Ctrl-C stops it)", 30)
    rc = demo.finish(400)
    out, err = "".join(demo.out), "".join(demo.err)
    assert rc == 0, out + err
    assert "Traceback" not in out + err and err == ""
    phases = ["loading torch and transformers", "building the tiny checkpoint tiny-llama",
              "starting 1 inference worker process ", "starting 1 trainer process:",
              "1 trainer joined", "1 round follows", "round 1:", "rounds done",
              "baseline: gather-then-broadcast on the same data and ranks",
              "(--no-baseline skips it)", "baseline: done in",
              "m2nkit demo: tiny-llama, fsdp:1 -> vllm:tp=1,dp=1", "│ gather-then-broadcast "]
    positions = [out.find(p) for p in phases]
    assert -1 not in positions, [p for p, i in zip(phases, positions) if i < 0]
    assert positions == sorted(positions), "phases out of order"
    demo.assert_nothing_left()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_fsdp2_tp_demo_prints_only_m2nkits_lines(tmp_path):
    """FSDP2 + TP trainers: torch's DTensor note that the (dp_shard, tp) mesh is not
    flattened ("... sequential ... operations will be performed", logged by
    torch.distributed.tensor._redistribute) is silenced in the trainer processes, so
    stderr stays empty; progress lines come whole (COLUMNS is 200 here). One worker: the
    note is the trainers' (a worker's stderr is checked empty above)."""
    demo = Demo(tmp_path, "--model", "tiny-qwen3-moe", "--trainer", "fsdp2:dp_shard=2,tp=2",
                "--inference", "vllm:tp=1", "--rounds", "1", "--no-baseline", "--timeout", "120")
    rc = demo.finish(580)
    out, err = "".join(demo.out), "".join(demo.err)
    assert rc == 0, out + err
    assert err == "", err
    assert "sequential" not in out and "_redistribute" not in out, out
    demo.assert_nothing_left()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_demo_with_one_line_and_status_130(tmp_path):
    demo = Demo(tmp_path, "--model", "tiny-llama", "--trainer", "fsdp:2",
                "--inference", "vllm:tp=1", "--no-baseline", "--timeout", "60")
    demo.wait_for("no baseline (Ctrl-C stops it)", 30)
    # Interrupt while the worker runs and the trainers are being spawned,
    # importing torch, joining the group: every kind of child exists.
    demo.wait_for("starting 2 trainer processes", 240)
    os.killpg(demo.proc.pid, signal.SIGINT)       # what a terminal's Ctrl-C does
    rc = demo.finish(60)
    out, err = "".join(demo.out), "".join(demo.err)
    assert rc == 130, out + err
    # the whole output in the message: a child's traceback is the clue to a start-up race
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert err.splitlines() == [
        "m2nkit: demo interrupted; its processes are stopped and its files removed"]
    demo.assert_nothing_left()


@pytest.mark.timeout(120)
def test_ctrl_c_while_torch_loads_is_just_as_clean(tmp_path):
    demo = Demo(tmp_path, "--no-baseline")
    demo.wait_for("loading torch and transformers", 30)
    os.killpg(demo.proc.pid, signal.SIGINT)
    rc = demo.finish(60)
    out, err = "".join(demo.out), "".join(demo.err)
    assert rc == 130 and "Traceback" not in out + err, out + err
    assert len(err.splitlines()) == 1
    demo.assert_nothing_left()
