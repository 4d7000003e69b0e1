"""The device program of a job's cgroup v2: which device nodes its processes may open.

cgroup v2 has no ``devices.allow``/``devices.deny`` files. What it has instead is a BPF program
of type ``BPF_PROG_TYPE_CGROUP_DEVICE`` attached to the cgroup (attach type
``BPF_CGROUP_DEVICE``): the kernel runs it whenever a process of that cgroup (or of one below it)
opens a device node or makes one with ``mknod``, with the device's type, major and minor number
(``struct bpf_cgroup_dev_ctx``); it returns 1 to allow, 0 to deny, which the process sees as
EPERM. It holds whatever the process's uid and the node's mode say, and wherever the node lies.

A job's program is an allow list (``job_rules``): the nodes its sandbox's ``/dev`` has (null, zero,
full, random, urandom, tty, ``/dev/pts/ptmx`` and the ``devpts`` terminals, the granted GPUs'
``/dev/nvidiaN`` with ``nvidiactl``, ``nvidia-uvm`` and ``nvidia-uvm-tools``), by the numbers the
VM's own nodes have; every other device, block or character, is denied, another GPU's
``/dev/nvidiaN`` among them. The access asked (read, write, mknod) is not looked at: a listed
device is the job's in every way (the sandbox makes its nodes with ``mknod`` once its process is in
the cgroup), and it cannot make nodes of its own anyway (no ``CAP_MKNOD``).

The program, for rules ``(type, major, minor or any)``::

        r2 = ctx->access_type          ; u32: (access << 16) | type
        r2 &= 0xffff                   ; the type: 1 block, 2 character
        r4 = ctx->major
        r5 = ctx->minor
    for each rule:
        if r2 != TYPE goto next        ; (each jump goes to the next rule's first instruction)
        if r4 != MAJOR goto next
        if r5 != MINOR goto next       ; left out for "any minor"
        r0 = 1                         ; allow
        exit
    next:
        ...
        r0 = 0                         ; no rule matched: deny
        exit

It is assembled here (``assemble``: five instruction kinds, each a ``struct bpf_insn`` of 8 bytes),
loaded with ``bpf(BPF_PROG_LOAD)`` (the kernel's verifier checks it) and attached with
``bpf(BPF_PROG_ATTACH)`` to the cgroup's directory, through ctypes: no compiler, no library.
The attachment (``BPF_F_ALLOW_MULTI``) runs beside the programs of the cgroups above it, such as
systemd's ``DevicePolicy``, and a device is allowed only where all of them allow it. The program
lives as long as the cgroup it is attached to; the fd ``load`` returns can be closed once attached.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpud_worker.sandbox import BASE_DEVICES, gpu_node_names, host_nodes

BLOCK = 1  # BPF_DEVCG_DEV_BLOCK
CHAR = 2  # BPF_DEVCG_DEV_CHAR
PTMX = (5, 2)  # /dev/ptmx and every devpts instance's ptmx
PTS_MAJORS = range(136, 144)  # UNIX98_PTY_SLAVE_MAJOR .. + UNIX98_PTY_MAJOR_COUNT: /dev/pts/N

# bpf(2) commands, program and attach types, flags (linux/bpf.h)
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_QUERY = 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2

# The syscall's number: x86_64's own, the generic table's (arm64, riscv64).
SYSCALL_BPF = {"x86_64": 321, "aarch64": 280, "arm64": 280, "riscv64": 280}

# Instruction classes, operations and operand sources (linux/bpf_common.h, linux/bpf.h).
_LDX, _ALU, _JMP, _ALU64 = 0x01, 0x04, 0x05, 0x07
_W, _MEM = 0x00, 0x60  # 32-bit size; memory mode
_K = 0x00  # immediate operand
_AND, _MOV = 0x50, 0xB0
_JNE, _EXIT = 0x50, 0x90
R0, R1, R2, R4, R5 = 0, 1, 2, 4, 5

_CTX_ACCESS_TYPE, _CTX_MAJOR, _CTX_MINOR = 0, 4, 8  # offsets in struct bpf_cgroup_dev_ctx


@dataclass(frozen=True, slots=True)
class Rule:
    """A device the program allows: its type (``CHAR`` or ``BLOCK``), major, and minor (None: any)."""

    type: int
    major: int
    minor: int | None


@dataclass(frozen=True, slots=True)
class Insn:
    """One eBPF instruction (``struct bpf_insn``): opcode, registers, jump offset, immediate."""

    code: int
    dst: int = 0
    src: int = 0
    off: int = 0
    imm: int = 0

    def encode(self) -> bytes:
        """Its 8 bytes in this host's byte order (as the kernel reads them); the register byte
        holds ``dst_reg:4, src_reg:4`` bit fields, dst in the low nibble on little-endian hosts."""
        regs = self.dst | self.src << 4 if sys.byteorder == "little" else self.src | self.dst << 4
        return struct.pack("=BBhi", self.code, regs, self.off, self.imm)


def load_word(dst: int, src: int, off: int) -> Insn:
    """``dst = *(u32 *)(src + off)``"""
    return Insn(_LDX | _MEM | _W, dst, src, off)


def and32(dst: int, imm: int) -> Insn:
    """``dst = (u32)dst & imm``"""
    return Insn(_ALU | _AND | _K, dst, imm=imm)


def move(dst: int, imm: int) -> Insn:
    """``dst = imm``"""
    return Insn(_ALU64 | _MOV | _K, dst, imm=imm)


def jump_unless(dst: int, imm: int, off: int) -> Insn:
    """``if dst != imm goto +off`` (``off`` instructions past the next one)."""
    return Insn(_JMP | _JNE | _K, dst, off=off, imm=imm)


def leave() -> Insn:
    """``exit`` (returns r0)"""
    return Insn(_JMP | _EXIT)


def program(rules: Iterable[Rule]) -> list[Insn]:
    """The allow list ``rules`` as a device program (see the module's doc)."""
    insns = [load_word(R2, R1, _CTX_ACCESS_TYPE), and32(R2, 0xFFFF),
             load_word(R4, R1, _CTX_MAJOR), load_word(R5, R1, _CTX_MINOR)]
    for rule in dict.fromkeys(rules):
        checks = [(R2, rule.type), (R4, rule.major)] + ([] if rule.minor is None else [(R5, rule.minor)])
        for i, (reg, value) in enumerate(checks):
            insns.append(jump_unless(reg, value, len(checks) - 1 - i + 2))  # past the checks left, r0 = 1, exit
        insns += [move(R0, 1), leave()]
    return insns + [move(R0, 0), leave()]


def assemble(insns: Sequence[Insn]) -> bytes:
    return b"".join(i.encode() for i in insns)


def job_rules(minors: Iterable[int], dev: str = "/dev") -> list[Rule]:
    """What a job granted the GPUs of ``minors`` may open: the character devices its sandbox's
    ``/dev`` has, by the numbers of the VM's nodes under ``dev`` (absent ones left out), then
    ``ptmx`` and the ``devpts`` terminals."""
    nodes = host_nodes(list(BASE_DEVICES) + gpu_node_names(minors), dev)
    rules = [Rule(CHAR, os.major(n.rdev), os.minor(n.rdev)) for n in nodes]
    rules.append(Rule(CHAR, *PTMX))
    rules += [Rule(CHAR, major, None) for major in PTS_MAJORS]
    return rules


# ---------------------------------------------------------------------------- the kernel


class _LoadAttr(ctypes.Structure):
    """``union bpf_attr`` as BPF_PROG_LOAD reads it, up to ``expected_attach_type``."""

    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
                ("prog_name", ctypes.c_char * 16), ("prog_ifindex", ctypes.c_uint32),
                ("expected_attach_type", ctypes.c_uint32)]


class _AttachAttr(ctypes.Structure):
    """``union bpf_attr`` as BPF_PROG_ATTACH reads it."""

    _fields_ = [("target_fd", ctypes.c_uint32), ("attach_bpf_fd", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("attach_flags", ctypes.c_uint32),
                ("replace_bpf_fd", ctypes.c_uint32)]


class _QueryAttr(ctypes.Structure):
    """``union bpf_attr`` as BPF_PROG_QUERY reads and writes it."""

    _fields_ = [("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("query_flags", ctypes.c_uint32), ("attach_flags", ctypes.c_uint32),
                ("prog_ids", ctypes.c_uint64), ("prog_cnt", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_LICENSE = ctypes.create_string_buffer(b"GPL")  # no GPL-only helper is called: any string would do
_LOG_SIZE = 1 << 16


def _bpf(cmd: int, attr: ctypes.Structure, what: str) -> int:
    number = SYSCALL_BPF.get(platform.machine())
    if number is None:
        raise OSError(38, f"{what}: no bpf(2) number known for {platform.machine()}")  # ENOSYS
    result = int(_libc.syscall(ctypes.c_long(number), ctypes.c_int(cmd), ctypes.byref(attr),
                               ctypes.c_uint(ctypes.sizeof(attr))))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def load(insns: Sequence[Insn]) -> int:
    """Load a device program; its fd (close-on-exec). OSError with the errno (and the verifier's
    last words, where it refused the program) where the kernel will not."""
    code = assemble(insns)
    buf = ctypes.create_string_buffer(code, len(code))
    attr = _LoadAttr(prog_type=BPF_PROG_TYPE_CGROUP_DEVICE, insn_cnt=len(insns), insns=ctypes.addressof(buf),
                     license=ctypes.addressof(_LICENSE), prog_name=b"gpud_devices",
                     expected_attach_type=BPF_CGROUP_DEVICE)
    try:
        return _bpf(BPF_PROG_LOAD, attr, "bpf BPF_PROG_LOAD (a cgroup device program)")
    except OSError as exc:
        if exc.errno not in (13, 22):  # EACCES, EINVAL: the verifier's; its log says why
            raise
        log_buf = ctypes.create_string_buffer(_LOG_SIZE)
        attr.log_level, attr.log_size, attr.log_buf = 1, _LOG_SIZE, ctypes.addressof(log_buf)
        try:
            return _bpf(BPF_PROG_LOAD, attr, "bpf BPF_PROG_LOAD (a cgroup device program)")
        except OSError as again:
            said = log_buf.value.decode(errors="replace").strip().splitlines()[-3:]
            raise OSError(again.errno, f"{again.strerror}: verifier: {' | '.join(said)}") from None


def attach(cgroup_dir_fd: int, prog_fd: int) -> None:
    """Attach device program ``prog_fd`` to the cgroup whose directory ``cgroup_dir_fd`` is."""
    _bpf(BPF_PROG_ATTACH, _AttachAttr(target_fd=cgroup_dir_fd, attach_bpf_fd=prog_fd,
                                      attach_type=BPF_CGROUP_DEVICE, attach_flags=BPF_F_ALLOW_MULTI),
         "bpf BPF_PROG_ATTACH (a cgroup device program)")


def attached(cgroup_dir_fd: int) -> int:
    """How many device programs are attached to the cgroup of ``cgroup_dir_fd`` itself."""
    attr = _QueryAttr(target_fd=cgroup_dir_fd, attach_type=BPF_CGROUP_DEVICE)
    _bpf(BPF_PROG_QUERY, attr, "bpf BPF_PROG_QUERY")
    return int(attr.prog_cnt)


def fence(cgroup_dir: str, rules: Iterable[Rule]) -> None:
    """Attach the allow list ``rules`` to cgroup v2 directory ``cgroup_dir``; OSError where the
    kernel refuses (not root, no ``CONFIG_CGROUP_BPF``, a seccomp filter, a verifier's no)."""
    prog = load(program(rules))
    try:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            attach(fd, prog)
        finally:
            os.close(fd)
    finally:
        os.close(prog)
