"""Every configurable placement policy runs in a live broker: echoes and jobs come back right."""

from __future__ import annotations

import pytest

from gpud_cli.cluster import LocalCluster
from gpud_client import Client


@pytest.mark.parametrize("policy", ["fgd", "random", "best-fit", "spread"])
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
