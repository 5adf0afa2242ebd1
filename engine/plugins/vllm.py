"""m2nkit inside vLLM: the ``"m2nkit"`` weight-transfer backend, as a vLLM plugin.

vLLM 0.33.0 builds its worker-side weight-transfer engine from
``--weight-transfer-config '{"backend": NAME}'`` through a registry
(``vllm/distributed/weight_transfer/factory.py``:
``WeightTransferEngineFactory.register_engine(name, module, class)``, then
``create_engine(config, vllm_config, device, model)`` in each worker,
``v1/worker/gpu_worker.py``), and its trainer side through a twin registry
keyed by ``TrainerInitInfo.backend`` (``WeightTransferTrainerFactory``; the
name the issue text gives, ``TrainerWeightTransferEngineFactory``, does not
exist in 0.33.0). vLLM runs every entry point of the ``vllm.general_plugins``
group in each of its processes (``vllm/plugins/__init__.py``,
``load_general_plugins``); m2nkit's ``pyproject.toml`` points that group at
:func:`register`, which puts ``"m2nkit"`` in both registries. So, with
m2nkit installed beside vLLM::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --tensor-parallel-size 2 \\
        --weight-transfer-config '{"backend": "m2nkit"}'

(``VLLM_SERVER_DEV_MODE=1`` mounts the weight-transfer HTTP routes,
``vllm/entrypoints/launchers/api_server/routers.py``).

The worker engine, :class:`M2NVLLMEngine`, is a thin adapter from vLLM's
``WeightTransferEngine`` to m2nkit's ``M2NReceiver``: the receiver writes
each slab straight into the **live** parameters of the model vLLM hands the
engine (never re-allocated, so their addresses, which CUDA graphs hold,
stay). What the adapter adds is what only the live model can tell:

* the destination spec (tp, dp, ep, expert placement, all2all backend,
  dtype) is read from ``vllm_config``, not typed twice;
* before any byte moves, every parameter m2nkit's tables declare for this
  worker is resolved against ``model.named_parameters()`` (name, local
  shape, dtype), every live parameter must be declared, and every alias the
  tables name must really share storage; any difference is refused on every
  rank of the session, naming the parameter and both shapes;
* after a complete round it runs what vLLM runs after loading weights that
  do not go through ``load_weights``: the post-load step of each attention
  layer (MLA's derived ``W_UK``/``W_UV``), as ``finalize_layerwise_reload``
  does at its end (``vllm/model_executor/model_loader/reload/layerwise.py``,
  ``_finalize_attention_layer``; ``model_loader/utils.py``
  ``process_weights_after_loading``).

A quantized model (``quantization="fp8_per_block"``, or a block-quantized fp8
checkpoint such as DeepSeek-V3's) holds kernel-format tensors that m2nkit's
checkpoint-format slabs must not be written into; its rounds go through
vLLM's own layerwise reload instead (``m2nkit.engine.plugins.vllm_reload``,
docs/fp8.md): the plan is checked against the checkpoint-format layout vLLM
recorded before the first load, slabs land in the layers the reload restores,
and vLLM quantizes each layer once it is complete. Any other scheme is
refused by name at every init, on every rank (``vllm_reload.quantization_mode``).
A worker serving ``fp8_per_block`` also accepts trainers whose spec is its own
plus ``quant=fp8_per_block`` (``_destination_for``); with ``wire=fp8`` (mode 2,
dense models) the trainers send e4m3 bytes and scales (``engine.fp8_wire``) and
its transport is wrapped in ``Fp8WireReceiver``, which hands them to the
reload in place of vLLM's own ``per_block_cast_to_fp8``
(``LayerwiseReload._process``), after the live model was held against the
trainers' targets (``_fp8_wire_problems``).

It sits above the runtime it drives (receiver, session, control plane),
like the tools, and below them: nothing of the runtime imports it, and it
imports no tool (``tests/test_layering.py``). Besides the tools, it is the
only module of m2nkit that imports vLLM. The CPU harness that builds a real
vLLM model without ``torch.distributed`` for the tests and ``m2nkit demo
--receiver vllm`` is ``m2nkit.engine.tools.vllm_workers``; a vLLM server
never needs it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from m2nkit.adapters.vllm.builder import vllm_destination
from m2nkit.adapters.vllm.dtype import model_dtype
from m2nkit.adapters.vllm.spec import ALL2ALL_BACKENDS, InferenceSpec
from m2nkit.engine.control import PlanMismatchError
from m2nkit.engine.plugins.live_model import (
    MODE_ENV,
    buffer_device as _buffer_device,
    live_model_problems,
    receive_mode,
    refuse_everywhere,
)
from m2nkit.engine.plugins.vllm_reload import (LayerwiseReload, checkpoint_params, padded_experts,
                                               quantization_mode)
from m2nkit.engine.receiver import M2NReceiver, M2NUpdateInfo, refuse_unparsed_payload
from m2nkit.engine.session import InitPayload, plan_from_manifest, session_destination

__all__ = ["BACKEND", "register", "M2NVLLMEngine", "inference_spec_of", "worker_index_of",
           "live_model_problems", "receive_mode", "MODE_ENV", "TRACE_CHECK_ENV"]

#: The backend name, in ``--weight-transfer-config '{"backend": "m2nkit"}'`` and
#: ``M2NTrainerInitInfo.backend``.
BACKEND = "m2nkit"

_LIST_AT_MOST = 8   # problems quoted in one refusal


def register() -> None:
    """Register ``"m2nkit"`` with both of vLLM's weight-transfer registries.

    The ``vllm.general_plugins`` entry point; vLLM may call it several
    times in one process (``load_general_plugins`` says plugins must allow
    it), so a second call does nothing. Registration is by module path
    (``M2NVLLMEngine`` here, ``M2NTrainerEngine`` of ``m2nkit.engine.trainer``):
    vLLM imports the trainer side only when it builds a trainer engine.
    """
    for factory, module, cls in (
            (WeightTransferEngineFactory, __name__, "M2NVLLMEngine"),
            (WeightTransferTrainerFactory, "m2nkit.engine.trainer", "M2NTrainerEngine")):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:      # "already registered": vLLM loaded the plugin before
            pass


# --------------------------------------------------------------------------
# vLLM's config -> m2nkit's destination


def inference_spec_of(vllm_config: Any) -> InferenceSpec:
    """The m2nkit spec of the layout a vLLM config gives its workers.

    tp, dp, ep, expert placement and all2all backend come from
    ``vllm_config.parallel_config`` (``tensor_parallel_size``,
    ``data_parallel_size``, ``enable_expert_parallel``,
    ``expert_placement_strategy``, ``all2all_backend``); the dtype from
    ``model_config.dtype``, written ``auto`` when m2nkit's reading of vLLM's
    ``auto`` rule gives the same dtype (so a trainer that wrote
    ``vllm:tp=2`` matches a server started without ``--dtype``).

    Raises:
        ValueError: pipeline parallelism (``pipeline_parallel_size > 1``), an
            all2all backend this m2nkit does not know.
    """
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    if pc.pipeline_parallel_size != 1:
        raise ValueError(f"m2nkit does not plan for pipeline parallelism; this vLLM runs "
                         f"pipeline_parallel_size={pc.pipeline_parallel_size} (use 1)")
    all2all = str(pc.all2all_backend)
    if all2all not in ALL2ALL_BACKENDS:
        raise ValueError(f"vLLM all2all_backend {all2all!r} is unknown to m2nkit "
                         f"(knows {', '.join(ALL2ALL_BACKENDS)})")
    dtype = str(mc.dtype).replace("torch.", "")
    try:
        if model_dtype(mc.hf_config, "auto").dtype == mc.dtype:
            dtype = "auto"
    except ValueError:
        pass                # auto is ambiguous for this config: name the dtype
    return InferenceSpec(tp=pc.tensor_parallel_size, dp=pc.data_parallel_size,
                         ep=bool(pc.enable_expert_parallel),
                         placement=str(pc.expert_placement_strategy), all2all=all2all,
                         dtype=dtype)


def worker_index_of(vllm_config: Any) -> int:
    """This worker's index ``dp_index * tp + tp_rank`` (m2nkit's ``worker``).

    vLLM's own rule for a worker's rank in a trainer-to-worker group is
    ``rank_offset + data_parallel_index * world_size + rank`` with
    ``world_size = tp * pp`` (``weight_transfer/nccl_common.py``,
    ``_worker_group_rank``); with ``pp = 1`` that is this index plus the
    number of trainer ranks.
    """
    pc = vllm_config.parallel_config
    return pc.data_parallel_index * pc.world_size + pc.rank


# --------------------------------------------------------------------------
# the worker engine


@dataclass
class _Identity:
    worker: int
    tp_rank: int
    dp_index: int

    def __str__(self) -> str:
        return f"worker {self.worker} (vLLM dp index {self.dp_index}, tp rank {self.tp_rank})"


class M2NVLLMEngine(WeightTransferEngine):
    """vLLM's worker-side ``WeightTransferEngine`` for backend ``"m2nkit"``.

    vLLM builds it in each worker after loading the model
    (``WeightTransferEngineFactory.create_engine(config, vllm_config, device,
    model)``) and calls it from the weight-transfer routes:
    ``parse_init_info`` + ``init_transfer_engine`` (``/init_weight_transfer_engine``),
    ``start_weight_update``, ``update_weights`` (the round's receive; returns
    when every rank's verdict is in), ``finish_weight_update`` (commit),
    ``shutdown``. The init payload and update info are m2nkit's
    (``InitPayload``, ``{"round": k, "version": v}``), sent by
    ``M2NTrainerEngine`` through any ``VLLMWeightSyncClient`` (vLLM's
    ``HTTPVLLMWeightSyncClient`` or ``RayVLLMWeightSyncClient``).

    Receiving: the live parameters are the receiver's target, in the mode
    :func:`receive_mode` reads (``in_place`` unless ``M2NKIT_RECEIVE_MODE=staged``).
    With a gloo
    group (trainers on CPU, or sharing this GPU) the receive buffers are on
    the CPU and each slab is copied into the parameter; with an nccl group
    they are on ``device``.

    Attributes:
        spec: the destination spec read from ``vllm_config``
            (:func:`inference_spec_of`).
        worker: this worker's index (:func:`worker_index_of`).
        weight_version: the last committed version (``None`` before one).
        traced_own_loaders: whether an init held this worker's part of the
            plan against its own model's loaders.
        quantization: ``None``, ``"fp8_per_block"`` (mode 1) or ``"fp8"``
            (mode 3), read from ``vllm_config`` (``vllm_reload.quantization_mode``);
            a quantized model always receives through vLLM's layerwise reload
            (``M2NKIT_RECEIVE_MODE`` does not apply: a layer is made live when
            its last slab lands, the version when every layer is).

    Layouts traced from vLLM's loaders (an architecture without a table,
    or ``--layout traced``): the trainers trace every worker's meta model and
    send the layout in the init payload (``InitPayload.destination``); this
    worker plans from it and holds its own part against its live model's
    loaders (one trace, its own model), so a layout that is not what this
    vLLM does is refused, naming the tensor, before any byte moves.

    Raises (construction):
        ValueError: pipeline parallelism (names it).
    """

    init_info_cls = InitPayload
    update_info_cls = M2NUpdateInfo
    #: The destination is resolved against the model this engine was built for.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.spec = inference_spec_of(vllm_config)
        self.worker = worker_index_of(vllm_config)
        self.identity = _Identity(self.worker, vllm_config.parallel_config.rank,
                                  vllm_config.parallel_config.data_parallel_index)
        self.destination = vllm_destination(self.model_config.hf_config, self.spec,
                                            layout_choice())
        self.mode = receive_mode()
        #: the way in for a quantized model (``vllm_reload.quantization_mode``: None,
        #: "fp8_per_block", "fp8"); a scheme m2nkit does not carry is refused at every init
        self.quantization: str | None = None
        self._quantization_refusal: str | None = None
        try:
            self.quantization = quantization_mode(vllm_config)
        except ValueError as e:
            self._quantization_refusal = str(e)
        self._receiver: M2NReceiver | None = None
        self._version: str | None = None
        #: whether an init held this worker's part of the plan against its own model's
        #: loaders (traced once, on the live model)
        self.traced_own_loaders = False
        #: (payload, plan, manifest digest) of the last payload _problems planned, for the
        #: receiver to check rather than plan again
        self._planned: tuple[InitPayload, Any, str] | None = None

    @property
    def weight_version(self) -> str | None:
        mine = self._receiver.weight_version if self._receiver is not None else None
        return mine if mine is not None else self._version

    def parse_init_info(self, init_dict: Mapping[str, Any]) -> InitPayload:
        """``InitPayload.from_json``; ``ValueError`` names the field and this worker.

        A payload that does not parse cannot be joined: its refusal is also
        written into the trainers' rendezvous store when the payload names
        one (``refuse_unparsed_payload``), so they fail at once, quoting it,
        instead of waiting out their rendezvous.
        """
        try:
            return InitPayload.from_json(init_dict)
        except (TypeError, ValueError) as e:
            message = f"{self.identity}: {e}"
            refuse_unparsed_payload(init_dict, self.worker, message)
            raise ValueError(message) from None

    def parse_update_info(self, update_dict: Mapping[str, Any]) -> M2NUpdateInfo:
        """``{"round": k, "version": v}``; ``ValueError`` names the field and this worker."""
        if not isinstance(update_dict, Mapping):
            raise ValueError(f"{self.identity}: update_info must be an object "
                             f"{{'round': k, 'version': v}}, got {type(update_dict).__name__}")
        try:
            return M2NUpdateInfo(**dict(update_dict))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.identity}: {e}") from None

    def _problems(self, payload: InitPayload) -> list[str]:
        """Why this worker refuses ``payload`` before any byte moves (empty: it accepts)."""
        if self._quantization_refusal is not None:
            return [self._quantization_refusal]
        builder = self._destination_for(payload)
        if payload.inference != builder.spec:
            return []       # the receiver refuses it, naming both specs
        try:
            destination = session_destination(payload, builder, str(self.identity))
            plan, digest = plan_from_manifest(payload.manifest, destination)
        except ValueError:
            return []       # the receiver refuses it with its own message
        self._planned = (payload, plan, digest)
        if getattr(builder, "fp8_wire_targets", None) is not None and \
                builder.fp8_wire_targets(plan.destination) is not None:
            found = self._fp8_wire_problems(payload, builder, plan)
            if found:
                return found
        quantized = self.quantization is not None
        found = live_model_problems(self.model, plan.destination, self.worker,
                                    checkpoint_params(self.model) if quantized else None)
        # The tables' layout, or the trainers' traced one (the payload's): either way this
        # worker's part is held against its own model's loaders, one trace, its own.
        theirs = destination is not self.destination
        if (not found and (theirs or self.destination.layout != "traced")
                and os.environ.get(TRACE_CHECK_ENV, "1") != "0"):
            if quantized:
                found = self._traced_problems_on_reload(plan)
            else:
                found = self._traced_problems(plan)
        if found:
            more = f" ... and {len(found) - _LIST_AT_MOST} more" if len(found) > _LIST_AT_MOST else ""
            return [f"vLLM's {type(self.model).__name__} does not match m2nkit's layout for "
                    f"{self.destination.spec}: " + "; ".join(found[:_LIST_AT_MOST]) + more]
        return []

    def _destination_for(self, payload: InitPayload):
        """The destination builder for ``payload``'s spec: this worker's own, or, on a
        worker serving ``quantization="fp8_per_block"``, the same layout with
        ``quant=fp8_per_block`` (``wire=bf16``: mode 1 by name; ``wire=fp8``: mode 2)."""
        from dataclasses import replace

        from m2nkit.adapters.vllm.spec import parse_inference_spec

        if payload.inference == self.destination.spec or self.quantization != "fp8_per_block":
            return self.destination
        try:
            theirs = parse_inference_spec(payload.inference)
        except ValueError:
            return self.destination
        if theirs.quant != "fp8_per_block" or str(
                replace(theirs, quant="none", wire="bf16")) != self.destination.spec:
            return self.destination
        return vllm_destination(self.model_config.hf_config, theirs, self.destination.layout)

    def _fp8_wire_problems(self, payload: InitPayload, builder, plan) -> list[str]:
        """Why this worker cannot take ``wire=fp8`` (mode 2) rounds of ``plan`` (empty: it can).

        The trainers' targets (``fp8_wire_targets``: m2nkit's table of what
        vLLM quantizes) are held against this live model: every target's
        served ``weight`` must be e4m3 of its shape with a float32
        ``weight_scale_inv`` of ``ceil(shape / 128)``, and every e4m3
        parameter the model serves must be a target.
        """
        from m2nkit.engine.fp8_wire import fp8_wire_plan

        if payload.transport != "torch_p2p":
            return [f"wire=fp8 runs over the torch_p2p transport only, not {payload.transport!r}"]
        try:
            fp8 = fp8_wire_plan(builder, plan)
        except ValueError as e:
            return [str(e)]
        live = dict(self.model.named_parameters())
        mine = {t.param: t for (w, _), t in fp8.targets.items() if w == self.worker}
        found = []
        for name, t in sorted(mine.items()):
            p, s = live.get(name), live.get(t.scale)
            if p is None or p.dtype != torch.float8_e4m3fn or tuple(p.shape) != t.fp8_shape:
                served = None if p is None else (p.dtype, tuple(p.shape))
                found.append(f"'{name}' is served as {served}, the fp8 wire sends "
                             f"float8_e4m3fn {t.fp8_shape}")
            elif s is None or s.dtype != torch.float32 or tuple(s.shape) != t.grid:
                found.append(f"'{t.scale}' is served as "
                             f"{None if s is None else (s.dtype, tuple(s.shape))}, the fp8 wire "
                             f"sends float32 {t.grid}")
        for name, p in sorted(live.items()):
            if p.dtype == torch.float8_e4m3fn and name not in mine:
                found.append(f"'{name}' is served in float8_e4m3fn but the fp8 wire does not "
                             "quantize it")
        if found:
            return [f"vLLM's {type(self.model).__name__} does not match m2nkit's fp8 wire for "
                    f"{payload.inference}: " + "; ".join(found[:_LIST_AT_MOST])]
        return []

    def _traced_problems(self, plan, padded=None) -> list[str]:
        """The plan's bindings for this worker against this worker's own loaders, traced.

        The live model's ``load_weights`` runs on fake wire tensors
        (``m2nkit.adapters.vllm.trace.traced_problems``: nothing is written),
        so the layout the tables declare is checked against what this vLLM
        build does with each wire tensor before any byte moves. Loaders
        that cannot be traced leave the tables' word standing (logged).
        ``M2NKIT_TRACE_CHECK=0`` skips the check. ``padded``: the expert
        weights vLLM pads (``vllm_reload.padded_experts``), whose traced
        regions are read in the wire's unpadded coordinates.
        """
        from m2nkit.adapters.vllm.trace import (TraceError, checkpoint_names, experts_on_disk,
                                                permuted_on_disk, traced_problems)

        hf_config = self.model_config.hf_config
        try:
            wire = [w.meta for w in plan.wires]
            names = [m.name for m in wire]
            # wire tensors stored on disk in another dim order (the family's
            # HFNaming.permuted) are fed to the loaders in the on-disk order they read
            found = traced_problems(self.model, plan.destination, self.worker, wire,
                                    self.vllm_config, experts_on_disk(hf_config),
                                    names=checkpoint_names(hf_config, names), padded=padded,
                                    permuted=permuted_on_disk(hf_config, names))
            self.traced_own_loaders = True
            return found
        except TraceError as e:
            _log.warning("%s: the layout was not checked against vLLM's loaders: %s",
                         self.identity, e)
            return []

    def _traced_problems_on_reload(self, plan) -> list[str]:
        """:meth:`_traced_problems` on the checkpoint-format model vLLM's reload restores.

        A quantized model's live loaders belong to its kernel-format tensors;
        the trace runs where a reload's loaders run: inside
        ``initialize_layerwise_reload`` (every layer in checkpoint format on
        the meta device), with the layerwise wrappers taken off for the
        trace (vLLM's sharded RDT engine traces the same way, ``_bake``),
        then every layer gets its kernel tensors back untouched
        (``LayerwiseReload.abort``).
        """
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        reload = LayerwiseReload(self.model, self.model_config, self.vllm_config)
        reload.begin()
        try:
            for module in self.model.modules():
                for t in get_layer_tensors(module).values():
                    if hasattr(t, "weight_loader"):
                        t.weight_loader = _get_original_loader(t)
            return self._traced_problems(plan, padded_experts(self.model))
        finally:
            reload.abort()

    def init_transfer_engine(self, init_info: InitPayload | Mapping[str, Any]) -> None:
        """Resolve the live model against the plan, then join the session.

        A refusal (a live parameter that differs from m2nkit's table, a
        quantization scheme m2nkit does not carry) still joins the payload's group, only to report
        it through the plan agreement, so every trainer rank and every
        worker raises this worker's message at once; nothing moves. An
        accepted payload replaces any earlier session of this engine.

        Raises:
            PlanMismatchError: this worker or another rank refused (the
                message names the rank and, for a live-model mismatch, the
                parameter and both shapes).
            ValueError, TransferError: as ``M2NReceiver.init_transfer_engine``.
        """
        payload = init_info if isinstance(init_info, InitPayload) else self.parse_init_info(init_info)
        self._planned = None
        problems = self._problems(payload)
        # the plan _problems built for this payload (a traced layout's plan is no small
        # thing: Kimi-K2 at tp=8,dp=8,ep binds 100 k boxes), not built again by the receiver
        planned = self._planned[1:] if self._planned and self._planned[0] is payload else None
        self._planned = None
        if problems:
            message = f"{self.identity}: {problems[0]}"
            self._refuse_everywhere(payload, message)
            raise PlanMismatchError(f"{message}; nothing was sent")
        device = _buffer_device(payload, self.device)
        builder = self._destination_for(payload)
        receiver = self._receiver
        if receiver is None or receiver.device != device or receiver.destination is not builder \
                and receiver.destination.spec != builder.spec:
            if receiver is not None:        # another group backend: new receive buffers
                self._version = self.weight_version
                receiver.shutdown()
            reload = None
            if self.quantization is not None:      # vLLM's layerwise reload, always in place
                reload = LayerwiseReload(self.model, self.model_config, self.vllm_config)
            receiver = self._receiver = M2NReceiver(
                builder, self.worker, target=self.model, device=device,
                mode="in_place" if reload is not None else self.mode, reload=reload)
        receiver.init_transfer_engine(payload, planned=planned)
        from m2nkit.engine.fp8_wire import Fp8WireReceiver, fp8_wire_plan

        fp8 = fp8_wire_plan(builder, receiver.plan)
        if fp8 is not None:
            # mode 2: the scales, then the e4m3 bytes, handed to vLLM's own quantization step
            # (LayerwiseReload._process); the round commits as any other
            receiver._transport = Fp8WireReceiver(receiver._transport, receiver.plan, fp8,
                                                  receiver._reload)

    def _refuse_everywhere(self, payload: InitPayload, message: str) -> None:
        """Join the payload's group only to tell every rank why this worker refuses."""
        refuse_everywhere(payload, self.worker, message)

    def _require(self, what: str) -> M2NReceiver:
        if self._receiver is None:
            raise ValueError(f"{self.identity}: {what} before init_weight_transfer_engine")
        return self._receiver

    def start_weight_update(self) -> None:
        """Begin a round: the live model is resolved again, then ``M2NReceiver.start_weight_update``.

        vLLM's sleep mode may have re-allocated the weights since the last
        round (``sleep(level=2)`` discards them, ``wake_up(tags=["weights"])``
        maps fresh memory, docs/colocated.md "Sleep mode"), and a wake or a
        reload path may even hand the model new storage. Nothing of an
        earlier round is kept: the receiver looks the live parameters up
        again (``model.named_parameters()``) at every round, so the round
        lands in whatever storage they hold now. Before that, this worker's
        part of the plan is held against the live model once more
        (:func:`live_model_problems`: every parameter's local shape and dtype,
        every tie still shared storage), so a parameter that came back
        another shape or dtype, or a tie a re-allocation broke, refuses the
        round before any byte moves; rank 0's trainer aborts the round for
        every rank with this message. A quantized model is checked by its
        reload at ``begin`` instead.

        Raises:
            ValueError: no session; the live model no longer fits the plan
                (names the parameter, both shapes and dtypes; nothing written).
        """
        receiver = self._require("start_weight_update")
        plan = receiver.plan
        if plan is not None and self.quantization is None:
            found = live_model_problems(self.model, plan.destination, self.worker,
                                        undeclared=False)
            if found:
                more = (f" ... and {len(found) - _LIST_AT_MOST} more"
                        if len(found) > _LIST_AT_MOST else "")
                raise ValueError(
                    f"{self.identity}: the live model changed since the session's init (a sleep/"
                    f"wake or reload re-allocated it unlike m2nkit's layout for "
                    f"{self.destination.spec}): " + "; ".join(found[:_LIST_AT_MOST]) + more
                    + "; nothing was written; restore the model's layout or call "
                    "init_weight_transfer_engine again")
        receiver.start_weight_update()

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """Receive this worker's slabs of the round; returns once every rank's verdict is in.

        vLLM's worker passes this worker's own dict (it indexes a list
        payload by global worker rank itself, ``gpu_worker.update_weights``).

        Raises:
            ValueError: a bad ``update_info`` (names the field).
            TransferError: the round failed (the root cause and its rank first).
        """
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: M2NUpdateInfo) -> None:
        self._require("update_weights").receive_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Commit the round, then run the attention layers' post-load step.

        vLLM's worker calls it without a version (it keeps the version
        itself, ``set_weight_version``); the commit then takes the round's
        ``version`` from its update info.

        Raises:
            IncompleteRoundError: wire tensors missing or the round failed
                elsewhere; nothing was committed or post-processed.
        """
        self._require("finish_weight_update").finish_weight_update(weight_version)
        if self.quantization is None:     # the layerwise reload's finalize ran them already
            self._after_loading()

    def _after_loading(self) -> None:
        """Each attention layer's ``process_weights_after_loading(dtype)``, as vLLM's reload ends.

        The linear layers' quant methods are not re-run: unquantized ones
        only repack on CPU/ROCm/XPU platforms (``UnquantizedLinearMethod``).
        A quantized model's round runs none of this: vLLM's layerwise reload
        processed every layer, attention ones last (``vllm_reload``).
        """
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        for module in self.model.modules():
            if is_deferred_attention_layer(module):
                module.process_weights_after_loading(self.model_config.dtype)

    def shutdown(self) -> None:
        """Drop the session's group; the live weights and the version stay."""
        if self._receiver is not None:
            self._receiver.shutdown()


#: Set to ``0`` to skip tracing the live model's loaders at init (the check of the
#: plan's bindings against what this vLLM build does; ``M2NVLLMEngine._traced_problems``).
TRACE_CHECK_ENV = "M2NKIT_TRACE_CHECK"
#: Environment variable of the vLLM server choosing the destination layout.
LAYOUT_ENV = "M2NKIT_LAYOUT"

_log = logging.getLogger(__name__)


def layout_choice() -> str:
    """``$M2NKIT_LAYOUT``: ``auto`` (default: the family table where there is one, else
    traced from vLLM's loaders), ``tables`` or ``traced`` (``m2nkit.adapters.vllm.LAYOUTS``).

    With ``traced`` a worker plans from the trainers' traced layout (the init payload's)
    and holds its part against its own loaders, even for an architecture with a table;
    the trainers must trace too (``vllm_destination(..., layout="traced")``), or the
    plan digests differ wherever the table and the trace do.

    Raises:
        ValueError: another value (names the variable and the valid ones).
    """
    from m2nkit.adapters.vllm.builder import LAYOUTS

    layout = os.environ.get(LAYOUT_ENV, "auto")
    if layout not in LAYOUTS:
        raise ValueError(f"{LAYOUT_ENV}={layout!r} is not one of {', '.join(LAYOUTS)}")
    return layout
