"""The pure cores import no sockets and no event loop (STYLE.md: files that must stay pure)."""

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

