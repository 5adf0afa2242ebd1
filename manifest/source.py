"""Weight sources: what a trainer rank declares and hands over, tensor by tensor.

A trainer engine needs two things from the trainer: the *metadata* of every
wire tensor (name, dtype, global shape, source layout), identical on every
rank so that every rank derives the same plan with no exchange, and a way to
produce each tensor when the engine reaches it, one at a time. This module
defines that contract (``WeightSource``, after vLLM
``vllm/distributed/weight_transfer/base.py``) and its implementations:

* ``ModuleSource`` — any ``torch.nn.Module``, plain or DTensor parameters.
* ``M2NWeightSource`` — the shard-to-shard flavour: iteration yields each
  rank's *local* piece and never a full tensor, because gathering is exactly
  the cost m2n removes (vLLM ``m2n_source.py``).
* ``ManifestM2NWeightSource`` — a fixed list of ``M2NManifestEntry`` whose
  local tensors come from lazy providers; what the adapters build.
* ``DTensorModuleSource`` — a module whose DTensor parameters live on a
  contiguous ``[0, n)`` mesh of at most two axes (nccl_m2n's model).

Which rank a source is: every source takes ``rank`` (keyword) at
construction. When it is not given, the source uses the global rank of the
default ``torch.distributed`` process group at the time it is asked (0 when
no process group is initialised). Trainer ranks are the ranks ``[0, T)`` of
that group, which is also how DTensor meshes name them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .layout import Box, SourceLayout, local_box
from .pieces import PieceLayout
from .m2n_layout import is_m2n_layout, layout_from_m2n
from .meta import ParamMeta
from .placement import Placement, Replicate, Shard

__all__ = [
    "WeightSource",
    "materialize_full_tensor",
    "ModuleSource",
    "M2NWeightSource",
    "M2NManifestEntry",
    "ManifestM2NWeightSource",
    "DTensorModuleSource",
    "mesh_from_tensor",
    "placements_from_tensor",
    "layout_from_dtensor",
    "owner_box",
]


# --------------------------------------------------------------------------
# helpers


def _check_rank(rank: object, where: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{where}: rank must be an int, got {rank!r}")
    if rank < 0:
        raise ValueError(f"{where}: rank must be >= 0, got {rank}")
    return rank


def _default_rank() -> int:
    """Global rank of the default process group, or 0 when there is none."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _wait(t: torch.Tensor) -> torch.Tensor:
    # DTensor.to_local()/full_tensor() may hand back an AsyncCollectiveTensor
    # whose collective is still in flight; .wait() returns the finished tensor.
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


def owner_box(layout: SourceLayout, shape: Sequence[int], rank: int) -> Box | None:
    """The global box of ``shape`` that trainer ``rank`` holds under ``layout``.

    ``owners=None`` means every rank holds the full tensor. The rank's mesh
    coordinate is its position in ``owners`` unravelled row-major over
    ``mesh_shape``; the box then follows ``layout.local_box`` (torch.chunk
    splits, outer axis first).

    Returns:
        The box (one ``(start, stop)`` per dim), or ``None`` when ``rank`` is
        not an owner.
    """
    if layout.owners is None:
        return tuple((0, n) for n in shape)
    try:
        flat = layout.owners.index(rank)
    except ValueError:
        return None
    coord = []
    for size in reversed(layout.mesh_shape):
        coord.append(flat % size)
        flat //= size
    return local_box(shape, layout.mesh_shape, layout.placements, tuple(reversed(coord)))


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


# --------------------------------------------------------------------------
# the contract


class WeightSource(ABC):
    """The trainer's weights as wire tensors, declared up front, produced lazily.

    Subclasses define ``metadata`` as a ``functools.cached_property``
    returning ``list[ParamMeta]`` (the whole model, identical on every trainer
    rank, in send order) and override ``iter_full``, ``iter_local`` or both.
    Each iterator yields ``(name, tensor)`` for exactly ``owned_names()`` of
    this rank, in metadata order, producing one tensor at a time: ranks that
    share a tensor may materialise it with a collective, so they must reach it
    in the same order.

    * ``iter_full()`` yields the whole global tensor (shape ``meta.shape``);
      it may all-gather.
    * ``iter_local()`` yields this rank's piece: the box of ``meta.shape``
      that the layout assigns to this rank (see ``owner_box``).

    Rule from vLLM ``weight_transfer/base.py`` (``WeightSource``): metadata is
    a cached property, so reading it twice never re-exports the model and
    never differs between calls.

    Args:
        rank: this trainer rank; default: the global rank of the initialised
            default process group, else 0 (resolved when first needed).

    Raises:
        TypeError: at class creation, when a subclass defines ``metadata`` as
            anything but a ``functools.cached_property``; at construction,
            when ``rank`` is not an int.
        ValueError: ``rank`` is negative.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        attr = cls.__dict__.get("metadata")
        if attr is not None and not isinstance(attr, cached_property):
            raise TypeError(
                f"{cls.__name__}.metadata must be a functools.cached_property "
                f"returning list[ParamMeta], got {type(attr).__name__}; metadata "
                "is read many times and must not change between reads "
                "(vLLM weight_transfer/base.py WeightSource)"
            )

    def __init__(self, *, rank: int | None = None) -> None:
        self._rank = None if rank is None else _check_rank(rank, type(self).__name__)

    @property
    def rank(self) -> int:
        """This trainer rank (explicit, else the default process group's rank)."""
        explicit = getattr(self, "_rank", None)
        return _default_rank() if explicit is None else explicit

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        """Every wire tensor of the model, in send order (abstract)."""
        raise NotImplementedError

    # Abstract without losing the cached_property type: ABCMeta reads this flag.
    metadata.__isabstractmethod__ = True

    def owned_names(self, rank: int | None = None) -> list[str]:
        """Names whose owners include ``rank`` (default: this rank), in metadata order.

        ``owners=None`` means every trainer rank owns the tensor.
        """
        rank = self.rank if rank is None else _check_rank(rank, type(self).__name__)
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)`` for ``owned_names()``, in metadata order.

        Raises:
            NotImplementedError: the source does not produce full tensors
                (``implements_iter_full()`` is False).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement iter_full(); "
            "check implements_iter_full() first"
        )

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, this rank's piece)`` for ``owned_names()``, in metadata order.

        Raises:
            NotImplementedError: the source does not produce local pieces
                (``implements_iter_local()`` is False).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement iter_local(); "
            "check implements_iter_local() first"
        )

    @classmethod
    def implements_iter_full(cls) -> bool:
        """True when the class overrides ``iter_full``."""
        return cls.iter_full is not WeightSource.iter_full

    @classmethod
    def implements_iter_local(cls) -> bool:
        """True when the class overrides ``iter_local``."""
        return cls.iter_local is not WeightSource.iter_local


def materialize_full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t.full_tensor()`` when ``t`` has one (a DTensor: an all-gather), else ``t``.

    Every rank of the DTensor's mesh must call it for the same tensor in the
    same order (it is a collective). Rule from vLLM
    ``weight_transfer/base.py`` (``materialize_full_tensor``).
    """
    full = getattr(t, "full_tensor", None)
    return _wait(full()) if callable(full) else t


# --------------------------------------------------------------------------
# DTensor reading


def _torch_placement(p: object, ndim: int) -> Placement | None:
    """torch.distributed.tensor Shard/Replicate -> m2nkit's; None for anything else."""
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return None
    if isinstance(p, TShard):
        dim = p.dim + ndim if p.dim < 0 else p.dim
        return Shard(dim)
    if isinstance(p, TReplicate):
        return Replicate()
    return None


def _mesh_ranks(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(r) for r in t.device_mesh.mesh.flatten().tolist())


def mesh_from_tensor(t: torch.Tensor, num_trainer_ranks: int) -> tuple[int, ...]:
    """The mesh shape of DTensor ``t``, checked against nccl_m2n's source model.

    The mesh's ranks, read row-major, must be exactly ``0, 1, ..., n-1`` with
    ``n <= num_trainer_ranks``, and the mesh has at most two axes (vLLM
    ``m2n_source.py`` ``mesh_from_tensor``; nccl-extensions
    ``nccl_m2n/README.md``: contiguous rank intervals, 1-D or 2-D meshes).
    A plain tensor (no device mesh) is held by every trainer rank: its mesh
    is the ``num_trainer_ranks``-rank 1-D mesh ``(T,)``, as the seed's
    ``M2NMesh((T, 1), 0)`` (vLLM ``m2n_source.py``).

    Returns:
        ``mesh_shape``, e.g. ``(2, 3)``; its owners are ``range(prod(mesh_shape))``.

    Raises:
        TypeError: ``num_trainer_ranks`` is not an int.
        ValueError: ``num_trainer_ranks`` is below 1; the mesh has more than
            two axes, its ranks are not the interval ``[0, n)`` in row-major
            order, or ``n`` exceeds ``num_trainer_ranks``.
    """
    _check_rank(num_trainer_ranks, "mesh_from_tensor num_trainer_ranks")
    if not _is_dtensor(t):
        if num_trainer_ranks < 1:
            raise ValueError("mesh_from_tensor: num_trainer_ranks must be >= 1")
        return (num_trainer_ranks,)
    mesh_shape = tuple(int(s) for s in t.device_mesh.shape)
    if len(mesh_shape) > 2:
        raise ValueError(
            f"DTensor mesh {mesh_shape} has {len(mesh_shape)} axes; at most 2 are "
            "supported (flatten the mesh or use ModuleSource)"
        )
    ranks = _mesh_ranks(t)
    if ranks != tuple(range(len(ranks))):
        raise ValueError(
            f"DTensor mesh ranks {list(ranks)} (row-major) are not the contiguous "
            f"interval [0, {len(ranks)}); build the mesh over ranks 0..{len(ranks) - 1} "
            "in order"
        )
    if len(ranks) > num_trainer_ranks:
        raise ValueError(
            f"DTensor mesh {mesh_shape} spans {len(ranks)} ranks but there are only "
            f"{num_trainer_ranks} trainer ranks"
        )
    return mesh_shape


def placements_from_tensor(t: torch.Tensor) -> tuple[Placement, ...] | None:
    """DTensor ``t``'s placements as m2nkit ``Shard``/``Replicate``, one per mesh axis.

    Negative ``Shard`` dims are normalised. All-``Replicate`` returns ``None``
    (``ParamMeta`` normalises the same way), and so does a plain tensor: every
    rank holds it in full (the seed's ``REPLICATED``, vLLM ``m2n_source.py``).

    Raises:
        ValueError: a placement is neither ``Shard`` nor ``Replicate``
            (``Partial``: reduce it first; ``_StridedShard``: use
            ``m2nkit.adapters.fsdp2.fsdp2_source``, which sends its pieces),
            naming the placement.
    """
    if not _is_dtensor(t):
        return None
    out = []
    for axis, p in enumerate(t.placements):
        mine = _torch_placement(p, t.dim())
        if mine is None:
            raise ValueError(
                f"DTensor placement {p!r} on mesh axis {axis} is not supported; "
                "only Shard(dim) and Replicate() can be sent shard to shard "
                "(reduce a Partial or redistribute first)"
            )
        out.append(mine)
    if all(isinstance(p, Replicate) for p in out):
        return None
    return tuple(out)


def layout_from_dtensor(t: torch.Tensor, num_trainer_ranks: int) -> SourceLayout:
    """The ``SourceLayout`` of DTensor ``t``: owners ``[0, n)``, its mesh and placements.

    m2nkit's form of the seed's ``M2NLayout``; a plain tensor is replicated
    over all ``num_trainer_ranks``; errors as in ``mesh_from_tensor`` and
    ``placements_from_tensor``.
    """
    mesh_shape = mesh_from_tensor(t, num_trainer_ranks)
    placements = placements_from_tensor(t)
    return SourceLayout(
        tuple(range(math.prod(mesh_shape))), mesh_shape, placements, where="DTensor"
    )


def _check_local_shape(name: str, rank: int, meta: ParamMeta, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"parameter '{name}' on rank {rank}: the local tensor must be a "
            f"torch.Tensor, got {type(t).__name__}"
        )
    expected = meta.local_shape(rank)
    got = tuple(t.shape)
    if meta.exact_local_shape:
        if got != expected:
            box = owner_box(meta.layout, meta.shape, rank)
            raise ValueError(
                f"parameter '{name}' on rank {rank}: local tensor has shape "
                f"{got}, expected {expected} (box {box} of global shape "
                f"{meta.shape})"
            )
    elif expected is None or len(got) != len(expected) or any(
            g < e for g, e in zip(got, expected)):
        raise ValueError(
            f"parameter '{name}' on rank {rank}: local tensor has shape {got}; its pieces "
            f"need at least {expected}"
        )
    if t.dtype != meta.dtype:
        raise ValueError(
            f"parameter '{name}' on rank {rank}: local tensor has dtype {t.dtype}, "
            f"expected {meta.dtype}"
        )
    return t


# --------------------------------------------------------------------------
# sources


class ModuleSource(WeightSource):
    """Every parameter of ``module`` (``named_parameters()``), plain or DTensor.

    * plain tensors: owned by every trainer rank (``owners=None``).
    * DTensors with ``Shard``/``Replicate`` placements: owned by their mesh
      ranks (row-major, any ranks, any number of axes) with those placements.
    * DTensors with any other placement (``Partial``, ``_StridedShard``):
      declared replicated over their mesh ranks; ``iter_local`` gathers them
      with ``full_tensor()`` (a collective over the mesh).

    Metadata reads global ``.shape``/``.dtype`` only and never gathers.
    ``iter_full`` all-gathers every DTensor (``materialize_full_tensor``);
    ``iter_local`` yields ``to_local()`` pieces. Tied parameters appear once,
    under their first name (``named_parameters`` deduplicates). Rules from
    vLLM ``weight_transfer/base.py`` (``ModuleSource``).
    """

    def __init__(self, module: torch.nn.Module, *, rank: int | None = None) -> None:
        super().__init__(rank=rank)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ModuleSource needs a torch.nn.Module, got {type(module).__name__}")
        self._module = module

    def _gathered(self, p: torch.Tensor) -> bool:
        return _is_dtensor(p) and any(
            _torch_placement(pl, p.dim()) is None for pl in p.placements
        )

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        out = []
        for name, p in self._module.named_parameters():
            shape = tuple(p.shape)
            if not _is_dtensor(p):
                out.append(ParamMeta(name, p.dtype, shape))
                continue
            owners = _mesh_ranks(p)
            mesh_shape = tuple(int(s) for s in p.device_mesh.shape)
            placements = None
            if not self._gathered(p):
                placements = tuple(_torch_placement(pl, p.dim()) for pl in p.placements)
            out.append(ParamMeta(name, p.dtype, shape, owners, mesh_shape, placements))
        return out

    def _owned_params(self) -> Iterator[tuple[str, ParamMeta, torch.Tensor]]:
        params = dict(self._module.named_parameters())
        rank = self.rank
        for meta in self.metadata:
            if meta.owners is None or rank in meta.owners:
                yield meta.name, meta, params[meta.name].detach()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)``; every DTensor is all-gathered over its mesh."""
        for name, _, p in self._owned_params():
            yield name, materialize_full_tensor(p)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, local piece)``: ``to_local()`` for Shard/Replicate DTensors,
        ``full_tensor()`` for the others, the tensor itself when plain."""
        rank = self.rank
        for name, meta, p in self._owned_params():
            if not _is_dtensor(p):
                yield name, p
            elif self._gathered(p):
                yield name, materialize_full_tensor(p)
            else:
                yield name, _check_local_shape(name, rank, meta, _wait(p.to_local()))


class M2NWeightSource(WeightSource):
    """A ``WeightSource`` whose iteration yields local shards, never full tensors.

    Gathering is exactly the cost m2n removes (vLLM ``m2n_source.py``), so
    ``iter_full`` is not available here, and a subclass that overrides it is
    rejected at class creation (``TypeError``). Subclasses implement
    ``metadata`` (a cached property with full source layouts) and
    ``iter_local``.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "iter_full" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides iter_full(), but an M2NWeightSource yields "
                "local shards only; derive from WeightSource to produce full tensors"
            )

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Not available: an M2N source never gathers.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"{type(self).__name__} is an M2NWeightSource: it yields local shards "
            "(iter_local), never full tensors"
        )

    @classmethod
    def implements_iter_full(cls) -> bool:
        return False

    @abstractmethod
    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, this rank's piece)`` for ``owned_names()``, in metadata order."""


@dataclass(frozen=True)
class M2NManifestEntry:
    """One wire tensor with a lazy provider of this rank's local piece.

    Attributes:
        name: the wire name (an HF checkpoint name). The seed API calls it
            ``key``; ``entry.key`` still reads it.
        dtype: the wire dtype (``torch.dtype``).
        global_shape: the full tensor's shape (non-negative ints).
        source_layout: which trainer ranks hold which box: placements
            (``SourceLayout``) or explicit pieces (``PieceLayout``); the
            seed's ``M2NLayout(M2NMesh(dims, start_rank), codes)`` is
            accepted and stored as the equivalent ``SourceLayout``
            (``m2nkit.manifest.m2n_layout``).
        local_tensor: zero-argument callable returning this rank's local
            tensor: of shape ``owner_box(source_layout, global_shape, rank)``
            under placements; holding every piece of the rank at its
            ``local_start`` under a ``PieceLayout`` (it may be larger); called
            once per iteration when the engine reaches this entry. It may
            return a view and may do rank-local work (split a fused QKV shard,
            cast to the wire dtype); it must not start a collective that the
            other owners do not also start in the same order.

    Rules from vLLM ``m2n_source.py`` (``M2NManifestEntry``).

    Raises:
        ValueError: empty ``name``; a negative or non-int dim in
            ``global_shape``; a ``Shard`` dim outside the shape; an
            ``M2NLayout`` breaking the seed's rules.
        TypeError: ``dtype`` is not a ``torch.dtype``; ``source_layout`` is
            not a ``SourceLayout``/``PieceLayout``/``M2NLayout``;
            ``local_tensor`` is not callable. Every message names the tensor.
    """

    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    source_layout: SourceLayout | PieceLayout
    local_tensor: Callable[[], torch.Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"manifest entry name must be a non-empty string, got {self.name!r}")
        k = self.name
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"manifest entry '{k}': dtype {self.dtype!r} is not a torch.dtype "
                "(use e.g. torch.bfloat16)"
            )
        try:
            shape = tuple(self.global_shape)
        except TypeError:
            raise ValueError(
                f"manifest entry '{k}': global_shape {self.global_shape!r} must be a "
                "sequence of non-negative ints"
            ) from None
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
            raise ValueError(
                f"manifest entry '{k}': global_shape {shape} must hold non-negative ints"
            )
        if is_m2n_layout(self.source_layout):  # the seed's vocabulary (vLLM m2n_common.py)
            object.__setattr__(self, "source_layout", layout_from_m2n(
                self.source_layout, where=f"manifest entry '{k}'"))
        if not isinstance(self.source_layout, (SourceLayout, PieceLayout)):
            raise TypeError(
                f"manifest entry '{k}': source_layout must be a SourceLayout, PieceLayout or "
                f"M2NLayout, got {type(self.source_layout).__name__}"
            )
        if not callable(self.local_tensor):
            raise TypeError(
                f"manifest entry '{k}': local_tensor must be a zero-argument callable "
                f"returning this rank's piece, got {type(self.local_tensor).__name__}"
            )
        object.__setattr__(self, "global_shape", shape)
        self.source_layout.check_shape(shape, k)

    @property
    def key(self) -> str:
        """The wire name under the seed API's spelling (``M2NManifestEntry.key``)."""
        return self.name

    @property
    def metadata(self) -> ParamMeta:
        """The entry as a ``ParamMeta``."""
        lay = self.source_layout
        if isinstance(lay, PieceLayout):
            return ParamMeta(self.name, self.dtype, self.global_shape, pieces=lay.pieces)
        return ParamMeta(self.name, self.dtype, self.global_shape,
                         lay.owners, lay.mesh_shape, lay.placements)


class ManifestM2NWeightSource(M2NWeightSource):
    """An M2N source over a fixed, ordered list of ``M2NManifestEntry``.

    The entry order is the send order and cannot change after construction.
    ``iter_local()`` walks the entries this rank owns and calls each
    provider only when the consumer asks for that entry, so at most one
    provider's result is alive because of this source; providers run again on
    every iteration (weights change between RL steps).

    Each returned tensor is checked: its shape must be this rank's box
    (``owner_box``, i.e. ``layout.local_box``) and its dtype the entry's.

    Args:
        entries: the manifest, in send order.
        rank: this trainer rank (see ``WeightSource``).

    Raises:
        TypeError: an entry is not an ``M2NManifestEntry``.
        ValueError: two entries share a key (naming it). During iteration: a
            provider returned the wrong shape or dtype (naming key, rank, got
            and expected).
    """

    def __init__(self, entries: Sequence[M2NManifestEntry], *, rank: int | None = None) -> None:
        super().__init__(rank=rank)
        entries = tuple(entries)
        seen: set[str] = set()
        for i, e in enumerate(entries):
            if not isinstance(e, M2NManifestEntry):
                raise TypeError(
                    f"manifest entry {i} must be an M2NManifestEntry, got {type(e).__name__}"
                )
            if e.name in seen:
                raise ValueError(f"manifest entry '{e.name}' appears more than once (entry {i})")
            seen.add(e.name)
        self._entries = entries

    @property
    def entries(self) -> tuple[M2NManifestEntry, ...]:
        """The entries, in send order (immutable)."""
        return self._entries

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [e.metadata for e in self._entries]

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        rank = self.rank
        for entry, meta in zip(self._entries, self.metadata):
            if meta.owners is not None and rank not in meta.owners:
                continue
            yield entry.name, _check_local_shape(entry.name, rank, meta, entry.local_tensor())


class DTensorModuleSource(M2NWeightSource):
    """An M2N source over ``module.named_parameters()`` of DTensors.

    DTensor parameters take their layout from ``layout_from_dtensor``: owners
    ``[0, n)``, the DTensor's mesh (at most 2-D, contiguous) and its
    ``Shard``/``Replicate`` placements; plain tensors are replicated over all
    trainer ranks (``owners=None``). ``iter_local`` yields ``to_local()``
    (no communication) for the names this rank owns, checked against
    ``owner_box``. Rules from vLLM ``m2n_source.py`` (``DTensorModuleSource``).

    Args:
        module: the trainer's module.
        num_trainer_ranks: ``T``, the number of trainer ranks.
        rank: this trainer rank (see ``WeightSource``).

    Raises:
        ValueError: (when ``metadata`` is first read) a DTensor with a
            ``Partial``/strided placement, a mesh that is not ``[0, n)`` with
            ``n <= T``, or more than two mesh axes; naming the parameter.
    """

    def __init__(self, module: torch.nn.Module, num_trainer_ranks: int,
                 *, rank: int | None = None) -> None:
        super().__init__(rank=rank)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"DTensorModuleSource needs a torch.nn.Module, got {type(module).__name__}"
            )
        _check_rank(num_trainer_ranks, "DTensorModuleSource num_trainer_ranks")
        if num_trainer_ranks == 0:
            raise ValueError("DTensorModuleSource: num_trainer_ranks must be >= 1")
        self._module = module
        self.num_trainer_ranks = num_trainer_ranks

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        out = []
        for name, p in self._module.named_parameters():
            if not _is_dtensor(p):
                out.append(ParamMeta(name, p.dtype, tuple(p.shape)))
                continue
            try:
                lay = layout_from_dtensor(p, self.num_trainer_ranks)
            except ValueError as e:
                raise ValueError(f"parameter '{name}': {e}") from None
            out.append(ParamMeta(name, p.dtype, tuple(p.shape),
                                 lay.owners, lay.mesh_shape, lay.placements))
        return out

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self._module.named_parameters())
        rank = self.rank
        for meta in self.metadata:
            if meta.owners is not None and rank not in meta.owners:
                continue
            p = params[meta.name].detach()
            local = _wait(p.to_local()) if _is_dtensor(p) else p
            yield meta.name, _check_local_shape(meta.name, rank, meta, local)
