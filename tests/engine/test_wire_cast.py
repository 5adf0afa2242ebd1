"""A wire dtype other than the worker's: cast on arrival, on every receive path (issue 21, item 1).

Field report: an fp32 checkpoint (tiny Llama, hidden 512, 32 heads, so each
``q_proj`` slab is 512 KiB at ``fsdp:2`` -> ``vllm:tp=2``) killed bf16 vLLM
workers with gloo's "Received data size doesn't match expected size": a
slab of ``DIRECT_BYTES`` or more was received straight into its bf16
parameter, sized in bf16, while the trainer sent it in fp32. The cast has to
happen wherever the dtypes differ, on the direct path too, and give what
vLLM's loaders give: ``param.data.copy_(loaded_weight)``, i.e. torch's own
fp32 -> bf16 rounding, which the expected values here compute directly from
the full tensor (never through m2nkit).

Three paths: a real ``torch_p2p`` round over gloo (threads, one group member
each, 127.0.0.1); the in-process executor behind ``plan --verify``, which
runs the transport's own messages; and the field report's own demo
(``run_demo``, what ``m2nkit demo`` runs, with the stand-in server: real
trainer and worker processes, gloo over 127.0.0.1). Its processes fork from
the tests' preloaded forkserver (tests/_procs.py) instead of spawning, so
the run costs no import of torch per process; the receive path is the same.
The CLI around ``run_demo`` (spawned processes, exit codes, progress lines)
is tests/engine/tools/test_demo_ux.py's. The real-vLLM plugin case is in
``tests/integration/test_vllm_plugin.py`` (``fp32-llama-h512``).
"""

from __future__ import annotations

import pytest
import torch

from _layouts import own_param_destination
from _procs import ensure_forkserver, p2p_round_in_threads
from m2nkit.engine.control import TransferError
from m2nkit.engine.in_process import allocate_storage, bitwise_equal, execute_plan
from m2nkit.engine.plan import build_plan
from m2nkit.engine.transports import torch_p2p
from m2nkit.engine.transports.torch_p2p import DIRECT_BYTES, BucketSchedule
from m2nkit.manifest import ParamMeta, Shard
from m2nkit.manifest.destination import DestinationLayout

T, N = 2, 2
BIG = (512, 512)    # fp32 rows 256 per rank and per worker: 512 KiB slabs, sent direct
SMALL = (8, 16)     # 256 B slabs: packed


def _case():
    """Two fp32 wire tensors, ``fsdp:2`` rows, into bf16 parameters split by rows over 2 workers."""
    g = torch.Generator().manual_seed(7)
    fulls = {"big": torch.randn(BIG, generator=g), "small": torch.randn(SMALL, generator=g)}
    metas = [ParamMeta(n, torch.float32, tuple(t.shape), owners=tuple(range(T)),
                       placements=(Shard(0),)) for n, t in fulls.items()]
    parts = {}
    for n, t in fulls.items():
        rows = t.shape[0] // N
        boxes = [[((w * rows, (w + 1) * rows), (0, t.shape[1]))] for w in range(N)]
        parts[n] = own_param_destination(n, tuple(t.shape), torch.bfloat16, boxes)
    dest = DestinationLayout("test", N, sum((d.params for d in parts.values()), ()),
                             {n: d.bindings[n] for n, d in parts.items()})
    plan = build_plan(metas, T, dest)
    assert plan.problems == []
    sizes = {w.name: {s.nbytes for s in w.slabs()} for w in plan.wires}
    assert min(sizes["big"]) >= DIRECT_BYTES > max(sizes["small"])   # both paths taken
    return fulls, plan, dest


def _streams(fulls):
    return {r: [(n, t.chunk(T, 0)[r]) for n, t in fulls.items()] for r in range(T)}


def _expected(fulls, worker):
    """What vLLM's loader makes of each row block: torch's fp32 -> bf16 cast (``copy_``)."""
    out = {}
    for n, t in fulls.items():
        rows = t.shape[0] // N
        dst = torch.empty((rows, t.shape[1]), dtype=torch.bfloat16)
        dst.copy_(t[worker * rows:(worker + 1) * rows])
        out[f"{n}.0"] = dst
    return out


def test_gloo_round_casts_an_fp32_wire_into_bf16_parameters_on_direct_and_packed_slabs():
    fulls, plan, dest = _case()
    schedule = BucketSchedule.build(plan)
    streams = _streams(fulls)
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    got = p2p_round_in_threads(plan, schedule, streams, storage)
    for w in range(N):
        want = _expected(fulls, w)
        assert set(storage[w]) == set(want)
        for name, t in want.items():
            assert storage[w][name].dtype == torch.bfloat16
            assert bitwise_equal(storage[w][name], t), (w, name)
        # what crossed the wire is fp32: the worker's own rows of both tensors, 4 bytes each
        assert got[T + w] == 4 * (BIG[0] * BIG[1] + SMALL[0] * SMALL[1]) // N


def test_in_process_executor_runs_the_transports_receive_path_and_casts_alike():
    fulls, plan, dest = _case()
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    execute_plan(plan, _streams(fulls), storage)
    for w in range(N):
        for name, t in _expected(fulls, w).items():
            assert bitwise_equal(storage[w][name], t), (w, name)


def test_in_process_executor_refuses_a_receive_that_disagrees_with_its_send(monkeypatch):
    # The check gloo makes ("Received data size doesn't match expected size"):
    # a receive sized unlike its send must fail here as it fails over gloo.
    fulls, plan, dest = _case()
    real = torch_p2p._recv_targets

    def halved(*args, **kwargs):
        out = real(*args, **kwargs)
        r = out[-1]
        return out[:-1] + [r._replace(target=r.target[: r.nbytes // 2], unpack=None)]

    monkeypatch.setattr(torch_p2p, "_recv_targets", halved)
    storage = {w: allocate_storage(dest, w) for w in range(N)}
    with pytest.raises(TransferError, match=r"expects \d+ bytes; the trainer sends \d+ bytes"):
        execute_plan(plan, _streams(fulls), storage)


def _fp32_wide_llama(out):
    from m2nkit.adapters.tiny import save_tiny_checkpoint, tiny_config

    config = tiny_config("tiny-llama", hidden_size=512, num_attention_heads=32, head_dim=16)
    return save_tiny_checkpoint(config, out, dtype=torch.float32)


@pytest.mark.timeout(300)
def test_the_field_reports_demo_fp32_checkpoint_into_bf16_workers(tmp_path):
    """The field report's demo, ``--model <fp32 Llama, hidden 512> --trainer fsdp:2
    --inference vllm:tp=2 --rounds 2 --no-baseline``: before the fix every worker aborted
    and the demo exited 1 after about 100 s. ``run_demo`` raises unless every worker's
    bytes equal ``reference_load`` of the round's tensors (torch's own cast) and every
    worker committed the round's version."""
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.engine.tools.demo import run_demo

    ensure_forkserver()
    model = _fp32_wide_llama(tmp_path / "fp32-llama")
    lines: list[str] = []
    result = run_demo(str(model), "fsdp:2", "vllm:tp=2", rounds=2, timeout_s=60,
                      baseline=False, workdir=str(tmp_path / "work"), log=lines.append,
                      start_method="forkserver")
    assert [(r.index, r.verified_workers) for r in result.rounds] == [(1, 2), (2, 2)]
    assert {t.dtype for t in full_checkpoint_tensors(read_checkpoint(model)).values()} == {
        torch.float32}    # the wire is fp32, the workers bf16 (vllm:tp=2, dtype auto)
    out = " ".join(" ".join(lines).split())
    for k in (1, 2):
        assert f"all 2 workers bit-exact at version v{k}" in out, lines
