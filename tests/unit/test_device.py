"""The simulated GPU, the built-in kernels and the GPU probes (no GPU needed, except `gpu` tests)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from gpud.clock import FakeClock
from gpud.errors import ConfigError, InvalidRequest, OutOfMemory, RemoteError, SessionLost
from gpud.protocol import BUILTIN_MODULE
from gpud_worker.device import SimulatedDevice, SimulatedSession
from gpud_worker.gpu import NvmlProbe, SimulatedProbe, simulated_gpus
from gpud_worker.kernels import BUILTINS, check_args
from tests.nvml_stand_in import NvmlStandIn

MiB = 1 << 20
G1 = (1, 1, 1)

F32Array = npt.NDArray[np.float32]


@pytest.fixture
def dev() -> SimulatedDevice:
    return SimulatedDevice(simulated_gpus(1, mem=64 * MiB)[0])


@pytest.fixture
def sess(dev: SimulatedDevice) -> SimulatedSession:
    return dev.open_session(32 * MiB)


def put(sess: SimulatedSession, arr: Any) -> int:
    data = np.ascontiguousarray(arr, dtype=np.float32)
    h = sess.alloc(max(data.nbytes, 1))
    sess.htod(h, 0, data)
    return h


def get(sess: SimulatedSession, h: int, n: int) -> F32Array:
    return np.frombuffer(sess.dtoh(h, 0, 4 * n), dtype=np.float32)


def rand(rng: np.random.Generator, *shape: int) -> F32Array:
    return rng.standard_normal(shape).astype(np.float32)


# --- the built-in kernels against numpy ---------------------------------------------------------


@pytest.mark.parametrize(("grid", "block"), [(G1, G1), ((3, 2, 1), (32, 2, 1))])
def test_vector_add(sess: SimulatedSession, grid: Any, block: Any) -> None:
    rng = np.random.default_rng(1)
    a, b = rand(rng, 1000), rand(rng, 1000)
    ha, hb, hout = put(sess, a), put(sess, b), put(sess, np.full(1000, 7.0))
    sess.launch(
        BUILTIN_MODULE,
        "vector_add",
        grid,
        block,
        [("ptr", ha), ("ptr", hb), ("ptr", hout), ("i32", 900)],
    )
    sess.sync()
    out = get(sess, hout, 1000)
    np.testing.assert_array_equal(out[:900], a[:900] + b[:900])
    np.testing.assert_array_equal(out[900:], 7.0)  # past n: untouched


def test_saxpy(sess: SimulatedSession) -> None:
    rng = np.random.default_rng(2)
    x, y = rand(rng, 513), rand(rng, 513)
    hx, hy = put(sess, x), put(sess, y)
    sess.launch(
        BUILTIN_MODULE,
        "saxpy",
        (4, 1, 1),
        (128, 1, 1),
        [("f32", 2.5), ("ptr", hx), ("ptr", hy), ("i32", 513)],
    )
    np.testing.assert_allclose(get(sess, hy, 513), np.float32(2.5) * x + y, rtol=1e-6)
    np.testing.assert_array_equal(get(sess, hx, 513), x)


@pytest.mark.parametrize(("m", "n", "k"), [(3, 5, 7), (37, 19, 23), (1, 64, 1)])
def test_sgemm_non_square(sess: SimulatedSession, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(3)
    a, b = rand(rng, m, k), rand(rng, k, n)
    ha, hb, hc = put(sess, a), put(sess, b), put(sess, np.full(m * n, np.nan))
    args = [("ptr", ha), ("ptr", hb), ("ptr", hc), ("i32", m), ("i32", n), ("i32", k)]
    sess.launch(BUILTIN_MODULE, "sgemm", (2, 2, 1), (16, 16, 1), args)
    c = get(sess, hc, m * n).reshape(m, n)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


def test_reduce_sum_writes_out(sess: SimulatedSession) -> None:
    rng = np.random.default_rng(4)
    x = rng.uniform(0.0, 1.0, 100_003).astype(np.float32)
    hx, hout = put(sess, x), put(sess, [123.0])  # out is overwritten, not accumulated into
    sess.launch(
        BUILTIN_MODULE,
        "reduce_sum",
        (8, 1, 1),
        (256, 1, 1),
        [("ptr", hx), ("ptr", hout), ("i32", x.size)],
    )
    assert get(sess, hout, 1)[0] == pytest.approx(float(x.astype(np.float64).sum()), rel=1e-5)
    sess.launch(BUILTIN_MODULE, "reduce_sum", G1, G1, [("ptr", hx), ("ptr", hout), ("i32", 0)])
    assert get(sess, hout, 1)[0] == 0.0


def test_negative_size_is_a_no_op(sess: SimulatedSession) -> None:
    h = put(sess, [1.0, 2.0])
    sess.launch(
        BUILTIN_MODULE, "vector_add", G1, G1, [("ptr", h), ("ptr", h), ("ptr", h), ("i32", -5)]
    )
    np.testing.assert_array_equal(get(sess, h, 2), [1.0, 2.0])


# --- memory ----------------------------------------------------------------------------------


def test_memory_grant_enforced(dev: SimulatedDevice) -> None:
    s = dev.open_session(1000)
    h = s.alloc(600)
    with pytest.raises(OutOfMemory, match="grant"):
        s.alloc(500)
    assert s.info()["mem_used"] == 600
    s.free(h)
    s.alloc(500)
    s.alloc(500)
    assert s.info()["mem_used"] == 1000 == dev.mem_used()


def test_device_memory_enforced_across_sessions() -> None:
    dev = SimulatedDevice(simulated_gpus(1, mem=1 * MiB)[0])
    a, b = dev.open_session(MiB), dev.open_session(MiB)
    a.alloc(800 * 1024)
    with pytest.raises(OutOfMemory, match="device"):
        b.alloc(300 * 1024)
    a.close()
    assert dev.mem_used() == 0
    b.alloc(300 * 1024)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True])
def test_alloc_size_must_be_positive_int(sess: SimulatedSession, nbytes: Any) -> None:
    with pytest.raises(InvalidRequest):
        sess.alloc(nbytes)


def test_free_unknown_and_double_free(sess: SimulatedSession) -> None:
    with pytest.raises(InvalidRequest, match="unknown handle"):
        sess.free(12345)
    h = sess.alloc(16)
    sess.free(h)
    with pytest.raises(InvalidRequest, match="unknown handle"):
        sess.free(h)


def test_handles_are_scoped_to_their_session(dev: SimulatedDevice) -> None:
    a, b = dev.open_session(MiB), dev.open_session(MiB)
    ha = put(a, np.ones(4))
    hb = put(b, np.ones(4))
    assert ha != hb
    with pytest.raises(InvalidRequest, match="unknown handle"):
        b.dtoh(ha, 0, 4)
    with pytest.raises(InvalidRequest, match="unknown handle"):
        b.htod(ha, 0, b"1234")
    with pytest.raises(InvalidRequest, match="unknown handle"):
        b.launch(
            BUILTIN_MODULE,
            "vector_add",
            G1,
            G1,
            [("ptr", hb), ("ptr", ha), ("ptr", hb), ("i32", 4)],
        )
    with pytest.raises(InvalidRequest, match="unknown handle"):
        b.free(ha)
    np.testing.assert_array_equal(get(a, ha, 4), 1.0)  # a's buffer is untouched


def test_copy_bounds(sess: SimulatedSession) -> None:
    h = sess.alloc(16)
    sess.htod(h, 12, b"abcd")
    assert sess.dtoh(h, 12, None) == b"abcd"
    assert sess.dtoh(h, 16, None) == b""
    assert len(sess.dtoh(h, 0, None)) == 16
    for offset, data in [(13, b"abcd"), (-1, b"a"), (17, b""), (0, bytes(17))]:
        with pytest.raises(InvalidRequest):
            sess.htod(h, offset, data)
    for offset, nbytes in [(0, 17), (16, 1), (-1, 1), (0, -1), (17, None)]:
        with pytest.raises(InvalidRequest):
            sess.dtoh(h, offset, nbytes)
    with pytest.raises(InvalidRequest):
        sess.htod(h, 0, "text is not bytes")
    sess.htod(h, 0, np.arange(4, dtype=np.float32).data)  # any contiguous buffer
    np.testing.assert_array_equal(get(sess, h, 4), [0, 1, 2, 3])


class Send:
    """A stand-in for the tracker of a zero-copy send (``zmq.MessageTracker``): done when set."""

    def __init__(self) -> None:
        self.done = False


def _writes_wait_for(send: Send, write: Any) -> None:
    """``write()`` (in a thread) does not finish while ``send`` is not done, and does once it is."""
    t = threading.Thread(target=write)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # still waiting for the wire
    send.done = True
    t.join(5)
    assert not t.is_alive()


def test_lent_memory_is_not_written_while_it_is_sent(sess: SimulatedSession) -> None:
    h = sess.alloc(1 << 20)
    sess.htod(h, 0, b"a" * (1 << 20))
    view = sess.dtoh_lent(h, 4096, 65536)
    assert isinstance(view, memoryview) and view.readonly and view.nbytes == 65536
    assert view.obj is sess._allocs[h]  # the device memory itself: no copy
    send = Send()
    sess.hold(view, send)
    _writes_wait_for(send, lambda: sess.htod(h, 0, b"b" * (1 << 20)))
    assert sess.dtoh(h, 0, None) == b"b" * (1 << 20)
    # Until the next write, the lent view was the bytes read; a write elsewhere does not wait.
    other = sess.alloc(16)
    view = sess.dtoh_lent(h, 0, 16)
    sess.hold(view, Send())  # never done
    sess.htod(other, 0, b"x" * 16)
    assert bytes(view) == b"b" * 16


def test_a_launch_waits_for_the_sends_of_its_buffers(sess: SimulatedSession) -> None:
    n = 1 << 14
    a, b, out = put(sess, np.ones(n)), put(sess, np.ones(n)), put(sess, np.zeros(n))
    view = sess.dtoh_lent(out, 0, None)
    send = Send()
    sess.hold(view, send)
    _writes_wait_for(send, lambda: sess.launch(BUILTIN_MODULE, "vector_add", (n // 256, 1, 1), (256, 1, 1),
                                               [("ptr", a), ("ptr", b), ("ptr", out), ("i32", n)]))
    np.testing.assert_array_equal(get(sess, out, n), 2.0)


def test_a_write_gives_up_on_a_send_that_never_ends(sess: SimulatedSession, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpud_worker.device.LEND_WAIT_S", 0.2)
    h = sess.alloc(64)
    sess.htod(h, 0, b"a" * 64)
    sess.hold(sess.dtoh_lent(h, 0, None), Send())
    with pytest.raises(RemoteError, match="not sent within"):
        sess.htod(h, 0, b"b" * 64)
    assert sess.dtoh(h, 0, None) == b"a" * 64  # unwritten: what was sent stays true
    sess.free(h)  # freed memory is written by no one: what it held is forgotten
    assert sess._lent == {}


def test_past_max_lent_dtoh_lent_copies(sess: SimulatedSession) -> None:
    from gpud_worker.device import MAX_LENT

    h = sess.alloc(64)
    for _ in range(MAX_LENT):
        view = sess.dtoh_lent(h, 0, None)
        assert isinstance(view, memoryview)
        sess.hold(view, Send())
    copy = sess.dtoh_lent(h, 0, None)
    assert type(copy) is bytes and copy == bytes(64)  # a client that reads nothing pins no more
    sess.hold(memoryview(copy), Send())  # a copy is not held
    for send in [t for _, ts in sess._lent.values() for t in ts]:
        send.done = True  # type: ignore[misc]
    assert isinstance(sess.dtoh_lent(h, 0, None), memoryview)


def test_closed_session(dev: SimulatedDevice) -> None:
    s = dev.open_session(MiB)
    s.alloc(1000)
    s.close()
    s.close()  # idempotent
    assert dev.mem_used() == 0
    with pytest.raises(SessionLost):
        s.alloc(1)
    with pytest.raises(SessionLost):
        s.info()


def test_info_and_simulated_label() -> None:
    real_looking = simulated_gpus(1)[0].__class__(
        "GPU-x", 0, "A100", 40 << 30, (8, 0), simulated=False
    )
    dev = SimulatedDevice(real_looking)
    assert dev.simulated is True and dev.gpu.simulated is True
    s = dev.open_session(4096)
    s.alloc(100)
    info = s.info()
    assert info["simulated"] is True
    assert info["mem_granted"] == 4096 and info["mem_used"] == 100
    assert info["gpu"]["uuid"] == "GPU-x" and info["gpu"]["simulated"] is True


def test_sessions_in_threads_keep_counts_consistent(dev: SimulatedDevice) -> None:
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            s = dev.open_session(MiB)
            x = np.full(256, float(seed), dtype=np.float32)
            for _ in range(50):
                ha, hout = put(s, x), s.alloc(1024)
                s.launch(
                    BUILTIN_MODULE,
                    "vector_add",
                    G1,
                    G1,
                    [("ptr", ha), ("ptr", ha), ("ptr", hout), ("i32", 256)],
                )
                np.testing.assert_array_equal(get(s, hout, 256), 2.0 * seed)
                s.free(ha)
            s.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert dev.mem_used() == 0


def test_tiny_buffers_with_zero_sizes(sess: SimulatedSession) -> None:
    h = sess.alloc(1)  # smaller than one float32
    sess.launch(
        BUILTIN_MODULE, "vector_add", G1, G1, [("ptr", h), ("ptr", h), ("ptr", h), ("i32", 0)]
    )
    with pytest.raises(RemoteError, match="illegal address"):
        sess.launch(BUILTIN_MODULE, "reduce_sum", G1, G1, [("ptr", h), ("ptr", h), ("i32", 0)])


# --- launch validation -------------------------------------------------------------------------


def test_illegal_address_keeps_session_usable(sess: SimulatedSession) -> None:
    ha, hb, hout = put(sess, np.ones(8)), put(sess, np.ones(8)), put(sess, np.zeros(4))
    args = [("ptr", ha), ("ptr", hb), ("ptr", hout), ("i32", 8)]
    with pytest.raises(RemoteError, match="illegal address.*argument 2 \\(out\\)"):
        sess.launch(BUILTIN_MODULE, "vector_add", G1, G1, args)
    np.testing.assert_array_equal(get(sess, hout, 4), 0.0)  # nothing ran
    args[3] = ("i32", 4)
    sess.launch(BUILTIN_MODULE, "vector_add", G1, G1, args)
    np.testing.assert_array_equal(get(sess, hout, 4), 2.0)


def test_sgemm_illegal_address_checks_each_matrix(sess: SimulatedSession) -> None:
    ha, hb, hc = put(sess, np.ones(6)), put(sess, np.ones(5)), put(sess, np.zeros(4))
    args = [("ptr", ha), ("ptr", hb), ("ptr", hc), ("i32", 2), ("i32", 2), ("i32", 3)]
    with pytest.raises(RemoteError, match="argument 1 \\(B\\)"):  # B needs K*N = 6
        sess.launch(BUILTIN_MODULE, "sgemm", G1, G1, args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ([("ptr", 1), ("ptr", 1), ("ptr", 1)], "takes 4 arguments, got 3"),
        ([("ptr", 1), ("ptr", 1), ("ptr", 1), ("i32", 1), ("i32", 1)], "takes 4 arguments, got 5"),
        ([("ptr", 1), ("ptr", 1), ("ptr", 1), ("f32", 1.0)], "argument 3 \\(n\\) must be i32"),
        ([("i32", 1), ("ptr", 1), ("ptr", 1), ("i32", 1)], "argument 0 \\(a\\) must be ptr"),
        (
            [("ptr", 1), ("ptr", 1), ("ptr", 1), ("i32", 1.5)],
            "argument 3 \\(n:i32\\) must be an int",
        ),
        ([("ptr", 1), ("ptr", 1), ("ptr", 1), ("i32", 1 << 31)], "argument 3 \\(n:i32\\)"),
        ([("ptr", -1), ("ptr", 1), ("ptr", 1), ("i32", 1)], "argument 0 \\(a:ptr\\)"),
    ],
)
def test_wrong_args_refused_before_running(
    sess: SimulatedSession, args: list[Any], match: str
) -> None:
    h = put(sess, np.zeros(4))
    args = [(t, h if t == "ptr" and v == 1 else v) for t, v in args]
    with pytest.raises(InvalidRequest, match=match):
        sess.launch(BUILTIN_MODULE, "vector_add", G1, G1, args)
    np.testing.assert_array_equal(get(sess, h, 4), 0.0)


def test_check_args_saxpy_types() -> None:
    check_args("saxpy", [("f32", 2), ("ptr", 1), ("ptr", 2), ("i32", 3)])
    with pytest.raises(InvalidRequest, match="argument 0 \\(alpha\\) must be f32, got 'ptr'"):
        check_args("saxpy", [("ptr", 2), ("ptr", 1), ("ptr", 2), ("i32", 3)])
    with pytest.raises(InvalidRequest, match="must be a number"):
        bad: list[Any] = [("f32", "2"), ("ptr", 1), ("ptr", 2), ("i32", 3)]
        check_args("saxpy", bad)


def test_unknown_kernel_and_module(sess: SimulatedSession) -> None:
    with pytest.raises(InvalidRequest, match="unknown kernel 'nope'"):
        sess.launch(BUILTIN_MODULE, "nope", G1, G1, [])
    with pytest.raises(InvalidRequest, match="unknown kernel"):
        check_args("nope", [])
    with pytest.raises(InvalidRequest, match="module 'mine' unknown"):
        sess.launch("mine", "vector_add", G1, G1, [])


@pytest.mark.parametrize(
    ("grid", "block", "shared"),
    [
        ((0, 1, 1), G1, 0),
        (G1, (1025, 1, 1), 0),
        (G1, (32, 32, 2), 0),
        (G1, (1, 1), 0),
        (G1, G1, -1),
    ],
)
def test_bad_launch_shape(sess: SimulatedSession, grid: Any, block: Any, shared: int) -> None:
    h = put(sess, np.zeros(1))
    with pytest.raises(InvalidRequest):
        sess.launch(
            BUILTIN_MODULE, "reduce_sum", grid, block, [("ptr", h), ("ptr", h), ("i32", 1)], shared
        )


def test_builtins_table() -> None:
    assert set(BUILTINS) == {"vector_add", "saxpy", "sgemm", "reduce_sum"}
    for name, sig in BUILTINS.items():
        assert sig.name == name and len(sig.params) == len(sig.names)
        assert set(sig.params) <= {"ptr", "i32", "f32"}


# --- utilization -------------------------------------------------------------------------------


class GatedClock:
    """A clock for one operation: it starts at ``t0`` and its end-of-work reading blocks until
    released, so the test looks at the device while the work is still running."""

    def __init__(self, t0: float, duration: float) -> None:
        self.t0, self.duration = t0, duration
        self.armed = False
        self.calls = 0
        self.in_flight = threading.Event()
        self.release = threading.Event()

    def monotonic(self) -> float:
        if not self.armed:
            return self.t0
        self.calls += 1
        if self.calls == 1:  # begin
            return self.t0
        self.in_flight.set()  # end: the work is done but not yet recorded as finished
        assert self.release.wait(10)
        return self.t0 + self.duration


def test_busy_fraction_counts_running_work_and_decays() -> None:
    clock = GatedClock(100.0, 0.6)
    dev = SimulatedDevice(simulated_gpus(1)[0], clock=clock)
    s = dev.open_session(MiB)
    h = put(s, np.ones((64, 64)))
    args = [
        ("ptr", h),
        ("ptr", h),
        ("ptr", s.alloc(64 * 64 * 4)),
        ("i32", 64),
        ("i32", 64),
        ("i32", 64),
    ]
    assert dev.busy_fraction(100.0) == 0.0
    errors: list[BaseException] = []

    def run() -> None:
        try:
            s.launch(BUILTIN_MODULE, "sgemm", G1, G1, args)
        except BaseException as exc:
            errors.append(exc)

    clock.armed = True
    t = threading.Thread(target=run)
    t.start()
    try:
        assert clock.in_flight.wait(10)
        assert dev.busy_fraction(100.5) == pytest.approx(0.5)  # rises while the sgemm runs
        assert dev.busy_fraction(100.9) == pytest.approx(0.9)
    finally:
        clock.release.set()
        t.join(10)
    assert not errors
    assert dev.busy_fraction(100.6) == pytest.approx(0.6)
    assert dev.busy_fraction(101.1) == pytest.approx(0.5)  # decays after
    assert dev.busy_fraction(101.7) == 0.0


def test_busy_fraction_real_clock_sgemm(dev: SimulatedDevice) -> None:
    s = dev.open_session(32 * MiB)
    n = 512
    ha, hb, hc = (s.alloc(n * n * 4) for _ in range(3))
    args = [("ptr", ha), ("ptr", hb), ("ptr", hc), ("i32", n), ("i32", n), ("i32", n)]
    t0 = time.monotonic()
    assert dev.busy_fraction(t0) == 0.0
    s.launch(BUILTIN_MODULE, "sgemm", G1, G1, args)
    t1 = time.monotonic()
    assert 0.0 < dev.busy_fraction(t1) <= 1.0
    assert dev.busy_fraction(t1 + 2.0) == 0.0


# --- probes ----------------------------------------------------------------------------------


class StepClock(FakeClock):
    """Each reading moves time on by ``step``: every operation takes ``step`` seconds."""

    def __init__(self, step: float) -> None:
        super().__init__(0.0)
        self.step = step

    def monotonic(self) -> float:
        t = self.now
        self.now += self.step
        return t


def test_simulated_probe_states() -> None:
    gpus = simulated_gpus(2, worker_name="w7")
    devs = [
        SimulatedDevice(gpus[0], clock=StepClock(0.25)),
        SimulatedDevice(gpus[1], clock=FakeClock()),
    ]
    probe = SimulatedProbe(devs)
    assert probe.simulated is True
    assert probe.inventory() == gpus
    s = devs[0].open_session(MiB)
    h = s.alloc(5000)
    s.htod(h, 0, b"x")  # one copy: busy from 0.0 to 0.25; states() then reads 0.5
    states = probe.states()
    assert set(states) == {"SIM-w7-0", "SIM-w7-1"}
    st = states["SIM-w7-0"]
    assert st.mem_used == 5000 and st.health == "ok"
    assert st.util == pytest.approx(25.0)
    assert st.temp == pytest.approx(42.5) and st.power == pytest.approx(112.5)
    idle = states["SIM-w7-1"]
    assert (idle.util, idle.mem_used, idle.temp, idle.power) == (0.0, 0, 30.0, 50.0)
    s.free(h)
    assert probe.states()["SIM-w7-0"].mem_used == 0
    probe.close()


def test_simulated_gpus_unique_per_worker() -> None:
    a, b = simulated_gpus(3, worker_name="a"), simulated_gpus(3, worker_name="b")
    assert [g.uuid for g in a] == ["SIM-a-0", "SIM-a-1", "SIM-a-2"]
    assert not {g.uuid for g in a} & {g.uuid for g in b}
    assert all(g.simulated for g in a + b)
    assert [g.index for g in a] == [0, 1, 2]


def test_nvml_available_does_not_raise() -> None:
    available = NvmlProbe.available()
    assert isinstance(available, bool)
    if not available:
        with pytest.raises(ConfigError, match="NVML unavailable"):
            NvmlProbe()


class FakeNvml(NvmlStandIn):
    """Two GPUs; GPU 1 gives its uuid as bytes and has no power sensor; ``lost`` GPUs fail."""

    def __init__(self) -> None:
        super().__init__()
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetUUID(self, h: int) -> str | bytes:
        return f"GPU-{h}" if h == 0 else b"GPU-1"

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._check(h)
        if h == 1:
            raise self.NVMLError_NotSupported("Not Supported")
        return self.power_mw  # milliwatts


def test_nvml_probe_with_fake_binding() -> None:
    nv = FakeNvml()
    probe = NvmlProbe(nvml=nv)
    assert probe.simulated is False
    gpus = probe.inventory()
    assert [(g.uuid, g.index, g.model, g.mem, g.cc, g.simulated) for g in gpus] == [
        ("GPU-0", 0, "NVIDIA H200", 141 << 30, (9, 0), False),
        ("GPU-1", 1, "NVIDIA H200", 141 << 30, (9, 0), False),
    ]
    states = probe.states()
    assert states["GPU-0"].util == 42.0 and states["GPU-0"].mem_used == 1 << 30
    assert states["GPU-0"].temp == 55.0 and states["GPU-0"].power == pytest.approx(123.5)
    assert states["GPU-1"].power == 0.0 and states["GPU-1"].health == "ok"  # NotSupported -> 0
    nv.lost.add(0)
    lost = probe.states()["GPU-0"]
    assert lost.health == "failed" and (lost.util, lost.mem_used, lost.power) == (0.0, 0, 0.0)
    probe.close()
    probe.close()
    assert nv.shutdowns == 1


@pytest.mark.gpu
def test_nvml_probe_real_gpu() -> None:
    if not NvmlProbe.available():
        pytest.skip("no NVIDIA driver")
    probe = NvmlProbe()
    try:
        gpus = probe.inventory()
        assert gpus and all(not g.simulated and g.mem > 0 for g in gpus)
        states = probe.states()
        assert set(states) == {g.uuid for g in gpus}
        assert all(s.health == "ok" for s in states.values())
    finally:
        probe.close()
