"""The vLLM side: what each vLLM worker holds, computed without vLLM installed.

m2nkit writes straight into a vLLM worker's local parameter storage, so it
must know vLLM's fused, sharded parameters. Per model family that knowledge
is data in ``m2nkit.adapters.families`` (one module per family, built from
the shard kinds of ``families/kinds.py``, each citing the vLLM 0.33.0 code
it restates). This package holds only what is the same for every family:

* ``spec.py``: the parallel spec ``vllm:tp=T[,dp=D][,ep]``;
* ``names.py``: vLLM parameter names that change between vLLM versions;
* ``destination.py``: ``destination_layout``, a family + a spec -> the
  ``DestinationLayout`` the planner intersects with the trainer's layout;
* ``builder.py``: ``vllm_destination``, a config + a spec packed as the
  ``DestinationBuilder`` the runtime (engine, receiver, session) takes;
* ``reference.py``: ``reference_load``, the same rules as vLLM-style
  weight loaders, for tests and ``--verify``.

It never loads vLLM and moves no bytes.

Public API::

    parse_inference_spec("vllm:tp=T[,dp=D][,ep]") -> InferenceSpec(tp, dp, ep)
    destination_layout(config, wire: Sequence[ParamMeta], spec) -> DestinationLayout
    vllm_destination(config, spec) -> VLLMDestination (callable: metas -> DestinationLayout)
    reference_load(config, checkpoint_tensors, spec, worker) -> {vLLM name: local tensor}
    supported_architectures() -> [architecture names]
    family_for(config) -> Family

Checked against the real vLLM 0.33.0 loaders (``shared/tools/vllm_oracle``)
for every tiny model at tp 1/2/4/8 (and EP for MoE); the dumps ship in
``tests/data/oracle`` so CI without vLLM still compares against them.
"""

from ..families import family_for, supported_architectures
from ..families.kinds import VOCAB_PADDING
from .builder import VLLMDestination, vllm_destination
from .destination import destination_layout
from .names import DEFAULT_VLLM_VERSION, VLLM_NAMES
from .reference import reference_load
from .spec import InferenceSpec, parse_inference_spec

__all__ = [
    "InferenceSpec",
    "parse_inference_spec",
    "destination_layout",
    "vllm_destination",
    "VLLMDestination",
    "reference_load",
    "supported_architectures",
    "family_for",
    "VLLM_NAMES",
    "DEFAULT_VLLM_VERSION",
    "VOCAB_PADDING",
]
