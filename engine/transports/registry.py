"""Every transport, named once.

``TRANSPORTS`` maps a transport's ``name`` (``InitPayload.transport``,
``M2NTrainerInitInfo.transport``, ``--transport``) to its class, a
``Transport`` (``m2nkit.engine.transports.base``). Everything that knows
transports reads it: the planner records the verdict of every transport
with rules (:data:`TRANSPORT_RULES`), the payload and the trainer's init
info check a name (:func:`check_transport`), the trainer engine and the
receiver open one (:func:`open_transport`). Adding a transport is its
module (a class of that shape) plus two lines here: its import, and its
class in the tuple of ``TRANSPORTS``.
"""

from __future__ import annotations

from typing import Any, Mapping

from m2nkit.engine.transports.base import CanCarry, Transport
from m2nkit.engine.transports.ipc import IpcTransport
from m2nkit.engine.transports.nccl_m2n import NcclM2NTransport
from m2nkit.engine.transports.torch_p2p import TorchP2PTransport

__all__ = ["TRANSPORTS", "TRANSPORT_RULES", "check_transport", "open_transport"]

#: name -> transport class, in the order messages list them (the default first).
TRANSPORTS: Mapping[str, type[Transport]] = {
    t.name: t for t in (TorchP2PTransport, NcclM2NTransport, IpcTransport)
}

#: name -> ``can_carry`` of every transport with rules: the planner's default
#: judges (``m2nkit.engine.plan.build_plan``). A transport whose ``can_carry``
#: is ``None`` carries any wire tensor and has no entry.
TRANSPORT_RULES: Mapping[str, CanCarry] = {
    name: t.can_carry for name, t in TRANSPORTS.items() if t.can_carry is not None
}


def check_transport(transport: str, where: str) -> str:
    """Return ``transport`` if this machine can run it.

    Raises:
        ValueError: an unknown transport, or one this machine cannot run
            (``nccl_m2n`` without CUDA); names ``where`` and what would be
            valid.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"{where} '{transport}' is not one of {list(TRANSPORTS)}")
    why = TRANSPORTS[transport].why_unavailable()
    if why is not None:
        raise ValueError(f"{where} '{transport}' {why}")
    return transport


def open_transport(transport: str, store: Any, group: Any, rank: int, world_size: int, *,
                   device: Any, timeout_s: float, bucket_bytes: int) -> Transport:
    """This rank's ``transport`` over an agreed group (``control.create_group``).

    Collective where the transport needs it (``nccl_m2n`` builds its
    communicator): every rank of the group calls it.

    Raises:
        KeyError: an unknown transport (``check_transport`` refuses it first).
        TransferError, NcclM2NUnavailableError: as the transport's ``connect``.
    """
    return TRANSPORTS[transport].connect(store, group, rank, world_size, device=device,
                                         timeout_s=timeout_s, bucket_bytes=bucket_bytes)
