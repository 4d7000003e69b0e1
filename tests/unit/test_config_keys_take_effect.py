"""Every key of ``systemd/gpud.toml.example`` takes effect, from the file, the environment and a flag.

The test walks the example's keys: a key added there without an effect on a daemon (or only on
one of the three layers) fails it. The broker's effect is its ``BrokerPlan`` (all ``run`` takes
from the configuration); the worker's is what its ``run`` reads of ``[worker]``, ``[security]`` as
a worker uses it, and ``[logging]``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpud import config
from gpud.security import SecuritySettings, security_flags
from gpud_broker import __main__ as broker_main
from gpud_broker.policies import FACTORIES
from gpud_worker import __main__ as worker_main

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "gpud.toml.example"
DOC = tomllib.loads(EXAMPLE.read_text())

ALT: dict[tuple[str, str], object] = {
    ("broker", "name"): "b2", ("broker", "frontend"): "tcp://127.0.0.1:6555",
    ("broker", "backend"): "tcp://127.0.0.1:6556", ("broker", "admin"): "ipc:///tmp/gpud-test-admin.sock",
    ("broker", "policy"): "spread",
    ("standby", "role"): "backup", ("standby", "peer"): "tcp://127.0.0.1:6557",
    ("standby", "peer_bind"): "tcp://127.0.0.1:6558",
    ("worker", "name"): "w2", ("worker", "brokers"): ("tcp://127.0.0.1:6556",), ("worker", "gpu_model"): "SIM-X",
    ("worker", "workdir"): "/tmp/w", ("worker", "job_user_prefix"): "gpud-x", ("worker", "job_uids"): "70000-70010",
    ("worker", "session_processes"): "on", ("worker", "compile_user"): "daemon", ("worker", "replica_of"): "w0",
    ("worker", "fault_file"): "/tmp/f.json", ("worker", "instance_id"): "abc", ("worker", "cgroups"): "off",
    ("worker", "cgroup_parent"): "/sys/fs/cgroup/x", ("worker", "mps_pipe_dir"): "/tmp/p",
    ("worker", "mps_log_dir"): "/tmp/l", ("worker", "job_network"): "host",
    ("broker", "tenant_pool_share"): 0.25,
    ("worker", "data_bind"): "tcp://127.0.0.1:6559", ("worker", "data_advertise"): "tcp://10.0.0.9:6559",
    ("worker", "data_ports"): "6560-6569",
    ("broker", "data_path"): "broker", ("broker", "spool_dir"): "/tmp/gpud-test-spool",
    ("security", "mode"): "none", ("security", "keys_dir"): "/srv/k", ("security", "secret_key_file"): "/srv/s.key_secret",
    ("security", "public_key_file"): "/srv/p.key", ("security", "broker_public_key_file"): "/srv/b.key",
    ("security", "worker_keys_dir"): "/srv/w", ("security", "client_keys_dir"): "/srv/c",
    ("metrics", "listen"): "127.0.0.1:29464",
    ("openstack", "cloud"): "c", ("openstack", "region"): "r", ("openstack", "image"): "i",
    ("openstack", "flavor"): "f", ("openstack", "network"): "n", ("openstack", "key_name"): "k",
    ("openstack", "name_prefix"): "gw", ("openstack", "install"): "gpud", ("openstack", "user_data"): "/tmp/u.yaml",
    ("openstack", "worker_metadata"): {"a": "b"}, ("openstack", "worker_tags"): ("t",),
    ("openstack", "brokers"): ("tcp://127.0.0.1:6556",),
    ("logging", "level"): "DEBUG", ("logging", "file"): "/tmp/gpud-test.log",
}
"""A value other than the default for each key that is not a number or a boolean."""

BASE: dict[str, dict[str, object]] = {
    "standby": {"role": "primary", "peer": "tcp://127.0.0.1:7557", "peer_bind": "tcp://127.0.0.1:7558"},
    "openstack": {"max_workers": 5},
}
"""What a section needs besides the default for its keys to matter (a pair's keys, a Nova pool's)."""

KEYS = [(s, k) for s, table in DOC.items() for k in table if k != "tenants"]
TENANT_KEYS = list(DOC["broker"]["tenants"]["default"])


def alt(section: str, key: str, default: object) -> object:
    if (section, key) in ALT:
        return ALT[(section, key)]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + (1 if isinstance(default, int) else 1.5)
    raise AssertionError(f"[{section}] {key}: give tests/unit/{Path(__file__).name} ALT a value other than the default")


def toml(tables: Mapping[str, Mapping[str, object]]) -> str:
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, tuple | list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v) if isinstance(v, str) else repr(v)
    return "".join(f"[{s}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in t.items()) for s, t in tables.items())


def env_text(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple | list):
        return ",".join(v)
    if isinstance(v, dict):
        return ",".join(f"{k}={x}" for k, x in v.items())
    return str(v)


def parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    (broker_main if role == "broker" else worker_main).add_arguments(p)
    return p


FLAG_DESTS: dict[str, dict[str, Mapping[str, str]]] = {
    "broker": {"broker": {k: k for k in broker_main.FLAGS}, "standby": {k: k for k in broker_main.STANDBY_FLAGS},
               "logging": broker_main.LOG_FLAGS, "metrics": broker_main.METRICS_FLAGS,
               "security": security_flags(worker=False)},
    "worker": {"worker": worker_main.FLAGS, "logging": worker_main.LOG_FLAGS, "security": security_flags(worker=True)},
}
"""Role -> section -> key -> argparse dest of the key's flag, as each daemon's load_config uses them."""


def argv_for(p: argparse.ArgumentParser, dest: str, value: object) -> list[str]:
    action = next(a for a in p._actions if a.dest == dest)
    opt = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [opt if value else f"--no-{opt.removeprefix('--')}"]
    if action.nargs == 0:
        assert value is True, f"{opt} can only turn {dest} on"
        return [opt]
    if isinstance(action, argparse._AppendAction):
        return [x for v in value for x in (opt, v)]  # type: ignore[attr-defined]
    return [opt, str(value)]


def loaded(role: str, text: str, env: dict[str, str], argv: list[str], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> config.GpudConfig:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    for name in [n for n in os.environ if n.startswith("GPUD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    main = broker_main if role == "broker" else worker_main
    return main.load_config(parser(role).parse_args(["--config", str(path), *argv]))


def broker_effect(cfg: config.GpudConfig) -> object:
    return broker_main.plan(cfg)


def worker_effect(cfg: config.GpudConfig) -> object:
    return cfg.worker, SecuritySettings.from_config(cfg.security, "worker"), cfg.logging


def worker_reads() -> set[str]:
    """The [worker] keys ``gpud_worker.__main__.run`` reads (as ``w.KEY``, ``w = cfg.worker``)."""
    tree = ast.parse(inspect.getsource(worker_main.run))
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "w"}


@pytest.mark.parametrize(("section", "key"), KEYS, ids=[f"{s}.{k}" for s, k in KEYS])
def test_each_example_key_takes_effect_from_every_layer(section: str, key: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    default = DOC[section][key]
    value = alt(section, key, default)
    base = BASE.get(section, {})
    roles = [r for r, sections in config.ROLE_SECTIONS.items() if section in sections]
    assert roles, f"[{section}] is read by no daemon"
    env_name = f"GPUD_{section.upper()}_{key.upper()}"
    for role in roles:
        effect = broker_effect if role == "broker" else worker_effect
        before = loaded(role, toml({section: base}), {}, [], tmp_path, monkeypatch)
        from_file = loaded(role, toml({section: {**base, key: value}}), {}, [], tmp_path, monkeypatch)
        want = getattr(from_file, section)
        assert getattr(want, key) == (dict(value) if isinstance(value, dict) else value), f"[{section}] {key} from the file"
        assert effect(from_file) != effect(before), f"[{section}] {key} in the file changes nothing the {role} runs with"
        # The environment beats the file; a flag, where the daemon has one, beats both.
        from_env = loaded(role, toml({section: {**base, key: default}}), {env_name: env_text(value)}, [],
                          tmp_path, monkeypatch)
        assert getattr(from_env, section) == want, f"{env_name} over the file"
        dest = FLAG_DESTS[role].get(section, {}).get(key)
        if dest is not None:
            argv = argv_for(parser(role), dest, value)
            from_flag = loaded(role, toml({section: base}), {env_name: env_text(default)}, argv, tmp_path, monkeypatch)
            assert getattr(from_flag, section) == want, f"{argv} over {env_name} and the file"
        if role == "worker" and section == "worker":
            assert key in worker_reads(), f"gpud worker never reads [worker] {key}"


@pytest.mark.parametrize("key", TENANT_KEYS)
def test_each_tenant_key_of_the_example_takes_effect(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = DOC["broker"]["tenants"]["default"][key]
    value = alt("broker.tenants", key, default)
    before = loaded("broker", "[broker.tenants.a]\n", {}, [], tmp_path, monkeypatch)
    after = loaded("broker", f"[broker.tenants.a]\n{key} = {value!r}\n", {}, [], tmp_path, monkeypatch)
    assert getattr(after.broker.tenants["a"], key) == value
    assert broker_effect(after) != broker_effect(before), f"[broker.tenants.NAME] {key} changes nothing"


def test_the_metrics_flag_and_the_file_are_one_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = loaded("broker", '[metrics]\nlisten = "127.0.0.1:29464"\n', {}, [], tmp_path, monkeypatch)
    assert broker_main.plan(cfg).metrics == "127.0.0.1:29464"
    cfg = loaded("broker", '[metrics]\nlisten = "127.0.0.1:29464"\n', {}, ["--metrics", "127.0.0.1:0"], tmp_path, monkeypatch)
    assert broker_main.plan(cfg).metrics == "127.0.0.1:0"
    assert broker_main.plan(config.load(None, {}, default_path=str(tmp_path / "absent"), policies=FACTORIES)).metrics is None


def test_the_plan_is_all_the_broker_takes_from_its_configuration() -> None:
    """run() hands serve() the plan's fields, not args or cfg of its own (as --metrics once was)."""
    source = inspect.getsource(broker_main.run)
    serve_call = source[source.index("return serve("):]
    serve_call = serve_call[:serve_call.index("\n\n")] if "\n\n" in serve_call else serve_call
    assert "cfg." not in serve_call and "args.metrics" not in source
    assert {f.name for f in dataclasses.fields(broker_main.BrokerPlan)} - {"log_level", "log_file"} <= {
        n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name) and n.value.id == "p"}
