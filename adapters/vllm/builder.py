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

__all__ = ["VLLMDestination", "vllm_destination"]


@dataclass(frozen=True)
class VLLMDestination:
    """vLLM's destination layout rules for one model config and parallel spec.

    Attributes:
        config: the HF config (transformers ``PretrainedConfig`` or the
            ``config.json`` dict) the workers serve.
        spec: the canonical spec text (``"vllm:tp=2,dp=1"``).
        num_workers: ``dp * tp``.

    Calling it with the wire tensors returns
    ``destination_layout(config, metas, spec)``. Picklable (it crosses into
    worker processes).
    """

    config: Any
    spec: str
    num_workers: int

    def __call__(self, metas: Sequence[Any]):
        from m2nkit.adapters.vllm.destination import destination_layout

        return destination_layout(self.config, metas, self.spec)


def vllm_destination(config: Any, spec: Any) -> VLLMDestination:
    """The ``DestinationBuilder`` of vLLM workers serving ``config`` with ``spec``.

    ``spec`` is ``"vllm:tp=T[,dp=D][,ep]"`` or an ``InferenceSpec``; the
    builder carries its canonical text.

    Raises:
        ValueError: a spec that does not parse (its message names the part
            and the valid syntax).
    """
    from m2nkit.adapters.vllm.spec import parse_inference_spec

    parsed = parse_inference_spec(spec)
    return VLLMDestination(config, str(parsed), parsed.num_workers)
