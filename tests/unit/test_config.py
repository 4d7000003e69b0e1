"""gpud.config: file, environment and flags into frozen dataclasses; refusals name key and origin."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpud import config
from gpud.config import GpudConfig, TenantLimits, for_role, load
from gpud.errors import ConfigError
from gpud_broker.policies import FACTORIES, POLICIES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "systemd" / "gpud.toml.example"
GPUD = [sys.executable, "-m", "gpud_cli"]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    return str(path)


def refused(path: str | None, env: dict[str, str] | None = None, **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, env or {}, **kw)  # type: ignore[arg-type]
    return str(info.value)


# --------------------------------------------------------------------------- layers


def test_defaults_without_a_file(tmp_path: Path) -> None:
    cfg = load(None, {}, default_path=str(tmp_path / "absent.toml"))
    assert cfg.path == ""
    assert cfg.broker == config.BrokerSection() and cfg.worker == config.WorkerSection()
    assert cfg.broker.policy == "fgd-balanced" and cfg.broker.heartbeat_ms == 1000 and cfg.broker.tenants == {}
    assert cfg.worker.brokers == ("tcp://127.0.0.1:5556",)
    assert cfg.security.mode == "curve" and cfg.security.secret_key_file == ""  # keys_dir's, for_role says which
    assert cfg.metrics.listen == "" and cfg.logging.level == "INFO"
    assert dataclasses.is_dataclass(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.broker.name = "x"  # type: ignore[misc]


def test_default_file_is_read_when_present(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\nname = "b1"\n')
    cfg = load(None, {}, default_path=path)
    assert cfg.path == path and cfg.broker.name == "b1"


def test_defaults_are_the_daemons_defaults(tmp_path: Path) -> None:
    from gpud_broker.__main__ import broker_config
    from gpud_broker.core import BrokerConfig
    from gpud_worker.worker import WorkerConfig

    cfg = load(None, {}, default_path=str(tmp_path / "absent.toml"))
    assert broker_config(cfg) == BrokerConfig()
    w = WorkerConfig(name="x", brokers=())
    assert (cfg.worker.slots, cfg.worker.session_idle, cfg.worker.drain_timeout) == (w.slots, w.session_idle, w.drain_timeout)
    assert cfg.worker.reconnect_max == w.reconnect_max
    assert (cfg.worker.heartbeat_ms / 1000, cfg.worker.liveness) == (w.heartbeat.interval, w.heartbeat.liveness)


def test_file_values(tmp_path: Path) -> None:
    path = write(tmp_path, """
[broker]
name = "control-1"
policy = "best-fit"
heartbeat_ms = 250
session_lease = 5        # an int where a float is wanted is fine
admin = "ipc:///run/gpud/admin.sock"

[worker]
brokers = ["tcp://a:5556", "tcp://b:5556"]
simulate = 2
job_uids = "61184-61199"

[security]
mode = "none"
allow_public_bind = true

[openstack]
worker_metadata = { role = "gpud-worker" }
min_workers = 1
max_workers = 4

[logging]
level = "debug"
""")
    cfg = load(path, {}, policies=POLICIES)
    assert cfg.path == path
    b = cfg.broker
    assert (b.name, b.policy, b.heartbeat_ms, b.session_lease, b.admin) == (
        "control-1", "best-fit", 250, 5.0, "ipc:///run/gpud/admin.sock")
    assert isinstance(b.session_lease, float)
    assert cfg.worker.brokers == ("tcp://a:5556", "tcp://b:5556") and cfg.worker.simulate == 2
    assert config.uid_range(cfg.worker.job_uids) == range(61184, 61200)
    assert cfg.security.mode == "none" and cfg.security.allow_public_bind is True
    assert cfg.openstack.worker_metadata == {"role": "gpud-worker"} and cfg.openstack.max_workers == 4
    assert cfg.logging.level == "debug"


def test_env_beats_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\npolicy = "spread"\nname = "from-file"\nliveness = 5\n')
    env = {"GPUD_BROKER_POLICY": "best-fit", "GPUD_BROKER_LIVENESS": "7", "GPUD_ADMIN": "not ours", "PATH": "/bin"}
    cfg = load(path, env, policies=POLICIES)
    assert (cfg.broker.policy, cfg.broker.liveness, cfg.broker.name) == ("best-fit", 7, "from-file")


def test_flags_beat_env(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\nname = "from-file"\nmax_queue = 10\n')
    env = {"GPUD_BROKER_NAME": "from-env", "GPUD_BROKER_MAX_QUEUE": "20"}
    cfg = load(path, env, flags={"broker": {"name": "from-flag", "max_queue": None}})
    assert cfg.broker.name == "from-flag"
    assert cfg.broker.max_queue == 20  # a flag left at None was not given


def test_lists_booleans_and_tables_from_env(tmp_path: Path) -> None:
    env = {
        "GPUD_WORKER_BROKERS": "tcp://a:5556, tcp://b:5556",
        "GPUD_SECURITY_ALLOW_PUBLIC_BIND": "yes",
        "GPUD_OPENSTACK_WORKER_METADATA": "role=gpud-worker, zone=a",
        "GPUD_BROKER_RESULT_TTL": "12.5",
    }
    cfg = load(None, env, default_path=str(tmp_path / "absent.toml"))
    assert cfg.worker.brokers == ("tcp://a:5556", "tcp://b:5556")
    assert cfg.security.allow_public_bind is True
    assert cfg.openstack.worker_metadata == {"role": "gpud-worker", "zone": "a"}
    assert cfg.broker.result_ttl == 12.5


def test_old_log_level_variable_still_works_below_the_new_one(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.toml")
    assert load(None, {"GPUD_LOG_LEVEL": "DEBUG"}, default_path=absent).logging.level == "DEBUG"
    env = {"GPUD_LOG_LEVEL": "DEBUG", "GPUD_LOGGING_LEVEL": "ERROR"}
    assert load(None, env, default_path=absent).logging.level == "ERROR"


# --------------------------------------------------------------------------- refusals


def test_unknown_key_is_refused_naming_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\npolcy = "spread"\n')
    msg = refused(path)
    assert path in msg and "[broker] polcy" in msg and "unknown key" in msg and "policy" in msg


def test_unknown_section_is_refused_naming_it_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[brokr]\nname = "x"\n')
    msg = refused(path)
    assert path in msg and "[brokr]" in msg and "unknown section" in msg


@pytest.mark.parametrize(
    ("section", "line", "problem"),
    [
        ("broker", "heartbeat_ms = 5", "must be >= 10"),
        ("broker", 'heartbeat_ms = "1000"', "must be an integer"),
        ("broker", "heartbeat_ms = 1000.5", "must be an integer"),
        ("broker", "liveness = 0", "must be >= 1"),
        ("broker", "max_queue = true", "must be an integer"),
        ("broker", "session_lease = 0", "must be > 0"),
        ("broker", "reserve_after = -1", "must be >= 0"),
        ("broker", 'policy = "fastest"', "must be one of balanced, best-fit, spread"),
        ("broker", 'frontend = "localhost:5555"', "must be an endpoint"),
        ("broker", "name = 3", "must be a string"),
        ("standby", 'role = "leader"', "must be one of standalone, primary, backup"),
        ("worker", 'brokers = "tcp://a:5556"', "must be a list of strings"),
        ("worker", "brokers = []", "at least one endpoint"),
        ("worker", "simulate = -1", "must be >= 0"),
        ("worker", 'job_uids = "10-20"', "unprivileged uids"),
        ("worker", 'job_uids = "61184"', "FIRST-LAST"),
        ("security", 'mode = "tls"', "must be one of curve, none"),
        ("security", 'allow_public_bind = "yes"', "must be true or false"),
        ("metrics", 'listen = "9464"', "HOST:PORT"),
        ("metrics", 'listen = "127.0.0.1:99999"', "HOST:PORT"),
        ("openstack", "worker_metadata = { a = 1 }", "a table of strings"),
        ("logging", 'level = "LOUD"', "must be one of DEBUG"),
    ],
)
def test_bad_values_are_refused_naming_key_and_file(tmp_path: Path, section: str, line: str, problem: str) -> None:
    path = write(tmp_path, f"[{section}]\n{line}\n")
    msg = refused(path, policies=POLICIES)
    key = line.split(" =")[0]
    assert f"{path}: [{section}] {key}: " in msg and problem in msg


def test_every_error_of_a_file_is_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "[broker]\nheartbeat_ms = 1\nliveness = 0\n[nope]\n")
    lines = refused(path).splitlines()
    assert len(lines) == 3 and all(path in line for line in lines)


def test_bad_env_and_flag_values_name_their_origin(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.toml")
    msg = refused(None, {"GPUD_BROKER_HEARTBEAT_MS": "fast"}, default_path=absent)
    assert "GPUD_BROKER_HEARTBEAT_MS" in msg and "[broker] heartbeat_ms" in msg and "must be an integer" in msg
    msg = refused(None, {"GPUD_BROKER_POLCY": "spread"}, default_path=absent)
    assert "GPUD_BROKER_POLCY" in msg and "unknown key" in msg
    msg = refused(None, {}, default_path=absent, flags={"worker": {"slots": 0}})
    assert "command line ([worker] slots)" in msg and "must be >= 1" in msg


def test_a_bad_file_value_is_refused_even_where_a_flag_overrides_it(tmp_path: Path) -> None:
    path = write(tmp_path, "[broker]\nliveness = 0\n")
    assert "[broker] liveness" in refused(path, flags={"broker": {"liveness": 3}})


def test_policy_is_checked_only_against_the_names_given(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\npolicy = "custom"\n')
    assert load(path, {}).broker.policy == "custom"
    assert "[broker] policy" in refused(path, policies=POLICIES)


def test_missing_explicit_file_and_bad_toml_are_refused(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.toml")
    assert missing in refused(missing) and "no such" in refused(missing)
    path = write(tmp_path, "[broker\n")
    msg = refused(path)
    assert path in msg and "not valid TOML" in msg


def test_standby_pair_needs_its_peer(tmp_path: Path) -> None:
    path = write(tmp_path, '[standby]\nrole = "primary"\n')
    msg = refused(path)
    assert f"{path}: [standby] role" in msg and "peer" in msg
    ok = write(tmp_path, '[standby]\nrole = "backup"\npeer = "tcp://c1:5557"\npeer_bind = "tcp://*:5557"\n')
    assert load(ok, {}).standby.role == "backup"
    bad = write(tmp_path, "[standby]\npeer_heartbeat_ms = 1000\npeer_expiry_ms = 500\n")
    assert "[standby] peer_expiry_ms" in refused(bad)


# --------------------------------------------------------------------------- tenants and security


def test_tenants_table(tmp_path: Path) -> None:
    path = write(tmp_path, """
[broker.tenants.team-a]
weight = 2
max_milli = 4000
max_mem = 68719476736

[broker.tenants."ml@lab"]
max_sessions = 3
max_queued = 100
""")
    tenants = load(path, {}).broker.tenants
    assert tenants == {
        "team-a": TenantLimits(weight=2.0, max_milli=4000, max_mem=64 << 30),
        "ml@lab": TenantLimits(max_sessions=3, max_queued=100),
    }
    from gpud_broker.__main__ import broker_config

    cfg = load(path, {})
    assert broker_config(cfg, {"other": 3.0}).tenant_weights == {"team-a": 2.0, "ml@lab": 1.0, "other": 3.0}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[broker.tenants.a]\nweight = 0\n", "[broker.tenants.a] weight: must be > 0"),
        ("[broker.tenants.a]\nmax_milli = -1\n", "[broker.tenants.a] max_milli: must be >= 0"),
        ("[broker.tenants.a]\nlimit = 1\n", "[broker.tenants.a] limit: unknown key"),
        ('[broker.tenants."bad name"]\n', "[broker.tenants.bad name]: a tenant name"),
        ("[broker]\ntenants = 3\n", "[broker] tenants: must be tables"),
    ],
)
def test_bad_tenants_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    msg = refused(path)
    assert path in msg and expected in msg


def test_tenants_cannot_come_from_the_environment(tmp_path: Path) -> None:
    msg = refused(None, {"GPUD_BROKER_TENANTS": "a"}, default_path=str(tmp_path / "absent.toml"))
    assert "only in the file" in msg


def test_security_key_paths_follow_keys_dir() -> None:
    sec = config.SecurityConfig(keys_dir="/srv/keys", client_keys_dir="/srv/tenants", worker_keys_dir="w")
    broker = for_role(sec, "broker")
    assert (broker.secret_key_file, broker.public_key_file) == ("/srv/keys/broker.key_secret", "/srv/keys/broker.key")
    assert broker.worker_keys_dir == "/srv/keys/w" and broker.client_keys_dir == "/srv/tenants"  # relative: inside
    worker = for_role(sec, "worker")  # a worker's own pair, not the broker's
    assert (worker.secret_key_file, worker.public_key_file) == ("/srv/keys/worker.key_secret", "/srv/keys/worker.key")
    assert worker.broker_public_key_file == "/srv/keys/broker.key"
    chosen = for_role(config.SecurityConfig(keys_dir="/k", secret_key_file="private/w7.key_secret"), "worker")
    assert (chosen.secret_key_file, chosen.public_key_file) == ("/k/private/w7.key_secret", "/k/private/w7.key")


def test_security_from_env_moves_the_derived_paths(tmp_path: Path) -> None:
    cfg = load(None, {"GPUD_SECURITY_KEYS_DIR": "/k"}, default_path=str(tmp_path / "absent.toml"))
    assert for_role(cfg.security, "broker").secret_key_file == "/k/broker.key_secret"
    assert for_role(cfg.security, "worker").secret_key_file == "/k/worker.key_secret"


# --------------------------------------------------------------------------- flags, output, example


def test_daemon_flags_default_to_not_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpud_broker.__main__ import add_arguments as broker_args
    from gpud_broker.__main__ import load_config as broker_load
    from gpud_worker.__main__ import add_arguments as worker_args
    from gpud_worker.__main__ import load_config as worker_load

    path = write(tmp_path, '[broker]\npolicy = "spread"\nname = "f"\n[worker]\nslots = 8\nname = "wf"\n[logging]\nlevel = "ERROR"\n')
    monkeypatch.setenv("GPUD_BROKER_NAME", "e")
    p = argparse.ArgumentParser()
    broker_args(p)
    cfg = broker_load(p.parse_args(["--config", path, "--heartbeat-ms", "200"]))
    assert (cfg.broker.policy, cfg.broker.name, cfg.broker.heartbeat_ms, cfg.logging.level) == ("spread", "e", 200, "ERROR")
    cfg = broker_load(p.parse_args(["--config", path, "--name", "flag", "--log-level", "DEBUG"]))
    assert (cfg.broker.name, cfg.logging.level) == ("flag", "DEBUG")
    p = argparse.ArgumentParser()
    worker_args(p)
    cfg = worker_load(p.parse_args(["--config", path, "--broker", "tcp://x:1", "--broker", "tcp://y:1"]))
    assert (cfg.worker.slots, cfg.worker.name, cfg.worker.brokers) == (8, "wf", ("tcp://x:1", "tcp://y:1"))


def test_flag_values() -> None:
    ns = argparse.Namespace(broker=["tcp://a:1"], slots=None)
    assert config.flag_values(ns, {"brokers": "broker", "slots": "slots"}) == {"brokers": ["tcp://a:1"], "slots": None}
    assert config.flag_values(ns, ["slots"]) == {"slots": None}


def test_dump_reads_back_to_the_same_config(tmp_path: Path) -> None:
    path = write(tmp_path, """
[broker]
name = "quote \\" and \\\\ back"
tenants.a = { weight = 2.5, max_mem = 1024 }
[worker]
brokers = ["tcp://a:1", "ipc:///run/b"]
[openstack]
worker_metadata = { "a key" = "v" }
""")
    cfg = load(path, {})
    again = write(tmp_path, config.dump(cfg))
    assert dataclasses.replace(load(again, {}), path=path) == cfg


def test_example_loads_and_documents_every_key_with_its_default() -> None:
    cfg = load(str(EXAMPLE), {}, policies=FACTORIES)
    doc = tomllib.loads(EXAMPLE.read_text())
    assert set(doc) == set(config.SECTIONS)
    for name, cls in config.SECTIONS.items():
        keys = {f.name for f in dataclasses.fields(cls)}
        assert keys == set(doc[name]), f"[{name}] in the example differs from the keys gpud knows"
    # ... each with its default: the example's values are the defaults (an example tenant aside).
    assert dataclasses.replace(cfg, path="", broker=dataclasses.replace(cfg.broker, tenants={})) == GpudConfig()
    assert set(doc["broker"]["tenants"]["default"]) == {f.name for f in dataclasses.fields(TenantLimits)}
    assert cfg.broker.tenants == {"default": TenantLimits()}
    lines = EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):  # and a comment just above it
        if " = " in line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


def test_uid_range() -> None:
    assert config.uid_range("") is None
    assert config.uid_range("1000-1000") == range(1000, 1001)
    for bad in ("5-1000", "2000-1000", "a-b", "1000", "1000-2147483648"):
        with pytest.raises(ValueError):
            config.uid_range(bad)


# --------------------------------------------------------------------------- gpud config check


def test_config_check_good_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\npolicy = "best-fit"\n')
    env = {"PATH": "/usr/bin:/bin", "GPUD_BROKER_NAME": "checked"}
    r = subprocess.run([*GPUD, "config", "check", "--config", path], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("OK")
    shown = tomllib.loads(r.stdout.rstrip().removesuffix("OK"))
    assert shown["broker"]["policy"] == "best-fit" and shown["broker"]["name"] == "checked"
    env = {"PATH": "/usr/bin:/bin", "GPUD_SECURITY_MODE": "none"}  # no key files to check
    r = subprocess.run([*GPUD, "config", "check", "--config", path, "--role", "worker"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and set(tomllib.loads(r.stdout.rstrip().removesuffix("OK"))) == {"worker", "security", "logging"}


def test_config_check_example() -> None:
    r = subprocess.run([*GPUD, "config", "check", "--config", str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stderr


def test_config_check_bad_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[broker]\npolicy = "fastest"\nheartbeat_ms = 1\n[worker]\ngpu = 1\n')
    r = subprocess.run([*GPUD, "config", "check", "--config", path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "OK" not in r.stdout
    assert f"{path}: [broker] policy" in r.stderr and f"{path}: [broker] heartbeat_ms" in r.stderr
    assert f"{path}: [worker] gpu: unknown key" in r.stderr
    r = subprocess.run([*GPUD, "config", "check", "--config", str(tmp_path / "nope.toml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nope.toml: no such configuration file" in r.stderr


def test_config_check_shows_and_checks_each_daemons_own_key_files(tmp_path: Path) -> None:
    from gpud.security import keygen

    keys = tmp_path / "keys"
    path = write(tmp_path, f'[security]\nkeys_dir = "{keys}"\n')
    env = {"PATH": "/usr/bin:/bin"}

    def check(role: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*GPUD, "config", "check", "--config", path, "--role", role],
                              capture_output=True, text=True, timeout=60, env=env)

    r = check("worker")  # nothing there yet: said, and not OK
    assert r.returncode == 2 and "OK" not in r.stdout
    assert f"secret_key_file: {keys}/worker.key_secret: No such file" in r.stderr
    assert f"broker_public_key_file: {keys}/broker.key: No such file" in r.stderr
    keygen(keys, "worker")
    keygen(keys, "broker")
    r = check("worker")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stderr
    shown = tomllib.loads(r.stdout.rstrip().removesuffix("OK"))["security"]
    assert shown["secret_key_file"] == f"{keys}/worker.key_secret" and shown["public_key_file"] == f"{keys}/worker.key"
    assert check("broker").returncode == 2  # its allow-lists are missing
    (keys / "workers").mkdir()
    (keys / "clients").mkdir()
    r = check("broker")
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout.rstrip().removesuffix("OK"))["security"]["secret_key_file"] == f"{keys}/broker.key_secret"
    (keys / "broker.key_secret").chmod(0o640)
    (keys / "clients").chmod(0o777)
    r = check("broker")
    assert r.returncode == 2 and "chmod 600" in r.stderr and f"{keys}/clients has mode 0777" in r.stderr


def test_the_spool_lies_in_systemds_state_directory_unless_configured() -> None:
    from gpud_broker.__main__ import spool_directory
    assert spool_directory("/srv/spool", {"STATE_DIRECTORY": "/var/lib/gpud/b1"}) == "/srv/spool"
    assert spool_directory("", {"STATE_DIRECTORY": "/var/lib/gpud/b1:/var/lib/other"}) == "/var/lib/gpud/b1/spool"
    assert spool_directory("", {}) == ""  # a temporary directory of the broker's
    assert spool_directory("", {"STATE_DIRECTORY": "relative"}) == ""
