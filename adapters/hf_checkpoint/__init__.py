"""Hugging Face safetensors checkpoints as wire tensors, read box by box.

A checkpoint (or just its ``config.json``) becomes an ordered list of wire
tensors (docs/reference.md §3, §4): the on-disk names, except that MoE
experts stored one tensor per expert are re-fused into the stacked
``<prefix>.experts.gate_up_proj.weight [E, 2*Im, H]`` and
``<prefix>.experts.down_proj.weight [E, H, Im]`` that vLLM's routed-experts
contract takes, and that a tensor a family stores in another dim order than
the wire's (``HFNaming.permuted``) travels permuted, read box by box from the
permuted box on disk.

Planning reads **headers only**: names, dtypes and shapes come from the
safetensors headers (``safe_open(...).keys()``, ``get_slice(name).get_shape()``)
and are checked against the tensors the config says the model has; no tensor
data is read. Data is read later, one box at a time
(:meth:`Checkpoint.read_box`), through ``get_slice(name)[slices]``, so a
trainer rank reads only the rows it would hold and never the whole file.

What the config expects comes from transformers itself: the model is built
on the meta device (``AutoModelForCausalLM.from_config``) and its
``named_parameters()`` are taken, in order; that order is the wire order, so
every rank builds the same manifest. transformers 5 keeps experts fused in
memory but writes them per expert on disk, and names a few blocks
differently in memory than on disk; each family's module in
``m2nkit.adapters.families`` holds that naming as data (``HF_NAMES``, an
``HFNaming``), and this module holds none. An architecture without a family
is refused with the registry's one message.

A config-only checkpoint (a bare ``config.json``, what ``m2nkit plan`` takes
for a model nobody has downloaded) skips transformers altogether: the family
table lists the same wire tensors in the same order
(``m2nkit.adapters.config_wires``), which for Kimi-K2 takes a tenth of a
second instead of several, most of them importing transformers' modeling
code. The meta model stays the reference (``via_transformers=True``), and
the fallback for a config the table does not describe exactly.

Every defect a user can hit (missing or corrupt files, wrong shapes,
unsupported dtypes, incomplete expert sets) raises :class:`CheckpointError`
naming the file, the tensor, the value and what was expected.

One module per job: :mod:`.files` (safetensors I/O: files, headers, index,
boxes), :mod:`.config` (``config.json`` and the meta model), :mod:`.match`
(expected tensors against on-disk names), :mod:`.checkpoint`
(``Checkpoint``, ``read_checkpoint``), :mod:`.manifests` (a trainer spec's
layout: ``checkpoint_metas``, ``checkpoint_manifest``), :mod:`.errors`.
"""

from .checkpoint import Checkpoint, full_checkpoint_tensors, read_checkpoint
from .errors import CheckpointError
from .files import SAFETENSORS_DTYPES
from .manifests import checkpoint_manifest, checkpoint_metas

__all__ = [
    "CheckpointError",
    "SAFETENSORS_DTYPES",
    "Checkpoint",
    "read_checkpoint",
    "checkpoint_metas",
    "checkpoint_manifest",
    "full_checkpoint_tensors",
]
