"""Every configurable placement policy runs in a live broker: echoes and jobs come back right; the
default policy spreads a burst by live utilization and pending work where fgd packs it."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from gpud_cli.cluster import LocalCluster
from gpud_client import BUILTIN, Client

MiB = 1 << 20


@pytest.mark.parametrize("policy", ["fgd", "fgd-balanced", "random", "best-fit", "spread"])
def test_policy_serves_a_live_cluster(policy: str, job_user_prefix: str | None) -> None:
    with LocalCluster(workers=2, gpus_per_worker=2, heartbeat_ms=200, job_user_prefix=job_user_prefix,
                      broker_args=["--policy", policy]) as c:
        assert c.status()["broker"]["policy"] == policy
        with Client(c.frontend, timeout=30) as client:
            pending = [client.submit_echo(bytes([i])) for i in range(100)]
            assert [p.wait() for p in pending] == [bytes([i]) for i in range(100)]
            jobs = [client.submit(["sh", "-c", "echo $0", str(i)], gpu_milli=300) for i in range(8)]
            results = [j.wait() for j in jobs]
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
        assert all(r.exit_code == 0 for r in results)


def _keep_busy(frontend: str, opened: threading.Event, stop: threading.Event, where: list[str]) -> None:
    """A session that keeps its (simulated) GPU computing until ``stop``: live load the ledger
    does not show (it holds a 100-milli share like the others)."""
    n = 512
    with Client(frontend, timeout=30) as client, client.session(gpu_milli=100, mem=4 * n * n * 4) as s:
        where.append(s.gpu["uuid"])
        a, b, c = (s.mem_alloc(n * n * 4) for _ in range(3))
        s.memcpy_htod(a, np.ones(n * n, np.float32))
        s.memcpy_htod(b, np.ones(n * n, np.float32))
        opened.set()
        while not stop.is_set():
            s.launch(BUILTIN, "sgemm", (1,), (1,), (a, b, c, np.int32(n), np.int32(n), np.int32(n)))


@pytest.mark.parametrize("policy", ["default", "fgd"])
def test_default_policy_spreads_a_burst_by_live_load_where_fgd_packs(policy: str) -> None:
    """Four GPUs; one computes hard for a session of 100 milli. Then four more 100-milli sessions
    open in a burst (no heartbeat between them). Every placement packs equally well (the requests
    are all the same small share), so the default policy (fgd-balanced) spreads them by live load:
    one on each idle GPU (the grants since the last heartbeat count), and the fourth, when every
    GPU holds 100 milli, still not on the busy one (its measured utilization). fgd breaks the same
    ties as Best-fit and packs all four onto the busy GPU."""
    args = [] if policy == "default" else ["--policy", policy]
    with LocalCluster(workers=2, gpus_per_worker=2, heartbeat_ms=200, broker_args=args) as c:
        assert c.status()["broker"]["policy"] == ("fgd-balanced" if policy == "default" else policy)
        opened, stop, where = threading.Event(), threading.Event(), []
        busy = threading.Thread(target=_keep_busy, args=(c.frontend, opened, stop, where), daemon=True)
        busy.start()
        try:
            assert opened.wait(60)
            hot = where[0]
            deadline = time.monotonic() + 30
            while True:  # until a heartbeat shows the busy GPU busy
                util = {g["uuid"]: g["util"] for g in c.status()["gpus"]}
                if util[hot] >= 50:
                    break
                assert time.monotonic() < deadline, f"the busy GPU never measured busy: {util}"
                time.sleep(0.05)
            with Client(c.frontend, timeout=30) as client, contextlib.ExitStack() as stack:
                burst = [stack.enter_context(client.session(gpu_milli=100, mem=MiB)) for _ in range(4)]
                gpus = [s.gpu["uuid"] for s in burst]
        finally:
            stop.set()
            busy.join(60)
    if policy == "default":
        assert hot not in gpus and len(set(gpus)) == 3, (hot, gpus)
    else:
        assert gpus == [hot] * 4, (hot, gpus)
