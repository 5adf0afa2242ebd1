"""A config's wire tensors from its family table, without building the model.

A config-only plan (``m2nkit plan config.json``) needs the names, shapes and
dtypes of the wire tensors a checkpoint of that config would hold, in wire
order. Building transformers' model on the meta device gives them, but
costs seconds for a model of a trillion parameters, nearly all of it
importing transformers' modeling code. The family table already knows
everything needed: which wire tensors feed which vLLM parameter, their
symbolic shapes, the conditions under which a layer has them, and (in
``HFNaming``) how transformers fuses experts and orders its modules. This
module reads them from there, and ``config.json`` with ``json``:

* :func:`read_config_json` reads ``config.json`` as transformers' config
  class of the family would, from the defaults the family declares
  (``HFNaming.config_defaults``), without importing transformers;
* :func:`table_wires` lists the wire tensors in transformers'
  ``named_parameters()`` order (the wire order of every checkpoint);
* :func:`skipped_layer_wires` lists the on-disk tensors of layers vLLM's
  model skips (multi-token-prediction layers), as the published checkpoints
  store them.

Which tensors a config has is the family table expanded for it by
:mod:`m2nkit.adapters.families.expand`, the same expansion
``destination_layout`` binds, so the two cannot disagree on a layer count,
a condition or a tied ``lm_head``. Nothing here imports the vLLM side:
the model dtype is the one the config names
(:func:`m2nkit.adapters.families.sizes.config_dtype`), not vLLM's choice.

The result is exactly what the meta-model path gives (names, shapes, order;
dtypes where transformers allocates what checkpoints store), for every
family's tiny models and every real config in ``examples/configs``
(``tests/adapters/test_config_wires.py``, which keeps the meta-model path as the
reference). The checkpoint reader falls back to transformers for a config
the family cannot read this way: a ``model_type`` it does not declare
(:func:`read_config_json` returns ``None``), or a config whose tensors its
table does not list exactly (``HFNaming.table_differs``).

Ordering rule (torch ``Module.named_parameters``): modules are visited
depth first, a module's own parameters before its children's, children in
registration order. The table gives the modules in vLLM's order, which is
transformers' registration order except where ``HFNaming.child_order``
says otherwise (a MoE block registering its experts before its router).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .experts import expert_name
from .families.expand import Expanded, expand
from .families.quant import FP8, QuantizedWires, scale_name
from .families.sizes import Sizes, config_dtype
from .families.table import Family

__all__ = ["ConfigJson", "read_config_json", "TableWire", "table_wires", "skipped_layer_wires"]

#: A module index in a name (``model.layers.3``, ``model.language_model.layers.3``,
#: ``model.visual.blocks.0``): ``HFNaming.child_order`` writes it ``{L}``.
_LAYER = re.compile(r"(?<=\.)\d+(?=\.|$)")


class ConfigJson(dict):
    """``config.json`` with the config class's defaults applied: a dict with attribute access.

    ``config["hidden_size"]`` and ``config.hidden_size`` both work, so every
    reader of configs in m2nkit (``cfg_get``, ``getattr``) takes it like a
    transformers config. ``model_type`` is the file's (an alias of
    ``HFNaming.config_classes`` keeps its name, read with its target's
    defaults), ``dtype`` the ``dtype``/``torch_dtype`` it names (a string),
    as transformers 5 keeps them.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no {key!r}") from None

    def to_dict(self) -> dict:
        """A plain dict copy (as a transformers config's ``to_dict``)."""
        return dict(self)


def read_config_json(data: Mapping[str, Any], family: Family) -> ConfigJson | None:
    """``config.json`` contents as ``family``'s transformers config class reads them.

    Keys the file lacks take the family's declared defaults
    (``HFNaming.config_defaults``: transformers' dataclass field defaults),
    then the callable ones derive their key from the others, as the class's
    ``__post_init__`` does (``head_dim`` from ``hidden_size //
    num_attention_heads`` when it is ``null`` or missing).

    Returns:
        The config, or ``None`` when ``data['model_type']`` is not one the
        family declares (``HFNaming.model_types``, or an alias in
        ``HFNaming.config_classes``): then only transformers can read it.
    """
    hf = family.hf
    model_type = data.get("model_type")
    if hf.config_classes.get(model_type, model_type) not in hf.model_types:
        return None
    out = ConfigJson(data)
    if out.get("dtype") is None and out.get("torch_dtype") is not None:
        out["dtype"] = out["torch_dtype"]
    rules = hf.config_defaults.items()
    for key, default in rules:          # dataclass field defaults first,
        if not callable(default) and key not in out:
            out[key] = default
    for key, default in rules:          # then what __post_init__ derives from them
        if callable(default):
            out[key] = default(out)
    return out


# --------------------------------------------------------------------------
# the wire tensors of a config


@dataclass(frozen=True)
class TableWire:
    """One wire tensor from the table: ``name``, global ``shape``, ``dtype``, and
    ``stacked``, the per-expert parts it stacks (``("gate", "up")``) or ``()``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stacked: tuple[str, ...] = ()


def _feeds(ex: Expanded, s: Sizes, dtype: torch.dtype
           ) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(wire name, shape, dtype)`` of every wire tensor of an expanded table, in its order.

    The expansion (:func:`m2nkit.adapters.families.expand.expand`, the one
    ``destination_layout`` uses) has already left out parameters whose
    condition is false and a tied ``lm_head`` (the files need not hold it).
    """
    for wire, (_, p, part) in ex.feeds.items():
        yield wire, p.kind.wire_shape(s.resolve(p.dims), part, s), (
            dtype if p.model_dtype_on_wire else p.dtype or dtype)


def _memory_path(family: Family, name: str) -> str:
    """The in-memory parameter path that orders wire tensor ``name`` (stacked and
    permuted experts are one parameter of their ``experts`` module in transformers)."""
    hf = family.hf
    for leaf, (wire_leaf, _) in hf.fused_experts.items():
        if name.endswith("." + wire_leaf):
            return name[: -len(wire_leaf)] + leaf
    for leaf, (wire_leaf, _) in hf.permuted.items():
        if name.endswith("." + wire_leaf):
            return name[: -len(wire_leaf)] + leaf
    return name


class _Module:
    __slots__ = ("params", "children")

    def __init__(self) -> None:
        self.params: list[Any] = []
        self.children: dict[str, _Module] = {}


def _in_module_order(family: Family, items: Sequence[Any],
                     name: Callable[[Any], str]) -> list[Any]:
    """``items`` in torch ``named_parameters()`` order of the model they belong to.

    The module tree is built in the order ``items`` come (the table's, vLLM's
    module order); ``HFNaming.child_order`` reorders the children of the
    modules it names to transformers' registration order.
    """
    root = _Module()
    for item in items:
        *path, _ = _memory_path(family, name(item)).split(".")
        node = root
        for part in path:
            node = node.children.setdefault(part, _Module())
        node.params.append(item)
    order = family.hf.child_order
    out: list[Any] = []

    def visit(node: _Module, path: str) -> None:
        out.extend(node.params)
        children = list(node.children.items())
        wanted = order.get(_LAYER.sub("{L}", path)) if order else None
        if wanted:
            rank = {c: i for i, c in enumerate(wanted)}
            children.sort(key=lambda kv: rank.get(kv[0], len(rank)))
        for child, sub in children:
            visit(sub, f"{path}.{child}" if path else child)

    visit(root, "")
    return out


def _model_dtype(config: Any) -> torch.dtype:
    """The dtype transformers builds ``config``'s model in: the one it names, else float32."""
    return config_dtype(config) or torch.float32


def table_wires(family: Family, config: Any, s: Sizes | None = None) -> list[TableWire]:
    """The wire tensors of ``config``, in wire order, without their fp8 scales.

    Names are wire names (on-disk names; experts stacked as
    ``<block>.experts.gate_up_proj.weight``; a permuted tensor in its wire
    form); shapes from the table's symbolic dims; dtypes the parameter's
    own (``Param.dtype``: a float32 router bias) or the config's model
    dtype (float32 when it names none). A tied
    ``lm_head.weight`` is left out, as a checkpoint need not hold it.
    Quantized weights keep the model dtype here; the checkpoint reader turns
    them into fp8 plus ``weight_scale_inv`` (``QuantizedWires``).

    Raises:
        ValueError: a config the family's ``sizes`` refuses.
    """
    s = family.sizes(config) if s is None else s
    dtype = _model_dtype(config)
    feeds = list(_feeds(expand(family, config, s, quantized=False), s, dtype))
    stacked = {f".{wire_leaf}": parts for wire_leaf, parts in family.hf.fused_experts.values()}
    out = []
    for name, shape, dt in _in_module_order(family, feeds, lambda f: f[0]):
        parts = next((p for leaf, p in stacked.items() if name.endswith(leaf)), ())
        out.append(TableWire(name, shape, dt, parts))
    return out


def skipped_layer_wires(family: Family, config: Any, s: Sizes | None = None,
                        quant: QuantizedWires | None = None) -> list[TableWire]:
    """On-disk tensors of the layers vLLM's model skips, as published checkpoints hold them.

    For each layer of ``Family.skipped_layers`` (multi-token-prediction layers):
    its extra tensors (``SkippedLayers.extras``, in the model dtype), then
    the decoder layer the table describes for that index, experts per
    expert under their on-disk names (``HFNaming.experts_on_disk``), each
    fp8 block-quantized weight followed by its ``weight_scale_inv`` when
    ``quant`` says so. Empty for a family without skipped layers.
    """
    spec = family.skipped_layers
    if spec is None:
        return []
    s = family.sizes(config) if s is None else s
    dtype = _model_dtype(config)
    hf = family.hf
    out: list[TableWire] = []

    def add(name: str, shape: tuple[int, ...], dt: torch.dtype, quantized: bool) -> None:
        if quantized and quant:
            out.append(TableWire(name, shape, FP8))
            out.append(TableWire(scale_name(name), quant.scale_shape(shape), torch.float32))
        else:
            out.append(TableWire(name, shape, dt))

    for layer in spec.layers(config):
        for leaf, dims in spec.extras:
            add(f"{spec.at.format(L=layer)}.{leaf}", s.resolve(dims), dtype, False)
        feeds = list(_feeds(expand(family, config, s, quantized=False, layers=(layer,)), s,
                            dtype))
        for name, shape, dt in _in_module_order(family, feeds, lambda f: f[0]):
            quantized = bool(quant) and quant.matches(name)
            fused = next(((leaf, parts) for leaf, (wire_leaf, parts) in hf.fused_experts.items()
                          if name.endswith("." + wire_leaf)), None)
            if fused is None:
                add(name, shape, dt, quantized)
                continue
            leaf, parts = fused
            prefix = name[: -len(hf.fused_experts[leaf][0]) - 1]
            E, rows, cols = shape
            for e in range(E):
                for part in parts:
                    add(expert_name(hf.experts_on_disk[part], prefix, e),
                        (rows // len(parts), cols), dt, quantized)
    return out
