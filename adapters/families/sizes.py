"""Model sizes read from a Hugging Face config, in the symbols of docs/reference.md §3.

Family tables write shapes symbolically (``("V", "H")``, ``("nh*hd",)``,
``("E", "2*Im", "H")``) so one table serves every size of a family; this
module turns a config into the numbers behind the symbols, and names the
config key behind each symbol so that a rule a config breaks can be reported
in the config's own words (``intermediate_size=96 is not divisible by tp=5``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["Sizes", "base_sizes", "cfg_get", "config_dtype"]


def cfg_get(config: Any, *keys: str, default: Any = ...) -> Any:
    """First present, non-None value of ``keys`` in a config object or dict.

    Raises:
        ValueError: none of ``keys`` is present and no default is given.
    """
    for key in keys:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if value is not None:
            return value
    if default is ...:
        raise ValueError(f"model config has none of {list(keys)}")
    return default


def _as_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        d = getattr(torch, value.removeprefix("torch."), None)
        return d if isinstance(d, torch.dtype) else None
    return None


def config_dtype(config: Any) -> torch.dtype | None:
    """The dtype ``config`` names (``dtype``/``torch_dtype``, then ``text_config``'s), or ``None``.

    What the checkpoint stores, as transformers 5 reads it (any torch dtype
    name, ``"torch."`` prefix or not). Both sides read it: the config-only
    wire list builds its tensors in it (``m2nkit.adapters.config_wires``),
    and vLLM's ``auto`` rule starts from it (``m2nkit.adapters.vllm.dtype``,
    which decides what vLLM allocates). :attr:`Sizes.dtype` is the narrower
    reading of the family tables (the float names only, no ``text_config``).
    """
    for cfg in (config, _get(config, "text_config")):
        if cfg is None:
            continue
        for key in ("dtype", "torch_dtype"):
            d = _as_dtype(_get(cfg, key))
            if d is not None:
                return d
    return None


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


_DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "float": torch.float32,
}


@dataclass(frozen=True)
class Sizes:
    """Model sizes from the HF config, in docs/reference.md §3 symbols.

    ``H`` hidden, ``V`` vocab, ``nh`` heads, ``nkv`` KV heads, ``hd`` head
    dim, ``I`` dense intermediate, ``Im`` MoE intermediate, ``E`` experts,
    ``layers`` decoder layers. ``I``/``Im``/``E`` are 0 where a model has
    none. ``tied``: ``tie_word_embeddings``. ``dtype``: the config's model
    dtype (``None`` when it names none m2nkit knows). ``extra``: symbols of
    a model's other parts, read as attributes too (a multimodal wrapper's
    vision tower: ``vH``, ``vnh``, ...; ``m2nkit.adapters.families.wrapper``).
    """

    H: int
    V: int
    nh: int
    nkv: int
    hd: int
    I: int
    Im: int
    E: int
    layers: int
    tied: bool
    dtype: torch.dtype | None
    #: symbol -> the config key it comes from (for error messages).
    keys: Mapping[str, str] = field(default_factory=dict)
    #: more symbols -> their values (a wrapper's vision tower), read like fields.
    extra: Mapping[str, int] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(f"Sizes has no symbol {name!r}")

    def label(self, sym: str) -> str:
        """``"intermediate_size=96"``-style text for a symbolic dim (``"I"``, ``"nh*hd"``)."""
        parts = sym.split("*")
        names = "*".join(self.keys.get(p, p) for p in parts)
        return f"{names}={self.resolve((sym,))[0]}"

    def resolve(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        """Symbolic dims (``"H"``, ``"nh*hd"``, ``"2*Im"``) to ints."""
        out = []
        for d in dims:
            n = 1
            for factor in d.split("*"):
                n *= int(factor) if factor.isdigit() else getattr(self, factor)
            out.append(n)
        return tuple(out)


_BASE_KEYS = {
    "H": "hidden_size", "V": "vocab_size", "nh": "num_attention_heads",
    "nkv": "num_key_value_heads", "hd": "head_dim", "I": "intermediate_size",
    "Im": "moe_intermediate_size", "E": "num_experts",
}


def base_sizes(config: Any, *, I: int = 0, Im: int = 0, E: int = 0,
               keys: Mapping[str, str] | None = None) -> Sizes:
    """Attention, vocab and layer sizes every family shares, plus the given MLP sizes.

    ``head_dim`` falls back to ``hidden_size // num_attention_heads`` like
    vLLM's model files (``llama.py``, ``qwen3.py``, ``mixtral.py``);
    ``num_key_value_heads`` falls back to ``num_attention_heads``. ``keys``
    overrides which config key a symbol is reported as.

    Raises:
        ValueError: the config lacks ``hidden_size``, ``num_attention_heads``,
            ``vocab_size`` or ``num_hidden_layers``.
    """
    H = int(cfg_get(config, "hidden_size"))
    nh = int(cfg_get(config, "num_attention_heads"))
    nkv = int(cfg_get(config, "num_key_value_heads", default=nh))
    hd = int(cfg_get(config, "head_dim", default=H // nh))
    dtype = cfg_get(config, "dtype", "torch_dtype", default=None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.replace("torch.", ""))
    elif not isinstance(dtype, torch.dtype):
        dtype = None
    return Sizes(
        H=H, V=int(cfg_get(config, "vocab_size")), nh=nh, nkv=nkv, hd=hd,
        I=I, Im=Im, E=E, layers=int(cfg_get(config, "num_hidden_layers")),
        tied=bool(cfg_get(config, "tie_word_embeddings", default=False)),
        dtype=dtype, keys={**_BASE_KEYS, **(keys or {})},
    )
