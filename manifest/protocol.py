"""The trainer/worker contracts, as abstract types the engine implements.

Three parties meet in a weight update: the trainer-side engine (one per
trainer rank, ``TrainerWeightTransferEngine``), the inference engine's
control plane as the trainer sees it (``VLLMWeightSyncClient``: four calls,
structural so that any HTTP/Ray/in-process wrapper fits without importing
m2nkit), and the worker-side engine that receives bytes
(``WeightTransferEngine``). The shapes follow vLLM
``vllm/distributed/weight_transfer/base.py``; this module holds only the
contracts, no transport, so that ``engine/`` can implement them and
``adapters/`` can name them without importing each other. vLLM itself is
not imported: a worker-side engine here receives whatever model object (or
m2nkit worker-local storage) it is given.

Round trip, driven by the sender (trainer rank 0) through the client:
``init_weight_transfer_engine(init_info)`` once, then per update
``start_weight_update()``, ``update_weights(update_info)`` (one or more
times, concurrently with the trainer-side send when the transport needs
it), ``finish_weight_update(weight_version)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from .source import WeightSource

__all__ = [
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferUpdateInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateRequest",
    "WeightTransferUpdatePayload",
]

WeightTransferUpdatePayload = dict[str, Any] | list[dict[str, Any]]
"""What ``update_weights`` takes: one update-info dict, or several in order."""


# --------------------------------------------------------------------------
# trainer side


@dataclass
class TrainerInitInfo:
    """Trainer-side init info: which trainer rank this process is.

    ``rank`` is keyword-only (backend subclasses add positional fields) and
    given explicitly by the caller: with several process groups (tp, pp, ep,
    dp) a global "current rank" is ambiguous. Rank 0 is the sender: only it
    drives the client's RPCs; every rank still runs the trainer-side
    collectives. Every subclass sets a class-level ``backend`` string (the
    key an engine factory dispatches on). Rules from vLLM
    ``weight_transfer/base.py`` (``TrainerInitInfo``).

    Raises:
        TypeError: a subclass without a non-empty ``backend`` string (at
            class creation); ``rank`` not an int (bools rejected).
        ValueError: ``rank`` negative.
    """

    backend: ClassVar[str]

    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend = getattr(cls, "backend", None)
        if not isinstance(backend, str) or not backend:
            raise TypeError(
                f"{cls.__name__} must set a class-level `backend` string "
                "(the key its engine is registered under), e.g. backend = 'torch_p2p'"
            )

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"{type(self).__name__}: rank must be an int, got {self.rank!r}")
        if self.rank < 0:
            raise ValueError(f"{type(self).__name__}: rank must be >= 0, got {self.rank}")

    @property
    def is_sender(self) -> bool:
        """True on trainer rank 0, the one rank that talks to the inference side."""
        return self.rank == 0


TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound=TrainerInitInfo)


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The inference side's weight-sync control plane, as the trainer calls it.

    Structural (PEP 544): anything with these four methods is a client, no
    import or subclassing needed (``isinstance`` checks method presence only).
    All calls are synchronous and take plain dicts; running ``update_weights``
    concurrently with the trainer-side send is the engine's job, not the
    client's. Rules from vLLM ``weight_transfer/base.py``
    (``VLLMWeightSyncClient``).
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    """Trainer-side engine, one per trainer rank.

    Built by ``trainer_init`` on every trainer rank; ``send_weights()`` then
    runs one full update round (``start_weight_update``, ``update_weights``
    with the send, ``finish_weight_update``) each RL step, on every rank.
    Only the sender (``is_sender``, trainer rank 0) calls the client; the
    other ranks take part in every collective so the group stays aligned.
    Rules from vLLM ``weight_transfer/base.py``
    (``TrainerWeightTransferEngine``).

    Attributes:
        init_info_cls: the backend's ``TrainerInitInfo`` subclass.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info: TTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> TrainerWeightTransferEngine:
        """Rendezvous with the inference side and return a ready engine.

        Called on every trainer rank; the sender also calls
        ``client.init_weight_transfer_engine``.
        """

    @abstractmethod
    def send_weights(self) -> None:
        """Run one full update round; called on every trainer rank."""

    def shutdown(self) -> None:
        """Release communicators and process groups. Default: nothing to release."""


# --------------------------------------------------------------------------
# worker side


@dataclass
class WeightTransferInitInfo:
    """Base of a backend's worker-side init info (a dataclass built from a dict)."""


@dataclass
class WeightTransferUpdateInfo:
    """Base of a backend's worker-side per-update info (a dataclass built from a dict)."""


TInitInfo = TypeVar("TInitInfo", bound=WeightTransferInitInfo)
TUpdateInfo = TypeVar("TUpdateInfo", bound=WeightTransferUpdateInfo)


@dataclass
class WeightTransferInitRequest:
    """API-level init request: the backend's init info as a plain dict.

    Raises:
        TypeError: ``init_info`` is not a mapping.
    """

    init_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.init_info, Mapping):
            raise TypeError(
                f"init_info must be a dict, got {type(self.init_info).__name__}"
            )


@dataclass
class WeightTransferUpdateRequest:
    """API-level update request: one update-info dict, or a list of them in order.

    Raises:
        TypeError: ``update_info`` is neither a mapping nor a list of mappings.
    """

    update_info: WeightTransferUpdatePayload = field(default_factory=dict)

    def __post_init__(self) -> None:
        u = self.update_info
        if isinstance(u, Mapping):
            return
        if isinstance(u, list) and all(isinstance(x, Mapping) for x in u):
            return
        raise TypeError(
            f"update_info must be a dict or a list of dicts, got {type(u).__name__}"
        )


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """Worker-side engine: receives weights into one inference worker.

    Lifecycle: ``init_transfer_engine(parse_init_info(d))`` once; per update
    ``start_weight_update()``, ``update_weights(d)`` (parses ``d`` and calls
    ``receive_weights``), ``finish_weight_update(weight_version)``, which is
    where a receiver commits the new version, only after every wire tensor of
    the round arrived. Rules from vLLM ``weight_transfer/base.py``
    (``WeightTransferEngine``); vLLM's ``finish_weight_update`` takes no
    version, m2nkit passes the client's ``weight_version`` through (optional).

    Attributes:
        init_info_cls, update_info_cls: the backend's dataclasses.
        defers_processing: True when ``update_weights`` may return before the
            weights are applied; callers that skip ``finish_weight_update``
            must then call ``drain_pending()``.
        model, model_config: the current update target (see
            ``set_weight_update_target``).
    """

    init_info_cls: ClassVar[type[WeightTransferInitInfo]]
    update_info_cls: ClassVar[type[WeightTransferUpdateInfo]]
    defers_processing: ClassVar[bool] = False

    def __init__(self, model: Any = None, *, model_config: Any = None,
                 device: Any = None) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self._default_target = (model, model_config)

    # -- parsing ----------------------------------------------------------

    def parse_init_info(self, init_dict: Mapping[str, Any]) -> TInitInfo:
        """``init_info_cls(**init_dict)``.

        Raises:
            ValueError: the dict does not fit the dataclass (unknown or
                missing keys, not a mapping), naming this engine class.
        """
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(
                f"invalid init_info for {type(self).__name__} "
                f"({self.init_info_cls.__name__}): {e}"
            ) from e

    def parse_update_info(self, update_dict: Mapping[str, Any]) -> TUpdateInfo:
        """``update_info_cls(**update_dict)``.

        Raises:
            ValueError: the dict does not fit the dataclass, naming this
                engine class.
        """
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(
                f"invalid update_info for {type(self).__name__} "
                f"({self.update_info_cls.__name__}): {e}"
            ) from e

    # -- lifecycle --------------------------------------------------------

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Join the transfer (communicators, buffers); called once."""

    @abstractmethod
    def start_weight_update(self) -> None:
        """Prepare for a new update round."""

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """Parse ``update_info`` (a dict, or a list of dicts in order) and receive each.

        Raises:
            ValueError: a dict does not fit ``update_info_cls``.
        """
        infos = update_info if isinstance(update_info, list) else [update_info]
        for info in infos:
            self.receive_weights(self.parse_update_info(info))

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        """Receive the weights ``update_info`` describes into the target."""

    @abstractmethod
    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the round; commit ``weight_version`` only if everything arrived."""

    def drain_pending(self) -> None:
        """Block until deferred updates are applied. Default: nothing is deferred."""

    def set_weight_update_target(self, model: Any, model_config: Any = None) -> None:
        """Send the next updates to ``model`` (a draft model, say)."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        """Send updates to the model given at construction again."""
        self.model, self.model_config = self._default_target

    @abstractmethod
    def shutdown(self) -> None:
        """Release communicators and buffers."""
