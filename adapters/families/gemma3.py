"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): everything m2nkit knows.

Gemma 2's layout (``m2nkit.adapters.families.gemma2``: four replicated
``GemmaRMSNorm`` per layer holding the checkpoint's ``gamma`` unchanged,
vLLM adding the 1 at run time; the embedding stored unscaled, multiplied
by ``sqrt(hidden_size)`` at run time) plus per-head ``q_norm``/``k_norm``
(``GemmaRMSNorm`` of size ``head_dim``, replicated, after ``o_proj`` in
vLLM's module order), and a real ``lm_head``: ``ParallelLMHead`` tied to
``model.embed_tokens`` when ``tie_word_embeddings`` (then a checkpoint's
``lm_head.weight`` is skipped), loaded like Llama's otherwise (vLLM 0.33.0
``model_executor/models/gemma3.py``, ``Gemma3Attention``,
``Gemma3ForCausalLM.__init__``). Checked bit for bit with vLLM's real
loaders (``tests/data/oracle/tiny-gemma3``). The multimodal
``Gemma3ForConditionalGeneration`` is another architecture, not covered.

transformers 5 names every tensor the same in memory and on disk.
"""

from __future__ import annotations

from typing import Any

from .gemma2 import CONDITIONS, GEMMA_DEFAULTS, attention_params, layer_norm_params, sizes_of
from .kinds import REPLICATED, VOCAB
from .llama import ATTENTION as A
from .llama import dense_mlp_params
from .table import Family, HFNaming, Param, TinyModel

__all__ = ["ARCHITECTURE", "HF_NAMES", "VLLM_PARAMS", "CONDITIONS", "TINY_MODELS",
           "FAMILY"]

ARCHITECTURE = "Gemma3ForCausalLM"

#: transformers 5: in-memory names are the on-disk names; no experts.
#: ``Gemma3TextConfig``'s defaults are Gemma 2's but for the vocabulary.
HF_NAMES = HFNaming(model_types=("gemma3_text",),
                    config_defaults={**GEMMA_DEFAULTS, "vocab_size": 262208})

#: vLLM parameters in ``named_parameters()`` order (per layer for ``{L}``).
VLLM_PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", VOCAB, ("V", "H")),
    *attention_params(),
    Param(f"{A}.q_norm.weight", REPLICATED, ("hd",)),
    Param(f"{A}.k_norm.weight", REPLICATED, ("hd",)),
    *dense_mlp_params(bias_when=None),
    *layer_norm_params(),
    Param("model.norm.weight", REPLICATED, ("H",)),
    Param("lm_head.weight", VOCAB, ("V", "H"), tied_to="model.embed_tokens.weight"),
)


def sizes(config: Any):
    """``Sizes`` of a Gemma 3 text config.

    Raises:
        ValueError: a quantized config.
    """
    return sizes_of(config, ARCHITECTURE)


#: Tiny test models (``m2nkit.adapters.tiny``): tied, as the published ones are.
TINY_MODELS = {"tiny-gemma3": TinyModel("gemma3_text", {"tie_word_embeddings": True})}

FAMILY = Family(
    ARCHITECTURE, HF_NAMES, VLLM_PARAMS, sizes, CONDITIONS, tiny=TINY_MODELS,
    vllm_source="vllm/model_executor/models/gemma3.py",
    module=__name__,
)
