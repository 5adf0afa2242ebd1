"""The wire dtype of each FSDP2 parameter: the dtype policy of :func:`~.source.fsdp2_source`.

A trainer's parameters may be fp32 masters under a bf16 forward, a router
kept fp32 by the model class, a buffer FSDP2 never casts; what travels is
decided once per tensor by :func:`wire_dtype_rule`, from what the model
says (``_keep_in_fp32_modules_strict``) and what FSDP2 says
(``MixedPrecisionPolicy.param_dtype``). The cast itself happens on the
local shard, in the provider.
"""

from __future__ import annotations

import re

import torch

__all__ = ["fp32_patterns", "policy_dtypes", "wire_dtype_rule"]


def fp32_patterns(model: torch.nn.Module) -> list[re.Pattern]:
    pats: set[str] = set()
    for m in model.modules():
        pats.update(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
    return [re.compile(r"(^|\.)" + re.escape(x).replace(r"\*", r"[^.]*") + r"($|\.)")
            for x in sorted(pats)]


def policy_dtypes(model: torch.nn.Module) -> dict[int, torch.dtype]:
    """``id(sharded parameter) -> MixedPrecisionPolicy.param_dtype`` of its FSDP2 group.

    Read from FSDP2's state (torch ``fsdp/_fully_shard/_fsdp_state.py``
    ``FSDPState._fsdp_param_groups``, ``_fsdp_param.py`` ``FSDPParam.mp_policy``);
    a parameter without a policy dtype is absent.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {}
    out: dict[int, torch.dtype] = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fp in group.fsdp_params:
                dt = getattr(fp.mp_policy, "param_dtype", None)
                if dt is not None:
                    out[id(fp.sharded_param)] = dt
    return out


def wire_dtype_rule(name: str, param_dtype: torch.dtype, *, policy_dtype: torch.dtype | None,
                    dtype: torch.dtype | None, keep_fp32: bool, buffer: bool = False
                    ) -> torch.dtype:
    """The wire dtype of one parameter or buffer (the rule :func:`fsdp2_source` documents).

    1. ``keep_fp32`` (the model class's ``_keep_in_fp32_modules_strict``
       names it: transformers loads it in fp32 whatever the model dtype,
       because the checkpoint format keeps it fp32, e.g. MoE routers and
       ``e_score_correction_bias``; transformers ``modeling_utils.py``,
       ``_get_dtype_plan``): ``float32``;
    2. a non-floating parameter, or a ``buffer``: its own dtype (FSDP2's
       ``MixedPrecisionPolicy`` casts parameters only, so the forward uses
       a buffer as it is; the families mark such tensors, ``HFNaming.buffers``);
    3. ``dtype`` when the caller gives one;
    4. the ``MixedPrecisionPolicy.param_dtype`` of its FSDP2 group: what the
       trainer computes with (fp32 masters, bf16 forward: bf16 on the wire);
    5. else the parameter's dtype.
    """
    if keep_fp32:
        return torch.float32
    if buffer or not param_dtype.is_floating_point:
        return param_dtype
    return dtype or policy_dtype or param_dtype

