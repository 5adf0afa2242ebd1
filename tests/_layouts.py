"""Destination layouts the tests build by hand (no model family)."""

from __future__ import annotations

from m2nkit.manifest import Binding, DestinationLayout, DestinationParam


def own_param_destination(name, shape, dtype, boxes_per_worker):
    """Worker ``w`` holds each of its boxes in its own parameter of exactly that shape."""
    params, bindings = [], []
    for w, boxes in enumerate(boxes_per_worker):
        for i, box in enumerate(boxes):
            pname = f"{name}.{i}"
            params.append(DestinationParam(w, pname, dtype, tuple(b - a for a, b in box)))
            bindings.append(Binding(name, w, box, pname, (0,) * len(shape)))
    return DestinationLayout("test", len(boxes_per_worker), tuple(params), {name: tuple(bindings)})
