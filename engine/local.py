"""Run a plan inside one process: every trainer rank's source, every worker's storage.

This is the executor behind ``m2nkit plan --verify`` and the planner tests:
it proves a plan moves the right bytes to the right places before any
process group exists. It follows the transports' rules — each rank's source
is read once per round in manifest order, one local tensor at a time, and
slabs are copied from the local tensor straight into the destination
region, never through a full tensor.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from m2nkit.manifest.destination import DestinationLayout

from .plan import Plan, next_local

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
    """Copy every slab of ``plan`` from trainer-local tensors into worker storage.

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
    iters = {r: iter(s) for r, s in local_streams.items()}
    for wp in plan.wires:
        local: dict[int, torch.Tensor] = {}
        for rank in wp.owners:
            it = iters.get(rank)
            if it is None:
                raise ValueError(f"no local stream for trainer rank {rank}, an owner of "
                                 f"'{wp.name}'")
            local[rank] = next_local(it, wp, rank)
        if wp.skipped:
            continue
        for slab in wp.slabs():
            storage[slab.dst][slab.param][slab.dst_region] = local[slab.src][slab.src_region]
        local.clear()
    for rank, it in iters.items():
        extra = next(it, None)
        if extra is not None:
            raise ValueError(f"trainer rank {rank} yielded '{extra[0]}' after the last "
                             "tensor of the manifest")


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and bytes (NaN-safe)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
