"""``m2nkit demo --trainer bridge:...`` and ``--trainer megatron:...``: Megatron trainers.

``m2nkit demo --trainer bridge:tp=T,pp=P[,ep=E] [--bridge-mode tasks|export]``:

Megatron-Bridge trainers into m2nkit's stand-in vLLM workers, verified
against Bridge's own export. Each trainer process joins a gloo world over
127.0.0.1, initialises megatron-core's model-parallel groups
(``parallel_state.initialize_model_parallel``), builds and loads the
checkpoint with ``AutoBridge.from_hf_pretrained(dir)`` (Bridge's provider,
megatron-core's local layer spec: no TransformerEngine on CPU) and makes an
M2N source with ``bridge_source(bridge, model, mode=...)``
(``m2nkit.adapters.megatron.bridge``). Trainer rank 0 drives the workers
over vLLM's weight-transfer HTTP routes (``engine/tools/server.py``).

Every round the trainers change their weights in place (``perturb``: every
parameter ``p <- p * 0.75 + 0.25 * k`` in round ``k``, elementwise, so
replicas stay equal), send them with ``M2NTrainerEngine.send_weights``,
then run Bridge's ``export_hf_weights`` (every rank: it is collective) and
trainer rank 0 saves what it yields. The driver compares every worker's
storage bit for bit with ``reference_load`` of that export, and checks the
committed version. Before the first round the driver prints the session's
notes (``M2NTrainerEngine.notes``): how vLLM's dtype and expert placement
were decided and which wire tensors went through Bridge's gather, and why.

``m2nkit demo --trainer megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D]``
runs the same trainer processes with one difference, the source:
``megatron_source(model_chunks, config=...)`` (``m2nkit.adapters.megatron.source``),
which reads the live Megatron-Core tensors (fused QKV shards, ``[gate_r;
up_r]``, padded vocabulary rows, local experts, one model chunk per virtual
stage) and never gathers; the check is the same, against Bridge's own
export of the changed weights (:func:`run_megatron_demo`). Both demos live
here because they are one driver and one trainer process with two sources.

The process-side helpers (:func:`init_megatron`, :func:`build_bridge_model`,
:func:`perturb`, :func:`exported_tensors`) are shared with the Bridge
integration tests and the benchmark. Importing this module is cheap (no
torch, no megatron).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["BRIDGE_SPEC_FORM", "BRIDGE_MODES", "BridgeSpec", "parse_bridge_spec",
           "MEGATRON_DEMO_FORM", "MegatronDemoSpec", "parse_megatron_demo_spec",
           "init_megatron", "build_bridge_model", "perturb", "exported_tensors",
           "bridge_trainer_main", "megatron_trainer_main", "run_bridge_demo",
           "run_megatron_demo"]

BRIDGE_SPEC_FORM = "bridge:tp=T,pp=P[,ep=E][,etp=X][,dp=D]"
#: ``--bridge-mode`` values (``bridge_source``'s ``mode``).
BRIDGE_MODES = ("tasks", "export")
_KEYS = ("tp", "pp", "ep", "etp", "dp")


class BridgeSpec:
    """A parsed ``bridge:`` trainer spec: Megatron parallel sizes, world ``tp*dp*pp``."""

    def __init__(self, par: Any) -> None:
        self.par = par  # m2nkit.adapters.megatron.layout.MegatronParallel

    @property
    def num_ranks(self) -> int:
        p = self.par
        return p.tp * p.dp * p.pp

    def __str__(self) -> str:
        p = self.par
        parts = [f"tp={p.tp}", f"pp={p.pp}"] + ([f"ep={p.ep}"] if p.ep > 1 else [])
        parts += [f"etp={p.etp}"] if p.etp != p.tp else []
        parts += [f"dp={p.dp}"] if p.dp > 1 else []
        return "bridge:" + ",".join(parts)


def parse_bridge_spec(text: str) -> BridgeSpec:
    """Parse ``bridge:tp=T,pp=P[,ep=E][,etp=X][,dp=D]`` (sizes as megatron-core takes them).

    ``etp`` defaults to ``tp``; ``dp`` to the least that fits the expert
    grid (megatron-core ``parallel_state``: ``tp*dp`` divisible by ``etp*ep``).

    Raises:
        ValueError: not a ``bridge:`` spec, an unknown or repeated size, a
            size that is not a positive integer, or sizes megatron-core
            refuses (one line, naming the value and the valid form).
    """
    from m2nkit.adapters.megatron.spec import parse_megatron_body

    head, colon, body = text.partition(":")
    if head.strip().lower() != "bridge" or not colon or not body.strip():
        raise ValueError(f"trainer spec '{text}' is not {BRIDGE_SPEC_FORM}")
    for part in body.split(","):
        key = part.partition("=")[0].strip().lower()
        if key and key not in _KEYS:
            raise ValueError(f"trainer spec '{text}': 'bridge' size {key!r} is not supported; "
                             f"sizes are {', '.join(_KEYS)} ({BRIDGE_SPEC_FORM})")

    def bad(spec: str, why: str) -> ValueError:
        return ValueError(f"trainer spec '{spec}': " + why.replace("'megatron'", "'bridge'"))

    return BridgeSpec(parse_megatron_body(text, body, bad).par)


#: ``mode`` of the shared trainer process for a ``megatron:`` spec: the model is built and
#: loaded through Bridge as above, the source is ``megatron_source`` (:func:`run_megatron_demo`).
MEGATRON_SOURCE = "megatron"

#: The ``megatron:`` trainer specs the demo runs (the dry run's grammar, minus first/last).
MEGATRON_DEMO_FORM = "megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D]"


class MegatronDemoSpec:
    """A ``megatron:`` trainer spec the demo can run: sizes, world ``tp*dp*pp``."""

    def __init__(self, par: Any, text: str) -> None:
        self.par = par  # m2nkit.adapters.megatron.layout.MegatronParallel
        self._text = text

    @property
    def num_ranks(self) -> int:
        return self.par.world

    def __str__(self) -> str:
        return self._text


def parse_megatron_demo_spec(text: str) -> MegatronDemoSpec:
    """Parse a ``megatron:`` spec for the demo (the dry-run grammar, minus ``first``/``last``).

    Raises:
        ValueError: not a ``megatron:`` spec, a size megatron-core refuses
            (one line, naming the value and the valid form), or
            ``first``/``last`` (uneven stages are planned by ``m2nkit plan``
            and tested in tests/integration/test_megatron_source.py; the demo
            builds even stages).
    """
    from m2nkit.adapters.trainer_spec import parse_trainer_spec

    spec = parse_trainer_spec(text)
    if spec.megatron is None:
        raise ValueError(f"trainer spec '{text}' is not {MEGATRON_DEMO_FORM}")
    if spec.megatron.first is not None or spec.megatron.last is not None:
        raise ValueError(f"trainer spec '{text}': the demo builds even pipeline stages; first= "
                         f"and last= are for m2nkit plan ({MEGATRON_DEMO_FORM})")
    return MegatronDemoSpec(spec.megatron.par, str(spec.megatron))


def demo_spec(text: str):
    """The parsed ``bridge:`` or ``megatron:`` demo trainer spec (``.par``, ``.num_ranks``)."""
    if text.strip().lower().startswith("megatron:"):
        return parse_megatron_demo_spec(text)
    return parse_bridge_spec(text)


# --------------------------------------------------------------------------
# trainer-process helpers (shared with tests/integration/_bridge.py and benchmarks)


def init_megatron(tp: int, pp: int, ep: int = 1, etp: int | None = None, vpp: int = 1) -> None:
    """(Re)initialise megatron-core's model-parallel groups on the live default group.

    Needs ``torch.distributed`` initialised over ``tp*dp*pp`` ranks and
    ``m2nkit.adapters.megatron.compat.enable_cpu()`` on a CPU machine.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=(etp or tp) if ep > 1 else None)
    # CPU: the inference RNG tracker's fork() needs no CUDA RNG state
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)


def build_bridge_model(ckpt: str | os.PathLike, tp: int, pp: int, ep: int = 1,
                       etp: int | None = None, vpp: int = 1, *, first: int | None = None,
                       last: int | None = None):
    """``(bridge, model chunks)``: ``ckpt`` built and loaded through Megatron-Bridge on CPU.

    ``AutoBridge.from_hf_pretrained(ckpt)``, its ``to_megatron_provider``
    with the parallel sizes, megatron-core's local layer spec (Bridge
    ``models/gpt_provider.py`` ``local_layer_spec``; no TransformerEngine),
    the fusions that need CUDA kernels off, ``provide_distributed_model``
    and ``load_hf_weights``. ``first``/``last``: megatron-core's
    ``num_layers_in_first/last_pipeline_stage`` (uneven stages). Collective
    over the default group (call after :func:`init_megatron` with the same sizes).
    """
    import torch
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.gpt_provider import local_layer_spec

    bridge = AutoBridge.from_hf_pretrained(str(ckpt))
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None  # a chunk per vp stage
    provider.num_layers_in_first_pipeline_stage = first
    provider.num_layers_in_last_pipeline_stage = last
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = (etp or tp) if provider.num_moe_experts else None
    provider.sequence_parallel = False
    if getattr(provider, "multi_latent_attention", False):
        # MLA (DeepSeek-V3): megatron-core's local decoder block spec (dense first
        # layers, MoE after), its parameterless core attention replaced by a CPU
        # stand-in (compat.with_mla_stand_in: the local one refuses MLA's k_channels);
        # no MTP block (Bridge builds it with TransformerEngine unconditionally)
        from functools import partial

        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from m2nkit.adapters.megatron.compat import with_mla_stand_in

        if provider.q_lora_rank is None and provider.qk_layernorm:
            # megatron-core 0.19.2 (mla_qk_norm_config.py) then builds linear_q_proj as
            # TransformerEngine's fused norm+linear, a q norm HF does not have
            # (Megatron-Bridge#5261/#5585); the local spec has no such module
            raise ValueError(
                "MLA with q_lora_rank null and qk_layernorm: megatron-core 0.19.2 builds "
                "linear_q_proj as TransformerEngine's fused layer-norm linear "
                "(transformer/mla_qk_norm_config.py), which cannot be built on CPU")
        provider.transformer_layer_spec = with_mla_stand_in(
            partial(get_gpt_decoder_block_spec, use_transformer_engine=False))
        provider.mtp_num_layers = None
    else:
        provider.transformer_layer_spec = local_layer_spec  # no TransformerEngine on CPU
    if provider.num_moe_experts:
        provider.moe_token_dispatcher_type = "allgather"  # alltoall touches CUDA streams
        # overlapping shared experts with the dispatch needs alltoall (megatron-core
        # TransformerConfig); a scheduling option, no parameter depends on it
        provider.moe_shared_expert_overlap = False
    for flag in ("moe_permute_fusion", "moe_grouped_gemm", "gradient_accumulation_fusion",
                 "masked_softmax_fusion", "bias_activation_fusion", "persist_layer_norm",
                 "apply_rope_fusion"):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    provider.use_cpu_initialization = True
    provider.pipeline_dtype = torch.bfloat16
    provider.finalize()
    if type(provider).__name__ in ("Qwen3VLModelProvider", "Qwen3VLMoEModelProvider"):
        # Bridge builds both parts with TransformerEngine only: the language model on
        # megatron-core's local spec, no vision tower (compat.vlm_language_model_only)
        from m2nkit.adapters.megatron.compat import vlm_language_model_only

        vlm_language_model_only(provider)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.load_hf_weights(model)
    return bridge, model


def perturb(model_chunks, round_index: int) -> None:
    """Round ``round_index``'s weights: every parameter ``p <- p * 0.75 + 0.25 * round_index``.

    In place and elementwise, so every replica (TP-replicated norms, tied
    embeddings over PP) changes alike and every rank's shard stays a shard
    of the changed full tensor.
    """
    import torch

    with torch.no_grad():
        for chunk in model_chunks:
            for p in chunk.parameters():
                if p.is_floating_point():
                    p.mul_(0.75).add_(0.25 * round_index)


def exported_tensors(bridge, model_chunks) -> dict:
    """Bridge's own ``export_hf_weights(model, cpu=True)``: ``{HF name: full tensor}``.

    Collective: every rank of the model calls it; every rank gets every tensor.
    """
    return {n: t.detach().clone().contiguous()
            for n, t in bridge.export_hf_weights(model_chunks, cpu=True, show_progress=False)}


def _setup_child() -> None:
    """A demo trainer process: SIGINT ignored (the driver stops it), exit with the parent,
    one torch thread, megatron's CPU shims, quiet loggers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import logging
    import warnings

    import torch

    from m2nkit.adapters.megatron.compat import enable_cpu
    from m2nkit.engine.tools.server import exit_with_parent

    exit_with_parent()
    torch.set_num_threads(1)
    enable_cpu()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def bridge_trainer_main(rank: int, world: int, model_dir: str, trainer: str, inference: str,
                        mode: str, dist_port: int, rounds: int,
                        timeout_s: float, bucket_bytes: int, work: str, results, go,
                        transport: str = "torch_p2p") -> None:
    """One Bridge trainer process: build through Bridge, ``bridge_source``, then per round
    ``perturb``, ``send_weights`` and Bridge's export (rank 0 saves it for the check).

    ``go`` first brings the inference server's URL and the transfer group's
    port (the model is built while the server starts; a port picked before a
    build of a minute or more could be taken by then), then each round's
    number. Reports ``("built", rank)``,
    ``("init", rank, seconds, (manifest JSON, notes) on rank 0)``, one
    ``("round", rank, k, (bytes sent, seconds))`` per round, or
    ``("error", rank, message, traceback)``. Megatron's and Bridge's own
    prints during the build are dropped; the process ends with ``os._exit``
    once its reports are flushed (the triton extension megatron-core imports
    prints nanobind "leak" reports at interpreter teardown).
    """
    _setup_child()
    code = 1
    try:
        from datetime import timedelta

        import torch.distributed as dist
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from m2nkit.adapters import bridge_source, megatron_source
        from m2nkit.adapters.vllm import vllm_destination
        from m2nkit.engine.clients import HTTPClient
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo
        from m2nkit.manifest.serialize import manifest_to_json

        par = demo_spec(trainer).par
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=6 * timeout_s))
        t0 = time.perf_counter()
        init_megatron(par.tp, par.pp, par.ep, par.etp, par.vpp)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), \
                contextlib.redirect_stderr(quiet):
            bridge, model = build_bridge_model(model_dir, par.tp, par.pp, par.ep, par.etp, par.vpp)
        source = (megatron_source(model, config=bridge.hf_pretrained.config)
                  if mode == MEGATRON_SOURCE else bridge_source(bridge, model, mode=mode))
        config = AutoConfig.from_pretrained(model_dir)
        results.put(("built", rank))
        url, port = go.get(timeout=10 * timeout_s)
        info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=world,
                                  destination=vllm_destination(config, inference),
                                  master_port=port, timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                                  transport=transport)
        client = HTTPClient(url, timeout_s=4 * timeout_s) if rank == 0 else None
        engine = M2NTrainerEngine.trainer_init(info, client=client, source=source)
        said = (manifest_to_json(source.metadata, world), list(engine.notes)) if rank == 0 else None
        results.put(("init", rank, time.perf_counter() - t0, said))
        for k in range(1, rounds + 1):
            if go.get(timeout=10 * timeout_s) != k:
                raise RuntimeError("demo driver out of step")
            perturb(model, k)
            stats = engine.send_weights(f"v{k}")
            exported = exported_tensors(bridge, model)  # the check's reference, every rank
            if rank == 0:
                save_file(exported, str(Path(work) / f"export-v{k}.safetensors"))
            results.put(("round", rank, k, (stats.bytes_sent, stats.seconds)))
        engine.shutdown()
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()   # the reports are out
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def megatron_trainer_main(rank: int, num_ranks: int, checkpoint: str, trainer: str,
                          inference: str, client, port: int, dist_port: int, timeout_s: float,
                          results) -> None:
    """One Megatron-Core trainer process: ``checkpoint`` loaded through Bridge, one round ``v1``.

    ``trainer`` is a ``megatron:`` spec (``megatron:tp=2``); the model is
    built and loaded as :func:`bridge_trainer_main` does (:func:`init_megatron`,
    :func:`build_bridge_model`) on a gloo default group at ``dist_port`` and
    sent through ``megatron_source`` (the live Megatron-Core shards, never
    gathered) with ``send_weights("v1")``; ``client`` (rank 0) drives the
    workers. Reports on ``results`` as ``demo_vllm.trainer_main`` does:
    ``("round", rank, 1, (bytes, seconds))``, then ``("done", rank, None,
    None)``, or ``("error", rank, message, traceback)``; the process ends
    with ``os._exit`` once its reports are flushed (as :func:`bridge_trainer_main`).
    """
    _setup_child()
    code = 1
    try:
        from datetime import timedelta

        import torch.distributed as dist
        from transformers import AutoConfig

        from m2nkit.adapters import megatron_source
        from m2nkit.adapters.vllm import vllm_destination
        from m2nkit.engine.trainer import M2NTrainerEngine, M2NTrainerInitInfo

        par = parse_megatron_demo_spec(trainer).par
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank,
                                world_size=num_ranks, timeout=timedelta(seconds=timeout_s))
        try:
            init_megatron(par.tp, par.pp, par.ep, par.etp, par.vpp)
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), \
                    contextlib.redirect_stderr(quiet):
                bridge, model = build_bridge_model(checkpoint, par.tp, par.pp, par.ep, par.etp,
                                                   par.vpp)
            source = megatron_source(model, config=bridge.hf_pretrained.config)
            info = M2NTrainerInitInfo(rank=rank, num_trainer_ranks=num_ranks,
                                      destination=vllm_destination(
                                          AutoConfig.from_pretrained(checkpoint), inference),
                                      master_port=port, timeout_s=timeout_s)
            engine = M2NTrainerEngine.trainer_init(info, client=client if rank == 0 else None,
                                                   source=source)
            stats = engine.send_weights("v1")
            results.put(("round", rank, 1, (stats.bytes_sent, stats.seconds)))
            engine.shutdown()
        finally:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        results.put(("done", rank, None, None))
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        results.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()   # the reports are out
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# --------------------------------------------------------------------------
# the driver


def _cfg(config, key):
    """``config[key]`` of a dict or attribute config; ``None`` when absent."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def run_bridge_demo(model: str, trainer: str, inference: str, *, mode: str = "tasks",
                    rounds: int = 2, timeout_s: float = 60.0, bucket_bytes: int = 4 << 20,
                    workdir: str | None = None, log=print, start_method: str = "spawn",
                    transport: str = "torch_p2p"):
    """Run the Bridge demo; returns a ``DemoResult`` of verified rounds.

    Args:
        model: a built-in tiny model name (``m2nkit.adapters.tiny``) or a
            checkpoint directory with safetensors data, of an architecture
            both Megatron-Bridge and m2nkit know.
        trainer: ``bridge:tp=T,pp=P[,ep=E][,etp=X][,dp=D]``.
        inference: ``vllm:...`` as for ``m2nkit plan``.
        mode: ``bridge_source``'s mode, ``"tasks"`` or ``"export"``.
        rounds: update rounds; the weights change before each.
        timeout_s: bound on every wait of the session (seconds); the
            trainers' start (importing megatron and Bridge, building) gets
            six times that, the workers' start (meanwhile) twice that, at
            least 120 s.

    Raises:
        ValueError: bad model, specs, mode or round count.
        RuntimeError: a trainer failed (its message and rank), or a worker's
            bytes or version differ from Bridge's export after a round.
    """
    from m2nkit.adapters.hf_checkpoint import read_checkpoint
    from m2nkit.adapters.vllm import parse_inference_spec, reference_load, vllm_destination
    from m2nkit.engine.in_process import bitwise_equal
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.engine.tools.demo import MAX_DEMO_PROCESSES, DemoResult, DemoRound, demo_checkpoint
    from m2nkit.engine.tools.procs import free_port, start_ranks, stop_processes, wait_reports
    from m2nkit.engine.tools.server import InferenceServer

    if mode not in BRIDGE_MODES + (MEGATRON_SOURCE,):
        raise ValueError(f"--bridge-mode {mode!r} is not one of {', '.join(BRIDGE_MODES)}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    tspec = demo_spec(trainer)
    ispec = parse_inference_spec(inference)
    T = tspec.num_ranks
    if T + ispec.num_workers > MAX_DEMO_PROCESSES:
        raise ValueError(f"{trainer} -> {inference} needs {T + ispec.num_workers} processes; the "
                         f"demo runs at most {MAX_DEMO_PROCESSES} on one machine")
    tmp = tempfile.TemporaryDirectory(prefix="m2nkit-demo-") if workdir is None else None
    work = Path(workdir or tmp.name)
    try:
        model_dir = demo_checkpoint(model, work / model, log)
        ckpt = read_checkpoint(model_dir)
        config = ckpt.config
        destination = vllm_destination(config, ispec)  # refuses an unknown family here
        # Refuse, in one line and before any process starts, what megatron-core
        # would refuse later inside the trainers (m2nkit.adapters.megatron.spec,
        # megatron_size_problem: heads, query groups, FFN, experts, vocabulary,
        # even stages), naming the spec as the user typed it.
        from m2nkit.adapters.megatron.spec import megatron_size_problem

        why = megatron_size_problem(tspec.par, config, loader="bridge")
        if (not why and _cfg(config, "kv_lora_rank") is not None
                and _cfg(config, "q_lora_rank") is None):
            why = ("MLA with q_lora_rank null: megatron-core 0.19.2 builds linear_q_proj as "
                   "TransformerEngine's fused layer-norm linear (transformer/"
                   "mla_qk_norm_config.py), which cannot be built on CPU and adds a q norm "
                   "the checkpoint does not have (docs/megatron.md, Limits)")
        if not why and _cfg(config, "vision_config") is not None and str(
                (_cfg(config, "architectures") or [""])[0]).startswith("Qwen3VL"):
            why = ("Qwen3-VL: Megatron-Bridge 0.6.2 builds its vision tower with "
                   "TransformerEngine only (modelling_qwen3_vl/model.py), so a CPU trainer "
                   "holds the language model alone, which cannot fill vLLM's tower; plan it "
                   "with m2nkit plan --trainer megatron:... (docs/megatron.md, Limits)")
        if why:
            raise ValueError(f"trainer spec '{trainer}': {why}")
        if mode != "export":
            # Shard-level sources (bridge_source tasks, megatron_source) lay the tensors
            # out by m2nkit's Megatron-Core names; the export carries any family Bridge
            # exports (bridge_source(mode="export"): full tensors from export_hf_weights).
            from m2nkit.adapters.hf_checkpoint import checkpoint_metas
            from m2nkit.adapters.trainer_spec import parse_trainer_spec

            label = "megatron:" + trainer.partition(":")[2]
            dry = parse_trainer_spec(label)
            try:
                metas = checkpoint_metas(ckpt, dry)
            except ValueError as e:
                msg = str(e).replace(f"trainer spec '{dry}'", f"trainer spec '{trainer}'")
                raise ValueError(msg.replace(f"trainer spec '{label}'",
                                             f"trainer spec '{trainer}'")) from None
            # the workers' side too (a tp the family's vLLM layout refuses), as the
            # stand-in demo does, rather than in every trainer once all are started
            from m2nkit.manifest.serialize import manifest_to_json

            planned, _ = plan_from_manifest(manifest_to_json(metas, T), destination)
            if planned.problems:
                raise ValueError("the plan has problems: "
                                 + "; ".join(map(str, planned.problems[:5])))
        made = "megatron_source" if mode == MEGATRON_SOURCE else f"bridge_source mode={mode!r}"
        log(f"model {ckpt.architecture} from {model_dir}; {T} Megatron trainer ranks loaded "
            f"by Megatron-Bridge ({tspec}, {made}) -> {ispec.num_workers} workers ({ispec})")
        ctx = mp.get_context(start_method)
        # The workers start while the trainers import megatron-core and build: on a
        # busy machine their start follows --timeout too (at least the server's 120 s).
        server = InferenceServer(model_dir, str(ispec), timeout_s=4 * timeout_s,
                                 start_timeout_s=max(120.0, 2 * timeout_s),
                                 start_method=start_method)
        procs: list = []
        finished = False
        try:
            results = ctx.Queue()
            gos = [ctx.Queue() for _ in range(T)]
            dist_port = free_port()
            log(f"starting {T} trainer processes: each imports megatron-core and Megatron-Bridge "
                "and builds and loads the model with AutoBridge.from_hf_pretrained (tens of "
                "seconds on a busy machine)")
            t_init = time.monotonic()
            start_ranks(bridge_trainer_main, lambda r: (
                r, T, str(model_dir), str(tspec), str(ispec), mode, dist_port, rounds,
                timeout_s, bucket_bytes, str(work), results, gos[r], transport),
                T, ctx=ctx, name="m2nkit-bridge-trainer-{rank}", started=procs)
            log(f"meanwhile starting {ispec.num_workers} inference worker process"
                f"{'' if ispec.num_workers == 1 else 'es'}")
            url = server.start()
            log(f"inference server at {url}, worker pids {server.worker_pids}")

            def failed(msg):
                raise RuntimeError(f"trainer rank {msg[1]} failed: {msg[2]}\n{msg[3]}")

            def collect(what, count):
                return wait_reports(results, count, time.monotonic() + 6 * timeout_s, what, log,
                                    failed, procs)

            collect("the Bridge trainers to build their models", T)
            port = free_port()      # picked now, used at once: the trainers are built
            for q in gos:
                q.put((url, port))
            joined = collect("the Bridge trainers to join the transfer group", T)
            manifest, notes = next(m[3] for m in joined if m[1] == 0)
            plan, _ = plan_from_manifest(manifest, destination)
            label = str(tspec) + ("" if mode == MEGATRON_SOURCE else f" ({mode})")
            result = DemoResult(str(model), label, str(ispec), plan.nbytes_min,
                                transport=transport)
            log(f"{T} trainers built and joined in {time.monotonic() - t_init:.1f} s; "
                f"{len(plan.wires)} wire tensors, {plan.num_slabs} slabs")
            for note in notes:
                log(f"note: {note}")
            for k in range(1, rounds + 1):
                for q in gos:
                    q.put(k)
                reports = collect(f"the trainers' round {k} reports", T)
                per_rank = [0] * T
                secs = 0.0
                for _, rank, _, (nbytes, seconds) in reports:
                    per_rank[rank] = nbytes
                    secs = max(secs, seconds)
                versions = server.weight_versions()
                if versions != [f"v{k}"] * ispec.num_workers:
                    raise RuntimeError(f"round {k}: worker versions are {versions}, expected v{k}")
                from safetensors.torch import load_file

                exported = load_file(str(work / f"export-v{k}.safetensors"))
                for w in range(ispec.num_workers):
                    got = server.storage(w, work / f"round{k}")
                    ref = reference_load(config, exported, ispec, w)
                    bad = sorted(n for n in got if n not in ref or not bitwise_equal(got[n], ref[n]))
                    missing = sorted(n for n in ref
                                     if n not in got and n not in plan.destination.aliases)
                    if bad or missing:
                        raise RuntimeError(f"round {k}: worker {w} differs from vLLM's loaders "
                                           f"on Bridge's export on {bad[:5]} (missing {missing[:5]})")
                result.rounds.append(DemoRound(k, per_rank, secs, ispec.num_workers))
                log(f"round {k}: weights changed, {sum(per_rank)} bytes in {secs * 1e3:.1f} ms, "
                    f"all {ispec.num_workers} workers bit-exact at version v{k} against "
                    "Bridge's export_hf_weights")
            log("rounds done; stopping the trainer and worker processes")
            finished = True
        finally:
            stop_processes(procs, grace_s=timeout_s if finished else 0.0)
            server.stop()
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def run_megatron_demo(model: str, trainer: str, inference: str, **kwargs):
    """Run the Megatron-Core demo; returns a ``DemoResult`` of verified rounds.

    Args:
        model: a built-in tiny model name or a checkpoint directory of an
            architecture both Megatron-Bridge (the loader) and m2nkit know.
        trainer: ``megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D]``.
        inference: ``vllm:...`` as for ``m2nkit plan``.
        kwargs: ``rounds``, ``timeout_s``, ``bucket_bytes``, ``workdir``,
            ``log``, ``start_method`` as for :func:`run_bridge_demo`.

    Raises:
        ValueError: bad model, specs or round count (one line).
        RuntimeError: a trainer failed (its message and rank; a
            ``MegatronSourceError`` names the rank that found the problem),
            or a worker's bytes or version differ after a round.
    """
    parse_megatron_demo_spec(trainer)  # refuse here, before any process starts
    return run_bridge_demo(model, trainer, inference, mode=MEGATRON_SOURCE, **kwargs)
