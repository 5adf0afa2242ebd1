"""``destination_layout``: a family table + a vLLM spec -> ``DestinationLayout``.

For every worker it declares every vLLM parameter (local shape, dtype,
zero-filled vocab padding rows) and, per wire tensor, the bindings that say
which box of the wire tensor lands where in which parameter. The rules per
shard kind are in ``table.py``; the names per model family in the family
modules. It never invents a filler: a parameter no wire tensor feeds stays
declared and unbound, so the planner's coverage proof reports it.

Cost: one loop over wire tensors x workers with a few tuples each (no
per-element work); Qwen3-235B at 64 workers plans in about a second.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from m2nkit.manifest import Binding, DestinationLayout, DestinationParam, ParamMeta

from .names import DEFAULT_VLLM_VERSION, vllm_names
from .registry import family_for
from .spec import InferenceSpec, parse_inference_spec
from .table import COLUMN, MERGED, QKV, REPLICATED, ROW, VOCAB, W13, W2, Family, Param, Sizes

__all__ = ["destination_layout", "VOCAB_PADDING"]

#: vLLM pads the vocab of VocabParallelEmbedding/ParallelLMHead to a multiple
#: of this (vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64

_ROTARY = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# --------------------------------------------------------------------------
# Parallel geometry and the divisibility rules
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Geometry:
    """Per-worker sizes of one (model, spec): REFERENCE.md §3 rules."""

    tp: int
    W: int
    ep: bool
    q_heads: int      # nh / tp
    kv_heads: int     # KV heads per rank
    kv_replicas: int  # ranks sharing one KV head (1 when tp < nkv)
    vocab_per: int    # Vp / tp
    e_local: int      # experts per worker
    im_local: int     # Im / tp_moe

    @classmethod
    def of(cls, s: Sizes, spec: InferenceSpec) -> "_Geometry":
        tp, W = spec.tp, spec.num_workers
        if tp >= s.nkv:
            kv_heads, kv_rep = 1, tp // max(s.nkv, 1)
        else:
            kv_heads, kv_rep = s.nkv // tp, 1
        vp = -(-s.V // VOCAB_PADDING) * VOCAB_PADDING
        if spec.ep and W > 1:
            e_local, im_local = s.E // W, s.Im
        else:
            e_local, im_local = s.E, s.Im // W
        return cls(tp, W, spec.ep and W > 1, s.nh // tp, kv_heads, kv_rep, vp // tp,
                   e_local, im_local)


def _violations(family: Family, s: Sizes, present: dict, tp: int, dp: int, ep: bool) -> list[str]:
    """Why ``tp``/``dp``/``ep`` cannot hold this model (empty: it can).

    ``present`` maps ``(kind, dims)`` to one parameter name of that shape.
    Rules: vLLM ``linear.py`` (``divide`` in QKV/Merged/Row constructors),
    ``vocab_parallel_embedding.py`` (``divide(num_embeddings_padded, tp)``),
    ``fused_moe/config.py`` (``intermediate_size % tp_size``),
    ``expert_map_manager.py`` (experts per EP rank; uneven splits are not
    supported here).
    """
    out: list[str] = []
    W = tp * dp
    order = (QKV, MERGED, COLUMN, ROW, VOCAB, W13, W2, REPLICATED)
    for (kind, dims), name in sorted(present.items(), key=lambda kv: order.index(kv[0][0])):
        if kind == QKV:
            if s.nh % tp:
                out.append(f"{name}: num_attention_heads={s.nh} is not divisible by tp={tp}")
            elif tp >= s.nkv and tp % s.nkv:
                out.append(
                    f"{name}: tp={tp} >= num_key_value_heads={s.nkv} must be a multiple "
                    f"of it (each rank holds one replicated KV head)")
            elif tp < s.nkv and s.nkv % tp:
                out.append(f"{name}: num_key_value_heads={s.nkv} is not divisible by tp={tp}")
        elif kind == VOCAB:
            vp = -(-s.V // VOCAB_PADDING) * VOCAB_PADDING
            if vp % tp:
                out.append(
                    f"{name}: vocab_size={s.V} padded to {vp} (a multiple of "
                    f"{VOCAB_PADDING}) is not divisible by tp={tp}")
        elif kind in (COLUMN, MERGED, ROW):
            sym = dims[1] if kind == ROW else dims[0]
            if s.resolve((sym,))[0] % tp:
                out.append(f"{name}: {s.label(sym)} is not divisible by tp={tp}")
        elif kind == W2 and any(k == W13 for k, _ in present):
            continue  # w13 and w2 share the MoE rules; report them once
        elif kind in (W13, W2):
            if ep and W > 1:
                if s.E % W:
                    out.append(
                        f"{name}: {s.label('E')} is not divisible by the expert-parallel "
                        f"size ep=dp*tp={W}")
            elif s.Im % W:
                out.append(
                    f"{name}: {s.label('Im')} is not divisible by the MoE tensor-parallel "
                    f"size dp*tp={W}")
    spec = InferenceSpec(tp, dp, ep)
    for check in family.checks:
        msg = check(s, spec)
        if msg:
            out.append(msg)
    return sorted(set(out), key=out.index)


def _check_parallel(family: Family, s: Sizes, present: dict, spec: InferenceSpec) -> None:
    bad = _violations(family, s, present, spec.tp, spec.dp, spec.ep)
    if not bad:
        return
    valid = [t for t in range(1, max(s.nh, 1) + 1)
             if not _violations(family, s, present, t, spec.dp, spec.ep)]
    where = f"dp={spec.dp}" + (", ep" if spec.ep else "")
    hint = (f"valid tp with {where}: {valid}" if valid
            else f"no tp works with {where}; change dp or ep")
    also = f" (also: {'; '.join(bad[1:])})" if len(bad) > 1 else ""
    raise ValueError(
        f"{family.architecture} cannot be laid out as {spec}: {bad[0]}; {hint}{also}")


# --------------------------------------------------------------------------
# Table expansion: concrete parameter names and the wire tensors feeding them
# --------------------------------------------------------------------------

@dataclass
class _Expanded:
    params: list[tuple[str, Param]]           # concrete vLLM name, table entry
    feeds: dict[str, tuple[str, Param, Any]]  # wire name -> (param name, entry, part)
    absent: dict[str, str]                    # wire name -> why its param does not exist
    skipped: dict[str, str]
    aliases: dict[str, str]


def _fill(template: str, layer: int | None, names: dict) -> str | None:
    keys = dict(names, L=layer)
    if any(v is None and "{" + k + "}" in template for k, v in keys.items()):
        return None
    return template.format(**keys)


def _expand(family: Family, config: Any, s: Sizes, names: dict) -> _Expanded:
    out = _Expanded([], {}, {}, {}, {})
    layered = [p for p in family.params if "{L}" in p.name]
    first = next((i for i, p in enumerate(family.params) if "{L}" in p.name), len(family.params))
    pre = [p for p in family.params[:first] if "{L}" not in p.name]
    post = [p for p in family.params[first:] if "{L}" not in p.name]

    def add(p: Param, layer: int | None) -> None:
        name = _fill(p.name, layer, names)
        exists = p.when is None or family.conditions[p.when](config, layer)
        if p.tied_to is not None and s.tied:
            canonical = _fill(p.tied_to, layer, names)
            out.aliases[name] = canonical
            for wire, _ in p.feeds:
                out.skipped[_fill(wire, layer, names)] = (
                    f"tie_word_embeddings=True: vLLM ties {name} to {canonical} and skips "
                    "this checkpoint tensor (models/utils.py, AutoWeightsLoader aliased params)")
            return
        if not exists:
            where = "" if layer is None else f" in layer {layer}"
            for wire, _ in p.feeds:
                out.absent[_fill(wire, layer, names)] = (
                    f"it would feed {name}, which {family.architecture} does not have{where} "
                    f"(condition '{p.when}' is false for this config)")
            return
        out.params.append((name, p))
        for wire, part in p.feeds:
            out.feeds[_fill(wire, layer, names)] = (name, p, part)
        for alias in p.aliases:
            a = _fill(alias, layer, names)
            if a is not None:
                out.aliases[a] = name

    for p in pre:
        add(p, None)
    for layer in range(s.layers):
        for p in layered:
            add(p, layer)
    for p in post:
        add(p, None)
    return out


# --------------------------------------------------------------------------
# Shapes and boxes per shard kind
# --------------------------------------------------------------------------

def _wire_shape(p: Param, part: Any, s: Sizes) -> tuple[int, ...]:
    """Global shape the config implies for a wire tensor feeding ``p``."""
    if p.kind == QKV:
        heads = s.nh if part == "q" else s.nkv
        return (heads * s.hd, *s.resolve(p.dims))
    return s.resolve(p.dims)


def _local_shape(p: Param, s: Sizes, g: _Geometry) -> tuple[int, ...]:
    dims = s.resolve(p.dims)
    k = p.kind
    if k == REPLICATED:
        return dims
    if k == COLUMN:
        return (dims[0] // g.tp, *dims[1:])
    if k == ROW:
        return (dims[0], dims[1] // g.tp)
    if k == QKV:
        return ((g.q_heads + 2 * g.kv_heads) * s.hd, *dims)
    if k == MERGED:
        return (len(p.feeds) * dims[0] // g.tp, *dims[1:])
    if k == VOCAB:
        return (g.vocab_per, *dims[1:])
    if k == W13:
        return (g.e_local, 2 * g.im_local, s.H)
    if k == W2:
        return (g.e_local, s.H, g.im_local)
    raise AssertionError(k)


def _vocab_rows(s: Sizes, g: _Geometry, r: int) -> tuple[int, int]:
    """Token rows ``[lo, hi)`` of tp rank ``r`` (vLLM ``_get_indices``)."""
    return min(r * g.vocab_per, s.V), min((r + 1) * g.vocab_per, s.V)


def _dense_boxes(p: Param, part: Any, shape: tuple[int, ...], s: Sizes, g: _Geometry, r: int):
    """``[(wire_box, offset)]`` of a non-expert wire tensor on tp rank ``r``."""
    full = tuple((0, n) for n in shape)
    zero = (0,) * len(shape)
    k = p.kind
    if k == REPLICATED:
        return [(full, zero)]
    if k == ROW:
        n = shape[1] // g.tp
        return [((full[0], (r * n, (r + 1) * n)), zero)]
    if k in (COLUMN, MERGED):
        n = shape[0] // g.tp
        at = 0 if k == COLUMN else part * n
        return [(((r * n, (r + 1) * n), *full[1:]), (at, *zero[1:]))]
    if k == QKV:
        q_rows = g.q_heads * s.hd
        if part == "q":
            return [(((r * q_rows, (r + 1) * q_rows), *full[1:]), zero)]
        n = g.kv_heads * s.hd
        shard = r // g.kv_replicas if g.tp >= s.nkv else r
        at = q_rows + (n if part == "v" else 0)
        return [(((shard * n, (shard + 1) * n), *full[1:]), (at, *zero[1:]))]
    if k == VOCAB:
        lo, hi = _vocab_rows(s, g, r)
        return [(((lo, hi), *full[1:]), zero)] if hi > lo else []
    raise AssertionError(k)


def _expert_boxes(p: Param, s: Sizes, g: _Geometry, w: int):
    """``[(wire_box, offset)]`` of stacked experts on worker ``w``.

    w13: wire ``[E, 2*Im, H]`` (gate rows then up rows per expert); local
    ``[E_local, 2*Im_local, H]``, gate block then up block. w2: wire
    ``[E, H, Im]``; local ``[E_local, H, Im_local]`` (``routed_experts.py``
    ``_load_w13``/``_load_w2``).
    """
    if g.ep:
        e0, e1, k = w * g.e_local, (w + 1) * g.e_local, 0
    else:
        e0, e1, k = 0, s.E, w
    n = g.im_local
    if p.kind == W13:
        if n == s.Im:  # one worker holds whole experts: gate and up are one run
            return [(((e0, e1), (0, 2 * n), (0, s.H)), (0, 0, 0))]
        return [
            (((e0, e1), (k * n, (k + 1) * n), (0, s.H)), (0, 0, 0)),
            (((e0, e1), (s.Im + k * n, s.Im + (k + 1) * n), (0, s.H)), (0, n, 0)),
        ]
    return [(((e0, e1), (0, s.H), (k * n, (k + 1) * n)), (0, 0, 0))]


# --------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------

def _unknown_reason(name: str, family: Family, s: Sizes, version: str) -> str:
    m = _PER_EXPERT.match(name)
    if m:
        return (f"a per-expert tensor: the wire carries each layer's experts stacked as "
                f"'{m.group(1)}.gate_up_proj.weight' [E, 2*Im, H] and "
                f"'{m.group(1)}.down_proj.weight' [E, H, Im]; re-fuse them before sending")
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= s.layers:
        return f"layer {m.group(1)} does not exist (num_hidden_layers={s.layers})"
    return (f"no vLLM {version} parameter of {family.architecture} takes this tensor "
            "(not in the family table, m2nkit/adapters/vllm)")


def destination_layout(
    config: Any,
    wire: Sequence[ParamMeta],
    spec: InferenceSpec | str,
    *,
    vllm_version: str = DEFAULT_VLLM_VERSION,
) -> DestinationLayout:
    """What every vLLM worker holds and where each wire tensor lands.

    Args:
        config: the HF config (a transformers ``PretrainedConfig`` or the
            ``config.json`` dict); ``architectures[0]`` picks the family.
        wire: the wire tensors (``ParamMeta``: name, dtype, global shape).
            Names are HF checkpoint names; MoE experts come stacked per
            layer (``<block>.experts.gate_up_proj.weight`` ``[E, 2*Im, H]``,
            ``<block>.experts.down_proj.weight`` ``[E, H, Im]``).
        spec: ``InferenceSpec`` or ``"vllm:tp=T[,dp=D][,ep]"``.
        vllm_version: which entry of ``names.VLLM_NAMES`` names the params.

    Returns:
        ``DestinationLayout`` with ``num_workers = dp*tp`` (dp-major), every
        worker's parameters (in the config's model dtype, as vLLM allocates
        them; a wire tensor of another dtype is cast on arrival), bindings per wire tensor, ``skipped`` (tied
        ``lm_head.weight``, rotary caches), ``aliases`` (tied lm_head,
        Qwen3-MoE router alias) and ``unknown`` (wire tensors no rule takes;
        not an error here). Parameters no wire tensor feeds stay declared and
        unbound.

    Raises:
        ValueError: an unknown architecture (lists the supported ones); a bad
            spec; a parallel size the model cannot be split by (names the
            config value and lists the valid tp); a wire tensor whose shape
            disagrees with the config; a repeated wire name.
    """
    spec = parse_inference_spec(spec)
    family = family_for(config)
    names = vllm_names(vllm_version)
    s = family.sizes(config)
    ex = _expand(family, config, s, names)
    present: dict = {}
    for name, p in ex.params:  # one entry per rule: dims matter only for column/row/merged
        present.setdefault((p.kind, p.dims if p.kind in (COLUMN, ROW, MERGED) else ()), name)
    _check_parallel(family, s, present, spec)
    g = _Geometry.of(s, spec)
    W = spec.num_workers
    tp = spec.tp

    bindings: dict[str, tuple[Binding, ...]] = {}
    skipped: dict[str, str] = {}
    unknown: dict[str, str] = {}
    seen: set[str] = set()
    for meta in wire:
        wname = meta.name
        if wname in seen:
            raise ValueError(f"wire tensor '{wname}' is listed twice")
        seen.add(wname)
        hit = ex.feeds.get(wname)
        if hit is None:
            if wname in ex.skipped:
                skipped[wname] = ex.skipped[wname]
            elif _ROTARY.search(wname):
                skipped[wname] = "rotary cache, not a weight (vLLM AutoWeightsLoader skips it)"
            elif wname in ex.absent:
                unknown[wname] = ex.absent[wname]
            else:
                unknown[wname] = _unknown_reason(wname, family, s, vllm_version)
            continue
        pname, p, part = hit
        expect = _wire_shape(p, part, s)
        if tuple(meta.shape) != expect:
            raise ValueError(
                f"wire tensor '{wname}' has shape {tuple(meta.shape)}, but the "
                f"{family.architecture} config implies {expect} for {pname}")
        out: list[Binding] = []
        if p.kind in (W13, W2):
            for w in range(W):
                out.extend(Binding(wname, w, box, pname, off)
                           for box, off in _expert_boxes(p, s, g, w))
        else:
            per_rank = [_dense_boxes(p, part, expect, s, g, r) for r in range(tp)]
            for w in range(W):
                out.extend(Binding(wname, w, box, pname, off) for box, off in per_rank[w % tp])
        bindings[wname] = tuple(out)

    # vLLM allocates every parameter of these families in the model dtype
    # (ModelConfig.dtype from the config's ``dtype``/``torch_dtype``) and its
    # weight loaders cast on copy; a wire tensor in another dtype is cast on
    # arrival the same way (the plan marks it, nccl.m2n cannot cast).
    model_dtype = s.dtype
    if model_dtype is None:
        common = Counter(m.dtype for m in wire).most_common(1)
        model_dtype = common[0][0] if common else torch.float32
    shapes = {name: _local_shape(p, s, g) for name, p in ex.params}
    vocab_zero: dict[int, tuple] = {}
    for r in range(tp):
        lo, hi = _vocab_rows(s, g, r)
        n = hi - lo
        vocab_zero[r] = (((n, g.vocab_per), (0, s.H)),) if n < g.vocab_per else ()
    params: list[DestinationParam] = []
    for w in range(W):
        r = w % tp
        for name, p in ex.params:
            zeros = vocab_zero[r] if p.kind == VOCAB else ()
            params.append(DestinationParam(w, name, model_dtype, shapes[name], zeros))
    return DestinationLayout(
        spec=str(spec), num_workers=W, params=tuple(params), bindings=bindings,
        skipped=skipped, aliases=dict(ex.aliases), unknown=unknown,
    )
