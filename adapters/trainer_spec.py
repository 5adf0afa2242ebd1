"""Trainer layouts for a checkpoint-backed source: who holds which box.

A checkpoint on disk has no trainer layout of its own. To plan or demo a
transfer from it, m2nkit pretends it is held by a trainer with one of the
layouts data-parallel RL trainers actually use, spelled as a short spec:

``replicated:N``
    N ranks, each holding every tensor whole (DDP, or a trainer that keeps
    an unsharded copy per rank).
``fsdp:N``
    FSDP2 ``fully_shard`` on a 1-D mesh of N ranks: every parameter is a
    DTensor with placement ``(Shard(0),)`` (PyTorch
    ``torch.distributed.fsdp.fully_shard``: "sharded on dim-0"; the 1-D
    mesh gives ``(Shard(0),)``). Chunks follow ``torch.chunk``, so with N
    not dividing dim 0 trailing ranks hold fewer rows or none.
``hsdp:R,S``
    FSDP2 HSDP: ``fully_shard`` on a 2-D mesh ``(R, S)`` replicates across
    the outer (0th) axis and shards across the inner (1st) one, placements
    ``(Replicate(), Shard(0))`` (``fully_shard`` docstring, ``mesh``
    argument). Rank ``r`` sits at mesh coordinate ``(r // S, r % S)``.

Every rank derives the same layouts from the spec alone; nothing is
exchanged. 0-d tensors cannot be sharded and are replicated on every rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from m2nkit.manifest.layout import SourceLayout
from m2nkit.manifest.placement import Placement, Replicate, Shard

__all__ = ["TrainerSpec", "parse_trainer_spec", "TRAINER_SPEC_FORMS"]

#: The accepted spec forms, as shown in error messages and ``--help``.
TRAINER_SPEC_FORMS = ("replicated:N", "fsdp:N", "hsdp:R,S")

_SPEC_RE = re.compile(r"^\s*(?P<kind>[A-Za-z_]+)\s*:\s*(?P<sizes>[^:]*?)\s*$")


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer layout: a row-major mesh over ranks ``0..num_ranks-1``.

    Attributes:
        kind: ``"replicated"``, ``"fsdp"`` or ``"hsdp"``.
        mesh_shape: ``(N,)`` for replicated and fsdp, ``(R, S)`` for hsdp.
        placements: one ``Shard``/``Replicate`` per mesh axis, applied to
            every tensor of rank >= 1.

    Build it with :func:`parse_trainer_spec`.
    """

    kind: str
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def num_ranks(self) -> int:
        """Trainer ranks in the mesh (product of ``mesh_shape``)."""
        return math.prod(self.mesh_shape)

    @property
    def owners(self) -> tuple[int, ...]:
        """Every trainer rank, in mesh (row-major) order."""
        return tuple(range(self.num_ranks))

    def layout_for(self, shape: Sequence[int]) -> SourceLayout:
        """The source layout of a tensor of global ``shape`` under this spec.

        0-d tensors are replicated on every rank (a scalar has no dim 0 to
        shard); everything else gets ``placements`` on ``mesh_shape``.
        """
        placements = self.placements if len(tuple(shape)) > 0 else None
        return SourceLayout(self.owners, self.mesh_shape, placements,
                            where=f"trainer spec '{self}'")

    def coord(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of trainer ``rank`` (row-major).

        Raises:
            ValueError: ``rank`` is not in ``0..num_ranks-1``.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"trainer rank {rank!r} is not in trainer spec '{self}'; valid ranks "
                f"are 0..{self.num_ranks - 1}"
            )
        out = []
        for size in reversed(self.mesh_shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(str(m) for m in self.mesh_shape)}"


#: Largest trainer world m2nkit plans for (a guard against typos like fsdp:99999999999).
MAX_TRAINER_RANKS = 1 << 16


def _bad(spec: object, why: str) -> ValueError:
    return ValueError(
        f"trainer spec {spec!r}: {why}; valid specs are "
        f"{', '.join(TRAINER_SPEC_FORMS)} with positive integers "
        "(e.g. 'fsdp:4', 'hsdp:2,4', 'replicated:2')"
    )


def parse_trainer_spec(spec: str | TrainerSpec) -> TrainerSpec:
    """Parse ``replicated:N``, ``fsdp:N`` or ``hsdp:R,S`` into a ``TrainerSpec``.

    A ``TrainerSpec`` is returned unchanged. Case and spaces around the
    parts are ignored.

    Raises:
        ValueError: an unknown kind, a wrong number of sizes, or a size
            that is not a positive integer; the message lists the valid
            forms.
    """
    if isinstance(spec, TrainerSpec):
        return spec
    if not isinstance(spec, str):
        raise _bad(spec, f"expected a string, got {type(spec).__name__}")
    m = _SPEC_RE.match(spec)
    if m is None:
        raise _bad(spec, "expected KIND:SIZES")
    kind = m.group("kind").lower()
    if kind not in ("replicated", "fsdp", "hsdp"):
        raise _bad(spec, f"unknown kind '{kind}'")
    parts = [p.strip() for p in m.group("sizes").split(",")]
    sizes = []
    for p in parts:
        if not (p.isascii() and p.isdigit()) or int(p) <= 0:
            raise _bad(spec, f"size {p!r} is not a positive integer")
        sizes.append(int(p))
    total = 1
    for n in sizes:
        total *= n
    if total > MAX_TRAINER_RANKS:
        raise _bad(spec, f"{total} trainer ranks is more than m2nkit plans for "
                         f"({MAX_TRAINER_RANKS})")
    if kind in ("replicated", "fsdp"):
        if len(sizes) != 1:
            raise _bad(spec, f"'{kind}' takes one size N, got {len(sizes)}")
        placement: Placement = Replicate() if kind == "replicated" else Shard(0)
        return TrainerSpec(kind, (sizes[0],), (placement,))
    if kind == "hsdp":
        if len(sizes) != 2:
            raise _bad(spec, f"'hsdp' takes two sizes R,S (replicas, shards), got {len(sizes)}")
        return TrainerSpec(kind, (sizes[0], sizes[1]), (Replicate(), Shard(0)))
    raise _bad(spec, f"unknown kind '{kind}'")
