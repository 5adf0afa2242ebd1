"""Architectures without an m2nkit table: what transformers itself says about them.

A family table (one module of this package) restates vLLM's loaders for a
vLLM-free dry run. An architecture without one is still carried when its
destination layout is traced from vLLM's own loaders
(``m2nkit.adapters.vllm.trace``): the trainer side then needs only what
transformers knows, read at run time rather than restated:

* the model class, ``getattr(transformers, config.architectures[0])``
  (causal LMs and multimodal ``...ForConditionalGeneration`` wrappers alike);
* the wire tensors, its ``named_parameters()`` and persistent buffers built
  on the meta device, under transformers 5's in-memory names (stacked
  experts as ``...mlp.experts.gate_up_proj [E, 2*I, H]``, no ``.weight``);
  vLLM 0.33.0's loaders take those names (``layers/fused_moe/routed_experts.py``);
* which of them are persistent buffers (whole on every FSDP2 rank:
  ``fully_shard`` shards parameters only);
* one restated fact: Llama-4's routed experts travel transposed, ``[E, out,
  in]`` (``families/llama4.py``: transformers stores them ``[E, in, out]``,
  which no binding can carry into vLLM's ``w13_weight``/``w2_weight``).

:func:`tableless_family` packs that into a :class:`~.table.Family` with no
vLLM table (``params`` empty): the checkpoint reader, the FSDP2 source and
the trainer layouts take it like any family; the table destination refuses
it, naming ``--layout traced``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Mapping

import torch

from .registry import (TRACED_HINT, UnsupportedArchitecture, architecture_name, family_for,
                       has_table, supported_architectures)
from .table import Family, HFNaming

__all__ = ["transformers_class", "transformers_config", "meta_model", "tableless_family",
           "family_or_tableless", "builtin_config_class", "TABLELESS_MODULE"]

#: ``Family.module`` of a tableless family (named in messages).
TABLELESS_MODULE = "no m2nkit table: layout traced from vLLM's loaders"


def transformers_class(architecture: str):
    """transformers' model class named ``architecture``.

    Raises:
        UnsupportedArchitecture: transformers has no such model class (names
            the version and the architectures m2nkit has tables for).
    """
    import transformers

    cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise UnsupportedArchitecture(
            f"architecture {architecture!r}: transformers {transformers.__version__} has no such "
            f"model class and m2nkit has no table for it; tables: "
            f"{', '.join(supported_architectures())}")
    return cls


def builtin_config_class(model_type: Any):
    """transformers' own config class of ``model_type`` (its static name table), or ``None``.

    Not ``AutoConfig``'s registry: vLLM registers its own config classes there
    for some model types when it reads a config (``vllm/transformers_utils/
    config.py``; ``deepseek_v32`` becomes its ``DeepseekV3Config``), so in a
    process that traced such a model the registry answers with vLLM's class,
    which transformers' model class cannot be built from.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    name = CONFIG_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    return getattr(transformers, name, None) if name else None


def transformers_config(config: Any):
    """``config`` as a transformers config object (a ``config.json`` dict is read by its class).

    Raises:
        UnsupportedArchitecture: a ``model_type`` transformers does not know.
    """
    if not isinstance(config, Mapping):
        return config
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = dict(config)
    model_type = data.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not built into transformers (m2nkit never runs a "
            f"model's own code); tables: {', '.join(supported_architectures())}")
    cls = builtin_config_class(model_type)      # not vLLM's registration of the type
    return cls(**data) if cls is not None else AutoConfig.for_model(model_type, **data)


def _dtype(config) -> torch.dtype:
    """The dtype the config names, else its text model's (a multimodal wrapper's
    ``text_config``, where published wrappers name it), else float32
    (transformers' default). transformers 5 reads a file's ``torch_dtype``
    into ``dtype``."""
    for c in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
        d = getattr(c, "dtype", None) if c is not None else None
        if isinstance(d, str):
            d = getattr(torch, d, None)
        if isinstance(d, torch.dtype):
            return d
    return torch.float32


def meta_model(config: Any) -> torch.nn.Module:
    """transformers' model of ``config`` on the meta device, in the dtype the config names.

    Modules transformers keeps in float32 (``_keep_in_fp32_modules``) stay so,
    as ``from_pretrained`` would hold them.

    Raises:
        UnsupportedArchitecture: transformers lacks the class or model type.
        ValueError: transformers cannot build the model from this config
            (its message, on one line).
    """
    config = transformers_config(config)
    archs = getattr(config, "architectures", None) or []
    cls = transformers_class(archs[0] if archs else None)
    try:
        with torch.device("meta"):
            return cls._from_config(config, dtype=_dtype(config))
    except Exception as e:   # transformers' refusals come as several exception types
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"transformers cannot build {cls.__name__} from this config: "
                         f"{first}") from e


@functools.lru_cache(maxsize=16)
def _family(architecture: str, config_json: str) -> Family:
    config = transformers_config(json.loads(config_json))
    model = meta_model(config)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = tuple(f"^{re.escape(n)}$" for n in model.state_dict(keep_vars=True)
                    if n not in params)
    return Family(architecture=architecture,
                  hf=HFNaming(buffers=buffers, permuted=_permuted(architecture)), params=(),
                  sizes=functools.partial(_no_table, architecture), module=TABLELESS_MODULE)


def _permuted(architecture: str) -> dict:
    """``HFNaming.permuted`` of an architecture whose wire is not transformers' dim order.

    Only Llama-4's routed experts (``families/llama4.py``: stored ``[E, in,
    out]``, carried ``[E, out, in]`` as vLLM holds them).
    """
    from . import llama4

    return dict(llama4.PERMUTED) if architecture in llama4.ARCHITECTURES else {}


def _no_table(architecture: str, config: Any):
    raise ValueError(f"architecture {architecture!r} has no m2nkit table; {TRACED_HINT}")


def tableless_family(config: Any) -> Family:
    """The :class:`~.table.Family` of an architecture without a table, from transformers.

    ``hf`` holds no renames and no expert fusing (wire names are transformers'
    in-memory names) and the model's persistent buffers; ``params`` is empty
    (no vLLM table); ``sizes`` raises. Cached per config.

    Raises:
        UnsupportedArchitecture: transformers has no class for the
            architecture, or does not know its ``model_type``.
        ValueError: transformers cannot build the model from the config.
    """
    config = transformers_config(config)
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else None
    transformers_class(arch)
    return _family(arch, config.to_json_string(use_diff=False))


def family_or_tableless(config: Any) -> Family:
    """The family table of ``config``'s architecture, or :func:`tableless_family` without one.

    For the callers that need only transformers' side (checkpoint reader,
    FSDP2 source, trainer layouts) of a layout that may be traced.

    Raises:
        UnsupportedArchitecture: no ``architectures``; without a table, one
            transformers has no model class for.
    """
    arch = architecture_name(config)
    if arch is not None and not has_table(arch):
        return tableless_family(config)
    return family_for(config)
