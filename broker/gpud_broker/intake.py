"""Fair intake by bytes: each sender's echo payload in flight (read by the broker, its reply not
yet sent) against a share, and the sender's messages that wait while it is over it.

An echo's bytes cross the worker's one connection twice, and every other tenant's messages to
and from that worker queue behind them: a tenant sending big echoes as fast as they come back
would make everyone's latency its own. So a sender may have ``share`` bytes of echo payload in
flight (one echo always, whatever its size); an echo past that waits here, and so does every
later message of the same sender (its order is kept: a CANCEL never overtakes its REQUEST), until
its echoes in flight are answered or the waiting one is ``max_wait_s`` old (then it goes anyway:
a sender is slowed, never stalled). Past ``max_waiting`` messages or ``max_waiting_bytes``
waiting, a sender's new messages are refused (the shell answers BUSY). Other senders' messages
never wait here.

The share bounds what one sender's echoes cost another's latency; a rate, ``rate`` bytes of echo
payload a second per sender (a token bucket holding one second's bytes, at least one share),
bounds what they cost the machine: every byte is encrypted and decrypted twice on the broker and
twice on the worker, CPU the other tenants' messages wait for. An echo past its sender's rate
waits as one past its share does.

Pure: the socket shell (``broker.Broker``) says what it read and what it answered; the caller
passes the time. A sender is a tenant under CURVE (its key's), else a routing id. The routing ids
that have echoes in flight are kept (``routes``), so that the shell looks for answered echoes only
among the replies to those.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from gpud.ratelog import TokenBucket

MAX_WAIT_S = 1.0  # a waiting message goes after this long, whatever is in flight
MAX_WAITING = 1024  # messages of one sender waiting, at most
FORGET_S = 600.0  # an echo in flight whose reply was never seen is forgotten after this long
MAX_BUCKETS = 4096  # senders whose rate is tracked at once (then the least recently used is forgotten)


@dataclass(slots=True)
class Waiting:
    frames: list[Any]
    user: str | None
    echo: tuple[bytes, int] | None  # (id, payload bytes) when it is an echo
    since: float
    msg: Any = None  # the message decoded (or why it could not be), when the shell decoded it already


class EchoShare:
    """Echo bytes in flight per sender, against ``share``; the messages waiting behind."""

    def __init__(self, share: int, max_waiting_bytes: int, max_wait_s: float = MAX_WAIT_S,
                 max_waiting: int = MAX_WAITING, rate: float = 0.0) -> None:
        self.share = share
        self.rate = rate  # echo payload bytes a second per sender (0: no bound)
        self.buckets = TokenBucket(rate, max(rate, share), MAX_BUCKETS)  # sender -> echo bytes it may send
        self.max_waiting_bytes = max_waiting_bytes
        self.max_wait_s = max_wait_s
        self.max_waiting = max_waiting
        self.in_flight: dict[bytes, tuple[Hashable, int, float, bytes]] = {}  # echo id -> (sender, bytes, since, route)
        self.routes: dict[bytes, int] = {}  # routing id -> echoes in flight whose reply goes to it
        self.bytes_of: dict[Hashable, int] = {}  # sender -> echo bytes in flight
        self.waiting: dict[Hashable, deque[Waiting]] = {}  # sender -> its messages waiting, in order
        self.waiting_bytes: dict[Hashable, int] = {}
        self.waited = 0  # messages that waited, so far
        self.refused = 0  # messages refused for a sender waiting past its bounds, so far

    def take(self, sender: Hashable, frames: list[Any], user: str | None, echo: tuple[bytes, int] | None,
             now: float, msg: Any = None) -> bool | None:
        """A message read (``frames[0]``: its routing id; ``msg``: decoded, if it was): True, hand
        it to the core now; False, it waits (``ready`` gives it back later); None, refused (the
        sender has too much waiting)."""
        queue = self.waiting.get(sender)
        if queue is None:
            if echo is None or not self._over(sender, echo, now):
                if echo is not None:
                    self._fly(sender, echo, now, frames[0])
                return True
            queue = self.waiting[sender] = deque()
            self.waiting_bytes[sender] = 0
        nbytes = echo[1] if echo is not None else 0
        if len(queue) >= self.max_waiting or self.waiting_bytes[sender] + nbytes > self.max_waiting_bytes:
            self.refused += 1
            return None
        queue.append(Waiting(frames, user, echo, now, msg))
        self.waiting_bytes[sender] += nbytes
        self.waited += 1
        return False

    def answered(self, rid: bytes) -> None:
        """A reply to ``rid`` was sent: if it was an echo in flight, its bytes are let go."""
        entry = self.in_flight.pop(rid, None)
        if entry is not None:
            self._land(*entry)

    def ready(self, now: float) -> list[Waiting]:
        """The waiting messages that may go now, each sender's in order: those before its next
        echo over the share, and any that waited ``max_wait_s``."""
        out: list[Waiting] = []
        for sender in list(self.waiting):
            queue = self.waiting[sender]
            while queue:
                head = queue[0]
                if head.echo is not None:
                    if self._over(sender, head.echo, now) and now - head.since < self.max_wait_s:
                        break
                    self._fly(sender, head.echo, now, head.frames[0])
                    self.waiting_bytes[sender] -= head.echo[1]
                out.append(queue.popleft())
            if not queue:
                del self.waiting[sender], self.waiting_bytes[sender]
        return out

    def forget_old(self, now: float) -> int:
        """Forget echoes in flight whose reply was never seen for FORGET_S (one answered in a way
        the shell did not see); returns how many."""
        old = [rid for rid, (_, _, since, _) in self.in_flight.items() if now - since >= FORGET_S]
        for rid in old:
            self.answered(rid)
        return len(old)

    def _over(self, sender: Hashable, echo: tuple[bytes, int], now: float) -> bool:
        """Would ``echo`` take ``sender`` past its share (never its first echo in flight), or is
        its rate spent? Never for a retry of an echo in flight."""
        if echo[0] in self.in_flight:
            return False
        held = self.bytes_of.get(sender, 0)
        if held > 0 and held + echo[1] > self.share:
            return True
        return self.rate > 0 and echo[1] > 0 and self.buckets.level(sender, now) <= 0

    def _fly(self, sender: Hashable, echo: tuple[bytes, int], now: float, route: bytes) -> None:
        rid, nbytes = echo
        entry = self.in_flight.get(rid)
        if entry is not None:  # a retry of an echo in flight: counted once, its reply goes to the retry's route
            if entry[3] != route:
                self._unroute(entry[3])
                self.in_flight[rid] = (*entry[:3], route)
                self.routes[route] = self.routes.get(route, 0) + 1
            return
        if nbytes <= 0:  # no bytes: nothing held
            return
        self.in_flight[rid] = (sender, nbytes, now, route)
        self.bytes_of[sender] = self.bytes_of.get(sender, 0) + nbytes
        if self.rate > 0:  # one echo may be larger than what is left: it overdraws, later ones wait
            self.buckets.spend(sender, nbytes, now)
        self.routes[route] = self.routes.get(route, 0) + 1

    def _land(self, sender: Hashable, nbytes: int, since: float, route: bytes) -> None:
        left = self.bytes_of.get(sender, 0) - nbytes
        if left > 0:
            self.bytes_of[sender] = left
        else:
            del self.bytes_of[sender]
        self._unroute(route)

    def _unroute(self, route: bytes) -> None:
        left = self.routes[route] - 1
        if left:
            self.routes[route] = left
        else:
            del self.routes[route]

    def shown(self) -> dict[str, Any]:
        """For admin ``status``: the share and what is held now."""
        return {"echo_bytes_in_flight_share": self.share, "echo_bytes_per_s": self.rate,
                "echo_bytes_in_flight": sum(self.bytes_of.values()),
                "senders_waiting": len(self.waiting), "messages_waiting": sum(len(q) for q in self.waiting.values()),
                "waited": self.waited, "refused": self.refused}
