"""The seccomp filter of sandboxed processes (``gpud_worker.seccomp``): in a forked child that
installs it as a job does (after ``PR_SET_NO_NEW_PRIVS``), no user namespace can be made, in any
way the kernel offers, and what a program needs of processes and threads still works."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from gpud_worker import seccomp

pytestmark = pytest.mark.skipif(seccomp.FILTER is None, reason="no filter for this architecture")

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE3 = 435  # on both x86_64 and aarch64


def _in_filtered_child(check: Callable[[], str]) -> str:
    """Run ``check`` in a forked child under the filter; what it returned ("" for all right)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = "child failed"
        try:
            os.close(r)
            assert _libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS, as a job's setup does
            seccomp.deny_user_namespaces()
            out = check()
        except BaseException as exc:
            out = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(w, out.encode()[:1000])
            os._exit(0)
    os.close(w)
    got = os.read(r, 1000).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return got


def _errno_of(call: Callable[[], int]) -> int:
    ctypes.set_errno(0)
    return 0 if call() == 0 else ctypes.get_errno()


def test_the_probe_finds_the_filter_working_here() -> None:
    assert seccomp.probe() == ""


def test_no_user_namespace_by_unshare_clone_or_clone3() -> None:
    def check() -> str:
        found = []
        unshare = _errno_of(lambda: _libc.unshare(seccomp.CLONE_NEWUSER))
        if unshare != errno.EPERM:
            found.append(f"unshare: errno {unshare}")
        both = _errno_of(lambda: _libc.unshare(seccomp.CLONE_NEWUSER | 0x00020000))  # with CLONE_NEWNS
        if both != errno.EPERM:
            found.append(f"unshare with NEWNS: errno {both}")
        # clone(CLONE_NEWUSER | SIGCHLD) through syscall(2): the raw system call, no libc wrapper.
        nr = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
        clone = _errno_of(lambda: _libc.syscall(nr, seccomp.CLONE_NEWUSER | 17, 0, 0, 0, 0))
        if clone != errno.EPERM:
            found.append(f"clone: errno {clone}")
        args = (ctypes.c_uint64 * 11)(seccomp.CLONE_NEWUSER)  # struct clone_args, flags first
        clone3 = _errno_of(lambda: _libc.syscall(_CLONE3, ctypes.addressof(args), ctypes.sizeof(args)))
        if clone3 != errno.ENOSYS:
            found.append(f"clone3: errno {clone3}")
        return "; ".join(found)

    assert _in_filtered_child(check) == ""


def test_threads_forks_and_programs_still_work_under_it() -> None:
    def check() -> str:
        seen: list[str] = []
        t = threading.Thread(target=seen.append, args=("thread",))
        t.start()
        t.join()
        child = os.fork()
        if child == 0:
            os._exit(7)
        status = os.waitpid(child, 0)[1]
        out = subprocess.run([sys.executable, "-c", "import threading; t = threading.Thread(target=print, "
                              "args=('ran',)); t.start(); t.join()"], capture_output=True, timeout=30)
        if seen != ["thread"] or os.waitstatus_to_exitcode(status) != 7 or out.stdout != b"ran\n":
            return f"thread {seen}, fork {status}, program {out!r}"
        return ""

    assert _in_filtered_child(check) == ""
