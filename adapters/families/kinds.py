"""The shard kinds: how vLLM splits one parameter over its workers, defined once.

vLLM gives each way of sharding a weight its own layer class, and each class
owns the ``weight_loader`` that copies a checkpoint tensor into a rank's
slice of the parameter (``ColumnParallelLinear``, ``QKVParallelLinear``,
``VocabParallelEmbedding``, ``RoutedExperts``, ...). m2nkit does the same:
one object per kind, shared by every family table, and each object answers
three questions about its kind, in one place:

* **bindings** (:meth:`Kind.boxes`, :meth:`Kind.local_shape`,
  :meth:`Kind.zero_boxes`): which box of a wire tensor lands where in the
  worker's local parameter. ``m2nkit.adapters.vllm.destination_layout``
  turns these into ``Binding`` records; it never copies data.
* **divisibility** (:meth:`Kind.violation`): why a parallel size cannot hold
  a parameter, as a message naming the config value and the rule.
* **reference load** (:meth:`Kind.load`): the same rule written the way
  vLLM's ``weight_loader`` is written (narrow the checkpoint tensor to the
  rank's shard, narrow the parameter to the shard's slot, copy). Used by
  ``m2nkit.adapters.vllm.reference_load``; tests hold the bindings and the
  loads against each other and against real vLLM 0.33.0 dumps
  (``tests/data/oracle``).

Rules restated from vLLM 0.33.0 (``vllm/model_executor/``), per kind in the
class docstrings; docs/reference.md §3 has them in one list. Symbols: tp, ``H``,
``V``, ``nh``, ``nkv``, ``hd``, ``Im``, ``E`` as in docs/reference.md §3.

Workers are numbered dp-major (``worker = dp_index * tp + tp_rank``). Dense
kinds only look at the tp rank: every dp replica holds the same. MoE kinds
look at the worker: without EP the MoE tensor-parallel size is ``dp*tp``
(``tp_moe``, flattened, moe rank = worker) and every worker holds all ``E``
experts; with EP (``enable_expert_parallel``) ``tp_moe = 1``, ``ep = dp*tp``
and worker ``w`` holds whole experts (``layers/fused_moe/config.py``
``FusedMoEParallelConfig.make``, ``flatten_tp_across_dp_and_pcp``). Which
experts (``layers/fused_moe/expert_map_manager.py`` ``determine_expert_map``):
``E // ep`` each, one more on the first ``E % ep`` workers (``E`` need not
divide by ``ep``); linear placement gives each worker a contiguous run in
worker order (10 experts over ep=4: 0-2, 3-5, 6-7, 8-9), round robin gives
worker ``w`` experts ``w, w+ep, w+2*ep, ...``. Whether vLLM really uses
round robin is decided by ``m2nkit.adapters.vllm.expert_placement``; :class:`Geometry`
takes the placement in effect.

The kind objects are also the one shard-kind vocabulary of the trainer side:
Megatron-Core's name tables (``m2nkit.adapters.megatron.names``) tag each
tensor with ``REPLICATED``, ``COLUMN``, ``ROW``, ``VOCAB`` or ``QKV`` where
Megatron splits it in the same way, and ``m2nkit.adapters.megatron.layout``
applies Megatron's own rule for each (its vocabulary padding, its fused QKV
interleaved per query group), never the vLLM methods above. Splits only
Megatron makes (gated ``linear_fc1``, experts over etp) are kinds of that
module. Importing this module pulls in no torch (the ``megatron:`` spec
parser reaches it before any tensor exists).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing the kinds pulls in no torch (the
    import torch   # megatron: spec parser names its tensors with them, before torch)

    from .sizes import Sizes

__all__ = [
    "VOCAB_PADDING", "padded_vocab", "expert_ids", "Geometry", "Kind",
    "Replicated", "Column", "Row", "Qkv", "Merged", "Vocab", "ExpertsW13", "ExpertsW2",
    "ExpertsRows", "ExpertsBiasOnce", "EXPERT_ROWS", "EXPERT_BIAS_ONCE",
    "ReplicatedMerged",
    "REPLICATED", "COLUMN", "ROW", "QKV", "MERGED", "VOCAB", "W13", "W2",
    "REPLICATED_MERGED", "KINDS", "SHARED_MERGED", "SHARED_ROW", "SEQUENCE_PARALLEL_ALL2ALL",
]

#: vLLM pads the vocab of VocabParallelEmbedding/ParallelLMHead to a multiple
#: of this (``layers/vocab_parallel_embedding.py``, ``DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64

Box = tuple[tuple[int, int], ...]
#: ``(box of the wire tensor, offset of its first element in the local parameter)``.
Placed = tuple[Box, tuple[int, ...]]


#: vLLM 0.33.0 all2all backends that run MoE sequence-parallel with EP, tp > 1 and
#: dp > 1 (``ParallelConfig.use_sequence_parallel_moe``, ``vllm/config/parallel.py``),
#: plus ``naive`` and ``pplx``, which vLLM replaces by ``allgather_reducescatter``
#: (``ParallelConfig.__post_init__``).
SEQUENCE_PARALLEL_ALL2ALL = frozenset({
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_nvlink_one_sided", "passthrough", "mori_high_throughput", "mori_low_latency",
    "nixl_ep", "naive", "pplx"})


def padded_vocab(V: int) -> int:
    """``Vp = ceil(V/64)*64`` (vLLM ``pad_vocab_size``)."""
    return -(-V // VOCAB_PADDING) * VOCAB_PADDING


@dataclass(frozen=True)
class Geometry:
    """What one vLLM worker holds of one model: the partition sizes of docs/reference.md §3.

    The numbers vLLM's layer constructors compute (``QKVParallelLinear.__init__``,
    ``VocabParallelEmbedding.__init__``, ``FusedMoEParallelConfig.make``), for
    worker ``worker`` of ``num_workers = dp*tp``. Built by :meth:`of`; the
    divisibility rules (:meth:`Kind.violation`) must hold first.

    Attributes:
        worker, num_workers, tp, tp_rank: ``tp_rank = worker % tp``.
        ep: expert parallelism in effect (``enable_expert_parallel`` and more
            than one worker).
        hd, nkv: head dim, KV heads (global).
        q_heads: ``nh/tp`` query heads per rank.
        kv_heads: KV heads per rank (1 when ``tp >= nkv``).
        kv_replicas: ranks sharing one KV head (``tp/nkv`` when ``tp >= nkv``, else 1).
        V, vocab_per: vocab and padded rows per rank ``Vp/tp``.
        H, E, Im: hidden, experts, MoE intermediate (global).
        moe_tp, moe_rank: MoE tensor-parallel size and this worker's rank in it.
        experts: global ids of this worker's experts, in local order (a
            ``range``: step 1 for linear placement, ``ep`` for round robin;
            empty when ``ep > E`` leaves a worker none). ``e_local``,
            ``e_first`` and ``expert_runs`` are derived from it.
        im_local: ``Im/moe_tp`` rows of gate (and of up) per expert.
        sizes: the model sizes the geometry was made from (for kinds whose
            parts are sized by family symbols, :class:`ReplicatedMerged`).
        sequence_parallel_moe: vLLM runs its MoE blocks sequence-parallel
            (``ParallelConfig.use_sequence_parallel_moe``, vLLM 0.33.0
            ``vllm/config/parallel.py``: an all2all backend of
            :data:`SEQUENCE_PARALLEL_ALL2ALL`, expert parallelism, tp > 1 and
            dp > 1); the dense layers inside a MoE block are then built
            unsharded (:class:`SharedExperts`).
    """

    worker: int
    num_workers: int
    tp: int
    tp_rank: int
    ep: bool
    hd: int
    nkv: int
    q_heads: int
    kv_heads: int
    kv_replicas: int
    V: int
    vocab_per: int
    H: int
    E: int
    Im: int
    moe_tp: int
    moe_rank: int
    experts: range
    im_local: int
    sizes: Sizes | None = None
    sequence_parallel_moe: bool = False

    @classmethod
    def of(cls, s: Sizes, tp: int, dp: int, ep: bool, worker: int,
           placement: str = "linear", all2all: str = "allgather_reducescatter") -> "Geometry":
        """The geometry of ``worker`` for model sizes ``s`` and vLLM ``tp``/``dp``/``ep``.

        ``placement`` is the expert placement in effect (``"linear"`` or
        ``"round_robin"``; only read with EP); ``all2all`` vLLM's
        ``all2all_backend`` (only whether it runs MoE sequence-parallel).
        """
        W = tp * dp
        if tp >= s.nkv:
            kv_heads, kv_rep = 1, tp // max(s.nkv, 1)
        else:
            kv_heads, kv_rep = s.nkv // tp, 1
        use_ep = bool(ep) and W > 1
        if use_ep:
            moe_tp, moe_rank = 1, 0
            experts = expert_ids(s.E, W, worker, placement)
        else:
            moe_tp, moe_rank, experts = W, worker, range(s.E)
        return cls(
            worker=worker, num_workers=W, tp=tp, tp_rank=worker % tp, ep=use_ep,
            hd=s.hd, nkv=s.nkv, q_heads=s.nh // tp, kv_heads=kv_heads, kv_replicas=kv_rep,
            V=s.V, vocab_per=padded_vocab(s.V) // tp, H=s.H, E=s.E, Im=s.Im,
            moe_tp=moe_tp, moe_rank=moe_rank, experts=experts, im_local=s.Im // moe_tp,
            sizes=s,
            sequence_parallel_moe=(all2all in SEQUENCE_PARALLEL_ALL2ALL and bool(ep)
                                   and tp > 1 and dp > 1),
        )

    @property
    def e_local(self) -> int:
        """Number of experts on this worker."""
        return len(self.experts)

    @property
    def e_first(self) -> int:
        """First expert of this worker's one contiguous run (linear placement).

        Raises:
            ValueError: the experts are not one contiguous run (round robin):
                use :attr:`expert_runs`.
        """
        if self.experts.step != 1 and len(self.experts) > 1:
            raise ValueError(f"worker {self.worker} holds experts {list(self.experts)} "
                             "(round-robin placement), not one run: use Geometry.expert_runs")
        return self.experts.start

    @property
    def expert_runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(first, stop, local index of first)`` per run of consecutive experts.

        One run under linear placement, one per expert under round robin,
        none for a worker without experts.
        """
        ids = self.experts
        if not ids:
            return ()
        if ids.step == 1:
            return ((ids.start, ids.stop, 0),)
        return tuple((e, e + 1, i) for i, e in enumerate(ids))

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """Token rows ``[lo, hi)`` of this tp rank (vLLM ``_get_indices``)."""
        r, per = self.tp_rank, self.vocab_per
        return min(r * per, self.V), min((r + 1) * per, self.V)


def expert_ids(E: int, ep: int, rank: int, placement: str = "linear") -> range:
    """The global experts EP rank ``rank`` of ``ep`` holds, in local order.

    ``E // ep`` experts each, one more on ranks ``< E % ep``. Linear: a
    contiguous run starting at ``rank * (E // ep) + min(rank, E % ep)``;
    round robin: ``rank, rank + ep, ...``. vLLM 0.33.0
    ``layers/fused_moe/expert_map_manager.py`` ``determine_expert_map``.

    Raises:
        ValueError: an unknown placement.
    """
    base, extra = divmod(E, ep)
    if placement == "round_robin":
        return range(rank, E, ep)
    if placement != "linear":
        raise ValueError(f"expert placement {placement!r} is not 'linear' or 'round_robin'")
    first = rank * base + min(rank, extra)
    return range(first, first + base + (rank < extra))


def _full(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


class Kind:
    """One shard kind. Subclasses restate one vLLM layer class.

    Attributes:
        name: the kind's name in tables and messages (``"column"``).
        source: the vLLM code the rule restates.
        by_worker: ``True`` when workers of one tp rank hold different boxes
            (MoE kinds); ``False`` when only the tp rank matters.
        rule_order: order of this kind's divisibility message among others
            (the first broken rule is the one an error leads with).
    """

    name = ""
    source = ""
    by_worker = False
    rule_order = 99

    def wire_shape(self, dims: tuple[int, ...], part: Any, s: Sizes) -> tuple[int, ...]:
        """Global shape of the wire tensor feeding ``part``, from the table's resolved dims."""
        return dims

    def local_shape(self, dims: tuple[int, ...], parts: int, g: Geometry) -> tuple[int, ...]:
        """Local shape of the parameter on a worker (``parts``: number of feeds)."""
        raise NotImplementedError

    def rule_key(self, syms: tuple[str, ...]) -> tuple:
        """Parameters with equal keys break the same rule; it is reported once."""
        return (self.name, ())

    def violation(self, name: str, syms: tuple[str, ...], s: Sizes, tp: int, dp: int,
                  ep: bool) -> str | None:
        """Why ``tp``/``dp``/``ep`` cannot hold parameter ``name`` (``None``: they can)."""
        return None

    def boxes(self, shape: tuple[int, ...], part: Any, g: Geometry) -> list[Placed]:
        """``[(box, offset)]``: the boxes of a wire tensor of ``shape`` that land on
        ``g``'s worker, and where each lands in the local parameter."""
        raise NotImplementedError

    def zero_boxes(self, local_shape: tuple[int, ...], g: Geometry) -> tuple[Box, ...]:
        """Local regions no wire tensor fills and that hold zeros."""
        return ()

    def load(self, param: torch.Tensor, wire: torch.Tensor, part: Any, g: Geometry) -> None:
        """Copy this worker's share of the full ``wire`` tensor into ``param`` (in place),
        the way vLLM's ``weight_loader`` does."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<shard kind {self.name}>"


class Replicated(Kind):
    """Every worker holds the whole tensor.

    Norms (``RMSNorm``), MoE routers (``GateLinear``, ``ReplicatedLinear``),
    Qwen3 ``q_norm``/``k_norm``, and the bias of a row-parallel layer (vLLM
    ``layers/linear.py`` ``RowParallelLinear``: the bias has no ``input_dim``,
    so ``weight_loader`` copies it whole to every rank).
    """

    name = "replicated"
    source = "vllm layers/layernorm.py RMSNorm, layers/linear.py ReplicatedLinear.weight_loader"
    rule_order = 7

    def local_shape(self, dims, parts, g):
        return dims

    def boxes(self, shape, part, g):
        return [(_full(shape), (0,) * len(shape))]

    def load(self, param, wire, part, g):
        if param.shape != wire.shape:
            raise ValueError(f"replicated parameter of shape {tuple(param.shape)} "
                             f"cannot take a tensor of shape {tuple(wire.shape)}")
        param.copy_(wire)


class _SplitRows(Kind):
    """Shared divisibility rule of column, merged and row parallel layers.

    The split dim must divide by tp: vLLM ``layers/linear.py``, ``divide(...,
    tp_size)`` in the ``ColumnParallelLinear``, ``MergedColumnParallelLinear``
    and ``RowParallelLinear`` constructors.
    """

    rule_dim = 0

    def rule_key(self, syms):
        return (self.name, syms)

    def violation(self, name, syms, s, tp, dp, ep):
        sym = syms[self.rule_dim]
        if s.resolve((sym,))[0] % tp:
            return f"{name}: {s.label(sym)} is not divisible by tp={tp}"
        return None


class Column(_SplitRows):
    """Column parallel: rank ``r`` holds rows ``[r*n/tp, (r+1)*n/tp)`` (bias likewise).

    vLLM ``layers/linear.py`` ``ColumnParallelLinear.weight_loader``
    (``output_dim`` narrowed at ``tp_rank * shard_size``); ``divide(n, tp)``
    in its constructor is the divisibility rule.
    """

    name = "column"
    source = "vllm layers/linear.py ColumnParallelLinear.weight_loader"
    rule_order = 2

    def local_shape(self, dims, parts, g):
        return (dims[0] // g.tp, *dims[1:])

    def boxes(self, shape, part, g):
        n, r = shape[0] // g.tp, g.tp_rank
        return [(((r * n, (r + 1) * n), *_full(shape[1:])), (0,) * len(shape))]

    def load(self, param, wire, part, g):
        size = param.shape[0]
        param.copy_(wire.narrow(0, g.tp_rank * size, size))


class Row(_SplitRows):
    """Row parallel: rank ``r`` holds columns ``[r*n/tp, (r+1)*n/tp)`` of a 2-D weight.

    vLLM ``layers/linear.py`` ``RowParallelLinear.weight_loader``
    (``input_dim`` narrowed at ``tp_rank * shard_size``). The bias is not this
    kind: it is :data:`REPLICATED`.
    """

    name = "row"
    source = "vllm layers/linear.py RowParallelLinear.weight_loader"
    rule_order = 3
    rule_dim = 1

    def local_shape(self, dims, parts, g):
        return (dims[0], dims[1] // g.tp)

    def boxes(self, shape, part, g):
        n, r = shape[1] // g.tp, g.tp_rank
        return [(((0, shape[0]), (r * n, (r + 1) * n)), (0, 0))]

    def load(self, param, wire, part, g):
        size = param.shape[1]
        param.copy_(wire.narrow(1, g.tp_rank * size, size))


class Merged(_SplitRows):
    """Merged column parallel: local ``[part0_r; part1_r; ...]``.

    Part ``p`` (``gate_proj`` = 0, ``up_proj`` = 1) of rank ``r`` is rows
    ``[r*n/tp, (r+1)*n/tp)`` of its wire tensor and lands at local row
    ``p*n/tp`` (all parts of m2nkit's tables have the same ``n``). vLLM
    ``layers/linear.py`` ``MergedColumnParallelLinear.weight_loader``
    (``shard_offset = sum(output_sizes[:shard_id]) // tp``, ``start_idx =
    tp_rank * shard_size``).
    """

    name = "merged"
    source = "vllm layers/linear.py MergedColumnParallelLinear.weight_loader"
    rule_order = 1

    def local_shape(self, dims, parts, g):
        return (parts * dims[0] // g.tp, *dims[1:])

    def boxes(self, shape, part, g):
        n, r = shape[0] // g.tp, g.tp_rank
        return [(((r * n, (r + 1) * n), *_full(shape[1:])), (part * n, *(0,) * (len(shape) - 1)))]

    def load(self, param, wire, part, g):
        size = wire.shape[0] // g.tp
        param.narrow(0, part * size, size).copy_(wire.narrow(0, g.tp_rank * size, size))


class Qkv(Kind):
    """QKV parallel: local rows ``[q | k | v]`` from three wire tensors (parts ``q``/``k``/``v``).

    q: heads ``[r*nh/tp, (r+1)*nh/tp)``. k and v: when ``tp >= nkv`` one head
    per rank, head ``r // (tp/nkv)`` (``tp/nkv`` ranks replicate it), else
    ``nkv/tp`` heads from ``r*nkv/tp``. Biases (Qwen2, Llama with
    ``attention_bias``) are split the same way. vLLM ``layers/linear.py``
    ``QKVParallelLinear.__init__`` (``num_heads = nh/tp``,
    ``num_kv_head_replicas``; ``divide(nh, tp)``, and ``tp`` a multiple of
    ``nkv`` or a divisor of it) and ``.weight_loader`` (k/v rows from KV
    shard ``tp_rank // num_kv_head_replicas``). The table's dims are those
    after the head rows (``("H",)`` for a weight, ``()`` for a bias).
    """

    name = "qkv"
    source = "vllm layers/linear.py QKVParallelLinear.__init__, .weight_loader"
    rule_order = 0

    def wire_shape(self, dims, part, s):
        heads = s.nh if part == "q" else s.nkv
        return (heads * s.hd, *dims)

    def local_shape(self, dims, parts, g):
        return ((g.q_heads + 2 * g.kv_heads) * g.hd, *dims)

    def violation(self, name, syms, s, tp, dp, ep):
        if s.nh % tp:
            return f"{name}: num_attention_heads={s.nh} is not divisible by tp={tp}"
        if tp >= s.nkv and tp % s.nkv:
            return (f"{name}: tp={tp} >= num_key_value_heads={s.nkv} must be a multiple "
                    f"of it (each rank holds one replicated KV head)")
        if tp < s.nkv and s.nkv % tp:
            return f"{name}: num_key_value_heads={s.nkv} is not divisible by tp={tp}"
        return None

    def _slot(self, part, g) -> tuple[int, int, int]:
        """``(local row offset, rows, shard index in the wire tensor)`` of ``part``."""
        q_rows = g.q_heads * g.hd
        if part == "q":
            return 0, q_rows, g.tp_rank
        n = g.kv_heads * g.hd
        return q_rows + (n if part == "v" else 0), n, g.tp_rank // g.kv_replicas

    def boxes(self, shape, part, g):
        at, n, shard = self._slot(part, g)
        rest = len(shape) - 1
        return [(((shard * n, (shard + 1) * n), *_full(shape[1:])), (at, *(0,) * rest))]

    def load(self, param, wire, part, g):
        at, n, shard = self._slot(part, g)
        param.narrow(0, at, n).copy_(wire.narrow(0, shard * n, n))


class Vocab(Kind):
    """Vocab parallel: rank ``r`` holds token rows ``[r*per, min((r+1)*per, V))``.

    ``per = Vp/tp`` with ``Vp = ceil(V/64)*64``; the local rows after the
    rank's tokens (padding) are zero, written by vLLM. vLLM
    ``layers/vocab_parallel_embedding.py`` (``pad_vocab_size``,
    ``_get_indices``, ``VocabParallelEmbedding.weight_loader``: copies the
    rank's rows and ``fill_(0)``s the rest; ``divide(num_embeddings_padded,
    tp)``). Embedding and untied ``lm_head`` (``ParallelLMHead``).
    """

    name = "vocab"
    source = "vllm layers/vocab_parallel_embedding.py VocabParallelEmbedding.weight_loader"
    rule_order = 4

    def local_shape(self, dims, parts, g):
        return (g.vocab_per, *dims[1:])

    def violation(self, name, syms, s, tp, dp, ep):
        vp = padded_vocab(s.V)
        if vp % tp:
            return (f"{name}: vocab_size={s.V} padded to {vp} (a multiple of "
                    f"{VOCAB_PADDING}) is not divisible by tp={tp}")
        return None

    def boxes(self, shape, part, g):
        lo, hi = g.vocab_rows
        return [(((lo, hi), *_full(shape[1:])), (0,) * len(shape))] if hi > lo else []

    def zero_boxes(self, local_shape, g):
        lo, hi = g.vocab_rows
        n = hi - lo
        return (((n, g.vocab_per), *_full(local_shape[1:])),) if n < g.vocab_per else ()

    def load(self, param, wire, part, g):
        lo, hi = g.vocab_rows
        piece = wire.narrow(0, lo, hi - lo)
        param[: piece.shape[0]].copy_(piece)
        param[piece.shape[0]:].fill_(0)


class _Experts(Kind):
    """Shared rules of the stacked-expert kinds (one message for w13 and w2).

    Without EP ``Im`` must divide by ``tp_moe = dp*tp`` (vLLM
    ``fused_moe/config.py``, ``intermediate_size % tp_size``). With EP any
    ``E`` is accepted, as vLLM accepts it (``expert_map_manager.py``
    ``determine_expert_map`` puts the remainder on the first ranks).
    """

    by_worker = True
    rule_order = 5

    def rule_key(self, syms):
        return ("experts", ())

    def violation(self, name, syms, s, tp, dp, ep):
        W = tp * dp
        if ep and W > 1:
            return None
        if s.Im % W:
            return (f"{name}: {s.label('Im')} is not divisible by the MoE tensor-parallel "
                    f"size dp*tp={W}")
        return None


class ExpertsW13(_Experts):
    """Stacked gate/up experts: wire ``[E, 2*Im, H]`` -> local ``[E_local, 2*Im_local, H]``.

    The wire tensor is ``experts.gate_up_proj.weight``, expert ``e`` = its
    gate rows then its up rows. Per local expert the parameter holds the gate
    rows of moe rank ``k`` (``[k*Im_local, (k+1)*Im_local)``), then its up
    rows. vLLM ``layers/fused_moe/routed_experts.py``
    ``RoutedExperts.load_weights`` (a stacked ``gate_up_proj`` is chunked
    into w1/w3), ``RoutedExperts.weight_loader`` (skips experts of other EP
    ranks) and ``_load_w13`` (w1 into the first half, w3 into the second,
    ``Im/tp_moe`` rows of moe rank ``k`` each). A worker holding whole
    experts (``Im_local == Im``) gets one box per run of consecutive experts
    (:attr:`Geometry.expert_runs`: one under linear placement, one per
    expert under round robin): gate and up are one run of rows.
    """

    name = "w13"
    source = "vllm layers/fused_moe/routed_experts.py RoutedExperts.load_weights, _load_w13"

    def local_shape(self, dims, parts, g):
        return (g.e_local, 2 * g.im_local, g.H)

    def boxes(self, shape, part, g):
        n, k, H, Im = g.im_local, g.moe_rank, g.H, g.Im
        out = []
        for e0, e1, at in g.expert_runs:
            if n == Im:
                out.append((((e0, e1), (0, 2 * n), (0, H)), (at, 0, 0)))
            else:
                out += [(((e0, e1), (k * n, (k + 1) * n), (0, H)), (at, 0, 0)),
                        (((e0, e1), (Im + k * n, Im + (k + 1) * n), (0, H)), (at, n, 0))]
        return out

    def load(self, param, wire, part, g):
        for i, e in enumerate(g.experts):
            dst = param[i]
            gate, up = wire[e].chunk(2, dim=0)
            half = dst.shape[0] // 2
            per_rank = gate.shape[0] // g.moe_tp
            dst.narrow(0, 0, half).copy_(gate.narrow(0, g.moe_rank * per_rank, per_rank))
            dst.narrow(0, half, half).copy_(up.narrow(0, g.moe_rank * per_rank, per_rank))


class ExpertsW2(_Experts):
    """Stacked down experts: wire ``[E, H, Im]`` -> local ``[E_local, H, Im_local]``.

    The wire tensor is ``experts.down_proj.weight``; moe rank ``k`` holds
    columns ``[k*Im_local, (k+1)*Im_local)`` of each local expert. vLLM
    ``layers/fused_moe/routed_experts.py`` ``_load_w2`` (shard dim 1).
    """

    name = "w2"
    source = "vllm layers/fused_moe/routed_experts.py RoutedExperts._load_w2"

    def local_shape(self, dims, parts, g):
        return (g.e_local, g.H, g.im_local)

    def boxes(self, shape, part, g):
        n, k = g.im_local, g.moe_rank
        return [(((e0, e1), (0, g.H), (k * n, (k + 1) * n)), (at, 0, 0))
                for e0, e1, at in g.expert_runs]

    def load(self, param, wire, part, g):
        for i, e in enumerate(g.experts):
            w = wire[e]
            per_rank = w.shape[1] // g.moe_tp
            param[i].copy_(w.narrow(1, g.moe_rank * per_rank, per_rank))


class ReplicatedMerged(Kind):
    """Merged parts of different sizes, not split: every worker holds ``[part0; part1; ...]`` whole.

    DeepSeek-V3's ``fused_qkv_a_proj`` (``q_a_proj`` rows, then
    ``kv_a_proj_with_mqa`` rows): vLLM ``models/deepseek_v2.py``
    ``DeepSeekV2FusedQkvAProjLinear``, a ``MergedColumnParallelLinear`` with
    ``disable_tp=True`` (tp size 1), so ``layers/linear.py``
    ``MergedColumnParallelLinear.weight_loader`` puts shard ``k`` whole at
    ``sum(output_sizes[:k])``. Parts differ in size, so a feed's part is the
    tuple of the row symbols of the parts up to and including it (``("qr",)``,
    ``("qr", "kva")``): the last symbol sizes the part, the others sum to its
    row offset. The table's dims are the whole parameter's (``("qkva",
    "H")``). No divisibility rule (nothing is split).
    """

    name = "replicated_merged"
    source = ("vllm layers/linear.py MergedColumnParallelLinear.weight_loader "
              "(disable_tp=True)")
    rule_order = 7

    def wire_shape(self, dims, part, s):
        return (s.resolve((part[-1],))[0], *dims[1:])

    def local_shape(self, dims, parts, g):
        return dims

    def row_offset(self, part, g: Geometry, block_n: int = 1) -> int:
        """Local row of ``part``'s first row; in blocks of ``block_n`` rows rounded up
        (vLLM ``layers/linear.py`` ``adjust_block_scale_shard``) for a block scale."""
        rows = sum(g.sizes.resolve(tuple(part[:-1])))
        return -(-rows // block_n)

    def boxes(self, shape, part, g):
        return [(_full(shape), (self.row_offset(part, g), *(0,) * (len(shape) - 1)))]

    def load(self, param, wire, part, g, block_n: int = 1):
        at = self.row_offset(part, g, block_n)
        param.narrow(0, at, wire.shape[0]).copy_(wire)


class ExpertsRows(_Experts):
    """Stacked experts split by rows: wire ``[E, R, *rest]`` -> local ``[E_local, R/tp_moe, *rest]``.

    Moe rank ``k`` holds the contiguous rows ``[k*R/tp_moe, (k+1)*R/tp_moe)``
    of each of its experts (with EP: whole experts, one box per run of
    :attr:`Geometry.expert_runs`). GPT-OSS's fused gate/up (``R = 2*Im``,
    weight ``[E, 2*Im, H]`` and bias ``[E, 2*Im]``), whose rows interleave
    gate and up (row ``2i`` is gate ``i``, row ``2i+1`` up ``i``) in the
    checkpoint and in vLLM alike, so a rank's gate and up rows are one run.
    vLLM 0.33.0 ``models/gpt_oss.py`` ``GptOssModel._load_weights_other``:
    ``w13_weight = weight[:, :, 2*tp_rank_start:2*tp_rank_end]`` then
    ``permute(0, 2, 1)`` (the transposition is the wire form's:
    ``m2nkit.adapters.families.gpt_oss``), ``w13_bias = weight[:,
    2*tp_rank_start:2*tp_rank_end]``, with EP ``weight[ep_rank_start:
    ep_rank_end]``; ``tp_rank`` flattened over dp*tp
    (``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``).
    """

    name = "expert_rows"
    source = "vllm models/gpt_oss.py GptOssModel._load_weights_other (w13_weight, w13_bias)"

    def local_shape(self, dims, parts, g):
        return (g.e_local, dims[1] // g.moe_tp, *dims[2:])

    def boxes(self, shape, part, g):
        n, k, rest = shape[1] // g.moe_tp, g.moe_rank, _full(shape[2:])
        return [(((e0, e1), (k * n, (k + 1) * n), *rest), (at, 0, *(0,) * len(rest)))
                for e0, e1, at in g.expert_runs]

    def load(self, param, wire, part, g):
        n = param.shape[1]
        for i, e in enumerate(g.experts):
            param[i].copy_(wire[e].narrow(0, g.moe_rank * n, n))


class ExpertsBiasOnce(_Experts):
    """Stacked output bias of row-parallel experts: wire ``[E, H]`` -> local ``[E_local, H]``.

    Without EP the experts' down projection is split over the moe ranks by
    its input dim and the partial outputs are summed, so vLLM adds the bias
    on one rank only: moe rank 0 (worker 0, the tp rank being flattened over
    dp*tp) holds every expert's bias, every other worker holds zeros. With
    EP each worker holds its experts' rows whole. vLLM 0.33.0
    ``models/gpt_oss.py`` ``GptOssModel._load_weights_other`` (``w2_bias``:
    ``weight.zero_()`` when ``tp_rank != 0``, "only load on rank 0 to avoid
    duplication"; with EP ``weight[ep_rank_start:ep_rank_end]``).
    """

    name = "expert_bias_once"
    source = "vllm models/gpt_oss.py GptOssModel._load_weights_other (w2_bias)"

    def local_shape(self, dims, parts, g):
        return (g.e_local, *dims[1:])

    def boxes(self, shape, part, g):
        if g.moe_rank:
            return []
        rest = _full(shape[1:])
        return [(((e0, e1), *rest), (at, *(0,) * len(rest))) for e0, e1, at in g.expert_runs]

    def zero_boxes(self, local_shape, g):
        return (_full(local_shape),) if g.moe_rank else ()

    def load(self, param, wire, part, g):
        if g.moe_rank:
            param.zero_()
            return
        for i, e in enumerate(g.experts):
            param[i].copy_(wire[e])


REPLICATED = Replicated()
COLUMN = Column()
ROW = Row()
QKV = Qkv()
MERGED = Merged()
VOCAB = Vocab()
W13 = ExpertsW13()
W2 = ExpertsW2()
EXPERT_ROWS = ExpertsRows()
EXPERT_BIAS_ONCE = ExpertsBiasOnce()
REPLICATED_MERGED = ReplicatedMerged()

#: Every shard kind, by name.
class _SharedExperts:
    """A dense layer inside a MoE block: split by tp, or whole under sequence-parallel MoE.

    vLLM 0.33.0 builds DeepSeek-V2/V3's shared experts with
    ``disable_tp=is_sequence_parallel`` (``models/deepseek_v2.py``,
    ``DeepseekV2MoE.__init__`` -> ``DeepseekV2MLP``), where
    ``is_sequence_parallel = parallel_config.use_sequence_parallel_moe``:
    then every worker holds the whole layer. Otherwise the parent kind
    (merged column or row parallel) applies. Found by comparing the table
    with vLLM's traced loaders (``adapters/vllm/trace.py``).
    """

    def _g(self, g: "Geometry") -> "Geometry":
        return replace(g, tp=1, tp_rank=0) if g.sequence_parallel_moe else g

    def local_shape(self, dims, parts, g):
        return super().local_shape(dims, parts, self._g(g))

    def boxes(self, shape, part, g):
        return super().boxes(shape, part, self._g(g))

    def load(self, param, wire, part, g):
        return super().load(param, wire, part, self._g(g))


class SharedMerged(_SharedExperts, Merged):
    __doc__ = _SharedExperts.__doc__
    name = "shared_merged"
    source = "vllm models/deepseek_v2.py DeepseekV2MoE shared_experts (MergedColumnParallelLinear)"


class SharedRow(_SharedExperts, Row):
    __doc__ = _SharedExperts.__doc__
    name = "shared_row"
    source = "vllm models/deepseek_v2.py DeepseekV2MoE shared_experts (RowParallelLinear)"


SHARED_MERGED = SharedMerged()
SHARED_ROW = SharedRow()

KINDS: dict[str, Kind] = {k.name: k for k in (REPLICATED, COLUMN, ROW, QKV, MERGED, VOCAB, W13, W2,
                                              SHARED_MERGED, SHARED_ROW,
                                              REPLICATED_MERGED,
                                              EXPERT_ROWS, EXPERT_BIAS_ONCE)}


# --------------------------------------------------------------------------
# A vision tower's attention: q, k and v fused in one wire tensor


class FusedQkv(Kind):
    """QKV parallel fed by one fused wire tensor ``[3*n*hd, ...]`` (rows q, then k, then v).

    Multi-head attention with as many KV heads as query heads (a vision
    tower's ``attn.qkv``: transformers stores it fused, ``nn.Linear(dim,
    3*dim)``). Rank ``r`` holds heads ``[r*n/tp, (r+1)*n/tp)`` of each of q,
    k and v: local rows ``[q_r | k_r | v_r]``, third ``j`` taken from wire
    rows ``j*n*hd + r*n*hd/tp``. vLLM ``layers/linear.py``
    ``QKVParallelLinear.weight_loader`` with ``loaded_shard_id=None`` (the
    fused checkpoint tensor is split by ``output_sizes`` and each part
    loaded as its shard) on the ``QKVParallelLinear(total_num_heads=n,
    total_num_kv_heads=n)`` of ``models/qwen2_5_vl.py``
    ``Qwen2_5_VisionAttention`` (``divide(n, tp)``: whole heads per rank).
    The table's dims: ``(n, hd, *rest)`` (heads, head dim, then the dims
    after the rows: ``("vH",)`` for a weight, ``()`` for a bias).
    """

    name = "fused_qkv"
    source = ("vllm layers/linear.py QKVParallelLinear.weight_loader (loaded_shard_id=None); "
              "models/qwen2_5_vl.py Qwen2_5_VisionAttention")
    rule_order = 0

    def wire_shape(self, dims, part, s):
        heads, hd, *rest = dims
        return (3 * heads * hd, *rest)

    def local_shape(self, dims, parts, g):
        heads, hd, *rest = dims
        return (3 * heads * hd // g.tp, *rest)

    def rule_key(self, syms):
        return (self.name, syms[:1])

    def violation(self, name, syms, s, tp, dp, ep):
        if s.resolve(syms[:1])[0] % tp:
            return f"{name}: {s.label(syms[0])} heads are not divisible by tp={tp}"
        return None

    def boxes(self, shape, part, g):
        third = shape[0] // 3
        n, r = third // g.tp, g.tp_rank
        rest = _full(shape[1:])
        zeros = (0,) * (len(shape) - 1)
        return [(((j * third + r * n, j * third + (r + 1) * n), *rest), (j * n, *zeros))
                for j in range(3)]

    def load(self, param, wire, part, g):
        third = wire.shape[0] // 3
        n = third // g.tp
        for j in range(3):
            param.narrow(0, j * n, n).copy_(wire.narrow(0, j * third + g.tp_rank * n, n))


FUSED_QKV = FusedQkv()
KINDS[FUSED_QKV.name] = FUSED_QKV
__all__ += ["FusedQkv", "FUSED_QKV"]


# --------------------------------------------------------------------------
# A vision tower vLLM runs data-parallel when its heads do not divide by tp


class VisionTowerSplit(Kind):
    """``base`` when the tower's attention heads divide by tp, else whole on every worker.

    vLLM ``models/vision.py`` ``is_vit_use_data_parallel(num_heads)``: when
    ``num_heads % tp != 0`` (or ``mm_encoder_tp_mode="data"``, not vLLM's
    default) the tower is data-parallel, and every split layer of it is
    built with ``disable_tp=True`` (``models/kimi_k25_vit.py``
    ``MoonViTEncoderLayer``, ``MLP2``: ``QKVParallelLinear``,
    ``ColumnParallelLinear``, ``RowParallelLinear``): its weight loader then
    copies the whole tensor (Kimi-K2.5's 2-head tiny tower at tp 4,
    ``tests/data/oracle/tiny-kimi-k25/tp4``). ``heads`` is the ``Sizes``
    symbol of the tower's head count (read from ``Geometry.sizes``).
    """

    rule_order = 0

    def __init__(self, base: Kind, heads: str) -> None:
        self.base, self.heads = base, heads
        self.name = f"vision_{base.name}"
        self.source = f"vllm models/vision.py is_vit_use_data_parallel; {base.source}"
        self.by_worker = base.by_worker

    def _split(self, g: Geometry) -> bool:
        return getattr(g.sizes, self.heads) % g.tp == 0

    def wire_shape(self, dims, part, s):
        return self.base.wire_shape(dims, part, s)

    def local_shape(self, dims, parts, g):
        if self._split(g):
            return self.base.local_shape(dims, parts, g)
        return self.base.wire_shape(dims, None, g.sizes)

    def rule_key(self, syms):
        return (self.name, self.base.rule_key(syms))

    def violation(self, name, syms, s, tp, dp, ep):
        if getattr(s, self.heads) % tp:
            return None                     # whole on every worker: nothing to divide
        return self.base.violation(name, syms, s, tp, dp, ep)

    def boxes(self, shape, part, g):
        if self._split(g):
            return self.base.boxes(shape, part, g)
        return [(_full(shape), (0,) * len(shape))]

    def load(self, param, wire, part, g):
        if self._split(g):
            self.base.load(param, wire, part, g)
        else:
            param.copy_(wire)


#: A vision tower's split layers (heads symbol ``vnh``): fused qkv, column, row.
VISION_FUSED_QKV = VisionTowerSplit(FUSED_QKV, "vnh")
VISION_COLUMN = VisionTowerSplit(COLUMN, "vnh")
VISION_ROW = VisionTowerSplit(ROW, "vnh")
KINDS.update({k.name: k for k in (VISION_FUSED_QKV, VISION_COLUMN, VISION_ROW)})
__all__ += ["VisionTowerSplit", "VISION_FUSED_QKV", "VISION_COLUMN", "VISION_ROW"]


# --------------------------------------------------------------------------
# Gated DeltaNet families (Qwen3-Next, Qwen3.5): adapters/families/qwen3_next.py


class GatedQkv(Qkv):
    """QKV parallel with the attention output gate: every query head has ``2*hd`` rows.

    Qwen3-Next/Qwen3.5 full attention (``attn_output_gate``): ``q_proj`` is
    ``[nh * 2*hd, H]``, each head's query rows then its gate rows. vLLM
    0.33.0 ``models/qwen3_next.py`` ``Qwen3NextAttention.__init__`` builds
    ``QKVParallelLinear(H, hd, nh * (1 + attn_output_gate), nkv)``: to
    ``layers/linear.py`` the q part is ``2*nh`` heads of ``hd``, so rank
    ``r`` holds q rows ``[r*2*nh*hd/tp, (r+1)*2*nh*hd/tp)`` (its ``nh/tp``
    heads, query and gate), then its k and v rows as :class:`Qkv`. The
    rule is Qkv's: ``Qwen3NextAttention`` asserts ``nh % tp == 0`` (stricter
    than ``divide(2*nh, tp)``) and the KV-head rule.
    """

    name = "qkv_gated"
    source = ("vllm models/qwen3_next.py Qwen3NextAttention.__init__ (QKVParallelLinear "
              "with nh * (1 + attn_output_gate) query heads)")

    def wire_shape(self, dims, part, s):
        heads = 2 * s.nh if part == "q" else s.nkv
        return (heads * s.hd, *dims)

    def local_shape(self, dims, parts, g):
        return ((2 * g.q_heads + 2 * g.kv_heads) * g.hd, *dims)

    def _slot(self, part, g):
        q_rows = 2 * g.q_heads * g.hd
        if part == "q":
            return 0, q_rows, g.tp_rank
        n = g.kv_heads * g.hd
        return q_rows + (n if part == "v" else 0), n, g.tp_rank // g.kv_replicas


class Sections(Kind):
    """Column parallel section by section: local ``[s0_r; s1_r; ...]``.

    The parameter's rows are ``sections`` (family size symbols, in order);
    each section is split over tp on its own: rank ``r`` holds rows
    ``[r*n_i/tp, (r+1)*n_i/tp)`` of section ``i`` (``n_i`` rows), and the
    sections' shares lie one after another in the local parameter. A wire
    tensor feeds a run of consecutive sections: its part is ``(first,
    stop)``, indices into ``sections`` (``None``: all of them), so one wire
    tensor lands as one box per section it holds. The table's dims are the
    whole parameter's (a symbol for the sum of the sections, then the rest).

    vLLM 0.33.0, Gated DeltaNet (``layers/mamba/gdn/qwen_gdn_linear_attn.py``
    ``QwenGatedDeltaNetAttention``):

    * ``in_proj_qkvz`` of Qwen3.5, a ``MergedColumnParallelLinear`` with
      ``output_sizes [key_dim, key_dim, value_dim, value_dim]``, fed by
      ``in_proj_qkv`` as shards ``(0, 1, 2)`` and ``in_proj_z`` as shard 3
      (``models/qwen3_5.py`` ``Qwen3_5Model.hf_to_vllm_mapper``):
      ``layers/linear.py`` ``MergedColumnParallelLinear.weight_loader``
      splits a tuple shard id into its shards and puts shard ``k``'s rank
      ``r`` rows (``start_idx = tp_rank * shard_size``) at
      ``sum(output_sizes[:k]) / tp``; its constructor divides every output
      size by tp;
    * ``conv1d`` (``[conv_dim, 1, K]``), whose loader is
      ``layers/mamba/mamba_mixer2.py`` ``mamba_v2_sharded_weight_loader``
      with shard spec ``[(key_dim, 0, False), (key_dim, 0, False),
      (value_dim, 0, False)]``: section by section, ``full_dim // tp`` rows
      from ``tp_rank * shard_size``.

    Rule: every section divisible by tp (``divide`` in the merged linear's
    constructor; the mamba loader floors and would leave rows unwritten).
    """

    rule_order = 1

    def __init__(self, name: str, sections: tuple[str, ...], source: str) -> None:
        self.name, self.sections, self.source = name, tuple(sections), source

    def _sizes(self, s: Sizes) -> tuple[int, ...]:
        return s.resolve(self.sections)

    def _span(self, part) -> range:
        return range(len(self.sections)) if part is None else range(*part)

    def wire_shape(self, dims, part, s):
        sizes = self._sizes(s)
        return (sum(sizes[i] for i in self._span(part)), *dims[1:])

    def local_shape(self, dims, parts, g):
        return (dims[0] // g.tp, *dims[1:])

    def rule_key(self, syms):
        return (self.name, self.sections)

    def violation(self, name, syms, s, tp, dp, ep):
        for sym in dict.fromkeys(self.sections):
            if s.resolve((sym,))[0] % tp:
                return f"{name}: {s.label(sym)} is not divisible by tp={tp}"
        return None

    def runs(self, part, g: Geometry) -> list[tuple[int, int, int]]:
        """``(wire row, local row, rows)`` of each section of ``part`` on ``g``'s rank."""
        sizes = self._sizes(g.sizes)
        out, at = [], 0
        for i in self._span(part):
            n = sizes[i] // g.tp
            out.append((at + g.tp_rank * n, sum(m // g.tp for m in sizes[:i]), n))
            at += sizes[i]
        return out

    def boxes(self, shape, part, g):
        rest = _full(shape[1:])
        return [(((w, w + n), *rest), (at, *(0,) * len(rest))) for w, at, n in self.runs(part, g)]

    def load(self, param, wire, part, g):
        for w, at, n in self.runs(part, g):
            param.narrow(0, at, n).copy_(wire.narrow(0, w, n))


QKV_GATED = GatedQkv()
#: Qwen3.5's ``in_proj_qkvz`` (q, k, v, z; ``kd`` = linear key dim, ``vd`` = linear value dim)
GDN_QKVZ = Sections("gdn_qkvz", ("kd", "kd", "vd", "vd"),
                    "vllm layers/linear.py MergedColumnParallelLinear.weight_loader "
                    "(tuple shard id; models/qwen3_5.py Qwen3_5Model.hf_to_vllm_mapper)")
#: ``conv1d`` of both Gated DeltaNet families (q, k, v)
GDN_CONV = Sections("gdn_conv", ("kd", "kd", "vd"),
                    "vllm layers/mamba/mamba_mixer2.py mamba_v2_sharded_weight_loader "
                    "(QwenGatedDeltaNetAttention.conv1d)")
KINDS.update({k.name: k for k in (QKV_GATED, GDN_QKVZ, GDN_CONV)})
__all__ += ["GatedQkv", "Sections", "QKV_GATED", "GDN_QKVZ", "GDN_CONV"]


# --------------------------------------------------------------------------
# Llama-4's q/k rows, reordered for vLLM's rotary embedding


def rotary_source_row(row: int, head_dim: int) -> int:
    """The wire row that row ``row`` of vLLM's rotary-reordered q/k weight is.

    vLLM 0.33.0 hands a Llama-4 q/k weight ``[n*hd, H]`` to its loaders as
    ``.view(n, hd/2, 2, H).transpose(1, 2).reshape(n*hd, H)``
    (``models/llama4.py``, ``Llama4ForCausalLM.permute_qk_weight_for_rotary``):
    row ``h*hd + t*hd/2 + i`` of what it loads is wire row ``h*hd + 2*i + t``
    (``t`` in {0, 1}, ``i < hd/2``): within a head, the even wire rows, then
    the odd ones.
    """
    h, j = divmod(row, head_dim)
    t, i = divmod(j, head_dim // 2)
    return h * head_dim + 2 * i + t


def rotary_row_runs(lo: int, hi: int, head_dim: int) -> list[tuple[int, int, int]]:
    """Rows ``[lo, hi)`` of the rotary-reordered tensor as ``(wire row, reordered row, rows)`` runs.

    Each run is rows adjacent in both the wire and the reordered tensor
    (:func:`rotary_source_row`): within a head no two are, except for
    ``head_dim`` 2 (the reordering is then the identity); a head's last row
    and the next head's first are. So a range of whole heads is about one
    run per row: the fewest boxes that carry it.
    """
    runs: list[list[int]] = []
    for p in range(lo, hi):
        w = rotary_source_row(p, head_dim)
        if runs and runs[-1][0] + runs[-1][2] == w:
            runs[-1][2] += 1
        else:
            runs.append([w, p, 1])
    return [tuple(r) for r in runs]


class RotaryQkv(Qkv):
    """QKV parallel with q and k rows reordered per head for the rotary embedding (Llama-4).

    The shard of each part is :class:`Qkv`'s (whole heads per rank, KV heads
    replicated past ``nkv``), but vLLM 0.33.0 slices it out of the
    *reordered* q and k weights (``models/llama4.py``,
    ``Llama4ForCausalLM.load_weights`` -> ``permute_qk_weight_for_rotary``,
    every layer, rope or not; then ``QKVParallelLinear.weight_loader``): local
    q/k row ``at + j`` is wire row ``rotary_source_row(s*n + j, hd)`` of the
    shard ``s`` of ``n`` rows (:func:`rotary_source_row`). No two wire rows
    of a head stay adjacent, so a rank's q (or k) share is one box per row,
    joined only across heads (:func:`rotary_row_runs`): about ``(nh/tp +
    2*nkv_local) * hd`` boxes per layer and worker, the bindings vLLM's
    traced loaders give (``adapters/vllm/trace.py``, ``rotary_rows``). v is
    plain :class:`Qkv`. Only weights: the rule is the loader's for a 2-D
    ``weight``, and Llama-4's attention has no bias.
    """

    name = "qkv_rotary"
    source = ("vllm models/llama4.py Llama4ForCausalLM.permute_qk_weight_for_rotary; "
              "layers/linear.py QKVParallelLinear.weight_loader")

    def boxes(self, shape, part, g):
        if part == "v":
            return super().boxes(shape, part, g)
        at, n, shard = self._slot(part, g)
        cols = _full(shape[1:])
        zeros = (0,) * (len(shape) - 1)
        return [(((w, w + k), *cols), (at + p - shard * n, *zeros))
                for w, p, k in rotary_row_runs(shard * n, (shard + 1) * n, g.hd)]

    def load(self, param, wire, part, g):
        if part != "v":
            rows, cols = wire.shape
            wire = (wire.view(rows // g.hd, g.hd // 2, 2, cols).transpose(1, 2)
                    .reshape(rows, cols))
        super().load(param, wire, part, g)


ROTARY_QKV = RotaryQkv()
KINDS[ROTARY_QKV.name] = ROTARY_QKV
__all__ += ["rotary_source_row", "rotary_row_runs", "RotaryQkv", "ROTARY_QKV"]
