"""A family table expanded for one config: every parameter that exists, and its wire tensors.

A family table (``VLLM_PARAMS``) is written once per architecture with a
``{L}`` for the layer and placeholders for vLLM-version names; a config
decides how many layers there are, which conditional parameters exist
(biases, dense or MoE layers) and whether ``lm_head`` is tied. Both sides
need that expansion, in the same words:

* the vLLM side binds each wire tensor to the parameter it feeds
  (``m2nkit.adapters.vllm.destination_layout``, ``reference_load``);
* the trainer side lists the wire tensors a config has
  (``m2nkit.adapters.config_wires``) and the names a live model may send
  (``m2nkit.adapters.fsdp2``).

So it is done here, once: :func:`expand`. Order is vLLM's module order
(``named_parameters()``): the non-layer parameters before the first layered
one, then every layer, then the rest; a run of consecutive rows using one of
the family's other placeholders (``Family.repeats``: a vision tower's
``{B}`` blocks) is repeated in place, index by index, like the layers. A
parameter whose condition is false for a layer is *absent* (its wire
tensors are recorded with why); a tied
``lm_head`` is *skipped* (vLLM's ``models/utils.py`` ``AutoWeightsLoader``
skips the aliased checkpoint tensor) and becomes an alias of the embedding.
Nothing here knows a sharding rule or a parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .quant import quantized_params
from .sizes import Sizes
from .table import Family, Param
from .vllm_names import DEFAULT_VLLM_VERSION, vllm_names

__all__ = ["Expanded", "expand", "split_layers", "fill"]

#: Why a tied ``lm_head.weight`` moves nothing.
_TIED = ("tie_word_embeddings=True: vLLM ties {name} to {canonical} and skips this checkpoint "
         "tensor (models/utils.py, AutoWeightsLoader aliased params)")


@dataclass
class Expanded:
    """A family table expanded for one config and vLLM version.

    Attributes:
        params: ``(vLLM name, table entry)`` of every parameter that exists,
            in vLLM's ``named_parameters()`` order.
        feeds: wire name -> ``(vLLM name, table entry, part)``, in the same
            order (the wire order of the table).
        absent: wire name -> why its parameter does not exist for this config.
        skipped: wire name -> why vLLM skips it (tied ``lm_head.weight``).
        aliases: vLLM name -> the parameter sharing its storage.
    """

    params: list[tuple[str, Param]]
    feeds: dict[str, tuple[str, Param, Any]]
    absent: dict[str, str]
    skipped: dict[str, str]
    aliases: dict[str, str]


def fill(template: str, layer: int | None, names: Mapping[str, Any]) -> str | None:
    """``template`` with ``{L}`` = ``layer`` and the vLLM-version placeholders of ``names``.

    ``None`` when the template uses a placeholder whose value is ``None``
    (an alias the vLLM version does not have, a layer name outside a layer).
    """
    keys = dict(names, L=layer)
    if any(v is None and "{" + k + "}" in template for k, v in keys.items()):
        return None
    return template.format(**keys)


def split_layers(table: Sequence[Param]) -> tuple[list[Param], list[Param], list[Param]]:
    """``(before, layered, after)``: the non-layer rows before the first ``{L}`` row,
    the ``{L}`` rows, and the non-layer rows after it (vLLM's module order)."""
    first = next((i for i, p in enumerate(table) if "{L}" in p.name), len(table))
    return ([p for p in table[:first] if "{L}" not in p.name],
            [p for p in table if "{L}" in p.name],
            [p for p in table[first:] if "{L}" not in p.name])


def expand(family: Family, config: Any, s: Sizes, names: Mapping[str, Any] | None = None, *,
           quantized: bool = True, layers: Iterable[int] | None = None) -> Expanded:
    """Expand ``family``'s table for ``config``: one entry per layer and parameter.

    Args:
        family, config, s: the family, its config and ``family.sizes(config)``.
        names: the vLLM version's name entry that fills placeholders like
            ``{experts}`` (:func:`~.vllm_names.vllm_names`); default: the
            default version's. Wire names never use them.
        quantized: with an fp8 block ``quantization_config``, add each
            quantized parameter's ``weight_scale_inv`` (``quant.quantized_params``);
            ``False``: the table as written.
        layers: ``None``: the whole model (``s.layers`` layers with the
            non-layer parameters around them); else only the layer rows, for
            these layer indices (layers vLLM skips that a checkpoint holds).

    Returns:
        :class:`Expanded`.
    """
    names = vllm_names(DEFAULT_VLLM_VERSION) if names is None else names
    out = Expanded([], {}, {}, {}, {})
    table = quantized_params(family, config) if quantized else family.params
    pre, layered, post = split_layers(table)

    def add(p: Param, layer: int | None, names: Mapping[str, Any] = names) -> None:
        name = fill(p.name, layer, names)
        exists = p.when is None or family.conditions[p.when](config, layer)
        if p.tied_to is not None and s.tied:
            canonical = fill(p.tied_to, layer, names)
            out.aliases[name] = canonical
            for wire, _ in p.feeds:
                out.skipped[fill(wire, layer, names)] = _TIED.format(name=name,
                                                                     canonical=canonical)
            return
        if not exists:
            where = "" if layer is None else f" in layer {layer}"
            for wire, _ in p.feeds:
                out.absent[fill(wire, layer, names)] = (
                    f"it would feed {name}, which {family.architecture} does not have{where} "
                    f"(condition '{p.when}' is false for this config)")
            return
        out.params.append((name, p))
        for wire, part in p.feeds:
            out.feeds[fill(wire, layer, names)] = (name, p, part)
        for alias in p.aliases:
            a = fill(alias, layer, names)
            if a is not None:
                out.aliases[a] = name

    if layers is not None:
        for layer in layers:
            for p in layered:
                add(p, layer)
        return out
    def add_rows(rows: Sequence[Param]) -> None:
        for key, run in _repeat_runs(rows, family.repeats):
            if key is None:
                for p in run:
                    add(p, None)
                continue
            for i in range(s.resolve((family.repeats[key],))[0]):
                for p in run:
                    add(p, i, {**names, key: i})

    add_rows(pre)
    for layer in range(s.layers):
        for p in layered:
            add(p, layer)
    add_rows(post)
    return out


def _repeat_runs(rows: Sequence[Param], repeats: Mapping[str, str]
                 ) -> list[tuple[str | None, list[Param]]]:
    """``rows`` cut into runs of consecutive rows using the same ``Family.repeats``
    placeholder (``None``: rows using none)."""
    out: list[tuple[str | None, list[Param]]] = []
    for p in rows:
        key = next((k for k in repeats if "{" + k + "}" in p.name), None)
        if out and key is not None and out[-1][0] == key:
            out[-1][1].append(p)
        else:
            out.append((key, [p]))
    return out
