"""Routine events are logged at INFO, trouble at WARNING or above, and each only once."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import zmq

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.protocol import Command, Peer
from gpud.security import HandshakeLog, SecuritySettings
from gpud_broker.broker import Broker, Endpoints
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_standby.bstar import State
from gpud_standby.pair import routine_change


def levels(caplog: pytest.LogCaptureFixture, text: str) -> list[int]:
    return [r.levelno for r in caplog.records if text in r.getMessage()]


def test_a_client_that_closes_during_its_handshake_is_routine(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    hs = HandshakeLog("frontend", skip_auth=True)
    hs.event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104, "tcp://127.0.0.1:5555")
    hs.event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11000002, "tcp://127.0.0.1:5555")
    assert levels(caplog, "the connection ended during the handshake") == [logging.INFO]
    assert levels(caplog, "mechanism mismatch") == [logging.WARNING]


def test_a_clean_worker_stop_is_routine_a_lost_worker_is_not(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = FakeClock(1000.0)
    core = BrokerCore(BrokerConfig(), clock.monotonic(), lambda *_: None, lambda *_: None)
    for ident, name in ((b"c1", "w1"), (b"c2", "w2")):
        enc = P.encode(Peer.WORKER, Command.READY, {"name": name, "gpus": [], "slots": 8})
        core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2])
    enc = P.encode(Peer.WORKER, Command.DISCONNECT, {"reason": "stopping"})
    core.on_worker(b"c1", P.decode(enc, Peer.WORKER), enc[2])
    core.workers.lost(core.registry.by_name["w2"], "silent")
    assert levels(caplog, "w1 said goodbye") == [logging.INFO]
    assert levels(caplog, "w1 lost (disconnected)") == [logging.INFO]
    assert levels(caplog, "w2 lost (silent)") == [logging.WARNING]


def test_a_reload_that_changes_nothing_is_routine(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    broker = Broker(BrokerConfig(), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                    security=SecuritySettings(mode="none"))
    try:
        broker.reloader = BrokerConfig
        assert broker.reload()["changed"] == []
        broker.reloader = lambda: BrokerConfig(policy="spread")
        assert broker.reload()["changed"] == ["policy"]
    finally:
        broker.close()
    assert levels(caplog, "configuration re-read: applied no changes") == [logging.INFO]
    assert levels(caplog, "configuration re-read: applied policy") == [logging.WARNING]


def test_pair_states_of_a_normal_start_are_routine_failovers_are_not() -> None:
    assert routine_change(State.PRIMARY, State.ACTIVE) and routine_change(State.PRIMARY, State.PASSIVE)
    assert routine_change(State.BACKUP, State.PASSIVE)
    assert not routine_change(State.BACKUP, State.ACTIVE)  # at start, no active peer: it takes over
    assert not routine_change(State.PASSIVE, State.ACTIVE) and not routine_change(State.ACTIVE, State.PASSIVE)


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only")
def test_root_without_pool_users_is_said_once_naming_job_uids(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from gpud_worker.jobs import JobRunner, UserPool

    caplog.set_level(logging.INFO)
    JobRunner(tmp_path / "jobs", UserPool("gpud-no-such-pool-"))
    said = [r for r in caplog.records if "pool users" in r.getMessage() or "without job users" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "--job-uids" in said[0].getMessage() and "gpud-no-such-pool-*" in said[0].getMessage()
