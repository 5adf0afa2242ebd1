"""Megatron-Core parameter names -> wire tensors: one table per model family.

A Megatron-Core ``GPTModel`` names its tensors its own way
(``decoder.layers.{L}.self_attention.linear_qkv.weight``) and fuses some
(``linear_qkv``: q, k and v; ``linear_fc1``: gate and up); the wire carries
Hugging Face tensors. Each row here (:class:`~.layout.MegatronName`) says which
wire tensor(s) one Megatron tensor holds and by which split
(:mod:`.layout`), so the live source, the ``megatron:`` dry-run spec and
the Bridge checks read one table.

The tables live with the Megatron adapter, which imports the families for
their HF names (``m2nkit.adapters.families.llama``: ``ATTENTION``, ``MLP``),
never the reverse: a family module knows nothing of Megatron. The split
kinds are the families' (``REPLICATED``, ``ROW``, ``VOCAB``, ``QKV`` of
``m2nkit.adapters.families.kinds``) plus the splits only Megatron makes
(``GATED_FC1``, ``EXPERT_FC1``, ``EXPERT_FC2`` of :mod:`.layout`).

The live source reads its names from Megatron-Bridge's registry where Bridge has
a bridge (:mod:`.registry`); these tables are for the dry run and for
architectures without one (Mixtral), and ``tests/integration/test_megatron_source.py``
holds them equal to the registry.

Families with a table: Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5,
GLM-4.7-Flash, Qwen3-VL, Qwen3-VL-MoE (the
families Megatron-Bridge 0.6.2 builds with these names:
``LlamaBridge``, ``Qwen2Bridge``, ``Qwen3Bridge``, ``Qwen3MoEBridge``,
``MixtralBridge`` ``mapping_registry``; ``tests/integration/test_megatron_names.py``
holds them against Bridge's registries; ``DeepSeekV3Bridge``), and Qwen3-VL / Qwen3-VL-MoE
(``Qwen3VLBridge``, ``Qwen3VLMoEBridge``: the vision tower and the language model under
its prefix, :func:`qwen3_vl_names`; tests/integration/test_megatron_qwen3_vl.py holds the
language model against the registry, the tower only in the dry run). The others
(GPT-OSS, Gemma 2/3, GLM-4.7-Flash/5, Qwen3-Next/3.5) have none yet: a Megatron trainer of them is refused with a
message naming the families that have one.
"""

from __future__ import annotations

from typing import Any

from ..families.kinds import COLUMN, QKV, REPLICATED, ROW, VOCAB
from ..families.llama import ATTENTION, MLP
from .layout import EXPERT_FC1, EXPERT_FC2, GATED_FC1, QKV_CONCAT, MegatronName

__all__ = ["gpt_model_names", "mla_names", "LLAMA", "QWEN2", "QWEN3", "QWEN3_MOE", "MIXTRAL",
           "DEEPSEEK_V3", "GLM4_MOE", "GLM4_MOE_LITE", "glm4_moe_names", "qwen3_vl_names",
           "QWEN3_VL", "QWEN3_VL_MOE", "tower_wires", "without_tower",
           "MEGATRON_NAMES", "megatron_names", "table_name"]


def gpt_model_names(*, qk_norm: bool = False, mlp: str | None = MLP,
                    moe: str | None = None) -> tuple[MegatronName, ...]:
    """Megatron-Core ``GPTModel`` names -> wire tensors, for Llama and the families built on it.

    Local layer spec names first, TransformerEngine spec names second
    (megatron-core ``models/gpt/gpt_layer_specs.py``; the same pairs as
    Megatron-Bridge's ``LlamaBridge``/``Qwen3Bridge``/``Qwen3MoEBridge``
    ``mapping_registry``). ``{L}`` is the layer index in the Megatron
    name (local to a pipeline chunk) and the global layer in the wire name;
    the live source maps one to the other through each layer's
    ``layer_number``. Biases (``linear_qkv.bias``: Megatron ``add_qkv_bias``;
    ``linear_proj.bias``, ``linear_fc1/fc2.bias``: ``add_bias_linear``) are
    listed and sent when the model has them.

    Args:
        qk_norm: Qwen3's ``q_norm``/``k_norm`` (Megatron ``q_layernorm``/``k_layernorm``).
        mlp: HF prefix of a dense layer's MLP (``None``: no dense layers).
        moe: HF prefix of a MoE layer's block (``model.layers.{L}.mlp``;
            Mixtral ``model.layers.{L}.block_sparse_moe``): router and stacked
            experts (``SequentialMLP`` ``local_experts.{i}``, ``TEGroupedMLP``
            ``weight{i}``).
    """
    N = MegatronName
    A = ATTENTION
    d = "decoder.layers.{L}"
    at = f"{d}.self_attention"
    qkv = {p: f"{A}.{p}_proj.weight" for p in "qkv"}
    out = [
        N("embedding.word_embeddings.weight", VOCAB, "model.embed_tokens.weight"),
        N((f"{d}.input_layernorm.weight", f"{at}.linear_qkv.layer_norm_weight"), REPLICATED,
          "model.layers.{L}.input_layernorm.weight", norm=True),
        N(f"{at}.linear_qkv.weight", QKV, qkv),
        N(f"{at}.linear_qkv.bias", QKV, {p: f"{A}.{p}_proj.bias" for p in "qkv"}),
    ]
    if qk_norm:
        out += [N(f"{at}.q_layernorm.weight", REPLICATED, f"{A}.q_norm.weight", norm=True),
                N(f"{at}.k_layernorm.weight", REPLICATED, f"{A}.k_norm.weight", norm=True)]
    out += [
        N(f"{at}.linear_proj.weight", ROW, f"{A}.o_proj.weight"),
        N(f"{at}.linear_proj.bias", REPLICATED, f"{A}.o_proj.bias"),
        N((f"{d}.pre_mlp_layernorm.weight", f"{d}.mlp.linear_fc1.layer_norm_weight"), REPLICATED,
          "model.layers.{L}.post_attention_layernorm.weight", norm=True),
    ]
    if mlp is not None:
        out += [
            N(f"{d}.mlp.linear_fc1.weight", GATED_FC1,
              {"gate": f"{mlp}.gate_proj.weight", "up": f"{mlp}.up_proj.weight"}),
            N(f"{d}.mlp.linear_fc1.bias", GATED_FC1,
              {"gate": f"{mlp}.gate_proj.bias", "up": f"{mlp}.up_proj.bias"}),
            N(f"{d}.mlp.linear_fc2.weight", ROW, f"{mlp}.down_proj.weight"),
            N(f"{d}.mlp.linear_fc2.bias", REPLICATED, f"{mlp}.down_proj.bias"),
        ]
    if moe is not None:
        ex = f"{d}.mlp.experts"
        out += [
            N(f"{d}.mlp.router.weight", REPLICATED, f"{moe}.gate.weight"),
            N((f"{ex}.local_experts.{{i}}.linear_fc1.weight", f"{ex}.linear_fc1.weight{{i}}"),
              EXPERT_FC1, f"{moe}.experts.gate_up_proj.weight"),
            N((f"{ex}.local_experts.{{i}}.linear_fc2.weight", f"{ex}.linear_fc2.weight{{i}}"),
              EXPERT_FC2, f"{moe}.experts.down_proj.weight"),
        ]
    out += [
        N("decoder.final_layernorm.weight", REPLICATED, "model.norm.weight", norm=True),
        N("output_layer.weight", VOCAB, "lm_head.weight"),
    ]
    return tuple(out)


#: Llama (Megatron-Bridge ``LlamaBridge``).
LLAMA = gpt_model_names()
#: Qwen2: Llama's; its q/k/v biases are ``linear_qkv.bias`` (Megatron
#: ``add_qkv_bias``; Megatron-Bridge ``Qwen2Bridge``).
QWEN2 = gpt_model_names()
#: Qwen3: Llama's plus ``q_layernorm``/``k_layernorm`` (Megatron-Bridge ``Qwen3Bridge``).
QWEN3 = gpt_model_names(qk_norm=True)
#: Qwen3-MoE: Qwen3's attention, MoE layers' router and stacked experts, dense
#: layers' (``mlp_only_layers``) gated MLP (Megatron-Bridge ``Qwen3MoEBridge``).
QWEN3_MOE = gpt_model_names(qk_norm=True, moe=MLP)
#: Mixtral: Llama's attention, every layer a MoE block ``block_sparse_moe``
#: (Megatron-Bridge ``MixtralBridge``).
MIXTRAL = gpt_model_names(mlp=None, moe="model.layers.{L}.block_sparse_moe")



def mla_names() -> tuple[MegatronName, ...]:
    """DeepSeek-V3's Megatron-Core names (MLA, dense first layers, shared and routed experts).

    megatron-core ``transformer/multi_latent_attention.py`` (``MLASelfAttention``) with
    the local layer spec (``gpt_layer_specs.py`` ``get_gpt_decoder_block_spec``,
    ``use_transformer_engine=False``): ``linear_q_down_proj`` and
    ``linear_kv_down_proj`` are ``ColumnParallelLinear`` (``gather_output=False``:
    rows split over tp; the TransformerEngine spec builds a duplicated ``TELinear``
    instead), ``linear_q_up_proj``/``linear_kv_up_proj`` column, ``linear_proj``
    row; ``q_lora_rank: null`` builds ``linear_q_proj`` (column) and no
    ``q_layernorm``. The MoE router's ``expert_bias`` is a persistent fp32
    buffer (``moe/router.py``), HF ``e_score_correction_bias``; shared experts
    are a gated MLP over tp (``moe/shared_experts.py``). The same pairs as
    Megatron-Bridge's ``DeepSeekV3Bridge`` (``deepseek/common.py``).
    """
    N = MegatronName
    A = ATTENTION
    d = "decoder.layers.{L}"
    at = f"{d}.self_attention"
    mlp = "model.layers.{L}.mlp"
    ex = f"{d}.mlp.experts"
    return (
        N("embedding.word_embeddings.weight", VOCAB, "model.embed_tokens.weight"),
        N(f"{d}.input_layernorm.weight", REPLICATED, "model.layers.{L}.input_layernorm.weight",
          norm=True),
        N(f"{at}.linear_q_proj.weight", COLUMN, f"{A}.q_proj.weight"),
        N(f"{at}.linear_q_down_proj.weight", COLUMN, f"{A}.q_a_proj.weight"),
        N((f"{at}.q_layernorm.weight", f"{at}.linear_q_up_proj.layer_norm_weight"), REPLICATED,
          f"{A}.q_a_layernorm.weight", norm=True),
        N(f"{at}.linear_q_up_proj.weight", COLUMN, f"{A}.q_b_proj.weight"),
        N(f"{at}.linear_kv_down_proj.weight", COLUMN, f"{A}.kv_a_proj_with_mqa.weight"),
        N((f"{at}.kv_layernorm.weight", f"{at}.linear_kv_up_proj.layer_norm_weight"), REPLICATED,
          f"{A}.kv_a_layernorm.weight", norm=True),
        N(f"{at}.linear_kv_up_proj.weight", COLUMN, f"{A}.kv_b_proj.weight"),
        N(f"{at}.linear_proj.weight", ROW, f"{A}.o_proj.weight"),
        N((f"{d}.pre_mlp_layernorm.weight", f"{d}.mlp.linear_fc1.layer_norm_weight"), REPLICATED,
          "model.layers.{L}.post_attention_layernorm.weight", norm=True),
        N(f"{d}.mlp.linear_fc1.weight", GATED_FC1,
          {"gate": f"{mlp}.gate_proj.weight", "up": f"{mlp}.up_proj.weight"}),
        N(f"{d}.mlp.linear_fc2.weight", ROW, f"{mlp}.down_proj.weight"),
    ) + _moe_with_bias_and_shared() + (
        N("decoder.final_layernorm.weight", REPLICATED, "model.norm.weight", norm=True),
        N("output_layer.weight", VOCAB, "lm_head.weight"),
    )


def _moe_with_bias_and_shared() -> tuple[MegatronName, ...]:
    """A MoE layer with a router ``expert_bias`` (persistent fp32 buffer, megatron-core
    ``moe/router.py``; HF ``e_score_correction_bias``), routed experts and shared experts
    (a gated MLP over tp, ``moe/shared_experts.py``): DeepSeek-V3's and GLM-4.5's."""
    N = MegatronName
    d = "decoder.layers.{L}"
    mlp = "model.layers.{L}.mlp"
    ex = f"{d}.mlp.experts"
    return (
        N(f"{d}.mlp.router.weight", REPLICATED, f"{mlp}.gate.weight"),
        N(f"{d}.mlp.router.expert_bias", REPLICATED, f"{mlp}.gate.e_score_correction_bias",
          buffer=True),
        N((f"{ex}.local_experts.{{i}}.linear_fc1.weight", f"{ex}.linear_fc1.weight{{i}}"),
          EXPERT_FC1, f"{mlp}.experts.gate_up_proj.weight"),
        N((f"{ex}.local_experts.{{i}}.linear_fc2.weight", f"{ex}.linear_fc2.weight{{i}}"),
          EXPERT_FC2, f"{mlp}.experts.down_proj.weight"),
        N(f"{d}.mlp.shared_experts.linear_fc1.weight", GATED_FC1,
          {"gate": f"{mlp}.shared_experts.gate_proj.weight",
           "up": f"{mlp}.shared_experts.up_proj.weight"}),
        N(f"{d}.mlp.shared_experts.linear_fc2.weight", ROW,
          f"{mlp}.shared_experts.down_proj.weight"),
    )


def glm4_moe_names() -> tuple[MegatronName, ...]:
    """GLM-4.5's Megatron-Core names: Qwen3's attention (fused QKV with its bias, q/k
    norms), dense first layers (``first_k_dense_replace``), MoE layers with a router
    ``expert_bias`` and shared experts. The same pairs as Megatron-Bridge's ``GLM45Bridge``
    (``glm/glm45_bridge.py``), which is read live; for the dry run only: that
    registry names routed experts under TEGroupedMLP's ``linear_fc1.weight{i}`` only, so
    Bridge cannot load the local spec's ``local_experts.{i}`` (docs/megatron.md, Limits)."""
    base = [e for e in gpt_model_names(qk_norm=True) if not e.megatron[0].startswith(
        ("output_layer", "decoder.final_layernorm"))]
    tail = [e for e in gpt_model_names(qk_norm=True) if e.megatron[0].startswith(
        ("output_layer", "decoder.final_layernorm"))]
    return tuple(base) + _moe_with_bias_and_shared() + tuple(tail)


#: DeepSeek-V3 / Kimi-K2 (Megatron-Bridge ``DeepSeekV3Bridge``).
DEEPSEEK_V3 = mla_names()

#: GLM-4.7-Flash (Megatron-Bridge ``GLM47FlashBridge``, ``glm/glm47_flash_bridge.py``): its
#: registry is DeepSeek-V3's (``deepseek/common.py`` ``get_common_mapping_list``), so the
#: same names: MLA with q LoRA, dense first layers, MoE with a router ``expert_bias``
#: and shared experts.
GLM4_MOE_LITE = DEEPSEEK_V3

#: GLM-4.5 / GLM-4.6 (Megatron-Bridge ``GLM45Bridge``).
GLM4_MOE = glm4_moe_names()

def _language_model(table: tuple[MegatronName, ...]) -> tuple[MegatronName, ...]:
    """A GPTModel table as a VLM's ``language_model`` holds it: Megatron names under
    ``language_model.`` (Bridge ``Qwen3VLModel.language_model``, a ``Qwen3VLGPTModel``),
    wire names under the checkpoint's ``model.language_model.`` (``lm_head.`` unchanged;
    transformers 5 on disk, ``families/qwen3_vl.py`` ``WRAPPER_PREFIXES``)."""
    def wire(t: str) -> str:
        return "model.language_model." + t[len("model."):] if t.startswith("model.") else t

    return tuple(MegatronName(tuple("language_model." + m for m in e.megatron), e.rule,
                              {p: wire(w) for p, w in e.wires.items()} if None not in e.wires
                              else wire(e.wires[None]), norm=e.norm, buffer=e.buffer)
                 for e in table)


def _vision_merger(megatron: str, wire: str) -> list[MegatronName]:
    """A Qwen3-VL patch merger (Bridge ``modelling_qwen3_vl/utils.py``: ``patch_norm``,
    ``linear_fc1`` column-parallel with ``gather_output=False``, ``linear_fc2``
    row-parallel with ``input_is_parallel=True``, both with biases)."""
    N = MegatronName
    return [N(f"{megatron}.patch_norm.weight", REPLICATED, f"{wire}.norm.weight", norm=True),
            N(f"{megatron}.patch_norm.bias", REPLICATED, f"{wire}.norm.bias"),
            N(f"{megatron}.linear_fc1.weight", COLUMN, f"{wire}.linear_fc1.weight"),
            N(f"{megatron}.linear_fc1.bias", COLUMN, f"{wire}.linear_fc1.bias"),
            N(f"{megatron}.linear_fc2.weight", ROW, f"{wire}.linear_fc2.weight"),
            N(f"{megatron}.linear_fc2.bias", REPLICATED, f"{wire}.linear_fc2.bias")]


def _vit_sublayer(norm: str, first: str, layout, second: str, hf_norm: str, hf_first: str,
                  hf_second: str) -> list[MegatronName]:
    """One half of a ViT layer (megatron-core ``models/vision/vit_layer_specs.py``), the
    attention or the MLP: a LayerNorm, weight and bias (local spelling ``norm``,
    TransformerEngine's fused ``first.layer_norm_*``), the ``first`` linear split by
    ``layout`` (weight and bias alike), the row-parallel ``second`` linear (its bias
    replicated: megatron-core ``RowParallelLinear`` adds it after the reduction). ``hf_*``:
    the wire (HF) prefixes."""
    N = MegatronName
    return [N((f"{norm}.weight", f"{first}.layer_norm_weight"), REPLICATED,
              f"{hf_norm}.weight", norm=True),
            N((f"{norm}.bias", f"{first}.layer_norm_bias"), REPLICATED, f"{hf_norm}.bias"),
            N(f"{first}.weight", layout, f"{hf_first}.weight"),
            N(f"{first}.bias", layout, f"{hf_first}.bias"),
            N(f"{second}.weight", ROW, f"{hf_second}.weight"),
            N(f"{second}.bias", REPLICATED, f"{hf_second}.bias")]


def qwen3_vl_names(text: tuple[MegatronName, ...]) -> tuple[MegatronName, ...]:
    """Qwen3-VL's Megatron names: Bridge ``Qwen3VLModel``'s ``vision_model`` and its
    ``language_model`` (``text``, a GPTModel table, under the VLM prefixes).

    The vision tower (``Qwen3VLVisionModel``; Megatron-Bridge 0.6.2
    ``qwen_vl/qwen3_vl_bridge.py`` ``mapping_registry``): ``patch_embed.proj`` (a
    Conv3d) and ``pos_embed`` replicated (``ReplicatedMapping``); per block ``{B}`` a
    ViT layer (megatron-core ``models/vision/vit_layer_specs.py``): LayerNorm weight and
    bias (local spelling ``input_layernorm``/``pre_mlp_layernorm``, TransformerEngine
    ``linear_qkv.layer_norm_*``/``linear_fc1.layer_norm_*``), ``linear_qkv`` from HF's one
    ``attn.qkv`` (``ConcatenatedQKVMapping``: :data:`~.layout.QKV_CONCAT`, every head its
    own query group), ``linear_proj`` row, a non-gated ``linear_fc1`` column (bias
    split with it) and ``linear_fc2`` row (:func:`_vit_sublayer`); the merger and the deepstack mergers
    (:func:`_vision_merger`). The tower lives on the first pipeline stage only
    (:func:`~.layout.wire_stage`).
    """
    N = MegatronName
    v, w = "vision_model", "model.visual"
    d, b = f"{v}.decoder.layers.{{B}}", f"{w}.blocks.{{B}}"
    at = f"{d}.self_attention"
    out = [
        N(f"{v}.patch_embed.proj.weight", REPLICATED, f"{w}.patch_embed.proj.weight"),
        N(f"{v}.patch_embed.proj.bias", REPLICATED, f"{w}.patch_embed.proj.bias"),
        N(f"{v}.pos_embed.weight", REPLICATED, f"{w}.pos_embed.weight"),
        *_vit_sublayer(f"{d}.input_layernorm", f"{at}.linear_qkv", QKV_CONCAT,
                       f"{at}.linear_proj", f"{b}.norm1", f"{b}.attn.qkv", f"{b}.attn.proj"),
        *_vit_sublayer(f"{d}.pre_mlp_layernorm", f"{d}.mlp.linear_fc1", COLUMN,
                       f"{d}.mlp.linear_fc2", f"{b}.norm2", f"{b}.mlp.linear_fc1",
                       f"{b}.mlp.linear_fc2"),
        *_vision_merger(f"{v}.merger", f"{w}.merger"),
        *_vision_merger(f"{v}.decoder.deepstack_merger_list.{{B}}",
                        f"{w}.deepstack_merger_list.{{B}}"),
    ]
    return tuple(out) + _language_model(text)


#: Qwen3-VL (Megatron-Bridge ``Qwen3VLBridge``): the vision tower and Qwen3's language model.
QWEN3_VL = qwen3_vl_names(QWEN3)
#: Qwen3-VL-MoE (``Qwen3VLMoEBridge``): the vision tower and Qwen3-MoE's language model.
QWEN3_VL_MOE = qwen3_vl_names(QWEN3_MOE)

#: ``config.architectures[0]`` -> the name of its table in this module.
_TABLES = {
    "LlamaForCausalLM": "LLAMA",
    "Qwen2ForCausalLM": "QWEN2",
    "Qwen3ForCausalLM": "QWEN3",
    "Qwen3MoeForCausalLM": "QWEN3_MOE",
    "MixtralForCausalLM": "MIXTRAL",
    "DeepseekV3ForCausalLM": "DEEPSEEK_V3",
    "Glm4MoeForCausalLM": "GLM4_MOE",
    "Glm4MoeLiteForCausalLM": "GLM4_MOE_LITE",
    "Qwen3VLForConditionalGeneration": "QWEN3_VL",
    "Qwen3VLMoeForConditionalGeneration": "QWEN3_VL_MOE",
}

#: ``config.architectures[0]`` -> its Megatron-Core names; a family absent has none.
MEGATRON_NAMES: dict[str, tuple[MegatronName, ...]] = {a: globals()[t] for a, t in _TABLES.items()}


def megatron_names(family: Any) -> tuple[MegatronName, ...]:
    """The Megatron-Core names of ``family`` (a ``Family`` or an architecture); ``()``: none."""
    return MEGATRON_NAMES.get(getattr(family, "architecture", family), ())


def without_tower(model: Any) -> bool:
    """True for a VLM built without its vision tower: Bridge's ``Qwen3VLModel`` with
    ``add_encoder=False`` (the same on every stage; ``modelling_qwen3_vl/model.py``).
    ``model``: one model chunk, DDP / ``Float16Module`` wrappers unwrapped here."""
    while hasattr(model, "module") and hasattr(model.module, "named_parameters"):
        model = model.module
    return getattr(model, "add_encoder", True) is False


def tower_wires(family: Any, wire_names: Any) -> list[str]:
    """The wire tensors of ``wire_names`` that ``family``'s vision tower sends (the
    ``vision_model.`` rows of its table), in order."""
    from .layout import match_wire

    table = megatron_names(family)
    out = []
    for w in wire_names:
        hit = match_wire(table, w)
        if hit is not None and hit.entry.megatron[0].startswith("vision_model."):
            out.append(w)
    return out


def table_name(family: Any) -> str:
    """Where ``family``'s table is, for messages (``m2nkit.adapters.megatron.names.QWEN3``);
    for a family without one, this module."""
    table = _TABLES.get(getattr(family, "architecture", family))
    return f"{__name__}.{table}" if table else __name__
