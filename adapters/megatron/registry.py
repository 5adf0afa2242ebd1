"""Megatron-Core names and conversion kinds read from Megatron-Bridge's own mapping registry.

Megatron-Bridge 0.6.2 holds, per architecture, a ``MegatronMappingRegistry``
(``megatron/bridge/models/conversion/mapping_registry.py``): one mapping
object per Megatron parameter pattern (``decoder.layers.*.self_attention.
linear_qkv.weight``), naming its Hugging Face tensor(s) and, by its class,
how it is converted (``param_mapping.py``: ``QKVMapping``,
``GatedMLPMapping``, ``ColumnParallelMapping``, ``RowParallelMapping``,
``ReplicatedMapping``, and ``AutoMapping``, which picks column, row or
replicated from the live module with ``_detect_parallelism_type``). When
Megatron-Bridge is installed and has a bridge for the model's architecture,
the live :func:`~m2nkit.adapters.megatron.megatron_source` reads its name
table from there (:func:`registry_names`), not from the hand-written tables
of :mod:`.names`; those stay for architectures without a bridge (Mixtral)
and for the vLLM-free dry run (``megatron:...``), and
``tests/integration/test_megatron_source.py`` holds them equal to the
registry for every family that has both.

How a registry row becomes a :class:`~.layout.MegatronName`:

* patterns: Bridge's ``*`` is a layer number in ``decoder.layers.*``
  (``{L}``) and an expert number in ``local_experts.*`` / TE
  ``linear_fc1.weight*`` (``{i}``);
* HF names: per-expert names (``...experts.*.gate_proj.weight``) are the
  family's stacked wire tensors (``...experts.gate_up_proj.weight``, by the
  family's ``HFNaming.experts_on_disk`` / ``fused_experts``);
* kinds: ``QKVMapping`` -> ``QKV``; ``GatedMLPMapping`` -> ``GATED_FC1``
  (``EXPERT_FC1`` for routed experts); column -> ``COLUMN`` (``VOCAB`` for
  ``embedding.word_embeddings.weight`` and ``output_layer.weight``, the
  vocabulary-parallel tensors of megatron-core ``gpt_model.py``); row ->
  ``ROW`` (``EXPERT_FC2`` for routed experts; a 1-D row-parallel tensor, a
  bias, is whole on every rank by the layout rule); replicated -> ``REPLICATED``.
  ``AutoMapping``'s kind is Bridge's ``_detect_parallelism_type`` on the
  module that owns the tensor (:func:`resolve_kind`): megatron-core's local
  spec builds MLA's ``linear_q_down_proj`` as a ``ColumnParallelLinear``
  (column), its TransformerEngine spec as a duplicated ``TELinear``
  (replicated), so the kind is the built model's, never a table's;
* rows of other mapping classes (``QKVGMapping``, the Gated DeltaNet
  mappings, ``RMSNorm2ZeroCenteredRMSNormMapping``, permuted
  ``AutoMapping``) have no m2nkit layout: :func:`registry_names` leaves them
  out and reports them (:attr:`RegistryTable.unsupported`), so a model
  parameter they map is refused naming the mapping class;
* multi-token-prediction rows (``mtp.*``) are left out: MTP layers are not
  sent (vLLM's main model skips them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..families.kinds import COLUMN, QKV, REPLICATED, ROW, VOCAB
from .layout import EXPERT_FC1, EXPERT_FC2, GATED_FC1, MegatronName, _template_regex

__all__ = ["RegistryRow", "RegistryTable", "bridge_registry", "registry_rows", "resolve_kind",
           "registry_names", "VOCAB_TENSORS"]

#: megatron-core ``GPTModel``'s vocabulary-parallel tensors (``gpt_model.py``:
#: ``LanguageModelEmbedding.word_embeddings`` is a ``VocabParallelEmbedding``,
#: ``output_layer`` a ``ColumnParallelLinear`` over the padded vocabulary).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

_PARAM_MAPPING_MODULE = "megatron.bridge.models.conversion.param_mapping"
#: Bridge mapping classes (exact class, so a subclass with its own transform is
#: not taken for its base) -> kind; ``"auto"``: decided per module.
_KINDS = {"QKVMapping": "qkv", "GatedMLPMapping": "gated", "ColumnParallelMapping": "column",
          "RowParallelMapping": "row", "ReplicatedMapping": "replicated", "AutoMapping": "auto"}
#: stand-in numbers used to resolve Bridge's wildcards into the family's wire names
_LAYER, _EXPERT = 987001, 987002


@dataclass(frozen=True)
class RegistryRow:
    """One mapping of a Bridge registry, in m2nkit's template spelling.

    Attributes:
        megatron: Megatron template (``{L}`` local layer, ``{i}`` local expert).
        mapping: the Bridge mapping class name (``AutoMapping``).
        kind: ``qkv``, ``gated``, ``column``, ``row``, ``replicated``, ``auto``,
            or ``None`` (a class m2nkit has no layout for).
        wire: the wire template, or part -> wire template (q/k/v, gate/up).
        expert: a routed expert's tensor (``{i}`` in ``megatron``).
        obj: the Bridge mapping object (for ``_detect_parallelism_type``).
    """

    megatron: str
    mapping: str
    kind: str | None
    wire: str | tuple[tuple[str, str], ...]
    expert: bool
    obj: Any = field(compare=False, repr=False)
    regex: re.Pattern = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", _template_regex(self.megatron))


@dataclass(frozen=True)
class RegistryTable:
    """The rows of one architecture's Bridge registry.

    Attributes:
        bridge: the Bridge class name (``Qwen3Bridge``), for messages.
        rows: every row m2nkit reads (MTP rows left out).
    """

    bridge: str
    rows: tuple[RegistryRow, ...]

    @property
    def unsupported(self) -> tuple[RegistryRow, ...]:
        """Rows whose mapping class has no m2nkit layout."""
        return tuple(r for r in self.rows if r.kind is None)

    def row_of(self, name: str) -> RegistryRow | None:
        """The row whose Megatron template matches the Megatron tensor ``name``."""
        for r in self.rows:
            if r.regex.match(name):
                return r
        return None


def bridge_registry(architecture: str, hf_config: Any = None) -> Any | None:
    """The mapping registry of Bridge's bridge for ``architecture``; ``None``: no bridge.

    Bridge's own dispatch (``model_bridge.get_model_bridge``, keyed by the
    transformers class or, for ``auto_map`` models, its name), the bridge
    instance given ``hf_config`` as ``AutoBridge`` does (``register_bridge_
    implementation``), then its ``mapping_registry()``.

    Returns:
        ``(bridge class name, registry)``, or ``None`` when Megatron-Bridge is
        not installed or has no bridge for it (an installed Bridge that fails
        to import raises: a silent fallback to the hand tables would hide it).
    """
    import importlib.util

    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            return None
    except ModuleNotFoundError:  # no megatron namespace at all
        return None
    from .compat import enable_py311

    enable_py311()  # Bridge imports typing.override (Python 3.12)
    import megatron.bridge.models  # noqa: F401 - registers every bridge
    from megatron.bridge.models.conversion import model_bridge
    try:
        import transformers

        source = getattr(transformers, architecture, architecture)
    except ImportError:
        source = architecture
    bridge = None
    for key in dict.fromkeys((source, architecture)):
        try:
            bridge = model_bridge.get_model_bridge(key)
            break
        except NotImplementedError:
            continue
    if bridge is None:
        return None
    if isinstance(hf_config, Mapping):  # a config.json dict: read by attribute, as Bridge does
        import types

        hf_config = types.SimpleNamespace(**hf_config)
    if hf_config is not None:
        bridge.hf_config = hf_config  # as register_bridge_implementation sets it
    if not hasattr(bridge, "hf_pretrained"):
        # some registries read the checkpoint's file layout (GLM45Bridge: fused or
        # per-expert HF experts); without a checkpoint, the per-expert mappings
        bridge.hf_pretrained = None
    return type(bridge).__name__, bridge.mapping_registry()


def _megatron_template(pattern: str) -> str:
    """Bridge pattern -> m2nkit template (``*`` -> ``{L}`` / ``{i}``)."""
    out = pattern.replace("decoder.layers.*.", "decoder.layers.{L}.", 1)
    out = out.replace("local_experts.*.", "local_experts.{i}.")
    out = re.sub(r"(\.weight|\.bias)\*$", r"\1{i}", out)
    if "*" in out:
        raise ValueError(f"Bridge pattern {pattern!r}: a wildcard m2nkit cannot place")
    return out


def _wire(hf: str, family: Any) -> tuple[str, bool]:
    """Bridge HF pattern -> (wire template, per-expert), via the family's stacked names."""
    from .bridge import _stacked_parts

    name = hf.replace("*", str(_LAYER), 1)
    expert = "*" in name
    if expert:
        name = name.replace("*", str(_EXPERT), 1)
        for rx, wire_leaf, _, _ in _stacked_parts(family).values():
            m = rx.match(name)
            if m:
                name = f"{m['prefix']}.{wire_leaf}"
                break
        else:
            raise ValueError(f"Bridge HF pattern {hf!r}: no stacked expert tensor of the "
                             f"{family.architecture} family holds it")
    if "*" in name:
        raise ValueError(f"Bridge HF pattern {hf!r}: a wildcard m2nkit cannot place")
    return name.replace(str(_LAYER), "{L}"), expert


def registry_rows(architecture: str, family: Any, hf_config: Any = None) -> RegistryTable | None:
    """Bridge's registry for ``architecture`` as :class:`RegistryRow`s; ``None``: no bridge."""
    found = bridge_registry(architecture, hf_config)
    if found is None:
        return None
    bridge, registry = found
    rows = []
    for m in registry.mappings:
        if m.megatron_param.startswith("mtp."):
            continue
        cls = type(m)
        kind = _KINDS.get(cls.__name__) if cls.__module__ == _PARAM_MAPPING_MODULE else None
        if kind == "auto" and getattr(m, "permute_dims", None):
            kind = None
        try:
            meg = _megatron_template(m.megatron_param)
            if isinstance(m.hf_param, str):
                wire, expert = _wire(m.hf_param, family)
            else:
                parts = {p: _wire(h, family) for p, h in m.hf_param.items()}
                expert = any(e for _, e in parts.values())
                stacked = {w for w, _ in parts.values()}
                wire = (next(iter(stacked)) if expert and len(stacked) == 1
                        else tuple((p, w) for p, (w, _) in parts.items()))
        except ValueError:
            meg, wire, expert, kind = m.megatron_param, str(m.hf_param), False, None
        rows.append(RegistryRow(meg, cls.__name__, kind, wire, expert or "{i}" in meg, m))
    return RegistryTable(bridge, tuple(rows))


def resolve_kind(row: RegistryRow, module: Any) -> str | None:
    """A row's kind for the module that owns its tensor (``AutoMapping``: Bridge's
    ``_detect_parallelism_type``; ``None``: Bridge cannot tell)."""
    if row.kind != "auto":
        return row.kind
    try:
        return row.obj._detect_parallelism_type(module)
    except ValueError:
        return None


def _is_norm(template: str) -> bool:
    """A norm weight by megatron-core's module names (``*_layernorm``, ``layer_norm_weight``)."""
    leaf = template.rsplit(".", 2)
    return template.endswith("layer_norm_weight") or "norm" in leaf[-2]


def registry_names(table: RegistryTable, kinds: Mapping[str, str], *,
                   buffers: frozenset = frozenset()) -> tuple[MegatronName, ...]:
    """The name table of a Bridge registry, in :mod:`.names`' form.

    Args:
        table: :func:`registry_rows`' answer.
        kinds: Megatron template -> resolved kind (``column``/``row``/
            ``replicated``) for ``AutoMapping`` rows (:func:`resolve_kind` on
            the built model); an ``auto`` row absent here maps no tensor of
            the model and is left out.
        buffers: Megatron templates whose tensor is a persistent buffer
            (``router.expert_bias``: fp32 on the wire).

    Returns:
        One :class:`MegatronName` per (kind, wire tensor(s)): the registry's
        spellings of one tensor (local spec and TE spec, e.g.
        ``input_layernorm.weight`` and ``linear_qkv.layer_norm_weight``) in
        one row, in registry order.

    Raises:
        ValueError: a row whose kind m2nkit cannot lay out for its tensor
            (a column-parallel routed expert), naming the template.
    """
    merged: dict[tuple, list[str]] = {}
    for r in table.rows:
        kind = kinds.get(r.megatron) if r.kind == "auto" else r.kind
        if kind is None:
            continue
        wire = r.wire
        if kind == "qkv":
            rule = QKV
        elif kind == "gated":
            rule = EXPERT_FC1 if r.expert else GATED_FC1
        elif r.expert:
            if kind != "row":
                raise ValueError(f"Bridge {table.bridge}: routed-expert tensor {r.megatron!r} is "
                                 f"{kind}; m2nkit lays out experts' linear_fc1 (gated) and "
                                 "linear_fc2 (row) only")
            rule = EXPERT_FC2
        elif kind == "column":
            # a VLM's language model (Bridge Qwen3VLModel) under its ``language_model.``
            rule = VOCAB if r.megatron.removeprefix("language_model.") in VOCAB_TENSORS \
                else COLUMN
        elif kind == "row":
            rule = ROW
        else:
            rule = REPLICATED
        key = (rule.name, wire, _is_norm(r.megatron) and rule is REPLICATED,
               r.megatron in buffers)
        merged.setdefault(key, []).append(r.megatron)
    rules = {r.name: r for r in (QKV, GATED_FC1, EXPERT_FC1, EXPERT_FC2, VOCAB, COLUMN, ROW,
                                 REPLICATED)}
    return tuple(MegatronName(tuple(dict.fromkeys(ms)), rules[rn],
                              w if isinstance(w, str) else dict(w), norm=norm, buffer=buf)
                 for (rn, w, norm, buf), ms in merged.items())
