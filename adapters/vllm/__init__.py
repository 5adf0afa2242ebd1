"""vLLM destination layouts: what each vLLM worker holds, per model family.

m2nkit writes straight into a vLLM worker's local parameter storage, so it
must know vLLM's fused, sharded parameters without vLLM installed. This
package restates vLLM 0.33.0's weight loaders as data: one table per model
family (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``,
``mixtral.py``), the shard kinds they use (``table.py``), the names that
change between vLLM versions (``names.py``), and one function that turns a
table plus a parallel spec into a ``DestinationLayout`` (``layout.py``). It
never loads vLLM and moves no bytes.

Public API::

    parse_inference_spec("vllm:tp=T[,dp=D][,ep]") -> InferenceSpec(tp, dp, ep)
    destination_layout(config, wire: Sequence[ParamMeta], spec) -> DestinationLayout
    reference_load(config, checkpoint_tensors, spec, worker) -> {vLLM name: local tensor}
    supported_architectures() -> [architecture names]

Where each rule comes from (vLLM 0.33.0, ``vllm/model_executor/``):

* column / row sharding: ``layers/linear.py`` ``ColumnParallelLinear.weight_loader``
  (rows ``[r*n/tp, ...)``), ``RowParallelLinear.weight_loader`` (columns; bias
  has no ``input_dim`` so it is copied whole to every rank).
* ``qkv_proj``: ``layers/linear.py`` ``QKVParallelLinear.__init__`` (``num_heads =
  nh/tp``; ``tp >= nkv`` -> one KV head per rank, ``num_kv_head_replicas =
  tp/nkv``) and ``.weight_loader`` (local rows ``[q | k | v]``; k/v rows from
  KV shard ``tp_rank // num_kv_head_replicas``); biases the same way.
* ``gate_up_proj``: ``layers/linear.py`` ``MergedColumnParallelLinear.weight_loader``
  (shard ``i`` at local row ``sum(sizes[:i])/tp``, rows ``tp_rank*size/tp`` of
  the checkpoint tensor).
* embedding / lm_head: ``layers/vocab_parallel_embedding.py``
  (``pad_vocab_size`` to a multiple of 64, ``_get_indices``, ``weight_loader``
  copies the rank's token rows and ``fill_(0)``s the local rows after them:
  padding rows hold zeros, written by vLLM).
* tied embeddings: ``models/utils.py`` ``AutoWeightsLoader`` (aliased params:
  a checkpoint ``lm_head.weight`` is skipped when ``lm_head`` is tied to
  ``embed_tokens``; ``ParallelLMHead.tie_weights``).
* experts: ``layers/fused_moe/routed_experts.py`` ``RoutedExperts.weight_loader``,
  ``_load_w13`` (gate into the first half of ``w13``, up into the second,
  ``Im/tp_moe`` rows of moe rank ``k`` each), ``_load_w2`` (columns), and
  ``load_weights`` (stacked ``gate_up_proj`` ``[E, 2*Im, H]`` chunked into w1/w3);
  ``layers/fused_moe/config.py`` ``FusedMoEParallelConfig.make`` (without EP
  ``tp_moe = dp*tp`` flattened, with EP ``ep = dp*tp`` and ``tp_moe = 1``);
  ``layers/fused_moe/expert_map_manager.py`` ``determine_expert_map``
  (linear placement: contiguous experts per EP rank).
* names and layer kinds: ``models/llama.py``, ``qwen2.py``, ``qwen3.py``,
  ``qwen3_moe.py``, ``mixtral.py`` (``hf_to_vllm_mapper`` /
  ``stacked_params_mapping``, ``mlp_only_layers``/``decoder_sparse_step``).

Checked against the real vLLM 0.33.0 loaders (``shared/tools/vllm_oracle``)
for every tiny model at tp 1/2/4/8 (and EP for MoE); the dumps ship in
``tests/data/oracle`` so CI without vLLM still compares against them.
"""

from .layout import VOCAB_PADDING, destination_layout
from .names import DEFAULT_VLLM_VERSION, VLLM_NAMES
from .reference import reference_load
from .registry import FAMILIES, family_for, supported_architectures
from .spec import InferenceSpec, parse_inference_spec

__all__ = [
    "InferenceSpec",
    "parse_inference_spec",
    "destination_layout",
    "reference_load",
    "supported_architectures",
    "family_for",
    "FAMILIES",
    "VLLM_NAMES",
    "DEFAULT_VLLM_VERSION",
    "VOCAB_PADDING",
]
