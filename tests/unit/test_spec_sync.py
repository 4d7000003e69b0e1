"""docs/PROTOCOL.md and the code must agree: version, signatures, command table, error table, the
Binary Star table (§9.1), the peer dialog's headers (§3, §9.2) and the replicated layouts (§9.3)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpud import errors, protocol
from gpud.clock import FakeClock
from gpud.protocol import Command, Peer
from gpud.resources import Grant
from gpud_broker import replication
from gpud_broker.tasks import Session, Task
from gpud_broker.tasks import State as TaskState
from gpud_standby.bstar import (
    HOLDS,
    TRANSITIONS,
    Action,
    Condition,
    Event,
    Facts,
    State,
    Transition,
    step,
)

DOC = Path(__file__).parents[2] / "docs" / "PROTOCOL.md"


@pytest.fixture(scope="module")
def lines() -> list[str]:
    assert DOC.is_file(), f"{DOC} is missing"
    return DOC.read_text(encoding="utf-8").splitlines()


def after_marker(lines: list[str], name: str) -> int:
    """Index of the line just after ``<!-- spec-sync: name -->`` (exactly one such marker)."""
    marker = f"<!-- spec-sync: {name} -->"
    found = [i for i, line in enumerate(lines) if line.strip() == marker]
    assert len(found) == 1, f"expected exactly one {marker!r} in {DOC.name}, found {len(found)}"
    return found[0] + 1


def table_rows(lines: list[str], start: int) -> list[list[str]]:
    """Body rows of the first Markdown table at or after ``start`` (header and rule dropped)."""
    return table(lines, start)[1:]


def table(lines: list[str], start: int) -> list[list[str]]:
    """The header and body rows of the first Markdown table at or after ``start`` (rule dropped)."""
    i = start
    while i < len(lines) and not lines[i].lstrip().startswith("|"):
        assert not lines[i].startswith("#"), "no table before the next section"
        i += 1
    rows: list[list[str]] = []
    while i < len(lines) and lines[i].lstrip().startswith("|"):
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        rows.append(cells)
        i += 1
    assert len(rows) >= 3, "a table needs a header, a rule and at least one row"
    assert all(set(c) <= set("-: ") for c in rows[1]), "second table line must be the rule"
    return [rows[0], *rows[2:]]


def section(lines: list[str], heading_prefix: str) -> int:
    found = [i for i, line in enumerate(lines) if line.startswith(heading_prefix)]
    assert len(found) == 1, f"expected one heading starting {heading_prefix!r}"
    return found[0] + 1


def test_version(lines: list[str]) -> None:
    i = after_marker(lines, "version")
    text = next(line for line in lines[i:] if line.strip())
    m = re.fullmatch(r"Protocol version: \*\*(\d+)\*\*", text.strip())
    assert m, f"unexpected version line {text!r}"
    assert int(m.group(1)) == protocol.PROTOCOL_VERSION
    assert lines[0].rstrip().endswith(f"version {protocol.PROTOCOL_VERSION}")
    for peer in Peer:
        assert peer.value[-1:] == str(protocol.PROTOCOL_VERSION).encode()


def test_signatures_table_lists_exactly_the_peers(lines: list[str]) -> None:
    rows = table_rows(lines, section(lines, "## 1."))
    documented: dict[str, str] = {}
    for row in rows:
        m = re.fullmatch(r"`(GPUD[A-Z]\d)`", row[-1])
        assert m, f"signature cell {row[-1]!r} is not a backquoted signature"
        kind = row[0].split()[0].upper()
        assert kind not in documented, f"peer {kind} listed twice"
        documented[kind] = m.group(1)
    assert documented == {p.name: p.value.decode("ascii") for p in Peer}
    for sig in documented.values():
        assert sig.startswith(protocol.SIGNATURE_PREFIX.decode()) and len(sig) == 6


def test_command_table(lines: list[str]) -> None:
    rows = table_rows(lines, after_marker(lines, "commands"))
    documented: list[tuple[str, int]] = []
    for row in rows:
        name, value = row[0], row[1]
        assert re.fullmatch(r"[A-Z_]+", name), f"command name {name!r}"
        assert re.fullmatch(r"0x[0-9A-F]{2}", value), f"command value {value!r} is not 0xNN"
        documented.append((name, int(value, 16)))
    names = [n for n, _ in documented]
    assert len(set(names)) == len(names), "a command is listed twice"
    assert len({v for _, v in documented}) == len(documented), "two commands share a value"
    assert dict(documented) == {c.name: c.value for c in Command}


def test_error_table(lines: list[str]) -> None:
    rows = table_rows(lines, after_marker(lines, "errors"))
    documented = []
    for row in rows:
        code, num = row[0], row[1]
        assert re.fullmatch(r"[A-Z_]+", code), f"error code {code!r}"
        assert re.fullmatch(r"\d+", num), f"errno {num!r}"
        documented.append((code, int(num)))
    assert documented == [(code, n) for code, (_, n) in errors.CODES.items()]  # same order too


# ---------------------------------------------------------------- the Binary Star table (§9.1)

# One outcome of a cell: "stay" or "→ STATE", then ", action", then " if [not ]COND and ..."; the
# last of several starts with "else " and has no condition.
OUTCOME = re.compile(r"(?P<else>else )?(?:stay|→ (?P<next>[A-Z]+))(?:, (?P<action>[a-z_]+))?(?: if (?P<cond>.+))?")


def parse_cell(state: State, cell: str) -> tuple[Transition, ...]:
    parts = cell.split("; ")
    outcomes = []
    for i, part in enumerate(parts):
        m = OUTCOME.fullmatch(part)
        assert m, f"{state.name}: cannot read {part!r} of {cell!r}"
        last = i == len(parts) - 1
        assert (m["cond"] is None) == last, f"{state.name}: {cell!r}: only the last outcome has no condition"
        assert bool(m["else"]) == (last and len(parts) > 1), f"{state.name}: {cell!r}: the default reads 'else'"
        when, unless = [], []
        for term in m["cond"].split(" and ") if m["cond"] else []:
            (unless if term.startswith("not ") else when).append(Condition[term.removeprefix("not ")])
        outcomes.append(Transition(
            State[m["next"]] if m["next"] else state,
            Action(m["action"]) if m["action"] else Action.NONE,
            tuple(when), tuple(unless),
        ))
    return tuple(outcomes)


@pytest.fixture(scope="module")
def spec_bstar(lines: list[str]) -> dict[tuple[State, Event], tuple[Transition, ...]]:
    head, *rows = table(lines, after_marker(lines, "bstar"))
    assert head[0] == "state"
    assert head[1:] == [e.name for e in Event], "the columns are the events, in the code's order"
    assert [r[0] for r in rows] == [s.name for s in State], "the rows are the states, in the code's order"
    spec = {}
    for row in rows:
        assert len(row) == len(head), f"row {row[0]} has {len(row)} cells"
        state = State[row[0]]
        for event, cell in zip(Event, row[1:], strict=True):
            spec[(state, event)] = parse_cell(state, cell)
    return spec


def _normal(outcomes: tuple[Transition, ...]) -> list[tuple[State, Action, frozenset[Condition], frozenset[Condition]]]:
    return [(t.next, t.action, frozenset(t.when), frozenset(t.unless)) for t in outcomes]


def test_bstar_spec_cells_are_the_code_rows_both_ways(spec_bstar: dict[tuple[State, Event], tuple[Transition, ...]]) -> None:
    assert set(spec_bstar) == set(itertools.product(State, Event)) == set(TRANSITIONS)
    differ = {k: (v, TRANSITIONS[k]) for k, v in spec_bstar.items() if _normal(v) != _normal(TRANSITIONS[k])}
    assert not differ, f"(PROTOCOL.md §9.1, bstar.TRANSITIONS) differ: {differ}"


def test_bstar_conditions_and_actions_are_the_code_enums(lines: list[str]) -> None:
    conditions = [r[0] for r in table_rows(lines, after_marker(lines, "bstar-conditions"))]
    assert conditions == [c.name for c in Condition]
    actions = [r[0] for r in table_rows(lines, after_marker(lines, "bstar-actions"))]
    assert sorted(actions) == sorted(a.value for a in Action if a is not Action.NONE)  # none: nothing written


ALL_FACTS = [
    Facts(primary=p, peer_expired=x, peer_silent=s, witness=w, epoch=e, peer_epoch=pe, peer_in_sync=y)
    for p, x, s, w, (e, pe), y in itertools.product(
        (True, False), (True, False), (True, False), (True, False), ((1, 1), (1, 2), (3, 2), (4, 4)), (True, False)
    )
]


def test_step_answers_every_pair_under_every_fact_as_the_spec_cell_reads(
        spec_bstar: dict[tuple[State, Event], tuple[Transition, ...]]) -> None:
    """The cells read as the spec says (the first outcome whose conditions hold), with the code's
    tests of the conditions (which test_bstar pins to the nested ifs' behaviour)."""
    for (state, event), outcomes in spec_bstar.items():
        for f in ALL_FACTS:
            expected = next(t for t in outcomes if all(HOLDS[c](f) for c in t.when)
                            and not any(HOLDS[c](f) for c in t.unless))
            assert step(state, event, f) == (expected.next, expected.action), (state, event, f)


# ---------------------------------------------------------------- the peer dialog (§3, §9.2)


def documented_keys(lines: list[str], command: Command) -> tuple[set[str], set[str]]:
    """The (required, all) header keys of ``command``'s row in the command table."""
    row = next(r for r in table_rows(lines, after_marker(lines, "commands")) if r[0] == command.name)
    cell = re.sub(r" \(§[\d.]+\)", "", row[3])
    if cell == "none required":
        return set(), set()
    keys = [k.strip() for k in cell.split(",")]
    assert all(re.fullmatch(r"(\*\*)?[a-z_]+(\*\*)?", k) for k in keys), f"{command.name}: cannot read {row[3]!r}"
    return {k.strip("*") for k in keys if k.startswith("**")}, {k.strip("*") for k in keys}


def test_the_pair_sends_its_peer_exactly_the_documented_header_keys(lines: list[str]) -> None:
    """Two real Pair shells, started, replicating a request and failing over, on a fake clock: every
    key each peer message carries is documented, the required ones always, and each documented one
    is sent at some point."""
    from tests.unit.test_broker_core import W1, rid
    from tests.unit.test_pair_clock import Side, settle

    ctx: zmq.Context[Any] = zmq.Context()
    clock = FakeClock()
    a = Side(ctx, clock, "primary", "inproc://sync-a", "inproc://sync-b")
    b = Side(ctx, clock, "backup", "inproc://sync-b", "inproc://sync-a")
    try:
        settle(a, b)
        a.h.ready(W1, "w1")
        a.client(rid(1))  # journaled: UPDATES
        settle(a, b)
        b.h.core.staging.unheld.add(rid(2))  # as if its spool could not write an upload's chunk: STATE unheld
        b.pair.state_due = True
        settle(a, b)
        b.h.core.staging.unheld.clear()
        a.pair.failover()  # STATE handover
        settle(a, b)
        assert (a.state.value, b.state.value) == ("passive", "active")
    finally:
        a.pair.close()
        b.pair.close()
        ctx.term()
    heard = a.heard + b.heard
    for command in sorted(protocol.SENDABLE[Peer.BROKER], key=lambda c: c.value):
        required, documented = documented_keys(lines, command)
        headers = [h for c, h in heard if c is command]
        assert headers, f"the pair never sent {command.name}"
        for h in headers:
            assert required <= set(h) <= documented, f"{command.name} {sorted(h)}: documented {sorted(documented)}"
        assert set().union(*headers) == documented, f"{command.name}: documented but never sent"


# ---------------------------------------------------------------- replication (§9.3)


def layout(lines: list[str], what: str) -> list[str]:
    """The item names of ``A <what> is `[a, b, ...]``` in §9.3."""
    start = section(lines, "### 9.3")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("#"))
    text = " ".join(line.strip() for line in lines[start:end])
    m = re.search(rf"A {what} (?:\([^)]*\) )?is `\[([^\]]+)\]`", text)
    assert m, f"§9.3 gives no layout of a {what}"
    return [item.strip() for item in m.group(1).split(",")]


GRANT = Grant(worker="w1", gpus=("GPU-1", "GPU-2"), gpu_milli=100, mem=256, cpu_milli=300, host_mem=400, exclusive=True)


def test_a_replicated_grant_session_and_task_are_the_documented_items_in_order(lines: list[str]) -> None:
    """Each item the spec names is the record's field of that name (as the wire carries it), in the
    spec's order. A name the record lacks yields KeyError, which no wire item equals."""
    names = layout(lines, "grant")
    assert replication.grant_to_wire(GRANT) == [list(v) if type(v) is tuple else v for v in (getattr(GRANT, n) for n in names)]

    s = Session(id=b"s" * 16, worker="w2", gpu="GPU-2", grant=GRANT, tenant="acme", route=b"r", last_seen=5.0,
                closing=True)
    names = layout(lines, "session")
    wire = {"grant": replication.grant_to_wire(GRANT)}
    assert replication.session_to_wire(s) == [wire.get(n, getattr(s, n, KeyError)) for n in names]

    now = 100.0
    need = protocol.parse_need("job", {"gpu_milli": 500})
    t = Task(id=b"t" * 16, kind="job", need=need, body={"argv": ["x"]}, frames=[b"in"], route=b"r", created=90.0,
             deadline=130.0, state=TaskState.RUNNING, tenant="acme", grant=GRANT, worker="w1", attempts=2,
             avoid={"w3", "w0"}, retryable=True, session=b"s" * 16, reply=[b"sig", b"cmd"], owner="acme KEY")
    names = layout(lines, "task")
    wire = {"need": protocol.need_to_wire(need), "created": 10.0, "deadline": 30.0,  # age and time left
            "avoid": ["w0", "w3"], "state": "running", "grant": replication.grant_to_wire(GRANT)}
    assert replication.task_to_wire(t, now) == [wire.get(n, getattr(t, n, KeyError)) for n in names]


def updates_of_every_kind() -> list[list[Any]]:
    """What a passive broker gets in UPDATES while its active peer goes through one of each update."""
    from tests.unit.test_broker_core import C1, W1, W2, rid
    from tests.unit.test_pair_clock import Side, settle

    ctx: zmq.Context[Any] = zmq.Context()
    a = Side(ctx, FakeClock(), "primary", "inproc://updates-a", "inproc://updates-b", max_queue=1, stage_ttl=0.005)
    b = Side(ctx, a.clock, "backup", "inproc://updates-b", "inproc://updates-a")
    try:
        settle(a, b)
        h = a.h
        h.ready(W1, "w1")
        a.client(rid(1))  # task, run
        h.result(W1, rid(1))  # done
        h.request(C1, rid(2), kind="session")
        h.result(W1, rid(2), session=rid(2))  # session
        h.request(C1, rid(5), kind="job", argv=["x"], need={"gpu_milli": 100})  # task, run
        h.worker(W1, Command.START, {"ids": [rid(5)]})  # start
        h.result(W1, rid(5))  # done
        h.core.tasks.share = lambda _tenant: 0  # no room for the job's reply: expired
        h.core.tasks.evict(h.core.now)
        h.request(C1, rid(3), kind="job", argv=["x"], idempotent=True, need={"gpu_milli": 100})
        h.worker(W1, Command.DISCONNECT, {})  # end (the session), queue (the idempotent job: it fills the queue)
        h.request(C1, rid(4), kind="job", argv=["x"])  # task, then forget: no room in the queue
        h.ready(W2, "w2")
        h.core.workers.marks_changed()  # marks
        h.client(C1, Command.PUT, {"id": rid(20), "job": rid(21), "sizes": [3]})  # stage
        h.client(C1, Command.PUT, {"id": rid(22), "job": rid(21), "file": 0, "offset": 0}, [b"abc"])  # chunk
        h.tick(0.01)  # unstage: no job claimed it
        settle(a, b)
    finally:
        a.pair.close()
        b.pair.close()
        ctx.term()
    return b.updates


def test_every_replicated_update_has_the_documented_items(lines: list[str]) -> None:
    rows = table_rows(lines, after_marker(lines, "updates"))
    documented = {row[0].strip("`"): [i.strip() for i in row[1].split(",")] for row in rows}
    assert set(documented) == {replication.TASK, replication.RUN, replication.QUEUE, replication.DONE, replication.FORGET,
                               replication.SESSION, replication.END, replication.MARKS, replication.START,
                               replication.EXPIRED, replication.STAGE, replication.CHUNK, replication.UNSTAGE}
    seen: dict[str, set[int]] = {}
    for update in updates_of_every_kind():
        seen.setdefault(update[0], set()).add(len(update) - 1)
    assert set(seen) == set(documented), "the passive should have been sent one of each update"
    assert {tag: {len(items)} for tag, items in documented.items()} == seen
