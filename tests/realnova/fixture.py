"""The session's real Nova as a pytest fixture (``real_nova``), started once, stopped at the end.
Skipped, saying why, only where .venv-nova is missing (``make test`` makes it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.realnova import RealNova, Unavailable


@pytest.fixture(scope="session")
def real_nova(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNova]:
    nova = RealNova(tmp_path_factory.mktemp("nova"))
    try:
        nova.start()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        yield nova
    finally:
        nova.close()
