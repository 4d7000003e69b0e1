"""The broker's bad client messages: the cut of a flooder's connection (``broker._shut_down``) shuts
down only the connection that is still the flooder's, to the frontend's port and from the address
its message came from; and a malformed message is decoded once on its way to its ERROR."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import zmq

from gpud import protocol
from gpud.protocol import Command, Peer
from gpud.security import SecuritySettings
from gpud_broker.broker import Broker, Endpoints, _shut_down
from gpud_broker.core import BrokerConfig


def _pair() -> tuple[socket.socket, socket.socket, socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    return listener, client, accepted, port


def _is_open(client: socket.socket, accepted: socket.socket) -> bool:
    client.sendall(b"x")
    accepted.settimeout(2)
    try:
        return accepted.recv(1) == b"x"
    except OSError:
        return False


def test_a_connection_from_another_address_than_the_messages_is_left_alone() -> None:
    listener, client, accepted, port = _pair()
    with listener, client, accepted:
        assert _shut_down(accepted.fileno(), port, "10.1.2.3") is None  # the descriptor was reused
        assert _is_open(client, accepted)
        assert _shut_down(accepted.fileno(), port + 1 if port < 65535 else port - 1, "127.0.0.1") is None
        assert _is_open(client, accepted)
        assert _shut_down(accepted.fileno(), port, "127.0.0.1") == "127.0.0.1"
        client.settimeout(2)
        assert client.recv(1) == b""  # the flooder's own connection: shut down, end of stream
        assert accepted.fileno() >= 0  # and the descriptor is still its owner's to close


def test_a_malformed_message_with_a_payload_is_decoded_once_and_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    real = protocol.decode

    def counted(frames: list[Any], *args: Any, **kwargs: Any) -> protocol.Message:
        decoded.append(len(frames))
        return real(frames, *args, **kwargs)

    monkeypatch.setattr(protocol, "decode", counted)
    broker = Broker(BrokerConfig(), Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                    security=SecuritySettings(mode="none"))
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    try:
        client.setsockopt(zmq.ROUTING_ID, os.urandom(protocol.ROUTING_ID_BYTES))
        client.connect(broker.endpoints.frontend)
        good = protocol.encode(Peer.CLIENT, Command.REQUEST, {"id": protocol.new_id(), "kind": "echo"})
        client.send_multipart([good[0], good[1], b"\xc1", b"payload"])  # a payload: through the echo share
        assert broker.frontend.poll(5000)
        assert broker._drain_clients(broker.frontend) == 1
        broker._flush()
        assert decoded == [4]  # once, not again in its handler
        assert client.poll(5000)
        reply = client.recv_multipart()
        assert reply[1] == protocol.CMD_BYTES[Command.ERROR]
    finally:
        client.close(0)
        ctx.term()
        broker.close()
