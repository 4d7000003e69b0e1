"""Chaos: workers SIGKILLed at random moments under bursts of non-idempotent jobs, round after round.

Each job's first command writes a mark (its job id and its shell's pid) into a FIFO that the
test reads and that outlives the workers, so the marks say which jobs began, and how often. A
FIFO because a job runs in its sandbox (gpud_worker.sandbox): its
/tmp is its own and the VM's files are read-only there, but a FIFO of the VM (under /run) can
still be written. A job may
fail (WORKER_LOST) only if it may have begun: the broker told its worker GO (PROTOCOL.md §4.4,
one broker DEBUG line per GO). Between a GO and the job's first command lies the fork and exec of
its shell, which a kill can hit: such a job failed with no mark, and is counted apart. A job that
never began, waiting for its turn to start behind the others or for its GO, is placed again on a
live worker and ends with its result. No job ever begins twice.
"""

from __future__ import annotations

import os
import random
import re
import signal
import tempfile
import threading
from collections import Counter
from pathlib import Path

from gpud.errors import GpudError
from gpud_cli.cluster import LocalCluster
from gpud_client import Client

ROUNDS = 12
JOBS = 30  # per round, all submitted at once over three workers
KILL_WITHIN_S = 1.2  # the kill lands at a random moment this long after the burst is submitted
UID_BASE = 62_000  # as root, each worker's 16 job uids are a block from here up (apart from other tests' 61184..)
_GO = re.compile(r"GO ([0-9a-f]{32}) to ")
_LOST = re.compile(r"worker w\d+ lost \(.*?\): (\d+) task")


class Marks:
    """A FIFO that jobs write one line each into, read by a thread of the test."""

    def __init__(self) -> None:
        base = "/run" if os.geteuid() == 0 and os.access("/run", os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="gpud-chaos-", dir=base))
        self.dir.chmod(0o755)
        self.path = self.dir / "marks"
        os.mkfifo(self.path, 0o622)
        self.path.chmod(0o622)  # pool users write, whatever the umask
        self.fd = os.open(self.path, os.O_RDWR)  # held open both ways: a writer never blocks
        self.data = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk or b"\0" in chunk:
                self.data += chunk.replace(b"\0", b"")
                return
            self.data += chunk

    def close(self) -> Counter[str]:
        os.write(self.fd, b"\0")
        self.thread.join(10)
        os.close(self.fd)
        self.path.unlink()
        self.dir.rmdir()
        return Counter(line.split(".")[0] for line in self.data.decode().split())


def test_jobs_that_never_began_survive_workers_killed_at_random() -> None:
    rng = random.Random()
    # A killed worker is suspended after 0.6 s of silence (its jobs not yet told GO placed again
    # then) and lost one liveness period later, not three: each round waits for its loss.
    with LocalCluster(workers=0, heartbeat_ms=200, log_level="DEBUG", dynamic_uid_base=UID_BASE,
                      env={"GPUD_BROKER_WORKER_RESUME_PERIODS": "1"}) as c:
        assert c.rundir is not None
        marks = Marks()
        names = ["w0", "w1", "w2"]
        c.add_worker("w0")
        c.add_worker("w1", extra=["--replica-of", "w0"])
        c.add_worker("w2")
        c.wait_workers(3)
        outcomes: dict[str, str] = {}  # job id (hex) -> "ok" or the error code
        wrong: list[str] = []
        with Client(c.frontend, timeout=90) as client:
            for rnd in range(ROUNDS):
                victim = rng.choice(names)
                pend = []
                for i in range(JOBS):
                    tag = f"{rnd}-{i}"
                    script = f'echo "$GPUD_JOB_ID".$$ > {marks.path}; sleep {rng.uniform(0.05, 0.4):.2f}; echo {tag}'
                    pend.append((tag, client.submit(["sh", "-c", script], gpu_milli=10, time_limit=30)))
                # A new worker in the victim's place, under a new name, starts as soon as it is
                # dead (while the round's jobs finish): its pool uids are its own (a worker kills
                # whatever runs as its pool users after each job), a block of the cluster's, under
                # its lock file (a fixed range here was shared with another run of this test on
                # the host: each one's workers killed the other's jobs, exit -9).
                fresh = f"w{3 + rnd}"

                def kill_and_replace(v: str = victim, new: str = fresh) -> None:
                    c.kill_worker(v, signal.SIGKILL)
                    c.add_worker(new)

                killer = threading.Timer(rng.uniform(0.0, KILL_WITHIN_S), kill_and_replace)
                killer.start()
                for tag, p in pend:
                    try:
                        got = p.wait()
                    except GpudError as exc:
                        outcomes[p.id.hex()] = exc.code
                        continue
                    outcomes[p.id.hex()] = "ok"
                    if got.exit_code != 0 or got.stdout.decode().strip() != tag:
                        wrong.append(f"{tag}: {got!r}")
                killer.join()
                c.worker_procs.pop(victim)
                names[names.index(victim)] = fresh
                c.wait_workers(3)
        broker_log = (c.rundir / "broker.log").read_text(errors="replace")
        told_go = set(_GO.findall(broker_log))
        lost_with_work = sum(int(n) for n in _LOST.findall(broker_log))
        began = marks.close()

    assert len(outcomes) == ROUNDS * JOBS
    assert wrong == []
    twice = {j: n for j, n in began.items() if n > 1}
    assert twice == {}, f"jobs that began twice: {twice}"
    failed = {j: code for j, code in outcomes.items() if code != "ok"}
    assert set(failed.values()) <= {"WORKER_LOST"}, failed
    never_told = [j for j in failed if j not in told_go]
    assert never_told == [], f"{len(never_told)} job(s) failed that the broker had never told GO"
    unmarked = [j for j in failed if j not in began]  # told GO; the kill hit their fork and exec
    assert all(began[j] == 1 for j, code in outcomes.items() if code == "ok")
    print(f"{ROUNDS} rounds of {JOBS} jobs: {len(failed)} failed (may have begun), of which "
          f"{len(unmarked)} were killed between GO and their first command; 0 began twice")
    assert lost_with_work > 0, "no kill hit a worker with jobs on it"
