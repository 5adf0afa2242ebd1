"""What a transfer plan is: slabs, their tables, per-wire plans, verdicts, the ``Plan``.

The planner (``m2nkit.engine.plan.build_plan``) builds these; the control
plane fingerprints them, each transport's rules judge a ``WirePlan``
(``can_carry`` -> ``Verdict``) and its runtime walks the slabs. They live
below all of those so that none of them imports the planner: the planner
asks the transports' rules (``m2nkit.engine.transports.registry``), and
the rules read these types, so a planner module that also held the types
would import itself in a circle.

A *slab* is one box copied from a trainer rank's local tensor into a
worker's parameter; a wire tensor's slabs are one int64 table (numpy,
columns in ``SlabTable``). :func:`next_local` is the one check of a
trainer rank's ``iter_local()`` stream that every executor and transport
runs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from m2nkit.manifest.destination import Binding, DestinationLayout
from m2nkit.manifest.meta import ParamMeta
from m2nkit.manifest.pieces import Box, Piece, box_volume

__all__ = [
    "Slab",
    "SlabTable",
    "Problem",
    "Verdict",
    "WirePlan",
    "Plan",
    "next_local",
]


class Slab(NamedTuple):
    """One box copied from a trainer rank's local tensor into a worker's parameter.

    ``box`` is in global wire coordinates; ``src_start`` is where it begins
    in the source rank's local tensor (through the piece that holds it),
    ``dst_start`` where it begins in the worker's local parameter ``param``.
    ``nbytes`` = volume × itemsize.
    """

    name: str
    src: int
    dst: int
    box: Box
    src_start: tuple[int, ...]
    param: str
    dst_start: tuple[int, ...]
    nbytes: int

    @property
    def src_region(self) -> tuple[slice, ...]:
        """Index of the slab in the source rank's local tensor."""
        return tuple(slice(s, s + b - a) for s, (a, b) in zip(self.src_start, self.box))

    @property
    def dst_region(self) -> tuple[slice, ...]:
        """Index of the slab in the worker's parameter ``param``."""
        return tuple(slice(s, s + b - a) for s, (a, b) in zip(self.dst_start, self.box))


class SlabTable:
    """Column layout of a wire plan's slab table (one int64 row per slab).

    Columns: ``SRC`` (trainer rank), ``DST`` (worker), ``BINDING`` (index
    into ``WirePlan.bindings``), ``PIECE`` (index into ``WirePlan.pieces``),
    then the box: ``ndim`` starts from ``LO``, ``ndim`` stops after them.
    """

    SRC, DST, BINDING, PIECE, LO = 0, 1, 2, 3, 4

    @staticmethod
    def width(ndim: int) -> int:
        return SlabTable.LO + 2 * ndim

    @staticmethod
    def lo(table: np.ndarray, ndim: int) -> np.ndarray:
        return table[:, SlabTable.LO:SlabTable.LO + ndim]

    @staticmethod
    def hi(table: np.ndarray, ndim: int) -> np.ndarray:
        return table[:, SlabTable.LO + ndim:SlabTable.LO + 2 * ndim]


@dataclass(frozen=True)
class Problem:
    """Something that stops the transfer: ``subject`` (a tensor or param) and why."""

    subject: str
    message: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.message}"


@dataclass(frozen=True)
class Verdict:
    """Whether one transport can carry one wire tensor, and how.

    ``reason`` says which of the transport's rules fails when not ``ok``;
    ``detail`` holds what the transport needs to carry it when ``ok`` (for
    ``nccl_m2n``: the source and destination encodings).
    """

    ok: bool
    reason: str = ""
    detail: Any = None


_NOT_CHECKED = Verdict(False, "not checked")


@dataclass
class WirePlan:
    """The plan for one wire tensor.

    Attributes:
        meta: the wire tensor (name, dtype, shape, source layout).
        pieces: every trainer-side piece (``meta.source_pieces(T)``).
        bindings: where the workers take it.
        table: ``[n_slabs, SlabTable.width(ndim)]`` int64, see ``SlabTable``.
        skipped: why the inference side takes none of it ('' if it does).
        verdicts: transport name -> ``Verdict``, one per transport with rules
            (``TRANSPORT_RULES`` of ``m2nkit.engine.transports.registry``).
        num_trainer_ranks: ``T`` (resolves ``owners=None``).
    """

    meta: ParamMeta
    pieces: tuple[Piece, ...]
    bindings: tuple[Binding, ...]
    table: np.ndarray
    skipped: str = ""
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    num_trainer_ranks: int = 0
    #: bytes moved and held, once known (the planner knows them; else computed once)
    _moved: int | None = field(default=None, repr=False, compare=False)
    _min: int | None = field(default=None, repr=False, compare=False)
    _local_shapes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.meta.name

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        """``meta.local_shape(rank)``, computed once per rank: a round asks it per tensor and
        the manifest's answer (a validated layout built per call) costs tens of µs."""
        try:
            return self._local_shapes[rank]
        except KeyError:
            shape = self._local_shapes[rank] = self.meta.local_shape(rank)
            return shape

    @property
    def itemsize(self) -> int:
        return self.meta.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)

    @property
    def owners(self) -> tuple[int, ...]:
        """Trainer ranks whose ``iter_local`` yields this tensor (an owner under
        placements may hold an empty box and no piece)."""
        return self.meta.owners if self.meta.owners is not None else tuple(
            range(self.num_trainer_ranks))

    def verdict(self, transport: str) -> Verdict:
        """The verdict of ``transport`` on this wire tensor (not ok if never checked)."""
        return self.verdicts.get(transport, _NOT_CHECKED)

    def sends_to(self, worker: int) -> bool:
        """Whether any slab of this tensor goes to ``worker``."""
        return bool(len(self.table)) and bool((self.table[:, SlabTable.DST] == worker).any())

    def rank_pieces(self, rank: int) -> list[Piece]:
        """The pieces trainer ``rank`` holds."""
        return [p for p in self.pieces if p.rank == rank]

    def slab_nbytes(self) -> np.ndarray:
        """Bytes of every slab, ``[n_slabs]`` int64."""
        nd = self.ndim
        if nd == 0:
            return np.full(len(self.table), self.itemsize, dtype=np.int64)
        ext = SlabTable.hi(self.table, nd) - SlabTable.lo(self.table, nd)
        return ext.prod(axis=1) * self.itemsize

    @property
    def nbytes_moved(self) -> int:
        """Bytes all slabs carry."""
        if self._moved is None:
            self._moved = int(self.slab_nbytes().sum())
        return self._moved

    @property
    def nbytes_min(self) -> int:
        """Bytes the workers hold of this tensor: every element once per binding."""
        if self._min is None:
            self._min = sum(box_volume(b.box) for b in self.bindings) * self.itemsize
        return self._min

    def slabs(self, *, src: int | None = None, dst: int | None = None) -> Iterator[Slab]:
        """Every slab as a ``Slab`` (optionally only those from ``src`` / to ``dst``)."""
        nd = self.ndim
        table = self.table
        if src is not None:
            table = table[table[:, SlabTable.SRC] == src]
        if dst is not None:
            table = table[table[:, SlabTable.DST] == dst]
        sizes = (np.full(len(table), self.itemsize, dtype=np.int64) if nd == 0 else
                 (SlabTable.hi(table, nd) - SlabTable.lo(table, nd)).prod(axis=1) * self.itemsize)
        lo_col = SlabTable.LO
        for row, nbytes in zip(table.tolist(), sizes.tolist()):
            box = tuple(zip(row[lo_col:lo_col + nd], row[lo_col + nd:lo_col + 2 * nd]))
            b = self.bindings[row[SlabTable.BINDING]]
            piece = self.pieces[row[SlabTable.PIECE]]
            yield Slab(
                self.meta.name, row[SlabTable.SRC], row[SlabTable.DST], box,
                tuple(a for a, _ in piece.local_region(box)), b.param,
                tuple(a for a, _ in b.region_of(box)), nbytes,
            )


@dataclass
class Plan:
    """A complete transfer plan and its accounting.

    Attributes:
        num_trainer_ranks: trainer ranks ``0..T-1``.
        destination: the inference side (workers ``0..N-1``).
        wires: one ``WirePlan`` per wire tensor, in manifest (send) order.
        problems: everything that prevents the transfer; empty when it can run.
        send_bytes: ``[T]`` bytes each trainer rank sends.
        recv_bytes: ``[N]`` bytes each worker receives.
        link_bytes: ``{(src, dst): bytes}``.
        manifest_digest: digest of the manifest the plan was built from.
    """

    num_trainer_ranks: int
    destination: DestinationLayout
    wires: list[WirePlan]
    problems: list[Problem]
    send_bytes: np.ndarray
    recv_bytes: np.ndarray
    link_bytes: dict[tuple[int, int], int]
    manifest_digest: str = ""

    @property
    def num_workers(self) -> int:
        return self.destination.num_workers

    @property
    def nbytes_moved(self) -> int:
        return int(self.send_bytes.sum())

    @property
    def nbytes_min(self) -> int:
        return sum(w.nbytes_min for w in self.wires if not w.skipped)

    @property
    def num_slabs(self) -> int:
        return sum(len(w.table) for w in self.wires)

    def fan_in(self) -> np.ndarray:
        """``[N]`` distinct trainer ranks sending to each worker."""
        out = np.zeros(self.num_workers, dtype=np.int64)
        for _, d in self.link_bytes:
            out[d] += 1
        return out

    def fan_out(self) -> np.ndarray:
        """``[T]`` distinct workers each trainer rank sends to."""
        out = np.zeros(self.num_trainer_ranks, dtype=np.int64)
        for s, _ in self.link_bytes:
            out[s] += 1
        return out

    def carried_share(self, transport: str) -> float:
        """Fraction of moved bytes in wire tensors ``transport`` can carry."""
        total = self.nbytes_moved
        ok = sum(w.nbytes_moved for w in self.wires if w.verdict(transport).ok)
        return ok / total if total else 1.0

    def estimated_seconds(self, link_gbps: float) -> float:
        """Transfer time if every rank has its own ``link_gbps`` Gbit/s link.

        The busiest rank bounds the transfer: ``max(max send, max receive) /
        (link_gbps * 1e9 / 8)`` seconds. A lower bound: latency, per-slab
        overhead and shared links are not modelled.
        """
        busiest = max(int(self.send_bytes.max(initial=0)), int(self.recv_bytes.max(initial=0)))
        return busiest / (link_gbps * 1e9 / 8)

    def digest(self) -> str:
        """sha256 of everything that decides which byte goes where.

        A skipped tensor counts by *being* skipped, not by the sentence saying
        why: the tables and the trace word the same skip differently (an MTP
        layer named by the table, "writes none of it" by the trace), and two
        sides that chose differently still make the same plan.
        """
        h = hashlib.sha256()
        h.update(json.dumps({
            "manifest": self.manifest_digest,
            "destination": self.destination.spec,
            "trainer_ranks": self.num_trainer_ranks,
        }, sort_keys=True).encode())
        for w in self.wires:
            h.update(json.dumps([w.name, bool(w.skipped), [
                [b.worker, b.param, b.box, b.offset] for b in w.bindings
            ]]).encode())
            h.update(np.ascontiguousarray(w.table, dtype="<i8").tobytes())
        return h.hexdigest()

    def to_json(self, *, with_slabs: bool = True) -> dict:
        """A JSON-ready description (slabs as rows when ``with_slabs``)."""
        wires = []
        for w in self.wires:
            entry = {
                "name": w.name,
                "dtype": str(w.meta.dtype).removeprefix("torch."),
                "shape": list(w.meta.shape),
                "skipped": w.skipped or None,
                "bytes_moved": w.nbytes_moved,
                "bytes_min": w.nbytes_min,
                "transports": {t: {"ok": v.ok, "reason": v.reason or None}
                               for t, v in sorted(w.verdicts.items())},
                "pieces": [pc.to_json() for pc in w.pieces],
                "bindings": [
                    {"worker": b.worker, "param": b.param, "box": [list(x) for x in b.box],
                     "offset": list(b.offset)} for b in w.bindings
                ],
            }
            if with_slabs:
                entry["slab_columns"] = ["src", "dst", "param", "box", "src_start", "dst_start", "bytes"]
                entry["slabs"] = [
                    [s.src, s.dst, s.param, [list(x) for x in s.box], list(s.src_start),
                     list(s.dst_start), s.nbytes] for s in w.slabs()
                ]
            wires.append(entry)
        return {
            "digest": self.digest(),
            "manifest_digest": self.manifest_digest,
            "trainer_ranks": self.num_trainer_ranks,
            "inference": self.destination.spec,
            "workers": self.num_workers,
            "bytes_moved": self.nbytes_moved,
            "bytes_min": self.nbytes_min,
            "send_bytes": self.send_bytes.tolist(),
            "recv_bytes": self.recv_bytes.tolist(),
            "links": [[s, d, b] for (s, d), b in sorted(self.link_bytes.items())],
            "problems": [{"subject": p.subject, "message": p.message} for p in self.problems],
            "wires": wires,
        }


def next_local(it, wp: WirePlan, rank: int, *,
               error: type[Exception] = ValueError) -> torch.Tensor:
    """Take wire tensor ``wp``'s local tensor from a rank's ``iter_local()`` stream.

    Every executor and transport pulls a trainer rank's stream through this
    one check (``WeightSource.iter_local`` contract: owned tensors, manifest
    order, the manifest dtype, and a shape that holds every piece of the
    rank: exactly its box under placements, at least the pieces' extent
    under explicit pieces).

    Raises:
        ``error`` (``ValueError`` by default; transports pass
        ``TransferError``): the stream ended early, yielded another name,
        or a local tensor of the wrong shape or dtype (names rank and tensor).
    """
    try:
        name, local = next(it)
    except StopIteration:
        raise error(f"trainer rank {rank}: source ended before '{wp.name}'") from None
    if name != wp.name:
        raise error(f"trainer rank {rank}: source yielded '{name}' where the manifest "
                    f"order expects '{wp.name}'")
    want = wp.local_shape(rank)
    got = tuple(local.shape)
    if want is not None and (got != want if wp.meta.exact_local_shape else (
            len(got) != len(want) or any(g < w for g, w in zip(got, want)))):
        need = "needs" if wp.meta.exact_local_shape else "needs at least"
        raise error(f"trainer rank {rank}: local '{name}' has shape {got}; its box {need} "
                    f"{want}")
    if local.dtype != wp.meta.dtype:
        raise error(f"trainer rank {rank}: local '{name}' is {local.dtype}; the manifest "
                    f"says {wp.meta.dtype}")
    return local
