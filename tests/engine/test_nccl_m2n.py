"""The nccl_m2n transport: descriptors, routing, and a full round on CPU.

What runs here (no GPU): every descriptor is a real ``nccl.m2n`` object
(nccl-extensions imports without a driver), checked attribute by attribute
and against the plan; the bytes those descriptors would move — interpreted
by this file's own reading of nccl-extensions ``nccl_m2n/README.md``, not by
the transport's helper — land exactly where vLLM's loaders put them; and a
real multi-process round over gloo runs the transport's segment walk, its
``torch_p2p`` segments and its provider order, with the reshards carried
by ``GlooReshard`` below (a CPU stand-in, because ``nccl.m2n.reshard`` needs
a GPU).

What only a GPU covers: ``NcclResharder`` and ``NcclM2NTransport.connect``
(the real reshard, handle, stream, event deadlines and communicator abort).
``benchmarks/gpu_check.py`` runs them, verifying every worker byte; the
skipped test at the bottom runs it when CUDA is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from _paths import REPO
import pytest
import torch

m2n = pytest.importorskip("nccl.m2n")

from m2nkit.adapters.hf_checkpoint import (checkpoint_manifest, checkpoint_metas,  # noqa: E402
                                           full_checkpoint_tensors, read_checkpoint)
from m2nkit.adapters.trainer_spec import parse_trainer_spec  # noqa: E402
from m2nkit.adapters.vllm import (destination_layout, parse_inference_spec,  # noqa: E402
                                  reference_load)
from m2nkit.engine.control import TransferError  # noqa: E402
from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan  # noqa: E402
from m2nkit.engine.plan import build_plan  # noqa: E402
from m2nkit.engine.tools.procs import free_port  # noqa: E402
from m2nkit.engine.transports import nccl_m2n_runtime  # noqa: E402
from m2nkit.engine.transports.nccl_m2n import NcclM2NTransport  # noqa: E402
from m2nkit.engine.transports.nccl_m2n_rules import (CARRIER_M2N, CARRIER_NONE,  # noqa: E402
                                                     CARRIER_P2P, plan_segments, sub_plan,
                                                     wire_carrier)
from m2nkit.engine.transports.nccl_m2n_runtime import (INSTALL_HINT,  # noqa: E402
                                                       NcclM2NUnavailableError,
                                                       destination_view, m2n_descriptors)
from m2nkit.manifest.serialize import manifest_digest  # noqa: E402

ROOT = REPO
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe"
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


def _plan(trainer: str, inference: str, ckpt=EXAMPLE):
    ck = read_checkpoint(ckpt)
    ts = parse_trainer_spec(trainer)
    metas = checkpoint_metas(ck, ts)
    dest = destination_layout(ck.config, metas, parse_inference_spec(inference))
    return ck, build_plan(metas, ts.num_ranks, dest,
                          manifest_digest=manifest_digest(metas, ts.num_ranks))


def _index(plan, name):
    return next(i for i, w in enumerate(plan.wires) if w.name == name)


def _call(plan, name):
    return m2n_descriptors(plan, _index(plan, name))


# --------------------------------------------------------------------------
# an independent reading of nccl.m2n descriptors


def _m2n_box(mesh, placements, local_shape, shape, index):
    """Box of the rank at row-major ``index`` of ``mesh``, from the m2n objects alone."""
    d0, d1 = mesh.dims
    coord = (index // d1, index % d1)
    box = [(0, n) for n in shape]
    for axis, p in enumerate(placements):
        if isinstance(p, m2n.Shard):
            k = local_shape[p.dim]
            box[p.dim] = (coord[axis] * k, (coord[axis] + 1) * k)
        else:
            assert isinstance(p, m2n.Replicate)
    return tuple(box)


def _side_boxes(mesh, placements, local_shape, shape):
    n = mesh.dims[0] * mesh.dims[1]
    return {mesh.start_rank + i: _m2n_box(mesh, placements, local_shape, shape, i)
            for i in range(n)}


# --------------------------------------------------------------------------
# descriptors against real nccl.m2n objects


def _assert_real(call):
    for mesh in (call.src_mesh, call.dst_mesh):
        assert isinstance(mesh, m2n.Mesh) and mesh.ndims == 2
    for p in call.src_placements + call.dst_placements:
        assert isinstance(p, (m2n.Shard, m2n.Replicate))
    # The package's own descriptor type takes them, as a rank outside both sides passes them.
    for mesh, pl, shape in ((call.src_mesh, call.src_placements, call.src_local_shape),
                            (call.dst_mesh, call.dst_placements, call.dst_local_shape)):
        dt = m2n.DistTensor(None, shape, call.dtype, mesh=mesh, placements=pl)
        assert not dt.is_participating and dt.local_shape == shape
        bound = dt.as_binding()
        assert tuple(bound.mesh.dims) == mesh.dims and bound.mesh.startRank == mesh.start_rank


def test_fsdp4_to_tp2_descriptors():
    ck, plan = _plan("fsdp:4", "vllm:tp=2")
    T = 4
    q = _call(plan, "model.layers.0.self_attn.q_proj.weight")   # [128, 128]
    _assert_real(q)
    assert q.src_mesh.dims == (1, 4) and q.src_mesh.start_rank == 0
    assert q.src_placements == (m2n.Replicate(), m2n.Shard(0))
    assert q.src_local_shape == (32, 128)
    assert q.dst_mesh.dims == (1, 2) and q.dst_mesh.start_rank == T
    assert q.dst_placements == (m2n.Replicate(), m2n.Shard(0))
    assert q.dst_local_shape == (64, 128)

    o = _call(plan, "model.layers.0.self_attn.o_proj.weight")   # row-parallel
    assert o.dst_placements == (m2n.Replicate(), m2n.Shard(1)) and o.dst_local_shape == (128, 64)

    down = _call(plan, "model.layers.1.mlp.experts.down_proj.weight")  # [8, 128, 32], TP over Im
    assert down.shape == (8, 128, 32)
    assert down.src_placements == (m2n.Replicate(), m2n.Shard(0)) and down.src_local_shape == (2, 128, 32)
    assert down.dst_placements == (m2n.Replicate(), m2n.Shard(2)) and down.dst_local_shape == (8, 128, 16)

    # Replicated on the workers: the size-1-axis encoding (n, 1) with (Replicate(), Shard(0)).
    norm = _call(plan, "model.norm.weight")
    _assert_real(norm)
    assert norm.dst_mesh.dims == (2, 1) and norm.dst_mesh.start_rank == T
    assert norm.dst_placements == (m2n.Replicate(), m2n.Shard(0))
    assert norm.dst_local_shape == norm.shape == (128,)
    assert m2n.DistTensor(None, norm.dst_local_shape, norm.dtype, mesh=norm.dst_mesh,
                          placements=norm.dst_placements).placements == (-1, 0)


def test_hsdp_descriptors():
    _, plan = _plan("hsdp:2,2", "vllm:tp=2,dp=2")
    q = _call(plan, "model.layers.1.self_attn.q_proj.weight")
    _assert_real(q)
    # HSDP (R, S) = (2, 2): outer axis replicates, inner shards dim 0.
    assert q.src_mesh.dims == (2, 2) and q.src_mesh.start_rank == 0
    assert q.src_placements == (m2n.Replicate(), m2n.Shard(0)) and q.src_local_shape == (64, 128)
    # vLLM (DP, TP) = (2, 2), workers from rank T = 4.
    assert q.dst_mesh.dims == (2, 2) and q.dst_mesh.start_rank == 4
    assert q.dst_placements == (m2n.Replicate(), m2n.Shard(0)) and q.dst_local_shape == (64, 128)
    router = _call(plan, "model.layers.1.mlp.gate.weight")
    assert router.dst_mesh.dims == (4, 1) and router.dst_local_shape == (8, 128)


def test_replicated_trainer_descriptors():
    _, plan = _plan("replicated:2", "vllm:tp=2")
    k = _call(plan, "model.layers.0.self_attn.k_proj.weight")
    _assert_real(k)
    assert k.src_mesh.dims == (2, 1) and k.src_mesh.start_rank == 0
    assert k.src_placements == (m2n.Replicate(), m2n.Shard(0)) and k.src_local_shape == (32, 128)
    assert k.dst_mesh.start_rank == 2 and k.dst_local_shape == (16, 128)
    norm = _call(plan, "model.layers.0.input_layernorm.weight")
    assert (norm.src_mesh.dims, norm.dst_mesh.dims) == ((2, 1), (2, 1))
    assert norm.src_local_shape == norm.dst_local_shape == (128,)


def test_expert_parallel_descriptors():
    _, plan = _plan("fsdp:2", "vllm:tp=2,dp=2,ep")
    gu = _call(plan, "model.layers.0.mlp.experts.gate_up_proj.weight")   # [8, 64, 128]
    _assert_real(gu)
    assert gu.src_mesh.dims == (1, 2) and gu.src_local_shape == (4, 64, 128)
    # ep = dp*tp = 4 workers, 2 whole experts each, contiguous in w13_weight.
    assert gu.dst_mesh.dims == (1, 4) and gu.dst_mesh.start_rank == 2
    assert gu.dst_placements == (m2n.Replicate(), m2n.Shard(0)) and gu.dst_local_shape == (2, 64, 128)
    assert wire_carrier(plan.wires[_index(plan, gu.name)]) == CARRIER_M2N


def test_kv_heads_replicated_over_tp_use_an_outer_shard_axis():
    # tp=4 over 2 KV heads: workers (0,1) share head 0 and (2,3) head 1.
    _, plan = _plan("fsdp:2", "vllm:tp=4")
    k = _call(plan, "model.layers.0.self_attn.k_proj.weight")
    assert k.dst_mesh.dims == (2, 2) and k.dst_mesh.start_rank == 2
    assert k.dst_placements == (m2n.Shard(0), m2n.Replicate()) and k.dst_local_shape == (16, 128)
    assert [k.dst_box(2 + w)[0] for w in range(4)] == [(0, 16), (0, 16), (16, 32), (16, 32)]


@pytest.mark.parametrize("trainer,inference", [
    ("fsdp:4", "vllm:tp=2"), ("hsdp:2,2", "vllm:tp=2,dp=2"), ("replicated:2", "vllm:tp=2"),
    ("fsdp:2", "vllm:tp=2,dp=2,ep"), ("fsdp:2", "vllm:tp=4"),
])
def test_descriptors_match_the_plan_boxes(trainer, inference):
    """Every m2n wire: the descriptors, read independently, give each rank the plan's box."""
    _, plan = _plan(trainer, inference)
    T = plan.num_trainer_ranks
    n = 0
    for wi, wp in enumerate(plan.wires):
        if not wp.verdict("nccl_m2n").ok:
            continue
        c = m2n_descriptors(plan, wi)
        n += 1
        src = _side_boxes(c.src_mesh, c.src_placements, c.src_local_shape, c.shape)
        assert src == {p.rank: p.box for p in wp.pieces}, wp.name
        dst = _side_boxes(c.dst_mesh, c.dst_placements, c.dst_local_shape, c.shape)
        assert dst == {T + b.worker: b.box for b in wp.bindings}, wp.name
        # Disjoint sides inside the communicator [0, T+N).
        assert c.src_ranks.stop <= T <= c.dst_ranks.start and c.dst_ranks.stop <= T + plan.num_workers
    assert n > 0


def test_a_wire_nccl_m2n_cannot_carry_is_refused_with_the_reason():
    _, plan = _plan("fsdp:4", "vllm:tp=2")
    with pytest.raises(ValueError, match="embed_tokens.*not split evenly"):
        _call(plan, "model.embed_tokens.weight")


# --------------------------------------------------------------------------
# routing


def test_non_expressible_tensors_go_to_torch_p2p():
    _, plan = _plan("fsdp:4", "vllm:tp=2")
    carriers = {w.name: wire_carrier(w) for w in plan.wires}
    # vocab 200 over tp=2 is padded (not an even split); fused gate/up halves land
    # in two places of w13_weight; both go through torch_p2p.
    for name in ("model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.mlp.experts.gate_up_proj.weight",
                 "model.layers.1.mlp.experts.gate_up_proj.weight"):
        assert carriers[name] == CARRIER_P2P, name
        assert not plan.wires[_index(plan, name)].verdict("nccl_m2n").ok
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.down_proj.weight",
                 "model.norm.weight"):
        assert carriers[name] == CARRIER_M2N, name
    segs = plan_segments(plan)
    assert [i for s in segs for i in s.wires] == list(range(len(plan.wires)))
    assert all(a.carrier != b.carrier for a, b in zip(segs, segs[1:]))
    for s in segs:
        assert {carriers[plan.wires[i].name] for i in s.wires} <= {s.carrier, CARRIER_NONE}
    assert [s.carrier for s in segs] == [CARRIER_P2P, CARRIER_M2N] * 3 + [CARRIER_P2P]


def test_uneven_fsdp_chunks_go_to_torch_p2p():
    # fsdp:3 splits 128 rows as torch.chunk does (43, 43, 42): nccl.m2n needs even shards.
    _, plan = _plan("fsdp:3", "vllm:tp=2")
    assert {wire_carrier(w) for w in plan.wires} == {CARRIER_P2P}
    q = plan.wires[_index(plan, "model.layers.0.self_attn.q_proj.weight")]
    assert q.verdict("nccl_m2n").reason.startswith("source: dim 0 of size 128 is not split evenly")
    assert [s.carrier for s in plan_segments(plan)] == [CARRIER_P2P]


@pytest.mark.parametrize("position", [0, 2])
def test_skipped_wires_join_a_segment(tiny_checkpoints, position):
    # Tied embeddings: vLLM skips a checkpoint's lm_head.weight, which then moves nothing.
    from m2nkit.manifest.meta import ParamMeta

    ck = read_checkpoint(tiny_checkpoints("tiny-qwen3-tied"))
    metas = checkpoint_metas(ck, parse_trainer_spec("fsdp:2"))
    emb = metas[0]
    metas.insert(position, ParamMeta("lm_head.weight", emb.dtype, emb.shape, emb.owners,
                                     emb.mesh_shape, emb.placements))
    dest = destination_layout(ck.config, metas, parse_inference_spec("vllm:tp=2"))
    plan = build_plan(metas, 2, dest)
    assert not plan.problems and plan.wires[position].skipped
    assert wire_carrier(plan.wires[position]) == CARRIER_NONE
    segs = plan_segments(plan)
    assert [i for s in segs for i in s.wires] == list(range(len(plan.wires)))
    assert all(a.carrier != b.carrier for a, b in zip(segs, segs[1:]))
    assert CARRIER_NONE not in {s.carrier for s in segs}
    # At the front it joins the first segment; inside a run it stays in that run.
    assert position in segs[0].wires if position == 0 else position in segs[1].wires
    assert segs[1].carrier == CARRIER_M2N


def test_sub_plan_keeps_only_its_wires_and_their_bytes():
    _, plan = _plan("fsdp:4", "vllm:tp=2")
    p2p = [i for i, w in enumerate(plan.wires) if wire_carrier(w) == CARRIER_P2P]
    sub = sub_plan(plan, p2p)
    assert [w.name for w in sub.wires] == [plan.wires[i].name for i in p2p]
    assert sub.nbytes_moved == sum(plan.wires[i].nbytes_moved for i in p2p)
    assert sum(sub.link_bytes.values()) == sub.nbytes_moved == int(sub.recv_bytes.sum())
    assert sub.num_trainer_ranks == 4 and sub.num_workers == 2 and not sub.problems


@pytest.mark.parametrize("trainer,inference", [
    ("fsdp:4", "vllm:tp=2"), ("hsdp:2,2", "vllm:tp=2,dp=2"), ("replicated:2", "vllm:tp=1"),
    ("fsdp:2", "vllm:tp=2,dp=2,ep"), ("fsdp:2", "vllm:tp=4"),
])
def test_descriptors_and_p2p_slabs_rebuild_vllm_weights(trainer, inference):
    """In one process: m2n wires moved per the descriptors (independent reading),
    the rest by the torch_p2p sub-plan's slabs; every worker equals vLLM's loaders."""
    ck, plan = _plan(trainer, inference)
    T, N = plan.num_trainer_ranks, plan.num_workers
    ts = parse_trainer_spec(trainer)
    storage = {w: allocate_storage(plan.destination, w) for w in range(N)}
    m2n_idx = [i for i, w in enumerate(plan.wires) if wire_carrier(w) == CARRIER_M2N]
    rest = [i for i in range(len(plan.wires)) if i not in set(m2n_idx)]
    rest_names = {plan.wires[i].name for i in rest}
    sources = {r: checkpoint_manifest(ck, ts, r) for r in range(T)}
    execute_plan(sub_plan(plan, rest),
                 {r: ((n, t) for n, t in s.iter_local() if n in rest_names)
                  for r, s in sources.items()}, storage)
    for wi in m2n_idx:
        c = m2n_descriptors(plan, wi)
        full = ck.read_full(c.name)
        src = _side_boxes(c.src_mesh, c.src_placements, c.src_local_shape, c.shape)
        for r, box in src.items():   # what a trainer rank hands over is its source box
            local = ck.read_box(c.name, box)
            assert tuple(local.shape) == c.src_local_shape
        for rank, box in _side_boxes(c.dst_mesh, c.dst_placements, c.dst_local_shape, c.shape).items():
            view = destination_view(plan, wi, rank - T, storage[rank - T])
            assert view is not None and view.is_contiguous()
            assert tuple(view.shape) == c.dst_local_shape
            view.copy_(full[tuple(slice(a, b) for a, b in box)])
    full = full_checkpoint_tensors(ck)
    aliases = plan.destination.aliases
    for w in range(N):
        ref = reference_load(ck.config, full, inference, w)
        for name, t in ref.items():
            if name in aliases:
                continue
            assert bitwise_equal(storage[w][name], t), (w, name)


# --------------------------------------------------------------------------
# transport guards and deadlines (no process group needed)


class _NeverCalled:
    def issue(self, *a):
        raise AssertionError("issue must not be called")

    def drain(self, max_pending_bytes=0):
        return []

    def fence(self):
        pass

    def close(self):
        pass


def test_transport_refuses_a_plan_with_problems_and_wrong_ranks():
    _, plan = _plan("fsdp:2", "vllm:tp=2")
    tr = NcclM2NTransport(None, _NeverCalled(), rank=0, device="cpu", timeout_s=5)
    with pytest.raises(ValueError, match="trainer rank 1 on the transport of rank 0"):
        tr.send_round(plan, 1, iter(()))
    with pytest.raises(ValueError, match="worker 0"):
        tr.recv_round(plan, 0, {})
    from m2nkit.engine.plan_types import Problem
    plan.problems.append(Problem("x", "broken"))
    with pytest.raises(ValueError, match="1 problem.*x: broken.*nothing was sent"):
        tr.send_round(plan, 0, iter(()))


def test_poll_deadline_becomes_an_error():
    events = []

    def expire():
        events.append("abort")
        raise TransferError("did not complete within 0.05 s")

    t0 = time.monotonic()
    with pytest.raises(TransferError, match="within 0.05 s"):
        nccl_m2n_runtime._poll(lambda: False, 0.05, expire)
    assert events == ["abort"] and 0.05 <= time.monotonic() - t0 < 2
    ticks = iter([False, False, True])
    nccl_m2n_runtime._poll(lambda: next(ticks), 5, expire)   # completes: no abort
    assert events == ["abort"]


# --------------------------------------------------------------------------
# missing package


def test_missing_nccl_m2n_says_what_to_install(monkeypatch):
    _, plan = _plan("fsdp:2", "vllm:tp=2")
    monkeypatch.setitem(sys.modules, "nccl.m2n", None)   # import of nccl.m2n now fails
    with pytest.raises(NcclM2NUnavailableError) as e:
        nccl_m2n_runtime.import_nccl_m2n()
    assert INSTALL_HINT in str(e.value)
    assert "install m2nkit[nccl] (nccl4py, nccl-extensions, cuda-bindings)" in str(e.value)
    assert isinstance(e.value, ImportError)
    with pytest.raises(NcclM2NUnavailableError, match=r"m2nkit\[nccl\]"):
        m2n_descriptors(plan, _index(plan, "model.norm.weight"))
    with pytest.raises(NcclM2NUnavailableError, match=r"m2nkit\[nccl\]"):
        NcclM2NTransport.connect(None, None, 0, 2, device=0, timeout_s=1)


def test_missing_nccl4py_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nccl.core", None)
    with pytest.raises(NcclM2NUnavailableError, match=r"nccl4py.*m2nkit\[nccl\]"):
        nccl_m2n_runtime.import_nccl_m2n()


# --------------------------------------------------------------------------
# a full round over gloo, reshards carried by a CPU stand-in


class GlooReshard:
    """Stand-in for ``nccl.m2n.reshard`` over the gloo group, for CPU tests only.

    It moves exactly what the descriptors say (this file's own reading of
    them), one replica per source piece, synchronously; every rank calls
    ``issue`` in the same order, as with nccl.m2n.
    """

    def __init__(self, group, rank):
        self.group, self.rank = group, rank
        self.finished = []

    def issue(self, call, src, dst):
        sb = _side_boxes(call.src_mesh, call.src_placements, call.src_local_shape, call.shape)
        db = _side_boxes(call.dst_mesh, call.dst_placements, call.dst_local_shape, call.shape)
        assert (src is not None) == (self.rank in sb) and (dst is not None) == (self.rank in db)
        pieces = {}
        for r, box in sb.items():
            pieces.setdefault(box, []).append(r)
        sends, recvs = [], []
        for d, dbox in db.items():
            for sbox, holders in pieces.items():
                inter = tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(sbox, dbox))
                if any(a >= b for a, b in inter):
                    continue
                s = holders[d % len(holders)]
                if self.rank == s:
                    piece = src[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, sbox))]
                    sends.append(self.group.send([piece.contiguous()], d, call.index))
                if self.rank == d:
                    buf = torch.empty([b - a for a, b in inter], dtype=call.dtype)
                    recvs.append((self.group.recv([buf], s, call.index), buf, inter))
        for w in sends:
            w.wait()
        for w, buf, inter in recvs:
            w.wait()
            dst[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, db[self.rank]))].copy_(buf)
        self.finished.append(call.name)

    def drain(self, max_pending_bytes=0):
        out, self.finished = self.finished, []
        return out

    def fence(self):
        pass

    def close(self):
        pass


def _gloo_rank(rank, world, trainer, inference, port, out_dir):
    torch.set_num_threads(1)
    from m2nkit.engine.control import agree_on_plan, create_group

    result = {"rank": rank}
    try:
        _, group = create_group("127.0.0.1", port, rank, world, timeout_s=60, backend="gloo")
        ck, plan = _plan(trainer, inference)
        T = plan.num_trainer_ranks
        agree_on_plan(group, rank, world, plan, timeout_s=60)
        tr = NcclM2NTransport(group, GlooReshard(group, rank), rank=rank, device="cpu",
                              timeout_s=60, bucket_bytes=8 << 10)
        rounds = []
        for _ in range(2):
            if rank < T:
                source = checkpoint_manifest(ck, parse_trainer_spec(trainer), rank)
                pulled = []

                def stream():
                    for name, t in source.iter_local():
                        pulled.append(name)
                        yield name, t

                rep = tr.send_round(plan, rank, stream())
                rounds.append({"pulled": pulled, "owned": source.owned_names(), **asdict(rep)})
            else:
                w = rank - T
                storage = allocate_storage(plan.destination, w)
                done, rep = tr.recv_round(plan, w, storage)
                full = full_checkpoint_tensors(ck)
                ref = reference_load(ck.config, full, inference, w)
                bad = sorted(n for n, t in ref.items()
                             if n not in plan.destination.aliases and not bitwise_equal(storage[n], t))
                expected = sorted(x.name for x in plan.wires
                                  if len(x.table) and (x.table[:, 1] == w).any())
                rounds.append({"bad": bad, "done": sorted(done), "expected": expected, **asdict(rep)})
        tr.close()
        result["rounds"] = rounds
    except BaseException as e:  # reported to the parent, which fails the test
        import traceback
        result["error"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


@pytest.mark.integration  # spawns processes for seconds: see pyproject.toml
@pytest.mark.parametrize("trainer,inference", [("fsdp:2", "vllm:tp=2"), ("hsdp:2,1", "vllm:tp=1,dp=2")])
def test_full_round_over_gloo(tmp_path, trainer, inference):
    T = parse_trainer_spec(trainer).num_ranks
    N = parse_inference_spec(inference).num_workers
    world, port = T + N, free_port()
    from _procs import CTX as ctx, ensure_forkserver

    ensure_forkserver()           # children fork with torch loaded: no import per process
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, trainer, inference, port, str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 150
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    results = {}
    for r in range(world):
        f = tmp_path / f"{r}.json"
        results[r] = json.loads(f.read_text()) if f.exists() else {"error": "no result"}
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    assert not alive and not errors, errors
    for r in range(T):
        for rnd in results[r]["rounds"]:
            assert rnd["pulled"] == rnd["owned"]      # every provider once, manifest order
            assert rnd["m2n_tensors"] > 0 and rnd["p2p_tensors"] > 0 and rnd["m2n_bytes"] > 0
    for r in range(T, world):
        for rnd in results[r]["rounds"]:
            assert rnd["bad"] == []
            assert rnd["done"] == rnd["expected"] and rnd["done"]
            assert rnd["m2n_bytes"] > 0 and rnd["p2p_bytes"] > 0


# --------------------------------------------------------------------------
# benchmarks/gpu_check.py


def _run_gpu_check(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(GPU_CHECK), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


# Its dry run (plans, real descriptors where nccl.m2n imports, every worker byte) is
# tests/engine/tools/test_gpu_check.py's, one run for every scenario and the serve check.


def test_gpu_check_rejects_bad_arguments():
    out = _run_gpu_check("--dry-run", "--scenario", "fsdp:2")
    assert out.returncode == 2 and "TRAINER/INFERENCE" in out.stderr
    out = _run_gpu_check("--dry-run", "--scenario", "fsdp:x/vllm:tp=2")
    assert out.returncode == 2 and "trainer spec" in out.stderr
    out = _run_gpu_check("--dry-run", "--timeout", "0")
    assert out.returncode == 2 and "--timeout" in out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the real nccl.m2n reshard")
def test_gpu_check_on_this_gpu_machine():
    """The real transport (NcclResharder, connect, abort paths) — covered by gpu_check."""
    out = _run_gpu_check("--timeout", "90", timeout=290)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "every worker byte matches" in out.stdout
