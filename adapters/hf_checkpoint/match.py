"""The expected tensors matched to the on-disk ones: wire names, experts, scales, leftovers.

transformers 5 keeps MoE experts fused in memory but writes them per expert
on disk, names a few blocks differently in memory than on disk, and some
families store a tensor in another dim order than the wire's; each family's
``HFNaming`` (``m2nkit.adapters.families``) holds that naming as data, and
this module applies it: every expected parameter gets its wire name and
its on-disk source (a name, a :class:`~m2nkit.adapters.experts.StackedExperts`
or a :class:`~.files.Permuted`), fp8 block-quantized weights get their
``weight_scale_inv`` (``m2nkit.adapters.families.quant``), and whatever is
missing, extra or of the wrong shape is refused, naming the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from m2nkit.manifest.meta import ParamMeta

from ..experts import StackedExperts, expert_name, group_expert_tensors, stack_experts
from ..families.quant import FP8, scale_name
from ..families.table import HFNaming
from ..module_names import wrapper_hint
from .config import Expected
from .errors import CheckpointError
from .files import Header, Permuted

__all__ = ["few", "permuted_wire", "match_expected", "add_scales"]


def few(names: Sequence[str], n: int = 5) -> str:
    """Up to ``n`` names quoted, and how many more (for messages)."""
    shown = ", ".join(f"'{x}'" for x in list(names)[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def permuted_wire(hf: HFNaming, wire: str) -> tuple[str, tuple[int, ...]] | None:
    """``(on-disk name, order)`` of a wire tensor that is a permuted on-disk tensor, or ``None``."""
    for leaf, (wire_leaf, order) in hf.permuted.items():
        if wire.endswith("." + wire_leaf):
            return wire[: -len(wire_leaf)] + leaf, tuple(order)
    return None


def match_expected(expected: Sequence[Expected], hf: HFNaming, headers: Mapping[str, Header],
           config_only: bool, root: Path, arch: str, *, quant: Any = None, skip: Any = None):
    """Pair every expected parameter with on-disk tensors; check shapes and leftovers.

    ``quant`` (``QuantizedWires``): fp8 block-quantized weights get their
    ``weight_scale_inv`` wire tensor (:func:`add_scales`). ``skip``: on-disk
    tensors the model does not have that vLLM skips on purpose (name ->
    reason or ``None``) are kept as wire tensors at the end, for the plan to
    list as skipped.
    """
    grouped = group_expert_tensors(headers, hf.experts_on_disk) if hf.experts_on_disk else {}
    shapes = {n: h.shape for n, h in headers.items()}
    dtypes = {n: h.dtype for n, h in headers.items()}
    params: list[ParamMeta] = []
    sources: dict[str, str | StackedExperts | Permuted] = {}
    used: set[str] = set()
    missing: list[str] = []
    stacked_hint = ""

    def where(name: str) -> str:
        return f"tensor '{name}' in {headers[name].file}"

    for name in headers:
        refusal = hf.refusal(name)
        if refusal:
            raise CheckpointError(f"{where(name)}: {refusal}")

    for exp in expected:
        permuted = hf.permuted_leaf(exp.name)
        if permuted is not None:
            disk = hf.disk_name(exp.name)
            wire_leaf, order = hf.permuted[permuted]
            wire = disk[: -len(permuted)] + wire_leaf
            shape = tuple(exp.shape[d] for d in order)
            h = headers.get(disk)
            if not config_only and h is None:
                missing.append(disk)
                continue
            if h is not None and h.shape != exp.shape:
                raise CheckpointError(f"{where(disk)} has shape {list(h.shape)}, but the config "
                                      f"({arch}) expects {list(exp.shape)}")
            params.append(ParamMeta(wire, exp.dtype if h is None else h.dtype, shape))
            sources[wire] = Permuted(disk, tuple(order))
            used.add(disk)
            continue
        leaf = hf.fused_leaf(exp.name)
        if leaf is not None:
            wire_leaf, parts = hf.fused_experts[leaf]
            prefix = hf.disk_name(exp.name)[: -len(leaf) - 1]
            wire = f"{prefix}.{wire_leaf}"
            num_experts, rows, cols = exp.shape
            part_shape = (rows // len(parts), cols)
            pattern_of = {p: hf.experts_on_disk[p] for p in parts}

            def expected_name(e: int, part: str, _prefix=prefix, _pat=pattern_of) -> str:
                return expert_name(_pat[part], _prefix, e)

            if config_only:
                stack = StackedExperts(wire, exp.dtype, tuple(
                    tuple(expected_name(e, p) for p in parts) for e in range(num_experts)
                ), part_shape)
            else:
                found = {}
                for e, ex in grouped.get(prefix, {}).items():
                    mine = {p: n for p, n in ex.items() if p in parts}
                    if mine:
                        found[e] = mine
                stacked = [n for n in hf.stacked_on_disk(prefix, leaf) if n in headers]
                if stacked:
                    # a family's published order (HFNaming.stacked_order) is that of the
                    # stacked in-memory leaf name; the wire name holds the wire's order
                    order = hf.stacked_order if stacked[0] == f"{prefix}.{leaf}" else ()
                    params.append(_stacked_on_disk(stacked, found, wire, exp, parts, headers,
                                                   arch, order))
                    sources[wire] = Permuted(stacked[0], order) if order else stacked[0]
                    used.add(stacked[0])
                    continue
                if not found:
                    missing.append(expected_name(0, parts[0]))
                    stacked_hint = stacked_hint or hf.stacked_on_disk(prefix, leaf)[0]
                    continue
                try:
                    stack = stack_experts(
                        wire, found, parts, num_experts,
                        shapes=shapes, dtypes=dtypes,
                        part_shape=part_shape, expected_name=expected_name,
                    )
                except ValueError as e:
                    raise CheckpointError(f"{root}: {e} (config: {arch})") from e
                used.update(stack.source_names())
            params.append(ParamMeta(wire, stack.dtype, stack.shape))
            sources[wire] = stack
            continue

        disk = hf.disk_name(exp.name)
        if config_only:
            if not exp.tied:
                params.append(ParamMeta(disk, exp.dtype, exp.shape))
                sources[disk] = disk
            continue
        h = headers.get(disk)
        if h is None:
            if not exp.tied:
                missing.append(disk)
            continue
        if h.shape != exp.shape:
            raise CheckpointError(
                f"{where(disk)} has shape {list(h.shape)}, but the config ({arch}) "
                f"expects {list(exp.shape)}"
            )
        params.append(ParamMeta(disk, h.dtype, h.shape))
        sources[disk] = disk
        used.add(disk)

    if quant:
        params = add_scales(params, sources, quant, headers, config_only, used, missing, arch)
    extra = [n for n in headers if n not in used]
    if skip is not None:
        for n in [n for n in extra if skip(n)]:
            params.append(ParamMeta(n, headers[n].dtype, headers[n].shape))
            sources[n] = n
        extra = [n for n in extra if n not in sources]
    # A checkpoint saved from a wrapped model (torch.compile's '_orig_mod.', DDP's
    # 'module.') misses every name and holds them all again under the prefix: say so.
    hint = wrapper_hint(extra)
    hint = f"; {hint}" if hint else ""
    if stacked_hint:
        hint += (f"; experts may also be stored stacked per layer, e.g. '{stacked_hint}' "
                 "(the per-expert tensors above or a stacked one, per MoE block)")
    if missing:
        raise CheckpointError(
            f"checkpoint {root} lacks {len(missing)} tensor(s) the config ({arch}) "
            f"expects: {few(missing)}{hint}"
        )
    if extra:
        raise CheckpointError(
            f"checkpoint {root} holds {len(extra)} tensor(s) the config ({arch}) does "
            f"not expect: {few(extra)} (first in {headers[extra[0]].file}){hint}"
        )
    return params, sources


def add_scales(params: list[ParamMeta], sources: dict, quant: Any, headers: Mapping[str, Header],
                config_only: bool, used: set[str], missing: list[str],
                arch: str) -> list[ParamMeta]:
    """Every fp8 block-quantized weight followed by its ``weight_scale_inv`` wire tensor.

    A plain weight ``X.weight`` takes ``X.weight_scale_inv`` from the files;
    stacked experts take each expert's per-part scales, stacked the same way
    (``<block>.experts.gate_up_proj.weight_scale_inv [E, 2*ceil(Im/n), ceil(H/k)]``).
    Config-only: the weight becomes float8 e4m3 and its scale float32 of
    the block shape (``m2nkit.adapters.families.quant``). A scale the files
    lack goes to ``missing``.

    Raises:
        CheckpointError: a scale of the wrong shape.
    """
    out: list[ParamMeta] = []
    for p in params:
        if not quant.matches(p.name):
            out.append(p)
            continue
        src = sources[p.name]
        parts = len(src.sources[0]) if isinstance(src, StackedExperts) else 1
        shape = quant.scale_shape(p.shape, parts)
        wire = scale_name(p.name)
        if config_only:
            out += [ParamMeta(p.name, FP8, p.shape), ParamMeta(wire, torch.float32, shape)]
            sources[wire] = wire
            continue
        out.append(p)
        if isinstance(src, StackedExperts):
            names = tuple(tuple(scale_name(n) for n in ex) for ex in src.sources)
            lacking = [n for ex in names for n in ex if n not in headers]
            if lacking:
                missing.append(lacking[0])
                continue
            first = headers[names[0][0]]
            found = (len(names), parts * first.shape[0], first.shape[1])
            if found != shape or any(headers[n].shape != first.shape for ex in names for n in ex):
                raise CheckpointError(
                    f"fp8 scales of '{p.name}' ('{names[0][0]}' ...) stack to {list(found)}, but "
                    f"its weight {list(p.shape)} and weight_block_size {quant.block} need "
                    f"{list(shape)} (config: {arch})")
            sources[wire] = StackedExperts(wire, first.dtype, names,
                                           (first.shape[0], first.shape[1]))
            used.update(n for ex in names for n in ex)
        else:
            disk = scale_name(src)
            h = headers.get(disk)
            if h is None:
                missing.append(disk)
                continue
            if h.shape != shape:
                raise CheckpointError(
                    f"tensor '{disk}' in {h.file} has shape {list(h.shape)}, but its weight "
                    f"{list(p.shape)} and weight_block_size {quant.block} need {list(shape)} "
                    f"(config: {arch})")
            sources[wire] = disk
            used.add(disk)
            first = h
        out.append(ParamMeta(wire, first.dtype, shape))
    return out


def _stacked_on_disk(stacked: Sequence[str], per_expert: Mapping, wire: str, exp: Expected,
                     parts: Sequence[str], headers: Mapping[str, Header], arch: str,
                     order: tuple[int, ...] = ()) -> ParamMeta:
    """The wire tensor of an expert tensor stored already stacked (``stacked[0]``).

    ``order``: the family's ``HFNaming.stacked_order``, the dims in which the
    files store it (``[E, in, out]``: ``(0, 2, 1)``); the wire
    tensor is the stored one permuted back, ``exp.shape``.

    Raises:
        CheckpointError: the block also holds per-expert tensors or a second
            stacked name, or the shape is not the config's ``[E, rows, cols]``.
    """
    name = stacked[0]
    h = headers[name]
    if len(stacked) > 1 or per_expert:
        other = stacked[1] if len(stacked) > 1 else next(iter(next(iter(per_expert.values())).values()))
        raise CheckpointError(
            f"tensor '{name}' in {h.file} holds the experts stacked, but the checkpoint also "
            f"holds '{other}' for the same experts; keep one form per MoE block")
    stored = tuple(exp.shape[d] for d in order) if order else exp.shape
    if h.shape != stored:
        E, rows, cols = exp.shape
        if order:
            raise CheckpointError(
                f"tensor '{name}' in {h.file} has shape {list(h.shape)}, but the config ({arch}) "
                f"expects stacked experts {list(stored)}: [experts, in, out], as {arch}'s "
                f"published checkpoints store them (transformers' save_pretrained may write "
                f"its in-memory [{E}, {rows}, {cols}]: transpose dims 1 and 2)")
        raise CheckpointError(
            f"tensor '{name}' in {h.file} has shape {list(h.shape)}, but the config ({arch}) "
            f"expects stacked experts {list(exp.shape)}: [experts, rows, cols] with each "
            f"expert's {' rows then its '.join(parts)} rows (a transposed [{E}, {cols}, {rows}] "
            "layout is not read)")
    return ParamMeta(wire, h.dtype, tuple(exp.shape))
