"""A deliberately simple reference of vLLM 0.33.0's weight loading, for tests.

``reference_load`` builds one worker's parameters the way vLLM's modules
allocate them and pushes every checkpoint tensor through the loader of its
parameter's shard kind (``Kind.load`` in ``m2nkit.adapters.families.kinds``),
written the way vLLM's ``weight_loader`` methods are: narrow the checkpoint
tensor to this rank's shard, narrow the parameter to the shard's slot, copy.
It shares the family table (which parameters exist, which checkpoint tensor
feeds which) with ``destination_layout``, but none of the box arithmetic:
the planner's bindings and these loads are two statements of each rule, and
the tests hold them against each other (``tests/adapters/test_families.py``,
``tests/adapters/test_vllm_layout.py``) and against real vLLM dumps
(``tests/adapters/test_vllm_oracle.py``, ``tests/data/oracle``).

It is slow by design (full tensors, one worker per call, Python loops over
experts). Per-expert checkpoint tensors are stacked first, the way the wire
carries them, and loaded as vLLM's ``RoutedExperts.load_weights`` loads a
stacked ``gate_up_proj`` (``layers/fused_moe/routed_experts.py``). Rotary
caches and tied ``lm_head.weight`` are skipped like vLLM's
``AutoWeightsLoader`` (``models/utils.py``) skips them.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..experts import expert_name, group_expert_tensors
from ..families import family_for
from ..families.expand import expand
from ..families.kinds import Geometry
from ..families.quant import stack_expert_scales
from ..families.table import Family
from .destination import check_parallel, is_rotary_cache
from .dtype import model_dtype
from .names import DEFAULT_VLLM_VERSION, vllm_names
from .expert_placement import expert_placement
from .spec import InferenceSpec, parse_inference_spec

__all__ = ["reference_load"]


def _stack_experts(family: Family, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On-disk names -> wire tensors: per-expert tensors stacked per MoE block.

    ``<prefix>.experts.gate_up_proj.weight[e] = cat(gate_e, up_e)``,
    ``<prefix>.experts.down_proj.weight[e] = down_e`` (the family's
    ``HFNaming`` names the parts on disk). Experts stored stacked already
    (``<prefix>.experts.gate_up_proj``, ``HFNaming.stacked_on_disk``) are
    renamed to their wire name, as vLLM's ``RoutedExperts.load_weights``
    takes them whole (permuted to the wire's order where the family stores
    them in another, ``HFNaming.stacked_order``). Tensors stored in another
    dim order than the wire's (``HFNaming.permuted``) are permuted into it, as the vLLM loader of
    such a family does (a ``permute`` of the order the family gives).

    Raises:
        ValueError: a MoE block lacking an expert or a part.
    """
    hf = family.hf
    if hf.permuted:
        wire_form = {}
        for n, t in tensors.items():
            leaf = hf.permuted_leaf(n)
            if leaf is None:
                wire_form[n] = t
            else:
                wire_leaf, order = hf.permuted[leaf]
                wire_form[n[: -len(leaf)] + wire_leaf] = t.permute(order)
        tensors = wire_form
    if not hf.experts_on_disk:
        return dict(tensors)
    grouped = group_expert_tensors(tensors, hf.experts_on_disk)
    used = {n for per in grouped.values() for ex in per.values() for n in ex.values()}
    out = {}
    for n, t in tensors.items():
        if n in used:
            continue
        stacked = hf.stacked_wire_name(n)
        if stacked is not None and stacked != n and hf.stacked_order:  # stored permuted
            t = t.permute(hf.stacked_order)
        out[stacked or n] = t
    for prefix, per in grouped.items():
        count = max(per) + 1
        for wire_leaf, parts in hf.fused_experts.values():
            if f"{prefix}.{wire_leaf}" in out:
                continue                                    # this part came stacked
            rows = []
            for e in range(count):
                names = [expert_name(hf.experts_on_disk[p], prefix, e) for p in parts]
                lacking = [n for n in names if n not in tensors]
                if lacking:
                    raise ValueError(f"reference_load: checkpoint lacks '{lacking[0]}' "
                                     f"({count} experts under '{prefix}')")
                rows.append(torch.cat([tensors[n] for n in names]))
            out[f"{prefix}.{wire_leaf}"] = torch.stack(rows)
    return out


def reference_load(
    config: Any,
    checkpoint_tensors: Mapping[str, torch.Tensor],
    spec: InferenceSpec | str,
    worker: int,
    *,
    fill: float = 0.0,
    vllm_version: str = DEFAULT_VLLM_VERSION,
) -> dict[str, torch.Tensor]:
    """One worker's vLLM parameters after loading a full checkpoint.

    Args:
        config: HF config object or ``config.json`` dict.
        checkpoint_tensors: FULL tensors under on-disk checkpoint names
            (MoE experts per expert, as the family's ``HFNaming`` names them
            on disk, or already stacked as wire tensors).
        spec: ``InferenceSpec`` or ``"vllm:tp=T[,dp=D][,ep][,placement=P][,dtype=X]"``.
        worker: ``dp_index * tp + tp_rank``.
        fill: initial value of every parameter (``nan`` shows what no loader
            wrote, like the oracle's ``--fill nan``).
        vllm_version: which entry of ``names.VLLM_NAMES`` names the params.

    Returns:
        ``{vLLM name: local tensor}`` in vLLM's model dtype (the spec's
        ``dtype``, or vLLM's ``auto`` rule from the config and the
        checkpoint tensors' dtypes: ``m2nkit.adapters.vllm.dtype``), experts
        where vLLM's placement puts them (``m2nkit.adapters.vllm.expert_placement``),
        including aliases
        (tied ``lm_head.weight``, MoE router aliases) as the same tensor
        object, like ``named_parameters(remove_duplicate=False)``.

    Raises:
        ValueError: an unsupported architecture (the one message of
            ``m2nkit.adapters.families``), a spec the model cannot be split
            by, a worker out of range, an incomplete expert set, or a
            checkpoint tensor no parameter takes.
    """
    spec = parse_inference_spec(spec)
    family = family_for(config)
    if not 0 <= worker < spec.num_workers:
        raise ValueError(f"reference_load: worker {worker} is not in 0..{spec.num_workers - 1}")
    s = family.sizes(config)
    ex = expand(family, config, s, vllm_names(vllm_version))
    check_parallel(family, s, ex, spec)
    placement = expert_placement(family, config, spec).strategy
    g = Geometry.of(s, spec.tp, spec.dp, spec.ep, worker, placement, spec.all2all)
    dtype = model_dtype(config, spec.dtype, (t.dtype for t in checkpoint_tensors.values())).dtype
    params = {
        name: torch.full(p.kind.local_shape(s.resolve(p.dims), len(p.feeds), g), fill,
                         dtype=p.dtype or dtype)
        for name, p in ex.params
    }
    with torch.no_grad():
        tensors = {n: t for n, t in checkpoint_tensors.items()  # the family's skips (MTP)
                   if family.skip is None or not family.skip(config, n)}
        tensors = stack_expert_scales(family.hf, tensors)  # fp8 block scales
        for name, tensor in _stack_experts(family, tensors).items():
            if (is_rotary_cache(name) or name in ex.skipped
                    or (family.skip is not None and family.skip(config, name))):
                continue                                    # AutoWeightsLoader skips
            hit = ex.feeds.get(name)
            if hit is None:
                raise ValueError(f"reference_load: no {family.architecture} parameter takes "
                                 f"'{name}'")
            pname, p, part = hit
            p.kind.load(params[pname], tensor, part, g)
    out = dict(params)
    for alias, canonical in ex.aliases.items():
        out[alias] = out[canonical]
    return out
