"""Rounds into a quantized vLLM model through vLLM's own layerwise reload.

A vLLM model served with ``quantization="fp8_per_block"`` (online: BF16
checkpoint weights, quantized by each worker) or from a block-quantized fp8
checkpoint (DeepSeek-V3's ``weight_scale_inv``) does not hold what the wire
carries: after loading, each layer's ``quant_method.process_weights_after_loading``
turned the checkpoint-format tensors into kernel-format ones (e4m3 ``weight``
and fp32 ``weight_scale_inv`` made by ``per_block_cast_to_fp8``, MoE
``w13``/``w2`` set up for their kernel, MLA's derived ``W_UK_T``/``W_UV``).
Writing slabs into those would be wrong bytes, and they must not be
re-allocated (CUDA graphs hold their addresses).

vLLM 0.33.0's path for reloading a live model
(``vllm/model_executor/model_loader/reload/layerwise.py``) is what
:class:`LayerwiseReload` drives, the way vLLM's own sharded RDT engine does
(``distributed/weight_transfer/sharded_rdt_engine.py``: ``start_weight_update``,
``_process_item``, ``_run_quant``), minus its loader replay:

* :meth:`~LayerwiseReload.begin`: ``initialize_layerwise_reload(model)`` keeps
  each layer's kernel tensors aside and puts the layer back in checkpoint
  format on the meta device, from the metadata ``initialize_model`` recorded
  before the first load (``record_metadata_for_reloading``,
  ``model_loader/utils.py``);
* the round's slabs land in those checkpoint-format tensors: a layer is
  materialized (``materialize_layer``, on the device vLLM recorded) and
  zeroed when its first slab arrives (the elements no slab writes are the
  layout's ``zero_boxes``, vocab padding, which vLLM's loaders fill with 0);
* as soon as every wire tensor the plan writes into a layer has landed (the
  transport says so after each bucket: ``wires_received``), the layer goes
  through ``_layerwise_process``: vLLM's quantization or repacking of it,
  ``update_param_tp_status``, then a copy into the kernel tensors kept aside
  (same storage). The plan's wire order is the trainer's module order,
  grouped by decoder layer, and its buckets are contiguous runs of it, so a
  worker holds the checkpoint-format tensors of about one bucket's layers at
  a time, not of the model (vLLM's own warning: "ordering weights by their
  parent layer" avoids its buffering);
* :meth:`~LayerwiseReload.commit`, after every wire tensor arrived and every
  rank agreed: any written layer not processed yet is, in model order, then
  ``finalize_layerwise_reload`` places the untouched layers' kernel tensors
  back and runs the attention layers' ``process_weights_after_loading``
  (MLA's derived weights from the new ``kv_b_proj``). The version commits
  only after that;
* :meth:`~LayerwiseReload.abort` (a failed or dropped round): every layer not
  processed yet gets its kernel tensors back unchanged
  (``_place_kernel_tensors``, as the sharded engine's
  ``_restore_after_dry_run``). Layers already processed keep the new values:
  ``live_changed`` tells the receiver, which then reports the weights as
  mixed (as in its ``in_place`` mode) until a complete round commits.

On the fp8 wire (mode 2, ``engine/fp8_wire.py``) a quantized linear layer's
``weight`` arrives as the trainers' e4m3 bytes with their block scales
(:meth:`~LayerwiseReload.prequantize`); the layer is processed the same way,
vLLM's ``per_block_cast_to_fp8`` answering, for that one call, with what
arrived (:meth:`~LayerwiseReload._process` says why and what it checks).

Expert weights vLLM pads to whole blocks (``padded_experts``, read from
the live layers' ``moe_config``) are written in the wire's unpadded shape
and laid into vLLM's padded tensor where its loaders put them
(``quant_fp8.pad_experts``) just before their layer is processed; on the
fp8 wire the trainers' e4m3 bytes are laid out the same way.

What is processed is exactly what vLLM's own loader would quantize: the
bytes the plan wrote where vLLM's loaders write (the plan's layout is the
checkpoint format, checked against :meth:`~LayerwiseReload.params` and traced
inside the reload).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["LayerwiseReload", "checkpoint_params", "padded_experts", "quantization_mode",
           "cast_refusal", "WIRE_BLOCK",
           "SUPPORTED_QUANTIZATION"]

#: The quantization schemes a quantized vLLM model may be served with to receive
#: m2nkit rounds, and what the wire then carries (docs/fp8.md).
SUPPORTED_QUANTIZATION = {
    "fp8_per_block": "mode 1: BF16 wire, quantized online by vLLM in 128 x 128 blocks",
    "fp8": "mode 3: a block-quantized fp8 checkpoint (weight_block_size; DeepSeek-V3 "
           "weight + weight_scale_inv) on the wire as stored",
}


#: The grid the fp8 wire is quantized in (``engine/quant_fp8.py``; vLLM 0.33.0's online
#: methods call ``per_block_cast_to_fp8`` with ``[128, 128]``, ``online/fp8.py``).
WIRE_BLOCK = (128, 128)


def cast_refusal(shape: tuple[int, ...], block_size: Any, use_ue8m0: bool,
                 wire_shape: tuple[int, ...] | None, scale_shape: tuple[int, ...] | None,
                 repeated: bool = False) -> str | None:
    """Why the fp8 wire cannot answer vLLM's ``per_block_cast_to_fp8(x, block_size, use_ue8m0)``.

    ``shape``: ``x``'s; ``wire_shape``/``scale_shape``: the e4m3 tensor and the
    float32 scales the trainers sent for it (``None``: ``x`` is none of the
    tensors the wire carries, e.g. not the layer's own weight); ``repeated``:
    vLLM asks for that tensor a second time. ``None`` when the wire's bytes
    and scales are the answer: the wire carries, per 128 x 128 block of the
    worker-local tensor, ``amax / 448`` in float32, never rounded to a power
    of two. UE8M0 (``use_ue8m0=True``, ``_ceil_to_ue8m0`` in
    ``vllm/utils/deep_gemm.py``) is not carried: vLLM 0.33.0's online fp8
    never asks for it (``use_ue8m0=False``); DeepGEMM's UE8M0 rounding comes
    later, in its kernel's weight processing (``requant_weight_ue8m0_inplace``),
    from these bytes and scales.
    """
    if wire_shape is None or scale_shape is None:
        return "a tensor the fp8 wire does not carry (only the layer's own weight, or one expert of it)"
    if repeated:
        return "the same tensor a second time (the wire carries one quantization of each)"
    if tuple(block_size or ()) != WIRE_BLOCK:
        return (f"blocks {list(block_size or ())}; the wire carries "
                f"{WIRE_BLOCK[0]} x {WIRE_BLOCK[1]} blocks")
    if use_ue8m0:
        return ("UE8M0 scales (powers of two); the wire carries float32 scales amax / 448, "
                "not rounded")
    if tuple(shape) != tuple(wire_shape):
        return f"shape {list(shape)}; the wire's e4m3 tensor is {list(wire_shape)}"
    grid = tuple(-(-n // b) for n, b in zip(shape, WIRE_BLOCK))
    if tuple(scale_shape) != grid:
        return (f"a scale grid of {list(grid)} blocks; the wire's scales are "
                f"{list(scale_shape)}")
    return None


def quantization_mode(vllm_config: Any) -> str | None:
    """Which way in a vLLM config's quantization gives (``None``: unquantized).

    ``"fp8_per_block"`` (vLLM's ``OnlineQuantizationConfig`` with block
    scheme: ``layers/quantization/online/``) or ``"fp8"`` with a
    checkpoint serialized in fp8 blocks (``Fp8Config`` with
    ``is_checkpoint_fp8_serialized`` and ``weight_block_size``,
    ``layers/quantization/fp8.py``).

    Raises:
        ValueError: any other scheme (int4 compressed-tensors, NVFP4, MXFP4,
            per-tensor fp8, ...), naming it and listing the supported ones.
    """
    name = getattr(vllm_config.model_config, "quantization", None)
    if name is None:
        return None
    qc = vllm_config.quant_config
    if name == "fp8_per_block":
        return name
    if name == "fp8" and getattr(qc, "is_checkpoint_fp8_serialized", False) \
            and getattr(qc, "weight_block_size", None):
        return name
    what = name
    if name == "fp8":
        what = ("fp8 " + ("per-tensor from an fp8 checkpoint"
                          if getattr(qc, "is_checkpoint_fp8_serialized", False)
                          else "online per-tensor from an unquantized checkpoint"))
    supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED_QUANTIZATION.items())
    raise ValueError(f"vLLM serves this model with quantization {what!r}, which m2nkit does "
                     f"not carry; supported: {supported}")


def _modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for prefix, module in model.named_modules(remove_duplicate=False):
        yield prefix, module


def checkpoint_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the model's checkpoint-format parameters (what its loaders fill).

    Each layer's parameters as ``initialize_model`` recorded them before the
    first load (``LAYERWISE_INFO[layer].restore_metadata``: meta tensors
    with the loader's shape and dtype, e.g. ``qkv_proj.weight`` in BF16 for
    online fp8, e4m3 ``weight`` + fp32 ``weight_scale_inv`` for an fp8
    checkpoint), plus the live parameters the reload never moves to meta
    (``SKIP_TENSORS``: ``e_score_correction_bias``), under the live model's
    dotted names. Tied parameters appear under every name. Expert weights
    vLLM pads (:func:`padded_experts`) appear in the shape its loaders are
    given, the unpadded one (a meta tensor): that is what the wire carries.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, module in _modules(model):
        dot = f"{prefix}." if prefix else ""
        for name, t in _own_checkpoint_params(module).items():
            out[dot + name] = t
    for name, (shape, _, _) in padded_experts(model).items():
        out[name] = torch.empty(shape, dtype=out[name].dtype, device="meta")
    return out


def padded_experts(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """``{name: (unpadded shape, padded shape, row shards)}`` of the expert weights vLLM pads.

    vLLM 0.33.0 rounds an experts layer's hidden and local intermediate
    sizes up where its quant method asks (``RoutedExperts.__init__``:
    ``quant_method.maybe_roundup_sizes``; ``Fp8PerBlockOnlineMoEMethod``
    rounds both to 128), keeping the unpadded ones in ``moe_config``
    (``hidden_dim_unpadded``, ``intermediate_size_per_partition_unpadded``).
    Its checkpoint-format ``w13_weight`` is then ``[E_local, 2*Ip, Hp]``
    and ``w2_weight`` ``[E_local, Hp, Ip]``, and its loaders write the
    unpadded checkpoint slices into them (``RoutedExperts._load_w13``: gate
    rows at 0, up rows at ``Ip``; ``_load_w2``), the rest zero
    (``OnlineMoEMethodBase._zero_padding``). Read from the live layers, so
    the padding is vLLM's word, not m2nkit's; row shards: 2 for ``w13``
    (gate, up; ``moe_config.is_act_and_mul``), 1 for ``w2``.
    """
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
    for prefix, module in _modules(model):
        cfg = getattr(module, "moe_config", None)
        if cfg is None or getattr(cfg, "hidden_dim_unpadded", None) is None:
            continue
        H, Hp = cfg.hidden_dim_unpadded, cfg.hidden_dim
        I, Ip = cfg.intermediate_size_per_partition_unpadded, cfg.intermediate_size_per_partition
        if (H, I) == (Hp, Ip):
            continue
        k = 2 if cfg.is_act_and_mul else 1
        dot = f"{prefix}." if prefix else ""
        params = _own_checkpoint_params(module)
        for attr, padded, unpadded, shards in (("w13_weight", (k * Ip, Hp), (k * I, H), k),
                                               ("w2_weight", (Hp, Ip), (H, I), 1)):
            t = params.get(attr)
            if t is not None and tuple(t.shape[1:]) == padded:
                out.setdefault(dot + attr, ((t.shape[0], *unpadded), tuple(t.shape), shards))
    return out


def _own_checkpoint_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One module's own checkpoint-format parameters (:func:`checkpoint_params`)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    params, _ = get_layerwise_info(module).restore_metadata
    out = dict(params)
    for name, t in module._parameters.items():
        if t is not None and name in SKIP_TENSORS:
            out[name] = t
    return out


def _never_on_meta() -> set[str]:
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    return SKIP_TENSORS


class _LazyStorage(Mapping):
    """``{checkpoint name: tensor}`` that materializes a layer on its first lookup.

    ``wires_received(names)``: the transport's word that these wire tensors
    landed whole (``torch_p2p.recv_round``, after each bucket).
    """

    def __init__(self, owner: "LayerwiseReload") -> None:
        self._owner = owner

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._owner._tensor(name)

    def wires_received(self, names) -> None:
        self._owner._wires_received(names)

    def __iter__(self):
        return iter(self._owner._where)

    def __len__(self) -> int:
        return len(self._owner._where)


class LayerwiseReload:
    """m2nkit's ``ReloadTarget`` (``engine/receiver.py``) for a live, quantized vLLM model.

    Args:
        model: the live vLLM model (built by ``initialize_model``, so its
            reload metadata is recorded).
        model_config: ``vllm_config.model_config`` (its dtype, for the
            attention layers' post-load step).
        vllm_config: set as vLLM's current config around the processing
            (online quantization methods read it).
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, vllm_config: Any) -> None:
        self.model = model
        self.model_config = model_config
        self.vllm_config = vllm_config
        self._where: dict[str, tuple[torch.nn.Module, str]] = {}
        #: expert weights vLLM pads: the round writes them in the wire's (unpadded) shape,
        #: laid into vLLM's padded tensor before their layer is processed
        self._padded = padded_experts(model)
        self._unpadded: dict[str, torch.Tensor] = {}
        for prefix, module in _modules(model):
            dot = f"{prefix}." if prefix else ""
            for name in _own_checkpoint_params(module):
                self._where.setdefault(dot + name, (module, name))
        #: id(layer) -> {attr: name} of its padded expert weights
        self._padded_of: dict[int, dict[str, str]] = {}
        for name in self._padded:
            module, attr = self._where[name]
            self._padded_of.setdefault(id(module), {})[attr] = name
        self._written: list[torch.nn.Module] = []      # materialized this round, in order
        self._seen: set[int] = set()
        self._waiting: dict[int, set[str]] = {}        # id(layer) -> wire tensors not yet in
        self._shadow: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        #: mode 2: id(layer) -> {attr: (e4m3, fp32 scales)} the trainers quantized
        self._given: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._layer_of: dict[int, torch.nn.Module] = {}
        self._wires_of: dict[str, set[int]] = {}       # wire tensor -> ids of layers it feeds
        self.active = False
        #: whether this round already replaced some layer's kernel tensors (a failure
        #: after that leaves the served weights mixed)
        self.live_changed = False
        #: layers processed during the round, as their last wire tensor arrived (their
        #: count, their ids)
        self.streamed = 0
        self.streamed_ids: set[int] = set()
        #: mode 2: the layers this round processed with the trainers' e4m3 bytes and scales
        self.prequantized_ids: set[int] = set()

    def params(self) -> dict[str, torch.Tensor]:
        """The checkpoint-format layout (:func:`checkpoint_params`)."""
        return checkpoint_params(self.model)

    def begin(self, plan: Any = None, worker: int | None = None) -> Mapping[str, torch.Tensor]:
        """``initialize_layerwise_reload``; returns the round's lazily materialized storage.

        With the round's ``plan`` and this ``worker``, each layer is processed
        as soon as every wire tensor the plan writes into it arrived (the
        transport says so after each bucket); without, at :meth:`commit`.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.active:
            self.abort()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)
        self._written, self._seen = [], set()
        self._waiting, self._layer_of, self._wires_of = {}, {}, {}
        self._shadow = {}
        self._given = {}
        self._unpadded = {}
        self.live_changed = False
        self.streamed = 0
        self.streamed_ids = set()
        self.prequantized_ids = set()
        if plan is not None:
            for wire, bindings in plan.destination.bindings.items():
                for b in bindings:
                    if b.worker == worker and b.param in self._where:
                        layer = self._where[b.param][0]
                        self._layer_of[id(layer)] = layer
                        self._waiting.setdefault(id(layer), set()).add(wire)
                        self._wires_of.setdefault(wire, set()).add(id(layer))
        self.active = True
        return _LazyStorage(self)

    def _wires_received(self, names) -> None:
        """Process each layer whose wire tensors all arrived (``_layerwise_process``)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        ready = []
        for wire in names:
            for lid in self._wires_of.pop(wire, ()):
                left = self._waiting.get(lid)
                if left is not None:
                    left.discard(wire)
                    if not left:
                        del self._waiting[lid]
                        ready.append(self._layer_of[lid])
        if not ready:
            return
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for layer in ready:
                info = get_layerwise_info(layer)
                if id(layer) in self._seen and info.can_load() \
                        and not is_deferred_attention_layer(layer):
                    self.live_changed = True
                    self._flush_shadows(layer)
                    self._process(layer, info)
                    self.streamed += 1
                    self.streamed_ids.add(id(layer))

    def _tensor(self, name: str) -> torch.Tensor:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_layer
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        if not self.active:
            raise RuntimeError(f"parameter '{name}' written outside a reload round")
        module, attr = self._where[name]
        t = getattr(module, attr)
        if t.is_meta:
            on_meta = [n for n, u in get_layer_tensors(module).items() if u.is_meta]
            materialize_layer(module, get_layerwise_info(module))
            # Elements no slab writes are the layout's zero_boxes (vocab padding, which
            # vLLM's loaders fill with 0): they must read 0, not what empty() left.
            for n in on_meta:
                getattr(module, n).data.zero_()
            t = getattr(module, attr)
        if id(module) not in self._seen:
            self._seen.add(id(module))
            self._written.append(module)
        if attr in _never_on_meta():
            # A tensor the reload leaves live (e_score_correction_bias): the round writes
            # a copy, put in place when its layer is processed, so an abort keeps it.
            if name not in self._shadow:
                self._shadow[name] = (module, attr, torch.zeros_like(t.data))
            return self._shadow[name][2]
        if name in self._padded:
            # written in the wire's shape, laid into vLLM's padded tensor by _process
            if name not in self._unpadded:
                self._unpadded[name] = torch.zeros(self._padded[name][0], dtype=t.dtype,
                                                   device=t.device)
            return self._unpadded[name]
        return t.data

    def _flush_shadows(self, layer: torch.nn.Module | None = None) -> None:
        """Copy the round's values of the live-kept tensors of ``layer`` (all: None) in."""
        for name, (module, attr, value) in list(self._shadow.items()):
            if layer is None or module is layer:
                getattr(module, attr).data.copy_(value)
                del self._shadow[name]

    def prequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Mode 2: the trainers' e4m3 ``weight`` and float32 block ``scale`` of ``name``.

        When its layer is processed, vLLM's online method gets these as the
        result of its ``per_block_cast_to_fp8`` of the layer's worker-local
        weight (:meth:`_process`); ``weight`` is written by the round.
        """
        if not self.active:
            raise RuntimeError(f"parameter '{name}' prequantized outside a reload round")
        module, attr = self._where[name]
        self._given.setdefault(id(module), {})[attr] = (weight, scale)

    def _process(self, layer: torch.nn.Module, info: Any) -> None:
        """vLLM's ``_layerwise_process`` of ``layer``; mode 2: with the trainers' quantization.

        vLLM 0.33.0's ``Fp8PerBlockOnlineLinearMethod.process_weights_after_loading``
        (``layers/quantization/online/fp8.py``) quantizes the layer's local
        BF16 ``weight`` with ``per_block_cast_to_fp8(weight, [128, 128],
        use_ue8m0=False)``, then ``replace_parameter``s ``weight`` and
        ``weight_scale_inv`` and runs its kernel's own
        ``process_weights_after_loading`` (which may re-lay the scales for
        its GEMM); the reload then copies the result into the kept kernel
        tensors. On the fp8 wire the trainers did the quantization, so for
        this one call that function gives the received e4m3 bytes and scales:
        every other step is vLLM's. ``Fp8PerBlockOnlineMoEMethod`` calls it
        once per local expert on ``w13_weight[e]`` and ``w2_weight[e]``, then
        hands the results to its kernel setup (``_setup_kernel``); the
        stand-in answers each with that expert's slice. It refuses
        (``RuntimeError``: the round fails, nothing commits) unless every
        call is on this layer's own weight (one expert's view of it), in
        128 x 128 blocks without UE8M0, with shapes that match, once each,
        and every weight (expert) was asked for: a vLLM whose method works
        otherwise is caught, not fed wrong bytes.
        """
        from vllm.model_executor.model_loader.reload.layerwise import _layerwise_process

        from m2nkit.engine.quant_fp8 import pad_experts

        given = self._given.pop(id(layer), None)
        for attr, name in self._padded_of.get(id(layer), {}).items():
            # where vLLM's loaders put an unpadded expert tensor (RoutedExperts._load_w13 /
            # _load_w2); _layerwise_process keeps the materialized tensor, and vLLM's
            # _zero_padding zeroes the rest again
            _, shape, shards = self._padded[name]
            staged = self._unpadded.pop(name, None)
            if staged is not None:
                pad_experts(staged, shape, shards, out=getattr(layer, attr).data)
            if given and attr in given:
                q, scale = given[attr]
                given[attr] = (pad_experts(q, shape, shards), scale)
        if not given:
            _layerwise_process(layer, info)
            return
        import vllm.model_executor.layers.quantization.online.fp8 as online_fp8

        method = getattr(layer, "quant_method", None)
        what = f"{type(layer).__name__} with {type(method).__name__}"
        if isinstance(method, online_fp8.Fp8PerBlockOnlineLinearMethod):
            want, per_call = {"weight"}, 1
        elif isinstance(method, online_fp8.Fp8PerBlockOnlineMoEMethod):
            want, per_call = {"w13_weight", "w2_weight"}, 0
        else:
            want = set()
        if set(given) != want:
            raise RuntimeError(f"wire=fp8: {what} got the trainers' e4m3 {sorted(given)}; "
                               "only Fp8PerBlockOnlineLinearMethod (weight) and "
                               "Fp8PerBlockOnlineMoEMethod (w13_weight, w2_weight) take them")
        calls: list[tuple[str, int]] = []
        original = online_fp8.per_block_cast_to_fp8

        def which(x):
            """``(attr, expert or -1)`` of the layer tensor ``x`` is (a view of one expert)."""
            for attr in sorted(given):
                base = getattr(layer, attr, None)
                if base is None:
                    continue
                if x is base:
                    return attr, -1
                if base.dim() == 3 and x.dim() == 2 and tuple(x.shape) == tuple(base.shape[1:]) \
                        and x.stride() == base.stride()[1:]:
                    step = base.stride(0) * base.element_size()
                    off = x.data_ptr() - base.data_ptr()
                    if off % step == 0 and 0 <= off // step < base.shape[0]:
                        return attr, off // step
            return None, -1

        def given_cast(x, block_size=None, use_ue8m0=False):
            attr, expert = which(x)
            q, scale = given.get(attr, (None, None))
            if q is not None and expert >= 0:
                q, scale = q[expert], scale[expert]
            reason = cast_refusal(tuple(x.shape), block_size, use_ue8m0,
                                  None if q is None else tuple(q.shape),
                                  None if scale is None else tuple(scale.shape),
                                  repeated=(attr, expert) in calls)
            if reason is not None:
                raise RuntimeError(
                    f"wire=fp8: {what} quantized otherwise than m2nkit's trainers did (a tensor "
                    f"of shape {tuple(x.shape)}: {attr or 'not the layer weight'}"
                    f"{'' if expert < 0 else f' expert {expert}'}, block {block_size}, "
                    f"use_ue8m0={use_ue8m0}): {reason}; this vLLM cannot take the fp8 wire: "
                    "use wire=bf16")
            calls.append((attr, expert))
            return q, scale

        online_fp8.per_block_cast_to_fp8 = given_cast
        try:
            _layerwise_process(layer, info)
        finally:
            online_fp8.per_block_cast_to_fp8 = original
        expected = per_call or sum(given[a][0].shape[0] for a in given)
        if len(calls) != expected:
            raise RuntimeError(f"wire=fp8: {what} called per_block_cast_to_fp8 {len(calls)} times, "
                               f"not {expected} (one per weight, or per expert and weight); this "
                               "vLLM cannot take the fp8 wire: use wire=bf16")
        self.prequantized_ids.add(id(layer))

    def commit(self) -> None:
        """Process every written layer as vLLM's reload does, then ``finalize_layerwise_reload``."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        written = {id(m) for m in self._written}
        self.active = False
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self._flush_shadows()
            for _, module in _modules(self.model):
                info = get_layerwise_info(module)
                if id(module) in written and info.can_load() \
                        and not is_deferred_attention_layer(module):
                    self._process(module, info)
            finalize_layerwise_reload(self.model, self.model_config)
        self._written, self._seen = [], set()

    def abort(self) -> None:
        """Give every layer its kernel tensors back, unchanged; nothing is processed."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            LOADING_LAYERS,
            _place_kernel_tensors,
            get_layerwise_info,
        )

        self.active = False
        self._shadow = {}
        self._given = {}
        self._unpadded = {}
        for _, module in _modules(self.model):
            info = get_layerwise_info(module)
            if info.can_load():
                if info.kernel_tensors is not None:
                    _place_kernel_tensors(module, info)
                info.reset()
        LOADING_LAYERS.clear()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload
        self._written, self._seen = [], set()
