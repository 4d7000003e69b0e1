"""The client library as a user VM has it: ``pip install gpud`` alone (no numpy), and an application
that configures logging, or not.

The client-only runs are real (:mod:`tests.isolated`): a fresh interpreter whose path holds only
``gpud``, ``gpud_client``, pyzmq and msgpack; the broker and worker are real daemons (LocalCluster,
CURVE on).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from gpud.security import keygen
from gpud_cli.cluster import LocalCluster
from tests.isolated import ROOT, run_isolated, site_with


def client_only_site(tmp: Path) -> Path:
    """What ``pip install gpud`` gives a user VM's program: the core, the client library, pyzmq
    and msgpack."""
    return site_with(tmp, ["gpud", "gpud_client"], third_party=True)


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "from gpud_client import" in b)
    return example


def test_readme_example_runs_without_numpy(tmp_path: Path) -> None:
    site = client_only_site(tmp_path)
    with LocalCluster(workers=1, gpus_per_worker=1, security="curve", pair=True) as cluster:
        cluster.wait_active()
        clients = cluster.keys / "clients" / "alice"
        clients.mkdir(mode=0o700, parents=True, exist_ok=True)
        public, secret = keygen(tmp_path / "mykeys", "alice")
        shutil.copy(public, clients / public.name)
        code = readme_example()
        for old, new in (('"alice.key_secret"', repr(str(secret))),
                         ('"broker.key"', repr(str(cluster.keys / "broker.key"))),
                         ('["tcp://control-1:5555", "tcp://control-2:5555"]', repr(cluster.frontends))):
            assert old in code, f"the README example no longer has {old}"
            code = code.replace(old, new)
        r = run_isolated(site, "import importlib.util\nassert importlib.util.find_spec('numpy') is None\n" + code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["b'ping'", "array('f', [3.0, 3.0, 3.0, 3.0])"], r.stdout
    assert r.stderr == ""


FAILOVER = """
from gpud_client import Client, Timeout
client = Client(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], timeout=1.5, ping_interval=0.1)
try:
    client.echo(b"x")
except Timeout:
    pass
client.close()
"""
"""A client whose brokers never answer: it fails over between them, logging a WARNING each time."""


def test_library_prints_nothing_where_no_logging_is_configured(tmp_path: Path) -> None:
    site = client_only_site(tmp_path)
    r = run_isolated(site, FAILOVER)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    # The application's logging configuration still decides: it gets the warnings it asks for...
    r = run_isolated(site, "import logging; logging.basicConfig(level=logging.WARNING)\n" + FAILOVER)
    assert r.returncode == 0 and "WARNING:gpud_client" in r.stderr and "failing over to" in r.stderr, r.stderr
    # ...and none when it turns the library's logger down.
    r = run_isolated(site, "import logging; logging.basicConfig(level=logging.WARNING)\n"
                           "logging.getLogger('gpud_client').setLevel(logging.ERROR)\n" + FAILOVER)
    assert r.returncode == 0 and r.stderr == "", r.stderr
