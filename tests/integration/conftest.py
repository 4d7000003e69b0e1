"""Fixtures for integration tests: real daemons as subprocesses on loopback, real pool users."""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Iterator

import pytest

from gpud.security import CurveKeys
from gpud_cli.cluster import LocalCluster

POOL_PREFIX = "gpud-itest"


@pytest.fixture(scope="session")
def job_user_prefix() -> Iterator[str | None]:
    """Prefix of the pool users of workers w0..w2 (``LocalCluster.job_user_prefix``). As root these
    are real unprivileged users made here, three per worker; otherwise jobs run as this user."""
    if os.geteuid() != 0:
        yield None
        return
    made = []
    names = [f"{POOL_PREFIX}w{w}-{i}" for w in range(3) for i in range(3)]
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=True, capture_output=True,
            )
            made.append(name)
    yield POOL_PREFIX
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture(scope="module")
def alice(cluster: LocalCluster) -> CurveKeys:
    """Keys of a client of tenant alice on the module's CURVE ``cluster``."""
    return cluster.client_keys("alice")


@pytest.fixture(scope="module")
def bob(cluster: LocalCluster) -> CurveKeys:
    """Keys of a client of tenant bob on the module's CURVE ``cluster``."""
    return cluster.client_keys("bob")
