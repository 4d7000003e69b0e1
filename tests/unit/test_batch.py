"""BATCH (PROTOCOL.md §2.1): ``batched`` combines runs of small messages and keeps the order and the
limits; ``unbatch`` gives back exactly what went in, and refuses a malformed BATCH as a whole."""

from __future__ import annotations

import os
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpud import protocol as P
from gpud.errors import GpudError, ProtocolError, TooLarge, UnknownCommand
from gpud.protocol import Command, Peer


def reply(n: int = 0, payload: list[Any] | None = None, **extra: Any) -> list[Any]:
    header = {"id": n.to_bytes(16, "little"), "ok": True, **extra}
    return P.encode(Peer.CLIENT, Command.REPLY, header, [] if payload is None else payload)


def sent(out: list[Any]) -> list[list[Any]]:
    """What a receiver makes of ``out`` (as sent by ``batched``): the messages, as frame lists."""
    got = []
    for frames in out:
        msg = P.decode(list(frames), Peer.CLIENT)
        if msg.command is Command.BATCH:
            got += [[Peer.CLIENT.value, P.CMD_BYTES[m.command], raw, *m.frames] for m, raw in P.unbatch(msg)]
        else:
            got.append([frames[0], frames[1], frames[2], *msg.frames])
    return got


def same(a: list[list[Any]], b: list[list[Any]]) -> bool:
    return [[bytes(f) for f in m] for m in a] == [[bytes(f) for f in m] for m in b]


def kinds(out: list[Any]) -> list[str]:
    return ["BATCH" if frames[1] == P.CMD_BYTES[Command.BATCH] else "alone" for frames in out]


# --------------------------------------------------------------------------- batched


def test_a_run_of_small_messages_is_one_batch_that_gives_back_each_message() -> None:
    msgs = [reply(0), reply(1, [b"a"]), reply(2, [b"bc", b"", memoryview(b"def")]), reply(3, code="X")]
    out = P.batched(msgs)
    assert kinds(out) == ["BATCH"]
    assert same(sent(out), msgs)
    inner = P.unbatch(P.decode(list(out[0]), Peer.CLIENT))
    assert [raw for _, raw in inner] == [m[2] for m in msgs]  # headers travel byte for byte
    assert [m.command for m, _ in inner] == [Command.REPLY] * 4
    assert inner[2][0].frames == [b"bc", b"", memoryview(b"def")]


def test_one_message_goes_alone() -> None:
    msg = reply(0, [b"x"])
    assert P.batched([msg]) == [msg]


def test_a_large_message_goes_alone_and_the_order_is_kept() -> None:
    big = reply(9, [os.urandom(P.BATCH_ITEM_PAYLOAD + 1)])
    msgs = [reply(0), reply(1), big, reply(2), big, reply(3), reply(4)]
    out = P.batched(msgs)
    assert kinds(out) == ["BATCH", "alone", "alone", "alone", "BATCH"]
    assert out[1] is big and out[3] is big
    assert same(sent(out), msgs)


def test_a_message_exactly_at_the_item_limit_is_batched() -> None:
    msgs = [reply(0, [bytes(P.BATCH_ITEM_PAYLOAD)]), reply(1)]
    assert kinds(P.batched(msgs)) == ["BATCH"]


@pytest.mark.parametrize(
    "make, count",
    [
        (lambda i: reply(i), P.BATCH_MAX_MESSAGES * 2 + 5),  # message count
        (lambda i: reply(i, note="x" * 20_000), 10),  # header bytes
        (lambda i: reply(i, [b"f"] * 1000), 10),  # payload frames
        (lambda i: reply(i, [bytes(60_000)]), 40),  # payload bytes
    ],
    ids=["messages", "header-bytes", "frames", "payload-bytes"],
)
def test_batches_keep_within_every_limit(make: Any, count: int) -> None:
    msgs = [make(i) for i in range(count)]
    out = P.batched(msgs)
    assert len(out) > 1
    for frames in out:
        msg = P.decode(list(frames), Peer.CLIENT)  # each within the header and frame limits
        if msg.command is Command.BATCH:
            assert len(P.unbatch(msg)) <= P.BATCH_MAX_MESSAGES
            assert sum(len(f) for f in msg.frames) <= P.BATCH_PAYLOAD
    assert same(sent(out), msgs)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=40))
def test_any_mix_comes_back_whole_and_in_order(shape: list[tuple[int, int]]) -> None:
    sizes = [0, 10, P.BATCH_ITEM_PAYLOAD, P.BATCH_ITEM_PAYLOAD + 1]
    msgs = [reply(i, [os.urandom(sizes[s])] * n) for i, (s, n) in enumerate(shape)]
    assert same(sent(P.batched(msgs)), msgs)


# --------------------------------------------------------------------------- unbatch refuses


def batch_of(msgs_field: Any, payload: list[bytes] | None = None) -> P.Message:
    """A decoded BATCH with this ``msgs`` (as decode hands it over: checked as a message only)."""
    return P.Message(Peer.WORKER, Command.BATCH, {"msgs": msgs_field}, list(payload or []))


GOOD = msgpack.packb({"id": bytes(16), "ok": True}, use_bin_type=True)


@pytest.mark.parametrize(
    "field, payload, error",
    [
        (None, [], ProtocolError),
        ("msgs", [], ProtocolError),
        ([], [], ProtocolError),
        ([[0x14, GOOD, 0]] * (P.BATCH_MAX_MESSAGES + 1), [], ProtocolError),
        ([[0x14, GOOD]], [], ProtocolError),
        ([[0x14, GOOD, 0, 1]], [], ProtocolError),
        ([(0x14, GOOD, 0)], [], ProtocolError),
        (["RESULT"], [], ProtocolError),
        ([[0x99, GOOD, 0]], [], UnknownCommand),
        ([[True, GOOD, 0]], [], UnknownCommand),
        ([["\x14", GOOD, 0]], [], UnknownCommand),
        ([[0x40, GOOD, 0]], [], ProtocolError),
        ([[0x14, "text header", 0]], [], ProtocolError),
        ([[0x14, b"\xc1", 0]], [], ProtocolError),
        ([[0x14, msgpack.packb([1, 2]), 0]], [], ProtocolError),
        ([[0x14, msgpack.packb({1: 2}), 0]], [], ProtocolError),
        ([[0x14, msgpack.packb({"x": "y" * P.MAX_HEADER_BYTES}), 0]], [], TooLarge),
        ([[0x14, GOOD, -1]], [], ProtocolError),
        ([[0x14, GOOD, 1.0]], [b"x"], ProtocolError),
        ([[0x14, GOOD, False]], [], ProtocolError),
        ([[0x14, GOOD, 2]], [b"x"], ProtocolError),
        ([[0x14, GOOD, 0]], [b"x"], ProtocolError),
        ([[0x14, GOOD, 1], [0x14, GOOD, 0]], [b"x", b"y"], ProtocolError),
        ([[0x14, GOOD, 0], [0x14, b"\xc1", 0]], [], ProtocolError),  # the good first one is not handed out
    ],
    ids=lambda v: None,
)
def test_a_malformed_batch_is_refused_whole(field: Any, payload: list[bytes], error: type[GpudError]) -> None:
    msg = batch_of(field, payload) if field is not None else P.Message(Peer.WORKER, Command.BATCH, {"other": 1})
    with pytest.raises(GpudError) as info:
        P.unbatch(msg)
    assert type(info.value) is error


def test_messages_of_a_plain_message_is_the_message() -> None:
    msg = P.decode(reply(5, [b"p"]), Peer.CLIENT)
    assert P.messages(msg) == [msg]


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-5, 70) | st.binary(max_size=20)
                    | st.text(max_size=5), lambda x: st.lists(x, max_size=4), max_leaves=12),
       st.lists(st.binary(max_size=8), max_size=4))
def test_unbatch_only_raises_gpud_errors(field: Any, payload: list[bytes]) -> None:
    try:
        out = P.unbatch(batch_of(field, payload))
    except GpudError:
        return
    assert sum(len(m.frames) for m, _ in out) == len(payload)
    assert all(isinstance(m.header, dict) and m.command is not Command.BATCH for m, _ in out)
