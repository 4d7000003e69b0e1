"""The cgroup v2 device program (gpud_worker.device_program): its instruction encoding and its logic,
pure (an interpreter of the few instructions it uses, here); then, as root, the kernel's verifier
loads it, and a process in a cgroup it is attached to opens an allowed STAND-IN device node and gets
EPERM opening a denied one (nodes made here with mknod: this machine has no GPU)."""

from __future__ import annotations

import errno
import os
import stat
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from gpud_worker import cgroups
from gpud_worker import device_program as dp
from gpud_worker.device_program import BLOCK, CHAR, Insn, Rule

IS_ROOT = os.geteuid() == 0
NVIDIA = 195


def run(insns: Sequence[Insn], type: int, major: int, minor: int, access: int = 0) -> int:
    """What ``insns`` return for one device access (``struct bpf_cgroup_dev_ctx``): an interpreter
    of exactly the instructions ``program`` emits, which fails on any other."""
    ctx = struct.pack("=III", access << 16 | type, major, minor)
    regs = [0] * 11
    regs[dp.R1] = -1  # the context pointer: only ever loaded from
    pc = 0
    for _ in range(10_000):
        i = insns[pc]
        pc += 1
        if i.code == dp.load_word(0, 0, 0).code:
            assert regs[i.src] == -1 and i.off in (0, 4, 8), "loads only the context's three fields"
            regs[i.dst] = struct.unpack_from("=I", ctx, i.off)[0]
        elif i.code == dp.and32(0, 0).code:
            regs[i.dst] = regs[i.dst] & i.imm & 0xFFFFFFFF
        elif i.code == dp.move(0, 0).code:
            regs[i.dst] = i.imm
        elif i.code == dp.jump_unless(0, 0, 0).code:
            if regs[i.dst] != i.imm:
                pc += i.off
        elif i.code == dp.leave().code:
            return regs[dp.R0]
        else:
            raise AssertionError(f"instruction {i} is not one program() emits")
    raise AssertionError("the program does not end")


READ, WRITE, MKNOD = 2, 4, 1  # BPF_DEVCG_ACC_*


def test_instructions_encode_as_the_kernel_reads_them() -> None:
    if sys.byteorder != "little":
        pytest.skip("the expected bytes are little-endian ones")
    assert dp.move(dp.R0, 1).encode() == bytes.fromhex("b700000001000000")  # r0 = 1
    assert dp.leave().encode() == bytes.fromhex("9500000000000000")  # exit
    assert dp.load_word(dp.R4, dp.R1, 4).encode() == bytes.fromhex("6114040000000000")  # r4 = *(u32 *)(r1 + 4)
    assert dp.and32(dp.R2, 0xFFFF).encode() == bytes.fromhex("54020000ffff0000")  # w2 &= 0xffff
    assert dp.jump_unless(dp.R5, 195, 3).encode() == bytes.fromhex("55050300c3000000")  # if r5 != 195 goto +3
    assert dp.assemble([dp.move(0, 0), dp.leave()]) == bytes.fromhex("b700000000000000" "9500000000000000")


def test_no_rule_denies_everything() -> None:
    insns = dp.program([])
    assert [run(insns, t, major, minor) for t, major, minor in ((CHAR, 1, 3), (BLOCK, 8, 0), (CHAR, 0, 0))] == [0, 0, 0]


def test_a_rule_allows_its_device_in_every_access_and_nothing_else() -> None:
    insns = dp.program([Rule(CHAR, 1, 3), Rule(CHAR, NVIDIA, 0), Rule(CHAR, NVIDIA, 255), Rule(CHAR, 136, None)])
    for access in (READ, WRITE, MKNOD, READ | WRITE | MKNOD):
        assert run(insns, CHAR, 1, 3, access) == 1
        assert run(insns, CHAR, NVIDIA, 0, access) == 1
        assert run(insns, CHAR, NVIDIA, 255, access) == 1
        assert run(insns, CHAR, NVIDIA, 1, access) == 0  # another GPU
    assert run(insns, BLOCK, 1, 3) == 0  # the same numbers, but a block device
    assert run(insns, CHAR, 1, 5) == 0
    assert run(insns, CHAR, 3, 1) == 0  # minor and major the other way round
    assert [run(insns, CHAR, 136, minor) for minor in (0, 7, 1 << 19)] == [1, 1, 1]  # any minor of that major
    assert run(insns, CHAR, 137, 0) == 0


def test_every_jump_lands_on_a_rule_or_the_final_deny() -> None:
    insns = dp.program([Rule(CHAR, 1, 3), Rule(CHAR, 136, None), Rule(CHAR, 1, 3)])  # the repeat is dropped
    starts, pc = {4}, 4
    for checks in (3, 2):
        pc += checks + 2
        starts.add(pc)
    assert len(insns) == pc + 2
    for at, i in enumerate(insns):
        if i.code == dp.jump_unless(0, 0, 0).code:
            assert at + 1 + i.off in starts, (at, i)


def test_job_rules_are_the_vms_numbers_of_the_sandbox_nodes(tmp_path: Path) -> None:
    """Names of the sandbox's /dev, linked here to the VM's /dev/null and /dev/zero so that they are
    character devices with known numbers: each rule is the number of its node; absent ones (tty,
    the GPUs here) are left out; ptmx and every devpts terminal major are in."""
    for name, target in (("null", "/dev/null"), ("urandom", "/dev/urandom"), ("nvidia1", "/dev/zero"),
                         ("nvidiactl", "/dev/full"), ("nvidia0", "/dev/random")):
        os.symlink(target, tmp_path / name)
    (tmp_path / "zero").write_text("not a device")
    rules = dp.job_rules([1], str(tmp_path))
    assert rules[:4] == [Rule(CHAR, 1, 3), Rule(CHAR, 1, 9), Rule(CHAR, 1, 5), Rule(CHAR, 1, 7)]  # nvidia0 not granted
    assert rules[4:] == [Rule(CHAR, 5, 2)] + [Rule(CHAR, m, None) for m in range(136, 144)]


# -- the kernel (root) ---------------------------------------------------------------------------


def _v2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        return cgroups.parse_mountinfo(f.read()).v2


def test_the_kernel_verifier_accepts_the_program_of_a_job() -> None:
    if not IS_ROOT:
        pytest.skip("loading a BPF program needs root")
    fd = dp.load(dp.program(dp.job_rules([0, 1, 2, 3])))
    try:
        assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog"
    finally:
        os.close(fd)


@pytest.fixture
def v2_cgroup() -> Iterator[Path]:
    mount = _v2_mount()
    if not IS_ROOT or mount is None:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    path = Path(mount) / f"gpud-devtest-{os.getpid()}"
    path.mkdir()
    try:
        yield path
    finally:
        cgroups.remove_cgroup(str(path))


@pytest.fixture
def stand_ins(tmp_path: Path) -> dict[str, Path]:
    """STAND-IN character devices made with mknod (no GPU here): NVIDIA's major 195 minors 0 and 1
    (no driver behind them: opening an allowed one gives ENXIO), a copy of /dev/null (1:3) and of
    /dev/kmsg (1:11), which root may open."""
    if not IS_ROOT:
        pytest.skip("mknod needs root")
    nodes = {"nvidia0": (NVIDIA, 0), "nvidia1": (NVIDIA, 1), "null": (1, 3), "kmsg": (1, 11)}
    out = {}
    for name, (major, minor) in nodes.items():
        path = tmp_path / name
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        out[name] = path
    return out


def _opens_in(cgroup: Path, paths: Sequence[Path]) -> list[str]:
    """Open each of ``paths`` from a child process (root) moved into ``cgroup`` first: "ok" or
    the errno's name, each."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            (cgroup / "cgroup.procs").write_text("0")
            said = []
            for path in paths:
                try:
                    os.close(os.open(path, os.O_RDONLY))
                    said.append("ok")
                except OSError as exc:
                    said.append(errno.errorcode[exc.errno])
            os.write(w, " ".join(said).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read().split()
    os.waitpid(pid, 0)
    return out


def test_an_attached_program_allows_its_nodes_and_denies_the_rest(v2_cgroup: Path, stand_ins: dict[str, Path]) -> None:
    order = [stand_ins[n] for n in ("null", "nvidia0", "nvidia1", "kmsg")]
    assert _opens_in(v2_cgroup, order) == ["ok", "ENXIO", "ENXIO", "ok"]  # no program: all open (no driver for 195)
    dp.fence(str(v2_cgroup), [Rule(CHAR, 1, 3), Rule(CHAR, NVIDIA, 0)])
    fd = os.open(v2_cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert dp.attached(fd) == 1
    finally:
        os.close(fd)
    assert _opens_in(v2_cgroup, order) == ["ok", "ENXIO", "EPERM", "EPERM"]
    child = v2_cgroup / "below"
    child.mkdir()  # a cgroup below it is fenced by it too
    assert _opens_in(child, order) == ["ok", "ENXIO", "EPERM", "EPERM"]


def test_setup_finds_whether_a_device_program_can_be_attached(v2_cgroup: Path, tmp_path: Path) -> None:
    cg = cgroups.JobCgroups.setup(str(v2_cgroup))
    assert cg is not None and cg.device_fence == "bpf"
    assert not (v2_cgroup / cgroups.DEVICE_PROBE).exists()
    assert cgroups.probe_device_program(str(tmp_path))  # a plain directory is no cgroup: why not, said
