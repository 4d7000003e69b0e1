"""Debian's MariaDB server for the tests' Nova, on a private unix socket (no TCP), its data in a
directory of the test run: nova's services in one process lock sqlite even at one boot at a time.

``MariaDB(datadir).start()`` initialises the directory if it is empty (mariadb-install-db) and
starts ``mariadbd`` as root with no networking; ``url(db)`` is the SQLAlchemy URL of a database;
``stop()`` shuts it down cleanly (so that the directory can be copied as a template).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

SERVER = "/usr/sbin/mariadbd"


class MariaDB:
    def __init__(self, datadir: Path) -> None:
        self.datadir = datadir
        self.socket = datadir / "mysqld.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> str:
        """Why it cannot run here, or ''."""
        if not Path(SERVER).exists() or shutil.which("mariadb-install-db") is None:
            return "mariadb-server is not installed (make test installs it with apt-get)"
        return ""

    def url(self, db: str) -> str:
        return f"mysql+pymysql://root@localhost/{db}?unix_socket={self.socket}&charset=utf8"

    def start(self, timeout: float = 60.0) -> MariaDB:
        if not (self.datadir / "mysql").exists():
            self.datadir.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={self.datadir}", "--user=root",
                                "--auth-root-authentication-method=normal", "--skip-test-db",
                                "--innodb-log-file-size=8M"], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"mariadb-install-db exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        self.socket.unlink(missing_ok=True)
        log = open(self.datadir / "server.log", "ab")
        self.proc = subprocess.Popen(
            [SERVER, "--no-defaults", f"--datadir={self.datadir}", f"--socket={self.socket}", "--skip-networking",
             "--user=root", f"--pid-file={self.datadir}/mariadbd.pid", "--innodb-log-file-size=8M",
             "--innodb-buffer-pool-size=64M", "--innodb-flush-log-at-trx-commit=0", "--skip-log-bin",
             "--max-connections=500", "--character-set-server=utf8mb3", "--collation-server=utf8mb3_general_ci"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while self.sql("SELECT 1", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mariadbd did not start: {(self.datadir / 'server.log').read_text()[-3000:]}")
            time.sleep(0.1)
        return self

    def sql(self, statement: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(["mariadb", "--no-defaults", f"--socket={self.socket}", "-uroot", "-N", "-e", statement],
                           capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise RuntimeError(f"mariadb: {statement}: {r.stderr}")
        return r

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # mariadbd shuts down cleanly on SIGTERM
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
