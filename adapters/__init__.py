"""Adapters: a trainer's weights as manifest entries, and vLLM's layouts (docs/architecture.md).

Public entry points are imported on first use, so ``import m2nkit.adapters.families``
(the architecture registry) still does not import torch:

* ``fsdp2_source(model, ...)`` — a live FSDP2 (``fully_shard``) model as an
  ``M2NWeightSource`` (:mod:`m2nkit.adapters.fsdp2`, docs/fsdp2.md).
* ``megatron_source(model_chunks, config=...)`` — a live Megatron-Core
  ``GPTModel`` (TP, PP, VPP, EP, ETP) as an ``M2NWeightSource``
  (:mod:`m2nkit.adapters.megatron.source`, docs/megatron.md).
* ``bridge_source(bridge, model_chunks, mode="tasks"|"export")`` — a Megatron-Bridge
  model as an ``M2NWeightSource`` (:mod:`m2nkit.adapters.megatron.bridge`, docs/bridge.md).
"""

from m2nkit._lazy import lazy_attributes

__all__ = ["fsdp2_source", "megatron_source", "bridge_source"]

__getattr__, __dir__ = lazy_attributes(__name__, {
    "fsdp2_source": (".fsdp2", "fsdp2_source"),
    "megatron_source": (".megatron.source", "megatron_source"),
    "bridge_source": (".megatron.bridge", "bridge_source"),
}, globals())
