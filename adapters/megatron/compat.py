"""Run megatron-core 0.19.2 and megatron-bridge 0.6.2 on Python 3.11 and on CPU.

Both packages declare Python >= 3.12 and assume CUDA in a few places. The
project installs them with ``--ignore-requires-python`` (scripts/setup.sh);
these runtime shims cover what remains. Nothing is applied on import: a
process calls :func:`enable_py311` before importing megatron (any machine
with Python 3.11) and :func:`enable_cpu` when it trains on CPU (tests, the
demo). On a CUDA machine :func:`enable_cpu` changes nothing.

What each shim answers (found on this machine, 2026-11-30; docs/reference.md
§5 has the stack's versions):

* ``typing.override`` (Python 3.12) is imported by
  ``megatron/training/models/gpt.py`` and ``hybrid.py``, which Bridge
  imports: :func:`enable_py311` puts ``typing_extensions.override`` (the
  backport; typing_extensions is a torch dependency) on ``typing``.
* ``torch.cuda.current_device()`` is called unconditionally by Bridge's
  ``ReplicatedMapping.hf_to_megatron`` (TP > 1, ``param_mapping.py``) and by
  rotary embeddings; a CPU torch raises. :func:`enable_cpu` answers
  ``"cpu"``, a valid device for every ``.to(...)``/``device=`` use found.
* ``weight.data.cuda()`` in megatron-core's
  ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with
  PP > 1, before the all-reduce over the embedding group): with no CUDA,
  :func:`enable_cpu` makes ``Tensor.cuda()`` leave the tensor where it is,
  which is what a gloo all-reduce needs.

* megatron-core imports triton unguarded for its MoE paged-stash GPU kernels
  (``transformer/moe/paged_stash.py`` -> ``moe/ops/paged_stash.py``). The real
  triton package would import on CPU, but torch then imports it in every
  process (``torch._dynamo`` probes for it) and triton's bindings print
  "nanobind: leaked ... instances" at every interpreter exit, m2nkit's CLI
  included. So without triton :func:`enable_cpu` registers that one kernel
  module: ``GLOBAL_BLOCK_SIZE`` as megatron-core 0.19.2 defines it (1024) and
  kernels that refuse to launch. Paged stashing is a GPU memory feature that
  is off unless configured.

One import in Bridge's ``peft/lora_layers.py`` is guarded at setup instead
(scripts/patch_stacks.py says why that one cannot be a shim).
The causal mask megatron-core builds by default lives on CUDA: a CPU forward
passes an explicit ``attention_mask``.
"""

from __future__ import annotations

import typing

__all__ = ["enable_py311", "enable_cpu", "with_mla_stand_in", "vlm_language_model_only"]


def enable_py311() -> None:
    """Give Python 3.11's ``typing`` the 3.12 ``override`` decorator (idempotent)."""
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _stay(self, device=None, non_blocking=False, memory_format=None):
    """``Tensor.cuda`` on a machine without CUDA: the tensor, unmoved."""
    return self


def enable_cpu() -> None:
    """Let megatron-core and Bridge run on a CPU-only torch (idempotent; no-op with CUDA).

    Also calls :func:`enable_py311`. Process-wide: call it in trainer
    processes that have no GPU, never in a process that uses CUDA.
    """
    enable_py311()
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = _stay
    _stand_in_paged_stash_kernels()


class _NoKernel:
    """A triton kernel that is not there: launching it (``kernel[grid](...)``) raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid):
        raise RuntimeError(f"megatron-core's {self.name} is a triton GPU kernel; this process "
                           "runs on CPU without triton (m2nkit.adapters.megatron.compat)")


def _stand_in_paged_stash_kernels() -> None:
    import importlib.util
    import sys
    import types

    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(name, "CPU stand-in (m2nkit.adapters.megatron.compat): no triton")
    module.GLOBAL_BLOCK_SIZE = 1024  # megatron-core 0.19.2 moe/ops/paged_stash.py
    module.paged_stash_copy_kernel = _NoKernel("paged_stash_copy_kernel")
    module.paged_stash_pop_kernel = _NoKernel("paged_stash_pop_kernel")
    sys.modules[name] = module


# --------------------------------------------------------------------------
# MLA on CPU (tests and demos only)


def mla_core_attention_stand_in():
    """A parameterless core attention that takes MLA's ``k_channels``/``v_channels``.

    megatron-core 0.19.2's ``MLASelfAttention`` builds its core attention with
    ``k_channels=q_head_dim, v_channels=v_head_dim``
    (``transformer/multi_latent_attention.py``); only TransformerEngine's
    ``TEDotProductAttention`` accepts them, the local ``DotProductAttention``
    raises ``TypeError: unexpected keyword argument 'k_channels'``. The core
    owns no parameter (``DotProductAttention`` has none without a learnable
    softmax offset), so replacing it changes no name, shape, shard or
    conversion. This one computes plain causal softmax attention in fp32
    over ``query [s, b, n, dk]``, ``key [s, b, n, dk]``, ``value [s, b, n,
    dv]`` and returns ``[s, b, n*dv]``, the layout ``linear_proj`` takes.
    For tests and demos on CPU only (docs/megatron.md says so).
    """
    import torch
    from megatron.core.transformer.module import MegatronModule

    class MLACoreAttentionStandIn(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, k_channels=None,
                     v_channels=None, cp_comm_type=None, pg_collection=None, **_):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale or (k_channels or config.kv_channels) ** -0.5

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None, **_):
            s, b, n, _ = query.shape
            q, k, v = (t.float().permute(1, 2, 0, 3) for t in (query, key, value))
            scores = q @ k.transpose(-1, -2) * self.softmax_scale
            causal = torch.ones(s, key.shape[0], dtype=torch.bool).triu(1)
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            out = (probs @ v).to(query.dtype)  # [b, n, s, dv]
            return out.permute(2, 0, 1, 3).reshape(s, b, n * value.shape[-1])

    return MLACoreAttentionStandIn


def _mla_layers(spec_fn, edit, what: str):
    """``spec_fn`` with ``edit(attention submodules, config)`` applied to every MLA layer."""
    import inspect

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    takes_vp = callable(spec_fn) and "vp_stage" in inspect.signature(spec_fn).parameters

    def build(config, vp_stage=None):  # Bridge's provide() passes vp_stage when named
        if not callable(spec_fn):
            spec = spec_fn
        else:
            spec = spec_fn(config, vp_stage=vp_stage) if takes_vp else spec_fn(config)
        layers = getattr(spec, "layer_specs", None) or [spec]
        n = 0
        for layer in layers:
            attn = layer.submodules.self_attention
            if getattr(attn, "module", None) is not None and issubclass(attn.module,
                                                                        MLASelfAttention):
                edit(attn.submodules, config)
                n += 1
        if not n:
            raise ValueError(f"{what}: the layer spec has no MLASelfAttention layer")
        return spec
    return build


def with_mla_stand_in(spec_fn):
    """``spec_fn`` (a provider's ``transformer_layer_spec``) with every MLA layer's
    ``core_attention`` replaced by :func:`mla_core_attention_stand_in` (nothing else).

    Raises:
        ValueError: (when the spec is built) a spec with no MLA layer.
    """
    stand_in = mla_core_attention_stand_in()

    def edit(sub, config):
        sub.core_attention = stand_in
    return _mla_layers(spec_fn, edit, "with_mla_stand_in")


# --------------------------------------------------------------------------
# Qwen3-VL on CPU (tests and demos only): the language model without the tower

def vlm_language_model_only(provider) -> None:
    """Let Bridge's ``Qwen3VLModelProvider``/``Qwen3VLMoEModelProvider`` build the
    language model of a ``Qwen3VLModel`` on CPU, without its vision tower (in place).

    Megatron-Bridge 0.6.2 cannot build either part without TransformerEngine:

    * ``provide()`` (``qwen_vl/qwen3_vl_provider.py``) makes the language layer spec
      with ``get_gpt_layer_with_transformer_engine_spec`` whatever
      ``transformer_layer_spec`` says, and that fails on ``TESpecProvider()``
      (``TypeError: 'NoneType' object is not callable``, ``gpt_layer_specs.py``);
    * ``Qwen3VLModel.__init__`` (``modelling_qwen3_vl/model.py``) builds the tower from
      ``get_vit_layer_with_transformer_engine_spec()`` and a patch merger of ``TENorm``,
      ``TEColumnParallelLinear`` and ``TERowParallelLinear``, with no other backend:
      on CPU the ViT layer's TE ``linear_fc1`` fails to build (``StopIteration when
      instantiating TransformerLayer``). Those modules own the tower's parameters, so no
      stand-in is allowed.

    Here ``provide`` builds the same ``Qwen3VLModel`` with megatron-core's local layer
    spec for the language model (Bridge ``gpt_provider.local_layer_spec``: the spec every
    other family runs on CPU) and ``add_encoder=False`` (Bridge's own switch: no
    ``vision_model``) and sequence parallelism off (a scheduling option; the MoE
    provider's ``finalize`` turns it on with tp > 1 and megatron-core's torch norms
    refuse it); everything else is Bridge's (its ``freeze`` options, which change no
    parameter, are not applied). ``megatron_source`` then leaves the
    tower's wire tensors out (``MegatronSource.left_out``).
    """
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model import Qwen3VLModel

    provider.add_encoder = False
    # Qwen3VLMoEModelProvider.finalize turns sequence parallelism on with tp > 1, which
    # megatron-core's torch norms refuse (torch_norm.py); a scheduling option, no
    # parameter depends on it
    provider.sequence_parallel = False

    def provide(pre_process=None, post_process=None, vp_stage=None):
        return Qwen3VLModel(
            language_transformer_config=provider,
            language_transformer_layer_spec=local_layer_spec(provider),
            vision_transformer_config=provider.vision_config,
            pre_process=pre_process, post_process=post_process,
            pg_collection=provider._pg_collection, add_encoder=False,
            add_decoder=provider.add_decoder, vp_stage=vp_stage)

    object.__setattr__(provider, "provide", provide)
