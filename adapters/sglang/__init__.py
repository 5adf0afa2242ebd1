"""The SGLang side: what each SGLang 0.5.23 worker holds, computed without SGLang installed.

SGLang's fused, sharded parameters are vLLM's for the families checked here
(``qkv_proj``, ``gate_up_proj``, the same vocab padding and KV-head
replication), so the layout is m2nkit's vLLM tables
(``m2nkit.adapters.vllm.destination_layout``) plus the rules where SGLang
differs, each named in ``rules.py`` with the SGLang source it restates:

* ``spec.py``: the spec ``sglang:tp=T[,dp=D][,ep][,dtype=X]``;
* ``rules.py``: SGLang's names (experts, no router alias), its ``auto``
  dtype, DeepSeek-V3's fused q_a/kv_a name, one alias (a tied lm_head), EP
  inside one replica, and the architectures checked against
  SGLang's own loaders;
* ``destination.py``: ``sglang_destination_layout``, a config + a spec ->
  the ``DestinationLayout`` the planner takes.

Checked against SGLang 0.5.23's real model classes and ``load_weights`` on
CPU over gloo (``tests/integration/test_sglang_layout.py``). It never loads
SGLang and moves no bytes.

Public API::

    parse_sglang_spec("sglang:tp=T[,dp=D][,ep][,dtype=X]") -> SGLangSpec(tp, dp, ep, dtype)
    sglang_destination_layout(config, wire: Sequence[ParamMeta], spec) -> DestinationLayout
    sglang_destination(config, spec) -> SGLangDestination (a DestinationBuilder, for sessions)
    SGLANG_ARCHITECTURES: the architectures checked against SGLang's loaders
"""

from m2nkit._lazy import lazy_attributes

_LAZY = {
    "SGLangSpec": (".spec", "SGLangSpec"),
    "parse_sglang_spec": (".spec", "parse_sglang_spec"),
    "is_sglang_spec": (".spec", "is_sglang_spec"),
    "SGLANG_ARCHITECTURES": (".rules", "SGLANG_ARCHITECTURES"),
    "sglang_destination_layout": (".destination", "sglang_destination_layout"),
    "sglang_destination": (".destination", "sglang_destination"),
    "SGLangDestination": (".destination", "SGLangDestination"),
}

__all__ = ["SGLangSpec", "parse_sglang_spec", "is_sglang_spec", "SGLANG_ARCHITECTURES",
           "sglang_destination_layout", "sglang_destination", "SGLangDestination"]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
