"""Llama-4's multimodal wrapper (``Llama4ForConditionalGeneration``: Scout, Maverick).

vLLM 0.33.0 ``model_executor/models/mllama4.py``, checked bit for bit with
its real loaders (``tests/data/oracle/tiny-llama4-vision``). The text model
is Llama-4's table (``families/llama4.py``) under ``language_model.``
(``families/wrapper.py``).

vLLM builds ``vision_model`` and ``multi_modal_projector`` (:data:`VISION`), then
``language_model`` (:data:`TEXT`), under the checkpoint's own names (its loader renames nothing of a Hugging Face
checkpoint). The vision tower (``Llama4VisionModel``): ``class_embedding``
and ``positional_embedding_vlm`` (parameters of the model itself),
``patch_embedding.linear`` (``ColumnParallelLinear``, no bias), the pre/post
``LayerNorm``s whole, then per layer a ``QKVParallelLinear`` fed by ``q/k/v_proj``
(as many KV heads as heads, biases, no rotary reordering: ``_load_other_weights``)
and a row-parallel ``o_proj`` with a replicated bias, ``mlp.fc1`` column /
``fc2`` row with biases, two ``LayerNorm``s; the pixel-shuffle
``vision_adapter.mlp`` (``Llama4VisionMLP``: ``fc1`` column, ``fc2`` row,
``bias=multi_modal_projector_bias``); ``multi_modal_projector.linear_1`` a
``ColumnParallelLinear`` (``gather_output=True``). Split over tp (the
tower's ``is_vit_use_data_parallel()`` is asked without a head count, so
only ``mm_encoder_tp_mode="data"``, not vLLM's default, builds it whole;
not in this table), so the tower's heads must divide by tp
(``QKVParallelLinear``).
"""

from __future__ import annotations

from typing import Any

from .kinds import COLUMN, MERGED, REPLICATED, ROW
from .llama4 import FAMILY as LLAMA4
from .llama4 import TINY_MODELS as TEXT_TINY
from .sizes import cfg_get
from .table import Param, TinyModel, merged_feeds
from .wrapper import Part, Tower, wrapper_family

__all__ = ["ARCHITECTURE", "VISION", "TEXT", "vision_symbols", "VISION_DEFAULTS", "TINY_VISION",
           "TINY_MODELS", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "FAMILY"]

ARCHITECTURE = "Llama4ForConditionalGeneration"


def vision_symbols(vc: Any) -> dict[str, int]:
    """The vision tower's ``Sizes`` symbols from ``vision_config``.

    ``vH`` hidden, ``vnh`` heads, ``vhd`` head dim (``hidden_size //
    num_attention_heads``, ``Llama4VisionAttention``), ``vI`` intermediate,
    ``vPatch`` = ``num_channels * patch_size**2`` (the unfold's width),
    ``vNP`` = ``(image_size // patch_size)**2 + 1`` positions, ``vPI``/``vPO``
    the adapter's projector input/output dims, ``vO`` ``vision_output_dim``
    (the projector's input), ``vdepth`` layers.

    Raises:
        ValueError: a non-square image or patch (a list), or an adapter vLLM and
            transformers build differently (``projector_input_dim !=
            projector_output_dim``: transformers' ``fc2`` is ``[out, out]``, vLLM's
            ``[out, in]``; ``multi_modal_projector_bias``: vLLM gives the adapter
            biases, transformers does not).
    """
    image, patch = cfg_get(vc, "image_size"), cfg_get(vc, "patch_size")
    if not isinstance(image, int) or not isinstance(patch, int):
        raise ValueError(f"Llama-4 vision_config image_size={image!r}, patch_size={patch!r}: "
                         "only square images and patches (integers) are supported")
    pi, po = int(cfg_get(vc, "projector_input_dim")), int(cfg_get(vc, "projector_output_dim"))
    if pi != po:
        raise ValueError(f"Llama-4 vision_config projector_input_dim={pi} != "
                         f"projector_output_dim={po}: transformers' vision_adapter.mlp.fc2 is "
                         "[out, out] and vLLM's (mllama4.py Llama4VisionMLP) [out, in]; "
                         "supported: equal dims")
    if cfg_get(vc, "multi_modal_projector_bias", default=False):
        raise ValueError("Llama-4 vision_config multi_modal_projector_bias=true: vLLM gives "
                         "vision_adapter.mlp biases (mllama4.py Llama4VisionPixelShuffleMLP), "
                         "transformers does not; supported: false")
    H, nh = int(cfg_get(vc, "hidden_size")), int(cfg_get(vc, "num_attention_heads"))
    return {"vH": H, "vnh": nh, "vhd": H // nh, "vI": int(cfg_get(vc, "intermediate_size")),
            "vPatch": int(cfg_get(vc, "num_channels")) * patch * patch,
            "vNP": (image // patch) ** 2 + 1, "vPI": pi, "vPO": po,
            "vO": int(cfg_get(vc, "vision_output_dim")),
            "vdepth": int(cfg_get(vc, "num_hidden_layers"))}


_VISION_KEYS = {"vH": "hidden_size", "vnh": "num_attention_heads",
                "vhd": "hidden_size/num_attention_heads", "vI": "intermediate_size",
                "vPatch": "num_channels*patch_size**2", "vNP": "(image_size/patch_size)**2+1",
                "vPI": "projector_input_dim", "vPO": "projector_output_dim",
                "vO": "vision_output_dim", "vdepth": "num_hidden_layers"}

#: ``Llama4VisionConfig``'s defaults (transformers 5 ``configuration_llama4.py``).
VISION_DEFAULTS = {"hidden_size": 768, "num_hidden_layers": 34, "num_attention_heads": 16,
                   "num_channels": 3, "intermediate_size": 5632, "vision_output_dim": 7680,
                   "image_size": 448, "patch_size": 14, "projector_input_dim": 4096,
                   "projector_output_dim": 4096, "multi_modal_projector_bias": False}


def _vision_heads(s, spec) -> str | None:
    if s.vnh % spec.tp:
        return (f"vision_config.num_attention_heads={s.vnh} is not divisible by tp={spec.tp} "
                "(vLLM mllama4.py Llama4VisionAttention: QKVParallelLinear splits whole heads)")
    return None


_VB = "vision_model.model.layers.{B}"
_VA = f"{_VB}.self_attn"

#: The vision tower and the projector, in vLLM's ``named_parameters()`` order
#: (``Llama4ForConditionalGeneration`` builds ``vision_model``, then
#: ``multi_modal_projector``); names are the checkpoint's and vLLM's alike.
VISION = Tower(
    name="Llama-4 vision tower and projector",
    params=(
        Param("vision_model.class_embedding", REPLICATED, ("vH",)),
        Param("vision_model.positional_embedding_vlm", REPLICATED, ("vNP", "vH")),
        Param("vision_model.patch_embedding.linear.weight", COLUMN, ("vH", "vPatch")),
        Param("vision_model.layernorm_pre.weight", REPLICATED, ("vH",)),
        Param("vision_model.layernorm_pre.bias", REPLICATED, ("vH",)),
        Param("vision_model.layernorm_post.weight", REPLICATED, ("vH",)),
        Param("vision_model.layernorm_post.bias", REPLICATED, ("vH",)),
        # q, k and v of vnh heads each: QKVParallelLinear's boxes are merged parts q, k, v
        Param(f"{_VA}.qkv_proj.weight", MERGED, ("vH", "vH"),
              feeds=merged_feeds(*(f"{_VA}.{p}_proj.weight" for p in "qkv"))),
        Param(f"{_VA}.qkv_proj.bias", MERGED, ("vH",),
              feeds=merged_feeds(*(f"{_VA}.{p}_proj.bias" for p in "qkv"))),
        Param(f"{_VA}.o_proj.weight", ROW, ("vH", "vH"), feeds=((f"{_VA}.o_proj.weight", None),)),
        Param(f"{_VA}.o_proj.bias", REPLICATED, ("vH",)),
        Param(f"{_VB}.mlp.fc1.weight", COLUMN, ("vI", "vH")),
        Param(f"{_VB}.mlp.fc1.bias", COLUMN, ("vI",)),
        Param(f"{_VB}.mlp.fc2.weight", ROW, ("vH", "vI")),
        Param(f"{_VB}.mlp.fc2.bias", REPLICATED, ("vH",)),
        Param(f"{_VB}.input_layernorm.weight", REPLICATED, ("vH",)),
        Param(f"{_VB}.input_layernorm.bias", REPLICATED, ("vH",)),
        Param(f"{_VB}.post_attention_layernorm.weight", REPLICATED, ("vH",)),
        Param(f"{_VB}.post_attention_layernorm.bias", REPLICATED, ("vH",)),
        Param("vision_model.vision_adapter.mlp.fc1.weight", COLUMN, ("vPI", "vI")),
        Param("vision_model.vision_adapter.mlp.fc2.weight", ROW, ("vPO", "vPI")),
        Param("multi_modal_projector.linear_1.weight", COLUMN, ("H", "vO")),
    ),
    symbols=vision_symbols, keys=_VISION_KEYS, config_key="vision_config",
    hf_prefix="", vllm_prefix="", repeats={"B": "vdepth"}, checks=(_vision_heads,),
    config_defaults=VISION_DEFAULTS,
    source="vllm/model_executor/models/mllama4.py Llama4VisionModel, Llama4MultiModalProjector",
)

#: The text model under ``language_model.`` (checkpoint and vLLM alike:
#: ``Llama4ForConditionalGeneration.language_model``).
TEXT = Part(LLAMA4, "text_config",
            {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
            {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
            inherit=("tie_word_embeddings",))

#: A tiny vision tower: 4 heads of 8 over hidden 32, 2 layers, 56 px images of 14 px patches.
TINY_VISION = {"hidden_size": 32, "intermediate_size": 128, "num_attention_heads": 4,
               "num_hidden_layers": 2, "image_size": 56, "patch_size": 14,
               "projector_input_dim": 64, "projector_output_dim": 64, "vision_output_dim": 64}

#: Tiny test models (``m2nkit.adapters.tiny``): Scout's text model (every layer MoE), one layer.
TINY_MODELS = {
    "tiny-llama4-vision": TinyModel("llama4", {
        "tie_word_embeddings": False, "vision_config": TINY_VISION,
        "text_config": {**TEXT_TINY["tiny-llama4"].config, "num_hidden_layers": 1,
                        "interleave_moe_layer_step": 1}}),
}

FAMILY = wrapper_family(
    ARCHITECTURE, TEXT, (VISION,), model_types=("llama4",),
    config_defaults={"tie_word_embeddings": False}, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/mllama4.py", module=__name__,
)
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
