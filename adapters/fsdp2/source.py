"""``fsdp2_source``: a live FSDP2 model as an ``M2NWeightSource``, every rank sending its own shard.

The parts come from the modules beside this one: each rank's box of each
tensor (:mod:`.dtensor`), its wire dtype (:mod:`.dtype`), its wire name
(:mod:`.names`), the parameters themselves (:mod:`.params`) and, with
``merge_lora=True``, the LoRA merge (:mod:`.lora`). Here they become
manifest entries whose providers read the live shard at send time; the
whole design is in the package docstring (:mod:`m2nkit.adapters.fsdp2`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from m2nkit.manifest import (
    M2NManifestEntry,
    ManifestM2NWeightSource,
    Piece,
    PieceLayout,
    SourceLayout,
)
from m2nkit.manifest.pieces import Box

from ..families.tableless import family_or_tableless
from .dtensor import mesh_of, weight_layout
from .dtype import fp32_patterns, policy_dtypes, wire_dtype_rule
from .errors import FSDP2SourceError
from .lora import adapter_param_ids, plan_lora_merge
from .names import SplitGroup, known_wire_names, wire_names
from .params import Weight, cast, is_dtensor, live, named_weights

__all__ = ["FSDP2Source", "fsdp2_source"]


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


def _find_config(model: torch.nn.Module) -> Any:
    for m in model.modules():  # pre-order: the outermost transformers model first
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "architectures", None):
            return cfg
    raise FSDP2SourceError(
        "fsdp2_source: no transformers config found on the model (a module with .config "
        "naming its architectures); pass config=<the model's PretrainedConfig>")



_LORA = re.compile(r"(^|\.)(lora_[A-Za-z_]+|lora_magnitude_vector)(\.|$)")


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
    A tensor transformers cut into several parameters as it loaded
    (``HFNaming.split_on_load``: a vision block's ``wqkv`` held as q, k and
    v, q's and k's rows reordered for rotary) travels as the checkpoint's
    tensor: the rank's local tensor concatenates its parts' shards, its
    pieces put each row where the checkpoint has it (:func:`_split_entry`).

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
            :mod:`m2nkit.adapters.fsdp2.lora`. Without it, a model with LoRA
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
        family = family_or_tableless(config)
    except ValueError as e:
        raise FSDP2SourceError(f"fsdp2_source: {e}") from None
    params = named_weights(model)
    if not params:
        raise FSDP2SourceError("fsdp2_source: the model has no parameters")
    lora = [x for x in params if _LORA.search(x.clean)]
    if lora:
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

    sharded = [x for x in params if is_dtensor(x.param)]
    plain = [x for x in params if not x.buffer and not is_dtensor(x.param)]
    if sharded and plain:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise FSDP2SourceError(
                f"parameter '{plain[0].name}' is a plain tensor, but {len(sharded)} of the "
                f"model's {len(sharded) + len(plain)} parameters are DTensors (sharded): every "
                "parameter must be sharded by fully_shard (call fully_shard(model) on the root "
                "module too; parameters it should leave whole go in its ignored_params)")
        # fully_shard(model) manages every parameter of the root that no child
        # group or ignored_params took (torch fsdp/_fully_shard/_fsdp_init.py,
        # _get_managed_states): under a sharded root a plain parameter was
        # ignored on purpose, and every rank holds it whole.
        for x in plain:
            x.ignored = True

    if mesh is not None:
        root = mesh_of(mesh)
    elif sharded:
        roots = {}
        for x in sharded:
            dm = x.param.device_mesh
            getter = getattr(dm, "_get_root_mesh", None)
            r = mesh_of(getter() if callable(getter) else dm)
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

    fp32 = fp32_patterns(model)
    policy = policy_dtypes(model)

    def wire_dtype(x: Weight) -> torch.dtype:
        return wire_dtype_rule(x.clean, x.param.dtype, policy_dtype=policy.get(id(x.param)),
                               dtype=dtype, keep_fp32=any(r.search(x.clean) for r in fp32),
                               buffer=x.buffer)

    def layout_of(x: Weight) -> tuple[dict[int, Box] | None, SourceLayout | PieceLayout]:
        if root is None:  # a plain model: every rank holds every weight
            return None, SourceLayout()
        return weight_layout(x, root, num_trainer_ranks)

    # Without a table every parameter is a wire tensor under its own name
    # (families.tableless), or its permuted wire name (HFNaming.permuted); the
    # traced layout says which ones vLLM takes.
    if family.params:
        known = known_wire_names(family, config)
    else:
        hf = family.hf
        known = {x.clean for x in params}
        for x in params:
            leaf = hf.permuted_leaf(x.clean)
            if leaf is not None:
                known.add(x.clean[: -len(leaf)] + hf.permuted[leaf][0])
    merge = None
    if merge_lora:  # before the names: a LoRA target vLLM cannot take gets its own message
        merge = plan_lora_merge(model, params, family, known, lambda x: layout_of(x)[0])
    if rank is None and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    order, groups = wire_names(params, family, known)

    entries: list[M2NManifestEntry] = []
    module_names: dict[str, tuple[str, ...]] = {}
    for wire, x in order:
        if x is None and isinstance(groups[wire], SplitGroup):
            split = groups[wire]
            entries.append(_split_entry(wire, split, config, layout_of, wire_dtype, bool(sharded)))
            module_names[wire] = tuple(split.parts[j].name for j in sorted(split.parts))
            continue
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


def _provider(x: Weight, sharded: bool, dtype: torch.dtype,
              merged: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> Callable[[], torch.Tensor]:
    """This rank's local tensor of ``x``: ``to_local()``, LoRA merged, permuted, cast."""
    module, attr, name, order = x.module, x.attr, x.name, x.order
    sharded = sharded and not x.whole

    def local() -> torch.Tensor:
        t = live(module, attr, name, sharded)
        if merged is not None:
            t = merged(t)
        return cast(t if order is None else t.permute(order), dtype)  # a view until cast
    return local


def _expert_entry(wire: str, experts: dict[int, dict[str, Weight]], parts: tuple[str, ...],
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
        shards = [[live(m, a, n, sharded) for m, a, n in row] for row in members]
        r, c = shards[0][0].shape
        out = torch.empty((count, P * r, c), dtype=dtype)
        for e, row in enumerate(shards):
            for j, t in enumerate(row):
                out[e, j * r:(j + 1) * r].copy_(t)
        return out

    return M2NManifestEntry(wire, dtype, global_shape, lay, local)


def _split_entry(wire: str, split: SplitGroup, config: Any, layout_of, wire_dtype,
                 sharded: bool) -> M2NManifestEntry:
    """The wire tensor of parameters transformers split as it loaded, as row pieces.

    The wire tensor ``[sum R_j, *C]`` is the checkpoint's: part ``j``
    (``[R_j, *C]`` in memory) fills rows ``[sum R_<j, sum R_<=j)``, each of
    its in-memory rows at the checkpoint row ``SplitOnLoad.wire_row`` gives
    for a ``rope`` part, at the same row otherwise. A rank's local tensor
    is its parts' local shards concatenated along dim 0 (one copy, no
    gather); a shard holding rows ``[r0, r1)`` of a part is one piece per
    run of rows that stay consecutive in the wire (``r1 - r0`` single rows
    for a rope part, whose neighbours land 2 rows apart; one piece
    otherwise). On a plain model every rank holds the whole wire tensor.

    Raises:
        FSDP2SourceError: a missing part; parts of different trailing
            shapes or dtypes; a rank whose parts' boxes differ off dim 0; a
            rope part whose rows are not whole heads of an even head dim.
    """
    rule = split.rule
    missing = [p for j, p in enumerate(rule.parts) if j not in split.parts]
    if missing:
        raise FSDP2SourceError(f"fsdp2_source: '{wire}' is re-fused from {rule.parts}, but its "
                               f"'{missing[0]}' part is not among the model's parameters")
    xs = [split.parts[j] for j in range(len(rule.parts))]
    shapes = [tuple(int(n) for n in x.param.shape) for x in xs]
    dtype = wire_dtype(xs[0])
    for x, shape in zip(xs, shapes):
        if not shape or shape[1:] != shapes[0][1:] or wire_dtype(x) != dtype:
            raise FSDP2SourceError(
                f"fsdp2_source: parameters of '{wire}' differ: '{x.name}' has shape {shape} "
                f"and dtype {wire_dtype(x)}, '{xs[0].name}' {shapes[0]} and {dtype}; the parts "
                "must match but for their rows to be concatenated")
    heads = rule.heads(config) if rule.rope else 0
    rows = [s[0] for s in shapes]
    offsets = [sum(rows[:j]) for j in range(len(rows))]
    maps = []  # per part: in-memory row -> wire row
    for j, (x, part) in enumerate(zip(xs, rule.parts)):
        try:
            maps.append([offsets[j] + (rule.wire_row(r, rows[j], heads) if part in rule.rope
                                       else r) for r in range(rows[j])])
        except ValueError as e:
            raise FSDP2SourceError(f"fsdp2_source: parameter '{x.name}': {e}") from None
    global_shape = (sum(rows), *shapes[0][1:])
    members = [(x.module, x.attr, x.name) for x in xs]
    layouts = [layout_of(x)[0] for x in xs]
    if layouts[0] is None:  # a plain model: every rank holds the whole wire tensor
        order = torch.empty(global_shape[0], dtype=torch.long)  # wire row -> row of the cat
        order[torch.tensor([w for m in maps for w in m])] = torch.arange(global_shape[0])

        def whole() -> torch.Tensor:
            parts = [live(m, a, n, False) for m, a, n in members]
            return cast(torch.cat(parts).index_select(0, order), dtype)

        return M2NManifestEntry(wire, dtype, global_shape, SourceLayout(), whole)
    pieces = []
    for rank in layouts[0]:
        boxes = [lay[rank] for lay in layouts]
        rest = boxes[0][1:]
        if any(b[1:] != rest for b in boxes):
            raise FSDP2SourceError(
                f"fsdp2_source: the parts of '{wire}' are sharded differently on trainer rank "
                f"{rank} ({dict(zip(rule.parts, boxes))}); they must split alike off dim 0 to "
                "be concatenated")
        if any(b == a for a, b in rest):
            continue
        rows_of = []  # (wire row, local row) of every row the rank holds, in local order
        for j, ((r0, r1), *_) in enumerate(boxes):
            base = len(rows_of) - r0
            rows_of += [(maps[j][r], base + r) for r in range(r0, r1)]
        for a, b, at in _row_runs(rows_of):
            pieces.append(Piece(rank, ((a, b), *rest), (at, *([0] * len(rest)))))
    lay = PieceLayout(tuple(pieces), where=f"parameter '{wire}'")

    def local() -> torch.Tensor:
        return cast(torch.cat([live(m, a, n, sharded) for m, a, n in members]), dtype)

    return M2NManifestEntry(wire, dtype, global_shape, lay, local)


def _row_runs(rows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(wire start, wire stop, local start)`` runs of ``(wire row, local row)`` pairs that
    continue one another on both sides."""
    runs: list[tuple[int, int, int]] = []
    for w, at in rows:
        if runs and runs[-1][1] == w and runs[-1][2] + w - runs[-1][0] == at:
            runs[-1] = (runs[-1][0], w + 1, runs[-1][2])
        else:
            runs.append((w, w + 1, at))
    return runs
