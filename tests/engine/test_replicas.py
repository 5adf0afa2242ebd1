"""Which replica sends each slab (HSDP, FSDP2 ``dp_replicate``): balance, coverage, determinism.

The planner picks, per slab, one of the replicas that hold it. Nothing here
reads that choice to compute what it should be: the boxes come from
``torch.chunk`` arithmetic written out below, the lower bound on the
busiest rank from those boxes alone, and the best possible plan of a small
case from trying every assignment.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from m2nkit.engine.plan import build_plan, count_coverage
from m2nkit.engine.plan_types import SlabTable
from m2nkit.manifest import Binding, DestinationLayout, DestinationParam, ParamMeta, Replicate, Shard


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``torch.chunk(range(n), k)[i]`` as ``(start, stop)`` (empty past the end)."""
    size = -(-n // k)
    start = min(i * size, n)
    return start, min(start + size, n)


def _hsdp_model(layers: int, replicas: int, shards: int, workers: int, kinds):
    """``layers`` copies of the tensors in ``kinds`` (name -> shape, how workers take it:
    ``"whole"``, ``"rows"`` or ``"cols"`` split over the workers), HSDP
    ``(replicas, shards)`` on dim 0, fp32. Returns metas, destination, and per
    tensor the worker boxes."""
    ranks = replicas * shards
    metas, params, bindings, wanted = [], [], {}, {}
    for layer in range(layers):
        for kind, (shape, how) in kinds.items():
            name = f"layers.{layer}.{kind}"
            metas.append(ParamMeta(name, torch.float32, shape, owners=tuple(range(ranks)),
                                   mesh_shape=(replicas, shards),
                                   placements=(Replicate(), Shard(0))))
            boxes = []
            for w in range(workers):
                box = [(0, n) for n in shape]
                if how == "rows":
                    box[0] = _chunk(shape[0], workers, w)
                elif how == "cols":
                    box[1] = _chunk(shape[1], workers, w)
                boxes.append(tuple(box))
            wanted[name] = boxes
            bindings[name] = tuple(Binding(name, w, box, name, (0,) * len(shape))
                                   for w, box in enumerate(boxes) if math.prod(b - a for a, b in box))
            params += [DestinationParam(w, name, torch.float32, tuple(b - a for a, b in box))
                       for w, box in enumerate(boxes) if math.prod(b - a for a, b in box)]
    return metas, DestinationLayout("hsdp-test", workers, tuple(params), bindings), wanted


#: One layer of a mid-size model: fine slabs (every worker takes all of a
#: shard's rows), coarse ones (a shard's rows go to one or two workers, like
#: experts under EP), uneven ``torch.chunk`` splits (50 rows over 6 shards:
#: 9, 9, 9, 9, 9, 5) and a 1-D tensor.
KINDS = {
    "q": ((50, 32), "whole"),
    "o": ((48, 64), "cols"),
    "experts": ((24, 96), "rows"),
    "norm": ((50,), "whole"),
    "down": ((36, 40), "rows"),
}


def _lower_bound(metas, wanted, replicas, shards):
    """The least any plan can send from its busiest rank: the bytes the workers
    need from shard ``s``'s rows can only leave from ``s``'s ``replicas`` ranks."""
    need = [0] * shards
    for m in metas:
        for s in range(shards):
            a, b = _chunk(m.shape[0], shards, s)
            for box in wanted[m.name]:
                rows = max(0, min(b, box[0][1]) - max(a, box[0][0]))
                need[s] += rows * math.prod(hi - lo for lo, hi in box[1:]) * 4
    return max(need) / replicas, sum(need)


def test_mid_size_hsdp_is_balanced_covered_once_and_deterministic():
    R, S, W = 4, 6, 4
    metas, dest, wanted = _hsdp_model(12, R, S, W, KINDS)
    plan = build_plan(metas, R * S, dest)
    assert plan.problems == []
    bound, total = _lower_bound(metas, wanted, R, S)
    assert plan.nbytes_moved == plan.nbytes_min == total
    # The busiest rank within 5 % of what no plan can beat.
    busiest = int(plan.send_bytes.max())
    assert bound <= busiest <= 1.05 * bound, (busiest, bound)
    # Every rank of every replica group sends (no replica idles while its twin sends).
    assert (plan.send_bytes > 0).all()

    # Each slab comes from a replica of the one shard whose rows hold it, and
    # the slabs of each replica group fill what the workers need from that
    # shard exactly once.
    for wp in plan.wires:
        nd = wp.ndim
        t = wp.table
        lo, hi = SlabTable.lo(t, nd), SlabTable.hi(t, nd)
        for src, piece, a, b in zip(t[:, SlabTable.SRC], t[:, SlabTable.PIECE], lo[:, 0], hi[:, 0]):
            shard = int(src) % S
            s0, s1 = _chunk(wp.meta.shape[0], S, shard)
            assert s0 <= a < b <= s1, (wp.name, int(src), (a, b))
            assert wp.pieces[piece].rank == src
        for w, box in enumerate(wanted[wp.name]):
            count = np.zeros(wp.meta.shape, dtype=np.int64)
            for row in t[t[:, SlabTable.DST] == w]:
                count[tuple(slice(x, y) for x, y in zip(row[SlabTable.LO:SlabTable.LO + nd],
                                                        row[SlabTable.LO + nd:]))] += 1
            inside = tuple(slice(x, y) for x, y in box)
            assert (count[inside] == 1).all(), (wp.name, w)
            assert count.sum() == count[inside].sum(), (wp.name, w)
    assert all(bool((c == 1).all()) for c in count_coverage(plan).values())

    # Deterministic: the same inputs, rebuilt from scratch, give the same plan.
    metas2, dest2, _ = _hsdp_model(12, R, S, W, KINDS)
    again = build_plan(metas2, R * S, dest2)
    assert again.digest() == plan.digest()
    assert all(np.array_equal(a.table, b.table) for a, b in zip(plan.wires, again.wires))


def _best_possible(plan, replicas, shards):
    """The least busiest-rank bytes over every assignment of slabs to replicas
    (brute force: each slab may come from any replica of its shard)."""
    slabs = [(int(src) % shards, int(v)) for wp in plan.wires
             for src, v in zip(wp.table[:, SlabTable.SRC], wp.slab_nbytes())]
    best = None
    for choice in itertools.product(range(replicas), repeat=len(slabs)):
        load = [0] * (replicas * shards)
        for (shard, v), r in zip(slabs, choice):
            load[r * shards + shard] += v
        top = max(load)
        best = top if best is None else min(best, top)
    return best, len(slabs)


def test_small_hsdp_matches_the_best_assignment():
    # 2 layers of a tensor whose shard rows go to one worker each (coarse)
    # and one every worker takes whole: 2 replicas x 2 shards, 2 workers.
    kinds = {"e": ((4, 6), "rows"), "a": ((4, 2), "whole")}
    metas, dest, wanted = _hsdp_model(2, 2, 2, 2, kinds)
    plan = build_plan(metas, 4, dest)
    assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min
    best, n = _best_possible(plan, 2, 2)
    assert n == 12
    assert _lower_bound(metas, wanted, 2, 2)[0] <= best
    assert int(plan.send_bytes.max()) == best


def test_uneven_layers_reach_the_best_assignment_within_one_slab():
    # Layers of different sizes on 3 replicas of one shard: the planner takes
    # the biggest slabs first, so the busiest rank ends within the smallest
    # slab of the best assignment.
    kinds = {"big": ((1, 12), "whole"), "mid": ((1, 7), "whole"), "small": ((1, 2), "whole")}
    metas, dest, _ = _hsdp_model(3, 3, 1, 1, kinds)
    plan = build_plan(metas, 3, dest)
    best, n = _best_possible(plan, 3, 1)
    assert n == 9
    assert best <= int(plan.send_bytes.max()) <= best + 2 * 4


def test_many_replicas_are_balanced_and_covered_once():
    # 20 replicas per shard (more than the planner rotates): each tensor
    # water-fills its own table; still within 5 % of the bound, every slab
    # from a replica of its shard, every worker element written once. (36
    # layers: each replica's share is some 30 slabs, so whole slabs can
    # come within 5 % of the fractional bound.)
    R, S, W = 20, 2, 4
    metas, dest, wanted = _hsdp_model(36, R, S, W, KINDS)
    plan = build_plan(metas, R * S, dest)
    assert plan.problems == [] and plan.nbytes_moved == plan.nbytes_min
    bound, total = _lower_bound(metas, wanted, R, S)
    assert plan.nbytes_moved == total
    assert bound <= int(plan.send_bytes.max()) <= 1.05 * bound
    for wp in plan.wires:
        lo = SlabTable.lo(wp.table, wp.ndim)[:, 0]
        for src, a in zip(wp.table[:, SlabTable.SRC], lo):
            s0, s1 = _chunk(wp.meta.shape[0], S, int(src) % S)
            assert s0 <= a < s1
    assert all(bool((c == 1).all()) for c in count_coverage(plan).values())
    metas2, dest2, _ = _hsdp_model(36, R, S, W, KINDS)
    assert build_plan(metas2, R * S, dest2).digest() == plan.digest()
