"""A job that began on a worker that restarted while the active broker died is not begun again by
the broker that takes over (PROTOCOL.md §9.4, settling): the new worker process does not list
it, so it ends WORKER_LOST (it is not idempotent) instead of being dispatched to the new process.

Real daemons (a Binary Star pair and one simulated-GPU worker, labelled simulated) as subprocesses
on loopback, the real client library, a real job under a restricted user.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.errors import GpudError
from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.integration.chaos import RECONNECT_MAX, executions
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[LocalCluster]:
    # Liveness 2 s (8 x 0.25 s): the passive broker forgets the killed worker's connection after
    # it, and only then admits the restarted process under the same name.
    with LocalCluster(workers=0, gpus_per_worker=1, pair=True, heartbeat_ms=250, liveness=8, rundir=tmp_path,
                      worker_args=["--log-level", "DEBUG", *RECONNECT_MAX]) as c:
        c.add_worker("w0")
        c.wait_workers(1)
        assert c.wait_active() == "primary"
        # The job must be in the backup's tables before the primary dies (the test's premise). A
        # heard backup gets it before the job's GO (PROTOCOL.md §9.3, Durable); one not heard yet
        # when the GO went out (it started late) would leave the backup nothing to settle against.
        wait_for(lambda: (st := c.pair_state("backup")).get("state") == "passive" and bool(st.get("synced")),
                 "the backup to be passive and in sync")
        yield c


def test_a_job_begun_on_a_worker_that_restarted_across_a_failover_is_not_begun_again(pair: LocalCluster) -> None:
    c = pair
    assert c.rundir is not None
    log = c.rundir / "w0.log"
    backup_log = c.rundir / "backup.log"
    # The job's client turns to the backup only after 8-16 s of silence: the takeover is made
    # first, below, once the restarted worker is known to the backup.
    with Client(c.frontends, timeout=90, ping_interval=8.0) as job_client:
        job = job_client.submit(["sh", "-c", "sleep 3; echo once"], gpu_milli=100)
        short = job.id.hex()[:12]
        wait_for(lambda: executions([log])[1][short] == 1, "the job to start on w0")
        c.kill_broker("primary")
        c.kill_worker("w0")
        readies = backup_log.read_text().count("worker w0 ready")
        c.add_worker("w0")  # another process: it holds nothing
        wait_for(lambda: backup_log.read_text().count("worker w0 ready") > readies,
                 "the backup to admit the restarted w0", timeout=30)
        with Client([c.frontends[1]], timeout=30) as voter:  # a client's vote: the backup takes over
            assert voter.submit_echo(b"after").wait() == b"after"
        with pytest.raises(GpudError) as lost:
            job.wait()
    text = backup_log.read_text()
    took_over = text.index("settling with")
    assert text.rfind("worker w0 ready", 0, took_over) > text.find("worker w0 ready"), \
        "the restarted w0 reached the backup only after its takeover: not the case this test is about"
    assert lost.value.code == "WORKER_LOST", lost.value
    assert executions([log])[1][short] == 1, "the job began a second time on the restarted worker"
