"""A real vLLM model on CPU, without ``torch.distributed``: the harness of the vLLM tests and demo.

``m2nkit demo --receiver vllm`` (``demo_vllm.py``) and the vLLM integration
tests run vLLM's own model class for a checkpoint, one worker per process,
as that tp/dp/ep rank would build it, and create m2nkit's engine the way a
vLLM worker does (through ``WeightTransferEngineFactory``). A vLLM server
never calls any of this: it has its own workers and parallel state, and
the plugin (``m2nkit.engine.plugins.vllm``) is all it loads.

* ``m2nkit.adapters.vllm.stand_in.worker_config`` sets vLLM's parallel state
  (``vllm/distributed/parallel_state.py``) to stand-in groups that only
  carry sizes and ranks, and builds the worker's ``VllmConfig``;
* :func:`build_cpu_worker` builds and loads the model
  (``initialize_model``, ``DefaultModelLoader.load_weights``);
  :func:`fresh_load` loads a checkpoint into a new one, the oracle of a
  round; :func:`create_engine` builds the plugin's engine through vLLM's
  factory.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from m2nkit.adapters.vllm.spec import InferenceSpec
from m2nkit.adapters.vllm.stand_in import gpu_sparse_attention, worker_config
from m2nkit.engine.plugins.vllm import BACKEND, M2NVLLMEngine, register

__all__ = ["build_cpu_worker", "load_checkpoint", "fresh_load", "fresh_fp8_load",
           "cpu_quantized_kernels", "FP8_KERNELS",
           "parameters_of", "create_engine", "set_current_config"]


def _cpu_environment() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


#: The fp8 block kernels :func:`cpu_quantized_kernels` can have vLLM pick on a CPU.
FP8_KERNELS = ("triton", "deep_gemm_e8m0")

#: The kernel the models built from now on in this process get (``cpu_quantized_kernels``).
_FP8_KERNEL = {"now": "triton"}


@contextlib.contextmanager
def _deep_gemm_answers():
    """vLLM asked "is DeepGEMM supported, is its E8M0 in use" answers yes; its scale packing is skipped.

    The answers are ``vllm/utils/deep_gemm.py``'s ``is_deep_gemm_supported``
    and ``is_deep_gemm_e8m0_used`` (on a GPU: DeepGEMM installed, a Hopper or
    Blackwell device, ``VLLM_USE_DEEP_GEMM_E8M0``; vLLM sets that for a
    config whose ``quantization_config`` has ``scale_fmt: ue8m0``,
    ``transformers_utils/config.py``), replaced where the block fp8 kernels
    read them: that module (``should_use_deepgemm_for_fp8_linear``), the
    DeepGEMM linear kernel's (``kernels/linear/scaled_mm/deep_gemm.py``) and
    ``quantization/utils/fp8_utils.py`` (``prepare_fp8_moe_layer_for_deepgemm``).
    ``fp8_utils.transform_sf_into_required_layout`` (DeepGEMM's packed,
    TMA-aligned scale layout: a call into the deep_gemm CUDA library) gives
    the float32 scales back unchanged. Everything is restored on exit.
    """
    import vllm.model_executor.kernels.linear.scaled_mm.deep_gemm as dg_linear
    import vllm.model_executor.layers.quantization.utils.fp8_utils as fp8_utils
    import vllm.utils.deep_gemm as deep_gemm

    def yes() -> bool:
        return True

    def unpacked(sf, **_):
        return sf

    swaps = [(m, name, yes) for m in (deep_gemm, dg_linear)
             for name in ("is_deep_gemm_supported", "is_deep_gemm_e8m0_used")]
    swaps += [(fp8_utils, "is_deep_gemm_e8m0_used", yes),
              (fp8_utils, "transform_sf_into_required_layout", unpacked)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in swaps]
    for m, name, value in swaps:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


def cpu_quantized_kernels(fp8_kernel: str = "triton") -> None:
    """Let vLLM build and post-process a quantized model on a CPU without AMX; idempotent.

    Only vLLM's choice of *kernel* (how a forward pass multiplies) is
    replaced, never the weight processing:

    * fp8 block-scaled linear layers: vLLM 0.33.0 offers the CPU only AMX
      kernels (``kernels/linear/__init__.py``, ``_POSSIBLE_FP8_BLOCK_KERNELS``),
      and ``choose_scaled_mm_linear_kernel`` raises without AMX; here it picks
      ``TritonFp8BlockScaledMMKernel``, the last CUDA/ROCm candidate, whose
      ``process_weights_after_loading`` is the block kernels' shared one
      (``BlockScaledMMLinearKernel.py``, ``process_fp8_weight_block_strategy``).
      ``tests/data/oracle/oracle_fp8.py`` makes the same cut (it returns no
      kernel: it never post-processes);
    * fp8 fused MoE: ``select_fp8_moe_backend`` (``fused_moe/oracle/fp8.py``)
      finds no CPU backend without AMX and answers ``NONE``, which
      ``convert_to_fp8_moe_kernel_format`` refuses; here ``NONE`` becomes
      ``TRITON`` (a CUDA/ROCm choice), whose kernel format is the weights
      as vLLM quantized them (no layout change in that function). With AMX
      it answers ``CPU``/``CPU_W8A8``, whose packing needs vLLM's compiled
      CPU ops; where those are missing (``torch.ops._C`` without
      ``convert_weight_packed``) that becomes ``TRITON`` too;
    * unquantized linear and embedding layers on CPU pack their weight for the
      oneDNN GEMM and drop it (``UnquantizedLinearMethod.process_weights_after_loading``,
      ``layers/utils.py`` ``dispatch_cpu_unquantized_gemm``); here they take
      the plain ``torch.nn.functional.linear``, as vLLM itself does on CPU for
      MLA's ``kv_b_proj`` (``_cpu_skip_gemm_dispatch``), so the weight stays,
      as on a GPU, where that step changes nothing.

    ``fp8_kernel="deep_gemm_e8m0"``: the block fp8 layers of the models built
    from then on in this process get vLLM's DeepGEMM kernels as a Hopper GPU
    with DeepGEMM and ``VLLM_USE_DEEP_GEMM_E8M0`` picks them (UE8M0 scales,
    DeepSeek-V3.2's ``scale_fmt: ue8m0``), and their own weight processing:

    * linear: ``DeepGemmFp8BlockScaledMMKernel`` (``kernels/linear/scaled_mm/
      deep_gemm.py``) wherever its own ``can_implement`` takes the layer
      (bf16 output, ``should_use_deepgemm_for_fp8_linear``: ``N % 64 == 0``
      and ``K % 128 == 0`` of the worker-local weight), else the Triton
      kernel as above (on a GPU the next candidate, e.g. CUTLASS). Its
      ``process_weights_after_loading`` runs as on a GPU: the shared block
      step, then ``deepgemm_post_process_fp8_weight_block``, whose
      ``requant_weight_ue8m0_inplace`` (``quantization/utils/fp8_utils.py``)
      dequantizes each weight with its float32 scales and quantizes it again
      with the scales rounded up to powers of two (``per_block_cast_to_fp8(...,
      use_ue8m0=True)``);
    * MoE: the ``DEEPGEMM`` backend (``TritonOrDeepGemmExperts``) wherever
      ``DeepGemmExperts._supports_quant_scheme`` takes the layer's keys
      (128 x 128 blocks), so ``convert_to_fp8_moe_kernel_format`` runs
      ``prepare_fp8_moe_layer_for_deepgemm``: the same requant of ``w13`` and
      ``w2``. The MoE kernel object (``make_fp8_moe_kernel``, forward only) is
      built with that class's own fallback experts (``TritonExperts``):
      ``DeepGemmExperts``' constructor asks the deep_gemm library for its
      alignment.

    ``Fp8LinearMethod`` (a checkpoint's fp8) is told DeepGEMM is supported
    too (its ``use_deep_gemm``, with which MLA's post-load step derives
    ``W_UK_T``/``W_UV`` from ``kv_b_proj`` by an identity matmul through the
    layer's kernel, ``quant_utils.get_and_maybe_dequant_weights``, as on a GPU).

    Replaced for those: only the answers to "is DeepGEMM supported / E8M0
    used" and the packing of the scales into DeepGEMM's layout
    (``transform_sf_into_required_layout``, a deep_gemm CUDA call, skipped:
    the layers keep the float32 power-of-two scales, so a comparison here
    checks the scales *before* that packing and is no evidence of the
    packed layout), both while vLLM chooses, builds or post-processes one of
    these kernels (:func:`_deep_gemm_answers`), and the GEMM (the float32
    upcast below). Live models and the fresh loads they are compared with
    must be built with the same ``fp8_kernel``.

    Raises:
        ValueError: ``fp8_kernel`` not one of :data:`FP8_KERNELS`.
    """
    if fp8_kernel not in FP8_KERNELS:
        raise ValueError(f"fp8_kernel {fp8_kernel!r} is not one of the CPU harness's fp8 "
                         f"block kernels; valid: {', '.join(FP8_KERNELS)}")
    _FP8_KERNEL["now"] = fp8_kernel
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.layers.fused_moe.oracle.fp8 as moe_oracle
    import vllm.model_executor.layers.quantization.fp8 as fp8_checkpoint
    import vllm.model_executor.layers.quantization.online.fp8 as fp8_online
    import vllm.model_executor.layers.utils as layer_utils
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe import DeepGemmExperts

    if getattr(kernels.choose_scaled_mm_linear_kernel, "_m2nkit_cpu", False):
        return
    choose = kernels.choose_scaled_mm_linear_kernel

    def plain_linear(layer, remove_weight=False):
        layer.cpu_linear = torch.nn.functional.linear

    cpu_moe = {moe_oracle.Fp8MoeBackend.CPU, moe_oracle.Fp8MoeBackend.CPU_W8A8}
    deep_gemm_moe = moe_oracle.Fp8MoeBackend.DEEPGEMM

    def select_moe_on_cpu(config, weight_key, activation_key, *args, **kwargs):
        if (_FP8_KERNEL["now"] == "deep_gemm_e8m0"
                and DeepGemmExperts._supports_quant_scheme(weight_key, activation_key)):
            return deep_gemm_moe, moe_oracle.backend_to_kernel_cls(deep_gemm_moe)[0]
        backend, experts = select_moe(config, weight_key, activation_key, *args, **kwargs)
        # A CPU with AMX gets vLLM's CPU fp8 MoE backends, whose weight packing needs
        # vLLM's compiled CPU ops (``torch.ops._C.convert_weight_packed``,
        # ``fused_moe/experts/cpu_moe.py`` ``prepare_fp8_moe_layer_for_cpu``), which a
        # vLLM installed without its CPU build lacks: the same Triton choice then.
        if backend == moe_oracle.Fp8MoeBackend.NONE or (
                backend in cpu_moe and not hasattr(torch.ops._C, "convert_weight_packed")):
            triton = moe_oracle.Fp8MoeBackend.TRITON
            return triton, moe_oracle.backend_to_kernel_cls(triton)[0]
        return backend, experts

    def convert_moe_on_cpu(fp8_backend, *args, **kwargs):
        if fp8_backend != deep_gemm_moe:
            return convert_moe(fp8_backend, *args, **kwargs)
        with _deep_gemm_answers():
            return convert_moe(fp8_backend, *args, **kwargs)

    def make_moe_kernel_on_cpu(*args, experts_cls, fp8_backend, **kwargs):
        if fp8_backend == deep_gemm_moe and hasattr(experts_cls, "get_clses"):
            experts_cls = experts_cls.get_clses()[1]     # TritonOrDeepGemmExperts' fallback
        return make_moe_kernel(*args, experts_cls=experts_cls, fp8_backend=fp8_backend, **kwargs)

    def upcast_block_mm(self, A, B, As, Bs):
        """Both operands times their block scales in float32, one matmul, cast to the output dtype."""
        bn, bk = self.weight_group_shape
        K, N = A.shape[-1], B.shape[0]
        a = A.float().reshape(-1, K)
        a = a * As.float().reshape(-1, As.shape[-1])[:a.shape[0]].repeat_interleave(
            bk, dim=1)[:, :K]
        b = B.float() * Bs.float().repeat_interleave(bn, dim=0).repeat_interleave(
            bk, dim=1)[:N, :K]
        return (a @ b.t()).to(self.config.out_dtype).reshape(*A.shape[:-1], N)

    class TorchUpcastFp8BlockKernel(TritonFp8BlockScaledMMKernel):
        """The Triton block fp8 kernel's choice and weight processing, its GEMM in torch.

        Triton does not run on a CPU, and vLLM's only CPU block fp8 GEMMs need
        AMX and its compiled CPU ops. A built model never runs a forward pass
        here, but MLA's post-load step multiplies once: ``split_kv_b_proj``
        dequantizes an online-fp8 ``kv_b_proj`` by an identity matmul through the
        layer's kernel (``quant_utils.get_and_maybe_dequant_weights``, the generic
        case), which derives ``W_UK_T``/``W_UV``. This GEMM is the float32 upcast
        vLLM itself falls back to where its Triton kernel cannot run
        (``fp8_utils.w8a8_triton_block_scaled_mm``, the gfx1250 branch): both
        operands times their block scales in float32, one matmul, cast to the
        output dtype. Live models and the fresh loads they are compared with
        both use it.
        """

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        apply_block_scaled_mm = upcast_block_mm

    class TorchUpcastDeepGemmFp8BlockKernel(DeepGemmFp8BlockScaledMMKernel):
        """vLLM's DeepGEMM block fp8 kernel: its choice and weight processing, its GEMM in torch.

        ``is_supported`` (CUDA with DeepGEMM) answers yes; ``can_implement``,
        the constructor and ``process_weights_after_loading`` are vLLM's, run
        with :func:`_deep_gemm_answers` (so ``requant_weight_ue8m0_inplace``
        runs, and the scales stay unpacked); the GEMM is the float32 upcast
        of :class:`TorchUpcastFp8BlockKernel` (DeepGEMM's ``fp8_gemm_nt`` is
        CUDA only), taking the float32 power-of-two scales.
        """

        def __init__(self, config):
            with _deep_gemm_answers():
                super().__init__(config)

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        @classmethod
        def can_implement(cls, config):
            with _deep_gemm_answers():
                return super().can_implement(config)

        def process_weights_after_loading(self, layer):
            with _deep_gemm_answers():
                super().process_weights_after_loading(layer)

        apply_block_scaled_mm = upcast_block_mm

    def choose_on_cpu(config, possible_kernels, **kwargs):
        if possible_kernels is kernels._POSSIBLE_FP8_BLOCK_KERNELS:
            if (_FP8_KERNEL["now"] == "deep_gemm_e8m0"
                    and TorchUpcastDeepGemmFp8BlockKernel.can_implement(config)[0]):
                return TorchUpcastDeepGemmFp8BlockKernel
            return TorchUpcastFp8BlockKernel
        return choose(config, possible_kernels, **kwargs)

    supported = fp8_checkpoint.is_deep_gemm_supported

    def deep_gemm_supported_for_fp8_checkpoints() -> bool:
        # Fp8LinearMethod.use_deep_gemm (layers/quantization/fp8.py), read by MLA's post-load
        # dequantization of kv_b_proj (quant_utils.get_and_maybe_dequant_weights: with
        # DeepGEMM the identity matmul through the layer's kernel, as on a GPU)
        return _FP8_KERNEL["now"] == "deep_gemm_e8m0" or supported()

    fp8_checkpoint.is_deep_gemm_supported = deep_gemm_supported_for_fp8_checkpoints
    choose_on_cpu._m2nkit_cpu = True
    kernels.choose_scaled_mm_linear_kernel = choose_on_cpu
    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear
    select_moe = moe_oracle.select_fp8_moe_backend
    convert_moe = moe_oracle.convert_to_fp8_moe_kernel_format
    make_moe_kernel = moe_oracle.make_fp8_moe_kernel
    for module in (fp8_checkpoint, fp8_online):
        module.select_fp8_moe_backend = select_moe_on_cpu
    # the checkpoint fp8 method imports these by name; the online one inside _setup_kernel
    for module in (fp8_checkpoint, moe_oracle):
        module.convert_to_fp8_moe_kernel_format = convert_moe_on_cpu
        module.make_fp8_moe_kernel = make_moe_kernel_on_cpu


def build_cpu_worker(checkpoint: str | os.PathLike, spec: InferenceSpec, worker: int, *,
                     load: bool = True,
                     quantization: str | None = None,
                     fp8_kernel: str = "triton") -> tuple[torch.nn.Module, Any]:
    """Build vLLM's own model class for ``checkpoint`` as ``worker`` of ``spec``, on CPU.

    vLLM resolves the class from ``config.json`` (its model registry),
    allocates the rank-local parameters (``initialize_model``) and, with
    ``load``, fills them from the checkpoint with ``DefaultModelLoader.
    load_weights`` (its per-parameter weight loaders). Nothing is
    post-processed (``process_weights_after_loading`` would repack linear
    weights for the CPU kernels). The process's vLLM parallel state is set
    for this worker (``stand_in.worker_config``) and stays so.

    Returns:
        ``(model, vllm_config)``: ``vllm_config.parallel_config`` carries
        ``rank`` and ``data_parallel_rank`` as a vLLM worker's does.

    ``quantization``: vLLM's ``--quantization`` (e.g. ``"fp8_per_block"``);
    a quantized model (that, or a checkpoint with a ``quantization_config``)
    is post-processed as vLLM's loader does (``BaseModelLoader.load_model``:
    ``finalize_layerwise_processing`` for online quantization, which quantizes
    each layer while it loads and the padded ones at the end, then
    ``process_weights_after_loading`` of ``model_loader/utils.py``), with :func:`cpu_quantized_kernels`: what it serves is then kernel
    format (e4m3 ``weight`` + ``weight_scale_inv``). ``fp8_kernel``: which
    block fp8 kernels vLLM picks for it (:func:`cpu_quantized_kernels`;
    ``"deep_gemm_e8m0"``: DeepGEMM's, UE8M0 scales).

    Requires ``VLLM_TARGET_DEVICE=cpu`` before vLLM is first imported (set
    here if unset; too late if vLLM was imported for another platform).
    """
    _cpu_environment()
    from vllm.config import LoadConfig, WeightTransferConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    path = str(Path(checkpoint).resolve())
    quantized = quantization is not None or _has_quantization_config(path)
    if quantized:
        cpu_quantized_kernels(fp8_kernel)
    vllm_config = worker_config(path, spec, worker, quantization=quantization,
                                load_config=LoadConfig(load_format="safetensors",
                                                       use_tqdm_on_load=False),
                                weight_transfer_config=WeightTransferConfig(backend=BACKEND))
    model_config = vllm_config.model_config
    # sparse-attention (DSA) layers build as on a GPU worker: their backend owns no
    # parameter (m2nkit.adapters.vllm.stand_in.gpu_sparse_attention)
    with set_current_vllm_config(vllm_config), gpu_sparse_attention():
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
    if load:
        load_checkpoint(model, vllm_config, path)
        if quantized:
            from vllm.model_executor.model_loader.base_loader import _has_online_quant
            from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            # as BaseModelLoader.load_model: online quantization first finishes the layers
            # whose last element never lands (padding vLLM added: experts rounded up to
            # whole 128-blocks), then every layer's post-load step
            with set_current_vllm_config(vllm_config), torch.no_grad():
                if _has_online_quant(model):
                    finalize_layerwise_processing(model, model_config)
                process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model, vllm_config


def _has_quantization_config(checkpoint: str) -> bool:
    import json

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return bool(config.get("quantization_config"))


def load_checkpoint(model: torch.nn.Module, vllm_config: Any,
                    checkpoint: str | os.PathLike) -> None:
    """Fill ``model`` from ``checkpoint`` with vLLM's ``DefaultModelLoader.load_weights``.

    The model config is copied with ``model`` pointed at ``checkpoint``, as
    vLLM's own ``reload_weights`` repoints it (``model_loader/reload/inplace.py``).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model_config = copy.copy(vllm_config.model_config)
    model_config.model = str(Path(checkpoint).resolve())
    model_config.model_weights = ""
    with set_current_vllm_config(vllm_config), torch.no_grad():
        DefaultModelLoader(vllm_config.load_config).load_weights(model, model_config)


def fresh_load(checkpoint: str | os.PathLike, spec: InferenceSpec,
               worker: int, quantization: str | None = None,
               fp8_kernel: str = "triton") -> dict[str, torch.Tensor]:
    """``worker``'s parameters as vLLM loads ``checkpoint`` into a new model (new configs).

    :func:`build_cpu_worker` again, so nothing is shared with a live model
    (vLLM registers each attention layer's name in its config's forward
    context, so a second model needs its own ``VllmConfig``); returns
    :func:`parameters_of` it. Leaves the process's stand-in parallel state
    set for ``worker``.
    """
    model, _ = build_cpu_worker(checkpoint, spec, worker, quantization=quantization,
                                fp8_kernel=fp8_kernel)
    return parameters_of(model)


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``named_parameters(remove_duplicate=False)`` (aliases included)."""
    return {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}


def create_engine(model: torch.nn.Module, vllm_config: Any,
                  device: torch.device | str = "cpu") -> M2NVLLMEngine:
    """The engine as a vLLM worker builds it: through vLLM's factory, by backend name.

    ``WeightTransferEngineFactory.create_engine(vllm_config.weight_transfer_config,
    vllm_config, device, model)`` (``v1/worker/gpu_worker.py``); :func:`register`
    first, as vLLM's plugin loading would.
    """
    register()
    return WeightTransferEngineFactory.create_engine(
        vllm_config.weight_transfer_config, vllm_config, torch.device(device), model)


def set_current_config(vllm_config: Any):
    """vLLM's ``set_current_vllm_config`` context (its worker wraps every engine call in it)."""
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


@contextlib.contextmanager
def no_fp8_kernels():
    """Build vLLM 0.33.0's fp8 layers on a CPU without AMX: no matmul kernel is chosen.

    vLLM asks for a kernel while it builds or processes an fp8 layer, and on
    a CPU without AMX every candidate declines (``CPUFp8BlockScaledMMKernel
    requires AMX``; the fused-MoE oracle finds backend ``NONE``). The kernel
    only decides how the forward pass multiplies, so inside this context
    that one choice is replaced, and nothing that computes a weight:

    * ``online/fp8.py`` ``init_fp8_linear_kernel``: a kernel whose
      ``process_weights_after_loading`` leaves the layer as vLLM's
      quantization left it (``per_block_cast_to_fp8``, ``replace_parameter``);
    * ``fused_moe/oracle/fp8.py`` ``convert_to_fp8_moe_kernel_format``: the
      tensors in no kernel's format (as quantized), and
      ``_Fp8OnlineMoEBase.get_fused_moe_quant_config``: no kernel config, so
      ``make_fp8_moe_kernel`` is not called.

    The model can be built and loaded, not run. Everything is restored on exit.
    """
    import vllm.model_executor.layers.fused_moe.oracle.fp8 as moe_fp8
    import vllm.model_executor.layers.quantization.online.fp8 as online_fp8

    class _NoKernel:
        def process_weights_after_loading(self, layer):
            return None

    def _as_quantized(*, w13, w2, w13_scale, w2_scale, **_):
        return w13, w2, w13_scale, w2_scale

    saved = [(online_fp8, "init_fp8_linear_kernel", online_fp8.init_fp8_linear_kernel),
             (moe_fp8, "convert_to_fp8_moe_kernel_format",
              moe_fp8.convert_to_fp8_moe_kernel_format),
             (online_fp8._Fp8OnlineMoEBase, "get_fused_moe_quant_config",
              online_fp8._Fp8OnlineMoEBase.get_fused_moe_quant_config)]
    online_fp8.init_fp8_linear_kernel = lambda **kwargs: _NoKernel()
    moe_fp8.convert_to_fp8_moe_kernel_format = _as_quantized
    online_fp8._Fp8OnlineMoEBase.get_fused_moe_quant_config = lambda self, layer: None
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def fresh_fp8_load(checkpoint: str | os.PathLike, spec: InferenceSpec,
                   worker: int) -> dict[str, torch.Tensor]:
    """``worker``'s parameters as vLLM serves a BF16 ``checkpoint`` with ``quantization="fp8_per_block"``.

    vLLM's own path: ``ModelConfig(quantization="fp8_per_block")``, the
    model built (online layers on the meta device), ``DefaultModelLoader.
    load_weights`` (each layer quantized as its last weight lands), then
    ``finalize_layerwise_processing`` (``model_loader/reload/layerwise.py``:
    the layers whose padding is never loaded, the experts), inside
    :func:`no_fp8_kernels`. Returns :func:`parameters_of` the model.
    """
    _cpu_environment()
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_processing
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    path = str(Path(checkpoint).resolve())
    with no_fp8_kernels():
        vllm_config = worker_config(path, spec, worker, quantization="fp8_per_block",
                                    load_config=LoadConfig(load_format="safetensors",
                                                           use_tqdm_on_load=False))
        model_config = vllm_config.model_config
        with set_current_vllm_config(vllm_config), gpu_sparse_attention():
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vllm_config)
        load_checkpoint(model, vllm_config, path)
        with set_current_vllm_config(vllm_config), torch.no_grad():
            finalize_layerwise_processing(model, model_config)
    return parameters_of(model)
