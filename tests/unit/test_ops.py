"""Operations pieces without daemons: sd_notify, one-line logs, request statistics, the metrics
collector on a core driven by hand."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpud import notify
from gpud import protocol as P
from gpud.log import OneLineFormatter, fold
from gpud.protocol import Command, Peer
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_broker.queue import FairShare, PendingQueue
from gpud_broker.stats import LATENCY_BUCKETS, OTHER, Histogram, RequestStats

# ------------------------------------------------------------------------------------ sd_notify


@pytest.fixture()
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "n.sock" if len(str(tmp_path)) < 90 else None
    if path is not None:
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    else:
        name = f"gpud-unit-{uuid.uuid4().hex}"
        s.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    s.settimeout(2)
    yield s
    s.close()


def test_notify_states_reach_the_socket(listener: socket.socket) -> None:
    assert notify.enabled()
    assert notify.ready("serving") and listener.recv(100) == b"READY=1\nSTATUS=serving"
    assert notify.watchdog() and listener.recv(100) == b"WATCHDOG=1"
    assert notify.stopping() and listener.recv(100) == b"STOPPING=1"
    assert notify.reloading()
    lines = listener.recv(100).decode().split("\n")
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=") and int(lines[1].split("=")[1]) > 0


def test_notify_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"gpud-unit-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.notify("READY=1") and s.recv(100) == b"READY=1"


def test_notify_without_a_manager_does_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify.enabled() and not notify.ready() and notify.watchdog_interval() is None
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not notify.watchdog()  # never raises: a vanished manager must not take the daemon along


@pytest.mark.parametrize(("usec", "pid", "expected"), [
    ("5000000", None, 5.0),
    ("200000", "self", 0.2),
    ("200000", "other", None),
    ("0", None, None),
    ("soon", None, None),
    (None, None, None),
])
def test_watchdog_interval(listener: socket.socket, monkeypatch: pytest.MonkeyPatch,
                           usec: str | None, pid: str | None, expected: float | None) -> None:
    for var, val in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", {"self": str(os.getpid()), "other": "1", None: None}[pid])):
        if val is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, val)
    assert notify.watchdog_interval() == expected


# ------------------------------------------------------------------------------------ logs


def _record(msg: str, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    return logging.LogRecord("gpud.x", logging.ERROR, __file__, 1, msg, None, exc_info)


def test_one_line_per_event_even_with_a_traceback() -> None:
    f = OneLineFormatter("%(asctime)s %(levelname)s c[%(process)d] %(name)s: %(message)s")
    line = f.format(_record("two\nlines", exc=True))
    assert "\n" not in line and "\r" not in line
    assert "two\\nlines exc=Traceback (most recent call last):\\n" in line and "ValueError: bad\\nvalue" in line
    when, level, component = line.split(" ")[:3]
    assert len(when) == 23 and when[10] == "T"  # ISO 8601 with milliseconds: one field
    assert level == "ERROR" and component.startswith("c[")


def test_journal_priority_prefix() -> None:
    f = OneLineFormatter("%(levelname)s %(message)s", priority_prefix=True)
    assert f.format(_record("x")).startswith("<3>ERROR x")
    rec = logging.LogRecord("n", logging.INFO, __file__, 1, "hello", None, None)
    assert f.format(rec) == "<6>INFO hello"
    assert fold("a\r\nb\rc\nd") == "a\\nb\\nc\\nd"


# ------------------------------------------------------------------------------------ statistics


def test_histogram_buckets_are_less_or_equal() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    buckets, count, total = h.cumulative()
    assert buckets == [(0.1, 2), (1.0, 4)] and count == 5 and total == pytest.approx(8.65)


def test_request_stats_bound_the_error_codes() -> None:
    s = RequestStats()
    s.accept("echo")
    s.accept("echo")
    s.finish("echo", 0.001)
    s.error("BUSY")
    s.error("made up by a worker")
    s.error(["unhashable"])
    assert s.accepted == {"echo": 2} and s.errors == {"BUSY": 1, OTHER: 2}
    assert s.latency["echo"].counts[LATENCY_BUCKETS.index(0.001)] == 1


def test_served_counts_what_was_granted_not_the_idle_floor() -> None:
    fair = FairShare()
    fair.grant("a", 1000, 0.0)
    fair.release("a", 1000, 10.0)  # a: 10 GPU-seconds
    fair.activate("b", 10.0)  # b arrives: lifted to a's usage for fairness...
    assert fair.usage("b", 10.0) == pytest.approx(10_000)
    assert fair.served("b", 10.0) == 0.0  # ...but it has used nothing
    fair.grant("b", 500, 10.0)
    assert fair.served("b", 12.0) == pytest.approx(1000)  # half a GPU for 2 s
    assert fair.served("a", 99.0) == pytest.approx(10_000) and fair.served("nobody", 1.0) == 0.0


def test_queue_depths_by_priority_and_tenant() -> None:
    class Item:
        def __init__(self, tenant: str, priority: int) -> None:
            self.tenant, self.priority = tenant, priority
            self.deadline, self.created, self.queued, self.reserved = 100.0, 0.0, False, None

    q: PendingQueue[Any] = PendingQueue(10)
    for t, p in (("a", 0), ("a", 0), ("b", 1)):
        q.push(Item(t, p))
    assert q.depths() == {(0, "a"): 2, (1, "b"): 1}


# ------------------------------------------------------------------------------------ core + collector


class Core:
    """A BrokerCore with one worker (two GPUs) and list outboxes."""

    def __init__(self) -> None:
        self.to_client: list[tuple[bytes, list[Any]]] = []
        self.to_worker: list[tuple[bytes, list[Any]]] = []
        self.core = BrokerCore(BrokerConfig(), 100.0, lambda i, f: self.to_client.append((i, f)),
                               lambda i, f: self.to_worker.append((i, f)))
        gpus = [{"uuid": f"GPU-{i}", "index": i, "model": "A100", "mem": 16 << 30, "cc": [8, 0]} for i in range(2)]
        self.worker(Command.READY, {"name": "w1", "gpus": gpus, "cpu_milli": 8000, "host_mem": 1 << 36, "slots": 8})
        self.to_worker.clear()

    def worker(self, cmd: Command, header: dict[str, Any], ident: bytes = b"conn-w1") -> None:
        enc = P.encode(Peer.WORKER, cmd, header)
        self.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2])

    def request(self, n: int, kind: str = "echo", **fields: Any) -> bytes:
        rid = n.to_bytes(16, "big")
        enc = P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": kind, **fields})
        self.core.on_client(b"client", P.decode(enc, Peer.CLIENT))
        return rid


def test_core_counts_requests_latency_errors_and_losses() -> None:
    c = Core()
    rid = c.request(1)
    c.core.now = 100.25
    c.worker(Command.RESULT, {"id": rid, "ok": True})
    assert c.core.stats.accepted == {"echo": 1}
    assert c.core.stats.latency["echo"].sum == pytest.approx(0.25)
    rid = c.request(2)
    c.worker(Command.RESULT, {"id": rid, "ok": False, "code": "REMOTE_ERROR", "message": "x"})
    c.request(3, need={"gpus": 3})  # no worker has three GPUs
    assert c.core.stats.errors == {"REMOTE_ERROR": 1, "NO_CAPACITY": 1}
    c.request(4)
    assert c.core.dispatched() == 1
    c.worker(Command.DISCONNECT, {"reason": "bye"})
    assert c.core.counters["worker_losses"] == 0  # a goodbye is no loss
    c.worker(Command.READY, {"name": "w2", "gpus": []}, ident=b"conn-w2")
    c.core.tick(1000.0)  # silent far past its liveness: suspended (PROTOCOL.md §4.2)
    assert (c.core.counters["worker_suspensions"], c.core.counters["worker_losses"]) == (1, 0)
    c.core.tick(2000.0)  # and not back in its grace window: lost
    assert c.core.counters["worker_losses"] == 1


def test_fail_queued_answers_shutting_down() -> None:
    c = Core()
    c.worker(Command.HEARTBEAT, {"seq": 1, "draining": True})  # nothing can be placed now
    c.request(1)
    c.request(2)
    assert len(c.core.queue) == 2
    from gpud.errors import ShuttingDown

    assert c.core.fail_queued(ShuttingDown("stopping")) == 2 and len(c.core.queue) == 0
    replies = [P.decode(f, Peer.CLIENT).header for _, f in c.to_client]
    assert [h["code"] for h in replies] == ["SHUTTING_DOWN", "SHUTTING_DOWN"]
    assert c.core.stats.errors == {"SHUTTING_DOWN": 2}


def test_collector_families_and_monotonic_gpu_seconds() -> None:
    pytest.importorskip("prometheus_client")
    from gpud_broker.metrics import BrokerCollector, parse_listen

    c = Core()
    c.request(1, "session", need={"gpu_milli": 500, "mem": 1 << 20})
    now = [100.0]
    col = BrokerCollector(c.core, clock=lambda: now[0])
    c.worker(Command.RESULT, {"id": (1).to_bytes(16, "big"), "ok": True})
    now[0] = 104.0
    fams = {f.name: f for f in col.collect()}
    assert fams["gpud_tenant_gpu_seconds"].samples[0].value == pytest.approx(2.0)  # half a GPU, 4 s
    assert [s.value for s in fams["gpud_sessions"].samples] == [1]
    health = {s.labels["state"]: s.value for s in fams["gpud_gpu_health"].samples if s.labels["gpu"] == "GPU-0"}
    assert health == {"ok": 1.0, "degraded": 0.0, "failed": 0.0, "cordoned": 0.0}
    granted = {s.labels["gpu"]: s.value for s in fams["gpud_gpu_granted_ratio"].samples}
    assert sorted(granted.values()) == [0.0, 0.5]
    now[0] = 103.0  # a clock read out of order must not make the counter go down
    fams = {f.name: f for f in col.collect()}
    assert fams["gpud_tenant_gpu_seconds"].samples[0].value == pytest.approx(2.0)
    assert parse_listen("[::1]:9464") == ("::1", 9464) and parse_listen(":0") == ("0.0.0.0", 0)


def test_a_workers_held_outputs_from_its_heartbeat_show_in_workers_and_the_metrics() -> None:
    """``held_outputs`` (PROTOCOL.md §4): what a worker says it holds, shown as it says it; a
    field of the wrong type or sign changes nothing."""
    pytest.importorskip("prometheus_client")
    from gpud_broker.commands import ADMIN
    from gpud_broker.metrics import BrokerCollector

    c = Core()

    def shown() -> tuple[Any, Any]:
        (row,) = ADMIN.dispatch(c.core, "workers", {}, who="tester pid 1")
        fams = {f.name: f for f in BrokerCollector(c.core).collect()}
        (metric,) = [s.value for s in fams["gpud_worker_held_output_bytes"].samples if s.labels == {"worker": "w1"}]
        return row["held_outputs"], metric

    assert shown() == (0, 0)
    c.worker(Command.HEARTBEAT, {"seq": 1, "held_outputs": 300 << 20})
    assert shown() == (300 << 20, 300 << 20)
    for bad in (-1, "lots", 2.5, None, [1]):
        c.worker(Command.HEARTBEAT, {"seq": 2, "held_outputs": bad})
        assert shown() == (300 << 20, 300 << 20), bad
    c.worker(Command.HEARTBEAT, {"seq": 3, "held_outputs": 0})
    assert shown() == (0, 0)


def test_collector_retries_when_the_state_changes_under_it() -> None:
    pytest.importorskip("prometheus_client")
    from gpud_broker.metrics import BrokerCollector

    class Flaky(BrokerCollector):
        calls = 0

        def _collect(self) -> list[Any]:
            self.calls += 1
            if self.calls < 3:
                raise RuntimeError("dictionary changed size during iteration")
            return super()._collect()

    col = Flaky(Core().core)
    assert any(f.name == "gpud_workers" for f in col.collect()) and col.calls == 3


def test_refused_requests_are_not_counted_as_accepted() -> None:
    c = Core()
    c.request(1, need={"gpus": 3})  # NO_CAPACITY: refused at the door
    assert c.core.stats.accepted == {} and c.core.stats.errors == {"NO_CAPACITY": 1}
    c.request(2)
    c.request(2)  # a retry of a known id: answered from the first, not counted again
    assert c.core.stats.accepted == {"echo": 1} and c.core.counters["retries"] == 1


def test_queue_wait_is_measured_apart_from_run_time() -> None:
    c = Core()
    first = c.request(1, need={"gpus": 2})
    c.request(2, need={"gpus": 2})  # waits for the first
    c.core.now = 105.0
    c.worker(Command.RESULT, {"id": first, "ok": True})  # the second is dispatched now, 5 s after it came
    c.core.now = 106.0
    c.worker(Command.RESULT, {"id": (2).to_bytes(16, "big"), "ok": True})
    waited, latency = c.core.stats.waited["echo"], c.core.stats.latency["echo"]
    assert waited.cumulative()[1] == 2 and waited.sum == pytest.approx(5.0)  # 0 s and 5 s
    assert latency.sum == pytest.approx(5.0 + 6.0)  # reply times: 5 s and 6 s


def test_requests_and_errors_per_tenant_with_a_bound_on_names() -> None:
    from gpud_broker.stats import MAX_TENANTS, OTHER_TENANT, RequestStats

    c = Core()
    c.request(1, need={"tenant": "alice"})
    c.request(2, need={"tenant": "alice", "gpus": 3})  # refused: no worker has three GPUs
    c.request(3, need={"tenant": "bob"})
    assert c.core.stats.tenant_requests == {"alice": 1, "bob": 1}
    assert c.core.stats.tenant_errors == {"alice": 1}
    s = RequestStats()
    for n in range(MAX_TENANTS + 50):  # a client making up tenant names (no CURVE) grows nothing
        s.accept("echo", f"t{n}")
    assert len(s.tenant_requests) == MAX_TENANTS + 1 and s.tenant_requests[OTHER_TENANT] == 50


def test_job_timeouts_and_session_replays_are_counted() -> None:
    c = Core()
    rid = c.request(1, "job", argv=["sleep", "9"], timeout_s=1)
    c.worker(Command.RESULT, {"id": rid, "ok": True, "exit_code": -9, "timed_out": True})
    assert c.core.counters["job_timeouts"] == 1
    c.request(2, "session", need={"gpu_milli": 100}, replaces=(99).to_bytes(16, "big"))
    assert c.core.counters["session_replays"] == 1


def test_finished_requests_are_the_accepted_and_the_taken_over_ones() -> None:
    pytest.importorskip("prometheus_client")
    from gpud_broker.metrics import BrokerCollector

    c = Core()
    for n in range(1, 4):
        c.worker(Command.RESULT, {"id": c.request(n), "ok": True})
    # The answer to work the pair's other broker accepted and dispatched (after a takeover).
    c.worker(Command.RESULT, {"id": (77).to_bytes(16, "big"), "ok": True})
    fams = {f.name: f for f in BrokerCollector(c.core).collect()}

    def total(name: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name.endswith("_total"))

    assert total("gpud_requests") == 3 and total("gpud_requests_taken_over") == 1
    assert total("gpud_requests_finished") == total("gpud_requests") + total("gpud_requests_taken_over")
    assert "gpud_request_queue_wait_seconds" in fams and "gpud_tenant_requests" in fams
