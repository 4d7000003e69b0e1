"""Chaos: the active broker of a pair killed (SIGKILL) in the middle of a session copy that the
broker relays (the worker binds no data socket), in both directions: the chunks in flight with the
dead broker are sent again, same ids, to the other, and the copy must end with the right bytes,
in the same session, with nothing replayed.

Real daemons (a Binary Star pair and a simulated-GPU worker, labelled simulated) as subprocesses on
loopback, the real client library.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpud_cli.cluster import LocalCluster, admin_call
from gpud_client import Client
from tests.integration.chaos import RECONNECT_MAX
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180) if hasattr(pytest.mark, "timeout") else []

SIZE = 24 << 20
CHUNK = 256 << 10  # small chunks, two in flight: about a hundred round trips a copy, so a kill
# 50 ms in falls well inside it (checked: the broker must be dead before the copy returns)


class Kill:
    """SIGKILL broker ``role`` ``delay`` seconds from now; ``at``: when it was dead."""

    def __init__(self, c: LocalCluster, role: str, delay: float) -> None:
        self.at = float("inf")
        self._t = threading.Timer(delay, self._kill, (c, role))
        self._t.start()

    def _kill(self, c: LocalCluster, role: str) -> None:
        c.kill_broker(role)
        self.at = time.monotonic()

    def cut(self, done: float) -> bool:
        """Whether the kill came before ``done`` (the copy's end)."""
        self._t.join()
        return self.at < done


def test_relayed_copies_cut_by_a_broker_failover_keep_their_bytes(tmp_path: Path) -> None:
    data = np.random.default_rng(7).integers(0, 255, SIZE, dtype=np.uint8)
    with LocalCluster(workers=1, gpus_per_worker=1, pair=True, heartbeat_ms=250, liveness=12, rundir=tmp_path,
                      direct=False, worker_args=RECONNECT_MAX) as c:
        c.wait_active()
        with Client(c.frontends, timeout=60, chunk_bytes=CHUNK, chunk_window=2) as client, \
                client.session(mem=2 * SIZE) as s:
            assert s.info()["path"] == "broker"
            sid = s.id
            p = s.mem_alloc(SIZE)
            s.memcpy_htod(p, np.zeros(SIZE, np.uint8))
            # The session reaches the passive broker (it replicates within a loop turn or two).
            assert wait_for(lambda: admin_call(c.admin_of("backup"), "status")["counts"].get("sessions") == 1,
                            "the session on the backup")

            kill = Kill(c, "primary", 0.05)
            s.memcpy_htod(p, data)  # host to device, cut
            assert kill.cut(time.monotonic()), "the htod was over before the kill"
            assert c.wait_active() == "backup"
            out = np.empty(SIZE, np.uint8)
            s.memcpy_dtoh(p, out=out)
            assert np.array_equal(out, data), f"{int(np.count_nonzero(out != data))} bytes differ after the htod"

            c.restart_broker("primary")
            assert wait_for(lambda: c.pair_state("primary").get("synced"), "the primary back in sync")
            known = lambda: {w.get("name") for w in admin_call(c.admin_of("primary"), "workers", {})}  # noqa: E731
            assert wait_for(lambda: "w0" in known(), "the worker back with the primary")

            out[:] = 0
            kill = Kill(c, "backup", 0.05)
            s.memcpy_dtoh(p, out=out)  # device to host, cut
            assert kill.cut(time.monotonic()), "the dtoh was over before the kill"
            assert np.array_equal(out, data), f"{int(np.count_nonzero(out != data))} bytes differ after the dtoh"
            assert (s.id, s.replays) == (sid, 0)  # the same session throughout: nothing was replayed
        assert c.wait_active() == "primary"
