"""gpud.security: key files, the allow-lists, the ZAP decision, bind checks. No sockets."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
import zmq.auth
import zmq.utils.z85

from gpud.clock import FakeClock
from gpud.config import SecurityConfig
from gpud.errors import ConfigError
from gpud.protocol import parse_client_user
from gpud.security import (
    ADMIN_DOMAIN,
    BACKEND_DOMAIN,
    FRONTEND_DOMAIN,
    PEER_DOMAIN,
    CurveKeys,
    KeyStore,
    SecuritySettings,
    ZapHandler,
    check_bind,
    client_user,
    is_local_endpoint,
    keygen,
    load_public_key,
    load_secret_key,
)


def raw(public_file: Path) -> bytes:
    return zmq.utils.z85.decode(load_public_key(public_file))


@pytest.fixture
def keys(tmp_path: Path) -> SimpleNamespace:
    """A broker's key directory: workers/w0.key, clients/alice/a1.key, clients/bob/b1.key, and
    keys that are in no list."""
    private = tmp_path / "private"
    k = SimpleNamespace(dir=tmp_path)
    for name, allow in (("w0", "workers"), ("a1", "clients/alice"), ("b1", "clients/bob"), ("adm", "admins"),
                        ("stranger", None)):
        public, _ = keygen(private, name)
        if allow:
            (tmp_path / allow).mkdir(parents=True, exist_ok=True)
            shutil.copy(public, tmp_path / allow / public.name)
        setattr(k, name, raw(public))
    k.store = KeyStore(tmp_path / "workers", tmp_path / "clients", tmp_path / "admins")
    k.clock = FakeClock(0.0)
    k.zap = ZapHandler(k.store, clock=k.clock.monotonic)
    return k


# ----------------------------------------------------------------------------- key files


def test_keygen_writes_a_zmq_certificate_pair_with_a_private_secret(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path / "k", "broker")
    assert (public.name, secret.name) == ("broker.key", "broker.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pub, sec = zmq.auth.load_certificate(str(secret))  # pyzmq reads them
    assert zmq.auth.load_certificate(str(public)) == (pub, None)
    assert sec is not None and zmq.curve_public(sec) == pub
    assert load_secret_key(secret) == (pub, sec)
    with pytest.raises(ConfigError, match="exists"):
        keygen(tmp_path / "k", "broker")
    assert keygen(tmp_path / "k", "broker", overwrite=True)[0] == public
    assert load_public_key(public) != pub
    with pytest.raises(ConfigError, match="key name"):
        keygen(tmp_path, "../evil")


def test_secret_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "w")
    os.chmod(secret, 0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret_key(secret)
    with pytest.raises(ConfigError, match="no secret key"):
        os.chmod(public, 0o600)
        load_secret_key(public)
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret_key(tmp_path / "missing.key_secret")


def test_curve_keys_never_show_the_secret(tmp_path: Path) -> None:
    _, secret = keygen(tmp_path, "c")
    server, _ = keygen(tmp_path, "broker")
    k = CurveKeys.from_files(secret, server)
    assert k.secret.decode() not in repr(k) and k.server_public == load_public_key(server)
    with pytest.raises(ConfigError):
        CurveKeys(b"short", k.secret)


def test_settings_from_the_config_section(tmp_path: Path) -> None:
    d = str(tmp_path)
    sec = SecurityConfig(keys_dir=d)  # every key path left empty: each daemon's own names in keys_dir
    keygen(tmp_path, "broker")
    keygen(tmp_path, "worker")
    broker = SecuritySettings.from_config(sec, "broker")
    assert broker.broker_keys().public == load_public_key(tmp_path / "broker.key")
    assert (broker.secret_key_file, broker.public_key_file) == (f"{d}/broker.key_secret", f"{d}/broker.key")
    worker = SecuritySettings.from_config(sec, "worker")  # the broker's pair is not the worker's
    assert (worker.secret_key_file, worker.public_key_file) == (f"{d}/worker.key_secret", f"{d}/worker.key")
    assert worker.broker_public_key_file == f"{d}/broker.key"
    wk = worker.worker_keys()
    assert wk.public == load_public_key(tmp_path / "worker.key")
    assert wk.server_public == load_public_key(tmp_path / "broker.key")
    with pytest.raises(ConfigError, match="gpud keygen"):
        SecuritySettings(keys_dir=str(tmp_path / "none")).broker_keys()
    with pytest.raises(ConfigError, match="security mode"):
        SecuritySettings(mode="tls")


# ----------------------------------------------------------------------------- ZAP decision


def test_workers_are_admitted_on_the_backend_only_from_the_allow_list(keys: SimpleNamespace) -> None:
    assert keys.zap.decide(BACKEND_DOMAIN, "10.0.0.5", "CURVE", [keys.w0]) == ("200", "OK", "w0")
    for k in (keys.stranger, keys.a1):  # unknown, or a client's key
        status, _, user = keys.zap.decide(BACKEND_DOMAIN, "10.0.0.5", "CURVE", [k])
        assert (status, user) == ("400", "")


def test_clients_are_admitted_on_the_frontend_with_their_tenant(keys: SimpleNamespace) -> None:
    # A client's User-Id is its tenant and its key: the broker binds replies to the key.
    assert keys.zap.decide(FRONTEND_DOMAIN, "10.0.0.9", "CURVE", [keys.a1]) == ("200", "OK", client_user("alice", keys.a1))
    assert keys.zap.decide(FRONTEND_DOMAIN, "10.0.0.9", "CURVE", [keys.b1]) == ("200", "OK", client_user("bob", keys.b1))
    assert parse_client_user(client_user("alice", keys.a1)) == ("alice", client_user("alice", keys.a1))
    assert client_user("alice", keys.a1) != client_user("alice", keys.b1)
    for k in (keys.stranger, keys.w0):
        assert keys.zap.decide(FRONTEND_DOMAIN, "10.0.0.9", "CURVE", [k])[0] == "400"
    assert keys.zap.decide(ADMIN_DOMAIN, "10.0.0.9", "CURVE", [keys.adm]) == ("200", "OK", "adm")
    assert keys.zap.decide(ADMIN_DOMAIN, "10.0.0.9", "CURVE", [keys.a1])[0] == "400"
    assert keys.zap.decide(PEER_DOMAIN, "10.0.0.2", "CURVE", [keys.w0])[0] == "400"  # no peer key given
    keys.zap.peer_key = keys.stranger
    assert keys.zap.decide(PEER_DOMAIN, "10.0.0.2", "CURVE", [keys.stranger]) == ("200", "OK", "peer")
    assert keys.zap.decide(PEER_DOMAIN, "10.0.0.2", "CURVE", [keys.w0])[0] == "400"


@pytest.mark.parametrize("domain, mechanism, credentials", [
    (FRONTEND_DOMAIN, "NULL", []),
    (FRONTEND_DOMAIN, "PLAIN", [b"alice", b"secret"]),
    (FRONTEND_DOMAIN, "CURVE", [b"x" * 31]),
    (FRONTEND_DOMAIN, "CURVE", []),
    ("", "CURVE", ["A1"]),
    ("other", "CURVE", ["A1"]),
])
def test_everything_else_is_refused(keys: SimpleNamespace, domain: str, mechanism: str, credentials: list) -> None:  # type: ignore[type-arg]
    creds = [keys.a1 if c == "A1" else c for c in credentials]
    status, text, user = keys.zap.decide(domain, "1.2.3.4", mechanism, creds)
    assert (status, user) == ("400", "") and text


def test_refusals_are_logged_with_key_prefix_and_address_rate_limited(keys: SimpleNamespace,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gpud.security")
    prefix = zmq.utils.z85.encode(keys.stranger)[:8].decode()
    for _ in range(5):  # a refused peer reconnects every 100 ms: one line, then a count
        keys.zap.decide(BACKEND_DOMAIN, "192.0.2.7", "CURVE", [keys.stranger])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and prefix in lines[0] and "192.0.2.7" in lines[0] and "unknown worker key" in lines[0]
    keys.clock.advance(61.0)
    keys.zap.decide(BACKEND_DOMAIN, "192.0.2.7", "CURVE", [keys.stranger])
    assert "4 more refusal(s)" in caplog.records[-1].getMessage()
    assert keys.zap.refused == 6


def test_a_fresh_key_per_handshake_is_one_line_per_address(keys: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gpud.security")
    for _ in range(200):
        keys.zap.decide(FRONTEND_DOMAIN, "198.51.100.9", "CURVE", [zmq.utils.z85.decode(zmq.curve_keypair()[0])])
    keys.zap.decide(FRONTEND_DOMAIN, "198.51.100.10", "CURVE", [keys.stranger])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "198.51.100.9" in lines[0] and "198.51.100.10" in lines[1]


def test_new_keys_are_picked_up_without_restart(keys: SimpleNamespace) -> None:
    assert keys.zap.decide(FRONTEND_DOMAIN, "h", "CURVE", [keys.stranger])[0] == "400"
    (keys.dir / "clients" / "carol").mkdir()
    shutil.copy(keys.dir / "private" / "stranger.key", keys.dir / "clients" / "carol" / "stranger.key")
    assert keys.zap.decide(FRONTEND_DOMAIN, "h", "CURVE", [keys.stranger]) == ("200", "OK", client_user("carol", keys.stranger))
    (keys.dir / "workers" / "w0.key").unlink()
    assert keys.zap.decide(BACKEND_DOMAIN, "h", "CURVE", [keys.w0])[0] == "400"


def test_a_key_under_two_tenants_is_refused(keys: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    shutil.copy(keys.dir / "clients" / "alice" / "a1.key", keys.dir / "clients" / "bob" / "a1.key")
    assert keys.zap.decide(FRONTEND_DOMAIN, "h", "CURVE", [keys.a1])[0] == "400"
    assert "two tenants" in caplog.text
    (keys.dir / "clients" / "bad name").mkdir()
    (keys.dir / "clients" / "alice" / "junk.key").write_text("not a certificate")
    keys.store.load()  # bad entries are logged and skipped, the rest stands
    assert keys.store.clients[keys.b1] == "bob"
    assert "not a valid tenant name" in caplog.text and "junk.key" in caplog.text


def test_handle_speaks_rfc27(keys: SimpleNamespace) -> None:
    req = [b"1.0", b"7", FRONTEND_DOMAIN.encode(), b"127.0.0.1", b"", b"CURVE", keys.a1]
    assert keys.zap.handle(req) == [b"1.0", b"7", b"200", b"OK", client_user("alice", keys.a1).encode(), b""]
    assert keys.zap.handle([b"2.0", *req[1:]])[2] == b"500"
    assert keys.zap.handle([b"1.0", b"8"])[:3] == [b"1.0", b"8", b"500"]
    assert keys.zap.handle([])[2] == b"500"


# ----------------------------------------------------------------------------- binds without CURVE


@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.1:*", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://lo:5555", True), ("ipc:///run/gpud/a.sock", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.1.2.3:5555", False),
    ("tcp://eth0:5555", False), ("tcp://[::]:5555", False), ("tcp://gpud.example:1", False), ("5555", False),
])
def test_local_endpoints(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local


def test_security_none_binds_loopback_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    none = SecuritySettings(mode="none")
    check_bind("tcp://127.0.0.1:*", none, "frontend")
    with pytest.raises(ConfigError, match="allow_public_bind"):
        check_bind("tcp://0.0.0.0:5555", none, "frontend")
    check_bind("tcp://0.0.0.0:5555", SecuritySettings(mode="none", allow_public_bind=True), "frontend")
    assert "without encryption" in caplog.text
    check_bind("tcp://0.0.0.0:5555", SecuritySettings(mode="curve"), "frontend")  # CURVE: anywhere


def test_a_key_file_copied_while_the_store_reads_it_is_still_learned(keys: SimpleNamespace) -> None:
    """`cp` creates the file, then writes it. A handshake that makes the store re-read in between
    sees an empty file; the directory's time does not change when the content is written, so the
    store must notice the file itself changing."""
    store = keys.store
    store.refresh()
    public, _ = keygen(keys.dir / "private", "c2")
    target = keys.dir / "clients" / "alice" / public.name
    target.touch()  # created, not yet written
    store.refresh()  # e.g. another client's handshake, now
    assert raw(public) not in store.clients
    os.utime(keys.dir / "clients" / "alice", ns=(0, 0))  # the directory keeps whatever time it had
    stamp = store._stamp()
    shutil.copyfile(public, target)  # now the content
    os.utime(keys.dir / "clients" / "alice", ns=(0, 0))
    assert store._stamp() != stamp
    assert store.refresh()
    assert store.clients.get(raw(public)) == "alice"


def test_swapped_key_files_are_named_as_swapped_before_any_mode_is_checked(tmp_path: Path) -> None:
    _, secret = keygen(tmp_path, "c")
    server, _ = keygen(tmp_path, "broker")
    assert stat.S_IMODE(os.stat(server).st_mode) == 0o644  # a public key file's normal mode
    with pytest.raises(ConfigError) as info:
        CurveKeys.from_files(server, secret)
    assert "swapped" in str(info.value) and "chmod" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # a public key alone where the secret one belongs
        CurveKeys.from_files(server)
    assert "no secret key" in str(info.value) and "chmod" not in str(info.value)
