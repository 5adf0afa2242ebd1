"""vLLM's parallel state for one worker without processes: sizes and ranks only.

vLLM's model classes and weight loaders read the tensor-, data- and
expert-parallel groups of ``vllm.distributed.parallel_state`` while they
build a worker's parameters and narrow checkpoint tensors to it. To build
a worker's model outside a vLLM server (the traced layout,
``adapters/vllm/trace.py``; the CPU workers of the demo and the tests,
``engine/tools/vllm_workers.py``) those globals are set to stand-ins that
answer sizes and ranks and nothing else: any collective on them fails.
vLLM is imported only when :meth:`StandInGroups.install` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StandInGroups"]


class _StandInProcessGroup:
    """Answers ``size()`` and ``rank()``; any collective on it fails (no such method)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _StandInCoordinator:
    """What model construction and the weight loaders read of a ``GroupCoordinator``."""

    def __init__(self, name: str, size: int, rank: int) -> None:
        self.unique_name = name
        self.world_size = size
        self.rank_in_group = rank
        self.rank = rank
        self.local_rank = rank
        self.ranks = list(range(size))
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.device_group = self.cpu_group = _StandInProcessGroup(size, rank)
        self.device_communicator = None
        self.use_device_communicator = False
        self.mq_broadcaster = None


@dataclass(frozen=True)
class StandInGroups:
    """vLLM's parallel state for one worker, without processes: sizes and ranks only.

    Sets the group globals of ``vllm.distributed.parallel_state`` the model
    classes and weight loaders read (``_WORLD``, ``_TP``, ``_ETP``, ``_PP``,
    ``_DP``, ``_PCP``, ``_DCP``, ``_EP``) for worker ``dp_index * tp +
    tp_rank``. The EP group spans ``dp * tp`` when ``ep`` is on, as vLLM's
    ``ep_size = dp * pcp * tp`` (``vllm/distributed/parallel_state.py``,
    ``initialize_model_parallel``). One worker per process at a time: the
    globals are the process's.
    """

    tp: int
    tp_rank: int
    dp: int = 1
    dp_index: int = 0
    ep: bool = False

    def install(self) -> None:
        import vllm.distributed.parallel_state as ps

        worker = self.dp_index * self.tp + self.tp_rank
        ps._WORLD = _StandInCoordinator("world", self.dp * self.tp, worker)
        ps._TP = _StandInCoordinator("tp", self.tp, self.tp_rank)
        ps._ETP = ps._TP
        ps._PP = _StandInCoordinator("pp", 1, 0)
        ps._DP = _StandInCoordinator("dp", self.dp, self.dp_index)
        ps._PCP = _StandInCoordinator("pcp", 1, 0)
        ps._DCP = _StandInCoordinator("dcp", 1, 0)
        ps._EP = (_StandInCoordinator("ep", self.dp * self.tp, worker) if self.ep
                  else _StandInCoordinator("ep", 1, 0))
