"""The colocated baseline: full tensors per parameter over shared memory, as vLLM's ``ipc`` does.

What m2nkit's ``ipc`` transport is measured against (``benchmarks/colocated.py``,
``m2nkit demo --colocated``). It is the way colocated RL stacks move
weights today, restated on CPU shared memory:

* vLLM 0.33.0's ``ipc`` weight-transfer backend
  (``vllm/distributed/weight_transfer/ipc_engine.py``): the trainer sends,
  per parameter, a CUDA IPC handle of the *full* tensor; every worker
  rebuilds the full tensor from it (``func(*args)`` of the pickled
  ``reduce_tensor`` handle) and hands it to ``load_weights``, which keeps
  its slice;
* verl / NeMo-RL / TRL colocate: ``DTensor.full_tensor()`` (or a Megatron
  export) of each parameter before its handle is taken.

Per wire tensor in manifest order (:func:`full_tensor_ipc_round`): the
``T`` trainer ranks all-gather the full tensor (padded chunks, as FSDP2
does) into a shared-memory buffer of their own, kept across tensors and
rounds; trainer rank 0 publishes the handle of its full tensor (plain JSON,
``m2nkit.engine.transports.ipc.expose``); every worker maps the full
tensor, copies the boxes of its bindings from it (the narrowing of vLLM's
``weight_loader``) and says it is done, and rank 0 waits for all of them
before the next tensor reuses its buffer. Not a transport m2nkit offers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Mapping

import torch

from m2nkit.engine.control import TransferError, wait_work
from m2nkit.engine.plan_types import Plan, next_local
from m2nkit.engine.transports.ipc import expose, open_handle
from m2nkit.manifest.pieces import box_slices

__all__ = ["FullIpcBytes", "SharedPool", "full_tensor_ipc_round"]


@dataclass
class FullIpcBytes:
    """One rank's round: ``gathered`` (all-gather bytes it sent), ``assembled`` (bytes of
    full tensors it put together), ``copied`` (bytes a worker copied into its parameters)."""

    gathered: int = 0
    assembled: int = 0
    copied: int = 0


class SharedPool:
    """A grow-only uint8 buffer in shared memory (exposed once per size)."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.handle: dict | None = None

    def reserve(self, n: int) -> torch.Tensor:
        if n > self.buf.numel():
            self.buf = torch.empty(0, dtype=torch.uint8)
            self.buf = torch.empty(n, dtype=torch.uint8)
            self.handle = expose(self.buf)
        return self.buf


def _wait(store, key: str, seconds: float, what: str) -> str:
    try:
        store.wait([key], timedelta(seconds=max(seconds, 0.01)))
    except Exception as e:  # noqa: BLE001 - a store timeout
        raise TransferError(f"{what} did not come within {seconds:g} s ({e})") from None
    return store.get(key).decode()


def full_tensor_ipc_round(store, trainer_group, plan: Plan, rank: int, round_id: int, *,
                          stream: Iterable[tuple[str, torch.Tensor]] | None = None,
                          storage: Mapping[str, torch.Tensor] | None = None,
                          pool: SharedPool | None = None, timeout_s: float) -> FullIpcBytes:
    """One round of the baseline (module docstring) on ``rank`` of ``T + N``.

    Trainer ranks ``[0, T)`` pass ``trainer_group`` (a gloo group of the
    trainer ranks, ``baseline.create_trainer_group``), ``stream`` (their
    ``iter_local()``) and a ``pool`` kept across rounds; workers pass
    ``storage``. ``round_id`` keys the store (one per round, the same on
    every rank). ``timeout_s`` bounds each wait.

    Raises:
        TransferError: a stream out of order, a collective or a wait that
            failed or timed out, a worker's error.
    """
    T, N = plan.num_trainer_ranks, plan.num_workers
    out = FullIpcBytes()
    prefix = f"m2nkit/full-ipc/{round_id}"
    if rank >= T:
        worker = rank - T
        for wi, wp in enumerate(plan.wires):
            if wp.skipped:
                continue
            what = f"worker {worker}: the full tensor '{wp.name}' from trainer rank 0"
            h = json.loads(_wait(store, f"{prefix}/{wi}", timeout_s, what))
            try:
                full = open_handle(h, what)          # "rebuild" the full tensor (a mapping)
                for b in wp.bindings:
                    if b.worker == worker:
                        storage[b.param][box_slices(b.region)].copy_(full[box_slices(b.box)])
                        out.copied += math.prod(hi - lo for lo, hi in b.box) * wp.itemsize
                del full
                store.set(f"{prefix}/{wi}/w{worker}", "ok")
            except Exception as e:
                store.set(f"{prefix}/{wi}/w{worker}", f"worker {worker}: {e}")
                raise
        return out
    it = iter(stream)
    for wi, wp in enumerate(plan.wires):
        local = next_local(it, wp, rank, error=TransferError) if wp.meta.holds(rank) else None
        if wp.skipped:
            continue
        shapes = {r: wp.meta.local_shape(r) for r in wp.owners}
        chunk = max(math.prod(sh) for sh in shapes.values()) * wp.itemsize
        mine = torch.zeros(chunk, dtype=torch.uint8)
        if local is not None and local.numel():
            mine[:local.numel() * wp.itemsize].copy_(
                local.contiguous().reshape(-1).view(torch.uint8))
        outs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(T)]
        wait_work(trainer_group.allgather([outs], [mine]), timeout_s,
                  f"trainer rank {rank}: all-gather of '{wp.name}'")
        out.gathered += (T - 1) * chunk
        buf = pool.reserve(wp.meta.nbytes)
        full = buf[:wp.meta.nbytes].view(wp.meta.dtype).view(wp.meta.shape)
        for pc in wp.pieces:                          # DTensor.full_tensor()
            sh = shapes[pc.rank]
            held = outs[pc.rank][:math.prod(sh) * wp.itemsize].view(wp.meta.dtype).view(sh)
            full[box_slices(pc.box)].copy_(held[box_slices(pc.local_box)])
        out.assembled += wp.meta.nbytes
        del outs, mine
        if rank == 0:
            h = {**pool.handle, "offset": 0, "dtype": str(wp.meta.dtype).removeprefix("torch."),
                 "shape": list(full.shape), "stride": list(full.stride())}
            store.set(f"{prefix}/{wi}", json.dumps(h))
            for w in range(N):
                answer = _wait(store, f"{prefix}/{wi}/w{w}", timeout_s,
                               f"trainer rank 0: worker {w}'s copy of '{wp.name}'")
                if answer != "ok":
                    raise TransferError(answer)
    return out
