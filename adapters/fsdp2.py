"""A live FSDP2 (``fully_shard``) model as an M2N source: every rank sends its own shard.

RL trainers built on FSDP2 (verl, OpenRLHF, TRL, prime-rl, torchtitan) push
weights to vLLM either with ``full_tensor()`` per parameter (an all-gather of
every tensor on every rank) or a full state dict gathered to rank 0. That is
exactly the cost m2nkit removes, so :func:`fsdp2_source` never gathers: its
metadata is read off each parameter's ``DTensor`` spec (global shape, device
mesh, placements; no collective, identical on every rank), and its
``iter_local`` hands over each rank's ``to_local()`` shard, cast to the wire
dtype, one tensor at a time. It refuses what it cannot send shard to shard
(``Partial`` placements, a parameter that is not a ``DTensor`` on a sharded
model, a name no vLLM parameter takes) on every rank, before any traffic.
With ``merge_lora=True`` it sends peft LoRA layers merged into their base
weights, each rank merging its own shard (``m2nkit.adapters.fsdp2_lora``).

Names. In-memory names become wire names (Hugging Face checkpoint names)
through the model's family (``m2nkit.adapters.families``: renames, fused
experts, per-expert names), after the wrapper prefixes of
``torch.compile``, activation checkpointing, FSDP1, DDP and PEFT are
stripped (``m2nkit.adapters.module_names``). This module holds no family
knowledge.

Which rows a rank holds. FSDP2 shards the tensor it is given (a plain
parameter, or the local tensor of a TP/EP ``DTensor``) on its shard dim with
``torch.chunk`` and pads the *storage* to ``ceil(n/k)`` rows per rank, but
the ``DTensor``'s local tensor is the unpadded ``narrow`` (torch
``distributed/fsdp/_fully_shard/_fsdp_param.py``,
``FSDPParam._init_sharded_param``, ``_chunk_with_empty`` in
``_fsdp_common.py``): rank ``i`` of ``k`` holds rows
``[i*c, min((i+1)*c, n))``, ``c = ceil(n/k)``, ranks past the end hold
``(0, ...)``. On top of tensor parallelism FSDP2 shards each TP rank's local
rows, i.e. right to left, and marks the data-parallel axis
``_StridedShard(dim, split_factor=<TP shards of that dim>)``
(``FSDPParam._init_sharding_spec_tp``). :func:`dtensor_box` applies that
order: the axes after a ``_StridedShard`` that shard the same dim split
first, then the strided axis splits each of their chunks. Every rank holds
one box. ``_StridedShard``'s own split (``placement_types.py``,
``_StridedShard._split_tensor``: ``split_factor`` chunks, each cut in
``mesh size`` chunks, a rank taking one of each) describes the same rows
when every split is even, and other rows when it is not (7 rows over
``tp=2`` then ``dp=3``: FSDP2 gives dp rank 2 / tp rank 0 no row and dp
rank 2 / tp rank 1 row 6; the strided split says the opposite); the tests
hold the rule against real ``to_local()`` data, uneven shapes included.

Parameters on a sub-mesh (norms of an FSDP+TP model live on the
data-parallel sub-mesh of each TP rank) are replicated over the other axes
of the root mesh (``DeviceMesh._get_root_mesh``), so every rank declares the
same owners for them. Pipeline parallelism (stages holding different layers)
is not supported.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from m2nkit.manifest import (
    M2NManifestEntry,
    ManifestM2NWeightSource,
    Piece,
    PieceLayout,
    Replicate,
    Shard,
    SourceLayout,
    chunk_bounds,
)
from m2nkit.manifest.pieces import Box, box_volume

from .experts import expert_pattern_regex
from .families import family_for
from .families.table import Family
from .module_names import strip_wrappers

__all__ = ["FSDP2SourceError", "FSDP2Source", "fsdp2_source", "dtensor_box", "wire_dtype_rule"]


class FSDP2SourceError(ValueError):
    """A model :func:`fsdp2_source` cannot send shard to shard (raised on every rank)."""


# --------------------------------------------------------------------------
# layout: which box each rank holds


def _placement_kind(p: object) -> tuple[str, int, int]:
    """``(kind, dim, split_factor)`` of a torch placement; kind in shard/strided/replicate/other."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # not a Shard subclass in torch 2.13; test it first anyway
        return "strided", int(p.dim), int(p.split_factor)
    if isinstance(p, TShard):
        return "shard", int(p.dim), 1
    if isinstance(p, TReplicate):
        return "replicate", -1, 1
    return "other", -1, 1


def _split_order(axes: list[tuple[int, str, int]]) -> list[int]:
    """Order in which mesh axes split one tensor dim (``axes``: ``(axis, kind, sf)`` in mesh order).

    Plain ``Shard`` axes split left to right (outer axis first, DTensor's
    rule); a ``_StridedShard`` axis splits after every later axis on the
    same dim (FSDP2's right-to-left sharding over TP/EP).
    """
    if not axes:
        return []
    rest = _split_order(axes[1:])
    first = axes[0][0]
    return rest + [first] if axes[0][1] == "strided" else [first] + rest


def dtensor_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[object],
                coord: Sequence[int], *, name: str = "tensor") -> Box:
    """The box of a ``DTensor``'s global ``shape`` that the rank at mesh ``coord`` holds.

    ``placements`` are torch placements (``Shard``, ``Replicate``,
    ``_StridedShard``), one per mesh axis. Each dim is split with
    ``torch.chunk`` bounds (:func:`m2nkit.manifest.chunk_bounds`), by the
    axes that shard it, in :func:`_split_order`: plain shards outer axis
    first (torch ``distributed/tensor/_utils.py``,
    ``compute_local_shape_and_global_offset``), a ``_StridedShard`` after the
    later axes on its dim (FSDP2 shards a TP/EP local tensor: torch
    ``fsdp/_fully_shard/_fsdp_param.py``, ``_init_sharding_spec_tp``).

    Returns:
        One ``(start, stop)`` per dim; a rank past the end of a dim holds an
        empty range.

    Raises:
        FSDP2SourceError: a ``Partial`` (or unknown) placement; a
            ``_StridedShard`` whose ``split_factor`` is not the product of the
            later axes sharding its dim (a layout FSDP2 does not make); naming
            ``name``.
    """
    kinds = _checked_kinds(len(shape), tuple(mesh_shape), placements, name)
    return _box(tuple(shape), tuple(mesh_shape), kinds, tuple(coord))


def _checked_kinds(ndim: int, mesh_shape: tuple[int, ...], placements: Sequence[object],
                   name: str) -> tuple[tuple[str, int, int], ...]:
    """``_placement_kind`` of each placement (dims normalised), checked (see ``dtensor_box``)."""
    kinds = []
    for axis, p in enumerate(placements):
        kind, dim, sf = _placement_kind(p)
        if kind == "other":
            raise FSDP2SourceError(
                f"parameter '{name}': placement {p!r} on mesh axis {axis} cannot be sent shard "
                "to shard (a Partial holds pending sums: reduce it first); supported: Shard, "
                "Replicate, _StridedShard")
        kinds.append((kind, dim + ndim if dim < 0 else dim, sf))
    for axis, (kind, dim, sf) in enumerate(kinds):
        if kind == "strided":
            later = math.prod(mesh_shape[a] for a in range(axis + 1, len(kinds))
                              if kinds[a][0] != "replicate" and kinds[a][1] == dim)
            if sf != later:
                raise FSDP2SourceError(
                    f"parameter '{name}': _StridedShard(dim={dim}, split_factor={sf}) on mesh "
                    f"axis {axis} of mesh {mesh_shape} with placements {tuple(placements)}: the "
                    f"later axes shard dim {dim} {later} ways; FSDP2 makes split_factor equal to "
                    "that (only FSDP2's strided layouts are supported)")
    return tuple(kinds)


@lru_cache(maxsize=1 << 16)
def _box(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
         kinds: tuple[tuple[str, int, int], ...], coord: tuple[int, ...]) -> Box:
    per_dim: dict[int, list[tuple[int, str, int]]] = {}
    for axis, (kind, dim, sf) in enumerate(kinds):
        if kind != "replicate":
            per_dim.setdefault(dim, []).append((axis, kind, sf))
    bounds = [[0, n] for n in shape]
    for dim, axes in per_dim.items():
        for axis in _split_order(axes):
            lo, hi = bounds[dim]
            s, e = chunk_bounds(hi - lo, mesh_shape[axis], coord[axis])
            bounds[dim] = [lo + s, lo + e]
    return tuple((a, b) for a, b in bounds)


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


@dataclass(frozen=True)
class _Root:
    """The trainer's root device mesh: its ranks (row-major) and shape."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    names: tuple[str, ...] | None

    @property
    def coords(self) -> dict[int, tuple[int, ...]]:
        return {r: _unravel(i, self.shape) for i, r in enumerate(self.ranks)}


def _mesh_of(mesh: Any) -> _Root:
    t = mesh.mesh
    return _Root(tuple(int(r) for r in t.flatten().tolist()), tuple(int(s) for s in t.shape),
                 tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None)


def _sub_coords(root: _Root, sub: _Root, name: str) -> dict[int, tuple[int, ...]]:
    """For every root rank, its coordinate in the (sub-)mesh of the same kind as ``sub``.

    ``sub`` is this rank's slice of a sub-mesh: the root ranks with some
    root axes fixed. Its copies on the other slices hold the same layout, so
    a root rank's coordinate in its own slice follows from its root
    coordinate on the axes ``sub`` spans (flattened row-major, then
    unravelled over ``sub``'s shape).

    Raises:
        FSDP2SourceError: ``sub`` is not such a slice of ``root``.
    """
    if set(sub.ranks) == set(root.ranks):
        return {r: _unravel(i, sub.shape) for i, r in enumerate(sub.ranks)}
    coords = root.coords
    missing = [r for r in sub.ranks if r not in coords]
    if not missing:
        mine = [coords[r] for r in sub.ranks]
        spans = [a for a in range(len(root.shape)) if len({c[a] for c in mine}) > 1]
        fixed = {a: mine[0][a] for a in range(len(root.shape)) if a not in spans}
        enum = [r for r, c in coords.items() if all(c[a] == v for a, v in fixed.items())]
        span_shape = [root.shape[a] for a in spans]
        if enum == list(sub.ranks) and math.prod(span_shape) == len(sub.ranks):
            out = {}
            for r, c in coords.items():
                flat = 0
                for a in spans:
                    flat = flat * root.shape[a] + c[a]
                out[r] = _unravel(flat, sub.shape)
            return out
    raise FSDP2SourceError(
        f"parameter '{name}': its device mesh (ranks {list(sub.ranks)}) is not a slice of the "
        f"root mesh (ranks {list(root.ranks)}, shape {root.shape}), so the ranks holding its "
        "other copies are unknown; pass mesh=<the trainer's world DeviceMesh> to fsdp2_source")


@lru_cache(maxsize=256)
def _sub_coords_cached(root: _Root, sub: _Root) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    try:
        return tuple(_sub_coords(root, sub, "").items())
    except FSDP2SourceError:
        return None


def _weight_layout(x: "_Param", root: _Root, num_trainer_ranks: int
                  ) -> tuple[dict[int, Box], SourceLayout | PieceLayout]:
    """Every root rank's box of one weight (in wire dim order), and the layout declaring them.

    Read off the ``DTensor`` spec only: identical on every rank, no
    collective. A persistent buffer (never sharded by FSDP2) is whole on
    every root rank.

    Raises:
        FSDP2SourceError: see :func:`dtensor_box` and :func:`_sub_coords`,
            naming the parameter.
    """
    shape = tuple(int(n) for n in x.param.shape)
    if x.buffer:
        return _layout_cached(shape, None, root, None, None, num_trainer_ranks)
    sub = _mesh_of(x.param.device_mesh)
    if _sub_coords_cached(root, sub) is None:
        _sub_coords(root, sub, x.name)  # raises, naming the parameter
    kinds = _checked_kinds(len(shape), sub.shape, x.param.placements, x.name)
    return _layout_cached(shape, sub, root, kinds, x.order, num_trainer_ranks)


@lru_cache(maxsize=4096)
def _layout_cached(shape: tuple[int, ...], sub: _Root | None, root: _Root,
                   kinds: tuple | None, order: tuple[int, ...] | None, num_trainer_ranks: int):
    """``_weight_layout`` for hashable facts: a model's layers repeat, so does this."""
    if sub is None:
        boxes = {r: tuple((0, n) for n in shape) for r in root.ranks}
    else:
        coords = _sub_coords_cached(root, sub)
        boxes = {r: _box(shape, sub.shape, kinds, c) for r, c in coords}
    if order is not None:
        shape = tuple(shape[d] for d in order)
        boxes = {r: tuple(b[d] for d in order) for r, b in boxes.items()}
    full = tuple((0, n) for n in shape)
    if all(b == full for b in boxes.values()):
        if root.ranks == tuple(range(num_trainer_ranks)):
            return boxes, SourceLayout()
        return boxes, SourceLayout(root.ranks)
    pieces = tuple(Piece(r, b) for r, b in boxes.items() if box_volume(b) or not shape)
    candidate = None if sub is None else _root_placements(sub, root, kinds, order)
    if candidate is not None:
        lay = SourceLayout(root.ranks, root.shape, candidate)
        if set(lay.pieces(shape)) == set(pieces):
            return boxes, lay
    return boxes, PieceLayout(pieces)


def _root_placements(sub: _Root, root: _Root, kinds: tuple,
                     order: tuple[int, ...] | None) -> tuple | None:
    """The placements on the root mesh's axes, when ``sub`` maps axis to axis (else None).

    ``order``: the wire tensor is the parameter permuted (``Shard(d)``
    becomes ``Shard(order.index(d))``)."""
    if any(k not in ("shard", "replicate") for k, _, _ in kinds):
        return None
    if sub.ranks == root.ranks and sub.shape == root.shape:
        axes = list(range(len(root.shape)))
    elif sub.names and root.names and all(n in root.names for n in sub.names):
        axes = [root.names.index(n) for n in sub.names]
    else:
        return None
    out: list = [Replicate()] * len(root.shape)
    for a, (kind, dim, _) in zip(axes, kinds):
        if kind == "shard":
            out[a] = Shard(dim if order is None else order.index(dim))
    return tuple(out)


# --------------------------------------------------------------------------
# dtype: what travels on the wire


def _fp32_patterns(model: torch.nn.Module) -> list[re.Pattern]:
    pats: set[str] = set()
    for m in model.modules():
        pats.update(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
    return [re.compile(r"(^|\.)" + re.escape(x).replace(r"\*", r"[^.]*") + r"($|\.)")
            for x in sorted(pats)]


def _policy_dtypes(model: torch.nn.Module) -> dict[int, torch.dtype]:
    """``id(sharded parameter) -> MixedPrecisionPolicy.param_dtype`` of its FSDP2 group.

    Read from FSDP2's state (torch ``fsdp/_fully_shard/_fsdp_state.py``
    ``FSDPState._fsdp_param_groups``, ``_fsdp_param.py`` ``FSDPParam.mp_policy``);
    a parameter without a policy dtype is absent.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {}
    out: dict[int, torch.dtype] = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fp in group.fsdp_params:
                dt = getattr(fp.mp_policy, "param_dtype", None)
                if dt is not None:
                    out[id(fp.sharded_param)] = dt
    return out


def wire_dtype_rule(name: str, param_dtype: torch.dtype, *, policy_dtype: torch.dtype | None,
                    dtype: torch.dtype | None, keep_fp32: bool, buffer: bool = False
                    ) -> torch.dtype:
    """The wire dtype of one parameter or buffer (the rule :func:`fsdp2_source` documents).

    1. ``keep_fp32`` (the model class's ``_keep_in_fp32_modules_strict``
       names it: transformers loads it in fp32 whatever the model dtype,
       because the checkpoint format keeps it fp32, e.g. MoE routers and
       ``e_score_correction_bias``; transformers ``modeling_utils.py``,
       ``_get_dtype_plan``): ``float32``;
    2. a non-floating parameter, or a ``buffer``: its own dtype (FSDP2's
       ``MixedPrecisionPolicy`` casts parameters only, so the forward uses
       a buffer as it is; the families mark such tensors, ``HFNaming.buffers``);
    3. ``dtype`` when the caller gives one;
    4. the ``MixedPrecisionPolicy.param_dtype`` of its FSDP2 group: what the
       trainer computes with (fp32 masters, bf16 forward: bf16 on the wire);
    5. else the parameter's dtype.
    """
    if keep_fp32:
        return torch.float32
    if buffer or not param_dtype.is_floating_point:
        return param_dtype
    return dtype or policy_dtype or param_dtype


# --------------------------------------------------------------------------
# the source


class FSDP2Source(ManifestM2NWeightSource):
    """The :class:`ManifestM2NWeightSource` :func:`fsdp2_source` returns.

    Attributes:
        config: the model's transformers config (picks the family and the
            vLLM destination).
        num_trainer_ranks: ``T``, the trainer ranks ``[0, T)``.
        module_names: wire name -> the ``named_parameters()`` names it is made
            of (several for re-fused per-expert tensors).
    """

    def __init__(self, entries: Sequence[M2NManifestEntry], *, rank: int | None,
                 num_trainer_ranks: int, config: Any,
                 module_names: dict[str, tuple[str, ...]], lora: Any = None) -> None:
        super().__init__(entries, rank=rank)
        self.config = config
        self.num_trainer_ranks = num_trainer_ranks
        self.module_names = module_names
        self._lora = lora

    def iter_local(self):
        """``ManifestM2NWeightSource.iter_local``; with ``merge_lora``, first gathers each
        LoRA ``A`` (and ``B`` where needed) on every rank, in manifest order: call it on
        every trainer rank each round (the trainer engine does)."""
        if self._lora is None:
            return super().iter_local()
        self._lora.gather()
        return self._released(super().iter_local())

    def _released(self, stream):
        try:
            yield from stream
        finally:
            self._lora.release()


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _find_config(model: torch.nn.Module) -> Any:
    for m in model.modules():  # pre-order: the outermost transformers model first
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "architectures", None):
            return cfg
    raise FSDP2SourceError(
        "fsdp2_source: no transformers config found on the model (a module with .config "
        "naming its architectures); pass config=<the model's PretrainedConfig>")


def _known_wire_names(family: Family, config: Any) -> set[str]:
    """Wire names vLLM takes or skips for this config (the family table, expanded)."""
    from .vllm.destination import expand
    from .vllm.names import DEFAULT_VLLM_VERSION, vllm_names

    ex = expand(family, config, family.sizes(config), vllm_names(DEFAULT_VLLM_VERSION))
    return set(ex.feeds) | set(ex.skipped)


_LORA = re.compile(r"(^|\.)(lora_[A-Za-z_]+|lora_magnitude_vector)(\.|$)")


@dataclass
class _Param:
    """One parameter (or persistent buffer) on its way to the wire."""

    name: str                 # as named_parameters()/named_buffers() gives it
    clean: str                # wrappers stripped
    module: torch.nn.Module   # owner, for reading the live tensor at send time
    attr: str
    param: torch.Tensor
    buffer: bool = False      # a persistent buffer: never sharded by FSDP2
    order: tuple[int, ...] | None = None  # HFNaming.permuted: wire = local.permute(order)

    @property
    def wire_shape(self) -> tuple[int, ...]:
        shape = tuple(int(n) for n in self.param.shape)
        return shape if self.order is None else tuple(shape[d] for d in self.order)


def _named_weights(model: torch.nn.Module) -> list[_Param]:
    """Parameters, then persistent buffers each right after its module's last parameter.

    A checkpoint holds both (``state_dict``); transformers keeps e.g. a
    router's score-correction bias as a persistent buffer. Same order as
    ``m2nkit.adapters.hf_checkpoint`` gives the checkpoint's wire tensors.
    """
    out = []
    for name, p in model.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        out.append(_Param(name, strip_wrappers(name), model.get_submodule(mod_name), attr, p))
    for name, b in model.named_buffers():
        mod_name, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_name)
        if attr in module._non_persistent_buffers_set:
            continue
        x = _Param(name, strip_wrappers(name), module, attr, b, buffer=True)
        prefix = mod_name + "."
        at = max((i + 1 for i, y in enumerate(out) if y.name.startswith(prefix)),
                 default=len(out))
        out.insert(at, x)
    return out


def _live(module: torch.nn.Module, attr: str, name: str, sharded: bool) -> torch.Tensor:
    """The parameter as it is now, its local shard when the model is sharded."""
    p = getattr(module, attr)
    if not sharded:
        return p.detach()
    if not _is_dtensor(p):
        raise FSDP2SourceError(
            f"parameter '{name}' is not sharded right now (FSDP2 holds it gathered inside "
            "forward/backward, or after forward with reshard_after_forward=False); call "
            "model.reshard() before sending")
    local = p.to_local()
    wait = getattr(local, "wait", None)  # AsyncCollectiveTensor
    return (wait() if callable(wait) else local).detach()


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _wire_names(params: Sequence[_Param], family: Family, known: set[str]):
    """Each parameter's wire name, in ``named_parameters()`` order.

    Returns ``(order, groups)``: ``order`` lists ``(wire name, _Param)``, or
    ``(wire name, None)`` for a stacked tensor re-fused from per-expert
    parameters (at the place of its first part); ``groups[wire] = ({expert:
    {part: _Param}}, parts)``. Names follow the family's ``HFNaming``:
    in-memory fused experts (``fused_leaf``), per-expert names
    (``experts_on_disk``), renames (``disk_name``).

    Raises:
        FSDP2SourceError: a name vLLM takes no tensor for (names the first,
            the count of others and the closest known name).
    """
    hf = family.hf
    permuted = getattr(hf, "permuted", None) or {}
    refusal = getattr(hf, "refusal", lambda name: None)
    expert_rx = [(part, expert_pattern_regex(pat)) for part, pat in hf.experts_on_disk.items()]
    wire_of_part = {part: (leaf, parts) for leaf, parts in hf.fused_experts.values()
                    for part in parts}
    order: list[tuple[str, _Param | None]] = []
    groups: dict[str, tuple[dict[int, dict[str, _Param]], tuple[str, ...]]] = {}
    unknown: list[tuple[str, str]] = []
    for x in params:
        leaf = hf.fused_leaf(x.clean)
        if leaf is not None:
            wire_leaf, _ = hf.fused_experts[leaf]
            wire = f"{hf.disk_name(x.clean)[: -len(leaf) - 1]}.{wire_leaf}"
        else:
            disk = hf.disk_name(x.clean)
            why = refusal(disk)
            if why:
                raise FSDP2SourceError(f"fsdp2_source: parameter '{x.name}' cannot be sent: {why}")
            leaf = next((leaf for leaf in permuted if disk.endswith("." + leaf)), None)
            if leaf is not None:  # the wire holds it in another dim order
                wire_leaf, x.order = permuted[leaf][0], tuple(permuted[leaf][1])
                wire = disk[: -len(leaf)] + wire_leaf
                if wire not in known:
                    unknown.append((x.name, wire))
                else:
                    order.append((wire, x))
                continue
            hit = next(((part, m) for part, rx in expert_rx if (m := rx.match(disk))), None)
            if hit is not None and hit[0] in wire_of_part:
                part, m = hit
                wire_leaf, parts = wire_of_part[part]
                wire = f"{m.group('prefix')}.{wire_leaf}"
                if wire not in groups:
                    groups[wire] = ({}, parts)
                    order.append((wire, None))
                groups[wire][0].setdefault(int(m.group("e")), {})[part] = x
                continue
            wire = disk
        if wire not in known:
            if not x.buffer:  # a persistent buffer no vLLM parameter takes is not a weight
                unknown.append((x.name, wire))
            continue
        order.append((wire, x))
    unknown += [(wire, wire) for wire in groups if wire not in known]
    if unknown:
        name, wire = unknown[0]
        close = difflib.get_close_matches(wire, sorted(known), n=1, cutoff=0.0)
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        shown = f"'{name}'" + (f" (wire name '{wire}')" if wire != name else "")
        raise FSDP2SourceError(
            f"fsdp2_source: parameter {shown}{more} maps to no {family.architecture} tensor "
            f"vLLM takes; the closest known name is '{close[0] if close else '?'}' "
            f"({family.module})")
    return order, groups


def fsdp2_source(
    model: torch.nn.Module,
    *,
    config: Any = None,
    dtype: torch.dtype | None = None,
    mesh: Any = None,
    num_trainer_ranks: int | None = None,
    rank: int | None = None,
    merge_lora: bool = False,
) -> FSDP2Source:
    """An ``M2NWeightSource`` for a transformers model sharded with ``fully_shard``.

    Call it on every trainer rank, after ``fully_shard`` (and
    ``parallelize_module``), with the model as the trainer holds it (wrapped
    by ``torch.compile``, activation checkpointing, DDP or PEFT is fine).

    Metadata (identical on every rank, no collective): one wire tensor per
    parameter (tied parameters once, as ``named_parameters()`` lists them)
    and per persistent buffer vLLM takes (a router's score-correction bias;
    FSDP2 leaves buffers whole on every rank), named by the model's family
    (``m2nkit.adapters.families``), with its
    global shape and its source layout read off the ``DTensor``
    (:func:`dtensor_box` for every rank of the root mesh: ``Shard``/``Replicate``
    placements as a ``SourceLayout``, ``_StridedShard`` and sub-mesh layouts
    as pieces). transformers 5's fused experts (``mlp.experts.gate_up_proj``
    ``[E, 2*Im, H]``, ``down_proj`` ``[E, H, Im]``) are the wire layout as
    they are; per-expert modules (``experts.{e}.<part>`` of the family) are
    re-fused rank-locally: each expert's shard is a piece of the stacked wire
    tensor, and the rank's local tensor stacks its shards. A tensor the
    family sends in another dim order (``HFNaming.permuted``) travels as
    ``to_local().permute(order)`` (a view) with its boxes permuted alike.

    Wire dtype (:func:`wire_dtype_rule`): fp32 for what the checkpoint format
    keeps fp32 (``_keep_in_fp32_modules_strict``); a buffer in its own dtype
    (FSDP2's policy casts parameters only); else ``dtype`` if given;
    else the FSDP2 ``MixedPrecisionPolicy.param_dtype`` (fp32 masters under
    ``param_dtype=bf16`` travel as bf16, the weights the trainer's forward
    uses); else the parameter's dtype. The cast happens in the provider, on
    the local shard only.

    ``iter_local`` (``M2NWeightSource``): this rank's local tensor of each
    wire tensor it holds, in manifest order, one at a time: ``to_local()``
    of the live parameter (a view; a cast copy when the dtype changes; a
    stacked copy of local shards for per-expert modules). It never calls
    ``full_tensor()``.

    Args:
        model: the trainer's model on this rank.
        config: its transformers config; default: the first ``.config``
            naming ``architectures`` among ``model.modules()``.
        dtype: wire dtype of floating parameters (see above).
        mesh: the trainer's root ``DeviceMesh``; default: the root of the
            parameters' meshes (``DeviceMesh._get_root_mesh``).
        num_trainer_ranks: ``T``; default: the default process group's world
            size (else the root mesh's size).
        rank: this trainer rank; default: the default process group's rank.
        merge_lora: send each peft LoRA target module's weight merged,
            ``W + scaling * B @ A`` per active adapter (peft's
            ``merge_and_unload`` math), under the base model's names; each
            rank merges its own box of ``W`` (``A``, and ``B`` where its rows
            are not ``W``'s, are gathered at the start of every
            ``iter_local``, on every rank; ``W`` never is). See
            :mod:`m2nkit.adapters.fsdp2_lora`. Without it, a model with LoRA
            weights is refused.

    Returns:
        An :class:`FSDP2Source` (a ``ManifestM2NWeightSource``).

    Raises:
        FSDP2SourceError (a ``ValueError``), the same on every rank, before
        any traffic: an unsupported architecture (the registry's message); a
        name that maps to no wire tensor vLLM takes (names it and the
        closest known name); a tensor the family refuses
        (``HFNaming.refused``); LoRA adapter weights without ``merge_lora``,
        and with it a LoRA variant (DoRA), a non-linear LoRA layer or a LoRA
        target module whose weight maps to no wire tensor vLLM takes; a
        plain-tensor parameter on a sharded model; a ``Partial`` placement;
        a mesh with ranks outside ``[0, T)``; a sub-mesh not a slice of the
        root mesh; per-expert modules with a missing expert or part, or
        sharded differently from each other; a root mesh axis named ``tp``
        (torchtitan's name) whose size the family's TP plan cannot split the
        model over (``Family.tp_problem``: whole heads, even MLP; names the
        config value and the valid sizes).
    """
    import torch.distributed as dist

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fsdp2_source needs a torch.nn.Module, got {type(model).__name__}")
    config = _find_config(model) if config is None else config
    try:
        family = family_for(config)
    except ValueError as e:
        raise FSDP2SourceError(f"fsdp2_source: {e}") from None
    params = _named_weights(model)
    if not params:
        raise FSDP2SourceError("fsdp2_source: the model has no parameters")
    lora = [x for x in params if _LORA.search(x.clean)]
    if lora:
        from .fsdp2_lora import adapter_param_ids

        adapters = adapter_param_ids(model)
        stray = [x for x in lora if id(x.param) not in adapters]
        if stray:
            raise FSDP2SourceError(
                f"fsdp2_source: parameter '{stray[0].name}' is named like a LoRA adapter weight "
                "but is not in a LoRA layer m2nkit recognises (peft's LoraLayer: base_layer, "
                "lora_A, lora_B, scaling)")
        if not merge_lora:
            raise FSDP2SourceError(
                f"fsdp2_source: parameter '{lora[0].name}' (and {len(lora) - 1} more) is a LoRA "
                "adapter weight; pass merge_lora=True to send W + scaling * B @ A per target "
                "module, merged on each rank's own shard (or merge the adapter into the base "
                "weights first: peft merge_and_unload())")
        params = [x for x in params if id(x.param) not in adapters]

    sharded = [x for x in params if _is_dtensor(x.param)]
    plain = [x for x in params if not x.buffer and not _is_dtensor(x.param)]
    if sharded and plain:
        raise FSDP2SourceError(
            f"parameter '{plain[0].name}' is a plain tensor, but {len(sharded)} of the model's "
            f"{len(sharded) + len(plain)} parameters are DTensors (sharded): every parameter "
            "must be sharded by fully_shard (call fully_shard(model) on the root module too)")

    if mesh is not None:
        root = _mesh_of(mesh)
    elif sharded:
        roots = {}
        for x in sharded:
            dm = x.param.device_mesh
            getter = getattr(dm, "_get_root_mesh", None)
            r = _mesh_of(getter() if callable(getter) else dm)
            roots.setdefault((r.ranks, r.shape), r)
        root = max(roots.values(), key=lambda r: (len(r.ranks), r.ranks))
    else:
        root = None
    if root is not None and root.names and "pp" in root.names:
        raise FSDP2SourceError(
            f"fsdp2_source: the root mesh has a pipeline axis 'pp' (axes {root.names}); "
            "pipeline stages hold different layers, which fsdp2_source does not support")
    if root is not None and root.names and "tp" in root.names:
        why = family.tp_problem(root.shape[root.names.index("tp")], config)
        if why:  # parallelize_module accepts it; the forward would fail (TPPlan.divides)
            raise FSDP2SourceError(f"fsdp2_source: the root mesh's 'tp' axis: {why}")
    if num_trainer_ranks is None:
        if dist.is_available() and dist.is_initialized():
            num_trainer_ranks = dist.get_world_size()
        else:
            num_trainer_ranks = len(root.ranks) if root is not None else 1
    if root is not None:
        outside = sorted(r for r in root.ranks if not 0 <= r < num_trainer_ranks)
        if outside:
            raise FSDP2SourceError(
                f"fsdp2_source: the device mesh (shape {root.shape}, ranks {list(root.ranks)}) "
                f"holds ranks {outside} outside the trainer world of {num_trainer_ranks} ranks "
                f"(0..{num_trainer_ranks - 1}); build the mesh over the trainer ranks, or pass "
                "num_trainer_ranks=<trainer world size>")

    fp32 = _fp32_patterns(model)
    policy = _policy_dtypes(model)

    def wire_dtype(x: _Param) -> torch.dtype:
        return wire_dtype_rule(x.clean, x.param.dtype, policy_dtype=policy.get(id(x.param)),
                               dtype=dtype, keep_fp32=any(r.search(x.clean) for r in fp32),
                               buffer=x.buffer)

    def layout_of(x: _Param) -> tuple[dict[int, Box] | None, SourceLayout | PieceLayout]:
        if root is None:  # a plain model: every rank holds every weight
            return None, SourceLayout()
        return _weight_layout(x, root, num_trainer_ranks)

    known = _known_wire_names(family, config)
    merge = None
    if merge_lora:  # before the names: a LoRA target vLLM cannot take gets its own message
        from .fsdp2_lora import plan_lora_merge

        merge = plan_lora_merge(model, params, family, known, lambda x: layout_of(x)[0])
    if rank is None and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    order, groups = _wire_names(params, family, known)

    entries: list[M2NManifestEntry] = []
    module_names: dict[str, tuple[str, ...]] = {}
    for wire, x in order:
        if x is None:
            experts, parts = groups[wire]
            entries.append(_expert_entry(wire, experts, parts, layout_of, wire_dtype,
                                         bool(sharded)))
            module_names[wire] = tuple(p.name for e in sorted(experts)
                                       for p in experts[e].values())
            continue
        _, lay = layout_of(x)
        wd = wire_dtype(x)
        merged = None
        if merge is not None and merge.merges(x):
            merged = functools.partial(merge.merged, x, rank=rank or 0)
        entries.append(M2NManifestEntry(wire, wd, x.wire_shape, lay,
                                        _provider(x, bool(sharded), wd, merged)))
        module_names[wire] = (x.name,)
    return FSDP2Source(entries, rank=rank, num_trainer_ranks=num_trainer_ranks, config=config,
                       module_names=module_names, lora=merge)


def _provider(x: _Param, sharded: bool, dtype: torch.dtype,
              merged: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> Callable[[], torch.Tensor]:
    """This rank's local tensor of ``x``: ``to_local()``, LoRA merged, permuted, cast."""
    module, attr, name, order = x.module, x.attr, x.name, x.order
    sharded = sharded and not x.buffer

    def local() -> torch.Tensor:
        t = _live(module, attr, name, sharded)
        if merged is not None:
            t = merged(t)
        return _cast(t if order is None else t.permute(order), dtype)  # a view until cast
    return local


def _expert_entry(wire: str, experts: dict[int, dict[str, _Param]], parts: tuple[str, ...],
                  layout_of, wire_dtype, sharded: bool) -> M2NManifestEntry:
    """The stacked wire tensor ``[E, P*R, C]`` of per-expert ``[R, C]`` parameters, as pieces.

    Expert ``e``'s part ``j`` (``gate``, ``up``; ``down``) is rows
    ``[j*R, (j+1)*R)`` of ``wire[e]`` (``m2nkit.adapters.experts``). A rank
    holding box ``(rows [r0, r1), cols [c0, c1))`` of each per-expert tensor
    holds, per expert and part, the piece ``((e, e+1), (j*R + r0, j*R + r1),
    (c0, c1))`` at local ``(e, j*(r1 - r0), 0)`` of its local tensor
    ``[E, P*(r1 - r0), c1 - c0]``.

    Raises:
        FSDP2SourceError: a missing expert or part; parts of different
            shapes, dtypes or layouts.
    """
    count = max(experts) + 1
    first = None
    for e in range(count):
        for part in parts:
            x = experts.get(e, {}).get(part)
            if x is None:
                raise FSDP2SourceError(
                    f"fsdp2_source: '{wire}' is re-fused from per-expert parameters, but expert "
                    f"{e} has no '{part}' part ({count} experts found)")
            if first is None:
                first = x
    shape = tuple(int(n) for n in first.param.shape)
    if len(shape) != 2:
        raise FSDP2SourceError(f"fsdp2_source: per-expert parameter '{first.name}' has shape "
                               f"{shape}; expected a 2-D [rows, cols] weight")
    boxes0, _ = layout_of(first)
    dtype = wire_dtype(first)
    for e in range(count):
        for part in parts:
            x = experts[e][part]
            boxes, _ = layout_of(x)
            if (tuple(x.param.shape) != shape or wire_dtype(x) != dtype or boxes != boxes0):
                raise FSDP2SourceError(
                    f"fsdp2_source: per-expert parameters of '{wire}' differ: '{x.name}' has "
                    f"shape {tuple(x.param.shape)}, dtype {x.param.dtype} and another layout "
                    f"than '{first.name}' {shape}; they must be sharded alike to be stacked")
    R, C = shape
    P = len(parts)
    global_shape = (count, P * R, C)
    if boxes0 is None:  # a plain (unsharded) model: every rank holds the whole stack
        lay: SourceLayout | PieceLayout = SourceLayout()
    else:
        pieces = []
        for rank, ((r0, r1), (c0, c1)) in boxes0.items():
            if r1 == r0 or c1 == c0:
                continue
            if r1 - r0 == R:  # whole rows: the local stack is one box of the wire tensor
                pieces.append(Piece(rank, ((0, count), (0, P * R), (c0, c1))))
                continue
            for e in range(count):
                for j in range(P):
                    pieces.append(Piece(rank, ((e, e + 1), (j * R + r0, j * R + r1), (c0, c1)),
                                        (e, j * (r1 - r0), 0)))
        lay = PieceLayout(tuple(pieces), where=f"parameter '{wire}'")
    members = [[(experts[e][part].module, experts[e][part].attr, experts[e][part].name)
                for part in parts] for e in range(count)]

    def local() -> torch.Tensor:
        shards = [[_live(m, a, n, sharded) for m, a, n in row] for row in members]
        r, c = shards[0][0].shape
        out = torch.empty((count, P * r, c), dtype=dtype)
        for e, row in enumerate(shards):
            for j, t in enumerate(row):
                out[e, j * r:(j + 1) * r].copy_(t)
        return out

    return M2NManifestEntry(wire, dtype, global_shape, lay, local)
