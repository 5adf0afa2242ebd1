"""The control plane of a transfer session: rendezvous, plan agreement, round verdicts.

Every transport moves bytes over a group that the control plane built and
checked first, and ends each round through it; none of this moves a wire
tensor, so it is the same for every transport (``torch_p2p``, ``nccl_m2n``)
and lives apart from them, as vLLM keeps its plan agreement
(``vllm/distributed/weight_transfer/m2n_common.py``,
``check_source_plan_agreement``) apart from the code that moves the tensors
(``m2n_engine.py``, ``m2n_trainer.py``).

* **Rendezvous** (:func:`create_group`): one *stateless* process group of
  trainer ranks ``[0, T)`` and workers ``[T, T+N)`` (vLLM ``m2n_common.py``),
  built from its own ``TCPStore`` (hosted by trainer rank 0) and
  ``ProcessGroup`` object, never the default group, so a trainer that
  already runs FSDP or Megatron keeps its own world untouched. A rank that
  will not come says why (:func:`refuse_rendezvous`) and every other rank
  stops waiting at once.
* **Agreement** (:func:`agree_on_plan`): every rank exchanges a fingerprint
  of its plan before any byte moves; a difference, or a rank that could not
  build a plan, ends the session on every rank (``PlanMismatchError``).
* **Round start** (:func:`open_round`, :func:`wait_round_open`): trainer
  rank 0 starts each round on the inference side (its client calls), waits
  until every worker joined it (:func:`join_round`,
  :func:`wait_workers_joined`) and then opens it in the store; the other
  trainer ranks wait for that word before they post a send. When rank 0
  cannot start the round (a worker refused ``start_weight_update``, the
  workers or the server refused ``update_weights`` before the workers
  joined) it aborts it there instead, with its reason, and every trainer
  rank fails at once naming it.
* **Commit** (:func:`report_commit`, :func:`wait_commit`): after the
  verdict rank 0 alone asks the workers to commit (``finish_weight_update``);
  it tells the other trainer ranks whether they did, so a refused commit
  fails every trainer rank, not only rank 0.
* **Verdicts** (:func:`finish_round`): every round ends with one verdict for
  every rank, exchanged through the session's store rather than the group,
  so a silent rank is named instead of blocking the others;
  :func:`wait_verdict_seen` keeps the store up until everyone read it.
* **Release** (:func:`release_group`): abort a group's own work when a
  session ends or breaks.

Every wait counts down to one ``Deadline`` (``m2nkit.engine.deadline``), so
waits never add up: a dead or stalled peer becomes a ``TransferError``
naming the peer, never a hang.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.distributed as dist

from m2nkit.engine.deadline import REPORT_GRACE_S, Deadline

if TYPE_CHECKING:
    from m2nkit.engine.plan_types import Plan

__all__ = [
    "TransferError",
    "PlanMismatchError",
    "create_group",
    "refuse_rendezvous",
    "release_group",
    "wait_work",
    "error_gist",
    "rank_label",
    "agree_on_plan",
    "RoundAbortedError",
    "join_round",
    "wait_workers_joined",
    "open_round",
    "wait_round_open",
    "report_commit",
    "wait_commit",
    "finish_round",
    "wait_verdict_seen",
]


class TransferError(RuntimeError):
    """A transfer failed: timeout, dead peer, or a stream out of order."""


class PlanMismatchError(TransferError):
    """Ranks disagree on the manifest or plan; nothing was moved."""


class RoundAbortedError(TransferError):
    """Trainer rank 0 could not start the round (see :func:`open_round`); nothing was moved."""


#: Store keys of the rendezvous, under the group's prefix (one fresh store per
#: group): the ranks that arrived, the session rank 0 hosts, and the refusals
#: of ranks that will not come (``slots/<n>``: their texts).
_ARRIVED, _SESSION = "rendezvous/arrived", "rendezvous/session"
_REFUSALS, _SLOTS = "rendezvous/refusals", "rendezvous/slots"


def _refusals(store) -> list[str]:
    """The refusals written so far (slots whose text is in; at least one once counted)."""
    out = []
    for i in range(1, store.add(_SLOTS, 0) + 1):
        key = f"{_SLOTS}/{i}"
        if store.check([key]):
            out.append(store.get(key).decode())
    return out


def _write_refusal(store, text: str) -> None:
    # The text is in before it is counted: a reader that sees the count finds it.
    n = store.add(_SLOTS, 1)
    store.set(f"{_SLOTS}/{n}", text)
    store.add(_REFUSALS, 1)


def refuse_rendezvous(host: str, port: int, who: str, message: str, *, timeout_s: float,
                      session: str = "", prefix: str = "m2nkit") -> bool:
    """Tell the ranks waiting in :func:`create_group` at ``host:port`` that ``who`` will not come.

    For a rank that refuses a session before it could join (a worker whose
    init payload does not parse): each rank waiting in ``create_group``
    there then raises ``PlanMismatchError`` quoting ``who`` and ``message``
    at once, instead of at its rendezvous timeout. ``session`` is the
    refused payload's session id: the refusal is written only if rank 0
    hosts that session there (so a late refusal cannot end a newer session
    on the same port). Connects as a client for at most ``timeout_s`` (the
    store may not be listening yet). Returns whether it was written; never
    raises.
    """
    try:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=max(timeout_s, 0.1)),
                              wait_for_workers=False)
        store = dist.PrefixStore(prefix, store)
        if store.get(_SESSION).decode() != session:
            return False
        _write_refusal(store, f"{who} refused the session: {message}")
        return True
    except Exception:  # noqa: BLE001 - best effort: the refusal is also raised locally
        return False


def _await_arrivals(store, rank: int, world_size: int, deadline: Deadline,
                    watch: Callable[[], str | None] | None) -> None:
    """Store-level rendezvous before the group is built: every rank arrived, or a refusal.

    ``ProcessGroupGloo``'s own rendezvous blocks until every rank came or its
    timeout passed, and nothing can interrupt it; waiting here first lets a
    refusal (:func:`refuse_rendezvous`, or ``watch()`` returning a reason on
    this rank) end every rank's wait at once; after the first refusal a rank
    waits at most ``REPORT_GRACE_S / 2`` for the other missing ranks' own,
    so each is named. Rank 0 hosts the store: on a refusal it stays (at most
    ``REPORT_GRACE_S``, within the deadline) until the ranks that arrived
    have read it.
    """
    arrived, refusals, read = _ARRIVED, _REFUSALS, _ARRIVED + "/read"
    store.add(arrived, 1)
    pause = 0.002
    while True:
        error = None
        if store.add(refusals, 0):
            # Give the other ranks that will not come (usually every worker
            # refuses alike) a moment to say so, so each is named.
            until = time.monotonic() + min(0.5 * REPORT_GRACE_S, max(deadline.left(), 0.0))
            while store.add(refusals, 0) + store.add(arrived, 0) < world_size \
                    and time.monotonic() < until:
                time.sleep(0.01)
            error = PlanMismatchError(f"rank {rank}: {'; '.join(_refusals(store))}; "
                                      "nothing was sent")
        elif store.add(arrived, 0) >= world_size:
            return
        else:
            reason = watch() if watch is not None else None
            if reason is not None:
                # The inference side refused (rank 0's init call failed): its workers
                # usually post their own reasons in the store a moment later; wait a
                # little for them, so this rank names each worker as the others do.
                until = time.monotonic() + min(0.5 * REPORT_GRACE_S, max(deadline.left(), 0.0))
                while not store.add(refusals, 0) and time.monotonic() < until:
                    time.sleep(0.01)
                if store.add(refusals, 0):
                    continue            # the workers' refusals, every one named (above)
                _write_refusal(store, f"rank {rank} refused the session: {reason}")
                error = PlanMismatchError(f"rank {rank}: {reason}; nothing was sent")
            elif deadline.expired():
                raise TransferError(f"rank {rank}: only {store.add(arrived, 0)} of {world_size} "
                                    f"ranks arrived by {deadline.describe()}")
        if error is not None:
            store.add(read, 1)
            if rank == 0:
                until = time.monotonic() + min(REPORT_GRACE_S, max(deadline.left(), 0.5))
                while store.add(read, 0) < store.add(arrived, 0) and time.monotonic() < until:
                    time.sleep(0.01)
            raise error
        time.sleep(min(pause, max(deadline.left(), 0.0)))
        pause = min(pause * 2, 0.02)


def create_group(host: str, port: int, rank: int, world_size: int, *, timeout_s: float,
                 backend: str = "gloo", prefix: str = "m2nkit", session: str = "",
                 watch: Callable[[], str | None] | None = None):
    """Join a stateless process group of ``world_size`` ranks.

    Rank 0 hosts the ``TCPStore`` at ``host:port``. Gloo binds to ``host``
    (use 127.0.0.1 on one machine). Returns ``(store, group)``.

    Before the group is built every rank waits in the store until all
    ``world_size`` ranks arrived, so a rank that will not come can say why:
    a refusal written with :func:`refuse_rendezvous` for rank 0's
    ``session`` (a worker whose init payload did not parse), or ``watch()``
    on this rank returning a reason (trainer rank 0: its init RPC failed),
    ends every rank's wait at once with ``PlanMismatchError`` quoting it.

    Raises:
        PlanMismatchError: a rank refused the session (quotes it).
        TransferError: the rendezvous did not complete within ``timeout_s``.
        ValueError: an unknown backend.
    """
    timeout = timedelta(seconds=timeout_s)
    deadline = Deadline(timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout,
                              wait_for_workers=False)
        store = dist.PrefixStore(prefix, store)
        if rank == 0:
            store.set(_SESSION, session)
        _await_arrivals(store, rank, world_size, deadline, watch)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            group = dist.ProcessGroupGloo(store, rank, world_size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            raise ValueError(f"unknown backend '{backend}'; use 'gloo' or 'nccl'")
    except TransferError:
        raise
    except (RuntimeError, dist.DistStoreError) as e:
        raise TransferError(f"rank {rank}: rendezvous at {host}:{port} for {world_size} ranks "
                            f"failed within {timeout_s:g} s: {e}") from e
    return store, group


def rank_label(rank: int, num_trainer_ranks: int) -> str:
    """How messages name a rank of the group: ``"trainer rank 1"``, ``"worker 0 (rank 3)"``."""
    if rank < num_trainer_ranks:
        return f"trainer rank {rank}"
    return f"worker {rank - num_trainer_ranks} (rank {rank})"


def error_gist(e: BaseException) -> str:
    """The gist of a c10d/gloo error: first line, without the source location or advice."""
    line = str(e).splitlines()[0] if str(e) else type(e).__name__
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]                 # "[.../pair.cc:553] Connection closed ..."
    return line.split(". This is typically", 1)[0]


def wait_work(work, deadline: Deadline | float, what: str) -> None:
    """Wait for a ``torch.distributed`` work object until ``deadline``.

    ``deadline`` is the round's ``Deadline`` (the wait gets only the time
    left to it), or seconds for a standalone wait. ``what`` names the
    operation and the peer (``"worker 0 (rank 2): receive of bucket 3 from
    trainer rank 1"``); every error starts with it.

    Raises:
        TransferError: the work failed (a peer closed its connection, the
            group was aborted) or was not complete at the deadline.
    """
    if not isinstance(deadline, Deadline):
        deadline = Deadline(deadline)
    left = deadline.left()
    try:
        if left <= 0.0 and not work.is_completed():
            ok = False
        else:
            # c10d treats a zero timeout as "wait forever": never pass one.
            ok = work.wait(timedelta(seconds=max(left, 0.002)))
    except RuntimeError as e:
        if deadline.expired():
            raise TransferError(f"{what} did not complete by {deadline.describe()}") from e
        raise TransferError(f"{what} failed: {error_gist(e)}") from e
    if ok is False:
        raise TransferError(f"{what} did not complete by {deadline.describe()}")


def _group_device(group) -> torch.device:
    """Where a group's collectives take tensors: CUDA for NCCL, else CPU."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None and isinstance(group, nccl):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allgather_bytes(group, rank: int, world_size: int, payload: bytes, deadline: Deadline,
                     what: str) -> list[bytes]:
    dev = _group_device(group)
    n = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    wait_work(group.allgather([sizes], [n]), deadline, f"{what} (sizes)")
    lengths = [int(s.item()) for s in sizes]
    cap = max(lengths)
    mine = torch.zeros(cap, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    outs = [torch.zeros(cap, dtype=torch.uint8, device=dev) for _ in range(world_size)]
    wait_work(group.allgather([outs], [mine.to(dev)]), deadline, what)
    return [bytes(o[:n].cpu().tolist()) for o, n in zip(outs, lengths)]


def _wire_fingerprints(plan: Plan) -> list[list[str]]:
    """``[name, hash of (meta, layout, bindings, slabs)]`` per wire tensor, in order."""
    out = []
    for w in plan.wires:
        h = hashlib.sha256()
        h.update(json.dumps([w.name, str(w.meta.dtype), list(w.meta.shape),
                             [pc.to_json() for pc in w.pieces], w.skipped,
                             [[b.worker, b.param, b.box, b.offset] for b in w.bindings]]).encode())
        h.update(np.ascontiguousarray(w.table, dtype="<i8").tobytes())
        out.append([w.name, h.hexdigest()[:16]])
    return out


def agree_on_plan(group, rank: int, world_size: int, plan: Plan | None, *,
                  timeout_s: float | None = None, deadline: Deadline | None = None,
                  error: str | None = None) -> None:
    """Check every rank built the same plan before any byte moves.

    All ranks exchange a per-wire-tensor fingerprint list (names, layouts,
    bindings, slabs). On any difference every rank raises, naming the first
    wire tensor that differs and the ranks involved. A rank that could not
    build a plan at all (its payload or model did not fit) passes
    ``plan=None`` and ``error``: every rank then raises that message, so a
    refusal on one side ends the session everywhere instead of leaving the
    others waiting.

    The exchange waits until ``deadline`` (the init's), else ``timeout_s``
    seconds from the call.

    Raises:
        PlanMismatchError: the plans differ, or some rank reported ``error``.
        TransferError: a peer did not answer by the deadline.
    """
    deadline = Deadline.of(deadline, timeout_s)
    if plan is None:
        payload = json.dumps({"error": error or "no plan"}).encode()
    else:
        payload = json.dumps({"digest": plan.digest(), "wires": _wire_fingerprints(plan),
                              "trainers": plan.num_trainer_ranks,
                              "workers": plan.num_workers}).encode()
    everyone = [json.loads(p) for p in _allgather_bytes(group, rank, world_size, payload,
                                                          deadline, f"rank {rank}: plan agreement")]
    for other_rank, other in enumerate(everyone):
        if "error" in other:
            raise PlanMismatchError(f"rank {rank}: rank {other_rank} refused the session: "
                                    f"{other['error']}; nothing was sent")
    ref = everyone[0]
    for other_rank, other in enumerate(everyone):
        if other["digest"] == ref["digest"]:
            continue
        a, b = ref["wires"], other["wires"]
        for i in range(max(len(a), len(b))):
            x = a[i] if i < len(a) else None
            y = b[i] if i < len(b) else None
            if x != y:
                def label(v):
                    return "nothing" if v is None else f"'{v[0]}'"
                raise PlanMismatchError(
                    f"rank {rank}: plans differ between rank 0 and rank {other_rank} at wire "
                    f"tensor #{i}: rank 0 has {label(x)}, rank {other_rank} has {label(y)}"
                    + ("" if x is None or y is None or x[0] != y[0] else
                       " (same name, different layout, bindings or slabs)")
                    + "; nothing was sent")
        raise PlanMismatchError(
            f"rank {rank}: plans differ between rank 0 and rank {other_rank} "
            f"({ref['trainers']}x{ref['workers']} vs {other['trainers']}x{other['workers']} "
            "ranks); nothing was sent")



#: Longest quote of one rank's report inside another rank's error (characters).
_REPORT_CHARS = 400


def _open_key(round_id) -> str:
    return f"verdict/{round_id}/open"


def _joined_key(round_id, worker: int) -> str:
    return f"verdict/{round_id}/joined/{worker}"


def join_round(store, round_id, worker: int) -> None:
    """Worker ``worker``: its ``update_weights`` of round ``round_id`` passed its checks.

    Called right before the worker posts its receives, so trainer rank 0
    (:func:`wait_workers_joined`) can tell a round the workers took part in
    from one they refused up front (or never heard of) while no trainer
    rank has posted a send yet: a send already waiting in gloo cannot be
    interrupted, so a refusal must be known before the first one.
    """
    store.set(_joined_key(round_id, worker), "")


def wait_workers_joined(store, round_id, *, num_workers: int, num_trainer_ranks: int,
                        deadline: Deadline, refused: Callable[[], str | None]) -> str | None:
    """Trainer rank 0: wait until all ``num_workers`` workers joined round ``round_id``.

    Returns ``None`` once every worker's :func:`join_round` is in; else the
    reason the round cannot start, for :func:`open_round`: ``refused()``
    (polled meanwhile; rank 0's ``update_weights`` call already failed, say
    the server or every worker refused it) when it returns a text, or, at
    ``deadline``, which workers did not join. Polls the store (1 to 10 ms
    apart); the workers join within moments of the call.

    Raises:
        RuntimeError: the store failed (it lives in this process: a bug).
    """
    keys = [_joined_key(round_id, w) for w in range(num_workers)]
    pause = 0.001
    while not store.check(keys):
        reason = refused()
        if reason is not None:
            return reason
        if deadline.expired():
            missing = [w for w, key in enumerate(keys) if not store.check([key])]
            who = ", ".join(rank_label(num_trainer_ranks + w, num_trainer_ranks) for w in missing)
            return (f"trainer rank 0: {who} did not join round {round_id} by "
                    f"{deadline.describe()} (update_weights never reached their receive)")
        time.sleep(min(pause, deadline.left()))
        pause = min(pause * 2, 0.01)
    return None


def open_round(store, round_id, error: str | None = None) -> None:
    """Trainer rank 0: round ``round_id`` has started on the inference side, or is aborted.

    Rank 0 makes the round's client calls (``start_weight_update``,
    ``update_weights``) alone; the other trainer ranks wait in
    :func:`wait_round_open` before they post a single send. Rank 0 calls
    this with ``error=None`` once every worker joined the round
    (:func:`wait_workers_joined`), or with ``error`` when it could not start
    the round: then it is aborted on every rank before any byte moved, the
    workers never asked or refusing up front, and ``error`` (``"trainer
    rank 0: start_weight_update failed: ..."``, ``"trainer rank 0:
    update_weights failed: ..."``) is the root cause every rank's
    :func:`finish_round` names first. Once per round.
    """
    store.set(_open_key(round_id), json.dumps({"error": error}))


def _aborted(store, round_id) -> str | None:
    """Rank 0's reason for aborting round ``round_id`` (:func:`open_round`).

    ``""`` when it opened the round, ``None`` when there is no word yet.
    """
    key = _open_key(round_id)
    if not store.check([key]):
        return None
    return json.loads(store.get(key))["error"] or ""


def _wait_key(store, key: str, until: float) -> bool:
    """Wait for ``key`` until ``until`` (``time.monotonic``); whether it is in.

    Event-driven (the store answers when the key is set).

    Raises:
        RuntimeError: the store stopped answering before ``until``.
    """
    try:
        # c10d treats a zero timeout as "wait forever": never pass one.
        store.wait([key], timedelta(seconds=max(until - time.monotonic(), 0.01)))
    except RuntimeError:
        if until - time.monotonic() > 0.05:     # (the store's clock counts whole ms)
            raise                               # the store is gone, not late
        return False
    return True


def wait_round_open(store, rank: int, round_id, deadline: Deadline) -> None:
    """Trainer ranks other than 0: wait, until ``deadline``, for rank 0's :func:`open_round`.

    Returns once rank 0 opened the round. Event-driven (the store answers
    when the key is set), so an open round costs one store round trip.

    Raises:
        RoundAbortedError: rank 0 aborted the round; the message quotes its
            reason (the inference side's refusal).
        TransferError: no word by ``deadline``.
        RuntimeError: the store stopped answering (rank 0 is gone); the
            verdict (:func:`finish_round`) says so.
    """
    key = _open_key(round_id)
    if not _wait_key(store, key, deadline.at):
        raise TransferError(f"trainer rank {rank}: trainer rank 0 did not start round {round_id} "
                            f"by {deadline.describe()}")
    reason = json.loads(store.get(key))["error"]
    if reason:
        raise RoundAbortedError(f"trainer rank {rank}: round {round_id} was not started: "
                                f"{reason}")


def _commit_key(round_id) -> str:
    return f"verdict/{round_id}/commit"


def report_commit(store, round_id, error: str | None = None, *, readers: int = 0,
                  until: float = 0.0) -> None:
    """Trainer rank 0, after a round every rank succeeded in: did the workers commit it?

    Only rank 0 calls ``finish_weight_update``; the other trainer ranks wait
    for this word in :func:`wait_commit`. ``error=None``: committed.
    Otherwise ``error`` (``"trainer rank 0: finish_weight_update failed:
    ..."``) is what every trainer rank raises; rank 0 is about to raise too
    and close the store it hosts, so it first waits, until ``until``
    (``time.monotonic``), for ``readers`` ranks to read it. After a commit
    the store's shutdown waits for them (:func:`wait_verdict_seen`,
    ``commit_readers``). Once per round; never raises for a store that is
    gone (a reader that died is the next session's problem).
    """
    key = _commit_key(round_id)
    try:
        store.set(key, json.dumps({"error": error}))
        while error is not None and store.add(key + "/read", 0) < readers \
                and time.monotonic() < until:
            time.sleep(0.005)
    except RuntimeError:
        pass


def wait_commit(store, rank: int, round_id, until: float) -> None:
    """Trainer ranks other than 0: wait, until ``until`` (``time.monotonic``), for
    rank 0's :func:`report_commit` of round ``round_id``; return once the workers committed.

    Event-driven: a commit costs one store round trip after rank 0's call.

    Raises:
        TransferError: the workers did not commit (rank 0's reason, named
            first), no word by ``until``, or the store stopped answering
            (rank 0 is gone).
    """
    key = _commit_key(round_id)
    me = f"trainer rank {rank}: round {round_id} failed"
    try:
        said = _wait_key(store, key, until)
        if said:
            reason = json.loads(store.get(key))["error"]
            store.add(key + "/read", 1)
    except RuntimeError as e:
        raise TransferError(
            f"{me}: the session store (hosted by trainer rank 0) stopped answering "
            f"({str(e).splitlines()[0]}) after every rank's part succeeded, so trainer rank 0 "
            "is dead or gone; whether the workers committed the round is unknown: check their "
            "weight_version") from e
    if not said:
        raise TransferError(f"{me}: trainer rank 0 did not say by the deadline whether the "
                            "workers committed the round; check their weight_version")
    if reason:
        raise TransferError(f"{me}: {reason}")


def wait_verdict_seen(store, round_id, world_size: int, timeout_s: float, *,
                      commit_readers: int = 0) -> bool:
    """On the store's host, before the store goes: wait until all ``world_size``
    ranks have read round ``round_id``'s verdict (``finish_round`` counts them),
    and ``commit_readers`` trainer ranks rank 0's commit word (:func:`wait_commit`).

    Without it the host (trainer rank 0) can return from its last round and
    shut down while a slower rank still polls the verdict, which then fails
    that rank's successful round with "the session store stopped answering".
    Returns whether every rank read it within ``timeout_s`` (seconds); never
    raises: a rank that died is the next session's problem, not this one's.
    """
    counts = ((f"verdict/{round_id}/read", world_size),
              (_commit_key(round_id) + "/read", commit_readers))
    until = time.monotonic() + timeout_s
    try:
        for key, n in counts:
            while store.add(key, 0) < n:
                if time.monotonic() >= until:
                    return False
                time.sleep(0.01)
    except RuntimeError:
        return False
    return True


def finish_round(store, rank: int, world_size: int, *, num_trainer_ranks: int, round_id,
                 error: str | None, deadline: Deadline | None = None,
                 timeout_s: float | None = None, grace_s: float = REPORT_GRACE_S,
                 on_reported: Callable[[], None] | None = None) -> None:
    """End a round on every rank with one verdict: all succeeded, or it failed.

    Each rank reports ``error`` (``None`` when its own part succeeded) under
    ``verdict/<round_id>/`` in the session's ``store`` (the ``TCPStore`` of
    :func:`create_group`, hosted by trainer rank 0), then collects everyone
    else's. The verdict goes through the store, not the process group, so a
    stalled rank cannot hold the others hostage: it is simply a rank that
    sent no report, and every other rank names it. A rank whose own part
    succeeded still learns that a worker lost data.

    Timing, with ``deadline`` the round's (else ``timeout_s`` from now):
    reports are collected until ``deadline`` + half of ``grace_s``; once
    some rank has reported a failure, for at most half of ``grace_s`` more
    (enough for the ranks that failed because of it to say so). Trainer
    rank 0 (the store's host) then stays until the ranks that reported have
    read the verdict, at most until ``deadline`` + 0.65 ``grace_s``. The
    rest of ``grace_s`` is slack for a loaded machine (where a few
    milliseconds of work can take a few hundred), so this returns or raises
    by ``deadline.at + grace_s`` on every rank that reaches it, and within
    ``grace_s`` of the first reported failure.

    A round that trainer rank 0 aborted before it started (:func:`open_round`
    with its reason: a worker refused ``start_weight_update``, or
    ``update_weights`` was refused before every worker joined) involves the
    trainer ranks alone (no send was posted; a worker that did join fails
    once the trainers close their connections, and is not waited for):
    reports are collected until every trainer rank's is in, and the message
    names rank 0's reason first.

    ``round_id`` must be new within the session (the trainer's round
    number); ``num_trainer_ranks`` names ranks in messages. ``on_reported``
    runs right after this rank's report is in the store, before waiting:
    a rank that failed closes its group connections there, so the peers
    blocked on it fail at once, and its own report is the earlier one.

    Raises:
        TransferError: the round failed. The message names, first, the ranks
            that sent no report (stalled, dead or cut off: the usual root
            cause when there are any), then the first failure reported (by
            report order) with its rank, then up to three more; its
            ``cause`` attribute holds that part alone. A round rank 0
            aborted: its reason first, then any trainer rank that sent no
            report, then failures other than the abort itself.
    """
    deadline = Deadline.of(deadline, timeout_s)
    me = rank_label(rank, num_trainer_ranks)
    prefix = f"verdict/{round_id}/"
    collect = 0.5 * grace_s
    hard = deadline.at + collect            # last moment to collect reports
    host_until = deadline.at + 0.65 * grace_s
    reports: dict[int, dict] = {}
    try:
        try:
            seq = store.add(prefix + "failed", 1) if error else 0
            store.set(prefix + f"rank{rank}", json.dumps({"error": error, "seq": seq}))
            store.add(prefix + "reported", 1)
        finally:
            if on_reported is not None:
                on_reported()
        first_failure_at = None
        aborted = None                  # rank 0's reason, if it aborted the round (open_round)
        expected = world_size
        pause = 0.005
        while True:
            reported = store.add(prefix + "reported", 0)
            failed = store.add(prefix + "failed", 0)     # read after: final once all reported
            if failed and aborted is None:
                # Rank 0 aborts (open_round) before it reports its own failure.
                aborted = _aborted(store, round_id)
                if aborted:
                    expected = num_trainer_ranks         # no trainer sent a byte
            now = time.monotonic()
            if reported >= expected:
                break
            if failed and first_failure_at is None:
                first_failure_at = now
            stop = hard if first_failure_at is None else min(hard, first_failure_at + collect)
            if now >= stop:
                break
            time.sleep(min(pause, stop - now))
            pause = min(pause * 2, 0.05)
        if reported >= world_size and not failed:
            # Seen: the store's host (trainer rank 0) keeps it up at shutdown
            # until every rank got here (wait_verdict_seen).
            store.add(prefix + "read", 1)
            return
        for r in range(world_size):
            key = prefix + f"rank{r}"
            if store.check([key]):
                reports[r] = json.loads(store.get(key))
        store.add(prefix + "read", 1)
        if rank == 0:
            # The store lives in this process: give the ranks that reported
            # (by now: a late one too) the time, within the bound, to read
            # the verdict before it goes.
            def unread() -> bool:
                return store.add(prefix + "read", 0) < max(len(reports),
                                                            store.add(prefix + "reported", 0))
            while unread() and time.monotonic() < host_until:
                time.sleep(0.02)
    except RuntimeError as e:                 # DistStoreError, DistNetworkError, ...
        raise TransferError(
            f"{me}: round {round_id} failed: the session store (hosted by trainer rank 0) "
            f"stopped answering ({str(e).splitlines()[0]}), so trainer rank 0 is dead or gone; "
            f"this rank's own part {'failed: ' + error if error else 'succeeded'}") from e

    def quote(r: int, msg: str) -> str:
        label = rank_label(r, num_trainer_ranks)
        names = [label + ": ", label.split(" (")[0] + ": "]     # "worker 0 (rank 2)", "worker 0"
        while any(msg.startswith(n) for n in names):         # said once, in front
            msg = msg[len(next(n for n in names if msg.startswith(n))):]
        kind, sep, rest = msg.partition(": ")                # "TransferError: trainer rank 1: ..."
        if sep and kind.isidentifier() and any(rest.startswith(n) for n in names):
            msg = f"{kind}: {rest[len(next(n for n in names if rest.startswith(n))):]}"
        if len(msg) > _REPORT_CHARS:
            msg = msg[:_REPORT_CHARS] + " ..."
        return f"{label}: {msg}"

    silent = [r for r in range(expected) if r not in reports]
    failures = sorted((doc["seq"], r, doc["error"]) for r, doc in reports.items() if doc["error"])
    parts = []
    if aborted:
        # The root cause is rank 0's; every trainer rank's report repeats it.
        parts.append(f"{aborted}; nothing was sent (trainer rank 0 stopped the round before "
                     "it started)")
        failures = [f for f in failures if aborted not in f[2]]
        if silent:
            who = ", ".join(rank_label(r, num_trainer_ranks) for r in silent)
            parts.append(f"{who} sent no report {deadline.elapsed():.1f} s into this rank's "
                         f"round (stalled, dead or cut off; timeout_s={deadline.seconds:g})")
        if failures:
            more = "; ".join(quote(r, msg) for _, r, msg in failures[:3])
            parts.append(f"{len(failures)} more rank(s) failed: {more}"
                         + (" ..." if len(failures) > 3 else ""))
        silent, failures = [], []
    if silent:
        who = ", ".join(rank_label(r, num_trainer_ranks) for r in silent)
        parts.append(f"{who} sent no report {deadline.elapsed():.1f} s into this rank's round "
                     f"(stalled, dead or cut off; timeout_s={deadline.seconds:g})")
    if failures:
        _, r, msg = failures[0]
        parts.append(f"first failure reported: {quote(r, msg)}")
        if len(failures) > 1:
            more = "; ".join(quote(r, msg) for _, r, msg in failures[1:4])
            parts.append(f"{len(failures) - 1} more rank(s) failed: {more}"
                         + (" ..." if len(failures) > 4 else ""))
    err = TransferError(f"{me}: round {round_id} failed: " + "; ".join(parts))
    err.cause = "; ".join(parts)
    raise err


def release_group(group) -> None:
    """Abort a stateless group's own work; never raises (``None``: nothing to do).

    A stateless group is not registered with ``torch.distributed``, so
    ``destroy_process_group`` does not apply: ``abort()`` stops this rank's
    own work (``shutdown()`` where there is no ``abort`` or it failed). Its
    connections close, and peers see "connection closed", only when the
    last reference to the group and to its pending work objects goes
    (gloo's ``abort()`` alone leaves the sockets open): callers drop
    theirs, and clear the frames of a failed round's traceback
    (``traceback.clear_frames``), which hold its work objects.
    """
    if group is None:
        return
    for name in ("abort", "shutdown"):
        fn = getattr(group, name, None)
        if callable(fn):
            try:
                fn()
                return
            except RuntimeError:
                pass
