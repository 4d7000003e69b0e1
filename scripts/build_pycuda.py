"""Build a pycuda wheel from its unpacked sdist, its C++ sources compiled in parallel.

Used by scripts/gpu-check.sh on a GPU machine without network (no build isolation: setuptools,
wheel and numpy come from the venv). setuptools compiles the sources of one extension one after
the other, and pycuda's ``_driver`` with its shipped Boost.Python has some forty: here they are
compiled by ``--jobs`` threads (default: every CPU).

    python scripts/build_pycuda.py SRC_DIR WHEEL_DIR [--jobs N]

SRC_DIR must hold pycuda's ``siteconf.py`` (written by its ``configure.py``: the CUDA root, the
libraries), as scripts/gpu-check.sh does.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from multiprocessing.pool import ThreadPool
from typing import Any


def parallel(jobs: int) -> None:
    """Make setuptools' compiler compile the sources of one extension with ``jobs`` threads."""
    import setuptools  # noqa: F401  (first: its distutils is the one to patch)
    from setuptools._distutils import ccompiler

    def compile(self: Any, sources: Any, output_dir: Any = None, macros: Any = None, include_dirs: Any = None,
                debug: Any = 0, extra_preargs: Any = None, extra_postargs: Any = None, depends: Any = None) -> Any:
        macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj: str) -> None:
            if obj in build:
                src, ext = build[obj]
                self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPool(max(jobs, 1)) as pool:
            list(pool.imap_unordered(one, objects))
        return objects

    ccompiler.CCompiler.compile = compile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    parallel(args.jobs)
    os.chdir(args.src)
    sys.path.insert(0, os.getcwd())
    sys.argv = ["setup.py", "--quiet", "bdist_wheel", "--dist-dir", out]
    runpy.run_path("setup.py", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
