"""What the vLLM and SGLang plugins check and do alike around m2nkit's receiver.

Both plugins hand m2nkit's ``M2NReceiver`` the engine's own live model; what
only a live model can tell is checked here, once for both: every parameter
the layout declares for a worker against ``named_parameters()`` (name, local
shape, dtype, ties), before any byte moves. A worker that refuses still
joins the payload's group to say why (:func:`refuse_everywhere`), so every
rank of the session raises its message instead of waiting out a rendezvous.
Neither vLLM nor SGLang is imported here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from m2nkit.engine.control import agree_on_plan, create_group, release_group
from m2nkit.engine.deadline import Deadline
from m2nkit.engine.session import InitPayload

__all__ = ["live_model_problems", "refuse_everywhere", "receive_mode", "buffer_device",
           "MODE_ENV"]

#: Environment variable of the inference server choosing the receive mode.
MODE_ENV = "M2NKIT_RECEIVE_MODE"


def live_model_problems(model: torch.nn.Module, layout: Any, worker: int,
                        params: Mapping[str, torch.Tensor] | None = None, *,
                        undeclared: bool = True, engine: str = "vLLM") -> list[str]:
    """How a live vLLM or SGLang model differs from m2nkit's layout for ``worker`` (empty: it fits).

    Three checks, each naming the parameter:

    * every parameter the layout declares for ``worker`` exists in
      ``model.named_parameters(remove_duplicate=False)`` with the declared
      local shape and dtype (both shapes quoted when not);
    * every live parameter is declared (or is a declared alias): one the
      tables do not know would never be updated;
    * every alias the layout declares (a tied ``lm_head.weight``) is the
      same storage as its target in the live model.

    Args:
        layout: a ``DestinationLayout`` (``params``, ``aliases``).
        params: the parameters to check instead of ``model``'s own: for a
            quantized model, its checkpoint-format ones
            (``vllm_reload.checkpoint_params``: what its loaders fill, meta
            tensors); their aliases' storage is then not compared (the
            reload keeps the live model's).
        undeclared: also list live parameters the layout does not declare
            (the init's check). The per-round check passes ``False``: after
            a round the post-load step registers derived parameters of its
            own (MLA's ``W_UK_T``/``W_UV``, ``replace_parameter`` in
            ``mla_attention.py``), which no round writes.
    """
    live = dict(params) if params is not None else dict(model.named_parameters(remove_duplicate=False))
    mine = {p.name: p for p in layout.params if p.worker == worker}
    out: list[str] = []
    for name, p in mine.items():
        t = live.get(name)
        if t is None:
            out.append(f"parameter '{name}' {list(p.shape)} {_dt(p.dtype)}: m2nkit's table "
                       f"declares it, {engine}'s model has no such parameter")
        elif tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
            out.append(f"parameter '{name}': {engine}'s model holds {list(t.shape)} "
                       f"{_dt(t.dtype)}, "
                       f"m2nkit's table declares {list(p.shape)} {_dt(p.dtype)}")
    aliases = {a: t for a, t in layout.aliases.items() if t in mine}
    for name, t in live.items() if undeclared else ():
        if name not in mine and name not in aliases:
            out.append(f"parameter '{name}' {list(t.shape)} {_dt(t.dtype)} of {engine}'s model is "
                       "not in m2nkit's table: it would never be updated")
    for alias, target in aliases.items():
        a, b = live.get(alias), live.get(target)
        if params is None and a is not None and b is not None and a.data_ptr() != b.data_ptr():
            out.append(f"parameter '{alias}': m2nkit's table ties it to '{target}', but "
                       f"{engine}'s model holds them in separate storage")
    return out


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def refuse_everywhere(payload: InitPayload, worker: int, message: str) -> None:
    """Join ``payload``'s group as ``worker`` only to tell every rank why it refuses.

    Every trainer rank and every other worker then raises ``PlanMismatchError``
    quoting ``message`` (``control.agree_on_plan`` with ``error=``); bounded by
    the payload's ``timeout_s``. Never raises: the caller raises its own refusal.
    """
    rank = payload.rank_offset + worker
    if rank >= payload.world_size:
        return
    deadline = Deadline(payload.timeout_s)
    group = None
    try:
        _, group = create_group(payload.master_address, payload.master_port, rank,
                                payload.world_size, timeout_s=max(deadline.left(), 1.0),
                                backend=payload.backend)
        agree_on_plan(group, rank, payload.world_size, None, error=message, deadline=deadline)
    except Exception:  # noqa: BLE001 - our own message, or nobody came: refuse anyway
        pass
    finally:
        release_group(group)


def receive_mode() -> str:
    """``$M2NKIT_RECEIVE_MODE``: ``in_place`` (default) or ``staged``.

    ``in_place``: slabs land in the live parameters as they arrive, no extra
    memory; for RL loops that pause generation around the update (vLLM's
    ``/pause`` ... ``/resume``, SGLang's ``pause_generation``), which is the usual case. ``staged``: the
    round lands in a copy (the worker's parameter bytes again) committed at
    ``finish_weight_update``, for callers that keep generating during a round;
    a failed round then leaves the served weights untouched.

    Raises:
        ValueError: another value (names the variable and the valid ones).
    """
    mode = os.environ.get(MODE_ENV, "in_place")
    if mode not in ("in_place", "staged"):
        raise ValueError(f"{MODE_ENV}={mode!r} is not 'in_place' or 'staged'")
    return mode


def buffer_device(payload: InitPayload, device: torch.device) -> str:
    """Receive buffers: on the CPU for a gloo group (gloo moves CPU tensors), else ``device``."""
    return "cpu" if payload.backend == "gloo" else str(device)
