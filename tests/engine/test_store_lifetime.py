"""The session store outlives every rank's reading of the last verdict.

Trainer rank 0 hosts the ``TCPStore`` every rank reads the end-of-round
verdict from. A rank that reports last-but-one and polls a moment later
found the store gone when rank 0 returned from its round and shut down at
once ("the session store ... stopped answering" on a round that succeeded;
seen under load with vLLM's HTTP client). ``wait_verdict_seen``, called by
rank 0's ``M2NTrainerEngine.shutdown``, holds the store until every rank has
read the verdict.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from m2nkit.engine.tools.procs import free_port
from m2nkit.engine.control import finish_round, wait_verdict_seen


def _stores(world: int):
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, world, True, timedelta(seconds=10),
                         wait_for_workers=False)
    others = [dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=10))
              for _ in range(world - 1)]
    return [host, *others]


def test_host_waits_until_a_slow_rank_has_read_the_verdict():
    stores = _stores(3)
    finished: dict[int, float] = {}
    reported: dict[int, float] = {}
    errors: list[BaseException] = []

    def dawdle(r: int) -> None:
        reported[r] = time.monotonic()
        time.sleep(0.5)

    def rank(r: int, slow: bool) -> None:
        try:
            # A slow rank reports, then takes 0.5 s before it polls the verdict.
            finish_round(stores[r], r, 3, num_trainer_ranks=2, round_id=1, error=None,
                         timeout_s=20, on_reported=(lambda: dawdle(r)) if slow else None)
            finished[r] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r, r == 2)) for r in (1, 2)]
    for t in threads:
        t.start()
    finish_round(stores[0], 0, 3, num_trainer_ranks=2, round_id=1, error=None, timeout_s=20)
    assert wait_verdict_seen(stores[0], 1, 3, timeout_s=10) is True
    seen_at = time.monotonic()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert set(finished) == {1, 2}
    # the slow rank cannot have read before its 0.5 s pause ended
    assert seen_at >= reported[2] + 0.5, "the host went on before the slow rank had read"


def test_waiting_for_a_rank_that_never_reads_is_bounded():
    stores = _stores(2)
    t0 = time.monotonic()
    assert wait_verdict_seen(stores[0], 7, 2, timeout_s=0.3) is False
    assert time.monotonic() - t0 < 5


def test_a_round_rank_0_aborts_ends_on_every_trainer_rank_at_once_naming_its_reason():
    # Trainer rank 0 could not start round 3 (a worker refused start_weight_update):
    # it aborts the round in the store; trainer ranks 1 and 2, waiting for word
    # before any send, fail at once naming rank 0's reason first, and the workers
    # (never asked to receive) are not reported as silent.
    from m2nkit.engine.control import RoundAbortedError, open_round, wait_round_open
    from m2nkit.engine.deadline import Deadline

    T, world = 3, 5
    stores = _stores(world)
    reason = ("trainer rank 0: start_weight_update failed: start_weight_update failed on "
              "workers [0, 1]: ValueError: target parameter 'w' is (4, 96, 128)")
    out: dict[int, tuple[float, BaseException | None]] = {}

    def rank(r: int) -> None:
        deadline = Deadline(30)
        error = None
        try:
            if r == 0:
                time.sleep(0.3)                       # rank 0's RPC fails after a while
                open_round(stores[0], 3, reason)
                error = f"TransferError: {reason}"
            else:
                wait_round_open(stores[r], r, 3, deadline)
        except RoundAbortedError as e:
            error = f"{type(e).__name__}: {e}"
        try:
            finish_round(stores[r], r, world, num_trainer_ranks=T, round_id=3, error=error,
                         deadline=deadline)
            out[r] = (time.monotonic(), None)
        except BaseException as e:  # noqa: BLE001 - asserted below
            out[r] = (time.monotonic(), e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(T)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(out) == [0, 1, 2], out
    for r, (at, e) in out.items():
        assert e is not None, r
        assert str(e).startswith(
            f"trainer rank {r}: round 3 failed: {reason}; nothing was sent"), e
        assert "sent no report" not in str(e) and "more rank(s)" not in str(e), e
        assert at - t0 < 0.3 + 1.0, (r, at - t0)     # at once, not at the 30 s deadline


def test_wait_round_open_returns_once_opened_and_is_bounded_without_word():
    from m2nkit.engine.control import TransferError, open_round, wait_round_open
    from m2nkit.engine.deadline import Deadline

    stores = _stores(2)
    open_round(stores[0], 1)
    wait_round_open(stores[1], 1, 1, Deadline(5))    # opened: returns
    t0 = time.monotonic()
    try:
        wait_round_open(stores[1], 1, 2, Deadline(0.3))
    except TransferError as e:
        assert "trainer rank 0 did not start round 2 by the deadline (0.3 s" in str(e), e
    else:
        raise AssertionError("no word from rank 0, yet wait_round_open returned")
    assert time.monotonic() - t0 < 3


def test_a_trainer_rank_absent_from_an_aborted_round_is_named_after_the_reason():
    from m2nkit.engine.control import RoundAbortedError, open_round, wait_round_open
    from m2nkit.engine.deadline import Deadline

    T, world = 3, 5
    stores = _stores(world)
    reason = "trainer rank 0: start_weight_update failed: the server is gone"
    out: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:                 # trainer rank 2 never comes
        deadline = Deadline(30)
        error = f"TransferError: {reason}"
        try:
            if r == 0:
                open_round(stores[0], 1, reason)
            else:
                wait_round_open(stores[r], r, 1, deadline)
                error = None
        except RoundAbortedError as e:
            error = f"{type(e).__name__}: {e}"
        try:
            finish_round(stores[r], r, world, num_trainer_ranks=T, round_id=1, error=error,
                         deadline=deadline)
            out[r] = None
        except BaseException as e:  # noqa: BLE001 - asserted below
            out[r] = e

    t0 = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert time.monotonic() - t0 < 5, "waited for the deadline"
    for r in (0, 1):
        msg = str(out[r])
        assert msg.startswith(f"trainer rank {r}: round 1 failed: {reason}; nothing was sent"), msg
        assert "; trainer rank 2 sent no report" in msg and "worker" not in msg, msg


@pytest.mark.timeout(30)
def test_rank_0_waits_for_every_worker_to_join_or_names_why_the_round_cannot_start():
    # Trainer rank 0 opens a round only once every worker joined it; until then it
    # watches its own update_weights call. Each way out: all joined (None), the call
    # failed first (its text), the deadline with a worker missing (that worker).
    from m2nkit.engine.control import join_round, wait_workers_joined
    from m2nkit.engine.deadline import Deadline

    stores = _stores(4)                       # 2 trainer ranks, 2 workers
    kw = dict(num_workers=2, num_trainer_ranks=2)
    join_round(stores[2], 1, 0)
    join_round(stores[3], 1, 1)
    assert wait_workers_joined(stores[0], 1, deadline=Deadline(5), refused=lambda: None,
                               **kw) is None
    refusal = "trainer rank 0: update_weights failed: HTTP 500: the server refused it"
    t0 = time.monotonic()
    assert wait_workers_joined(stores[0], 2, deadline=Deadline(20), refused=lambda: refusal,
                               **kw) == refusal
    assert time.monotonic() - t0 < 2, "the failed call was not noticed before the deadline"
    join_round(stores[2], 3, 0)
    reason = wait_workers_joined(stores[0], 3, deadline=Deadline(0.3), refused=lambda: None,
                                 **kw)
    assert reason == ("trainer rank 0: worker 1 (rank 3) did not join round 3 by the deadline "
                      "(0.3 s after the start) (update_weights never reached their receive)")


@pytest.mark.timeout(30)
def test_a_commit_rank_0_could_not_make_reaches_every_trainer_rank_before_the_store_goes():
    # Only trainer rank 0 calls finish_weight_update. Its word reaches the other
    # trainer ranks through the store it hosts: a commit returns there too, a failed
    # one raises its reason first; rank 0 keeps the store up until they have read it.
    from m2nkit.engine.control import TransferError, report_commit, wait_commit

    stores = _stores(3)                       # 3 trainer ranks
    readers = (1, 2)
    report_commit(stores[0], 1)
    for r in readers:
        wait_commit(stores[r], r, 1, time.monotonic() + 5)      # committed: returns
    assert wait_verdict_seen(stores[0], 1, 0, timeout_s=5, commit_readers=2) is True

    reason = ("trainer rank 0: finish_weight_update failed: finish_weight_update failed on "
              "workers [1]: worker 1 (pid 7) died during finish_weight_update (exit code -9)")
    out: dict[int, tuple[float, BaseException | None]] = {}

    def rank(r: int) -> None:
        try:
            wait_commit(stores[r], r, 2, time.monotonic() + 20)
            out[r] = (time.monotonic(), None)
        except BaseException as e:  # noqa: BLE001 - asserted below
            out[r] = (time.monotonic(), e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    report_commit(stores[0], 2, reason, readers=2, until=t0 + 10)
    done = time.monotonic()
    for t in threads:
        t.join(20)
    assert done - t0 < 5, "rank 0 waited past its readers"
    for r in readers:
        at, e = out[r]
        assert isinstance(e, TransferError), out[r]
        assert str(e) == f"trainer rank {r}: round 2 failed: {reason}", e
        assert at - t0 < 5, (r, at - t0)
    # Rank 0 went on only after both had read the word.
    assert stores[0].add("verdict/2/commit/read", 0) == 2
    # No word at all is bounded, and says what is unknown.
    with pytest.raises(TransferError, match="trainer rank 0 did not say by the deadline whether "
                                            "the workers committed the round"):
        wait_commit(stores[1], 1, 3, time.monotonic() + 0.3)
