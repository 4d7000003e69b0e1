"""The CUDA C compiler of a worker: nvcc found on this host (``find_nvcc``) and run with a time
limit, as an unprivileged user where the worker is root, its messages cleaned of file paths
(``NvccCompiler``). Real GPUs load what it makes; SIMULATED GPUs compile a module only to show its
errors (they run the built-in kernels).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpud.errors import RemoteError
from gpud_worker.modules import MAX_MESSAGE_CHARS

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120.0  # one nvcc run


def find_nvcc() -> str | None:
    """``$GPUD_NVCC``, else nvcc on PATH, else ``$CUDA_HOME/bin/nvcc``, else
    ``/usr/local/cuda/bin/nvcc``; None when none exists."""
    for cand in (os.environ.get("GPUD_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


class NvccCompiler:
    """nvcc, run as ``pycuda.compiler.compile`` runs it (``--cubin -arch sm_XY``), with a time
    limit and the client's options already checked (``modules.check_options``).

    Parameters
    ----------
    nvcc:
        Its path (``find_nvcc()`` by default).
    timeout:
        Seconds one compilation may take.
    user:
        ``(uid, gid)`` to run nvcc as (a worker running as root gives an unprivileged user, so
        that a source's ``#include`` reaches only what that user may read); None: as this process.
    """

    def __init__(self, nvcc: str | None = None, timeout: float = COMPILE_TIMEOUT_S,
                 user: tuple[int, int] | None = None) -> None:
        self.nvcc = nvcc or find_nvcc()
        self.timeout = timeout
        self.user = user
        self._version: str | None = None

    def version(self) -> str:
        """nvcc's ``--version`` text (part of the cache key)."""
        if self._version is None:
            if self.nvcc is None:
                return "no nvcc"
            try:
                out = subprocess.run([self.nvcc, "--version"], capture_output=True, timeout=30, check=False)
                self._version = out.stdout.decode(errors="replace").strip() or f"nvcc exited {out.returncode}"
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"nvcc failed: {exc}"
        return self._version

    def compile(self, source: str, arch: str, options: Sequence[str]) -> bytes:
        """The cubin of ``source`` (already wrapped, see ``modules.wrap_extern_c``).

        Raises
        ------
        RemoteError
            No nvcc, or the compilation failed (the message is nvcc's, file paths removed) or
            took too long.
        """
        if self.nvcc is None:
            raise RemoteError("no CUDA compiler (nvcc) on this worker: load PTX or a cubin instead, "
                              "or install the CUDA toolkit there (or set GPUD_NVCC)")
        with tempfile.TemporaryDirectory(prefix="gpud-nvcc-") as tmp:
            src = Path(tmp) / "kernel.cu"
            src.write_text(source)
            as_user: dict[str, Any] = {}
            if self.user is not None:
                uid, gid = self.user
                os.chown(tmp, uid, gid)
                os.chown(src, uid, gid)
                as_user = {"user": uid, "group": gid, "extra_groups": [],
                           "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp}}
            cmd = [self.nvcc, "--cubin", f"-arch={arch}", *options, "-o", "kernel.cubin", "kernel.cu"]
            try:
                out = subprocess.run(cmd, cwd=tmp, capture_output=True, timeout=self.timeout, check=False,
                                     stdin=subprocess.DEVNULL, **as_user)
            except subprocess.TimeoutExpired:
                raise RemoteError(f"compile error: nvcc took more than {self.timeout:g} s") from None
            except OSError as exc:
                raise RemoteError(f"compile error: nvcc could not run: {exc}") from None
            text = (out.stderr + out.stdout).decode(errors="replace").replace(tmp + os.sep, "").strip()
            cubin = Path(tmp) / "kernel.cubin"
            if out.returncode != 0 or not cubin.exists():
                raise RemoteError(f"compile error (nvcc exited with {out.returncode}):\n"
                                  + _clip(text or "no message"))
            if text:
                log.debug("nvcc said: %s", text[:2000])
            return cubin.read_bytes()


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 20] + "\n[... cut]"
