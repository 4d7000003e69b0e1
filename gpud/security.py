"""CURVE keys and who may connect: key files, socket setup, the broker's allow-lists and its ZAP
decision. Every component sets its sockets up through this module and nowhere else.

Keys are zmq.auth certificates: ``NAME.key`` holds the public key, ``NAME.key_secret`` both keys
(mode 0600). The broker admits, by ZAP domain:

- ``gpud-backend``: workers whose public key is a ``*.key`` file in ``worker_keys_dir``;
- ``gpud-frontend``: clients whose public key is a ``*.key`` file in ``client_keys_dir/TENANT/``;
  the tenant and the key are handed back as the ZAP User-Id ``TENANT KEY`` (KEY: the public key,
  Z85), which libzmq attaches to every message of that connection (``zmq.Frame.get("User-Id")``),
  so the broker knows each request's tenant, binds its reply to the key that sent it, and names
  that key for a direct session (``client_user``, ``protocol.parse_client_user``);
- ``gpud-admin`` (a TCP admin endpoint only): keys in ``keys_dir/admins/``;
- ``gpud-peer`` (the broker pair's link): the brokers' own public key (the pair shares its keys).

Everything else is refused with status 400, and the refusal is logged (key prefix, peer address).
``ZapHandler.decide`` is the whole policy and does no I/O on sockets; the broker's loop moves the
RFC 27 frames (``ZapHandler.handle``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.auth
import zmq.utils.z85

from gpud.config import SecurityConfig, for_role
from gpud.errors import ConfigError
from gpud.protocol import _TENANT_RE
from gpud.ratelog import RateLimit

log = logging.getLogger(__name__)

MODES = ("curve", "none")
DEFAULT_KEYS_DIR = "/etc/gpud/keys"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
FRONTEND_DOMAIN = "gpud-frontend"
BACKEND_DOMAIN = "gpud-backend"
ADMIN_DOMAIN = "gpud-admin"
PEER_DOMAIN = "gpud-peer"  # the broker pair's link: both brokers share one key pair
BROKER_KEY_NAME = "broker"
WORKER_KEY_NAME = "worker"
REFUSAL_LOG_INTERVAL_S = 60.0  # one WARNING per source address (or endpoint) and interval; the rest are counted
MAX_HELD_KEYS = 4096  # client keys held off at once, at most (then the oldest go first)
HANDSHAKE_IVL_MS = 5000  # a connection that has not finished its handshake by then is closed

_NAME_OK = _TENANT_RE  # key names and tenant directory names: 1-64 of [A-Za-z0-9._@-]

_SECRET_BANNER = """#   ****  Generated on {0} by gpud keygen  ****
#   ZeroMQ CURVE **Secret** Certificate
#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.

"""
_PUBLIC_BANNER = """#   ****  Generated on {0} by gpud keygen  ****
#   ZeroMQ CURVE Public Certificate
#   Give this file to the broker's operator (workers, clients) or to the peers (broker).

"""


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """One side's CURVE keys, Z85 text as bytes (40 characters each).

    ``server_public`` is the broker's public key: needed by clients and workers, unused by the
    broker itself.
    """

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    def __post_init__(self) -> None:
        for name in ("public", "secret", "server_public"):
            value = getattr(self, name)
            if value is None and name == "server_public":
                continue
            if not isinstance(value, bytes) or len(value) != 40:
                raise ConfigError(f"CurveKeys.{name} must be a 40-character Z85 key (bytes)")

    def __repr__(self) -> str:  # never print a secret key
        server = self.server_public[:8].decode() + "..." if self.server_public else None
        return f"CurveKeys(public={self.public[:8].decode()}..., server_public={server})"

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike[str],
                   server_key_file: str | os.PathLike[str] | None = None) -> CurveKeys:
        """Load our pair from a ``.key_secret`` file and, for a client or worker, the broker's
        public key from its ``.key`` file."""
        if server_key_file is not None and _holds_secret(server_key_file) and not _holds_secret(secret_key_file):
            raise ConfigError(f"the arguments are swapped: {secret_key_file} is a public key file and "
                              f"{server_key_file} a secret one; call from_files(SECRET_FILE, BROKER_PUBLIC_FILE)")
        public, secret = load_secret_key(secret_key_file)
        server = load_public_key(server_key_file) if server_key_file is not None else None
        return cls(public, secret, server)


def _holds_secret(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a readable certificate with a secret key in it."""
    try:
        return zmq.auth.load_certificate(os.fspath(path))[1] is not None
    except (OSError, ValueError):
        return False


def require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support; use a pyzmq wheel, or security none")


def keygen(directory: str | os.PathLike[str], name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new key pair as ``directory/name.key`` (public, 0644) and ``name.key_secret``
    (both keys, 0600; created with that mode, never readable by others in between).

    Returns (public file, secret file). Refuses to replace existing files unless ``overwrite``.
    """
    require_curve()
    if not _NAME_OK.match(name):
        raise ConfigError(f"key name {name!r} must be 1-64 of [A-Za-z0-9._@-]")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o755)
    public_file, secret_file = d / f"{name}.key", d / f"{name}.key_secret"
    if not overwrite:
        for f in (public_file, secret_file):
            if f.exists():
                raise ConfigError(f"{f} exists; remove it or use --force to replace the pair")
    public, secret = zmq.curve_keypair()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    _write_cert(secret_file, _SECRET_BANNER.format(now), public, secret, 0o600)
    _write_cert(public_file, _PUBLIC_BANNER.format(now), public, None, 0o644)
    return public_file, secret_file


def _write_cert(path: Path, banner: str, public: bytes, secret: bytes | None, mode: int) -> None:
    text = banner + "metadata\ncurve\n" + f'    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key in a certificate file (``.key`` or ``.key_secret``)."""
    try:
        public, _ = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cannot read a CURVE public key from {path}: {why}") from None
    if len(public) != 40:
        raise ConfigError(f"{path}: the public key is not a 40-character Z85 key")
    return public


def load_secret_key(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file, which nobody but its owner may read.

    What the file holds is checked first: a public ``.key`` file given in its place (arguments
    swapped) is named as such, not asked to be chmod-ed."""
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cannot read a CURVE key pair from {path}: {why}") from None
    if secret is None:
        raise ConfigError(f"{path} holds no secret key: it is a public key file (.key), "
                          "where the secret one (.key_secret) belongs")
    if len(secret) != 40 or len(public) != 40:
        raise ConfigError(f"{path}: the keys are not 40-character Z85 keys")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path}: a secret key file must not be accessible to others "
                          f"(mode {mode:04o}); run chmod 600 {path}")
    return public, secret


def key_prefix(key: bytes) -> str:
    """A short, loggable name for a key: the first 8 Z85 characters of the public key."""
    try:
        return (zmq.utils.z85.encode(key) if len(key) == 32 else key)[:8].decode("ascii", "replace")
    except (ValueError, UnicodeDecodeError):
        return key[:8].hex()


# --------------------------------------------------------------------------- sockets


def server_socket_options(sock: zmq.Socket[Any], secret: bytes, public: bytes, domain: str) -> None:
    """Make ``sock`` a CURVE server whose peers are checked by the ZAP handler under ``domain``.
    Call before bind."""
    require_curve()
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def client_socket_options(sock: zmq.Socket[Any], own_secret: bytes, own_public: bytes,
                          server_public: bytes) -> None:
    """Make ``sock`` a CURVE client of the server with public key ``server_public``. Call before
    connect."""
    require_curve()
    sock.setsockopt(zmq.CURVE_SECRETKEY, own_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, own_public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


def apply_client_keys(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    if keys.server_public is None:
        raise ConfigError("CURVE client keys need the broker's public key (server_public)")
    client_socket_options(sock, keys.secret, keys.public, keys.server_public)


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and TCP endpoints on a loopback address (or ``lo``)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme not in ("tcp", "ws", "wss"):
        return False
    host = rest.rpartition(";")[2]  # "source;destination" form: the bound side is the last
    host = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].partition("]")[0]
    host = host.partition("/")[0]
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", 0.0.0.0, interface names, host names


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """The security settings a broker or worker runs with (``[security]`` in ``gpud.config``,
    whose keys and flags have the same names).

    ``mode``: ``curve`` (encryption and authentication on every TCP socket) or ``none`` (nothing:
    daemons then bind loopback only unless ``allow_public_bind``). Empty paths are derived from
    ``keys_dir``: the daemon's own pair ``broker.key_secret`` or ``worker.key_secret``, the broker's
    public key ``broker.key``, the allow-lists ``workers/`` and ``clients/TENANT/`` (and
    ``admins/`` for a TCP admin endpoint).
    """

    mode: str = "curve"
    allow_public_bind: bool = False
    keys_dir: str = DEFAULT_KEYS_DIR
    secret_key_file: str = ""  # this daemon's pair
    public_key_file: str = ""  # broker: its public key, checked against its pair
    broker_public_key_file: str = ""  # worker: the broker's public key
    worker_keys_dir: str = ""  # broker: allowed workers' *.key
    client_keys_dir: str = ""  # broker: TENANT/*.key for each tenant

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"security mode {self.mode!r}: use one of {', '.join(MODES)}")

    @classmethod
    def from_config(cls, sec: SecurityConfig, role: str) -> SecuritySettings:
        """From ``gpud.config``'s [security] section, with the key paths a ``broker`` or
        ``worker`` uses (``gpud.config.for_role``)."""
        s = for_role(sec, role)
        return cls(mode=s.mode, allow_public_bind=s.allow_public_bind, keys_dir=s.keys_dir,
                   secret_key_file=s.secret_key_file, public_key_file=s.public_key_file,
                   broker_public_key_file=s.broker_public_key_file,
                   worker_keys_dir=s.worker_keys_dir, client_keys_dir=s.client_keys_dir)

    @property
    def curve(self) -> bool:
        return self.mode == "curve"

    def _file(self, value: str, default: str) -> Path:
        return Path(value) if value else Path(self.keys_dir) / default

    @property
    def admin_keys_dir(self) -> Path:
        return Path(self.keys_dir) / "admins"

    def own_keys(self, default_name: str, server_key_file: Path | None = None) -> CurveKeys:
        secret_file = self._file(self.secret_key_file, f"{default_name}.key_secret")
        if not secret_file.exists():
            raise ConfigError(
                f"security is 'curve' but the secret key {secret_file} does not exist: run "
                f"`gpud keygen --dir {secret_file.parent} --name {secret_file.name.removesuffix('.key_secret')}`"
                " (or choose the file with --secret-key-file), or pass --security none for an "
                "unauthenticated, loopback-only setup")
        keys = CurveKeys.from_files(secret_file, server_key_file)
        if self.public_key_file and Path(self.public_key_file).exists():
            public = load_public_key(self.public_key_file)
            if public != keys.public:
                raise ConfigError(f"{self.public_key_file} does not hold the public key of {secret_file}")
        return keys

    def broker_keys(self) -> CurveKeys:
        return self.own_keys(BROKER_KEY_NAME)

    def worker_keys(self) -> CurveKeys:
        server = self._file(self.broker_public_key_file, f"{BROKER_KEY_NAME}.key")
        if not server.exists():
            raise ConfigError(f"security is 'curve' but the broker's public key {server} does not exist: "
                              "copy the broker's broker.key there (or choose it with --broker-key)")
        return self.own_keys(WORKER_KEY_NAME, server)

    def keystore(self) -> KeyStore:
        return KeyStore(self._file(self.worker_keys_dir, "workers"), self._file(self.client_keys_dir, "clients"),
                        self.admin_keys_dir)


def security_flags(worker: bool) -> dict[str, str]:
    """[security] key -> the argparse dest of its flag (``add_security_arguments``), for
    ``gpud.config.flag_values``."""
    keys = ["keys_dir", "secret_key_file"] + (["broker_public_key_file"] if worker else [
        "public_key_file", "worker_keys_dir", "client_keys_dir", "allow_public_bind"])
    return {"mode": "security", **{k: k for k in keys}}


def add_security_arguments(p: argparse.ArgumentParser, worker: bool) -> None:
    """The [security] flags of ``gpud broker`` and ``gpud worker`` (None when not given: the
    configuration decides)."""
    g = p.add_argument_group("security ([security] in the configuration file)")
    g.add_argument("--security", choices=("curve", "none"), default=None,
                   help="curve (default): CURVE encryption and authentication on every TCP socket; "
                        + ("none: neither" if worker else "none: neither (loopback binds only, unless --allow-public-bind)"))
    g.add_argument("--keys-dir", default=None, help="where the keys are (default /etc/gpud/keys)")
    g.add_argument("--secret-key-file", "--key-file", dest="secret_key_file", default=None, metavar="PATH",
                   help=f"this daemon's key pair (default KEYS_DIR/{'worker' if worker else 'broker'}.key_secret)")
    if worker:
        g.add_argument("--broker-key", "--broker-public-key-file", dest="broker_public_key_file", default=None,
                       metavar="PATH", help="the broker's public key (default KEYS_DIR/broker.key)")
        return
    g.add_argument("--public-key-file", default=None, metavar="PATH",
                   help="the broker's public key, checked against its pair (default KEYS_DIR/broker.key)")
    g.add_argument("--worker-keys-dir", default=None, metavar="DIR",
                   help="public keys (*.key) of the workers allowed to register (default KEYS_DIR/workers)")
    g.add_argument("--client-keys-dir", default=None, metavar="DIR",
                   help="client public keys, TENANT/*.key, one directory per tenant (default KEYS_DIR/clients)")
    g.add_argument("--allow-public-bind", action="store_const", const=True, default=None,
                   help="with --security none, bind beyond loopback anyway (a warning is logged)")


def check_bind(endpoint: str, security: SecuritySettings, what: str) -> None:
    """Refuse a non-local bind without CURVE unless ``allow_public_bind`` (then warn)."""
    if security.curve or is_local_endpoint(endpoint):
        return
    if not security.allow_public_bind:
        raise ConfigError(f"security is 'none' (no encryption, no authentication): the {what} may only "
                          f"bind a loopback address, not {endpoint}; use CURVE, or allow_public_bind "
                          "(--allow-public-bind) if this network is trusted")
    log.warning("security none: the %s listens on %s without encryption or authentication "
                "(allow_public_bind is set)", what, endpoint)


# --------------------------------------------------------------------------- allow-lists


class KeyStore:
    """Allowed public keys (raw 32 bytes): workers by name, clients by tenant, admins by name.

    Re-read when a directory or a key file changes (its time or size), so adding a worker or a
    tenant needs no restart. A key listed twice with different
    meanings (two tenants) is refused altogether and logged.
    """

    def __init__(self, worker_dir: Path, client_dir: Path, admin_dir: Path | None = None) -> None:
        self.worker_dir = worker_dir
        self.client_dir = client_dir
        self.admin_dir = admin_dir
        self.workers: dict[bytes, str] = {}
        self.clients: dict[bytes, str] = {}
        self.admins: dict[bytes, str] = {}
        self._signature: tuple[Any, ...] | None = None

    def _stamp(self) -> tuple[Any, ...]:
        """The directories' times, and each key file's time and size: a file copied in with `cp`
        is created (the directory's time changes) and only then written (it does not)."""
        out: list[Any] = []
        dirs = [d for d in (self.worker_dir, self.client_dir, self.admin_dir) if d is not None]
        try:
            with os.scandir(self.client_dir) as it:
                dirs += [Path(e.path) for e in it if e.is_dir()]
        except OSError:
            pass
        for d in dirs:
            try:
                out.append((str(d), d.stat().st_mtime_ns, 0))
                with os.scandir(d) as it:
                    for e in it:
                        if e.name.endswith(".key") and e.is_file():
                            st = e.stat()
                            out.append((e.path, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((str(d), None, 0))
        return tuple(sorted(out, key=lambda x: x[0]))

    def refresh(self) -> bool:
        """Reload if any directory changed; True when it did."""
        stamp = self._stamp()
        if stamp == self._signature:
            return False
        self._signature = stamp
        self.load()
        return True

    def load(self) -> None:
        self.workers = self._read_dir(self.worker_dir, "worker")
        self.admins = self._read_dir(self.admin_dir, "admin") if self.admin_dir is not None else {}
        clients: dict[bytes, str] = {}
        doubled: set[bytes] = set()
        try:
            with os.scandir(self.client_dir) as it:
                tenants = sorted((e for e in it if e.is_dir()), key=lambda e: e.name)
        except FileNotFoundError:
            tenants = []
        except OSError as exc:
            log.error("cannot read the client keys directory %s: %s", self.client_dir, exc.strerror)
            tenants = []
        for entry in tenants:
            if not _NAME_OK.match(entry.name):
                log.error("client keys: %s is not a valid tenant name (1-64 of [A-Za-z0-9._@-]); ignored", entry.path)
                continue
            for key, _ in self._read_dir(Path(entry.path), f"client (tenant {entry.name})").items():
                if key in clients and clients[key] != entry.name:
                    doubled.add(key)
                clients[key] = entry.name
        for key in doubled:
            log.error("client key %s is listed under two tenants (%s and another); refused until fixed",
                      key_prefix(key), clients.pop(key))
        self.clients = clients
        log.info("allowed keys: %d worker(s), %d client(s) in %d tenant(s)%s",
                 len(self.workers), len(self.clients), len(set(self.clients.values())),
                 f", {len(self.admins)} admin(s)" if self.admins else "")

    @staticmethod
    def _read_dir(directory: Path, what: str) -> dict[bytes, str]:
        out: dict[bytes, str] = {}
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            return out
        except OSError as exc:
            log.error("cannot read the %s keys directory %s: %s", what, directory, exc.strerror)
            return out
        for name in names:
            if not name.endswith(".key"):
                continue
            try:
                z85 = load_public_key(directory / name)
                out[zmq.utils.z85.decode(z85)] = name.removesuffix(".key")
            except (ConfigError, ValueError) as exc:
                log.error("%s key file %s ignored: %s", what, directory / name, exc)
        return out


# --------------------------------------------------------------------------- ZAP


def client_user(tenant: str, key: bytes) -> str:
    """The ZAP User-Id of a client: its tenant and its public key (Z85), space-separated."""
    return f"{tenant} {zmq.utils.z85.encode(key).decode('ascii')}"


class SourceGate(Protocol):
    """Which sources are held off for refused handshakes (``gpud_broker.gate.ConnectionGate``)."""

    def is_held_off(self, address: str, now: float) -> bool: ...

    def handshake_refused(self, address: str, now: float) -> None: ...


class ZapHandler:
    """The broker's ZAP policy (RFC 27) over a ``KeyStore``. With a ``gate``, each refusal is
    counted against its source address; for a source held off for too many, the key directories
    are not re-read: its known keys are admitted, its unknown ones refused at the cost of a look-up.
    A client key held off (``hold_off``: its connection was closed for flooding the broker) is
    refused until its time is up."""

    def __init__(self, keys: KeyStore, clock: Callable[[], float] = time.monotonic,
                 log_interval: float = REFUSAL_LOG_INTERVAL_S, peer_key: bytes | None = None,
                 gate: SourceGate | None = None) -> None:
        self.keys = keys
        self.peer_key = peer_key  # raw 32 bytes: the broker pair's public key (PEER_DOMAIN)
        self.clock = clock
        self.gate = gate
        self._limit = RateLimit(log_interval, clock)
        self.refused = 0
        self.admitted = 0
        self.held_keys: dict[bytes, float] = {}  # client key (raw 32 bytes) -> refused until (oldest first)

    def hold_off(self, key: bytes, seconds: float) -> None:
        """Refuse client ``key``'s handshakes for ``seconds``."""
        held = self.held_keys
        held.pop(key, None)
        if len(held) >= MAX_HELD_KEYS:
            del held[next(iter(held))]
        held[key] = self.clock() + seconds

    def decide(self, domain: str, address: str, mechanism: str, credentials: list[bytes]) -> tuple[str, str, str]:
        """(status code, status text, user id) for one handshake. The user id of a client is its
        tenant and key (``client_user``); of a worker or admin, its key's file name."""
        key = credentials[0] if len(credentials) == 1 else b""
        if mechanism != "CURVE":
            return self._refuse(domain, address, key, "400", f"mechanism {mechanism or '?'} not allowed; CURVE required")
        if len(key) != 32:
            return self._refuse(domain, address, key, "400", "malformed CURVE credentials")
        if self.gate is None or not self.gate.is_held_off(address, self.clock()):
            self.keys.refresh()  # a source held off (its handshakes keep being refused) is judged by the keys as read
        if domain == FRONTEND_DOMAIN:
            if key in self.held_keys:
                if self.clock() < self.held_keys[key]:
                    return self._refuse(domain, address, key, "400", "client key held off: it flooded the broker")
                del self.held_keys[key]
            tenant = self.keys.clients.get(key)
            user = None if tenant is None else client_user(tenant, key)
            what = "client"
        elif domain == BACKEND_DOMAIN:
            user = self.keys.workers.get(key)
            what = "worker"
        elif domain == ADMIN_DOMAIN:
            user = self.keys.admins.get(key)
            what = "admin"
        elif domain == PEER_DOMAIN:
            user = "peer" if self.peer_key is not None and key == self.peer_key else None
            what = "peer broker"
        else:
            return self._refuse(domain, address, key, "400", "unknown ZAP domain")
        if user is None:
            return self._refuse(domain, address, key, "400", f"unknown {what} key")
        self.admitted += 1
        (log.info if what != "client" else log.debug)(
            "admitted %s key %s (%s) from %s", what, key_prefix(key), user, address)
        return "200", "OK", user

    def _refuse(self, domain: str, address: str, key: bytes, code: str, why: str) -> tuple[str, str, str]:
        self.refused += 1
        if self.gate is not None:
            self.gate.handshake_refused(address, self.clock())
        # Per source address, not per key: an outsider with a fresh key per handshake is one line.
        held = self._limit((domain, address))
        if held is not None:
            log.warning("refused a connection on %s from %s: %s (key %s)%s", domain or "-", address or "?",
                        why, key_prefix(key) if key else "-",
                        f"; {held} more refusal(s) of it since the last report" if held else "")
        return code, why, ""

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """An RFC 27 request in, its reply out (a REP socket must answer every request)."""
        if len(frames) < 6:
            log.error("malformed ZAP request (%d frames)", len(frames))
            return [ZAP_VERSION, frames[1] if len(frames) > 1 else b"", b"500", b"malformed request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        if version != ZAP_VERSION:
            return [ZAP_VERSION, request_id, b"500", b"unsupported ZAP version", b"", b""]
        code, text, user = self.decide(domain.decode("utf-8", "replace"), address.decode("utf-8", "replace"),
                                       mechanism.decode("ascii", "replace"), frames[6:])
        return [ZAP_VERSION, request_id, code.encode(), text.encode(), user.encode(), b""]


HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class HandshakeLog:
    """Logs the failed handshakes a socket monitor reports (rate-limited per endpoint and kind).

    ZAP refusals are logged by ``ZapHandler`` with the key; this catches what ZAP never sees: a
    peer without CURVE (mechanism mismatch) or with the wrong server key."""

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic,
                 interval: float = REFUSAL_LOG_INTERVAL_S, skip_auth: bool = True) -> None:
        self.what = what
        self.skip_auth = skip_auth
        self._limit = RateLimit(interval, clock)
        self.failures = 0

    def event(self, event: int, value: int, endpoint: str) -> None:
        if not event & HANDSHAKE_FAILURES:
            return
        if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if self.skip_auth:
                return
            why = f"our key was refused (ZAP status {value}): is its public key in the peer's allow-list?"
        elif event & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            why = f"the connection ended during the handshake ({os.strerror(value) if 0 < value < 4096 else value})"
        elif value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", 0x11000002):
            why = "security mechanism mismatch (one side uses CURVE, the other not)"
        else:
            why = f"protocol error {value:#x} (a wrong CURVE server key?)"
        self.failures += 1
        held = self._limit((endpoint, event, value))
        if held is not None:
            # A peer that closes before its handshake ends (a client that gave up, a port probe)
            # is routine; a mismatch or a protocol error is a misconfiguration.
            routine = bool(event & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            (log.info if routine else log.warning)("%s %s: a CURVE handshake failed: %s%s", self.what, endpoint, why,
                                                   f"; {held} more since the last report" if held else "")

    def drain(self, monitor: zmq.Socket[Any]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                msg = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = parse_monitor_message(msg)
            except Exception:  # a malformed monitor message is no reason to stop serving
                continue
            endpoint = ev["endpoint"]
            self.event(int(ev["event"]), int(ev["value"]),
                       endpoint.decode("utf-8", "replace") if isinstance(endpoint, bytes) else str(endpoint))
