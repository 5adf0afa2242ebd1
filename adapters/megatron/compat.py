"""Run megatron-core 0.19.2 and megatron-bridge 0.6.2 on Python 3.11 and on CPU.

Both packages declare Python >= 3.12 and assume CUDA in a few places. The
project installs them with ``--ignore-requires-python`` (scripts/setup.sh);
these runtime shims cover what remains. Nothing is applied on import: a
process calls :func:`enable_py311` before importing megatron (any machine
with Python 3.11) and :func:`enable_cpu` when it trains on CPU (tests, the
demo). On a CUDA machine :func:`enable_cpu` changes nothing.

What each shim answers (found on this machine, 2026-11-30; docs/reference.md
§5 has the stack's versions):

* ``typing.override`` (Python 3.12) is imported by
  ``megatron/training/models/gpt.py`` and ``hybrid.py``, which Bridge
  imports: :func:`enable_py311` puts ``typing_extensions.override`` (the
  backport; typing_extensions is a torch dependency) on ``typing``.
* ``torch.cuda.current_device()`` is called unconditionally by Bridge's
  ``ReplicatedMapping.hf_to_megatron`` (TP > 1, ``param_mapping.py``) and by
  rotary embeddings; a CPU torch raises. :func:`enable_cpu` answers
  ``"cpu"``, a valid device for every ``.to(...)``/``device=`` use found.
* ``weight.data.cuda()`` in megatron-core's
  ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with
  PP > 1, before the all-reduce over the embedding group): with no CUDA,
  :func:`enable_cpu` makes ``Tensor.cuda()`` leave the tensor where it is,
  which is what a gloo all-reduce needs.

* megatron-core imports triton unguarded for its MoE paged-stash GPU kernels
  (``transformer/moe/paged_stash.py`` -> ``moe/ops/paged_stash.py``). The real
  triton package would import on CPU, but torch then imports it in every
  process (``torch._dynamo`` probes for it) and triton's bindings print
  "nanobind: leaked ... instances" at every interpreter exit, m2nkit's CLI
  included. So without triton :func:`enable_cpu` registers that one kernel
  module: ``GLOBAL_BLOCK_SIZE`` as megatron-core 0.19.2 defines it (1024) and
  kernels that refuse to launch. Paged stashing is a GPU memory feature that
  is off unless configured.

One import in Bridge's ``peft/lora_layers.py`` is guarded at setup instead
(scripts/patch_stacks.py says why that one cannot be a shim).
The causal mask megatron-core builds by default lives on CUDA: a CPU forward
passes an explicit ``attention_mask``.
"""

from __future__ import annotations

import typing

__all__ = ["enable_py311", "enable_cpu"]


def enable_py311() -> None:
    """Give Python 3.11's ``typing`` the 3.12 ``override`` decorator (idempotent)."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _stay(self, device=None, non_blocking=False, memory_format=None):
    """``Tensor.cuda`` on a machine without CUDA: the tensor, unmoved."""
    return self


def enable_cpu() -> None:
    """Let megatron-core and Bridge run on a CPU-only torch (idempotent; no-op with CUDA).

    Also calls :func:`enable_py311`. Process-wide: call it in trainer
    processes that have no GPU, never in a process that uses CUDA.
    """
    enable_py311()
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = _stay
    _stand_in_paged_stash_kernels()


class _NoKernel:
    """A triton kernel that is not there: launching it (``kernel[grid](...)``) raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        raise RuntimeError(f"megatron-core's {self.name} is a triton GPU kernel; this process "
                           "runs on CPU without triton (m2nkit.adapters.megatron.compat)")


def _stand_in_paged_stash_kernels() -> None:
    import importlib.util
    import sys
    import types

    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(name, "CPU stand-in (m2nkit.adapters.megatron.compat): no triton")
    module.GLOBAL_BLOCK_SIZE = 1024  # megatron-core 0.19.2 moe/ops/paged_stash.py
    module.paged_stash_copy_kernel = _NoKernel("paged_stash_copy_kernel")
    module.paged_stash_pop_kernel = _NoKernel("paged_stash_pop_kernel")
    sys.modules[name] = module
