"""The broker's Prometheus endpoint, scraped over HTTP while a cluster serves work."""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterator

import pytest

pytest.importorskip("prometheus_client", reason="the extra 'metrics' (prometheus-client) is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpud_cli.cluster import LocalCluster  # noqa: E402
from gpud_client import Client  # noqa: E402

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def cluster(job_user_prefix: str | None) -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=2, heartbeat_ms=200, job_user_prefix=job_user_prefix,
                      broker_args=["--metrics", "127.0.0.1:0"]) as c:
        yield c


def scrape(cluster: LocalCluster) -> tuple[set[str], Samples]:
    url = cluster.endpoints["metrics"]
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    families = set()
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return families, samples


def value(samples: Samples, metric: str, **labels: str) -> float:
    got = [v for lab, v in samples.get(metric, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(got) == 1, (metric, labels, samples.get(metric))
    return got[0]


def test_ready_file_names_the_metrics_url(cluster: LocalCluster) -> None:
    assert cluster.endpoints["metrics"].startswith("http://127.0.0.1:")
    assert cluster.endpoints["metrics"].endswith("/metrics")


def test_scrape_after_echoes_and_a_session(cluster: LocalCluster) -> None:
    n = 50
    # Relayed (data_path="broker"): the broker counts the session calls it sees; direct ones it never sees.
    with Client(cluster.frontend, timeout=30, data_path="broker") as client:
        for i in range(n):
            assert client.echo(b"x%d" % i) == b"x%d" % i
        with client.session(gpu_milli=500, mem=1 << 20) as s:
            # Held for a while: half a GPU for at least 0.3 s is at least 0.15 GPU-seconds.
            _, during = scrape(cluster)
            time.sleep(0.3)
            s.synchronize()
        assert value(during, "gpud_sessions", tenant="default", worker="w0") == 1
    families, samples = scrape(cluster)
    for name in ("gpud_broker_info", "gpud_workers", "gpud_gpu_utilization_ratio", "gpud_gpu_memory_used_bytes",
                 "gpud_gpu_memory_total_bytes", "gpud_gpu_temperature_celsius", "gpud_gpu_power_watts",
                 "gpud_gpu_granted_ratio", "gpud_gpu_granted_memory_bytes", "gpud_gpu_health", "gpud_queue_requests",
                 "gpud_requests", "gpud_errors", "gpud_request_duration_seconds", "gpud_retries", "gpud_worker_losses",
                 "gpud_bad_messages", "gpud_tenant_gpu_seconds", "gpud_failovers", "process_cpu_seconds"):
        assert name in families, name
    assert value(samples, "gpud_workers") == 1
    assert value(samples, "gpud_requests_total", kind="echo") >= n
    assert value(samples, "gpud_requests_total", kind="session") >= 1
    assert value(samples, "gpud_requests_total", kind="call") >= 2  # synchronize, close
    assert value(samples, "gpud_request_duration_seconds_count", kind="echo") >= n
    assert value(samples, "gpud_request_duration_seconds_bucket", kind="echo", le="+Inf") >= n
    assert value(samples, "gpud_request_duration_seconds_sum", kind="echo") > 0
    assert value(samples, "gpud_tenant_gpu_seconds_total", tenant="default") >= 0.15
    # Per GPU, with the labels that tie it to its worker VM.
    gpu = dict(worker="w0", gpu="SIM-w0-0", index="0", model="SIM-GPU", simulated="true")
    assert value(samples, "gpud_gpu_memory_total_bytes", **gpu) == 16 << 30
    assert 0 <= value(samples, "gpud_gpu_utilization_ratio", **gpu) <= 1
    assert value(samples, "gpud_gpu_health", state="ok", **gpu) == 1
    assert value(samples, "gpud_gpu_health", state="failed", **gpu) == 0
    assert value(samples, "gpud_gpu_granted_ratio", **gpu) == 0  # everything was released
    assert value(samples, "gpud_broker_info", name="broker", role="standalone") == 1
    assert value(samples, "gpud_failovers_total") == 0


def test_counters_never_go_down_and_errors_have_codes(cluster: LocalCluster) -> None:
    with Client(cluster.frontend, timeout=30) as client:
        with pytest.raises(Exception):  # noqa: B017 (any refusal: the code is checked below)
            client.session(gpu_milli=500, mem=1 << 50)  # more than any GPU has
    _, first = scrape(cluster)
    assert value(first, "gpud_errors_total", code="NO_CAPACITY") >= 1
    seconds = value(first, "gpud_tenant_gpu_seconds_total", tenant="default")
    with Client(cluster.frontend, timeout=30) as client:
        client.echo(b"again")
    _, second = scrape(cluster)
    assert value(second, "gpud_tenant_gpu_seconds_total", tenant="default") >= seconds
    assert value(second, "gpud_request_messages_total") > value(first, "gpud_request_messages_total")


def test_bad_metrics_address_is_refused() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "gpud_cli", "broker", "--security", "none", "--metrics", "nonsense"],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ))
    assert r.returncode == 2 and "HOST:PORT" in r.stderr, r.stderr
