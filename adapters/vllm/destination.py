"""``destination_layout``: a model family + a vLLM spec -> ``DestinationLayout``.

For every worker it declares every vLLM parameter (local shape, dtype,
zero-filled vocab padding rows) and, per wire tensor, the bindings that say
which box of the wire tensor lands where in which parameter. It knows no
model family and no sharding rule of its own: the family module
(``m2nkit.adapters.families.<family>``) says which parameters exist and
which wire tensors feed them (expanded for the config by
``m2nkit.adapters.families.expand``, the expander the trainer side uses
too; ``expand`` and ``Expanded`` are re-exported here), the shard kinds
(``m2nkit.adapters.families.kinds``) say what each worker holds of each.
It never invents a filler: a parameter no wire tensor feeds stays declared
and unbound, so the planner's coverage proof reports it.

Cost: one loop over wire tensors x workers with a few tuples each (no
per-element work); a 235B-parameter MoE model at 64 workers plans in about a
second.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from m2nkit.manifest import Binding, DestinationLayout, DestinationParam, ParamMeta

from ..families import family_for
from ..families.expand import Expanded, expand
from ..families.kinds import Geometry
from ..families.sizes import Sizes
from ..families.table import Family
from ..families.vllm_names import DEFAULT_VLLM_VERSION, vllm_names
from .dtype import model_dtype
from .expert_placement import expert_placement
from .spec import InferenceSpec, parse_inference_spec

__all__ = ["destination_layout", "expand", "Expanded", "check_parallel", "check_unquantized",
           "dense_ep_note"]

_ROTARY = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# --------------------------------------------------------------------------
# The divisibility rules
# --------------------------------------------------------------------------

def _violations(family: Family, s: Sizes, present: dict, tp: int, dp: int, ep: bool) -> list[str]:
    """Why ``tp``/``dp``/``ep`` cannot hold this model (empty: it can).

    ``present`` maps a kind's ``rule_key`` to ``(parameter name, Param)`` of
    the first parameter breaking that rule, if any does; each kind states
    its rule and the vLLM source (``Kind.violation``), the family its own
    extra ones (``Family.checks``).
    """
    out: list[str] = []
    for name, p in sorted(present.values(), key=lambda np: np[1].kind.rule_order):
        msg = p.kind.violation(name, p.dims, s, tp, dp, ep)
        if msg:
            out.append(msg)
    spec = InferenceSpec(tp, dp, ep)
    for check in family.checks:
        msg = check(s, spec)
        if msg:
            out.append(msg)
    return sorted(set(out), key=out.index)


def check_parallel(family: Family, s: Sizes, ex: "Expanded", spec: InferenceSpec) -> None:
    """Raise if ``spec`` cannot hold the expanded model.

    Raises:
        ValueError: names the first broken rule (config value and rule), the
            tp values that would work with the same dp/ep, and the others.
    """
    present: dict = {}
    for name, p in ex.params:
        present.setdefault(p.kind.rule_key(p.dims), (name, p))
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


def _quantization_config(config: Any) -> Any:
    if isinstance(config, dict):
        return config.get("quantization_config")
    return getattr(config, "quantization_config", None)


def check_unquantized(family: Family, config: Any, name: str, dtype: torch.dtype) -> None:
    """Refuse an integer or fp8 wire tensor for a model with no ``quantization_config``.

    vLLM allocates such a model's parameters in the model dtype and its
    loaders cast on copy (``param.data.copy_(loaded_weight)``), so an int8
    ``down_proj`` would load as its integer values, silently: a quantized
    checkpoint missing its ``quantization_config``, or a wrong tensor.

    Raises:
        ValueError: names the tensor, its dtype and the rule.
    """
    if dtype.is_floating_point and dtype.itemsize > 1:
        return
    if _quantization_config(config):
        return
    raise ValueError(
        f"wire tensor '{name}' is {str(dtype).removeprefix('torch.')}, but the "
        f"{family.architecture} config has no quantization_config: vLLM would cast it to the "
        "model dtype as plain numbers. Integer and fp8 weights need the checkpoint's "
        "quantization_config; otherwise send bfloat16, float16 or float32")


def is_rotary_cache(name: str) -> bool:
    """A rotary cache (``rotary_emb.inv_freq`` ...): never a weight; vLLM skips it."""
    return bool(_ROTARY.search(name))


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
            f"(not in the family table, {family.module})")


def dense_ep_note(family, sizes, spec) -> str | None:
    """The note for ``ep`` on a model without experts (``None`` otherwise): vLLM's
    ``enable_expert_parallel`` changes only the MoE layers, so a dense model is laid out
    as without it."""
    if not spec.ep or sizes.E:
        return None
    rest = f"tp={spec.tp}" + (f", dp={spec.dp}" if spec.dp > 1 else "")
    return (f"ep has no effect here: {family.architecture} has no experts (a dense model), "
            f"so every worker holds what {rest} alone gives it")


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
        spec: ``InferenceSpec`` or ``"vllm:tp=T[,dp=D][,ep][,placement=P][,dtype=X]"``.
        vllm_version: which entry of ``names.VLLM_NAMES`` names the params.

    Returns:
        ``DestinationLayout`` with ``num_workers = dp*tp`` (dp-major), every
        worker's parameters (in vLLM's model dtype, ``m2nkit.adapters.vllm.dtype``:
        the spec's ``dtype``, or vLLM's ``auto`` rule from the config and,
        when it names none, the wire dtypes; a wire tensor of another dtype
        is cast on arrival), bindings per wire tensor (experts placed as
        vLLM places them, ``m2nkit.adapters.vllm.expert_placement``), ``skipped``
        (tied ``lm_head.weight``, rotary caches), ``aliases`` (tied
        lm_head, MoE router aliases), ``unknown`` (wire tensors no rule
        takes; not an error here) and ``notes`` (how the dtype and the
        expert placement were decided when that is not plain from the
        spec and config, e.g. a round-robin request vLLM turns into
        linear). Parameters no wire tensor feeds stay declared and unbound.

    Raises:
        ValueError: an unsupported architecture
            (``m2nkit.adapters.families.UnsupportedArchitecture``, lists the
            supported ones); a bad spec; a parallel size the model cannot be
            split by (names the config value and lists the valid tp); a wire
            tensor whose shape disagrees with the config; a repeated wire name;
            an integer or fp8 wire tensor in a model without
            ``quantization_config``; a dtype vLLM refuses or cannot decide
            (``m2nkit.adapters.vllm.dtype.model_dtype``).
    """
    spec = parse_inference_spec(spec)
    family = family_for(config)
    names = vllm_names(vllm_version)
    s = family.sizes(config)
    ex = expand(family, config, s, names)
    check_parallel(family, s, ex, spec)
    W, tp = spec.num_workers, spec.tp
    placement = expert_placement(family, config, spec)
    geo = [Geometry.of(s, tp, spec.dp, spec.ep, w, placement.strategy, spec.all2all)
           for w in range(W)]

    bindings: dict[str, tuple[Binding, ...]] = {}
    placed_by_entry: dict[tuple, tuple] = {}   # (table entry, part) -> (wire shape, boxes per worker)
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
            elif is_rotary_cache(wname):
                skipped[wname] = "rotary cache, not a weight (vLLM AutoWeightsLoader skips it)"
            elif family.skip is not None and family.skip(config, wname):
                skipped[wname] = family.skip(config, wname)
            elif wname in ex.absent:
                unknown[wname] = ex.absent[wname]
            else:
                unknown[wname] = _unknown_reason(wname, family, s, vllm_version)
            continue
        pname, p, part = hit
        kind = p.kind
        check_unquantized(family, config, wname, meta.dtype)
        # Every layer's entry is the same table row: its shape and boxes are the same.
        entry = (id(p), part)
        if entry not in placed_by_entry:
            expect = kind.wire_shape(s.resolve(p.dims), part, s)
            if kind.by_worker:
                placed = [kind.boxes(expect, part, geo[w]) for w in range(W)]
            else:  # only the tp rank matters: every dp replica holds the same
                per_rank = [kind.boxes(expect, part, geo[r]) for r in range(tp)]
                placed = [per_rank[w % tp] for w in range(W)]
            placed_by_entry[entry] = expect, placed
        expect, placed = placed_by_entry[entry]
        if tuple(meta.shape) != expect:
            raise ValueError(
                f"wire tensor '{wname}' has shape {tuple(meta.shape)}, but the "
                f"{family.architecture} config implies {expect} for {pname}")
        bindings[wname] = tuple(Binding(wname, w, box, pname, off)
                                for w in range(W) for box, off in placed[w])

    # vLLM allocates every parameter of these families in the model dtype
    # and its weight loaders cast on copy; a wire tensor in another dtype is
    # cast on arrival the same way (the plan marks it, nccl.m2n cannot cast).
    decided = model_dtype(config, spec.dtype, (m.dtype for m in wire))
    param_dtype = decided.dtype
    params: list[DestinationParam] = []
    # (table entry, worker or tp rank) -> (local shape, zero boxes): the same in every layer
    local: dict[tuple[int, int], tuple] = {}
    for w in range(W):
        r = w % tp
        for name, p in ex.params:
            key = (id(p), w if p.kind.by_worker else r)
            got = local.get(key)
            if got is None:
                # MoE kinds: uneven EP gives workers different expert counts
                shape = p.kind.local_shape(s.resolve(p.dims), len(p.feeds),
                                           geo[w] if p.kind.by_worker else geo[0])
                got = local[key] = shape, p.kind.zero_boxes(shape, geo[w])
            params.append(DestinationParam(w, name, p.dtype or param_dtype, *got))
    family_notes = family.notes(config) if family.notes is not None else ()
    notes = tuple(n for n in (decided.note, placement.note, dense_ep_note(family, s, spec),
                              *family_notes) if n)
    return DestinationLayout(
        spec=str(spec), num_workers=W, params=tuple(params), bindings=bindings,
        skipped=skipped, aliases=dict(ex.aliases), unknown=unknown, notes=notes,
    )
