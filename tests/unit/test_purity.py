"""The pure cores import no sockets and no event loop (STYLE.md: files that must stay pure); the
broker's core and its parts read no clock (the caller passes the time) and draw no unseeded random."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = [
    "gpud/protocol.py",
    "gpud/errors.py",
    "gpud/resources.py",
    "gpud/heartbeat.py",
    "gpud/clock.py",
    "broker/gpud_broker/registry.py",
    "broker/gpud_broker/ledger.py",
    "broker/gpud_broker/policies.py",
    "broker/gpud_broker/queue.py",
    "broker/gpud_broker/tasks.py",
    "broker/gpud_broker/core.py",
    "broker/gpud_broker/config.py",
    "broker/gpud_broker/admission.py",
    "broker/gpud_broker/dispatcher.py",
    "broker/gpud_broker/workers.py",
    "broker/gpud_broker/results.py",
    "broker/gpud_broker/sessions.py",
    "broker/gpud_broker/starts.py",
    "broker/gpud_broker/direct.py",
    "broker/gpud_broker/mix.py",
    "broker/gpud_broker/stats.py",
    "broker/gpud_broker/replication.py",
    "broker/gpud_broker/accounts.py",
    "broker/gpud_broker/leases.py",
    "broker/gpud_broker/takeover.py",
    "broker/gpud_broker/gate.py",
    "gpud/ratelog.py",
    "worker/gpud_worker/health.py",
    "worker/gpud_worker/modules.py",
    "worker/gpud_worker/cgroups.py",
    "standby/gpud_standby/bstar.py",
    "standby/gpud_standby/paired.py",
    "libclient/gpud_client/journal.py",
    "libclient/gpud_client/chunks.py",
]
FORBIDDEN = {"zmq", "asyncio", "socket", "selectors", "subprocess", "threading"}


def imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("rel", PURE)
def test_pure_module_imports_no_io(rel: str) -> None:
    bad = imported(ROOT / rel) & FORBIDDEN
    assert not bad, f"{rel} imports {sorted(bad)}"


BROKER_PURE = [rel for rel in PURE if rel.startswith("broker/")]
CLOCKS = {"monotonic", "monotonic_ns", "time", "time_ns", "sleep"}  # time's clocks (perf_counter only measures)
UNSEEDED = {"random", "choice", "choices", "sample", "shuffle", "randrange", "randint", "uniform", "getrandbits"}


def clock_and_random_uses(path: Path) -> list[str]:
    """What ``path`` reads of a clock or of the unseeded global random: ``time.monotonic()``,
    ``from time import time``, ``datetime``, ``random.sample(...)``, ``random.Random()``."""
    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if node.module == "datetime" or a.name in CLOCKS]
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name == "datetime"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            owner, name = node.func.value.id, node.func.attr
            if owner == "time" and name in CLOCKS:
                found.append(f"time.{name}()")
            elif owner in ("random", "_random") and (name in UNSEEDED or (name == "Random" and not node.args)):
                found.append(f"{owner}.{name}()")
    return found


@pytest.mark.parametrize("rel", BROKER_PURE)
def test_broker_core_reads_no_clock_and_no_unseeded_random(rel: str) -> None:
    bad = clock_and_random_uses(ROOT / rel)
    assert not bad, f"{rel} uses {bad}: take the time from the caller and draw from a seeded random.Random"


def test_the_clock_and_random_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    src = tmp_path / "bad.py"
    src.write_text("import time, random\nfrom time import monotonic, perf_counter\n"
                   "x = time.monotonic()\nr = random.Random()\ns = random.sample([1], 1)\nok = random.Random(0)\n")
    assert clock_and_random_uses(src) == ["from time import monotonic", "time.monotonic()", "random.Random()",
                                          "random.sample()"]
