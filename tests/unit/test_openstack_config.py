"""The ``[openstack]`` keys and ``[worker] instance_id`` (gpud.config): defaults, checks, and the
checks across keys that apply once OpenStack is enabled."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpud.config import load
from gpud.errors import ConfigError


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    return str(path)


def test_defaults_are_off_and_recognise_workers_by_metadata(tmp_path: Path) -> None:
    o = load(None, {}, default_path=str(tmp_path / "absent.toml")).openstack
    assert (o.enabled, o.heal, o.scale) == (False, False, False)
    assert o.worker_metadata == {"gpud:role": "worker"} and o.worker_tags == ()


def test_a_full_section_loads(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, """
[openstack]
enabled = true
cloud = "gpu"
image = "ubuntu-gpu"
flavor = "g1.a100"
worker_tags = ["gpud", "gpu"]
brokers = ["tcp://control-1:5556", "tcp://control-2:5556"]
min_workers = 1
max_workers = 8
heal = true
heal_after = 60
scale = true
"""), {"GPUD_OPENSTACK_API_RETRIES": "5"})
    o = cfg.openstack
    assert o.worker_tags == ("gpud", "gpu") and o.brokers[1] == "tcp://control-2:5556"
    assert o.heal_after == 60.0 and isinstance(o.heal_after, float) and o.api_retries == 5


@pytest.mark.parametrize(("lines", "problem"), [
    ('worker_tags = ["a/b"]', "[openstack] worker_tags: a tag is 1-60 characters"),
    ('name_prefix = "-gpu"', "[openstack] name_prefix: must be 1-40 of [A-Za-z0-9-]"),
    ('brokers = ["control:5556"]', "[openstack] brokers: must be an endpoint"),
    ("heal_after = 0", "[openstack] heal_after: must be > 0"),
    ("api_retries = -1", "[openstack] api_retries: must be >= 0"),
    ("enabled = true\nworker_metadata = {}", "worker_metadata or worker_tags must say which servers"),
    ("enabled = true\nscale = true", "[openstack] scale needs max_workers >= 1"),
])
def test_bad_values_are_refused_with_the_key(tmp_path: Path, lines: str, problem: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(write(tmp_path, f"[openstack]\n{lines}\n"), {})
    assert problem in e.value.message


def test_worker_instance_id(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.toml")
    assert load(None, {"GPUD_WORKER_INSTANCE_ID": "auto"}, default_path=absent).worker.instance_id == "auto"
    sid = "5f0c0e0a-93a5-4c64-9d43-1a2b3c4d5e6f"
    assert load(None, {"GPUD_WORKER_INSTANCE_ID": sid}, default_path=absent).worker.instance_id == sid
    with pytest.raises(ConfigError, match="instance_id.*must be a Nova server id"):
        load(None, {"GPUD_WORKER_INSTANCE_ID": "a b"}, default_path=absent)
