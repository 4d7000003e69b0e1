"""The link between the two brokers cut while clients and workers still reach both: at no moment
do both accept work.

Each broker runs in a network namespace of its own, created and removed here:

    this namespace (workers, clients) --veth-- gpudA (primary) --veth (peer link)-- gpudB (backup)
                                     `--veth-- gpudB

Cutting the peer link leaves the backup with a silent peer and clients that can reach it; the
witness rule (its workers still hear an active broker) keeps it passive. Needs root and
``ip netns``; skipped, saying so, where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gpud import protocol as P
from gpud.protocol import Command, Peer
from gpud_cli.cluster import LocalCluster
from gpud_client import Client

NET = "10.213"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def namespaces() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces; the split-brain test did not run")
    tag = uuid.uuid4().hex[:4]
    ns = {"primary": f"gpudA{tag}", "backup": f"gpudB{tag}"}
    links = [f"gA{tag}", f"gB{tag}", f"gP{tag}"]
    try:
        for n in ns.values():
            _ip("netns", "add", n)
            _ip("link", "set", "lo", "up", ns=n)
    except subprocess.CalledProcessError as exc:
        for n in ns.values():
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot make network namespaces here ({exc.stderr.decode().strip()}); the split-brain test did not run")
    try:
        for i, n in enumerate(ns.values(), start=1):  # this namespace <-> each broker's
            here, there = links[i - 1] + "h", links[i - 1] + "n"
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", there, "netns", n)
            _ip("addr", "add", f"{NET}.{i}.1/24", "dev", here)
            _ip("link", "set", here, "up")
            _ip("addr", "add", f"{NET}.{i}.2/24", "dev", there, ns=n)
            _ip("link", "set", there, "up", ns=n)
        a, b = links[2] + "a", links[2] + "b"  # the peer link, broker to broker
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", a, "netns", ns["primary"])
        _ip("link", "set", b, "netns", ns["backup"])
        _ip("addr", "add", f"{NET}.3.1/24", "dev", a, ns=ns["primary"])
        _ip("addr", "add", f"{NET}.3.2/24", "dev", b, ns=ns["backup"])
        _ip("link", "set", a, "up", ns=ns["primary"])
        _ip("link", "set", b, "up", ns=ns["backup"])
        yield {**ns, "peer_link": a}
    finally:
        for n in ns.values():
            subprocess.run(["ip", "netns", "del", n], capture_output=True)  # takes its veth ends along
        for link in links[:2]:
            subprocess.run(["ip", "link", "del", link + "h"], capture_output=True)


def _not_active_answer(endpoint: str) -> str | None:
    """Send one echo REQUEST straight to ``endpoint``; the code of the answer (None: served)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, os.urandom(16))  # a client's id (PROTOCOL.md §2)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        rid = P.new_id()
        s.send_multipart(P.encode(Peer.CLIENT, Command.REQUEST, {"id": rid, "kind": "echo"}, [b"x"]))
        if not s.poll(5000):
            return "no answer"
        msg = P.decode(s.recv_multipart(), Peer.CLIENT)
        return None if msg.header.get("ok") else str(msg.header.get("code"))
    finally:
        s.close(0)


def test_a_cut_peer_link_never_makes_two_active_brokers(namespaces: dict[str, str], tmp_path: Path) -> None:
    roles = ("primary", "backup")
    c = LocalCluster(
        workers=2, pair=True, heartbeat_ms=250, rundir=tmp_path, broker_args=["--allow-public-bind"],
        broker_netns={r: namespaces[r] for r in roles},
        broker_hosts={"primary": f"{NET}.1.2", "backup": f"{NET}.2.2"},
        peer_hosts={"primary": f"{NET}.3.1", "backup": f"{NET}.3.2"},
    )
    with c:
        assert c.wait_active() == "primary"
        states: list[tuple[str, str]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    states.append((c.pair_state("primary")["state"], c.pair_state("backup")["state"]))
                except Exception:  # noqa: BLE001 - an unanswered poll is not a state
                    pass
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _ip("link", "set", namespaces["peer_link"], "down", ns=namespaces["primary"])  # cut
        try:
            deadline = time.monotonic() + 4.0
            answers = []
            with Client(c.frontends, timeout=10) as client:
                while time.monotonic() < deadline:
                    # Clients keep reaching both: the primary serves, the backup votes no.
                    assert client.echo(b"still") == b"still"
                    answers.append(_not_active_answer(c.frontends[1]))
                    time.sleep(0.1)
            assert c.pair_state("backup")["peer_silent_s"] > 1.0  # the peer was silent past its expiry
            assert set(answers) == {"NOT_ACTIVE"}, answers
        finally:
            _ip("link", "set", namespaces["peer_link"], "up", ns=namespaces["primary"])  # heal
        time.sleep(1.0)
        stop.set()
        watcher.join(5)
        assert states, "the brokers' states were never read"
        both = [s for s in states if s == ("active", "active")]
        assert not both, f"both brokers active in {len(both)} of {len(states)} samples"
        assert c.wait_active() == "primary"
        assert c.pair_state("backup")["state"] == "passive"
