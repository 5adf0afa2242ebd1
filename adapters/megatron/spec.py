"""The ``megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D][,first=N][,last=N]`` dry-run trainer spec.

``m2nkit plan CHECKPOINT --trainer megatron:...`` lays a checkpoint out as a
Megatron-Core trainer would hold it, from the rules of
:mod:`m2nkit.adapters.megatron.layout` (the ones the live source uses), so a
user can plan Qwen3-235B-A22B ``megatron:tp=4,pp=8,ep=8`` into
``vllm:tp=8,ep`` on a laptop. Parsing imports no torch.

Sizes (megatron-core ``parallel_state.initialize_model_parallel``):
``etp`` defaults to ``tp``; ``dp`` defaults to the least data-parallel size
the expert grid fits (``tp*dp`` divisible by ``etp*ep``), so the world is
``tp*dp*pp`` ranks in Megatron's default order ``tp-cp-ep-dp-pp``.
Layers: even stages (``L/pp``, ``L/(pp*vpp)`` per chunk); ``first``/``last``
are ``num_layers_in_first/last_pipeline_stage``. When ``L`` does not split
evenly and neither is given, the first and last stages share what the
middle stages (``ceil(L/pp)`` each) leave (Qwen3-235B-A22B's 94 layers over
pp=8: 11, 12 x 6, 11), a default of m2nkit's, not a Megatron rule: pass first=/last= to plan what your trainer runs. The padded vocabulary is
``make_vocab_size_divisible_by=128`` times ``tp`` (Megatron-LM's default);
padding rows are never sent, so only the split points depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .layout import (MegatronLayoutError, MegatronParallel, WireRule, match_wire, wire_pieces,
                     wire_stage)

__all__ = ["MEGATRON_SPEC_FORM", "MegatronSpec", "parse_megatron_body", "megatron_wire_rules",
           "megatron_size_problem"]

MEGATRON_SPEC_FORM = "megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D][,first=N][,last=N]"
_KEYS = ("tp", "pp", "vpp", "ep", "etp", "dp", "first", "last")


@dataclass(frozen=True)
class MegatronSpec:
    """A parsed ``megatron:`` spec: the parallel sizes and optional first/last stage layer counts."""

    par: MegatronParallel
    first: int | None = None
    last: int | None = None

    def __str__(self) -> str:
        p = self.par
        parts = [f"tp={p.tp}", f"pp={p.pp}"]
        parts += [f"vpp={p.vpp}"] if p.vpp > 1 else []
        parts += [f"ep={p.ep}"] if p.ep > 1 else []
        parts += [f"etp={p.etp}"] if p.etp != p.tp else []
        parts += [f"dp={p.dp}"] if p.dp > 1 else []
        parts += [f"first={self.first}"] if self.first is not None else []
        parts += [f"last={self.last}"] if self.last is not None else []
        return "megatron:" + ",".join(parts)

    def layers_for(self, num_layers: int) -> MegatronParallel:
        """The grid with its layer assignment for a model of ``num_layers`` layers.

        Raises:
            MegatronLayoutError: ``first``/``last``/``vpp`` that do not split the layers.
        """
        first, last = self.first, self.last
        p = self.par
        if p.pp > 1 and first is None and last is None and num_layers % (p.pp * p.vpp):
            m = -(-num_layers // p.pp)
            rest = num_layers - (p.pp - 2) * m
            if p.pp > 2 and rest >= 0:
                first, last = rest // 2, rest - rest // 2
        return p.with_layers(num_layers, first=first, last=last)


def parse_megatron_body(spec: str, body: str, bad) -> MegatronSpec:
    """Parse ``tp=T,pp=P,...`` (any order); ``bad(spec, why)`` builds the error to raise."""
    sizes: dict[str, int] = {}
    for part in body.split(","):
        key, eq, value = (x.strip() for x in part.partition("="))
        key = key.lower()
        if not eq:
            raise bad(spec, f"'megatron' takes NAME=SIZE pairs, got {part.strip()!r}")
        if key not in _KEYS:
            raise bad(spec, f"'megatron' size {key!r} is not supported; sizes are "
                            f"{', '.join(_KEYS)} ({MEGATRON_SPEC_FORM})")
        if key in sizes:
            raise bad(spec, f"'megatron' size {key!r} is given twice")
        if not (value.isascii() and value.isdigit()) or (int(value) <= 0 and key not in (
                "first", "last")):
            raise bad(spec, f"'megatron' {key}={value!r} is not a positive integer")
        sizes[key] = int(value)
    try:
        par = MegatronParallel(tp=sizes.get("tp", 1), pp=sizes.get("pp", 1),
                               vpp=sizes.get("vpp", 1), ep=sizes.get("ep", 1),
                               etp=sizes.get("etp"), dp=sizes.get("dp"))
    except MegatronLayoutError as e:
        raise bad(spec, str(e)) from None
    if par.vpp > 1 and par.pp == 1:
        raise bad(spec, "vpp > 1 needs pp > 1 (virtual stages interleave pipeline stages)")
    return MegatronSpec(par, sizes.get("first"), sizes.get("last"))


def _cfg(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def megatron_size_problem(par: MegatronParallel, config: Any, *, loader: str = "plan") -> str | None:
    """What megatron-core 0.19.2 would refuse about this model at these sizes, or ``None``.

    Reads the Hugging Face config (a dict, e.g. ``config.json`` read with
    ``json``, or a transformers config) without torch, so ``m2nkit plan`` and
    ``m2nkit demo`` refuse in milliseconds what the trainers would otherwise
    refuse minutes later. Every rule megatron-core applies to these sizes
    when it builds a ``GPTModel``:

    * heads: ``num_attention_heads % tp == 0``
      (``transformer/transformer_config.py``, ``TransformerConfig.__post_init__``);
    * query groups (``num_key_value_heads``): a multiple or a divisor of ``tp``
      (same place);
    * dense FFN (``intermediate_size``, where the model has dense layers):
      ``% tp == 0`` (``tensor_parallel/layers.py``: ``ColumnParallelLinear`` and
      ``RowParallelLinear`` ``divide`` their split size by the TP size;
      ``transformer/mlp.py`` builds ``linear_fc1``/``linear_fc2`` from them);
    * experts: ``num_experts % ep == 0`` (``transformer/moe/moe_layer.py``,
      ``MoELayer.__init__``); expert FFN (``moe_intermediate_size``, Mixtral's and
      GPT-OSS's ``intermediate_size``) ``% etp == 0`` (``transformer/moe/experts.py``:
      the experts' ``linear_fc1``/``fc2`` are the same parallel linears over the
      expert-TP group);
    * vocabulary, for a model Megatron-Bridge builds (``loader="bridge"``):
      ``vocab_size % tp == 0`` (Bridge's ``GPTModelProvider.should_pad_vocab`` is
      False, and ``VocabUtility.vocab_range_from_global_vocab_size`` in
      ``tensor_parallel/utils.py`` ``divide``s it; ``m2nkit plan`` plans
      Megatron-LM's padded vocabulary, ``make_vocab_size_divisible_by * tp``);
    * layers: even stages need ``num_hidden_layers % pp == 0`` and the layers of
      a stage ``% vpp == 0`` (``transformer/transformer_block.py``,
      ``get_num_layers_to_build``); uneven ones are
      :meth:`MegatronSpec.layers_for`'s (``m2nkit plan`` picks first=/last= when
      the split is uneven, which the demo, ``loader="bridge"``, does not).

    * expert parallelism needs experts: ``ep > 1`` on a model without them is
      refused (``TransformerConfig.__post_init__``: "num_moe_experts must be non
      None to use expert-parallel.").

    A multimodal config (Qwen3-VL, Qwen3.5) is read from its ``text_config``,
    where its language model's sizes are (the vision tower's are the wire
    rules' of ``megatron_wire_rules``).

    ``loader``: ``"plan"`` (the dry run) or ``"bridge"`` (the demo's trainers,
    built by Megatron-Bridge's provider with even stages).
    """
    text = _cfg(config, "text_config")
    if text is not None:
        config = text

    def num(*keys: str) -> int:
        for key in keys:
            value = _cfg(config, key)
            if value is not None:
                return int(value)
        return 0

    tp, ep, etp = par.tp, par.ep, par.etp
    nh = num("num_attention_heads")
    ng = num("num_key_value_heads") or nh
    experts = num("num_experts", "num_local_experts", "n_routed_experts")
    dense = (not experts or bool(_cfg(config, "mlp_only_layers"))
             or num("decoder_sparse_step") > 1 or num("first_k_dense_replace") > 0)
    ffn = num("intermediate_size")

    def tp_error(t: int) -> str | None:
        if nh and nh % t:
            return (f"num_attention_heads ({nh}) must be a multiple of tp ({t}) (megatron-core "
                    "TransformerConfig)")
        if ng and ng % t and t % ng:
            return (f"num_key_value_heads ({ng}, megatron-core's num_query_groups) must be a "
                    f"multiple or a divisor of tp ({t}) (megatron-core TransformerConfig)")
        if dense and ffn and ffn % t:
            return (f"intermediate_size ({ffn}, megatron-core's ffn_hidden_size) must be "
                    f"divisible by tp ({t}) (megatron-core ColumnParallelLinear/"
                    "RowParallelLinear)")
        return None

    error = tp_error(tp)
    if error is not None:
        fits = [t for t in range(1, max(nh, tp) + 1) if tp_error(t) is None]
        return f"{error}; tp that fits these rules: {', '.join(map(str, fits))}"
    if ep > 1 and not experts:
        return (f"ep={ep} needs experts, and this model has none (no num_experts, "
                "num_local_experts or n_routed_experts): megatron-core refuses expert "
                "parallelism without them (TransformerConfig: num_moe_experts must be non None "
                "to use expert-parallel); drop ep")
    if experts:
        if experts % ep:
            return (f"the number of experts ({experts}) must be divisible by ep ({ep}) "
                    "(megatron-core MoELayer)")
        moe_ffn = num("moe_intermediate_size", "intermediate_size")
        if moe_ffn % etp:
            key = "moe_intermediate_size" if _cfg(config, "moe_intermediate_size") else \
                "intermediate_size"
            return (f"{key} ({moe_ffn}, megatron-core's moe_ffn_hidden_size) must be divisible "
                    f"by etp ({etp}) (megatron-core's expert linear layers)")
    vocab = num("vocab_size")
    if loader == "bridge" and vocab and vocab % tp:
        return (f"vocab_size ({vocab}) must be divisible by tp ({tp}): Megatron-Bridge builds "
                "the vocabulary unpadded (megatron-core VocabUtility)")
    layers = num("num_hidden_layers")
    if loader == "bridge" and layers and layers % (par.pp * par.vpp):
        return (f"the demo builds even pipeline stages, and {layers} layers do not split "
                f"over pp*vpp={par.pp * par.vpp} (megatron-core get_num_layers_to_build); pick "
                f"sizes that divide {layers} (m2nkit plan takes first=/last= for uneven stages)")
    return None


@dataclass(frozen=True)
class _WireKey:
    """What ``TrainerSpec.tp_dims`` answers for one wire name under a megatron spec."""

    name: str
    rules: "_Rules"


@dataclass(frozen=True, eq=False)
class _Rules:
    par: MegatronParallel
    names: tuple
    sizes: tuple
    architecture: str
    table: str

    def layout(self, name: str, shape: tuple[int, ...]):
        rule = match_wire(self.names, name)
        if rule is None:
            raise ValueError(
                f"wire tensor '{name}' has no Megatron-Core name in {self.table}, so a "
                "megatron trainer spec cannot lay it out")
        # every layer of one stage has the same pieces: one layout per (row, part, stage, shape)
        return self._stage_layout(rule.entry, rule.part, wire_stage(rule, self.par), shape)

    @lru_cache(maxsize=None)
    def _stage_layout(self, entry, part, stage, shape):
        layered = "{L}" in entry.wire_of(part)
        rule = WireRule(entry, part, sum(self.par.layers[stage], ())[0] if layered else None)
        name = entry.wire_of(part).replace("{L}", str(rule.layer))
        return wire_pieces(rule, shape, self.par, sizes=dict(self.sizes), wire=name)


def megatron_wire_rules(mspec: MegatronSpec, config: Any, label: str):
    """``wire name -> key`` for ``TrainerSpec.layout_for(shape, tp_dim=key)`` under ``mspec``.

    Raises:
        ValueError: a family without Megatron names (names the families
            with them); sizes the Megatron rules cannot split (heads, the
            MLP, experts, layers; names the value); an unsupported architecture.
    """
    from ..families import family_for
    from .names import MEGATRON_NAMES, megatron_names, table_name

    fam = family_for(config)
    names = megatron_names(fam)
    if not names:
        having = sorted(MEGATRON_NAMES)
        raise ValueError(f"trainer spec '{label}': {fam.architecture} has no Megatron-Core names "
                         f"(no table in {table_name(fam)}); families with them: "
                         f"{', '.join(having)}")
    why = megatron_size_problem(mspec.par, config)
    if why:
        raise ValueError(f"trainer spec '{label}': {why}")
    s = fam.sizes(config)
    try:
        par = mspec.layers_for(s.layers)
    except MegatronLayoutError as e:
        raise ValueError(f"trainer spec '{label}': {e}") from None
    sizes = (("nh", s.nh), ("ng", s.nkv), ("hd", s.hd))
    vision = _cfg(config, "vision_config")
    if vision is not None:  # a VLM tower's heads (QKV_CONCAT), every head its own group
        sizes += (("vnh", int(_cfg(vision, "num_heads"))),)
    rules = _Rules(par, names, sizes, fam.architecture, table_name(fam))
    return lambda name: _WireKey(name, rules)


def layout_of_key(key: Any, shape: tuple[int, ...], label: str):
    """The ``PieceLayout`` of the wire tensor ``key`` names (``TrainerSpec.layout_for``).

    Raises:
        ValueError: ``key`` is not from :func:`megatron_wire_rules`; see there.
    """
    if not isinstance(key, _WireKey):
        raise ValueError(f"trainer spec '{label}': layout_for needs tp_dim=<tp_dims(config)"
                         f"(name)>, got {key!r}")
    try:
        return key.rules.layout(key.name, tuple(shape))
    except MegatronLayoutError as e:
        raise ValueError(f"trainer spec '{label}': {e}") from None


def world_of(mspec: MegatronSpec) -> tuple[int, int, int]:
    """``(pp, dp, tp)``: the spec's mesh (row-major rank = ``tp_r + tp*(dp_r + dp*pp_r)``)."""
    p = mspec.par
    return (p.pp, p.dp, p.tp)

