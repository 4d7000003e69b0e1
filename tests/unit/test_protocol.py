"""gpud.protocol: encode/decode, the malformed-message taxonomy, and every header-field validator."""

from __future__ import annotations

import math
import random
from typing import Any

import msgpack
import pytest

from gpud import protocol as P
from gpud.errors import (
    GpudError,
    InvalidRequest,
    ProtocolError,
    TooLarge,
    UnknownCommand,
    VersionError,
)
from gpud.protocol import Command, Message, Peer
from gpud.resources import GpuInfo, GpuState, Need

MiB = 1 << 20
GiB = 1 << 30
RID = bytes(range(16))


def raw_header(obj: Any) -> bytes:
    """A header frame packed like any msgpack producer would (bypassing encode's dict typing)."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def decode_error(frames: list[Any], **kw: Any) -> GpudError:
    """Decode ``frames`` and return the GpudError raised (the test fails if none is)."""
    with pytest.raises(GpudError) as info:
        P.decode(frames, **kw)
    return info.value


def assert_raises_exactly(cls: type[GpudError], frames: list[Any], **kw: Any) -> None:
    exc = decode_error(frames, **kw)
    assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc}"
    assert exc.code == cls.code


def valid(
    peer: Peer = Peer.CLIENT, cmd: Command = Command.REQUEST, header: Any = None
) -> list[Any]:
    return [peer.value, P.CMD_BYTES[cmd], raw_header({"id": RID} if header is None else header)]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("cmd", list(Command), ids=lambda c: c.name)
@pytest.mark.parametrize("peer", list(Peer), ids=lambda p: p.name)
def test_round_trip_every_command(peer: Peer, cmd: Command) -> None:
    header = {
        "id": RID,
        "kind": "echo",
        "n": -5,
        "f": 1.5,
        "ok": True,
        "none": None,
        "nested": {"list": [1, "two", b"\x03"], "map": {"k": "v"}},
    }
    payload = [b"plain bytes", memoryview(b"a view"), bytearray(b"a bytearray"), b""]
    frames = P.encode(peer, cmd, header, payload)
    assert frames[0] == peer.value and len(frames[0]) == 6
    assert frames[1] == bytes([cmd.value]) and len(frames[1]) == 1
    msg = P.decode(frames, expect=peer)
    assert isinstance(msg, Message)
    assert msg.peer is peer
    assert msg.command is cmd
    assert msg.header == header
    assert type(msg.header["id"]) is bytes  # bin stays bin, str stays str
    assert type(msg.header["kind"]) is str
    assert len(msg.frames) == len(payload)
    for got, sent in zip(msg.frames, payload, strict=True):
        assert got is sent  # payload frames are passed through, never copied
        assert bytes(got) == bytes(sent)


def test_round_trip_without_payload_and_without_expect() -> None:
    msg = P.decode(P.encode(Peer.WORKER, Command.HEARTBEAT, {"seq": 7}))
    assert (msg.peer, msg.command, msg.header, msg.frames) == (
        Peer.WORKER,
        Command.HEARTBEAT,
        {"seq": 7},
        [],
    )


def test_encode_does_not_copy_payload() -> None:
    big = bytearray(MiB)
    frames = P.encode(Peer.CLIENT, Command.REQUEST, {"id": RID}, [big])
    assert frames[3] is big


def test_decode_accepts_bytes_like_leading_frames() -> None:
    frames = valid()
    msg = P.decode([bytearray(frames[0]), memoryview(frames[1]), bytearray(frames[2])])
    assert msg.peer is Peer.CLIENT and msg.command is Command.REQUEST and msg.header == {"id": RID}


@pytest.mark.parametrize("frame", ["GPUDC1", 7, None], ids=["str", "int", "none"])
def test_decode_non_bytes_frame_is_protocol_error(frame: Any) -> None:
    assert_raises_exactly(ProtocolError, [frame, b"\x01", raw_header({})])


def test_decode_header_exactly_at_limit_is_accepted() -> None:
    header = raw_header(
        {"x": b"a" * (P.MAX_HEADER_BYTES - 6)}
    )  # fixmap + fixstr "x" + bin16 head = 6
    assert len(header) == P.MAX_HEADER_BYTES
    msg = P.decode([Peer.CLIENT.value, b"\x01", header])
    assert len(msg.header["x"]) == P.MAX_HEADER_BYTES - 6


def test_decode_payload_frames_exactly_at_limit_is_accepted() -> None:
    frames = valid() + [b""] * P.MAX_PAYLOAD_FRAMES
    assert len(P.decode(frames).frames) == P.MAX_PAYLOAD_FRAMES


def test_decode_total_exactly_at_max_bytes_is_accepted() -> None:
    frames = valid()
    limit = len(frames[2]) + 100
    assert len(P.decode(frames + [b"x" * 100], max_bytes=limit).frames) == 1


# --------------------------------------------------------------------------- malformed messages


@pytest.mark.parametrize("frames", [[], [b"GPUDC1"], [b"GPUDC1", b"\x01"]], ids=["0", "1", "2"])
def test_fewer_than_three_frames(frames: list[Any]) -> None:
    assert_raises_exactly(ProtocolError, frames)


@pytest.mark.parametrize(
    "sig",
    [b"", b"GPUD", b"XXXXXX", b"GPUDX1", b"gpudc1", b"GPUDC1 ", b"GPUDC", b"MDPW01", b"\xff" * 100],
)
def test_bad_signature(sig: bytes) -> None:
    assert_raises_exactly(ProtocolError, [sig, b"\x01", raw_header({"id": RID})])


@pytest.mark.parametrize("sig", [b"GPUDC2", b"GPUDW0", b"GPUDA9", b"GPUDC3"])
def test_known_prefix_other_version(sig: bytes) -> None:
    assert_raises_exactly(VersionError, [sig, b"\x01", raw_header({"id": RID})])


@pytest.mark.parametrize("cmd", [b"\x00", b"\x0f", b"\x7e", b"\xff", b"", b"\x01\x01"])
def test_unknown_command_byte(cmd: bytes) -> None:
    assert_raises_exactly(UnknownCommand, [Peer.CLIENT.value, cmd, raw_header({"id": RID})])


@pytest.mark.parametrize("sender", list(Peer), ids=lambda p: p.name)
def test_wrong_peer_kind(sender: Peer) -> None:
    for expect in Peer:
        frames = valid(sender)
        if expect is sender:
            assert P.decode(frames, expect=expect).peer is sender
        else:
            assert_raises_exactly(UnknownCommand, frames, expect=expect)


def test_header_over_64k() -> None:
    header = raw_header({"x": b"a" * (P.MAX_HEADER_BYTES - 5)})
    assert len(header) == P.MAX_HEADER_BYTES + 1
    assert_raises_exactly(TooLarge, [Peer.CLIENT.value, b"\x01", header])


def test_too_many_payload_frames() -> None:
    assert_raises_exactly(TooLarge, valid() + [b""] * (P.MAX_PAYLOAD_FRAMES + 1))


def test_total_size_over_max_bytes() -> None:
    frames = valid()
    limit = len(frames[2]) + 100
    assert_raises_exactly(TooLarge, frames + [b"x" * 50, b"y" * 51], max_bytes=limit)
    assert_raises_exactly(TooLarge, frames + [memoryview(b"x" * 101)], max_bytes=limit)


def test_header_only_message_over_max_bytes() -> None:
    frames = [Peer.CLIENT.value, b"\x01", raw_header({"id": RID, "pad": "x" * 1000})]
    assert_raises_exactly(TooLarge, frames, max_bytes=100)


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\xc1",  # the one byte msgpack never uses
        b"\xff\xfe\xfd garbage",
        raw_header({"id": RID, "kind": "echo"})[:-3],  # truncated
        raw_header({"id": RID})[:1],  # a map head with nothing after it
        raw_header({}) + b"\x00",  # trailing data after the map
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G entries, no data
    ],
    ids=["empty", "c1", "garbage", "truncated", "head-only", "extra-data", "huge-count"],
)
def test_bad_msgpack(header: bytes) -> None:
    assert_raises_exactly(ProtocolError, [Peer.CLIENT.value, b"\x01", header])


@pytest.mark.parametrize(
    "obj", [[1, 2, 3], 5, "a string", b"bytes", None, 1.5, True], ids=lambda o: type(o).__name__
)
def test_msgpack_not_a_map(obj: Any) -> None:
    assert_raises_exactly(ProtocolError, [Peer.CLIENT.value, b"\x01", raw_header(obj)])


@pytest.mark.parametrize("key", [1, -1, 1.5, None, True], ids=repr)
def test_non_str_map_keys(key: Any) -> None:
    assert_raises_exactly(ProtocolError, [Peer.CLIENT.value, b"\x01", raw_header({key: 1})])


def test_bytes_map_keys_are_refused() -> None:
    assert_raises_exactly(ProtocolError, [Peer.CLIENT.value, b"\x01", raw_header({b"id": RID})])


def test_fuzz_decode_only_raises_gpud_errors() -> None:
    rng = random.Random(20240601)
    sigs = [p.value for p in Peer] + [b"GPUDC2", b"GPUDW9", b"GPUDX1", b"GPUD"]
    cmds = [bytes([c]) for c in Command] + [b"\x00", b"\x99", b"", b"\x01\x02"]
    templates = [
        raw_header({"id": RID, "kind": "echo", "need": {"gpu_milli": 5}}),
        raw_header({"seq": 3, "gpus": [{"uuid": "GPU-0", "util": 50.5}], "draining": False}),
        raw_header([1, {"a": b"b"}]),
    ]
    outcomes = {"message": 0, "error": 0}

    def rbytes(n: int) -> bytes:
        return bytes(rng.getrandbits(8) for _ in range(n))

    for _ in range(2000):
        mode = rng.randrange(5)
        if mode == 0:  # anything at all
            frames: list[Any] = [rbytes(rng.randrange(12)) for _ in range(rng.randrange(7))]
        elif mode == 1:  # valid-looking signature and command, random header bytes
            frames = [rng.choice(sigs), rng.choice(cmds), rbytes(rng.randrange(40))]
        elif mode == 2:  # a valid header with random bytes flipped, cut or appended
            h = bytearray(rng.choice(templates))
            for _ in range(rng.randrange(1, 4)):
                op = rng.randrange(3)
                if op == 0 and h:
                    h[rng.randrange(len(h))] = rng.getrandbits(8)
                elif op == 1:
                    del h[rng.randrange(len(h) + 1) :]
                else:
                    h += rbytes(rng.randrange(1, 6))
            frames = [rng.choice(sigs), rng.choice(cmds), bytes(h)]
        elif mode == 3:  # valid prefix, a msgpack head byte of every type followed by random bytes
            frames = [
                Peer.WORKER.value,
                b"\x12",
                bytes([rng.getrandbits(8)]) + rbytes(rng.randrange(20)),
            ]
        else:  # a well-formed message (so the loop also sees successes)
            frames = P.encode(rng.choice(list(Peer)), rng.choice(list(Command)), {"k": rbytes(4)})
        if mode and rng.random() < 0.3:
            frames += [rbytes(rng.randrange(8)) for _ in range(rng.randrange(4))]
        kw: dict[str, Any] = {}
        if rng.random() < 0.3:
            kw["expect"] = rng.choice(list(Peer))
        if rng.random() < 0.2:
            kw["max_bytes"] = rng.randrange(64)
        try:
            msg = P.decode(frames, **kw)
        except GpudError:
            outcomes["error"] += 1
        else:
            assert isinstance(msg, Message)
            assert type(msg.header) is dict
            assert all(isinstance(k, (str, bytes)) for k in msg.header)
            outcomes["message"] += 1
    # The generator must exercise both outcomes, or the loop proves little.
    assert outcomes["message"] > 50 and outcomes["error"] > 500, outcomes


# --------------------------------------------------------------------------- get_id


def test_get_id() -> None:
    assert P.get_id({"id": RID}) == RID
    assert P.get_id({"session": RID}, "session") == RID
    new = P.new_id()
    assert type(new) is bytes and len(new) == P.ID_BYTES == 16
    assert P.new_id() != new


@pytest.mark.parametrize(
    "value",
    [None, b"", b"x" * 15, b"x" * 17, "x" * 16, bytearray(16), list(range(16)), 16],
    ids=["none", "empty", "15", "17", "str", "bytearray", "list", "int"],
)
def test_get_id_refuses(value: Any) -> None:
    with pytest.raises(ProtocolError):
        P.get_id({"id": value})
    with pytest.raises(ProtocolError):
        P.get_id({"other": RID}, "id")  # missing


# --------------------------------------------------------------------------- parse_need


@pytest.mark.parametrize(
    ("kind", "milli", "mem"), [("echo", 1, 0), ("job", 1000, 0), ("session", 100, 256 * MiB)]
)
def test_need_defaults_per_kind(kind: str, milli: int, mem: int) -> None:
    raws: list[dict[str, Any] | None] = [None, {}]
    for raw in raws:
        need = P.parse_need(kind, raw)
        assert need == Need(gpu_milli=milli, gpus=0, mem=mem)
        assert need.tenant == "default" and need.priority == 0 and not need.exclusive
        assert need.models is None and need.min_cc is None
        assert need.cpu_milli == 0 and need.host_mem == 0


def test_need_unknown_keys_are_ignored() -> None:
    assert P.parse_need("job", {"future_key": [1, 2]}) == P.parse_need("job", {})


@pytest.mark.parametrize("raw", [[], "x", 5, True], ids=repr)
def test_need_must_be_a_map(raw: Any) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_need("echo", raw)


@pytest.mark.parametrize("milli", [None, 0, 1000])
def test_need_whole_gpus_force_1000_milli(milli: int | None) -> None:
    raw: dict[str, Any] = {"gpus": 2}
    if milli is not None:
        raw["gpu_milli"] = milli
    need = P.parse_need("job", raw)
    assert need.gpus == 2 and need.gpu_milli == 1000
    assert need.gpu_count == 2 and need.milli_per_gpu == 1000 and need.total_milli == 2000


@pytest.mark.parametrize("milli", [1, 500, 999, 1001])
def test_need_whole_gpus_refuse_partial_milli(milli: int) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_need("job", {"gpus": 1, "gpu_milli": milli})


def test_need_ranges_accept_bounds() -> None:
    assert P.parse_need("echo", {"gpu_milli": 1}).gpu_milli == 1
    assert P.parse_need("echo", {"gpu_milli": 1000}).gpu_milli == 1000
    assert P.parse_need("job", {"gpus": 64}).gpus == 64
    assert P.parse_need("echo", {"mem": 0}).mem == 0
    assert P.parse_need("echo", {"mem": P.MAX_MEM}).mem == P.MAX_MEM
    assert P.parse_need("echo", {"priority": -100}).priority == -100
    assert P.parse_need("echo", {"priority": 100}).priority == 100
    assert P.parse_need("echo", {"tenant": "a" * 64}).tenant == "a" * 64
    assert P.parse_need("echo", {"tenant": "team-1.x_y@z"}).tenant == "team-1.x_y@z"
    assert P.parse_need("echo", {"models": ["A100", "H100"]}).models == frozenset({"A100", "H100"})
    assert P.parse_need("echo", {"min_cc": [8, 6]}).min_cc == (8, 6)
    assert P.parse_need("echo", {"exclusive": True}).exclusive is True
    assert P.parse_need("echo", {"cpu_milli": 2500, "host_mem": GiB}).host_mem == GiB


@pytest.mark.parametrize(
    "raw",
    [
        {"gpu_milli": 0},
        {"gpu_milli": 1001},
        {"gpu_milli": -1},
        {"gpu_milli": 1.5},
        {"gpu_milli": "1"},
        {"gpus": -1},
        {"gpus": 65},
        {"mem": -1},
        {"mem": P.MAX_MEM + 1},
        {"cpu_milli": -1},
        {"host_mem": -1},
        {"priority": -101},
        {"priority": 101},
        {"tenant": ""},
        {"tenant": "a" * 65},
        {"tenant": "a b"},
        {"tenant": "a/b"},
        {"tenant": "a\n"},
        {"tenant": 5},
        {"models": []},
        {"models": [1]},
        {"models": [""]},
        {"models": ["x" * 65]},
        {"models": "A100"},
        {"min_cc": [8]},
        {"min_cc": [8, 0, 0]},
        {"min_cc": ["8", 0]},
        {"min_cc": [8, -1]},
        {"min_cc": [100, 0]},
        {"min_cc": [8.0, 0]},
        {"min_cc": "8.0"},
        {"exclusive": 1},
        {"exclusive": "yes"},
    ],
    ids=repr,
)
def test_need_refuses(raw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_need("echo", raw)


@pytest.mark.parametrize(
    "raw",
    [
        {"gpu_milli": True},
        {"gpu_milli": False},
        {"gpus": True},
        {"mem": False},
        {"cpu_milli": True},
        {"host_mem": True},
        {"priority": True},
        {"min_cc": [True, 0]},
    ],
    ids=repr,
)
def test_need_refuses_booleans_for_ints(raw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_need("job", raw)


def test_need_session_is_one_gpu() -> None:
    with pytest.raises(InvalidRequest):
        P.parse_need("session", {"gpus": 2})
    one = P.parse_need("session", {"gpus": 1})
    assert one.gpus == 1 and one.gpu_milli == 1000 and one.mem == 256 * MiB


@pytest.mark.parametrize(
    "need",
    [
        Need(gpu_milli=1),
        Need(gpu_milli=250, mem=3 * GiB, tenant="t1"),
        Need(gpu_milli=1000, gpus=4, mem=GiB, exclusive=True),
        Need(
            gpu_milli=10,
            cpu_milli=1500,
            host_mem=5 * GiB,
            models=frozenset({"H100", "A100"}),
            min_cc=(8, 0),
            priority=-7,
            tenant="alice@lab",
        ),
    ],
)
@pytest.mark.parametrize("kind", ["echo", "job"])
def test_need_to_wire_round_trip(kind: str, need: Need) -> None:
    wire = P.need_to_wire(need)
    assert P.parse_need(kind, wire) == need
    # and through msgpack, as on the wire
    assert P.parse_need(kind, P.unpackb(P.packb(wire))) == need


# --------------------------------------------------------------------------- parse_job


def job(**kw: Any) -> dict[str, Any]:
    header: dict[str, Any] = {"id": RID, "kind": "job", "argv": ["python3", "-c", "print(1)"]}
    header.update(kw)
    return header


def test_job_defaults_and_round_trip() -> None:
    spec = P.parse_job(job(), 0)
    assert spec.argv == ("python3", "-c", "print(1)")
    assert spec.env == {} and spec.files == () and spec.outputs == ()
    assert spec.time_limit == 60.0 and spec.output_cap == 1 << 20 and spec.idempotent is False
    full = P.parse_job(
        job(
            env={"A_B": "1", "_X": "", "PATH2": "/x"},
            files=["in.txt", "data-1.bin"],
            outputs=["out.npy"],
            time_limit=2,
            output_cap=0,
            idempotent=True,
        ),
        2,
    )
    assert type(full.time_limit) is float and full.time_limit == 2.0
    assert P.parse_job(P.job_to_wire(full), 2) == full


@pytest.mark.parametrize(
    "argv", [None, [], "ls", ["ls", 1], ["a\0b"], [b"ls"], ["x"] * 4097], ids=lambda a: repr(a)[:20]
)
def test_job_argv(argv: Any) -> None:
    header = job()
    if argv is None:
        del header["argv"]
    else:
        header["argv"] = argv
    with pytest.raises(InvalidRequest):
        P.parse_job(header, 0)


@pytest.mark.parametrize(
    "env",
    [
        {"lower": "x"},
        {"1A": "x"},
        {"A-B": "x"},
        {"": "x"},
        {"A": 1},
        {"A": "a\0b"},
        {"A": None},
        ["A"],
    ],
    ids=repr,
)
def test_job_env_refused(env: Any) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_job(job(env=env), 0)


@pytest.mark.parametrize(
    "name", ["a/b", "/etc", "..", ".", "", "x" * 129, "a b", "a\\b", "é", 5, None], ids=repr
)
@pytest.mark.parametrize("field", ["files", "outputs"])
def test_job_bad_file_names(field: str, name: Any) -> None:
    nframes = 1 if field == "files" else 0
    with pytest.raises(InvalidRequest):
        P.parse_job(job(**{field: [name]}), nframes)
    with pytest.raises(InvalidRequest):
        P.check_file_name(name)


def test_job_good_file_names() -> None:
    names = ["x" * 128, "a.b", ".hidden", "...", "A-Z_0.9"]
    assert P.parse_job(job(files=names), len(names)).files == tuple(names)
    assert P.parse_job(job(outputs=names), 0).outputs == tuple(names)


def test_job_files_frame_count_mismatch() -> None:
    with pytest.raises(InvalidRequest):
        P.parse_job(job(files=["a", "b"]), 1)
    with pytest.raises(InvalidRequest):
        P.parse_job(job(files=["a"]), 2)
    with pytest.raises(InvalidRequest):
        P.parse_job(job(), 1)  # frames without files


def test_job_duplicate_file_names() -> None:
    with pytest.raises(InvalidRequest):
        P.parse_job(job(files=["a", "a"]), 2)


@pytest.mark.parametrize(
    "limit", [0, -1, 0.0, P.MAX_TIME_LIMIT + 1, math.inf, math.nan, True, "5"], ids=repr
)
def test_job_time_limit_bounds(limit: Any) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_job(job(time_limit=limit), 0)


def test_job_time_limit_accepts_bounds() -> None:
    assert P.parse_job(job(time_limit=None), 0).time_limit == 60.0  # nil means the default
    assert P.parse_job(job(time_limit=0.001), 0).time_limit == 0.001
    assert P.parse_job(job(time_limit=P.MAX_TIME_LIMIT), 0).time_limit == P.MAX_TIME_LIMIT
    assert P.parse_job(job(time_limit=int(P.MAX_TIME_LIMIT)), 0).time_limit == P.MAX_TIME_LIMIT


@pytest.mark.parametrize("cap", [-1, P.MAX_OUTPUT_CAP + 1, 1.5, True, "1"], ids=repr)
def test_job_output_cap_bounds(cap: Any) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_job(job(output_cap=cap), 0)


def test_job_output_cap_accepts_bounds() -> None:
    assert P.parse_job(job(output_cap=0), 0).output_cap == 0
    assert P.parse_job(job(output_cap=P.MAX_OUTPUT_CAP), 0).output_cap == P.MAX_OUTPUT_CAP


def test_job_idempotent_must_be_bool() -> None:
    with pytest.raises(InvalidRequest):
        P.parse_job(job(idempotent=1), 0)


# --------------------------------------------------------------------------- parse_launch_args


@pytest.mark.parametrize(
    ("tag", "lo", "hi"),
    [
        ("i32", -(1 << 31), (1 << 31) - 1),
        ("u32", 0, (1 << 32) - 1),
        ("i64", -(1 << 63), (1 << 63) - 1),
        ("u64", 0, (1 << 64) - 1),
        ("ptr", 0, (1 << 63) - 1),
    ],
)
def test_launch_int_ranges(tag: str, lo: int, hi: int) -> None:
    assert P.parse_launch_args([[tag, lo], [tag, hi]]) == [(tag, lo), (tag, hi)]
    for bad in (lo - 1, hi + 1):
        with pytest.raises(InvalidRequest):
            P.parse_launch_args([[tag, bad]])
    for bad_type in (True, False, "1", 1.0, None, b"\x01"):
        with pytest.raises(InvalidRequest):
            P.parse_launch_args([[tag, bad_type]])


@pytest.mark.parametrize("tag", ["f32", "f64"])
def test_launch_floats(tag: str) -> None:
    out = P.parse_launch_args([[tag, 1.5], [tag, 2], [tag, -0.25]])
    assert out == [(tag, 1.5), (tag, 2.0), (tag, -0.25)]
    assert all(type(v) is float for _, v in out)
    for bad in (True, "1.5", None, [1.0]):
        with pytest.raises(InvalidRequest):
            P.parse_launch_args([[tag, bad]])


def test_launch_every_tag_in_one_list() -> None:
    args = [
        ["ptr", 3],
        ["i32", -1],
        ["u32", 7],
        ["i64", -(1 << 40)],
        ["u64", 1 << 40],
        ["f32", 0.5],
        ["f64", 2.0],
    ]
    assert [t for t, _ in P.parse_launch_args(args)] == list(P.ARG_TYPES)
    assert P.parse_launch_args([]) == []


@pytest.mark.parametrize(
    "value",
    [
        None,
        "args",
        {"a": 1},
        [["f16", 1.0]],
        [["i32"]],
        [["i32", 1, 2]],
        [("i32", 1)],
        ["i32"],
        [[["i32"], 1]],
        [["i32", 1]] * 257,
    ],
    ids=lambda v: repr(v)[:24],
)
def test_launch_args_shape(value: Any) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_launch_args(value)


# --------------------------------------------------------------------------- parse_dims


def test_dims_pad_to_three() -> None:
    assert P.parse_dims([4], "grid") == (4, 1, 1)
    assert P.parse_dims([2, 3], "grid") == (2, 3, 1)
    assert P.parse_dims([2, 3, 5], "block") == (2, 3, 5)
    assert P.parse_dims([(1 << 31) - 1], "grid") == ((1 << 31) - 1, 1, 1)


@pytest.mark.parametrize(
    "value",
    [[], [1, 2, 3, 4], [0], [-1], [True], [1 << 31], [1.0], "4", 4, (1, 1), None],
    ids=repr,
)
def test_dims_refused(value: Any) -> None:
    with pytest.raises(InvalidRequest):
        P.parse_dims(value, "grid")


# --------------------------------------------------------------------------- GPU info and state


def gpu_wire(**kw: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "uuid": "GPU-0",
        "index": 0,
        "model": "A100",
        "mem": 40 * GiB,
        "cc": [8, 0],
    }
    raw.update(kw)
    return raw


def test_gpu_info_round_trip() -> None:
    info = GpuInfo(uuid="GPU-1", index=3, model="H100", mem=80 * GiB, cc=(9, 0), simulated=True)
    assert P.parse_gpu_info(P.unpackb(P.packb(P.gpu_info_to_wire(info)))) == info
    assert P.parse_gpu_info(gpu_wire()).simulated is False
    assert P.parse_gpu_info({k: v for k, v in gpu_wire().items() if k != "cc"}).cc == (0, 0)


@pytest.mark.parametrize(
    "raw",
    [
        [],
        "GPU-0",
        None,
        gpu_wire(uuid=None),
        gpu_wire(uuid=""),
        gpu_wire(uuid="x" * 129),
        gpu_wire(index=-1),
        gpu_wire(index=1025),
        gpu_wire(index=True),
        gpu_wire(index="0"),
        gpu_wire(model=""),
        gpu_wire(mem=-1),
        gpu_wire(mem=1.5),
        gpu_wire(cc=[8]),
        gpu_wire(cc=[8, "0"]),
        gpu_wire(cc=[True, 0]),
        gpu_wire(cc="8.0"),
    ],
    ids=lambda r: repr(r)[:40],
)
def test_gpu_info_refused(raw: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        P.parse_gpu_info(raw)
    assert type(info.value) is ProtocolError


def test_gpu_state_round_trip() -> None:
    state = GpuState(util=37.5, mem_used=3 * GiB, temp=61.0, power=250.0, health="degraded")
    assert P.parse_gpu_state(P.unpackb(P.packb(P.gpu_state_to_wire("GPU-9", state)))) == (
        "GPU-9",
        state,
    )


@pytest.mark.parametrize(
    ("raw", "field", "expected"),
    [
        ({"util": 500}, "util", 100.0),
        ({"util": -3}, "util", 0.0),
        ({"util": 42}, "util", 42.0),
        ({"util": math.inf}, "util", 100.0),
        ({"util": -math.inf}, "util", 0.0),
        ({"util": "50"}, "util", 0.0),
        ({"util": True}, "util", 0.0),
        ({}, "util", 0.0),
        ({"mem_used": -1}, "mem_used", 0),
        ({"mem_used": 1 << 60}, "mem_used", P.MAX_MEM),
        ({"mem_used": 2.9}, "mem_used", 2),
        ({"temp": 1000}, "temp", 200.0),
        ({"temp": -1000}, "temp", -50.0),
        ({"power": -1}, "power", 0.0),
        ({"power": 1e9}, "power", 10000.0),
        ({"health": "ok"}, "health", "ok"),
        ({"health": "degraded"}, "health", "degraded"),
        ({"health": "failed"}, "health", "failed"),
        ({"health": "on fire"}, "health", "failed"),
        ({"health": 1}, "health", "failed"),
        ({"health": ["ok"]}, "health", "failed"),
        ({}, "health", "ok"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_gpu_state_clamps(raw: dict[str, Any], field: str, expected: Any) -> None:
    uuid, state = P.parse_gpu_state({"uuid": "GPU-0", **raw})
    assert uuid == "GPU-0"
    got = getattr(state, field)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "raw", [[], "x", None, 5, {"util": 5}, {"uuid": 5}, {"uuid": b"GPU-0"}], ids=repr
)
def test_gpu_state_refused(raw: Any) -> None:
    with pytest.raises(ProtocolError):
        P.parse_gpu_state(raw)


def test_gpu_state_clamps_nan_util() -> None:
    _, state = P.parse_gpu_state(
        {"uuid": "GPU-0", "util": math.nan, "temp": math.nan, "power": math.nan}
    )
    assert 0.0 <= state.util <= 100.0
    assert -50.0 <= state.temp <= 200.0
    assert 0.0 <= state.power <= 10000.0


def test_gpu_state_nan_mem_used_does_not_escape() -> None:
    try:
        _, state = P.parse_gpu_state({"uuid": "GPU-0", "mem_used": math.nan})
    except GpudError:
        return
    assert 0 <= state.mem_used <= P.MAX_MEM


def test_ids_are_not_repeated_across_a_fork() -> None:
    """Parent and child must not draw the same ids from a pool copied by fork()."""
    import os

    from gpud.ids import new_id

    new_id()  # the pool holds bytes now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, then leave at once
        os.write(w, new_id())
        os._exit(0)
    os.close(w)
    child = os.read(r, 16)
    os.close(r)
    os.waitpid(pid, 0)
    assert len(child) == 16 and child != new_id()


def test_ids_across_pool_refills_are_distinct_version_4_uuids() -> None:
    """More ids than one 4 KiB pool holds: none repeats, each is a version 4, variant 1 UUID."""
    import uuid

    from gpud.ids import new_id

    ids = [new_id() for _ in range(3 * 256 + 7)]
    assert len(set(ids)) == len(ids)
    for rid in ids:
        u = uuid.UUID(bytes=rid)
        assert len(rid) == 16 and u.version == 4 and u.variant == uuid.RFC_4122
