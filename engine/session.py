"""The init payload both sides build a transfer session from.

Trainer rank 0 sends it through ``VLLMWeightSyncClient.init_weight_transfer_engine``
(vLLM's ``POST /init_weight_transfer_engine`` body ``{"init_info": ...}``).
It carries the rendezvous (vLLM ``m2n_common.py``: trainer ranks ``[0, T)``,
workers ``[T, T+N)``, ``rank_offset = T``), the manifest, and the digests
each side must reproduce: a worker recomputes the manifest digest from the
manifest it received and rebuilds the plan from its own destination layout;
any difference is refused before a byte moves.

The runtime knows no model family and no inference engine: both sides get
the destination layout from their caller as a :class:`DestinationBuilder`,
which an adapter builds (``m2nkit.adapters.vllm.vllm_destination(config,
spec)``). Nothing here imports ``m2nkit.adapters``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

from m2nkit.engine.plan import build_plan
from m2nkit.engine.transports.registry import check_transport

if TYPE_CHECKING:
    from m2nkit.engine.plan_types import Plan
    from m2nkit.manifest.destination import DestinationLayout
    from m2nkit.manifest.meta import ParamMeta

__all__ = ["INIT_SCHEMA_VERSION", "DestinationBuilder", "check_destination", "InitPayload",
           "GivenLayout", "session_destination", "plan_from_manifest"]


@runtime_checkable
class DestinationBuilder(Protocol):
    """The inference side's layout rules, as the runtime needs them (built by an adapter).

    Structural: any object with these members works, so an adapter need not
    import the engine. ``m2nkit.adapters.vllm.vllm_destination(config,
    "vllm:tp=2")`` builds one for vLLM.

    Attributes:
        spec: the inference layout in canonical text (``"vllm:tp=2,dp=1"``).
            It travels in the init payload, and a worker refuses a payload
            whose ``inference`` is not exactly its own ``spec``.
        num_workers: ``N``, the workers of that layout (``0..N-1``).

    Calling it with the wire tensors (``ParamMeta`` in manifest order)
    returns the ``DestinationLayout`` for them: what every worker holds and
    where each wire tensor lands. It must be a pure function of the metas
    (both sides of a session call it and compare the resulting plans), and
    raise ``ValueError`` naming the tensor for wire tensors it cannot place.
    """

    spec: str
    num_workers: int

    def __call__(self, metas: Sequence[ParamMeta]) -> DestinationLayout: ...


def check_destination(destination: Any, where: str) -> DestinationBuilder:
    """Return ``destination`` if it is a :class:`DestinationBuilder`.

    Raises:
        ValueError: it is missing, not callable, or lacks a string ``spec``
            or a positive int ``num_workers`` (names ``where``).
    """
    if destination is None:
        raise ValueError(f"{where} is missing: pass the destination layout builder, e.g. "
                         "m2nkit.adapters.vllm.vllm_destination(config, 'vllm:tp=2')")
    spec = getattr(destination, "spec", None)
    n = getattr(destination, "num_workers", None)
    if not callable(destination) or not isinstance(spec, str) or isinstance(n, bool) \
            or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{where} must be a DestinationBuilder (a callable (metas) -> "
                         f"DestinationLayout with a str 'spec' and an int 'num_workers' > 0), "
                         f"got {type(destination).__name__}")
    return destination

#: The session protocol both sides speak. 2: a worker joins each round in the
#: session store before it receives (``control.join_round``), and the trainers
#: wait for that before they send; a worker of version 1 never would. 3: a
#: traced layout travels in the payload (``InitPayload.destination``) and each
#: worker checks its own part against its own loaders, instead of tracing
#: every worker itself; a worker of version 2 would trace them all.
INIT_SCHEMA_VERSION = 3


@dataclass(frozen=True)
class InitPayload:
    """Everything a worker needs to join a transfer session.

    Attributes:
        master_address, master_port: the rendezvous ``TCPStore`` (hosted by
            trainer rank 0).
        rank_offset: ``T``, the number of trainer ranks; worker ``w`` joins
            as rank ``T + w``.
        world_size: ``T + N``.
        backend: ``"gloo"`` or ``"nccl"`` (the session's process group,
            ``m2nkit.engine.control.create_group``).
        inference: the inference layout the trainer planned for, its
            ``DestinationBuilder.spec`` (``"vllm:tp=2,dp=1"``); a worker
            refuses one that differs from its own.
        manifest: ``m2nkit.manifest.serialize.manifest_to_json`` output.
        manifest_digest: sha256 of the canonical manifest.
        plan_digest: ``Plan.digest()`` on the trainer.
        timeout_s: the bound on the init and on each round, seconds, on
            every rank: every wait of one counts down to one deadline set
            when it starts (``m2nkit.engine.deadline``).
        bucket_bytes: ``BucketSchedule`` bucket size (bytes).
        transport: a name of ``m2nkit.engine.transports.registry.TRANSPORTS``:
            ``"torch_p2p"`` (any backend, any layout) or ``"nccl_m2n"``
            (GPUs: one ``nccl.m2n.reshard`` per expressible wire tensor,
            torch_p2p for the rest).
        session: an id the trainer picks per ``trainer_init`` (``""``: none).
            Every ``update_weights`` of the session carries it, so a worker
            that a newer init has taken over refuses the older session's
            calls as *superseded* instead of mixing the two.
        destination: the trainers' destination layout
            (``m2nkit.manifest.destination.layout_to_json``) when it was
            traced from vLLM's loaders (``VLLMDestination.layout ==
            "traced"``), else ``None``. A worker whose own destination is
            traced plans from it instead of tracing every worker's model
            (:func:`session_destination`) and checks its own part against
            its live model's loaders (the vLLM plugin), so each worker
            traces one model, its own.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    inference: str
    manifest: dict
    manifest_digest: str
    plan_digest: str
    timeout_s: float
    bucket_bytes: int
    transport: str = "torch_p2p"
    session: str = ""
    destination: dict | None = None
    schema_version: int = INIT_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != INIT_SCHEMA_VERSION:
            raise ValueError(f"init payload schema_version {self.schema_version} is not supported; "
                             f"this m2nkit speaks {INIT_SCHEMA_VERSION}")
        for name in ("master_port", "rank_offset", "world_size", "bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"init payload field '{name}' must be a positive int, got {v!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"init payload master_port {self.master_port} is not a TCP port")
        if self.world_size <= self.rank_offset:
            raise ValueError(f"init payload world_size {self.world_size} leaves no workers after "
                             f"rank_offset {self.rank_offset}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"init payload backend '{self.backend}' is not 'gloo' or 'nccl'")
        check_transport(self.transport, "init payload transport")
        if not isinstance(self.session, str):
            raise ValueError(f"init payload field 'session' must be a string, got {self.session!r}")
        if self.destination is not None and not isinstance(self.destination, Mapping):
            raise ValueError("init payload field 'destination' must be an object (a traced "
                             f"layout) or null, got {type(self.destination).__name__}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"init payload timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def num_workers(self) -> int:
        return self.world_size - self.rank_offset

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "InitPayload":
        """Parse a payload dict.

        Raises:
            ValueError: not a dict, missing or unknown fields, bad values
                (names the field).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"init payload must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"init payload has unknown fields {unknown}; expected {sorted(names)}")
        optional = ("schema_version", "transport", "session", "destination")
        missing = sorted(n for n in names - set(data) if n not in optional)
        if missing:
            raise ValueError(f"init payload is missing fields {missing}")
        return cls(**dict(data))


@dataclass(frozen=True)
class GivenLayout:
    """A :class:`DestinationBuilder` that returns a layout the trainers traced (the payload's).

    Attributes:
        traced: the ``DestinationLayout`` (its ``spec`` and ``num_workers`` are the builder's).
    """

    traced: Any

    @property
    def spec(self) -> str:
        return self.traced.spec

    @property
    def num_workers(self) -> int:
        return self.traced.num_workers

    def __call__(self, metas: Any) -> Any:
        return self.traced


def session_destination(payload: "InitPayload", destination: DestinationBuilder,
                        where: str) -> DestinationBuilder:
    """The destination a worker plans ``payload`` with: the payload's traced layout, or its own.

    A worker whose own builder traces vLLM's loaders (``layout == "traced"``)
    takes the trainers' traced layout from ``payload.destination`` rather
    than tracing every worker's model itself (W traces per worker, W^2 in
    all); its own part is then checked against its own model by the caller
    (``m2nkit.engine.plugins.vllm``). Otherwise (tables, or no layout in the
    payload) its own builder, as before.

    Raises:
        ValueError: the payload's layout does not parse, or is for another
            spec or number of workers than ``destination`` (names ``where``
            and both).
    """
    from m2nkit.manifest.destination import layout_from_json

    if payload.destination is None or getattr(destination, "layout", None) != "traced":
        return destination
    layout = layout_from_json(dict(payload.destination))
    if (layout.spec, layout.num_workers) != (destination.spec, destination.num_workers):
        raise ValueError(f"{where}: init payload field 'destination' is a layout of "
                         f"{layout.spec} ({layout.num_workers} workers), but this worker serves "
                         f"{destination.spec} ({destination.num_workers} workers)")
    return GivenLayout(layout)


def plan_from_manifest(manifest: Mapping[str, Any],
                       destination: DestinationBuilder) -> tuple[Plan, str]:
    """Rebuild the plan from a manifest JSON and the destination layout builder.

    Returns ``(plan, manifest digest)``; both sides of a session call this,
    so the plan is a pure function of what they agree on.

    Raises:
        ValueError: a malformed manifest, a destination that is not a
            ``DestinationBuilder``, or wire tensors the destination cannot
            place (its own message).
    """
    from m2nkit.manifest.serialize import manifest_digest, manifest_from_json

    check_destination(destination, "destination")
    metas, num_trainer_ranks = manifest_from_json(dict(manifest))
    digest = manifest_digest(metas, num_trainer_ranks)
    dest = destination(metas)
    return build_plan(metas, num_trainer_ranks, dest, manifest_digest=digest), digest
