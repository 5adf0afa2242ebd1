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


def fused_moe_destination(name, num_workers, experts, intermediate, hidden, param_dtype):
    """vLLM's fused ``w13_weight`` ``[E, I/N, H]`` per worker, bound from a ``[E, 2I, H]``
    ``gate_up_proj`` wire tensor: worker ``w``'s gate rows, then its up rows, per expert
    (``FusedMoE.weight_loader``, vLLM ``model_executor/layers/fused_moe/layer.py``)."""
    half = intermediate // num_workers
    params, bindings = [], []
    for w in range(num_workers):
        params.append(DestinationParam(w, "w13_weight", param_dtype,
                                       (experts, intermediate, hidden)))
        for rows, at in (((w * half, (w + 1) * half), 0),
                         ((intermediate + w * half, intermediate + (w + 1) * half), half)):
            bindings.append(Binding(name, w, ((0, experts), rows, (0, hidden)), "w13_weight",
                                    (0, at, 0)))
    return DestinationLayout("test", num_workers, tuple(params), {name: tuple(bindings)})


def fill_worker(layout, wire, worker):
    """Worker ``worker``'s storage as the layout's bindings fill it from ``wire`` (name ->
    full tensor): NaN first, zero boxes zeroed, each binding's box copied (cast to the
    parameter's dtype). Returns ``(store, count)``, ``count`` how often each element was
    written (every element of a full layout exactly once)."""
    import torch

    store = layout.allocate(worker, fill=float("nan"))
    count = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in store.items()}
    for p in layout.params:                          # vocab padding rows: zeros
        if p.worker == worker:
            for box in p.zero_boxes:
                sl = tuple(slice(a, c) for a, c in box)
                store[p.name][sl] = 0
                count[p.name][sl] += 1
    for name, bindings in layout.bindings.items():
        for b in bindings:
            if b.worker == worker:
                dst = tuple(slice(o, o + (c - a)) for o, (a, c) in zip(b.offset, b.box))
                store[b.param][dst] = wire[name][tuple(slice(a, c) for a, c in b.box)].to(
                    store[b.param].dtype)
                count[b.param][dst] += 1
    return store, count


def megatron_fused_qkv(q, k, v, ng, gate=None):
    """Megatron's full ``linear_qkv`` built from HF's q, k, v ``[rows, H]``: per query
    group ``[q_g; (gate_g;) k_g; v_g]`` (megatron-core ``transformer/attention.py``)."""
    import torch

    parts = [q.view(ng, -1, q.shape[1])]
    if gate is not None:
        parts.append(gate.view(ng, -1, q.shape[1]))
    parts += [k.view(ng, -1, k.shape[1]), v.view(ng, -1, v.shape[1])]
    return torch.cat(parts, dim=1).reshape(-1, q.shape[1])
