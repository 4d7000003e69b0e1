"""A real systemd for tests: Debian's systemd as PID 1 of a new PID namespace, with its own mount
and cgroup namespaces, driven with ``systemctl`` through ``nsenter``.

The recipe: a cgroup directory under the cgroup v2 mount (below this process's own v2 cgroup) that
the namespace's processes start in; ``unshare --pid --fork --mount --cgroup --uts --propagation
private --mount-proc``; inside it, tmpfs on /run, /tmp, /var/lib, /var/cache, /var/log and /var/tmp,
an overlay on /etc (so that systemd-sysusers and the tests' configuration change a private copy,
never the host's), a cgroup2 mount with ``nsdelegate`` on /sys/fs/cgroup, ``SYSTEMD_UNIT_PATH``
naming only a private unit directory (bound at /run/gpud-test/units), and an exec of ``systemd
--system --unit=`` a stub target that pulls in journald only. The network is the host's: the
daemons' TCP sockets on 127.0.0.1 are reachable from the tests as they are.

Only the private directory is searched for units, never Debian's /lib/systemd/system: there,
sysinit.target (which every service with default dependencies requires) pulls in
systemd-tmpfiles-setup, systemd-sysctl and the like, which would act on the host's /tmp and kernel
settings. The private directory gets empty sysinit.target, basic.target and shutdown.target and a
copy of journald's units.

``SystemdNamespace.start()`` returns once the manager answers, or raises ``Unavailable`` with the
reason the kernel (or the machine) gave; the tests skip with that reason. A namespace that is made
but whose systemd does not come up is a failure (RuntimeError), not a skip. ``close()`` kills every
process of the namespace (cgroup.kill) and removes the cgroup.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"
STUB = "gpud-test.target"
INSIDE = "/run/gpud-test"  # the work directory, as the namespace sees it
JOURNALD = ("systemd-journald.service", "systemd-journald.socket", "systemd-journald-dev-log.socket")


class Unavailable(Exception):
    """systemd cannot be booted in a namespace here; the message says why."""


def cgroup2_mount() -> Path | None:
    """Where cgroup v2 is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host)."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def own_cgroup2() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


HIDDEN = ("/root", "/home", "/run/user")  # what ProtectHome=yes hides from the units
PRIVATE_TMP = ("/tmp", "/var/tmp")  # what PrivateTmp=yes replaces with the units' own
PACKAGES = ("gpud", "gpud_broker", "gpud_worker", "gpud_standby", "gpud_client", "gpud_cli")


def _hidden(path: str) -> bool:
    return any(path == h or path.startswith(h + "/") for h in HIDDEN)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _visible(path: str, workdir: Path, name: str) -> str:
    """``path`` as the units see it: itself, or, where PrivateTmp hides it (a checkout or a
    virtualenv under /tmp, as a CI clone may be), a copy in ``workdir`` (hard links where the
    file system allows), which the namespace binds at INSIDE."""
    real = os.path.realpath(path)
    if not any(real == t or real.startswith(t + "/") for t in PRIVATE_TMP):
        return real
    dest = workdir / "copies" / name
    if not dest.exists():
        shutil.copytree(real, dest, symlinks=True, copy_function=_link_or_copy)
    return f"{INSIDE}/{dest.relative_to(workdir)}"


def unit_bindir(workdir: Path) -> Path:
    """A directory of ``gpud`` and ``gpudctl`` that the units can execute, made in ``workdir``.

    The units' ProtectHome=yes hides /root and /home, where this machine's Python (pyenv) lives.
    So the console scripts of this virtualenv are copied into a virtualenv of a Python outside
    those (this one's base if it is, else the system's ``/usr/bin/python3.X``) that reaches this
    virtualenv's packages through a .pth file (same minor version: same ABI). Raises Unavailable
    when the packages themselves are hidden or no such Python exists."""
    site = sysconfig.get_paths()["purelib"]
    if _hidden(os.path.realpath(site)):
        raise Unavailable(f"this virtualenv ({site}) is below {', '.join(HIDDEN)}, which the units' ProtectHome=yes hides")
    base = os.path.realpath(os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}"))
    if _hidden(base) or not os.access(base, os.X_OK):
        base = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        if not os.access(base, os.X_OK):
            raise Unavailable(f"no Python {sys.version_info.major}.{sys.version_info.minor} outside {', '.join(HIDDEN)} "
                              "for the units to run")
    venv = workdir / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True, timeout=120)
    inner_site = Path(subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    # gpud's own packages first, by their source roots (an editable install's finder would map
    # them to paths the units may not see), then this virtualenv's packages.
    lines = []
    for name in PACKAGES:
        package = Path(importlib.import_module(name).__file__ or "").resolve().parent
        lines.append(str(Path(_visible(str(package), workdir, f"src/{name}")).parent))
    lines = list(dict.fromkeys(lines))
    lines.append(f"import site; site.addsitedir({_visible(site, workdir, 'site-packages')!r})")
    (inner_site / "gpud-tests.pth").write_text("\n".join(lines) + "\n")
    here = Path(sys.executable).parent
    for script in ("gpud", "gpudctl"):
        text = (here / script).read_text().split("\n", 1)[1]
        (venv / "bin" / script).write_text(f"#!{INSIDE}/{venv.relative_to(workdir)}/bin/python\n{text}")
        (venv / "bin" / script).chmod(0o755)
    return venv / "bin"


class SystemdNamespace:
    """systemd as PID 1 of a namespace; ``units`` is the private unit directory (searched first)."""

    def __init__(self, workdir: Path, units: Path) -> None:
        if not units.is_relative_to(workdir):
            raise ValueError("the unit directory must be inside the work directory")
        self.workdir = workdir
        self.units = units
        self.pid = 0
        self.cgroup: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.console = workdir / "systemd-console.log"

    # ------------------------------------------------------------------ life

    def start(self, timeout: float = 60.0) -> SystemdNamespace:
        if os.geteuid() != 0:
            raise Unavailable("booting systemd in a namespace needs root (unshare --pid --mount --cgroup)")
        for tool in ("unshare", "nsenter", "systemctl"):
            if shutil.which(tool) is None:
                raise Unavailable(f"{tool} is not installed")
        if not os.access(SYSTEMD, os.X_OK):
            raise Unavailable(f"{SYSTEMD} is not installed (apt-get install systemd)")
        mount = cgroup2_mount()
        if mount is None:
            raise Unavailable("no cgroup v2 hierarchy is mounted: systemd 252 needs one for its namespace")
        self.cgroup = mount / own_cgroup2().lstrip("/") / f"gpud-test-{uuid.uuid4().hex[:8]}"
        try:
            self.cgroup.mkdir()
        except OSError as exc:
            raise Unavailable(f"cannot make a cgroup under {mount}: {exc.strerror}") from None
        (self.units / STUB).write_text(f"[Unit]\nDescription=gpud test stub\nWants={' '.join(JOURNALD)}\n")
        for target in ("sysinit.target", "basic.target", "shutdown.target"):
            (self.units / target).write_text(f"[Unit]\nDescription=stub {target}\nDefaultDependencies=no\n")
        for unit in JOURNALD:
            shutil.copy(Path("/lib/systemd/system") / unit, self.units / unit)
        for d in ("etc-upper", "etc-work"):
            (self.workdir / d).mkdir(exist_ok=True)
        self.workdir.chmod(0o755)  # the units' users read their executables and units in it
        inner = "; ".join([
            "set -e",
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={self.workdir}/etc-upper,workdir={self.workdir}/etc-work /etc",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            f"mkdir {INSIDE}",
            f"mount --bind {self.workdir} {INSIDE}",
            *(f"mount -t tmpfs -o mode=755 tmpfs {d}" for d in ("/var/lib", "/var/cache", "/var/log")),
            *(f"mount -t tmpfs -o mode=1777 tmpfs {d}" for d in ("/tmp", "/var/tmp")),
            "mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup",
            f"export SYSTEMD_UNIT_PATH={INSIDE}/{self.units.relative_to(self.workdir)} container=gpud-test",
            f"exec {SYSTEMD} --system --unit={STUB} --show-status=no",
        ])
        outer = (f'echo $$ > {self.cgroup}/cgroup.procs && exec unshare --pid --fork --mount --cgroup --uts '
                 f'--propagation private --mount-proc sh -c "$0"')
        with open(self.console, "ab") as log:
            self.proc = subprocess.Popen(["sh", "-c", outer, inner], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                said = self.console.read_text(errors="replace").strip()
                self.close()
                raise Unavailable(f"the namespace could not be made: {said.splitlines()[-1] if said else self.proc.returncode}")
            self.pid = self._pid1()
            if self.pid:
                r = self.systemctl("is-system-running", check=False)
                if r.stdout.strip() in ("running", "degraded"):
                    return self
            if time.monotonic() > deadline:  # the namespace was made: a systemd that hangs is a failure
                said = self.console.read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"systemd did not come up within {timeout:.0f}s: {said}")
            time.sleep(0.1)

    def _pid1(self) -> int:
        """The host PID of the namespace's PID 1 (the child of ``unshare --fork``)."""
        assert self.cgroup is not None
        for pid in (self.cgroup / "cgroup.procs").read_text().split():
            comm = Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}").exists() else ""
            if comm == "systemd":
                return int(pid)
        # systemd moves itself into init.scope
        procs = self.cgroup / "init.scope" / "cgroup.procs"
        for pid in (procs.read_text().split() if procs.exists() else []):
            return int(pid)
        return 0

    def close(self) -> None:
        if self.cgroup is not None and self.cgroup.exists():
            try:
                (self.cgroup / "cgroup.kill").write_text("1")
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.cgroup is not None:
            deadline = time.monotonic() + 10
            while self.cgroup.exists():
                for d in sorted((p for p in self.cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    try:
                        d.rmdir()
                    except OSError:
                        pass
                try:
                    self.cgroup.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            self.cgroup = None

    def __enter__(self) -> SystemdNamespace:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inside

    @property
    def root(self) -> Path:
        """The namespace's file system as the host sees it (its /run, /etc overlay, ...)."""
        return Path(f"/proc/{self.pid}/root")

    def run(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``args`` run inside the namespace (its mounts and PIDs), as root."""
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "-C", "-u", "--", *args],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def systemctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, check=check, timeout=timeout)

    def inside(self, path: Path) -> str:
        """``path``, a file of the work directory, as the namespace sees it."""
        return f"{INSIDE}/{path.relative_to(self.workdir)}"

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "-p", prop, "--value", unit).stdout.strip()

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, check=False).stdout
