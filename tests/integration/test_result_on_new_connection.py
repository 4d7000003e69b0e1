"""A RESULT that a worker sends on a connection the broker does not know yet (PROTOCOL.md §4.2):
libzmq reconnected the worker's socket by itself, under a new routing id, and the worker does not
know. Real daemons: one standalone broker, one worker of SIMULATED GPUs (heartbeat 1 s x 3).

The worker's process is frozen (SIGSTOP) for 1 s, well within either side's liveness, while its
job runs; meanwhile its TCP connection to the broker's backend is aborted (``ss -K``) and the
job's own process ends. Thawed (SIGCONT), the worker sends the job's RESULT at once, and its socket
carries it on the new connection: the broker drops it (DISCONNECT, unknown worker), and the worker,
which keeps every RESULT until ACKed, holds it in its READY and sends it again after the WELCOME.
(On a loaded machine the job may end before the cut, its RESULT then going on the old connection:
the test then passes without the loss it is about.)
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from gpud_cli.cluster import LocalCluster
from gpud_client import Client
from tests.integration.chaos import executions
from tests.waiting import wait_for


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1, heartbeat_ms=1000, rundir=tmp_path) as c:
        yield c


def test_a_result_sent_on_a_connection_the_broker_does_not_know_yet_reaches_its_client(cluster: LocalCluster) -> None:
    c = cluster
    port = urlparse(str(c.backend)).port
    with Client(c.frontend, timeout=30) as client:
        pending = client.submit(["sh", "-c", "sleep 1; echo done"], gpu_milli=100)
        short_id = pending.id.hex()[:12]
        wait_for(lambda: executions([c.rundir / "w0.log"])[1][short_id] > 0,  # type: ignore[operator]
                 "the job's start", timeout=15)
        time.sleep(0.5)
        proc = c.worker_procs["w0"]
        proc.send_signal(signal.SIGSTOP)
        try:
            cut = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port)],
                                 capture_output=True, text=True)
            assert cut.returncode == 0, cut.stderr
            time.sleep(1.0)  # the job's process ends meanwhile
        finally:
            proc.send_signal(signal.SIGCONT)
        got = pending.wait()  # the worker kept the RESULT the broker dropped, and sent it again
        assert got.exit_code == 0 and got.stdout == b"done\n", got
