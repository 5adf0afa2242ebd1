"""A live FSDP2 (``fully_shard``) model as an M2N source: every rank sends its own shard.

RL trainers built on FSDP2 (verl, OpenRLHF, TRL, prime-rl, torchtitan) push
weights to vLLM either with ``full_tensor()`` per parameter (an all-gather of
every tensor on every rank) or a full state dict gathered to rank 0. That is
exactly the cost m2nkit removes, so :func:`fsdp2_source` never gathers: its
metadata is read off each parameter's ``DTensor`` spec (global shape, device
mesh, placements; no collective, identical on every rank), and its
``iter_local`` hands over each rank's ``to_local()`` shard, cast to the wire
dtype, one tensor at a time. It refuses what it cannot send shard to shard
(``Partial`` placements, a parameter that is not a ``DTensor`` on a sharded
model, a name no vLLM parameter takes) on every rank, before any traffic.
With ``merge_lora=True`` it sends peft LoRA layers merged into their base
weights, each rank merging its own shard (:mod:`.lora`).

Names. In-memory names become wire names (Hugging Face checkpoint names)
through the model's family (``m2nkit.adapters.families``: renames, fused
experts, per-expert names), after the wrapper prefixes of
``torch.compile``, activation checkpointing, FSDP1, DDP and PEFT are
stripped (``m2nkit.adapters.module_names``). This package holds no family
knowledge.

Which rows a rank holds. FSDP2 shards the tensor it is given (a plain
parameter, or the local tensor of a TP/EP ``DTensor``) on its shard dim with
``torch.chunk`` and pads the *storage* to ``ceil(n/k)`` rows per rank, but
the ``DTensor``'s local tensor is the unpadded ``narrow`` (torch
``distributed/fsdp/_fully_shard/_fsdp_param.py``,
``FSDPParam._init_sharded_param``, ``_chunk_with_empty`` in
``_fsdp_common.py``): rank ``i`` of ``k`` holds rows
``[i*c, min((i+1)*c, n))``, ``c = ceil(n/k)``, ranks past the end hold
``(0, ...)``. On top of tensor parallelism FSDP2 shards each TP rank's local
rows, i.e. right to left, and marks the data-parallel axis
``_StridedShard(dim, split_factor=<TP shards of that dim>)``
(``FSDPParam._init_sharding_spec_tp``). :func:`dtensor_box` applies that
order: the axes after a ``_StridedShard`` that shard the same dim split
first, then the strided axis splits each of their chunks. Every rank holds
one box. ``_StridedShard``'s own split (``placement_types.py``,
``_StridedShard._split_tensor``: ``split_factor`` chunks, each cut in
``mesh size`` chunks, a rank taking one of each) describes the same rows
when every split is even, and other rows when it is not (7 rows over
``tp=2`` then ``dp=3``: FSDP2 gives dp rank 2 / tp rank 0 no row and dp
rank 2 / tp rank 1 row 6; the strided split says the opposite); the tests
hold the rule against real ``to_local()`` data, uneven shapes included.

Parameters on a sub-mesh (norms of an FSDP+TP model live on the
data-parallel sub-mesh of each TP rank) are replicated over the other axes
of the root mesh (``DeviceMesh._get_root_mesh``), so every rank declares the
same owners for them. Pipeline parallelism (stages holding different layers)
is not supported.

One module per job, so the math can be read (and tested) without a model:

* :mod:`.dtensor`: which box each rank holds (``dtensor_box``; the
  ``fsdp2:`` dry-run spec uses it too);
* :mod:`.dtype`: the wire dtype policy (``wire_dtype_rule``);
* :mod:`.params`: the model's parameters and buffers, read live;
* :mod:`.names`: in-memory names -> wire names through the family;
* :mod:`.lora`: peft LoRA merged on each rank's shard;
* :mod:`.source`: ``fsdp2_source`` and ``FSDP2Source``, built from the above;
* :mod:`.errors`: ``FSDP2SourceError``.
"""

from .dtensor import dtensor_box
from .dtype import wire_dtype_rule
from .errors import FSDP2SourceError
from .source import FSDP2Source, fsdp2_source

__all__ = ["FSDP2SourceError", "FSDP2Source", "fsdp2_source", "dtensor_box", "wire_dtype_rule"]
