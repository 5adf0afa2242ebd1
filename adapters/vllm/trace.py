"""The destination layout traced from vLLM's own weight loaders (needs vLLM installed).

m2nkit's family tables restate vLLM's loaders by hand; this module asks the
loaders themselves. For each worker of an inference spec it builds vLLM's
model class for the served config on the meta device, as that worker would
(stand-in parallel state: sizes and ranks only), and runs the model's real
``load_weights`` over fake checkpoint tensors that carry only a name, a
shape and a dtype. vLLM's own tracing classes record what the loaders do
(``vllm/distributed/weight_transfer/sharded_rdt_fake.py``, vLLM 0.33.0:
``FakeRDTTensor`` appends each view op of ``SUPPORTED_OPS`` to an op chain
and fails on any other op; ``BakeSink.accept_copy`` records every ``copy_``
into a parameter with the destination view's offset, shape and strides).
Each recorded copy becomes an m2nkit ``Binding``: the op chain, replayed on
the wire tensor's global shape, must select a *box* of it in its own axis
order (``narrow``, slices with step 1, integer indices, ``chunk``/``unbind``
with their trailing index, and views that only add or drop unit dims); the
destination view must be a box of the parameter. A chain that is not such a
box (a transpose, a strided slice, a reshape that mixes dims) is refused
with :class:`TraceError`, naming the wire tensor, the parameter and the op:
never a guess. One row permutation is recognized, op for op: vLLM's rotary
reordering of q/k rows (``permute_qk_weight_for_rotary``:
``.view(nh, hd/2, 2, H).transpose(1, 2).reshape(nh*hd, H)``, then boxes of
the result) moves row ``2i+t`` of each head to row ``t*hd/2+i``, so within a
head no two rows adjacent in the wire stay adjacent; it is bound as one
copy per row (:func:`rotary_heads`, :func:`rotary_rows`; about
``(nh + nkv) * hd`` bindings a layer; its cost is measured by
benchmarks/ (docs/families.md)). Any other view/transpose/reshape chain is
still refused (tests/integration/test_traced_misc.py holds the evidence
from vLLM's dumps).

Parameters that some loader wrote only in part keep their unwritten
elements as ``zero_boxes`` (vocab padding: vLLM's ``VocabParallelEmbedding``
loader zero-fills the rows past the vocabulary, a ``fill_`` the fake cannot
see); a parameter no loader wrote at all stays declared and unbound, so the
planner's coverage proof names it. Wire tensors no worker takes are
``skipped`` (a tied ``lm_head.weight``).

Wire names are Hugging Face checkpoint names; the re-fused stacked experts
(``...mlp.experts.gate_up_proj.weight`` ``[E, 2*I, H]``) are handed to vLLM
under the name transformers 5 keeps them by in memory
(``...mlp.experts.gate_up_proj``), which vLLM 0.33.0's fused-MoE loader
takes whole (``layers/fused_moe/routed_experts.py``, ``load_weights``);
where that loader reads them ``[E, in, out]`` (``is_fused_checkpoint_transposed``)
the fake is the wire's transpose, which the loader's own ``transpose(-1, -2)``
undoes (a transpose that is not undone is refused). A model whose own
``load_moe_expert_weights`` transposes every 3-D fused expert tensor is fed
so too, its wire holding them ``[E, out, in]`` under ``.weight`` names (the
family's ``HFNaming.permuted``; under transformers' in-memory names they are
refused), and under EP its index by local expert ids reads as a slice
(:func:`_fake_class`). More generally, a wire tensor that a family table
declares to be an on-disk tensor with its dims permuted (``HFNaming.permuted``:
stacked experts stored ``[E, in, out]`` on disk) is handed over as that on-disk
tensor, under its on-disk name (:func:`permuted_on_disk`): the vLLM 0.33.0 model
loader that reads such experts itself (``_load_weights_other`` in
``model_executor/models/``) narrows ``gate_up_proj [E, H, 2*I]`` on its last dim,
then ``permute(0, 2, 1)``, which undoes the fake's transpose. That loader
``copy_``s into its parameters outside any ``weight_loader``; such a copy is
attributed to the parameter whose storage it writes (:func:`trace_worker`).
Its ``down_proj_bias.zero_()`` on tp ranks other than 0 makes the copy that
follows a zeroed one: a zero box of ``w2_bias`` there, not a binding
(:class:`TracedCopy` ``zero``). A config the family table plans in its
unquantized form (an MXFP4 ``quantization_config``) is traced so too
(:func:`unquantized_form`).
A model loader that takes only per-expert tensors (several MLA models'
``load_weights`` in ``model_executor/models/``, which match expert names
from ``fused_moe_make_expert_params_mapping``) is fed each expert's gate,
up and down boxes under the per-expert names of the family table or, for
an architecture without one, of transformers' own conversion rule
(:func:`experts_on_disk`). For an architecture without a family table
the wire is transformers 5's in-memory model, names and all, and vLLM is
handed the checkpoint names transformers' own renaming rules give them
(:func:`checkpoint_names`; MiniMax-M2's MoE blocks are renamed on load).

At scale, a dp replica's model is worker ``(0, t)``'s re-placed as vLLM's
elastic EP re-places it (:func:`_replace_for_worker`), and under EP each
worker's copies of the stacked experts are worker 0's relabelled by that
worker's own expert map (:class:`_ExpertSlots`), with sample workers traced
in full and held to the derived copies; and decoder layers that the built
meta model shows identical (:func:`_layer_structure`: every submodule's
class and attributes, every parameter's shape, dtype and loader attributes,
modulo the layer index) are traced once, with the last of each group as a
sample, and re-indexed (:func:`_trace_layers`).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import math
import os
import re
import tempfile
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from m2nkit.manifest import Binding, DestinationLayout, DestinationParam, ParamMeta

from ..families.kinds import rotary_source_row

from .spec import InferenceSpec, parse_inference_spec

__all__ = ["TraceError", "TracedCopy", "missing_transformers_class", "missing_class_refusal",
           "Feed", "per_expert_feeds", "trace_worker", "traced_problems", "experts_on_disk",
           "transformers_experts_on_disk", "trace_destination", "chain_box", "chain_text",
           "view_region", "vllm_checkpoint_name", "merge_copies", "checkpoint_names"]

#: Stacked-expert wire names whose vLLM checkpoint name drops ``.weight``.
_STACKED = (".experts.gate_up_proj.weight", ".experts.down_proj.weight")

#: transformers 5's in-memory names of stacked experts (``[E, out, in]``).
_STACKED_IN_MEMORY = (".experts.gate_up_proj", ".experts.down_proj")

_SKIPPED = "vLLM 0.33.0's load_weights writes none of it on any worker (traced)"


class TraceError(ValueError):
    """A loader did something to a wire tensor that is not a box: names tensor, parameter, op."""


def vllm_checkpoint_name(wire_name: str) -> str:
    """The name vLLM's ``load_weights`` is handed for wire tensor ``wire_name``.

    Every wire name is the checkpoint's own, except m2nkit's stacked experts
    (``<layer>.mlp.experts.gate_up_proj.weight``), which vLLM takes under
    transformers 5's in-memory name ``<layer>.mlp.experts.gate_up_proj``.
    """
    if wire_name.endswith(_STACKED):
        return wire_name[: -len(".weight")]
    return wire_name


@dataclass(frozen=True)
class TracedCopy:
    """One ``copy_`` a loader made: ``box`` of wire tensor ``name`` into ``region`` of ``param``.

    ``box`` and ``region`` are half-open ``((lo, hi), ...)`` boxes of the
    wire tensor's global shape and of the parameter's local shape, of equal
    rank and equal extents per dim. ``zero``: the loader zeroed the tensor
    before it copied it (``weight.zero_()``: a ``w2_bias`` on tp ranks other
    than 0, :func:`_fake_class`), so ``region`` ends up zeros,
    not the box: it becomes a zero box of the parameter, never a binding.
    """

    name: str
    param: str
    box: tuple[tuple[int, int], ...]
    region: tuple[tuple[int, int], ...]
    zero: bool = False


# --------------------------------------------------------------------------
# op chains -> boxes
# --------------------------------------------------------------------------

def chain_text(ops: Iterable[tuple]) -> str:
    """A ``FakeRDTTensor`` op chain as the Python it records (``.view(4, 8, 2, 64).t()``)."""
    out = []
    for op, args, kwargs in ops:
        if op == "__getitem__":
            out.append(f"[{', '.join(map(repr, args))}]")
        else:
            out.append(f".{op}(" + ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs)])
                       + ")")
    return "".join(out)


def chain_box(name: str, shape: Sequence[int], ops: Iterable[tuple],
              dims: Sequence[int] | None = None,
              param: str | None = None) -> tuple[tuple, list[int]]:
    """Replay a ``FakeRDTTensor`` op chain on a tensor of ``shape``: the box it selects.

    ``dims[k]``: the wire dim that dim ``k`` of ``shape`` runs along (default
    ``0..rank-1``; a :class:`Feed` handed to vLLM in its on-disk dim order has
    others). Transposes and permutes only relabel dims; the result must run
    along the wire's dims in the wire's order, so a chain that transposes a
    feed given transposed (vLLM's ``_orient_fused_weight``) is a box, and a
    lone transpose of a wire-ordered tensor is not.

    Returns ``(box, kept)``: ``box`` is one ``(lo, hi)`` per dim of
    ``shape``; ``kept[j]`` is the dim of ``shape`` that dim ``j`` of the
    chain's result comes from (``-1`` for a unit dim a view inserted).

    A cast (``to(dtype)``, see :func:`_fake_class`) keeps the box; whether
    it equals the ``copy_`` that follows is the caller's check.

    Raises:
        TraceError: an op that does not keep the result a box of the tensor
            in its axis order (names ``name``, ``param`` when given, the op
            and the whole chain).
    """
    ops = tuple(ops)
    start = [0] * len(shape)
    ext = list(shape)
    cur: list[int] = list(range(len(shape)))    # result dim -> source dim (-1: inserted)
    pending = None                              # a multi-return op awaiting its index
    permuted = None                             # the first op that reordered dims

    def size(j):
        return 1 if cur[j] < 0 else ext[cur[j]]

    def refuse(op, why):
        into = f" into parameter '{param}'" if param else ""
        raise TraceError(f"wire tensor '{name}'{into}: vLLM's loader applies {op} ({why}) in "
                         f"its op chain {chain_text(ops)}; m2nkit carries only loaders that "
                         "take a box of the tensor in its own axis order")

    def norm(d, n):
        return d + n if d < 0 else d

    for op, args, kwargs in ops:
        kw = dict(kwargs)
        if pending is not None:
            kind, dim, chunks = pending
            pending = None
            if op != "__getitem__" or len(args) != 1 or not isinstance(args[0], int):
                refuse(op, f"after {kind}, expected the index of one output")
            i = args[0]
            src = cur[dim]
            if kind == "unbind":
                if src >= 0:
                    start[src] += i
                    ext[src] = 1
                del cur[dim]
            elif src < 0:                   # one chunk of an inserted unit dim: itself
                pass
            else:
                n = ext[src]
                c = -(-n // chunks)
                lo = min(i * c, n)
                start[src] += lo
                ext[src] = min(c, n - lo)
            continue
        if op == "narrow":
            d, s, length = (list(args) + [kw.get("dim"), kw.get("start"), kw.get("length")])[:3]
            d = norm(d, len(cur))
            if cur[d] < 0:
                refuse(op, "narrow of an inserted dim")
            start[cur[d]] += s
            ext[cur[d]] = length
        elif op == "chunk":
            chunks = args[0] if args else kw["chunks"]
            d = norm(args[1] if len(args) > 1 else kw.get("dim", 0), len(cur))
            pending = ("chunk", d, chunks)
        elif op == "unbind":
            d = norm(args[0] if args else kw.get("dim", 0), len(cur))
            pending = ("unbind", d, None)
        elif op == "__getitem__":
            idx = args[0] if isinstance(args[0], tuple) else (args[0],)
            j = 0
            out = []
            for k in idx:
                if k is Ellipsis:
                    rest = len(cur) - j - sum(1 for x in idx if x is not Ellipsis and x is not None)
                    out.extend(cur[j:j + rest])
                    j += rest
                elif k is None:
                    out.append(-1)
                elif isinstance(k, int):
                    src = cur[j]
                    k = norm(k, size(j))
                    if src >= 0:
                        start[src] += k
                        ext[src] = 1
                    j += 1
                elif isinstance(k, slice):
                    n = size(j)
                    a, b, step = k.indices(n)
                    if step != 1:
                        refuse(f"__getitem__ with step {step}", "a strided slice")
                    src = cur[j]
                    if src >= 0:
                        start[src] += a
                        ext[src] = max(b - a, 0)
                    out.append(src)
                    j += 1
                else:
                    refuse(f"__getitem__[{type(k).__name__}]", "advanced indexing")
            out.extend(cur[j:])
            cur = out
        elif op in ("transpose", "t", "permute"):
            if op == "permute":
                perm = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) \
                    else (args or kw["dims"])
                perm = [norm(d, len(cur)) for d in perm]
            else:
                perm = list(range(len(cur)))
                if op == "t" and len(cur) == 2:
                    perm = [1, 0]
                elif op == "transpose":
                    a = norm(args[0] if args else kw["dim0"], len(cur))
                    b = norm(args[1] if len(args) > 1 else kw["dim1"], len(cur))
                    perm[a], perm[b] = perm[b], perm[a]
            if sorted(perm) != list(range(len(cur))):
                refuse(f"{op}{tuple(args)}", "not a permutation of the dims")
            cur = [cur[d] for d in perm]
            permuted = permuted or f"{op}{tuple(args)}"
        elif op in ("view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "to"):
            if op in ("contiguous", "to"):
                continue
            if op in ("view", "reshape"):
                target = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) \
                    else args
                if any(isinstance(t, torch.dtype) for t in target):
                    refuse(op, "a dtype view")
                target = list(target)
                n = math.prod(size(j) for j in range(len(cur)))
                if -1 in target:
                    known = math.prod(t for t in target if t != -1)
                    target[target.index(-1)] = n // known if known else 0
            elif op == "flatten":
                target = [math.prod(size(j) for j in range(len(cur)))] if len(cur) > 1 \
                    else [size(0)] if cur else [1]
                if sum(1 for j in range(len(cur)) if size(j) != 1) > 1:
                    refuse(op, "a flatten of several non-unit dims")
            elif op == "squeeze":
                dims = [norm(d, len(cur)) for d in (args if args else range(len(cur)))]
                if len(args) == 1 and isinstance(args[0], (tuple, list)):
                    dims = [norm(d, len(cur)) for d in args[0]]
                target = [size(j) for j in range(len(cur)) if not (j in dims and size(j) == 1)]
            else:
                d = args[0] if args else kw["dim"]
                d = d + len(cur) + 1 if d < 0 else d
                target = [size(j) for j in range(len(cur))]
                target.insert(d, 1)
            # Only unit dims may come or go: the non-unit sizes stay, in order.
            have = [(j, size(j)) for j in range(len(cur)) if size(j) != 1]
            want = [t for t in target if t != 1]
            if [s for _, s in have] != want:
                refuse(f"{op}{tuple(args)}", "a reshape that mixes dims")
            it = iter(cur[j] for j, _ in have)
            cur = [next(it) if t != 1 else -1 for t in target]
        else:
            refuse(op, "not a slice")
    if pending is not None:
        refuse(pending[0], "its outputs are never indexed")
    dims = list(range(len(shape))) if dims is None else list(dims)
    order = [dims[k] for k in cur if k >= 0 and ext[k] != 1]
    if order != sorted(order):
        if permuted:
            refuse(permuted, "a transpose of the tensor's dims")
        refuse("no transpose", f"the tensor is handed to it with its dims in the order "
               f"{tuple(dims)} of the wire's, which the loader does not undo")
    return tuple((s, s + e) for s, e in zip(start, ext)), cur


def rotary_heads(feed: "Feed", ops: Sequence[tuple]) -> tuple[int, int] | None:
    """``(heads, head_dim)`` when ``ops`` opens with vLLM's rotary reordering of q/k rows.

    vLLM 0.33.0's ``permute_qk_weight_for_rotary`` (``model_executor/models/``;
    which model: ``m2nkit.adapters.families``) hands a 2-D q/k weight
    ``[nh*hd, H]`` on as ``.view(nh, hd/2, 2, H).transpose(1, 2)
    .reshape(nh*hd, H)``. Exactly that chain, on a whole 2-D wire tensor in
    its own dim order, with ``hd`` even: anything else (another view, the
    1-D scale form, a feed that is part of a wire tensor) returns ``None``
    and :func:`chain_box` refuses it as before. What it does to rows is
    :func:`rotary_source_row`.
    """
    if len(ops) < 3 or len(feed.shape) != 2 or feed.dims != (0, 1) or any(feed.offset):
        return None
    (v, vargs, vkw), (t, targs, tkw), (r, rargs, rkw) = ops[:3]
    rows, cols = feed.shape
    if v != "view" or t != "transpose" or r != "reshape" or vkw or tkw or rkw:
        return None
    shape = tuple(vargs[0]) if len(vargs) == 1 and isinstance(vargs[0], (tuple, list)) \
        else tuple(vargs)
    out = tuple(rargs[0]) if len(rargs) == 1 and isinstance(rargs[0], (tuple, list)) \
        else tuple(rargs)
    if (len(shape) != 4 or not all(isinstance(x, int) and x > 0 for x in shape)
            or shape[2] != 2 or shape[3] != cols or shape[0] * shape[1] * 2 != rows
            or tuple(targs) != (1, 2) or out != (rows, cols)):
        return None
    return shape[0], 2 * shape[1]


def rotary_rows(copy: TracedCopy, heads: int, head_dim: int) -> list[TracedCopy]:
    """A copy of rows of the rotary-reordered tensor as one copy per wire row.

    ``copy.box`` is in the reordered tensor's rows (:func:`rotary_heads`);
    each of its rows is one wire row (:func:`rotary_source_row`) landing in
    one row of ``copy.region``. No two rows adjacent in the reordered
    tensor are adjacent in the wire within a head, so no fewer boxes carry
    it; :func:`merge_copies` joins the pairs that are adjacent in both
    (the last row of a head with the first of the next).
    """
    (a, b), cols = copy.box
    (r, _), rcols = copy.region
    return [TracedCopy(copy.name, copy.param,
                       ((w, w + 1), cols), ((r + p - a, r + p - a + 1), rcols), copy.zero)
            for p in range(a, b) for w in (rotary_source_row(p, head_dim),)]


def view_region(param_shape: Sequence[int], offset: int, shape: Sequence[int],
                stride: Sequence[int]) -> tuple[tuple, list[int]]:
    """Which box of a C-contiguous parameter of ``param_shape`` a strided view covers.

    ``offset``, ``shape`` and ``stride`` are the view's (elements). Returns
    ``(region, dims)``: one ``(lo, hi)`` per parameter dim, and for each dim
    of the view the parameter dim it runs along (``-1`` for a unit dim).

    Raises:
        ValueError: the view is not a box of the parameter in its axis order.
    """
    pstride = [math.prod(param_shape[k + 1:]) for k in range(len(param_shape))]
    lo = []
    rem = offset
    for s in pstride:
        q, rem = divmod(rem, s) if s else (0, rem)
        lo.append(q)
    ext = [1] * len(param_shape)
    dims = []
    last = -1
    for n, st in zip(shape, stride):
        if n == 1:
            dims.append(-1)
            continue
        k = next((k for k in range(len(param_shape))
                  if pstride[k] == st and param_shape[k] != 1 and k > last), None)
        if k is None or ext[k] != 1:
            raise ValueError(f"view (offset {offset}, shape {tuple(shape)}, stride "
                             f"{tuple(stride)}) is not a box of a {tuple(param_shape)} tensor")
        ext[k] = n
        dims.append(k)
        last = k
    region = tuple((a, a + e) for a, e in zip(lo, ext))
    if any(b > n for (_, b), n in zip(region, param_shape)):
        raise ValueError(f"view (offset {offset}, shape {tuple(shape)}) runs past a "
                         f"{tuple(param_shape)} tensor")
    return region, dims


def _pair(name: str, param: str, box: tuple, kept: list[int], region: tuple,
          dims: list[int]) -> TracedCopy:
    """Align the source box and the parameter region dim for dim (same rank, same order)."""
    if len(box) != len(region):
        raise TraceError(f"wire tensor '{name}' (rank {len(box)}) lands in parameter '{param}' "
                         f"of rank {len(region)}; m2nkit binds boxes of equal rank only")
    src = [k for k in kept if k >= 0 and box[k][1] - box[k][0] != 1]
    dst = [k for k in dims if k >= 0 and region[k][1] - region[k][0] != 1]
    if src != dst:
        raise TraceError(f"wire tensor '{name}' lands in parameter '{param}' with its dims "
                         f"{src} on the parameter's dims {dst}: a transpose, which m2nkit "
                         "does not bind")
    for k, ((a, b), (c, d)) in enumerate(zip(box, region)):
        if b - a != d - c:
            raise TraceError(f"wire tensor '{name}' box {box} and parameter '{param}' region "
                             f"{region} differ in extent on dim {k}")
    return TracedCopy(name, param, box, region)


# --------------------------------------------------------------------------
# one worker
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Feed:
    """One fake checkpoint tensor handed to ``load_weights``: a box of a wire tensor.

    ``name`` is the checkpoint name vLLM is handed, ``shape`` its shape;
    its element ``i`` is the wire tensor's element at ``offset`` plus ``i``
    placed along ``dims`` (``dims[j]``: the wire dim of dim ``j``; the other
    wire dims are fixed at ``offset``). A whole wire tensor is ``offset`` 0
    and ``dims`` ``0..rank-1``; expert ``e``'s gate part of stacked
    ``[E, 2*Im, H]`` experts is ``[Im, H]`` at ``(e, 0, 0)`` along ``(1, 2)``.
    """

    name: str
    wire: ParamMeta
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    dims: tuple[int, ...]
    #: per-expert feeds: the MoE block (``model.layers.3.mlp``) and the global expert id
    block: str | None = None
    expert: int | None = None

    @classmethod
    def whole(cls, meta: ParamMeta, name: str | None = None) -> "Feed":
        return cls(name or vllm_checkpoint_name(meta.name), meta, tuple(meta.shape),
                   (0,) * len(meta.shape), tuple(range(len(meta.shape))))

    def to_wire(self, box: tuple, kept: list[int]) -> tuple[tuple, list[int]]:
        """A box of this feed (and its result dims) as a box of the wire tensor."""
        out = [(o, o + 1) for o in self.offset]
        for j, (lo, hi) in enumerate(box):
            d = self.dims[j]
            out[d] = (self.offset[d] + lo, self.offset[d] + hi)
        return tuple(out), [self.dims[k] if k >= 0 else -1 for k in kept]


def per_expert_feeds(meta: ParamMeta, patterns: dict[str, str],
                     name: str | None = None) -> list[Feed] | None:
    """Stacked wire experts as the per-expert checkpoint tensors they are fused from.

    ``patterns``: part -> on-disk pattern (``{prefix}``, ``{e}``), the
    family's ``experts_on_disk``. ``None`` when ``meta`` is not a stacked
    expert tensor or a part has no pattern. The stacked weight is named as
    a family table's wire names it (``<block>.experts.gate_up_proj.weight``)
    or as transformers 5 keeps it in memory (``<block>.experts.gate_up_proj``,
    the wire of an architecture without a table); its per-expert parts are
    ``.weight`` tensors either way. ``name``: the wire tensor's checkpoint
    name where it differs from ``meta.name`` (:func:`checkpoint_names`).
    """
    from ..experts import expert_name
    from ..families.table import TRANSFORMERS_FUSED_EXPERTS

    name = name or meta.name
    for leaf, parts in TRANSFORMERS_FUSED_EXPERTS.values():
        stem = leaf.removesuffix(".weight")
        # the weight (with or without ".weight"), or its fp8 block scales
        # (``weight_scale_inv``), stacked alike: wire suffix -> per-expert suffix
        suffix = next(((x, y) for x, y in ((".weight", ".weight"),
                                           (".weight_scale_inv", ".weight_scale_inv"),
                                           ("", ".weight"))
                       if name.endswith("." + stem + x)), None)
        if suffix is None or any(p not in patterns for p in parts) or len(meta.shape) != 3:
            continue
        prefix = name[: len(name) - len("." + stem + suffix[0])]
        E, rows, cols = meta.shape
        R = rows // len(parts)
        return [Feed(expert_name(patterns[part], prefix, e).removesuffix(".weight") + suffix[1],
                     meta, (R, cols), (e, k * R, 0), (1, 2), prefix, e)
                for e in range(E) for k, part in enumerate(parts)]
    return None


#: The op chain of a checkpoint tensor its loader zeroed whole (:func:`_fake_class`).
_ZEROED = (("zero_", (), ()),)


@functools.lru_cache(maxsize=1)
def _fake_class():
    """vLLM's ``FakeRDTTensor`` with the loader idioms it does not record, as what they are.

    vLLM 0.33.0's mamba loaders (``mamba_v2_sharded_weight_loader``,
    ``layers/mamba/mamba_mixer2.py``; the Gated DeltaNet models' ``conv1d``)
    write ``param.data[a:b, ...] = loaded_weight[c:d].view_as(target)``:
    ``view_as`` is not in ``SUPPORTED_OPS`` and the slice assignment is no
    ``copy_``. Here ``view_as(t)`` is recorded as ``view(t.shape)`` (what
    torch defines it to be) and ``dest[idx] = fake`` as ``dest[idx].copy_(fake)``
    (what a basic-index assignment does), so both reach vLLM's own chain and
    sink.

    An index by a CPU tensor of consecutive integer ids (a ``load_moe_expert_weights``
    EP loader picking its experts, :func:`_fused_experts_indexed_by_ids`) is
    recorded as the slice it equals; any other tensor index stays advanced
    indexing, which :func:`chain_box` refuses.

    A cast ``to(dtype)`` (MiniMax-M2's ``MiniMaxM2MoE.ebias_weight_loader``,
    ``models/minimax_m2.py``: ``param.data.copy_(loaded_weight.to(torch.float32))``)
    is recorded as the op ``to`` and gives the child that dtype;
    :func:`trace_worker` accepts it only where it casts to the parameter's
    own dtype, i.e. where it is the cast ``copy_`` makes anyway (and the
    receiver's ``copy_`` makes too). ``to`` with a device, a memory format
    or ``copy=True``, and every other op, still fails in vLLM's
    ``__torch_dispatch__``.

    ``zero_()`` of a whole checkpoint tensor before any view of it was taken
    (vLLM 0.33.0's ``_load_weights_other`` in ``model_executor/models/``:
    ``if tp_rank != 0: weight.zero_()`` on ``down_proj_bias`` before
    ``param.copy_(weight)``, so that only moe rank 0 adds the bias) is what
    it is, in place: the fake's chain opens with the op ``zero_``, and every
    copy from it (or a view of it taken later) writes zeros, which
    :func:`trace_worker` turns into a zeroed :class:`TracedCopy` (a zero box
    of the parameter, not a binding). A ``zero_`` of a view, or of a tensor
    some view was already taken of (whose zeros that view would or would
    not share), is marked on the tensor's root (``_zero_refused``) and every
    copy from that tensor is refused naming the parameter and the op.
    """
    from vllm.distributed.weight_transfer.sharded_rdt_fake import FakeRDTTensor

    class Fake(FakeRDTTensor):
        def _make_child(self, new_shape, new_dtype, *new_ops):
            root = getattr(self, "_root", None)
            root = self if root is None else root       # (no `or`: a tensor has no truth value)
            root._viewed = True
            child = Fake(name=self._name, shape=new_shape, dtype=new_dtype, device=self.device,
                         ops=self._ops + new_ops, sink=self._sink)
            child._root = root
            return child

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.zero_ and len(args) == 1 and isinstance(args[0], cls):
                t = args[0]
                root = getattr(t, "_root", None)
                root = t if root is None else root
                if t is root and t._ops in ((), _ZEROED) and not getattr(t, "_viewed", False):
                    t._ops = _ZEROED
                else:
                    root._zero_refused = (
                        f"zero_() of a view of it ({chain_text(t._ops) or 'the tensor'})"
                        if t is not root else "zero_() after views of it were taken")
                    t._ops = t._ops + _ZEROED
                return t
            if func is torch.Tensor.view_as and args and isinstance(args[0], cls):
                return args[0].view(tuple(args[1].shape))
            if func is torch.Tensor.to and args and isinstance(args[0], cls):
                rest = args[1:] or (kwargs.get("dtype"),)
                if (len(rest) == 1 and isinstance(rest[0], torch.dtype)
                        and set(kwargs) <= {"dtype"}):
                    return args[0]._make_child(args[0].shape, rest[0], ("to", (rest[0],), ()))
            if (func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[0], cls)
                    and isinstance(args[1], torch.Tensor) and not isinstance(args[1], cls)
                    and args[1].device.type == "cpu" and args[1].dim() == 1
                    and not args[1].dtype.is_floating_point and args[1].dtype != torch.bool
                    and len(args[1]) > 0):
                ids = args[1].tolist()
                if ids == list(range(ids[0], ids[0] + len(ids))):
                    return args[0][ids[0]:ids[0] + len(ids)]
            if (func is torch.Tensor.__setitem__ and len(args) == 3
                    and isinstance(args[2], cls) and not isinstance(args[0], cls)):
                dest, index, src = args
                with torch._C.DisableTorchFunctionSubclass():
                    view = dest[index]
                return view.copy_(src)
            return super().__torch_function__(func, types, args, kwargs)

    return Fake


def trace_worker(model: torch.nn.Module, feeds: Sequence[Feed],
                 vllm_config: Any = None) -> tuple[list[TracedCopy], set[str]]:
    """Run ``model.load_weights`` on fake checkpoint tensors; every copy as a :class:`TracedCopy`.

    ``model`` is vLLM's model object of one worker, built on the meta device
    (its parameters are not written). Each parameter's ``weight_loader``
    (vLLM's ``default_weight_loader`` where it has none, as
    ``AutoWeightsLoader`` falls back to) is wrapped for the call so each
    copy is attributed to its parameter, then restored. A ``copy_`` outside
    any ``weight_loader`` into a parameter or a view of one (vLLM 0.33.0's
    ``_load_weights_other`` in ``model_executor/models/``: ``param.copy_(narrow_weight)``
    for its experts and their biases) is attributed to the parameter whose
    storage it writes (vLLM's own ``BakeSink`` drops such a copy); one into
    anything else (a buffer) stays unrecorded, as there.

    A copy from a tensor the loader zeroed first (``weight.zero_()``,
    :func:`_fake_class`) is a :class:`TracedCopy` with ``zero`` set: the
    region ends up zeros, whatever the wire holds.

    Returns:
        ``(copies, touched, copied)``: the copies in wire coordinates; the
        parameters whose loader copied nothing into them (an empty slice:
        a worker whose vocabulary rows are all padding); the feed names some
        loader copied from.

    Raises:
        TraceError: a loader op that is not a box, a broadcasting copy, or a
            loader vLLM cannot run on fake tensors.
    """
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class _Sink(BakeSink):
        def __init__(self):
            super().__init__()
            self.owners: dict[int, str] = {}    # storage -> the parameter it holds

        def accept_copy(self, dest, src):
            if self.current is None:
                try:
                    owner = self.owners.get(dest.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):
                    owner = None
                if owner is not None:
                    self.current = (owner, owner)
                    try:
                        return super().accept_copy(dest, src)
                    finally:
                        self.current = None
            return super().accept_copy(dest, src)

    sink = _Sink()
    params = dict(model.named_parameters())
    for n, p in reversed(params.items()):       # the first name of a shared storage wins
        try:
            sink.owners[p.untyped_storage()._cdata] = n
        except (RuntimeError, NotImplementedError):     # a parameter without a storage
            pass
    saved: list[tuple[torch.nn.Parameter, Any, bool]] = []
    for pname, p in params.items():
        inner = getattr(p, "weight_loader", None)
        had = inner is not None
        inner = inner or default_weight_loader

        @functools.wraps(inner)
        def stamp(*args, _name=pname, _inner=inner, **kwargs):
            sink.current = (_name, _name)
            try:
                return _inner(*args, **kwargs)
            finally:
                sink.current = None

        saved.append((p, getattr(p, "weight_loader", None), had))
        p.weight_loader = stamp
    by_name = {f.name: f for f in feeds}
    fake = _fake_class()
    # vLLM's load_moe_expert_weights (model_executor/models/) under EP moves its local
    # expert ids to the fake's device, reads the first back (.item()) and indexes
    # the fake with them: its stacked experts' fakes say
    # "cpu" (they hold no data on any device), so the ids stay readable.
    ids_on_cpu = _fused_experts_indexed_by_ids(model)
    fakes = [(f.name, fake(f.name, torch.Size(f.shape), f.wire.dtype,
                           torch.device("cpu" if ids_on_cpu and len(f.shape) == 3
                                        and f.name.endswith(_STACKED_IN_MEMORY) else "meta"),
                           sink=sink)) for f in feeds]
    roots = dict(fakes)
    handed: list[str] = []          # the last fake load_weights took (it reads lazily)

    def stream():
        for name, t in fakes:
            handed[:] = [name]
            yield name, t

    try:
        with _config_context(vllm_config), torch.no_grad():
            model.load_weights(stream())
    except NotImplementedError as e:      # vLLM's _UnsupportedFakeOp
        raise TraceError(f"{type(model).__name__}: vLLM's loaders cannot be traced: {e}") \
            from None
    except (RuntimeError, KeyError, AttributeError, ValueError, IndexError) as e:
        # A loader that needs data, or a checkpoint layout the wire does not
        # have (stacked experts read in an on-disk dim order other than the
        # wire's): no trace, never a guess.
        from ..families import has_table

        last = (f" (the last one handed to it: wire tensor '{by_name[handed[0]].wire.name}')"
                if handed else "")
        archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None)
        hint = ("use the family table (--layout tables)" if archs and has_table(archs[0])
                else "m2nkit has no family table for it")
        raise TraceError(f"{type(model).__name__}: vLLM's load_weights failed on the fake "
                         f"wire tensors{last} ({type(e).__name__}: {e}); {hint}") from None
    finally:
        for p, loader, had in saved:
            if had:
                p.weight_loader = loader
            else:
                del p.weight_loader
    out = []
    touched: set[str] = set()
    for pname, copies in sink.copies_by_layer.items():
        pshape = tuple(params[pname].shape)
        for c in copies:
            if math.prod(c.shape) == 0:     # a worker past the vocabulary: no rows
                touched.add(pname)
                continue
            src_name, ops = c.src
            feed = by_name[src_name]
            refused = getattr(roots.get(src_name), "_zero_refused", None)
            zero = ops[:1] == _ZEROED
            if zero:
                ops = ops[1:]
            if refused or any(op == "zero_" for op, _, _ in ops):
                raise TraceError(f"wire tensor '{feed.wire.name}' into parameter '{pname}': "
                                 f"vLLM's loader applies {refused or 'zero_()'} in its op chain "
                                 f"{chain_text(c.src[1])}; m2nkit carries a zero_() only of the "
                                 "whole tensor before any view of it (its copies then leave "
                                 "zeros)")
            rotary = rotary_heads(feed, ops)
            if rotary is not None:
                ops = ops[3:]
            box, kept = feed.to_wire(*chain_box(feed.wire.name, feed.shape, ops, feed.dims,
                                                pname))
            casts = [args[0] for op, args, _ in ops if op == "to"]
            if casts and (len(casts) > 1 or casts[0] != params[pname].dtype):
                raise TraceError(f"wire tensor '{feed.wire.name}' into parameter '{pname}' "
                                 f"({params[pname].dtype}): vLLM's loader casts it "
                                 f"{chain_text(o for o in ops if o[0] == 'to')}, which is not "
                                 "the cast copy_ into the parameter makes; m2nkit binds only "
                                 "casts to the parameter's own dtype")
            try:
                region, dims = view_region(pshape, c.offset, c.shape, c.stride)
            except ValueError as e:
                raise TraceError(f"wire tensor '{feed.wire.name}' into parameter '{pname}': "
                                 f"{e}") from None
            pair = replace(_pair(feed.wire.name, pname, box, kept, region, dims), zero=zero)
            out.extend([pair] if rotary is None else rotary_rows(pair, *rotary))
    return out, touched, set(sink.copied_names)


def _feeds(wire: Sequence[ParamMeta], experts: dict[str, str], fused: bool,
           model: torch.nn.Module | None = None,
           names: dict[str, str] | None = None,
           split: "list[tuple[ParamMeta, list[Feed] | None]] | None" = None,
           only: frozenset[str] | None = None,
           permuted: Mapping[str, tuple[str, tuple[int, ...]]] | None = None) -> list[Feed]:
    """The fake checkpoint tensors of ``wire``: stacked experts whole (``fused``) or per expert.

    Per expert, with ``model``: only the experts vLLM placed on this worker
    (its own ``ExpertMapManager.expert_map`` of the block's MoE layer,
    ``layers/fused_moe/expert_map_manager.py``: global id -> local id, -1
    elsewhere; kept on the CPU for a meta model). The loaders skip the
    others anyway; with 384 experts over 64 workers this hands each worker
    6 of them instead of 384. ``names``: wire name -> checkpoint name where
    they differ (:func:`checkpoint_names`). ``split``: :func:`_split_experts`
    of the same arguments, computed once for every worker of a trace.
    ``only``: the wire tensors to feed (default: all of them). ``permuted``:
    the wire tensors that are on-disk tensors with their dims permuted
    (:func:`permuted_on_disk`), fed as those.
    """
    names = names or {}
    permuted = permuted or {}
    transposed = model is not None and _fused_experts_read_transposed(model)
    if model is not None and _fused_experts_indexed_by_ids(model):
        bad = next((m.name for m in wire if len(m.shape) == 3
                    and m.name.endswith(_STACKED_IN_MEMORY)), None)
        if bad is not None:
            raise TraceError(
                f"{type(model).__name__}: wire tensor '{bad}' is stacked experts under "
                "transformers' in-memory name, stored [E, in, out], which vLLM's loader "
                "transposes into [E, out, in] (load_moe_expert_weights): no box "
                f"carries that; the wire holds them as '{bad}.weight' [E, out, in] "
                "(the family's HFNaming.permuted)")
    if fused:
        return [_whole_feed(m, transposed, names.get(m.name), permuted.get(m.name)) for m in wire
                if only is None or m.name in only]
    local = _local_experts(model) if model is not None else {}
    out = []
    for m, per_expert in (split if split is not None else _split_experts(wire, experts, names)):
        if only is not None and m.name not in only:
            continue
        if per_expert is None:
            out.append(_whole_feed(m, transposed, names.get(m.name), permuted.get(m.name)))
            continue
        here = local.get(per_expert[0].block) if per_expert else None
        if here is None:
            out.extend(per_expert)
        else:       # expert-major: expert e's parts are per_expert[e * parts:(e + 1) * parts]
            parts = len(per_expert) // (per_expert[-1].expert + 1)
            for e in sorted(here):
                out.extend(per_expert[e * parts:(e + 1) * parts])
    return out


def _split_experts(wire: Sequence[ParamMeta], experts: dict[str, str],
                   names: dict[str, str] | None) -> list[tuple[ParamMeta, list[Feed] | None]]:
    """Each wire tensor with its per-expert feeds (:func:`per_expert_feeds`; ``None``: not experts)."""
    names = names or {}
    return [(m, per_expert_feeds(m, experts, names.get(m.name))) for m in wire]


def _local_experts(model: torch.nn.Module) -> dict[str, frozenset[int] | None]:
    """MoE block -> the global expert ids vLLM placed on this worker (``None``: all of them)."""
    out: dict[str, frozenset[int] | None] = {}
    for block, manager in _expert_maps(model).items():
        expert_map = getattr(manager, "expert_map", None)
        if expert_map is None:                      # no EP: every expert is local
            out[block] = None
        else:
            out[block] = frozenset(int(i) for i in torch.nonzero(expert_map.cpu() >= 0).flatten())
    return out


def _fused_experts_read_transposed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s fused-MoE loaders read stacked experts as ``[E, in, out]``.

    vLLM 0.33.0's ``RoutedExperts`` (``layers/fused_moe/routed_experts.py``)
    keeps ``is_fused_checkpoint_transposed``, set by the model classes whose
    published checkpoints store fused experts ``[E, in, out]`` (their decoder
    layers pass ``is_fused_checkpoint_transposed=True``, ``models/``), and its
    ``load_weights`` turns such a tensor to ``[E, out, in]`` with
    ``_orient_fused_weight`` (``transpose(-1, -2)``) before it slices it.
    A model with ``load_moe_expert_weights`` (the only
    ``load_moe_expert_weights`` in ``models/``) transposes every 3-D fused
    expert tensor itself, whatever that flag says: it reads them so too.

    Raises:
        TraceError: some MoE layers of the model read them transposed and
            others not (which wire tensor feeds which layer is not known here).
    """
    if _fused_experts_indexed_by_ids(model):
        return True
    flags = {m.is_fused_checkpoint_transposed for m in model.modules()
             if isinstance(getattr(m, "is_fused_checkpoint_transposed", None), bool)}
    if len(flags) > 1:
        raise TraceError(f"{type(model).__name__}: some of vLLM's MoE layers read fused experts "
                         "[E, in, out] and others [E, out, in]; m2nkit cannot tell which "
                         "stacked wire tensor is which (use the family table: --layout tables)")
    return flags == {True}


def _fused_experts_indexed_by_ids(model: torch.nn.Module) -> bool:
    """Whether ``model``'s loader picks this worker's experts out of a stacked tensor by id.

    vLLM 0.33.0's ``load_moe_expert_weights`` (one model of ``models/``),
    under EP: ``loaded_weight[(expert_map != -1).nonzero().flatten()
    .to(loaded_weight.device)]``, then ``local_expert_indices[0].item()``.
    """
    return any(callable(getattr(m, "load_moe_expert_weights", None)) for m in model.modules())


def _whole_feed(meta: ParamMeta, transposed: bool, name: str | None = None,
                on_disk: tuple[str, tuple[int, ...]] | None = None) -> Feed:
    """A whole wire tensor as the checkpoint tensor vLLM reads.

    Stacked experts (transformers 5's in-memory ``[E, out, in]``,
    ``...experts.gate_up_proj``/``down_proj``) go to a loader that reads
    them ``[E, in, out]`` (``transposed``, :func:`_fused_experts_read_transposed`)
    as such: the fake is the wire's transpose of its last two dims (``dims``
    ``(0, 2, 1)``), the loader's own ``transpose(-1, -2)`` undoes it, and the
    copies it records are boxes of the wire in its own axis order. Handed
    ``[E, out, in]`` under that name, the loader would slice the wrong dims
    (transformers 5.12.1's ``save_pretrained`` writes such experts that way,
    and vLLM reads such a file wrongly or not at all; see
    tests/data/oracle/README.md). ``name``: the wire tensor's checkpoint
    name where it differs from ``meta.name`` (:func:`checkpoint_names`).

    ``on_disk``: ``(on-disk name, order)`` of a wire tensor that is an
    on-disk tensor ``D`` with its dims permuted, ``wire = D.permute(order)``
    (:func:`permuted_on_disk`): the fake is ``D`` itself, under its on-disk
    name, its dim ``j`` running along wire dim ``order.index(j)``. vLLM's
    loaders read checkpoints, so that is the tensor they are written for;
    a loader that permutes it back (``_load_weights_other``:
    ``narrow_weight.permute(0, 2, 1)``) copies boxes of the wire in its own axis order, and one that does
    not is refused by :func:`chain_box`.
    """
    if on_disk is not None:
        disk, order = on_disk
        dims = tuple(order.index(j) for j in range(len(order)))
        return Feed(disk, meta, tuple(meta.shape[d] for d in dims), (0,) * len(dims), dims)
    name = vllm_checkpoint_name(name or meta.name)
    if transposed and len(meta.shape) == 3 and name.endswith(_STACKED_IN_MEMORY):
        experts, rows, cols = meta.shape
        return Feed(name, meta, (experts, cols, rows), (0, 0, 0), (0, 2, 1))
    return Feed.whole(meta, name)


#: model -> its modules that hold an ``expert_map_manager`` (found once per model: a
#: 61-layer model has some 12 k modules; re-placing replaces managers, not modules)
_MANAGED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _expert_maps(model: torch.nn.Module) -> dict[str, Any]:
    """MoE block name -> its vLLM ``ExpertMapManager`` (blocks named by the wire's prefix)."""
    managed = _MANAGED.get(model)
    if managed is None:
        managed = [(name, module) for name, module in model.named_modules()
                   if ".experts" in name and getattr(module, "expert_map_manager", None)
                   is not None]
        _MANAGED[model] = managed
    out = {}
    for name, module in managed:
        manager = getattr(module, "expert_map_manager", None)
        if manager is not None and hasattr(manager, "is_local_expert"):
            out.setdefault(name[: name.index(".experts")], manager)
    return out


def merge_copies(copies: Iterable[TracedCopy]) -> list[TracedCopy]:
    """Coalesce copies that tile one box: the fewest bindings for the same bytes.

    Loaders copy per expert and per shard (gate rows, then up rows); two
    copies of one wire tensor into one parameter merge when their boxes
    touch along one dim and their regions touch the same way, all other
    dims equal. Repeated to a fixed point, so a worker's whole experts
    ``[E/ep, 2*Im, H]`` become one binding, as the family tables declare it.
    Zeroed copies (``TracedCopy.zero``) merge only with zeroed ones.
    """
    groups: dict[tuple[str, str, bool], list[TracedCopy]] = {}
    for c in copies:
        groups.setdefault((c.name, c.param, c.zero), []).append(c)
    out = []
    for items in groups.values():
        changed = True
        while changed and len(items) > 1:
            changed = False
            for k in range(len(items[0].box)):
                items.sort(key=lambda c: tuple(c.box[j] for j in range(len(c.box)) if j != k)
                           + (c.box[k],))
                merged = [items[0]]
                for c in items[1:]:
                    m = merged[-1]
                    same = all(m.box[j] == c.box[j] and m.region[j] == c.region[j]
                               for j in range(len(c.box)) if j != k)
                    if same and m.box[k][1] == c.box[k][0] and m.region[k][1] == c.region[k][0]:
                        merged[-1] = TracedCopy(
                            m.name, m.param,
                            m.box[:k] + ((m.box[k][0], c.box[k][1]),) + m.box[k + 1:],
                            m.region[:k] + ((m.region[k][0], c.region[k][1]),) + m.region[k + 1:],
                            m.zero)
                        changed = True
                    else:
                        merged.append(c)
                items = merged
        out.extend(items)
    return out


def _config_context(vllm_config):
    if vllm_config is None:
        return contextlib.nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def _tile(shape: tuple[int, ...], regions: list[tuple]) -> bool:
    """Whether ``regions`` (boxes inside ``shape``) are pairwise disjoint and fill it."""
    if sum(math.prod(b - a for a, b in r) for r in regions) != math.prod(shape):
        return False
    return not any(all(a < d and c < b for (a, b), (c, d) in zip(r, q))
                   for i, r in enumerate(regions) for q in regions[i + 1:])


def _uncovered(shape: tuple[int, ...], regions: list[tuple]) -> tuple[tuple, ...]:
    """Boxes of a ``shape`` tensor no region covers (a cell grid at every region edge)."""
    import itertools

    if not regions:
        return (tuple((0, n) for n in shape),)
    whole = tuple((0, n) for n in shape)
    if whole in regions:            # the common case: one copy fills the parameter
        return ()
    if len(regions) <= 16 and _tile(shape, regions):     # a few (fused q/kv, gate/up)
        return ()
    cuts = [sorted({0, n, *(r[k][0] for r in regions), *(r[k][1] for r in regions)})
            for k, n in enumerate(shape)]
    out = []
    for cell in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        if not any(all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(cell, r))
                   for r in regions):
            out.append(cell)
    return tuple(out)


def checkpoint_names(config: Any, wire: Iterable[str]) -> dict[str, str]:
    """Wire name -> checkpoint name for an architecture without a family table (the renamed ones).

    Such a wire is transformers 5's in-memory model (``named_parameters()``
    and persistent buffers), and transformers renames some checkpoint keys
    as it loads (``conversion_mapping.py``: MiniMax-M2's MoE blocks, say),
    while vLLM's loaders
    read checkpoint names. Each wire name gets transformers' own
    ``WeightRenaming`` rules reverted, as ``save_pretrained`` does
    (``core_model_loading.revert_weight_conversion``, its second phase;
    ``PrefixChange`` dropped as there for a model built from a config). Its
    ``WeightConverter`` rules are not: a fused in-memory tensor keeps its
    fused leaf under the renamed block (per-expert names:
    :func:`experts_on_disk`). The rules are the architecture class's (by
    name, then ``model_type``) as ``get_model_conversion_mapping`` collects
    them; where a sub-config (a wrapper's ``text_config``) has rules of its
    own they are scoped to its module, so the class is built on the meta
    device for its module tree (nothing is allocated).

    ``config``: a checkpoint directory, a ``config.json`` dict or a
    transformers config. ``{}`` for an architecture with a family table
    (its wire names are checkpoint names), for a class transformers does
    not have, and where no rule renames anything.
    """
    import json

    import transformers
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 get_model_conversion_mapping)
    from transformers.core_model_loading import PrefixChange, WeightConverter, rename_source_key

    from ..families import architecture_name, has_table

    if isinstance(config, (str, os.PathLike)):
        config = json.loads(Path(config, "config.json").read_text())
    arch = architecture_name(config) or ""
    cls = getattr(transformers, arch, None)
    if has_table(arch) or cls is None:
        return {}
    if isinstance(config, dict):
        from ..families.tableless import transformers_config

        config = transformers_config(config)
    subs = [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
    if any(get_checkpoint_conversion_mapping(c.model_type) for c in subs if c is not None):
        with torch.device("meta"):
            rules = get_model_conversion_mapping(cls(config), add_legacy=False)
    else:
        # the root's own rules, unscoped; no build (vLLM's Transformers backend
        # decorates the classes it serves, which then build only inside a vLLM config)
        rules = (get_checkpoint_conversion_mapping(arch)
                 or get_checkpoint_conversion_mapping(config.model_type) or [])
    renamings = [t.reverse_transform() for t in rules[::-1]
                 if not isinstance(t, (WeightConverter, PrefixChange))]
    out = {}
    for name in wire:
        renamed, _ = rename_source_key(name, renamings, [])
        if renamed != name:
            out[name] = renamed
    return out


def experts_on_disk(config: Any) -> dict[str, str]:
    """The per-expert on-disk patterns of ``config``'s stacked experts (``{}``: none known).

    From the family table where m2nkit has one; otherwise from transformers'
    own conversion rules (:func:`transformers_experts_on_disk`), so a
    tableless MoE whose vLLM loader takes only per-expert checkpoint
    tensors still traces. ``config``: a transformers config, a
    ``config.json`` dict, or a checkpoint directory.
    """
    import json

    from ..families import UnsupportedArchitecture, family_for

    if isinstance(config, (str, os.PathLike)):
        config = json.loads(Path(config, "config.json").read_text())
    try:
        return dict(family_for(config).hf.experts_on_disk)
    except UnsupportedArchitecture:
        return transformers_experts_on_disk(config)


def permuted_on_disk(config: Any, wire: Iterable[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Wire name -> ``(on-disk name, order)`` of the wire tensors that are permuted on-disk ones.

    A family table's ``HFNaming.permuted`` declares on-disk tensors the wire
    carries in another dim order (``wire = disk.permute(order)``: stacked
    experts ``[E, H, 2*I]`` on disk, ``[E, 2*I, H]`` on the wire), the rule
    the checkpoint reader reads such a wire tensor from disk by
    (``m2nkit.adapters.hf_checkpoint.match.permuted_wire``).
    vLLM's loaders are written for the on-disk tensor, so that is what the
    trace hands them (:func:`_whole_feed`). ``{}`` for an architecture
    without a table (its wire is transformers' in-memory model) or a table
    without such tensors. ``config``: a transformers config, a
    ``config.json`` dict, or a checkpoint directory.
    """
    import json

    from ..families import UnsupportedArchitecture, family_for
    from ..hf_checkpoint.match import permuted_wire

    if isinstance(config, (str, os.PathLike)):
        config = json.loads(Path(config, "config.json").read_text())
    try:
        hf = family_for(config).hf
    except UnsupportedArchitecture:
        return {}
    if not hf.permuted:
        return {}
    out = {}
    for name in wire:
        found = permuted_wire(hf, name)
        if found is not None:
            out[name] = found
    return out


def unquantized_form(config: Mapping[str, Any],
                     wire: Sequence[ParamMeta]) -> tuple[dict, tuple[str, ...]] | None:
    """``(config without quantization_config, notes)`` where the family table plans it unquantized.

    A model published MXFP4 (``quantization_config: {quant_method:
    mxfp4}``) is one for which vLLM 0.33.0 builds MXFP4 expert parameters whose
    padding and swizzle depend on the GPU's MoE kernel (it does not even
    build them on a CPU: ``layers/fused_moe/oracle/mxfp4.py``). m2nkit's
    table plans such a config in its bf16 form, for a vLLM serving the bf16
    checkpoint of the model, and says so in the plan's notes
    (its family module's ``MXFP4_NOTE``). The trace does the same, so
    that a traced plan and a table plan of one config describe one served
    model: vLLM's model is built for the config without its
    ``quantization_config``, and the layout carries the family's notes.

    Taken only where all of these hold: the config has a
    ``quantization_config``; its architecture has a family table that
    accepts the config (``Family.sizes``), whose wire for it holds no
    quantized tensor (``families.quant.QuantizedWires`` is empty: an fp8
    block config's table wire holds fp8 weights and their scales, and stays
    quantized), and that says how it reads the config (``Family.notes`` is
    not empty); and the wire handed to the trace is unquantized (floating
    point, 16 bits or more). Otherwise ``None``: vLLM builds the config as
    it is, and :func:`_check_quantized_wire` refuses a quantized build fed an
    unquantized wire.
    """
    if not isinstance(config, Mapping) or not config.get("quantization_config"):
        return None
    if any(m.dtype.itemsize < 2 or not m.dtype.is_floating_point for m in wire):
        return None
    from ..families import UnsupportedArchitecture, family_for
    from ..families.quant import QuantizedWires

    try:
        family = family_for(config)
        family.sizes(config)
        if QuantizedWires(family, config):
            return None
    except (UnsupportedArchitecture, ValueError):
        return None
    notes = tuple(family.notes(config)) if family.notes is not None else ()
    if not notes:
        return None
    return {k: v for k, v in config.items() if k != "quantization_config"}, notes


def transformers_experts_on_disk(config: Any) -> dict[str, str]:
    """Per-expert on-disk patterns read off transformers' own conversion rules for ``config``.

    transformers 5 fuses per-expert checkpoint tensors into stacked ones as
    it loads, and splits them again as it saves, by the ``WeightConverter``
    rules of its ``conversion_mapping.py`` (``get_checkpoint_conversion_mapping``
    of the config's ``model_type``, or its ``text_config``'s). The one rule
    the stacked wire tensors of :data:`TRANSFORMERS_FUSED_EXPERTS` mean is
    taken: sources ``<block>.experts.*.<gate leaf>`` and ``.*.<up leaf>``,
    ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``, into
    ``<block>.experts.gate_up_proj`` (expert ``e``'s gate rows, then its up
    rows), and ``.*.<down leaf>`` by ``MergeModulelist(dim=0)`` alone into
    ``<block>.experts.down_proj``. Returns part -> pattern in the family
    tables' form (``{"gate": "{prefix}.experts.{e}.<gate leaf>", ...}``;
    ``{prefix}`` is the in-memory MoE block, as the wire names it); ``{}``
    where transformers has no such rule (experts kept stacked on disk, or
    fused another way: a transpose): no pattern is ever guessed.
    """
    from ..families.table import TRANSFORMERS_FUSED_EXPERTS

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return {}

    def field(c, key):
        return c.get(key) if isinstance(c, dict) else getattr(c, key, None)

    text = field(config, "text_config")
    model_types = [t for t in (field(config, "model_type"),
                               field(text, "model_type") if text else None) if t]
    #: the operations of the rule for a leaf of one part (down) or two (gate, up)
    merge = {1: [("MergeModulelist", 0)], 2: [("MergeModulelist", 0), ("Concatenate", 1)]}
    out: dict[str, str] = {}
    for model_type in model_types:
        for rule in get_checkpoint_conversion_mapping(model_type) or ():
            targets = [t.lstrip(".") for t in getattr(rule, "target_patterns", ())]
            sources = [src.lstrip(".") for src in getattr(rule, "source_patterns", ())]
            ops = [(type(o).__name__, getattr(o, "dim", None))
                   for o in getattr(rule, "operations", ())]
            for leaf, (_, parts) in TRANSFORMERS_FUSED_EXPERTS.items():
                if len(targets) != 1 or not (targets[0] == leaf or targets[0].endswith("." + leaf)):
                    continue
                block = targets[0][: -len(leaf)]                 # "mlp." or ""
                if (len(sources) == len(parts) and ops == merge[len(parts)]
                        and all(src.startswith(block + "experts.*.") for src in sources)):
                    for part, src in zip(parts, sources):
                        out.setdefault(part, "{prefix}.experts.{e}."
                                       + src[len(block + "experts.*."):])
    every = [p for _, parts in TRANSFORMERS_FUSED_EXPERTS.values() for p in parts]
    return out if all(p in out for p in every) else {}


def _build_meta_model(config_dir: str, spec: InferenceSpec, worker: int):
    """vLLM's model object of ``worker`` on the meta device, with its ``VllmConfig``.

    Built under the stand-ins of ``stand_in.py``: the parallel groups, and for
    sparse-attention (DSA) models on a CPU the GPU's sparse attention backend
    and an empty workspace (``gpu_sparse_attention``; neither owns a parameter),
    and the platform's current device answered as meta (``meta_current_device``:
    Kimi-K2.5 moves its vision tower there).

    Raises:
        TraceError: vLLM could not build the model here (names the
            architecture, the worker and vLLM's own error: a config class
            this transformers lacks, a layer that wants a GPU).
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    from .stand_in import gpu_sparse_attention, meta_current_device, worker_config  # stand-ins

    if current_platform.is_unspecified():
        raise TraceError("vLLM found no platform in this process (no GPU, and vLLM was "
                         "imported before VLLM_TARGET_DEVICE=cpu was set): set "
                         "VLLM_TARGET_DEVICE=cpu before vLLM is first imported")
    try:
        vllm_config = worker_config(config_dir, spec, worker)
        model_config = vllm_config.model_config
        with set_current_vllm_config(vllm_config), _no_fp8_kernel_choice(), \
                _no_reload_record(), gpu_sparse_attention(), meta_current_device():
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = initialize_model(vllm_config=vllm_config)
    except TraceError:
        raise
    except Exception as e:      # vLLM cannot build it here: a refusal, not a traceback
        import json

        try:
            archs = json.loads(Path(config_dir, "config.json").read_text()).get("architectures")
        except (OSError, ValueError):
            archs = None
        what = archs[0] if archs else "the model"
        lacking = missing_transformers_class(e)
        why = (f": {missing_class_refusal(lacking, archs[0] if archs else None)}" if lacking
               else f" ({type(e).__name__}: {one_line_reason(e)}); no layout can be traced here")
        raise TraceError(f"{what}: vLLM could not build its model for worker {worker} of "
                         f"{spec} on the meta device{why}") from None
    return model, vllm_config


def one_line_reason(e: BaseException) -> str:
    """``e``'s message on one line: a pydantic ``ValidationError`` (how vLLM's
    ``VllmConfig`` refuses a configuration, ``vllm/config/vllm.py``) as its errors'
    messages alone, anything else with its whitespace collapsed."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            msgs = [str(x.get("msg", "")).removeprefix("Value error, ") for x in errors()]
        except Exception:       # not pydantic's errors(): the message as it is
            msgs = []
        if msgs and all(msgs):
            return "; ".join(msgs)
    return " ".join(str(e).split())


#: How an import of a name transformers does not have reads: vLLM's lazy config
#: registry (``transformers_utils/configs/__init__.py`` ``__getattr__``, a
#: ``getattr(transformers, name)``) and a model module's ``from transformers import``.
_NO_TRANSFORMERS_NAME = re.compile(r"module '?transformers'? has no attribute '?(\w+)'?"
                                   r"|cannot import name '(\w+)' from 'transformers'")


def missing_transformers_class(error: BaseException) -> str | None:
    """The transformers class ``error`` says is missing, when this transformers indeed lacks it.

    vLLM 0.33.0 imports some configs and model classes from transformers
    itself (Kimi-K2.5: ``models/kimi_k25.py`` imports ``Kimi_K25Config``,
    which vLLM's config registry maps ``kimi_k25`` to,
    ``transformers_utils/config.py`` ``_CONFIG_REGISTRY``); an older
    transformers fails the build with an ``AttributeError`` or
    ``ImportError`` naming it. ``None`` for any other error.
    """
    m = _NO_TRANSFORMERS_NAME.search(str(error))
    if m is None or not isinstance(error, (AttributeError, ImportError)):
        return None
    import transformers

    name = m.group(1) or m.group(2)
    return None if hasattr(transformers, name) else name


def missing_class_refusal(name: str, architecture: str | None = None) -> str:
    """Why no layout traces here when vLLM needs transformers' ``name``, and what would work.

    Names this transformers' version, the range vLLM's own metadata declares
    (``importlib.metadata.requires("vllm")``, read at run time), where a
    newer transformers lives in this repository (``.venv-tf``, made by
    ``scripts/side_transformers.sh``) and, for an ``architecture`` with a
    family table, ``--layout tables``.
    """
    from importlib import metadata

    import transformers

    from ..families import has_table

    try:
        wanted = next((r.replace(" ", "") for r in metadata.requires("vllm") or ()
                       if re.match(r"transformers\b", r) and "extra ==" not in r), None)
        vllm = f"vLLM {metadata.version('vllm')}"
    except metadata.PackageNotFoundError:
        wanted, vllm = None, "vLLM"
    asks = f" ({vllm} declares {wanted})" if wanted else ""
    table = (", or use the family table (--layout tables)"
             if architecture and has_table(architecture) else "")
    return (f"transformers {transformers.__version__} has no {name}, which {vllm}'s model "
            f"class imports{asks}; trace it under a transformers that has {name} (this "
            f"repository's .venv-tf, made by scripts/side_transformers.sh){table}")


#: Module attributes that would hold a rank cached at build time outside the
#: MoE layers' own config (some vLLM 0.33.0 model classes in ``models/`` keep
#: ``self.ep_rank = get_ep_group().rank_in_group``); a model holding one is
#: built afresh for every worker instead of re-placed (:func:`_replace_for_worker`).
_CACHED_RANKS = ("ep_rank", "dp_rank", "dp_index")

#: Re-place dp replicas' models (:func:`_replace_for_worker`) instead of building
#: each worker's; ``False`` builds every worker (tests compare the two).
REPLACE_REPLICAS = True


def _replace_for_worker(model: torch.nn.Module, vllm_config: Any, spec: InferenceSpec,
                        worker: int, layers: Sequence[torch.nn.Module]) -> bool:
    """Turn the meta model of worker ``(0, t)`` into worker ``(d, t)``'s, as vLLM's elastic EP does.

    Workers of one tensor-parallel rank in different dp replicas build the
    same modules; only the MoE layers read the dp rank, through their
    ``FusedMoEParallelConfig`` (``layers/fused_moe/config.py``, ``make``:
    the flattened expert TP rank, or the EP rank, and the expert map made
    from it). vLLM 0.33.0 changes exactly that at run time when it scales
    expert parallelism (``distributed/elastic_ep/elastic_execute.py``:
    ``FusedMoEParallelConfig.make`` under the new groups, ``_set_moe_config``,
    then ``update_expert_map``); the same steps here, under ``worker``'s
    stand-in groups, re-place the experts of an already built model, so a
    dp-replicated trace builds ``tp`` models, not ``dp * tp`` (Kimi-K2 at
    ``tp=8,dp=8,ep``: 8 builds of 61 layers instead of 64). The loaders then
    run on the re-placed model as on a fresh one.

    Returns ``False``, leaving the model untouched, where the steps would not
    give a fresh build's model: experts that do not split evenly (the local
    expert count, hence the parameter shapes, differs by rank), a parallel
    size that would change, or a module caching a rank of its own
    (:data:`_CACHED_RANKS`); the caller then builds the worker's model.
    ``layers``: the model's MoE layers (:func:`_moe_layers`).
    """
    from dataclasses import replace

    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    from .stand_in import StandInGroups

    if not REPLACE_REPLICAS:
        return False
    StandInGroups(spec.tp, spec.tp_rank(worker), spec.dp, spec.dp_index(worker),
                  spec.ep).install()
    configs = []
    sizes = ("tp_size", "pcp_size", "dp_size", "ep_size", "sp_size", "use_ep")
    for m in layers:
        old = m.moe_config.moe_parallel_config
        flat = old.ep_size if old.use_ep else old.tp_size
        new = FusedMoEParallelConfig.make(
            tp_size_=flat // (old.dp_size * old.pcp_size), pcp_size_=old.pcp_size,
            dp_size_=old.dp_size, sp_size_=old.sp_size,
            vllm_parallel_config=vllm_config.parallel_config)
        if (any(getattr(new, k) != getattr(old, k) for k in sizes)
                or (new.use_ep and m.moe_config.num_experts % new.ep_size)):
            return False
        configs.append((m, replace(m.moe_config, moe_parallel_config=new)))
    def local_count(m):
        return getattr(getattr(m, "routed_experts", m), "local_num_experts", None)

    for m, moe_config in configs:
        local = local_count(m)
        m._set_moe_config(moe_config)
        if moe_config.moe_parallel_config.use_ep:     # without EP there is no expert map
            m.update_expert_map()
        now = local_count(m)
        if now != local:
            raise TraceError(f"{type(model).__name__}: re-placing the experts of "
                             f"{type(m).__name__} for worker {worker} changed its local "
                             f"expert count ({local} -> {now})")
    return True


@contextlib.contextmanager
def _no_reload_record():
    """Build without recording each layer's metadata for a later weight reload.

    vLLM 0.33.0's ``initialize_model`` (``model_loader/utils.py``) ends with
    ``record_metadata_for_reloading(model)`` (``model_loader/reload/layerwise.py``):
    a meta copy of every parameter of every module, kept for
    ``initialize_layerwise_reload`` (torchao's reload of high-precision
    weights, the dummy loader). A trace never reloads, and the copy is about
    a fifth of each meta build of a 61-layer model; the module attribute is
    restored on exit.
    """
    try:
        import vllm.model_executor.model_loader.utils as utils
    except ImportError:
        yield
        return
    original = getattr(utils, "record_metadata_for_reloading", None)
    if original is None:
        yield
        return
    utils.record_metadata_for_reloading = lambda model: None
    try:
        yield
    finally:
        utils.record_metadata_for_reloading = original


@contextlib.contextmanager
def _no_fp8_kernel_choice():
    """Build fp8 layers without choosing their matmul kernel (the trace never multiplies).

    vLLM 0.33.0's ``Fp8LinearMethod.create_weights``
    (``layers/quantization/fp8.py``) asks ``init_fp8_linear_kernel`` for a
    kernel after it made the parameters and their loaders; on a CPU without
    AMX tiles every candidate declines and it raises. The answer decides
    only how a forward pass multiplies, so for the meta build it is ``None``;
    the module attribute is restored on exit.
    """
    try:
        import vllm.model_executor.layers.quantization.fp8 as fp8
    except ImportError:
        yield
        return
    original = fp8.init_fp8_linear_kernel
    fp8.init_fp8_linear_kernel = lambda **kwargs: None
    try:
        yield
    finally:
        fp8.init_fp8_linear_kernel = original


def _check_quantized_wire(vllm_config: Any, wire: Sequence[ParamMeta]) -> None:
    """Refuse a quantized served model fed an unquantized wire: the layouts cannot meet.

    vLLM builds the parameters the config's ``quantization_config`` asks for
    (fp8 weights and ``weight_scale_inv`` blocks); a wire of only floating
    point tensors of 16 bits or more (transformers' unquantized model of a
    config-only plan) has no tensor for the scales, and would bind as bytes
    of another dtype.

    Raises:
        TraceError: names the quantization and what would work.
    """
    quant = getattr(vllm_config.model_config, "quantization", None)
    if quant is None:
        return
    if any(m.dtype.itemsize < 2 or not m.dtype.is_floating_point for m in wire):
        return      # the wire carries the quantized tensors (a checkpoint read from disk)
    raise TraceError(f"vLLM serves this config quantized ({quant}, its quantization_config) "
                     f"while the wire tensors are unquantized ({wire[0].dtype} and wider): give "
                     "the quantized checkpoint itself, or a config without quantization_config "
                     "to plan the unquantized model")


@dataclass(frozen=True)
class _Replica:
    """What worker ``(0, t)``'s trace leaves for its dp replicas ``(d, t)``.

    Under :func:`_replace_for_worker`'s premise (only the MoE layers read the
    dp rank) every copy into a parameter outside the MoE layers is the same
    on ``(d, t)`` as on ``(0, t)``; the copies into the MoE layers' parameters
    are traced again on the re-placed model, from the wire tensors that
    reached them on ``(0, t)`` (``moe_wires``). ``tests/integration/test_vllm_trace.py``
    compares the result with fresh builds of every worker.
    """

    moe: tuple[str, ...]          # prefixes ("model.layers.3.mlp.experts.") of the MoE layers
    copies: tuple                 # (0, t)'s copies outside them (merge_copies'd)
    touched: frozenset[str]       # (0, t)'s empty-slice parameters outside them
    moe_wires: frozenset[str]     # wire tensors (0, t)'s loaders copied into them
    layers: tuple                 # the MoE layer modules
    movable: bool                 # no module caches a rank of its own (_CACHED_RANKS)

    @classmethod
    def of(cls, model: torch.nn.Module, copies: Sequence[TracedCopy],
           touched: set[str]) -> "_Replica":
        from vllm.utils import is_moe_layer

        named = [(n, m) for n, m in model.named_modules() if n and is_moe_layer(m)]
        moe = tuple(f"{n}." for n, _ in named)
        movable = not any(isinstance(getattr(m, k, None), int)
                          for m in model.modules() for k in _CACHED_RANKS)

        def inside(p):
            return p.startswith(moe)
        return cls(moe, tuple(merge_copies([c for c in copies if not inside(c.param)])),
                   frozenset(p for p in touched if not inside(p)),
                   frozenset(c.name for c in copies if inside(c.param)),
                   tuple(m for _, m in named), movable)

    def in_moe(self, param: str) -> bool:
        return param.startswith(self.moe)


#: Derive EP workers' expert copies from worker 0's (:class:`_ExpertSlots`) instead of
#: running their loaders on every expert; ``False`` traces them all (tests compare).
DERIVE_EXPERTS = True


def _block_of(param: str) -> str | None:
    """The MoE block a parameter belongs to, keyed as :func:`_expert_maps` keys it."""
    return param[: param.index(".experts")] if ".experts" in param else None


def _slot_maps(model: torch.nn.Module) -> dict[str, tuple[int, ...]] | None:
    """MoE block -> global expert id of each local slot, read off vLLM's expert maps.

    vLLM's ``ExpertMapManager.expert_map`` (``layers/fused_moe/expert_map_manager.py``,
    ``determine_expert_map``) maps global expert id -> local slot (-1: elsewhere).
    ``None`` unless every MoE block has such a map, its experts split evenly over
    the EP ranks (``global_num_experts % ep_size == 0``: every rank holds as many,
    so every rank's parameters have one shape), the map is exactly
    ``global_num_experts`` long (no fused shared or redundant slots appended) and
    it places each local slot once.
    """
    out: dict[str, tuple[int, ...]] = {}
    for block, manager in _expert_maps(model).items():
        expert_map = getattr(manager, "expert_map", None)
        total = getattr(manager, "global_num_experts", None)
        ep = getattr(manager, "ep_size", None)
        local = getattr(manager, "local_num_experts", None)
        if (expert_map is None or not total or not ep or not local or total % ep
                or len(expert_map) != total or local != total // ep):
            return None
        expert_map = expert_map.cpu()
        here = torch.nonzero(expert_map >= 0).flatten()
        slots = [-1] * local
        for g, j in zip(here.tolist(), expert_map[here].tolist()):
            if j >= local or slots[j] != -1:
                return None
            slots[j] = g
        if -1 in slots:
            return None
        out[block] = tuple(slots)
    return out or None


@dataclass(frozen=True)
class _ExpertSlots:
    """Worker 0's copies of the stacked expert wire tensors, as copies into local slots.

    Under expert parallelism vLLM's fused-MoE loaders
    (``layers/fused_moe/routed_experts.py``, ``weight_loader``: the global
    ``expert_id`` looked up in the layer's ``expert_map``, then the shard
    narrowed into ``param.data[local_id]``) copy expert ``e`` of a stacked wire
    tensor ``[E, ...]`` whole into local slot ``expert_map[e]``, by the same op
    chain whatever ``e`` is: the slot, not the expert, fixes the region. So each
    worker's expert copies are worker 0's with the wire's expert index replaced
    by the global id that worker's own expert map (read off its model) puts in
    the same slot. Kimi-K2 at ``tp=8,dp=8,ep``: the loaders run on the experts
    of 3 workers (0, and the two samples), not 64.

    Only taken where that is provable from worker 0's trace (:meth:`of`): EP
    maps of :func:`_slot_maps`' kind in every MoE block, every copy of a
    stacked expert wire tensor landing in an MoE block's parameter with its
    expert dim on the slot dim exactly as the map says, and no empty copy into
    an MoE block. A worker whose own maps are not of that kind, or have other
    slot counts, is traced for real. ``trace_destination`` also traces sample
    workers for real and holds them to the derived copies (:meth:`agree`).
    """

    wires: frozenset[str]                   # the stacked expert wire tensors
    slots: dict[str, tuple[int, ...]]       # worker 0's block -> slot -> global id
    copies: tuple[tuple[str, TracedCopy], ...]   # worker 0's (block, merged copy)

    @classmethod
    def of(cls, model: torch.nn.Module, copies: Sequence[TracedCopy], touched: set[str],
           wires: frozenset[str]) -> "_ExpertSlots | None":
        slots = _slot_maps(model)
        if slots is None or any(_block_of(p) in slots for p in touched):
            return None
        mine = []
        for c in merge_copies([c for c in copies if c.name in wires]):
            block = _block_of(c.param)
            if block not in slots or not c.box or len(c.region) != len(c.box) or c.zero:
                return None
            (a, b), (r0, r1) = c.box[0], c.region[0]
            if b - a != r1 - r0 or r1 > len(slots[block]) \
                    or slots[block][r0:r1] != tuple(range(a, b)):
                return None
            mine.append((block, c))
        return cls(wires, slots, tuple(mine)) if mine else None

    def copies_for(self, model: torch.nn.Module) -> list[TracedCopy] | None:
        """The expert copies of the worker whose model this is; ``None``: trace it instead."""
        slots = _slot_maps(model)
        if slots is None or {b: len(s) for b, s in slots.items()} != \
                {b: len(s) for b, s in self.slots.items()}:
            return None
        out = []
        for block, c in self.copies:
            r0, r1 = c.region[0]
            ids = slots[block][r0:r1]
            i = 0
            while i < len(ids):       # one copy per run of consecutive global ids
                k = i + 1
                while k < len(ids) and ids[k] == ids[k - 1] + 1:
                    k += 1
                out.append(TracedCopy(c.name, c.param, ((ids[i], ids[k - 1] + 1),) + c.box[1:],
                                      ((r0 + i, r0 + k),) + c.region[1:]))
                i = k
        return out

    def agree(self, worker: int, derived: Sequence[TracedCopy], real: Sequence[TracedCopy],
              touched: set[str]) -> None:
        """Hold ``worker``'s derived expert copies to its loaders' own trace of them.

        Raises:
            TraceError: they differ (names the worker, a differing copy and the
                switch that turns the derivation off).
        """
        want = {(c.name, c.param, c.box, c.region, c.zero)
                for c in merge_copies([c for c in real if c.name in self.wires])}
        have = {(c.name, c.param, c.box, c.region, c.zero)
                for c in merge_copies(list(derived))}
        empty = sorted(p for p in touched if _block_of(p) in self.slots)
        if want == have and not empty:
            return
        diff = sorted(want - have)[:1] or sorted(have - want)[:1]
        what = (f"vLLM's loaders copy {diff[0]}" if diff and diff[0] in want
                else f"the derivation copies {diff[0]}" if diff
                else f"vLLM's loaders leave {empty[:2]} empty")
        raise TraceError(f"worker {worker}: the expert copies derived from worker 0's trace "
                         f"differ from its own loaders' ({what}, and not the other); vLLM's "
                         "loaders do not place experts by slot alone here: set "
                         "m2nkit.adapters.vllm.trace.DERIVE_EXPERTS = False to trace every "
                         "worker's experts")


# --------------------------------------------------------------------------
# structurally identical layers: traced once, re-indexed
# --------------------------------------------------------------------------

#: Trace each group of structurally identical decoder layers once (plus one
#: sample) and re-index the rest (:func:`_trace_layers`); ``False`` traces every
#: layer (tests compare the two).
DEDUPE_LAYERS = True

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: Attributes every ``torch.nn.Module`` keeps for itself (hooks, the member dicts).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {"_parameters", "_buffers", "_modules"}


def _layer_of(name: str) -> tuple[str, int, str] | None:
    """``("model.layers.", 3, ".mlp.experts.w13_weight")`` for ``model.layers.3.mlp.experts.w13_weight``."""
    m = _LAYER.search(name)
    return None if m is None else (name[:m.start(1)], int(m.group(1)), name[m.end(1):])


def _encode(value: Any, index: int, prefix: str, memo: dict, depth: int = 0) -> Any:
    """A layer-independent, comparable image of one attribute value of layer ``index``.

    The layer's own index inside a string (``prefix + index``) becomes a
    placeholder (an attribute holding the index itself is
    :func:`_index_attributes`'); tensors that hold data give their values
    (expert maps), meta ones their shape and dtype; other objects their class
    and, two levels deep, their own attributes.
    """
    if value is None or isinstance(value, (bool, int, float, torch.dtype, torch.device)):
        return value
    if isinstance(value, str):
        return value.replace(f"{prefix}{index}", f"{prefix}<layer>")
    if isinstance(value, torch.nn.Module):          # its own entry in named_modules
        return ("module", type(value).__qualname__)
    if isinstance(value, torch.Tensor):
        if value.is_meta or value.numel() > 1 << 16:
            return ("tensor", tuple(value.shape), value.dtype, value.device.type)
        return ("tensor", tuple(value.shape), value.dtype, tuple(value.flatten().tolist()))
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [_encode(v, index, prefix, memo, depth) for v in value]
        out = (type(value).__name__, tuple(sorted(items, key=repr) if isinstance(
            value, (set, frozenset)) else items))
    elif isinstance(value, dict):
        out = ("dict", tuple(sorted(((repr(k), _encode(v, index, prefix, memo, depth))
                                     for k, v in value.items()), key=lambda kv: kv[0])))
    elif isinstance(value, enum.Enum):
        out = ("enum", repr(value))
    elif isinstance(value, functools.partial):      # a loader with its arguments bound
        out = ("partial", _encode(value.func, index, prefix, memo, depth),
               _encode(value.args, index, prefix, memo, depth),
               _encode(value.keywords, index, prefix, memo, depth))
    elif inspect.isroutine(value) or isinstance(value, type):
        out = ("routine", getattr(value, "__module__", None),
               getattr(value, "__qualname__", type(value).__qualname__),
               type(getattr(value, "__self__", None)).__qualname__)
    elif depth < 2 and hasattr(value, "__dict__"):
        memo[key] = ("object", type(value).__qualname__, "...")    # cycles
        out = ("object", type(value).__qualname__,
               tuple(sorted((k, _encode(v, index, prefix, memo, depth + 1))
                            for k, v in vars(value).items())))
    else:
        out = ("object", type(value).__qualname__)
    memo[key] = out
    return out


def _index_attributes(layers: Sequence[torch.nn.Module]) -> frozenset[tuple[str, str]]:
    """``(submodule, attribute)`` of the layers that hold the layer's own index.

    An ``int`` attribute that equals its layer's index in every layer holding
    it, over at least three layers (a decoder layer's own ``layer_idx``); a
    constant that only happens to equal some layer's index is not one.
    """
    seen: dict[tuple[str, str], bool] = {}
    count: dict[tuple[str, str], int] = {}
    for i, layer in enumerate(layers):
        for mname, mod in layer.named_modules(remove_duplicate=False):
            for k, v in vars(mod).items():
                if type(v) is int and k not in _MODULE_INTERNALS:
                    key = (mname, k)
                    seen[key] = seen.get(key, True) and v == i
                    count[key] = count.get(key, 0) + 1
    return frozenset(k for k, ok in seen.items() if ok and count[k] >= 3)


def _layer_structure(layer: torch.nn.Module, index: int, prefix: str,
                     at_index: frozenset[tuple[str, str]] = frozenset(),
                     memo: dict | None = None) -> tuple:
    """What vLLM's loaders can read off one decoder layer, modulo its index.

    Every submodule's name and class, its attributes (:func:`_encode`), and
    each parameter's and buffer's name, class, shape, dtype and attributes
    (vLLM's ``weight_loader``, ``output_dim``, ``tp_rank``... set on them).
    Two layers with equal structures and equally shaped wire tensors are
    loaded alike: :func:`_trace_layers` relies on that, and checks it on a
    sample layer of each group. ``at_index``: the attributes that hold the
    layer's index (:func:`_index_attributes`), compared as a placeholder.
    ``memo``: id -> encoding, seeded with the objects the layers share
    (:func:`_shared_objects`), which are then the same object, not alike.
    """
    memo = {} if memo is None else memo
    out = []
    for mname, mod in layer.named_modules(remove_duplicate=False):
        attrs = tuple(sorted((k, "<layer>" if (mname, k) in at_index
                              else _encode(v, index, prefix, memo))
                             for k, v in vars(mod).items() if k not in _MODULE_INTERNALS))
        tensors = tuple((kind, n, type(t).__qualname__, tuple(t.shape), t.dtype,
                         _encode(vars(t), index, prefix, memo)
                         if kind == "param" else _encode(t, index, prefix, memo))
                        for kind, group in (("param", mod._parameters), ("buffer", mod._buffers))
                        for n, t in group.items() if t is not None)
        out.append((mname, type(mod).__qualname__, attrs, tensors))
    return tuple(out)


def _shared_objects(layers: Sequence[torch.nn.Module]) -> dict[int, tuple]:
    """The dicts and objects that attributes of two or more layers hold (vLLM's configs).

    Encoded by identity: one object is equal to itself, whatever it holds
    (``compilation_config.static_forward_context`` names every layer).
    """
    holders: dict[int, set[int]] = {}
    for i, layer in enumerate(layers):
        for mod in layer.modules():
            for k, v in vars(mod).items():
                if k not in _MODULE_INTERNALS and (isinstance(v, dict) or (
                        hasattr(v, "__dict__") and not isinstance(
                            v, (torch.nn.Module, torch.Tensor, type, enum.Enum))
                        and not inspect.isroutine(v))):
                    holders.setdefault(id(v), set()).add(i)
    return {k: ("shared", k) for k, held in holders.items() if len(held) > 1}


def _trace_layers(model: torch.nn.Module, feeds: Sequence[Feed],
                  vllm_config: Any = None) -> tuple[list[TracedCopy], set[str], set[str]]:
    """:func:`trace_worker`'s result, each group of identical decoder layers traced once.

    vLLM's decoder layers (the ``layers`` ``ModuleList`` of a model,
    ``model_executor/models/utils.py`` ``make_layers``) are mostly built alike.
    Layers of one group have equal :func:`_layer_structure` (read off the live
    meta model, never assumed from the config) and feeds that differ only in
    the layer index; the loaders run on the first layer of each group, on the
    last as a sample, and on everything outside the layers, and the first
    layer's copies, re-indexed, stand for the others. Falls back to the full
    trace where that does not hold: a copy from one layer's wire tensor into
    another layer's parameter, a re-indexed name that does not exist, or the
    sample layer's own copies differing from the re-indexed ones.

    Returns:
        ``(copies, touched, copied)`` as :func:`trace_worker`.
    """
    layers: dict[str, torch.nn.ModuleList] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and mname.rsplit(".", 1)[-1] == "layers":
            layers[mname + "."] = mod
    by_layer: dict[tuple[str, int], list[Feed]] = {}
    for f in feeds:
        where = _layer_of(f.name)
        if where is not None:
            by_layer.setdefault(where[:2], []).append(f)
    # the feeds' layer prefix -> the modules': the same, or the one list of each
    prefixes = {p for p, _ in by_layer}
    pairing = {p: p for p in prefixes if p in layers}
    if not pairing and len(prefixes) == 1 and len(layers) == 1:
        pairing = {next(iter(prefixes)): next(iter(layers))}
    groups: dict[tuple, list[int]] = {}
    for fp, mp in pairing.items():
        mods = layers[mp]
        at_index = _index_attributes(mods)
        shared = _shared_objects(mods)
        for i, layer in enumerate(mods):
            mine = by_layer.get((fp, i))
            if not mine:
                continue
            wire = tuple((_layer_of(f.name)[2], _layer_of(f.wire.name)[2]
                          if _layer_of(f.wire.name) else f.wire.name, f.shape, f.offset,
                          f.dims, f.wire.shape, f.wire.dtype, f.expert) for f in mine)
            groups.setdefault((fp, mp, _layer_structure(layer, i, mp, at_index, dict(shared)), wire), []).append(i)
    derived = {(g[0], i): (g[0], g[1], members[0]) for g, members in groups.items()
               if len(members) > 2 for i in members[1:-1]}
    if not DEDUPE_LAYERS or not derived:
        return trace_worker(model, feeds, vllm_config)
    copies, touched, copied = trace_worker(
        model, [f for f in feeds if (_layer_of(f.name) or (None, None))[:2] not in derived],
        vllm_config)
    params = dict(model.named_parameters())
    reps = {(fp, r): mp for fp, mp, r in derived.values()}
    samples = {(g[0], members[-1]): members[0] for g, members in groups.items()
               if len(members) > 2}
    wire_layer = {f.wire.name: _layer_of(f.name)[:2] for f in feeds if _layer_of(f.name)}
    from_rep: dict[tuple[str, int], list[TracedCopy]] = {}
    sampled: dict[tuple[str, int], set] = {}
    for c in copies:
        src = wire_layer.get(c.name)
        dst = _layer_of(c.param)
        if src in reps or src in samples:
            if dst is None or dst[1] != src[1]:
                return trace_worker(model, feeds, vllm_config)    # a copy across layers
            if src in reps:
                from_rep.setdefault(src, []).append(c)
            else:
                sampled.setdefault(src, set()).add((c.name, c.param, c.box, c.region, c.zero))

    def reindexed(name: str, i: int) -> str:
        head, _, tail = _layer_of(name)
        return f"{head}{i}{tail}"

    wires = {m.wire.name for m in feeds}
    extra: list[TracedCopy] = []
    for (fp, i), (_, mp, r) in sorted(derived.items()):
        for c in from_rep.get((fp, r), ()):
            name, param = reindexed(c.name, i), reindexed(c.param, i)
            if name not in wires or param not in params:
                return trace_worker(model, feeds, vllm_config)
            extra.append(replace(c, name=name, param=param))
    for (fp, s), r in samples.items():
        mine = {(reindexed(c.name, s), reindexed(c.param, s), c.box, c.region, c.zero)
                for c in from_rep.get((fp, r), ())}
        if mine != sampled.get((fp, s), set()):
            return trace_worker(model, feeds, vllm_config)
    for p in list(touched):
        where = _layer_of(p)
        if where is not None and (fp := next((f for f, m in pairing.items()
                                              if m == where[0]), None)) is not None \
                and (fp, where[1]) in reps:
            touched |= {reindexed(p, i) for (f, i), (_, _, r) in derived.items()
                        if f == fp and r == where[1]}
    rep_feeds = {f.name for f in feeds if (_layer_of(f.name) or (None, None))[:2] in reps}
    copied |= {reindexed(n, i) for n in copied & rep_feeds
               for (f, i), (_, _, r) in derived.items() if (f, r) == _layer_of(n)[:2]}
    return [*copies, *extra], touched, copied


def trace_destination(config: Any, wire: Sequence[ParamMeta],
                      spec: InferenceSpec | str) -> DestinationLayout:
    """The ``DestinationLayout`` of ``spec`` as vLLM's own loaders place ``wire``.

    Args:
        config: a transformers config or a ``config.json`` dict (saved to a
            temporary directory for vLLM's ``ModelConfig``), or the path of
            a checkpoint directory.
        wire: the wire tensors (``checkpoint_metas``, ``config_wires``; for an
            architecture without a family table, transformers' in-memory
            ``state_dict()`` under its in-memory names).
        spec: ``"vllm:tp=T[,dp=D][,ep]..."`` or an ``InferenceSpec``.

    Returns:
        Every worker's parameters (``named_parameters`` of vLLM's model
        object: names, local shapes, the dtype vLLM allocates), the bindings
        traced from its loaders, ``zero_boxes`` for elements a loader leaves
        unwritten in a parameter it writes (or writes zeros into: a zeroed
        copy, ``TracedCopy.zero``), aliases for parameters that share
        storage, and ``skipped`` for wire tensors no worker takes. Its notes
        add the family's where the config is traced in the unquantized form
        the family table plans it in (:func:`unquantized_form`: an MXFP4
        config as its bf16 form).

    Raises:
        TraceError: a loader that is not a box algebra (names tensor,
            parameter and op).
        ImportError: vLLM is not installed.
    """
    spec = parse_inference_spec(spec) if isinstance(spec, str) else spec
    with tempfile.TemporaryDirectory(prefix="m2nkit-trace-") as tmp:
        if isinstance(config, (str, os.PathLike)):
            config_dir = str(Path(config).resolve())
        elif isinstance(config, dict):                 # a config.json as read
            import json

            Path(tmp, "config.json").write_text(json.dumps(config))
            config_dir = tmp
        else:
            config.save_pretrained(tmp)
            config_dir = tmp
        config_dir, notes = _served_config(config_dir, wire, tmp)
        params: list[DestinationParam] = []
        bindings: dict[str, list[Binding]] = {m.name: [] for m in wire}
        aliases: dict[str, str] = {}
        experts = experts_on_disk(config_dir)
        names = checkpoint_names(config_dir, [m.name for m in wire])
        permuted = permuted_on_disk(config_dir, [m.name for m in wire])
        split = _split_experts(wire, experts, names)    # the same for every worker
        stacked = {vllm_checkpoint_name(names.get(m.name, m.name)) for m, per_expert in split
                   if per_expert is not None}
        fused = bool(stacked)

        def _trace_fresh(w: int, only: frozenset[str] | None = None):
            nonlocal fused
            model, vllm_config = _build_meta_model(config_dir, spec, w)
            if w == 0:
                _check_quantized_wire(vllm_config, wire)
            # Stacked experts go in whole, under transformers 5's fused name,
            # where vLLM's loader takes that (one fake per layer instead of
            # one per expert and part: the trace of a 384-expert model is
            # seconds, not minutes); worker 0, which holds expert 0 under
            # every placement, decides. A loader that refuses the fused name
            # or ignores it gets the per-expert tensors a checkpoint holds.
            # A loader that ignored the fused names ran to the end on fakes that
            # wrote nothing: the same model takes the per-expert ones; one that
            # failed part way gets a fresh model.
            copies = None
            if fused:
                try:
                    copies, touched, copied = _trace_layers(
                        model, _feeds(wire, experts, True, model, names, only=only,
                                      permuted=permuted), vllm_config)
                    if w == 0 and not stacked <= copied:
                        copies = None
                        fused = False
                except TraceError:
                    if w > 0:
                        raise
                    fused = False
                    model, vllm_config = _build_meta_model(config_dir, spec, w)
            if copies is None:
                copies, touched, _ = _trace_layers(
                    model, _feeds(wire, experts, False, model, names, split, only=only,
                                  permuted=permuted), vllm_config)
            return model, vllm_config, copies, touched

        def _trace_only(model, vllm_config, only: frozenset[str]):
            if not only:
                return [], set()
            feeds = _feeds(wire, experts, fused, model, names, None if fused else split,
                           only=only, permuted=permuted)
            mine, touched, _ = _trace_layers(model, feeds, vllm_config)
            return mine, touched

        # EP workers: the copies of the stacked expert wire tensors are worker 0's,
        # relabelled by each worker's own expert map (_ExpertSlots); the sample
        # workers of `check` are traced for real as well and must agree.
        expert_wires = frozenset(m.name for m, per_expert in split if per_expert is not None)
        derive: _ExpertSlots | None = None
        check = {spec.tp - 1, spec.num_workers - 1} - {0}
        rest = frozenset(m.name for m in wire) - expert_wires

        # dp replicas: worker (d, t) is worker (0, t)'s model with its experts re-placed
        # (_replace_for_worker), so only the wire tensors that reach its MoE layers
        # are traced again; the rest of (0, t)'s copies stand (_Replica).
        built: dict[int, tuple[Any, Any, _Replica]] = {}     # tp rank -> dp group 0's
        for w in range(spec.num_workers):
            t = spec.tp_rank(w)
            if (t in built and built[t][2].movable
                    and _replace_for_worker(*built[t][:2], spec, w, built[t][2].layers)):
                model, vllm_config, base = built[t]
                mine, touched = _trace_only(model, vllm_config, base.moe_wires - derive.wires
                                            if derive else base.moe_wires)
                # merged apart: no (wire, parameter) pair is in two of the parts
                copies = [*base.copies,
                          *merge_copies([c for c in mine if base.in_moe(c.param)])]
                touched = base.touched | {p for p in touched if base.in_moe(p)}
                merged = True
            else:
                model, vllm_config, copies, touched = _trace_fresh(w, rest if derive else None)
                merged = False
            if derive is not None:
                derived = derive.copies_for(model)
                if derived is None or w in check:
                    real, real_touched = _trace_only(model, vllm_config, derive.wires)
                    if derived is not None:
                        derive.agree(w, derived, real, real_touched)
                    else:                 # this worker's placement is not worker 0's kind
                        derived = real
                        touched = touched | real_touched
                copies = [*copies, *(merge_copies(derived) if merged else derived)]
            elif (w == 0 and DERIVE_EXPERTS and spec.ep and expert_wires
                    and spec.num_workers > 1):
                derive = _ExpertSlots.of(model, copies, touched, expert_wires)
            if spec.dp > 1 and spec.dp_index(w) == 0 and t not in built:
                built[t] = (model, vllm_config, _Replica.of(model, copies, touched))
            if not merged:
                copies = merge_copies(copies)
            by_param: dict[str, list[tuple]] = {p: [] for p in touched}
            zeroed: dict[str, list[TracedCopy]] = {}
            for c in copies:
                if c.zero:      # the loader zeroed the tensor: a zero box, not a binding
                    by_param.setdefault(c.param, [])
                    zeroed.setdefault(c.param, []).append(c)
                    continue
                by_param.setdefault(c.param, []).append(c.region)
                bindings[c.name].append(Binding(c.name, w, c.box, c.param,
                                                tuple(a for a, _ in c.region)))
            _check_zeroed(w, zeroed, by_param)
            canonical = {}
            for pname, p in model.named_parameters(remove_duplicate=False):
                key = id(p)
                if key in canonical:
                    aliases[pname] = canonical[key]
                    continue
                canonical[key] = pname
                shape = tuple(p.shape)
                zero = _uncovered(shape, by_param[pname]) if pname in by_param else ()
                params.append(DestinationParam(w, pname, p.dtype, shape, zero))
            del model
        built.clear()
    skipped = {n: _SKIPPED for n, b in bindings.items() if not b}
    return DestinationLayout(str(spec), spec.num_workers, tuple(params),
                             {n: tuple(b) for n, b in bindings.items() if b},
                             skipped=skipped, aliases=aliases,
                             notes=("layout traced from vLLM's own weight loaders", *notes))


def _check_zeroed(worker: int, zeroed: Mapping[str, Sequence[TracedCopy]],
                  bound: Mapping[str, Sequence[tuple]]) -> None:
    """Refuse a zeroed copy whose region a binding of the same worker also writes.

    A zeroed copy (``TracedCopy.zero``) becomes a zero box because no
    binding writes its region (``_uncovered``); where a binding does, the
    result depends on which copy came last, which the layout does not keep.

    Raises:
        TraceError: names the worker, the parameter, the wire tensor and the op.
    """
    for pname, copies in zeroed.items():
        for c in copies:
            if any(all(a < d and q < b for (a, b), (q, d) in zip(c.region, r))
                   for r in bound.get(pname, ())):
                raise TraceError(f"worker {worker}: vLLM's loader copies wire tensor "
                                 f"'{c.name}' zeroed (zero_()) into {list(c.region)} of "
                                 f"parameter '{pname}', which another copy also writes; "
                                 "m2nkit cannot tell which of the two lands last")


def _served_config(config_dir: str, wire: Sequence[ParamMeta], tmp: str) -> tuple[str, tuple]:
    """The config directory vLLM builds from, and the notes that say how it was read.

    ``config_dir`` itself, or, where the family table plans a quantized config
    in its unquantized form (:func:`unquantized_form`: an MXFP4 one), a
    directory under ``tmp`` holding that config without ``quantization_config``
    (any other file of ``config_dir`` linked beside it) and the family's notes.
    """
    import json

    try:
        config = json.loads(Path(config_dir, "config.json").read_text())
    except (OSError, ValueError):
        return config_dir, ()
    unquantized = unquantized_form(config, wire)
    if unquantized is None:
        return config_dir, ()
    served, notes = unquantized
    out = Path(tmp, "unquantized")
    out.mkdir()
    (out / "config.json").write_text(json.dumps(served))
    for f in Path(config_dir).iterdir():
        if f.name != "config.json" and f.resolve() != out.resolve():
            (out / f.name).symlink_to(f.resolve())
    return str(out), notes


def _unpadded_region(region: tuple, padding) -> tuple:
    """A region of a padded expert tensor in its unpadded coordinates (see ``traced_problems``)."""
    if padding is None:
        return region
    shape, padded_shape, shards = padding
    r, R = shape[-2] // shards, padded_shape[-2] // shards
    lo, hi = region[-2]
    s = lo // R
    return (*region[:-2], (lo - s * (R - r), hi - s * (R - r)), region[-1])


def traced_problems(model: torch.nn.Module, layout: DestinationLayout, worker: int,
                    wire: Sequence[ParamMeta], vllm_config: Any = None,
                    experts_on_disk: dict[str, str] | None = None,
                    at_most: int = 8, names: dict[str, str] | None = None,
                    padded: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], int]] | None = None,
                    permuted: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
                    ) -> list[str]:
    """How ``layout``'s bindings for ``worker`` differ from what the live model's loaders do.

    For a vLLM worker (the plugin) holding its live ``model``: its own
    ``load_weights`` runs on fake wire tensors (:func:`trace_worker`). The
    fakes' ``copy_`` records and writes nothing, so the live parameters keep
    their bytes (a loader's own ``fill_`` of vocab padding rows writes the
    zeros they already hold). Each traced copy is compared, after
    :func:`merge_copies`, with the layout's bindings of ``worker``; a binding
    the loaders do not make, or a copy no binding makes, is one problem
    (wire tensor, parameter, box, region). Empty: the layout is what vLLM
    does. ``names``: the wire's checkpoint names where they differ, for an
    architecture without a family table (:func:`checkpoint_names`).
    ``padded``: ``{param: (unpadded shape, padded shape, row shards)}`` of
    expert weights the loaders write into a padded tensor
    (``engine.plugins.vllm_reload.padded_experts``); their traced regions
    are read back in the unpadded coordinates the layout declares (row
    shard ``s`` at ``s * R`` is ``s * r``). ``permuted``: the wire tensors
    that are permuted on-disk ones (:func:`permuted_on_disk`), fed as those;
    a copy the loaders make from a tensor they zeroed first
    (``TracedCopy.zero``) is no binding and not compared.

    Raises:
        TraceError: the loaders cannot be traced (the caller decides whether
            the tables alone may stand).
    """
    copies, _, _ = trace_worker(model, _feeds(wire, experts_on_disk or {}, False, model, names,
                                              permuted=permuted), vllm_config)
    if padded:
        copies = [replace(c, region=_unpadded_region(c.region, padded[c.param]))
                  if c.param in padded else c for c in copies]
    # a zeroed copy (TracedCopy.zero) is no binding: the plan leaves those elements zero
    traced = {(c.name, c.param, c.box, c.region) for c in merge_copies(copies) if not c.zero}
    declared = [TracedCopy(b.name, b.param, b.box,
                           tuple((o, o + hi - lo) for o, (lo, hi) in zip(b.offset, b.box)))
                for bs in layout.bindings.values() for b in bs if b.worker == worker]
    planned = {(c.name, c.param, c.box, c.region) for c in merge_copies(declared)}
    out = []
    for name, param, box, region in sorted(planned - traced)[:at_most]:
        out.append(f"the plan writes box {list(box)} of '{name}' into {list(region)} of "
                   f"'{param}', which vLLM's loaders do not")
    for name, param, box, region in sorted(traced - planned)[:at_most]:
        out.append(f"vLLM's loaders write box {list(box)} of '{name}' into {list(region)} of "
                   f"'{param}', which the plan does not")
    return out

