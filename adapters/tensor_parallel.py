"""A family's tensor-parallel plan applied to a live transformers model.

The plan is data in the family module (``Family.tp_plan``: module ->
colwise/rowwise, :class:`m2nkit.adapters.families.table.TPPlan`); the dry
run (``m2nkit plan --trainer fsdp2:dp_shard=S,tp=T``) reads the same data to
lay the checkpoint out. This module turns it into torch ``ParallelStyle``s
and calls ``parallelize_module``, so a trainer (the demo, the tests) shards
a model exactly the way the dry run assumes. It knows no family itself.
"""

from __future__ import annotations

from typing import Any

import torch

from .families import family_for
from .families.table import COLWISE

__all__ = ["apply_tp_plan"]


def apply_tp_plan(model: torch.nn.Module, tp_mesh: Any, config: Any = None, *,
                  src_data_rank: int | None = 0) -> dict[str, str]:
    """Parallelize ``model`` over the 1-D ``tp_mesh`` with its family's TP plan.

    Call it on the bare transformers model, before ``fully_shard``. Styles
    (torch ``distributed/tensor/parallel/style.py``): ``colwise`` is
    ``ColwiseParallel()``, ``rowwise`` is ``RowwiseParallel()``; the
    embedding takes replicated token ids (``RowwiseParallel(input_layouts=
    Replicate())``) and the LM head gives full logits
    (``ColwiseParallel(output_layouts=Replicate())``), so the loss needs no
    change (torchtitan's ``parallelize_llama`` without loss parallelism).

    Args:
        model: the transformers model (names as ``named_modules()`` gives them).
        tp_mesh: the tensor-parallel ``DeviceMesh`` (1-D).
        config: its config; default ``model.config``.
        src_data_rank: ``parallelize_module``'s: the rank whose values every
            rank's shard is scattered from; ``None``: each rank cuts its own
            shard from the full values it holds (no communication).

    Returns:
        The modules parallelized: name -> style.

    Raises:
        ValueError: the family has no TP plan, or no module of the model
            matches the plan (a model of another family).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    config = model.config if config is None else config
    fam = family_for(config)
    if fam.tp_plan is None:
        raise ValueError(f"{fam.architecture} has no tensor-parallel plan (Family.tp_plan in "
                         f"{fam.module})")
    styles = {}
    for name, _ in model.named_modules():
        style = fam.tp_plan.style(name, config)
        if style is None:
            continue
        if name in fam.tp_plan.embeddings:
            styles[name] = RowwiseParallel(input_layouts=Replicate())
        elif name == "lm_head":
            styles[name] = ColwiseParallel(output_layouts=Replicate())
        else:
            styles[name] = ColwiseParallel() if style == COLWISE else RowwiseParallel()
    if not styles:
        raise ValueError(f"no module of the model matches the TP plan of {fam.architecture} "
                         f"({fam.module})")
    parallelize_module(model, tp_mesh, styles, src_data_rank=src_data_rank)
    return {n: type(s).__name__ for n, s in styles.items()}

