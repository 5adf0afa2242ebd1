"""Which expert placement vLLM really uses: linear, or the round robin asked for.

``expert_placement_strategy="round_robin"`` is a request. vLLM 0.33.0
honours it only in some layouts and otherwise logs a warning and places
experts linearly; a plan made for round robin would then put every expert
on the wrong worker. This module restates vLLM's decision so that m2nkit
plans what vLLM will hold, and says why when it falls back.

vLLM 0.33.0 (``layers/fused_moe/expert_map_manager.py``,
``determine_expert_placement_strategy`` and
``ExpertMapManager._determine_placement_strategy``, called from
``layers/fused_moe/layer.py`` for every MoE layer) uses round robin only when
all of these hold:

* expert parallelism is in effect: ``enable_expert_parallel`` and
  ``ep = dp*tp > 1`` (``fused_moe/config.py`` ``FusedMoEParallelConfig.make``);
* the model's MoE layer passes ``num_expert_group > 1`` to
  ``FusedMoEFactory`` (grouped top-k routing; most MoE model files pass no
  group count at all), which each family module states as
  ``Family.num_expert_group``;
* no redundant experts and no EPLB (m2nkit plans neither);
* no all2all kernels, or ones that need round-robin routing tables: with
  ``dp > 1`` (``use_all2all_kernels``: ``dp*pcp > 1`` or sequence-parallel
  MoE, which itself needs ``dp > 1``) the ``all2all_backend`` must be
  ``deepep_low_latency`` or ``nixl_ep``
  (``needs_round_robin_routing_tables``).

Without EP there is no placement: every worker holds every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..families.table import Family
from .spec import InferenceSpec

__all__ = ["Placement", "expert_placement", "ROUND_ROBIN_ALL2ALL"]

#: all2all backends whose kernels carry round-robin routing tables (vLLM
#: ``FusedMoEParallelConfig.needs_round_robin_routing_tables``).
ROUND_ROBIN_ALL2ALL = ("deepep_low_latency", "nixl_ep")


@dataclass(frozen=True)
class Placement:
    """The expert placement in effect.

    Attributes:
        strategy: ``"linear"`` or ``"round_robin"`` (what the workers hold).
        note: why it differs from the spec's request, or ``None`` when the
            request is honoured (or no placement was asked for).
    """

    strategy: str
    note: str | None = None


def expert_placement(family: Family, config: Any, spec: InferenceSpec) -> Placement:
    """The placement vLLM 0.33.0 uses for ``family``/``config`` under ``spec``.

    Returns the spec's ``placement`` when vLLM honours it, else
    ``Placement("linear", note)`` with the rule that made vLLM fall back
    (see the module docstring for the rules and their source).
    """
    if spec.placement != "round_robin":
        return Placement(spec.placement)
    fallback = "round_robin placement falls back to linear, as vLLM 0.33.0 does"
    if not spec.ep or spec.num_workers == 1:
        return Placement("linear", f"{fallback}: no expert parallelism (ep with dp*tp > 1), "
                                   "so every worker holds every expert")
    groups = family.num_expert_group(config) if family.num_expert_group else None
    if groups is None or groups <= 1:
        have = "passes no num_expert_group" if groups is None else f"has num_expert_group={groups}"
        return Placement("linear", (
            f"{fallback}: {family.architecture} {have} (round robin needs grouped "
            "routing with more than one expert group; vllm expert_map_manager.py "
            "determine_expert_placement_strategy)"))
    if spec.dp > 1 and spec.all2all not in ROUND_ROBIN_ALL2ALL:
        return Placement("linear", (
            f"{fallback}: with dp={spec.dp} vLLM uses all2all kernels, and all2all="
            f"{spec.all2all} has no round-robin routing tables (needs "
            f"{' or '.join(ROUND_ROBIN_ALL2ALL)}; vllm expert_map_manager.py)"))
    return Placement("round_robin")
