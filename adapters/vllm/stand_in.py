"""vLLM's parallel state for one worker without processes: sizes and ranks only.

vLLM's model classes and weight loaders read the tensor-, data- and
expert-parallel groups of ``vllm.distributed.parallel_state`` while they
build a worker's parameters and narrow checkpoint tensors to it. To build
a worker's model outside a vLLM server (the traced layout,
``adapters/vllm/trace.py``; the CPU workers of the demo and the tests,
``engine/tools/vllm_workers.py``) those globals are set to stand-ins that
answer sizes and ranks and nothing else: any collective on them fails.
vLLM is imported only when :meth:`StandInGroups.install` runs.

:func:`gpu_sparse_attention` stands in for what a CPU process lacks to
build a sparse-attention (DSA) model: the GPU's sparse MLA backend and its
scratch workspace. Neither owns a parameter, so the layout is vLLM's own.
:func:`meta_current_device` makes the platform's current device the meta
device while a model is built there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["StandInGroups", "worker_config", "gpu_sparse_attention", "meta_current_device",
           "SPARSE_BACKEND"]

#: The sparse MLA backend a CUDA worker of vLLM 0.33.0 builds DSA models with
#: (``AttentionBackendEnum.FLASHMLA_SPARSE``); the oracle's default too.
SPARSE_BACKEND = "FLASHMLA_SPARSE"


class _StandInProcessGroup:
    """Answers ``size()`` and ``rank()``; any collective on it fails (no such method)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _StandInCoordinator:
    """What model construction and the weight loaders read of a ``GroupCoordinator``."""

    def __init__(self, name: str, size: int, rank: int) -> None:
        self.unique_name = name
        self.world_size = size
        self.rank_in_group = rank
        self.rank = rank
        self.local_rank = rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.device_group = self.cpu_group = _StandInProcessGroup(size, rank)
        self.device_communicator = None
        self.use_device_communicator = False
        self.mq_broadcaster = None


@dataclass(frozen=True)
class StandInGroups:
    """vLLM's parallel state for one worker, without processes: sizes and ranks only.

    Sets the group globals of ``vllm.distributed.parallel_state`` the model
    classes and weight loaders read (``_WORLD``, ``_TP``, ``_ETP``, ``_PP``,
    ``_DP``, ``_PCP``, ``_DCP``, ``_EP``) for worker ``dp_index * tp +
    tp_rank``. The EP group spans ``dp * tp`` when ``ep`` is on, as vLLM's
    ``ep_size = dp * pcp * tp`` (``vllm/distributed/parallel_state.py``,
    ``initialize_model_parallel``). One worker per process at a time: the
    globals are the process's.
    """

    tp: int
    tp_rank: int
    dp: int = 1
    dp_index: int = 0
    ep: bool = False

    def install(self) -> None:
        import vllm.distributed.parallel_state as ps

        worker = self.dp_index * self.tp + self.tp_rank
        ps._WORLD = _StandInCoordinator("world", self.dp * self.tp, worker)
        ps._TP = _StandInCoordinator("tp", self.tp, self.tp_rank)
        ps._ETP = ps._TP
        ps._PP = _StandInCoordinator("pp", 1, 0)
        ps._DP = _StandInCoordinator("dp", self.dp, self.dp_index)
        ps._PCP = _StandInCoordinator("pcp", 1, 0)
        ps._DCP = _StandInCoordinator("dcp", 1, 0)
        ps._EP = (_StandInCoordinator("ep", self.dp * self.tp, worker) if self.ep
                  else _StandInCoordinator("ep", 1, 0))


def worker_config(model_dir: str, spec: Any, worker: int, *, quantization: str | None = None,
                  **extra: Any) -> Any:
    """The ``VllmConfig`` of ``worker`` of ``spec`` (an ``InferenceSpec``), its groups installed.

    ``model_dir`` holds the ``config.json`` vLLM's ``ModelConfig`` reads
    (and the checkpoint, when one is loaded). The parallel config carries
    ``rank`` and ``data_parallel_rank`` as a vLLM worker's does, with the
    spec's EP, expert placement and all2all backend; the device is the CPU.
    ``extra`` goes to ``VllmConfig`` (a ``load_config``, a
    ``weight_transfer_config``). ``quantization``: vLLM's ``--quantization``
    (``ModelConfig.quantization``; ``None``: the checkpoint's own
    ``quantization_config``, if any). Sets the process's parallel state for this
    worker (:class:`StandInGroups`), which stays so.
    """
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    tp_rank, dp_index = spec.tp_rank(worker), spec.dp_index(worker)
    StandInGroups(spec.tp, tp_rank, spec.dp, dp_index, spec.ep).install()
    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                               dtype=spec.dtype, enforce_eager=True, seed=0,
                               quantization=quantization)
    parallel = ParallelConfig(tensor_parallel_size=spec.tp, data_parallel_size=spec.dp,
                              data_parallel_rank=dp_index, rank=tp_rank,
                              enable_expert_parallel=spec.ep,
                              expert_placement_strategy=spec.placement,
                              all2all_backend=spec.all2all)
    extra.setdefault("load_config", LoadConfig(load_format="safetensors"))
    if getattr(model_config, "use_mla", False) and "attention_config" not in extra:
        extra["attention_config"] = _reference_cpu_mla()
    return VllmConfig(model_config=model_config, parallel_config=parallel,
                      device_config=DeviceConfig(device="cpu"), **extra)



def _reference_cpu_mla() -> Any:
    """vLLM's reference CPU MLA backend, asked for by name (``AttentionConfig.backend``).

    On an x86 host with AMX tiles, ``CpuPlatform.get_attn_backend_cls``
    (``vllm/platforms/cpu.py``, vLLM 0.33.0) picks ``AMX_MLA`` "unless
    CPU_MLA was explicitly requested"; ``AMX_MLA``'s post-load step
    (``v1/attention/backends/mla/amx_mla.py``, ``process_weights_after_loading``)
    packs ``W_UK``/``W_UV`` with ``torch.ops._C.convert_weight_packed``, an op
    of vLLM's CPU build that the CUDA wheel installed here lacks, so an
    MLA model could not be post-processed on such a host (it is on
    this one). ``CPU_MLA`` is vLLM's own pure-torch path. Attention backends
    own no parameters: the parameters, their loaders and the layout stay
    vLLM's. What a backend derives after loading differs between them
    (``CPU_MLA`` keeps ``W_UK_T``/``W_UV``, ``AMX_MLA`` packed copies), so a
    live model and the fresh load it is compared with are both built here.
    Set only for MLA models (``ModelConfig.use_mla``) and only when the
    caller gives no ``attention_config``.
    """
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionConfig(backend=AttentionBackendEnum.CPU_MLA)


class _NoWorkspace:
    """vLLM's ``WorkspaceManager`` for a model that is built, never run: empty scratch."""

    def get_simultaneous(self, *specs: Any) -> list[Any]:
        import torch

        return [torch.empty(0, dtype=dtype) for _, dtype in specs]


@contextlib.contextmanager
def gpu_sparse_attention(backend: str = SPARSE_BACKEND) -> Iterator[None]:
    """Build sparse-attention (DSA) layers as a GPU worker would, in a CPU process.

    vLLM 0.33.0 builds GLM-5 and the other architectures with a
    sparse-attention indexer (``tests/integration/test_traced_glm.py``) with
    a sparse MLA attention layer
    (``model_executor/layers/attention/mla_attention.py``, ``use_sparse``).
    Two things stop a CPU process from building one:

    * ``CpuPlatform.get_attn_backend_cls`` (``vllm/platforms/cpu.py``) raises
      ``NotImplementedError("Sparse Attention is not supported on CPU.")``;
      inside this context it answers a sparse request with ``backend`` (an
      ``AttentionBackendEnum`` name), what a CUDA worker picks, and leaves
      every other request to vLLM;
    * the GPU sparse backend's ``__init__`` reserves forward scratch from
      vLLM's ``WorkspaceManager`` (``vllm/v1/worker/workspace.py``), which a
      GPU worker makes in ``GPUModelRunner.__init__``: where none exists, a
      stand-in hands back empty tensors.

    Attention backends and scratch own no parameters: the parameters, their
    loaders and so the layout stay vLLM's own. This is what the oracle that
    made the shipped dumps does (``shared/tools/vllm_oracle/oracle.py``,
    ``_patch_sparse_attn_backend``, with the same default backend). Both
    are restored on exit, and vLLM's memo of backend choices
    (``v1/attention/selector.py``, ``_cached_get_attn_backend``) is cleared
    so no sparse choice made here outlives the context.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker import workspace

    path = AttentionBackendEnum[backend].get_path()
    platform = type(current_platform) if current_platform.is_cpu() else None
    original = platform.__dict__["get_attn_backend_cls"] if platform is not None else None
    if platform is not None:
        vllm_choice = original.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.use_sparse:
                return path
            return vllm_choice(cls, selected_backend, attn_selector_config, num_heads)

        platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    stand_in = workspace._manager is None
    if stand_in:
        workspace._manager = _NoWorkspace()
    try:
        yield
    finally:
        if platform is not None:
            platform.get_attn_backend_cls = original
        if stand_in and isinstance(workspace._manager, _NoWorkspace):
            workspace._manager = None
        selector._cached_get_attn_backend.cache_clear()


@contextlib.contextmanager
def meta_current_device() -> Iterator[None]:
    """While a worker's model is built on the meta device, the platform's device is meta.

    A vLLM worker builds its model on its platform's current device, and
    some model classes move submodules there by name: vLLM 0.33.0's
    ``KimiK25ForConditionalGeneration.__init__`` (``models/kimi_k25.py``)
    does ``self.vision_tower.to(device=current_platform.current_device())``
    and the same for ``mm_projector``; ``GatedDeltaNetAttention``
    (the gated-DeltaNet module under ``layers/mamba/gdn/``) builds its ``norm`` with
    ``device=current_platform.current_device()``. For a meta build
    (``adapters/vllm/trace.py``) the device the model is built on is meta,
    and the CPU platform's answer (``torch.cpu.current_device()``, through
    ``Platform.__getattr__`` in ``platforms/interface.py``) is ``"cpu"``, to
    which a meta module cannot move (torch: "Cannot copy out of meta
    tensor"). Inside this context ``current_platform.current_device()``
    answers ``torch.device("meta")``: a device, not a parameter, so shapes,
    dtypes and loaders stay vLLM's own. The platform object is restored on
    exit.
    """
    import torch
    from vllm.platforms import current_platform

    had = "current_device" in vars(current_platform)
    saved = vars(current_platform).get("current_device")
    current_platform.current_device = lambda: torch.device("meta")
    try:
        yield
    finally:
        if had:
            current_platform.current_device = saved
        else:
            del current_platform.current_device
