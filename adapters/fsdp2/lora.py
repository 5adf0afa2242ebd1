"""PEFT LoRA merged shard by shard: what ``fsdp2_source(model, merge_lora=True)`` sends.

A trainer that trains LoRA adapters (peft ``LoraModel``) under FSDP2 must
give vLLM the weights its forward uses: ``W + scaling * B @ A`` per target
module. Gathering ``W`` to merge it is exactly the cost m2nkit removes, so
every rank merges its own box of ``W``: rows ``R`` and columns ``C`` of
``W [out, in]`` take rows ``R`` of ``B [out, r]`` and columns ``C`` of
``A [r, in]``. FSDP2 shards ``A`` over its ``r`` rows, so ``A`` is gathered
(it is small, ``r x in``); ``B`` comes from the rank's own shard when its
rows are ``W``'s rows on every rank (``fully_shard`` cuts both the same way
on dim 0) and is gathered otherwise (a TP-sharded ``W`` with a whole ``B``).
The gathers run once per round at the start of ``iter_local``, on every
rank, in manifest order, before any byte moves: a provider never calls a
collective. ``W`` itself is never gathered.

The math is peft's (0.21, ``tuners/lora/layer.py``: ``Linear.get_delta_weight``
and ``LoraLayer.merge`` with ``safe_merge=False``, what ``merge_and_unload``
does): ``delta = (B @ A) * scaling[adapter]`` in ``B``'s dtype (computed in
fp32 on CPU for fp16/bf16 ``B`` and cast back), then ``W += delta`` in
``W``'s dtype, adapter by adapter in ``active_adapters`` order; with
``lora_bias`` also ``bias += B.bias * scaling``. A layer whose adapters are
disabled, or already merged, sends ``W`` as it is (peft's forward then uses
the base layer alone). A rank's ``B[R] @ A[:, C]`` is the block of the
whole ``B @ A`` as long as the BLAS computes those rows the same way (the
tests hold fp32 bit for bit against ``merge_and_unload``); a BLAS that takes
another kernel for a block of one to three rows can change the last bit of
such a row's delta.

LoRA layers are recognised by their shape (``base_layer``, ``lora_A``,
``lora_B``, ``scaling``: peft's ``LoraLayer``), so peft is not imported.
Refused, on every rank, before any traffic: LoRA variants (DoRA's
``lora_magnitude_vector`` and peft's other ``lora_variant``s), embedding and
convolution LoRA, ``fan_in_fan_out``, a target whose base weight maps to no
wire tensor vLLM takes (naming the module and the closest known name), and
LoRA weights outside a layer of that shape.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..families.table import Family
from .errors import FSDP2SourceError
from .params import Weight, is_dtensor, live

__all__ = ["LoraMerge", "plan_lora_merge", "adapter_param_ids", "ADAPTER_SUBMODULES"]

#: Sub-containers of a peft ``LoraLayer`` that hold adapter weights
#: (``LoraLayer.adapter_layer_names``).
ADAPTER_SUBMODULES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                      "lora_magnitude_vector")


def _is_lora_layer(m: torch.nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("base_layer", "lora_A", "lora_B", "scaling"))


def _base_layer(m: torch.nn.Module) -> torch.nn.Module:
    base = m.base_layer
    while hasattr(base, "base_layer"):  # peft get_base_layer: wrappers may nest
        base = base.base_layer
    return base


@dataclass
class _Target:
    """One LoRA layer to merge: its base weight (and bias) and adapters, with gather choices."""

    module: str                       # the LoRA layer's name (named_modules)
    layer: torch.nn.Module            # the peft LoraLayer
    adapters: tuple[str, ...]         # merged in this order
    weight: Weight
    bias: Weight | None               # merged too when an adapter has lora_bias
    gather: dict[tuple[str, str], bool] = field(default_factory=dict)  # (adapter, A|B|Bb)


class LoraMerge:
    """The LoRA layers of one model, merged into their base weights at send time.

    :meth:`gather` (every rank, once per round, before any provider runs)
    collects what a rank needs beyond its own shards; :meth:`merged`
    (inside a provider) merges one local box; :meth:`release` drops the
    gathered tensors after the round.
    """

    def __init__(self, targets: Sequence[_Target], boxes: Callable[[Weight], dict | None]):
        self._targets = tuple(targets)
        self._boxes = boxes
        self._full: dict[tuple[int, str, str], torch.Tensor] = {}
        self._by_param = {id(t.weight.param): (t, "weight") for t in self._targets}
        self._by_param.update({id(t.bias.param): (t, "bias") for t in self._targets
                               if t.bias is not None})

    def merges(self, x: Weight) -> bool:
        """Whether wire tensor ``x`` is a base weight or bias this merge changes."""
        hit = self._by_param.get(id(x.param))
        return hit is not None and bool(hit[0].adapters) and (
            hit[1] == "weight" or _has_lora_bias(hit[0]))

    def gather(self) -> None:
        """Gather every ``A`` (and ``B`` where needed) in manifest order: a collective on every rank."""
        self._full = {}
        for t in self._targets:
            for a in t.adapters:
                for part, (mod, attr) in _parts(t, a).items():
                    if t.gather[(a, part)]:
                        self._full[(id(t.layer), a, part)] = _full_tensor(getattr(mod, attr))

    def release(self) -> None:
        self._full = {}

    def merged(self, x: Weight, local: torch.Tensor, rank: int) -> torch.Tensor:
        """``local`` (this rank's box of base weight or bias ``x``) with every adapter merged."""
        t, what = self._by_param[id(x.param)]
        boxes = self._boxes(x)
        box = None if boxes is None else boxes[rank]
        rows = slice(None) if box is None else slice(*box[0])
        out = local
        for a in t.adapters:
            scaling = t.layer.scaling[a]
            if what == "weight":
                cols = slice(None) if box is None else slice(*box[1])
                A = self._part(t, a, "A")[:, cols]
                B = self._part(t, a, "B")
                B = B[rows] if t.gather[(a, "B")] else B
                out = (out + _delta(B, A, scaling)).to(local.dtype)
            elif "Bb" in _parts(t, a):
                Bb = self._part(t, a, "Bb")
                Bb = Bb[rows] if t.gather[(a, "Bb")] else Bb
                out = (out + Bb * scaling).to(local.dtype)
        return out

    def _part(self, t: _Target, a: str, part: str) -> torch.Tensor:
        if t.gather[(a, part)]:
            return self._full[(id(t.layer), a, part)]
        mod, attr = _parts(t, a)[part]
        return live(mod, attr, f"{t.module}.{part}", is_dtensor(getattr(mod, attr)))


def _has_lora_bias(t: _Target) -> bool:
    return any((getattr(t.layer, "lora_bias", None) or {}).get(a, False) for a in t.adapters)


def _parts(t: _Target, a: str) -> dict[str, tuple[torch.nn.Module, str]]:
    """``A``, ``B`` (and ``Bb``, ``B``'s bias, with ``lora_bias``): (owner module, attribute)."""
    out = {"A": (t.layer.lora_A[a], "weight"), "B": (t.layer.lora_B[a], "weight")}
    if (getattr(t.layer, "lora_bias", None) or {}).get(a, False):
        out["Bb"] = (t.layer.lora_B[a], "bias")
    return out


def _delta(B: torch.Tensor, A: torch.Tensor, scaling: float) -> torch.Tensor:
    """peft ``Linear.get_delta_weight``: ``(B @ A) * scaling`` in ``B``'s dtype (fp32 on CPU for halves)."""
    dtype = B.dtype
    cast = B.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast:
        A, B = A.float(), B.float()
    out = (B @ A) * scaling
    return out.to(dtype) if cast else out


def _full_tensor(p: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(p):
        return p.detach()
    full = p.full_tensor()
    wait = getattr(full, "wait", None)  # AsyncCollectiveTensor
    return (wait() if callable(wait) else full).detach()


def adapter_param_ids(model: torch.nn.Module) -> set[int]:
    """``id`` of every adapter weight of every LoRA layer of ``model``."""
    ids = set()
    for _, m in model.named_modules():
        if _is_lora_layer(m):
            for sub in ADAPTER_SUBMODULES:
                container = getattr(m, sub, None)
                if isinstance(container, torch.nn.Module):
                    ids.update(id(p) for p in container.parameters())
    return ids


def plan_lora_merge(model: torch.nn.Module, params: Sequence[Weight], family: Family,
                    known: set[str], boxes: Callable[[Weight], dict | None]) -> LoraMerge | None:
    """The merge of every LoRA layer of ``model`` (``None`` when it has none), checked.

    Args:
        params: the model's weights with adapter weights already left out.
        known: wire names vLLM takes for the model's config.
        boxes: every root rank's box of a weight (``None`` for an unsharded model).

    Raises:
        FSDP2SourceError: see the module docstring; the same on every rank.
    """
    by_id = {id(x.param): x for x in params}
    hf = family.hf
    targets = []
    for name, m in model.named_modules():
        if not _is_lora_layer(m):
            continue
        if getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
            adapters: tuple[str, ...] = ()
        else:
            active = getattr(m, "active_adapters", None) or getattr(m, "active_adapter", ())
            active = (active,) if isinstance(active, str) else tuple(active)
            adapters = tuple(a for a in active if a in m.lora_A)
        base = _base_layer(m)
        where = f"fsdp2_source: LoRA layer '{name}'"
        variants = getattr(m, "lora_variant", None) or {}
        for a in adapters:
            if a in variants or (getattr(m, "use_dora", None) or {}).get(a, False):
                kind = type(variants[a]).__name__ if a in variants else "DoRA"
                raise FSDP2SourceError(
                    f"{where}: adapter '{a}' is a LoRA variant ({kind}); merge_lora merges "
                    "plain LoRA (W + scaling * B @ A) only: merge it with peft "
                    "(merge_and_unload) before sending")
        if adapters and (len(getattr(m, "lora_embedding_A", {}) or {}) or
                         not isinstance(base, torch.nn.Linear)):
            raise FSDP2SourceError(
                f"{where}: its base layer is a {type(base).__name__}; merge_lora merges LoRA "
                "on nn.Linear layers only (embedding and convolution LoRA are not supported)")
        if adapters and getattr(m, "fan_in_fan_out", False):
            raise FSDP2SourceError(f"{where}: fan_in_fan_out=True (a transposed weight) is not "
                                   "supported by merge_lora")
        weight = by_id.get(id(base.weight))
        if weight is None:  # a tied weight listed under another name is found by identity
            raise FSDP2SourceError(f"{where}: its base weight is not a parameter of the model")
        disk = hf.disk_name(weight.clean)
        if (disk not in known or hf.fused_leaf(weight.clean) is not None
                or hf.permuted_leaf(disk) is not None):
            close = difflib.get_close_matches(disk, sorted(known), n=1, cutoff=0.0)
            raise FSDP2SourceError(
                f"{where} (adapters {list(m.lora_A)}) targets a module whose weight "
                f"'{weight.clean}' maps to no {family.architecture} tensor vLLM takes as it is, "
                f"so its merged weight has nowhere to go; the closest known name is "
                f"'{close[0] if close else '?'}' ({family.module}); target the modules of "
                "the family's wire tensors")
        bias = by_id.get(id(base.bias)) if getattr(base, "bias", None) is not None else None
        t = _Target(name, m, adapters, weight, bias)
        if bias is None and _has_lora_bias(t):
            raise FSDP2SourceError(f"{where}: lora_bias=True, but the base layer has no bias "
                                   "(peft refuses to merge it too)")
        _choose_gathers(t, boxes)
        targets.append(t)
    if not targets:
        return None
    order = {id(x.param): i for i, x in enumerate(params)}
    targets.sort(key=lambda t: order[id(t.weight.param)])  # manifest order: same on every rank
    return LoraMerge(targets, boxes)


def _choose_gathers(t: _Target, boxes: Callable[[Weight], dict | None]) -> None:
    """Which of ``A``, ``B``, ``B.bias`` to gather: decided from every rank's boxes alike.

    ``A`` unless every rank holds it whole; ``B`` (``B.bias``) unless on every
    rank its rows are the base weight's (bias's) rows and it is whole on dim 1.
    A plain (not ``DTensor``) part of a sharded model counts as gathered: it
    is whole, and each rank slices its box out of it.
    """
    w_boxes = boxes(t.weight)
    for a in t.adapters:
        for part, (mod, attr) in _parts(t, a).items():
            p = getattr(mod, attr)
            x = Weight(f"{t.module}.{part}", "", mod, attr, p)
            mine = boxes(x) if is_dtensor(p) else None
            shape = tuple(int(n) for n in p.shape)
            whole = tuple((0, n) for n in shape)
            if mine is None:
                t.gather[(a, part)] = w_boxes is not None
            elif part == "A":
                t.gather[(a, part)] = any(b != whole for b in mine.values())
            else:
                ref = w_boxes if part == "B" else boxes(t.bias)
                t.gather[(a, part)] = ref is None or any(
                    mine[r][0] != ref[r][0] or mine[r][1:] != whole[1:] for r in mine)
