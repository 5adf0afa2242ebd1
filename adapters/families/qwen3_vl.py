"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's table and a vision tower, wrapped.

vLLM 0.33.0 ``model_executor/models/qwen3_vl.py``:
``Qwen3VLForConditionalGeneration`` builds ``visual =
Qwen3_VisionTransformer(config.vision_config)`` and then ``language_model =
Qwen3LLMForCausalLM(config.text_config)`` (``Qwen3ForCausalLM`` with
``Qwen3VLDecoderLayer(Qwen3DecoderLayer)``: Qwen3's parameters exactly), and
its ``hf_to_vllm_mapper`` renames ``model.visual.`` -> ``visual.``,
``model.language_model.`` -> ``language_model.model.``, ``lm_head.`` ->
``language_model.lm_head.``. transformers 5 names every tensor the same in
memory and on disk (``modeling_qwen3_vl.py``; ``lm_head`` tied to
``model.language_model.embed_tokens`` by the wrapper's
``tie_word_embeddings``, which ``Qwen3VLConfig`` holds at its top level).
The text table is Qwen3's (``families/qwen3.py``) under those prefixes
(``families/wrapper.py``).

The vision tower (:data:`VISION`, shared with the Qwen3.5 wrappers, whose
vLLM classes reuse it): ``Qwen3_VisionTransformer`` registers
``patch_embed`` (``Conv3dLayer``, whole), ``pos_embed`` (``nn.Embedding``,
whole), ``merger`` and ``deepstack_merger_list.{D}``
(``Qwen3_VisionPatchMerger``: LayerNorm whole, ``linear_fc1``
``ColumnParallelLinear``, ``linear_fc2`` ``RowParallelLinear``, both with
bias; the merger's norm is over ``hidden_size``, a deepstack merger's over
the merged ``hidden_size * spatial_merge_size**2``, ``use_postshuffle_norm``),
then ``blocks.{B}`` (``Qwen3_VisionBlock``: ``norm1``/``norm2`` LayerNorms
whole, ``attn`` = ``models/qwen2_5_vl.py`` ``Qwen2_5_VisionAttention``:
``qkv`` a ``QKVParallelLinear`` with as many KV heads as heads, fed by the
checkpoint's fused ``attn.qkv`` (kind ``FUSED_QKV``), ``proj``
``RowParallelLinear``; ``mlp`` ``Qwen3_VisionMLP``: ``linear_fc1`` column,
``linear_fc2`` row, with biases). Each is split over the tensor-parallel
ranks (``mm_encoder_tp_mode="weights"``, vLLM's default; ``"data"`` builds
the tower whole on every worker and is not in this table).
transformers registers the tower's children ``patch_embed, pos_embed,
blocks, merger, deepstack_merger_list`` (``Qwen3VLVisionModel``), which
orders the wire tensors.
"""

from __future__ import annotations

from typing import Any

from .kinds import COLUMN, FUSED_QKV, REPLICATED, ROW
from .qwen3 import FAMILY as QWEN3
from .sizes import cfg_get
from .table import Param, TinyModel, kv_heads
from .wrapper import Part, Tower, wrapper_family

__all__ = ["ARCHITECTURE", "VISION", "TEXT", "vision_symbols", "VISION_DEFAULTS",
           "TEXT_DEFAULTS", "WRAPPER_PREFIXES", "TINY_VISION", "TINY_MODELS",
           "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "FAMILY"]

ARCHITECTURE = "Qwen3VLForConditionalGeneration"

#: The text model's prefixes: wire side (transformers 5 on disk), vLLM side
#: (``Qwen3VLForConditionalGeneration.hf_to_vllm_mapper`` targets).
WRAPPER_PREFIXES = {
    "hf": {"model.": "model.language_model.", "lm_head.": "lm_head."},
    "vllm": {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
}


def vision_symbols(vc: Any) -> dict[str, int]:
    """The vision tower's ``Sizes`` symbols from ``vision_config``.

    ``vH`` hidden, ``vnh`` heads, ``vhd`` head dim (``hidden_size //
    num_heads``, as ``Qwen3_VisionTransformer``), ``vI`` MLP intermediate,
    ``vO`` out hidden (the text model's hidden), ``vM`` merged hidden
    (``hidden_size * spatial_merge_size**2``), ``vC`` in channels, ``vT``
    temporal patch, ``vP`` patch, ``vNP`` position embeddings, ``vdepth``
    blocks, ``vdeep`` deepstack mergers.

    Raises:
        ValueError: a non-square patch (``patch_size`` a list).
    """
    H, nh = int(cfg_get(vc, "hidden_size")), int(cfg_get(vc, "num_heads"))
    patch, temporal = cfg_get(vc, "patch_size"), cfg_get(vc, "temporal_patch_size")
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise ValueError(f"vision_config patch_size={patch!r}, temporal_patch_size={temporal!r}: "
                         "m2nkit's Qwen3-VL vision table takes integer patch sizes (vLLM's "
                         "Qwen3_VisionPatchEmbed builds a cubic Conv3d kernel from them)")
    m = int(cfg_get(vc, "spatial_merge_size"))
    return {"vH": H, "vnh": nh, "vhd": H // nh, "vI": int(cfg_get(vc, "intermediate_size")),
            "vO": int(cfg_get(vc, "out_hidden_size")), "vM": H * m * m,
            "vC": int(cfg_get(vc, "in_channels")), "vT": temporal, "vP": patch,
            "vNP": int(cfg_get(vc, "num_position_embeddings")),
            "vdepth": int(cfg_get(vc, "depth")),
            "vdeep": len(cfg_get(vc, "deepstack_visual_indexes", default=()) or ())}


_VISION_KEYS = {"vH": "hidden_size", "vnh": "num_heads", "vhd": "hidden_size/num_heads",
                "vI": "intermediate_size",
                "vO": "out_hidden_size", "vM": "hidden_size*spatial_merge_size**2",
                "vC": "in_channels", "vT": "temporal_patch_size", "vP": "patch_size",
                "vNP": "num_position_embeddings", "vdepth": "depth",
                "vdeep": "len(deepstack_visual_indexes)"}

#: ``Qwen3VLVisionConfig``'s defaults (transformers 5 ``configuration_qwen3_vl.py``;
#: ``Qwen3VLMoeVisionConfig`` has the same).
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                   "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "out_hidden_size": 3584,
                   "num_position_embeddings": 2304, "deepstack_visual_indexes": (8, 16, 24)}


def _merger(prefix: str, norm: str) -> tuple[Param, ...]:
    """A ``Qwen3_VisionPatchMerger`` under ``prefix`` (norm over ``norm``)."""
    return (
        Param(f"{prefix}.norm.weight", REPLICATED, (norm,)),
        Param(f"{prefix}.norm.bias", REPLICATED, (norm,)),
        Param(f"{prefix}.linear_fc1.weight", COLUMN, ("vM", "vM")),
        Param(f"{prefix}.linear_fc1.bias", COLUMN, ("vM",)),
        Param(f"{prefix}.linear_fc2.weight", ROW, ("vO", "vM")),
        Param(f"{prefix}.linear_fc2.bias", REPLICATED, ("vO",)),
    )


_B = "blocks.{B}"

#: The Qwen3-VL vision tower, in vLLM's ``named_parameters()`` order; names
#: relative to ``model.visual.`` (wire) and ``visual.`` (vLLM).
VISION = Tower(
    name="Qwen3-VL vision tower",
    params=(
        Param("patch_embed.proj.weight", REPLICATED, ("vH", "vC", "vT", "vP", "vP")),
        Param("patch_embed.proj.bias", REPLICATED, ("vH",)),
        Param("pos_embed.weight", REPLICATED, ("vNP", "vH")),
        *_merger("merger", "vH"),
        *_merger("deepstack_merger_list.{D}", "vM"),
        Param(f"{_B}.norm1.weight", REPLICATED, ("vH",)),
        Param(f"{_B}.norm1.bias", REPLICATED, ("vH",)),
        Param(f"{_B}.norm2.weight", REPLICATED, ("vH",)),
        Param(f"{_B}.norm2.bias", REPLICATED, ("vH",)),
        Param(f"{_B}.attn.qkv.weight", FUSED_QKV, ("vnh", "vhd", "vH")),
        Param(f"{_B}.attn.qkv.bias", FUSED_QKV, ("vnh", "vhd")),
        Param(f"{_B}.attn.proj.weight", ROW, ("vH", "vnh*vhd")),
        Param(f"{_B}.attn.proj.bias", REPLICATED, ("vH",)),
        Param(f"{_B}.mlp.linear_fc1.weight", COLUMN, ("vI", "vH")),
        Param(f"{_B}.mlp.linear_fc1.bias", COLUMN, ("vI",)),
        Param(f"{_B}.mlp.linear_fc2.weight", ROW, ("vH", "vI")),
        Param(f"{_B}.mlp.linear_fc2.bias", REPLICATED, ("vH",)),
    ),
    symbols=vision_symbols, keys=_VISION_KEYS, config_key="vision_config",
    hf_prefix="model.visual.", vllm_prefix="visual.",
    repeats={"B": "vdepth", "D": "vdeep"},
    config_defaults=VISION_DEFAULTS,
    child_order={"": ("patch_embed", "pos_embed", "blocks", "merger", "deepstack_merger_list")},
    source="vllm/model_executor/models/qwen3_vl.py Qwen3_VisionTransformer",
)

#: ``Qwen3VLTextConfig``'s defaults (transformers 5 ``configuration_qwen3_vl.py``).
TEXT_DEFAULTS = {"hidden_size": 4096, "vocab_size": 151936, "num_attention_heads": 32,
                 "num_hidden_layers": 32, "intermediate_size": 22016, "head_dim": 128,
                 "attention_bias": False, "num_key_value_heads": kv_heads(32)}

TEXT = Part(QWEN3, "text_config", WRAPPER_PREFIXES["hf"], WRAPPER_PREFIXES["vllm"],
            inherit=("tie_word_embeddings",), config_defaults=TEXT_DEFAULTS)

#: A tiny vision tower for the tiny test models (the text sizes are
#: ``m2nkit.adapters.tiny.TINY_SIZES``): 2 blocks of 8 heads of 8 (tp up to 8),
#: one deepstack merger, out hidden = the tiny text hidden.
TINY_VISION = {"depth": 2, "hidden_size": 64, "num_heads": 8, "intermediate_size": 64,
               "out_hidden_size": 128, "patch_size": 4, "num_position_embeddings": 16,
               "deepstack_visual_indexes": [0]}

#: Tiny test models (``m2nkit.adapters.tiny``): tied, as the fixture in
#: tests/data/oracle/tiny-qwen3-vl (the published configs are untied).
TINY_MODELS = {
    "tiny-qwen3-vl": TinyModel("qwen3_vl", {"tie_word_embeddings": True,
                                            "vision_config": TINY_VISION}),
}

FAMILY = wrapper_family(
    ARCHITECTURE, TEXT, (VISION,), model_types=("qwen3_vl",),
    config_defaults={"tie_word_embeddings": False}, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/qwen3_vl.py", module=__name__,
)
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
