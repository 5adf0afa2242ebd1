"""The vocabulary of a family module: ``Param``, ``HFNaming``, ``TinyModel``, ``Family``.

A family module is data first: the names transformers gives the family's
tensors (:class:`HFNaming`), the vLLM parameters with the shard kind of
each and the wire tensors that feed them (a tuple of :class:`Param`), the
conditions that decide which parameters a config has, the tiny test models
(:class:`TinyModel`), and how trainers apply tensor parallelism
(:class:`TPPlan`). :class:`Family` bundles them; the registry hands it to
the adapters (``hf_checkpoint``, ``config_wires``, ``fsdp2``, ``tiny``,
``vllm``), which hold no family knowledge of their own. Megatron-Core's
names for a family's tensors belong to the Megatron adapter
(``m2nkit.adapters.megatron.names``), which reads the families, never the
reverse. Nothing here moves data.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping, Sequence

from .kinds import KINDS, Kind
from .sizes import Sizes

__all__ = [
    "Feeds", "Param", "qkv_feeds", "merged_feeds", "kv_heads", "head_dim", "alias",
    "TRANSFORMERS_FUSED_EXPERTS", "SplitOnLoad", "HFNaming", "TinyModel", "Family",
    "COLWISE", "ROWWISE", "TPPlan", "SkippedLayers",
]

#: Feeds of one parameter: ``(wire name template, part)``; part is ``None``
#: for a single feed, ``"q"/"k"/"v"`` for qkv, ``0/1`` for merged.
Feeds = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Param:
    """One vLLM parameter of a family table.

    Attributes:
        name: vLLM parameter name; ``{L}`` = layer index, ``{experts}`` = the
            version-dependent experts path (``m2nkit.adapters.families.vllm_names``).
        kind: its shard kind (:mod:`.kinds`: ``COLUMN``, ``QKV``, ...).
        dims: symbolic global shape of each feeding wire tensor (``"H"``,
            ``"nh*hd"``, see ``Sizes``). For ``QKV``: only the dims after the
            head rows (``("H",)`` for a weight, ``()`` for a bias).
        feeds: the wire tensors filling it; default: the same name, one feed.
        when: name of a family condition (``Family.conditions``) deciding
            whether the parameter exists (per layer); ``None``: always.
        tied_to: for ``lm_head.weight``: the parameter it shares storage with
            when ``tie_word_embeddings`` is set (then it is not allocated and
            a wire ``lm_head.weight`` is skipped, like vLLM does:
            ``ParallelLMHead.tie_weights``; ``models/utils.py``
            ``AutoWeightsLoader`` skips aliased params).
        aliases: names of other paths to the same storage; may use
            placeholders of the vLLM version name table (``{router_alias}``).
        dtype: the dtype vLLM allocates it in when that is not the model
            dtype (DeepSeek-V3's ``e_score_correction_bias``: float32);
            ``None``: the model dtype.
        model_dtype_on_wire: checkpoints store it in the model dtype although
            vLLM allocates it in ``dtype`` (its loader casts on copy: GLM-4.5's
            router weight, ``GateLinear(params_dtype=torch.float32)``); a
            config-only wire tensor then has the model dtype.
        quantized: vLLM builds the layer with the model's ``quant_config``
            (a linear layer or routed experts); with an fp8 block
            ``quantization_config`` it becomes float8 and gains a
            ``weight_scale_inv`` (``m2nkit.adapters.families.quant``).

    Raises:
        ValueError: ``kind`` is not a shard kind.
    """

    name: str
    kind: Kind
    dims: tuple[str, ...]
    feeds: Feeds | None = None
    when: str | None = None
    tied_to: str | None = None
    aliases: tuple[str, ...] = ()
    dtype: Any = None
    quantized: bool = False
    model_dtype_on_wire: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ValueError(f"table entry {self.name!r}: kind {self.kind!r} is not a shard "
                             f"kind; valid kinds: {', '.join(KINDS)} (m2nkit.adapters.families.kinds)")
        if self.feeds is None:
            object.__setattr__(self, "feeds", ((self.name, None),))


def kv_heads(default: int | None) -> Callable[[Mapping[str, Any]], int]:
    """``HFNaming.config_defaults`` rule for ``num_key_value_heads``: ``default``
    when ``config.json`` lacks it, ``num_attention_heads`` when it (or the
    default) is ``null`` (transformers' ``__post_init__`` of most config classes)."""
    def rule(c: Mapping[str, Any]) -> int:
        n = c.get("num_key_value_heads", default)
        return c["num_attention_heads"] if n is None else n
    return rule


def head_dim(default: int | None) -> Callable[[Mapping[str, Any]], int]:
    """``HFNaming.config_defaults`` rule for ``head_dim``: ``default`` when
    ``config.json`` lacks it, ``hidden_size // num_attention_heads`` when it
    (or the default) is ``null`` (``LlamaConfig.__post_init__``)."""
    def rule(c: Mapping[str, Any]) -> int:
        n = c.get("head_dim", default)
        return c["hidden_size"] // c["num_attention_heads"] if n is None else n
    return rule


def alias(key: str, other: str, default: Any) -> Callable[[Mapping[str, Any]], Any]:
    """``HFNaming.config_defaults`` rule for a key transformers also reads under
    another name (``attribute_map``: Mixtral's ``num_experts`` is
    ``num_local_experts``): ``key``, else ``other``, else ``default``."""
    def rule(c: Mapping[str, Any]) -> Any:
        return c[key] if key in c else c.get(other, default)
    return rule


def qkv_feeds(prefix: str, suffix: str = "weight") -> Feeds:
    """``q_proj``/``k_proj``/``v_proj`` under ``prefix`` as parts q, k, v."""
    return tuple((f"{prefix}.{p}_proj.{suffix}", p) for p in ("q", "k", "v"))


def merged_feeds(*names: str) -> Feeds:
    """Feeds of a merged column parameter, parts ``0, 1, ...`` in order."""
    return tuple((n, i) for i, n in enumerate(names))


#: transformers 5 in-memory fused expert parameters (``conversion_mapping.py``:
#: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``): in-memory leaf ->
#: (wire leaf, parts concatenated along the rows of each expert). The wire
#: tensor is ``<prefix>.<wire leaf>``, ``<prefix>`` the MoE block's on-disk
#: name; its parts come from the family's per-expert on-disk tensors.
TRANSFORMERS_FUSED_EXPERTS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "experts.gate_up_proj": ("experts.gate_up_proj.weight", ("gate", "up")),
    "experts.down_proj": ("experts.down_proj.weight", ("down",)),
}


@dataclass(frozen=True)
class SplitOnLoad:
    """A wire tensor transformers holds in memory as several parameters, cut by rows as it loads.

    transformers' ``WeightConverter`` with ``Chunk(dim=0)``, then
    ``PermuteForRope`` on some of the chunks (``conversion_mapping.py``,
    ``core_model_loading.py``): Kimi-K2.5's MoonViT checkpoint holds
    ``wqkv`` ``[3*D, D]``, transformers 5.24+ holds ``attn.q_proj``,
    ``attn.k_proj`` and ``attn.v_proj`` ``[D, D]``, q's and k's rows
    reordered per head for its rotary embedding. The wire tensor is the
    checkpoint's (what vLLM's loader takes): part ``j``'s rows follow the
    parts before it, each in the checkpoint's row order.

    ``PermuteForRope`` views a part's ``[heads * hd, ...]`` rows as
    ``(heads, hd // 2, 2)`` and swaps the last two axes: in-memory row
    ``h*hd + a*(hd//2) + i`` is checkpoint row ``h*hd + 2*i + a``
    (:meth:`wire_row`); a bias is permuted alike.

    Attributes:
        pattern: regex on a part's on-disk name (after ``HFNaming.renames``),
            with named groups ``prefix``, ``part`` (one of ``parts``) and
            ``leaf`` (``weight``, ``bias``).
        wire_leaf: the wire tensor is ``{prefix}.{wire_leaf}.{leaf}``.
        parts: the parts, in the wire's row order.
        rope: the parts whose rows ``PermuteForRope`` reorders.
        heads: the config -> the heads of each ``rope`` part (``PermuteForRope``
            reads ``num_attention_heads`` of its ``subconfig_key``).
    """

    pattern: str
    wire_leaf: str
    parts: tuple[str, ...]
    rope: tuple[str, ...] = ()
    heads: Callable[[Any], int] | None = None

    def __post_init__(self) -> None:
        stray = sorted(set(self.rope) - set(self.parts))
        if stray:
            raise ValueError(f"SplitOnLoad: rope parts {stray} are not among parts {self.parts}")
        if self.rope and self.heads is None:
            raise ValueError("SplitOnLoad: rope parts need heads (config -> heads per part)")

    def match(self, disk_name: str) -> tuple[str, int] | None:
        """``(wire name, part index)`` of on-disk name ``disk_name``, or ``None``."""
        m = re.fullmatch(self.pattern, disk_name)
        if m is None or m.group("part") not in self.parts:
            return None
        wire = f"{m.group('prefix')}.{self.wire_leaf}.{m.group('leaf')}"
        return wire, self.parts.index(m.group("part"))

    @staticmethod
    def wire_row(row: int, rows: int, heads: int) -> int:
        """The checkpoint row of in-memory row ``row`` of a ``rope`` part of ``rows`` rows.

        Raises:
            ValueError: ``rows`` not ``heads`` times an even head dim.
        """
        hd = rows // heads if heads > 0 else 0
        if hd * heads != rows or hd % 2:
            raise ValueError(f"SplitOnLoad: {rows} rows are not {heads} heads of an even head "
                             "dim, which transformers' PermuteForRope needs")
        h, r = divmod(row, hd)
        a, i = divmod(r, hd // 2)
        return h * hd + 2 * i + a


@dataclass(frozen=True)
class HFNaming:
    """How transformers 5 names a family's tensors in memory and on disk.

    The in-memory names are those of the model's ``named_parameters()``
    (built on the meta device by ``hf_checkpoint``); the on-disk names are
    what ``save_pretrained`` writes. They differ in two ways, both data here
    (transformers ``conversion_mapping.py`` applies the same rules when it
    loads):

    Attributes:
        renames: ``(regex, replacement)`` pairs applied in order to an
            in-memory name to get its on-disk name.
        fused_experts: in-memory fused expert leaf -> ``(wire leaf, parts)``
            (:data:`TRANSFORMERS_FUSED_EXPERTS` for transformers 5 MoE
            families; empty for dense families).
        experts_on_disk: part -> on-disk per-expert pattern (``{prefix}``:
            the MoE block after renames, ``{e}``: the expert) for every part
            of ``fused_experts``.
        permuted: on-disk leaf -> ``(wire leaf, order)`` for a tensor that
            is stored in another dim order than the wire's: the wire tensor
            ``<prefix>.<wire leaf>`` is the on-disk ``<prefix>.<leaf>``
            with its dims permuted, ``disk.permute(order)`` (GPT-OSS's
            stacked experts, stored ``[E, in, out]``, travel ``[E, out,
            in]``). A trainer rank's piece is its own box permuted the same
            way, a local view or copy; nothing is gathered.
        refused: ``(regex, reason)``: on-disk tensors the family cannot
            carry (``re.search`` on the name), and why; a checkpoint holding
            one is refused naming it.
        config_classes: ``model_type`` a ``config.json`` may carry that
            transformers has no class for -> the ``model_type`` whose config
            class reads it (Kimi-K2's ``kimi_k2`` -> ``deepseek_v3``).
        model_types: transformers ``model_type`` values whose config class
            reads this family's ``config.json``; a config-only plan reads
            such a file without transformers
            (``m2nkit.adapters.config_wires``). Empty: always through
            transformers.
        config_defaults: transformers' config class defaults for the keys
            the family reads: a value (its dataclass field default) fills a
            key ``config.json`` lacks; then each callable computes its key
            from the config as read so far, as the class's
            ``__post_init__`` does (:func:`head_dim`: the file's value, else
            ``hidden_size // num_attention_heads``; :func:`kv_heads`,
            :func:`alias`). Pinned to transformers key by key by
            ``tests/adapters/test_config_wires.py``.
        table_differs: config -> why transformers' model of this config has
            tensors the family table does not list, or lacks some it lists
            (a Qwen3 ``attention_bias`` gives transformers an ``o_proj``
            bias vLLM's model lacks), or ``None``. A config-only plan of
            such a config builds transformers' model instead of reading the
            table, so that the plan shows the difference.
        child_order: in-memory module (``{L}``: any layer) -> its children in
            the order transformers registers them, where that differs from
            the order of the vLLM table (the order of ``named_parameters()``,
            hence of the wire tensors: DeepSeek-V3 registers ``experts``
            before ``gate``). Children not listed follow, in table order.
        buffers: regexes (``re.search`` on on-disk names) of the tensors
            transformers holds as persistent **buffers**, not parameters
            (saved in the checkpoint, loaded back, never trained: DeepSeek-V3's
            ``mlp.gate.e_score_correction_bias``, an ``nn.Buffer`` of
            ``DeepseekV3TopkRouter`` in ``modeling_deepseek_v3.py``). FSDP2's
            ``fully_shard`` shards parameters only and leaves buffers plain,
            whole tensors on every rank (torch ``fsdp/_fully_shard/_fully_shard.py``:
            ``_get_modules_and_states`` collects both, ``_fsdp_init.py``
            ``_move_states_to_device`` moves both, ``_init_param_group`` makes
            ``FSDPParam``s of the parameters only), so the ``fsdp2:``,
            ``fsdp:`` and ``hsdp:`` dry-run specs replicate them
            (``TrainerSpec.layout_for(..., buffer=True)``). Pinned to
            transformers' persistent buffers by ``tests/adapters/test_fsdp2_buffers.py``.
        stacked_order: the dim order in which a checkpoint stores experts
            already stacked (``<block>.experts.gate_up_proj``), relative to
            the wire's ``[E, out, in]``; ``()``: the wire's own. Qwen3-VL-MoE's
            published checkpoints hold them ``[E, in, out]``, ``(0, 2, 1)``
            (transformers' ``conversion_mapping.py`` transposes them as it
            loads, vLLM's loader as it reads: ``is_fused_checkpoint_transposed``);
            the reader takes such a tensor as a permuted view, never a gather.
        split_on_load: wire tensors transformers holds as several in-memory
            parameters (:class:`SplitOnLoad`); the FSDP2 source re-fuses each
            rank's shards of them, row by row, without a gather.

    Raises:
        ValueError: a part of ``fused_experts`` has no on-disk pattern; an
            ``order`` of ``permuted`` that is not a permutation.
    """

    renames: tuple[tuple[str, str], ...] = ()
    fused_experts: Mapping[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    experts_on_disk: Mapping[str, str] = field(default_factory=dict)
    permuted: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    refused: tuple[tuple[str, str], ...] = ()
    config_classes: Mapping[str, str] = field(default_factory=dict)
    model_types: tuple[str, ...] = ()
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    child_order: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    table_differs: Callable[[Any], str | None] | None = None
    buffers: tuple[str, ...] = ()
    stacked_order: tuple[int, ...] = ()
    split_on_load: tuple[SplitOnLoad, ...] = ()

    def __post_init__(self) -> None:
        if self.stacked_order and sorted(self.stacked_order) != [0, 1, 2]:
            raise ValueError(f"HFNaming: stacked_order {self.stacked_order} is not a "
                             "permutation of 0..2")
        parts = {p for _, ps in self.fused_experts.values() for p in ps}
        missing = sorted(parts - set(self.experts_on_disk))
        if missing:
            raise ValueError(f"HFNaming: fused expert parts {missing} have no on-disk pattern "
                             f"in experts_on_disk (has {sorted(self.experts_on_disk)})")
        for leaf, (_, order) in self.permuted.items():
            if sorted(order) != list(range(len(order))):
                raise ValueError(f"HFNaming: permuted {leaf!r} has order {order}, which is not "
                                 f"a permutation of 0..{len(order) - 1}")

    def disk_name(self, in_memory: str) -> str:
        """The on-disk name of in-memory parameter ``in_memory`` (not a fused expert)."""
        for pattern, repl in self.renames:
            in_memory = re.sub(pattern, repl, in_memory)
        return in_memory

    def is_buffer(self, disk_name: str) -> bool:
        """Whether transformers holds on-disk tensor ``disk_name`` as a buffer (:attr:`buffers`)."""
        return any(re.search(pattern, disk_name) for pattern in self.buffers)

    def permuted_leaf(self, name: str) -> str | None:
        """The ``permuted`` leaf ``name`` (in memory or on disk) ends with, or ``None``."""
        for leaf in self.permuted:
            if name.endswith("." + leaf):
                return leaf
        return None

    def refusal(self, disk_name: str) -> str | None:
        """Why the family refuses on-disk tensor ``disk_name``, or ``None``."""
        for pattern, reason in self.refused:
            if re.search(pattern, disk_name):
                return reason
        return None

    def split_part(self, disk_name: str) -> tuple[SplitOnLoad, str, int] | None:
        """``(rule, wire name, part index)`` of on-disk ``disk_name``, or ``None``.

        The first :attr:`split_on_load` rule that matches it.
        """
        for rule in self.split_on_load:
            hit = rule.match(disk_name)
            if hit is not None:
                return (rule, *hit)
        return None

    def fused_leaf(self, in_memory: str) -> str | None:
        """The ``fused_experts`` leaf ``in_memory`` ends with, or ``None``."""
        for leaf in self.fused_experts:
            if in_memory.endswith("." + leaf):
                return leaf
        return None

    def stacked_on_disk(self, prefix: str, leaf: str) -> tuple[str, str]:
        """Names under which a checkpoint may hold fused ``leaf`` of MoE block ``prefix`` already stacked.

        ``<prefix>.<leaf>`` (transformers' in-memory name, e.g.
        ``model.layers.0.mlp.experts.gate_up_proj``, what RL frameworks
        saving the fused parameters write; vLLM's ``RoutedExperts.load_weights``
        takes it too) and the wire name ``<prefix>.<wire leaf>``
        (``...experts.gate_up_proj.weight``). ``prefix`` is the block's
        on-disk name (after ``renames``).
        """
        return f"{prefix}.{leaf}", f"{prefix}.{self.fused_experts[leaf][0]}"

    def stacked_wire_name(self, disk_name: str) -> str | None:
        """The wire name of a tensor stored already stacked (see :meth:`stacked_on_disk`), or ``None``."""
        for leaf, (wire_leaf, _) in self.fused_experts.items():
            for candidate in (leaf, wire_leaf):
                if disk_name.endswith("." + candidate):
                    return disk_name[: -len(candidate)] + wire_leaf
        return None


#: Tensor-parallel styles of a trainer's TP plan, named as torch
#: (``ColwiseParallel``, ``RowwiseParallel``), torchtitan and transformers'
#: ``base_model_tp_plan`` name them.
COLWISE, ROWWISE = "colwise", "rowwise"

#: Style -> (dim of a linear's weight, dim of its bias, dim of an embedding's
#: weight) it shards; ``None``: replicated over TP (torch
#: ``distributed/tensor/parallel/style.py``: ``ColwiseParallel``
#: ``_partition_linear_fn`` Shard(0) weight and bias, ``_partition_embedding_fn``
#: Shard(1); ``RowwiseParallel`` Shard(1) weight, Replicate bias, embedding Shard(0)).
_TP_DIMS = {COLWISE: (0, 0, 1), ROWWISE: (1, None, 0)}


@dataclass(frozen=True)
class TPPlan:
    """How trainers apply tensor parallelism to a family: module -> style.

    The plan ``parallelize_module`` takes (torchtitan ``parallelize_llama``;
    transformers' ``base_model_tp_plan`` names the same layer modules), as
    data: the demo applies it to a live model
    (``m2nkit.adapters.tensor_parallel``) and ``m2nkit plan --trainer
    fsdp2:dp_shard=S,tp=T`` derives each wire tensor's layout from it.
    Modules it does not name (norms, routers, experts) stay whole on every
    TP rank.

    Attributes:
        modules: in-memory module name (``{L}``: any layer) -> ``COLWISE`` or
            ``ROWWISE``. For every family with a plan the names of these
            modules' tensors are the same in memory and on disk (checked by
            ``tests/adapters/test_trainer_spec.py``), so they name wire tensors too.
        untied: the same for the embedding and the LM head, applied only when
            the config does not tie them (tied, they are one parameter,
            which FSDP shards alone).
        embeddings: modules of the plan that are ``nn.Embedding``s (a style
            shards an embedding's weight on the other dim than a linear's).
        grad_allreduce: modules (``{L}``: any layer) that stay whole on every
            TP rank but see only the rank's heads (Qwen3's per-head
            ``q_norm``/``k_norm``), so each TP rank computes a partial
            gradient that must be summed over TP before the optimizer step,
            or the replicas drift apart (transformers
            ``"replicated_with_grad_allreduce"``; Megatron all-reduces
            QK-layernorm gradients over TP the same way). Their layout is
            whole on every TP rank, like a norm's.
        divides: ``Sizes`` symbols the TP size must divide -> the family
            condition (``Family.conditions``) under which the plan shards
            that size in some layer, ``None``: always. The default, heads:
            each TP rank's q/k/v rows must be whole heads in the ratio
            ``nh/nkv`` (transformers' attention reshapes each projection by
            ``head_dim`` and repeats every KV head ``nh/nkv`` times:
            ``modeling_llama.py``, ``LlamaAttention.forward``, ``repeat_kv``;
            torch's DTensor cuts uneven rows without complaint, the forward
            then fails). An MLP in the plan adds its intermediate size: the
            rowwise ``down_proj`` rebuilds its input with ``DTensor.from_local``
            assuming even shards (torch ``distributed/tensor/parallel/style.py``,
            ``RowwiseParallel._prepare_input_fn``), so an uneven one fails in
            sharding propagation of the matmul. The vocab may split unevenly
            (a real 2- and 3-rank gloo forward and backward of tiny Llama
            with vocab 201 runs; one with ``intermediate_size`` 97 or 100,
            or 2 KV heads over tp=3 or 1 over tp=2, fails).

    Raises:
        ValueError: a style that is not ``COLWISE``/``ROWWISE``, naming the module.
    """

    modules: Mapping[str, str]
    untied: Mapping[str, str] = field(default_factory=dict)
    embeddings: tuple[str, ...] = ("model.embed_tokens",)
    grad_allreduce: tuple[str, ...] = ()
    divides: Mapping[str, str | None] = field(
        default_factory=lambda: {"nkv": None, "nh": None})

    def __post_init__(self) -> None:
        for module, style in {**self.modules, **self.untied}.items():
            if style not in _TP_DIMS:
                raise ValueError(f"TPPlan: module {module!r} has style {style!r}; valid styles: "
                                 f"{', '.join(_TP_DIMS)}")

    def styles(self, config: Any) -> dict[str, str]:
        """Module pattern -> style for ``config`` (``untied`` only when not tied)."""
        from .sizes import cfg_get

        tied = bool(cfg_get(config, "tie_word_embeddings", default=False))
        return dict(self.modules) if tied else {**self.modules, **self.untied}

    def style(self, module: str, config: Any) -> str | None:
        """The style of in-memory module ``module`` for ``config``; ``None``: not in the plan."""
        for pattern, style in self.styles(config).items():
            if _module_regex(pattern).fullmatch(module):
                return style
        return None

    def sums_grads(self, module: str) -> bool:
        """Whether in-memory module ``module`` is one of :attr:`grad_allreduce`."""
        return any(_module_regex(p).fullmatch(module) for p in self.grad_allreduce)

    def shard_dim(self, name: str, config: Any) -> int | None:
        """The dim TP shards tensor ``name`` (``<module>.weight``/``.bias``) on; ``None``: whole.

        See :data:`_TP_DIMS` for the torch rule per style.
        """
        module, _, leaf = name.rpartition(".")
        style = self.style(module, config)
        if style is None:
            return None
        weight, bias, embedding = _TP_DIMS[style]
        if module in self.embeddings:
            return embedding if leaf == "weight" else None
        return {"weight": weight, "bias": bias}.get(leaf)


@lru_cache(maxsize=None)
def _module_regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(re.escape("{L}"), r"\d+"))


@dataclass(frozen=True)
class TinyModel:
    """A tiny test model of a family, built and saved by ``m2nkit.adapters.tiny``.

    Attributes:
        model_type: transformers ``model_type`` (``AutoConfig.for_model``).
        config: config keys set on top of the shared tiny sizes
            (``m2nkit.adapters.tiny.TINY_SIZES``), e.g. ``tie_word_embeddings``.
        derived: config key -> function of the shrunk config, for keys whose
            value must follow others (applied unless the caller overrides
            the key).
    """

    model_type: str
    config: Mapping[str, Any] = field(default_factory=dict)
    derived: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class SkippedLayers:
    """Layers a checkpoint holds that vLLM's model skips (DeepSeek-V3's MTP layers).

    A config-only plan lists their tensors as skipped (``Family.skip`` says
    why), as a plan of the published checkpoint would: each such layer is a
    decoder layer of the family's table at that index, experts per expert
    under their on-disk names, plus ``extras``
    (``m2nkit.adapters.config_wires.skipped_layer_wires``).

    Attributes:
        layers: config -> the layer indices.
        extras: ``(name under <at>, symbolic dims)`` of the layer's
            tensors besides its decoder layer, in the model dtype, unquantized.
        at: the wire name of layer ``{L}``'s module (``model.layers.{L}``; a
            multimodal wrapper moves it under its prefix).
    """

    layers: Callable[[Any], Sequence[int]]
    extras: tuple[tuple[str, tuple[str, ...]], ...] = ()
    at: str = "model.layers.{L}"


#: :attr:`Family.online_fp8` meaning "the table's ``Param.quantized`` flags".
ONLINE_FP8_FROM_TABLE = ("<Param.quantized>",)


@dataclass(frozen=True)
class Family:
    """Everything m2nkit knows about one model family.

    Attributes:
        architecture: ``config.architectures[0]`` (``"LlamaForCausalLM"``).
        hf: transformers' in-memory and on-disk names, expert fusing.
        params: the vLLM table, in vLLM's ``named_parameters()`` order per layer.
        sizes: config -> ``Sizes`` (may raise ``ValueError`` for a config
            variant the table does not cover).
        conditions: ``Param.when`` name -> ``(config, layer) -> bool``
            (``layer`` is ``None`` for non-layer parameters).
        checks: extra parallel-size rules: ``(sizes, spec) -> message or
            None`` (``spec`` has ``tp``, ``dp``, ``ep``; a message names the
            config value and the rule).
        tiny: tiny test model name (``"tiny-llama"``) -> ``TinyModel``.
        vllm_source: the vLLM model file the table restates.
        module: the module defining the family (for messages).
        skip: ``(config, wire name) -> reason or None``: wire tensors a
            checkpoint may hold that vLLM's model skips on purpose
            (DeepSeek-V3's MTP layer); the plan lists them as skipped with
            the reason. ``None``: none.
        skipped_layers: the layers ``skip`` names, described for config-only
            plans (:class:`SkippedLayers`), so that those list the skipped
            tensors a published checkpoint holds; ``None``: none.
        num_expert_group: config -> the ``num_expert_group`` the family's
            vLLM MoE layer passes to ``FusedMoEFactory`` (DeepSeek-V3: the
            config's ``n_group``); ``None`` (the default): it passes none.
            vLLM honours round-robin expert placement only with more than
            one group (``m2nkit.adapters.vllm.expert_placement``).
        notes: config -> sentences a plan of this config must carry (how the
            family reads a config variant it plans differently from what
            the config alone says, e.g. a quantized config planned in
            bf16); ``None``: none. They end up in ``DestinationLayout.notes``.
        tp_plan: how trainers apply tensor parallelism to the family
            (:class:`TPPlan`); ``None``: no plan (a trainer spec with
            ``tp > 1`` is refused for the family).
        repeats: placeholders of the table besides ``{L}`` that repeat a
            run of consecutive rows -> the ``Sizes`` symbol of the count (a
            vision tower's blocks: ``{"B": "vdepth"}``); filled by
            ``m2nkit.adapters.families.expand``. Empty for most families.
        online_fp8: which vLLM parameters vLLM 0.33.0 quantizes under
            ``quantization="fp8_per_block"`` (``m2nkit.adapters.vllm.fp8``):
            suffixes of their names, or :data:`ONLINE_FP8_FROM_TABLE` (the
            table's ``Param.quantized`` flags, where vLLM's checkpoint-fp8
            rule and its online one agree); ``None``: no rule (``quant=`` is
            refused for the family).

    Raises:
        ValueError: a ``Param.when`` names no condition.
    """

    architecture: str
    hf: HFNaming
    params: tuple[Param, ...]
    sizes: Callable[[Any], Sizes]
    conditions: Mapping[str, Callable[[Any, int | None], bool]] = field(default_factory=dict)
    checks: tuple[Callable[[Sizes, Any], str | None], ...] = ()
    tiny: Mapping[str, TinyModel] = field(default_factory=dict)
    vllm_source: str = ""
    module: str = ""
    skip: Callable[[Any, str], str | None] | None = None
    num_expert_group: Callable[[Any], int | None] | None = None
    notes: Callable[[Any], tuple[str, ...]] | None = None
    tp_plan: TPPlan | None = None
    skipped_layers: SkippedLayers | None = None
    repeats: Mapping[str, str] = field(default_factory=dict)
    online_fp8: tuple[str, ...] | None = None

    def tp_problem(self, tp: int, config: Any) -> str | None:
        """Why a trainer cannot apply :attr:`tp_plan` over ``tp`` ranks to ``config``, or ``None``.

        The rule is :attr:`TPPlan.divides`: ``tp`` must divide each size the
        plan shards for this config. The message names the first size it
        does not divide, its config key and value, and the valid TP sizes
        (the divisors of every such size), on one line. ``None`` also for
        ``tp == 1`` and for a family without a plan (:meth:`TrainerSpec.tp_dims`
        refuses that).
        """
        if self.tp_plan is None or tp == 1:
            return None
        s = self.sizes(config)
        layers = range(s.layers)
        need = [sym for sym, when in self.tp_plan.divides.items()
                if when is None or any(self.conditions[when](config, L) for L in layers)]
        values = {sym: s.resolve((sym,))[0] for sym in need}
        bad = [sym for sym in need if values[sym] % tp]
        if not bad:
            return None
        g = math.gcd(*values.values())
        valid = [d for d in range(1, g + 1) if g % d == 0]
        what = {"nh": "each TP rank must hold whole attention heads",
                "nkv": "each TP rank must hold whole KV heads; a trainer's TP does not "
                       "replicate KV heads as vLLM does",
                "I": "gate/up rows and down_proj columns must split evenly",
                "Im": "gate/up rows and down_proj columns must split evenly"}
        why = what.get(bad[0], "the plan shards it")
        return (f"tp={tp} does not divide {s.label(bad[0])} ({why}; {self.architecture} TP "
                f"plan, {self.module}); valid tp sizes for this model: "
                f"{', '.join(map(str, valid))}")

    def __post_init__(self) -> None:
        if self.tp_plan is not None:
            for sym, when in self.tp_plan.divides.items():
                if when is not None and when not in self.conditions:
                    raise ValueError(
                        f"{self.architecture}: TPPlan.divides {sym!r} uses condition {when!r}, "
                        f"which is not one of {sorted(self.conditions)}")
        for p in self.params:
            if p.when is not None and p.when not in self.conditions:
                raise ValueError(
                    f"{self.architecture}: table entry {p.name!r} uses condition {p.when!r}, "
                    f"which is not one of {sorted(self.conditions)}")
