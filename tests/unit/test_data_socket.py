"""The worker's data socket admission table (PROTOCOL.md §10.3): capabilities, keys, ZAP."""

from __future__ import annotations

import zmq
import zmq.utils.z85

from gpud.security import CurveKeys
from gpud_worker.data import DATA_DOMAIN, DataSocket, advertised


def _keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret, None)


def _zap(key: bytes, domain: str = DATA_DOMAIN, mechanism: bytes = b"CURVE") -> list[bytes]:
    return [b"1.0", b"7", domain.encode(), b"127.0.0.1", b"", mechanism, key]


def test_capabilities_without_curve() -> None:
    d = DataSocket("tcp://127.0.0.1:*")
    try:
        a, b = d.offer(b"A" * 16, ""), d.offer(b"B" * 16, "")
        assert len(a["cap"]) == 16 and a["cap"] != b["cap"] and "key" not in a
        assert a["endpoint"].startswith("tcp://127.0.0.1:")
        assert d.admits(b"A" * 16, a["cap"], None)
        assert not d.admits(b"A" * 16, b["cap"], None)  # another session's capability
        assert not d.admits(b"A" * 16, None, None) and not d.admits(b"A" * 16, "x", None)
        assert not d.admits("A", a["cap"], None) and not d.admits(b"C" * 16, a["cap"], None)
        d.revoke(b"A" * 16)
        d.revoke(b"A" * 16)  # idempotent
        assert not d.admits(b"A" * 16, a["cap"], None)  # dead with its session
        assert d.admits(b"B" * 16, b["cap"], None)
    finally:
        d.close()


def test_curve_binds_each_session_to_its_key_and_zap_admits_only_granted_keys() -> None:
    worker, alice, alice2 = _keys(), _keys(), _keys()
    z_alice = alice.public.decode()
    d = DataSocket("tcp://127.0.0.1:*", curve=worker)
    try:
        raw_alice = zmq.utils.z85.decode(alice.public)
        raw_alice2 = zmq.utils.z85.decode(alice2.public)
        assert d._zap_reply(_zap(raw_alice))[2] == b"400"  # no session granted for it yet
        one = d.offer(b"A" * 16, z_alice)
        two = d.offer(b"B" * 16, z_alice)
        assert one["key"] == worker.public.decode()
        assert d._zap_reply(_zap(raw_alice))[2:5] == [b"200", b"OK", alice.public]
        assert d._zap_reply(_zap(raw_alice2))[2] == b"400"  # same tenant, other key
        assert d._zap_reply(_zap(raw_alice, domain="gpud-frontend"))[2] == b"400"
        assert d._zap_reply(_zap(raw_alice, mechanism=b"NULL"))[2] == b"400"
        assert d._zap_reply([b"1.0"])[2] == b"500"
        assert d.admits(b"A" * 16, one["cap"], z_alice)
        assert not d.admits(b"A" * 16, one["cap"], alice2.public.decode())  # the right cap, wrong key
        assert not d.admits(b"A" * 16, one["cap"], None)
        d.revoke(b"A" * 16)
        assert d._zap_reply(_zap(raw_alice))[2] == b"200"  # still granted for session B
        d.revoke(b"B" * 16)
        assert d._zap_reply(_zap(raw_alice))[2] == b"400"
        assert not d.admits(b"B" * 16, two["cap"], z_alice)
    finally:
        d.close()


def test_advertised_endpoint() -> None:
    import socket

    host = socket.gethostname()
    assert advertised("tcp://*:5557", "tcp://0.0.0.0:5557") == f"tcp://{host}:5557"
    assert advertised("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5557") == "tcp://10.0.0.5:5557"
