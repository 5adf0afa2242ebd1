"""GPT-OSS (``GptOssForCausalLM``, gpt-oss-20b/120b): everything m2nkit knows about the family.

vLLM 0.33.0 ``model_executor/models/gpt_oss.py``, checked bit for bit with
its real loaders (``tests/data/oracle/tiny-gpt-oss``):

* **Names.** vLLM renames on load (``GptOssForCausalLM.hf_to_vllm_mapper``):
  ``self_attn`` is ``attn`` and ``model.embed_tokens`` is
  ``model.embedding``; the table binds the Hugging Face names (the wire) to
  vLLM's. ``lm_head`` is never tied (vLLM builds its own ``ParallelLMHead``
  and has no ``tie_weights`` call), so a config with
  ``tie_word_embeddings=True`` is refused.
* **Attention.** ``qkv_proj`` and ``o_proj`` always carry biases
  (``bias=True``; the ``o_proj`` bias is row-parallel, so replicated);
  ``attn.sinks [nh]`` is split by heads like a column-parallel bias
  (``make_attention_sink(num_attention_heads // tp_size)``). KV heads are
  not replicated: ``tp > num_key_value_heads`` is refused (vLLM's
  ``OAIAttention`` would get zero KV heads per rank).
* **Router.** ``mlp.router`` is a ``GateLinear`` with a bias, replicated and
  not handed to ``FusedMoEFactory`` (no router alias).
* **Experts.** transformers stores them stacked, in memory and on disk, as
  ``experts.gate_up_proj [E, H, 2*I]`` (``x @ W`` layout, gate and up
  *interleaved* on the last dim: column ``2i`` is gate ``i``, ``2i+1`` up
  ``i``), ``experts.down_proj [E, I, H]``, ``gate_up_proj_bias [E, 2*I]``
  (interleaved too) and ``down_proj_bias [E, H]``. vLLM's bf16 loader
  (``GptOssModel._load_weights_other``) keeps the interleaving (its
  ``swigluoai`` activation reads the pairs) and only transposes:
  ``w13_weight = gate_up_proj[:, :, 2*s:2*e].permute(0, 2, 1)``
  (``[E, 2*I/tp_moe, H]``), ``w2_weight = down_proj[:, s:e, :].permute(0,
  2, 1)``, ``w13_bias = gate_up_proj_bias[:, 2*s:2*e]``, and ``w2_bias``
  whole on moe rank 0, zeros elsewhere; with EP whole experts
  ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``.

**The wire form.** The wire carries the experts in vLLM's ``[E, out, in]``
order, so that every worker's share is one box:
``<L>.mlp.experts.gate_up_proj.weight [E, 2*I, H]`` = the checkpoint's
``gate_up_proj`` transposed (rows still interleaved gate/up, exactly as
vLLM's ``w13_weight`` and the per-expert ``gate_up_proj.weight [2*I, H]``
of quark-format GPT-OSS checkpoints hold them), and
``<L>.mlp.experts.down_proj.weight [E, H, I]`` = ``down_proj`` transposed
(the usual stacked-down contract, kind ``W2``). The biases travel as
stored. With the checkpoint's own ``[E, H, 2*I]`` on the wire instead,
every worker's ``w13_weight`` would be a transposed copy, which a binding
(a box of the wire landing at an offset, same dim order) cannot express
except as one ``[E, H, 1]`` box per local row: ``2*I/tp`` bindings per
layer and worker (5760 for gpt-oss-20b at tp=1) of ``H`` elements each.
De-interleaving instead (``[gate; up]`` like the other families) would
make vLLM's interleaved rows one box per row too. So the transposition is
done where the data already is, on the trainer: a rank holding box
``(e, h, j)`` of ``gate_up_proj`` holds box ``(e, j, h)`` of the wire
tensor, and its piece is ``local.transpose(1, 2)`` (a view; copied when a
transport needs contiguous memory), never a gather
(``HFNaming.permuted``; ``m2nkit.adapters.hf_checkpoint`` reads the
permuted box from disk and transposes it).

**MXFP4.** The published checkpoints store the experts as MXFP4
(``*_blocks`` packed fp4, ``*_scales`` e8m0; ``quantization_config:
{quant_method: mxfp4}``). vLLM 0.33.0 allocates its MXFP4 expert
parameters padded to a size that depends on the MoE kernel it selects on
the GPU (``layers/fused_moe/oracle/mxfp4.py``
``mxfp4_round_up_hidden_size_and_intermediate_size``: unpadded, 32, 128 or
256 per backend) and swizzles them after loading, so that layout cannot be
derived from the config: a checkpoint holding MXFP4 tensors is refused
naming the tensor, and a config-only plan of an MXFP4 config plans the bf16
form (what a bf16 trainer holds, for a vLLM serving the bf16 checkpoint)
and says so in the plan's notes. Other ``quant_method`` values are refused.
"""

from __future__ import annotations

from typing import Any

from .kinds import COLUMN, EXPERT_BIAS_ONCE, EXPERT_ROWS, QKV, REPLICATED, ROW, VOCAB, W2
from .sizes import base_sizes, cfg_get
from .table import Family, HFNaming, Param, TinyModel, alias, head_dim, kv_heads, qkv_feeds

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "FAMILY", "MXFP4_REFUSAL", "MXFP4_NOTE"]

ARCHITECTURE = "GptOssForCausalLM"

#: Why a checkpoint holding MXFP4 expert tensors is refused.
MXFP4_REFUSAL = (
    "MXFP4 experts (quant_method mxfp4: *_blocks packed fp4, *_scales e8m0) are not carried. "
    "vLLM 0.33.0 pads its MXFP4 expert parameters to a size that depends on the MoE kernel it "
    "picks on the GPU (layers/fused_moe/oracle/mxfp4.py, "
    "mxfp4_round_up_hidden_size_and_intermediate_size: unpadded, 32, 128 or 256 per backend) "
    "and repacks them after loading, so their layout cannot be derived from the config. "
    "Dequantize the experts to bf16 (transformers Mxfp4Config(dequantize=True)) and send the "
    "bf16 form to a vLLM serving the bf16 checkpoint")

#: The note a plan of an MXFP4 config carries (config-only plans).
MXFP4_NOTE = (
    "quantization_config quant_method=mxfp4: planned the bf16 form of GPT-OSS's experts "
    "(experts.gate_up_proj.weight [E, 2*I, H], experts.down_proj.weight [E, H, I]), for a vLLM "
    "serving a bf16 checkpoint of this model (no quantization_config); vLLM's MXFP4 expert "
    "layout depends on the GPU's MoE kernel and is not planned")

M = "model.layers.{L}.mlp"
S = "model.layers.{L}.self_attn"     # Hugging Face (wire) names
A = "model.layers.{L}.attn"          # vLLM names

#: transformers 5: in-memory names are the on-disk names; the stacked experts
#: travel transposed (see the module docstring); MXFP4 tensors are refused.
#: Config-only plans read ``config.json`` with ``GptOssConfig``'s defaults
#: (transformers 5 ``configuration_gpt_oss.py``).
HF_NAMES = HFNaming(
    permuted={
        "experts.gate_up_proj": ("experts.gate_up_proj.weight", (0, 2, 1)),
        "experts.down_proj": ("experts.down_proj.weight", (0, 2, 1)),
    },
    refused=((r"\.experts\.(gate_up|down)_proj_(blocks|scales)$", MXFP4_REFUSAL),),
    model_types=("gpt_oss",),
    config_defaults={"hidden_size": 2880, "vocab_size": 201088, "num_attention_heads": 64,
                     "num_hidden_layers": 36, "intermediate_size": 2880,
                     "tie_word_embeddings": False, "attention_bias": True,
                     "num_key_value_heads": kv_heads(8), "head_dim": head_dim(64),
                     "num_local_experts": alias("num_local_experts", "num_experts", 128)},
)


def _same(name: str) -> tuple[tuple[str, None], ...]:
    return ((name, None),)


#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embedding.weight", VOCAB, ("V", "H"), feeds=_same("model.embed_tokens.weight")),
    Param(f"{A}.sinks", COLUMN, ("nh",), feeds=_same(f"{S}.sinks")),
    Param(f"{A}.qkv_proj.weight", QKV, ("H",), feeds=qkv_feeds(S)),
    Param(f"{A}.qkv_proj.bias", QKV, (), feeds=qkv_feeds(S, "bias")),
    Param(f"{A}.o_proj.weight", ROW, ("H", "nh*hd"), feeds=_same(f"{S}.o_proj.weight")),
    Param(f"{A}.o_proj.bias", REPLICATED, ("H",), feeds=_same(f"{S}.o_proj.bias")),
    Param(f"{M}.router.weight", REPLICATED, ("E", "H")),
    Param(f"{M}.router.bias", REPLICATED, ("E",)),
    Param(f"{M}.{{experts}}.w13_weight", EXPERT_ROWS, ("E", "2*Im", "H"),
          feeds=_same(f"{M}.experts.gate_up_proj.weight")),
    Param(f"{M}.{{experts}}.w13_bias", EXPERT_ROWS, ("E", "2*Im"),
          feeds=_same(f"{M}.experts.gate_up_proj_bias")),
    Param(f"{M}.{{experts}}.w2_weight", W2, ("E", "H", "Im"),
          feeds=_same(f"{M}.experts.down_proj.weight")),
    Param(f"{M}.{{experts}}.w2_bias", EXPERT_BIAS_ONCE, ("E", "H"),
          feeds=_same(f"{M}.experts.down_proj_bias")),
    Param("model.layers.{L}.input_layernorm.weight", REPLICATED, ("H",)),
    Param("model.layers.{L}.post_attention_layernorm.weight", REPLICATED, ("H",)),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H")),
)

#: ``Param.when`` conditions: none (every layer is sparse, biases always exist).
CONDITIONS: dict = {}


def _quant_method(config: Any) -> str | None:
    q = cfg_get(config, "quantization_config", default=None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method))


def sizes(config: Any):
    """``Sizes`` of a GPT-OSS config (``Im``: ``intermediate_size``, ``E``: ``num_local_experts``).

    Raises:
        ValueError: ``tie_word_embeddings=True`` (vLLM never ties GPT-OSS's
            ``lm_head``), ``attention_bias=False`` (vLLM always allocates
            the biases), or a ``quant_method`` other than ``mxfp4``.
    """
    if cfg_get(config, "tie_word_embeddings", default=False):
        raise ValueError("GptOssForCausalLM with tie_word_embeddings=True is not supported: "
                         "vLLM's GptOssForCausalLM never ties lm_head (models/gpt_oss.py) and "
                         "would leave it unloaded; supported: tie_word_embeddings=False")
    if not cfg_get(config, "attention_bias", default=True):
        raise ValueError("GptOssForCausalLM with attention_bias=False is not supported: vLLM's "
                         "OAIAttention always has q/k/v and o_proj biases (bias=True)")
    method = _quant_method(config)
    if method not in (None, "mxfp4"):
        raise ValueError(f"GptOssForCausalLM with quantization_config quant_method={method!r} "
                         "is not supported; supported: no quantization_config (bf16), or mxfp4 "
                         "(planned in bf16)")
    return base_sizes(
        config,
        Im=int(cfg_get(config, "intermediate_size")),
        E=int(cfg_get(config, "num_local_experts")),
        keys={"Im": "intermediate_size", "E": "num_local_experts"},
    )


def notes(config: Any) -> tuple[str, ...]:
    """What a plan of ``config`` must say: the MXFP4 note when the config is MXFP4."""
    return (MXFP4_NOTE,) if _quant_method(config) == "mxfp4" else ()


def _kv_heads_per_rank(s, spec) -> str | None:
    """vLLM's GPT-OSS attention does not replicate KV heads (``models/gpt_oss.py``).

    ``OAIAttention`` builds its ``Attention`` with ``num_key_value_heads //
    tp_size`` KV heads, zero when ``tp > num_key_value_heads`` (vLLM then
    fails with a division by zero, seen with the oracle).
    """
    if spec.tp > s.nkv:
        return (f"tp={spec.tp} is greater than num_key_value_heads={s.nkv}: vLLM's GPT-OSS "
                "attention gives each rank num_key_value_heads // tp KV heads and does not "
                "replicate them")
    return None


def _expert_parallel(s, spec) -> str | None:
    """vLLM's GPT-OSS rules with EP (``models/gpt_oss.py``).

    ``GptOssModel.load_weights`` gives EP rank ``r`` experts ``[r*(E//ep),
    (r+1)*(E//ep))``, which fills the uneven split the MoE layer allocates
    only when ``ep`` divides ``E``; ``MLPBlock`` asserts
    ``intermediate_size % world_size == 0`` even with EP.
    """
    W = spec.tp * spec.dp
    if not spec.ep or W == 1:
        return None
    if s.E % W:
        return (f"num_local_experts={s.E} is not divisible by the expert-parallel size "
                f"ep=dp*tp={W} (vLLM's GptOssModel.load_weights splits experts evenly)")
    if s.Im % W:
        return (f"intermediate_size={s.Im} is not divisible by the world size dp*tp={W} "
                "(vLLM's GPT-OSS MLPBlock asserts it)")
    return None


def _fixed(value: int):
    return lambda config: value


#: Tiny test models (``m2nkit.adapters.tiny``). vLLM's CPU MoE kernel (the
#: oracle's) needs the per-rank intermediate size and the hidden size to be
#: multiples of 32 with GPT-OSS's ``swigluoai`` activation
#: (``experts/cpu_moe.py``), so I = 128 (32 per rank at tp=4); 4 KV heads
#: because vLLM's GPT-OSS does not replicate KV heads (tp=4 needs 4);
#: hidden 64 and 4 experts keep the oracle dumps small. These keys are
#: among the shared tiny sizes, hence ``derived``, applied after them.
TINY_MODELS = {
    "tiny-gpt-oss": TinyModel("gpt_oss", derived={
        "hidden_size": _fixed(64), "intermediate_size": _fixed(128),
        "num_key_value_heads": _fixed(4), "num_local_experts": _fixed(4)}),
}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, (_kv_heads_per_rank, _expert_parallel),
    tiny=TINY_MODELS, vllm_source="vllm/model_executor/models/gpt_oss.py", module=__name__,
    notes=notes,
)
