"""Large job inputs and outputs staged through a real broker pair (PROTOCOL.md §11) while another
client works on the same worker: nothing stalls (no worker, session or peer is taken for silent),
the broker's memory stays bounded, and a SIGKILL of the active broker mid-upload runs the job
exactly once, as does one mid-pull of its outputs. And a passive broker whose spool disk cannot hold an upload fails that one job at
once, not the pair (its own pair: the backup's spool on a 64 MiB file system).

Real daemons (a CURVE Binary Star pair and one worker with two simulated GPUs, labelled
simulated) as subprocesses on loopback, two real clients of two tenants, real jobs under
restricted users.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud.errors import Busy
from gpud.security import CurveKeys
from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Client
from tests.integration.chaos import executions

pytestmark = pytest.mark.timeout(400) if hasattr(pytest.mark, "timeout") else []

MiB = 1 << 20
RSS_BOUND = 400 * MiB  # the active broker's resident memory while 1 GiB is staged through it
STALLS = re.compile(r"passive peer is silent|peer link is full|silent for|WORKER_LOST|SESSION_LOST|was lost")


def payload(nbytes: int, seed: int) -> bytes:
    """``nbytes`` that differ from one block to the next (a wrong offset shows in the checksum)."""
    block = hashlib.sha256(seed.to_bytes(4, "big")).digest() * (MiB // 32)
    out = bytearray(block * (nbytes // MiB))
    for i in range(0, len(out), MiB):
        out[i : i + 8] = i.to_bytes(8, "big")
    return bytes(out)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    rundir = tmp_path_factory.mktemp("large")
    with LocalCluster(workers=1, gpus_per_worker=2, pair=True, rundir=rundir, security="curve",
                      worker_args=["--log-level", "DEBUG"]) as c:
        c.wait_active()
        yield c


def logs(c: LocalCluster) -> dict[str, str]:
    assert c.rundir is not None
    return {p.name: p.read_text(errors="replace") for p in Path(c.rundir).glob("*.log")}


def stalls(c: LocalCluster, before: dict[str, str]) -> list[str]:
    """Lines logged since ``before`` that say something was taken for silent or lost."""
    out = []
    for name, text in logs(c).items():
        new = text[len(before.get(name, "")) :]
        out += [f"{name}: {line}" for line in new.splitlines() if STALLS.search(line)]
    return out


class Other:
    """The second client: a job and a session on the same worker, kept busy until stopped."""

    def __init__(self, endpoints: list[str], keys: CurveKeys) -> None:
        self.endpoints = endpoints
        self.keys = keys
        self.stop = threading.Event()
        self.calls = 0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="other-client")

    def _run(self) -> None:
        try:
            with Client(self.endpoints, timeout=60, curve=self.keys) as c:
                job = c.submit(["sh", "-c", "sleep 4; echo other-done"], gpu_milli=100, time_limit=60)
                with c.session(gpu_milli=100, mem=16 * MiB) as s:
                    x = s.mem_alloc(4096)
                    while not self.stop.is_set():
                        data = self.calls.to_bytes(8, "big") * 512
                        s.memcpy_htod(x, data)
                        if bytes(s.memcpy_dtoh(x)) != data:
                            self.errors.append(f"session copy {self.calls} came back wrong")
                        self.calls += 1
                        time.sleep(0.01)
                out = job.wait()
                if out.exit_code != 0 or out.stdout.strip() != b"other-done":
                    self.errors.append(f"the other job ended {out.exit_code}: {out.stdout!r}")
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Other:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=90)


class Rss:
    """The largest VmRSS of a process, sampled from /proc while in use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss")

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
                        self.samples += 1

    def __enter__(self) -> Rss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def ran_once(thread: threading.Thread, result: dict[str, Any], data: bytes, logs: list[Path],
             before: Counter[str]) -> Counter[str]:
    """Wait for the uploading ``thread``: its job must have seen ``data`` (``result["sum"]``) and
    started exactly once, by the worker ``logs`` (counted since ``before``); the starts by id."""
    thread.join(timeout=240)
    assert not thread.is_alive()
    assert result.get("sum") == hashlib.md5(data).hexdigest(), result
    started = executions(logs)[1] - before
    assert sum(started.values()) == 1, f"the job started {dict(started)}"
    return started


def uploader(pair: LocalCluster, data: bytes, timeout: float = 180.0) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread (not started) that runs ``checksum_job`` on ``data`` as alice, and what it got:
    ``sum``, or ``error``."""
    result: dict[str, Any] = {}
    keys = pair.client_keys("alice")

    def upload() -> None:
        try:
            with Client(pair.frontends, timeout=60, curve=keys) as c:
                result["sum"] = checksum_job(c, data, timeout)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"

    return threading.Thread(target=upload), result


def checksum_job(c: Client, data: bytes, timeout: float = 180.0) -> str:
    out = c.run(["md5sum", "a"], files={"a": data}, gpu_milli=100, time_limit=timeout, timeout=timeout)
    assert out.exit_code == 0, out.stderr
    return out.stdout.split()[0].decode()


def test_300mb_and_1gib_inputs_and_300mb_outputs_while_another_client_works_on_the_worker(
        pair: LocalCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpud_client")
    before = logs(pair)
    big, huge = payload(300 * MiB, 1), payload(1024 * MiB, 2)
    with Other(pair.frontends, pair.client_keys("bob")) as other, \
            Client(pair.frontends, timeout=60, curve=pair.client_keys("alice")) as c:
        assert checksum_job(c, big) == hashlib.md5(big).hexdigest()
        primary = pair.brokers["primary"].pid
        with Rss(primary) as rss:
            assert checksum_job(c, huge) == hashlib.md5(huge).hexdigest()
        del huge
        out = c.run(["sh", "-c", f"yes abcdefgh | head -c {300 * MiB} > out; echo made"], outputs=["out"],
                    gpu_milli=100, time_limit=180, timeout=180)
        assert out.exit_code == 0 and out.stdout == b"made\n", out.stderr
        assert len(out.files["out"]) == 300 * MiB
        assert hashlib.sha256(out.files["out"]).digest() == hashlib.sha256(
            (b"abcdefgh\n" * (300 * MiB // 9 + 1))[: 300 * MiB]).digest()
        time.sleep(0.5)
    assert not other.errors, other.errors
    assert other.calls > 10, "the other client's session made no progress during the uploads"
    assert rss.samples > 10 and rss.peak < RSS_BOUND, f"broker RSS reached {rss.peak >> 20} MiB"
    assert stalls(pair, before) == []
    silent = [r.getMessage() for r in caplog.records if "silent" in r.getMessage()]
    assert silent == [], "a client took its broker for silent"
    status = admin_call(pair.admin_of("primary"), "status")
    # Every staged byte went to the worker on its data connection, none ahead of the control dialog.
    assert status["counters"]["fetches_on_data"] >= 1324 and status["counters"]["fetches_on_control"] == 0
    # And every output byte came back on it too (under CURVE: bound by the worker's own key).
    assert status["counters"]["output_chunks_on_data"] >= 300 and status["counters"]["output_chunks_on_control"] == 0
    spool = status["spool"]
    # The inputs went with their jobs; the outputs stay stage_ttl after their last read (a retry's).
    assert (spool["uploads"], spool["reserved"], spool["stored"]) == (1, 300 * MiB, 300 * MiB)


def test_too_large_comes_before_any_byte_is_sent(pair: LocalCluster, tmp_path: Path) -> None:
    from gpud.errors import TooLarge

    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(5 << 30)  # 5 GiB that take no room: never read, the opening PUT is refused
    with open(sparse, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # unmapped when collected
    admin = pair.admin_of(pair.wait_active())
    before = admin_call(admin, "status")["spool"]
    with Client(pair.frontends, timeout=10, curve=pair.client_keys("alice")) as c:
        with pytest.raises(TooLarge, match=r"max_job_input_bytes \(4294967296\)"):
            c.run(["true"], files={"a": view})
    after = admin_call(admin, "status")["spool"]
    assert (after["reserved"], after["stored"]) == (before["reserved"], before["stored"])  # nothing taken in


def test_sigkill_of_the_active_broker_mid_upload_runs_the_job_exactly_once(pair: LocalCluster) -> None:
    active = pair.wait_active()
    data = payload(300 * MiB, 3)
    worker_logs = [Path(str(pair.rundir)) / f"{w}.log" for w in pair.worker_procs]
    _, jobs_before = executions(worker_logs)
    thread, result = uploader(pair, data)
    admin = pair.admin_of(active)
    held = admin_call(admin, "status")["spool"]["stored"]  # what earlier tests left (their outputs)
    thread.start()
    deadline = time.monotonic() + 60
    while (stored := admin_call(admin, "status")["spool"]["stored"] - held) < 30 * MiB:
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.01)
    pair.kill_broker(active)
    assert stored < len(data), "the upload was over before the kill"
    ran_once(thread, result, data, worker_logs, jobs_before)
    now_active = pair.wait_active()
    assert now_active != active
    # The worker asked the new active broker again, on its data connection to it.
    assert admin_call(pair.admin_of(now_active), "status")["counters"]["fetches_on_data"] > 0


def test_a_passive_with_a_small_spool_disk_bounds_the_uploads_and_the_pair_serves_on(
        small_fs: Path, tmp_path: Path) -> None:
    """The backup's spool on a 64 MiB file system, the primary's not: an upload over the
    backup's room is answered BUSY at once, naming the standby broker; uploads that fit go
    through one after the other (the backup removes the files it keeps for reuse when it needs
    their room) with another tenant's job running meanwhile, the pair never re-syncing; and a
    queued staged job survives the active broker's SIGKILL (PROTOCOL.md §11.4)."""
    (tmp_path / "spool-backup").symlink_to(small_fs)  # the backup's spool_dir (LocalCluster's)
    with LocalCluster(workers=1, gpus_per_worker=1, pair=True, rundir=tmp_path, security="curve") as c:
        assert c.wait_active() == "primary"
        deadline = time.monotonic() + 30
        while (peer_room := admin_call(c.admin_of("primary"), "status")["spool"]["peer_room"]) is None:
            assert time.monotonic() < deadline, "the active broker never heard its peer's spool room"
            time.sleep(0.05)
        assert 40 * MiB < peer_room <= 48 * MiB  # 64 MiB less the 16 of headroom
        with Client(c.frontends, timeout=60, curve=c.client_keys("alice")) as alice, \
                Client(c.frontends, timeout=60, curve=c.client_keys("bob")) as bob:
            other = bob.submit(["sh", "-c", "sleep 1; echo other"], gpu_milli=100, time_limit=60)
            t = time.monotonic()
            with pytest.raises(Busy, match="the standby broker's spool disk has room for [0-9]+ more bytes now"):
                checksum_job(alice, bytes(100 * MiB))
            assert time.monotonic() - t < 10
            for seed in range(3):
                data = payload(40 * MiB, seed)
                assert checksum_job(alice, data) == hashlib.md5(data).hexdigest()
            assert other.wait().stdout == b"other\n"
            assert c.pair_state("primary")["streaming"] is True and c.pair_state("backup")["snapshots"] == 1
            blocker = bob.submit(["sleep", "3"], gpu_milli=1000, time_limit=60)  # the GPU is taken
            time.sleep(0.5)
            data = payload(40 * MiB, 9)
            queued = alice.submit(["md5sum", "a"], files={"a": data}, gpu_milli=1000, time_limit=60)
            c.kill_broker("primary")
            out = queued.wait()
            assert out.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
            assert blocker.wait().exit_code == 0
        assert c.wait_active() == "backup"
        backup_log = (tmp_path / "backup.log").read_text()
        assert "re-syncing" not in backup_log and "cannot write a staged file" not in backup_log


def whole_pair(pair: LocalCluster) -> str:
    """The pair whole again (an earlier test may have killed one) and its passive in sync; the active's role."""
    active = pair.wait_active()
    for role in pair.roles:
        if pair.brokers[role].poll() is not None:
            pair.restart_broker(role)
    deadline = time.monotonic() + 60
    while not pair.pair_state(next(r for r in pair.roles if r != active)).get("synced"):
        assert time.monotonic() < deadline, "the passive broker never got in sync"
        time.sleep(0.05)
    return active


def test_sigkill_of_the_active_broker_mid_pull_of_outputs_gives_them_whole_from_one_run(pair: LocalCluster) -> None:
    """The worker holds a finished job's outputs until a broker ACKs its RESULT (PROTOCOL.md
    §11.5): the active broker SIGKILLed while it pulls them, the new active one pulls them again
    from the worker's hold, and the client gets every byte of the one run (not a second run)."""
    active = whole_pair(pair)
    size = 400 * MiB
    expected = hashlib.sha256((b"abcdefgh\n" * (size // 9 + 1))[:size]).hexdigest()
    worker_logs = [Path(str(pair.rundir)) / f"{w}.log" for w in pair.worker_procs]
    _, jobs_before = executions(worker_logs)
    admin = pair.admin_of(active)
    pulled_before = admin_call(admin, "status")["counters"]["output_chunks_on_data"]
    result: dict[str, Any] = {}

    def pull() -> None:
        try:
            with Client(pair.frontends, timeout=60, curve=pair.client_keys("alice")) as c:
                out = c.run(["sh", "-c", f"yes abcdefgh | head -c {size} > out; echo made"], outputs=["out"],
                            gpu_milli=100, time_limit=180, timeout=180)
                result.update(code=out.exit_code, stdout=out.stdout, n=len(out.files["out"]),
                              sum=hashlib.sha256(out.files["out"]).hexdigest())
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=pull)
    thread.start()
    deadline = time.monotonic() + 120
    while (pulled := admin_call(admin, "status")["counters"]["output_chunks_on_data"] - pulled_before) < 30:
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.005)
    pair.kill_broker(active)
    assert pulled < size // MiB, "the pull was over before the kill"
    thread.join(timeout=240)
    assert not thread.is_alive()
    assert result == {"code": 0, "stdout": b"made\n", "n": size, "sum": expected}
    started = executions(worker_logs)[1] - jobs_before
    assert sum(started.values()) == 1, f"the job started {dict(started)}"
    now_active = pair.wait_active()
    assert now_active != active
    # The new active broker pulled the outputs itself, from the worker's hold, on its data connection.
    assert admin_call(pair.admin_of(now_active), "status")["counters"]["output_chunks_on_data"] > 0
    pair.restart_broker(active)


def test_the_passive_killed_and_restarted_mid_upload_then_the_active_killed_runs_the_job_once(pair: LocalCluster) -> None:
    """Two failures one after the other during one upload: the passive broker is SIGKILLed (the
    active goes on alone), started again (a SNAPSHOT without the bytes, then the active backfills
    them chunk by chunk, PROTOCOL.md §11.4) and, while the upload still runs, the active one is
    SIGKILLed. The new active broker may lack chunks the old one took alone: the client re-opens
    the upload and sends them again. The job runs once, on the right bytes. (512 MiB: the upload
    outlasts a broker's restart.)"""
    active = whole_pair(pair)
    passive = next(r for r in pair.roles if r != active)
    data = payload(512 * MiB, 4)
    worker_logs = [Path(str(pair.rundir)) / f"{w}.log" for w in pair.worker_procs]
    _, jobs_before = executions(worker_logs)
    thread, result = uploader(pair, data, timeout=240)
    admin = pair.admin_of(active)
    held = admin_call(admin, "status")["spool"]["stored"]

    def stored() -> int:
        return int(admin_call(admin, "status")["spool"]["stored"]) - held

    def wait_stored(nbytes: int) -> int:
        deadline = time.monotonic() + 120
        while (got := stored()) < nbytes:
            assert time.monotonic() < deadline and thread.is_alive(), result
            time.sleep(0.01)
        return got

    thread.start()
    wait_stored(10 * MiB)
    pair.kill_broker(passive)
    at_restart = wait_stored(20 * MiB)
    pair.restart_broker(passive)
    deadline = time.monotonic() + 60
    while not pair.pair_state(passive).get("synced"):
        assert time.monotonic() < deadline and thread.is_alive(), f"the passive never got in sync: {result}"
        time.sleep(0.02)
    at_kill = stored()
    pair.kill_broker(active)
    assert at_restart < at_kill < len(data), f"the upload was over before the kill ({at_kill} bytes stored)"
    ran_once(thread, result, data, worker_logs, jobs_before)
    assert pair.wait_active() == passive
    pair.restart_broker(active)
