"""``sglang_destination_layout``: what every SGLang 0.5.23 worker holds.

m2nkit's vLLM family tables (``m2nkit.adapters.vllm.destination_layout``)
with the rules of ``m2nkit.adapters.sglang.rules``: SGLang's names (experts,
DeepSeek-V3's fused ``q_a``/``kv_a``, aliases), its ``auto`` dtype, and one TP
group per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from m2nkit.manifest import ParamMeta
from m2nkit.manifest.destination import Binding, DestinationLayout, DestinationParam

from .rules import NAMES, check_architecture, keeps_alias, rename, replica_spec, sglang_dtype
from .spec import SGLangSpec, parse_sglang_spec

__all__ = ["sglang_destination_layout", "SGLangDestination", "sglang_destination"]


def sglang_destination_layout(config: Any, wire: Sequence[ParamMeta],
                              spec: SGLangSpec | str) -> DestinationLayout:
    """What every SGLang worker holds and where each wire tensor lands.

    Args:
        config: the HF config (object or ``config.json`` dict).
        wire: the wire tensors (``ParamMeta``; HF names, experts stacked per
            layer as for ``m2nkit.adapters.vllm.destination_layout``).
        spec: ``SGLangSpec`` or ``"sglang:tp=T[,dp=D][,ep][,dtype=X]"``.

    Returns:
        ``DestinationLayout`` with ``spec`` the canonical SGLang text,
        ``num_workers = dp * tp`` (dp-major), SGLang's parameter names, local
        shapes (model dtype by ``rules.sglang_dtype``) and bindings; every
        replica holds what replica 0 holds.

    Raises:
        ValueError: a bad spec; an architecture not in
            ``rules.SGLANG_ARCHITECTURES``; whatever the vLLM tables refuse
            (a tp the model cannot be split by, a wire shape that disagrees
            with the config, ...), with their message.
    """
    from m2nkit.adapters.families import architecture_name
    from m2nkit.adapters.vllm.destination import destination_layout

    spec = parse_sglang_spec(spec)
    arch = architecture_name(config)
    check_architecture(arch, config)
    dtype, dtype_note = sglang_dtype(config, spec.dtype)
    replica = replica_spec(spec.tp, spec.ep, dtype)
    try:
        one = destination_layout(config, wire, replica, vllm_version=NAMES)
    except ValueError as e:   # the tables name the spec they were asked for: name SGLang's
        raise ValueError(_sglang_words(str(e), str(replica), spec)) from None
    tp = spec.tp
    params = tuple(DestinationParam(k * tp + p.worker, rename(arch, p.name), p.dtype, p.shape,
                                    p.zero_boxes)
                   for k in range(spec.dp) for p in one.params)
    bindings = {n: tuple(Binding(b.name, k * tp + b.worker, b.box, rename(arch, b.param), b.offset)
                         for k in range(spec.dp) for b in bs)
                for n, bs in one.bindings.items()}
    aliases = {rename(arch, a): rename(arch, t) for a, t in one.aliases.items()
               if keeps_alias(a, t)}
    notes = ((dtype_note,) if dtype_note else ()) + tuple(one.notes)
    return DestinationLayout(spec=str(spec), num_workers=spec.num_workers, params=params,
                             bindings=bindings, skipped=dict(one.skipped),
                             aliases=aliases, unknown=dict(one.unknown), notes=notes)


def _sglang_words(message: str, replica: str, spec: SGLangSpec) -> str:
    """A vLLM-table refusal of ``replica`` (vLLM's ``tp=T,dp=1`` spec) in SGLang's terms.

    The tables speak of vLLM, whose MoE layers split over ``dp * tp`` and whose valid tp
    depend on ``dp``; one SGLang replica is its own TP group (rule ``replica``), so the
    MoE split is ``tp`` and the valid tp hold for any ``dp``. Without this a user's
    ``sglang:tp=3,dp=2`` read "valid tp with dp=1" and "dp*tp=3".
    """
    ep = ", ep" if spec.ep else ""
    return (message.replace(replica, str(spec))
            .replace(f"valid tp with dp=1{ep}:", f"valid tp{' with ep' if spec.ep else ''} "
                     "(for any dp: each SGLang replica is its own TP group):")
            .replace(f"no tp works with dp=1{ep}; change dp or ep",
                     f"no tp works{' with ep' if spec.ep else ''} (for any dp); change ep")
            .replace("the MoE tensor-parallel size dp*tp=", "the MoE tensor-parallel size tp="))


@dataclass(frozen=True)
class SGLangDestination:
    """SGLang's destination layout rules for one model config and spec: a ``DestinationBuilder``.

    What ``M2NTrainerInitInfo.destination`` and the SGLang plugin's receiver
    take (``m2nkit.engine.session.DestinationBuilder``): calling it with the
    wire tensors returns ``sglang_destination_layout(config, metas, spec)``.
    Both sides build alike and the plan agreement refuses plans that differ.
    Picklable (it crosses into worker processes).

    Attributes:
        config: the HF config (object or ``config.json`` dict) the workers serve.
        spec: the canonical spec text (``"sglang:tp=2,dp=1,ep"``).
        num_workers: ``dp * tp``.
    """

    config: Any
    spec: str
    num_workers: int
    layout: str = "tables"

    def __call__(self, metas: Sequence[ParamMeta]) -> DestinationLayout:
        return sglang_destination_layout(self.config, metas, self.spec)


def sglang_destination(config: Any, spec: SGLangSpec | str) -> SGLangDestination:
    """The ``DestinationBuilder`` of SGLang workers serving ``config`` with ``spec``.

    ``spec`` is ``"sglang:tp=T[,dp=D][,ep][,dtype=X]"`` or an ``SGLangSpec``;
    the builder carries its canonical text. The architecture is checked
    here (``rules.check_architecture``), so an unsupported one is refused
    before any rendezvous.

    Raises:
        ValueError: a spec that does not parse; an architecture not in
            ``rules.SGLANG_ARCHITECTURES`` (or a quantized config).
    """
    from m2nkit.adapters.families import architecture_name

    parsed = parse_sglang_spec(spec)
    check_architecture(architecture_name(config), config)
    return SGLangDestination(config, str(parsed), parsed.num_workers)
