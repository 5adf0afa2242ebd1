"""``ipc``: colocated trainer and inference, shard to shard over shared memory.

When trainer ranks and vLLM workers share a machine (verl's hybrid engine,
NeMo-RL's colocated mode, OpenRLHF's colocate, TRL's vLLM colocate mode),
bytes need not cross a socket: each trainer rank *exposes its own shard*
(the local tensors its source yields) as handles, and each worker copies
exactly the boxes the plan assigns it, from the mapped shards of the
trainer ranks on its node, straight into its parameters. Nothing is
gathered and no full tensor exists on either side; a worker's only extra
memory is the mapping of the trainer's pages.

Mechanism (CPU): torch's own ``file_system`` sharing, the one
``torch.multiprocessing`` uses when a tensor is sent to another process
(``torch/multiprocessing/reductions.py``: ``storage._share_filename_cpu_()``
on the owner); the reader maps the named file itself (``torch.from_file``,
``MAP_SHARED``), so it takes no reference in torch's shared-memory manager
and no manager process outlives a trainer on a worker's account. It moves
a storage into a named POSIX shared-memory file
(``/dev/shm/torch_<pid>_...``) *in place*: every view of that storage (the
FSDP2 flat shard, the optimizer's parameter) keeps seeing the same bytes,
so after the first round a stable storage is exposed again at no cost
(once per session); a source that yields fresh tensors each round is
exposed once per round. Chosen over the default ``file_descriptor``
strategy because its handle is a *name* (plain data a store can carry; an
fd needs ``SCM_RIGHTS`` over a Unix socket), and over stdlib
``multiprocessing.shared_memory`` because that cannot move an existing
tensor's storage (it would need a copy of the shard). torch unlinks the
shared file once the trainer frees the storage, so a handle that no longer
maps (file gone, or another size) is refused (:class:`StaleHandleError`),
never read.

Mechanism (CUDA, prepared; no GPU in the CPU tests): ``storage._share_cuda_()``
gives a CUDA IPC handle of the caching allocator's block and
``torch.UntypedStorage._new_shared_cuda`` opens it in the worker (the same
pair ``reductions.py`` uses), so a worker copies over NVLink / PCIe peer
access from the trainer's own shard.

Handles are data, not code: a trainer rank publishes its handles in the
session's store (rank 0's ``TCPStore``) as JSON (names, sizes, offsets,
dtype, shape, strides, the round's generation); nothing is ever unpickled
(vLLM's ``ipc_engine`` needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to
take pickled handles over HTTP). A worker checks every handle against the
plan (wire name, owner, dtype, local shape, the round, the bytes its
strides reach) before it maps it.

Nodes: each rank's node is ``M2NKIT_NODE`` if set, else its host name,
exchanged when the transport connects. Slabs whose trainer rank is on
another node than the worker go by ``torch_p2p`` in the same round and
bucket (:func:`split_by_node`, :func:`route_bytes`). One bucket
(``torch_p2p.BucketSchedule``) is exposed at a time: the trainer pulls the
next bucket's local tensors only once every worker copied this one, so a
source of fresh tensors holds at most one bucket of them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Iterable, Mapping

import numpy as np
import torch

from m2nkit.engine.control import TransferError, error_gist, wait_work
from m2nkit.engine.deadline import Deadline
from m2nkit.engine.plan_types import Plan, SlabTable, next_local
from m2nkit.engine.transports import torch_p2p
from m2nkit.engine.transports.torch_p2p import BucketSchedule, BufferPool

__all__ = [
    "IpcTransport",
    "IpcReport",
    "StaleHandleError",
    "HandleError",
    "node_id",
    "expose",
    "open_handle",
    "split_by_node",
    "even_nodes",
    "route_bytes",
]

#: Store keys of this transport (one fresh store per session).
_PREFIX = "m2nkit/ipc"
#: The environment variable that names a rank's node (default: its host name).
NODE_ENV = "M2NKIT_NODE"


class HandleError(TransferError):
    """A trainer rank's handle does not match the plan (wrong name, dtype, shape, bounds, round)."""


class StaleHandleError(TransferError):
    """A handle whose storage no longer maps (the trainer freed or re-allocated it); never read."""


def node_id() -> str:
    """This process's node: ``$M2NKIT_NODE`` when set (tests simulate nodes with it), else
    the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64)}


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _reach(shape, stride) -> int:
    """Elements from a view's first element to one past its last (0 for an empty view)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


#: Trainer, CPU: bytes moved into shared memory between two :func:`return_freed_heap`.
TRIM_BYTES = 8 << 20


def return_freed_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere.

    ``malloc_trim`` releases free pages anywhere in the heap, not only at
    its top (glibc >= 2.8, ``madvise(MADV_DONTNEED)``).
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc: Any = None


def expose(t: torch.Tensor) -> dict:
    """A handle of ``t``'s storage as plain data (a JSON-ready dict), sharing it first.

    CPU: the storage moves into a named shared-memory file in place, if it
    is not there yet (``UntypedStorage._share_filename_cpu_``, torch's
    ``file_system`` sharing; an already file-shared storage keeps its
    file). CUDA: a CUDA IPC handle of the block (``_share_cuda_``).

    Keys: ``kind`` ("shm" | "cuda"), ``file``/``manager`` (shm) or the IPC
    fields (cuda, bytes as hex), ``storage_nbytes``, ``offset`` (elements),
    ``dtype``, ``shape``, ``stride``.

    Raises:
        RuntimeError: torch cannot share this storage (a caller bounces
            the tensor through a shareable buffer instead).
    """
    st = t.untyped_storage()
    out = {"offset": int(t.storage_offset()), "dtype": _dtype_name(t.dtype),
           "shape": list(t.shape), "stride": list(t.stride())}
    if t.device.type == "cuda":            # prepared path (reductions.py reduce_tensor)
        dev, handle, size, off, rc_handle, rc_off, ev_handle, ev_sync = st._share_cuda_()
        out.update(kind="cuda", device=int(dev), handle=bytes(handle).hex(),
                   storage_nbytes=int(size), storage_offset_bytes=int(off),
                   ref_counter_handle=bytes(rc_handle).hex(), ref_counter_offset=int(rc_off),
                   event_handle=bytes(ev_handle).hex() if ev_handle else "",
                   event_sync_required=bool(ev_sync))
        return out
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot share a tensor on {t.device}")
    manager, name, size = st._share_filename_cpu_()
    # torch's shared file holds a reference-count header before the data: its size, from
    # the file itself, travels with the handle so the reader needs no torch internals.
    off = os.stat("/dev/shm" + name.decode()).st_size - int(size)
    out.update(kind="shm", manager=manager.decode(), file=name.decode(), storage_nbytes=int(size),
               data_offset=off)
    return out


def _check_shm_file(h: Mapping[str, Any], what: str) -> str:
    """The handle's shared file exists with exactly ``data_offset + storage_nbytes`` bytes.

    Returns its path. Checked before mapping: mapping a shorter file than
    the handle claims would fault (SIGBUS) on the first read past its end.
    The name must be one plain name under /dev/shm (no path).

    Raises:
        HandleError: not a shared-memory name, or an implausible ``data_offset``.
        StaleHandleError: the file is gone (the trainer freed the storage) or
            has another size (it was re-allocated).
    """
    name, off = h.get("file"), h.get("data_offset")
    if not isinstance(name, str) or not name.startswith("/") or "/" in name[1:] or \
            name in ("/", "/.", "/.."):
        raise HandleError(f"{what}: handle file {name!r} is not a shared-memory name")
    if not isinstance(off, int) or isinstance(off, bool) or not 0 <= off <= 4096:
        raise HandleError(f"{what}: handle data_offset {off!r} is not in [0, 4096]")
    path = "/dev/shm" + name
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise StaleHandleError(
            f"{what}: the handle ({name}, {h.get('storage_nbytes')} bytes) no longer maps: the "
            f"trainer freed or re-allocated that storage ({e.strerror}); nothing was "
            "read") from None
    if size != int(h["storage_nbytes"]) + off:
        raise StaleHandleError(
            f"{what}: the handle ({name}) says {h['storage_nbytes']} bytes and its shared file "
            f"holds {size - off}: the storage was re-allocated; nothing was read")
    return path


def open_handle(h: Mapping[str, Any], what: str) -> torch.Tensor:
    """Map a handle from :func:`expose` (already checked): the viewed tensor.

    Raises:
        StaleHandleError: the storage no longer maps (its shared file is
            gone: the trainer freed or re-allocated it), or maps with
            another size; names ``what`` and the file. Nothing is read.
        HandleError: an unknown kind.
    """
    kind = h.get("kind")
    dtype = _DTYPES.get(h.get("dtype"))
    if dtype is None:
        raise HandleError(f"{what}: handle dtype {h.get('dtype')!r} is not one of "
                          f"{sorted(_DTYPES)}")
    start = 0              # bytes before the storage's first byte in what is mapped
    try:
        if kind == "shm":
            # A plain shared mapping of the file (torch.from_file): the reader takes no
            # reference in torch's shared-memory manager, so a trainer that frees its
            # storage unlinks the file at once (its pages stay valid for a mapping that
            # is still open) and no manager process outlives the trainer because of it.
            path = _check_shm_file(h, what)
            start, n = int(h["data_offset"]), int(h["storage_nbytes"])
            if start % dtype.itemsize or n % dtype.itemsize:
                raise HandleError(f"{what}: data_offset {start} / {n} bytes do not hold whole "
                                  f"{h['dtype']} elements")
            st = torch.from_file(path, shared=True, size=start + n,
                                 dtype=torch.uint8).untyped_storage()
        elif kind == "cuda":
            if not torch.cuda.is_available():
                raise HandleError(f"{what}: a CUDA IPC handle, and this process sees no GPU; "
                                  "colocate the worker with the trainer's GPUs")
            torch.cuda._lazy_init()
            st = torch.UntypedStorage._new_shared_cuda(
                h["device"], bytes.fromhex(h["handle"]), int(h["storage_nbytes"]),
                int(h["storage_offset_bytes"]), bytes.fromhex(h["ref_counter_handle"]),
                int(h["ref_counter_offset"]),
                bytes.fromhex(h["event_handle"]) if h["event_handle"] else None,
                bool(h["event_sync_required"]))
        else:
            raise HandleError(f"{what}: unknown handle kind {kind!r}; expected 'shm' or 'cuda'")
    except (RuntimeError, OSError) as e:
        if isinstance(e, TransferError):
            raise
        where = h.get("file") or f"CUDA IPC block on device {h.get('device')}"
        raise StaleHandleError(
            f"{what}: the handle ({where}, {h.get('storage_nbytes')} bytes) no longer maps: the "
            f"trainer freed or re-allocated that storage ({error_gist(e)}); nothing was "
            "read") from None
    if st.nbytes() != start + int(h["storage_nbytes"]):
        raise StaleHandleError(f"{what}: the handle's storage maps {st.nbytes() - start} bytes, "
                               f"the handle says {h['storage_nbytes']}; it was re-allocated; "
                               "nothing was read")
    base = torch.empty(0, dtype=dtype, device=st.device)
    base.set_(st, 0, (st.nbytes() // dtype.itemsize,), (1,))
    return base.as_strided(h["shape"], h["stride"], start // dtype.itemsize + h["offset"])


def check_handle(h: Any, plan: Plan, wi: int, rank: int, generation: int, what: str) -> None:
    """A published handle is the plan's: refuse anything else before it is mapped.

    Checks: a dict of the documented keys; the round's ``generation``; the
    wire tensor's name, that ``rank`` owns it, its dtype, its local shape
    (``ParamMeta.local_shape``); non-negative strides whose reach
    (offset + extent) lies inside ``storage_nbytes``.

    Raises:
        HandleError: what differs, naming ``what`` (trainer rank, wire tensor).
    """
    wp = plan.wires[wi]
    if not isinstance(h, dict):
        raise HandleError(f"{what}: a handle must be an object, got {type(h).__name__}")
    need = {"kind", "storage_nbytes", "offset", "dtype", "shape", "stride", "name", "generation"}
    if need - set(h):
        raise HandleError(f"{what}: handle lacks {sorted(need - set(h))}")
    if h["generation"] != generation:
        raise HandleError(f"{what}: handle of generation {h['generation']!r}, this round is "
                          f"{generation}; a stale handle is never read")
    if h["name"] != wp.name or not wp.meta.holds(rank):
        raise HandleError(f"{what}: handle names {h['name']!r}; the plan has '{wp.name}' "
                          f"{'held' if wp.meta.holds(rank) else 'not held'} by trainer rank {rank}")
    if h["dtype"] != _dtype_name(wp.meta.dtype):
        raise HandleError(f"{what}: handle dtype {h['dtype']!r}, the manifest says "
                          f"{_dtype_name(wp.meta.dtype)}")
    shape, stride = h["shape"], h["stride"]
    ints = all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
               for x in [*shape, *stride, h["offset"], h["storage_nbytes"]])
    want = wp.meta.local_shape(rank)
    if not ints or len(shape) != len(stride) or (want is not None and (
            tuple(shape) != tuple(want) if wp.meta.exact_local_shape else
            len(shape) != len(want) or any(g < w for g, w in zip(shape, want)))):
        raise HandleError(f"{what}: handle shape {shape} stride {stride} offset {h['offset']}; "
                          f"the plan's local shape is {want}")
    end = (h["offset"] + _reach(shape, stride)) * wp.meta.dtype.itemsize
    if end > h["storage_nbytes"]:
        raise HandleError(f"{what}: handle reaches byte {end} of a {h['storage_nbytes']}-byte "
                          "storage")


# --------------------------------------------------------------------------
# which slabs go which way


def _node_masks(plan: Plan, nodes: tuple[str, ...]) -> list[np.ndarray]:
    """Per wire: ``[n_slabs]`` True where trainer and worker share a node (cached on the plan)."""
    cache = plan.__dict__.setdefault("_m2nkit_ipc_masks", {})
    if nodes not in cache:
        T = plan.num_trainer_ranks
        code = {n: i for i, n in enumerate(sorted(set(nodes)))}
        ids = np.array([code[n] for n in nodes], dtype=np.int64)
        masks = []
        for w in plan.wires:
            if not len(w.table):
                masks.append(np.zeros(0, dtype=bool))
                continue
            masks.append(ids[w.table[:, SlabTable.SRC]] == ids[T + w.table[:, SlabTable.DST]])
        cache[nodes] = masks
    return cache[nodes]


def split_by_node(plan: Plan, nodes: tuple[str, ...]) -> tuple[Plan, Plan]:
    """``(local, remote)``: ``plan`` with only the slabs whose trainer and worker share a
    node, and with only the others (cached on ``plan``).

    ``nodes[rank]`` for every rank of the session (trainer ranks ``[0, T)``,
    workers ``[T, T+N)``). Both plans keep every wire tensor (same manifest
    order, so a trainer's stream fits either); their ``send_bytes``,
    ``recv_bytes`` and ``link_bytes`` count their own slabs.

    Raises:
        ValueError: ``nodes`` does not name every rank.
    """
    T, N = plan.num_trainer_ranks, plan.num_workers
    if len(nodes) != T + N:
        raise ValueError(f"nodes names {len(nodes)} ranks; the plan has {T} trainer ranks and "
                         f"{N} workers")
    cache = plan.__dict__.setdefault("_m2nkit_ipc_split", {})
    if nodes in cache:
        return cache[nodes]
    masks = _node_masks(plan, nodes)
    out = []
    for keep in (True, False):
        wires, send, recv, links = [], np.zeros(T, np.int64), np.zeros(N, np.int64), {}
        for w, m in zip(plan.wires, masks):
            table = w.table[m == keep] if len(w.table) else w.table
            sub = dataclasses.replace(w, table=table, _moved=None)
            wires.append(sub)
            if len(table):
                nb = sub.slab_nbytes()
                for s, d, b in zip(table[:, SlabTable.SRC], table[:, SlabTable.DST], nb):
                    send[s] += b
                    recv[d] += b
                    links[(int(s), int(d))] = links.get((int(s), int(d)), 0) + int(b)
        out.append(dataclasses.replace(plan, wires=wires, problems=[], send_bytes=send,
                                       recv_bytes=recv, link_bytes=links))
    cache[nodes] = tuple(out)
    return cache[nodes]


def even_nodes(num_trainer_ranks: int, num_workers: int, count: int) -> tuple[str, ...]:
    """Node names of every rank when ``count`` nodes each hold an equal run of trainer
    ranks and of workers, in rank order (trainer rank ``r`` on node ``r * count // T``,
    worker ``w`` on ``w * count // N``): what ``m2nkit plan --nodes`` reports.

    Raises:
        ValueError: ``count`` below 1, above the trainer ranks or the workers, or not
            dividing both (no equal runs); names the counts that would do.
    """
    T, N = num_trainer_ranks, num_workers
    valid = [c for c in range(1, min(T, N) + 1) if T % c == 0 and N % c == 0]
    if count not in valid:
        raise ValueError(f"--nodes {count}: each node holds an equal run of the {T} trainer "
                         f"ranks and of the {N} workers, so the count must divide both; "
                         f"valid: {', '.join(map(str, valid))}")
    return tuple(f"node{r * count // T}" for r in range(T)) + \
        tuple(f"node{w * count // N}" for w in range(N))


def route_bytes(plan: Plan, nodes: tuple[str, ...]) -> dict:
    """Bytes each way: ``{"ipc": bytes over shared memory, "p2p": bytes by torch_p2p,
    "ipc_slabs": n, "p2p_slabs": n}`` for ``nodes`` (see :func:`split_by_node`)."""
    local, remote = split_by_node(plan, nodes)
    return {"ipc": local.nbytes_moved, "p2p": remote.nbytes_moved,
            "ipc_slabs": local.num_slabs, "p2p_slabs": remote.num_slabs}


# --------------------------------------------------------------------------
# the transport


@dataclass(frozen=True)
class IpcReport:
    """One round on this rank: ``nbytes`` (all), ``ipc_bytes`` (copied over shared memory)
    and ``p2p_bytes`` (by torch_p2p, to or from other nodes)."""

    nbytes: int
    ipc_bytes: int
    p2p_bytes: int


def _dests_of(wp, rank: int) -> np.ndarray:
    """Workers with slabs of ``wp`` from trainer ``rank`` (with repeats)."""
    if not len(wp.table):
        return wp.table[:0, SlabTable.DST]
    return wp.table[wp.table[:, SlabTable.SRC] == rank, SlabTable.DST]


def _sources_of(wp, worker: int) -> np.ndarray:
    """Trainer ranks with slabs of ``wp`` for ``worker`` (with repeats)."""
    if not len(wp.table):
        return wp.table[:0, SlabTable.SRC]
    return wp.table[wp.table[:, SlabTable.DST] == worker, SlabTable.SRC]


def _settle(posted, deadline: Deadline, grace_s: float = 1.0) -> None:
    """Best effort on a failure path: let posted signals go out, each for at most
    ``grace_s`` (within the round's deadline); errors are ignored (the peer may be gone)."""
    for work, _, _ in posted:
        try:
            wait_work(work, Deadline(max(min(deadline.left(), grace_s), 0.01)), "")
        except TransferError:
            pass


def _wait_keys(store, keys: list[str], deadline: Deadline, what) -> None:
    """Wait until every key is set, or raise TransferError naming the first missing one."""
    if not keys:
        return
    try:
        store.wait(keys, timedelta(seconds=max(deadline.left(), 0.01)))
    except Exception as e:  # noqa: BLE001 - a store timeout or a closed store
        missing = [k for k in keys if not _check(store, k)]
        raise TransferError(f"{what(missing[0] if missing else keys[0])} by {deadline.describe()} "
                            f"({error_gist(e)})") from None


def _check(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


class IpcTransport:
    """The ``ipc`` ``Transport`` (``m2nkit.engine.transports.base``) of one rank.

    Per round and bucket (``BucketSchedule.of(plan, bucket_bytes)``):

    * trainer rank ``r`` pulls the bucket's local tensors from its stream,
      exposes those with slabs for workers on its node (:func:`expose`; a
      tensor torch cannot share in place, or one that is a small view of a
      much larger storage, is copied into a shared staging buffer kept
      across rounds: one bucket at most), publishes
      ``{wire index: handle}`` as JSON under
      ``m2nkit/ipc/<round>/<bucket>/t<r>``, sends the bucket's slabs for
      other nodes by torch_p2p, then waits until every worker that reads
      its handles wrote ``.../w<worker>/t<r>`` (``"ok"`` or its error);
    * worker ``w`` receives the bucket's torch_p2p slabs, then for each
      trainer rank on its node with slabs for it: waits for its handles,
      checks them against the plan (:func:`check_handle`), maps them
      (:func:`open_handle`), copies each slab's box into ``storage``
      (``copy_`` casts to the parameter's dtype as vLLM's loaders do),
      drops the mapping and says it is done.

    Every wait counts down to the round's ``Deadline``. A trainer that
    fails mid-bucket publishes its error in place of its handles of that
    bucket and of every later one, and a worker that fails writes its error
    as its answer to every trainer rank it would still have read, so the
    peers fail at once without waiting for any connection to close (a
    group's connections close only when its last reference goes). Each
    trainer rank posts the receives for its readers' answers before it
    publishes, since a gloo send waits for its receive. "Handles published" and "done" also go as one-byte signals over
    ``group`` (:meth:`_post`), so a rank that dies, whose connections close,
    is named at once ("trainer rank 0: worker 1 (rank 3)'s answer for
    bucket 2 failed: Connection closed by peer"), not at the deadline.

    Args:
        store: the session's store (``control.create_group``).
        group: the session's process group (torch_p2p for other nodes).
        rank: this rank; ``nodes``: every rank's node; ``num_trainer_ranks``
            is read from the plan.
    """

    name: ClassVar[str] = "ipc"
    #: No rules: any wire tensor's slabs can be copied from a mapped shard.
    can_carry: ClassVar[None] = None

    def __init__(self, store: Any, group: Any, *, rank: int, nodes: tuple[str, ...],
                 device: torch.device | str = "cpu", timeout_s: float,
                 bucket_bytes: int = 64 << 20) -> None:
        self.store = store
        self.group = group
        self.rank = rank
        self.nodes = tuple(nodes)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._round = 0
        self._pool = BufferPool(self.device)      # torch_p2p staging (other nodes)
        self._staging = torch.empty(0, dtype=torch.uint8)   # shared bounce bytes (trainer)
        #: bytes bounced through the staging buffer in the last round (trainer)
        self.bounced = 0
        self._moved = 0     # bytes moved into shared memory since the last return_freed_heap

    @staticmethod
    def why_unavailable() -> str | None:
        """``None`` on Linux (named POSIX shared memory under /dev/shm), else why not."""
        if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
            return (f"needs Linux shared memory (/dev/shm) and this is {sys.platform}; use "
                    "'torch_p2p'")
        return None

    @staticmethod
    def check_source(source: Any, rank: int) -> None:
        """Accepts every source (its collectives run while the stream is pulled, as for
        torch_p2p)."""

    @classmethod
    def connect(cls, store: Any, group: Any, rank: int, world_size: int, *,
                device: torch.device | str, timeout_s: float,
                bucket_bytes: int = 64 << 20) -> "IpcTransport":
        """This rank's transport; collective: every rank publishes its node and reads all.

        Raises:
            TransferError: some rank did not publish its node within ``timeout_s``.
        """
        store.set(f"{_PREFIX}/node/{rank}", node_id())
        deadline = Deadline(timeout_s)
        keys = [f"{_PREFIX}/node/{r}" for r in range(world_size)]
        _wait_keys(store, keys, deadline,
                   lambda k: f"rank {rank}: rank {k.rsplit('/', 1)[1]} did not say its node "
                             "for the ipc transport")
        nodes = tuple(store.get(k).decode() for k in keys)
        return cls(store, group, rank=rank, nodes=nodes, device=device, timeout_s=timeout_s,
                   bucket_bytes=bucket_bytes)

    # -- helpers -------------------------------------------------------

    def schedule(self, plan: Plan) -> BucketSchedule:
        return BucketSchedule.of(plan, self.bucket_bytes)

    def _key(self, k: int, *parts) -> str:
        return "/".join([_PREFIX, str(self._round), str(k), *map(str, parts)])

    def _bucket_plans(self, plan: Plan, schedule: BucketSchedule):
        """Per bucket: ``(local sub-plan, remote sub-plan)`` of just its wires (cached)."""
        cache = plan.__dict__.setdefault("_m2nkit_ipc_buckets", {})
        key = (self.nodes, schedule.bounds)
        if key not in cache:
            local, remote = split_by_node(plan, self.nodes)
            out = []
            for k in range(len(schedule)):
                def only(p, k=k):
                    keep = set(schedule.wires(k))
                    wires = [w if i in keep else dataclasses.replace(
                        w, table=w.table[:0], _moved=None) for i, w in enumerate(p.wires)]
                    return dataclasses.replace(p, wires=wires)
                out.append((only(local), only(remote)))
            cache[key] = out
        return cache[key]

    def _share(self, local: torch.Tensor) -> dict | None:
        """A handle of ``local``'s own storage, or ``None`` where it needs a bounce.

        A bounce (:meth:`_stage`) where torch cannot share the storage in
        place, and where ``local`` is a small view of a much larger storage
        (more than twice its bytes and over 1 MiB: sharing would move all
        of it, a checkpoint's or a flat buffer's, into shared memory).

        Memory: moving a CPU storage into shared memory copies it, then
        frees its old bytes; glibc keeps freed heap chunks (below its mmap
        threshold, which grows to 32 MiB) mapped, so the first round would
        hold the whole shard twice by its end. Every :data:`TRIM_BYTES`
        moved, the freed pages go back to the OS (``malloc_trim``), so
        the first round's extra is the largest storage moved (while it is
        in both places) plus at most ``TRIM_BYTES``: within one bucket
        unless one local tensor is larger (docs/colocated.md, "Memory").
        """
        st = local.untyped_storage()
        if st.nbytes() > max(2 * local.numel() * local.element_size(), 1 << 20):
            return None
        moves = local.device.type == "cpu" and not st.is_shared()
        try:
            h = expose(local)
        except RuntimeError:
            return None
        if moves:
            self._moved += st.nbytes()
            if self._moved >= TRIM_BYTES:
                return_freed_heap()
                self._moved = 0
        return h

    # -- rounds ----------------------------------------------------------

    def send_round(self, plan: Plan, rank: int, stream: Iterable[tuple[str, torch.Tensor]], *,
                   deadline: Deadline | None = None) -> IpcReport:
        """Expose trainer ``rank``'s shard bucket by bucket; see the class. Returns its bytes.

        Raises:
            TransferError: a stream out of manifest order or shape (names
                the rank and tensor), a worker's refusal of a handle, a
                worker that did not copy by the deadline, a torch_p2p failure.
        """
        deadline = Deadline.of(deadline, self.timeout_s)
        self._round += 1
        schedule = self.schedule(plan)
        it = iter(stream)
        ipc_bytes = p2p_bytes = 0
        self.bounced = 0
        T = plan.num_trainer_ranks
        for k, (local_plan, remote_plan) in enumerate(self._bucket_plans(plan, schedule)):
            published = False
            readers = self._readers(plan, schedule, k, rank)
            signals: list = []
            try:
                locals_: list[tuple[str, torch.Tensor]] = []
                handles: dict[str, dict] = {}
                staged: list[tuple[int, torch.Tensor]] = []
                for wi in schedule.wires(k):
                    wp = plan.wires[wi]
                    if not wp.meta.holds(rank):
                        continue
                    local = next_local(it, wp, rank, error=TransferError)
                    if deadline.expired():
                        raise TransferError(f"trainer rank {rank}: the source's local tensor of "
                                            f"'{wp.name}' came after {deadline.describe()}; the "
                                            "round is over")
                    locals_.append((wp.name, local))
                    lw = local_plan.wires[wi]
                    if not len(_dests_of(lw, rank)):
                        continue
                    ipc_bytes += int(lw.slab_nbytes()[lw.table[:, SlabTable.SRC] == rank].sum())
                    h = self._share(local)
                    if h is None:
                        staged.append((wi, local))
                        self.bounced += local.numel() * local.element_size()
                    else:
                        handles[str(wi)] = {**h, "name": wp.name, "generation": self._round}
                if staged:
                    handles.update(self._stage(plan, staged))
                if any(t.is_cuda for _, t in locals_):
                    torch.cuda.current_stream().synchronize()   # written before it is read
                # Each reader's "done" comes over the group: a worker that dies closes its
                # connections, so this fails at once naming it, not at the deadline. Posted
                # before the handles go out, so a reader's answer always finds its receive
                # (a gloo send waits for it) even when this rank fails right after.
                dones = [(w, self._post("recv", T + w, 2 * k + 1,
                                        f"trainer rank {rank}: worker {w} (rank {T + w})'s "
                                        f"answer for bucket {k}")) for w in readers]
                if readers:
                    self.store.set(self._key(k, f"t{rank}"), json.dumps({"handles": handles}))
                    published = True
                    signals = self._signal_all(readers, T, 2 * k, rank, k)
                if any(len(_dests_of(w, rank)) for w in remote_plan.wires):
                    p2p_bytes += torch_p2p.send_round(
                        self.group, remote_plan, BucketSchedule.of(remote_plan, 1 << 62), rank,
                        iter(locals_), deadline=deadline, device=self.device, pool=self._pool)
                for w, (work, _, what) in dones:
                    wait_work(work, deadline, what)
                for w in readers:
                    answer = self.store.get(self._key(k, f"w{w}", f"t{rank}")).decode()
                    if answer != "ok":
                        raise TransferError(answer)
                for work, _, what in signals:
                    wait_work(work, deadline, what)
                del locals_, handles, staged
            except Exception as e:
                # The workers waiting on this rank hear at once: its error in place of the
                # handles of this bucket (unless published) and of every later one, each
                # with its signal, so no worker waits for a bucket this rank will never
                # expose (its connections close only when the group's last reference
                # goes: not something to rely on), or (published) the signals already
                # posted go out.
                try:
                    self._fail_later_buckets(plan, schedule, rank, k if not published else k + 1,
                                             f"trainer rank {rank}: {e}", signals, deadline)
                except Exception:  # noqa: BLE001 - the store or group is gone too
                    pass
                if isinstance(e, TransferError):
                    raise
                raise TransferError(f"trainer rank {rank}: bucket {k}: {error_gist(e)}") from e
        leftover = next(it, None)
        if leftover is not None:
            raise TransferError(f"trainer rank {rank}: source yielded '{leftover[0]}' after the "
                                "last wire tensor of the manifest")
        return IpcReport(ipc_bytes + p2p_bytes, ipc_bytes, p2p_bytes)

    def _stage(self, plan: Plan, staged) -> dict[str, dict]:
        """Copy ``[(wire index, local)]`` into the shared staging buffer; their handles."""
        need = sum((t.numel() * t.element_size() + 15) & ~15 for _, t in staged)
        if self._staging.numel() < need:
            self._staging = torch.empty(0, dtype=torch.uint8)
            self._staging = torch.empty(need, dtype=torch.uint8, device=staged[0][1].device)
        out, at = {}, 0
        for wi, t in staged:
            n = t.numel() * t.element_size()
            view = self._staging[at:at + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            out[str(wi)] = {**expose(view), "name": plan.wires[wi].name,
                            "generation": self._round}
            at += (n + 15) & ~15
        return out

    def recv_round(self, plan: Plan, worker: int, storage: Mapping[str, torch.Tensor], *,
                   deadline: Deadline | None = None) -> tuple[set[str], IpcReport]:
        """Copy worker ``worker``'s boxes of one round into ``storage``; see the class.

        Returns ``(names of the wire tensors fully received, IpcReport)``.

        Raises:
            TransferError (``received``/``missing`` set): a trainer's error,
                a handle that does not match the plan (:class:`HandleError`)
                or no longer maps (:class:`StaleHandleError`), a trainer that
                did not publish by the deadline, a torch_p2p failure.
        """
        deadline = Deadline.of(deadline, self.timeout_s)
        self._round += 1
        schedule = self.schedule(plan)
        T = plan.num_trainer_ranks
        me = T + worker
        expected = {w.name for w in plan.wires if w.sends_to(worker)}
        done: set[str] = set()
        ipc_bytes = p2p_bytes = 0
        try:
            for k, (local_plan, remote_plan) in enumerate(self._bucket_plans(plan, schedule)):
                if any(w.sends_to(worker) for w in remote_plan.wires):
                    _, got = torch_p2p.recv_round(
                        self.group, remote_plan, BucketSchedule.of(remote_plan, 1 << 62), worker,
                        storage, deadline=deadline, device=self.device, pool=self._pool)
                    p2p_bytes += got
                srcs = self._sources(plan, schedule, k, worker)
                for i, src in enumerate(srcs):
                    try:
                        self._raise_if_failed(k, src)
                        work, _, what = self._post(
                            "recv", src, 2 * k, f"worker {worker} (rank {me}): trainer rank "
                                                f"{src}'s handles of bucket {k}")
                        wait_work(work, deadline, what)
                        ipc_bytes += self._copy_from(plan, local_plan, schedule, k, src, worker,
                                                     storage, deadline)
                    except Exception as e:
                        # Every trainer still to hear from this worker, in this bucket and
                        # every later one, hears why (its answer and its signal).
                        self._answer_later_buckets(plan, schedule, worker, k, srcs[i:],
                                                   f"worker {worker} (rank {me}): {e}", deadline)
                        raise
                    self._answer(k, worker, src, "ok")
                    work, _, what = self._post("send", src, 2 * k + 1,
                                               f"worker {worker} (rank {me}): answer to trainer "
                                               f"rank {src} for bucket {k}")
                    wait_work(work, deadline, what)
                for wi in schedule.wires(k):
                    if plan.wires[wi].name in expected:
                        done.add(plan.wires[wi].name)
        except Exception as e:
            err = e if isinstance(e, TransferError) else TransferError(
                f"worker {worker} (rank {me}): {error_gist(e)}")
            err.received = sorted(done)
            err.missing = sorted(expected - done)
            if err is e:
                raise
            raise err from e
        return done, IpcReport(ipc_bytes + p2p_bytes, ipc_bytes, p2p_bytes)

    def _post(self, op: str, peer: int, tag: int, what: str):
        """Post a one-byte signal to or from ``peer``: ``(work, its buffer, what)``.

        The store carries the handles and answers; these signals only say
        "look now", so that a peer that dies (and closes its connections) is
        found at once instead of at the deadline. Tags: ``2k`` handles of
        bucket ``k`` published (trainer -> worker), ``2k + 1`` answered
        (worker -> trainer); torch_p2p's messages in the same bucket only run
        between ranks of different nodes, these only within one.
        """
        buf = torch.zeros(1, dtype=torch.uint8)
        try:
            post = self.group.send if op == "send" else self.group.recv
            return post([buf], peer, tag), buf, what
        except RuntimeError as e:
            raise TransferError(f"{what} failed: {error_gist(e)}") from e

    def _signal_all(self, readers, T: int, tag: int, rank: int, k: int) -> list:
        """Post the signal to every reader; a post that fails (a dead worker) does not keep
        the others from theirs. Returns the posted ones.

        Raises:
            TransferError: a post failed, after the others were posted and given
                up to a second to go out (:func:`_settle`).
        """
        posted, first = [], None
        for w in readers:
            try:
                posted.append(self._post("send", T + w, tag, f"trainer rank {rank}: signal of "
                                                             f"bucket {k} to worker {w} "
                                                             f"(rank {T + w})"))
            except TransferError as e:
                first = first or e
        if first is not None:
            _settle(posted, Deadline(1.0))
            raise first
        return posted

    def _readers(self, plan: Plan, schedule: BucketSchedule, k: int, rank: int) -> list[int]:
        """Workers on this node that read trainer ``rank``'s handles of bucket ``k``."""
        local_plan = self._bucket_plans(plan, schedule)[k][0]
        return sorted({int(d) for wi in schedule.wires(k)
                       for d in _dests_of(local_plan.wires[wi], rank)})

    def _sources(self, plan: Plan, schedule: BucketSchedule, k: int, worker: int) -> list[int]:
        """Trainer ranks on this node whose handles of bucket ``k`` worker ``worker`` reads."""
        local_plan = self._bucket_plans(plan, schedule)[k][0]
        return sorted({int(s) for wi in schedule.wires(k)
                       for s in _sources_of(local_plan.wires[wi], worker)})

    def _fail_later_buckets(self, plan: Plan, schedule: BucketSchedule, rank: int, first: int,
                            text: str, posted: list, deadline: Deadline) -> None:
        """Trainer ``rank`` failed: publish ``text`` in place of its handles of buckets
        ``first`` onwards and signal each of their readers, then give the signals (and
        ``posted``, the ones already out) at most half a second in all to go.

        A worker already waiting for one of these buckets wakes at once and reads the
        error; one that reaches it later finds the error in the store before it waits
        (:meth:`_raise_if_failed`). Neither depends on this rank's connections closing.
        """
        T = plan.num_trainer_ranks
        posted = list(posted)
        for kk in range(first, len(schedule)):
            readers = self._readers(plan, schedule, kk, rank)
            if not readers:
                continue
            self.store.set(self._key(kk, f"t{rank}"), json.dumps({"error": text}))
            for w in readers:
                try:
                    posted.append(self._post("send", T + w, 2 * kk, ""))
                except TransferError:
                    pass
        _settle(posted, Deadline(max(min(deadline.left(), 0.5), 0.01)))

    def _answer_later_buckets(self, plan: Plan, schedule: BucketSchedule, worker: int, k: int,
                              pending: list[int], text: str, deadline: Deadline) -> None:
        """Worker ``worker`` failed in bucket ``k``: answer ``text`` (with its signal) to
        the trainer ranks ``pending`` of bucket ``k`` and to every trainer rank it would
        have read in the later buckets; the signals get at most half a second in all."""
        sends = []
        for kk in range(k, len(schedule)):
            srcs = pending if kk == k else self._sources(plan, schedule, kk, worker)
            for src in srcs:
                self._answer(kk, worker, src, text)
                try:
                    sends.append(self._post("send", src, 2 * kk + 1, ""))
                except TransferError:
                    pass
        _settle(sends, Deadline(max(min(deadline.left(), 0.5), 0.01)))

    def _raise_if_failed(self, k: int, src: int) -> None:
        """Raise trainer ``src``'s error for bucket ``k`` if it already published one."""
        key = self._key(k, f"t{src}")
        if not _check(self.store, key):
            return
        try:
            msg = json.loads(self.store.get(key))
        except ValueError:
            return                        # _copy_from names a malformed message
        if isinstance(msg, dict) and "error" in msg:
            raise TransferError(str(msg["error"]))

    def _answer(self, k: int, worker: int, src: int, text: str) -> None:
        """Tell trainer ``src`` that ``worker`` is done with its bucket ``k`` ("ok" or why not)."""
        try:
            self.store.set(self._key(k, f"w{worker}", f"t{src}"), text)
        except Exception:  # noqa: BLE001 - the store is gone: the trainer finds out itself
            pass

    def _copy_from(self, plan: Plan, local_plan: Plan, schedule: BucketSchedule, k: int,
                   src: int, worker: int, storage: Mapping[str, torch.Tensor],
                   deadline: Deadline) -> int:
        """Bucket ``k``'s slabs from trainer ``src`` into ``storage``: bytes copied."""
        T = plan.num_trainer_ranks
        me = T + worker
        key = self._key(k, f"t{src}")
        _wait_keys(self.store, [key], deadline, lambda _: (
            f"worker {worker} (rank {me}): trainer rank {src} did not expose bucket {k}"))
        try:
            msg = json.loads(self.store.get(key))    # plain data: never unpickled
        except ValueError as e:
            raise HandleError(f"worker {worker} (rank {me}): trainer rank {src}'s handles of "
                              f"bucket {k} are not JSON ({e})") from None
        if not isinstance(msg, dict):
            raise HandleError(f"worker {worker} (rank {me}): trainer rank {src}'s handles of "
                              f"bucket {k} are not an object")
        if "error" in msg:
            raise TransferError(str(msg["error"]))
        handles = msg.get("handles")
        if not isinstance(handles, dict):
            raise HandleError(f"worker {worker} (rank {me}): trainer rank {src} published no "
                              f"handles for bucket {k}")
        got = 0
        for wi in schedule.wires(k):
            lw = local_plan.wires[wi]
            if not len(lw.table):
                continue
            slabs = list(lw.slabs(src=src, dst=worker))
            if not slabs:
                continue
            what = (f"worker {worker} (rank {me}): trainer rank {src}'s handle of "
                    f"'{lw.name}' (bucket {k})")
            h = handles.get(str(wi))
            if h is None:
                raise HandleError(f"{what} is missing")
            check_handle(h, plan, wi, src, self._round, what)
            view = open_handle(h, what)
            try:
                for slab in slabs:
                    dst = storage[slab.param][slab.dst_region]
                    dst.copy_(view[slab.src_region])
                    got += slab.nbytes
                if view.is_cuda or any(storage[s.param].is_cuda for s in slabs):
                    # read before "done": the trainer may change its shard after it
                    torch.cuda.current_stream().synchronize()
            finally:
                del view           # the mapping goes: the trainer may free its storage
        return got

    def close(self) -> None:
        """Drop the staging bytes; the store and group are the caller's."""
        self._pool.release()
        self._staging = torch.empty(0, dtype=torch.uint8)
