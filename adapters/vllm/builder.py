"""The vLLM destination as the m2nkit runtime takes it: a ``DestinationBuilder``.

The runtime (trainer engine, receiver, session) knows no model family and no
inference engine; its caller hands it the destination layout rules. This
module packs vLLM's — a model config and a parallel spec — into the small
object the runtime calls (``m2nkit.engine.session.DestinationBuilder``:
``spec``, ``num_workers``, ``(metas) -> DestinationLayout``). It is
structural, so nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["VLLMDestination", "vllm_destination", "LAYOUTS", "resolve_layout", "vllm_importable"]

#: Where a destination layout comes from: m2nkit's family tables (no vLLM
#: needed), or vLLM's own weight loaders, traced (``adapters/vllm/trace.py``;
#: needs vLLM). ``auto``: the table where the architecture has one (the same
#: layout, checked against the trace by the integration tests, in a fraction
#: of the time), else traced when vLLM is importable.
LAYOUTS = ("tables", "traced", "auto")


def resolve_layout(layout: str, architecture: str | None = None) -> str:
    """``"tables"`` or ``"traced"`` for a ``LAYOUTS`` choice.

    ``auto``: ``"tables"`` for an ``architecture`` with a family table (or
    none given, when vLLM is not importable), else ``"traced"`` when vLLM is
    importable; without vLLM an architecture without a table resolves to
    ``"tables"``, whose refusal says what would work.

    Raises:
        ValueError: ``layout`` is not one of ``LAYOUTS``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {list(LAYOUTS)}")
    if layout != "auto":
        return layout
    from ..families import has_table

    if architecture is not None and has_table(architecture):
        return "tables"
    return "traced" if vllm_importable() else "tables"


def vllm_importable() -> bool:
    """Whether vLLM can be imported here (found on the path; not imported): what decides
    whether a layout may be traced from vLLM's own loaders (``trace.trace_destination``)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class VLLMDestination:
    """vLLM's destination layout rules for one model config and parallel spec.

    Attributes:
        config: the HF config (transformers ``PretrainedConfig`` or the
            ``config.json`` dict) the workers serve.
        spec: the canonical spec text (``"vllm:tp=2,dp=1"``).
        num_workers: ``dp * tp``.
        layout: ``"tables"`` (m2nkit's family tables) or ``"traced"``
            (vLLM's own loaders, ``trace_destination``; needs vLLM).

    Calling it with the wire tensors returns
    ``destination_layout(config, metas, spec)`` (tables) or
    ``trace_destination(config, metas, spec)`` (traced). Both sides of a
    session must build alike: the plan agreement refuses plans that differ.
    Picklable (it crosses into worker processes).
    """

    config: Any
    spec: str
    num_workers: int
    layout: str = "tables"

    def __call__(self, metas: Sequence[Any]):
        if self.layout == "traced":
            from m2nkit.adapters.vllm.trace import trace_destination

            return trace_destination(self.config, metas, self.spec)
        from m2nkit.adapters.vllm.destination import destination_layout

        return destination_layout(self.config, metas, self.spec)

    def fp8_wire_targets(self, layout: Any) -> list | None:
        """``wire=fp8`` (mode 2): the parameters the trainers quantize, else ``None``.

        ``layout`` is the ``DestinationLayout`` this builder gave; the
        answer is ``adapters.vllm.fp8.online_fp8_params`` of it (the fields
        of ``engine.quant_fp8.Fp8Target``).

        Raises:
            ValueError: as ``online_fp8_params`` (a config with a
                ``quantization_config``, an architecture without a rule).
        """
        from m2nkit.adapters.vllm.fp8 import online_fp8_params
        from m2nkit.adapters.vllm.spec import parse_inference_spec

        if parse_inference_spec(self.spec).wire != "fp8":
            return None
        return online_fp8_params(self.config, layout)


def vllm_destination(config: Any, spec: Any, layout: str = "auto") -> VLLMDestination:
    """The ``DestinationBuilder`` of vLLM workers serving ``config`` with ``spec``.

    ``spec`` is ``"vllm:tp=T[,dp=D][,ep]"`` or an ``InferenceSpec``; the
    builder carries its canonical text. ``layout`` is one of ``LAYOUTS``
    (``auto``, the default, is resolved here: the family table where the
    architecture has one, else traced when vLLM is importable).

    Raises:
        ValueError: a spec that does not parse (its message names the part
            and the valid syntax), or an unknown ``layout``.
    """
    from m2nkit.adapters.vllm.spec import parse_inference_spec

    from ..families import architecture_name

    parsed = parse_inference_spec(spec)
    return VLLMDestination(config, str(parsed), parsed.num_workers,
                           resolve_layout(layout, architecture_name(config)))
