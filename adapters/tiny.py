"""Tiny checkpoints of real architectures, made on the spot.

Nothing can be downloaded here, so tests, the demo and the README's default
input use checkpoints that transformers itself builds and saves
(``AutoModelForCausalLM.from_config`` + ``save_pretrained``) from a real
architecture with its sizes shrunk. The shapes are chosen to exercise every
layout rule: 8 query heads over 2 KV heads (tp 4 and 8 replicate KV heads),
a vocab of 200 (not a multiple of 64, so vLLM pads), 8 experts (ep up to 8),
intermediate sizes divisible by 8.

The sizes are shared (:data:`TINY_SIZES`); which tiny models exist, and the
config keys each adds, belong to the families (``TINY_MODELS`` in each
module of ``m2nkit.adapters.families``), collected here into
:data:`BUILTIN_TINY_MODELS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .families import ARCHITECTURES, family

__all__ = ["TINY_SIZES", "BUILTIN_TINY_MODELS", "shrink_config", "tiny_config", "save_tiny_checkpoint",
           "build_model", "save_model"]

#: Sizes every tiny model shares (keys are transformers config attributes).
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "vocab_size": 200,
    "num_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}


def _builtin() -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, Mapping[str, Callable]]]:
    models: dict[str, tuple[str, dict[str, Any]]] = {}
    derived: dict[str, Mapping[str, Callable]] = {}
    for arch in ARCHITECTURES:  # registry order
        for name, tiny in family(arch).tiny.items():
            models[name] = (tiny.model_type, {"architectures": [arch], **tiny.config})
            derived[name] = tiny.derived
    return models, derived


#: Built-in tiny models: name -> (transformers model_type, extra config keys),
#: from the families' ``TINY_MODELS``.
BUILTIN_TINY_MODELS: dict[str, tuple[str, dict[str, Any]]]
_DERIVED: dict[str, Mapping[str, Callable]]
BUILTIN_TINY_MODELS, _DERIVED = _builtin()


#: Per-layer lists a config class derives from ``num_hidden_layers`` when they are unset,
#: dropped so that the shrunk config derives them again (DSA configs: the MLP and indexer
#: type of each layer, from first_k_dense_replace and index_topk_freq; Llama-4: its MoE and
#: NoPE layers, from interleave_moe_layer_step and no_rope_layer_interval).
_PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types", "moe_layers", "no_rope_layers")


def shrink_config(config, *, derived: Mapping[str, Callable] | None = None, **overrides):
    """Return a copy of a transformers ``config`` with ``TINY_SIZES`` applied.

    Only attributes the config already has are changed (a dense config gets
    no expert count). ``overrides`` win over ``TINY_SIZES``. ``derived``
    (a family's ``TinyModel.derived``: config key -> function of the shrunk
    config) sets keys that must follow others, unless overridden; by default
    it is taken from the family of ``config.architectures[0]`` when m2nkit
    has one. Token ids are cleared so they fit the tiny vocab.
    """
    data = config.to_dict()
    for key in _PER_LAYER:
        data.pop(key, None)
    # A multimodal wrapper's sub-configs (text_config, vision_config) shrink too;
    # a dict override of one is merged into it, after the shared sizes.
    subs = [k for k in getattr(config, "sub_configs", None) or {} if isinstance(data.get(k), dict)]
    sizes = {**TINY_SIZES, **{k: v for k, v in overrides.items() if k not in subs}}
    for key, value in sizes.items():
        if key in overrides or key in data:
            data[key] = value
    for sub in subs:
        for key in _PER_LAYER:
            data[sub].pop(key, None)
        for key, value in TINY_SIZES.items():
            if key in data[sub]:
                data[sub][key] = value
        data[sub].update(overrides.get(sub) or {})
    config = config.__class__.from_dict(data)
    if derived is None:
        derived = _family_derived(config)
    for key, rule in derived.items():
        if key not in overrides:
            setattr(config, key, rule(config))
    for c in (config, *(getattr(config, k) for k in subs)):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if hasattr(c, key):
                setattr(c, key, None)
        c.dtype = torch.bfloat16
    return config


def _family_derived(config) -> Mapping[str, Callable]:
    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in ARCHITECTURES:
        return {}
    out: dict[str, Callable] = {}
    for tiny in family(archs[0]).tiny.values():
        if tiny.model_type == getattr(config, "model_type", None):
            out.update(tiny.derived)
    return out


def tiny_config(name: str, **overrides):
    """The config of a built-in tiny model (see ``BUILTIN_TINY_MODELS``).

    Raises:
        ValueError: ``name`` is not a built-in tiny model (lists the valid names).
    """
    from transformers import AutoConfig

    if name not in BUILTIN_TINY_MODELS:
        raise ValueError(
            f"unknown tiny model '{name}'; built-in names are {sorted(BUILTIN_TINY_MODELS)}"
        )
    model_type, extra = BUILTIN_TINY_MODELS[name]
    # a wrapper's sub-config keys (vision_config: {...}) shrink with the rest, then apply
    nested = {k: v for k, v in extra.items() if isinstance(v, dict)}
    return shrink_config(AutoConfig.for_model(model_type, **extra), derived=_DERIVED[name],
                         **{**nested, **overrides})


def save_tiny_checkpoint(config_or_name, out_dir, *, seed: int = 0,
                         max_shard_size: str | int | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """Build a randomly initialised model and save it as safetensors.

    Args:
        config_or_name: a transformers config (saved as given) or a built-in
            tiny model name.
        out_dir: directory to write (``config.json`` + ``*.safetensors``).
        seed: torch seed for the random weights.
        max_shard_size: pass e.g. ``"50KB"`` for a sharded checkpoint with
            ``model.safetensors.index.json``.
        dtype: the dtype the weights are saved in (and ``config.json``'s
            ``dtype``); ``torch.float32`` gives an fp32 checkpoint, which
            vLLM's ``dtype=auto`` serves in bf16.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(config_or_name) if isinstance(config_or_name, str) else config_or_name
    torch.manual_seed(seed)
    model = build_model(config, dtype=dtype)
    with torch.no_grad():
        # Norm weights start at exactly 1.0 and biases at 0: randomise them so
        # a norm sent to the wrong place is caught by a byte comparison
        # (stacked expert biases, [E, n], included).
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
        _randomise_saved_buffers(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    save_model(model, out, **kwargs)
    _quantize_saved(out, config)
    return out


def save_model(model, out_dir, **kwargs) -> Path:
    """``model.save_pretrained(out_dir, **kwargs)``, stacked experts in the published order.

    Where a family's published checkpoints store stacked experts in another dim order
    than transformers holds them (``HFNaming.stacked_order``: Qwen3-VL-MoE's
    ``[E, in, out]``), the saved files are rewritten in that order: transformers
    5.12.1's ``save_pretrained`` writes its in-memory ``[E, out, in]``
    (tests/data/oracle/README.md), which neither vLLM nor the checkpoint reader reads.
    """
    out = Path(out_dir)
    model.save_pretrained(out, **kwargs)
    _stacked_order_saved(out, model.config)
    return out


def _stacked_order_saved(out: Path, config) -> None:
    from safetensors.torch import load_file, save_file

    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in ARCHITECTURES:
        return
    hf = family(archs[0]).hf
    if not hf.stacked_order:
        return
    leaves = tuple("." + leaf for leaf in hf.fused_experts)
    for file in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(file))
        if any(n.endswith(leaves) for n in tensors):
            save_file({n: (t.permute(hf.stacked_order).contiguous() if n.endswith(leaves) else t)
                       for n, t in tensors.items()}, str(file), metadata={"format": "pt"})


def build_model(config, *, dtype: torch.dtype | None = None):
    """transformers' model of ``config`` (random weights; on the current default device).

    ``AutoModelForCausalLM.from_config`` for a causal LM; the architecture's own
    class for a multimodal wrapper with a table (``Qwen3VLForConditionalGeneration``),
    which no causal-LM auto class builds. ``dtype``: as ``from_config``'s.
    """
    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype is None else {"dtype": dtype}
    wrapper = _wrapper_class(config)
    if wrapper is not None:
        return wrapper._from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def _wrapper_class(config):
    """transformers' class of a table architecture that is no causal LM (a multimodal
    ``...ForConditionalGeneration``, ``families/wrapper.py``), or ``None``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in ARCHITECTURES or archs[0] in set(
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return None
    from .families.tableless import transformers_class

    return transformers_class(archs[0])


def _randomise_saved_buffers(model) -> None:
    """Give every persistent buffer (what ``save_pretrained`` writes besides the
    parameters: DeepSeek-V3's router ``e_score_correction_bias``) random values, in
    float32 where the model class keeps it float32.

    transformers initialises that bias to zeros and, built by ``from_config`` in
    bf16, stores it in bf16; the published checkpoints hold it non-zero in float32,
    which is what ``from_pretrained`` keeps (``_keep_in_fp32_modules_strict`` of
    ``DeepseekV3PreTrainedModel``) and what vLLM allocates (``GateLinear``). Zeros
    would let a bias sent to the wrong place or through a lossy cast pass a byte
    comparison. Parameters are untouched, and drawn before the buffers, so the other
    tensors of a seed stay what they were.
    """
    import re

    strict = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for module_name, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            fp32 = any(re.search(rf"(^|\.){re.escape(k)}($|\.)", full) for k in strict)
            dtype = torch.float32 if fp32 else buf.dtype
            if not dtype.is_floating_point:
                continue
            module._buffers[name] = torch.randn(buf.shape, dtype=torch.float32).to(dtype)


def _quantize_saved(out: Path, config) -> None:
    """Quantize what ``save_pretrained`` wrote as the config's fp8 block quantization says.

    transformers builds and saves the model unquantized (``from_config``
    ignores ``quantization_config``, and its fp8 quantizer needs a GPU);
    a real fp8 checkpoint holds each quantized weight in float8 e4m3 with
    its ``weight_scale_inv``. So the weights the family marks quantized
    (``m2nkit.adapters.families.quant``) are rewritten that way, file by
    file; the index (if any) learns the scales. No-op without an fp8 block
    ``quantization_config``.
    """
    import json

    from safetensors.torch import load_file, save_file

    from .families.quant import QuantizedWires, quantize_fp8_blocks

    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in ARCHITECTURES:
        return
    wires = QuantizedWires(family(archs[0]), config)
    if not wires:
        return
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    for file in sorted(out.glob("*.safetensors")):
        tensors = quantize_fp8_blocks(load_file(str(file)), wires.block, wires.matches_disk)
        save_file(tensors, str(file), metadata={"format": "pt"})
        if index is not None:
            for name in tensors:
                index["weight_map"][name] = file.name
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
