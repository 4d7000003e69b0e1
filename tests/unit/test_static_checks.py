"""The Makefile's `lint` and `typecheck` run inside `make test` (CI runs only that): a change that
breaks either fails the suite, as 28ac162 broke mypy for weeks unnoticed. The commands are read
from the Makefile, so the two stay one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def make_command(tool: str) -> list[str]:
    """The arguments of the Makefile's ``$(BIN)/TOOL ...`` line."""
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.fullmatch(rf"\t\$\(BIN\)/{tool} (.+)", line)
        if m:
            return [str(BIN / tool), *m.group(1).split()]
    raise AssertionError(f"the Makefile runs no $(BIN)/{tool}")


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_the_tree_passes_the_makefiles_static_check(tool: str) -> None:
    cmd = make_command(tool)
    if not Path(cmd[0]).exists():
        pytest.skip(f"{tool} is not installed beside this Python (the 'test' extra has it)")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
