"""The broker's cut of a flooder's connection (``broker._shut_down``) shuts down only the connection
that is still the flooder's: to the frontend's port and from the address its message came from."""

from __future__ import annotations

import socket

from gpud_broker.broker import _shut_down


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
