"""The worker's CUDA C compiler (gpud_worker.nvcc.NvccCompiler) with the real nvcc, where one is
installed (a GPU is not needed to compile: `pip install nvidia-cuda-nvcc nvidia-cuda-runtime`, or a
CUDA toolkit, or GPUD_NVCC). Without nvcc these tests skip, except the ones that need none.

They compile the built-in kernels and every kernel of the GPU checks (tests/gpu/gpu_sources.py), so
that a source that does not compile shows here, before a GPU machine is borrowed."""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path

import pytest

from gpud.errors import RemoteError
from gpud_worker import nvcc as C
from gpud_worker.kernels import CUDA_SOURCE
from gpud_worker.modules import check_cuda_source, cuda_signatures, ptx_signatures, wrap_extern_c

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import gpu_sources as sources  # noqa: E402

NVCC = C.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc here (GPUD_NVCC, PATH, CUDA_HOME, /usr/local/cuda)")
ARCH = "sm_90"
ELF = b"\x7fELF"


def test_without_nvcc_a_clear_remote_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "find_nvcc", lambda: None)
    compiler = C.NvccCompiler()
    assert compiler.nvcc is None and compiler.version() == "no nvcc"
    with pytest.raises(RemoteError, match="no CUDA compiler"):
        compiler.compile("__global__ void k() {}", ARCH, [])


@needs_nvcc
def test_builtins_compile() -> None:
    compiler = C.NvccCompiler()
    assert "release" in compiler.version()
    assert compiler.compile(wrap_extern_c(CUDA_SOURCE), ARCH, []).startswith(ELF)


@needs_nvcc
@pytest.mark.parametrize("name", ["MIX", "WILD", "SMALL_BLOCK", "SCALE", "SPIN"])
def test_gpu_check_sources_compile(name: str) -> None:
    source = getattr(sources, name)
    check_cuda_source(source)  # they pass the worker's source checks too
    assert C.NvccCompiler().compile(wrap_extern_c(source), ARCH, ["-O3"]).startswith(ELF)


@needs_nvcc
def test_compile_error_is_nvccs_message_with_the_users_line() -> None:
    with pytest.raises(RemoteError) as err:
        C.NvccCompiler().compile(wrap_extern_c(sources.BROKEN), ARCH, [])
    msg = err.value.message
    assert msg.startswith("compile error (nvcc exited with")
    assert "kernel.cu(4)" in msg and "undeclared_thing" in msg
    assert "/tmp" not in msg and "gpud-nvcc-" not in msg  # no paths of the worker


@needs_nvcc
@pytest.mark.parametrize("options", [["-O3", "--use_fast_math", "-DN=4", "-lineinfo"], ["--std=c++17", "--fmad=false", "-w"]])
def test_allowed_options_are_options_nvcc_takes(options: list[str]) -> None:
    assert C.NvccCompiler().compile(wrap_extern_c(sources.SCALE), ARCH, options).startswith(ELF)


@needs_nvcc
def test_ptx_parameters_agree_with_the_source() -> None:
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cu").write_text(wrap_extern_c(sources.MIX))
        subprocess.run([NVCC, "--ptx", f"-arch={ARCH}", "-o", "k.ptx", "k.cu"], cwd=tmp, check=True, capture_output=True)  # type: ignore[list-item]
        ptx = (Path(tmp) / "k.ptx").read_text()
    from_ptx, from_c = ptx_signatures(ptx)["mix"], cuda_signatures(sources.MIX)["mix"]
    assert len(from_ptx) == len(from_c)
    for p, c in zip(from_ptx, from_c, strict=True):
        assert set(c.accepts) <= set(p.accepts), (p, c)


@needs_nvcc
def test_compile_time_limit() -> None:
    with pytest.raises(RemoteError, match="took more than"):
        C.NvccCompiler(timeout=0.001).compile(wrap_extern_c(sources.MIX), ARCH, [])


@needs_nvcc
@pytest.mark.skipif(os.geteuid() != 0, reason="running nvcc as another user needs root")
def test_nvcc_runs_as_the_compile_user(tmp_path: Path) -> None:
    """Defence in depth behind the source checks: as root the worker compiles as an unprivileged
    user (compile_user), so even an include the checks missed reads only what that user may."""
    nobody = pwd.getpwnam("nobody")
    secret = tmp_path / "secret.h"
    secret.write_text("#define SECRET 42\n")
    secret.chmod(0o600)
    os.chmod(tmp_path, 0o755)  # the directory is not what stops it: the file's mode is
    source = wrap_extern_c(f'#include "{secret}"\n__global__ void k(int* x) {{ x[0] = SECRET; }}\n')
    as_nobody = C.NvccCompiler(user=(nobody.pw_uid, nobody.pw_gid))
    assert as_nobody.compile(wrap_extern_c(sources.SCALE), ARCH, []).startswith(ELF)
    with pytest.raises(RemoteError, match="(?i)permission denied"):
        as_nobody.compile(source, ARCH, [])
    assert C.NvccCompiler().compile(source, ARCH, []).startswith(ELF)  # as root it reads the file
