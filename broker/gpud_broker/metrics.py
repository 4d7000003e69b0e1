"""The broker's Prometheus endpoint (extra ``metrics``: prometheus-client).

A custom collector reads the broker core's state when Prometheus scrapes, so serving requests costs
nothing beyond the plain counters the core keeps anyway (``BrokerCore.counters`` and ``.stats``).
It runs in prometheus-client's HTTP thread while the broker thread changes that state: it copies
each dict and list it walks in one step (``list(d.values())`` runs under the GIL without a switch),
retries the whole scrape when a dict still changed size under it, and never lets a counter go down.
The per-tenant chain (tenant -> session or request -> worker VM -> GPU) is what a GPU exporter alone
cannot show: GPU-seconds granted per tenant, queue depth per tenant, sessions per tenant and worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

import gpud
from gpud.errors import ConfigError
from gpud_broker.core import BrokerCore
from gpud_broker.stats import Histogram

log = logging.getLogger(__name__)

HEALTH_STATES = ("ok", "degraded", "failed", "cordoned")
GPU_LABELS = ["worker", "gpu", "index", "model", "simulated"]


class BrokerCollector(Collector):
    """Every ``gpud_*`` metric family, read from ``core`` at scrape time."""

    def __init__(self, core: BrokerCore, clock: Callable[[], float] = time.monotonic, role: str = "standalone") -> None:
        self.core = core
        self.clock = clock
        self.role = role
        self._gpu_seconds: dict[str, float] = {}  # last exported, so the counter never goes down

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on the live state; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        for _ in range(5):
            try:
                return self._collect()
            except RuntimeError:  # "dictionary changed size during iteration": read again
                continue
        log.warning("metrics scrape gave up: the broker state kept changing under it")
        return []

    def _collect(self) -> list[Metric]:
        core = self.core
        now = self.clock()
        out: list[Metric] = []

        info = InfoMetricFamily("gpud_broker", "This broker: name, version, policy and role.")
        info.add_metric([], {"name": core.config.name, "version": gpud.__version__,
                             "policy": core.config.policy, "role": self.role})
        out.append(info)
        out.append(GaugeMetricFamily("gpud_broker_uptime_seconds", "Seconds since the broker started.",
                                     value=max(0.0, now - core.started)))

        # Workers and their GPUs.
        workers = list(core.registry.by_identity.values())
        out.append(GaugeMetricFamily("gpud_workers", "Connected workers (GPU VMs).", value=len(workers)))
        out.append(GaugeMetricFamily(
            "gpud_workers_suspended", "Connected workers suspended now: silent past their liveness, in their grace window "
            "(counted in gpud_workers; nothing new is placed on them).", value=sum(1 for w in workers if w.suspended_at)))
        inflight = GaugeMetricFamily("gpud_worker_inflight_requests", "Requests dispatched to a worker and not answered.", labels=["worker"])
        draining = GaugeMetricFamily("gpud_worker_draining", "1 while a worker takes no new work.", labels=["worker"])
        heard = GaugeMetricFamily("gpud_worker_last_heard_seconds", "Seconds since a worker was last heard.", labels=["worker"])
        isolation = GaugeMetricFamily("gpud_worker_isolation", "1 for how the worker isolates user work (READY): namespaces "
                                      "(with its job network) or rlimits only.", labels=["worker", "level", "job_network"])
        held = GaugeMetricFamily("gpud_worker_held_output_bytes", "Finished jobs' staged outputs a worker holds until a "
                                 "broker fetches them (its max_held_output_bytes bounds them).", labels=["worker"])
        pool_free = GaugeMetricFamily("gpud_worker_pool_users_free", "Pool users of a worker that no placed job or session holds.",
                                      labels=["worker"])
        util = GaugeMetricFamily("gpud_gpu_utilization_ratio", "GPU utilization (0-1) at the last heartbeat.", labels=GPU_LABELS)
        used = GaugeMetricFamily("gpud_gpu_memory_used_bytes", "Device memory in use at the last heartbeat.", labels=GPU_LABELS)
        total = GaugeMetricFamily("gpud_gpu_memory_total_bytes", "Device memory of the GPU.", labels=GPU_LABELS)
        temp = GaugeMetricFamily("gpud_gpu_temperature_celsius", "GPU temperature at the last heartbeat.", labels=GPU_LABELS)
        power = GaugeMetricFamily("gpud_gpu_power_watts", "GPU power draw at the last heartbeat.", labels=GPU_LABELS)
        granted = GaugeMetricFamily("gpud_gpu_granted_ratio", "Share of the GPU granted by the broker (granted milli-GPU / 1000).", labels=GPU_LABELS)
        granted_mem = GaugeMetricFamily("gpud_gpu_granted_memory_bytes", "Device memory granted by the broker.", labels=GPU_LABELS)
        grants = GaugeMetricFamily("gpud_gpu_grants", "Grants held on the GPU (running work and open sessions).", labels=GPU_LABELS)
        health = GaugeMetricFamily("gpud_gpu_health", "1 for the GPU's health state (cordoned by an operator wins), 0 for the others.",
                                   labels=[*GPU_LABELS, "state"])
        for w in workers:
            inflight.add_metric([w.name], w.inflight)
            draining.add_metric([w.name], 1.0 if w.draining else 0.0)
            heard.add_metric([w.name], max(0.0, now - w.liveness.last_heard))
            isolation.add_metric([w.name, w.isolation or "unknown", w.job_network or "unknown"], 1.0)
            held.add_metric([w.name], w.held_outputs)
            if w.pool_users:
                pool_free.add_metric([w.name], max(0, w.pool_users - sum(list(w.pool_held.values()))))
            for gpu in list(w.gpus):
                i, s = gpu.info, gpu.state
                labels = [w.name, i.uuid, str(i.index), i.model, "true" if i.simulated else "false"]
                util.add_metric(labels, s.util / 100.0)
                used.add_metric(labels, s.mem_used)
                total.add_metric(labels, i.mem)
                temp.add_metric(labels, s.temp)
                power.add_metric(labels, s.power)
                granted.add_metric(labels, gpu.granted_milli / 1000.0)
                granted_mem.add_metric(labels, gpu.granted_mem)
                grants.add_metric(labels, gpu.tasks)
                state = "cordoned" if gpu.cordoned else s.health
                for name in HEALTH_STATES:
                    health.add_metric([*labels, name], 1.0 if name == state else 0.0)
        out += [inflight, draining, heard, isolation, held, pool_free, util, used, total, temp, power, granted, granted_mem, grants, health]

        # Queue, sessions and tenants.
        queue = GaugeMetricFamily("gpud_queue_requests", "Requests waiting for a GPU, by tenant and priority.", labels=["tenant", "priority"])
        for (priority, tenant), n in sorted(core.queue.depths().items()):
            queue.add_metric([tenant, str(priority)], n)
        out.append(queue)
        sessions = GaugeMetricFamily("gpud_sessions", "Open device sessions, by tenant and worker.", labels=["tenant", "worker"])
        per: dict[tuple[str, str], int] = {}
        for sess in list(core.sessions.values()):
            per[(sess.tenant, sess.worker)] = per.get((sess.tenant, sess.worker), 0) + 1
        for (tenant, worker), n in sorted(per.items()):
            sessions.add_metric([tenant, worker], n)
        out.append(sessions)
        tenant_now = GaugeMetricFamily("gpud_tenant_granted_gpus", "GPUs (in whole-GPU units) granted to a tenant now.", labels=["tenant"])
        tenant_sec = CounterMetricFamily("gpud_tenant_gpu_seconds", "GPU-seconds granted to a tenant (a half GPU for 2 s is 1).", labels=["tenant"])
        fair = core.accounts.fair
        for tenant in sorted(list(fair.tenants)):
            seconds = max(fair.served(tenant, now) / 1000.0, self._gpu_seconds.get(tenant, 0.0))
            self._gpu_seconds[tenant] = seconds
            tenant_sec.add_metric([tenant], seconds)
            share = fair.tenants.get(tenant)
            tenant_now.add_metric([tenant], share.granted / 1000.0 if share is not None else 0.0)
        out += [tenant_now, tenant_sec]

        # Requests.
        stats = core.stats
        requests = CounterMetricFamily("gpud_requests", "Requests accepted (queued or dispatched), by kind; retries and refusals are not counted.", labels=["kind"])
        for kind, n in sorted(dict(stats.accepted).items()):
            requests.add_metric([kind], n)
        errors = CounterMetricFamily("gpud_errors", "Requests answered with an error, by error code.", labels=["code"])
        for code, n in sorted(dict(stats.errors).items()):
            errors.add_metric([code], n)
        latency = _histogram("gpud_request_duration_seconds", "Seconds from accepting a request to its reply, by kind.",
                             stats.latency)
        waited = _histogram("gpud_request_queue_wait_seconds",
                            "Seconds from accepting a request to its first dispatch to a worker (0 for one placed at once), by kind.",
                            stats.waited)
        finished = CounterMetricFamily(
            "gpud_requests_finished",
            "Requests this broker answered, by kind: those it accepted (gpud_requests_total) and those it took over "
            "from its pair's other broker (gpud_requests_taken_over_total), less those still running or queued.",
            labels=["kind"])
        for kind, n in sorted(stats.answered().items()):
            finished.add_metric([kind], n)
        taken = CounterMetricFamily("gpud_requests_taken_over",
                                    "Requests the pair's other broker accepted that this one took over (at a takeover), by kind.",
                                    labels=["kind"])
        for kind, n in sorted(dict(stats.taken_over).items()):
            taken.add_metric([kind], n)
        per_tenant = CounterMetricFamily("gpud_tenant_requests", "Requests accepted, by tenant (beyond 256 tenants: \"(other)\").",
                                         labels=["tenant"])
        for tenant, n in sorted(dict(stats.tenant_requests).items()):
            per_tenant.add_metric([tenant], n)
        tenant_errors = CounterMetricFamily("gpud_tenant_errors", "Requests answered with an error, by tenant (refusals included).",
                                            labels=["tenant"])
        for tenant, n in sorted(dict(stats.tenant_errors).items()):
            tenant_errors.add_metric([tenant], n)
        c = dict(core.counters)
        out += self._spool(core, c)
        out += [
            requests,
            errors,
            latency,
            waited,
            finished,
            taken,
            per_tenant,
            tenant_errors,
            CounterMetricFamily("gpud_job_timeouts", "Jobs killed at their time limit.", value=c.get("job_timeouts", 0)),
            CounterMetricFamily("gpud_session_replays",
                                "Sessions opened to replace a lost one (a client replaying its session's journal).",
                                value=c.get("session_replays", 0)),
            CounterMetricFamily("gpud_request_messages", "REQUEST messages received from clients (with retries and refusals).", value=c.get("requests", 0)),
            CounterMetricFamily("gpud_retries", "Requests resent with a known id (answered from the first one, never run again).", value=c.get("retries", 0)),
            CounterMetricFamily("gpud_worker_losses", "Workers lost without a goodbye (silent, or reconnected under the same name).", value=c.get("worker_losses", 0)),
            CounterMetricFamily("gpud_worker_suspensions", "Times a worker was suspended, silent past its liveness "
                                "(each then resumed, or lost after its grace window).", value=c.get("worker_suspensions", 0)),
            CounterMetricFamily("gpud_worker_resumes", "Times a suspended worker was heard again, or came back as the same "
                                "process on a new connection, within its grace window.", value=c.get("worker_resumes", 0)),
            CounterMetricFamily("gpud_bad_messages", "Messages refused as malformed or not allowed.", value=c.get("bad_messages", 0)),
            CounterMetricFamily("gpud_failovers", "Times this broker took the active role of its pair.", value=c.get("takeovers", 0)),
            GaugeMetricFamily("gpud_active", "1 while this broker accepts work (standalone, or the active one of its pair).",
                              value=1 if core.active else 0),
            GaugeMetricFamily("gpud_replication_lag_updates",
                              "Replication updates sent to the passive peer and not yet applied by it (0 without one).",
                              value=core.journal.lag),
        ]
        return out

    @staticmethod
    def _spool(core: BrokerCore, c: dict[str, int]) -> list[Metric]:
        """Staged job inputs and outputs (PROTOCOL.md §11): what the spool holds against its quota
        and each tenant's budget, its disk room, and which connection the bulk bytes took."""
        spool, accounts = core.staging.spool, core.accounts
        by_tenant = GaugeMetricFamily("gpud_tenant_spool_bytes", "Staged bytes a tenant's uploads and outputs reserve "
                                      "in the spool (its budget: tenant_max_spool_bytes).", labels=["tenant"])
        for tenant, n in sorted(dict(accounts.spooled).items()):
            by_tenant.add_metric([tenant], n)
        chunks = CounterMetricFamily("gpud_staged_chunks", "Staged chunks between the broker and its workers, by "
                                     "direction and by the worker's connection they took (data: apart from its "
                                     "heartbeats and results).", labels=["direction", "connection"])
        for direction, key in (("inputs", "fetches"), ("outputs", "output_chunks")):
            for conn in ("data", "control"):
                chunks.add_metric([direction, conn], c.get(f"{key}_on_{conn}", 0))
        room = spool.room()  # None where the file system cannot tell: no sample rather than a false 0
        out = [] if room is None else [GaugeMetricFamily(
            "gpud_spool_disk_room_bytes", "Bytes more the spool's disk can take now, less what open uploads still "
            "owe and its headroom.", value=room)]
        return out + [
            GaugeMetricFamily("gpud_spool_uploads", "Staged uploads and pulled outputs the spool holds.", value=len(spool)),
            GaugeMetricFamily("gpud_spool_reserved_bytes", "Bytes the spool's uploads and outputs reserve, written or not.",
                              value=spool.reserved),
            GaugeMetricFamily("gpud_spool_stored_bytes", "Staged bytes the spool holds now.", value=spool.stored),
            GaugeMetricFamily("gpud_spool_quota_bytes", "The spool's quota, all tenants together (spool_quota_bytes).",
                              value=accounts.budgets.max_spool_bytes),
            by_tenant,
            chunks,
        ]


def _le(bound: float) -> str:
    return repr(float(bound))


def _histogram(name: str, documentation: str, by_kind: dict[str, Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=["kind"])
    for kind, h in sorted(dict(by_kind).items()):
        buckets, count, total_s = h.cumulative()
        family.add_metric([kind], [(_le(b), n) for b, n in buckets] + [("+Inf", count)], sum_value=total_s)
    return family


@dataclass
class MetricsServer:
    """A running endpoint: ``url`` to scrape, ``close()`` to stop it."""

    url: str
    server: Any
    registry: CollectorRegistry

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9464``; ``:9464`` for every address; port 0 picks a free one)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"metrics address {listen!r}: use HOST:PORT, e.g. 127.0.0.1:9464")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def start(core: BrokerCore, listen: str, role: str = "standalone") -> MetricsServer:
    """Serve ``/metrics`` for ``core`` on ``listen`` from a daemon thread; returns the real URL."""
    host, port = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(core, role=role))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    server, _thread = start_http_server(port, host, registry=registry)
    real_host, real_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{real_host}]" if ":" in real_host else real_host
    url = f"http://{shown}:{real_port}/metrics"
    log.info("metrics at %s", url)
    return MetricsServer(url=url, server=server, registry=registry)
