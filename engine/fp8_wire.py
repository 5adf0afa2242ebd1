"""Mode 2, live: a round on the fp8 wire (``vllm:...,quant=fp8_per_block,wire=fp8``) over torch_p2p.

The trainer ranks quantize what they send in each worker's own 128 x 128
grid (``engine.quant_fp8``: the block math and ``plan_fp8``'s exchange plan);
the workers hand vLLM's online fp8 method the e4m3 bytes and float32 scales
in place of its own ``per_block_cast_to_fp8`` of the same worker-local
tensor (``engine.plugins.vllm_reload``, ``LayerwiseReload.prequantized``).
One round, on trainer rank ``r``:

1. **Partial maxima.** ``r`` reads its local tensors once
   (``source.iter_local()``) and takes, per block of every worker grid it
   feeds, ``max |x|`` in float32 of its own elements (after the cast to the
   parameter's dtype vLLM's loaders make).
2. **Exchange** (``torch.distributed`` point-to-point among trainer ranks,
   float32 scalars only, never weights). For each block several ranks feed
   (``Fp8Plan.feeders``), each non-leader feeder sends its partial maximum
   to the block's leader (its lowest feeder) and receives the block's amax
   back: one message each way per (rank, leader) pair, the blocks in
   ``(worker, parameter, block)`` order, which both ends derive from the
   slab table without asking.
3. **Scales.** Each block's leader sends the block's scale
   (``amax.clamp(1e-4) / 448``) to its worker: one float32 message per
   (trainer rank, worker) pair, before any weight byte.
4. **Bytes.** ``r`` reads its local tensors again and sends, through
   torch_p2p's own round (:func:`wire_plan`: the same slabs, buckets and
   messages, each quantized wire tensor carried as e4m3, one byte an
   element), ``(x * (1 / scale)).to(float8_e4m3fn)`` of each element with
   its destination block's scale.

Every wait counts down to the round's one ``Deadline``; a dead or stalled
peer is a ``TransferError`` naming it. The receive commits nothing: the
receiver commits only after every wire tensor landed and every rank agreed
(``engine.receiver``), as for the BF16 wire.

Linear ``weight`` and stacked experts (``w13_weight``/``w2_weight``, one
grid per expert) are carried. Experts whose hidden or local intermediate
dim is not a whole number of 128-blocks are quantized in vLLM's padded grid
(``Fp8PerBlockOnlineMoEMethod.maybe_roundup_sizes``: ``Fp8Target.fp8_shape``,
the padding zero, as ``per_block_cast_to_fp8`` sees it); the e4m3 bytes
travel in the wire's unpadded shape and the worker lays them into vLLM's
padded one (``LayerwiseReload._process``, ``quant_fp8.pad_experts``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from m2nkit.engine.control import TransferError, wait_work
from m2nkit.engine.deadline import Deadline
from m2nkit.engine.plan_types import Plan
from m2nkit.engine.quant_fp8 import (FP8_DTYPE, SCALE_BYTES, Fp8Plan, Fp8Target,
                                     block_partial_amax, piece_of, plan_fp8,
                                     quantize_region, scale_of_amax)

__all__ = ["fp8_wire_plan", "wire_plan", "Fp8WireSender", "Fp8WireReceiver",
           "SCALE_TAG", "PARTIAL_TAG", "AMAX_TAG"]

#: Tags of the fp8 wire's own messages. torch_p2p numbers each (trainer, worker) pair's
#: messages from 0 up (one per bucket and message), far below these.
SCALE_TAG = 1 << 24
PARTIAL_TAG = SCALE_TAG + 1
AMAX_TAG = SCALE_TAG + 2


def fp8_wire_plan(destination: Any, plan: Plan) -> Fp8Plan | None:
    """The ``Fp8Plan`` of a ``wire=fp8`` session (leaders and feeders kept), else ``None``.

    ``destination`` is the session's ``DestinationBuilder``; the quantized
    parameters are its word (``fp8_wire_targets(layout)``: the vLLM
    adapter's ``online_fp8_params``), so this runtime knows no vLLM table.
    Cached on ``plan``.

    Raises:
        ValueError: the builder's own (``online_fp8_params``).
    """
    targets_of = getattr(destination, "fp8_wire_targets", None)
    if targets_of is None:
        return None
    cache = plan.__dict__.setdefault("_m2nkit_fp8_wire", {})
    if "fp8" not in cache:
        rows = targets_of(plan.destination)
        if rows is None:
            cache["fp8"] = None
            return None
        targets = [Fp8Target(*r) for r in rows]
        cache["fp8"] = plan_fp8(plan, targets, with_leaders=True)
    return cache["fp8"]


def wire_plan(plan: Plan, fp8: Fp8Plan) -> Plan:
    """``plan`` with every wire tensor that lands in a quantized parameter carried as e4m3.

    Same slabs, boxes and order, so torch_p2p builds the same buckets and
    messages at one byte an element (cached on ``plan``).

    Raises:
        ValueError: a wire tensor that lands in both quantized and
            unquantized parameters (names it and both).
    """
    cache = plan.__dict__.setdefault("_m2nkit_fp8_wire", {})
    if "plan" in cache:
        return cache["plan"]
    wires = []
    for wp in plan.wires:
        q = [(b.worker, b.param) in fp8.targets for b in wp.bindings]
        if any(q) and not all(q):
            yes = next(b for b, ok in zip(wp.bindings, q) if ok)
            no = next(b for b, ok in zip(wp.bindings, q) if not ok)
            raise ValueError(f"wire=fp8: '{wp.name}' lands in quantized '{yes.param}' (worker "
                             f"{yes.worker}) and unquantized '{no.param}' (worker {no.worker}); "
                             "one wire tensor carries one dtype")
        if any(q) and not wp.skipped:
            wp = dataclasses.replace(wp, meta=_as_e4m3(wp.meta),
                                     _moved=None, _min=None, _local_shapes={})
        wires.append(wp)
    cache["plan"] = dataclasses.replace(plan, wires=wires)
    return cache["plan"]


def _as_e4m3(meta):
    """``meta`` (a ``ParamMeta``) carried as e4m3: same name, shape and source layout.

    A meta given by explicit pieces (``megatron_source``'s) holds the owners
    its pieces imply, which ``ParamMeta`` refuses beside ``pieces``.
    """
    if meta.pieces is not None:
        return dataclasses.replace(meta, dtype=FP8_DTYPE, owners=None)
    return dataclasses.replace(meta, dtype=FP8_DTYPE)


def _rank_slabs(plan: Plan, fp8: Fp8Plan, rank: int) -> dict[str, list]:
    """``{wire name: [(target, slab, dst region, [fp8 sub-regions])]}`` of ``rank``'s
    slabs into quantized parameters (cached on ``plan``)."""
    cache = plan.__dict__.setdefault("_m2nkit_fp8_wire", {})
    key = ("slabs", rank)
    if key not in cache:
        out: dict[str, list] = {}
        for wp in plan.wires:
            if wp.skipped:
                continue
            for slab in wp.slabs(src=rank):
                t = fp8.targets.get((slab.dst, slab.param))
                if t is None:
                    continue
                region = tuple((s, s + b - a) for s, (a, b) in zip(slab.dst_start, slab.box))
                out.setdefault(wp.name, []).append((t, slab, region, t.map_region(region)))
        cache[key] = out
    return cache[key]


def _leader_of_rows(rows: np.ndarray) -> np.ndarray:
    """Per row of ``Fp8Plan.feeders`` (sorted by block, then rank), its block's leader."""
    first = np.concatenate(([True], rows[1:, 0] != rows[:-1, 0])) if len(rows) else rows[:, 0]
    idx = np.maximum.accumulate(np.where(first, np.arange(len(rows)), 0)) if len(rows) else first
    return rows[idx, 1]


def _exchange_lists(fp8: Fp8Plan, rank: int):
    """``(to_leader, from_feeders)``: ``{peer: [(key, flat block)]}`` of the partial maxima
    ``rank`` sends to each leader, and receives from each feeder as a leader."""
    to_leader: dict[int, list] = {}
    from_feeders: dict[int, list] = {}
    for key in sorted(fp8.feeders):
        rows = fp8.feeders[key]
        lead = _leader_of_rows(rows)
        mine = rows[:, 1] == rank
        for flat, ld in zip(rows[mine & (lead != rank), 0].tolist(),
                            lead[mine & (lead != rank)].tolist()):
            to_leader.setdefault(ld, []).append((key, flat))
        for flat, f in zip(rows[(lead == rank) & (rows[:, 1] != rank), 0].tolist(),
                           rows[(lead == rank) & (rows[:, 1] != rank), 1].tolist()):
            from_feeders.setdefault(f, []).append((key, flat))
    return to_leader, from_feeders


def _scale_order(fp8: Fp8Plan, worker: int, rank: int) -> list[tuple[tuple[int, str], np.ndarray]]:
    """``[(key, flat indices into the target's grid)]`` of the scales trainer ``rank`` sends
    ``worker`` (the blocks it leads), parameters in name order, blocks in C order."""
    out = []
    for key in sorted(k for k in fp8.targets if k[0] == worker):
        leaders = fp8.leaders.get(key)
        if leaders is None:
            continue
        flat = np.nonzero(leaders.reshape(-1) == rank)[0]
        if len(flat):
            out.append((key, flat))
    return out


def _wait(works, deadline: Deadline) -> None:
    for work, what in works:
        wait_work(work, deadline, what)


class Fp8WireSender:
    """A trainer rank's transport on the fp8 wire: wraps its torch_p2p ``Transport``.

    ``send_round(plan, rank, stream, deadline=)`` runs the four steps of this
    module's docstring and returns the inner transport's report with the
    exchange and scale bytes added. ``quantize_seconds`` is the last round's
    time in partial maxima and quantization (both reads of the source).

    Args:
        inner: the rank's ``TorchP2PTransport`` (its ``group`` carries the
            exchange and the scales).
        plan: the session's (BF16) plan.
        fp8: :func:`fp8_wire_plan` of it.
        source: the rank's ``M2NWeightSource`` (read twice per round).
    """

    def __init__(self, inner: Any, plan: Plan, fp8: Fp8Plan, source: Any) -> None:
        self.inner, self.plan, self.fp8, self.source = inner, plan, fp8, source
        self.quantize_seconds = 0.0
        self.exchange_bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _partial_amax(self, rank: int, stream) -> dict[tuple[int, str], torch.Tensor]:
        by_name = {w.name: w for w in self.plan.wires}
        slabs = _rank_slabs(self.plan, self.fp8, rank)
        dtype = {(p.worker, p.name): p.dtype for p in self.plan.destination.params}
        amax: dict[tuple[int, str], torch.Tensor] = {}
        for name, local in stream:
            if by_name.get(name) is None:
                raise TransferError(f"trainer rank {rank}: source yielded '{name}', which is "
                                    "not in the manifest")
            for t, slab, region, subs in slabs.get(name, ()):
                k = (t.worker, t.param)
                x = local[slab.src_region].to(dtype[k])
                grid = amax.get(k)
                if grid is None:
                    grid = amax[k] = torch.zeros(self.fp8.grids.get(t.param, t.grid),
                                                 dtype=torch.float32)
                for sub in subs:
                    blocks, part = block_partial_amax(piece_of(x, region, sub, t), sub, t.block)
                    grid[blocks] = torch.maximum(grid[blocks], part)
        return amax

    def _exchange(self, rank: int, amax, deadline: Deadline) -> int:
        group = self.inner.group
        to_leader, from_feeders = _exchange_lists(self.fp8, rank)

        def grid_of(key):
            t = self.fp8.targets[key]
            g = amax.get(key)
            if g is None:       # fed by this rank only through shared blocks it leads: none
                g = amax[key] = torch.zeros(self.fp8.grids.get(t.param, t.grid),
                                            dtype=torch.float32)
            return g.view(-1)

        moved = 0
        works, inbox = [], {}
        for peer, items in sorted(to_leader.items()):
            buf = torch.stack([grid_of(k)[f] for k, f in items])
            works.append((group.send([buf], peer, PARTIAL_TAG),
                          f"trainer rank {rank}: fp8 partial maxima to trainer rank {peer}"))
            inbox[peer] = torch.empty(len(items), dtype=torch.float32)
            moved += buf.numel() * SCALE_BYTES
        partial = {}
        for peer, items in sorted(from_feeders.items()):
            partial[peer] = torch.empty(len(items), dtype=torch.float32)
            works.append((group.recv([partial[peer]], peer, PARTIAL_TAG),
                          f"trainer rank {rank}: fp8 partial maxima from trainer rank {peer}"))
        _wait(works, deadline)
        for peer, items in sorted(from_feeders.items()):
            for (k, f), v in zip(items, partial[peer].tolist()):
                g = grid_of(k)
                g[f] = max(float(g[f]), v)
        works = []
        for peer, items in sorted(from_feeders.items()):
            buf = torch.stack([grid_of(k)[f] for k, f in items])
            works.append((group.send([buf], peer, AMAX_TAG),
                          f"trainer rank {rank}: fp8 block amax to trainer rank {peer}"))
            moved += buf.numel() * SCALE_BYTES
        for peer in sorted(to_leader):
            works.append((group.recv([inbox[peer]], peer, AMAX_TAG),
                          f"trainer rank {rank}: fp8 block amax from trainer rank {peer}"))
        _wait(works, deadline)
        for peer, items in sorted(to_leader.items()):
            for (k, f), v in zip(items, inbox[peer].tolist()):
                grid_of(k)[f] = v
        return moved

    def _send_scales(self, rank: int, scales, deadline: Deadline) -> int:
        group, T = self.inner.group, self.plan.num_trainer_ranks
        works, moved = [], 0
        for w in range(self.plan.num_workers):
            parts = []
            for key, flat in _scale_order(self.fp8, w, rank):
                t = self.fp8.targets[key]
                grid = scales[key][tuple(slice(0, n) for n in t.grid)].reshape(-1)
                parts.append(grid[torch.from_numpy(flat)])
            if parts:
                buf = torch.cat(parts).contiguous()
                works.append((group.send([buf], T + w, SCALE_TAG),
                              f"trainer rank {rank}: fp8 block scales to worker {w}"))
                moved += buf.numel() * SCALE_BYTES
        _wait(works, deadline)
        return moved

    def _quantized(self, rank: int, stream, scales) -> Iterator[tuple[str, torch.Tensor]]:
        slabs = _rank_slabs(self.plan, self.fp8, rank)
        dtype = {(p.worker, p.name): p.dtype for p in self.plan.destination.params}
        e4m3 = {w.name for w in wire_plan(self.plan, self.fp8).wires if w.meta.dtype == FP8_DTYPE}
        for name, local in stream:
            items = slabs.get(name)
            if not items:
                # a wire tensor carried as e4m3 that this rank holds but sends none of (a
                # data-parallel replica whose twin sends it): its local tensor in the
                # manifest's dtype, nothing of it moves
                yield name, (torch.zeros(local.shape, dtype=FP8_DTYPE) if name in e4m3
                             else local)
                continue
            t0 = time.perf_counter()
            q = torch.zeros(local.shape, dtype=FP8_DTYPE)
            written = torch.zeros(local.shape, dtype=torch.bool)
            for t, slab, region, subs in items:
                k = (t.worker, t.param)
                x = local[slab.src_region].to(dtype[k])
                out, seen = q[slab.src_region], written[slab.src_region]
                for sub in subs:
                    val = quantize_region(piece_of(x, region, sub, t), sub, scales[k], t.block)
                    dst = piece_of(out, region, sub, t)
                    mask = piece_of(seen, region, sub, t)
                    if mask.any() and not torch.equal(dst.view(torch.uint8)[mask],
                                                      val.view(torch.uint8)[mask]):
                        raise TransferError(
                            f"trainer rank {rank}: '{name}' sends one element to two workers "
                            f"whose 128 x 128 grids give it different e4m3 values ('{t.param}' "
                            f"of worker {t.worker}); the fp8 wire carries one value an element")
                    dst.copy_(val)
                    mask.fill_(True)
            self.quantize_seconds += time.perf_counter() - t0
            yield name, q

    def send_round(self, plan: Plan, rank: int, stream: Iterable[tuple[str, torch.Tensor]], *,
                   deadline: Deadline | None = None):
        """The four steps (module docstring) on trainer ``rank``; ``stream`` feeds step 4."""
        from m2nkit.engine.transports.torch_p2p import P2PReport

        if plan is not self.plan:
            raise ValueError("Fp8WireSender.send_round: a plan other than the session's")
        deadline = Deadline.of(deadline, self.inner.timeout_s)
        t0 = time.perf_counter()
        amax = self._partial_amax(rank, self.source.iter_local())
        self.quantize_seconds = time.perf_counter() - t0
        if deadline.expired():
            raise TransferError(f"trainer rank {rank}: fp8 partial maxima took past "
                                f"{deadline.describe()}; the round is over")
        self.exchange_bytes = self._exchange(rank, amax, deadline)
        scales = {k: scale_of_amax(a) for k, a in amax.items()}
        moved = self.exchange_bytes + self._send_scales(rank, scales, deadline)
        report = self.inner.send_round(wire_plan(self.plan, self.fp8), rank,
                                       self._quantized(rank, stream, scales), deadline=deadline)
        return P2PReport(report.nbytes + moved)


class _Fp8Storage(Mapping):
    """The round's storage on the fp8 wire: e4m3 staging for the quantized parameters.

    A quantized parameter's name gives its e4m3 staging tensor (the
    worker-local shape, zeroed; made on first lookup, which also makes the
    reload materialize and track its layer) and hands it, with its scales,
    to the reload (``LayerwiseReload.prequantized``); every other name is
    the reload's own storage.
    """

    def __init__(self, inner: Mapping[str, torch.Tensor], targets: Mapping[str, Fp8Target],
                 scales: Mapping[str, torch.Tensor], reload: Any) -> None:
        self._inner, self._targets, self._scales, self._reload = inner, targets, scales, reload
        self._staged: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._targets.get(name)
        if t is None:
            return self._inner[name]
        if name not in self._staged:
            bf16 = self._inner[name]            # materializes and tracks the layer
            q = self._staged[name] = torch.zeros(t.shape, dtype=FP8_DTYPE, device=bf16.device)
            self._reload.prequantize(name, q, self._scales[name].to(bf16.device))
        return self._staged[name]

    def wires_received(self, names) -> None:
        notify = getattr(self._inner, "wires_received", None)
        if notify is not None:
            notify(names)

    def __iter__(self):
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class Fp8WireReceiver:
    """A worker's transport on the fp8 wire: wraps its torch_p2p ``Transport``.

    ``recv_round(plan, worker, storage, deadline=)`` first receives the
    block scales from their leaders (step 3), then the e4m3 bytes through
    the inner transport's round of :func:`wire_plan` into e4m3 staging
    (:class:`_Fp8Storage`), which the reload hands vLLM's quantization.

    Args:
        inner: the worker's ``TorchP2PTransport``.
        plan: the session's (BF16) plan; fp8: :func:`fp8_wire_plan` of it.
        reload: the worker's ``LayerwiseReload`` (``prequantize``).
    """

    def __init__(self, inner: Any, plan: Plan, fp8: Fp8Plan, reload: Any) -> None:
        self.inner, self.plan, self.fp8, self.reload = inner, plan, fp8, reload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _recv_scales(self, worker: int, deadline: Deadline) -> tuple[dict[str, torch.Tensor], int]:
        group, T = self.inner.group, self.plan.num_trainer_ranks
        grids = {k[1]: scale_of_amax(torch.zeros(t.grid)) for k, t in self.fp8.targets.items()
                 if k[0] == worker}          # a block with no feeder: vLLM's all-zero block
        works, bufs, moved = [], {}, 0
        for r in range(T):
            order = _scale_order(self.fp8, worker, r)
            n = sum(len(flat) for _, flat in order)
            if n:
                bufs[r] = (torch.empty(n, dtype=torch.float32), order)
                works.append((group.recv([bufs[r][0]], r, SCALE_TAG),
                              f"worker {worker} (rank {T + worker}): fp8 block scales from "
                              f"trainer rank {r}"))
                moved += n * SCALE_BYTES
        _wait(works, deadline)
        for r, (buf, order) in bufs.items():
            at = 0
            for (_, param), flat in order:
                grids[param].view(-1)[torch.from_numpy(flat)] = buf[at:at + len(flat)]
                at += len(flat)
        return grids, moved

    def recv_round(self, plan: Plan, worker: int, storage: Mapping[str, torch.Tensor], *,
                   deadline: Deadline | None = None):
        """Scales, then the e4m3 bytes (see the class); returns the inner round's result."""
        from m2nkit.engine.transports.torch_p2p import P2PReport

        if plan is not self.plan:
            raise ValueError("Fp8WireReceiver.recv_round: a plan other than the session's")
        deadline = Deadline.of(deadline, self.inner.timeout_s)
        try:
            scales, moved = self._recv_scales(worker, deadline)
        except TransferError as e:
            e.received, e.missing = [], sorted(w.name for w in plan.wires if w.sends_to(worker))
            raise
        targets = {t.param: t for k, t in self.fp8.targets.items() if k[0] == worker}
        done, report = self.inner.recv_round(wire_plan(self.plan, self.fp8), worker,
                                             _Fp8Storage(storage, targets, scales, self.reload),
                                             deadline=deadline)
        return done, P2PReport(report.nbytes + moved)
