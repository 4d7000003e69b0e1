"""The frontend listener's filter of held-off sources (``gpud_broker.synfilter``), on real
loopback sockets: a held-off IPv4 address's SYNs are dropped by the kernel (but one in
``keep_one_in``), every other address's connections are accepted, and the filter comes off."""

from __future__ import annotations

import ipaddress
import socket

import pytest
import zmq

from gpud_broker import synfilter


def tcp_connects(port: int, source: str, timeout: float = 0.3, host: str = "127.0.0.1") -> bool:
    """Whether a bare TCP connection from ``source`` to ``host:port`` is accepted within
    ``timeout`` (under the first SYN retransmission, 1 s: one SYN per try)."""
    s = socket.socket()
    try:
        s.bind((source, 0))
        s.settimeout(timeout)
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _ip(text: str) -> int:
    return int(ipaddress.ip_address(text))


def test_a_held_off_address_is_dropped_at_the_listener_and_others_are_not() -> None:
    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        assert tcp_connects(port, "127.0.0.3")
        synfilter.attach(listener.fileno(), synfilter.program([_ip("127.0.0.3")], keep_one_in=1 << 32))
        assert not tcp_connects(port, "127.0.0.3")  # its SYN never answered
        assert tcp_connects(port, "127.0.0.1") and tcp_connects(port, "127.0.0.4")
        synfilter.attach(listener.fileno(), None)
        assert tcp_connects(port, "127.0.0.3")


def test_one_syn_in_keep_one_in_of_a_held_off_address_gets_through() -> None:
    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        listener.setblocking(False)
        synfilter.attach(listener.fileno(), synfilter.program([_ip("127.0.0.3"), _ip("127.0.0.5")], keep_one_in=2))
        got = sum(tcp_connects(port, "127.0.0.5", timeout=0.05) for _ in range(80))
        assert 15 <= got <= 65  # about half (binomial(80, 1/2): outside this once in 10^7)


def test_only_ipv4_sources_are_filtered_and_at_most_max_sources() -> None:
    many = [f"10.0.{i // 256}.{i % 256}" for i in range(synfilter.MAX_SOURCES + 10)]
    got = synfilter.ipv4_sources(["2001:db8::/64", "ipc", *many])
    assert len(got) == synfilter.MAX_SOURCES and got[-1] == _ip(many[-1])
    assert len(synfilter.program(got)) == 8 * (synfilter.MAX_SOURCES + 9)
    with pytest.raises(ValueError):
        synfilter.program(got + [1])


def test_the_listening_descriptor_of_a_zeromq_socket_is_found() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        fd = synfilter.listening_fd(port)
        assert fd is not None
        with socket.socket(fileno=fd) as sock:
            try:
                assert sock.getsockname()[1] == port and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            finally:
                sock.detach()
        assert synfilter.listening_fd(port + 1 if port < 65535 else port - 1) is None
        router.close(linger=0)
    finally:
        ctx.term()


def _through(listener: socket.socket, port: int, source: str) -> tuple[socket.socket, socket.socket]:
    """A connection from ``source`` that the listener's filter let all the way through: both its
    ends. The client's side may connect while the filter drops its last ACK (the server then
    never accepts it, its SYN-ACKs given up after their retries): such an attempt is given up
    after 0.5 s and another made; one that the server completes late is not taken for the new one."""
    listener.settimeout(0.5)
    for _ in range(100):
        client = None
        for _ in range(200):
            client = socket.socket()
            client.bind((source, 0))
            client.settimeout(0.05)
            try:
                client.connect(("127.0.0.1", port))
                break
            except OSError:
                client.close()
                client = None
        assert client is not None
        try:
            while True:
                accepted, peer = listener.accept()
                if peer == client.getsockname():
                    return client, accepted
                accepted.close()  # an earlier attempt's, completed late
        except TimeoutError:
            client.close()
    raise AssertionError(f"no connection from {source} got through the filter")


def test_a_connection_let_through_carries_the_listeners_filter_until_it_is_taken_off() -> None:
    """The kernel copies the listener's filter to each connection it accepts: one from a held-off
    address that got through would lose most of its segments, so the broker takes it off each
    connection it admits (``Broker._detach_filter``)."""
    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        assert not synfilter.attached(listener.fileno())
        synfilter.attach(listener.fileno(), synfilter.program([_ip("127.0.0.5")], keep_one_in=2))
        assert synfilter.attached(listener.fileno())
        client, accepted = _through(listener, port, "127.0.0.5")
        with client:
            with accepted:
                assert synfilter.attached(accepted.fileno())  # the listener's, shared
                synfilter.attach(accepted.fileno(), None)
                assert not synfilter.attached(accepted.fileno())
                assert synfilter.attached(listener.fileno())  # the listener keeps its own
                for i in range(200):  # nothing of the connection is dropped now
                    client.sendall(b"x")
                    accepted.settimeout(1.0)
                    assert accepted.recv(1) == b"x", i
