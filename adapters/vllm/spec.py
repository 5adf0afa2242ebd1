"""The vLLM spec: ``vllm:tp=T[,dp=D][,ep][,placement=P][,all2all=B][,dtype=X][,quant=Q[,wire=W]]``.

One string names the inference side's layout on the command line and in a
``DestinationLayout``. Workers are numbered dp-major, ``worker = dp_index * tp
+ tp_rank``, which is vLLM 0.33.0's order in the m2n communicator
(``weight_transfer/m2n_common.py``: worker rank ``T + dp_index * (TP*PP) +
tp_rank``; m2nkit plans with ``PP = 1``).

Besides the parallel sizes it carries the vLLM engine arguments that change
what a worker holds: ``expert_placement_strategy`` and ``all2all_backend``
(``vllm/config/parallel.py`` ``ParallelConfig``; together they decide where
experts go) and ``--dtype`` (``vllm/config/model.py``; the dtype vLLM
allocates parameters in). The values are checked here, without torch, so a
typo is refused at once; what they mean for a model is decided in
``m2nkit.adapters.vllm.expert_placement`` and ``m2nkit.adapters.vllm.dtype``.

``quant`` is vLLM's ``--quantization`` for a BF16 model quantized online
(``vllm/config/quantization.py`` ``_ONLINE_SHORTHANDS``); m2nkit carries
``fp8_per_block`` only (``m2nkit.adapters.vllm.fp8``) and refuses vLLM's
other online schemes by name. ``wire`` says what the trainer sends into it:
``bf16`` (vLLM quantizes what lands, mode 1) or ``fp8`` (each trainer rank
quantizes its slabs in the worker's 128 x 128 grid, mode 2,
``m2nkit.engine.quant_fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec_text import check_sizes, flag, positive_size, spec_items

__all__ = ["InferenceSpec", "parse_inference_spec", "SPEC_SYNTAX", "PLACEMENTS",
           "ALL2ALL_BACKENDS", "DTYPES", "QUANTS", "REFUSED_QUANTS", "WIRES"]

#: What a valid spec looks like (quoted in every parse error).
SPEC_SYNTAX = ("vllm:tp=T[,dp=D][,ep][,placement=linear|round_robin][,all2all=BACKEND]"
               "[,dtype=auto|bfloat16|float16|float32][,quant=none|fp8_per_block[,wire=bf16|fp8]] "
               "(T, D positive ints; e.g. 'vllm:tp=4', "
               "'vllm:tp=2,dp=4,ep', 'vllm:tp=2,ep,placement=round_robin', 'vllm:tp=2,dtype=float16', "
               "'vllm:tp=8,quant=fp8_per_block,wire=fp8')")

#: vLLM 0.33.0 ``ExpertPlacementStrategy`` (``vllm/config/parallel.py``).
PLACEMENTS = ("linear", "round_robin")

#: vLLM 0.33.0 ``All2AllBackend`` (``vllm/config/parallel.py``); the default first.
ALL2ALL_BACKENDS = (
    "allgather_reducescatter", "naive", "pplx", "deepep_high_throughput", "deepep_low_latency",
    "deepep_v2", "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep",
    "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
    "passthrough",
)

#: vLLM 0.33.0 ``--dtype`` values -> the canonical name m2nkit keeps
#: (``vllm/config/model.py`` ``_STR_DTYPE_TO_TORCH_DTYPE``, plus ``auto``).
DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16", "half": "float16",
          "float32": "float32", "float": "float32"}

#: Online quantization schemes m2nkit carries (``none``: vLLM serves the model unquantized).
QUANTS = ("none", "fp8_per_block")
#: vLLM 0.33.0 ``--quantization`` online shorthands m2nkit does not carry
#: (``vllm/config/quantization.py`` ``ONLINE_QUANT_SHORTHAND_NAMES``), and checkpoint
#: schemes a user may name here by mistake.
REFUSED_QUANTS = ("fp8_per_tensor", "fp8_per_channel", "mxfp8", "mxfp4",
                  "int8_per_channel_weight_only", "nvfp4_per_token", "online", "fp8",
                  "compressed-tensors", "nvfp4", "modelopt_fp4", "awq", "gptq", "int4")
#: What the trainer sends into an fp8_per_block worker: BF16 (vLLM quantizes) or e4m3 + scales.
WIRES = ("bf16", "fp8")



def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"vLLM spec: {name}={value!r} must be a positive int")
    if value <= 0:
        raise ValueError(f"vLLM spec: {name}={value} must be a positive int (>= 1)")
    return value


def _check_quant(value: object) -> None:
    if value in QUANTS:
        return
    known = value in REFUSED_QUANTS
    raise ValueError(f"vLLM spec: quant={value!r} is "
                     + ("a quantization scheme m2nkit does not carry" if known else
                        "not a quantization scheme m2nkit knows")
                     + f"; supported: {', '.join(QUANTS)} (fp8_per_block: vLLM's online "
                     "128x128 block fp8 of a BF16 model)")


def _check_choice(name: str, value: object, choices) -> None:
    if value not in choices:
        raise ValueError(f"vLLM spec: {name}={value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class InferenceSpec:
    """vLLM parallel sizes and the engine arguments that shape what a worker holds.

    Attributes:
        tp: ``tensor_parallel_size``.
        dp: ``data_parallel_size`` (replicas; MoE layers span all of them).
        ep: ``enable_expert_parallel``: MoE experts are split whole over all
            ``dp * tp`` workers instead of tensor-sharded over them (vLLM
            ``fused_moe/config.py``, ``FusedMoEParallelConfig.make``).
        placement: ``expert_placement_strategy`` as asked for (``linear`` or
            ``round_robin``); vLLM may fall back to linear, see
            ``m2nkit.adapters.vllm.expert_placement``.
        all2all: ``all2all_backend`` (only its effect on placement matters
            here).
        dtype: ``--dtype``: ``auto`` (vLLM decides from the config, see
            ``m2nkit.adapters.vllm.dtype``), ``bfloat16``, ``float16`` or
            ``float32``.
        quant: ``--quantization`` of a BF16 model quantized online:
            ``none`` or ``fp8_per_block``.
        wire: with ``quant``: ``bf16`` (default; vLLM quantizes) or ``fp8``
            (the trainer quantizes, e4m3 + float32 scales on the wire).

    Raises:
        ValueError: ``tp`` or ``dp`` is not a positive int, or another field
            is not one of its valid values (the message lists them); a
            quantization scheme m2nkit does not carry (named, with the
            supported ones); ``wire=fp8`` without ``quant``.
    """

    tp: int
    dp: int = 1
    ep: bool = False
    placement: str = "linear"
    all2all: str = ALL2ALL_BACKENDS[0]
    dtype: str = "auto"
    quant: str = "none"
    wire: str = "bf16"

    def __post_init__(self) -> None:
        _check_size("tp", self.tp)
        _check_size("dp", self.dp)
        if not isinstance(self.ep, bool):
            raise ValueError(f"vLLM spec: ep={self.ep!r} must be True or False")
        _check_choice("placement", self.placement, PLACEMENTS)
        _check_choice("all2all", self.all2all, ALL2ALL_BACKENDS)
        _check_choice("dtype", self.dtype, tuple(dict.fromkeys(DTYPES.values())))
        _check_quant(self.quant)
        _check_choice("wire", self.wire, WIRES)
        if self.wire == "fp8" and self.quant == "none":
            raise ValueError("vLLM spec: wire=fp8 needs quant=fp8_per_block (the worker must "
                             "serve the model in fp8); without quant the wire is the model dtype")

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
        """Canonical text; options at their defaults are left out."""
        out = f"vllm:tp={self.tp},dp={self.dp}" + (",ep" if self.ep else "")
        for key, default in (("placement", "linear"), ("all2all", ALL2ALL_BACKENDS[0]),
                             ("dtype", "auto"), ("quant", "none"), ("wire", "bf16")):
            value = getattr(self, key)
            if value != default:
                out += f",{key}={value}"
        return out


def parse_inference_spec(text: str) -> InferenceSpec:
    """Parse ``"vllm:tp=T[,dp=D][,ep][,placement=P][,all2all=B][,dtype=X][,quant=Q[,wire=W]]"``.

    Keys may come in any order; ``tp`` is required, ``dp`` defaults to 1,
    ``ep`` (or ``ep=1``/``ep=0``/``ep=true``/``ep=false``) defaults to off,
    ``placement`` to ``linear``, ``all2all`` to ``allgather_reducescatter``
    and ``dtype`` to ``auto`` (``half``/``float`` are read as vLLM reads
    them, ``float16``/``float32``), ``quant`` to ``none`` and ``wire`` to
    ``bf16``. Values are case-insensitive.

    Raises:
        ValueError: not a string, a prefix other than ``vllm:``, a missing
            or repeated key, an unknown key, or a size that is not a
            positive int. The message quotes the offending part and the
            valid syntax.
    """
    if isinstance(text, InferenceSpec):
        return text
    label = "vLLM spec"
    values: dict[str, object] = {}
    for item in spec_items(text, "vllm", label, SPEC_SYNTAX):
        key, value, part = item.key, item.value, item.part
        if key in ("tp", "dp"):
            values[key] = positive_size(item, text, label, SPEC_SYNTAX)
        elif key == "ep":
            values[key] = flag(item, text, label, "vLLM's expert parallelism is on or off (--enable-expert-parallel): its size is always tp*dp")
        elif key == "quant":
            if not item.has_value or not value:
                raise ValueError(f"{label} {text!r}: '{part}' needs a scheme, like "
                                 "quant=fp8_per_block")
            _check_quant(value.lower())
            values[key] = value.lower()
        elif key in _CHOICES:
            choices, names = _CHOICES[key]
            if not item.has_value or value.lower() not in choices:
                spelt = _SPELLINGS.get(key, {}).get(value.lower())
                raise ValueError(f"{label} {text!r}: '{part}' is not valid; {key} must be one "
                                 f"of {', '.join(names)}"
                                 + (f" (vLLM's --dtype values: write {key}={spelt})" if spelt
                                    else ""))
            values[key] = choices[value.lower()]
        else:
            raise ValueError(f"{label} {text!r}: unknown key '{key}'; valid keys are tp, dp, ep, "
                             "placement, all2all, dtype, quant, wire (pipeline parallelism is "
                             f"not supported); expected {SPEC_SYNTAX}")
    check_sizes(values, text, label, SPEC_SYNTAX)
    return InferenceSpec(**values)


#: Short names vLLM's ``--dtype`` does not take (vllm/config/model.py ``ModelDType``), and
#: its spelling of them, for the refusal to suggest.
_SPELLINGS = {"dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}}

#: Keys with a fixed set of values: key -> (accepted text -> value, names to list).
_CHOICES = {
    "placement": ({p: p for p in PLACEMENTS}, PLACEMENTS),
    "all2all": ({b: b for b in ALL2ALL_BACKENDS}, ALL2ALL_BACKENDS),
    "dtype": (DTYPES, tuple(DTYPES)),
    "wire": ({w: w for w in WIRES} | {"bfloat16": "bf16", "e4m3": "fp8"}, WIRES),
}
