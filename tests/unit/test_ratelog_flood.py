"""A real broker (security none, loopback TCP, in this process) under two floods at once: one
client sends bad messages up to its cut while another sprays bad messages from many fresh routing
ids (a new connection each). The spray fills the table of bad-message counts again and again; the
flooder's count must survive it, and its connection be closed at BAD_CUT."""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

from gpud import protocol
from gpud.protocol import Command, Peer
from gpud.ratelog import WindowCount
from gpud.security import SecuritySettings
from gpud_broker.broker import BAD_CUT, Broker, Endpoints
from gpud_broker.core import BrokerConfig

TABLE = 64  # sources the broker's count remembers here (MAX_SOURCES in service): the spray fills it often
FRESH_PER_ROUND = 16  # new routing ids between two rounds of the flooder: well under TABLE
FLOOD_PER_ROUND = 100


def _bad() -> list[bytes]:
    header = protocol.encode(Peer.CLIENT, Command.REQUEST, {})
    return [header[0], header[1], b"\xc1"]  # not msgpack: PROTOCOL


def _dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[bytes]:
    s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, os.urandom(protocol.ROUTING_ID_BYTES))
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    return s


def _read_until(broker: Broker, bad_messages: int, deadline: float) -> None:
    counters = broker.core.counters
    while counters["bad_messages"] < bad_messages and not counters["cut_connections"] and time.monotonic() < deadline:
        if broker.frontend.poll(200):
            broker._drain_clients(broker.frontend)
            broker._flush()


def test_a_flooder_is_cut_while_fresh_routing_ids_spray_the_count_table() -> None:
    broker = Broker(BrokerConfig(), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                    security=SecuritySettings(mode="none"))
    # A small table, so that a few thousand fresh ids fill it many times over; one endless
    # window, so that the flooder reaches its cut whatever the machine's load.
    broker._bad_count = WindowCount(float("inf"), time.monotonic, max_sources=TABLE)
    ctx: zmq.Context[Any] = zmq.Context()
    flooder = _dealer(ctx, broker.endpoints.frontend)
    monitor = flooder.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    counters = broker.core.counters
    deadline = time.monotonic() + 60
    fresh = 0
    try:
        for _ in range(2 * BAD_CUT // FLOOD_PER_ROUND):
            sprayers = [_dealer(ctx, broker.endpoints.frontend) for _ in range(FRESH_PER_ROUND)]
            for _ in range(FLOOD_PER_ROUND):
                flooder.send_multipart(_bad())
            for s in sprayers:
                s.send_multipart(_bad())
            fresh += len(sprayers)
            _read_until(broker, counters["bad_messages"] + FLOOD_PER_ROUND + FRESH_PER_ROUND, deadline)
            for s in sprayers:
                s.close(0)
            if counters["cut_connections"]:
                break
        assert counters["cut_connections"] == 1, (counters["bad_messages"], fresh)
        assert fresh >= 8 * TABLE  # the spray filled the table many times over before the cut
        assert monitor.poll(5000)  # the flooder's own connection was the one closed
    finally:
        flooder.disable_monitor()
        monitor.close(0)
        flooder.close(0)
        ctx.term()
        broker.close()
