"""An interpreter that has only the packages named: what a host with part of gpud installed runs.

``python -I -S`` (no site-packages, so no editable-install finder either) with ``sys.path`` led by a
directory holding copies of the gpud packages named and, where asked, links to pyzmq and msgpack
(the core's two dependencies) and nothing else: whatever else the code imports fails as it would
on such a host. Real, not a monkeypatched import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"gpud": ROOT / "gpud", "gpud_cli": ROOT / "cli" / "gpud_cli",
            "gpud_broker": ROOT / "broker" / "gpud_broker", "gpud_worker": ROOT / "worker" / "gpud_worker",
            "gpud_standby": ROOT / "standby" / "gpud_standby", "gpud_client": ROOT / "libclient" / "gpud_client"}
"""Every package of the distribution, by import name."""
COMPONENTS = ("gpud_broker", "gpud_worker", "gpud_standby", "gpud_client")


def site_with(tmp: Path, packages: list[str], third_party: bool) -> Path:
    """A directory (under ``tmp``) holding copies of ``packages`` and, with ``third_party``,
    links to pyzmq and msgpack."""
    site = tmp / "site"
    site.mkdir()
    for name in packages:
        shutil.copytree(PACKAGES[name], site / name, ignore=shutil.ignore_patterns("__pycache__"))
    if third_party:
        for module in (zmq, msgpack):
            src = Path(module.__file__ or "").parent
            (site / src.name).symlink_to(src)
            libs = src.parent / f"py{src.name}.libs"  # pyzmq's bundled libzmq, where wheels put it
            if libs.exists():
                (site / libs.name).symlink_to(libs)
    return site


def run_isolated(site: Path, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose path is ``site`` and the standard library."""
    boot = f"import sys; sys.path.insert(0, {str(site)!r})\n"
    return subprocess.run([sys.executable, "-I", "-S", "-c", boot + code], capture_output=True, text=True,
                          timeout=timeout, cwd=site)
