"""``m2nkit demo``: a real multi-process transfer on one machine, checked byte by byte.

Trainer processes hold FSDP/HSDP-style shards of a checkpoint (each reads only
its own box from the safetensors files) and send them with m2nkit's trainer
engine into receiver processes holding vLLM tp/dp/ep storage, behind vLLM's
weight-transfer HTTP routes on 127.0.0.1. The weights change every round
(round k adds ``0.5*k`` to every floating element, elementwise, so it
commutes with any sharding), so a worker that kept last round's bytes is
caught. After each round every worker's storage is compared bit for bit with
``reference_load`` of the round's full tensors, and every worker must have
committed the round's version.

With an ``fsdp2:`` trainer spec the trainers are real FSDP2 trainers
instead: each builds the model with transformers from the checkpoint (fp32
masters, a bf16 ``MixedPrecisionPolicy``), applies the family's TP plan
where the spec has ``tp`` (``m2nkit.adapters.tensor_parallel``), wraps it
with ``fully_shard`` (HSDP on a ``dp_replicate`` axis) and sends through
``fsdp2_source``. Each round they take one real AdamW step on random tokens,
so the weights change as in RL, then send; the harness then gathers the
trained parameters (``get_model_state_dict(full_state_dict=True)``, for the
check only) and trainer rank 0 saves them with ``save_pretrained``; every
worker is compared with ``reference_load`` of that checkpoint. Before the
first round the live FSDP2 manifest is held against the dry run of the same
spec (``checkpoint_metas``): same wire tensors, shapes and pieces.

Importing this module is cheap (no torch): the CLI reads
``MAX_DEMO_PROCESSES`` from it before deciding anything is worth loading,
and every spawned process imports it to find its target. Long phases
(building the checkpoint, starting processes, the baseline) are announced
through ``log`` before they start, and waits longer than
``procs.HEARTBEAT_S`` say what they are still waiting for. The processes the
demo starts ignore SIGINT: on Ctrl-C the parent tears them down. Starting,
hearing and stopping them is ``engine/tools/procs.py``'s, shared with the
other demos, the benchmarks and the tests.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from m2nkit.engine.tools.procs import free_port, start_ranks, stop_processes, wait_reports

__all__ = ["shift", "DemoRound", "DemoResult", "run_demo", "MAX_DEMO_PROCESSES", "build_fsdp2_model"]

#: Most processes (trainers + workers) the demo starts on one machine.
MAX_DEMO_PROCESSES = 32

def _child_setup() -> None:
    """First thing in every process the demo spawns.

    SIGINT is ignored (Ctrl-C in a terminal reaches every process of the
    group; the parent tears its children down, so they need not print a
    traceback each), the process exits with its parent, and torch uses one
    thread (the demo runs many processes on few cores).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from m2nkit.engine.tools.server import exit_with_parent

    exit_with_parent()
    torch.set_num_threads(1)


def _count(n: int, noun: str) -> str:
    """``"1 worker"``, ``"2 workers"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def shift(t: torch.Tensor, round_index: int) -> torch.Tensor:
    """Round ``round_index``'s version of a tensor: ``t + 0.5*round_index`` (floats only).

    Elementwise, so shifting a local box equals slicing the shifted full tensor.
    """
    if not t.is_floating_point() or round_index == 0:
        return t
    return (t.float() + 0.5 * round_index).to(t.dtype)


def demo_checkpoint(model: str, out: Path, log) -> Path:
    """``--model``: a built-in tiny model, saved (seed 0) to ``out``, or a checkpoint directory.

    Raises:
        ValueError: ``model`` is neither (the message lists the tiny models).
    """
    from m2nkit.adapters.tiny import BUILTIN_TINY_MODELS, save_tiny_checkpoint

    if model in BUILTIN_TINY_MODELS:
        log(f"building the tiny checkpoint {model} (transformers, seed 0)")
        return save_tiny_checkpoint(model, out, seed=0)
    if Path(model).is_dir():
        return Path(model)
    raise ValueError(f"--model '{model}' is neither a built-in tiny model "
                     f"({', '.join(sorted(BUILTIN_TINY_MODELS))}) nor a checkpoint directory")


def shifted_source(checkpoint, trainer_spec, rank: int, state: dict):
    """This rank's checkpoint manifest with every provider shifted by ``state["round"]``."""
    from m2nkit.adapters.hf_checkpoint import checkpoint_manifest
    from m2nkit.manifest import M2NManifestEntry, ManifestM2NWeightSource

    base = checkpoint_manifest(checkpoint, trainer_spec, rank)

    def wrap(entry):
        return M2NManifestEntry(entry.name, entry.dtype, entry.global_shape, entry.source_layout,
                                lambda: shift(entry.local_tensor(), state["round"]))

    return ManifestM2NWeightSource([wrap(e) for e in base.entries], rank=rank)


def build_fsdp2_model(model_dir, tspec):
    """The checkpoint as an FSDP2 trainer holds it: transformers, TP plan, ``fully_shard``.

    fp32 parameters (the optimizer's masters) under ``MixedPrecisionPolicy(
    param_dtype=bf16)``; every decoder layer and the root sharded over the
    data-parallel axes (``dp_replicate`` x ``dp_shard``: HSDP when both),
    after the family's TP plan on the ``tp`` axis. Needs the default process
    group over the trainer ranks. Returns ``(model, tp mesh or None)``.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from m2nkit.adapters.tensor_parallel import apply_tp_plan

    names = tspec.mesh_dim_names
    mesh = init_device_mesh("cpu", tspec.mesh_shape, mesh_dim_names=names)
    model_tp = None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if tspec.tp > 1:
        model_tp = mesh["tp"]
        apply_tp_plan(model, model_tp)
    dp = mesh[tuple(n for n in names if n != "tp")]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    return model, model_tp


def _train_step(model, optimizer, vocab_size: int, seed: int, tp_mesh=None) -> float:
    """One AdamW step on random tokens (2 x 16); returns the loss.

    ``seed``: one per data-parallel rank (the TP ranks of one replica see the
    same tokens); ``tp_mesh``: sum the TP-partial gradients first
    (``sum_partial_grads``).
    """
    import torch

    from m2nkit.adapters.tensor_parallel import sum_partial_grads

    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if tp_mesh is not None:
        sum_partial_grads(model, tp_mesh)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _save_trained(model, plain, out: Path, rank: int) -> None:
    """For the check only: gather the full parameters to rank 0 and ``save_pretrained`` them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        plain.load_state_dict(full)
        plain.save_pretrained(out)


def _fsdp2_trainer_main(rank, num_ranks, model_dir, trainer, inference, url, port, dist_port,
                        rounds, timeout_s, bucket_bytes, work, results, go, transport="torch_p2p"):
    """One FSDP2 trainer: build and shard the model, then per round one AdamW step and a send."""
    _child_setup()
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from m2nkit.adapters.fsdp2 import fsdp2_source
        from m2nkit.adapters.trainer_spec import parse_trainer_spec
        from m2nkit.adapters.vllm import vllm_destination
        from m2nkit.engine.clients import HTTPClient
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo
        from m2nkit.manifest.serialize import manifest_to_json

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # transformers' CausalLM returns logits[:, slice] (a view); FSDP2 warns about
        # in-place ops on it on every step, and the demo does none.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        # With tp, the demo gathers each trained parameter whole for its check
        # (get_model_state_dict(full_state_dict=True) of (_StridedShard, Shard) DTensors
        # over (dp_shard, tp): _save_trained); DTensor
        # logs, once per mesh and rank at WARNING, that this takes "2 sequential
        # all_gather operations" (non-ascending mesh dims cannot merge). A speed note on
        # the check's gather, not on the transfer, and four copies of it on the user's
        # screen; this trainer process owns its loggers, so it is silenced here only.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        tspec = parse_trainer_spec(trainer)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                                world_size=num_ranks, timeout=timedelta(seconds=timeout_s))
        t0 = time.perf_counter()
        model, tp_mesh = build_fsdp2_model(model_dir, tspec)
        config = AutoConfig.from_pretrained(model_dir)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32) if rank == 0 else None
        source = fsdp2_source(model)
        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=num_ranks,
                                  destination=vllm_destination(config, inference),
                                  master_port=port, timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                                  transport=transport)
        client = HTTPClient(url, timeout_s=4 * timeout_s) if rank == 0 else None
        engine = M2NTrainerEngine.trainer_init(info, client=client, source=source)
        manifest = manifest_to_json(source.metadata, num_ranks) if rank == 0 else None
        results.put(("init", rank, time.perf_counter() - t0, manifest))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for k in range(1, rounds + 1):
            if go.get(timeout=10 * timeout_s) != k:
                raise RuntimeError("demo driver out of step")
            loss = _train_step(model, optimizer, config.vocab_size, 1000 * k + rank // tspec.tp,
                               tp_mesh)
            stats = engine.send_weights(f"v{k}")
            _save_trained(model, plain, Path(work) / f"trained-v{k}", rank)
            results.put(("round", rank, k, (stats.bytes_sent, stats.seconds, loss)))
        engine.shutdown()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


def _check_live_manifest(doc: dict, metas, T: int, trainer: str) -> None:
    """The live FSDP2 manifest (trainer rank 0's) against the dry run of the same spec.

    Raises:
        RuntimeError: a wire tensor differs in name, shape or pieces (names the first).
    """
    from m2nkit.manifest.serialize import manifest_from_json

    live, _ = manifest_from_json(doc)
    if [m.name for m in live] != [m.name for m in metas]:
        extra = sorted({m.name for m in live} ^ {m.name for m in metas})
        raise RuntimeError(f"the live FSDP2 manifest names other wire tensors than the dry run "
                           f"of --trainer {trainer}: {extra[:3]}")
    for a, b in zip(live, metas):
        if a.shape != b.shape or set(a.source_pieces(T)) != set(b.source_pieces(T)):
            raise RuntimeError(f"wire tensor '{a.name}': the live FSDP2 layout differs from the "
                               f"dry run of --trainer {trainer} (pieces {a.source_pieces(T)[:3]} "
                               f"vs {b.source_pieces(T)[:3]})")


def _trainer_main(rank, num_ranks, model_dir, trainer, inference, url, port, rounds,
                  timeout_s, bucket_bytes, results, go, transport="torch_p2p"):
    """One trainer process: init, then one ``send_weights`` per round, reporting each."""
    _child_setup()
    try:
        from transformers.utils import logging as hf_logging

        from m2nkit.adapters.hf_checkpoint import read_checkpoint
        from m2nkit.adapters.trainer_spec import parse_trainer_spec
        from m2nkit.engine.clients import HTTPClient
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        hf_logging.set_verbosity_error()
        ckpt = read_checkpoint(model_dir)
        tspec = parse_trainer_spec(trainer)
        state = {"round": 0}
        source = shifted_source(ckpt, tspec, rank, state)
        from m2nkit.adapters.vllm import vllm_destination

        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=num_ranks,
                                  destination=vllm_destination(ckpt.config, inference), master_port=port,
                                  timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                                  transport=transport)
        client = HTTPClient(url, timeout_s=4 * timeout_s) if rank == 0 else None
        t0 = time.perf_counter()
        engine = M2NTrainerEngine.trainer_init(info, client=client, source=source)
        results.put(("init", rank, time.perf_counter() - t0, None))
        for k in range(1, rounds + 1):
            if go.get(timeout=10 * timeout_s) != k:
                raise RuntimeError("demo driver out of step")
            state["round"] = k
            stats = engine.send_weights(f"v{k}")
            results.put(("round", rank, k, (stats.bytes_sent, stats.seconds)))
        engine.shutdown()
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


@dataclass
class DemoRound:
    """One verified round: per-rank bytes and the slowest rank's time."""

    index: int
    bytes_per_rank: list[int]
    seconds: float
    verified_workers: int
    loss: float | None = None  # fsdp2 trainers: the mean loss of the round's AdamW step


@dataclass
class DemoResult:
    model: str
    trainer: str
    inference: str
    nbytes_min: int
    rounds: list[DemoRound] = field(default_factory=list)
    baseline: dict | None = None
    #: the transport of the m2nkit rounds ("ipc" with --colocated)
    transport: str = "torch_p2p"


def run_demo(model: str, trainer: str, inference: str, *, rounds: int = 2, timeout_s: float = 60.0,
             bucket_bytes: int = 4 << 20, workdir: str | None = None, baseline: bool = True,
             log=print, start_method: str = "spawn", colocated: bool = False) -> DemoResult:
    """Run the demo; returns the verified rounds.

    Args:
        model: a built-in tiny model name (``m2nkit.adapters.tiny``) or a
            checkpoint directory with safetensors data.
        trainer, inference: specs as for ``m2nkit plan``; an ``fsdp2:`` trainer
            spec runs real FSDP2 trainers that train between rounds (module
            docstring).
        rounds: update rounds, weights changed each round.
        timeout_s: bound on every wait in the session (seconds).
        start_method: how the trainer and worker processes start
            (``multiprocessing``; tests use a preloaded ``"forkserver"``).
        colocated: trainers and workers share memory: the rounds use the
            ``ipc`` transport (each worker copies its boxes from the
            trainers' shards in shared memory) and the baseline is full
            tensors per parameter over shared memory, as vLLM's ``ipc``
            backend moves them (``engine/tools/colocated_baseline.py``).

    Raises:
        ValueError: bad model, specs, or a plan with problems.
        RuntimeError: a process failed, or a worker's bytes or version are
            wrong after a round (names the worker and tensors).
    """
    from m2nkit.adapters.hf_checkpoint import full_checkpoint_tensors, read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import parse_inference_spec, reference_load
    from m2nkit.engine.in_process import bitwise_equal
    from m2nkit.engine.tools.server import InferenceServer
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json
    from m2nkit.adapters.hf_checkpoint import checkpoint_metas

    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if bucket_bytes < 1:
        raise ValueError(f"--bucket-mib must be at least one byte, got {bucket_bytes} bytes")
    from m2nkit.adapters.trainer_spec import parse_trainer_spec as _pts
    from m2nkit.adapters.vllm import parse_inference_spec as _pis

    count = _pts(trainer).num_ranks + _pis(inference).num_workers
    if count > MAX_DEMO_PROCESSES:
        raise ValueError(f"{trainer} -> {inference} needs {count} processes; the demo runs at most "
                         f"{MAX_DEMO_PROCESSES} on one machine (use m2nkit plan for larger layouts)")
    tmp = tempfile.TemporaryDirectory(prefix="m2nkit-demo-") if workdir is None else None
    work = Path(workdir or tmp.name)
    try:
        model_dir = demo_checkpoint(model, work / model, log)
        ckpt = read_checkpoint(model_dir)
        if not ckpt.has_data:
            raise ValueError(f"--model {model_dir} has only a config; the demo needs tensor data")
        tspec = parse_trainer_spec(trainer)
        ispec = parse_inference_spec(inference)
        live = tspec.kind == "fsdp2"
        metas = checkpoint_metas(ckpt, tspec)
        from m2nkit.adapters.vllm import vllm_destination

        plan, _ = plan_from_manifest(manifest_to_json(metas, tspec.num_ranks),
                                     vllm_destination(ckpt.config, ispec))
        if plan.problems:
            raise ValueError("the plan has problems: " + "; ".join(map(str, plan.problems[:5])))
        transport = "ipc" if colocated else "torch_p2p"
        result = DemoResult(str(model), str(tspec), str(ispec), plan.nbytes_min,
                            transport=transport)
        full = full_checkpoint_tensors(ckpt)
        T = tspec.num_ranks
        log(f"model {ckpt.architecture} from {model_dir}; {T} trainer ranks ({tspec}) -> "
            f"{ispec.num_workers} workers ({ispec}); {len(plan.wires)} wire tensors, "
            f"{plan.num_slabs} slabs")
        ctx = mp.get_context(start_method)
        server = InferenceServer(model_dir, str(ispec), timeout_s=4 * timeout_s,
                                 start_method=start_method)
        procs = []
        finished = False
        try:
            log(f"starting {ispec.num_workers} inference worker "
                f"process{'' if ispec.num_workers == 1 else 'es'} (each loads torch; "
                "seconds on a busy machine)")
            url = server.start()
            log(f"inference server at {url}, worker pids {server.worker_pids}")
            results = ctx.Queue()
            gos = [ctx.Queue() for _ in range(T)]
            port = free_port()
            if live:
                log(f"starting {T} trainer process{'' if T == 1 else 'es'}: each builds the model "
                    "with transformers, "
                    + ("applies the family's TP plan, " if tspec.tp > 1 else "")
                    + "shards it with fully_shard, then all join the transfer group")
            else:
                log(f"starting {T} trainer process{'' if T == 1 else 'es'}: each reads its own "
                    "shard, then all join the transfer group")
            t_init = time.monotonic()
            dist_port = free_port()
            if live:
                start_ranks(_fsdp2_trainer_main, lambda r: (
                    r, T, str(model_dir), str(tspec), str(ispec), url, port, dist_port, rounds,
                    timeout_s, bucket_bytes, str(work), results, gos[r], transport),
                    T, ctx=ctx, name="m2nkit-trainer-{rank}", started=procs)
            else:
                start_ranks(_trainer_main, lambda r: (
                    r, T, str(model_dir), str(tspec), str(ispec), url, port, rounds,
                    timeout_s, bucket_bytes, results, gos[r], transport),
                    T, ctx=ctx, name="m2nkit-trainer-{rank}", started=procs)

            def failed(msg):
                raise RuntimeError(f"trainer rank {msg[1]} failed: {msg[2]}\n{msg[3]}")

            def collect(what, count):
                return wait_reports(results, count, time.monotonic() + 6 * timeout_s,
                                     what, log, failed, procs)

            joined = collect("the trainers to join", T)
            if live:
                doc = next(m[3] for m in joined if m[1] == 0)
                _check_live_manifest(doc, metas, T, str(tspec))
                log(f"the live FSDP2 manifest matches the dry run of {tspec}: "
                    f"{len(metas)} wire tensors, same pieces on every rank")
            log(f"{_count(T, 'trainer')} joined in {time.monotonic() - t_init:.1f} s; "
                f"{_count(rounds, 'round')} follow{'s' if rounds == 1 else ''}")
            for k in range(1, rounds + 1):
                for q in gos:
                    q.put(k)
                reports = collect(f"the trainers' round {k} reports", T)
                per_rank = [0] * T
                secs = 0.0
                losses = []
                for _, rank, _, (nbytes, seconds, *loss) in reports:
                    per_rank[rank] = nbytes
                    secs = max(secs, seconds)
                    losses += loss
                versions = server.weight_versions()
                if versions != [f"v{k}"] * ispec.num_workers:
                    raise RuntimeError(f"round {k}: worker versions are {versions}, expected v{k}")
                if live:  # the trainers' parameters after the step, gathered for the check only
                    shifted = full_checkpoint_tensors(read_checkpoint(work / f"trained-v{k}"))
                else:
                    shifted = {n: shift(t, k) for n, t in full.items()}
                for w in range(ispec.num_workers):
                    got = server.storage(w, work / f"round{k}")
                    ref = reference_load(ckpt.config, shifted, ispec, w)
                    bad = sorted(n for n in got if n not in ref or not bitwise_equal(got[n], ref[n]))
                    missing = sorted(n for n in ref if n not in got and n not in plan.destination.aliases)
                    if bad or missing:
                        raise RuntimeError(f"round {k}: worker {w} differs from vLLM's loaders on "
                                           f"{bad[:5]} (missing {missing[:5]})")
                loss = sum(losses) / len(losses) if losses else None
                result.rounds.append(DemoRound(k, per_rank, secs, ispec.num_workers, loss))
                log(f"round {k}: "
                    + (f"one AdamW step (mean loss {loss:.4f}), then " if live else "")
                    + f"{sum(per_rank)} bytes in {secs * 1e3:.1f} ms, "
                    f"all {ispec.num_workers} workers bit-exact at version v{k}"
                    + (" against the trained parameters" if live else ""))
            log("rounds done; stopping the trainer and worker processes")
            finished = True
        finally:
            stop_processes(procs, grace_s=timeout_s if finished else 0.0)
            server.stop()
        if baseline:
            what = ("full tensors per parameter over shared memory (vLLM's ipc backend)"
                    if colocated else "gather-then-broadcast")
            log(f"baseline: {what} on the same data and ranks, for comparison: "
                f"{T + ispec.num_workers} new processes, the slowest part of the demo "
                "(--no-baseline skips it)")
            t_base = time.monotonic()
            # fsdp2: what the trainers hold after the last step, as the m2nkit round sent it
            held = (work / f"trained-v{rounds}", doc) if live else None
            result.baseline = _run_baseline(model_dir, tspec, ispec, timeout_s, log=log,
                                            held=held, colocated=colocated)
            log(f"baseline: done in {time.monotonic() - t_base:.1f} s"
                + ("" if result.baseline["verified"] else ", NOT bit-exact"))
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def _baseline_rank(rank, model_dir, trainer, inference, ports, timeout_s, results, held=None,
                   colocated=False):
    """One process of the gather-then-broadcast baseline (``engine/tools/baseline.py``).

    ``held``: ``(trained checkpoint dir, live manifest JSON)`` of an fsdp2 demo: move
    those weights in that layout and those wire dtypes (``held_stream``)."""
    _child_setup()
    try:
        from transformers.utils import logging as hf_logging

        from m2nkit.adapters.hf_checkpoint import (
            checkpoint_manifest,
            checkpoint_metas,
            full_checkpoint_tensors,
            read_checkpoint,
        )
        from m2nkit.adapters.trainer_spec import parse_trainer_spec
        from m2nkit.adapters.vllm import reference_load
        from m2nkit.engine.tools.baseline import (
            create_trainer_group,
            gather_then_broadcast_round,
            held_stream,
        )
        from m2nkit.engine.in_process import allocate_storage, bitwise_equal
        from m2nkit.engine.session import plan_from_manifest
        from m2nkit.engine.control import create_group
        from m2nkit.manifest.serialize import manifest_from_json, manifest_to_json

        hf_logging.set_verbosity_error()
        ckpt = read_checkpoint(model_dir)
        tspec = parse_trainer_spec(trainer)
        T = tspec.num_ranks
        from m2nkit.adapters.vllm import vllm_destination

        doc = manifest_to_json(checkpoint_metas(ckpt, tspec), T) if held is None else held[1]
        plan, _ = plan_from_manifest(doc, vllm_destination(ckpt.config, inference))
        data = ckpt if held is None else read_checkpoint(held[0])
        world = T + plan.num_workers
        from m2nkit.engine.tools.colocated_baseline import SharedPool, full_tensor_ipc_round

        store, group = create_group("127.0.0.1", ports[0], rank, world, timeout_s=timeout_s)
        if rank < T:
            _, tgroup = create_trainer_group("127.0.0.1", ports[1], rank, T, timeout_s=timeout_s)
            stream = (checkpoint_manifest(ckpt, tspec, rank).iter_local() if held is None
                      else held_stream(data, manifest_from_json(doc)[0], T, rank))
            t0 = time.perf_counter()
            if colocated:       # bytes: the all-gather and the full tensors assembled
                moved = full_tensor_ipc_round(store, tgroup, plan, rank, 1, stream=stream,
                                              pool=SharedPool(), timeout_s=timeout_s)
                nbytes = moved.gathered + moved.assembled
            else:
                moved = gather_then_broadcast_round(group, tgroup, plan, rank, stream=stream,
                                                    timeout_s=timeout_s)
                nbytes = moved.sent + moved.gathered
            results.put(("trainer", rank, nbytes, time.perf_counter() - t0))
        else:
            w = rank - T
            storage = allocate_storage(plan.destination, w)
            t0 = time.perf_counter()
            if colocated:
                full_tensor_ipc_round(store, None, plan, rank, 1, storage=storage,
                                      timeout_s=timeout_s)
            else:
                gather_then_broadcast_round(group, None, plan, rank, storage=storage,
                                            timeout_s=timeout_s)
            seconds = time.perf_counter() - t0
            ref = reference_load(ckpt.config, full_checkpoint_tensors(data), inference, w)
            ok = all(bitwise_equal(t, ref[n]) for n, t in storage.items())
            results.put(("worker", rank, ok, seconds))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", 0.0))


def _run_baseline(model_dir, tspec, ispec, timeout_s, log=print, held=None,
                  colocated=False) -> dict:
    """Gather-then-broadcast (``colocated``: full tensors per parameter over shared
    memory, ``colocated_baseline.py``) on the same checkpoint and ranks, verified.

    ``held``: for fsdp2 trainers, ``(trained checkpoint dir, live manifest
    JSON)``: the baseline moves the weights the trainers hold after the last
    step, in the live layout and wire dtypes, not the untrained checkpoint.
    Trainer ranks all-gather every full tensor, trainer rank 0 sends it to
    every worker (``engine/tools/baseline.py``). Returns bytes sent by trainer
    ranks (point to point plus all-gather), the slowest rank's time, and
    whether every worker ended bit-exact. Long waits are reported to
    ``log``; on any error (or interrupt) its processes are killed at once.

    Raises:
        RuntimeError: a baseline process failed or did not finish in time.
    """
    T, N = tspec.num_ranks, ispec.num_workers
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = (free_port(), free_port())
    held = None if held is None else (str(held[0]), held[1])
    procs: list = []

    def failed(msg):
        raise RuntimeError(f"baseline rank {msg[1]} failed: {msg[2]}")

    finished = False
    try:
        start_ranks(_baseline_rank, lambda r: (r, str(model_dir), str(tspec), str(ispec), ports,
                                               timeout_s, results, held, colocated),
                    T + N, ctx=ctx, name="m2nkit-baseline-{rank}", started=procs)
        reports = wait_reports(results, T + N, time.monotonic() + 6 * timeout_s,
                               "the baseline's ranks", log, failed, procs)
        finished = True
    finally:
        stop_processes(procs, grace_s=5.0 if finished else 0.0)
    sent = [m[2] for m in reports if m[0] == "trainer"]
    return {
        "bytes_total": sum(sent),
        "bytes_max_rank": max(sent),
        "seconds": max(m[3] for m in reports),
        "verified": all(m[2] for m in reports if m[0] == "worker"),
        "method": "full tensors per param (IPC)" if colocated else "gather-then-broadcast",
    }
