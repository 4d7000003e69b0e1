"""The daemons read their configuration file: values take effect; a bad file stops them with exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpud_cli.cluster import admin_call

GPUD = [sys.executable, "-m", "gpud_cli"]


def _env() -> dict[str, str]:
    """This environment without GPUD_* variables, so that only the test's file counts."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUD_")}


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "broker not ready:\n" + log.read_text()
        time.sleep(0.02)
    return json.loads(ready.read_text())  # type: ignore[no-any-return]


def test_broker_and_worker_take_their_settings_from_the_file(tmp_path: Path) -> None:
    admin = f"ipc://{tmp_path}/admin.sock"
    conf = tmp_path / "gpud.toml"
    conf.write_text(f"""
[broker]
name = "from-file"
policy = "spread"
frontend = "tcp://127.0.0.1:*"
backend = "tcp://127.0.0.1:*"
admin = "{admin}"
heartbeat_ms = 200

[security]
mode = "none"  # loopback only; the security tests cover CURVE

[logging]
level = "INFO"
file = "{tmp_path}/broker-file.log"
""")
    ready, log = tmp_path / "broker.json", tmp_path / "broker.log"
    with open(log, "ab") as out:
        broker = subprocess.Popen([*GPUD, "broker", "--config", str(conf), "--ready-file", str(ready)],
                                  stdout=subprocess.DEVNULL, stderr=out, env=_env())
    worker = None
    try:
        ep = _wait_ready(broker, ready, log)
        st = admin_call(admin, "status", timeout=5)
        assert st["broker"]["name"] == "from-file" and st["broker"]["policy"] == "spread"
        assert "broker from-file ready" in (tmp_path / "broker-file.log").read_text()  # [logging] too
        assert "ready" not in log.read_text()

        # A worker whose file names the broker; the environment overrides the file's name.
        wconf = tmp_path / "worker.toml"
        wconf.write_text(f'[worker]\nbrokers = ["{ep["backend"]}"]\nname = "file-name"\nsimulate = 1\nheartbeat_ms = 200\n'
                         '[security]\nmode = "none"\n')
        with open(tmp_path / "worker.log", "ab") as out:
            worker = subprocess.Popen([*GPUD, "worker", "--config", str(wconf), "--workdir", str(tmp_path / "jobs")],
                                      stdout=subprocess.DEVNULL, stderr=out, env={**_env(), "GPUD_WORKER_NAME": "env-name"})
        deadline = time.monotonic() + 20
        while True:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            st = admin_call(admin, "status", timeout=5)
            if st["counts"]["workers"] == 1:
                break
            assert time.monotonic() < deadline, "the worker never registered"
            time.sleep(0.05)
        assert [w["name"] for w in st["workers"]] == ["env-name"]
        assert [g["uuid"] for g in st["gpus"]] == ["SIM-env-name-0"]
    finally:
        for proc in (worker, broker):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
        if worker is not None:
            assert worker.wait(timeout=30) == 0
        assert broker.wait(timeout=30) == 0


def test_broker_with_a_bad_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "gpud.toml"
    conf.write_text('[broker]\npolicy = "fastest"\nheartbeat_ms = 1\n')
    r = subprocess.run([*GPUD, "broker", "--config", str(conf), "--ready-file", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 2
    assert f"{conf}: [broker] policy" in r.stderr and f"{conf}: [broker] heartbeat_ms" in r.stderr
    assert not (tmp_path / "r.json").exists()


def test_daemons_refuse_a_missing_file_and_bad_environment(tmp_path: Path) -> None:
    r = subprocess.run([*GPUD, "worker", "--config", str(tmp_path / "missing.toml"), "--simulate", "1"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 2 and "missing.toml: no such configuration file" in r.stderr
    r = subprocess.run([*GPUD, "broker", "--config", os.devnull], capture_output=True, text=True, timeout=60,
                       env={**_env(), "GPUD_BROKER_LIVENESS": "none"})
    assert r.returncode == 2 and "GPUD_BROKER_LIVENESS" in r.stderr and "[broker] liveness" in r.stderr


def test_sighup_and_gpudctl_reload_re_read_the_file(tmp_path: Path) -> None:
    """Reload applies what can change live (policy, queue bound, tenant weights), names what needs
    a restart, and keeps the running configuration when the new file is bad."""
    admin = f"ipc://{tmp_path}/admin.sock"
    conf = tmp_path / "gpud.toml"
    base = f"""
[broker]
name = "reloading"
frontend = "tcp://127.0.0.1:*"
backend = "tcp://127.0.0.1:*"
admin = "{admin}"
policy = "{{policy}}"
max_queue = {{max_queue}}

[security]
mode = "none"
"""
    conf.write_text(base.format(policy="balanced", max_queue=100))
    ready, log = tmp_path / "broker.json", tmp_path / "broker.log"
    with open(log, "ab") as out:
        broker = subprocess.Popen([*GPUD, "broker", "--config", str(conf), "--ready-file", str(ready)],
                                  stdout=subprocess.DEVNULL, stderr=out, env=_env())
    try:
        _wait_ready(broker, ready, log)
        assert admin_call(admin, "status", timeout=5)["broker"]["policy"] == "balanced"
        # gpudctl reload: applied at once, and it says what changed.
        conf.write_text(base.format(policy="best-fit", max_queue=100))
        result = admin_call(admin, "reload", timeout=5)
        assert "policy" in json.dumps(result)
        assert admin_call(admin, "status", timeout=5)["broker"]["policy"] == "best-fit"
        # SIGHUP does the same.
        conf.write_text(base.format(policy="spread", max_queue=100))
        broker.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while admin_call(admin, "status", timeout=5)["broker"]["policy"] != "spread":
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        # A bad file is refused and the running configuration stays.
        conf.write_text(base.format(policy="no-such-policy", max_queue=100))
        try:
            admin_call(admin, "reload", timeout=5)
            raise AssertionError("a bad configuration was accepted on reload")
        except Exception as exc:  # the admin error names the key
            assert "policy" in str(exc)
        assert admin_call(admin, "status", timeout=5)["broker"]["policy"] == "spread"
        assert broker.poll() is None
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(timeout=30)
