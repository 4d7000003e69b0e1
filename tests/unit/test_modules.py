"""Kernel modules before anything compiles them (gpud_worker.modules): load arguments, the source
checks that keep the worker's compiler from reading the worker's files, signatures, the cache."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from gpud.errors import InvalidRequest
from gpud_worker.kernels import BUILTINS, CUDA_SOURCE
from gpud_worker.modules import (
    ModuleCache,
    cache_key,
    check_cuda_source,
    check_launch_args,
    check_load_args,
    check_options,
    cuda_signatures,
    decode_text,
    default_cache_dir,
    describe,
    pack_format,
    ptx_signatures,
    strip_comments,
    wrap_extern_c,
)

# --------------------------------------------------------------------------- load arguments


def test_load_args() -> None:
    assert check_load_args("cuda", "m1", ["-O3", "-DN=4"]) == ("cuda", "m1", ("-O3", "-DN=4"))
    assert check_load_args("ptx", "a.b-c_d", None) == ("ptx", "a.b-c_d", ())
    for kind, name, options, match in [
        ("fortran", "m", [], "kind"),
        ("cuda", "", [], "module name"),
        ("cuda", "1abc", [], "module name"),
        ("cuda", "x" * 65, [], "module name"),
        ("cuda", "a/b", [], "module name"),
        ("cuda", "builtin", [], "reserved"),
        ("cuda", "m", "-O3", "list of strings"),
        ("cuda", "m", [3], "list of strings"),
        ("ptx", "m", ["-O3"], "CUDA C sources only"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            check_load_args(kind, name, options)


@pytest.mark.parametrize("opt", [
    "-O0", "-O3", "-DN=1024", "-DUSE_X", "-DF=(1+2)", "-UX", "--use_fast_math", "-use_fast_math",
    "-lineinfo", "-G", "--std=c++17", "-std=c++20", "--maxrregcount=64", "--ftz=true",
    "--prec-div=false", "--fmad=false", "--restrict", "-w", "--expt-relaxed-constexpr", "-Xptxas=-O2",
])
def test_allowed_options(opt: str) -> None:
    assert check_options([opt]) == (opt,)


@pytest.mark.parametrize("opt", [
    "-I/etc", "-I", "-ccbin=/tmp/evil", "-ccbin", "/tmp/evil", "-o", "--output-file=/etc/x",
    "--keep", "--keep-dir=/tmp", "-Xcompiler=-fplugin=/tmp/x.so", "-arch=sm_90", "-include=/etc/shadow",
    "--pre-include", "-DX=$(id)", "-D X", "-DX=a b", "--compiler-bindir=/tmp", "-O4", "-rdc=true",
    "--dependency-output=/tmp/x", "-l", "-L/tmp", "--library=x", "-Xlinker=-T/etc/x", "--run",
])
def test_refused_options(opt: str) -> None:
    with pytest.raises(InvalidRequest, match="not allowed"):
        check_options([opt])


def test_decode_text() -> None:
    assert decode_text(b"abc", "cuda") == "abc"
    assert decode_text(b".version 8.0\0", "ptx") == ".version 8.0"  # one trailing NUL is PTX's end
    with pytest.raises(InvalidRequest, match="NUL"):
        decode_text(b"a\0b", "cuda")
    with pytest.raises(InvalidRequest, match="UTF-8"):
        decode_text(b"\xff\xfe", "cuda")


# --------------------------------------------------------------------------- source checks

OK_SOURCE = r"""
#include <cuda_fp16.h>
#  include   <stdint.h>
#define N 4 // a comment with #include "/etc/passwd" in it
/* #include </etc/shadow> in a comment */
#pragma unroll
extern "C" __global__ void k(float* x) { const char* s = "#include </etc/shadow>"; x[0] = N; }
"""


def test_safe_source_passes() -> None:
    stripped = check_cuda_source(OK_SOURCE)
    assert "/etc/passwd" not in stripped  # comments are gone, strings are kept
    assert '"#include </etc/shadow>"' in stripped


@pytest.mark.parametrize("bad", [
    '#include "/etc/passwd"',
    '#include "kernel.h"',
    "#include </etc/shadow>",
    "#include <../../etc/shadow>",
    "#include <sys/../../../etc/shadow>",
    "#define F </etc/shadow>\n#include F",
    "#include_next <stdio.h>",
    "#import <x.h>",
    "#embed </etc/shadow>",
    "#/**/include </etc/shadow>",
    "# /* x */ include \"/etc/shadow\"",
    "#inc\\\nlude </etc/shadow>",
    "%:include </etc/shadow>",
    "??=include </etc/shadow>",
    '#if __has_include(</etc/gpud/keys/worker.key_secret>)\n#error yes\n#endif',
    '#pragma GCC dependency "/etc/shadow"',
    '_Pragma("GCC dependency \\"/etc/shadow\\"")',
    'const char* s = R"(\n#include </etc/shadow>\n)";',
    "/* unterminated",
    'const char* s = "unterminated;\n',
])
def test_unsafe_source_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        check_cuda_source(bad + "\n__global__ void k() {}\n")


def test_strip_comments_keeps_lines() -> None:
    text = "a /* one\ntwo */ b // three\nc '/*' \"//\" d"
    out = strip_comments(text)
    assert out.count("\n") == text.count("\n")
    assert out.split("\n")[-1] == "c '/*' \"//\" d"


def test_wrap_extern_c() -> None:
    assert wrap_extern_c('extern "C" __global__ void k() {}') == 'extern "C" __global__ void k() {}'
    wrapped = wrap_extern_c("__global__ void k() {}")
    assert wrapped.startswith('extern "C" {\n#line 1 "kernel.cu"\n') and wrapped.rstrip().endswith("}")


# --------------------------------------------------------------------------- signatures


def test_cuda_source_of_the_builtins_parses_to_their_signatures() -> None:
    check_cuda_source(CUDA_SOURCE)  # the built-ins pass the checks that user modules must pass
    sigs = cuda_signatures(CUDA_SOURCE)
    assert set(sigs) == set(BUILTINS)
    for name, sig in BUILTINS.items():
        assert [p.accepts for p in sigs[name]] == [(t,) for t in sig.params], name
        assert [p.name for p in sigs[name]] == list(sig.names), name


def test_cuda_signatures_types() -> None:
    src = r"""
    // __global__ void commented(int x) {}
    extern "C" __global__ void __launch_bounds__(256) a(const float* __restrict__ x, float y, int n,
        unsigned int u, unsigned m, long long ll, unsigned long long ull, size_t s, double d,
        int64_t i64, uint32_t u32, float z[], int* __restrict__ out) {}
    __global__ __launch_bounds__(128, 2) void b(void) {}
    template <typename T> __global__ void t(T* p, T v) {}
    __global__ void c(char ch, short s, bool flag) {}
    __global__ void d(float, int) {}
    __device__ void not_a_kernel(int x) {}
    """
    sigs = cuda_signatures(src)
    assert set(sigs) == {"a", "b", "t", "c", "d"}
    assert [p.accepts for p in sigs["a"]] == [
        ("ptr",), ("f32",), ("i32",), ("u32",), ("u32",), ("i64",), ("u64",), ("u64",), ("f64",),
        ("i64",), ("u32",), ("ptr",), ("ptr",),
    ]
    assert [p.name for p in sigs["a"]][:3] == ["x", "y", "n"]
    assert sigs["b"] == ()
    assert [p.accepts for p in sigs["t"]] == [("ptr",), ()]
    assert all(p.accepts == () for p in sigs["c"])
    assert [p.accepts for p in sigs["d"]] == [("f32",), ("i32",)]
    assert describe("d", sigs["d"]) == "d(float, int)"


def test_overloads_are_left_out() -> None:
    assert cuda_signatures("__global__ void k(int a) {}\n__global__ void k(float a) {}\n__global__ void j() {}") == {"j": ()}


def test_ptx_signatures() -> None:
    ptx = """
    .version 8.0
    .target sm_90
    .address_size 64
    // .entry commented(.param .u32 x)
    .visible .entry scale(
        .param .u64 scale_param_0,
        .param .f32 scale_param_1,
        .param .u32 scale_param_2
    )
    { ret; }
    .visible .entry by_value(.param .align 8 .b8 by_value_param_0[16], .param .f64 d)
    { ret; }
    """
    sigs = ptx_signatures(ptx)
    assert set(sigs) == {"scale", "by_value"}
    assert [p.accepts for p in sigs["scale"]] == [("ptr", "u64", "i64"), ("f32",), ("i32", "u32")]
    assert [p.accepts for p in sigs["by_value"]] == [(), ("f64",)]


def test_check_launch_args() -> None:
    sig = cuda_signatures("__global__ void k(float* x, float a, int n) {}")["k"]
    check_launch_args("m", "k", sig, [("ptr", 1), ("f32", 2.0), ("i32", 3)])
    check_launch_args("m", "k", None, [("f64", 1.0)])  # nothing known: passed as typed
    with pytest.raises(InvalidRequest, match="takes 3 arguments, got 2"):
        check_launch_args("m", "k", sig, [("ptr", 1), ("f32", 2.0)])
    with pytest.raises(InvalidRequest, match=r"argument 2 \(int n\) must be i32, got i64"):
        check_launch_args("m", "k", sig, [("ptr", 1), ("f32", 2.0), ("i64", 3)])
    with pytest.raises(InvalidRequest, match=r"argument 1 \(float a\) must be f32, got f64"):
        check_launch_args("m", "k", sig, [("ptr", 1), ("f64", 2.0), ("i32", 3)])
    with pytest.raises(InvalidRequest, match="argument 0 .* must be ptr, got u64"):
        check_launch_args("m", "k", sig, [("u64", 1), ("f32", 2.0), ("i32", 3)])
    bad = cuda_signatures("__global__ void c(char x) {}")["c"]
    with pytest.raises(InvalidRequest, match="cannot express"):
        check_launch_args("m", "c", bad, [("i32", 1)])


def test_pack_format_follows_c_alignment() -> None:
    args = [("i32", 1), ("ptr", 0x1000), ("f32", 1.5), ("f64", 2.0), ("u32", 7)]
    fmt = pack_format(args)
    assert fmt == "iPfdI"
    buf = struct.pack(fmt, *(v for _, v in args))
    # int at 0, pointer aligned to 8, float at 16, double aligned to 24, uint at 32: 36 bytes
    assert len(buf) == 36 and struct.unpack_from("P", buf, 8) == (0x1000,)


# --------------------------------------------------------------------------- the cache


def test_cache_key_covers_everything() -> None:
    base = cache_key("cuda", b"src", ["-O3"], (9, 0), "nvcc 13.0")
    assert len(base) == 64
    assert base == cache_key("cuda", b"src", ["-O3"], (9, 0), "nvcc 13.0")
    others = {
        cache_key("ptx", b"src", ["-O3"], (9, 0), "nvcc 13.0"),
        cache_key("cuda", b"src2", ["-O3"], (9, 0), "nvcc 13.0"),
        cache_key("cuda", b"src", ["-O2"], (9, 0), "nvcc 13.0"),
        cache_key("cuda", b"src", [], (9, 0), "nvcc 13.0"),
        cache_key("cuda", b"src", ["-O", "3"], (9, 0), "nvcc 13.0"),
        cache_key("cuda", b"src", ["-O3"], (8, 0), "nvcc 13.0"),
        cache_key("cuda", b"src", ["-O3"], (9, 0), "nvcc 12.4"),
    }
    assert base not in others and len(others) == 7


def test_module_cache(tmp_path: Path) -> None:
    cache = ModuleCache(tmp_path / "c")
    key = cache_key("cuda", b"x", [], (9, 0), "v")
    assert cache.get(key) is None
    path = cache.put(key, b"cubin")
    assert path == tmp_path / "c" / key[:2] / f"{key}.cubin"
    assert cache.get(key) == b"cubin"
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    cache.put(key, b"cubin2")  # replaced whole
    assert cache.get(key) == b"cubin2"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    with pytest.raises(ValueError):
        cache.path("../../etc/passwd")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUD_MODULE_CACHE", str(tmp_path / "m"))
    assert default_cache_dir() == tmp_path / "m"
    monkeypatch.delenv("GPUD_MODULE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "gpud" / "modules"
