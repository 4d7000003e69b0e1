"""docs/PROTOCOL.md and the code must agree: version, signatures, command table, error table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpud import errors, protocol
from gpud.protocol import Command, Peer

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
    return rows[2:]


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
