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
