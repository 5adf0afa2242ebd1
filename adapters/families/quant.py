"""FP8 block quantization (``quant_method: fp8`` with ``weight_block_size``): scales as kinds.

DeepSeek-V3 and Kimi-K2 ship their linear weights as float8 e4m3 with one
float32 scale per ``[block_n, block_k]`` tile (``config.json``:
``"quantization_config": {"quant_method": "fp8", "weight_block_size": [128,
128], "activation_scheme": "dynamic"}``). On disk and on the wire every
quantized weight ``X.weight [N, K]`` (fp8) comes with
``X.weight_scale_inv [ceil(N/block_n), ceil(K/block_k)]`` (fp32); stacked
experts carry ``<block>.experts.gate_up_proj.weight_scale_inv
[E, 2*ceil(Im/block_n), ceil(H/block_k)]`` and
``<block>.experts.down_proj.weight_scale_inv [E, ceil(H/block_n),
ceil(Im/block_k)]``, stacked like their weights.

vLLM 0.33.0 gives each such layer an fp8 ``weight`` and a
``weight_scale_inv`` (``layers/quantization/fp8.py``
``Fp8LinearMethod.create_weights``: ``BlockQuantScaleParameter`` of
``ceil(N_local/block_n) x ceil(K_local/block_k)``; ``Fp8MoEMethod.create_weights``:
``w13_weight_scale_inv [E_local, 2*ceil(Im_local/block_n), ceil(H/block_k)]``,
``w2_weight_scale_inv [E_local, ceil(H/block_n), ceil(Im_local/block_k)]``)
and loads a scale with its layer's own loader, in block units
(``layers/linear.py``: ``load_column_parallel_weight`` /
``load_row_parallel_weight`` narrow by the scale's local size,
``MergedColumnParallelLinear.weight_loader_v2`` rounds shard offsets and
sizes up to blocks, ``adjust_block_scale_shard``;
``layers/fused_moe/routed_experts.py`` ``_load_w13``/``_load_w2`` narrow by
``scale rows // tp``). So a scale is the **same shard kind as its weight, at
block granularity** (:class:`BlockScale`), and a split is only valid where
every rank's share starts on a block boundary (``quantization/utils/
fp8_utils.py`` ``validate_fp8_block_shape``, ``validate_fp8_block_shape_moe``).

What m2nkit refuses that vLLM 0.33.0 sometimes accepts: a MoE split whose
``Im_local`` is not a multiple of the block, which vLLM may serve by
*refining* the scale grid at load time (``fused_moe/oracle/fp8.py``
``refine_fp8_moe_block_shape``: scales repeated to a finer block) or by
padding the shard (``pad_tp_shard_to_weight_blocks``). Neither is a copy of
a box of the wire tensor, so m2nkit refuses the layout and lists the tp
values that split on block boundaries.

Which parameters are quantized is the family table's word (``Param.quantized``:
vLLM builds the layer with ``quant_config``); embeddings, ``lm_head``
(``Fp8Config.get_quant_method`` returns ``None`` for them), norms and routers
(``GateLinear`` gets no ``quant_config``) stay in the model dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from .kinds import (Column, ExpertsW2, ExpertsW13, Geometry, Kind, Merged, Replicated,
                    ReplicatedMerged, Row)
from .sizes import cfg_get
from .table import Family, Param

__all__ = ["FP8", "SCALE_SUFFIX", "SCALE_FMTS", "Fp8Block", "fp8_block", "fp8_checkpoint_row",
           "BlockScale", "scale_name",
           "compressed_tensors_refusal",
           "stack_expert_scales",
           "quantized_params", "QuantizedWires", "quantize_fp8_blocks"]

#: The dtype of a block-quantized weight (vLLM ``create_fp8_weight_parameter``).
FP8 = torch.float8_e4m3fn
#: Appended to a weight's name (wire and vLLM alike) to name its scale.
SCALE_SUFFIX = "_scale_inv"
#: Largest finite float8 e4m3fn value (used by :func:`quantize_fp8_blocks`).
_FP8_MAX = 448.0


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``; ``w13_weight`` -> ``w13_weight_scale_inv``."""
    return name + SCALE_SUFFIX


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


#: ``quantization_config.scale_fmt`` values m2nkit carries (besides none: float32 scales).
#: vLLM 0.33.0 reads ``"ue8m0"`` only (``transformers_utils/config.py``: it then sets
#: ``VLLM_USE_DEEP_GEMM_E8M0=1``, so DeepGEMM's kernels round the scales to powers of two,
#: ``fp8_utils.requant_weight_ue8m0_inplace``); DeepSeek-V3.2 ships it.
SCALE_FMTS = ("ue8m0",)


@dataclass(frozen=True)
class Fp8Block:
    """``weight_block_size = [n, k]``: one scale per ``n`` output rows x ``k`` input columns.

    ``scale_fmt``: the config's ``quantization_config.scale_fmt``, ``"ue8m0"``
    (every scale a power of two; still float32 on disk and in vLLM's
    ``weight_scale_inv``) or ``None``. It changes no shape, dtype or box: the
    scales travel as stored either way.
    """

    n: int
    k: int
    scale_fmt: str | None = None

    def per_dim(self, ndim: int) -> tuple[int, ...]:
        """Block size per dim of a weight of ``ndim`` dims (stacked experts: 1 per expert)."""
        return (1,) * (ndim - 2) + (self.n, self.k)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``ceil`` of ``shape`` over the blocks (the scale of a weight of ``shape``)."""
        return tuple(_ceil(a, b) for a, b in zip(shape, self.per_dim(len(shape))))

    def __str__(self) -> str:
        return f"[{self.n}, {self.k}]"


def _qconfig(config: Any) -> Mapping | None:
    q = cfg_get(config, "quantization_config", default=None)
    if q is None or isinstance(q, Mapping):
        return q
    return q.to_dict() if hasattr(q, "to_dict") else vars(q)


def fp8_block(config: Any, architecture: str = "this model") -> Fp8Block | None:
    """The fp8 block size (and ``scale_fmt``) of ``config``'s ``quantization_config``; ``None`` without one.

    Raises:
        ValueError: a ``quantization_config`` m2nkit does not lay out: another
            ``quant_method``, fp8 without ``weight_block_size`` (per-tensor
            scales), a block that is not two positive ints, a static
            activation scheme (vLLM ``Fp8Config.__init__`` refuses it with
            blocks), a ``scale_fmt`` other than :data:`SCALE_FMTS` (named with the
            valid ones), or ``ignored_layers``/``modules_to_not_convert``.
    """
    q = _qconfig(config)
    if not q:
        return None
    method = q.get("quant_method")
    valid = "quant_method 'fp8' with weight_block_size [n, k] (as DeepSeek-V3 ships), or none"
    if method != "fp8":
        raise ValueError(f"{architecture}: quantization_config quant_method {method!r} is not "
                         f"supported; supported: {valid}")
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError(f"{architecture}: fp8 quantization_config without weight_block_size "
                         f"(per-tensor scales) is not supported; supported: {valid}")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{architecture}: quantization_config weight_block_size {block!r} must "
                         "be two positive ints [n, k] (vLLM Fp8Config)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{architecture}: fp8 weight_block_size needs activation_scheme "
                         f"'dynamic', got {scheme!r} (vLLM Fp8Config refuses it)")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt is not None and scale_fmt not in SCALE_FMTS:
        raise ValueError(f"{architecture}: quantization_config scale_fmt {scale_fmt!r} is not "
                         f"supported; valid: {', '.join(repr(f) for f in SCALE_FMTS)} "
                         "(power-of-two scales, as DeepSeek-V3.2 ships) or none "
                         "(float32 scales)")
    ignored = q.get("ignored_layers") or q.get("modules_to_not_convert")
    if ignored:
        raise ValueError(f"{architecture}: quantization_config ignored_layers/"
                         f"modules_to_not_convert {list(ignored)[:3]} is not supported by "
                         "m2nkit (every linear layer of the table is taken as quantized)")
    return Fp8Block(block[0], block[1], scale_fmt)


def fp8_checkpoint_row(block: Fp8Block) -> tuple[str, dict]:
    """What ``m2nkit plan`` shows of an fp8 checkpoint: ``(row text, json)``.

    The json is ``{"weight_block_size": [n, k], "scale_fmt": "ue8m0" or None}``.
    """
    text = f"weight_block_size {block}, e4m3 weights with float32 weight_scale_inv"
    if block.scale_fmt == "ue8m0":
        text += "; scale_fmt ue8m0: scales are powers of two"
    return text, {"weight_block_size": [block.n, block.k], "scale_fmt": block.scale_fmt}


def _describe_compressed(q: Mapping) -> str:
    """``int4 weights, group size 32, strategy group, symmetric, format pack-quantized``."""
    groups = q.get("config_groups") or {}
    parts = []
    for group in (groups.values() if isinstance(groups, Mapping) else ()):
        w = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(w, Mapping):
            continue
        what = [f"{w.get('type', '?')}{w.get('num_bits', '?')} weights"]
        if w.get("group_size"):
            what.append(f"group size {w['group_size']}")
        if w.get("strategy"):
            what.append(f"strategy {w['strategy']}")
        if w.get("symmetric") is not None:
            what.append("symmetric" if w["symmetric"] else "asymmetric")
        if group.get("input_activations"):
            what.append("quantized activations")
        parts.append(", ".join(what))
    described = "; ".join(dict.fromkeys(parts)) or "weights"
    return described + (f", format {q['format']}" if q.get("format") else "")


def compressed_tensors_refusal(config: Any, architecture: str = "this model") -> str | None:
    """Why m2nkit refuses ``config``: a ``compressed-tensors`` ``quantization_config``.

    Looked for on the config and on its ``text_config`` (a multimodal
    wrapper's language model: Kimi-K2.5 ships ``text_config.quantization_config``
    ``{"quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {... "weights": {"num_bits": 4, "type": "int",
    "group_size": 32, "strategy": "group", "symmetric": true}}}``). Such a
    checkpoint stores each quantized linear as packed integers
    (``weight_packed`` int32, ``weight_scale`` per group, ``weight_shape``;
    vLLM ``layers/quantization/compressed_tensors/``, e.g.
    ``CompressedTensorsWNA16.create_weights``), not as boxes of the
    unquantized tensors a trainer holds, so no m2nkit layout (table,
    traced, checkpoint reader) plans it: a plan of the bf16 tensors against
    it would be silently wrong. ``None`` when there is no such config.

    Returns:
        One sentence naming the architecture, where the config sits, the
        method, bits, group size and format, and what is supported: the
        unquantized form, the same config without that ``quantization_config``.
    """
    for where, cfg in (("", config), ("text_config.", _get(config, "text_config"))):
        q = _qconfig(cfg) if cfg is not None else None
        if not q or q.get("quant_method") != "compressed-tensors":
            continue
        return (f"{architecture}: {where}quantization_config is compressed-tensors "
                f"({_describe_compressed(q)}), which m2nkit does not lay out (vLLM loads "
                "packed integer weights with per-group scales, not boxes of the unquantized "
                "tensors a trainer holds); supported: the unquantized (bf16) form, the same "
                f"config without {where}quantization_config")
    return None


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


class BlockScale(Kind):
    """The ``weight_scale_inv`` of an fp8 block-quantized parameter of kind ``base``.

    Same boxes as the weight, in block units: the weight's box
    ``[a, b)`` on a dim with block ``B`` is the scale's ``[a/B, ceil(b/B))``,
    the local offset ``o`` is ``o/B`` (every start is a block boundary once
    :meth:`violation` holds; only the end of a dim may be ragged). Local
    shape ``ceil(weight local shape / block)``; wire shape
    ``ceil(weight wire shape / block)`` (stacked gate/up:
    ``2*ceil(Im/block_n)`` rows per expert). Loads with the base kind's
    loader on the scale tensors, as vLLM does (module docstring).

    Attributes:
        base: the weight's kind (column, row, merged, replicated,
            replicated_merged, w13, w2).
        block: the :class:`Fp8Block`.
        parts: the weight's feed parts (for the merged rules).
    """

    by_worker = False
    rule_order = 6
    source = ("vllm layers/quantization/fp8.py Fp8LinearMethod/Fp8MoEMethod.create_weights, "
              "quantization/utils/fp8_utils.py validate_fp8_block_shape(_moe)")

    def __init__(self, base: Kind, block: Fp8Block, parts: tuple = ()) -> None:
        if not isinstance(base, (Replicated, Column, Row, Merged, ReplicatedMerged,
                                 ExpertsW13, ExpertsW2)):
            raise ValueError(f"fp8 block scales of shard kind {base.name!r} are not supported")
        self.base, self.block, self.parts = base, block, tuple(parts)
        self.name = f"{base.name}_scale"
        self.by_worker = base.by_worker

    def wire_shape(self, dims, part, s):
        w = self.base.wire_shape(dims, part, s)
        if isinstance(self.base, ExpertsW13):
            E, rows, H = w
            return (E, 2 * _ceil(rows // 2, self.block.n), _ceil(H, self.block.k))
        return self.block.scale_shape(w)

    def local_shape(self, dims, parts, g):
        return self.block.scale_shape(self.base.local_shape(dims, parts, g))

    def _block_geometry(self, g: Geometry) -> Geometry:
        """``g`` with the expert sizes the base kind reads in block units."""
        n, k = self.block.n, self.block.k
        if isinstance(self.base, ExpertsW13):
            return replace(g, Im=g.Im // n, im_local=g.im_local // n, H=_ceil(g.H, k))
        if isinstance(self.base, ExpertsW2):
            return replace(g, H=_ceil(g.H, n), Im=g.Im // k, im_local=g.im_local // k)
        return g

    def boxes(self, shape, part, g):
        if isinstance(self.base, ReplicatedMerged):
            at = self.base.row_offset(part, g, self.block.n)
            return [(tuple((0, d) for d in shape), (at, *(0,) * (len(shape) - 1)))]
        return self.base.boxes(shape, part, self._block_geometry(g))

    def load(self, param, wire, part, g):
        if isinstance(self.base, ReplicatedMerged):
            self.base.load(param, wire, part, g, block_n=self.block.n)
        else:
            self.base.load(param, wire, part, g)

    def rule_key(self, syms):
        return ("fp8", self.base.rule_key(syms), self.parts)

    def violation(self, name, syms, s, tp, dp, ep):
        n, k = self.block.n, self.block.k
        base = self.base
        where = f"fp8 weight_block_size {self.block}"
        src = "vLLM quantization/utils/fp8_utils.py"

        def bad(what: str, value: int, b: int, which: str, fn: str) -> str:
            return (f"{name}: {where} needs {what}={value} to be a multiple of block_{which}={b} "
                    f"(each rank's share must start on a block; {src} {fn})")

        if isinstance(base, (Column, Merged)):
            rows = s.resolve((syms[0],))[0]
            if rows % tp:
                return None                                   # the base rule reports it
            if tp > 1 and (rows // tp) % n:
                return bad(f"{s.label(syms[0])}/tp={tp}", rows // tp, n, "n",
                           "validate_fp8_block_shape")
            if tp == 1 and isinstance(base, Merged) and rows % n:
                return bad(s.label(syms[0]), rows, n, "n", "validate_fp8_block_shape (merged)")
        elif isinstance(base, Row):
            cols = s.resolve((syms[1],))[0]
            if tp > 1 and not cols % tp and (cols // tp) % k:
                return bad(f"{s.label(syms[1])}/tp={tp}", cols // tp, k, "k",
                           "validate_fp8_block_shape")
        elif isinstance(base, ReplicatedMerged):
            for part in self.parts[:-1]:
                rows = s.resolve((part[-1],))[0]
                if rows % n:
                    return bad(s.label(part[-1]), rows, n, "n",
                               "validate_fp8_block_shape (merged, all parts but the last)")
        elif isinstance(base, (ExpertsW13, ExpertsW2)):
            W = tp * dp
            use_ep = ep and W > 1
            moe_tp = 1 if use_ep else W
            if s.Im % moe_tp:
                return None                                   # the base rule reports it
            im = s.Im // moe_tp
            what = s.label("Im") + ("" if moe_tp == 1 else f"/(dp*tp)={moe_tp}")
            if im % n:
                return bad(what, im, n, "n", "validate_fp8_block_shape_moe")
            if (tp > 1 or moe_tp > 1) and im % k:
                return bad(what, im, k, "k", "validate_fp8_block_shape_moe")
        return None


def quantized_params(family: Family, config: Any) -> tuple[Param, ...]:
    """``family.params`` as vLLM builds them for ``config``'s quantization.

    Without an fp8 block ``quantization_config`` (or for a family without
    quantized parameters) the table as it is. Otherwise every
    ``Param.quantized`` weight becomes float8 e4m3 and gains its
    ``weight_scale_inv`` (:class:`BlockScale`, float32, fed by the wire
    scales, aliased where the weight is): right after it, except stacked
    experts, whose two scales follow both weights (``Fp8MoEMethod.create_weights``
    registers ``w13_weight``, ``w2_weight``, then the scales).

    Raises:
        ValueError: an unsupported ``quantization_config`` (:func:`fp8_block`).
    """
    if not any(p.quantized for p in family.params):
        return family.params
    block = fp8_block(config, family.architecture)
    if block is None:
        return family.params
    out: list[Param] = []
    pending: list[Param] = []
    for p in family.params:
        experts = isinstance(p.kind, (ExpertsW13, ExpertsW2))
        if not experts:
            out += pending
            pending = []
        if not p.quantized:
            out.append(p)
            continue
        out.append(replace(p, dtype=FP8))
        scale = Param(scale_name(p.name), BlockScale(p.kind, block, tuple(q for _, q in p.feeds)),
                      p.dims, feeds=tuple((scale_name(w), q) for w, q in p.feeds), when=p.when,
                      aliases=tuple(scale_name(a) for a in p.aliases), dtype=torch.float32)
        (pending if experts else out).append(scale)
    return tuple(out + pending)


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{L\})", template)
    return re.compile("^" + "".join(r"\d+" if x == "{L}" else re.escape(x) for x in parts) + "$")


class QuantizedWires:
    """Which wire tensors of a family are fp8 block-quantized for a config.

    ``block`` is ``None`` when nothing is (no quantization_config, or a
    family without quantized parameters). Used by the checkpoint reader
    (``m2nkit.adapters.hf_checkpoint``) and the tiny-model builder, which
    know no family: a wire name matches when a ``Param.quantized`` entry
    of the table is fed by it.

    Raises:
        ValueError: an unsupported ``quantization_config`` (:func:`fp8_block`).
    """

    def __init__(self, family: Family, config: Any) -> None:
        quantized = [p for p in family.params if p.quantized]
        self.block: Fp8Block | None = fp8_block(config, family.architecture) if quantized else None
        self._rx = [_template_regex(w) for p in quantized for w, _ in p.feeds]
        self._hf = family.hf

    def matches_disk(self, name: str) -> bool:
        """Is on-disk tensor ``name`` a quantized weight? Per-expert tensors
        (``...experts.{e}.gate_proj.weight``) count as their stacked wire tensor."""
        from ..experts import group_expert_tensors

        for prefix, per in group_expert_tensors([name], self._hf.experts_on_disk).items():
            part = next(iter(next(iter(per.values()))))
            for wire_leaf, parts in self._hf.fused_experts.values():
                if part in parts:
                    return self.matches(f"{prefix}.{wire_leaf}")
        return self.matches(name)

    def __bool__(self) -> bool:
        return self.block is not None

    def matches(self, wire: str) -> bool:
        """Is wire tensor ``wire`` (a weight) quantized?"""
        return self.block is not None and any(rx.match(wire) for rx in self._rx)

    def scale_shape(self, weight_shape: tuple[int, ...], stacked_parts: int = 1) -> tuple[int, ...]:
        """The scale of a weight of ``weight_shape`` (stacked experts: ``stacked_parts``
        row parts per expert, each rounded up on its own)."""
        assert self.block is not None
        if len(weight_shape) == 3:
            E, rows, cols = weight_shape
            per = _ceil(rows // stacked_parts, self.block.n)
            return (E, stacked_parts * per, _ceil(cols, self.block.k))
        return self.block.scale_shape(tuple(weight_shape))


def quantize_fp8_blocks(tensors: Mapping[str, torch.Tensor], block: Fp8Block,
                        quantized: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """fp8-block-quantize the 2-D tensors for which ``quantized(name)`` holds (for tiny models).

    Each becomes ``name`` in float8 e4m3fn plus ``name + "_scale_inv"``
    (float32, ``[ceil(N/n), ceil(K/k)]``, right after it): per block,
    ``scale = max|w| / 448`` and ``w_fp8 = w / scale``, the layout DeepSeek-V3
    checkpoints use (``w ~ w_fp8 * scale_inv``). With ``block.scale_fmt ==
    "ue8m0"`` each scale is rounded up to a power of two first (``2 **
    ceil(log2(scale))``, as DeepSeek-V3.2's are). Other tensors pass through.
    """
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not quantized(name):
            out[name] = w
            continue
        N, K = w.shape
        rn, rk = _ceil(N, block.n), _ceil(K, block.k)
        padded = torch.zeros(rn * block.n, rk * block.k, dtype=torch.float32)
        padded[:N, :K] = w.float()
        tiles = padded.view(rn, block.n, rk, block.k)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / _FP8_MAX
        if block.scale_fmt == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (tiles / scale[:, None, :, None]).view(rn * block.n, rk * block.k)[:N, :K]
        out[name] = q.to(FP8).contiguous()
        out[scale_name(name)] = scale.contiguous()
    return out


def stack_expert_scales(hf: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``..._scale_inv`` tensors stacked like their weights (full tensors; for the
    reference loader and tests).

    ``<prefix>.experts.gate_up_proj.weight_scale_inv[e] = cat(gate_scale_e, up_scale_e)``,
    ``<prefix>.experts.down_proj.weight_scale_inv[e] = down_scale_e``; ``hf`` is the
    family's ``HFNaming`` (its per-expert weight patterns + ``_scale_inv``). Other
    tensors pass through; a checkpoint without such scales comes back unchanged.
    """
    from ..experts import expert_name, group_expert_tensors

    patterns = {part: pat + SCALE_SUFFIX for part, pat in hf.experts_on_disk.items()}
    if not patterns:
        return dict(tensors)
    grouped = group_expert_tensors(tensors, patterns)
    if not grouped:
        return dict(tensors)
    used = {n for per in grouped.values() for ex in per.values() for n in ex.values()}
    out = {n: t for n, t in tensors.items() if n not in used}
    for prefix, per in grouped.items():
        for wire_leaf, parts in hf.fused_experts.values():
            rows = [torch.cat([tensors[expert_name(patterns[p], prefix, e)] for p in parts])
                    for e in range(max(per) + 1)]
            out[scale_name(f"{prefix}.{wire_leaf}")] = torch.stack(rows)
    return out
