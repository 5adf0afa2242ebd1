"""Wrapper prefixes in a live module's parameter names, and how to strip them.

A trainer rarely hands over the bare transformers model: ``torch.compile``,
activation checkpointing, FSDP1, DDP and PEFT each wrap a module and put one
more segment into every ``named_parameters()`` name. Hugging Face names (and
so the wire) carry none of them. This module is the one place that knows
those segments; it knows no model family (docs/architecture.md: family knowledge lives
in ``adapters/families``).

Segments removed wherever they occur (each wrapper sits at any depth):

* ``_orig_mod`` — ``torch.compile``'s ``OptimizedModule`` (torch
  ``_dynamo/eval_frame.py``);
* ``_checkpoint_wrapped_module`` — activation checkpointing's
  ``CheckpointWrapper`` (torch ``distributed/algorithms/_checkpoint/
  checkpoint_wrapper.py``, ``_CHECKPOINT_WRAPPED_MODULE``);
* ``_fsdp_wrapped_module`` — FSDP1's ``FlatParameter`` wrapper (torch
  ``distributed/fsdp/_common_utils.py``, ``FSDP_WRAPPED_MODULE``);
* ``base_layer`` — PEFT's tuner layer around the original linear
  (peft ``tuners/tuners_utils.py``, ``BaseTunerLayer.base_layer``).

Prefixes removed at the start only (they wrap the whole model):

* ``module.`` — ``DistributedDataParallel.module``;
* ``base_model.model.`` — PEFT's ``PeftModel.base_model`` (a ``LoraModel``)
  and its ``.model``.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["WRAPPER_SEGMENTS", "LEADING_WRAPPERS", "strip_wrappers", "wrapper_segments",
           "wrapper_hint"]

#: Segment -> the wrapper that adds it (removed at any depth).
WRAPPER_SEGMENTS: dict[str, str] = {
    "_orig_mod": "torch.compile",
    "_checkpoint_wrapped_module": "activation checkpointing (checkpoint_wrapper)",
    "_fsdp_wrapped_module": "FSDP1",
    "base_layer": "PEFT",
}

#: Leading segments -> the wrapper that adds them (removed at the start only).
LEADING_WRAPPERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("module",), "DDP"),
    (("base_model", "model"), "PEFT"),
)


def strip_wrappers(name: str) -> str:
    """``name`` without wrapper segments and leading wrapper prefixes.

    ``module._orig_mod.base_model.model.model.layers.0.mlp.down_proj.base_layer.weight``
    -> ``model.layers.0.mlp.down_proj.weight``. Names without wrappers
    come back unchanged.
    """
    segs = [s for s in name.split(".") if s not in WRAPPER_SEGMENTS]
    changed = True
    while changed:
        changed = False
        for lead, _ in LEADING_WRAPPERS:
            if tuple(segs[:len(lead)]) == lead and len(segs) > len(lead):
                del segs[:len(lead)]
                changed = True
    return ".".join(segs)


def wrapper_segments(name: str) -> list[tuple[str, str]]:
    """``(prefix as written, wrapper)`` for every wrapper ``name`` carries, in order."""
    segs = name.split(".")
    found = []
    i, leading = 0, True  # leading: no segment of the model itself seen yet
    while i < len(segs) - 1:
        if segs[i] in WRAPPER_SEGMENTS:
            found.append((segs[i] + ".", WRAPPER_SEGMENTS[segs[i]]))
            i += 1
            continue
        lead = next(((ls, who) for ls, who in LEADING_WRAPPERS
                     if leading and tuple(segs[i:i + len(ls)]) == ls), None)
        if lead is not None:
            found.append((".".join(lead[0]) + ".", lead[1]))
            i += len(lead[0])
            continue
        leading = False
        i += 1
    return found


def wrapper_hint(names: Iterable[str]) -> str:
    """A sentence pointing at wrapper prefixes in ``names``, or ``""`` when none carries one.

    For messages about names that match nothing: ``'_orig_mod.model.norm.weight'``
    fails because of torch.compile's prefix, not because the tensor is unknown.
    """
    for name in names:
        found = wrapper_segments(name)
        if found:
            prefixes = ", ".join(f"'{p}' ({w})" for p, w in found)
            return (f"the names carry wrapper prefixes: {prefixes}, e.g. '{name}' is "
                    f"'{strip_wrappers(name)}'; save or send the unwrapped model "
                    "(model._orig_mod for torch.compile, model.module for DDP) or strip "
                    "the prefixes")
    return ""
