"""The client library as a user VM has it: ``pip install gpud`` alone (no numpy), and an application
that configures logging, or not.

The client-only runs are real: a fresh interpreter (``python -I -S``: no site-packages, no
editable-install finder) whose path holds copies of ``gpud`` and ``gpud_client`` and links to pyzmq
and msgpack, nothing else; the broker and worker are real daemons (LocalCluster, CURVE on).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import zmq

from gpud.security import keygen
from gpud_cli.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


def client_only_site(tmp: Path) -> Path:
    """A directory with what ``pip install gpud`` gives a user VM's program: the core, the client
    library, pyzmq and msgpack."""
    site = tmp / "site"
    site.mkdir()
    for src in (ROOT / "gpud", ROOT / "libclient" / "gpud_client"):
        shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    for module in (zmq, msgpack):
        src = Path(module.__file__ or "").parent
        (site / src.name).symlink_to(src)
        libs = src.parent / f"py{src.name}.libs"  # pyzmq's bundled libzmq, where wheels put it
        if libs.exists():
            (site / libs.name).symlink_to(libs)
    return site


def run_isolated(site: Path, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    boot = f"import sys; sys.path.insert(0, {str(site)!r})\n"
    return subprocess.run([sys.executable, "-I", "-S", "-c", boot + code], capture_output=True, text=True,
                          timeout=timeout, cwd=site)


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
