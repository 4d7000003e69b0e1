"""A LocalCluster leaves nothing behind it: not its processes when its start fails part-way, not
its brokers' spooled files when one was killed."""

import glob
import os
import signal
import tempfile
import time

import psutil
import pytest

from gpud.errors import ConfigError
from gpud_cli.cluster import LocalCluster
from gpud_cli.uid_ranges import DYNAMIC_LAST, UidBlocks
from gpud_client import Client


@pytest.mark.skipif(os.geteuid() != 0, reason="dynamic job uids are taken only as root")
def test_a_start_that_fails_after_the_broker_stops_the_broker() -> None:
    base = DYNAMIC_LAST - 15  # one block only, held here: the worker's start cannot get uids
    held = UidBlocks(base, 16, DYNAMIC_LAST)
    try:
        held.take()
    except ConfigError:
        pytest.skip("the last uid block is in use on this host")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with pytest.raises(ConfigError, match="held by another running cluster"):
            with LocalCluster(workers=1, dynamic_uid_base=base):
                pass
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        assert left == []  # the broker it had started is stopped, not orphaned
    finally:
        held.close()


def test_a_killed_brokers_spooled_inputs_go_with_the_cluster() -> None:
    """A staged job input of 20 MiB is spooled to disk (files over 1 MiB are); its broker is
    SIGKILLed while the job runs, so the broker removes nothing itself. Closing the cluster still
    removes the spool: it lies in the cluster's own directory, not in a temporary one of the
    broker's that outlives it (tests and benchmarks had left gigabytes of them in /tmp)."""
    pattern = os.path.join(tempfile.gettempdir(), "gpud-spool-*")
    before = set(glob.glob(pattern))
    # The job outlives its broker, so no cancel reaches it: the worker's drain on close would wait
    # for it (to the cluster's 15 s stop deadline). The test is over by then: a 1 s drain.
    with LocalCluster(workers=1, heartbeat_ms=200, worker_args=["--drain-timeout", "1"]) as cluster:
        assert cluster.rundir is not None
        rundir = cluster.rundir
        with Client(cluster.frontend, timeout=60) as client:
            job = client.submit(["sleep", "30"], files={"a": os.urandom(20 << 20)}, time_limit=40)
            spooled = glob.glob(str(rundir / "spool-*" / "*"))
            assert spooled  # held while the job runs, in the cluster's directory
            assert cluster.broker is not None
            cluster.broker.send_signal(signal.SIGKILL)
            cluster.broker.wait(10)
            job.cancel()
    deadline = time.monotonic() + 5
    while rundir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rundir.exists()
    assert set(glob.glob(pattern)) <= before
