#!/usr/bin/env bash
# Prepare, on a machine WITH network, the directory of files that `make gpu-check` installs from on
# a GPU machine WITHOUT network: wheels of scripts/gpu-requirements.txt for the GPU machine's
# Python and platform, and the pycuda sdist (built there, against its CUDA toolkit).
#
#   scripts/gpu-wheels.sh [DIR]          # DIR: default ./wheels (ignored by git)
#   PY_VERSION=3.12 scripts/gpu-wheels.sh   # the GPU machine's Python (default 3.12)
#
# Then copy DIR to the GPU machine beside the checkout (or point GPUD_WHEELS at it) and run
# `make gpu-check` there (docs/OPERATIONS.md, GPU check).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels}
PY_VERSION=${PY_VERSION:-3.12}
PIP=${PIP:-python3 -m pip}
PYCUDA=${PYCUDA_VERSION:-2026.1}
mkdir -p "$DIR"
# Wheels only, for CPython $PY_VERSION on x86-64 Linux (manylinux), pinned, with no dependency
# resolution beyond the pinned list (it names every dependency).
$PIP download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$PY_VERSION" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform linux_x86_64 --platform any \
    -d "$DIR" -r scripts/gpu-requirements.txt
# pycuda as its source: it must be compiled against the GPU machine's CUDA toolkit.
$PIP download --quiet --no-deps --no-binary=pycuda -d "$DIR" "pycuda==$PYCUDA"
ls -l "$DIR"
du -sh "$DIR"
