"""CUDA_SOURCE and BUILTINS describe the same kernels: names, parameter names and types."""

from __future__ import annotations

import re

from gpud_worker.kernels import BUILTINS, CUDA_SOURCE

_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
_PARAM = re.compile(r"^(?:const\s+)?(float|int)\s*(\*?)\s*(\w+)$")
_C_TYPES = {("float", "*"): "ptr", ("float", ""): "f32", ("int", ""): "i32"}


def _cuda_kernels() -> dict[str, list[tuple[str, str]]]:
    kernels: dict[str, list[tuple[str, str]]] = {}
    for name, params in _KERNEL.findall(CUDA_SOURCE):
        assert name not in kernels, f"kernel {name} defined twice"
        parsed = []
        for p in params.split(","):
            m = _PARAM.match(p.strip())
            assert m, f"{name}: cannot parse parameter {p!r}"
            parsed.append((_C_TYPES[(m.group(1), m.group(2))], m.group(3)))
        kernels[name] = parsed
    return kernels


def test_cuda_source_defines_exactly_the_builtins() -> None:
    kernels = _cuda_kernels()
    assert set(kernels) == set(BUILTINS)
    assert CUDA_SOURCE.count("__global__") == len(BUILTINS)  # no kernel without extern "C"
    for name, sig in BUILTINS.items():
        assert len(kernels[name]) == len(sig.params), name
        assert [t for t, _ in kernels[name]] == list(sig.params), name
        assert [n for _, n in kernels[name]] == list(sig.names), name
