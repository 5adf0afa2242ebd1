"""The SGLang spec: ``sglang:tp=T[,dp=D][,ep][,dtype=X]``.

The sizes are SGLang 0.5.23's server arguments (``sglang/srt/server_args.py``
``ServerArgs``): ``tp`` is ``--tp-size``, ``dp`` is ``--dp-size`` without
``--enable-dp-attention`` (separate replicas, each a TP group of its own,
launched by ``sglang/srt/managers/data_parallel_controller.py``), ``ep`` is
``--ep-size`` equal to ``--tp-size`` (experts split whole over the TP group
of one replica) and ``dtype`` is ``--dtype``. Workers are numbered
dp-major, ``worker = dp_index * tp + tp_rank``. DP attention and an
``--ep-size`` below ``--tp-size`` are not planned (refused by name).

Checked here without torch, so a typo is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec_text import check_sizes, flag, positive_size, spec_items

__all__ = ["SGLangSpec", "parse_sglang_spec", "is_sglang_spec", "SPEC_SYNTAX", "DTYPES"]

SPEC_SYNTAX = ("sglang:tp=T[,dp=D][,ep][,dtype=auto|bfloat16|float16|float32] "
               "(T, D positive ints; e.g. 'sglang:tp=4', 'sglang:tp=2,dp=2,ep')")

#: SGLang 0.5.23 ``--dtype`` values -> the canonical name (``sglang/srt/server_args.py``
#: ``--dtype`` choices; ``configs/model_config.py`` ``_STR_DTYPE_TO_TORCH_DTYPE``).
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
          "float32": "float32", "float": "float32"}



@dataclass(frozen=True)
class SGLangSpec:
    """SGLang parallel sizes and dtype.

    Attributes:
        tp: ``--tp-size`` (one replica's TP group).
        dp: ``--dp-size`` replicas (no DP attention).
        ep: ``--ep-size`` = ``tp``: experts split whole over one replica's
            ``tp`` workers (not over all ``dp * tp``, unlike vLLM).
        dtype: ``--dtype`` (``auto``: SGLang decides from the config,
            ``m2nkit.adapters.sglang.rules.sglang_dtype``).

    Raises:
        ValueError: ``tp``/``dp`` not a positive int, ``ep`` not a bool, or
            an unknown dtype.
    """

    tp: int
    dp: int = 1
    ep: bool = False
    dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"SGLang spec: {name}={v!r} must be a positive int (>= 1)")
        if not isinstance(self.ep, bool):
            raise ValueError(f"SGLang spec: ep={self.ep!r} must be True or False")
        if self.dtype not in set(DTYPES.values()):
            raise ValueError(f"SGLang spec: dtype={self.dtype!r} is not one of "
                             f"{', '.join(dict.fromkeys(DTYPES.values()))}")

    # m2nkit's quantized paths are vLLM's; an SGLang worker gets the model dtype.
    quant = "none"
    wire = "bf16"

    @property
    def num_workers(self) -> int:
        """``dp * tp``: every worker of every replica."""
        return self.dp * self.tp

    def __str__(self) -> str:
        """Canonical text; ``dtype`` left out at ``auto``."""
        out = f"sglang:tp={self.tp},dp={self.dp}" + (",ep" if self.ep else "")
        return out + (f",dtype={self.dtype}" if self.dtype != "auto" else "")


def is_sglang_spec(text: object) -> bool:
    """Whether ``text`` is an ``SGLangSpec`` or a spec string naming ``sglang:``."""
    if isinstance(text, SGLangSpec):
        return True
    # "sglang" alone is SGLang's too: its parser then asks for the settings
    return isinstance(text, str) and text.strip().partition(":")[0].strip().lower() == "sglang"


def parse_sglang_spec(text: object) -> SGLangSpec:
    """Parse ``"sglang:tp=T[,dp=D][,ep][,dtype=X]"`` (keys in any order, case-insensitive).

    Raises:
        ValueError: not a string, another prefix, an empty, repeated or
            unknown item, a size that is not a positive int, ``ep=N`` other
            than a flag, more than ``spec_text.MAX_WORKERS`` workers. The message quotes
            the offending part and the valid syntax.
    """
    if isinstance(text, SGLangSpec):
        return text
    label = "SGLang spec"
    values: dict[str, object] = {}
    for item in spec_items(text, "sglang", label, SPEC_SYNTAX):
        if item.key in ("tp", "dp"):
            values[item.key] = positive_size(item, text, label, SPEC_SYNTAX)
        elif item.key == "ep":
            values["ep"] = flag(item, text, label, "ep means --ep-size = --tp-size; a smaller "
                                                   "--ep-size is not planned")
        elif item.key == "dtype":
            if not item.has_value or item.value.lower() not in DTYPES:
                raise ValueError(f"{label} {text!r}: '{item.part}' is not valid; dtype must be "
                                 f"one of {', '.join(DTYPES)}")
            values["dtype"] = DTYPES[item.value.lower()]
        else:
            raise ValueError(f"{label} {text!r}: unknown key '{item.key}'; valid keys are tp, "
                             "dp, ep, dtype (DP attention and pipeline parallelism are not "
                             f"planned); expected {SPEC_SYNTAX}")
    check_sizes(values, text, label, SPEC_SYNTAX)
    return SGLangSpec(**values)
