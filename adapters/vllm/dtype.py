"""The dtype vLLM allocates a model's parameters in: ``--dtype`` and its ``auto`` rule.

vLLM allocates every parameter of the families m2nkit knows in one model
dtype and its weight loaders cast whatever the checkpoint holds on copy, so
the destination's storage dtype is vLLM's choice, not the checkpoint's.
With ``--dtype auto`` (the default) vLLM 0.33.0 decides as follows
(``vllm/config/model.py`` ``_get_and_verify_dtype`` and
``_resolve_auto_dtype``; ``transformers_utils/model_arch_config_convertor.py``
``get_torch_dtype``):

1. The config's dtype: ``config.json``'s ``dtype``/``torch_dtype``, else its
   ``text_config``'s; if neither names one, the dtype every tensor of the
   checkpoint's safetensors files casts to without loss (``utils/torch_utils.py``
   ``common_broadcastable_dtype``: the dtype most others cast to losslessly);
   with no files either, float32.
2. float32 becomes the platform's preferred dtype; a dtype the platform does
   not support (float16 for the model types of :data:`FLOAT16_NOT_SUPPORTED`,
   an integer or fp8 dtype) becomes it too.

m2nkit plans for a platform whose preferred dtype is bfloat16: NVIDIA GPUs
of compute capability 8.0 or newer and x86/aarch64 CPUs
(``current_platform.supported_dtypes[0]``, ``platforms/cuda.py``,
``platforms/cpu.py``); on an older GPU pass ``dtype=float16`` in the spec.
An explicit ``--dtype`` (``vllm:tp=2,dtype=float16``) is taken as given, and
vLLM refuses float16 for the models above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

# What the config names is the checkpoint's dtype, read alike on the trainer side:
# it lives with the family tables; vLLM's rule below only starts from it.
from ..families.sizes import config_dtype

__all__ = ["ModelDtype", "model_dtype", "config_dtype", "PREFERRED_DTYPE"]

#: The platform's preferred dtype m2nkit assumes (see the module docstring).
PREFERRED_DTYPE = torch.bfloat16

#: ``current_platform.supported_dtypes`` of that platform, in vLLM's order.
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)

#: vLLM ``config/model.py`` ``_FLOAT16_NOT_SUPPORTED_MODELS`` (model_type).
FLOAT16_NOT_SUPPORTED = frozenset({"gemma2", "gemma3", "gemma3_text", "glm4"})

_SPEC_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelDtype:
    """vLLM's model dtype and, when it is not simply the config's, why.

    Attributes:
        dtype: the dtype every parameter is allocated in.
        note: one sentence on how it was decided, or ``None`` when it is the
            dtype ``config.json`` names.
    """

    dtype: torch.dtype
    note: str | None = None


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _level(d: torch.dtype) -> int:
    return 0 if d == torch.bool else (2 if d.is_floating_point else 1)


def _lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Can every value of ``src`` be held by ``dst``? (vLLM ``is_lossless_cast``)."""
    if src == dst:
        return True
    if _level(src) != _level(dst):
        return _level(src) < _level(dst)
    if not src.is_floating_point:
        a, b = torch.iinfo(src), torch.iinfo(dst)
        return a.min >= b.min and a.max <= b.max
    a, b = torch.finfo(src), torch.finfo(dst)
    return a.min >= b.min and a.max <= b.max and a.resolution >= b.resolution


def _auto(d: torch.dtype, model_type: str | None) -> torch.dtype:
    """``_resolve_auto_dtype``: float32 and unsupported dtypes become the preferred one."""
    supported = [x for x in _SUPPORTED
                 if not (x == torch.float16 and model_type in FLOAT16_NOT_SUPPORTED)]
    return d if d != torch.float32 and d in supported else PREFERRED_DTYPE


def _name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def model_dtype(config: Any, spec_dtype: str = "auto",
                file_dtypes: Iterable[torch.dtype] = ()) -> ModelDtype:
    """The dtype vLLM 0.33.0 allocates the parameters of ``config`` in.

    Args:
        config: HF config object or ``config.json`` dict.
        spec_dtype: the spec's ``dtype``: ``"auto"``, ``"bfloat16"``,
            ``"float16"`` or ``"float32"``.
        file_dtypes: the dtypes of the checkpoint's tensors (read only when
            the config names no dtype).

    Returns:
        A :class:`ModelDtype`.

    Raises:
        ValueError: ``float16`` for a model type vLLM refuses it for; an
            unknown ``spec_dtype``; a config without a dtype whose tensors
            leave vLLM's choice to set order (float16 and bfloat16, neither
            casting to the other): the message asks for ``dtype=`` in the spec.
    """
    model_type = _get(config, "model_type")
    named = config_dtype(config)
    if spec_dtype != "auto":
        if spec_dtype not in _SPEC_DTYPES:
            raise ValueError(f"dtype={spec_dtype!r} is not one of auto, {', '.join(_SPEC_DTYPES)}")
        d = _SPEC_DTYPES[spec_dtype]
        if d == torch.float16 and model_type in FLOAT16_NOT_SUPPORTED:
            raise ValueError(f"dtype=float16: vLLM refuses float16 for model_type {model_type!r} "
                             "(numerical instability; vllm/config/model.py); use bfloat16 or "
                             "float32")
        was = f"config dtype {_name(named)}" if named else "config.json names no dtype"
        note = None if d == named else f"parameters are {spec_dtype}: dtype={spec_dtype} in the spec ({was})"
        return ModelDtype(d, note)
    rule = "vLLM dtype=auto, vllm/config/model.py _resolve_auto_dtype"
    if named is not None:
        d = _auto(named, model_type)
        note = None if d == named else (
            f"parameters are {_name(d)}: the config's {_name(named)} becomes the platform's "
            f"preferred {_name(PREFERRED_DTYPE)} ({rule}; pass dtype=... in the spec to override)")
        return ModelDtype(d, note)
    seen = sorted(set(file_dtypes), key=str)
    if not seen:
        d = _auto(torch.float32, model_type)
        return ModelDtype(d, f"parameters are {_name(d)}: config.json names no dtype and there "
                             f"are no tensors to read one from, so float32, which becomes the "
                             f"platform's preferred {_name(PREFERRED_DTYPE)} ({rule})")
    counts = {d: sum(_lossless(x, d) for x in seen) for d in seen}
    best = max(counts.values())
    outcomes = {_auto(d, model_type) for d, c in counts.items() if c == best}
    if len(outcomes) > 1:
        raise ValueError(
            f"config.json names no dtype and the checkpoint's tensors are "
            f"{', '.join(map(_name, seen))}: vLLM's dtype=auto would pick one by set order "
            f"(none casts losslessly to the others); give it in the spec, e.g. "
            f"dtype={_name(PREFERRED_DTYPE)}")
    d = outcomes.pop()
    return ModelDtype(d, f"parameters are {_name(d)}: config.json names no dtype, the tensors "
                         f"are {', '.join(map(_name, seen))} ({rule}; get_torch_dtype reads "
                         f"the safetensors headers)")
