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
``fsdp2:dp_shard=N``, ``fsdp2:dp_replicate=R,dp_shard=S``, ``fsdp2:dp_shard=S,tp=T``
    FSDP2 as torchtitan lays it out, axes named as its ``ParallelDims``
    (``dp_replicate``, ``dp_shard``, ``tp``; any of the three with
    ``dp_shard``), mesh in that order, row-major (``init_device_mesh``).
    Without ``tp`` the boxes are ``fsdp:N``'s and ``hsdp:R,S``'s.
    With ``tp`` the family's TP plan (``Family.tp_plan``: colwise/rowwise
    per module) says which dim TP shards a tensor on, and FSDP2 shards each
    TP rank's local tensor on dim 0 (placements ``(_StridedShard(0,
    split_factor=T), Shard(0))`` for a TP ``Shard(0)``, ``(Shard(0),
    Shard(d))`` for a TP ``Shard(d)``, ``(Shard(0), Replicate())`` for a
    tensor TP leaves whole); the boxes come from the FSDP2 adapter's rule,
    :func:`m2nkit.adapters.fsdp2.dtensor_box`, the one ``fsdp2_source``
    reads a live model with.

``megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D][,first=N][,last=N]``
    A Megatron-Core trainer (``GPTModel`` with tensor, pipeline, virtual
    pipeline, expert and expert-tensor parallelism): fused QKV rows per
    query group, ``[gate_r; up_r]`` MLP shards, padded vocabularies, experts
    per ep rank, layers per pipeline stage, as explicit pieces from the rules
    the live Megatron source uses (:mod:`m2nkit.adapters.megatron.spec`,
    :mod:`m2nkit.adapters.megatron.layout`). Mesh ``(pp, dp, tp)``.

Every rank derives the same layouts from the spec alone; nothing is
exchanged. 0-d tensors cannot be sharded and are replicated on every rank.
So are the tensors transformers holds as buffers (``HFNaming.buffers``:
DeepSeek-V3's ``e_score_correction_bias``) under every FSDP2 spec
(``fsdp``, ``hsdp``, ``fsdp2``): ``fully_shard`` shards parameters only
and leaves buffers whole on every rank, which is what ``fsdp2_source``
reads off a live model (:meth:`TrainerSpec.buffers`). A ``tp`` the family's
TP plan cannot split (``Family.tp_problem``: whole heads, even MLP) is
refused by :meth:`TrainerSpec.tp_dims`, naming the valid sizes.
Parsing imports neither torch nor a family module (the CLI refuses a bad
spec in milliseconds); the TP layouts import both when first asked for.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Sequence

from m2nkit.manifest.layout import SourceLayout, local_box
from m2nkit.manifest.pieces import Box, Piece, PieceLayout, box_volume
from m2nkit.manifest.placement import Placement, Replicate, Shard

__all__ = ["TrainerSpec", "parse_trainer_spec", "TRAINER_SPEC_FORMS", "FSDP2_AXES"]

#: The accepted spec forms, as shown in error messages and ``--help``.
TRAINER_SPEC_FORMS = ("replicated:N", "fsdp:N", "hsdp:R,S", "fsdp2:dp_shard=N",
                      "fsdp2:dp_replicate=R,dp_shard=S", "fsdp2:dp_shard=S,tp=T",
                      "megatron:tp=T,pp=P[,vpp=V][,ep=E][,etp=X][,dp=D][,first=N][,last=N]")

#: Mesh axes of an ``fsdp2:`` spec, in mesh order (torchtitan ``ParallelDims``
#: names; ``dp_shard`` is required).
FSDP2_AXES = ("dp_replicate", "dp_shard", "tp")

_SPEC_RE = re.compile(r"^\s*(?P<kind>[A-Za-z_][A-Za-z0-9_]*)\s*:\s*(?P<sizes>[^:]*?)\s*$")


@dataclass(frozen=True)
class TrainerSpec:
    """A trainer layout: a row-major mesh over ranks ``0..num_ranks-1``.

    Attributes:
        kind: ``"replicated"``, ``"fsdp"``, ``"hsdp"`` or ``"fsdp2"``.
        mesh_shape: ``(N,)`` for replicated and fsdp, ``(R, S)`` for hsdp,
            one size per axis of ``mesh_dim_names`` for fsdp2.
        placements: one ``Shard``/``Replicate`` per mesh axis, applied to
            every tensor of rank >= 1 that tensor parallelism leaves whole.
        mesh_dim_names: fsdp2: the axes, a subsequence of
            :data:`FSDP2_AXES`; megatron: ``("pp", "dp", "tp")``; else ``None``.
        megatron: megatron: the parsed sizes
            (``m2nkit.adapters.megatron.spec.MegatronSpec``); else ``None``.

    Build it with :func:`parse_trainer_spec`.
    """

    kind: str
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh_dim_names: tuple[str, ...] | None = None
    megatron: Any = None

    @property
    def num_ranks(self) -> int:
        """Trainer ranks in the mesh (product of ``mesh_shape``)."""
        return math.prod(self.mesh_shape)

    @cached_property
    def owners(self) -> tuple[int, ...]:
        """Every trainer rank, in mesh (row-major) order (one tuple per spec: layouts
        sharing it check its ranks once, ``m2nkit.manifest.layout``)."""
        return tuple(range(self.num_ranks))

    @property
    def tp(self) -> int:
        """Tensor-parallel size (the ``tp`` axis of an fsdp2 spec; 1 without one)."""
        names = self.mesh_dim_names or ()
        return self.mesh_shape[names.index("tp")] if "tp" in names else 1

    def layout_for(self, shape: Sequence[int], *, tp_dim: int | None = None,
                   buffer: bool = False) -> SourceLayout | PieceLayout:
        """The source layout of a tensor of global ``shape`` under this spec.

        0-d tensors are replicated on every rank (a scalar has no dim 0 to
        shard), and so is a ``buffer`` (a tensor transformers holds as a
        buffer, :meth:`buffers`: FSDP2 never shards one, ``HFNaming.buffers``
        cites torch); everything else gets ``placements`` on ``mesh_shape``, except
        that on an fsdp2 spec with a ``tp`` axis ``tp_dim`` (the dim the TP
        plan shards the tensor on, :meth:`tp_dims`) changes the placements as
        FSDP2 does (module docstring): a ``SourceLayout`` for ``tp_dim != 0``,
        the pieces of :func:`m2nkit.adapters.fsdp2.dtensor_box` (a
        ``PieceLayout``; ranks holding nothing have no piece) for
        ``tp_dim == 0``.

        Raises:
            ValueError: ``tp_dim`` outside ``shape``.
        """
        shape = tuple(shape)
        if self.megatron is not None:  # tp_dim: the wire tensor's key from tp_dims()
            from .megatron.spec import layout_of_key

            return layout_of_key(tp_dim, shape, str(self))
        if len(shape) == 0 or buffer:
            return SourceLayout(self.owners, self.mesh_shape, None, where=f"trainer spec '{self}'")
        if tp_dim is None or self.tp == 1:
            return SourceLayout(self.owners, self.mesh_shape, self.placements,
                                where=f"trainer spec '{self}'")
        if not 0 <= tp_dim < len(shape):
            raise ValueError(f"trainer spec '{self}': tp_dim {tp_dim} is not a dim of a tensor of "
                             f"shape {list(shape)}")
        return _tp_layout(self, shape, tp_dim)

    def local_box(self, shape: Sequence[int], rank: int, *, tp_dim: int | None = None,
                  buffer: bool = False) -> Box:
        """The box of a tensor of global ``shape`` that trainer ``rank`` holds (may be empty).

        Raises:
            ValueError: ``rank`` not in the spec; see :meth:`layout_for`.
        """
        coord = self.coord(rank)
        if self.megatron is not None:
            raise ValueError(
                f"trainer spec '{self}': a Megatron rank holds several pieces of one wire tensor "
                "(fused QKV, [gate; up]), not one box, so a checkpoint cannot stand in for it "
                "rank by rank; plan without --verify, or run m2nkit demo --trainer "
                f"{self} (real GPTModels)")
        lay = self.layout_for(shape, tp_dim=tp_dim, buffer=buffer)
        if isinstance(lay, SourceLayout):
            return local_box(tuple(shape), lay.mesh_shape, lay.placements, coord)
        return _strided_boxes(self, tuple(shape), tp_dim)[rank]

    def tp_dims(self, config: Any) -> Callable[[str], int | None]:
        """``wire name -> tp_dim`` for :meth:`layout_for`: the family's TP plan (``Family.tp_plan``).

        Without a ``tp`` axis every name maps to ``None``.

        Raises:
            ValueError: ``tp > 1`` for a family without a TP plan (names it
                and the families that have one); a ``tp`` the plan cannot
                split this config over (``Family.tp_problem``: names the
                config value and the valid tp sizes); an unsupported
                architecture.
        """
        if self.megatron is not None:  # Megatron's own rules (m2nkit.adapters.megatron.spec)
            from .megatron.spec import megatron_wire_rules

            return megatron_wire_rules(self.megatron, config, str(self))
        if self.tp == 1:
            return lambda name: None
        from .families import ARCHITECTURES, family
        from .families.tableless import family_or_tableless

        fam = family_or_tableless(config)
        if fam.tp_plan is None:
            having = sorted(a for a in ARCHITECTURES if family(a).tp_plan is not None)
            raise ValueError(
                f"trainer spec '{self}': {fam.architecture} has no tensor-parallel plan "
                f"(Family.tp_plan in {fam.module}), so tp={self.tp} cannot be laid out; "
                f"families with one: {', '.join(having)}; or drop tp")
        why = fam.tp_problem(self.tp, config)
        if why:
            raise ValueError(f"trainer spec '{self}': {why}")
        return lambda name: fam.tp_plan.shard_dim(name, config)

    def buffers(self, config: Any) -> Callable[[str], bool]:
        """``wire name -> buffer`` for :meth:`layout_for`: what transformers holds as a buffer.

        The family's ``HFNaming.buffers`` (:mod:`m2nkit.adapters.families`);
        every name maps to ``False`` under ``replicated`` (everything is
        whole there anyway).

        Raises:
            ValueError: an unsupported architecture.
        """
        if self.kind in ("replicated", "megatron"):  # megatron: tp_dims() knows buffers
            return lambda name: False
        from .families.tableless import family_or_tableless

        return family_or_tableless(config).hf.is_buffer

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
        if self.megatron is not None:
            return str(self.megatron)
        if self.mesh_dim_names is not None:
            return f"{self.kind}:" + ",".join(
                f"{n}={m}" for n, m in zip(self.mesh_dim_names, self.mesh_shape))
        return f"{self.kind}:{','.join(str(m) for m in self.mesh_shape)}"


def _torch_placements(spec: TrainerSpec, tp_dim: int) -> tuple:
    """The torch placements FSDP2 gives a tensor TP shards on ``tp_dim`` (module docstring)."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for name in spec.mesh_dim_names:
        if name == "dp_replicate":
            out.append(TReplicate())
        elif name == "dp_shard":
            out.append(_StridedShard(0, split_factor=spec.tp) if tp_dim == 0 else TShard(0))
        else:  # tp
            out.append(TShard(tp_dim))
    return tuple(out)


@lru_cache(maxsize=4096)
def _strided_boxes(spec: TrainerSpec, shape: tuple[int, ...], tp_dim: int) -> dict[int, Box]:
    """Every rank's box of a tensor TP shards on ``tp_dim``, by the FSDP2 adapter's rule."""
    from .fsdp2 import dtensor_box

    placements = _torch_placements(spec, tp_dim)
    return {r: dtensor_box(shape, spec.mesh_shape, placements, spec.coord(r), name=str(spec))
            for r in spec.owners}


@lru_cache(maxsize=4096)
def _tp_layout(spec: TrainerSpec, shape: tuple[int, ...], tp_dim: int) -> SourceLayout | PieceLayout:
    if tp_dim != 0:  # plain shards: dp rows, TP dim tp_dim (what fsdp2_source declares too)
        placements = tuple(Shard(tp_dim) if n == "tp" else p
                           for n, p in zip(spec.mesh_dim_names, spec.placements))
        return SourceLayout(spec.owners, spec.mesh_shape, placements, where=f"trainer spec '{spec}'")
    boxes = _strided_boxes(spec, shape, tp_dim)
    return PieceLayout(tuple(Piece(r, b) for r, b in boxes.items() if box_volume(b)),
                       where=f"trainer spec '{spec}'")


#: Largest trainer world m2nkit plans for (a guard against typos like fsdp:99999999999).
MAX_TRAINER_RANKS = 1 << 16


def _bad(spec: object, why: str) -> ValueError:
    return ValueError(
        f"trainer spec {spec!r}: {why}; valid specs are "
        f"{', '.join(TRAINER_SPEC_FORMS)} with positive integers "
        "(e.g. 'fsdp:4', 'hsdp:2,4', 'replicated:2', 'fsdp2:dp_shard=4,tp=2')"
    )


def _positive(spec: object, text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise _bad(spec, f"size {text!r} is not a positive integer")
    return int(text)


def _check_total(spec: object, sizes: Sequence[int]) -> None:
    total = math.prod(sizes)
    if total > MAX_TRAINER_RANKS:
        raise _bad(spec, f"{total} trainer ranks is more than m2nkit plans for "
                         f"({MAX_TRAINER_RANKS})")


def _parse_fsdp2(spec: str, body: str) -> TrainerSpec:
    """``dp_replicate=R,dp_shard=S,tp=T`` (any order, ``dp_shard`` required)."""
    sizes: dict[str, int] = {}
    for part in body.split(","):
        key, eq, value = (x.strip() for x in part.partition("="))
        key = key.lower()
        if not eq:
            raise _bad(spec, f"'fsdp2' takes AXIS=SIZE pairs, got {part.strip()!r}")
        if key not in FSDP2_AXES:
            raise _bad(spec, f"'fsdp2' axis {key!r} is not supported; axes are "
                             f"{', '.join(FSDP2_AXES)} (torchtitan ParallelDims names)")
        if key in sizes:
            raise _bad(spec, f"'fsdp2' axis {key!r} is given twice")
        sizes[key] = _positive(spec, value)
    if "dp_shard" not in sizes:
        raise _bad(spec, "'fsdp2' needs dp_shard (the axis fully_shard shards over)")
    names = tuple(n for n in FSDP2_AXES if n in sizes)
    _check_total(spec, list(sizes.values()))
    placements = tuple(Shard(0) if n == "dp_shard" else Replicate() for n in names)
    return TrainerSpec("fsdp2", tuple(sizes[n] for n in names), placements, names)


def parse_trainer_spec(spec: str | TrainerSpec) -> TrainerSpec:
    """Parse a trainer spec (:data:`TRAINER_SPEC_FORMS`) into a ``TrainerSpec``.

    ``replicated:N``, ``fsdp:N``, ``hsdp:R,S``, or ``fsdp2:`` with
    ``AXIS=SIZE`` pairs over :data:`FSDP2_AXES` (``dp_shard`` required).
    A ``TrainerSpec`` is returned unchanged. Case and spaces around the
    parts are ignored. Imports no torch.

    Raises:
        ValueError: an unknown kind or fsdp2 axis, a wrong number of sizes,
            a missing ``dp_shard``, or a size that is not a positive integer;
            the message lists the valid forms.
    """
    if isinstance(spec, TrainerSpec):
        return spec
    if not isinstance(spec, str):
        raise _bad(spec, f"expected a string, got {type(spec).__name__}")
    m = _SPEC_RE.match(spec)
    if m is None:
        raise _bad(spec, "expected KIND:SIZES")
    kind = m.group("kind").lower()
    if kind == "fsdp2":
        return _parse_fsdp2(spec, m.group("sizes"))
    if kind == "megatron":
        from .megatron.spec import parse_megatron_body

        ms = parse_megatron_body(spec, m.group("sizes"), _bad)
        mesh = (ms.par.pp, ms.par.dp, ms.par.tp)
        _check_total(spec, mesh)
        return TrainerSpec("megatron", mesh, (Replicate(),) * 3, ("pp", "dp", "tp"), ms)
    if kind not in ("replicated", "fsdp", "hsdp"):
        raise _bad(spec, f"unknown kind '{kind}'")
    sizes = [_positive(spec, p.strip()) for p in m.group("sizes").split(",")]
    _check_total(spec, sizes)
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
