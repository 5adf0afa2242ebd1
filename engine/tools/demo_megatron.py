"""``m2nkit demo --trainer megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D]``.

Megatron-Core trainers sending their own shards with ``megatron_source``
(``m2nkit.adapters.megatron.source``) into m2nkit's stand-in vLLM workers.
The trainer processes are the Megatron-Bridge demo's
(``engine/tools/demo_bridge.py``): each joins a gloo world over 127.0.0.1,
initialises megatron-core's model-parallel groups, builds real
``GPTModel`` chunks with megatron-core's local layer spec and loads the
checkpoint through ``AutoBridge.load_hf_weights``; every round it changes
every parameter in place (``perturb``) and sends with the real
``M2NTrainerEngine`` over torch_p2p. The one difference from the Bridge
demo is the source: ``megatron_source(model_chunks, config=...)``, which
reads the live tensors (fused QKV shards, ``[gate_r; up_r]``, padded
vocabulary rows, local experts, one model chunk per virtual stage) and
never gathers. After each round the driver compares every worker's storage
bit for bit with vLLM's loaders (``reference_load``) applied to Bridge's own
``export_hf_weights`` of the changed weights, an independent HF-form copy.

Importing this module is cheap (no torch, no megatron).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MEGATRON_DEMO_FORM", "MegatronDemoSpec", "parse_megatron_demo_spec",
           "run_megatron_demo"]

MEGATRON_DEMO_FORM = "megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D]"


class MegatronDemoSpec:
    """A ``megatron:`` trainer spec the demo can run: sizes, world ``tp*dp*pp``."""

    def __init__(self, par: Any, text: str) -> None:
        self.par = par  # m2nkit.adapters.megatron.layout.MegatronParallel
        self._text = text

    @property
    def num_ranks(self) -> int:
        return self.par.world

    def __str__(self) -> str:
        return self._text


def parse_megatron_demo_spec(text: str) -> MegatronDemoSpec:
    """Parse a ``megatron:`` spec for the demo (the dry-run grammar, minus ``first``/``last``).

    Raises:
        ValueError: not a ``megatron:`` spec, a size megatron-core refuses
            (one line, naming the value and the valid form), or
            ``first``/``last`` (uneven stages are planned by ``m2nkit plan``
            and tested in tests/integration/test_megatron_source.py; the demo
            builds even stages).
    """
    from m2nkit.adapters.trainer_spec import parse_trainer_spec

    spec = parse_trainer_spec(text)
    if spec.megatron is None:
        raise ValueError(f"trainer spec '{text}' is not {MEGATRON_DEMO_FORM}")
    if spec.megatron.first is not None or spec.megatron.last is not None:
        raise ValueError(f"trainer spec '{text}': the demo builds even pipeline stages; first= "
                         f"and last= are for m2nkit plan ({MEGATRON_DEMO_FORM})")
    return MegatronDemoSpec(spec.megatron.par, str(spec.megatron))


def run_megatron_demo(model: str, trainer: str, inference: str, **kwargs):
    """Run the Megatron-Core demo; returns a ``DemoResult`` of verified rounds.

    Args:
        model: a built-in tiny model name or a checkpoint directory of an
            architecture both Megatron-Bridge (the loader) and m2nkit know.
        trainer: ``megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D]``.
        inference: ``vllm:...`` as for ``m2nkit plan``.
        kwargs: ``rounds``, ``timeout_s``, ``bucket_bytes``, ``workdir``,
            ``log``, ``start_method`` as for
            ``m2nkit.engine.tools.demo_bridge.run_bridge_demo``.

    Raises:
        ValueError: bad model, specs or round count (one line).
        RuntimeError: a trainer failed (its message and rank; a
            ``MegatronSourceError`` names the rank that found the problem),
            or a worker's bytes or version differ after a round.
    """
    from m2nkit.engine.tools.demo_bridge import MEGATRON_SOURCE, run_bridge_demo

    parse_megatron_demo_spec(trainer)  # refuse here, before any process starts
    return run_bridge_demo(model, trainer, inference, mode=MEGATRON_SOURCE, **kwargs)
