"""The one shape every transport has: the ``Transport`` protocol.

A transport moves the slabs of an agreed plan, one round at a time, over a
group the control plane built (``m2nkit.engine.control``: rendezvous,
agreement and the end-of-round verdict are not a transport's business). The
trainer engine and the receiver drive every transport through these members
alone, and ``m2nkit.engine.transports.registry`` names each transport once,
so a new transport is one module with a class of this shape plus its line in
the registry; nothing else changes.

Structural (``typing.Protocol``): a transport module need not import this
one; the registry's type annotation and ``tests/engine/test_transports.py`` hold
every registered class to it.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Mapping, Protocol

import torch

from m2nkit.engine.plan_types import Plan, Verdict, WirePlan
from m2nkit.manifest.destination import DestinationParam

__all__ = ["Transport", "RoundResult", "CanCarry"]

#: A transport's rules: ``(wire plan, {(worker, param name): DestinationParam})
#: -> Verdict``, whether it can carry that wire tensor and, if not, why (the
#: planner records it in ``WirePlan.verdicts[name]``).
CanCarry = Callable[[WirePlan, Mapping[tuple[int, str], DestinationParam]], Verdict]


class RoundResult(Protocol):
    """What a transport's ``send_round`` returns (and ``recv_round`` beside the names)."""

    @property
    def nbytes(self) -> int:
        """Bytes this rank sent (trainer) or received (worker) in the round."""


class Transport(Protocol):
    """A way to move a plan's slabs from trainer ranks into worker storage.

    Class-level members (the registry reads them without a session):

    * ``name``: the transport's name in ``InitPayload.transport``,
      ``M2NTrainerInitInfo.transport`` and ``--transport`` (``"torch_p2p"``).
    * ``can_carry``: its rules (:data:`CanCarry`), or ``None`` for a
      transport that carries any wire tensor (the planner records no
      verdict for it).
    * ``why_unavailable()``: ``None`` when this machine can run it, else the
      rest of a sentence saying why and what to use instead (``"needs CUDA
      GPUs and this process sees none; use 'torch_p2p' ..."``).
    * ``check_source(source, rank)``: raise ``ValueError`` for a trainer
      source it cannot drive safely (names the rank and what to use).
    * ``connect(store, group, rank, world_size, *, device, timeout_s,
      bucket_bytes)``: the transport of this rank over an agreed group
      (``store``, ``group``: ``control.create_group``). Collective where the
      transport needs it: every rank of the group calls it.

    Per session:

    * ``send_round(plan, rank, stream, *, deadline)`` on every trainer rank
      (``stream``: its ``iter_local()``, each provider called once, in
      manifest order) -> a :class:`RoundResult`;
    * ``recv_round(plan, worker, storage, *, deadline)`` on every worker
      (``storage``: ``{vLLM name: tensor}`` written in place) -> ``(names of
      the wire tensors fully received, RoundResult)``;
    * ``close()`` at the end (collective where the transport needs it).

    Every wait of a round counts down to ``deadline`` (the round's
    ``m2nkit.engine.deadline.Deadline``; ``None``: the transport's
    ``timeout_s`` per call). A failure raises ``control.TransferError``
    naming the peer; a worker's carries ``received`` and ``missing`` (wire
    tensor names). ``ValueError`` for a plan with problems or a rank that
    is not this transport's.
    """

    name: ClassVar[str]
    can_carry: ClassVar[CanCarry | None]

    @staticmethod
    def why_unavailable() -> str | None: ...

    @staticmethod
    def check_source(source: Any, rank: int) -> None: ...

    @classmethod
    def connect(cls, store: Any, group: Any, rank: int, world_size: int, *,
                device: torch.device | str, timeout_s: float,
                bucket_bytes: int) -> "Transport": ...

    def send_round(self, plan: Plan, rank: int, stream: Iterable[tuple[str, torch.Tensor]], *,
                   deadline: Any = None) -> RoundResult: ...

    def recv_round(self, plan: Plan, worker: int, storage: Mapping[str, torch.Tensor], *,
                   deadline: Any = None) -> tuple[set[str], RoundResult]: ...

    def close(self) -> None: ...
