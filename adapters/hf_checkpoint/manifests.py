"""A checkpoint laid out as a trainer spec holds it: metadata for planning, a source per rank.

The trainer spec (``fsdp:N``, ``fsdp2:...``, ``megatron:...``;
``m2nkit.adapters.trainer_spec``) decides each wire tensor's layout; the
metadata is the same on every rank, and a rank's source reads exactly its
own box of each tensor from disk when the transport asks for it.
"""

from __future__ import annotations

import functools

from m2nkit.manifest.meta import ParamMeta
from m2nkit.manifest.pieces import PieceLayout

from ..trainer_spec import TrainerSpec, parse_trainer_spec
from .checkpoint import Checkpoint

__all__ = ["checkpoint_metas", "checkpoint_manifest"]


def checkpoint_metas(checkpoint: Checkpoint, trainer_spec: TrainerSpec | str) -> list[ParamMeta]:
    """Every wire tensor as a ``ParamMeta`` with the trainer spec's layout.

    Identical on every rank (depends on headers, config and spec only).
    With a ``tp`` axis (``fsdp2:dp_shard=S,tp=T``) the family's TP plan
    decides each tensor's layout (``TrainerSpec.tp_dims``); FSDP2's strided
    layouts become explicit pieces. Tensors transformers holds as buffers
    are whole on every rank (``TrainerSpec.buffers``).

    Raises:
        ValueError: a malformed trainer spec; ``tp > 1`` for a family without
            a TP plan, or a ``tp`` its plan cannot split the model over.
    """
    spec = parse_trainer_spec(trainer_spec)
    tp_dim = spec.tp_dims(checkpoint.config)
    buffer = spec.buffers(checkpoint.config)  # whole on every FSDP2 rank
    out = []
    for p in checkpoint.params:
        lay = spec.layout_for(p.shape, tp_dim=tp_dim(p.name), buffer=buffer(p.name))
        if isinstance(lay, PieceLayout):
            out.append(ParamMeta(p.name, p.dtype, p.shape, pieces=lay.pieces))
        else:
            out.append(ParamMeta(p.name, p.dtype, p.shape, lay.owners, lay.mesh_shape,
                                 lay.placements))
    return out


def checkpoint_manifest(checkpoint: Checkpoint, trainer_spec: TrainerSpec | str, rank: int):
    """A ``ManifestM2NWeightSource`` for trainer ``rank`` holding its box of the checkpoint.

    One ``M2NManifestEntry`` per wire tensor, in wire order, with the
    spec's layout; its ``local_tensor`` reads exactly this rank's box
    (``local_box`` at the rank's mesh coordinate) via
    :meth:`Checkpoint.read_box`, only when called. Ranks with an empty box
    (``fsdp:N`` with N above dim 0) get an empty tensor of the right shape.

    Raises:
        ValueError: a malformed trainer spec, or ``rank`` outside it.
    """
    from m2nkit.manifest.source import M2NManifestEntry, ManifestM2NWeightSource

    spec = parse_trainer_spec(trainer_spec)
    spec.coord(rank)  # refuses a rank outside the spec before anything else
    tp_dim = spec.tp_dims(checkpoint.config)
    buffer = spec.buffers(checkpoint.config)
    entries = []
    for p in checkpoint.params:
        lay = spec.layout_for(p.shape, tp_dim=tp_dim(p.name), buffer=buffer(p.name))
        box = spec.local_box(p.shape, rank, tp_dim=tp_dim(p.name), buffer=buffer(p.name))
        entries.append(M2NManifestEntry(
            p.name, p.dtype, p.shape, lay,
            functools.partial(checkpoint.read_box, p.name, box),
        ))
    return ManifestM2NWeightSource(entries, rank=rank)
