"""docs/PROTOCOL.md and the code must agree: version, signatures, command table, error table, the
Binary Star table (§9.1)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from gpud import errors, protocol
from gpud.protocol import Command, Peer
from gpud_standby.bstar import TRANSITIONS, Action, Condition, Event, Facts, State, Transition, step

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


# The conditions as the spec's words define them, written here independently of bstar.HOLDS.
SPEC_CONDITIONS = {
    Condition.EXPIRED: lambda f: f.peer_expired,
    Condition.SILENT: lambda f: f.peer_silent,
    Condition.WITNESS: lambda f: f.witness,
    Condition.PRIMARY: lambda f: f.primary,
    Condition.LOWER: lambda f: f.epoch < f.peer_epoch or (f.epoch == f.peer_epoch and not f.primary),
    Condition.IN_SYNC: lambda f: f.peer_in_sync,
}
ALL_FACTS = [
    Facts(primary=p, peer_expired=x, peer_silent=s, witness=w, epoch=e, peer_epoch=pe, peer_in_sync=y)
    for p, x, s, w, (e, pe), y in itertools.product(
        (True, False), (True, False), (True, False), (True, False), ((1, 1), (1, 2), (3, 2), (4, 4)), (True, False)
    )
]


def test_step_answers_every_pair_under_every_fact_as_the_spec_cell_reads(
        spec_bstar: dict[tuple[State, Event], tuple[Transition, ...]]) -> None:
    assert set(SPEC_CONDITIONS) == set(Condition)
    for (state, event), outcomes in spec_bstar.items():
        for f in ALL_FACTS:
            expected = next(t for t in outcomes if all(SPEC_CONDITIONS[c](f) for c in t.when)
                            and not any(SPEC_CONDITIONS[c](f) for c in t.unless))
            assert step(state, event, f) == (expected.next, expected.action), (state, event, f)
