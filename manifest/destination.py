"""Destination layouts: what each inference worker holds and where bytes land.

The inference side declares, per wire tensor, which box each worker needs
and where that box lands inside a worker-local parameter (a vLLM parameter
name and an element offset per dim). Fused parameters receive several
bindings (q, k and v rows in one ``qkv_proj``); replicated tensors bind the
same box on many workers. Regions no wire tensor fills (vocab padding) are
declared as ``zero_boxes`` so coverage can be proven for every element.

This module knows no model family: adapters (``m2nkit.adapters.vllm``) fill
it from their tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import Box

__all__ = ["DestinationParam", "Binding", "DestinationLayout", "layout_to_json",
           "layout_from_json"]


@dataclass(frozen=True)
class DestinationParam:
    """A worker-local parameter: ``name``, ``dtype`` and local ``shape``.

    ``zero_boxes`` are regions (local coordinates) that no wire tensor fills
    and that must hold zeros (vocab padding rows).
    """

    worker: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    zero_boxes: tuple[Box, ...] = ()


@dataclass(frozen=True)
class Binding:
    """``box`` of wire tensor ``name`` lands in ``param`` of ``worker``.

    The element at ``box`` start lands at ``offset`` (local coordinates
    of the parameter, one int per dim; same tensor rank as the wire tensor).
    """

    name: str
    worker: int
    box: Box
    param: str
    offset: tuple[int, ...]

    @property
    def region(self) -> Box:
        """Where ``box`` lands: a box of ``param``'s local tensor (local coordinates)."""
        return tuple((o, o + hi - lo) for o, (lo, hi) in zip(self.offset, self.box))

    def region_of(self, box: Box) -> Box:
        """Where a sub-box ``box`` of :attr:`box` lands in ``param`` (local coordinates)."""
        return tuple((o + lo - w, o + hi - w)
                     for o, (lo, hi), (w, _) in zip(self.offset, box, self.box))


@dataclass(frozen=True)
class DestinationLayout:
    """Everything the inference side holds, for one model and parallel layout.

    Attributes:
        spec: the parallel spec it was built for (``"vllm:tp=2,dp=1"``).
        num_workers: workers ``0..num_workers-1`` (dp-major: ``dp*tp + tp_rank``).
        params: every worker-local parameter.
        bindings: wire tensor name -> its bindings (any order).
        skipped: wire tensor name -> why the inference side does not take
            it (a tied ``lm_head.weight``); such tensors move no bytes.
        aliases: worker-local name -> the parameter it shares storage with.
        unknown: wire tensor name -> why no inference-side rule takes it (a
            name the family table does not know); such tensors move no
            bytes, and callers decide whether that is an error.
        notes: sentences on how the layout was decided where the spec
            alone does not say (the model dtype vLLM picks; a requested
            expert placement vLLM does not honour). Not part of the digest:
            the params and bindings are.
    """

    spec: str
    num_workers: int
    params: tuple[DestinationParam, ...]
    bindings: dict[str, tuple[Binding, ...]]
    skipped: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def param_index(self) -> dict[tuple[int, str], DestinationParam]:
        """``(worker, name) -> DestinationParam``."""
        return {(p.worker, p.name): p for p in self.params}

    def allocate(self, worker: int, fill: float = 0.0) -> dict[str, torch.Tensor]:
        """Fresh local storage of one worker: ``{name: tensor}`` filled with ``fill``."""
        return {
            p.name: torch.full(p.shape, fill, dtype=p.dtype)
            for p in self.params if p.worker == worker
        }


def layout_to_json(layout: DestinationLayout) -> dict:
    """``layout`` as JSON-able data, for :func:`layout_from_json` (the init payload of a
    traced layout, ``m2nkit.engine.session.InitPayload.destination``).

    Compact: wire and parameter names are listed once and referred to by index;
    dtypes by torch name (``"bfloat16"``); boxes as ``[lo, hi]`` pairs.
    """
    from .serialize import dtype_name

    params = sorted({p.name for p in layout.params}
                    | {b.param for bs in layout.bindings.values() for b in bs})
    index = {n: i for i, n in enumerate(params)}
    return {
        "spec": layout.spec, "num_workers": layout.num_workers, "param_names": params,
        "params": [[p.worker, index[p.name], dtype_name(p.dtype), list(p.shape),
                    [[list(d) for d in z] for z in p.zero_boxes]] for p in layout.params],
        "bindings": {n: [[b.worker, [list(d) for d in b.box], index[b.param], list(b.offset)]
                         for b in bs] for n, bs in layout.bindings.items()},
        "skipped": dict(layout.skipped), "aliases": dict(layout.aliases),
        "unknown": dict(layout.unknown), "notes": list(layout.notes),
    }


def layout_from_json(data: dict) -> DestinationLayout:
    """The :class:`DestinationLayout` :func:`layout_to_json` wrote.

    Raises:
        ValueError: not such data (names the field or entry that is wrong).
    """
    from .serialize import dtype_from_name

    def box(rows, where):
        out = tuple(tuple(int(v) for v in d) for d in rows)
        if any(len(d) != 2 or d[0] > d[1] for d in out):
            raise ValueError(f"destination layout {where}: {rows!r} is not a box of [lo, hi] pairs")
        return out

    try:
        names = list(data["param_names"])
        params = tuple(DestinationParam(int(w), names[i], dtype_from_name(dt),
                                        tuple(int(n) for n in shape),
                                        tuple(box(z, f"zero box of {names[i]!r}") for z in zero))
                       for w, i, dt, shape, zero in data["params"])
        bindings = {str(n): tuple(Binding(str(n), int(w), box(b, f"binding of {n!r}"), names[i],
                                          tuple(int(o) for o in off))
                                  for w, b, i, off in bs)
                    for n, bs in data["bindings"].items()}
        return DestinationLayout(str(data["spec"]), int(data["num_workers"]), params, bindings,
                                 skipped=dict(data.get("skipped", {})),
                                 aliases=dict(data.get("aliases", {})),
                                 unknown=dict(data.get("unknown", {})),
                                 notes=tuple(data.get("notes", ())))
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(f"destination layout data is malformed ({type(e).__name__}: {e}); "
                         "expected what m2nkit.manifest.destination.layout_to_json writes") from None
