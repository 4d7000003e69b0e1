"""CUDA C of the GPU checks (tests/gpu, bench/gpu_check.py). tests/unit/test_nvcc.py compiles
them wherever nvcc exists, GPU or not, so a typo shows before a GPU machine is borrowed."""

from __future__ import annotations

# Every scalar type launch arguments have (PROTOCOL.md §5.4), in an order that needs padding.
MIX = r"""
// out[i] = a * x[i] + (float)(b + offset + stride + (scale_bits & 0xff)) for i < n
__global__ void mix(const float* x, float* out, int n, unsigned int stride, long long offset,
                    unsigned long long scale_bits, float a, double b)
{
    double c = b + (double)offset + (double)stride + (double)(scale_bits & 0xffull);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        out[i] = __fmul_rn(a, x[i]) + (float)c;
}
"""


def mix_expected(x, n, stride, offset, scale_bits, a, b):  # type: ignore[no-untyped-def]
    """What ``mix`` writes (numpy float32, as the kernel rounds)."""
    import numpy as np

    c = np.float32(float(b) + float(offset) + float(stride) + float(scale_bits & 0xFF))
    return (np.float32(a) * x[:n]).astype(np.float32) + c


# A write to an address no allocation holds: CUDA_ERROR_ILLEGAL_ADDRESS, a sticky error.
WILD = r"""
extern "C" __global__ void wild_write(float* x)
{
    float* nowhere = (float*)0x10;
    nowhere[threadIdx.x] = x[0];
}
"""

# A kernel compiled for at most 64 threads per block: launched with more, CUDA refuses the launch
# (an error that is not sticky: the session goes on).
SMALL_BLOCK = r"""
extern "C" __global__ void __launch_bounds__(64) small_block(float* x)
{
    x[threadIdx.x] = 1.0f;
}
"""

# Does not compile: an undeclared identifier on line 4.
BROKEN = r"""
__global__ void broken(float* x)
{
    x[0] = undeclared_thing;
}
"""

# A kernel that never ends while flag[0] is 0 (the session's process must be killed to end it).
SPIN = r"""
extern "C" __global__ void spin(volatile int* flag)
{
    while (flag[0] == 0) {
    }
}
"""

# For PTX and cubin loads (compiled by the test with nvcc).
SCALE = r"""
extern "C" __global__ void scale(float* x, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = __fmul_rn(x[i], a);
}
"""

# A job's view of CUDA: the devices it can see, by uuid (libcuda through ctypes: no pycuda needed).
JOB_VISIBLE = r"""
import ctypes, json, os
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0, "cuInit failed"
n = ctypes.c_int()
assert cuda.cuDeviceGetCount(ctypes.byref(n)) == 0
uuids = []
get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
for i in range(n.value):
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
    raw = (ctypes.c_ubyte * 16)()
    assert get_uuid(raw, dev) == 0
    h = bytes(raw).hex()
    uuids.append("GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:]))
print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": n.value, "uuids": uuids}))
"""
