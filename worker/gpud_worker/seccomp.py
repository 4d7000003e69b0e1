"""The seccomp filter of every sandboxed job and session process: no user namespaces of its own.

A pool user may otherwise ``unshare(CLONE_NEWUSER)`` (``unshare -U -r``) wherever the kernel lets
unprivileged users make user namespaces, and be "root" in one: no file or process of the VM
becomes its, but every namespaced part of the kernel (mounts, netfilter, filesystems that mount in
a user namespace...) becomes reachable to it, which is where most of the kernel's local privilege
escalations of recent years were found. A tenant's job has no use for one: the sandbox made its
namespaces already. So the process that runs the user's code, once it is the pool user and has
``PR_SET_NO_NEW_PRIVS``, installs this filter (it stays across exec and is inherited by every
child): ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` fail with EPERM, and ``clone3`` (whose
flags lie in memory, out of a filter's reach) fails with ENOSYS, upon which the C library falls
back to ``clone`` for threads and processes. Every other system call is allowed.

The filter is classic BPF, written out here for the two architectures gpud runs on, x86_64 (with
its i386 and x32 system calls) and aarch64 (with its 32-bit ARM ones); elsewhere ``FILTER`` is
None and ``probe`` says why. ``probe`` tries it in a forked child at worker start.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

CLONE_NEWUSER = 0x10000000

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_PR_SET_NO_NEW_PRIVS = 38
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (args[0]'s low half, little-endian)

_X32 = 0x40000000  # x32 system calls are x86_64 numbers with this bit
# AUDIT_ARCH_* -> (unshare, clone, clone3) of that ABI.
_ABIS: dict[str, dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]] = {
    "x86_64": {0xC000003E: ((272, _X32 | 272), (56, _X32 | 56), (435, _X32 | 435)),  # x86_64 and x32
               0x40000003: ((310,), (120,), (435,))},  # i386
    "aarch64": {0xC00000B7: ((97,), (220,), (435,)),  # aarch64
                0x40000028: ((337,), (120,), (435,))},  # arm
}


def _program(abis: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> bytes:
    """The filter for ``abis``, as struct sock_filter entries. Each jump goes forward to a label
    when its test holds and falls through otherwise."""
    items: list[str | tuple[int, str | None, int]] = [(_LD_W_ABS, None, _ARCH)]  # (op, jump to, k)
    items += [(_JEQ_K, f"abi{i}", arch) for i, arch in enumerate(abis)]
    items.append((_RET_K, None, _RET_ALLOW))  # no other ABI reaches this kernel
    for i, (unshare, clone, clone3) in enumerate(abis.values()):
        items += [f"abi{i}", (_LD_W_ABS, None, _NR)]
        items += [(_JEQ_K, "flags", nr) for nr in (*unshare, *clone)]
        items += [(_JEQ_K, "enosys", nr) for nr in clone3]
        items.append((_RET_K, None, _RET_ALLOW))
    items += ["flags", (_LD_W_ABS, None, _ARG0), (_JSET_K, "eperm", CLONE_NEWUSER), (_RET_K, None, _RET_ALLOW),
              "eperm", (_RET_K, None, _RET_ERRNO | errno.EPERM),
              "enosys", (_RET_K, None, _RET_ERRNO | errno.ENOSYS)]
    labels: dict[str, int] = {}
    body: list[tuple[int, str | None, int]] = []
    for item in items:
        if isinstance(item, str):
            labels[item] = len(body)
        else:
            body.append(item)
    out = []
    for at, (op, target, k) in enumerate(body):
        jump = labels[target] - at - 1 if target is not None else 0
        if not 0 <= jump < 256:
            raise ValueError("a BPF jump goes at most 255 instructions forward")
        out.append(struct.pack("=HBBI", op, jump, 0, k))
    return b"".join(out)


FILTER: bytes | None = _program(_ABIS[platform.machine()]) if platform.machine() in _ABIS else None
"""This machine's filter, or None where gpud has none for its architecture."""


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.unshare.argtypes = [ctypes.c_int]


def deny_user_namespaces() -> None:
    """Install ``FILTER`` in this process (for it and all it starts from now on). It must have
    ``PR_SET_NO_NEW_PRIVS`` already (or be privileged). OSError where the kernel refuses."""
    if FILTER is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {platform.machine()}")
    buf = ctypes.create_string_buffer(FILTER, len(FILTER))
    prog = _Prog(len(FILTER) // 8, ctypes.addressof(buf))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {os.strerror(err)}")


def probe() -> str:
    """"" where ``deny_user_namespaces`` works here (tried in a forked child: installed, then
    ``unshare(CLONE_NEWUSER)`` must fail with EPERM and a fork still work), else why not."""
    if FILTER is None:
        return f"no seccomp filter for {platform.machine()}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child must never return into the caller's code
        why = ""
        try:
            os.close(r)
            if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS refused")
            deny_user_namespaces()
            if _libc.unshare(CLONE_NEWUSER) == 0 or ctypes.get_errno() != errno.EPERM:
                why = "the filter did not stop unshare(CLONE_NEWUSER)"
            else:
                child = os.fork()
                if child == 0:
                    os._exit(0)
                if os.waitpid(child, 0)[1] != 0:
                    why = "a fork under the filter failed"
        except BaseException as exc:
            why = str(exc) or type(exc).__name__
        finally:
            os.write(w, why.encode(errors="replace")[:500])
            os._exit(0)
    os.close(w)
    try:
        why = os.read(r, 1000).decode(errors="replace")
    finally:
        os.close(r)
    status = os.waitpid(pid, 0)[1]
    return why or ("" if status == 0 else f"the probe process ended with status {status}")
