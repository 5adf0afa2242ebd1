"""Kimi-K2.5 (``KimiK25ForConditionalGeneration``): DeepSeek-V3's table and a MoonViT tower.

Restated from vLLM 0.33.0 ``model_executor/models/kimi_k25.py``
(``KimiK25ForConditionalGeneration``) and ``kimi_k25_vit.py``, and checked
against its real loaders (``tests/data/oracle/tiny-kimi-k25``).

**Module tree** (``KimiK25ForConditionalGeneration.__init__``, in
``named_parameters()`` order): ``vision_tower`` (``MoonViT3dPretrainedModel``),
``mm_projector`` (``KimiK25MultiModalProjector``), then ``language_model`` =
``init_vllm_registered_model(hf_config=config.text_config,
architectures=["DeepseekV2ForCausalLM"])``: DeepSeek-V3's model exactly, so
the text part is :data:`~.deepseek_v3.FAMILY` (imported, not restated) under
``language_model.`` (``families/wrapper.py``). ``load_weights`` is
``AutoWeightsLoader(self)`` with ``hf_to_vllm_mapper``: ``mm_projector.proj.0``
-> ``mm_projector.linear_1``, ``mm_projector.proj.2`` ->
``mm_projector.linear_2`` (and ``language_model.layers.`` ->
``language_model.model.layers.`` for legacy NVFP4 checkpoints only). The
published checkpoint's names are vLLM's otherwise:
``language_model.model.layers.N...``, ``language_model.lm_head.weight``,
``vision_tower.encoder.blocks.N.wqkv.weight``, ``mm_projector.proj.0.weight``
(transformers 5.24's ``conversion_mapping.py`` reads the same names for
``kimi_k25``; the project's transformers 5.12.1 has no Kimi-K2.5 class, so
this table is the only description of the trainer side: the checkpoint
reader takes the expected tensors from it, ``hf_checkpoint._table_only_family``).

**Vision tower** (:data:`VISION`, ``kimi_k25_vit.py``): ``patch_embed.proj``
(``Conv2dLayer(3, D, patch, patch)``, weight + bias) and
``patch_embed.pos_emb.weight [h, w, D]`` (``Learnable2DInterpPosEmbDivided_fixed``;
``h``/``w`` from ``init_pos_emb_height``/``_width``, the published
spelling, which ``_get_pos_emb_size`` reads first, else ``pos_emb_*``), whole;
per block (``MoonViTEncoderLayer``) ``norm0``, ``norm1`` (LayerNorm, weight +
bias, whole), ``mlp.fc0`` (``ColumnParallelLinear``), ``mlp.fc1``
(``RowParallelLinear``, bias whole), ``wqkv`` (``QKVParallelLinear`` with as
many KV heads as heads, fed by the checkpoint's fused ``wqkv``: kind
``FUSED_QKV``, rank ``r`` its q heads' rows, then k, then v; bias alike),
``wo`` (``RowParallelLinear``, bias whole); ``encoder.final_layernorm``.
Every split layer is built with ``disable_tp=use_data_parallel``, and
``is_vit_use_data_parallel(num_heads)`` (``models/vision.py``) is true when
the heads do not divide by tp (or ``mm_encoder_tp_mode="data"``, not vLLM's
default and not in this table): the tower is then **whole on every worker**
(kinds ``VISION_FUSED_QKV``/``VISION_COLUMN``/``VISION_ROW``,
:class:`~.kinds.VisionTowerSplit`; the tiny tower's 2 heads at tp 4
show it in the dumps). Kimi-K2.5's 16 heads split at tp 1/2/4/8/16.

**Projector** (:data:`PROJECTOR`, ``KimiK25MultiModalProjector``,
``mm_projector_type: patchmerger``): ``pre_norm`` (LayerNorm over ``D``),
``linear_1 [D*kh*kw, D*kh*kw]``, ``linear_2 [H, D*kh*kw]``
(``ReplicatedLinear``, with biases), all whole. ``patchmergerv2`` (no biases,
no ``pre_norm``, a ``post_norm``) is refused.

**dtype**: the tower and the projector are cast to the model dtype
(``.to(dtype=model_config.dtype)``); the text part is DeepSeek-V3's (the
router's ``e_score_correction_bias`` float32).

**Quantization**: the published config carries an int4 compressed-tensors
``text_config.quantization_config`` (``pack-quantized``, group size 32). No
m2nkit layout describes packed int4 weights, so it is refused by every path
(``quant.compressed_tensors_refusal``: the checkpoint reader, hence every
``m2nkit plan`` layout, and this family's ``sizes``); what is planned is the
bf16 form, the same config without ``quantization_config``. Any other
quantization is refused too: vLLM would hand it to the tower as well
(``_maybe_ignore_quant_config`` drops only compressed-tensors), which the
table does not model.

**Config keys**: vLLM reads the vision sizes through transformers 5.24's
``Kimi_K25VisionConfig`` (``hidden_size``, ``num_attention_heads``,
``num_hidden_layers``, ``intermediate_size``, ``patch_size``,
``merge_kernel_size``; defaults 1152/16/27/4304/14/(2, 2), :data:`VISION_DEFAULTS`).
The published ``config.json`` still spells them in the hub's older schema
(``vt_hidden_size``, ...), which that class does not read: vLLM builds the
defaults, which are the published sizes (``tests/adapters/test_kimi_k25.py``
pins the two equal), and so does this table.

**FSDP2** (transformers 5.24+'s ``Kimi_K25ForConditionalGeneration``):
its in-memory names are renamed to the checkpoint's (:data:`IN_MEMORY_RENAMES`)
and each block's in-memory ``attn.q_proj``/``k_proj``/``v_proj`` are re-fused
into the checkpoint's ``wqkv`` row by row (:data:`WQKV_SPLIT`), both read
from transformers' ``conversion_mapping.py`` (``kimi_k25``) and held against
vLLM's own load by ``tests/integration/test_fsdp2_kimi_k25.py``.

**Parallel sizes**: the text model's heads must divide by tp (vLLM
``ModelConfig.verify_with_parallel_config``; MLA's column splits alone would
take the tiny model's 4 heads at tp 8). Found by tracing vLLM's own loaders
under transformers 5.24 (``.venv-tf``; ``tests/integration/test_traced_kimi_k25.py``:
this venv's transformers 5.12.1 cannot import vLLM's ``kimi_k25.py``), where
the trace equals this table at tp 1/2/4, EP 2/4 and dp 2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .deepseek_v3 import FAMILY as DEEPSEEK_V3
from .kinds import REPLICATED, VISION_COLUMN, VISION_FUSED_QKV, VISION_ROW
from .quant import compressed_tensors_refusal
from .sizes import Sizes, cfg_get
from .table import Param, SplitOnLoad
from .wrapper import Part, Tower, wrapper_family

__all__ = ["ARCHITECTURE", "PREFIXES", "TEXT", "VISION", "PROJECTOR", "vision_symbols",
           "VISION_DEFAULTS", "TINY_MODELS", "IN_MEMORY_RENAMES", "WQKV_SPLIT", "HF_NAMES",
           "VLLM_PARAMS", "CONDITIONS", "FAMILY"]

ARCHITECTURE = "KimiK25ForConditionalGeneration"

#: DeepSeek-V3's names -> Kimi-K2.5's, the same on the wire (the published
#: checkpoint) and in vLLM (``language_model = DeepseekV2ForCausalLM``).
PREFIXES = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}

#: The text part: DeepSeek-V3 under ``language_model.``. Kimi-K2.5 ships no MTP
#: layer (``num_nextn_predict_layers: 0``), so none is listed for config-only plans;
#: the skip rule stays (a checkpoint holding one plans it as skipped).
TEXT = Part(replace(DEEPSEEK_V3, skipped_layers=None), "text_config", PREFIXES, PREFIXES)

#: ``Kimi_K25VisionConfig``'s defaults (transformers 5.24
#: ``models/kimi_k25/configuration_kimi_k25.py``), the published sizes.
VISION_DEFAULTS = {"hidden_size": 1152, "num_attention_heads": 16, "num_hidden_layers": 27,
                   "intermediate_size": 4304, "patch_size": 14, "pos_emb_height": 64,
                   "pos_emb_width": 64, "merge_kernel_size": [2, 2]}

#: Variants vLLM's MoonViT builds with other parameters than this table's: key ->
#: (value vLLM assumes when absent, i.e. the one this table describes).
_FIXED = {"mm_projector_type": "patchmerger", "norm_type": "layernorm", "mlp_type": "mlp2",
          "attn_bias": True, "linear_bias": True, "patch_embed_proj_bias": True,
          "pos_emb_type": "divided_fixed"}


def _vision_key(vc: Any, key: str) -> int:
    return int(cfg_get(vc, key, default=VISION_DEFAULTS[key]))


def vision_symbols(vc: Any) -> dict[str, int]:
    """The tower's ``Sizes`` symbols from ``vision_config``.

    ``vH`` hidden (``D``), ``vnh`` heads, ``vhd`` head dim (``qkv_hidden_size
    // num_heads``; ``qkv_hidden_size`` must be ``None`` or ``D``), ``vI`` MLP
    intermediate, ``vdepth`` blocks, ``vP`` patch, ``vGH``/``vGW`` the learned
    position grid (``init_pos_emb_height``/``_width``, else ``pos_emb_*``),
    ``vM`` merged width ``D * kh * kw`` (``merge_kernel_size``).

    Raises:
        ValueError: a variant with other parameters (``mm_projector_type``
            ``patchmergerv2``, ``norm_type`` rmsnorm, no biases, ...), a
            non-square or non-int patch, or a ``qkv_hidden_size`` other than
            ``hidden_size``: the key, its value and what is supported.
    """
    for key, value in _FIXED.items():
        got = cfg_get(vc, key, default=value)
        if got != value:
            raise ValueError(f"{ARCHITECTURE}: vision_config {key}={got!r} is not supported "
                             f"by m2nkit's table (vLLM kimi_k25_vit.py builds other "
                             f"parameters for it); supported: {key}={value!r}")
    D = _vision_key(vc, "hidden_size")
    qkv = cfg_get(vc, "qkv_hidden_size", default=None)
    if qkv is not None and int(qkv) != D:
        raise ValueError(f"{ARCHITECTURE}: vision_config qkv_hidden_size={qkv} != hidden_size="
                         f"{D} is not supported by m2nkit's table; supported: qkv_hidden_size "
                         "null (= hidden_size), as Kimi-K2.5 ships")
    patch = cfg_get(vc, "patch_size", default=VISION_DEFAULTS["patch_size"])
    if not isinstance(patch, int):
        raise ValueError(f"{ARCHITECTURE}: vision_config patch_size={patch!r}: m2nkit's table "
                         "takes an integer (square) patch, as Kimi-K2.5 ships")
    kh, kw = cfg_get(vc, "merge_kernel_size", default=VISION_DEFAULTS["merge_kernel_size"])
    nh = _vision_key(vc, "num_attention_heads")
    grid = {axis: int(cfg_get(vc, f"init_pos_emb_{axis}", f"pos_emb_{axis}",
                              default=VISION_DEFAULTS[f"pos_emb_{axis}"]))
            for axis in ("height", "width")}
    return {"vH": D, "vnh": nh, "vhd": D // nh, "vI": _vision_key(vc, "intermediate_size"),
            "vdepth": _vision_key(vc, "num_hidden_layers"), "vP": patch,
            "vGH": grid["height"], "vGW": grid["width"], "vM": D * int(kh) * int(kw)}


_VISION_KEYS = {"vH": "hidden_size", "vnh": "num_attention_heads",
                "vhd": "hidden_size/num_attention_heads", "vI": "intermediate_size",
                "vdepth": "num_hidden_layers", "vP": "patch_size", "vGH": "init_pos_emb_height",
                "vGW": "init_pos_emb_width", "vM": "hidden_size*merge_kernel_size"}

#: The tower's split layers: their kind when the heads divide by tp, whole otherwise.
_QKV, _COL, _ROW = VISION_FUSED_QKV, VISION_COLUMN, VISION_ROW
_B = "encoder.blocks.{B}"

#: MoonViT, in vLLM's ``named_parameters()`` order; names relative to ``vision_tower.``
#: (the same on the wire and in vLLM).
VISION = Tower(
    name="Kimi-K2.5 MoonViT vision tower",
    params=(
        Param("patch_embed.proj.weight", REPLICATED, ("vH", "3", "vP", "vP")),
        Param("patch_embed.proj.bias", REPLICATED, ("vH",)),
        Param("patch_embed.pos_emb.weight", REPLICATED, ("vGH", "vGW", "vH")),
        Param(f"{_B}.norm0.weight", REPLICATED, ("vH",)),
        Param(f"{_B}.norm0.bias", REPLICATED, ("vH",)),
        Param(f"{_B}.norm1.weight", REPLICATED, ("vH",)),
        Param(f"{_B}.norm1.bias", REPLICATED, ("vH",)),
        Param(f"{_B}.mlp.fc0.weight", _COL, ("vI", "vH")),
        Param(f"{_B}.mlp.fc0.bias", _COL, ("vI",)),
        Param(f"{_B}.mlp.fc1.weight", _ROW, ("vH", "vI")),
        Param(f"{_B}.mlp.fc1.bias", REPLICATED, ("vH",)),
        Param(f"{_B}.wqkv.weight", _QKV, ("vnh", "vhd", "vH")),
        Param(f"{_B}.wqkv.bias", _QKV, ("vnh", "vhd")),
        Param(f"{_B}.wo.weight", _ROW, ("vH", "vnh*vhd")),
        Param(f"{_B}.wo.bias", REPLICATED, ("vH",)),
        Param("encoder.final_layernorm.weight", REPLICATED, ("vH",)),
        Param("encoder.final_layernorm.bias", REPLICATED, ("vH",)),
    ),
    symbols=vision_symbols, keys=_VISION_KEYS, config_key="vision_config",
    hf_prefix="vision_tower.", vllm_prefix="vision_tower.", repeats={"B": "vdepth"},
    config_defaults=VISION_DEFAULTS,
    source="vllm/model_executor/models/kimi_k25_vit.py MoonViT3dPretrainedModel",
)

#: The patch-merger projector; vLLM's ``linear_1``/``linear_2`` are the checkpoint's
#: ``proj.0``/``proj.2`` (``hf_to_vllm_mapper``). Names relative to ``mm_projector.``.
PROJECTOR = Tower(
    name="Kimi-K2.5 projector",
    params=(
        Param("pre_norm.weight", REPLICATED, ("vH",)),
        Param("pre_norm.bias", REPLICATED, ("vH",)),
        Param("linear_1.weight", REPLICATED, ("vM", "vM"), feeds=(("proj.0.weight", None),)),
        Param("linear_1.bias", REPLICATED, ("vM",), feeds=(("proj.0.bias", None),)),
        Param("linear_2.weight", REPLICATED, ("H", "vM"), feeds=(("proj.2.weight", None),)),
        Param("linear_2.bias", REPLICATED, ("H",), feeds=(("proj.2.bias", None),)),
    ),
    symbols=lambda vc: {}, keys={}, config_key="vision_config",
    hf_prefix="mm_projector.", vllm_prefix="mm_projector.",
    config_defaults=VISION_DEFAULTS,
    source="vllm/model_executor/models/kimi_k25_vit.py KimiK25MultiModalProjector",
)

#: No tiny model m2nkit builds: transformers 5.12.1 has no Kimi-K2.5 class.
#: ``tests/data/oracle/tiny-kimi-k25`` is written by transformers 5.24+'s own model and
#: ``save_pretrained`` under .venv-tf (``regenerate.py``, ``_kimi_k25``).
TINY_MODELS: dict = {}

_WRAPPED = wrapper_family(
    ARCHITECTURE, TEXT, (VISION, PROJECTOR), model_types=("kimi_k25",),
    vllm_source="vllm/model_executor/models/kimi_k25.py", module=__name__,
)


def refusal(config: Any) -> str | None:
    """Why the table cannot plan ``config``: a quantized text model (``None``: bf16)."""
    why = compressed_tensors_refusal(config, ARCHITECTURE)
    if why:
        return why
    text = cfg_get(config, "text_config", default={})
    q = cfg_get(text, "quantization_config", default=None) or cfg_get(
        config, "quantization_config", default=None)
    if q:
        method = q.get("quant_method") if hasattr(q, "get") else getattr(q, "quant_method", q)
        return (f"{ARCHITECTURE}: quantization_config quant_method {method!r} is not supported "
                "(vLLM would quantize the vision tower too, which m2nkit's table does not "
                "model); supported: the unquantized (bf16) form, the same config without "
                "quantization_config")
    return None


def sizes(config: Any) -> Sizes:
    """DeepSeek-V3's sizes of ``text_config`` plus the tower's symbols.

    Raises:
        ValueError: a quantized config (:func:`refusal`), or what the text
            family or :func:`vision_symbols` refuse.
    """
    why = refusal(config)
    if why:
        raise ValueError(why)
    return _WRAPPED.sizes(config)


def _heads_divide(s: Sizes, spec: Any) -> str | None:
    """vLLM ``ModelConfig.verify_with_parallel_config`` (``config/model.py``): the text
    model's heads must divide by tp (MLA's column splits alone would not say so)."""
    if s.nh % spec.tp:
        return (f"text_config.num_attention_heads={s.nh} is not divisible by tp={spec.tp} "
                "(vLLM ModelConfig.verify_with_parallel_config refuses it)")
    return None


_L = r"^model\.vision_tower\.layers\.(\d+)\."
_BLOCK = r"vision_tower.encoder.blocks.\1."

#: transformers 5.24+'s in-memory names of ``Kimi_K25ForConditionalGeneration`` ->
#: the checkpoint's, in order: the inverse of its ``conversion_mapping.py``
#: ``kimi_k25`` renames (``language_model.model`` -> ``model.language_model``;
#: per vision block ``norm0``/``norm1`` -> ``norm1``/``norm2``, ``mlp.fc0``/``fc1``
#: -> ``fc1``/``fc2``, ``wo`` -> ``attn.proj``; ``vision_tower.encoder`` ->
#: ``model.vision_tower``, ``blocks`` -> ``layers``; ``mm_projector.proj.0``/``.2``
#: -> ``model.mm_projector.in_proj``/``out_proj``; ``pos_emb.weight`` ->
#: ``pos_emb.position_embeddings``). Every pattern starts at an in-memory root
#: (``model.``, ``lm_head.``), which no checkpoint name has, so each applies once.
IN_MEMORY_RENAMES = (
    (_L + r"norm1\.", _BLOCK + "norm0."),
    (_L + r"norm2\.", _BLOCK + "norm1."),
    (_L + r"mlp\.fc1\.", _BLOCK + "mlp.fc0."),
    (_L + r"mlp\.fc2\.", _BLOCK + "mlp.fc1."),
    (_L + r"attn\.proj\.", _BLOCK + "wo."),
    (_L, _BLOCK),
    (r"^model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$",
     "vision_tower.patch_embed.pos_emb.weight"),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
)

#: transformers 5.24+ cuts each block's ``wqkv`` into ``attn.q_proj``/``k_proj``/``v_proj``
#: as it loads and reorders q's and k's rows per head for its rotary embedding
#: (``conversion_mapping.py`` ``kimi_k25``: ``Chunk(dim=0)``, then ``PermuteForRope``
#: over ``vision_config.num_attention_heads``); the wire is the checkpoint's ``wqkv``.
WQKV_SPLIT = SplitOnLoad(
    pattern=r"(?P<prefix>vision_tower\.encoder\.blocks\.\d+)\.attn\.(?P<part>[qkv]_proj)"
            r"\.(?P<leaf>weight|bias)",
    wire_leaf="wqkv", parts=("q_proj", "k_proj", "v_proj"), rope=("q_proj", "k_proj"),
    heads=lambda config: _vision_key(cfg_get(config, "vision_config", default={}),
                                     "num_attention_heads"))

FAMILY = replace(_WRAPPED, sizes=sizes, checks=(*_WRAPPED.checks, _heads_divide),
                 hf=replace(_WRAPPED.hf, renames=(*IN_MEMORY_RENAMES, *_WRAPPED.hf.renames),
                            split_on_load=(WQKV_SPLIT,)))
#: The composed pieces, under the names every family module has.
HF_NAMES, VLLM_PARAMS, CONDITIONS = FAMILY.hf, FAMILY.params, FAMILY.conditions
