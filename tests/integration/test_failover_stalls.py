"""Chaos: daemons that hang instead of dying (SIGSTOP, then SIGCONT), under load. A hung process
is the failure a peer cannot tell from a dead one until it wakes up with stale tables, an old
epoch and a socket full of old messages: the active broker, the passive one (which is also what
a cut link between the pair looks like from the active side) and a worker. Through each, nothing
accepted may be lost, no job (none is idempotent here) may run twice, and no daemon may crash.

Real daemons (a Binary Star pair and simulated-GPU workers, labelled simulated) as subprocesses on
loopback, the real client library, real jobs under restricted users.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud_cli.cluster import LocalCluster, admin_call
from tests.integration.chaos import Outcome, duplicates, executions, run_load
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []

CLIENTS, ECHOES, JOBS = 3, 150, 20


def _cluster(tmp_path: Path, liveness: int) -> LocalCluster:
    return LocalCluster(workers=2, gpus_per_worker=2, pair=True, heartbeat_ms=250, liveness=liveness,
                        rundir=tmp_path, worker_args=["--log-level", "DEBUG", "--slots", "64"])


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[LocalCluster]:
    # Silence counts as a worker's loss after 3 s (the defaults' 1 s x 3): only the process the
    # test stops is to look lost, not one starved by a loaded machine.
    with _cluster(tmp_path, liveness=12) as c:
        c.wait_active()
        yield c


def _synced(c: LocalCluster, role: str) -> bool:
    st = c.pair_state(role)
    return st.get("state") == "passive" and bool(st.get("synced"))


def _workers_known(c: LocalCluster, role: str) -> bool:
    known = {w.get("name") for w in admin_call(c.admin_of(role), "workers", {})}
    return set(c.worker_procs) <= known


def _checked(c: LocalCluster, out: Outcome, what: str) -> tuple[int, int]:
    """Assert that every request came back right and that no job ran twice; (jobs, echo reruns)."""
    logs = [c.rundir / f"{w}.log" for w in c.worker_procs]  # type: ignore[operator]
    echo_runs, job_runs = executions(logs)
    report = (f"{what}: ok {out.ok}, lost {out.lost}, wrong {len(out.wrong)}, job duplicates "
              f"{duplicates(out.job_ids, job_runs)}, echo reruns {duplicates(out.echo_ids, echo_runs)}")
    assert not out.wrong, f"{report}\nfirst wrong: {out.wrong[:5]}"
    assert duplicates(out.job_ids, job_runs) == 0, report  # never twice, whatever else happened
    failed = [e.split()[1].rstrip(":") for e in out.errors if e.startswith("job ")]
    assert duplicates(failed, job_runs) == 0, f"{report}: a failed job ran twice"
    assert all(job_runs[j] >= 1 for j in out.job_ids), f"{report}: a job answered without running"
    return len(out.job_ids), duplicates(out.echo_ids, echo_runs)


def _alive(c: LocalCluster) -> None:
    for name, proc in {**c.brokers, **c.worker_procs}.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{c.log_tail(name)}"


def test_a_hung_active_broker_is_replaced_and_steps_down_when_it_wakes(pair: LocalCluster) -> None:
    """The active broker stops answering mid-load (SIGSTOP): the passive one takes over once the
    clients turn to it and no worker hears the old one. Woken up (SIGCONT) with its old epoch,
    its old tables and everything its sockets queued meanwhile, the old one must step down without
    dispatching, answering or starting anything twice."""
    assert wait_for(lambda: _synced(pair, "backup"), "the backup in sync")
    woke: list[str] = []

    def hang_then_wake() -> None:
        time.sleep(0.3)
        pair.brokers["primary"].send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: pair.pair_state("backup").get("state") == "active", "the backup to take over", timeout=60)
        finally:
            pair.brokers["primary"].send_signal(signal.SIGCONT)
            woke.append("primary")

    out = run_load(pair.frontends, CLIENTS, ECHOES, JOBS, during=hang_then_wake)
    assert woke
    _checked(pair, out, "primary hung")
    assert not out.errors, out.errors[:5]
    assert out.ok == CLIENTS * (ECHOES + JOBS)
    assert pair.wait_active() == "backup"  # the woken one stepped down: one active broker
    assert wait_for(lambda: _synced(pair, "primary"), "the woken primary back in sync", timeout=30)
    _alive(pair)


def test_a_hung_passive_broker_costs_the_load_nothing_and_resyncs(pair: LocalCluster) -> None:
    """The passive broker hangs mid-load (as a cut link between the pair looks from the active
    side): the active one serves on, acknowledging results without it. Woken up, the passive one
    must neither take over (its peer is alive: it is the one that was silent) nor keep stale
    tables: it re-syncs, and a SIGKILL of the active one after that still loses nothing."""
    assert wait_for(lambda: _synced(pair, "backup"), "the backup in sync")

    def hang_then_wake() -> None:
        pair.brokers["backup"].send_signal(signal.SIGSTOP)
        time.sleep(2.0)  # well past the peer expiry (0.75 s)
        pair.brokers["backup"].send_signal(signal.SIGCONT)

    out = run_load(pair.frontends, CLIENTS, ECHOES, JOBS, during=hang_then_wake)
    _checked(pair, out, "backup hung")
    assert not out.errors, out.errors[:5]
    assert out.ok == CLIENTS * (ECHOES + JOBS)
    assert pair.wait_active() == "primary"
    assert pair.pair_state("backup").get("state") == "passive"
    assert wait_for(lambda: _synced(pair, "backup"), "the woken backup back in sync", timeout=30)
    assert wait_for(lambda: _workers_known(pair, "backup"), "the workers back with the backup", timeout=30)

    out = run_load(pair.frontends, CLIENTS, ECHOES, JOBS, during=lambda: (time.sleep(0.3), pair.kill_broker("primary")))
    _checked(pair, out, "primary killed after the backup woke")
    assert not out.errors, out.errors[:5]
    assert out.ok == CLIENTS * (ECHOES + JOBS)
    assert pair.wait_active() == "backup"


def test_a_hung_worker_is_lost_once_and_runs_nothing_twice_when_it_wakes(tmp_path: Path) -> None:
    """A worker hangs mid-load past its liveness (1 s here): the broker counts it lost, places
    again what it had not told GO and fails what it had (WORKER_LOST). Woken up, the worker still
    holds those jobs and asks to start them: a job placed again elsewhere must not begin here too,
    and nothing else may fail."""
    with _cluster(tmp_path, liveness=4) as c:
        c.wait_active()

        def hang_then_wake() -> None:
            time.sleep(0.3)
            c.worker_procs["w0"].send_signal(signal.SIGSTOP)
            time.sleep(2.5)
            c.worker_procs["w0"].send_signal(signal.SIGCONT)

        out = run_load(c.frontends, CLIENTS, ECHOES, JOBS, during=hang_then_wake)
        _checked(c, out, "w0 hung")
        not_lost = [e for e in out.errors if "WORKER_LOST" not in e]
        assert not not_lost, not_lost[:5]  # only a job that may have begun may fail, and only so
        assert out.ok + out.lost == CLIENTS * (ECHOES + JOBS)
        assert all(e.startswith("job ") for e in out.errors), out.errors[:5]  # an echo is placed again
        assert wait_for(lambda: c.status(role="primary")["counts"]["workers"] == 2, "w0 back")
        _alive(c)


def test_stopping_the_active_broker_hands_its_work_to_the_passive_one(pair: LocalCluster) -> None:
    """An operator stops the active broker of an in-sync pair under load (SIGTERM: systemctl stop
    or restart). The passive one holds every accepted request; none may end in an error."""
    assert wait_for(lambda: _synced(pair, "backup"), "the backup in sync")
    out = run_load(pair.frontends, CLIENTS, ECHOES, JOBS,
                   during=lambda: (time.sleep(0.3), pair.kill_broker("primary", signal.SIGTERM)))
    _checked(pair, out, "primary stopped")
    assert not out.errors, out.errors[:5]
    assert out.ok == CLIENTS * (ECHOES + JOBS)
    assert pair.wait_active() == "backup"
