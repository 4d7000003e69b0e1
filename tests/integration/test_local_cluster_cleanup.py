"""A LocalCluster whose start fails part-way leaves nothing running behind it."""

import os

import psutil
import pytest

from gpud.errors import ConfigError
from gpud_cli.cluster import LocalCluster
from gpud_cli.uid_ranges import DYNAMIC_LAST, UidBlocks


@pytest.mark.skipif(os.geteuid() != 0, reason="dynamic job uids are taken only as root")
def test_a_start_that_fails_after_the_broker_stops_the_broker() -> None:
    base = DYNAMIC_LAST - 15  # one block only, held here: the worker's start cannot get uids
    held = UidBlocks(base, 16, DYNAMIC_LAST)
    try:
        held.take()
    except ConfigError:
        pytest.skip("the last uid block is in use on this host")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with pytest.raises(ConfigError, match="held by another running cluster"):
            with LocalCluster(workers=1, dynamic_uid_base=base):
                pass
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        assert left == []  # the broker it had started is stopped, not orphaned
    finally:
        held.close()
