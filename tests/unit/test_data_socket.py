"""The worker's data socket admission table (PROTOCOL.md §10.3): capabilities, keys, ZAP, and the
sockets of the sessions themselves."""

from __future__ import annotations

import pytest
import zmq
import zmq.utils.z85

from gpud.errors import GpudError
from gpud.security import CurveKeys
from gpud_worker.data import DATA_DOMAIN, DataSocket, advertised, parse_ports, session_domain


def _keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret, None)


def _zap(key: bytes, domain: str = DATA_DOMAIN, mechanism: bytes = b"CURVE") -> list[bytes]:
    return [b"1.0", b"7", domain.encode(), b"127.0.0.1", b"", mechanism, key]


def test_capabilities_without_curve() -> None:
    d = DataSocket("tcp://127.0.0.1:*")
    (sa, a), (sb, b) = d.open_session(b"A" * 16, ""), d.open_session(b"B" * 16, "", relay=False)
    try:
        assert len(a["cap"]) == 16 and a["cap"] != b["cap"] and "key" not in a
        # Each session has an endpoint of its own; PINGs go to the data socket.
        assert a["endpoint"].startswith("tcp://127.0.0.1:") and a["endpoint"] == sa.endpoint
        assert len({a["endpoint"], b["endpoint"], d.endpoint}) == 3 and a["ping"] == b["ping"] == d.endpoint
        assert "relay" not in a and b["relay"] is False
        assert d.admits(b"A" * 16, a["cap"], None)
        assert not d.admits(b"A" * 16, b["cap"], None)  # another session's capability
        assert not d.admits(b"A" * 16, None, None) and not d.admits(b"A" * 16, "x", None)
        assert not d.admits("A", a["cap"], None) and not d.admits(b"C" * 16, a["cap"], None)
        d.revoke(b"A" * 16)
        d.revoke(b"A" * 16)  # idempotent
        assert not d.admits(b"A" * 16, a["cap"], None)  # dead with its session
        assert d.admits(b"B" * 16, b["cap"], None)
    finally:
        sa.close()
        sb.close()
        sb.close()  # idempotent
        assert d.open_sockets == 0
        d.close()


def test_curve_binds_each_session_to_its_key_and_zap_admits_only_granted_keys() -> None:
    worker, alice, alice2 = _keys(), _keys(), _keys()
    z_alice = alice.public.decode()
    d = DataSocket("tcp://127.0.0.1:*", curve=worker)
    try:
        raw_alice = zmq.utils.z85.decode(alice.public)
        raw_alice2 = zmq.utils.z85.decode(alice2.public)
        assert d._zap_reply(_zap(raw_alice))[2] == b"400"  # no session granted for it yet
        s1, one = d.open_session(b"A" * 16, z_alice)
        s2, two = d.open_session(b"B" * 16, z_alice)
        assert one["key"] == worker.public.decode()
        assert d._zap_reply(_zap(raw_alice))[2:5] == [b"200", b"OK", alice.public]
        assert d._zap_reply(_zap(raw_alice2))[2] == b"400"  # same tenant, other key
        assert d._zap_reply(_zap(raw_alice, domain="gpud-frontend"))[2] == b"400"
        assert d._zap_reply(_zap(raw_alice, mechanism=b"NULL"))[2] == b"400"
        assert d._zap_reply([b"1.0"])[2] == b"500"
        # A session's own socket admits the key of that session alone.
        assert d._zap_reply(_zap(raw_alice, domain=session_domain(b"A" * 16)))[2] == b"200"
        assert d._zap_reply(_zap(raw_alice2, domain=session_domain(b"A" * 16)))[2] == b"400"
        assert d._zap_reply(_zap(raw_alice, domain=session_domain(b"C" * 16)))[2] == b"400"  # no such session
        for junk in ("gpud-data/zz", "gpud-data/", f"gpud-data/{'ab' * 17}"):
            assert d._zap_reply(_zap(raw_alice, domain=junk))[2] == b"400"
        assert d.admits(b"A" * 16, one["cap"], z_alice)
        assert not d.admits(b"A" * 16, one["cap"], alice2.public.decode())  # the right cap, wrong key
        assert not d.admits(b"A" * 16, one["cap"], None)
        d.revoke(b"A" * 16)
        assert d._zap_reply(_zap(raw_alice))[2] == b"200"  # still granted for session B
        assert d._zap_reply(_zap(raw_alice, domain=session_domain(b"A" * 16)))[2] == b"400"  # not for A
        d.revoke(b"B" * 16)
        assert d._zap_reply(_zap(raw_alice))[2] == b"400"
        assert not d.admits(b"B" * 16, two["cap"], z_alice)
        s1.close()
        s2.close()
    finally:
        d.close()


def test_advertised_endpoint() -> None:
    import socket

    host = socket.gethostname()
    assert advertised("tcp://*:5557", "tcp://0.0.0.0:5557") == f"tcp://{host}:5557"
    assert advertised("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5557") == "tcp://10.0.0.5:5557"


def test_session_sockets_bind_in_data_ports() -> None:
    assert parse_ports("") is None and parse_ports("5560-5659") == (5560, 5660) and parse_ports("7000") == (7000, 7001)
    for bad in ("x-y", "0-10", "10-5", "5-70000"):
        with pytest.raises(GpudError):
            parse_ports(bad)
    d = DataSocket("tcp://127.0.0.1:*")
    probe = d.open_session(b"P" * 16, "")[0]  # a free port to build a range of two around
    port = int(probe.endpoint.rsplit(":", 1)[1])
    probe.close()
    d.close()
    d = DataSocket("tcp://127.0.0.1:*", ports=f"{port}-{port}")
    try:
        one, offer = d.open_session(b"A" * 16, "")
        assert offer["endpoint"] == f"tcp://127.0.0.1:{port}"
        with pytest.raises(GpudError, match="no port free"):
            d.open_session(b"B" * 16, "")
        assert not d.admits(b"B" * 16, b"", None) and d.open_sockets == 1
        one.close()
    finally:
        d.close()
