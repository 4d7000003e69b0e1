"""Load for chaos tests and the failover benchmark: several real clients with echo requests and
jobs in flight, every result checked, executions counted from the workers' logs.

A job prints its own number; an echo returns its payload. ``Load.run`` starts the clients, calls
``during`` while everything is in flight (the chaos: a SIGKILL), and returns the outcome.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpud.errors import GpudError
from gpud_client import Client

RECONNECT_MAX = ["--reconnect-max", "0.5"]
"""Worker flags for a test that waits for workers to be back with a restarted broker: they retry a
dead one every 0.5 s at most, not every 5 s (the default backoff is not what such a test is about)."""

_JOB = re.compile(r"job ([0-9a-f]{12})[0-9a-f]* started")
_ECHO = re.compile(r"echo ([0-9a-f]{12})\b")


@dataclass
class Outcome:
    ok: int = 0
    wrong: list[str] = field(default_factory=list)  # results that came back but were not right
    errors: list[str] = field(default_factory=list)  # requests that ended in an error
    echo_ids: list[str] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return len(self.errors)


def executions(logs: list[Path]) -> tuple[Counter[str], Counter[str]]:
    """(echo executions, job executions) by short id, counted from worker logs."""
    echo: Counter[str] = Counter()
    jobs: Counter[str] = Counter()
    for path in logs:
        if not path.exists():
            continue
        text = path.read_text(errors="replace")
        echo.update(_ECHO.findall(text))
        jobs.update(_JOB.findall(text))
    return echo, jobs


def duplicates(ids: list[str], counts: Counter[str]) -> int:
    return sum(max(0, counts[i] - 1) for i in ids)


def run_load(endpoints: list[str], clients: int, echoes: int, jobs: int, during: Callable[[], None],
             timeout: float = 60.0, job_sleep: float = 0.2, client_kw: dict[str, object] | None = None) -> Outcome:
    """``clients`` threads, each with its own Client, submit ``echoes`` echo requests and ``jobs``
    non-idempotent jobs (all in flight at once), then wait for every result."""
    out = Outcome()
    lock = threading.Lock()
    submitted = threading.Barrier(clients + 1)

    def one(n: int) -> None:
        with Client(endpoints, timeout=timeout, **(client_kw or {})) as c:  # type: ignore[arg-type]
            pend = []
            try:
                for i in range(jobs):
                    tag = f"{n}-{i}"
                    j = c.submit(["sh", "-c", f"sleep {job_sleep}; echo {tag}"], gpu_milli=10, time_limit=30)
                    pend.append(("job", tag, j))
                for i in range(echoes):
                    payload = f"{n}:{i}".encode()
                    pend.append(("echo", payload, c.submit_echo(payload, timeout=timeout)))
            finally:
                submitted.wait()
            for kind, expect, p in pend:
                short = p.id.hex()[:12]
                try:
                    got = p.wait()
                except GpudError as exc:
                    with lock:
                        out.errors.append(f"{kind} {short}: {exc.code} {exc}")
                    continue
                if kind == "echo":
                    right = got == expect
                else:
                    right = got.exit_code == 0 and got.stdout.decode().strip() == expect
                with lock:
                    (out.echo_ids if kind == "echo" else out.job_ids).append(short)
                    if right:
                        out.ok += 1
                    else:
                        out.wrong.append(f"{kind} {short}: {got!r}")

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    submitted.wait()
    during()
    deadline = time.monotonic() + timeout + 30
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic()))
    return out
