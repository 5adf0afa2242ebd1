"""Where SGLang 0.5.23's destination layout differs from vLLM 0.33.0's: named rules.

Everything else is m2nkit's vLLM family tables: for the architectures in
``SGLANG_ARCHITECTURES`` SGLang's parameter names, fused order, shapes,
vocab padding and KV-head replication equal vLLM's, proven bit for bit by
``tests/integration/test_sglang_layout.py`` (SGLang's own model classes and
``load_weights`` over gloo at tp 2 and 4, with and without EP). Each rule
cites the SGLang source it restates (paths under ``sglang/srt/``).

* ``NAMES``: the experts and the router (``expert_names``);
* ``rename``: DeepSeek-V3's fused ``q_a`` + ``kv_a`` projection (``renames``);
* ``keeps_alias``: only the tied embedding is an alias (``aliases``);
* ``sglang_dtype``: SGLang's ``--dtype auto``;
* ``replica_spec``: one replica per SGLang engine (DP without DP attention),
  MoE split (EP or TP) inside the replica only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NAMES", "SGLANG_VERSION", "SGLANG_ARCHITECTURES", "RENAMES", "rename", "keeps_alias",
           "sglang_dtype", "replica_spec", "check_architecture"]

SGLANG_VERSION = "0.5.23"

#: Rule ``expert_names``: the entry of ``m2nkit.adapters.families.vllm_names.VLLM_NAMES``
#: for SGLang. ``layers/moe/fused_moe_triton/layer.py`` ``FusedMoE.__init__`` registers
#: ``w13_weight`` [E_local, 2*I_local, H] and ``w2_weight`` [E_local, H, I_local] on the
#: ``experts`` module itself (vLLM 0.33.0: ``experts.routed_experts.*``), and
#: ``models/qwen3_moe.py`` ``Qwen3MoeSparseMoeBlock`` keeps its router ``gate`` apart
#: (vLLM 0.33.0 registers it again as ``experts.gate.weight``).
NAMES = f"sglang-{SGLANG_VERSION}"

#: Architectures whose layout was compared with SGLang's own loaders (the test above);
#: others are refused rather than assumed to follow vLLM.
SGLANG_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM")

#: Rule ``renames``: architecture -> (vLLM parameter-name ending, SGLang's). DeepSeek-V3:
#: ``models/deepseek_v2.py`` ``DeepseekV2AttentionMLA.__init__`` holds the fused
#: ``q_a_proj`` + ``kv_a_proj_with_mqa`` rows (same order and bytes as vLLM's
#: ``fused_qkv_a_proj``) as ``fused_qkv_a_proj_with_mqa``, when ``q_lora_rank`` is set.
RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "DeepseekV3ForCausalLM": ((".self_attn.fused_qkv_a_proj.weight",
                               ".self_attn.fused_qkv_a_proj_with_mqa.weight"),),
}


def rename(architecture: str | None, name: str) -> str:
    """SGLang's name of the vLLM parameter ``name`` (rule ``renames``)."""
    for old, new in RENAMES.get(architecture, ()):
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def keeps_alias(alias: str, target: str) -> bool:
    """Rule ``aliases``: SGLang registers each module once, so of vLLM's aliases only the
    tied output embedding stays (``models/qwen3.py`` ``Qwen3ForCausalLM.__init__``:
    ``self.lm_head = self.model.embed_tokens`` when ``tie_word_embeddings``). vLLM 0.33.0's
    others (the MLA wrapper's ``mla_attn.*``, ``experts._shared_experts._layer.*``,
    ``experts.gate.*`` in ``models/deepseek_v2.py``) have no SGLang counterpart."""
    return alias == "lm_head.weight" and target == "model.embed_tokens.weight"


def check_architecture(architecture: str | None, config: Any = None) -> None:
    """Refuse an architecture (or a DeepSeek-V3 variant) not checked against SGLang's loaders.

    Raises:
        ValueError: names it and lists ``SGLANG_ARCHITECTURES``; a DeepSeek-V3
            config without ``q_lora_rank`` (SGLang then keeps ``q_proj`` and
            ``kv_a_proj_with_mqa`` apart, not checked here); a config with a
            ``quantization_config`` (the published DeepSeek-V3 and Kimi-K2 fp8
            checkpoints: their scales were laid out under vLLM's names, e.g.
            ``fused_qkv_a_proj.weight_scale_inv`` beside SGLang's
            ``fused_qkv_a_proj_with_mqa.weight``, and never compared with SGLang).
    """
    if architecture not in SGLANG_ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r}: m2nkit's SGLang {SGLANG_VERSION} layout is checked "
            f"against SGLang's own loaders for {', '.join(SGLANG_ARCHITECTURES)} only "
            "(docs/sglang.md)")
    q_lora = (config.get("q_lora_rank") if isinstance(config, Mapping)
              else getattr(config, "q_lora_rank", None)) if config is not None else 0
    if architecture == "DeepseekV3ForCausalLM" and q_lora is None:
        raise ValueError("DeepseekV3ForCausalLM without q_lora_rank: SGLang's layout for it "
                         "is not checked against SGLang's loaders (docs/sglang.md)")
    quant = (config.get("quantization_config") if isinstance(config, Mapping)
             else getattr(config, "quantization_config", None)) if config is not None else None
    if quant:
        method = (quant.get("quant_method") if isinstance(quant, Mapping)
                  else getattr(quant, "quant_method", None))
        raise ValueError(
            f"{architecture} with a quantization_config (quant_method {method!r}): SGLang's "
            "layout of a quantized checkpoint (fp8 weight + weight_scale_inv, ...) is not "
            "checked against SGLang's loaders (the test loads unquantized checkpoints; "
            "docs/sglang.md); supported: the unquantized (bf16) form, the same config "
            "without quantization_config")


def _config_dtype(config: Any) -> str | None:
    value = (config.get("dtype") or config.get("torch_dtype")) if isinstance(config, Mapping) \
        else (getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def sglang_dtype(config: Any, requested: str) -> tuple[str, str | None]:
    """Rule ``auto_dtype``: the dtype SGLang allocates parameters in, and a note.

    ``configs/model_config.py`` ``_get_and_verify_dtype``: a config without a
    dtype counts as float32; ``auto`` keeps the config's dtype unless it is
    float32, which becomes float16 (bfloat16 for ``model_type`` starting
    ``gemma``). vLLM 0.33.0 turns float32 into bfloat16 instead. An explicit
    ``--dtype`` is taken as given.

    Args:
        config: HF config object or ``config.json`` dict.
        requested: the spec's canonical dtype (``auto``, ``bfloat16``, ...).

    Returns:
        (canonical dtype name, a note when ``auto`` chose something the config
        does not say, else None).

    Raises:
        ValueError: a config dtype SGLang does not know (names it).
    """
    if requested != "auto":
        return requested, None
    have = _config_dtype(config) or "float32"
    known = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16",
             "float32": "float32", "float": "float32"}
    if have not in known:
        raise ValueError(f"config dtype {have!r} is not one SGLang's --dtype auto reads "
                         f"(valid: {', '.join(known)})")
    have = known[have]
    if have != "float32":
        return have, None
    model_type = (config.get("model_type") if isinstance(config, Mapping)
                  else getattr(config, "model_type", "")) or ""
    picked = "bfloat16" if model_type.startswith("gemma") else "float16"
    return picked, (f"SGLang's --dtype auto serves a float32 (or dtype-less) config in "
                    f"{picked} (configs/model_config.py _get_and_verify_dtype)")


def replica_spec(tp: int, ep: bool, dtype: str):
    """Rule ``replica``: the vLLM spec whose layout equals one SGLang replica.

    SGLang's ``--dp-size`` without DP attention runs ``dp`` engines, each a
    TP group of its own (``managers/data_parallel_controller.py``); the MoE
    ranks come from the TP rank alone (``runtime_context.py``
    ``derive_spawn_ranks``: ``moe_ep_rank``/``moe_tp_rank`` of ``tp_rank``).
    So experts are split over the ``tp`` workers of one replica and every
    replica holds the same; vLLM 0.33.0 splits MoE layers over all
    ``dp * tp`` workers. One replica is vLLM's ``tp=T,dp=1`` layout, copied to
    each replica by ``destination.sglang_destination_layout``.
    """
    from m2nkit.adapters.vllm.spec import InferenceSpec

    return InferenceSpec(tp, 1, ep, dtype=dtype)
