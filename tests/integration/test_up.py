"""``gpud up --demo`` (what ``make run`` runs): a broker pair, workers, the demo workload with a
broker failover in the middle; every result checked by the demo itself."""

from __future__ import annotations

import subprocess
import sys


def test_gpud_up_demo_checks_every_result_through_a_failover() -> None:
    r = subprocess.run([sys.executable, "-m", "gpud_cli", "up", "--demo"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "demo OK: every result checked" in r.stdout
    assert "took over; all answered" in r.stdout and ", 0 wrong" in r.stdout
    assert "comes back passive" in r.stdout
