"""GPU checks on a real NVIDIA GPU: NVML, sessions through pycuda, jobs, isolation.

Each test talks to real daemons (the ``cluster`` fixture: a broker and a worker serving this
machine's GPUs) through the real client library, and checks results against numpy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import gpu_sources as sources
import numpy as np
import pytest

from gpud.errors import InvalidRequest, OutOfMemory, RemoteError, SessionLost, Timeout
from gpud_client import BUILTIN, Client
from tests.waiting import wait_for

F32 = np.float32
MiB = 1 << 20


def nvml_used(index: int) -> int:
    """Bytes NVML counts as used on GPU ``index`` now."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def nvcc(args: list[str], source: str) -> bytes:
    """Compile ``source`` with the worker's nvcc (as the test's own tool) and return the output."""
    from gpud_worker.nvcc import find_nvcc

    exe = find_nvcc()
    if exe is None:
        pytest.skip("no nvcc here")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cu").write_text(source)
        subprocess.run([exe, *args, "-o", "k.out", "k.cu"], cwd=tmp, check=True, capture_output=True, timeout=120)
        return (Path(tmp) / "k.out").read_bytes()


# --------------------------------------------------------------------------- NVML


def test_nvml_inventory_and_live_state(cluster: Any, gpus: list[Any]) -> None:
    from gpud_worker.gpu import NvmlProbe

    assert gpus and all(not g.simulated and g.mem > 0 and g.cc >= (3, 0) and g.uuid.startswith("GPU-") for g in gpus)
    probe = NvmlProbe()
    try:
        states = probe.states()
    finally:
        probe.close()
    assert set(states) == {g.uuid for g in gpus}
    for s in states.values():
        assert s.health == "ok" and 0 <= s.util <= 100 and s.mem_used > 0 and s.temp > 0 and s.power > 0
    # What the broker shows is NVML's inventory and the worker's live heartbeats.
    def shown_live() -> dict[str, Any]:
        return {g["uuid"]: g for g in cluster.status()["gpus"] if g["temp"] > 0}

    assert wait_for(lambda: len(shown_live()) == len(gpus)), cluster.status()["gpus"]
    shown = shown_live()
    for g in gpus:
        row = shown[g.uuid]
        assert row["simulated"] is False and row["model"] == g.model and row["mem"] == g.mem
        assert tuple(row["cc"]) == g.cc and row["health"] == "ok"
        assert row["temp"] > 0 and row["power"] > 0 and row["mem_used"] > 0


# --------------------------------------------------------------------------- kernels


def test_builtin_kernels_match_numpy(cluster: Any) -> None:
    rng = np.random.default_rng(1)
    n = 100_003
    a, b, y = (rng.standard_normal(n).astype(F32) for _ in range(3))
    m, k, nn = 67, 45, 33
    A, B = rng.standard_normal((m, k)).astype(F32), rng.standard_normal((k, nn)).astype(F32)
    with Client(cluster.frontend, timeout=60) as client, client.session(mem=256 * MiB) as s:
        info = s.device_info()
        assert info["simulated"] is False and info["gpu"]["simulated"] is False
        # The session runs in a process of its own (session_processes "auto": on for real GPUs),
        # as an unprivileged pool user when the worker is root.
        assert info["process"]["pid"] != cluster.worker_procs["w0"].pid
        assert os.geteuid() != 0 or info["process"]["uid"] != 0
        pa, pb, py, pout = (s.mem_alloc(4 * n) for _ in range(4))
        s.memcpy_htod(pa, a)
        s.memcpy_htod(pb, b)
        s.memcpy_htod(py, y)
        # Results do not depend on grid and block: several shapes, 1-D to 3-D, give the same.
        for grid, block in [((1,), (1,)), ((7,), (96,)), ((2, 3, 4), (8, 4, 2)), ((400,), (256,))]:
            s.launch(BUILTIN, "vector_add", grid, block, [pa, pb, pout, np.int32(n)])
            np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(pout), F32), a + b)
        s.launch(BUILTIN, "saxpy", (64,), (256,), [F32(2.5), pa, py, np.int32(n)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(py), F32), F32(2.5) * a + y)  # bit for bit
        pA, pB, pC = s.mem_alloc(A.nbytes), s.mem_alloc(B.nbytes), s.mem_alloc(4 * m * nn)
        s.memcpy_htod(pA, A)
        s.memcpy_htod(pB, B)
        s.launch(BUILTIN, "sgemm", (5, 2), (32, 4), [pA, pB, pC, np.int32(m), np.int32(nn), np.int32(k)])
        C = np.frombuffer(s.memcpy_dtoh(pC), F32).reshape(m, nn)
        np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64), rtol=1e-4, atol=1e-4)
        ps = s.mem_alloc(4)
        for block in [(1,), (37,), (1024,), (16, 16, 4)]:
            s.launch(BUILTIN, "reduce_sum", (3,), block, [pa, ps, np.int32(n)])
            got, want = np.frombuffer(s.memcpy_dtoh(ps), F32)[0], F32(a.astype(np.float64).sum())
            assert abs(got - want) <= abs(np.spacing(want)), (block, got, want)  # a double sum, rounded once
        s.launch(BUILTIN, "reduce_sum", (1,), (128,), [pa, ps, np.int32(-5)])  # negative: zero
        assert np.frombuffer(s.memcpy_dtoh(ps), F32)[0] == 0
        s.synchronize()


def test_user_cuda_c_ptx_and_cubin_kernels(cluster: Any, gpus: list[Any]) -> None:
    rng = np.random.default_rng(2)
    n = 5000
    x = rng.standard_normal(n).astype(F32)
    args = dict(n=n, stride=7, offset=-3, scale_bits=(1 << 40) + 0x21, a=1.75, b=0.5)
    with Client(cluster.frontend, timeout=60) as client, client.session(mem=64 * MiB) as s:
        mod = s.module_load(sources.MIX, options=["-O3"])
        assert s.modules[mod] == ["mix"]
        px, pout = s.mem_alloc(x.nbytes), s.mem_alloc(x.nbytes)
        s.memcpy_htod(px, x)
        s.launch(mod, "mix", (10,), (128,), [px, pout, np.int32(n), np.uint32(7), np.int64(-3),
                                             np.uint64((1 << 40) + 0x21), F32(1.75), np.float64(0.5)])
        out = np.frombuffer(s.memcpy_dtoh(pout), F32)
        np.testing.assert_array_equal(out, sources.mix_expected(x, **args))
        # Wrong count or type: refused before launch, naming the parameter.
        with pytest.raises(InvalidRequest, match="takes 8 arguments, got 7"):
            s.launch(mod, "mix", 1, 1, [px, pout, np.int32(n), np.uint32(7), np.int64(-3), np.uint64(0), F32(1)])
        with pytest.raises(InvalidRequest, match=r"argument 3 \(unsigned int stride\) must be u32, got i32"):
            s.launch(mod, "mix", 1, 1, [px, pout, np.int32(n), np.int32(7), np.int64(-3), np.uint64(0), F32(1), np.float64(0)])
        # PTX and cubin made here with nvcc for this GPU.
        major, minor = gpus[0].cc
        ptx = nvcc(["--ptx", f"-arch=sm_{major}{minor}"], sources.SCALE)
        cubin = nvcc(["--cubin", f"-arch=sm_{major}{minor}"], sources.SCALE)
        assert s.module_load(ptx, name="p", kind="ptx") == "p" and s.modules["p"] == ["scale"]
        assert s.module_load(cubin, name="c", kind="cubin") == "c"
        s.launch("p", "scale", (40,), (128,), [px, F32(2), np.int32(n)])
        s.launch("c", "scale", (40,), (128,), [px, F32(0.5), np.int32(n)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(px), F32), x)  # *2 then /2: exact
        with pytest.raises(RemoteError, match="CUDA_ERROR_INVALID_IMAGE|CUDA_ERROR_"):
            s.module_load(b"\x7fELF garbage", name="junk", kind="cubin")


# --------------------------------------------------------------------------- errors


def test_compile_error_and_illegal_addresses(cluster: Any) -> None:
    with Client(cluster.frontend, timeout=60) as client, client.session(mem=64 * MiB) as s, \
            client.session(mem=64 * MiB) as neighbour:
        x = np.arange(256, dtype=F32)
        px = s.mem_alloc(x.nbytes)
        s.memcpy_htod(px, x)
        pn = neighbour.mem_alloc(x.nbytes)
        neighbour.memcpy_htod(pn, x)
        # A compile error: nvcc's message, with the user's line number.
        with pytest.raises(RemoteError, match=r"(?s)compile error.*kernel.cu\(4\).*undeclared_thing"):
            s.module_load(sources.BROKEN, name="broken")
        # A built-in with a buffer too small: "illegal address", found before launch.
        with pytest.raises(RemoteError, match="illegal address"):
            s.launch(BUILTIN, "saxpy", 1, 256, [F32(1), px, px, np.int32(257)])
        # A launch CUDA refuses (more threads than the kernel's launch bounds): not sticky.
        s.module_load(sources.SMALL_BLOCK, name="small")
        with pytest.raises(RemoteError, match="CUDA_ERROR_"):
            s.launch("small", "small_block", 1, 128, [px])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(px), F32), x)
        assert s.replays == 0  # the same session all along
        # A real illegal address in a kernel: sticky. The call says so; the context is gone.
        s.module_load(sources.WILD, name="wild")
        with pytest.raises(RemoteError, match="CUDA_ERROR_ILLEGAL_ADDRESS.*SESSION_LOST"):
            s.launch("wild", "wild_write", 1, 32, [px])
        # The next call finds the session lost; the client replays its journal (modules, memory)
        # onto a new session, so the caller's session is usable with its data.
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(px), F32), x)
        assert s.replays == 1
        s.launch(BUILTIN, "saxpy", 2, 128, [F32(1), px, px, np.int32(256)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(px), F32), 2 * x)
        # The other session on the same GPU (its own process on the same worker) did not notice:
        # in one process, the illegal address made every context of it fail (seen on an H200).
        neighbour.launch(BUILTIN, "saxpy", 2, 128, [F32(3), pn, pn, np.int32(256)])
        np.testing.assert_array_equal(np.frombuffer(neighbour.memcpy_dtoh(pn), F32), 4 * x)
        assert neighbour.replays == 0
    # Without a journal, the loss reaches the caller as SESSION_LOST.
    with Client(cluster.frontend, timeout=60, journal_bytes=0) as client, client.session(mem=16 * MiB) as s:
        p = s.mem_alloc(1024)
        s.module_load(sources.WILD, name="wild")
        with pytest.raises(RemoteError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            s.launch("wild", "wild_write", 1, 1, [p])
        with pytest.raises(SessionLost, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            s.memcpy_dtoh(p)


def test_driver_error_names() -> None:
    from gpud_worker.cuda import driver_error_names

    names = driver_error_names()
    assert names["an illegal memory access was encountered"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert names["out of memory"] == "CUDA_ERROR_OUT_OF_MEMORY"


# --------------------------------------------------------------------------- memory


def test_memory_grant_enforced(cluster: Any, gpus: list[Any]) -> None:
    with Client(cluster.frontend, timeout=60) as client, client.session(mem=64 * MiB) as s:
        before = nvml_used(s.gpu["index"])
        a = s.mem_alloc(48 * MiB)
        with pytest.raises(OutOfMemory, match="grant"):
            s.mem_alloc(17 * MiB)
        b = s.mem_alloc(16 * MiB)
        assert s.device_info()["mem_used"] == 64 * MiB
        assert nvml_used(s.gpu["index"]) >= before + 60 * MiB  # real allocations
        s.mem_free(a)
        s.mem_alloc(48 * MiB)
        s.mem_free(b)


def test_sessions_are_reclaimed(tmp_path: Path, gpus: list[Any]) -> None:
    """Closed: memory back at once. Idle past --session-idle: context destroyed, memory back."""
    from gpu_cluster import start_cluster

    c = start_cluster(tmp_path, "--session-idle", "2")
    try:
        index = gpus[0].index
        base = nvml_used(index)
        with Client(c.frontend, timeout=60, journal_bytes=0) as client:
            s = client.session(mem=1200 * MiB)
            s.mem_alloc(1024 * MiB)
            assert nvml_used(index) >= base + 1000 * MiB
            s.close()
            assert wait_for(lambda: nvml_used(index) < base + 64 * MiB), "closing did not free the memory"
            s = client.session(mem=1200 * MiB)
            p = s.mem_alloc(1024 * MiB)
            assert nvml_used(index) >= base + 1000 * MiB
            assert wait_for(lambda: nvml_used(index) < base + 64 * MiB), "the idle session kept its memory"
            with pytest.raises(SessionLost):
                s.memcpy_dtoh(p, 16)
    finally:
        c.stop()


def test_a_kernel_that_never_ends_is_ended_by_close(cluster: Any, gpus: list[Any]) -> None:
    """Closing a session whose kernel never ends kills the session's process: its memory comes
    back and the GPU serves the next session."""
    with Client(cluster.frontend, timeout=60, journal_bytes=0) as client:
        s = client.session(mem=600 * MiB)
        index = s.gpu["index"]
        flag = s.mem_alloc(4)
        s.memcpy_htod(flag, np.zeros(1, np.int32))
        big = s.mem_alloc(512 * MiB)
        held = nvml_used(index)
        s.module_load(sources.SPIN, name="spin")
        with pytest.raises(Timeout):
            s.launch("spin", "spin", 1, 1, [flag], timeout=3)
        s.close()
        assert wait_for(lambda: nvml_used(index) < held - 400 * MiB), "the spinning session kept its memory"
        del big
        with client.session(mem=16 * MiB) as t:
            p = t.mem_alloc(1024)
            x = np.arange(256, dtype=F32)
            t.memcpy_htod(p, x)
            t.launch(BUILTIN, "saxpy", 1, 256, [F32(1), p, p, np.int32(256)])
            np.testing.assert_array_equal(np.frombuffer(t.memcpy_dtoh(p), F32), 2 * x)


# --------------------------------------------------------------------------- jobs and sharing


def test_a_job_sees_exactly_its_gpu(cluster: Any, gpus: list[Any]) -> None:
    python = os.path.realpath(sys.executable)  # the interpreter itself: the job runs as another user
    env = {k: os.environ[k] for k in ("LD_LIBRARY_PATH",) if os.environ.get(k)}  # where libcuda is
    with Client(cluster.frontend, timeout=60) as client:
        res = client.run([python, "-c", sources.JOB_VISIBLE], env=env, gpus=1, time_limit=60)
    assert res.exit_code == 0, res.stderr.decode(errors="replace")
    seen = json.loads(res.stdout)
    assert res.gpus and seen["visible"] == ",".join(res.gpus)
    assert seen["count"] == 1 and seen["uuids"] == res.gpus  # exactly the granted GPU


def test_a_session_process_runs_kernels_in_a_cgroup_of_its_own(cluster: Any) -> None:
    """As root, where the worker makes cgroups: a session process on a real GPU is in a cgroup
    ``session-<hex>`` of its own, whose device fence (the v1 devices cgroup, or v2's BPF
    program of its sandbox's nodes) still lets CUDA open its GPU: a built-in kernel runs."""
    if os.geteuid() != 0:
        pytest.skip("the worker makes cgroups only as root (or with a delegated cgroup_parent)")
    n = 4096
    a = np.arange(n, dtype=F32)
    with Client(cluster.frontend, timeout=60) as client, client.session(mem=16 * MiB) as s:
        pid = s.device_info()["process"]["pid"]
        with open(f"/proc/{pid}/cgroup") as f:
            own = f.read()
        if "/session-" not in own:
            pytest.skip(f"the worker has no cgroups here (its log says why): {own!r}")
        pa, pout = s.mem_alloc(4 * n), s.mem_alloc(4 * n)
        s.memcpy_htod(pa, a)
        s.launch(BUILTIN, "vector_add", (16,), (256,), [pa, pa, pout, np.int32(n)])
        np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(pout), F32), a + a)


def test_two_sessions_share_one_gpu(cluster: Any, gpus: list[Any]) -> None:
    n = 1 << 20
    errors: list[BaseException] = []
    # One Client per thread (a Client is not thread-safe), each with a session on the one GPU.
    with Client(cluster.frontend, timeout=60) as client, Client(cluster.frontend, timeout=60) as other:
        a = client.session(gpu_milli=500, mem=64 * MiB)
        b = other.session(gpu_milli=500, mem=64 * MiB)
        assert a.id != b.id
        if len(gpus) == 1:
            assert a.gpu["uuid"] == b.gpu["uuid"]

        def work(s: Any, seed: int) -> None:
            try:
                x = np.random.default_rng(seed).standard_normal(n).astype(F32)
                p = s.mem_alloc(x.nbytes)
                s.memcpy_htod(p, x)
                for _ in range(20):
                    s.launch(BUILTIN, "saxpy", (256,), (256,), [F32(1), p, p, np.int32(n)])
                np.testing.assert_array_equal(np.frombuffer(s.memcpy_dtoh(p), F32), x * F32(2**20))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s, i)) for i, s in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        # Isolation: b cannot name a's memory, nor a's modules.
        pa = a.mem_alloc(4)
        with pytest.raises(InvalidRequest, match="another session"):
            b.memcpy_dtoh(pa)
        with pytest.raises(InvalidRequest):
            b.memcpy_dtoh(1_000_000, 4)  # a handle number b never had
        a.module_load(sources.SCALE, name="only_a")
        with pytest.raises(InvalidRequest, match="module 'only_a' unknown"):
            b.launch("only_a", "scale", 1, 1, [b.mem_alloc(4), F32(1), np.int32(1)])
        a.close()
        b.close()


def test_nvidia_smi_in_a_job_lists_exactly_its_gpu(cluster: Any, gpus: list[Any]) -> None:
    """In its sandbox a job granted one GPU finds that GPU's node only (and the driver's /proc
    entries of the others covered): ``nvidia-smi -L`` lists exactly the granted GPU, also with
    CUDA_VISIBLE_DEVICES unset (it does not read it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not installed")
    with Client(cluster.frontend, timeout=60) as client:
        res = client.run(["sh", "-c", f"unset CUDA_VISIBLE_DEVICES; {smi} -L"], gpus=1, time_limit=60)
    assert res.exit_code == 0, res.stderr.decode(errors="replace")
    listed = [line for line in res.stdout.decode().splitlines() if line.startswith("GPU ")]
    assert len(listed) == 1 and res.gpus[0] in listed[0], res.stdout
