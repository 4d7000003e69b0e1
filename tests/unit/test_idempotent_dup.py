"""A job marked ``idempotent`` that may have begun (told GO) is placed again when its worker is lost
(PROTOCOL.md §4.3, §5.3), here by a failover: its worker is not connected to the broker that takes
over, and the mark travelled with it; a plain job beside it gets WORKER_LOST. (Removal at once and
suspension are pinned in test_broker_core and test_worker_resume.) BrokerCore driven directly on a
fake clock (the harnesses of test_broker_core and test_replication).
"""

from __future__ import annotations

from gpud import protocol as P
from gpud.protocol import Command
from gpud_broker.tasks import State
from tests.unit.test_broker_core import C1, C2, W1, W2, Harness, rid
from tests.unit.test_replication import confirm, dispatched, ship, take_over
from tests.unit.test_settle_begun import pair_with_w2_busy

PLAIN, IDEM = rid(1), rid(2)


def both_told_go(h: Harness) -> None:
    """PLAIN and IDEM dispatched to w1 and told GO (w2, idle, sorts after w1)."""
    h.request(C1, PLAIN, kind="job", argv=["train.py"], need={"gpu_milli": 100})
    h.request(C2, IDEM, kind="job", argv=["render.py"], idempotent=True, need={"gpu_milli": 100})
    assert dispatched(h) == [(W1, PLAIN), (W1, IDEM)]
    h.worker(W1, Command.START, {"ids": [PLAIN, IDEM]})


def test_an_idempotent_job_told_go_runs_again_when_its_worker_is_not_connected_after_a_failover() -> None:
    a, b = pair_with_w2_busy(500)
    both_told_go(a)
    ship(a, b)  # the marks are durable: both may have begun
    a.core.set_durable(a.core.seq)
    assert list(a.core.take_go()) == [W1]
    assert b.core.tasks.tasks[IDEM].started and b.core.tasks.tasks[PLAIN].started
    b.core.workers.lost(b.core.registry.by_name["w1"], "silent")  # a passive broker removes it at once
    take_over(b)
    done = b.core.tasks.tasks[PLAIN]
    assert done.state is State.DONE and done.reply is not None and P.unpackb(done.reply[2])["code"] == "WORKER_LOST"
    idem = b.core.tasks.tasks[IDEM]
    assert idem.state is State.QUEUED and idem.avoid == {"w1"} and not idem.started
    b.core.registry.by_name["w2"].gpus[0].granted_milli = 0
    confirm(b, W2)
    assert dispatched(b) == [(W2, IDEM)]
