"""Every admin command's documentation renders, and every documented example runs.

The docstrings in ``gpud.admin_commands`` are the help of ``gpudctl`` and the reference in
docs/OPERATIONS.md; each ``Example:`` line is run here, as written, against a live broker (a
LocalCluster with one simulated worker ``w0``), and must end as documented: status 0, or the
documented status with the documented error text.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.admin_commands import COMMANDS, markdown, usage
from gpud_cli.cluster import LocalCluster
from gpud_client import ctl

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
BEGIN, END = "<!-- admin-commands: begin -->", "<!-- admin-commands: end -->"

EXAMPLES = [(name, line, status, error) for name, spec in COMMANDS.items() for line, status, error in spec.examples]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=1, gpus_per_worker=1) as c:
        yield c


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_a_summary_and_an_example(name: str) -> None:
    spec = COMMANDS[name]
    assert spec.summary and spec.summary.endswith(".") and len(spec.summary) <= 100, spec.summary
    assert spec.examples, f"{name} documents no Example: line"
    for line, status, error in spec.examples:
        words = shlex.split(line)
        assert words[:2] == ["gpudctl", name], line
        assert status in (0, 1) and (status == 0) == (error == ""), line


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_is_the_docstring(name: str, capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    assert ctl.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    spec = COMMANDS[name]
    assert spec.doc in out
    assert "--json" in out
    for a in spec.args:
        assert (a.metavar or a.name) in out if a.positional else a.flag in out


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    assert ctl.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, spec in COMMANDS.items():
        assert f"{name} {' '.join(spec.summary.split())}" in out, name
    assert "top" in out


def test_operations_doc_carries_the_rendered_table() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{OPERATIONS.name} needs the {BEGIN} markers"
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert section.strip() == markdown().strip(), (
        "docs/OPERATIONS.md is out of date: replace the text between the markers with the output "
        "of `python -m gpud.admin_commands`"
    )
    for name, spec in COMMANDS.items():
        assert f"`{name}`" in section and usage(spec) in section


@pytest.mark.parametrize(("name", "line", "status", "error"), EXAMPLES, ids=[e[1] for e in EXAMPLES])
def test_documented_example_runs(cluster: LocalCluster, name: str, line: str, status: int, error: str) -> None:
    argv = shlex.split(line)[1:]
    r = subprocess.run([sys.executable, "-m", "gpud_client.ctl", "--admin", cluster.admin, *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == status, f"{line}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    if status:
        assert error in r.stderr, r.stderr
    else:
        assert r.stdout.strip() and r.stderr == "", r.stderr
        assert all(len(out) <= 80 for out in r.stdout.splitlines()), r.stdout
