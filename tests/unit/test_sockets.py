"""gpud.sockets: which received frames come back as bytes and which without a copy."""

from __future__ import annotations

from typing import Any

import zmq

from gpud.sockets import ZERO_COPY_BYTES, recv_frames, send_frames


def test_small_payload_frames_are_copied_large_ones_are_not() -> None:
    # A small frame kept as zmq.Frame pins the receive buffer it was read into (kilobytes): the
    # broker keeps finished replies for a minute, so small ones must be copies.
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://sockets-test")
        b.connect("inproc://sockets-test")
        big = b"x" * ZERO_COPY_BYTES
        send_frames(a, [b"head", b"y" * 64, big])
        parts = recv_frames(b, copy_first=1)
        assert parts[0] == b"head" and type(parts[1]) is bytes and parts[1] == b"y" * 64
        assert isinstance(parts[2], zmq.Frame) and parts[2].bytes == big
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
