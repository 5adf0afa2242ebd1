"""A multimodal wrapper as a family: a text family's table and a tower table under new prefixes.

A ``...ForConditionalGeneration`` checkpoint is a text model and a vision
tower side by side. vLLM builds the text model with the text family's own
classes under a prefix (``models/qwen3_vl.py``,
``Qwen3VLForConditionalGeneration``: ``language_model =
Qwen3LLMForCausalLM(config.text_config)``) and renames the checkpoint's
prefixes as it loads (its ``hf_to_vllm_mapper``: ``model.language_model.``
-> ``language_model.model.``, ``lm_head.`` -> ``language_model.lm_head.``,
``model.visual.`` -> ``visual.``). So the table of a wrapper is not written
again: :func:`wrapper_family` composes it from

* one :class:`Part`: the text family, the sub-config it reads
  (``text_config``) and the two prefix maps (wire side: transformers 5's
  on-disk names; vLLM side: the mapper's targets), and
* :class:`Tower` tables (a vision tower: its rows, the symbols of its sizes
  read off its sub-config, its repeated blocks),

into one plain :class:`~.table.Family`. Its ``sizes`` are the text family's
(``H``, ``nh``, ``layers``, ...) plus the towers' symbols
(``Sizes.extra``); its conditions, checks, skip rule, skipped (MTP) layers
and notes are the text family's applied to the sub-config, under the new
prefixes; its tower rows repeat by ``Family.repeats``. Every consumer of a
family (the expander, the checkpoint reader, config-only plans, the FSDP2
source and trainer specs, the vLLM destination) therefore takes a wrapper
as it takes any family, without a branch of its own.

A sub-config is read as a view (:class:`SubConfig`): the text family's
keys come from ``text_config``, except the ones the wrapper keeps at its
top level (``Part.inherit``: vLLM copies the wrapper's
``tie_word_embeddings`` into the text config, ``config/vllm.py``
``VllmConfig.with_hf_config``; transformers 5's ``Qwen3VLConfig`` holds it
there only).

What it does not do: rename by rule. The text family's ``HFNaming`` rules
(renames, refused and buffer patterns) apply to the wrapper's names as
they are, so they must not anchor at the text model's own prefix; a row
or TP-plan module outside the prefix maps is refused at import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from .sizes import Sizes
from .table import Family, HFNaming, Param, TinyModel, TPPlan

__all__ = ["SubConfig", "Part", "Tower", "wrapper_family", "sub_config_defaults"]


class SubConfig(Mapping):
    """A sub-config (``config.text_config``) seen with some keys of the wrapper config.

    ``view[key]``, ``view.get(key)`` and ``view.key`` read ``key`` from the
    wrapper config when it is one of ``inherit`` and set there, else from
    the sub-config (a transformers config object or a dict). So a family's
    ``sizes``, conditions and rules (``cfg_get``) read it like any config.
    """

    def __init__(self, config: Any, key: str, inherit: Sequence[str] = ()) -> None:
        self._top = config
        sub = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        self._sub = {} if sub is None else sub
        self._inherit = tuple(inherit)

    @staticmethod
    def _read(config: Any, key: str) -> Any:
        if isinstance(config, Mapping):
            return config.get(key)
        return getattr(config, key, None)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self._inherit:
            value = self._read(self._top, key)
            if value is not None:
                return value
        value = self._read(self._sub, key)
        return default if value is None else value

    def __getitem__(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        value = self.get(key)
        if value is None:
            raise AttributeError(f"config has no {key!r}")
        return value

    def _keys(self) -> list[str]:
        sub = self._sub
        keys = list(sub) if isinstance(sub, Mapping) else list(
            sub.to_dict() if hasattr(sub, "to_dict") else vars(sub))
        return keys + [k for k in self._inherit if k not in keys]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def sub_config_defaults(key: str, defaults: Mapping[str, Any]) -> Callable[[Mapping], Any]:
    """``HFNaming.config_defaults`` rule reading sub-config ``key`` with its class's defaults.

    The wrapper's ``config.json`` holds ``text_config``/``vision_config`` as
    objects, each read by its own transformers config class; this rule
    applies that class's ``defaults`` (the same rules as a top-level family's:
    values first, then callables) to the sub-object, and returns it in the
    container type of the config being read (``config_wires.ConfigJson``).
    """
    def rule(c: Mapping[str, Any]) -> Any:
        out = type(c)(c.get(key) or {})
        for k, default in defaults.items():
            if not callable(default) and k not in out:
                out[k] = default
        for k, default in defaults.items():
            if callable(default):
                out[k] = default(out)
        return out
    return rule


def _renamer(prefixes: Mapping[str, str]) -> Callable[[str | None], str | None]:
    """Name -> the name with its longest matching prefix replaced (``None`` stays ``None``).

    Raises:
        ValueError: a name no prefix matches (a table row the wrapper does not place).
    """
    order = sorted(prefixes, key=len, reverse=True)

    def rename(name: str | None) -> str | None:
        if name is None:
            return None
        dotted = name + "."          # a module name (``lm_head``) matches ``lm_head.``
        for old in order:
            if dotted.startswith(old):
                return (prefixes[old] + dotted[len(old):])[:-1]
        raise ValueError(f"wrapper: table name {name!r} starts with none of the prefixes "
                         f"{sorted(prefixes)}")
    return rename


def _renamed(p: Param, vllm: Callable, hf: Callable) -> Param:
    return replace(p, name=vllm(p.name), feeds=tuple((hf(w), part) for w, part in p.feeds),
                   tied_to=vllm(p.tied_to), aliases=tuple(vllm(a) for a in p.aliases))


@dataclass(frozen=True)
class Part:
    """The text family of a wrapper, under new prefixes.

    Attributes:
        family: the text family (``qwen3.FAMILY``).
        config_key: the sub-config it reads (``"text_config"``).
        hf: prefix of the family's wire (and in-memory) names -> the
            wrapper's (``{"model.": "model.language_model.", "lm_head.":
            "lm_head."}``); every wire name and TP-plan module must match one.
        vllm: prefix of the family's vLLM names -> the wrapper's
            (``{"model.": "language_model.model.", "lm_head.":
            "language_model.lm_head."}``: vLLM's ``hf_to_vllm_mapper`` targets).
        inherit: keys the family reads that the wrapper config holds at its
            top level (``tie_word_embeddings``).
        config_defaults: the defaults of the sub-config's transformers class
            (``Qwen3VLTextConfig``) where they are not the family's own
            class's (``HFNaming.config_defaults``); ``None``: the family's.
    """

    family: Family
    config_key: str
    hf: Mapping[str, str]
    vllm: Mapping[str, str]
    inherit: tuple[str, ...] = ()
    config_defaults: Mapping[str, Any] | None = None

    def sub(self, config: Any) -> SubConfig:
        """``config``'s view for the text family."""
        return SubConfig(config, self.config_key, self.inherit)


@dataclass(frozen=True)
class Tower:
    """A tower (vision encoder and its projector) of a wrapper: its own small table.

    Attributes:
        name: what it is, for messages (``"Qwen3-VL vision tower"``).
        params: its vLLM rows in ``named_parameters()`` order, names relative
            to the tower (``blocks.{B}.attn.qkv.weight``); feeds default to
            the same relative name. Dims use the tower's own symbols.
        symbols: sub-config -> ``{symbol: value}`` of its sizes (``vH``: 1152).
        keys: symbol -> the sub-config key it comes from (for messages).
        config_key: the sub-config it reads (``"vision_config"``).
        hf_prefix, vllm_prefix: where its rows sit on the wire
            (``model.visual.``) and in vLLM (``visual.``).
        repeats: placeholder -> the symbol counting its rows
            (``{"B": "vdepth"}``; :attr:`Family.repeats`).
        conditions, checks: as a family's (conditions take the sub-config).
        config_defaults: its transformers config class's defaults, for
            config-only plans (:func:`sub_config_defaults`).
        child_order: module (relative; ``""``: the tower itself, ``{L}``: an
            index) -> its children in transformers' registration order where
            it differs from the table's.
        source: the vLLM classes the table restates.
    """

    name: str
    params: tuple[Param, ...]
    symbols: Callable[[Any], Mapping[str, int]]
    keys: Mapping[str, str]
    config_key: str
    hf_prefix: str
    vllm_prefix: str
    repeats: Mapping[str, str] = field(default_factory=dict)
    conditions: Mapping[str, Callable[[Any, int | None], bool]] = field(default_factory=dict)
    checks: tuple[Callable[[Sizes, Any], str | None], ...] = ()
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    child_order: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    source: str = ""

    def sub(self, config: Any) -> SubConfig:
        """``config``'s view for the tower."""
        return SubConfig(config, self.config_key)


def _on(view: Callable[[Any], Any], f: Callable) -> Callable:
    """``f`` with its first argument (a config) replaced by its view."""
    return lambda config, *args: f(view(config), *args)


def wrapper_family(architecture: str, text: Part, towers: Sequence[Tower], *,
                   model_types: tuple[str, ...] = (),
                   config_defaults: Mapping[str, Any] | None = None,
                   stacked_order: tuple[int, ...] = (),
                   child_order: Mapping[str, tuple[str, ...]] | None = None,
                   tiny: Mapping[str, TinyModel] | None = None,
                   vllm_source: str = "", module: str = "") -> Family:
    """The :class:`~.table.Family` of a multimodal wrapper: ``towers`` then ``text``, renamed.

    Rows are in vLLM's ``named_parameters()`` order when the towers come
    first (vLLM's wrappers build the tower before the language model). The
    text family's ``HFNaming`` applies unchanged to the wrapper's names
    (its renames, expert fusing, permuted and refused tensors, buffers are
    suffix rules); its ``child_order`` and TP plan are moved under the new
    prefixes.

    Args:
        architecture: the wrapper's ``architectures[0]``.
        text, towers: the parts.
        model_types: the wrapper's ``model_type`` values (config-only plans).
        config_defaults: the wrapper config class's own defaults (its top
            level); the parts' sub-configs get theirs (:func:`sub_config_defaults`).
        stacked_order: ``HFNaming.stacked_order`` of the wrapper's checkpoints.
        child_order: more ``HFNaming.child_order`` entries (wrapper names).
        tiny, vllm_source, module: as ``Family``'s.

    Raises:
        ValueError: a row (or TP-plan module) no prefix of ``text`` places; a
            condition name or a repeat placeholder used by two parts.
    """
    fam = text.family
    view = text.sub
    vmap, hmap = _renamer(text.vllm), _renamer(text.hf)

    params: list[Param] = []
    conditions = {name: _on(view, f) for name, f in fam.conditions.items()}
    repeats = dict(fam.repeats)
    checks = list(fam.checks)
    defaults = dict(config_defaults or {})
    defaults[text.config_key] = sub_config_defaults(
        text.config_key, fam.hf.config_defaults if text.config_defaults is None
        else text.config_defaults)
    order = {hmap(m): c for m, c in fam.hf.child_order.items()}
    order.update(child_order or {})
    for tower in towers:
        tv = _renamer({"": tower.vllm_prefix})
        th = _renamer({"": tower.hf_prefix})
        params += [_renamed(p, tv, th) for p in tower.params]
        for name, f in tower.conditions.items():
            if name in conditions:
                raise ValueError(f"{architecture}: condition {name!r} of {tower.name} is also "
                                 f"one of {fam.architecture}")
            conditions[name] = _on(tower.sub, f)
        for key, sym in tower.repeats.items():
            if key in repeats or key == "L":
                raise ValueError(f"{architecture}: placeholder {{{key}}} of {tower.name} is "
                                 "used twice")
            repeats[key] = sym
        checks += tower.checks
        defaults[tower.config_key] = sub_config_defaults(tower.config_key, tower.config_defaults)
        root = tower.hf_prefix.rstrip(".")
        order.update({th(m) if m else root: c for m, c in tower.child_order.items()})
    params += [_renamed(p, vmap, hmap) for p in fam.params]

    def sizes(config: Any) -> Sizes:
        s = fam.sizes(view(config))
        extra, keys = dict(s.extra), dict(s.keys)
        for tower in towers:
            extra.update(tower.symbols(tower.sub(config)))
            keys.update({sym: f"{tower.config_key}.{k}" for sym, k in tower.keys.items()})
        keys.update({sym: f"{text.config_key}.{k}" for sym, k in s.keys.items()
                     if sym not in extra})
        return replace(s, extra=extra, keys=keys)

    h = fam.hf
    hf = HFNaming(
        renames=h.renames, fused_experts=h.fused_experts, experts_on_disk=h.experts_on_disk,
        permuted=h.permuted, refused=h.refused, model_types=model_types,
        config_defaults=defaults, child_order=order,
        table_differs=_on(view, h.table_differs) if h.table_differs else None,
        buffers=h.buffers, stacked_order=stacked_order or h.stacked_order)
    unmap = _renamer({new: old for old, new in text.hf.items()})

    def skip(config: Any, name: str) -> str | None:
        try:
            own = unmap(name)
        except ValueError:
            return None
        return fam.skip(view(config), own)

    tp = fam.tp_plan
    tp_plan = None if tp is None else TPPlan(
        {hmap(m): st for m, st in tp.modules.items()},
        untied={hmap(m): st for m, st in tp.untied.items()},
        embeddings=tuple(hmap(m) for m in tp.embeddings),
        grad_allreduce=tuple(hmap(m) for m in tp.grad_allreduce), divides=tp.divides)
    skipped = fam.skipped_layers
    if skipped is not None:    # the text model's skipped (MTP) layers, under the new prefix
        skipped = replace(skipped, layers=_on(view, skipped.layers), at=hmap(skipped.at))
    return Family(
        architecture, hf, tuple(params), sizes, conditions, tuple(checks), tiny=tiny or {},
        vllm_source=vllm_source, module=module,
        skip=skip if fam.skip is not None else None,
        num_expert_group=_on(view, fam.num_expert_group) if fam.num_expert_group else None,
        notes=_on(view, fam.notes) if fam.notes else None,
        tp_plan=tp_plan, skipped_layers=skipped, repeats=repeats)
