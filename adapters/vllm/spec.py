"""The vLLM parallel spec: ``vllm:tp=T[,dp=D][,ep]``.

One string names the inference side's layout on the command line and in a
``DestinationLayout``. Workers are numbered dp-major, ``worker = dp_index * tp
+ tp_rank``, which is vLLM 0.33.0's order in the m2n communicator
(``weight_transfer/m2n_common.py``: worker rank ``T + dp_index * (TP*PP) +
tp_rank``; m2nkit plans with ``PP = 1``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["InferenceSpec", "parse_inference_spec", "SPEC_SYNTAX"]

#: What a valid spec looks like (quoted in every parse error).
SPEC_SYNTAX = "vllm:tp=T[,dp=D][,ep] (T, D positive ints; e.g. 'vllm:tp=4', 'vllm:tp=2,dp=4,ep')"

_INT = re.compile(r"^[0-9]+$")
#: Largest inference world m2nkit plans for (a guard against typos like dp=100000).
MAX_WORKERS = 1 << 14


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"vLLM spec: {name}={value!r} must be a positive int")
    if value <= 0:
        raise ValueError(f"vLLM spec: {name}={value} must be a positive int (>= 1)")
    return value


@dataclass(frozen=True)
class InferenceSpec:
    """vLLM parallel sizes: ``tp`` (tensor), ``dp`` (data replicas), ``ep``.

    ``ep`` is vLLM's ``enable_expert_parallel``: MoE experts are split whole
    over all ``dp * tp`` workers instead of tensor-sharded over them
    (vLLM ``fused_moe/config.py``, ``FusedMoEParallelConfig.make``).

    Raises:
        ValueError: ``tp`` or ``dp`` is not a positive int.
    """

    tp: int
    dp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        _check_size("tp", self.tp)
        _check_size("dp", self.dp)
        if not isinstance(self.ep, bool):
            raise ValueError(f"vLLM spec: ep={self.ep!r} must be True or False")

    @property
    def num_workers(self) -> int:
        """``dp * tp``: every worker of every data-parallel replica."""
        return self.dp * self.tp

    def worker(self, dp_index: int, tp_rank: int) -> int:
        """Worker number of ``tp_rank`` in replica ``dp_index`` (dp-major)."""
        return dp_index * self.tp + tp_rank

    def tp_rank(self, worker: int) -> int:
        return worker % self.tp

    def dp_index(self, worker: int) -> int:
        return worker // self.tp

    def __str__(self) -> str:
        return f"vllm:tp={self.tp},dp={self.dp}" + (",ep" if self.ep else "")


def parse_inference_spec(text: str) -> InferenceSpec:
    """Parse ``"vllm:tp=T[,dp=D][,ep]"`` into an ``InferenceSpec``.

    Keys may come in any order; ``tp`` is required, ``dp`` defaults to 1,
    ``ep`` (or ``ep=1``/``ep=0``/``ep=true``/``ep=false``) defaults to off.

    Raises:
        ValueError: not a string, a prefix other than ``vllm:``, a missing
            or repeated key, an unknown key, or a size that is not a
            positive int. The message quotes the offending part and the
            valid syntax.
    """
    if isinstance(text, InferenceSpec):
        return text
    if not isinstance(text, str):
        raise ValueError(f"vLLM spec {text!r} is not a string; expected {SPEC_SYNTAX}")
    s = text.strip()
    engine, sep, body = s.partition(":")
    if not sep or engine.strip().lower() != "vllm":
        raise ValueError(f"inference spec {text!r} must start with 'vllm:'; expected {SPEC_SYNTAX}")
    values: dict[str, object] = {}
    for raw in body.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"vLLM spec {text!r} has an empty item; expected {SPEC_SYNTAX}")
        key, eq, value = (x.strip() for x in part.partition("="))
        key = key.lower()
        if key in values:
            raise ValueError(f"vLLM spec {text!r} gives '{key}' twice; expected {SPEC_SYNTAX}")
        if key in ("tp", "dp"):
            if not eq or not _INT.match(value):
                raise ValueError(
                    f"vLLM spec {text!r}: '{part}' needs a positive int, like {key}=2; "
                    f"expected {SPEC_SYNTAX}"
                )
            n = int(value)
            if n <= 0:
                raise ValueError(
                    f"vLLM spec {text!r}: {key}={n} must be a positive int (>= 1)"
                )
            values[key] = n
        elif key == "ep":
            flag = value.lower() if eq else "true"
            if flag not in ("1", "0", "true", "false"):
                raise ValueError(
                    f"vLLM spec {text!r}: '{part}' must be 'ep', 'ep=1' or 'ep=0'"
                )
            values[key] = flag in ("1", "true")
        else:
            raise ValueError(
                f"vLLM spec {text!r}: unknown key '{key}'; valid keys are tp, dp, ep "
                f"(pipeline parallelism is not supported); expected {SPEC_SYNTAX}"
            )
    if "tp" not in values:
        raise ValueError(f"vLLM spec {text!r} has no tp=...; expected {SPEC_SYNTAX}")
    workers = values["tp"] * values.get("dp", 1)
    if workers > MAX_WORKERS:
        raise ValueError(f"vLLM spec {text!r}: tp*dp = {workers} workers is more than m2nkit "
                         f"plans for ({MAX_WORKERS})")
    return InferenceSpec(tp=values["tp"], dp=values.get("dp", 1), ep=values.get("ep", False))
