"""The session journal: the state-changing ops of a device session, kept so it can be rebuilt.

A device session lives on one GPU of one worker; when that worker or GPU is lost, so is the session
(PROTOCOL.md §4.3, §5.4). The client library can hide that from the caller by opening a new session
and replaying, in order, what made the old one's state: its allocations (``alloc``), frees
(``free``), copies to the device (``htod``), module loads (``load``) and kernel launches
(``launch``). ``dtoh``, ``sync`` and ``info`` change nothing and are not journaled. A ``load`` is
never dropped by compaction (the launches after it name its module); it counts
:data:`ENTRY_COST` plus the bytes of its source or binary, which the journal keeps.

This module is pure: no sockets, no clock, no threads. :class:`Journal` records ops that have
*succeeded* (an op that failed is not part of the session's state) and compacts itself so that it
holds only what the session's current state still depends on:

- a ``free`` drops the allocation, its copies and the free itself when no launch kept in the
  journal used it; a long loop that allocates, uses and frees buffers stays small;
- more generally (:meth:`Journal.compact`), an entry is dropped when nothing after it reads what it
  wrote: a liveness pass from the end, where every allocation still open at the end is needed, a
  copy of a whole allocation or a kernel that writes all of it ends the need for what was there
  before, and a launch of an unknown kernel is taken to read and write every pointer it gets. For
  the built-in kernels (PROTOCOL.md §5.4) it knows which pointer arguments are read and which is
  written, so a loop that copies inputs, launches and reads back the output stays small too.

Its size is bounded: each entry counts :data:`ENTRY_COST` bytes plus the bytes it copies (a
journal keeps its own copy of every ``htod`` buffer it holds). Past the bound, after a compaction,
the journal *overflows*: it drops everything and can no longer be replayed (``usable`` is false)
for the rest of the session. A journal of limit 0 is off from the start.

Handles in the journal are the ones the caller sees (the session maps them to the current
session's real handles); a handle may be reused after its ``free``, each use is told apart inside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTIN_EFFECTS", "ENTRY_COST", "Entry", "Journal"]

ENTRY_COST = 64
"""Bytes each entry counts against the journal's bound, on top of the bytes it copies."""

MIN_COMPACT_ENTRIES = 64
"""Entries below which the journal compacts only on a free or when it is over its bound."""

_F32 = 4


@dataclass(frozen=True, slots=True)
class _Effect:
    """What a built-in kernel does to its pointer arguments: the argument indexes it reads, the one
    it writes, and how many float32 elements it writes from the start (None: it cannot tell)."""

    reads: tuple[int, ...]
    writes: int
    count: Any  # Callable[[Sequence[Any]], int | None]: the launch's argument values -> elements


def _size(value: Any) -> int:
    return max(int(value), 0) if isinstance(value, int | float) else 0


BUILTIN_EFFECTS: dict[str, _Effect] = {
    # vector_add(a*, b*, out*, n): out[:n] = a[:n] + b[:n]
    "vector_add": _Effect((0, 1), 2, lambda v: _size(v[3])),
    # saxpy(alpha, x*, y*, n): y[:n] = alpha x[:n] + y[:n] (y is read too)
    "saxpy": _Effect((1, 2), 2, lambda v: _size(v[3])),
    # sgemm(A*, B*, C*, M, N, K): C[:M*N] = A @ B (C overwritten, not accumulated into)
    "sgemm": _Effect((0, 1), 2, lambda v: _size(v[3]) * _size(v[4])),
    # reduce_sum(x*, out*, n): out[0] = sum(x[:n])
    "reduce_sum": _Effect((0,), 1, lambda v: 1),
}
"""Effects of the kernels of module ``"builtin"`` (gpud_worker/kernels.py is their definition)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One journaled op, as it is to be replayed.

    Attributes
    ----------
    op:
        ``"alloc"``, ``"free"``, ``"htod"``, ``"load"`` or ``"launch"``.
    args:
        The CALL's arguments (PROTOCOL.md §5.4) with the caller's handles: ``handle`` of free and
        htod, and the values of ``ptr`` launch arguments, are the handles the caller holds.
    handle:
        alloc: the handle the caller got for it; free and htod: the handle they name; launch: 0.
    data:
        htod: the bytes copied (the journal's own copy); load: the module's source or binary;
        otherwise empty.
    """

    op: str
    args: Mapping[str, Any]
    handle: int = 0
    data: bytes = b""


@dataclass(slots=True)
class _Record:
    entry: Entry
    slots: tuple[int, ...]  # the allocations (by use, not by handle) it concerns
    cost: int
    reads: tuple[int, ...] = ()  # launch: slots it reads
    writes: tuple[tuple[int, bool], ...] = ()  # launch: (slot, whether all of it) it writes
    full: bool = False  # htod: it covers the whole allocation


@dataclass(slots=True)
class _Slot:
    handle: int
    nbytes: int
    freed: bool = False
    records: list[int] = field(default_factory=list)  # seqs of its alloc, htods and free
    launches: int = 0  # launches held in the journal that concern it


class Journal:
    """The journal of one device session (see the module's docstring).

    Parameters
    ----------
    limit:
        Bytes the journal may hold (:data:`ENTRY_COST` per entry plus copied bytes); 0 turns it
        off (nothing is recorded and it is never usable).
    """

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 0:
            raise ValueError(f"journal limit must be a non-negative int, got {limit!r}")
        self._limit = limit
        self._records: dict[int, _Record] = {}  # by seq, in order
        self._slots: dict[int, _Slot] = {}  # by slot number: every allocation held in the journal
        self._open: dict[int, int] = {}  # handle -> slot of the allocations not yet freed
        self._seq = 0
        self._next_slot = 0
        self._bytes = 0
        self._compact_at = MIN_COMPACT_ENTRIES
        self._overflowed = False
        self._reason: str | None = None if limit else "replay is turned off (journal_bytes=0)"

    # ------------------------------------------------------------------ state

    @property
    def limit(self) -> int:
        """The bound, in bytes (0: the journal is off)."""
        return self._limit

    @property
    def nbytes(self) -> int:
        """Bytes counted against the bound now."""
        return self._bytes

    @property
    def usable(self) -> bool:
        """Whether replaying the journal rebuilds the session's state."""
        return self._reason is None

    @property
    def overflowed(self) -> bool:
        """Whether the journal went past its bound (it is then unusable for good)."""
        return self._overflowed

    @property
    def reason(self) -> str | None:
        """Why the journal is not usable; None while it is."""
        return self._reason

    def __len__(self) -> int:
        return len(self._records)

    def entries(self) -> list[Entry]:
        """The entries to replay, in order (empty when the journal is not usable)."""
        return [r.entry for r in self._records.values()]

    def live(self) -> dict[int, int]:
        """The allocations not freed, handle -> size in bytes."""
        return {h: self._slots[s].nbytes for h, s in self._open.items()}

    def disable(self, reason: str) -> None:
        """Make the journal unusable for good (``reason`` says why) and drop what it holds."""
        if self._reason is None:
            self._reason = reason
        self._records.clear()
        self._slots.clear()
        self._open.clear()
        self._bytes = 0

    # ------------------------------------------------------------------ recording

    def alloc(self, handle: int, nbytes: int) -> None:
        """Record an allocation of ``nbytes`` that the caller knows as ``handle``."""
        if self._reason is not None:
            return
        if handle in self._open:
            self.disable(f"handle {handle} was allocated twice without a free")
            return
        slot = self._next_slot
        self._next_slot += 1
        self._slots[slot] = _Slot(handle, nbytes)
        self._open[handle] = slot
        self._add(Entry("alloc", {"nbytes": nbytes}, handle), (slot,), ENTRY_COST)

    def free(self, handle: int) -> None:
        """Record the free of ``handle``: drop the allocation's entries when no launch held in the
        journal used it; otherwise keep them and record the free."""
        if self._reason is not None:
            return
        slot = self._slot_of(handle, "free")
        if slot is None:
            return
        del self._open[handle]
        info = self._slots[slot]
        info.freed = True
        if info.launches == 0:
            for seq in info.records:
                self._bytes -= self._records.pop(seq).cost
            del self._slots[slot]
            return
        self._add(Entry("free", {"handle": handle}, handle), (slot,), ENTRY_COST)
        self._maybe_compact()

    def htod(self, handle: int, offset: int, data: bytes | memoryview) -> None:
        """Record a copy of ``data`` to ``handle`` at ``offset``: one entry for the whole copy,
        however many CALLs carried it. ``bytes`` are kept as they are (pass bytes the journal may
        keep); any other buffer is copied, and only when the journal keeps it: a copy larger than
        the journal's bound overflows it at once, without a copy of the buffer."""
        if self._reason is not None:
            return
        slot = self._slot_of(handle, "htod")
        if slot is None:
            return
        size = len(data) if type(data) is bytes else memoryview(data).nbytes
        if ENTRY_COST + size > self._limit:  # could never fit, whatever compaction drops
            self._overflowed = True
            self.disable(f"the journal went past its bound of {self._limit} bytes")
            return
        if type(data) is not bytes:
            data = bytes(data)
        entry = Entry("htod", {"handle": handle, "offset": offset}, handle, data)
        full = offset == 0 and len(data) >= self._slots[slot].nbytes
        self._add(entry, (slot,), ENTRY_COST + len(data), full=full)
        if full:
            self._maybe_compact()

    def load(self, kind: str, name: str, options: Sequence[str], data: bytes) -> None:
        """Record the load of module ``name`` (``kind`` "cuda", "ptx" or "cubin") from ``data``
        (kept as it is: pass bytes the journal may keep) with ``options``."""
        if self._reason is not None:
            return
        if ENTRY_COST + len(data) > self._limit:  # could never fit, whatever compaction drops
            self._overflowed = True
            self.disable(f"the journal went past its bound of {self._limit} bytes")
            return
        body = {"kind": kind, "name": name, "options": list(options)}
        self._add(Entry("load", body, 0, data), (), ENTRY_COST + len(data))

    def launch(
        self,
        module: str,
        name: str,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[Sequence[Any]],
        shared_mem: int,
    ) -> None:
        """Record a kernel launch; ``args`` are its ``[type, value]`` pairs with the caller's
        handles as the values of ``ptr`` arguments."""
        if self._reason is not None:
            return
        pairs = [[t, v] for t, v in args]
        by_index: dict[int, int] = {}
        for i, (tag, value) in enumerate(pairs):
            if tag == "ptr":
                slot = self._slot_of(value, "launch")
                if slot is None:
                    return
                by_index[i] = slot
        slots = tuple(dict.fromkeys(by_index.values()))
        reads, writes = self._effects(module, name, pairs, by_index, slots)
        body = {
            "module": module,
            "name": name,
            "grid": list(grid),
            "block": list(block),
            "args": pairs,
            "shared_mem": shared_mem,
        }
        self._add(Entry("launch", body), slots, ENTRY_COST, reads=reads, writes=writes)
        for slot in slots:
            self._slots[slot].launches += 1
        if any(whole for _, whole in writes):
            self._maybe_compact()

    # ------------------------------------------------------------------ compaction

    def compact(self) -> None:
        """Drop every entry that nothing in the session's current state depends on.

        A liveness pass from the last entry back: the allocations still open are needed; a kept
        launch needs what it reads, a kept copy or launch that writes a whole allocation ends the
        need for its earlier content, and an entry is kept when it writes something needed. An
        allocation is kept when it is still open or a kept entry uses it; its free with it.
        """
        if self._reason is not None:
            return
        needed = {slot: True for slot in self._open.values()}
        used: set[int] = set(self._open.values())
        keep: set[int] = set()
        for seq in reversed(self._records):
            rec = self._records[seq]
            op = rec.entry.op
            if op == "htod":
                slot = rec.slots[0]
                if needed.get(slot, False):
                    keep.add(seq)
                    used.add(slot)
                    if rec.full:
                        needed[slot] = False
            elif op == "launch":
                if any(needed.get(slot, False) for slot, _ in rec.writes):
                    keep.add(seq)
                    used.update(rec.slots)
                    for slot, whole in rec.writes:
                        if whole:
                            needed[slot] = False
                    for slot in rec.reads:
                        needed[slot] = True
        records: dict[int, _Record] = {}
        for seq, rec in self._records.items():
            op = rec.entry.op
            if (op in ("alloc", "free") and rec.slots[0] in used) or seq in keep or op == "load":
                records[seq] = rec
        self._rebuild(records)

    def _maybe_compact(self) -> None:
        if len(self._records) >= self._compact_at:
            self.compact()
            self._compact_at = max(MIN_COMPACT_ENTRIES, 2 * len(self._records))

    def _rebuild(self, records: dict[int, _Record]) -> None:
        self._records = records
        self._bytes = sum(r.cost for r in records.values())
        slots: dict[int, _Slot] = {}
        for seq, rec in records.items():
            for slot in rec.slots:
                info = slots.get(slot)
                if info is None:
                    old = self._slots[slot]
                    info = slots[slot] = _Slot(old.handle, old.nbytes, old.freed)
                if rec.entry.op == "launch":
                    info.launches += 1
                else:
                    info.records.append(seq)
        self._slots = slots

    # ------------------------------------------------------------------ helpers

    def _slot_of(self, handle: Any, op: str) -> int | None:
        slot = self._open.get(handle) if type(handle) is int else None
        if slot is None:
            self.disable(f"{op} names handle {handle!r}, which the journal does not hold")
        return slot

    def _effects(
        self,
        module: str,
        name: str,
        pairs: list[list[Any]],
        by_index: dict[int, int],
        slots: tuple[int, ...],
    ) -> tuple[tuple[int, ...], tuple[tuple[int, bool], ...]]:
        """The slots a launch reads, and those it writes with whether it writes all of each."""
        effect = BUILTIN_EFFECTS.get(name) if module == "builtin" else None
        if effect is not None:
            try:
                count = effect.count([v for _, v in pairs])
                reads = tuple(by_index[i] for i in effect.reads)
                written = by_index[effect.writes]
            except (IndexError, KeyError, TypeError, ValueError):
                effect = None  # not the built-in's signature: assume the worst
        if effect is None:
            return slots, tuple((slot, False) for slot in slots)
        whole = count * _F32 >= self._slots[written].nbytes and written not in reads
        return reads, ((written, whole),)

    def _add(
        self,
        entry: Entry,
        slots: tuple[int, ...],
        cost: int,
        *,
        full: bool = False,
        reads: tuple[int, ...] = (),
        writes: tuple[tuple[int, bool], ...] = (),
    ) -> None:
        seq = self._seq
        self._seq += 1
        self._records[seq] = _Record(entry, slots, cost, reads, writes, full)
        if entry.op not in ("launch", "load"):
            self._slots[slots[0]].records.append(seq)
        self._bytes += cost
        if self._bytes > self._limit:
            self.compact()
            if self._bytes > self._limit:
                self._overflowed = True
                self.disable(f"the journal went past its bound of {self._limit} bytes")
