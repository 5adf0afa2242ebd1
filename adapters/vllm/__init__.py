"""The vLLM side: what each vLLM worker holds, computed without vLLM installed.

m2nkit writes straight into a vLLM worker's local parameter storage, so it
must know vLLM's fused, sharded parameters. Per model family that knowledge
is data in ``m2nkit.adapters.families`` (one module per family, built from
the shard kinds of ``families/kinds.py``, each citing the vLLM 0.33.0 code
it restates). This package holds only what is the same for every family:

* ``spec.py``: the spec ``vllm:tp=T[,dp=D][,ep][,placement=P][,all2all=B][,dtype=X]``;
* ``expert_placement.py``: which expert placement vLLM really uses (a round-robin
  request falls back to linear unless the model has expert groups, ...);
* ``dtype.py``: the dtype vLLM allocates parameters in (``--dtype``, ``auto``);
* ``names.py``: vLLM parameter names that change between vLLM versions (the
  table lives with the family tables, ``families/vllm_names.py``);
* ``destination.py``: ``destination_layout``, a family + a spec -> the
  ``DestinationLayout`` the planner intersects with the trainer's layout;
* ``builder.py``: ``vllm_destination``, a config + a spec packed as the
  ``DestinationBuilder`` the runtime (engine, receiver, session) takes;
* ``reference.py``: ``reference_load``, the same rules as vLLM-style
  weight loaders, for tests and ``--verify``.

It never loads vLLM and moves no bytes.

Public API::

    parse_inference_spec("vllm:tp=T[,dp=D][,ep][,...]") -> InferenceSpec(tp, dp, ep, placement,
                                                                         all2all, dtype)
    destination_layout(config, wire: Sequence[ParamMeta], spec) -> DestinationLayout
    vllm_destination(config, spec) -> VLLMDestination (callable: metas -> DestinationLayout)
    reference_load(config, checkpoint_tensors, spec, worker) -> {vLLM name: local tensor}
    supported_architectures() -> [architecture names]
    family_for(config) -> Family

Checked against the real vLLM 0.33.0 loaders (the dumps in ``tests/data/oracle``)
for every tiny model at tp 1/2/4/8 (and EP for MoE); the dumps ship in
``tests/data/oracle`` so CI without vLLM still compares against them.
"""

# Names load on first use (m2nkit._lazy): light modules of this package
# import without torch.
from m2nkit._lazy import lazy_attributes

_LAZY = {
    "family_for": ("..families", "family_for"),
    "supported_architectures": ("..families", "supported_architectures"),
    "VOCAB_PADDING": ("..families.kinds", "VOCAB_PADDING"),
    "VLLMDestination": (".builder", "VLLMDestination"),
    "vllm_destination": (".builder", "vllm_destination"),
    "destination_layout": (".destination", "destination_layout"),
    "DEFAULT_VLLM_VERSION": (".names", "DEFAULT_VLLM_VERSION"),
    "VLLM_NAMES": (".names", "VLLM_NAMES"),
    "reference_load": (".reference", "reference_load"),
    "InferenceSpec": (".spec", "InferenceSpec"),
    "parse_inference_spec": (".spec", "parse_inference_spec"),
}

__all__ = ['InferenceSpec', 'parse_inference_spec', 'destination_layout', 'vllm_destination', 'VLLMDestination', 'reference_load', 'supported_architectures', 'family_for', 'VLLM_NAMES', 'DEFAULT_VLLM_VERSION', 'VOCAB_PADDING']


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
