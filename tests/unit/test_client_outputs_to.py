"""``outputs_to`` against a broker that lies: the client writes only the output files its job
asked for, under their own names in the directory it was given, whatever names a REPLY carries
(``gpud_client.staging.job_result``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpud.errors import ProtocolError
from gpud.protocol import Command, Message, Peer
from gpud_client.staging import job_result

NO_CONNECTION: Any = None  # these replies are refused (or taken) before anything is fetched


def reply(files: list[str], frames: list[bytes], **extra: Any) -> Message:
    header = {"id": b"j" * 16, "ok": True, "exit_code": 0, "files": files, **extra}
    return Message(Peer.BROKER, Command.REPLY, header, [b"out", b"err", *frames])


@pytest.mark.parametrize("names", [["../evil"], ["/tmp/evil"], ["other"], ["out", "out"]])
def test_an_inline_reply_naming_files_the_job_did_not_ask_for_writes_nothing(tmp_path: Path, names: list[str]) -> None:
    convert = job_result(NO_CONNECTION, "t", 1.0, outputs_to=tmp_path / "d", requested=["out"])
    (tmp_path / "d").mkdir()
    with pytest.raises(ProtocolError, match="did not ask for"):
        convert(reply(names, [b"x"] * len(names)))
    assert list(tmp_path.rglob("*")) == [tmp_path / "d"]


@pytest.mark.parametrize("names", [["../evil"], ["other"], ["out", "out"], "out"])
def test_a_staged_reply_naming_files_the_job_did_not_ask_for_fetches_and_writes_nothing(
        tmp_path: Path, names: Any) -> None:
    convert = job_result(NO_CONNECTION, "t", 1.0, outputs_to=tmp_path, requested=["out"])
    with pytest.raises(ProtocolError):
        convert(reply(names, [], staged=[5] * len(names)))
    assert list(tmp_path.iterdir()) == []


def test_an_inline_reply_of_the_asked_files_is_written_under_their_names(tmp_path: Path) -> None:
    convert = job_result(NO_CONNECTION, "t", 1.0, outputs_to=tmp_path, requested=["a", "b", "c"])
    result = convert(reply(["a", "c"], [b"first", b""]))
    assert result.files == {} and result.paths == {"a": tmp_path / "a", "c": tmp_path / "c"}
    assert (tmp_path / "a").read_bytes() == b"first" and (tmp_path / "c").read_bytes() == b""
    assert (result.stdout, result.stderr) == (b"out", b"err")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]
