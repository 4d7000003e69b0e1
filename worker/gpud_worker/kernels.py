"""The built-in kernel library (module ``"builtin"``, docs/PROTOCOL.md §5.4).

This module owns the one table of built-in kernels, ``BUILTINS``: each kernel's parameter types, the
number of float32 elements each pointer argument must hold, and a numpy implementation that the
simulated GPU runs on the CPU. ``CUDA_SOURCE`` holds the same kernels as CUDA C for a real GPU, and
``check_args`` validates a launch's arguments against the table before anything runs.

Semantics, identical for the numpy and the CUDA versions (all data float32):

- ``vector_add(a*, b*, out*, n:i32)``: ``out[i] = a[i] + b[i]`` for ``i < n``.
- ``saxpy(alpha:f32, x*, y*, n:i32)``: ``y[i] = alpha * x[i] + y[i]`` for ``i < n``.
- ``sgemm(A*, B*, C*, M:i32, N:i32, K:i32)``: row-major ``C[MxN] = A[MxK] @ B[KxN]``
  (``C`` is overwritten, not accumulated into).
- ``reduce_sum(x*, out*, n:i32)``: *writes* ``out[0] = sum(x[:n])``; the caller need not zero
  ``out`` first.

A negative size counts as zero: nothing is read and the loops do not run (``reduce_sum`` then writes
0, ``sgemm`` with ``K <= 0`` writes zeros). Results do not depend on ``grid`` and ``block``.

Rounding: ``vector_add`` and ``saxpy`` give the same bits on both (the CUDA ``saxpy`` rounds the
product before the sum, as numpy, instead of one fused multiply-add); ``reduce_sum`` sums in float64
on both and rounds once (in another order: equal to the last bit but for rare ties); ``sgemm`` sums
float32 products in another order than numpy's BLAS (equal within float32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gpud.errors import InvalidRequest
from gpud.protocol import BUILTIN_MODULE

F32 = np.float32
F32_BYTES = 4
MAX_THREADS_PER_BLOCK = 1024  # CUDA's limit; CUDA_SOURCE's reduce_sum relies on it

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_PTR_MAX = (1 << 63) - 1

Arg = tuple[str, int | float]  # one launch argument as it comes off the wire: (type, value)
Buffer = npt.NDArray[np.float32]  # a device buffer seen as float32
Resolved = Buffer | int | float  # an argument with its pointer replaced by the buffer


@dataclass(frozen=True, slots=True)
class KernelSig:
    """One built-in kernel.

    Attributes
    ----------
    name:
        The kernel's name in module ``"builtin"``.
    params:
        The wire type of each parameter, in order (``"ptr"``, ``"i32"``, ``"f32"``).
    names:
        Each parameter's name, for error messages.
    footprint:
        Given the argument values, the number of float32 elements each pointer argument must hold,
        keyed by argument index. A buffer smaller than that is an illegal address.
    run:
        The numpy implementation, called with the resolved arguments in order.
    """

    name: str
    params: tuple[str, ...]
    names: tuple[str, ...]
    footprint: Callable[[Sequence[int | float]], Mapping[int, int]]
    run: Callable[..., None]

    def signature(self) -> str:
        """``name(p0:type, p1:type, ...)`` for messages and docs."""
        inner = ", ".join(f"{n}:{t}" for n, t in zip(self.names, self.params, strict=True))
        return f"{self.name}({inner})"


def _size(v: int | float) -> int:
    """A size argument as an element count; negative sizes count as zero."""
    return max(int(v), 0)


def _vector_add(a: Buffer, b: Buffer, out: Buffer, n: int) -> None:
    n = _size(n)
    np.add(a[:n], b[:n], out=out[:n])


def _saxpy(alpha: float, x: Buffer, y: Buffer, n: int) -> None:
    n = _size(n)
    y[:n] = F32(alpha) * x[:n] + y[:n]


def _sgemm(a: Buffer, b: Buffer, c: Buffer, m: int, n: int, k: int) -> None:
    m, n, k = _size(m), _size(n), _size(k)
    if m == 0 or n == 0:
        return
    # A temporary, then a copy: C may alias A or B (a race on a real GPU, defined here).
    c[: m * n] = (a[: m * k].reshape(m, k) @ b[: k * n].reshape(k, n)).reshape(-1)


def _reduce_sum(x: Buffer, out: Buffer, n: int) -> None:
    n = _size(n)
    out[0] = F32(np.sum(x[:n], dtype=np.float64))


BUILTINS: dict[str, KernelSig] = {
    "vector_add": KernelSig(
        name="vector_add",
        params=("ptr", "ptr", "ptr", "i32"),
        names=("a", "b", "out", "n"),
        footprint=lambda v: {0: _size(v[3]), 1: _size(v[3]), 2: _size(v[3])},
        run=_vector_add,
    ),
    "saxpy": KernelSig(
        name="saxpy",
        params=("f32", "ptr", "ptr", "i32"),
        names=("alpha", "x", "y", "n"),
        footprint=lambda v: {1: _size(v[3]), 2: _size(v[3])},
        run=_saxpy,
    ),
    "sgemm": KernelSig(
        name="sgemm",
        params=("ptr", "ptr", "ptr", "i32", "i32", "i32"),
        names=("A", "B", "C", "M", "N", "K"),
        footprint=lambda v: _sgemm_footprint(_size(v[3]), _size(v[4]), _size(v[5])),
        run=_sgemm,
    ),
    "reduce_sum": KernelSig(
        name="reduce_sum",
        params=("ptr", "ptr", "i32"),
        names=("x", "out", "n"),
        footprint=lambda v: {0: _size(v[2]), 1: 1},
        run=_reduce_sum,
    ),
}


def _sgemm_footprint(m: int, n: int, k: int) -> dict[int, int]:
    if m == 0 or n == 0:  # nothing is read or written
        return {0: 0, 1: 0, 2: 0}
    return {0: m * k, 1: k * n, 2: m * n}


def lookup(module: str, name: str) -> KernelSig:
    """The kernel ``name`` of ``module``; InvalidRequest when either is unknown."""
    if module != BUILTIN_MODULE:
        raise InvalidRequest(f"module {module!r} unknown (only {BUILTIN_MODULE!r} is loaded)")
    sig = BUILTINS.get(name)
    if sig is None:
        known = ", ".join(sorted(BUILTINS))
        raise InvalidRequest(f"unknown kernel {name!r} in module {module!r} (known: {known})")
    return sig


def check_args(name: str, args: Sequence[Arg]) -> None:
    """Validate a built-in launch's arguments against ``BUILTINS``.

    Raises
    ------
    InvalidRequest
        Unknown kernel, wrong argument count, or an argument of the wrong type or value (the
        message names the argument's index, its parameter name and the expected type).
    """
    sig = lookup(BUILTIN_MODULE, name)
    if len(args) != len(sig.params):
        raise InvalidRequest(
            f"kernel {sig.signature()} takes {len(sig.params)} arguments, got {len(args)}"
        )
    for i, (arg, want, pname) in enumerate(zip(args, sig.params, sig.names, strict=True)):
        if not isinstance(arg, tuple | list) or len(arg) != 2:
            raise InvalidRequest(
                f"kernel {name!r} argument {i} ({pname}) must be a (type, value) pair"
            )
        tag, value = arg
        if tag != want:
            raise InvalidRequest(
                f"kernel {name!r} argument {i} ({pname}) must be {want}, got {tag!r}"
            )
        _check_value(name, i, pname, want, value)


def _check_value(name: str, i: int, pname: str, tag: str, value: Any) -> None:
    where = f"kernel {name!r} argument {i} ({pname}:{tag})"
    if tag == "f32":
        if type(value) not in (int, float):
            raise InvalidRequest(f"{where} must be a number, got {type(value).__name__}")
        return
    lo, hi = (0, _PTR_MAX) if tag == "ptr" else (_I32_MIN, _I32_MAX)
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidRequest(f"{where} must be an int in {lo}..{hi}, got {value!r}")


CUDA_SOURCE: str = r"""
// gpud built-in kernels (module "builtin"); the CUDA twin of gpud_worker/kernels.py.
// All data is float32. Every kernel walks the whole launch (all three grid and block dimensions)
// with a grid-stride loop, so its result does not depend on grid and block.

static __device__ __forceinline__ unsigned long long gpud_thread_rank()
{
    unsigned long long block = blockIdx.x + (unsigned long long)gridDim.x
        * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    unsigned long long per_block = (unsigned long long)blockDim.x * blockDim.y * blockDim.z;
    unsigned long long local = threadIdx.x + (unsigned long long)blockDim.x
        * (threadIdx.y + (unsigned long long)blockDim.y * threadIdx.z);
    return block * per_block + local;
}

static __device__ __forceinline__ unsigned long long gpud_thread_count()
{
    return (unsigned long long)gridDim.x * gridDim.y * gridDim.z
        * blockDim.x * blockDim.y * blockDim.z;
}

// out[i] = a[i] + b[i] for i < n
extern "C" __global__ void vector_add(const float* a, const float* b, float* out, int n)
{
    long long len = n;
    for (unsigned long long i = gpud_thread_rank(); (long long)i < len; i += gpud_thread_count())
        out[i] = a[i] + b[i];
}

// y[i] = alpha * x[i] + y[i] for i < n. __fmul_rn: the product is rounded before the sum, as
// numpy does (nvcc would otherwise fuse them into one FMA, rounded once: another last bit).
extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n)
{
    long long len = n;
    for (unsigned long long i = gpud_thread_rank(); (long long)i < len; i += gpud_thread_count())
        y[i] = __fmul_rn(alpha, x[i]) + y[i];
}

// Row-major C[M x N] = A[M x K] @ B[K x N]; one output element per loop step.
extern "C" __global__ void sgemm(const float* A, const float* B, float* C, int M, int N, int K)
{
    if (M <= 0 || N <= 0)
        return;
    long long total = (long long)M * N;
    for (unsigned long long idx = gpud_thread_rank(); (long long)idx < total;
         idx += gpud_thread_count()) {
        long long row = (long long)idx / N;
        long long col = (long long)idx % N;
        float acc = 0.0f;
        for (long long k = 0; k < K; ++k)
            acc += A[row * K + k] * B[k * N + col];
        C[idx] = acc;
    }
}

// Writes out[0] = sum(x[0..n)). Only the grid's first block works: each of its threads sums a
// strided slice, then a shared-memory tree reduction (any block size up to 1024 threads) leaves
// the total in partial[0]. The other blocks return at once, so the result does not depend on grid.
// The sum is taken in double and rounded to float once, as numpy's np.sum(x, dtype=float64).
extern "C" __global__ void reduce_sum(const float* x, float* out, int n)
{
    __shared__ double partial[1024];
    if (blockIdx.x != 0 || blockIdx.y != 0 || blockIdx.z != 0)
        return;
    unsigned int width = blockDim.x * blockDim.y * blockDim.z;
    unsigned int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    long long len = n;
    double acc = 0.0;
    for (long long i = tid; i < len; i += width)
        acc += (double)x[i];
    partial[tid] = acc;
    __syncthreads();
    while (width > 1) {
        unsigned int half = (width + 1) / 2;
        if (tid < width - half)
            partial[tid] += partial[tid + half];
        __syncthreads();
        width = half;
    }
    if (tid == 0)
        out[0] = (float)partial[0];
}
"""
