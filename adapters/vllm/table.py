"""The vocabulary of the family tables: shard kinds, ``Param``, ``Family``.

A family table is a tuple of ``Param`` records, one per vLLM parameter of a
model (``{L}`` in a name stands for the layer index). Each record says how
vLLM shards the parameter over its workers (the *kind*), the global shape of
the wire tensors that feed it (symbolic dims), which wire tensors feed it and
as which part, and when it exists. ``layout.py`` turns the table into a
``DestinationLayout``; nothing in this module or the tables moves data.

Shard kinds: what tp rank ``r`` holds locally (vLLM 0.33.0 loaders, REFERENCE.md §3).

* ``replicated``: the whole tensor. Norms, routers (``RMSNorm``,
  ``GateLinear``, ``ReplicatedLinear``), row-parallel biases.
* ``column``: rows ``[r*n/tp, (r+1)*n/tp)``. ``linear.py`` ColumnParallelLinear.
* ``row``: columns ``[r*n/tp, (r+1)*n/tp)`` of a 2-D weight.
  ``linear.py`` RowParallelLinear.
* ``qkv``: local rows ``[q | k | v]``; q: heads ``[r*nh/tp, (r+1)*nh/tp)``;
  k/v: when ``tp >= nkv`` one head, ``r // (tp/nkv)``, else ``nkv/tp`` heads
  from ``r*nkv/tp``. ``linear.py`` QKVParallelLinear.
* ``merged``: ``[gate_r; up_r]``, part ``p`` at local row ``p*n/tp``.
  ``linear.py`` MergedColumnParallelLinear.
* ``vocab``: token rows ``[r*per, min((r+1)*per, V))`` with ``per =
  ceil(V/64)*64/tp``; the local rows after them are zero.
  ``vocab_parallel_embedding.py`` VocabParallelEmbedding.weight_loader.
* ``w13``: ``[E_local, 2*Im/tp_moe, H]``, per expert the gate rows of moe rank
  ``k`` then its up rows, from the wire's ``[E, 2*Im, H]``.
  ``fused_moe/routed_experts.py`` ``_load_w13``.
* ``w2``: ``[E_local, H, Im/tp_moe]``, down columns of moe rank ``k``.
  ``fused_moe/routed_experts.py`` ``_load_w2``.

MoE ranks: without EP ``tp_moe = dp*tp`` and the moe rank is the worker
number (``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``), every
worker holds all ``E`` experts; with EP ``tp_moe = 1`` and worker ``w`` holds
experts ``[w*E/ep, (w+1)*E/ep)`` with ``ep = dp*tp``
(``expert_map_manager.determine_expert_map``, linear placement). Dense
parameters only use the tp rank ``w % tp``: every dp replica holds the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

__all__ = [
    "REPLICATED", "COLUMN", "ROW", "QKV", "MERGED", "VOCAB", "W13", "W2", "KINDS",
    "Param", "Family", "Sizes", "cfg_get", "qkv_feeds", "merged_feeds",
]

REPLICATED = "replicated"
COLUMN = "column"
ROW = "row"
QKV = "qkv"
MERGED = "merged"
VOCAB = "vocab"
W13 = "w13"
W2 = "w2"
KINDS = (REPLICATED, COLUMN, ROW, QKV, MERGED, VOCAB, W13, W2)

#: Feeds of one parameter: ``(wire name template, part)``; part is ``None``
#: for a single feed, ``"q"/"k"/"v"`` for qkv, ``0/1`` for merged.
Feeds = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Param:
    """One vLLM parameter of a family table.

    Attributes:
        name: vLLM parameter name; ``{L}`` = layer index, ``{experts}`` = the
            version-dependent experts path (``names.py``).
        kind: one of ``KINDS``.
        dims: symbolic global shape of each feeding wire tensor (``"H"``,
            ``"nh*hd"``, see ``Sizes``). For ``qkv``: only the dims after the
            head rows (``("H",)`` for a weight, ``()`` for a bias).
        feeds: the wire tensors filling it; default: the same name, one feed.
        when: name of a family condition (``Family.conditions``) deciding
            whether the parameter exists (per layer); ``None``: always.
        tied_to: for ``lm_head.weight``: the parameter it shares storage with
            when ``tie_word_embeddings`` is set (then it is not allocated and
            a wire ``lm_head.weight`` is skipped, like vLLM does).
        aliases: keys of the version name table (``names.py``) naming
            another path of the same storage (``router_alias``).
    """

    name: str
    kind: str
    dims: tuple[str, ...]
    feeds: Feeds | None = None
    when: str | None = None
    tied_to: str | None = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"table entry {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.feeds is None:
            object.__setattr__(self, "feeds", ((self.name, None),))


def qkv_feeds(prefix: str, suffix: str = "weight") -> Feeds:
    """``q_proj``/``k_proj``/``v_proj`` under ``prefix`` as parts q, k, v."""
    return tuple((f"{prefix}.{p}_proj.{suffix}", p) for p in ("q", "k", "v"))


def merged_feeds(*names: str) -> Feeds:
    """Feeds of a merged column parameter, parts ``0, 1, ...`` in order."""
    return tuple((n, i) for i, n in enumerate(names))


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


_DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "float": torch.float32,
}


@dataclass(frozen=True)
class Sizes:
    """Model sizes from the HF config, in REFERENCE.md §3 symbols.

    ``H`` hidden, ``V`` vocab, ``nh`` heads, ``nkv`` KV heads, ``hd`` head
    dim, ``I`` dense intermediate, ``Im`` MoE intermediate, ``E`` experts,
    ``layers`` decoder layers. ``I``/``Im``/``E`` are 0 where a model has
    none.
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

    def label(self, sym: str) -> str:
        """``"intermediate_size (I)=96"``-style text for a symbolic dim."""
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
    """Attention, vocab and layer sizes every family shares.

    ``head_dim`` falls back to ``hidden_size // num_attention_heads`` like
    vLLM's model files (``llama.py``, ``qwen3.py``, ``mixtral.py``).
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


@dataclass(frozen=True)
class Family:
    """One model family: its table and the few functions it needs.

    Attributes:
        architecture: ``config.architectures[0]`` (``"LlamaForCausalLM"``).
        params: the table, in vLLM's ``named_parameters()`` order per layer.
        sizes: config -> ``Sizes``.
        conditions: ``Param.when`` name -> ``(config, layer) -> bool``
            (``layer`` is ``None`` for non-layer parameters).
        checks: extra parallel-size rules: ``(sizes, spec) -> message or
            None`` (a message names the config value and the rule).
        source: the vLLM model file the table restates.
    """

    architecture: str
    params: tuple[Param, ...]
    sizes: Callable[[Any], Sizes]
    conditions: Mapping[str, Callable[[Any, int | None], bool]] = field(default_factory=dict)
    checks: tuple[Callable[[Sizes, Any], str | None], ...] = ()
    source: str = ""
