"""Model families: everything m2nkit knows about one architecture, in one module.

A family's knowledge used to be spread over the checkpoint reader, the vLLM
tables, the reference loader and the tiny-model builder; adding a family
meant editing all four. Here each family is one module (``llama.py``,
``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``, ``mixtral.py``,
``gpt_oss.py``, ``gemma2.py``, ``gemma3.py``, ``deepseek_v3.py``; the
multimodal wrappers ``qwen3_vl.py``, ``qwen3_vl_moe.py``, composed from a
text family and a tower table by ``wrapper.py``) holding:

* transformers' names for its tensors, in memory and on disk, and how MoE
  experts are fused (``HF_NAMES``);
* the vLLM parameters, each with its shard kind and the wire tensors that
  feed them (``VLLM_PARAMS``), and the conditions deciding which exist for a
  config (``CONDITIONS``: biases, dense or MoE layers; tied embeddings);
* its tiny test models (``TINY_MODELS``);
* how trainers apply tensor parallelism to it (``TP_PLAN``, where it has one);
* ``FAMILY``, the :class:`~.table.Family` bundling them.

The shard kinds every family uses (replicated, column, row, vocab, merged
column, QKV, stacked experts) are defined once, in :mod:`.kinds`; the table
vocabulary is :mod:`.table`; config sizes are :mod:`.sizes`; one expander
(:mod:`.expand`) turns a table into a config's parameters and wire tensors
for both sides, with vLLM's version-dependent names from
:mod:`.vllm_names`. The registry (:mod:`.registry`) maps
``config.architectures[0]`` to the module. Adding a family:
``docs/families.md``.

Trainer-side names that are not transformers' (Megatron-Core's) are the
trainer adapter's: ``m2nkit.adapters.megatron.names`` holds one table per
family and imports the families; nothing here imports ``adapters/megatron``
(``tests/test_layering.py``).

This package imports only the registry, so ``import
m2nkit.adapters.families`` does not import torch or transformers.
"""

from .registry import (
    ARCHITECTURES,
    TRACED_HINT,
    TINY_MODEL_ARCHITECTURES,
    UnsupportedArchitecture,
    architecture_name,
    architecture_of,
    check_architecture,
    family,
    family_for,
    has_table,
    supported_architectures,
    unsupported_architecture,
)

__all__ = [
    "ARCHITECTURES",
    "TRACED_HINT",
    "TINY_MODEL_ARCHITECTURES",
    "UnsupportedArchitecture",
    "architecture_name",
    "architecture_of",
    "check_architecture",
    "family",
    "family_for",
    "has_table",
    "supported_architectures",
    "unsupported_architecture",
]
