"""The ``gpud`` command as installed pieces: the core alone, a missing extra, and a closing terminal.

The isolated runs are real (:mod:`tests.isolated`): a fresh interpreter whose path holds copies of
only the packages named.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpud_cli.main import EXTRAS
from tests.isolated import COMPONENTS, PACKAGES, ROOT, run_isolated, site_with


def test_version_and_help_with_only_the_core(tmp_path: Path) -> None:
    site = site_with(tmp_path, ["gpud", "gpud_cli"], third_party=False)
    r = run_isolated(site, (
        "import importlib.util\n"
        f"assert all(importlib.util.find_spec(m) is None for m in {COMPONENTS!r}), 'a component is importable'\n"
        "from gpud_cli.main import main\n"
        "rc = main(['version'])\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {COMPONENTS!r})\n"
        "assert not loaded, loaded\n"
        "sys.exit(rc)\n"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("gpud ") and "Traceback" not in r.stderr
    r = run_isolated(site, "from gpud_cli.main import main; main(['--help'])")
    assert r.returncode == 0, r.stderr
    assert all(name in r.stdout for name in ("broker", "worker", "up", "keygen", "version", "config"))


def test_the_core_imports_no_component(tmp_path: Path) -> None:
    site = site_with(tmp_path, ["gpud"], third_party=True)
    modules = sorted(f"gpud.{p.stem}" for p in (ROOT / "gpud").glob("*.py") if p.stem != "__init__")
    r = run_isolated(site, (
        f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {(*COMPONENTS, 'gpud_cli')!r})\n"
        "assert not loaded, loaded\nprint(len(sys.modules))\n"))
    assert r.returncode == 0, r.stderr


def test_a_missing_extra_is_named_not_a_traceback(tmp_path: Path) -> None:
    """Every package of the distribution but none of the extras: the worker's dependencies
    (psutil, nvidia-ml-py, numpy) are not there."""
    site = site_with(tmp_path, list(PACKAGES), third_party=True)
    r = run_isolated(site, (
        "from gpud_cli.main import main\n"
        f"sys.exit(main(['worker', '--security', 'none', '--simulate', '1', '--broker', 'tcp://127.0.0.1:1',"
        f" '--name', 'w', '--workdir', {str(tmp_path / 'jobs')!r}]))\n"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "gpud worker needs the extra 'worker'" in r.stderr and "pip install 'gpud[worker]'" in r.stderr
    # gpud up starts workers: it needs the same extra, and says so at once.
    r = run_isolated(site, "from gpud_cli.main import main; sys.exit(main(['up', '--single', '--workers', '1']))")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "pip install 'gpud[worker]'" in r.stderr


def test_extras_table_matches_setup_cfg() -> None:
    """Each extra EXTRAS names exists in setup.cfg and lists a distribution for that module."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    dist_of = {"pynvml": "nvidia-ml-py", "yaml": "PyYAML", "daemon": "python-daemon",
               "prometheus_client": "prometheus-client", "novaclient": "python-novaclient"}
    for module, extra in EXTRAS.items():
        assert extra in extras, extra
        dist = dist_of.get(module, module)
        assert dist.lower() in extras[extra].lower(), (module, extra)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sighup_stops_up_and_its_children(tmp_path: Path) -> None:
    """A terminal that closes sends SIGHUP to its foreground process group: ``gpud up`` and the
    daemons it started. The daemons take SIGHUP as "re-read the configuration"; ``gpud up`` must
    take it as the end, and stop them."""
    with (tmp_path / "stderr").open("w+") as err, subprocess.Popen(
            [sys.executable, "-m", "gpud_cli", "up", "--single", "--workers", "1", "--simulate", "--no-curve"],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True) as proc:
        children: list[int] = []
        try:
            assert proc.stdout is not None
            lines: list[str] = []
            while not any("running; Ctrl-C stops it" in line for line in lines):
                line = proc.stdout.readline()
                assert line, (lines, (tmp_path / "stderr").read_text())
                lines.append(line)
            children = _children(proc.pid)
            assert len(children) == 2, children  # the broker and the worker
            os.killpg(proc.pid, signal.SIGHUP)
            assert proc.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
            deadline = time.monotonic() + 10
            while any(_alive(c) for c in children) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not [c for c in children if _alive(c)], "children left running after SIGHUP"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for child in children:  # orphans of a failed run
                if _alive(child):
                    os.kill(child, signal.SIGKILL)
