"""Every transport has the one shape (``engine/transports/base.py``) and is named once.

The trainer engine, the receiver, the payload check and the planner reach
transports only through ``engine/transports/registry.py``; these tests hold
each registered class to the ``Transport`` members they use, so a new
transport that forgets one fails here, not in a session.
"""

from __future__ import annotations

import inspect

import pytest

from m2nkit.engine.plan import build_plan
from m2nkit.engine.transports.base import Transport
from m2nkit.engine.transports.ipc import IpcTransport
from m2nkit.engine.transports.nccl_m2n import NcclM2NTransport
from m2nkit.engine.transports.nccl_m2n_rules import can_carry
from m2nkit.engine.transports.registry import (TRANSPORT_RULES, TRANSPORTS, check_transport,
                                               open_transport)
from m2nkit.engine.transports.torch_p2p import TorchP2PTransport

MEMBERS = ("why_unavailable", "check_source", "connect", "send_round", "recv_round", "close")


def test_the_registry_names_every_transport_once_default_first():
    assert list(TRANSPORTS) == ["torch_p2p", "nccl_m2n", "ipc"]
    assert TRANSPORTS["torch_p2p"] is TorchP2PTransport
    assert TRANSPORTS["nccl_m2n"] is NcclM2NTransport
    assert TRANSPORTS["ipc"] is IpcTransport
    assert all(t.name == name for name, t in TRANSPORTS.items())


@pytest.mark.parametrize("name", list(TRANSPORTS))
def test_each_transport_has_the_protocols_members(name):
    t = TRANSPORTS[name]
    for member in MEMBERS:
        assert callable(getattr(t, member, None)), (name, member)
    assert t.can_carry is None or callable(t.can_carry)
    proto = {m: list(inspect.signature(getattr(Transport, m)).parameters) for m in MEMBERS}
    for member in ("send_round", "recv_round"):
        assert list(inspect.signature(getattr(t, member)).parameters)[:4] == proto[member][:4]
    assert {"device", "timeout_s", "bucket_bytes"} <= set(inspect.signature(t.connect).parameters)


def test_the_planner_asks_the_transports_with_rules():
    assert TRANSPORT_RULES == {"nccl_m2n": can_carry}
    assert TorchP2PTransport.can_carry is None          # carries anything: no verdict
    with pytest.raises(ValueError, match=r"transport 'torch_p2p' has no rules; known: \['nccl_m2n'\]"):
        build_plan([], 1, None, transports=("torch_p2p",))


def test_check_transport_names_the_valid_ones():
    assert check_transport("torch_p2p", "transport") == "torch_p2p"
    assert check_transport("ipc", "transport") == "ipc"
    with pytest.raises(ValueError, match=r"transport 'shm' is not one of "
                                         r"\['torch_p2p', 'nccl_m2n', 'ipc'\]"):
        check_transport("shm", "transport")


def test_torch_p2p_opens_without_a_collective_and_keeps_its_bytes_until_close():
    t = open_transport("torch_p2p", None, object(), 0, 2, device="cpu", timeout_s=5,
                       bucket_bytes=1 << 10)
    assert isinstance(t, TorchP2PTransport) and t.bucket_bytes == 1 << 10
    t._pool.reserve(64)
    assert t._pool.nbytes == 64
    t.close()
    assert t._pool.nbytes == 0


def test_nccl_m2n_refuses_a_source_with_collectives_and_accepts_others():
    class Streams:
        collectives_while_iterating = True

    with pytest.raises(ValueError, match="trainer rank 1: this source runs collectives"):
        NcclM2NTransport.check_source(Streams(), 1)
    NcclM2NTransport.check_source(object(), 1)
    TorchP2PTransport.check_source(Streams(), 1)
