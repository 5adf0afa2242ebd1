"""Adapters: a trainer's weights as manifest entries, and vLLM's layouts (DESIGN.md, "Folders").

Public entry points are imported on first use, so ``import m2nkit.adapters.families``
(the architecture registry) still does not import torch:

* ``fsdp2_source(model, ...)`` — a live FSDP2 (``fully_shard``) model as an
  ``M2NWeightSource`` (:mod:`m2nkit.adapters.fsdp2`, docs/fsdp2.md).
"""

__all__ = ["fsdp2_source"]


def __getattr__(name: str):
    if name == "fsdp2_source":
        from .fsdp2 import fsdp2_source

        return fsdp2_source
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
