"""What the pair asks of the broker it pairs: ``PairedBroker``, the one interface between the
Binary Star shell (``pair.py``) and the broker's core. Pure: no sockets.

The standby sits below the broker: it imports nothing of ``gpud_broker``; the broker's core
(``gpud_broker.core.BrokerCore``) has these members, and the broker's shell hands it to ``Pair``.
"""

from __future__ import annotations

from typing import Any, Protocol


class PairedBroker(Protocol):
    """The broker's tables and role, as the pair reads and changes them (PROTOCOL.md §9)."""

    epoch: int  # the epoch it is (or was last) active at
    max_epoch_seen: int  # the largest epoch any worker or the peer has shown it
    fenced: bool  # active, and a worker showed a later epoch: another broker is active

    # Read only: the broker's name (its STATE says it); active, the seq of the last update
    # journalled (0 before any); settling after a takeover (waiting for its workers, placing nothing);
    # the last update set durable (``set_durable``).
    @property
    def name(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def settling(self) -> bool: ...
    @property
    def durable(self) -> int: ...

    def join_pair(self) -> None:
        """Start as a broker of a pair: passive, and a worker's result is ACKed once durable."""

    def become_passive(self) -> None:
        """Accept no work and hold no tables until a snapshot is loaded."""

    def saw_epoch(self, epoch: int) -> None:
        """The peer showed ``epoch``."""

    def witness(self, within: float) -> bool:
        """Does a connected worker still hear another broker say it is active (within seconds)?"""

    def snapshot(self) -> dict[str, Any]:
        """Active: its tables for the peer, msgpack-ready; the updates not yet taken are in it."""

    def load(self, snap: Any, now: float) -> None:
        """Passive: replace the tables with a snapshot (ProtocolError if it is malformed)."""

    def apply(self, updates: Any, now: float) -> None:
        """Passive: apply updates in order (ProtocolError if one is malformed)."""

    def take_over(self, epoch: int, settle: float, now: float) -> None:
        """Become active at ``epoch`` with the tables as replicated; settle at most ``settle`` s."""

    def step_down(self) -> int:
        """Stop being active (another broker is); returns how many clients were told so."""

    def take_updates(self) -> list[list[Any]]:
        """Active: the updates journalled since the last call, in order (seq ends at ``seq``)."""

    def set_durable(self, seq: int) -> None:
        """Updates up to ``seq`` are held by the passive peer (or need not be: no peer streams)."""

    def unheld(self) -> list[bytes]:
        """Passive: the staged uploads whose bytes it could not hold (PROTOCOL.md §11.4)."""

    def spool_room(self) -> int | None:
        """Bytes of new staged files its spool's disk can take now (None: it cannot tell)."""

    def peer_spool_room(self, room: Any) -> None:
        """Active: the passive peer's spool room (its STATE's ``room``, as it came off the wire;
        None: the peer is gone)."""

    def peer_unheld(self, jobs: Any) -> None:
        """Active: the passive peer could not hold the bytes of these uploads (its STATE's
        ``unheld``, as it came off the wire)."""
