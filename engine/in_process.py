"""Run a plan inside one process: every trainer rank's source, every worker's storage.

This is the executor behind ``m2nkit plan --verify`` and the planner tests:
it proves a plan moves the right bytes to the right places before any
process group exists. It follows the transports' rules — each rank's source
is read once per round in manifest order, one local tensor at a time, and
slabs travel in the transport's own messages (``torch_p2p``'s buckets,
packing, zero-copy targets and casts), copied in memory instead of sent,
never through a full tensor.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from m2nkit.manifest.destination import DestinationLayout

from .plan_types import Plan
from .transports.torch_p2p import exchange_in_process

__all__ = ["allocate_storage", "execute_plan", "bitwise_equal"]


def allocate_storage(destination: DestinationLayout, worker: int,
                     fill: float = float("nan")) -> dict[str, torch.Tensor]:
    """One worker's vLLM-layout storage, ``{param: tensor}``.

    Filled with ``fill`` (NaN by default, so an element no slab writes is
    caught), except the declared zero regions (vocab padding), which are 0
    as in vLLM's loaders.
    """
    storage = {}
    for p in destination.params:
        if p.worker != worker:
            continue
        t = torch.full(p.shape, fill, dtype=p.dtype) if p.dtype.is_floating_point \
            else torch.zeros(p.shape, dtype=p.dtype)
        for z in p.zero_boxes:
            t[tuple(slice(a, b) for a, b in z)] = 0
        storage[p.name] = t
    return storage


def execute_plan(
    plan: Plan,
    local_streams: Mapping[int, Iterable[tuple[str, torch.Tensor]]],
    storage: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Move every slab of ``plan`` from trainer-local tensors into worker storage, in-process.

    Runs the ``torch_p2p`` transport's own message path
    (``torch_p2p.exchange_in_process``): the same buckets, packed and
    direct messages, zero-copy targets and casts into the parameters'
    dtype as a real round, with a byte copy in place of each send and
    receive. So what passes here passes the transport's receive path too.

    Args:
        plan: the plan.
        local_streams: trainer rank -> its ``iter_local()`` stream, yielding
            ``(wire name, local tensor)`` for the tensors it owns, in
            manifest order (``WeightSource.iter_local`` contract).
        storage: worker -> ``{param: tensor}`` (``allocate_storage``).

    Raises:
        ValueError: a stream yields a name out of manifest order, ends
            early, or a local tensor does not hold the rank's pieces
            (names the rank and tensor).
    """
    exchange_in_process(plan, local_streams, storage, error=ValueError)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
