"""Placement at scale in BrokerCore: sampled placement for ``balanced`` on large clusters, the
free-slot count that lets placement return at once, and placement timing (admin ``status``)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from typing import Any

import pytest

from gpud import protocol as P
from gpud.clock import FakeClock
from gpud.protocol import Command, Peer
from gpud_broker.commands import ADMIN
from gpud_broker.core import BrokerConfig, BrokerCore
from gpud_broker.policies import SAMPLE_ABOVE, SAMPLE_K
from gpud_broker.registry import WorkerRecord, WorkerRegistry
from gpud_broker.stats import PlacementTimes

GiB = 1 << 30
C1 = b"client-1"


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


class Cluster:
    """A BrokerCore with a fake clock, lists as sockets, and a spy on its policy: ``offered``
    holds how many workers each policy call was offered."""

    def __init__(self, policy: str = "balanced") -> None:
        self.clock = FakeClock(1000.0)
        self.to_client: list[tuple[bytes, list[Any]]] = []
        self.to_worker: list[tuple[bytes, list[Any]]] = []
        self.core = BrokerCore(
            BrokerConfig(policy=policy),
            self.clock.monotonic(),
            lambda ident, frames: self.to_client.append((ident, list(frames))),
            lambda ident, frames: self.to_worker.append((ident, list(frames))),
        )
        self.core.dispatcher.rng.seed(7)
        self.offered: list[int] = []
        self.spy()

    def spy(self) -> None:
        """Wrap the core's current policy so that each call's offer is counted."""
        inner = self.core.dispatcher.policy

        def spy(need: Any, workers: Iterable[WorkerRecord], avoid: Any) -> Any:
            workers = list(workers)
            self.offered.append(len(workers))
            return inner(need, workers, avoid)

        self.core.dispatcher.policy = spy

    def now(self) -> None:
        self.core.now = self.clock.monotonic()

    def worker(self, ident: bytes, cmd: Command, header: dict[str, Any]) -> None:
        self.now()
        enc = P.encode(Peer.WORKER, cmd, header)
        self.core.on_worker(ident, P.decode(enc, Peer.WORKER), enc[2])

    def ready(self, n: int, model: str = "A100", slots: int = 64, ngpus: int = 8) -> bytes:
        ident = b"conn-%d" % n
        gpus = [{"uuid": f"GPU-{n}-{i}", "index": i, "model": model, "mem": 80 * GiB, "cc": [8, 0]}
                for i in range(ngpus)]
        self.worker(ident, Command.READY, {"name": f"w{n}", "gpus": gpus, "cpu_milli": 64000,
                                           "host_mem": 512 * GiB, "slots": slots})
        return ident

    def request(self, r: bytes, **need: Any) -> None:
        self.now()
        enc = P.encode(Peer.CLIENT, Command.REQUEST, {"id": r, "kind": "echo", "need": need})
        self.core.on_client(C1, P.decode(enc, Peer.CLIENT))

    def dispatches(self) -> list[tuple[bytes, bytes]]:
        """(worker connection, request id) of each DISPATCH sent since the last call."""
        out = []
        for ident, frames in self.to_worker:
            msg = P.decode(frames, Peer.WORKER)
            if msg.command is Command.DISPATCH:
                out.append((ident, msg.header["id"]))
        self.to_worker.clear()
        return out

    def check_open(self) -> None:
        assert self.core.dispatcher.open_workers == self.core.dispatcher.count_open_workers()


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)


def test_large_balanced_cluster_places_from_a_sample() -> None:
    c = Cluster()
    n = SAMPLE_ABOVE + 36
    for i in range(n):
        c.ready(i)
    # Every GPU of most workers is cordoned: a sample must still yield a feasible worker, or the
    # fallback must find one.
    feasible = {b"conn-%d" % i for i in range(0, n, 4)}
    for i in range(n):
        if b"conn-%d" % i not in feasible:
            for g in c.core.registry.by_name[f"w{i}"].gpus:
                g.cordoned = True
    c.dispatches()
    for k in range(200):
        c.request(rid(k))
    sent = c.dispatches()
    assert len(sent) == 200
    assert {ident for ident, _ in sent} <= feasible
    assert c.offered.count(SAMPLE_K) >= 190  # nearly always decided on the sample alone
    assert max(c.offered) in (SAMPLE_K, n)
    assert c.core.dispatcher.placement_times.count == 200  # one decision each (a fallback is part of it)


def test_sample_without_a_fit_falls_back_to_every_worker() -> None:
    c = Cluster()
    n = SAMPLE_ABOVE + 36
    for i in range(n):
        c.ready(i, model="H100" if i == 57 else "A100")
    c.dispatches()
    fallbacks = 0
    for k in range(20):
        c.offered.clear()
        c.request(rid(k), models=["H100"])
        assert c.dispatches() == [(b"conn-57", rid(k))]
        # The sample held w57, or it did not and the whole cluster was asked next.
        assert c.offered in ([SAMPLE_K], [SAMPLE_K, n])
        fallbacks += len(c.offered) == 2
    assert fallbacks >= 10


def test_small_clusters_and_other_policies_see_every_worker() -> None:
    small = Cluster()
    for i in range(SAMPLE_ABOVE):
        small.ready(i)
    small.request(rid(1))
    assert small.offered == [SAMPLE_ABOVE]
    packed = Cluster(policy="best-fit")
    for i in range(SAMPLE_ABOVE + 10):
        packed.ready(i)
    packed.request(rid(1))
    assert packed.offered == [SAMPLE_ABOVE + 10]


def test_a_reloaded_policy_decides_whether_to_sample() -> None:
    from dataclasses import replace

    c = Cluster()
    n = SAMPLE_ABOVE + 10
    for i in range(n):
        c.ready(i)
    c.request(rid(1))
    assert c.offered == [SAMPLE_K]
    c.core.apply_config(replace(c.core.config, policy="best-fit"))
    c.spy()
    c.offered.clear()
    c.request(rid(2))
    assert c.offered == [n]


def test_no_free_slot_returns_without_asking_the_policy() -> None:
    c = Cluster()
    a = c.ready(1, slots=2, ngpus=1)
    b = c.ready(2, slots=1, ngpus=1)
    for k in range(3):
        c.request(rid(k))
    sent = c.dispatches()
    assert len(sent) == 3 and c.core.dispatcher.open_workers == 0
    on_b = next(r for ident, r in sent if ident == b)
    asked = len(c.offered)
    for k in range(3, 10):
        c.request(rid(k))
    assert len(c.offered) == asked and len(c.core.queue) == 7  # queued, the policy never asked
    c.core.dispatcher.place_queued()
    assert len(c.offered) == asked
    c.worker(b, Command.RESULT, {"id": on_b, "ok": True})  # w2's slot frees: one queued is placed
    assert c.dispatches() == [(b, rid(3))] and c.core.dispatcher.open_workers == 0
    c.check_open()
    c.worker(a, Command.DISCONNECT, {"reason": "bye"})
    c.check_open()


def test_open_worker_count_matches_a_recount_through_random_operations() -> None:
    c = Cluster()
    rng = random.Random(1234)
    live: dict[bytes, int] = {}  # connection -> worker number
    running: dict[bytes, bytes] = {}  # request id -> connection it was dispatched to
    next_worker = 0
    next_req = 0

    def note_dispatches() -> None:
        for ident, r in c.dispatches():
            running[r] = ident

    for step in range(3000):
        op = rng.random()
        if op < 0.12 or not live:
            if len(live) < SAMPLE_ABOVE + 20:  # crosses the sampling threshold both ways
                ident = c.ready(next_worker, slots=rng.randint(1, 3), ngpus=rng.randint(1, 2))
                live[ident] = next_worker
                next_worker += 1
        elif op < 0.50:
            next_req += 1
            c.request(rid(next_req), **({"models": ["A100"]} if rng.random() < 0.5 else {}))
        elif op < 0.78 and running:
            r = rng.choice(sorted(running))
            ident = running.pop(r)
            if ident in live:
                if rng.random() < 0.1:
                    c.worker(ident, Command.RESULT, {"id": r, "ok": False, "code": "SHUTTING_DOWN", "message": "stop"})
                else:
                    c.worker(ident, Command.RESULT, {"id": r, "ok": True})
        elif op < 0.84:
            ident = rng.choice(sorted(live))
            c.worker(ident, Command.HEARTBEAT, {"seq": step, "draining": rng.random() < 0.3})
        elif op < 0.90:
            name = f"w{live[rng.choice(sorted(live))]}"
            ADMIN.dispatch(c.core, "drain" if rng.random() < 0.5 else "undrain", {"worker": name}, who="t pid 1")
        elif op < 0.94:
            ident = rng.choice(sorted(live))
            c.worker(ident, Command.DISCONNECT, {"reason": "bye"})
            del live[ident]
        elif op < 0.97:
            # READY again on the same connection (a restarted worker process)
            ident = rng.choice(sorted(live))
            c.ready(live[ident], slots=rng.randint(1, 3))
        else:
            # Silence: every worker but a few heartbeats; the rest expire in the next tick.
            keep = set(rng.sample(sorted(live), max(1, len(live) - 3)))
            c.clock.advance(2.0)
            for ident in keep:
                c.worker(ident, Command.HEARTBEAT, {"seq": step})
            c.clock.advance(1.5)
            c.core.tick(c.clock.monotonic())
            for ident in list(live):
                if ident not in c.core.registry.by_identity:
                    del live[ident]
        note_dispatches()
        c.check_open()
        assert len(c.core.registry.workers) == len(c.core.registry.by_identity)
        assert all(c.core.registry.workers[w.pos] is w for w in c.core.registry.workers)
    assert c.core.dispatcher.placement_times.count > 500
    assert max(c.offered) > SAMPLE_K and SAMPLE_K in c.offered


def test_status_reports_placement_times() -> None:
    c = Cluster()
    c.ready(1)
    before = ADMIN.dispatch(c.core, "status", {})["placement"]
    assert before == {"count": 0, "p50_us": 0.0, "p99_us": 0.0, "max_us": 0.0}
    for k in range(10):
        c.request(rid(k))
    p = ADMIN.dispatch(c.core, "status", {})["placement"]
    assert p["count"] == 10 and 0 < p["p50_us"] <= p["p99_us"] <= p["max_us"]


def test_placement_times_ring() -> None:
    t = PlacementTimes(size=100)
    for i in range(1, 251):
        t.record(i / 1e6)
    s = t.summary()
    assert s["count"] == 250 and s["max_us"] == 250.0
    # The ring holds the last 100 samples, 151..250 us.
    assert s["p50_us"] == 201.0 and s["p99_us"] == 250.0


def test_registry_sample_and_removal_keep_the_list_exact() -> None:
    from gpud.heartbeat import HeartbeatPolicy
    from gpud.resources import GpuInfo

    reg = WorkerRegistry()
    rng = random.Random(3)
    made = []
    for i in range(50):
        made.append(reg.add(name=f"w{i}", identity=b"c%d" % i, hostname="h",
                            gpus=[GpuInfo(uuid=f"g{i}", index=0, model="A100", mem=GiB, cc=(8, 0))],
                            cpu_milli=0, host_mem=0, slots=1, policy=HeartbeatPolicy(), now=0.0))
    for w in rng.sample(made, 20):
        reg.remove(w)
        reg.remove(w)  # twice is harmless
    assert sorted(w.name for w in reg.workers) == sorted(reg.by_name)
    assert all(reg.workers[w.pos] is w for w in reg.workers)
    s = reg.sample(10, rng)
    assert len(s) == len(set(map(id, s))) == 10 and all(w.pos >= 0 for w in s)
    assert len(reg.sample(100, rng)) == 30
