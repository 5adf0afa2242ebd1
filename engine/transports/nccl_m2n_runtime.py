"""The NCCL side of the ``nccl_m2n`` transport: nccl4py, descriptors, reshards, deadlines.

Everything here needs ``nccl.m2n`` and nccl4py (nccl-extensions,
``nccl_m2n/README.md``) at run time, imported only when used
(:func:`import_nccl_m2n`): importing this module needs neither, nor a GPU.

* :func:`m2n_descriptors` turns a wire tensor's verdict encodings
  (``nccl_m2n_rules.can_carry``) into real ``nccl.m2n`` meshes and
  placements over absolute communicator ranks (trainer ranks ``[0, T)``,
  workers ``[T, T+N)``, vLLM ``weight_transfer/m2n_common.py``), checked
  against the plan's boxes; :func:`destination_view` is the region of a
  worker's parameter one reshard fills.
* :class:`NcclResharder` issues the reshards on the current CUDA stream of
  one nccl4py communicator and waits for them with deadlines: every wait
  for GPU completion polls a CUDA event and, on expiry or on an
  asynchronous NCCL error, aborts the communicator and raises
  ``TransferError``. Not covered: a host-blocking step inside
  ``ncclReshard`` itself (its first call per communicator sets up a staging
  pool and may wait for peers) and ``ncclCommInitRank``. See
  docs/nccl_m2n.md.
"""

from __future__ import annotations

import importlib
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from m2nkit.engine.control import TransferError
from m2nkit.engine.plan_types import Plan
from m2nkit.engine.transports.nccl_m2n_rules import CARRIER_M2N, m2n_local_box
from m2nkit.manifest.pieces import box_slices

__all__ = [
    "INSTALL_HINT",
    "NcclM2NUnavailableError",
    "import_nccl_m2n",
    "M2NCall",
    "m2n_descriptors",
    "destination_view",
    "Resharder",
    "NcclResharder",
]

#: What to install when ``nccl.m2n`` or nccl4py does not import.
INSTALL_HINT = "install m2nkit[nccl] (nccl4py, nccl-extensions, cuda-bindings)"


class NcclM2NUnavailableError(ImportError):
    """``nccl.m2n`` or nccl4py does not import in this environment."""


def import_nccl_m2n() -> tuple[Any, Any]:
    """Import ``nccl.m2n`` and nccl4py's ``nccl.core``, only when needed.

    Importing them does not need a GPU; creating a handle or a communicator
    does (``libnccl.so.2`` and the NVIDIA driver).

    Returns:
        ``(nccl.m2n, nccl.core)``.

    Raises:
        NcclM2NUnavailableError: either does not import; the message says
            what to install.
    """
    try:
        m2n = importlib.import_module("nccl.m2n")
        core = importlib.import_module("nccl.core")
    except ImportError as e:
        raise NcclM2NUnavailableError(
            f"the nccl_m2n transport needs nccl.m2n and nccl4py, which do not import here "
            f"({e}); {INSTALL_HINT}") from e
    return m2n, core


# --------------------------------------------------------------------------
# descriptors


@dataclass(frozen=True)
class M2NCall:
    """Everything one ``nccl.m2n.reshard`` of a wire tensor needs but the buffers.

    Attributes:
        name: the wire tensor's name; ``index``: its position in the plan.
        dtype, shape: the wire tensor (global shape).
        src_mesh, dst_mesh: real ``nccl.m2n.Mesh`` objects over absolute
            communicator ranks: trainer side from ``src.start_rank``, worker
            side from ``T + dst.start_rank``. 2-D ``(outer, inner)``.
        src_placements, dst_placements: one ``nccl.m2n.Shard(d)`` /
            ``Replicate()`` per mesh axis, from the plan's codes. A fully
            replicated side is the size-1-axis encoding: mesh ``(n, 1)``,
            ``(Replicate(), Shard(0))``.
        src_local_shape, dst_local_shape: each participating rank's buffer
            shape (elements); every rank passes them, in or out of a side.
        codes: ``(src codes, dst codes)`` as the plan's ``M2NEncoding`` has them.
    """

    name: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    src_mesh: Any
    src_placements: tuple[Any, ...]
    src_local_shape: tuple[int, ...]
    dst_mesh: Any
    dst_placements: tuple[Any, ...]
    dst_local_shape: tuple[int, ...]
    codes: tuple[tuple[int, int], tuple[int, int]]

    @property
    def src_ranks(self) -> range:
        """Absolute communicator ranks of the trainer side."""
        return range(self.src_mesh.start_rank, self.src_mesh.start_rank + math.prod(self.src_mesh.dims))

    @property
    def dst_ranks(self) -> range:
        """Absolute communicator ranks of the worker side."""
        return range(self.dst_mesh.start_rank, self.dst_mesh.start_rank + math.prod(self.dst_mesh.dims))

    def src_box(self, rank: int) -> Box:
        """Global box trainer ``rank`` (absolute) passes, by nccl.m2n's rules."""
        return m2n_local_box(self.src_mesh.dims, self.codes[0], self.shape,
                             rank - self.src_mesh.start_rank)

    def dst_box(self, rank: int) -> Box:
        """Global box worker rank ``rank`` (absolute, ``T + worker``) receives."""
        return m2n_local_box(self.dst_mesh.dims, self.codes[1], self.shape,
                             rank - self.dst_mesh.start_rank)


def _local_shape(shape: Sequence[int], dims: Sequence[int], codes: Sequence[int],
                 wire: str, side: str) -> tuple[int, ...]:
    out = list(shape)
    for axis, code in enumerate(codes):
        if code >= 0:
            if out[code] % dims[axis]:
                raise ValueError(f"wire tensor '{wire}': {side} dim {code} of size {shape[code]} "
                                 f"does not split evenly over mesh axis {axis} of size {dims[axis]}")
            out[code] //= dims[axis]
    return tuple(out)


def m2n_descriptors(plan: Plan, wire_index: int, *, m2n: Any = None) -> M2NCall:
    """Turn one wire tensor's verdict encodings into real ``nccl.m2n`` descriptors.

    ``M2NEncoding`` ranks are relative to their side; the trainer side
    starts at communicator rank ``src.start_rank`` and the worker side at
    ``T + dst.start_rank`` (vLLM ``m2n_common.py`` numbering). The result is
    checked against the plan: every trainer rank's box under nccl.m2n's
    rules must be the box the plan says it holds, and every worker's the box
    its binding takes, so a descriptor can never move a byte the plan would
    not.

    Args:
        plan: a plan from ``build_plan``.
        wire_index: index into ``plan.wires``.
        m2n: the ``nccl.m2n`` module (default: imported lazily).

    Raises:
        ValueError: the plan does not mark the wire tensor ``m2n.ok`` (the
            message gives the verdict's reason), or the encodings disagree
            with the plan's boxes (an internal inconsistency).
        NcclM2NUnavailableError: ``nccl.m2n`` does not import.
    """
    if m2n is None:
        m2n, _ = import_nccl_m2n()
    wp = plan.wires[wire_index]
    verdict = wp.verdict(CARRIER_M2N)
    if not verdict.ok:
        raise ValueError(f"wire tensor '{wp.name}' cannot go through nccl.m2n: "
                         f"{verdict.reason or 'not planned'}")
    src, dst = verdict.detail.src, verdict.detail.dst
    T, N = plan.num_trainer_ranks, plan.num_workers
    shape = tuple(wp.meta.shape)
    for side, enc, limit in (("source", src, T), ("destination", dst, N)):
        if enc.start_rank < 0 or enc.start_rank + math.prod(enc.mesh_dims) > limit:
            raise ValueError(f"wire tensor '{wp.name}': {side} mesh {enc.mesh_dims} at "
                             f"{enc.start_rank} does not fit the {limit} ranks of its side")

    def placements(codes):
        return tuple(m2n.Replicate() if c < 0 else m2n.Shard(c) for c in codes)

    call = M2NCall(
        name=wp.name, index=wire_index, dtype=wp.meta.dtype, shape=shape,
        src_mesh=m2n.Mesh(src.mesh_dims, src.start_rank),
        src_placements=placements(src.placements),
        src_local_shape=_local_shape(shape, src.mesh_dims, src.placements, wp.name, "source"),
        dst_mesh=m2n.Mesh(dst.mesh_dims, T + dst.start_rank),
        dst_placements=placements(dst.placements),
        dst_local_shape=_local_shape(shape, dst.mesh_dims, dst.placements, wp.name, "destination"),
        codes=(tuple(src.placements), tuple(dst.placements)),
    )
    held = {p.rank: p.box for p in wp.pieces}
    if set(held) != set(call.src_ranks):
        raise ValueError(f"wire tensor '{wp.name}': owners {sorted(held)[:8]} are not the source "
                         f"mesh ranks {call.src_ranks}")
    for r, box in held.items():
        if call.src_box(r) != box:
            raise ValueError(f"wire tensor '{wp.name}': trainer rank {r} holds {box} but the m2n "
                             f"source descriptor gives it {call.src_box(r)}")
    taken = {b.worker: b.box for b in wp.bindings}
    if {T + w for w in taken} != set(call.dst_ranks):
        raise ValueError(f"wire tensor '{wp.name}': workers {sorted(taken)[:8]} are not the "
                         f"destination mesh ranks {call.dst_ranks} - {T}")
    for w, box in taken.items():
        if call.dst_box(T + w) != box:
            raise ValueError(f"wire tensor '{wp.name}': worker {w} takes {box} but the m2n "
                             f"destination descriptor gives it {call.dst_box(T + w)}")
    return call


def destination_view(plan: Plan, wire_index: int, worker: int,
                     storage: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The region of ``worker``'s vLLM parameter that wire tensor ``wire_index`` fills.

    A view (no copy) into ``storage[binding.param]`` at the binding's
    offset, shaped like the binding's wire box; ``None`` when the worker
    takes nothing of it. For ``m2n.ok`` wire tensors the plan guarantees one
    binding per worker and a contiguous region.

    Raises:
        TransferError: the worker takes several pieces (not an m2n tensor),
            its storage lacks the parameter, or the view is not contiguous.
    """
    wp = plan.wires[wire_index]
    mine = [b for b in wp.bindings if b.worker == worker]
    if not mine:
        return None
    if len(mine) > 1:
        raise TransferError(f"worker {worker}: '{wp.name}' lands in {len(mine)} places; "
                            "only a single region can be an nccl.m2n destination")
    b = mine[0]
    if b.param not in storage:
        raise TransferError(f"worker {worker}: storage has no parameter '{b.param}' for "
                            f"'{wp.name}'")
    view = storage[b.param][box_slices(b.region)]
    if not view.is_contiguous():
        raise TransferError(f"worker {worker}: the region of '{wp.name}' in '{b.param}' is not "
                            "contiguous in its storage")
    return view


# --------------------------------------------------------------------------
# issuing reshards


class Resharder(Protocol):
    """What ``NcclM2NTransport`` needs to move one m2n wire tensor.

    ``NcclResharder`` is the real one. Every rank calls ``issue`` for every
    m2n wire tensor in the same order.
    """

    def issue(self, call: M2NCall, src: torch.Tensor | None, dst: torch.Tensor | None) -> None:
        """Start one reshard (asynchronous); keep ``src``/``dst`` alive until it completes."""

    def drain(self, max_pending_bytes: int = 0) -> list[str]:
        """Wait until at most ``max_pending_bytes`` are in flight; return finished wire names."""

    def fence(self) -> None:
        """Wait until all work this rank enqueued on its current stream completed."""

    def close(self) -> None:
        """Release resources (collective: every rank calls it)."""


def _poll(done: Callable[[], bool], timeout_s: float, on_timeout: Callable[[], None],
          check: Callable[[], None] = lambda: None) -> None:
    """Poll ``done()`` until true; after ``timeout_s`` call ``on_timeout`` (which raises).

    ``check`` runs between polls (an async-error probe). Sleeps back off
    from 0.1 ms to 10 ms, so short waits stay short.
    """
    deadline = time.monotonic() + timeout_s
    delay = 1e-4
    while not done():
        check()
        if time.monotonic() > deadline:
            on_timeout()
            raise AssertionError("on_timeout must raise")
        time.sleep(delay)
        delay = min(delay * 2, 1e-2)


class NcclResharder:
    """Issues ``nccl.m2n.reshard`` on one nccl4py communicator, with deadlines.

    Each reshard is enqueued on the device's current CUDA stream
    (``torch.cuda.current_stream``) with an explicit ``nccl.m2n.Handle``
    (nccl-extensions ``nccl_m2n/README.md``: the call follows CUDA stream
    semantics; keep buffers alive until the work completes). A CUDA event
    recorded after each call tracks completion; ``drain`` polls the oldest
    events so that at most ``max_pending_bytes`` of buffers stay referenced.

    Args:
        comm: an initialised ``nccl.core.Communicator`` over trainer and
            worker ranks (owned from now on: ``close`` destroys it).
        rank: this rank in ``comm`` (for messages).
        device: the CUDA device of ``comm``.
        timeout_s: seconds any single wait may take.
        max_cta: ``nccl.m2n.Config(max_cta=...)``; ``None`` keeps the
            library default (8, or ``NCCL_RESHARD_MAX_CTA``).

    Raises:
        NcclM2NUnavailableError: nccl.m2n does not import.
    """

    def __init__(self, comm: Any, *, rank: int, device: torch.device | str | int,
                 timeout_s: float, max_cta: int | None = None) -> None:
        self.m2n, self.core = import_nccl_m2n()
        self.comm = comm
        self.rank = rank
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.timeout_s = timeout_s
        Result = importlib.import_module("nccl.bindings.nccl").Result   # nccl4py's ncclResult_t
        self._healthy = {int(Result.Success), int(Result.InProgress)}
        self.handle = self.m2n.init(self.m2n.Config(max_cta=max_cta)) if max_cta else self.m2n.init()
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._aborted = False
        #: The current round's ``Deadline`` (set by ``NcclM2NTransport``); ``None``: per-wait ``timeout_s``.
        self.deadline = None

    def _stream(self):
        return torch.cuda.current_stream(self.device)

    def _check_buffer(self, t: torch.Tensor | None, call: M2NCall, side: str) -> None:
        if t is None:
            return
        if t.device != self.device:
            raise TransferError(f"rank {self.rank}: {side} buffer of '{call.name}' is on "
                                f"{t.device}; nccl.m2n needs it on {self.device}")
        if not t.is_contiguous():
            raise TransferError(f"rank {self.rank}: {side} buffer of '{call.name}' is not contiguous")

    def issue(self, call: M2NCall, src: torch.Tensor | None, dst: torch.Tensor | None) -> None:
        if self._aborted:
            raise TransferError(f"rank {self.rank}: the nccl_m2n communicator was aborted; "
                                "build a new transport")
        self._check_buffer(src, call, "source")
        self._check_buffer(dst, call, "destination")
        stream = self._stream()
        try:
            self.m2n.reshard(
                src, dst, self.comm, stream,
                src_mesh=call.src_mesh, src_placements=call.src_placements,
                src_local_shape=call.src_local_shape, src_dtype=call.dtype,
                dst_mesh=call.dst_mesh, dst_placements=call.dst_placements,
                dst_local_shape=call.dst_local_shape, dst_dtype=call.dtype,
                handle=self.handle)
        except Exception as e:  # NcclReshardError, NcclInvalid, NCCLError, ValueError...
            raise TransferError(f"rank {self.rank}: nccl.m2n.reshard of '{call.name}' failed: "
                                f"{type(e).__name__}: {e}") from e
        event = torch.cuda.Event()
        event.record(stream)
        nbytes = sum(t.numel() * t.element_size() for t in (src, dst) if t is not None)
        self._pending.append((event, call.name, (src, dst), nbytes))
        self._pending_bytes += nbytes

    def _check_async(self, what: str) -> None:
        result = self.comm.get_async_error()
        if int(result) not in self._healthy:
            msg = self.core.get_error_string(int(result))
            self.abort()
            raise TransferError(f"rank {self.rank}: {what} failed: NCCL reports {msg}; the "
                                "communicator was aborted")

    def _wait(self, event, what: str) -> None:
        timeout_s = self.timeout_s if self.deadline is None else self.deadline.left()

        def expire():
            self.abort()
            raise TransferError(f"rank {self.rank}: {what} did not complete within "
                                f"{timeout_s:g} s; the nccl_m2n communicator was aborted "
                                "(every rank must build a new transport)")

        _poll(event.query, timeout_s, expire, lambda: self._check_async(what))

    def drain(self, max_pending_bytes: int = 0) -> list[str]:
        finished = []
        while self._pending and self._pending_bytes > max_pending_bytes:
            event, wire, _, nbytes = self._pending[0]
            self._wait(event, f"nccl.m2n.reshard of '{wire}'")
            self._pending.popleft()
            self._pending_bytes -= nbytes
            finished.append(wire)
        return finished

    def fence(self) -> None:
        event = torch.cuda.Event()
        event.record(self._stream())
        self._wait(event, "the end of the round (reshards and torch_p2p copies)")
        self._pending.clear()
        self._pending_bytes = 0

    def abort(self) -> None:
        """Abort the communicator: in-flight NCCL work on this rank ends, buffers are released."""
        if self._aborted:
            return
        self._aborted = True
        self._pending.clear()
        self._pending_bytes = 0
        try:
            self.comm.abort()
        except Exception:  # best effort: we are already reporting a failure
            pass

    def close(self) -> None:
        """Finish pending work, finalize the handle, then destroy the communicator.

        nccl.m2n must be finalized before its communicator is destroyed
        (nccl-extensions README, "Lifecycle"); ``Communicator.destroy`` is
        collective on a node, so every rank calls ``close``. After an abort
        nothing is released here: the handle's state refers to the aborted
        communicator and to work that never completed, which the README
        does not allow finalizing; the process should exit or rebuild.
        """
        if self._aborted:
            return
        self.fence()
        try:
            self.handle.destroy()
        finally:
            self.comm.destroy()
