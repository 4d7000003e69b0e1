"""Property-based fuzzing of the codec (hypothesis): whatever arrives, decode either returns a
Message or raises a GpudError, and what encode produces decodes to the same thing."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpud import protocol as P
from gpud.errors import GpudError
from gpud.protocol import Command, Peer

SIGS = [p.value for p in Peer] + [b"GPUDC9", b"GPUDX1", b"", b"GPUD"]
CMDS = [bytes([c]) for c in Command] + [b"\x00", b"\xff", b"", b"\x01\x02"]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
headers = st.dictionaries(st.sampled_from(["id", "kind", "need", "op", "args", "session", "x"]) | st.text(max_size=8),
                          msgpack_values, max_size=8)


def _decode_is_total(frames: list[Any]) -> None:
    try:
        msg = P.decode(frames)
    except GpudError:
        return
    assert isinstance(msg.header, dict)
    assert all(type(k) is str for k in msg.header)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_random_frames_never_escape_the_error_tree(frames: list[bytes]) -> None:
    _decode_is_total(frames)


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(SIGS), st.sampled_from(CMDS), st.binary(max_size=200), st.lists(st.binary(max_size=32), max_size=4))
def test_mutated_envelopes(sig: bytes, cmd: bytes, header: bytes, payload: list[bytes]) -> None:
    _decode_is_total([sig, cmd, header, *payload])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Peer)), st.sampled_from(list(Command)), headers, st.lists(st.binary(max_size=64), max_size=4))
def test_encode_decode_round_trip(peer: Peer, cmd: Command, header: dict[str, Any], payload: list[bytes]) -> None:
    msg = P.decode(P.encode(peer, cmd, header, payload))
    assert msg.peer is peer and msg.command is cmd
    assert P.packb(msg.header) == P.packb(header)
    assert msg.frames == payload


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["echo", "job", "session"]), msgpack_values)
def test_parse_need_total(kind: str, raw: Any) -> None:
    try:
        need = P.parse_need(kind, raw)
    except GpudError:
        return
    assert 1 <= need.milli_per_gpu <= 1000 and need.mem >= 0 and -100 <= need.priority <= 100


@settings(max_examples=200, deadline=None)
@given(msgpack_values)
def test_launch_args_total(raw: Any) -> None:
    try:
        args = P.parse_launch_args(raw)
    except GpudError:
        return
    assert all(tag in P.ARG_TYPES for tag, _ in args)


@settings(max_examples=200, deadline=None)
@given(headers, st.integers(0, 3))
def test_parse_job_total(header: dict[str, Any], nframes: int) -> None:
    try:
        spec = P.parse_job(header, nframes)
    except GpudError:
        return
    assert spec.argv and len(spec.files) == nframes
