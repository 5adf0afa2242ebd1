"""Which worker parameters vLLM quantizes online (``quantization="fp8_per_block"``), and their shapes.

vLLM 0.33.0 turns ``--quantization fp8_per_block`` into an
``OnlineQuantizationConfig`` (``vllm/config/quantization.py``
``_ONLINE_SHORTHANDS``: ``linear`` and ``moe`` both ``kFp8Static128BlockSym``).
Its ``get_quant_method`` (``layers/quantization/online/base.py``) gives
``Fp8PerBlockOnlineLinearMethod`` to every ``LinearBase`` layer that was
built with the model's ``quant_config`` and is not in
``quantization_config.ignore``, and ``Fp8PerBlockOnlineMoEMethod`` to every
``RoutedExperts``; embeddings, ``lm_head`` (``ParallelLMHead`` is no
``LinearBase``), norms and the ``e_score_correction_bias`` get none. Whether
a router is quantized is the model's word: a router built with ``quant_config``
(a ``GateLinear``) becomes fp8, one built without stays in the model dtype
(each family's ``online_fp8`` says which, citing its vLLM model file).

Each quantized layer ends with ``weight`` (float8 e4m3, the local shape) and
``weight_scale_inv`` (float32, ``ceil(local / 128)``); experts with
``w13_weight``/``w2_weight`` and ``w13_weight_scale_inv``/``w2_weight_scale_inv``
(``_Fp8OnlineMoEBase``: ``weight_scale_name = "weight_scale_inv"``), after
``Fp8PerBlockOnlineMoEMethod.maybe_roundup_sizes`` rounded ``H`` and
``Im_local`` up to 128: ``w13 [E_local, 2*ceil128(Im_local), ceil128(H)]``
(gate rows, then up rows, each padded with zeros, ``moe_base._zero_padding``),
``w2 [E_local, ceil128(H), ceil128(Im_local)]``.

Per family the rule is data, in the family's module: ``Family.online_fp8``
lists the suffixes of the parameters vLLM quantizes, or is
``ONLINE_FP8_FROM_TABLE`` where the table's ``Param.quantized`` (pinned by
vLLM's checkpoint-fp8 dumps: the same ``quant_config`` rule) says it. The
integration test ``tests/integration/test_fp8_plan.py`` holds every family's
rule against a fresh vLLM load with ``quantization="fp8_per_block"``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from m2nkit.adapters.families.table import ONLINE_FP8_FROM_TABLE
from m2nkit.manifest.destination import DestinationLayout

__all__ = ["OnlineFp8Param", "online_fp8_params", "fp8_architectures", "SCALE_SUFFIX"]

SCALE_SUFFIX = "_scale_inv"
_BLOCK = 128


class OnlineFp8Param(NamedTuple):
    """One worker-local parameter vLLM quantizes; the fields of ``engine.quant_fp8.Fp8Target``."""

    worker: int
    param: str
    scale: str
    shape: tuple[int, ...]
    fp8_shape: tuple[int, ...]
    row_shards: int


def _round_up(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def fp8_architectures() -> tuple[str, ...]:
    """Architectures m2nkit plans under ``quant=fp8_per_block`` (``Family.online_fp8`` set)."""
    from m2nkit.adapters.families.registry import ARCHITECTURES, family

    return tuple(sorted(a for a in ARCHITECTURES if family(a).online_fp8 is not None))


def online_fp8_params(config: Any, destination: DestinationLayout) -> list[OnlineFp8Param]:
    """Every worker parameter of ``destination`` that vLLM quantizes under ``fp8_per_block``.

    Args:
        config: the HF config (dict or ``PretrainedConfig``) of the BF16 model.
        destination: its BF16 layout (``destination_layout``), whose
            parameter shapes the plan's slabs address.

    Returns:
        One :class:`OnlineFp8Param` per quantized (worker, parameter), in
        the destination's order; aliases (MLA ``mla_attn.*``) are not
        repeated, their scales alias the target's (``<alias>_scale_inv``).

    Raises:
        ValueError: a config that already carries a ``quantization_config``
            (serve it unquantized, or plan it from disk without ``quant=``),
            or an architecture without an online fp8 rule (lists those with one).
    """
    from m2nkit.adapters.families import family_for
    from m2nkit.adapters.families.expand import expand
    from m2nkit.adapters.families.vllm_names import vllm_names
    from m2nkit.adapters.vllm.names import DEFAULT_VLLM_VERSION

    q = config.get("quantization_config") if isinstance(config, dict) else getattr(
        config, "quantization_config", None)
    family = family_for(config)
    arch = family.architecture
    if q:
        method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", q)
        raise ValueError(f"{arch}: quant=fp8_per_block quantizes BF16 weights, but the config "
                         f"already has quantization_config (quant_method {method!r}); plan a "
                         "BF16 config (without quantization_config) with quant=fp8_per_block, "
                         "or this one without quant=")
    suffixes = family.online_fp8
    flagged: set[str] | None = None
    if suffixes is None:
        raise ValueError(f"{arch}: m2nkit has no fp8_per_block rule for this architecture; "
                         f"supported: {', '.join(fp8_architectures())}")
    if suffixes == ONLINE_FP8_FROM_TABLE:
        s = family.sizes(config)
        ex = expand(family, config, s, vllm_names(DEFAULT_VLLM_VERSION), quantized=False)
        flagged = {name for name, p in ex.params if p.quantized}

    def quantized(name: str) -> bool:
        if flagged is not None:
            return name in flagged
        return any(name.endswith(x) for x in suffixes)

    out = []
    for p in destination.params:
        if p.name in destination.aliases or not quantized(p.name):
            continue
        shape = tuple(p.shape)
        if len(shape) == 2:
            out.append(OnlineFp8Param(p.worker, p.name, p.name + SCALE_SUFFIX, shape, shape, 1))
        elif p.name.endswith("w13_weight"):
            E, rows, H = shape
            out.append(OnlineFp8Param(p.worker, p.name, p.name + SCALE_SUFFIX, shape,
                                      (E, 2 * _round_up(rows // 2), _round_up(H)), 2))
        elif p.name.endswith("w2_weight"):
            E, H, im = shape
            out.append(OnlineFp8Param(p.worker, p.name, p.name + SCALE_SUFFIX, shape,
                                      (E, _round_up(H), _round_up(im)), 1))
        else:
            raise ValueError(f"{arch}: quantized parameter {p.name!r} of shape {shape} is "
                             "neither a 2-D linear weight nor stacked experts")
    return out
