"""Which package may import which: every part sits below the parts that use it (DESIGN.md §2).

- ``gpud`` (the shared core) imports no component;
- the components import ``gpud`` and themselves, and no other component, except that the
  broker's socket shell wires in the pair (``gpud_broker.broker`` and ``gpud_broker.__main__``
  import ``gpud_standby``);
- ``gpud_cli`` (the command line, the local cluster, the demo) sits above them all: it starts them;
- so ``gpud_standby`` imports nothing of ``gpud_broker``: ``Pair`` talks to the broker's core
  through ``gpud_standby.paired.PairedBroker``, which the core implements.

Every import counts, at the top of a module or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "gpud": ROOT / "gpud",
    "gpud_broker": ROOT / "broker" / "gpud_broker",
    "gpud_worker": ROOT / "worker" / "gpud_worker",
    "gpud_standby": ROOT / "standby" / "gpud_standby",
    "gpud_client": ROOT / "libclient" / "gpud_client",
    "gpud_cli": ROOT / "cli" / "gpud_cli",
}
COMPONENTS = set(PACKAGES) - {"gpud"}
TOP = {"gpud_cli"}  # may import every component
# Modules allowed to import another component, and which.
WIRING = {
    "broker/gpud_broker/broker.py": {"gpud_standby"},
    "broker/gpud_broker/__main__.py": {"gpud_standby"},
}


def top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def modules() -> list[tuple[str, str]]:
    return [(package, str(p.relative_to(ROOT))) for package, folder in PACKAGES.items()
            for p in sorted(folder.rglob("*.py"))]


@pytest.mark.parametrize(("package", "rel"), modules())
def test_a_module_imports_no_component_above_it(package: str, rel: str) -> None:
    others = (top_level_imports(ROOT / rel) & COMPONENTS) - {package} - WIRING.get(rel, set())
    if package in TOP:
        others &= TOP - {package}
    assert not others, f"{rel} ({package}) imports {sorted(others)}"


def test_the_checks_see_every_package() -> None:
    found = {package for package, _ in modules()}
    assert found == set(PACKAGES)
    assert ("gpud_standby", "standby/gpud_standby/pair.py") in modules()


def test_the_broker_core_has_every_member_of_paired_broker() -> None:
    """``Pair`` is given the core as its PairedBroker (mypy checks the types where it runs)."""
    from gpud_broker.core import BrokerConfig, BrokerCore
    from gpud_standby.paired import PairedBroker

    wanted = {n for n in vars(PairedBroker) if not n.startswith("_")}
    core = BrokerCore(BrokerConfig(), 0.0, lambda *_: None, lambda *_: None)
    missing = sorted(n for n in wanted if not hasattr(core, n))
    assert len(wanted) > 10 and not missing, f"BrokerCore lacks {missing}"
