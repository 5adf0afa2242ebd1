"""``config.json`` -> a transformers config, its architecture, and the tensors it expects.

The reference for which tensors a checkpoint must hold is transformers
itself: the config is read with its own config class (``AutoConfig``, or
the class a family names for a ``model_type`` transformers lacks,
``HFNaming.config_classes``), the model is built on the meta device
(``AutoModelForCausalLM.from_config``) and its ``named_parameters()`` (and
persistent buffers) are taken in order, the wire order. Nothing is read
from the Hub (``HF_HUB_OFFLINE``) and no model code is run. An architecture
without a family table is read as transformers builds it
(``m2nkit.adapters.families.tableless``: its model class by name, for
multimodal ``...ForConditionalGeneration`` wrappers too), for layouts traced
from vLLM's loaders; one transformers has no class for is refused, naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..families import (UnsupportedArchitecture, check_architecture, family, has_table,
                        supported_architectures)
from .errors import CheckpointError

__all__ = ["load_config", "peek_config", "supported_list", "check_supported",
           "config_architecture", "Expected", "expected_params"]


def load_config(config_path: Path):
    """``config.json`` read by transformers' config class, locally and without model code.

    Raises:
        CheckpointError: a missing file, a malformed ``architectures``, an
            unsupported architecture (before transformers is imported), a
            ``model_type`` transformers lacks, or transformers' own refusal.
    """
    if not config_path.is_file():
        raise CheckpointError(
            f"{config_path} does not exist: m2nkit needs the model's config.json to "
            "know which tensors the checkpoint must hold"
        )
    data = peek_config(config_path)
    archs = data.get("architectures")
    if archs is not None and (not isinstance(archs, list)
                              or not all(isinstance(a, str) for a in archs)):
        # before transformers, whose own refusal (5.12) does not say what would be valid
        raise CheckpointError(f"{config_path}: 'architectures' must be a list of class names "
                              f"like [\"{supported_architectures()[0]}\"], got {archs!r}")
    # (an architecture without a table is checked against transformers' classes below)
    model_type = data.get("model_type")

    # Nothing may come from the Hub: config.json is always a local file here.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    alias = _config_class(archs, model_type)
    if model_type is not None and model_type not in CONFIG_MAPPING and alias is None:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not built into transformers (it would "
            f"need the model's own Python code, which m2nkit never runs); m2nkit supports "
            f"{supported_list()}")
    try:
        if alias is not None:  # the family reads this model_type with a known config class
            from transformers.utils import logging as hf_logging

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # no "model of type X used as Y" warning: intended
            try:
                return CONFIG_MAPPING[alias].from_pretrained(str(config_path),
                                                             local_files_only=True)
            finally:
                hf_logging.set_verbosity(level)
        from ..families.tableless import builtin_config_class

        cls = builtin_config_class(model_type)
        if cls is not None:
            return cls.from_pretrained(str(config_path), local_files_only=True)
        return AutoConfig.from_pretrained(str(config_path), local_files_only=True,
                                          trust_remote_code=False)
    except Exception as e:
        # transformers' messages can span lines: make them one line.
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise CheckpointError(
            f"transformers cannot read {config_path}"
            + (f" (model_type {model_type!r})" if model_type else "")
            + f": {first}; m2nkit supports {supported_list()}") from e


def _config_class(archs: Any, model_type: Any) -> str | None:
    """The transformers ``model_type`` whose config class reads ``model_type``, when the
    family of ``archs[0]`` says so (``HFNaming.config_classes``) and transformers lacks it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if (not isinstance(archs, list) or not archs or not isinstance(archs[0], str)
            or not has_table(archs[0])
            or not isinstance(model_type, str) or model_type in CONFIG_MAPPING):
        return None
    alias = family(archs[0]).hf.config_classes.get(model_type)
    return alias if alias in CONFIG_MAPPING else None


def peek_config(config_path: Path) -> dict:
    """``config.json`` as a dict, or ``{}`` when it is not JSON (transformers then says why)."""
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def supported_list() -> str:
    """The supported architectures, comma-separated (for messages)."""
    return ", ".join(supported_architectures())


def check_supported(arch: str, config_path: Path) -> None:
    """Refuse an architecture without a family, prefixed with the config path."""
    try:
        check_architecture(arch)
    except UnsupportedArchitecture as e:
        raise CheckpointError(f"{config_path}: {e}") from None


def config_architecture(config, config_path: Path) -> str:
    """``config.architectures[0]`` (or the causal LM of its ``model_type``), checked.

    Raises:
        CheckpointError: malformed or missing ``architectures``, no family,
            or a class this transformers lacks.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{config_path}: 'architectures' must be a list of class names "
                              f"like [\"{supported_architectures()[0]}\"], got {archs!r}")
    arch = archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is not None and not has_table(arch):   # read as transformers builds it
        from ..families.tableless import transformers_class

        try:
            transformers_class(arch)
        except UnsupportedArchitecture as e:
            raise CheckpointError(f"{config_path}: {e}") from None
        return arch
    if arch is None:
        raise CheckpointError(
            f"{config_path}: no 'architectures', and model_type {config.model_type!r} is not "
            f"a causal LM that transformers knows; m2nkit supports {supported_list()}")
    check_supported(arch, config_path)
    if arch not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) and not _wrapper_class(arch):
        raise CheckpointError(
            f"{config_path}: this transformers has no causal LM class {arch!r} "
            f"(transformers too old?)")
    return arch


def _wrapper_class(arch: str):
    """transformers' class of a table architecture that is no causal LM (a multimodal
    ``...ForConditionalGeneration`` wrapper, ``families/wrapper.py``), or ``None``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if arch in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return None
    from ..families.tableless import transformers_class

    try:
        return transformers_class(arch)
    except UnsupportedArchitecture:
        return None


@dataclass(frozen=True)
class Expected:
    name: str  # in-memory name
    shape: tuple[int, ...]
    dtype: torch.dtype
    tied: bool  # a second name of an earlier parameter (tied lm_head)


def expected_params(config, arch: str, config_path: Path) -> list[Expected]:
    """``named_parameters()`` of the model built on the meta device, in order.

    An architecture without a table is built by its own class, in the dtype
    its config names (``m2nkit.adapters.families.tableless.meta_model``).
    """
    from transformers import AutoModelForCausalLM

    try:
        if not has_table(arch):
            from ..families.tableless import meta_model

            model = meta_model(config)
        elif _wrapper_class(arch) is not None:   # a multimodal wrapper: as transformers builds it
            from ..families.tableless import meta_model

            model = meta_model(config)
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise CheckpointError(
            f"transformers cannot build {arch} from {config_path}: {type(e).__name__}: {e}"
        ) from e
    if type(model).__name__ != arch:
        raise CheckpointError(
            f"{config_path}: architectures says {arch} but model_type "
            f"{config.model_type!r} builds {type(model).__name__}"
        )
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        out.append(Expected(name, tuple(p.shape), p.dtype, id(p) in seen))
        seen.add(id(p))
    # Persistent buffers are saved too (a MoE router's score-correction bias, say):
    # each goes right after the last parameter of its module, or at the end.
    names = {e.name for e in out}
    for name, b in model.state_dict(keep_vars=True).items():
        if name in names:
            continue
        module = name.rsplit(".", 1)[0] + "."
        at = max((i + 1 for i, e in enumerate(out) if e.name.startswith(module)), default=len(out))
        out.insert(at, Expected(name, tuple(b.shape), b.dtype, False))
    return out
