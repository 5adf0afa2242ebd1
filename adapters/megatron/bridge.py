"""A Megatron-Bridge model as an M2N source: its own tasks, shard to shard, or its own export.

Megatron-Bridge (``megatron.bridge.AutoBridge``) is how NeMo-RL, verl and
slime turn a Megatron-Core model into Hugging Face tensors:
``export_hf_weights(model)`` all-gathers every tensor over TP, broadcasts it
over PP and all-gathers experts over EP, so every rank ends up holding every
full tensor. :func:`bridge_source` plugs such a model into m2nkit in one of
two modes.

``mode="tasks"`` (default): read ``bridge.get_conversion_tasks(model)``
(Bridge ``models/conversion/model_bridge.py``, ``build_conversion_tasks``:
one task per global Megatron parameter, the local tensor, the mapping object
and the resolved HF name(s), with PP/VPP layer numbers and EP expert numbers
already made global by ``_megatron_local_name_to_global``). For the mapping
kinds whose layout is known, each rank declares the pieces of the HF wire
tensors its *local* tensor holds and hands that tensor over as it is; no
collective runs while the source is iterated:

* ``ColumnParallelMapping`` (rows over tp; the embedding and output layer
  keep only the rows below the HF vocabulary: Megatron's padding rows are
  in no piece), ``RowParallelMapping`` (columns over tp),
  ``ReplicatedMapping``, and ``AutoMapping`` after Bridge's own
  ``_detect_parallelism_type`` picks one of the three
  (``param_mapping.py``);
* ``QKVMapping``: ``linear_qkv`` rows interleaved per query group and split
  evenly over tp, any number of query groups (``qkv_row_runs`` of
  :mod:`m2nkit.adapters.megatron.layout`, the rule Bridge's ``merge_qkv_weights``
  and ``split_qkv_weights`` also restate);
* ``GatedMLPMapping``: ``[gate_r; up_r]`` per rank (``fc1_row_runs``);
* the expert variants of all of these (the mapping's ``is_expert``: tp is
  the expert tensor-parallel group, the expert number in the HF name is
  Bridge's global one), re-fused into the family's stacked wire tensors
  (``<block>.experts.gate_up_proj.weight [E, 2*Im, H]``, expert ``e`` its
  gate rows then its up rows; ``down_proj [E, H, Im]``). A rank's local
  experts of one layer are copied into one ``[E/ep, ...]`` tensor, its own
  share only.

Any other mapping kind (a subclass with its own transform, a Bridge for an
architecture with other fused layouts) goes through that task's own
``megatron_to_hf``, which gathers; the tensors it returns are replicas on
the ranks that hold them. :attr:`BridgeSource.gathered` names every wire
tensor that goes this way and why, and :attr:`BridgeSource.notes` says it in
sentences (``M2NTrainerEngine.notes`` carries them to the user). A
*grouped-export* mapping (``is_grouped_export``: one HF tensor holds every
expert, and Bridge stacks the per-expert outputs of ``megatron_to_hf`` in its
own export loop, ``model_bridge.py`` ``_accumulate_grouped_export``; GPT-OSS's
expert mappings) has no such fallback: ``mode="tasks"`` refuses it, naming
``mode="export"``.

HF tensors the family's wire carries with permuted dims
(``HFNaming.permuted``: GPT-OSS's stacked ``experts.gate_up_proj [E, H,
2*I]`` is the wire's ``experts.gate_up_proj.weight [E, 2*I, H]``) are sent
as the permuted view of what Bridge yields.

``mode="export"``: ``export_hf_weights(model, cpu=True)`` is the provider,
for any architecture Bridge knows and m2nkit has a family for. Every rank
receives every tensor, so dense tensors are declared replicated over all
ranks and the planner's replica balancing has each rank send about 1/T of
the bytes (rather than rank 0 sending everything). Per-expert HF tensors
are re-fused into the stacked wire tensors: each expert is a piece of one
rank (expert ``e`` on the ``e mod n``-th of its ``n`` holders), and a rank
keeps only its own experts, so no rank stacks a layer's experts.

Both the export and the fallback tasks are *streams* of collective calls.
Every rank runs the same calls at the same point of the manifest order
(before the first wire tensor that needs them on any rank), whether or not
it owns that tensor, and runs what is left when its iteration ends, so the
ranks' collectives line up as Bridge's own export loop does. With the
``torch_p2p`` transport this cannot deadlock although each rank reaches a
step at its own point of the send loop (the argument is in docs/bridge.md,
checked by tests/integration/test_bridge_round.py); ``nccl_m2n`` would issue
its reshards and Bridge's collectives in different orders on different ranks,
so the trainer engine refuses a source with
:attr:`BridgeSource.collectives_while_iterating` there. The names,
shapes and dtypes a stream yields are learnt once, when the source is
built, by running it once (one export): what Bridge yields is only known
by running it.

Metadata (wire names, shapes, dtypes and every rank's pieces) is identical
on every rank: each rank declares what it holds, one ``all_gather_object``
over the default process group collects the declarations when the source is
built, and the wire tensors follow the family's wire order
(``m2nkit.adapters.config_wires.table_wires``). Every wire tensor of the
family's table must be held by some rank, and every tensor Bridge produces
must be one of them; otherwise :class:`BridgeSourceError` on every rank,
before any traffic. So is a Bridge model whose architecture has no m2nkit
family (no vLLM table), before even Bridge's own collectives.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from m2nkit.manifest import M2NManifestEntry, ManifestM2NWeightSource, Piece, PieceLayout
from m2nkit.manifest.pieces import Box

from ..config_wires import TableWire, table_wires
from ..experts import expert_pattern_regex
from ..families import family_for
from ..families.registry import UnsupportedArchitecture
from ..families.table import Family
from .layout import fc1_row_runs, qkv_row_runs
from .names import tower_wires, without_tower

__all__ = ["BridgeSourceError", "BridgeSource", "bridge_source", "MODES", "KNOWN_MAPPINGS"]

MODES = ("tasks", "export")

#: Bridge mapping classes (``megatron.bridge.models.conversion.param_mapping``) whose
#: layout m2nkit knows -> the rule used; matched by exact class, so a subclass with
#: its own transform (``RMSNorm2ZeroCenteredRMSNormMapping``) is not taken for its base.
KNOWN_MAPPINGS = {
    "ColumnParallelMapping": "column",
    "RowParallelMapping": "row",
    "ReplicatedMapping": "replicated",
    "AutoMapping": "auto",
    "QKVMapping": "qkv",
    "GatedMLPMapping": "gated",
    # one HF tensor [E, ...] <-> per-expert Megatron tensors (Qwen3-VL-MoE's packed
    # checkpoint experts, qwen/qwen35_bridge.py _moe_routed_expert_mappings): each
    # task is one local expert, a piece of the stacked wire tensor
    "FusedGatedExpertMapping": "fused_gated",
    "FusedExpertMapping": "fused",
}

_PARAM_MAPPING_MODULE = "megatron.bridge.models.conversion.param_mapping"


class BridgeSourceError(ValueError):
    """A Bridge model :func:`bridge_source` cannot send (raised on every rank, before traffic)."""


# --------------------------------------------------------------------------
# what a rank declares


@dataclass
class _Decl:
    """One piece a rank holds: ``box`` of wire ``wire`` at ``local_start`` of local tensor ``key``."""

    wire: str
    dtype: torch.dtype
    box: Box
    local_start: tuple[int, ...]


@dataclass
class _Holding:
    """What this rank holds: declarations and how to build each wire's local tensor."""

    decls: list[_Decl] = field(default_factory=list)
    #: wire -> zero-argument callable returning the local tensor (tasks, known kinds)
    local: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    #: wire -> why it goes through Bridge's gather
    gathered: dict[str, str] = field(default_factory=dict)


def _stacked_parts(family: Family) -> dict[str, tuple[re.Pattern, str, int, int]]:
    """part -> (per-expert regex, wire leaf, index of the part, number of parts)."""
    out = {}
    for wire_leaf, parts in family.hf.fused_experts.values():
        for k, part in enumerate(parts):
            out[part] = (expert_pattern_regex(family.hf.experts_on_disk[part]), wire_leaf, k,
                         len(parts))
    return out


class _Names:
    """HF names -> wire tensors: dense names as they are, per-expert names stacked."""

    def __init__(self, family: Family, wires: Sequence[TableWire], tied: bool):
        self.family = family
        self.wires = {w.name: w for w in wires}
        self.parts = _stacked_parts(family)
        self.tied = tied

    def expert(self, hf_name: str) -> tuple[str, int, int, int] | None:
        """``(wire, expert, part index, parts)`` of a per-expert HF name, else ``None``."""
        for rx, wire_leaf, k, n in self.parts.values():
            m = rx.match(hf_name)
            if m:
                return f"{m['prefix']}.{wire_leaf}", int(m["e"]), k, n
        return None

    def permuted(self, hf_name: str) -> tuple[str, tuple[int, ...]] | None:
        """``(wire, order)`` of an HF tensor the wire carries with its dims permuted, else ``None``.

        The family's ``HFNaming.permuted`` (GPT-OSS: Bridge exports
        ``...experts.gate_up_proj [E, H, 2*I]`` as transformers stores it;
        the wire is ``...experts.gate_up_proj.weight [E, 2*I, H]`` =
        ``permute(0, 2, 1)``).
        """
        if hf_name in self.wires:
            return None
        leaf = self.family.hf.permuted_leaf(hf_name)
        if leaf is None:
            return None
        wire_leaf, order = self.family.hf.permuted[leaf]
        return hf_name[: -len(leaf)] + wire_leaf, tuple(order)

    def ignored(self, hf_name: str) -> bool:
        """A tied ``lm_head`` Bridge may emit beside the embedding (the same tensor)."""
        return self.tied and hf_name not in self.wires and any(
            p.tied_to and p.name == hf_name for p in self.family.params)

    def check(self, hf_name: str, what: str) -> None:
        if hf_name not in self.wires:
            near = sorted(self.wires)[:3]
            raise BridgeSourceError(
                f"{what} produces '{hf_name}', which the {self.family.architecture} family "
                f"table ({self.family.module}) has no wire tensor for (its wire tensors start "
                f"{near} ...); m2nkit cannot place it in vLLM")

    def stacked_box(self, wire: str, e: int, k: int, n: int, part_box: Box) -> Box:
        """The box in stacked ``wire`` of ``part_box`` of part ``k`` of expert ``e``."""
        shape = self.wires[wire].shape
        rows = shape[1] // n
        (r0, r1), *rest = part_box
        return ((e, e + 1), (k * rows + r0, k * rows + r1), *rest)


# --------------------------------------------------------------------------
# tasks mode: the known kinds, from each rank's local tensor


def _rule(task: Any, config: Any) -> str | None:
    """The known rule of a task's mapping, or ``None`` (Bridge's gather).

    Decided from the mapping class and the model config only, so every rank
    decides alike, also for a task whose tensor another pipeline stage
    holds. ``AutoMapping`` is known (Bridge resolves it to column, row or
    replicated: :func:`_resolved`) unless it permutes dims.
    """
    m = task.mapping
    cls = type(m)
    rule = KNOWN_MAPPINGS.get(cls.__name__) if cls.__module__ == _PARAM_MAPPING_MODULE else None
    if rule == "auto" and getattr(m, "permute_dims", None):
        return None
    if rule == "qkv" and getattr(config, "attention_output_gate", False):
        return None
    if rule in ("fused_gated", "fused") and getattr(m, "permute_dims", None):
        return None
    return rule


def _fused_expert_pieces(task: Any, rule: str, names: "_Names"
                         ) -> tuple[str, int, list[tuple[int, int, Box, tuple[int, ...]]]]:
    """``(wire, global expert, [(part index, parts, part box, local start)])`` of one
    ``FusedGatedExpertMapping`` / ``FusedExpertMapping`` task (Bridge
    ``param_mapping.py``: ``hf_to_megatron`` takes expert
    ``extract_expert_number_from_param(megatron_param)`` of the HF tensor, then
    ``GatedMLPMapping``'s ``[gate_r; up_r]`` or ``AutoMapping``'s row split over the expert
    TP group). The part box is in one expert's gate/up/down tensor, as
    :meth:`_Names.stacked_box` takes it; the wire is the HF name plus ``.weight``
    (m2nkit's stacked wire name, ``[E, 2*Im, H]`` / ``[E, H, Im]``: Bridge's
    ``transpose_on_export`` turns only its export to the on-disk ``[E, in, out]``)."""
    from megatron.bridge.utils.common_utils import extract_expert_number_from_param

    m, w = task.mapping, task.param_weight
    e = int(extract_expert_number_from_param(m.megatron_param))
    hf = str(m.hf_param)
    wire = hf if hf in names.wires else f"{hf}.weight"
    shape = tuple(w.shape)
    zero = (0,) * len(shape)
    tp, r = m.tp_size, m.tp_rank
    if rule == "fused_gated":
        runs = fc1_row_runs(shape[0] * tp // 2, tp, r)
        return wire, e, [(("gate", "up").index(run.part), 2, _box(shape, 0, run.start, run.stop),
                          (run.local,) + zero[1:]) for run in runs]
    n = shape[1]
    return wire, e, [(0, 1, _box(shape, 1, r * n, (r + 1) * n), zero)]


def _resolved(task: Any, rule: str) -> str:
    """``AutoMapping``'s kind by Bridge's own, local rule (``_detect_parallelism_type``)."""
    if rule != "auto":
        return rule
    return task.mapping._detect_parallelism_type(task.megatron_module)


def _box(shape: Sequence[int], dim: int | None = None, lo: int = 0, hi: int = 0) -> Box:
    return tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(shape))


def _known_pieces(task: Any, rule: str, names: _Names) -> list[tuple[str, Box, tuple[int, ...]]]:
    """``(HF name, box of the HF tensor, local start)`` of one task's local tensor."""
    m, w = task.mapping, task.param_weight
    shape = tuple(w.shape)
    zero = (0,) * len(shape)
    tp, r = m.tp_size, m.tp_rank  # the expert TP group for expert tensors (param_mapping.py)
    hf = m.hf_param
    if rule == "replicated":
        return [(hf, _box(shape), zero)]
    if rule == "row":
        if len(shape) == 1:  # a row-parallel bias is whole on every rank
            return [(hf, _box(shape), zero)]
        n = shape[1]
        return [(hf, _box(shape, 1, r * n, (r + 1) * n), zero)]
    if rule == "column":
        n = shape[0]
        lo, hi = r * n, (r + 1) * n
        wire = names.wires.get(hf)
        if wire is not None and not m.is_expert:
            # Megatron's padded vocabulary: rows >= V belong to no wire tensor
            # (Bridge ColumnParallelMapping.hf_to_megatron pads the embedding and
            # output layer only; its export returns what the rows hold).
            lo, hi = min(lo, wire.shape[0]), min(hi, wire.shape[0])
        return [(hf, _box(shape, 0, lo, hi), zero)] if lo < hi else []
    if rule == "qkv":
        cfg = task.megatron_module.config
        runs = qkv_row_runs(cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, tp, r)
        return [(hf[run.part], _box(shape, 0, run.start, run.stop), (run.local,) + zero[1:])
                for run in runs]
    if rule == "gated":
        runs = fc1_row_runs(shape[0] * tp // 2, tp, r)
        return [(hf[run.part], _box(shape, 0, run.start, run.stop), (run.local,) + zero[1:])
                for run in runs]
    raise AssertionError(rule)


def _tasks_holding(tasks: Sequence[Any], names: _Names, config: Any, gather: frozenset
                   ) -> tuple[_Holding, list[Any]]:
    """This rank's declarations for the known kinds; the tasks left for Bridge's gather."""
    hold = _Holding()
    fallback = []
    dense: dict[str, torch.Tensor] = {}  # wire -> the one local tensor feeding it
    experts: dict[str, list[torch.Tensor]] = {}  # stacked wire -> local experts, in order
    for task in tasks:
        if task is None:
            continue
        rule = None if type(task.mapping).__name__ in gather else _rule(task, config)
        if rule is None:
            fallback.append(task)
            continue
        w = task.param_weight
        if w is None:  # another pipeline stage holds it
            continue
        if rule in ("fused_gated", "fused"):
            wire, e, parts = _fused_expert_pieces(task, rule, names)
            names.check(wire, f"Bridge task '{task.global_param_name}'")
            mine = experts.setdefault(wire, [])
            if not any(p is w for p in mine):
                mine.append(w)
            j = next(i for i, p in enumerate(mine) if p is w)
            for k, n, box, start in parts:
                hold.decls.append(_Decl(wire, w.dtype, names.stacked_box(wire, e, k, n, box),
                                        (j,) + start))
            continue
        for hf_name, box, start in _known_pieces(task, _resolved(task, rule), names):
            ex = names.expert(hf_name)
            if ex is None:
                if names.ignored(hf_name):
                    continue
                names.check(hf_name, f"Bridge task '{task.global_param_name}'")
                if dense.setdefault(hf_name, w) is not w:
                    raise BridgeSourceError(
                        f"wire tensor '{hf_name}' is fed by two local Megatron tensors on one "
                        f"rank (the second: '{task.global_param_name}'); m2nkit expects one")
                hold.decls.append(_Decl(hf_name, w.dtype, box, start))
                continue
            wire, e, k, n = ex
            names.check(wire, f"Bridge task '{task.global_param_name}'")
            mine = experts.setdefault(wire, [])
            if not any(p is w for p in mine):
                mine.append(w)
            j = next(i for i, p in enumerate(mine) if p is w)
            hold.decls.append(_Decl(wire, w.dtype, names.stacked_box(wire, e, k, n, box),
                                    (j,) + start))
    for wire, p in dense.items():
        hold.local[wire] = (lambda p=p: p.detach())
    for wire, params in experts.items():
        # this rank's own experts of the layer (E/ep of them, 1/etp of each)
        hold.local[wire] = (lambda ps=params: torch.stack([p.detach() for p in ps]))
    return hold, fallback


# --------------------------------------------------------------------------
# streams: Bridge's export, or the fallback tasks' megatron_to_hf


class _Stream:
    """A sequence of collective calls, each yielding ``{HF name: full tensor}``.

    ``steps()`` starts a fresh pass (a generator of dicts, one per call).
    Every rank makes the same calls in the same order (Bridge's rule for its
    export loop), so the pass is advanced on every rank at the same points.
    """

    def __init__(self, start: Callable[[], Iterator[dict[str, torch.Tensor]]]):
        self.start = start


def _export_stream(bridge: Any, model: list) -> _Stream:
    def steps():
        for name, tensor in bridge.export_hf_weights(model, cpu=True, show_progress=False):
            yield {name: tensor}
    return _Stream(steps)


def _tasks_stream(tasks: Sequence[Any]) -> _Stream:
    def steps():
        for task in tasks:
            out = task.mapping.megatron_to_hf(task.param_weight, task.megatron_module)
            yield dict(out or {})
    return _Stream(steps)


@dataclass
class _StreamPlan:
    """Where each stream output goes on this rank (from the construction-time pass)."""

    #: step index -> [(HF name, wire, expert or None, part index, parts)]
    outputs: dict[int, list[tuple[str, str, int | None, int, int]]] = field(default_factory=dict)
    #: wire -> (dtype, shape of one output) learnt from the pass
    seen: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    #: wire -> last step this rank needs for it (dense: the step of the output)
    last_step: dict[str, int] = field(default_factory=dict)
    #: (wire, expert) -> parts seen on this rank (stacked wires)
    expert_parts: dict[tuple[str, int], set] = field(default_factory=dict)
    #: HF name -> dim order of its wire tensor (``_Names.permuted``)
    permute: dict[str, tuple[int, ...]] = field(default_factory=dict)
    steps: int = 0


def _dry_run(stream: _Stream, names: _Names, what: str) -> _StreamPlan:
    plan = _StreamPlan()
    for i, out in enumerate(stream.start()):
        plan.steps = i + 1
        for hf_name, t in out.items():
            perm = names.permuted(hf_name)
            if perm is not None:  # one whole tensor, its dims in the wire's order
                wire, order = perm
                names.check(wire, what)
                plan.permute[hf_name] = order
                plan.outputs.setdefault(i, []).append((hf_name, wire, None, 0, 1))
                plan.seen[wire] = (t.dtype, tuple(t.permute(order).shape))
                plan.last_step[wire] = i
                continue
            ex = names.expert(hf_name)
            if ex is None:
                if names.ignored(hf_name):
                    continue
                names.check(hf_name, what)
                plan.outputs.setdefault(i, []).append((hf_name, hf_name, None, 0, 1))
                plan.seen[hf_name] = (t.dtype, tuple(t.shape))
                plan.last_step[hf_name] = i
                continue
            wire, e, k, n = ex
            names.check(wire, what)
            plan.outputs.setdefault(i, []).append((hf_name, wire, e, k, n))
            plan.seen[wire] = (t.dtype, tuple(t.shape))
            plan.expert_parts.setdefault((wire, e), set()).add(k)
            plan.last_step[wire] = i  # refined once the expert owners are known
        del out
    return plan


# --------------------------------------------------------------------------
# the source


class BridgeSource(ManifestM2NWeightSource):
    """The M2N source :func:`bridge_source` returns.

    Attributes:
        mode: ``"tasks"`` or ``"export"``.
        gathered: wire name -> why it goes through Bridge's gather (every
            wire tensor in ``"export"`` mode; the fallback kinds in
            ``"tasks"`` mode), identical on every rank.
        collective_free: wire names sent straight from local tensors.
        collectives_while_iterating: ``iter_local()`` runs Bridge's
            collectives (``"export"`` mode, fallback tasks); see
            docs/bridge.md for why ``torch_p2p`` interleaves them safely
            and ``nccl_m2n`` cannot (the engine refuses that pairing).
        left_out: wire tensors of the config not sent because the model was built
            without them (a VLM's vision tower, Bridge ``Qwen3VLModel`` with
            ``add_encoder=False``), as ``MegatronSource.left_out``.
    """

    left_out: tuple[str, ...] = ()

    def __init__(self, entries, *, rank, mode, gathered, stream, stream_plan, complete_at,
                 assigned):
        super().__init__(entries, rank=rank)
        self.mode = mode
        self.gathered = dict(gathered)
        self.collective_free = tuple(e.name for e in entries if e.name not in self.gathered)
        #: whether ``iter_local()`` runs Bridge's collectives (export mode, fallback tasks);
        #: the trainer engine refuses such a source with the nccl_m2n transport
        self.collectives_while_iterating = stream is not None
        self._stream = stream
        self._plan = stream_plan
        self._complete_at = complete_at  # wire -> last stream step any rank needs for it
        self._assigned = assigned  # (wire, expert) -> owner rank (stacked stream wires)
        self._pass = None
        self._shapes = {e.name: e.global_shape for e in entries}
        self._dtypes = {e.name: e.dtype for e in entries}

    @property
    def notes(self) -> tuple[str, ...]:
        """Sentences for a plan: which wire tensors went through Bridge's gather and why."""
        if not self.gathered:
            return (f"Megatron-Bridge ({self.mode} mode): every wire tensor is sent from the "
                    "rank's local Megatron tensor; no gather",)
        by_reason: dict[str, list[str]] = {}
        for name, why in self.gathered.items():
            by_reason.setdefault(why, []).append(name)
        return tuple(f"Megatron-Bridge: {len(v)} wire tensor(s) went through Bridge's gather "
                     f"({why}): {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}"
                     for why, v in by_reason.items())

    # -- the stream pass ---------------------------------------------------

    def _advance(self, upto: int) -> None:
        """Run stream steps until ``upto`` steps are done, keeping this rank's pieces."""
        p = self._pass
        while p["done"] < upto:
            step = p["done"]
            out = next(p["it"])
            p["done"] += 1
            for hf_name, wire, e, k, n in self._plan.outputs.get(step, ()):
                t = out.get(hf_name)
                if t is None:
                    raise BridgeSourceError(
                        f"Bridge's {'export' if self.mode == 'export' else 'gather'} did not "
                        f"produce '{hf_name}' at step {step} on rank {self.rank} this time "
                        "(it did when the source was built); the model changed shape")
                if e is None:
                    order = self._plan.permute.get(hf_name)
                    p["dense"][wire] = t if order is None else t.permute(order)
                elif self._assigned.get((wire, e)) == self.rank:
                    p["experts"].setdefault(wire, {}).setdefault(e, {})[k] = t
            del out

    def _finish(self) -> None:
        p = self._pass
        if p is not None:
            self._advance(self._plan.steps)
            self._pass = None

    def _stream_local(self, wire: str) -> torch.Tensor:
        p = self._pass
        self._advance(self._complete_at[wire])
        if wire in p["dense"]:
            return p["dense"].pop(wire)
        mine = p["experts"].pop(wire, {})
        shape = self._shapes[wire]
        parts = len(next(iter(mine.values()))) if mine else 1
        rows = shape[1] // max(parts, 1)
        order = sorted(mine)
        buf = torch.empty((len(order), *shape[1:]), dtype=self._dtypes[wire])
        for j, e in enumerate(order):  # this rank's experts only: its share of the layer
            for k, t in mine[e].items():
                buf[j, k * rows:(k + 1) * rows] = t
        return buf

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's local tensors in manifest order.

        Known kinds: the local Megatron tensor, no collective. Streamed wire
        tensors: the stream is advanced, on every rank alike, to the step
        where the next wire tensor is complete on every rank; whatever is
        left of it runs after the last entry.
        """
        if self._stream is not None:
            self._pass = {"it": iter(self._stream.start()), "done": 0, "dense": {},
                          "experts": {}}
        try:
            rank = self.rank
            for entry, meta in zip(self.entries, self.metadata):
                if entry.name in self._complete_at:
                    self._advance(self._complete_at[entry.name])
                if meta.owners is not None and rank not in meta.owners:
                    continue
                yield entry.name, _check(entry, meta, rank)
            self._finish()
        finally:
            self._pass = None


def _check(entry, meta, rank):
    from m2nkit.manifest.source import _check_local_shape  # the one shape/dtype rule

    return _check_local_shape(entry.name, rank, meta, entry.local_tensor())


def _chunk_config(chunks: Sequence[Any]) -> Any:
    """The ``TransformerConfig`` of the model (every chunk shares it)."""
    m = chunks[0]
    while hasattr(m, "module") and not hasattr(m, "config"):
        m = m.module
    return getattr(m, "config", None)


def _hf_config(bridge: Any) -> Any:
    hf = getattr(bridge, "hf_pretrained", None)
    config = getattr(hf, "config", hf)
    if config is None:
        raise BridgeSourceError("the bridge has no Hugging Face config (bridge.hf_pretrained); "
                                "build it with AutoBridge.from_hf_pretrained(path) or "
                                "AutoBridge.from_hf_config(config)")
    return config


def _family(config: Any) -> Family:
    try:
        return family_for(config)
    except UnsupportedArchitecture as e:
        archs = getattr(config, "architectures", None) or ["?"]
        raise BridgeSourceError(
            f"Megatron-Bridge model of architecture {archs[0]!r}: m2nkit has no family (vLLM "
            f"table) for it, so it cannot be sent into vLLM; {e}") from None


def bridge_source(bridge: Any, model_chunks: Any, mode: str = "tasks", *,
                  gather: Iterable[str] = (), rank: int | None = None) -> BridgeSource:
    """A Megatron-Bridge model's weights as an ``M2NWeightSource`` (call on every rank).

    Args:
        bridge: the ``megatron.bridge.AutoBridge`` the model was built with
            (``AutoBridge.from_hf_pretrained(path)``; its HF config names the
            architecture, and with it the m2nkit family).
        model_chunks: the Megatron model: a list of chunks (one per virtual
            pipeline stage), or one chunk.
        mode: ``"tasks"`` (default): known mapping kinds shard to shard with
            no collective while iterating, others through their task's
            ``megatron_to_hf``; ``"export"``: ``export_hf_weights`` as the
            provider (module docstring).
        gather: mapping class names (``"QKVMapping"``) to send through their
            task's own ``megatron_to_hf`` in ``"tasks"`` mode even though
            their layout is known: to compare the two paths, or to step
            around a layout m2nkit gets wrong. Default: none.
        rank: this trainer rank (default: the default process group's rank).

    A collective call: every rank of the default process group calls it in
    the same order (Bridge's ``get_conversion_tasks`` gathers names over PP;
    the declarations are gathered once over the world; ``"export"`` mode and
    fallback tasks run once to learn their output names, shapes and dtypes).

    Returns:
        A :class:`BridgeSource`; ``metadata`` identical on every rank, wire
        tensors in the family's wire order (HF names; experts stacked).

    Raises:
        BridgeSourceError: an unknown ``mode``; an architecture without an
            m2nkit family (before any collective, naming it); a tensor
            Bridge produces that the family table has no wire tensor for;
            a wire tensor of the table no rank holds; ranks disagreeing on
            a dtype or shape; in ``"tasks"`` mode a grouped-export mapping
            (GPT-OSS's experts: use ``"export"``). Every rank raises the
            same message, naming the rank that found it.
    """
    if mode not in MODES:
        raise BridgeSourceError(f"bridge_source: mode {mode!r} is not one of {', '.join(MODES)}")
    config = _hf_config(bridge)
    family = _family(config)  # refuse before Bridge's own collectives
    import torch.distributed as dist

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    wires = table_wires(family, config)
    left_out: list[str] = []
    if chunks and without_tower(chunks[0]):  # Qwen3VLModel(add_encoder=False): no tower
        left_out = tower_wires(family, [w.name for w in wires])
        wires = [w for w in wires if w.name not in left_out]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    names = _Names(family, wires, tied)
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if dist.is_initialized() else 0
    rank = me if rank is None else rank

    error = None
    hold, stream, splan = _Holding(), None, _StreamPlan()
    try:
        if mode == "tasks":
            tasks = bridge.get_conversion_tasks(chunks)
            hold, fallback = _tasks_holding(tasks, names, _chunk_config(chunks),
                                            frozenset(gather))
            grouped = sorted({type(t.mapping).__name__ for t in fallback
                              if getattr(t.mapping, "is_grouped_export", False)})
            if grouped:
                raise BridgeSourceError(
                    f"mode='tasks' cannot send {', '.join(grouped)}: a grouped-export mapping "
                    "(one HF tensor holds every expert; Bridge stacks the per-expert outputs of "
                    "its megatron_to_hf inside its own export loop, model_bridge.py "
                    "_accumulate_grouped_export) with no layout m2nkit knows; use "
                    "bridge_source(..., mode='export')")
            if fallback:
                stream = _tasks_stream(fallback)
                for t in fallback:
                    kind = type(t.mapping).__name__
                    why = (f"{kind} named in bridge_source(gather=...)" if kind in gather else
                           f"{kind} has no layout m2nkit knows") + \
                        "; its megatron_to_hf gathers"
                    hf = t.mapping.hf_param
                    for n in ([hf] if isinstance(hf, str) else list(hf.values())):
                        ex = names.expert(n)
                        hold.gathered[ex[0] if ex else n] = why
        else:
            stream = _export_stream(bridge, chunks)
        if stream is not None:
            splan = _dry_run(stream, names, "Megatron-Bridge's export" if mode == "export"
                             else "Bridge's megatron_to_hf")
    except BridgeSourceError as e:  # every rank must hear of it: finish the exchange first
        error = str(e)

    mine = {
        "rank": rank,
        "error": error,
        "decls": [(d.wire, str(d.dtype), d.box, d.local_start) for d in hold.decls],
        "gathered": hold.gathered,
        "seen": {w: (str(dt), s) for w, (dt, s) in splan.seen.items()},
        "last_step": splan.last_step,
        "experts": {f"{w}\0{e}": sorted(ks) for (w, e), ks in splan.expert_parts.items()},
        "steps": splan.steps,
    }
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    errors = [(d["rank"], d["error"]) for d in everyone if d["error"]]
    if errors:
        r, msg = errors[0]
        raise BridgeSourceError(f"rank {r}: {msg}")
    src = _build(everyone, wires, names, mode, rank, chunks, hold, stream, splan)
    src.left_out = tuple(left_out)
    return src


def _build(everyone, wires, names, mode, rank, chunks, hold, stream, splan) -> BridgeSource:
    dtype_of = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                    torch.int64, torch.int32, torch.uint8, torch.int8)}
    table = {w.name: w for w in wires}
    pieces: dict[str, list[Piece]] = {}
    dtypes: dict[str, tuple[str, int]] = {}
    gathered: dict[str, str] = {}

    def note_dtype(wire, dt, r):
        if wire in dtypes and dtypes[wire][0] != dt:
            raise BridgeSourceError(
                f"wire tensor '{wire}': rank {dtypes[wire][1]} holds it as {dtypes[wire][0]}, "
                f"rank {r} as {dt}; every rank must hold one dtype")
        dtypes.setdefault(wire, (dt, r))

    for d in everyone:
        r = d["rank"]
        for wire, dt, box, start in d["decls"]:
            note_dtype(wire, dt, r)
            pieces.setdefault(wire, []).append(Piece(r, tuple(map(tuple, box)), tuple(start)))
        gathered.update(d["gathered"])
    # streamed wires: dense ones are replicas on their holders; each expert of a
    # stacked one goes to one of its holders (e mod n), who keeps only its own
    holders: dict[str, list[int]] = {}
    expert_holders: dict[tuple[str, int], list[int]] = {}
    for d in everyone:
        for wire, (dt, _) in d["seen"].items():
            note_dtype(wire, dt, d["rank"])
        for key in d["experts"]:
            wire, e = key.split("\0")
            expert_holders.setdefault((wire, int(e)), []).append(d["rank"])
        for wire in d["seen"]:
            holders.setdefault(wire, []).append(d["rank"])
    steps = {d["steps"] for d in everyone if d["steps"]}
    if len(steps) > 1:
        raise BridgeSourceError(f"ranks ran different numbers of Bridge calls ({sorted(steps)}); "
                                "their conversion tasks disagree")
    assigned = {key: rs[key[1] % len(rs)] for key, rs in expert_holders.items()}
    complete_at: dict[str, int] = {}
    for d in everyone:
        for wire, step in d["last_step"].items():
            complete_at[wire] = max(complete_at.get(wire, 0), step + 1)
            if mode == "export":
                gathered.setdefault(wire, "mode='export': Bridge's export_hf_weights gathers "
                                          "every tensor onto every rank")
    for wire, rs in holders.items():
        w = table[wire]
        if w.stacked:
            per_owner: dict[int, list[int]] = {}
            for (wn, e), owner in sorted(assigned.items()):
                if wn == wire:
                    per_owner.setdefault(owner, []).append(e)
            for owner, es in per_owner.items():
                for j, e in enumerate(es):  # local order: the owner's experts ascending
                    pieces.setdefault(wire, []).append(
                        Piece(owner, ((e, e + 1),) + tuple((0, n) for n in w.shape[1:]),
                              (j,) + (0,) * (len(w.shape) - 1)))
        else:
            for r in rs:
                pieces.setdefault(wire, []).append(Piece(r, tuple((0, n) for n in w.shape)))
    missing = [w.name for w in wires if w.name not in pieces]
    if missing:
        raise BridgeSourceError(
            f"{len(missing)} wire tensor(s) of the {names.family.architecture} table are held "
            f"by no rank of the Bridge model, e.g. {missing[:3]}; Bridge's mapping registry "
            "did not produce them (a layer without a mapping, or another variant of the "
            "architecture)")
    entries = []
    local = dict(hold.local)
    for w in wires:
        dt = dtype_of.get(dtypes[w.name][0])
        if dt is None:
            raise BridgeSourceError(f"wire tensor '{w.name}': dtype {dtypes[w.name][0]} is not "
                                    "supported on the wire")
        lay = PieceLayout(tuple(pieces[w.name]), where=f"wire tensor '{w.name}'")
        provider = local.get(w.name)
        if provider is None:
            provider = _Lazy(w.name)
        entries.append(M2NManifestEntry(w.name, dt, tuple(w.shape), lay, provider))
    src = BridgeSource(entries, rank=rank, mode=mode, gathered=gathered, stream=stream,
                       stream_plan=splan, complete_at=complete_at, assigned=assigned)
    for e in entries:
        if isinstance(e.local_tensor, _Lazy):
            e.local_tensor.source = src
    return src


class _Lazy:
    """Provider of a streamed wire tensor: the source's current pass holds it."""

    def __init__(self, wire: str):
        self.wire = wire
        self.source: BridgeSource | None = None

    def __call__(self) -> torch.Tensor:
        if self.source is None or self.source._pass is None:
            raise BridgeSourceError(f"wire tensor '{self.wire}' comes from a Bridge stream; "
                                    "read it through BridgeSource.iter_local()")
        return self.source._stream_local(self.wire)
