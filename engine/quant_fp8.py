"""FP8 block quantization on the trainer (mode 2): the math, the block grid, the amax exchange.

A vLLM worker serving ``quantization="fp8_per_block"`` loads BF16 weights and
then quantizes **its own local partition** in 128 x 128 blocks
(``vllm/model_executor/layers/quantization/online/fp8.py``
``Fp8PerBlockOnlineLinearMethod.process_weights_after_loading`` and
``Fp8PerBlockOnlineMoEMethod.process_weights_after_loading``, both through
``vllm/utils/deep_gemm.py`` ``per_block_cast_to_fp8`` with
``use_ue8m0=False``). Per block of the worker-local tensor, zero-padded to
whole blocks:

* ``amax = max |x|`` taken in float32, clamped at ``1e-4``;
* ``scale = amax / finfo(float8_e4m3fn).max`` (a Python float divisor, as
  vLLM writes it; ``quant_utils.get_fp8_min_max``);
* ``q = (x * (1.0 / scale)).to(float8_e4m3fn)``;

stored as ``weight`` (e4m3, local shape) and ``weight_scale_inv`` (float32,
``ceil(local shape / 128)``; experts ``[E_local, ...]``, one grid per
expert). Online fp8 never rounds scales to UE8M0 (``use_ue8m0=False`` in
both methods); that rounding belongs to checkpoint-format DeepSeek-V3.2
(``scale_fmt: ue8m0``), mode 3.

Sending e4m3 bytes instead of BF16 halves the wire, but a trainer rank
holds only part of most blocks: a block of a fused ``qkv_proj`` gathers q
and k rows, an FSDP shard boundary cuts a block in two. Such a block's
``amax`` is the max of its parts' maxima, so the ranks that feed it
exchange one float32 partial maximum each (to the block's *leader*, the
lowest contributing rank) and get the block's amax back, before any byte
moves. Only these scalars are exchanged, never weights; which ranks meet
at which block is read from the slab table (:func:`plan_fp8`), so every
rank knows the exchange without asking. Because max is exact and the
rest is elementwise with the same operations vLLM uses, the e4m3 bytes
and scales equal vLLM's own, bit for bit (the integration tests hold
them against a fresh vLLM load with ``quantization="fp8_per_block"``).

This module knows no model family and no vLLM table: which parameters are
quantized, and their padded shapes, come in as :class:`Fp8Target` from
``m2nkit.adapters.vllm.fp8``. It does not move bytes between processes;
:func:`execute_fp8_in_process` runs the trainer-side algorithm inside one
process (``m2nkit plan --verify``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import torch

from m2nkit.engine.plan_types import Plan, SlabTable

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "AMAX_MIN", "SCALE_BYTES", "Fp8Target",
           "Fp8Plan", "plan_fp8", "block_partial_amax", "scale_of_amax", "piece_of",
           "quantize_region", "pad_experts", "execute_fp8_in_process"]

#: vLLM online ``fp8_per_block``: ``weight_block_size = [128, 128]`` (online/fp8.py).
BLOCK = (128, 128)
#: ``current_platform.fp8_dtype()`` on CUDA and CPU.
FP8_DTYPE = torch.float8_e4m3fn
#: ``get_fp8_min_max()[1]`` (``quant_utils.py``: ``torch.finfo(fp8_dtype).max``, 448.0).
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: ``per_block_cast_to_fp8``: ``amax(...).clamp(1e-4)``.
AMAX_MIN = 1e-4
#: One block scale or partial maximum on the wire: float32.
SCALE_BYTES = 4


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8Target:
    """One worker-local parameter vLLM quantizes, and how its BF16 layout maps onto it.

    Attributes:
        worker: the worker.
        param: the BF16 destination parameter the plan's slabs land in
            (vLLM's name, ``...qkv_proj.weight``, ``...w13_weight``).
        scale: the scale's vLLM name (``param`` + ``_scale_inv``).
        shape: the BF16 local shape the slabs address (``[N, K]``, experts
            ``[E_local, rows, cols]``).
        fp8_shape: the shape vLLM quantizes: ``shape``, or for experts the
            rows per shard and the columns rounded up to 128
            (``Fp8PerBlockOnlineMoEMethod.maybe_roundup_sizes``).
        row_shards: experts ``w13``: 2 (gate rows, then up rows, each
            padded on its own, ``moe_base._zero_padding``); else 1.

    Raises:
        ValueError: shapes of different rank, an fp8 shape smaller than
            the BF16 one, or rows that do not split into ``row_shards``.
    """

    worker: int
    param: str
    scale: str
    shape: tuple[int, ...]
    fp8_shape: tuple[int, ...]
    row_shards: int = 1

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.fp8_shape) or len(self.shape) not in (2, 3):
            raise ValueError(f"fp8 target {self.param!r}: shape {self.shape} and fp8 shape "
                             f"{self.fp8_shape} must both be 2-D or 3-D")
        if any(a > b for a, b in zip(self.shape, self.fp8_shape)):
            raise ValueError(f"fp8 target {self.param!r}: fp8 shape {self.fp8_shape} is "
                             f"smaller than the loaded shape {self.shape}")
        rows = -2
        if self.shape[rows] % self.row_shards or self.fp8_shape[rows] % self.row_shards:
            raise ValueError(f"fp8 target {self.param!r}: rows {self.shape[rows]} / "
                             f"{self.fp8_shape[rows]} do not split into {self.row_shards} shards")

    @property
    def block(self) -> tuple[int, ...]:
        """Block extent per dim: ``(128, 128)``, experts ``(1, 128, 128)``."""
        return (1,) * (len(self.shape) - 2) + BLOCK

    @property
    def grid(self) -> tuple[int, ...]:
        """Scale shape: ``ceil(fp8_shape / block)``."""
        return tuple(_ceil(a, b) for a, b in zip(self.fp8_shape, self.block))

    def map_region(self, region: tuple[tuple[int, int], ...]) -> list[tuple[tuple[int, int], ...]]:
        """Where a box of the BF16 parameter lies in the fp8 one (one box per row shard hit).

        Rows of shard ``s`` (``[s*r, (s+1)*r)`` with ``r = shape[-2] / row_shards``)
        move to ``[s*R, s*R + r)``, ``R = fp8_shape[-2] / row_shards``; other dims
        keep their coordinates (padding is appended).
        """
        if self.row_shards == 1:
            return [tuple(region)]
        r = self.shape[-2] // self.row_shards
        R = self.fp8_shape[-2] // self.row_shards
        lo, hi = region[-2]
        out = []
        for s in range(self.row_shards):
            a, b = max(lo, s * r), min(hi, (s + 1) * r)
            if a < b:
                moved = (a - s * r + s * R, b - s * r + s * R)
                out.append((*region[:-2], moved, region[-1]))
        return out


def pad_experts(x: torch.Tensor, padded_shape: tuple[int, ...], row_shards: int = 1,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` laid out in vLLM's padded expert shape, zeros elsewhere.

    Rows ``[s*r, (s+1)*r)`` of shard ``s`` (``r = x.shape[-2] / row_shards``)
    land at ``[s*R, s*R + r)`` (``R = padded_shape[-2] / row_shards``), the
    columns at ``[0, x.shape[-1])``: where vLLM's expert loaders write an
    unpadded checkpoint tensor into the padded parameter
    (``RoutedExperts._load_w13`` / ``_load_w2``: gate rows then up rows,
    each narrowed on its own, ``_narrow_expert_data_for_padding``) and what
    ``OnlineMoEMethodBase.get_weights_for_quantization``'s ``pad_moe_weights``
    computes. ``out`` (``padded_shape``, ``x``'s dtype) is written in place
    (not zeroed first); else a new zero tensor is returned.

    Raises:
        ValueError: ``padded_shape`` smaller than ``x`` in some dim, of
            another rank, or rows that do not split into ``row_shards``.
    """
    shape = tuple(x.shape)
    if len(shape) != len(padded_shape) or any(a > b for a, b in zip(shape, padded_shape)) \
            or shape[-2] % row_shards or padded_shape[-2] % row_shards:
        raise ValueError(f"cannot pad a {list(shape)} tensor to {list(padded_shape)} in "
                         f"{row_shards} row shards")
    if out is None:
        out = torch.zeros(padded_shape, dtype=x.dtype, device=x.device)
    r, R = shape[-2] // row_shards, padded_shape[-2] // row_shards
    for s in range(row_shards):
        out[..., s * R:s * R + r, :shape[-1]] = x[..., s * r:(s + 1) * r, :]
    return out


def block_partial_amax(x: torch.Tensor, region: tuple[tuple[int, int], ...],
                       block: tuple[int, ...]) -> tuple[tuple[slice, ...], torch.Tensor]:
    """Per-block ``max |x|`` (float32) of a piece ``x`` lying at ``region`` of the fp8 grid.

    Returns ``(blocks, amax)``: the index of the blocks the region touches
    and their partial maxima (not clamped: the clamp comes after the
    exchange). ``abs`` in ``x``'s dtype, then ``float()``, then ``amax``,
    as ``per_block_cast_to_fp8`` does; the zero fill stands for elements
    other ranks hold and for vLLM's padding (max is neutral to 0).
    """
    lo = [a // b * b for (a, _), b in zip(region, block)]
    hi = [_ceil(e, b) * b for (_, e), b in zip(region, block)]
    buf = torch.zeros([h - l for l, h in zip(lo, hi)], dtype=x.dtype)
    buf[tuple(slice(a - l, e - l) for (a, e), l in zip(region, lo))] = x
    nd = len(block)
    view_shape, red = [], []
    for i, (n, b) in enumerate(zip(buf.shape, block)):
        view_shape += [n // b, b]
        red.append(2 * i + 1)
    amax = buf.view(view_shape).abs().float().amax(dim=tuple(red))
    blocks = tuple(slice(l // b, h // b) for l, h, b in zip(lo, hi, block))
    assert amax.dim() == nd
    return blocks, amax


def scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax.clamp(1e-4) / FP8_MAX`` (float32): vLLM's ``sf`` before the UE8M0 option."""
    return amax.float().clamp(AMAX_MIN) / FP8_MAX


def quantize_region(x: torch.Tensor, region: tuple[tuple[int, int], ...],
                    scale_grid: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """e4m3 of a piece ``x`` lying at ``region`` of a parameter whose block scales are ``scale_grid``.

    ``(x * (1.0 / scale)).to(float8_e4m3fn)`` element by element, ``scale``
    the scale of the element's block: the expression of
    ``per_block_cast_to_fp8`` (a BF16 ``x`` times a float32 reciprocal
    computes in float32).
    """
    recip = 1.0 / scale_grid
    idx = []
    for (a, e), b in zip(region, block):
        pos = torch.arange(a, e) // b
        idx.append(pos)
    sub = recip
    for d, pos in enumerate(idx):
        sub = sub.index_select(d, pos)
    return (x * sub).to(FP8_DTYPE)


def piece_of(x: torch.Tensor, region: tuple[tuple[int, int], ...],
             sub: tuple[tuple[int, int], ...], t: Fp8Target) -> torch.Tensor:
    """The part of ``x`` (lying at ``region`` of ``t``'s BF16 parameter) that
    ``t.map_region`` moved to ``sub`` (a view; row shards split a box)."""
    if t.row_shards == 1:
        return x
    r, R = t.shape[-2] // t.row_shards, t.fp8_shape[-2] // t.row_shards
    s = sub[-2][0] // R
    start = sub[-2][0] - s * R + s * r - region[-2][0]
    return x.narrow(x.dim() - 2, start, sub[-2][1] - sub[-2][0])


@dataclass
class Fp8Plan:
    """The mode-2 (fp8 wire) overlay of a ``Plan``: which blocks each rank feeds, what moves.

    Attributes:
        targets: ``{(worker, param): Fp8Target}`` of the quantized parameters.
        blocks: scale blocks over all targets (every worker's own).
        shared_blocks: blocks fed by more than one trainer rank (their amax
            needs the exchange).
        multi_wire_blocks: blocks fed by more than one wire tensor (q and
            k rows of a ``qkv_proj``; gate and up of a ``gate_up_proj``).
        exchange_scalars: float32 scalars the exchange sends: per shared
            block fed by ``c`` ranks, ``c - 1`` partial maxima to the
            leader and ``c - 1`` amaxes back.
        leaders: ``{(worker, param): int64 array of grid shape}``: the rank
            that sends each block's scale (its lowest feeder), only kept
            when planned ``with_leaders``.
        feeders: ``{(worker, param): int64 [n, 2]}``: ``(flat block, rank)`` of
            every feeder of every shared block (sorted by block, then rank;
            flat over ``grids[param]``), only kept ``with_leaders``: the
            exchange's plan (``engine.fp8_wire``).
        grids: ``{param: grid}`` the flat block indices of ``feeders`` run
            over (a target's own ``grid``; experts: the most ``E_local`` of
            any worker in dim 0).
        send_bytes / recv_bytes: ``[T]`` / ``[N]`` bytes per trainer rank /
            worker on the fp8 wire (e4m3 for quantized slabs, the wire dtype
            for the rest, plus scales; trainer sends include the exchange).
        trainer_recv_bytes: ``[T]`` exchange bytes each trainer rank receives.
        bf16_bytes / fp8_bytes: bytes moved on each wire, all ranks.
    """

    targets: dict[tuple[int, str], Fp8Target]
    blocks: int = 0
    shared_blocks: int = 0
    multi_wire_blocks: int = 0
    exchange_scalars: int = 0
    leaders: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    feeders: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    grids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    send_bytes: np.ndarray | None = None
    recv_bytes: np.ndarray | None = None
    trainer_recv_bytes: np.ndarray | None = None
    bf16_bytes: int = 0
    fp8_bytes: int = 0

    @property
    def exchange_bytes(self) -> int:
        return self.exchange_scalars * SCALE_BYTES

    def estimated_seconds(self, link_gbps: float) -> float:
        """Busiest rank's bytes on the fp8 wire over its own ``link_gbps`` Gbit/s link
        (exchange included; as ``Plan.estimated_seconds``, a lower bound)."""
        busiest = max(int(self.send_bytes.max(initial=0)), int(self.recv_bytes.max(initial=0)),
                      int(self.trainer_recv_bytes.max(initial=0)))
        return busiest / (link_gbps * 1e9 / 8)

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "shared_blocks": self.shared_blocks,
                "multi_wire_blocks": self.multi_wire_blocks,
                "exchange_scalars": self.exchange_scalars, "exchange_bytes": self.exchange_bytes,
                "bf16_wire_bytes": self.bf16_bytes, "fp8_wire_bytes": self.fp8_bytes,
                "fp8_max_send_per_trainer_rank": int(self.send_bytes.max(initial=0)),
                "fp8_max_receive_per_worker": int(self.recv_bytes.max(initial=0))}


def _edge_boxes(blo, bhi, ilo, ihi):
    """Block boxes ``[blo, bhi)`` minus their inner boxes ``[ilo, ihi)``, as disjoint boxes.

    Returns ``(row, lo, hi)``: which input box each output box came from. A box whose
    inner box is empty (some dim without a whole block) comes back whole.
    """
    n, nd = blo.shape
    empty = (ihi <= ilo).any(axis=1)
    rows, los, his = [np.nonzero(empty)[0]], [blo[empty]], [bhi[empty]]
    keep = np.nonzero(~empty)[0]
    b0, b1, i0, i1 = blo[keep], bhi[keep], ilo[keep], ihi[keep]
    for d in range(nd):
        for part_lo, part_hi in ((b0[:, d], i0[:, d]), (i1[:, d], b1[:, d])):
            m = part_lo < part_hi
            if not m.any():
                continue
            lo = np.concatenate([i0[m, :d], part_lo[m, None], b0[m, d + 1:]], axis=1)
            hi = np.concatenate([i1[m, :d], part_hi[m, None], b1[m, d + 1:]], axis=1)
            rows.append(keep[m]), los.append(lo), his.append(hi)
    return np.concatenate(rows), np.concatenate(los), np.concatenate(his)


def _distinct(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values of a 1-D int64 array (a sort; numpy 2's hashing
    ``np.unique`` is many times slower on tens of millions of keys)."""
    a = np.sort(a)
    if len(a) < 2:
        return a
    return a[np.concatenate(([True], a[1:] != a[:-1]))]


def _box_blocks(lo: np.ndarray, hi: np.ndarray, grid: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``(box index, flat block index)`` of every block in each block box ``[lo, hi)``."""
    ext = hi - lo
    count = ext.prod(axis=1)
    box = np.repeat(np.arange(len(lo)), count)
    if not len(box):
        return box, box
    start = np.repeat(np.cumsum(count) - count, count)
    k = np.arange(len(box)) - start
    flat = np.zeros(len(box), dtype=np.int64)
    e = ext[box]
    for d in range(lo.shape[1] - 1, -1, -1):
        flat += (lo[box, d] + k % e[:, d]) * int(np.prod(grid[d + 1:], dtype=np.int64))
        k = k // e[:, d]
    return box, flat


def plan_fp8(plan: Plan, targets: Iterable[Fp8Target], *, with_leaders: bool = False) -> Fp8Plan:
    """Plan the fp8 wire over ``plan``'s slabs: blocks, their feeders, the exchange, the bytes.

    For every slab into a quantized parameter, the blocks of the worker's
    fp8 grid it touches (through ``Fp8Target.map_region``). A block the
    slab covers whole (up to the end of the data: vLLM's zero padding has
    no feeder) has that slab's rank as its only feeder and is counted, not
    listed; only the blocks at a slab's edges are listed, and a listed
    block's feeders are the distinct source ranks of the slabs touching it.
    Numpy over the slab tables, one parameter's edge blocks in memory at a
    time: DeepSeek-V3 at ``fsdp:256 -> vllm:tp=8,dp=8,ep`` (11.8 M slabs) in
    about 25 s and 0.55 GB on a loaded 2-core machine (docs/benchmarks.md).

    Returns:
        :class:`Fp8Plan`. The bytes of the BF16 wire are ``plan``'s own.

    Raises:
        ValueError: a target whose BF16 shape disagrees with the plan's
            destination parameter, or targets of one parameter name whose
            last two dims differ between workers.
    """
    tmap = {(t.worker, t.param): t for t in targets}
    dest_shape = {(p.worker, p.name): p.shape for p in plan.destination.params}
    by_name: dict[str, Fp8Target] = {}
    grid0: dict[str, list[int]] = {}
    for key, t in tmap.items():
        if dest_shape.get(key) != t.shape:
            raise ValueError(f"fp8 target {t.param!r} of worker {t.worker}: shape {t.shape} "
                             f"but the destination holds {dest_shape.get(key)}")
        first = by_name.setdefault(t.param, t)
        if (first.shape[-2:], first.fp8_shape[-2:], first.row_shards) != (
                t.shape[-2:], t.fp8_shape[-2:], t.row_shards):
            raise ValueError(f"fp8 target {t.param!r}: workers {first.worker} and {t.worker} "
                             f"hold different shapes {first.shape} / {t.shape}")
        g = grid0.setdefault(t.param, list(t.grid))
        g[0] = max(g[0], t.grid[0])
    T, N = plan.num_trainer_ranks, plan.num_workers
    send = np.zeros(T, dtype=np.int64)
    recv = np.zeros(N, dtype=np.int64)
    trecv = np.zeros(T, dtype=np.int64)
    out = Fp8Plan(tmap)
    edges: dict[str, list[np.ndarray]] = {}     # param -> [(worker, flat block, src, wire)]
    wire_ids: dict[str, dict[int, int]] = {}
    interior_leaders: dict[str, list[np.ndarray]] = {}
    shared_rows: dict[str, list[np.ndarray]] = {}
    last_wire: dict[str, int] = {}                 # param -> the last wire feeding it
    for wi, wp in enumerate(plan.wires):
        if not wp.skipped and len(wp.table):
            for b in wp.bindings:
                if (b.worker, b.param) in tmap:
                    last_wire[b.param] = wi

    def finish(pname: str) -> None:
        chunks = edges.pop(pname)
        rows = np.concatenate(chunks)
        NB, NW = int(np.prod(grid0[pname])), len(wire_ids[pname])
        if N * NB * T * NW >= 1 << 62:
            raise ValueError(f"fp8 plan: {pname!r} has too many blocks to index "
                             f"({N} workers x {NB} blocks x {T} ranks)")
        # one int64 per (worker, block, src, wire): sorting it sorts by block, then src
        code = _distinct(((rows[:, 0] * NB + rows[:, 1]) * T + rows[:, 2]) * NW + rows[:, 3])
        wbs = _distinct(code // NW)                     # distinct (worker*NB + block)*T + src
        wb = wbs // T
        src = wbs % T
        keys, first, counts = np.unique(wb, return_index=True, return_counts=True)
        out.blocks += len(keys)
        shared = counts > 1
        out.shared_blocks += int(shared.sum())
        _, wire_counts = np.unique(_distinct(code // (NW * T) * NW + code % NW) // NW,
                                   return_counts=True)
        out.multi_wire_blocks += int((wire_counts > 1).sum())
        out.exchange_scalars += int(2 * (counts[shared] - 1).sum())
        leader = src[first]                             # lowest feeder
        kw = keys // NB
        np.add.at(send, leader, SCALE_BYTES)            # the block's scale, leader -> worker
        np.add.at(recv, kw, SCALE_BYTES)
        lead_of = np.repeat(leader, counts)
        nonlead = src != lead_of                        # partial max to the leader, amax back
        np.add.at(send, src[nonlead], SCALE_BYTES)
        np.add.at(trecv, lead_of[nonlead], SCALE_BYTES)
        np.add.at(send, lead_of[nonlead], SCALE_BYTES)
        np.add.at(trecv, src[nonlead], SCALE_BYTES)
        if with_leaders:
            interior_leaders.setdefault(pname, []).append(
                np.stack([kw, keys % NB, leader], axis=1))
            fed = np.repeat(shared, counts)
            shared_rows.setdefault(pname, []).append(
                np.stack([wb[fed] // NB, wb[fed] % NB, src[fed]], axis=1))

    for wi, wp in enumerate(plan.wires):
        if wp.skipped or not len(wp.table):
            continue
        nd = wp.ndim
        table = wp.table
        lo, hi = SlabTable.lo(table, nd), SlabTable.hi(table, nd)
        nbytes = (hi - lo).prod(axis=1) * wp.itemsize if nd else np.full(len(table), wp.itemsize)
        out.bf16_bytes += int(nbytes.sum())
        b_idx = table[:, SlabTable.BINDING]
        is_q = np.array([(b.worker, b.param) in tmap for b in wp.bindings], dtype=bool)
        q = is_q[b_idx]
        fbytes = np.where(q, nbytes // max(wp.itemsize, 1), nbytes)   # e4m3: a byte an element
        np.add.at(send, table[:, SlabTable.SRC], fbytes)
        np.add.at(recv, table[:, SlabTable.DST], fbytes)
        if not q.any():
            continue
        names = sorted({b.param for b, ok in zip(wp.bindings, is_q) if ok})
        b_name = np.array([names.index(b.param) if ok else -1
                           for b, ok in zip(wp.bindings, is_q)])
        b_off = np.array([np.asarray(b.offset) - np.asarray([a for a, _ in b.box])
                          for b in wp.bindings]).reshape(len(wp.bindings), nd)
        for ni, pname in enumerate(names):
            sel = np.nonzero(q & (b_name[b_idx] == ni))[0]
            t = by_name[pname]
            block = np.asarray(t.block)
            grid = tuple(grid0[pname])
            wl = wire_ids.setdefault(pname, {}).setdefault(wi, len(wire_ids[pname]))
            dlo = lo[sel] + b_off[b_idx[sel]]
            dhi = hi[sel] + b_off[b_idx[sel]]
            srcs, dsts = table[sel, SlabTable.SRC], table[sel, SlabTable.DST]
            r = t.shape[-2] // t.row_shards
            R = t.fp8_shape[-2] // t.row_shards
            for mlo, mhi, keep in _mapped(t, dlo, dhi):
                end = np.broadcast_to(np.asarray(t.shape), mlo.shape).copy()
                end[:, 0] = np.iinfo(np.int64).max if nd == 3 else end[:, 0]
                end[:, -2] = mlo[:, -2] // R * R + r            # data end of the row shard
                blo, bhi = mlo // block, -(-mhi // block)
                ilo = -(-mlo // block)                          # first block starting inside
                ihi = np.where(mhi >= np.minimum(end, -(-mhi // block) * block), bhi, mhi // block)
                inner = np.clip(ihi - ilo, 0, None).prod(axis=1)
                s, d = srcs[keep], dsts[keep]
                out.blocks += int(inner.sum())
                np.add.at(send, s, SCALE_BYTES * inner)
                np.add.at(recv, d, SCALE_BYTES * inner)
                if with_leaders:
                    ib, iflat = _box_blocks(ilo[inner > 0], ihi[inner > 0], grid)
                    interior_leaders.setdefault(pname, []).append(np.stack(
                        [d[inner > 0][ib], iflat, s[inner > 0][ib]], axis=1))
                row, elo, ehi = _edge_boxes(blo, bhi, ilo, np.maximum(ihi, ilo))
                box, flat = _box_blocks(elo, ehi, grid)
                k = row[box]
                edges.setdefault(pname, []).append(np.stack(
                    [d[k], flat, s[k], np.full(len(k), wl)], axis=1))
        for pname in names:                             # one layer's edges in memory at a time
            if last_wire[pname] == wi and pname in edges:
                finish(pname)
    for pname in list(edges):
        finish(pname)
    if with_leaders:
        for pname, chunks in interior_leaders.items():
            rows = np.concatenate(chunks)
            for w in np.unique(rows[:, 0]).tolist():
                t = tmap[(w, pname)]
                grid = np.full(int(np.prod(grid0[pname])), -1, dtype=np.int64)
                m = rows[:, 0] == w
                grid[rows[m, 1]] = rows[m, 2]
                out.leaders[(w, pname)] = grid.reshape(grid0[pname])[:t.grid[0]] \
                    if len(t.grid) == 3 else grid.reshape(t.grid)
        out.grids = {p: tuple(g) for p, g in grid0.items()}
        for pname, chunks in shared_rows.items():
            rows = np.concatenate(chunks)
            for w in np.unique(rows[:, 0]).tolist():
                m = rows[:, 0] == w
                out.feeders[(w, pname)] = rows[m, 1:]
    out.fp8_bytes = int(recv.sum())
    out.send_bytes, out.recv_bytes, out.trainer_recv_bytes = send, recv, trecv
    return out


def _mapped(t: Fp8Target, dlo: np.ndarray, dhi: np.ndarray):
    """``(lo, hi, rows kept)`` of the boxes ``[dlo, dhi)`` moved into ``t``'s fp8 coordinates."""
    if t.row_shards == 1:
        yield dlo, dhi, np.arange(len(dlo))
        return
    r = t.shape[-2] // t.row_shards
    R = t.fp8_shape[-2] // t.row_shards
    for s in range(t.row_shards):
        a = np.maximum(dlo[:, -2], s * r)
        b = np.minimum(dhi[:, -2], (s + 1) * r)
        keep = np.nonzero(a < b)[0]
        if not len(keep):
            continue
        lo, hi = dlo[keep].copy(), dhi[keep].copy()
        lo[:, -2] = a[keep] - s * r + s * R
        hi[:, -2] = b[keep] - s * r + s * R
        yield lo, hi, keep


def execute_fp8_in_process(
    plan: Plan,
    fp8: Fp8Plan,
    local_stream,
    storage: Mapping[int, dict[str, torch.Tensor]],
) -> None:
    """Run mode 2 in this process: every trainer rank quantizes what it sends, workers store it.

    Pass 1: each rank reads its local tensors (``local_stream(rank)``: a
    fresh ``iter_local()`` stream of that rank per call) and takes the per-block
    partial maxima of every slab it sends into a quantized parameter
    (:func:`block_partial_amax`, after the cast to the parameter's dtype
    vLLM's loader makes). Exchange: every block's amax is the max of its
    feeders' partial maxima (here an elementwise max; a distributed round
    sends exactly ``fp8.exchange_scalars`` scalars). Pass 2: each rank
    quantizes its slabs with their blocks' scales (:func:`quantize_region`)
    and the bytes land in the worker's e4m3 ``weight``; the block scales
    land in ``weight_scale_inv``.

    ``storage`` holds each worker's parameters after the BF16 plan ran
    (``execute_plan``); every quantized parameter's BF16 tensor is replaced
    by its e4m3 one (``fp8_shape``, zero padding) and its scale added, as
    vLLM's ``replace_parameter`` leaves the layer.
    """
    by_name = {w.name: w for w in plan.wires}
    amax = {k: torch.zeros(t.grid, dtype=torch.float32) for k, t in fp8.targets.items()}
    dtype = {(p.worker, p.name): p.dtype for p in plan.destination.params}

    def slabs_of(rank: int):
        for name, local in local_stream(rank):
            wp = by_name.get(name)
            if wp is None or wp.skipped:
                continue
            for slab in wp.slabs(src=rank):
                t = fp8.targets.get((slab.dst, slab.param))
                if t is None:
                    continue
                x = local[slab.src_region].to(dtype[(slab.dst, slab.param)])
                region = tuple((s, s + b - a) for s, (a, b) in zip(slab.dst_start, slab.box))
                for sub in t.map_region(region):
                    yield t, x, region, sub

    piece = piece_of

    for rank in range(plan.num_trainer_ranks):
        for t, x, region, sub in slabs_of(rank):
            blocks, part = block_partial_amax(piece(x, region, sub, t), sub, t.block)
            grid = amax[(t.worker, t.param)]
            grid[blocks] = torch.maximum(grid[blocks], part)
    scales = {k: scale_of_amax(a) for k, a in amax.items()}
    out = {k: torch.zeros(t.fp8_shape, dtype=FP8_DTYPE) for k, t in fp8.targets.items()}
    for rank in range(plan.num_trainer_ranks):
        for t, x, region, sub in slabs_of(rank):
            k = (t.worker, t.param)
            out[k][tuple(slice(a, b) for a, b in sub)] = quantize_region(
                piece(x, region, sub, t), sub, scales[k], t.block)
    for (w, name), t in fp8.targets.items():
        storage[w][name] = out[(w, name)]
        storage[w][t.scale] = scales[(w, name)]
