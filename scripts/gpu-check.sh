#!/usr/bin/env bash
# `make gpu-check`: the GPU check, on a machine with an NVIDIA GPU, its driver and the CUDA toolkit
# (nvcc), and NO network. In under 5 minutes it:
#
#   1. makes a venv (build/gpu-venv) and installs scripts/gpu-requirements.txt from a directory of
#      files prepared elsewhere (GPUD_WHEELS, default ./wheels: scripts/gpu-wheels.sh makes it);
#   2. builds pycuda from its sdist in that directory, against this machine's CUDA toolkit (once:
#      the wheel is kept in build/pycuda-wheel/ and reused while the sdist, the toolkit and the
#      Python are the same; a pycuda wheel for this Python in GPUD_WHEELS is used as it is);
#   3. runs tests/gpu/ (a broker and a worker on the real GPU, through the real client library);
#   4. prints the GPU figures (bench/gpu_check.py): remote launch round trip and memcpy bandwidth
#      through gpud beside the same operations done locally with pycuda. Its last line is one JSON
#      object, with the test counts.
#
# Exit status: 0 when every GPU test passed and the figures were measured.
# Settings (environment): GPUD_WHEELS, GPUD_PYTHON (python3), GPUD_GPU_VENV (build/gpu-venv),
# GPUD_GPU_OUT (build/gpu-check: logs, junit XML, figures), CUDA_HOME, GPUD_NVCC, GPUD_LIBCUDA (the
# libcuda to link pycuda against where the toolkit has no stubs/libcuda.so),
# GPUD_GPU_TEST_TIMEOUT (180 s), GPUD_GPU_BENCH_TIMEOUT (90 s). docs/OPERATIONS.md, GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$SECONDS
say() { printf '[gpu-check %3ds] %s\n' $((SECONDS - T0)) "$*"; }
die() { say "FAILED: $*"; printf '{"error": "%s"}\n' "$(printf '%s' "$*" | tr '"\n' "' ")"; exit 1; }

WHEELS=${GPUD_WHEELS:-wheels}
PY=${GPUD_PYTHON:-python3}
VENV=${GPUD_GPU_VENV:-build/gpu-venv}
OUT=${GPUD_GPU_OUT:-build/gpu-check}
TEST_TIMEOUT=${GPUD_GPU_TEST_TIMEOUT:-180}
BENCH_TIMEOUT=${GPUD_GPU_BENCH_TIMEOUT:-90}
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$OUT" build
[ -d "$WHEELS" ] || die "no directory $WHEELS of wheels and the pycuda sdist: make it with scripts/gpu-wheels.sh on a machine with network and copy it here, or set GPUD_WHEELS (docs/OPERATIONS.md, GPU check)"
WHEELS=$(cd "$WHEELS" && pwd)

# ---------------------------------------------------------------- 0. the machine
command -v nvidia-smi >/dev/null && nvidia-smi -L | sed 's/^/  /' || say "nvidia-smi not found (the tests ask NVML themselves)"
NVCC=${GPUD_NVCC:-}
for cand in "$NVCC" "$(command -v nvcc || true)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    if [ -n "$cand" ] && [ -x "$cand" ]; then NVCC=$cand; break; fi
done
[ -x "$NVCC" ] || die "no nvcc: install the CUDA toolkit, or set CUDA_HOME or GPUD_NVCC"
if [ -n "${CUDA_HOME:-}" ] && [ -d "$CUDA_HOME/include" ]; then CUDA_ROOT=$CUDA_HOME
elif [ -d /usr/local/cuda/include ]; then CUDA_ROOT=/usr/local/cuda
else CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
fi
[ -f "$CUDA_ROOT/include/cuda.h" ] || die "no cuda.h under $CUDA_ROOT/include: set CUDA_HOME to the CUDA toolkit"
export PATH="$(dirname "$NVCC"):$PATH" GPUD_NVCC=$NVCC CUDA_HOME=$CUDA_ROOT
say "nvcc: $NVCC ($("$NVCC" --version | tail -1)); CUDA toolkit: $CUDA_ROOT; $JOBS CPUs"

# ---------------------------------------------------------------- 1. the venv
VPY=$ROOT/$VENV/bin/python
case "$VENV" in /*) VPY=$VENV/bin/python ;; esac
if [ ! -x "$VPY" ]; then
    "$PY" -m venv "$VENV" 2>/dev/null || { rm -rf "$VENV"; "$PY" -m venv --without-pip "$VENV"; } || die "$PY -m venv failed"
fi
if "$VPY" -m pip --version >/dev/null 2>&1; then
    PIP=("$VPY" -m pip --disable-pip-version-check --no-input --quiet)
else  # a Python without ensurepip: its own pip installs into the venv
    PIP=("$PY" -m pip --python "$VPY" --disable-pip-version-check --no-input --quiet)
fi
"${PIP[@]}" install --no-index --find-links "$WHEELS" -r scripts/gpu-requirements.txt \
    || die "installing scripts/gpu-requirements.txt from $WHEELS failed (wheels for $("$VPY" -V) on $(uname -m)? see scripts/gpu-wheels.sh)"
say "venv $VENV ready ($("$VPY" -V))"

# ---------------------------------------------------------------- 2. pycuda
if ! "$VPY" -c "import pycuda.driver" 2>/dev/null; then
    SDIST=$(ls "$WHEELS"/pycuda-*.tar.gz 2>/dev/null | head -1 || true)
    TAG=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    # A wheel built here before is reused while the sdist, the toolkit and the Python are the same.
    KEY=$(printf '%s\n' "$(basename "${SDIST:-none}")" "$CUDA_ROOT" "$("$NVCC" --version)" "$TAG" "${GPUD_LIBCUDA:-}" | sha256sum | cut -c1-16)
    WHEEL_DIR=build/pycuda-wheel/$KEY
    BUILT=$(ls "$WHEEL_DIR"/pycuda-*-"$TAG"-*.whl "$WHEELS"/pycuda-*-"$TAG"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$BUILT" ]; then
        [ -n "$SDIST" ] || die "no pycuda sdist (pycuda-*.tar.gz) in $WHEELS"
        PYINC=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
        [ -f "$PYINC/Python.h" ] || die "no Python.h in $PYINC: building pycuda needs the Python headers (python3-dev), or put a pycuda wheel built for this Python and CUDA in $WHEELS"
        command -v g++ >/dev/null || die "no g++: building pycuda needs a C++ compiler"
        say "building pycuda from $(basename "$SDIST") against $CUDA_ROOT ($JOBS jobs)"
        SRC=build/pycuda-src
        rm -rf "$SRC" build/pycuda-link && mkdir -p "$SRC" build/pycuda-link
        tar xzf "$SDIST" -C "$SRC" --strip-components=1
        # -lcuda at link time: the toolkit's stub (SONAME libcuda.so.1), else the driver's library.
        LIBCUDA=${GPUD_LIBCUDA:-}
        [ -n "$LIBCUDA" ] || for cand in "$CUDA_ROOT"/lib64/stubs/libcuda.so "$CUDA_ROOT"/lib/stubs/libcuda.so \
                    "$CUDA_ROOT"/targets/*/lib/stubs/libcuda.so /usr/local/nvidia/lib64/libcuda.so.1 \
                    /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1; do
            if [ -e "$cand" ]; then LIBCUDA=$cand; break; fi
        done
        if [ -z "$LIBCUDA" ]; then
            LIBCUDA=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}' || true)
        fi
        [ -n "$LIBCUDA" ] || die "no libcuda to link pycuda against (toolkit stubs or the driver's libcuda.so.1)"
        ln -s "$(readlink -f "$LIBCUDA")" build/pycuda-link/libcuda.so
        (cd "$SRC" && "$VPY" configure.py --cuda-root="$CUDA_ROOT" --no-cuda-enable-curand \
            --cudadrv-lib-dir="$ROOT/build/pycuda-link" >/dev/null) || die "pycuda's configure.py failed"
        "$VPY" scripts/build_pycuda.py "$SRC" "$WHEEL_DIR" --jobs "$JOBS" >"$OUT/pycuda-build.log" 2>&1 \
            || { tail -40 "$OUT/pycuda-build.log"; die "building pycuda failed (log: $OUT/pycuda-build.log)"; }
        BUILT=$(ls "$WHEEL_DIR"/pycuda-*-"$TAG"-*.whl 2>/dev/null | head -1 || true)
        [ -n "$BUILT" ] || die "no pycuda wheel was built (log: $OUT/pycuda-build.log)"
    fi
    "${PIP[@]}" install --no-index --no-deps --force-reinstall "$BUILT" || die "installing $BUILT failed"
fi
"$VPY" -W ignore -c "import pycuda.driver as d; d.init(); print('  pycuda', __import__('pycuda').VERSION_TEXT, 'CUDA', d.get_version(), 'driver', d.get_driver_version(), 'GPUs', d.Device.count())" \
    || die "pycuda does not start CUDA here"
say "pycuda ready"

# ---------------------------------------------------------------- 3. tests/gpu
export PYTHONPATH="$ROOT:$ROOT/cli:$ROOT/broker:$ROOT/worker:$ROOT/standby:$ROOT/libclient${PYTHONPATH:+:$PYTHONPATH}"
export GPUD_MODULE_CACHE=${GPUD_MODULE_CACHE:-$ROOT/build/gpu-module-cache}
set +e
timeout -k 10 "$TEST_TIMEOUT" "$VPY" -m pytest tests/gpu -v -p no:cacheprovider -rs --timeout 150 \
    --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log"
TESTS_RC=${PIPESTATUS[0]}
set -e
say "tests/gpu exited with $TESTS_RC"

# ---------------------------------------------------------------- 4. the figures
set +e
timeout -k 10 "$BENCH_TIMEOUT" "$VPY" bench/gpu_check.py --junit "$OUT/junit.xml" --out "$OUT/figures.json" \
    2>"$OUT/bench.log" | tee "$OUT/bench.out"
BENCH_RC=${PIPESTATUS[0]}
set -e
[ "$BENCH_RC" -eq 0 ] || { say "bench exited with $BENCH_RC (log: $OUT/bench.log)" >&2; tail -20 "$OUT/bench.log" >&2; }
[ "$BENCH_RC" -eq 0 ] || [ -s "$OUT/figures.json" ] || printf '{"error": "bench exited with %s"}\n' "$BENCH_RC"
if [ "$TESTS_RC" -ne 0 ]; then exit "$TESTS_RC"; fi
exit "$BENCH_RC"
