"""``torch_p2p``: execute any plan with ``torch.distributed`` point-to-point ops.

Works over any backend (gloo over 127.0.0.1 on CPU, nccl on GPU) and any
layout, including those ``nccl.m2n`` cannot express. One process group holds
trainer ranks ``[0, T)`` and workers ``[T, T+N)`` (the rank numbering of
vLLM's ``m2n_common.py``). The group is *stateless* — built from its own
``TCPStore`` and ``ProcessGroup`` object, never the default group — so a
trainer that already runs FSDP or Megatron keeps its own world untouched.

Wire tensors are cut into *buckets*: consecutive tensors in manifest order,
closed once some rank would send or receive ``bucket_bytes``. Within a
bucket every (trainer, worker) pair exchanges at most one message: the
trainer packs its slabs for that worker into one staging buffer, straight
from the provider's local tensor; the worker unpacks each slab straight into
its vLLM-layout parameter. Both sides derive bucket boundaries and message
layouts from the plan alone, so no sizes are exchanged. Two buckets are in
flight at a time (pack the next while the last is on the wire), so a
trainer's extra memory stays near two buckets, not one model.

Every wait has a timeout; a dead or stalled peer becomes a ``TransferError``
naming the peer and the bucket, never a hang.
"""

from __future__ import annotations

import json
import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from m2nkit.engine.plan import Plan, WirePlan, next_local
from m2nkit.manifest.layout import rank_boxes

__all__ = [
    "TransferError",
    "PlanMismatchError",
    "create_group",
    "BucketSchedule",
    "agree_on_plan",
    "send_round",
    "recv_round",
]



class TransferError(RuntimeError):
    """A transfer failed: timeout, dead peer, or a stream out of order."""


class PlanMismatchError(TransferError):
    """Ranks disagree on the manifest or plan; nothing was moved."""


def create_group(host: str, port: int, rank: int, world_size: int, *, timeout_s: float,
                 backend: str = "gloo", prefix: str = "m2nkit"):
    """Join a stateless process group of ``world_size`` ranks.

    Rank 0 hosts the ``TCPStore`` at ``host:port``. Gloo binds to ``host``
    (use 127.0.0.1 on one machine). Returns ``(store, group)``.

    Raises:
        TransferError: the rendezvous did not complete within ``timeout_s``.
        ValueError: an unknown backend.
    """
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout,
                              wait_for_workers=False)
        store = dist.PrefixStore(prefix, store)
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
    except (RuntimeError, dist.DistStoreError) as e:
        raise TransferError(f"rank {rank}: rendezvous at {host}:{port} for {world_size} ranks "
                            f"failed within {timeout_s:g} s: {e}") from e
    return store, group


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
    if ok is False:
        raise TransferError(f"{what} did not complete within {timeout_s:g} s")


def _group_device(group) -> torch.device:
    """Where a group's collectives take tensors: CUDA for NCCL, else CPU."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None and isinstance(group, nccl):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _allgather_bytes(group, rank: int, world_size: int, payload: bytes, timeout_s: float,
                     what: str) -> list[bytes]:
    dev = _group_device(group)
    n = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    _wait(group.allgather([sizes], [n]), timeout_s, f"{what} (sizes)")
    lengths = [int(s.item()) for s in sizes]
    cap = max(lengths)
    mine = torch.zeros(cap, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    outs = [torch.zeros(cap, dtype=torch.uint8, device=dev) for _ in range(world_size)]
    _wait(group.allgather([outs], [mine.to(dev)]), timeout_s, what)
    return [bytes(o[:n].cpu().tolist()) for o, n in zip(outs, lengths)]


def _wire_fingerprints(plan: Plan) -> list[list[str]]:
    """``[name, hash of (meta, layout, bindings, slabs)]`` per wire tensor, in order."""
    out = []
    for w in plan.wires:
        h = hashlib.sha256()
        h.update(json.dumps([w.name, str(w.meta.dtype), list(w.meta.shape),
                             w.layout.to_json(), w.skipped,
                             [[b.worker, b.param, b.wire_box, b.offset] for b in w.bindings]]).encode())
        h.update(np.ascontiguousarray(w.table, dtype="<i8").tobytes())
        out.append([w.name, h.hexdigest()[:16]])
    return out


def agree_on_plan(group, rank: int, world_size: int, plan: Plan | None, *, timeout_s: float,
                  error: str | None = None) -> None:
    """Check every rank built the same plan before any byte moves.

    All ranks exchange a per-wire-tensor fingerprint list (names, layouts,
    bindings, slabs). On any difference every rank raises, naming the first
    wire tensor that differs and the ranks involved. A rank that could not
    build a plan at all (its payload or model did not fit) passes
    ``plan=None`` and ``error``: every rank then raises that message, so a
    refusal on one side ends the session everywhere instead of leaving the
    others waiting.

    Raises:
        PlanMismatchError: the plans differ, or some rank reported ``error``.
        TransferError: a peer did not answer within ``timeout_s``.
    """
    if plan is None:
        payload = json.dumps({"error": error or "no plan"}).encode()
    else:
        payload = json.dumps({"digest": plan.digest(), "wires": _wire_fingerprints(plan),
                              "trainers": plan.num_trainer_ranks,
                              "workers": plan.num_workers}).encode()
    everyone = [json.loads(p) for p in _allgather_bytes(group, rank, world_size, payload,
                                                          timeout_s, "plan agreement")]
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


@dataclass(frozen=True)
class BucketSchedule:
    """Bucket boundaries over ``plan.wires``: ``bounds[k]`` to ``bounds[k+1]``.

    A bucket closes once some trainer would send, or some worker receive,
    at least ``bucket_bytes`` in it; a single larger tensor is a bucket of
    its own. Derived from the plan alone, so every rank agrees.
    """

    bounds: tuple[int, ...]
    bucket_bytes: int

    @classmethod
    def build(cls, plan: Plan, bucket_bytes: int = 64 << 20) -> "BucketSchedule":
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        bounds = [0]
        send = np.zeros(plan.num_trainer_ranks, dtype=np.int64)
        recv = np.zeros(plan.num_workers, dtype=np.int64)
        for i, w in enumerate(plan.wires):
            if len(w.table):
                nb = w.slab_nbytes()
                send += np.bincount(w.table[:, 0], weights=nb, minlength=len(send)).astype(np.int64)
                recv += np.bincount(w.table[:, 1], weights=nb, minlength=len(recv)).astype(np.int64)
            if max(send.max(initial=0), recv.max(initial=0)) >= bucket_bytes:
                bounds.append(i + 1)
                send[:] = 0
                recv[:] = 0
        if bounds[-1] != len(plan.wires):
            bounds.append(len(plan.wires))
        return cls(tuple(bounds), bucket_bytes)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def wires(self, k: int) -> range:
        return range(self.bounds[k], self.bounds[k + 1])


def _aligned(n: int) -> int:
    # Messages need no padding: see ``_link_rows`` for why every slab is aligned.
    return n


def _link_rows(plan: Plan, wires: range, col: int, me: int, peer_col: int):
    """Per peer: the ``(wire index, row)`` slabs of one message, in packing order.

    Slabs are packed by falling element size (8, 4, 2, 1 bytes), then in
    manifest and plan order. Every slab's bytes are a multiple of its
    element size, so each slab then starts at an offset its dtype can be
    viewed at, with no padding: the message is exactly the slab bytes.
    """
    out: dict[int, list] = {}
    for wi in wires:
        t = plan.wires[wi].table
        if not len(t):
            continue
        sel = t[t[:, col] == me]
        for row in sel.tolist():
            out.setdefault(row[peer_col], []).append((wi, row))
    for rows in out.values():
        rows.sort(key=lambda item: -plan.wires[item[0]].itemsize)  # stable
    return out


def _row_region(wp: WirePlan, row):
    nd = len(wp.meta.shape)
    return row[3:3 + nd], row[3 + nd:3 + 2 * nd]


def _row_nbytes(wp: WirePlan, row) -> int:
    lo, hi = _row_region(wp, row)
    n = wp.itemsize
    for a, b in zip(lo, hi):
        n *= b - a
    return n


def send_round(group, plan: Plan, schedule: BucketSchedule, rank: int,
               stream: Iterable[tuple[str, torch.Tensor]], *, timeout_s: float,
               device: torch.device | str = "cpu") -> int:
    """Send this trainer rank's slabs of one round. Returns bytes sent.

    ``stream`` is the rank's ``iter_local()``: one ``(name, local tensor)``
    per owned wire tensor in manifest order; each provider runs once.

    Raises:
        TransferError: a stream out of manifest order or of the wrong shape,
            or a send that failed or timed out (names the worker and bucket).
    """
    it = iter(stream)
    owned_boxes = {}
    for wi, wp in enumerate(plan.wires):
        if rank in wp.layout.owners:
            owned_boxes[wi] = dict(rank_boxes(wp.layout, wp.meta.shape))[rank]
    in_flight: list[tuple[object, str]] = []
    sent = 0
    T = plan.num_trainer_ranks
    for k in range(len(schedule)):
        wires = schedule.wires(k)
        links = _link_rows(plan, wires, 0, rank, 1)
        buffers = {dst: torch.empty(sum(_aligned(_row_nbytes(plan.wires[wi], r)) for wi, r in rows),
                                    dtype=torch.uint8, device=device)
                   for dst, rows in links.items()}
        cursor = {dst: 0 for dst in links}
        by_wire: dict[int, list] = {}
        for dst, rows in links.items():
            for wi, r in rows:
                by_wire.setdefault(wi, []).append((dst, r))
        for wi in wires:
            if wi not in owned_boxes:
                continue
            wp = plan.wires[wi]
            box = owned_boxes[wi]
            local = next_local(it, wp, rank, box, error=TransferError)
            for dst, r in by_wire.get(wi, ()):
                lo, hi = _row_region(wp, r)
                piece = local[tuple(slice(a - s, b - s) for a, b, (s, _) in zip(lo, hi, box))]
                n = piece.numel() * wp.itemsize
                c = cursor[dst]
                buffers[dst][c:c + n].view(wp.meta.dtype).view(piece.shape).copy_(piece)
                cursor[dst] = c + _aligned(n)
        # Keep at most one earlier bucket in flight: wait for it now.
        for work, what in in_flight:
            _wait(work, timeout_s, what)
        in_flight = []
        for dst, buf in buffers.items():
            what = f"trainer rank {rank}: send of bucket {k} to worker {dst}"
            try:
                work = group.send([buf], T + dst, k)
            except RuntimeError as e:
                raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
            in_flight.append((work, what))
            sent += buf.numel()
    for work, what in in_flight:
        _wait(work, timeout_s, what)
    leftover = next(it, None)
    if leftover is not None:
        raise TransferError(f"trainer rank {rank}: source yielded '{leftover[0]}' after the last "
                            "wire tensor of the manifest")
    return sent


def recv_round(group, plan: Plan, schedule: BucketSchedule, worker: int,
               storage: Mapping[str, torch.Tensor], *, timeout_s: float,
               device: torch.device | str = "cpu") -> tuple[set[str], int]:
    """Receive this worker's slabs of one round straight into ``storage``.

    Returns ``(names of wire tensors fully received, bytes received)``. On
    failure raises ``TransferError`` whose ``received`` attribute lists the
    wire tensors that did arrive whole and ``missing`` the others.
    """
    expected = {plan.wires[wi].name for wi in range(len(plan.wires))
                if len(plan.wires[wi].table) and (plan.wires[wi].table[:, 1] == worker).any()}
    done: set[str] = set()
    got = 0
    T = plan.num_trainer_ranks
    me = T + worker

    def post(k):
        links = _link_rows(plan, schedule.wires(k), 1, worker, 0)
        posted = []
        for src, rows in sorted(links.items()):
            n = sum(_aligned(_row_nbytes(plan.wires[wi], r)) for wi, r in rows)
            buf = torch.empty(n, dtype=torch.uint8, device=device)
            what = f"worker {worker} (rank {me}): receive of bucket {k} from trainer rank {src}"
            try:
                work = group.recv([buf], src, k)
            except RuntimeError as e:
                raise TransferError(f"{what} failed: {str(e).splitlines()[0]}") from e
            posted.append((src, rows, buf, work, what))
        return posted

    try:
        pending = post(0) if len(schedule) else []
        for k in range(len(schedule)):
            current = pending
            pending = post(k + 1) if k + 1 < len(schedule) else []
            for src, rows, buf, work, what in current:
                _wait(work, timeout_s, what)
                c = 0
                for wi, r in rows:
                    wp = plan.wires[wi]
                    b = wp.bindings[r[2]]
                    lo, hi = _row_region(wp, r)
                    n = _row_nbytes(wp, r)
                    region = tuple(slice(off + a - w0, off + c2 - w0)
                                   for off, a, c2, (w0, _) in zip(b.offset, lo, hi, b.wire_box))
                    dst = storage[b.param][region]
                    dst.copy_(buf[c:c + n].view(wp.meta.dtype).view(dst.shape))
                    c += _aligned(n)
                got += buf.numel()
            for wi in schedule.wires(k):
                name = plan.wires[wi].name
                if name in expected:
                    done.add(name)
    except TransferError as e:
        e.received = sorted(done)
        e.missing = sorted(expected - done)
        raise
    return done, got


def finish_round(group, rank: int, world_size: int, *, error: str | None, timeout_s: float) -> None:
    """End a round on every rank with one verdict: all succeeded, or it failed.

    Each rank reports ``error`` (``None`` when its own part succeeded); ranks
    exchange reports. A rank whose sends finished still learns that a worker
    lost data, and a stalled or dead rank turns into a timeout or connection
    error here instead of a silent success elsewhere.

    Raises:
        TransferError: some rank reported an error (the message names every
            failing rank), or the exchange itself failed or timed out.
    """
    payload = json.dumps({"error": error}).encode()
    everyone = [json.loads(p) for p in _allgather_bytes(group, rank, world_size, payload,
                                                          timeout_s, "end-of-round status")]
    failed = [(r, e["error"]) for r, e in enumerate(everyone) if e.get("error")]
    if failed:
        listed = "; ".join(f"rank {r}: {msg}" for r, msg in failed[:4])
        raise TransferError(f"rank {rank}: the round failed on {len(failed)} rank(s): {listed}")
