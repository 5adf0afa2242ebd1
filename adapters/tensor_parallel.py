"""A family's tensor-parallel plan applied to a live transformers model.

The plan is data in the family module (``Family.tp_plan``: module ->
colwise/rowwise, :class:`m2nkit.adapters.families.table.TPPlan`); the dry
run (``m2nkit plan --trainer fsdp2:dp_shard=S,tp=T``) reads the same data to
lay the checkpoint out. This module turns it into torch ``ParallelStyle``s
and calls ``parallelize_module``, so a trainer (the demo, the tests) shards
a model exactly the way the dry run assumes; :func:`sum_partial_grads` is
the one step such a trainer adds after ``backward()`` (the plan's
``grad_allreduce`` modules). It knows no family itself.
"""

from __future__ import annotations

from typing import Any

import torch

from .families import family_for
from .families.table import COLWISE

__all__ = ["apply_tp_plan", "sum_partial_grads"]


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



def sum_partial_grads(model: torch.nn.Module, tp_mesh: Any, config: Any = None) -> int:
    """Sum the gradients of the plan's ``grad_allreduce`` modules over TP, in place.

    Call it on every rank after ``backward()`` and before the optimizer
    step. Those modules (Qwen3's per-head ``q_norm``/``k_norm``) are whole on
    every TP rank but each rank's forward feeds them only its own heads, so
    each rank holds a partial gradient; without the sum the TP replicas of
    the weight drift apart at the first step (and vLLM would get whichever
    replica the plan reads). Works on plain and FSDP2 (``DTensor``) gradients:
    the TP ranks at one data-parallel coordinate hold the same box of the
    weight, so an elementwise all-reduce over the TP group is the sum.

    Returns:
        The number of gradients summed (0 for a family without such modules).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    config = model.config if config is None else config
    plan = family_for(config).tp_plan
    if plan is None or not plan.grad_allreduce:
        return 0
    group = tp_mesh.get_group()
    count = 0
    for name, p in model.named_parameters():  # same order on every rank
        if p.grad is None or not plan.sums_grads(name.rpartition(".")[0]):
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
        count += 1
    return count
