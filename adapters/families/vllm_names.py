"""vLLM parameter names that differ between vLLM versions: one table.

Family tables (``m2nkit.adapters.families``) write version-dependent parts
of a vLLM name as placeholders (``{experts}``, ``{router_alias}``); the
table expander (:mod:`.expand`) fills them from the entry of the vLLM
version it is asked for: ``destination_layout`` and ``reference_load`` pass
the version they plan for, the trainer side (``fsdp2_source``'s known wire
names, the config-only wire list) takes the default, since wire names never
depend on it. The table lives with the family tables it completes, so both
sides read it without the trainer side importing ``m2nkit.adapters.vllm``
(which re-exports it as ``m2nkit.adapters.vllm.names``).

vLLM 0.33.0 (checked with its real loaders: the dumps in ``tests/data/oracle``):

* ``FusedMoEFactory`` keeps the expert weights in a ``RoutedExperts``
  submodule named ``routed_experts`` (``fused_moe/layer.py``,
  ``fused_moe/routed_experts.py``), so experts live at
  ``<moe block>.experts.routed_experts.w13_weight`` / ``w2_weight``.
* A MoE block that hands its router ``GateLinear`` to
  ``FusedMoEFactory(gate=...)`` has it registered again, so the router shows
  up twice: ``<moe block>.gate.weight`` and the alias
  ``<moe block>.experts.gate.weight`` (same storage). Which families do so
  is in their modules (``m2nkit.adapters.families``): they list
  ``{router_alias}`` among the router's aliases.

Adding a vLLM version is adding an entry here (and a fixture set under
``tests/data/oracle`` made with that version).
"""

from __future__ import annotations

__all__ = ["VLLM_NAMES", "DEFAULT_VLLM_VERSION", "vllm_names"]

#: vLLM version -> placeholder -> text.
#:   experts: the submodule path holding ``w13_weight``/``w2_weight`` under a
#:       MoE block (``{experts}`` in family tables).
#:   router_alias: where the MoE layer re-registers the router's weight
#:       when a family passes it in (``None``: no alias).
VLLM_NAMES: dict[str, dict[str, str | None]] = {
    "0.33.0": {
        "experts": "experts.routed_experts",
        "router_alias": "experts.gate.weight",
    },
    # Not a vLLM version: SGLang 0.5.23's names for the same placeholders (checked
    # with its real loaders, tests/integration/test_sglang_layout.py). Its
    # ``FusedMoE`` holds ``w13_weight``/``w2_weight`` itself
    # (``sglang/srt/layers/moe/fused_moe_triton/layer.py`` ``FusedMoE.__init__``)
    # and never re-registers the router. Used by ``m2nkit.adapters.sglang``.
    "sglang-0.5.23": {
        "experts": "experts",
        "router_alias": None,
    },
}

DEFAULT_VLLM_VERSION = "0.33.0"


def vllm_names(version: str) -> dict[str, str | None]:
    """The name entry of ``version``.

    Raises:
        ValueError: a version without an entry (lists the known ones).
    """
    try:
        return VLLM_NAMES[version]
    except KeyError:
        raise ValueError(
            f"vLLM version {version!r} has no name table; known versions are "
            f"{sorted(VLLM_NAMES)} (see m2nkit/adapters/families/vllm_names.py)"
        ) from None
