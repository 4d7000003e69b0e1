"""The worker keeps a job's RESULT under the broker's maximum message size (PROTOCOL.md §4.2)."""

from __future__ import annotations

import pytest

from gpud import protocol as P
from gpud.errors import TooLarge
from gpud_worker.worker import RESULT_HEADROOM, check_result_size

MiB = 1 << 20


def test_a_result_under_the_limit_passes() -> None:
    check_result_size({"ok": True, "files": ["a"]}, [b"x" * MiB, b"", b"y" * MiB], 4 * MiB)


def test_output_files_past_the_limit_fail_the_job_naming_the_sizes() -> None:
    with pytest.raises(TooLarge) as info:
        check_result_size({"ok": True, "files": ["a", "b"]}, [b"out", b"", b"y" * (2 * MiB), b"z" * (2 * MiB)], 4 * MiB)
    assert "2 output file(s)" in info.value.message and str(4 * MiB - RESULT_HEADROOM) in info.value.message


def test_stdout_alone_can_be_too_large() -> None:
    with pytest.raises(TooLarge):
        check_result_size({"ok": True}, [b"x" * (4 * MiB), b""], 4 * MiB)


def test_too_many_files_or_names_fail() -> None:
    names = [f"f{i}" for i in range(P.MAX_PAYLOAD_FRAMES)]
    with pytest.raises(TooLarge):
        check_result_size({"files": names}, [b"", b"", *[b""] * len(names)], 1 << 30)
    long_names = [f"{i:04d}" + "n" * 120 for i in range(1000)]
    with pytest.raises(TooLarge, match="header"):
        check_result_size({"files": long_names}, [b"", b"", *[b""] * len(long_names)], 1 << 30)
