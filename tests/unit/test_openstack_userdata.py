"""The cloud-init user data of booted GPU VMs (gpud_broker.openstack.userdata): the built-in template
renders to valid cloud-config whose worker configuration gpud loads, whose keys zmq reads, and whose
unit, sysusers and tmpfiles files are the repository's own (rendered for /opt/gpud/bin)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq.auth

from gpud.config import load
from gpud_broker.openstack import userdata

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"


def rendered(**over: str) -> tuple[str, dict[str, Any], userdata.WorkerKeys]:
    keys = userdata.new_keys("rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7")
    values = userdata.values("gpud-worker-0a1b2c", ["tcp://control-1:5556", "tcp://control-2:5556"],
                             "gpud[worker,daemon]==1.0; python_version >= '3.11'", "curve", keys)
    text = userdata.render(userdata.load(), {**values, **over})
    return text, yaml.safe_load(text), keys


def files(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["path"]: f for f in doc["write_files"]}


def test_the_built_in_template_is_cloud_config_that_starts_the_worker() -> None:
    text, doc, _ = rendered()
    assert text.startswith("#cloud-config\n") and doc["hostname"] == "gpud-worker-0a1b2c"
    assert doc["runcmd"] == [["/usr/local/sbin/gpud-install-worker"]]
    script = files(doc)["/usr/local/sbin/gpud-install-worker"]
    assert script["permissions"] == "0755"
    lines = script["content"].splitlines()
    assert "systemctl enable --now gpud-worker.service" in lines
    pip = next(line for line in lines if "pip install" in line)
    assert shlex.split(pip)[-1] == "gpud[worker,daemon]==1.0; python_version >= '3.11'"  # quoted for the shell


def test_the_worker_configuration_loads_with_its_name_brokers_and_instance_id(tmp_path: Path) -> None:
    _, doc, _ = rendered()
    path = tmp_path / "gpud.toml"
    path.write_text(files(doc)["/etc/gpud/gpud.toml"]["content"])
    cfg = load(str(path), {})
    assert cfg.worker.name == "gpud-worker-0a1b2c" and cfg.worker.instance_id == "auto"
    assert cfg.worker.brokers == ("tcp://control-1:5556", "tcp://control-2:5556")
    assert cfg.security.mode == "curve" and cfg.security.keys_dir == "/etc/gpud/keys"


def test_the_keys_are_certificates_zmq_reads(tmp_path: Path) -> None:
    _, doc, keys = rendered()
    f = files(doc)
    assert f["/etc/gpud/keys/worker.key_secret"]["permissions"] == "0600"
    for path, public, secret in (("/etc/gpud/keys/worker.key_secret", keys.public, keys.secret),
                                 ("/etc/gpud/keys/worker.key", keys.public, None),
                                 ("/etc/gpud/keys/broker.key", keys.broker_public, None)):
        out = tmp_path / Path(path).name
        out.write_text(f[path]["content"])
        got_public, got_secret = zmq.auth.load_certificate(str(out))
        assert got_public == public.encode() and got_secret == (secret.encode() if secret else None)
    allow = tmp_path / "allow.key"
    allow.write_text(userdata.public_certificate(keys.public, "gpud-worker-0a1b2c"))
    assert zmq.auth.load_certificate(str(allow))[0] == keys.public.encode()


def test_unit_sysusers_and_tmpfiles_are_the_repository_s() -> None:
    _, doc, _ = rendered()
    f = files(doc)
    unit = (SYSTEMD / "gpud-worker.service.in").read_text()
    unit = unit.replace("@BINDIR@", "/opt/gpud/bin").replace("@SYSCONFDIR@", "/etc")
    assert f["/etc/systemd/system/gpud-worker.service"]["content"] == unit, (
        "the unit in cloud-init-worker.yaml.in differs from systemd/gpud-worker.service.in")
    assert f["/etc/sysusers.d/gpud.conf"]["content"] == (SYSTEMD / "gpud-sysusers.conf").read_text()
    assert f["/etc/tmpfiles.d/gpud.conf"]["content"] == (SYSTEMD / "gpud-tmpfiles.conf").read_text()


def test_bad_templates_and_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(userdata.TemplateError, match="unknown placeholder\\(s\\) colour"):
        userdata.render("hostname: {{ name }} {{ colour }}", {f: "x" for f in userdata.FIELDS})
    with pytest.raises(userdata.TemplateError, match="the value of name must be one line"):
        rendered(name="a\nruncmd: [rm, -rf, /]")
    with pytest.raises(userdata.TemplateError, match="cannot read the cloud-init template"):
        userdata.load(str(tmp_path / "absent.yaml.in"))
    big = tmp_path / "big.yaml.in"
    big.write_text("#cloud-config\n# " + "x" * userdata.MAX_BYTES + "\n")
    with pytest.raises(userdata.TemplateError, match="Nova takes at most"):
        userdata.load(str(big))
    mine = tmp_path / "mine.yaml.in"
    mine.write_text("#cloud-config\nhostname: {{name}}\n")
    assert userdata.render(userdata.load(str(mine)), {"name": "n1"}) == "#cloud-config\nhostname: n1\n"
