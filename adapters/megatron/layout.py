"""Megatron-Core's parameter layouts as pieces of Hugging Face wire tensors (pure rules).

A Megatron-Core ``GPTModel`` keeps each tensor in its own, fused form:
``linear_qkv`` interleaves q, k and v rows per query group, ``linear_fc1``
holds ``[gate_r; up_r]`` on each tensor-parallel rank, the vocabulary is
padded, experts are numbered per expert-parallel rank, a pipeline stage
numbers its layers locally. m2nkit sends none of that fused form: every
Megatron rank hands over its local tensor as it is, and this module says
which *pieces* of which HF wire tensors it holds and where they sit
locally (``m2nkit.manifest.Piece``). Splitting happens by index, on the
rank, never by a gather.

Everything here is arithmetic on sizes; nothing imports megatron. The live
source (:mod:`m2nkit.adapters.megatron.source`), the dry-run trainer spec
(``megatron:tp=T,pp=P,...``) and the Megatron-Bridge adapter all use these
functions, so the three agree by construction.

Rules, each restated from megatron-core 0.19.2 (file named per function):

* fused QKV (:func:`qkv_row_runs`);
* gated ``linear_fc1`` (:func:`fc1_row_runs`);
* vocabulary padding (:func:`padded_vocab_size`, :func:`vocab_rows`);
* experts (:func:`local_expert_range`);
* rank grids (:class:`MegatronParallel`, :meth:`MegatronParallel.ranks`);
* pipeline layer assignment (:func:`stage_layers`);
* name tables (:class:`MegatronName`; one table per family in
  :mod:`m2nkit.adapters.megatron.names`) and the pieces of one wire tensor
  (:func:`wire_pieces`).

Kinds. A row names how its tensor is split with the families' shard kinds
(``REPLICATED``, ``COLUMN``, ``ROW``, ``VOCAB``, ``QKV`` of
``m2nkit.adapters.families.kinds``, the one vocabulary of both sides) where
Megatron splits it in the same way, and with the kinds below for the splits
only Megatron makes (``GATED_FC1``, ``EXPERT_FC1``, ``EXPERT_FC2``). The
rules applied to them are Megatron's own, stated in this module; the
kinds' vLLM methods are never called here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Mapping, Sequence

from m2nkit.manifest.pieces import Box, Piece, PieceLayout

from ..families.kinds import COLUMN, QKV, REPLICATED, ROW, VOCAB

__all__ = [
    "MegatronKind", "GATED_FC1", "EXPERT_FC1", "EXPERT_FC2", "QKV_CONCAT", "RULES", "MegatronName",
    "Run",
    "qkv_row_runs", "fc1_row_runs", "padded_vocab_size", "vocab_rows", "local_expert_range",
    "stage_layers", "MegatronParallel", "WireRule", "match_wire", "match_megatron", "wire_pieces",
    "wire_stage", "megatron_templates", "MegatronLayoutError",
]


class MegatronLayoutError(ValueError):
    """Sizes or names the Megatron layout rules cannot place (the message names the value)."""


# --------------------------------------------------------------------------
# rule names (how a Megatron tensor is split over its ranks)
#
# The families' kinds, as Megatron applies them (rules in _pieces):
#   REPLICATED  the whole tensor on every rank of its stage (norms, router, ``expert_bias``)
#   COLUMN      ``ColumnParallelLinear``: rows split evenly over tp (megatron-core
#               ``tensor_parallel/layers.py``, ``partition_dim=0``)
#   ROW         ``RowParallelLinear``: columns (dim 1) split evenly over tp; its bias is whole
#   VOCAB       ``VocabParallelEmbedding`` / ``output_layer``: ``Vp/tp`` rows per rank,
#               padding not sent
#   QKV         ``linear_qkv``: rows interleaved per query group, then column-parallel


@dataclass(frozen=True, eq=False)
class MegatronKind:
    """A split only Megatron makes (the families' kinds cover the others).

    Attributes:
        name: its name in tables and messages (``"gated_fc1"``).
    """

    name: str

    def __repr__(self) -> str:
        return f"<megatron kind {self.name}>"


#: gated ``linear_fc1``: ``[gate_r; up_r]`` per tp rank (``partition_stride=2``)
GATED_FC1 = MegatronKind("gated_fc1")
#: an expert's gated ``linear_fc1`` split over etp, stacked by global expert
EXPERT_FC1 = MegatronKind("expert_fc1")
#: an expert's ``linear_fc2`` (row-parallel over etp), stacked by global expert
EXPERT_FC2 = MegatronKind("expert_fc2")

#: a ``linear_qkv`` fed by ONE wire tensor holding ``[q; k; v]`` (all q heads, then all k,
#: then all v rows: Qwen3-VL's vision ``attn.qkv``), interleaved per query group as
#: :data:`QKV` (Megatron-Bridge ``ConcatenatedQKVMapping``, ``conversion/param_mapping.py``)
QKV_CONCAT = MegatronKind("qkv_concat")

#: Every kind a :class:`MegatronName` may name.
RULES = (REPLICATED, COLUMN, ROW, VOCAB, QKV, GATED_FC1, EXPERT_FC1, EXPERT_FC2, QKV_CONCAT)


@dataclass(frozen=True)
class MegatronName:
    """One row of a family's Megatron name table (:mod:`.names`): Megatron tensor -> wire tensor(s).

    Attributes:
        megatron: the Megatron-Core name template, or several spellings of
            one tensor (local layer spec first, then TransformerEngine spec:
            ``decoder.layers.{L}.input_layernorm.weight`` and
            ``decoder.layers.{L}.self_attention.linear_qkv.layer_norm_weight``).
            ``{L}`` is the layer index as the module tree numbers it (local
            to the chunk); ``{i}`` a local expert index (SequentialMLP
            ``local_experts.{i}`` / TEGroupedMLP ``weight{i}``); ``{B}`` a
            vision-tower index (block, deepstack merger), the same in both
            names: the vision tower is not pipelined.
        rule: one of :data:`RULES` (a kind object; ``rule.name`` in messages).
        wire: the wire name template (``{L}`` = the global layer), or for
            ``QKV`` / ``GATED_FC1`` a mapping part -> wire template
            (``q``/``k``/``v``[/``gate``]; ``gate``/``up``), stored as a
            tuple of ``(part, template)`` pairs (read it with :attr:`wires`).
        norm: a norm weight: with ``layernorm_zero_centered_gamma`` Megatron
            stores ``w - 1`` and the wire carries ``w`` (+1 in the provider).
        buffer: a persistent buffer, not a parameter (``router.expert_bias``):
            its dtype is kept on the wire (fp32).
        when: a config key that must be truthy for the tensor to exist
            (``add_qkv_bias``); informative only.

    Raises:
        MegatronLayoutError: an unknown rule; a part mapping for a rule
            without parts, or the wrong parts.
    """

    megatron: str | tuple[str, ...]
    rule: str
    wire: str | Mapping[str, str]
    norm: bool = False
    buffer: bool = False

    def __post_init__(self) -> None:
        names = (self.megatron,) if isinstance(self.megatron, str) else tuple(self.megatron)
        object.__setattr__(self, "megatron", names)
        if not any(self.rule is r for r in RULES):
            raise MegatronLayoutError(f"Megatron name {names[0]!r}: rule {self.rule!r} is not "
                                      f"one of {', '.join(r.name for r in RULES)}")
        parts = {QKV: ({"q", "k", "v"}, {"q", "gate", "k", "v"}), GATED_FC1: ({"gate", "up"},)}
        if self.rule in parts:
            if isinstance(self.wire, str) or set(dict(self.wire)) not in parts[self.rule]:
                raise MegatronLayoutError(
                    f"Megatron name {names[0]!r}: rule {self.rule.name!r} needs wire parts "
                    f"{' or '.join(sorted(map(str, parts[self.rule])))}, got {self.wire!r}")
            # hashable: the tables are cached by value
            object.__setattr__(self, "wire", tuple(dict(self.wire).items()))
        elif not isinstance(self.wire, str):
            raise MegatronLayoutError(f"Megatron name {names[0]!r}: rule {self.rule.name!r} "
                                      f"feeds one wire tensor, got parts {self.wire!r}")

    @property
    def wires(self) -> dict[str | None, str]:
        """part -> wire template (part ``None`` for a single wire tensor)."""
        return {None: self.wire} if isinstance(self.wire, str) else dict(self.wire)

    def wire_of(self, part: str | None) -> str:
        """The wire template of ``part`` (``None`` for a single wire tensor)."""
        return self.wires[part]


# --------------------------------------------------------------------------
# split rules of one tensor


@dataclass(frozen=True)
class Run:
    """Rows ``[start, stop)`` of wire part ``part`` sit at local row ``local`` onward."""

    part: str
    start: int
    stop: int
    local: int


def _div(n: int, k: int, what: str) -> int:
    if k <= 0 or n % k:
        raise MegatronLayoutError(f"{what}: {n} is not divisible by {k}")
    return n // k


def qkv_row_runs(nh: int, ng: int, hd: int, tp: int, tp_rank: int, *,
                 gate: bool = False) -> tuple[Run, ...]:
    """Which q/k/v (and gate) rows tp rank ``tp_rank`` holds in its local ``linear_qkv``.

    The full fused tensor has, for each query group ``g`` in order, the rows
    ``[q of the nh/ng heads of g (nh/ng*hd rows); (gate of the same heads,
    nh/ng*hd rows, with attention_output_gate); k_g (hd); v_g (hd)]``
    (megatron-core ``transformer/attention.py``, ``SelfAttention.
    get_query_key_value_tensors``: view ``[.., ng, (np/ng + 2) * hn]`` then
    split ``[np/ng*hn, (np/ng*hn,) hn, hn]``). ``linear_qkv`` is a
    ``ColumnParallelLinear``: rank ``r`` holds rows ``[r*R/tp, (r+1)*R/tp)``
    of it, ``R = ng*(nh/ng*(1+gate) + 2)*hd``. With ``ng >= tp`` that is
    ``ng/tp`` whole groups; with ``ng < tp`` (``num_query_groups <
    world_size`` branch, which all-gathers in the forward) a rank holds an
    arbitrary row range: possibly only q rows, possibly part of a head.

    Returns:
        Runs in local row order; ``Run.start/stop`` are rows of the HF
        tensor of that part (``q_proj`` ``[nh*hd]``, ``k_proj``/``v_proj``
        ``[ng*hd]``; ``gate`` ``[nh*hd]`` laid out like q).

    Raises:
        MegatronLayoutError: ``nh`` not divisible by ``ng``, or ``R`` by ``tp``.
    """
    qpg = _div(nh, ng, "num_attention_heads / num_query_groups") * hd
    seg = [("q", qpg)] + ([("gate", qpg)] if gate else []) + [("k", hd), ("v", hd)]
    per_group = sum(n for _, n in seg)
    rows = _div(ng * per_group, tp, f"linear_qkv rows (ng={ng}, heads={nh}, head dim={hd}) / tp")
    lo, hi = tp_rank * rows, (tp_rank + 1) * rows
    out: list[Run] = []
    for g in range(ng):
        base = g * per_group
        for part, n in seg:
            a, b = max(lo, base), min(hi, base + n)
            if a < b:
                off = g * n  # the part's rows of group g start at g*n in its HF tensor
                out.append(Run(part, off + a - base, off + b - base, a - lo))
            base += n
    return tuple(out)


def fc1_row_runs(inter: int, tp: int, tp_rank: int) -> tuple[Run, Run]:
    """Gate and up rows of tp rank ``tp_rank``'s local gated ``linear_fc1`` ``[2*inter/tp, H]``.

    Megatron keeps ``[gate_r; up_r]`` per rank (``MLP.__init__`` builds
    ``linear_fc1`` with ``2*ffn_hidden_size`` outputs for ``gated_linear_unit``
    and ``partition_stride=2``; ``mlp.py`` ``glu`` splits the local output in
    two halves; Megatron-Bridge ``GatedMLPMapping`` restates it).

    Raises:
        MegatronLayoutError: ``inter`` not divisible by ``tp``.
    """
    n = _div(inter, tp, "ffn_hidden_size / tp")
    return (Run("gate", tp_rank * n, (tp_rank + 1) * n, 0),
            Run("up", tp_rank * n, (tp_rank + 1) * n, n))


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: ``ceil(V / (divisible_by*tp)) * divisible_by*tp``.

    megatron-training ``vocab_utils.calculate_padded_vocab_size``
    (``--make-vocab-size-divisible-by``, default 128). Megatron-Bridge pads
    only with ``should_pad_vocab`` (``gpt_provider.py``); then pass
    ``divisible_by=1`` and the layout needs ``V`` divisible by ``tp``.
    """
    m = divisible_by * tp
    return -(-vocab // m) * m


def vocab_rows(vocab: int, padded: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Token rows ``[start, stop)`` of the real vocabulary tp rank ``tp_rank`` holds (local row 0).

    ``VocabParallelEmbedding``: ``per = Vp/tp`` rows per rank from
    ``rank*per`` (megatron-core ``tensor_parallel/utils.py``,
    ``VocabUtility.vocab_range_from_per_partition_vocab_size``); rows
    ``>= V`` are padding and belong to no wire tensor. May be empty.

    Raises:
        MegatronLayoutError: ``padded`` not divisible by ``tp`` or below ``vocab``.
    """
    per = _div(padded, tp, "padded vocabulary / tp")
    if padded < vocab:
        raise MegatronLayoutError(f"padded vocabulary {padded} is smaller than the vocabulary "
                                  f"{vocab}")
    a = min(tp_rank * per, vocab)
    return a, min((tp_rank + 1) * per, vocab)


def local_expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global experts of ep rank ``ep_rank``: local expert ``i`` is ``ep_rank*E/ep + i``.

    megatron-core ``transformer/moe/moe_layer.py``: ``local_expert_indices_offset
    = ep_rank * num_local_experts``.

    Raises:
        MegatronLayoutError: ``E`` not divisible by ``ep``.
    """
    n = _div(num_experts, ep, "num_moe_experts / expert_model_parallel_size")
    return range(ep_rank * n, (ep_rank + 1) * n)


def stage_layers(num_layers: int, pp: int, vpp: int = 1, *, first: int | None = None,
                 last: int | None = None) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Global layer ids per pipeline stage and virtual chunk: ``out[pp_rank][vp_stage]``.

    megatron-core ``transformer/transformer_layer.py``,
    ``get_transformer_layer_offset``: even stages split ``L/pp`` layers; with
    ``vpp`` chunks, chunk ``v`` of stage ``p`` starts at ``v*L/vpp +
    p*L/(pp*vpp)``; ``first``/``last`` (``num_layers_in_first/last_pipeline_stage``)
    give the first/last stage their own count, the middle stages share the
    rest evenly. A live model reads its layers' own ``layer_number``
    instead (which also covers ``pipeline_model_parallel_layout``).

    Raises:
        MegatronLayoutError: a count that does not split evenly.
    """
    if pp == 1:
        if vpp != 1:
            raise MegatronLayoutError("vpp > 1 needs pp > 1")
        return ((tuple(range(num_layers)),),)
    f = first or 0
    l_ = last or 0
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - f - l_
    if middle < 0 or (middle_stages == 0 and middle) or (middle_stages and middle % middle_stages):
        raise MegatronLayoutError(
            f"{num_layers} layers do not split over pp={pp} (first stage {first}, last stage "
            f"{last}): the middle stages need an equal share")
    counts = [middle // middle_stages if middle_stages else 0] * pp
    if first is not None:
        counts[0] = f
    if last is not None:
        counts[-1] = l_
    for p, c in enumerate(counts):
        if c == 0:
            # megatron-core TransformerConfig: num_layers_in_first/last_pipeline_stage
            # "must be larger than 0"; a middle stage cannot be empty either
            raise MegatronLayoutError(
                f"pipeline stage {p} would hold no layers ({num_layers} layers over pp={pp}, "
                f"first stage {first}, last stage {last}); megatron-core refuses an empty stage")
        if c % vpp:
            raise MegatronLayoutError(f"pipeline stage {p} holds {c} layers, not divisible by "
                                      f"vpp={vpp}")
    per_chunk = [c // vpp for c in counts]
    out = [[() for _ in range(vpp)] for _ in range(pp)]
    start = 0
    for v in range(vpp):
        for p in range(pp):
            out[p][v] = tuple(range(start, start + per_chunk[p]))
            start += per_chunk[p]
    return tuple(tuple(x) for x in out)


# --------------------------------------------------------------------------
# rank grids


@dataclass(frozen=True)
class MegatronParallel:
    """Megatron parallel sizes and the rank grid they imply.

    Attributes:
        tp, pp, vpp, ep: tensor, pipeline, virtual pipeline, expert parallel sizes.
        etp: expert tensor-parallel size; ``None`` means ``tp`` (megatron-core
            ``parallel_state.initialize_model_parallel``: "defaults to
            tensor_model_parallel_size").
        dp: data-parallel size; ``None``: the least that fits the expert
            grid (``tp*dp`` divisible by ``etp*ep``).
        layers: ``layers[pp_rank][vp_stage]`` = global layer ids
            (:func:`stage_layers`); ``None``: even stages (needs the layer
            count, see :meth:`with_layers`).
        vocab_divisible_by: ``make_vocab_size_divisible_by`` (the padded
            vocabulary is a multiple of it times ``tp``).
        grid: ``{"dense": {(pp, dp, tp): rank}, "expert": {(pp, edp, ep, etp): rank}}``
            as read from live process groups; ``None``: Megatron's default
            order ``tp-cp-ep-dp-pp`` (:meth:`ranks`).

    Raises:
        MegatronLayoutError: a size < 1; ``tp*dp`` not divisible by ``etp*ep``.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int | None = None
    layers: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    vocab_divisible_by: int = 128
    grid: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "vpp", "ep", "vocab_divisible_by"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MegatronLayoutError(f"megatron parallel size {k}={v!r} must be an int >= 1")
        etp = self.tp if self.etp is None else self.etp
        object.__setattr__(self, "etp", etp)
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
            raise MegatronLayoutError(f"megatron parallel size etp={etp!r} must be an int >= 1")
        need = etp * self.ep
        if self.dp is None:
            object.__setattr__(self, "dp", math.lcm(self.tp, need) // self.tp)
        if self.dp < 1 or (self.tp * self.dp) % need:
            raise MegatronLayoutError(
                f"tp*dp = {self.tp}*{self.dp} ranks per pipeline stage is not divisible by "
                f"etp*ep = {etp}*{self.ep} (megatron-core parallel_state: the expert grid "
                f"etp x ep x edp covers the same ranks); use dp={need // math.gcd(self.tp, need)}"
                " or a multiple")
        if self.layers is not None:
            if len(self.layers) != self.pp or any(len(s) != self.vpp for s in self.layers):
                raise MegatronLayoutError(
                    f"layer assignment has {len(self.layers)} stages x "
                    f"{[len(s) for s in self.layers]} chunks; expected pp={self.pp} x "
                    f"vpp={self.vpp}")

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``tp*dp / (etp*ep)``."""
        return self.tp * self.dp // (self.etp * self.ep)

    @property
    def world(self) -> int:
        """Trainer ranks: ``tp*dp*pp``."""
        return self.tp * self.dp * self.pp

    def with_layers(self, num_layers: int, *, first: int | None = None,
                    last: int | None = None) -> "MegatronParallel":
        """This grid with :func:`stage_layers` filled in (unchanged when already set)."""
        if self.layers is not None:
            return self
        return MegatronParallel(self.tp, self.pp, self.vpp, self.ep, self.etp, self.dp,
                                stage_layers(num_layers, self.pp, self.vpp, first=first,
                                             last=last),
                                self.vocab_divisible_by, self.grid)

    @cached_property
    def _stage_of(self) -> dict[int, int]:
        if self.layers is None:
            raise MegatronLayoutError("the layer assignment per stage is unknown; call "
                                      "with_layers(num_layers) first")
        return {L: p for p, chunks in enumerate(self.layers) for c in chunks for L in c}

    def stage_of(self, layer: int) -> int:
        """The pipeline stage holding global layer ``layer``.

        Raises:
            MegatronLayoutError: no stage holds it.
        """
        try:
            return self._stage_of[layer]
        except KeyError:
            raise MegatronLayoutError(f"no pipeline stage holds layer {layer}; the stages hold "
                                      f"{sorted(self._stage_of)}") from None

    @cached_property
    def ranks(self) -> dict[str, dict[tuple[int, ...], int]]:
        """The rank of every grid coordinate.

        ``"dense"``: ``(pp, dp, tp) -> rank``; ``"expert"``: ``(pp, edp, ep,
        etp) -> rank``. Without a live ``grid``: megatron-core's default
        order ``tp-cp-ep-dp-pp`` (``parallel_state.RankGenerator``, cp = 1):
        ``rank = tp_r + tp*(dp_r + dp*pp_r)`` and, on the expert grid,
        ``rank = etp_r + etp*(ep_r + ep*(edp_r + edp*pp_r))``.
        """
        if self.grid is not None:
            return self.grid
        dense = {(p, d, t): t + self.tp * (d + self.dp * p)
                 for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)}
        expert = {(p, d, e, t): t + self.etp * (e + self.ep * (d + self.edp * p))
                  for p in range(self.pp) for d in range(self.edp) for e in range(self.ep)
                  for t in range(self.etp)}
        return {"dense": dense, "expert": expert}

    def dense_holders(self, stage: int, tp_rank: int) -> tuple[int, ...]:
        """Ranks of pipeline stage ``stage`` at tp rank ``tp_rank`` (every dp replica)."""
        return tuple(self.ranks["dense"][(stage, d, tp_rank)] for d in range(self.dp))

    def expert_holders(self, stage: int, ep_rank: int, etp_rank: int) -> tuple[int, ...]:
        """Ranks of stage ``stage`` at expert coordinate (ep_rank, etp_rank) (every edp replica)."""
        return tuple(self.ranks["expert"][(stage, d, ep_rank, etp_rank)]
                     for d in range(self.edp))


# --------------------------------------------------------------------------
# name tables


def _template_regex(template: str) -> re.Pattern:
    out = (re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{i\}", r"(?P<i>\d+)")
           .replace(r"\{B\}", r"(?P<B>\d+)"))
    return re.compile("^" + out + "$")


@dataclass(frozen=True)
class WireRule:
    """A wire name matched to its Megatron row: ``entry``, the ``part`` it is, its ``layer``."""

    entry: MegatronName
    part: str | None
    layer: int | None


@lru_cache(maxsize=64)
def _wire_index(names: tuple[MegatronName, ...]) -> tuple[tuple[re.Pattern, MegatronName, Any], ...]:
    return tuple((_template_regex(t), e, part) for e in names for part, t in e.wires.items())


def match_wire(names: Sequence[MegatronName], wire: str) -> WireRule | None:
    """The row of ``names`` whose wire template matches ``wire`` (``None``: none does)."""
    for rx, e, part in _wire_index(tuple(names)):
        m = rx.match(wire)
        if m:
            L = m.groupdict().get("L")
            return WireRule(e, part, None if L is None else int(L))
    return None


@lru_cache(maxsize=64)
def _megatron_index(names: tuple[MegatronName, ...]) -> tuple[tuple[re.Pattern, MegatronName], ...]:
    return tuple((_template_regex(t), e) for e in names for t in e.megatron)


def match_megatron(names: Sequence[MegatronName], name: str
                   ) -> tuple[MegatronName, int | None, int | None] | None:
    """``(row, local layer, local expert)`` for a Megatron tensor name, or ``None``."""
    for rx, e in _megatron_index(tuple(names)):
        m = rx.match(name)
        if m:
            g = m.groupdict()
            return (e, None if g.get("L") is None else int(g["L"]),
                    None if g.get("i") is None else int(g["i"]))
    return None


def megatron_templates(names: Sequence[MegatronName]) -> list[str]:
    """Every Megatron name template of a table (for messages and tests)."""
    return [t for e in names for t in e.megatron]


# --------------------------------------------------------------------------
# the pieces of one wire tensor


def wire_stage(rule: WireRule, par: MegatronParallel) -> int:
    """The pipeline stage whose ranks send the wire tensor ``rule`` matched.

    A layer's tensors: the stage holding that global layer. ``embedding.*``
    lives on the first stage, the final norm and the output layer on the
    last (megatron-core ``GPTModel``: ``pre_process`` / ``post_process``).
    A tied output layer on the last stage (PP > 1) is a replica of the
    embedding; m2nkit sends the first stage's copy only.
    """
    return _stage(par, rule.entry, rule.layer)


def _stage(par: MegatronParallel, entry: MegatronName, layer: int | None) -> int:
    if layer is not None:
        return par.stage_of(layer)
    # ``embedding.*`` lives on the first stage, the final norm and the output
    # layer on the last (GPTModel pre_process / post_process). A tied output
    # layer is a replica of the embedding on the last stage: m2nkit sends the
    # first stage's copy only.
    # A VLM's (Bridge ``Qwen3VLModel``) tensors carry its module prefix: ``language_model.``
    # as a GPTModel's; ``vision_model.`` is built on the first stage only, with pp 1
    # (``modelling_qwen3_vl/model.py``: ``if self.pre_process and self.add_encoder``,
    # ``megatron_vision_transformer_config.pipeline_model_parallel_size = 1``).
    first = entry.megatron[0]
    if first.startswith("vision_model."):
        return 0
    first = first.removeprefix("language_model.")
    return 0 if first.startswith("embedding.") else par.pp - 1


def wire_pieces(rule: WireRule, shape: Sequence[int], par: MegatronParallel, *,
                sizes: Mapping[str, int], wire: str = "") -> PieceLayout:
    """Every rank's pieces of one wire tensor under ``par`` (local coordinates of the Megatron tensor).

    ``rule``: :func:`match_wire`'s answer. ``shape``: the wire tensor's
    global shape. ``sizes``: ``nh``, ``ng`` (KV heads), ``hd``, ``V``,
    ``E`` as needed (docs/reference.md symbols). Local coordinates are those of
    the Megatron local tensor (``linear_qkv`` rows for q/k/v, the padded
    embedding rows, ``[gate_r; up_r]``); for stacked experts, the rank's
    local experts stacked in local order (``[E/ep, 2*Im/etp, H]``,
    ``[E/ep, H, Im/etp]``).

    Raises:
        MegatronLayoutError: sizes the rule cannot split (names the tensor).
    """
    e, part = rule.entry, rule.part
    shape = tuple(shape)
    where = f"wire tensor '{wire}' (Megatron {e.megatron[0]!r}, rule {e.rule.name})"
    try:
        pieces = _pieces(e.rule, part, shape, par, _stage(par, e, rule.layer), sizes)
    except MegatronLayoutError as err:
        raise MegatronLayoutError(f"{where}: {err}") from None
    return PieceLayout(tuple(pieces), where=where)


def _rows_box(a: int, b: int, shape: tuple[int, ...]) -> Box:
    return ((a, b),) + tuple((0, n) for n in shape[1:])


def _pieces(rule: Any, part: str | None, shape: tuple[int, ...], par: MegatronParallel,
            stage: int, s: Mapping[str, int]) -> list[Piece]:
    out: list[Piece] = []
    nd = len(shape)
    zero = (0,) * nd
    if rule in (EXPERT_FC1, EXPERT_FC2):
        E = shape[0]
        for ep_r in range(par.ep):
            experts = local_expert_range(E, par.ep, ep_r)
            e0 = experts.start
            for t in range(par.etp):
                holders = par.expert_holders(stage, ep_r, t)
                if rule == EXPERT_FC1:
                    im = _div(shape[1], 2, "gate_up rows")
                    runs = fc1_row_runs(im, par.etp, t)
                    ex = (e0, experts.stop)
                    if par.etp == 1:  # whole experts: one box
                        boxes = [((ex, (0, shape[1]), (0, shape[2])), (0, 0, 0))]
                    else:  # [gate_t; up_t] of every local expert: two boxes
                        boxes = [((ex, (off + r.start, off + r.stop), (0, shape[2])),
                                  (0, r.local, 0)) for r, off in zip(runs, (0, im))]
                else:
                    n = _div(shape[2], par.etp, "expert linear_fc2 columns / etp")
                    boxes = [(((e0, experts.stop), (0, shape[1]), (t * n, (t + 1) * n)),
                              (0, 0, 0))]
                out += [Piece(r, b, ls) for r in holders for b, ls in boxes]
        return out
    for t in range(par.tp):
        holders = par.dense_holders(stage, t)
        if rule == REPLICATED or (rule == ROW and nd == 1):
            boxes = [(tuple((0, n) for n in shape), zero)]
        elif rule == COLUMN:
            n = _div(shape[0], par.tp, "rows / tp")
            boxes = [(_rows_box(t * n, (t + 1) * n, shape), zero)]
        elif rule == ROW:
            n = _div(shape[1], par.tp, "columns / tp")
            boxes = [(((0, shape[0]), (t * n, (t + 1) * n)) + tuple((0, m) for m in shape[2:]),
                      zero)]
        elif rule == VOCAB:
            V = shape[0]
            Vp = s.get("Vp") or padded_vocab_size(V, par.vocab_divisible_by, par.tp)
            a, b = vocab_rows(V, Vp, par.tp, t)
            boxes = [(_rows_box(a, b, shape), zero)] if a < b else []
        elif rule == QKV:
            runs = qkv_row_runs(s["nh"], s["ng"], s["hd"], par.tp, t, gate=bool(s.get("gate")))
            boxes = [(_rows_box(r.start, r.stop, shape), (r.local,) + zero[1:])
                     for r in runs if r.part == part]
        elif rule == QKV_CONCAT:
            # the wire is [q (nh*hd rows); k (ng*hd); v (ng*hd)]: QKV's runs, offset per
            # part; Qwen3-VL's ViT has as many query groups as heads (MHA)
            nh = ng = s["vnh"]
            hd = _div(shape[0], nh + 2 * ng, f"qkv rows / (heads {nh} + 2 * groups {ng})")
            off = {"q": 0, "k": nh * hd, "v": (nh + ng) * hd}
            boxes = [(_rows_box(off[r.part] + r.start, off[r.part] + r.stop, shape),
                      (r.local,) + zero[1:]) for r in qkv_row_runs(nh, ng, hd, par.tp, t)]
        elif rule == GATED_FC1:
            runs = fc1_row_runs(shape[0], par.tp, t)
            boxes = [(_rows_box(r.start, r.stop, shape), (r.local,) + zero[1:])
                     for r in runs if r.part == part]
        else:  # pragma: no cover - RULES is closed
            raise MegatronLayoutError(f"unknown rule {rule!r}")
        out += [Piece(r, b, ls) for r in holders for b, ls in boxes]
    return out
