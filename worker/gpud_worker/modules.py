"""Kernel modules a session loads (``load`` CALL, docs/PROTOCOL.md §5.4): checks, signatures, cache.

This module is pure (no pycuda, no subprocess, no sockets): it owns what both device backends need
to know about a module before anything compiles or runs it.

- ``check_load_args`` validates a ``load`` CALL's ``kind``, ``name`` and ``options``.
- ``check_cuda_source`` refuses CUDA C sources that would make the worker's compiler read files of
  the worker host: the compiler runs as the worker's user, and its error messages go back to the
  client, so a source may only ``#include <relative/path.h>`` (system and CUDA headers), never a
  quoted, absolute, ``..`` or computed include, ``#include_next``, ``#import``, ``#embed``,
  ``__has_include`` or a ``dependency`` pragma; raw string literals are refused too (they would
  hide directives from this check). ``check_options`` accepts only the nvcc options of
  ``ALLOWED_OPTIONS`` (macros, optimisation and floating point switches, debug info): no option
  that names a file, a directory or another program (``-I``, ``-ccbin``, ``-o``, ``--keep-dir``...).
- ``cuda_signatures`` / ``ptx_signatures`` read the kernels' parameter lists from a CUDA C source
  (``__global__ void name(...)``) or from PTX (``.entry name(...)``), so that a launch's typed
  arguments are checked against the kernel *before* it runs (``check_launch_args``).
- ``ModuleCache`` is the on-disk cache of compiled modules (cubin), keyed by
  ``cache_key`` = sha256 of the source, the options, the GPU's architecture and the compiler's
  version.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpud.errors import InvalidRequest
from gpud.protocol import BUILTIN_MODULE

KINDS = ("cuda", "ptx", "cubin")
"""Module kinds of a ``load`` CALL: CUDA C source, PTX text, or a cubin (ELF) for the GPU."""

MAX_MODULE_BYTES = 16 << 20  # one module's source or binary
MAX_OPTIONS = 64
MAX_MODULES = 256  # modules one session may hold
MAX_FUNCTIONS = 1024  # names listed in a load's result
MAX_MESSAGE_CHARS = 16 * 1024  # of a compiler's message sent back (headers are at most 64 KiB)

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")

# nvcc options a client may pass: none names a file, a directory or another program.
ALLOWED_OPTIONS: tuple[str, ...] = (
    r"-D[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+\-*/()]*)?",
    r"-U[A-Za-z_][A-Za-z0-9_]*",
    r"-O[0-3]",
    r"--?use_fast_math",
    r"-lineinfo|--generate-line-info",
    r"-G|--device-debug",
    r"--?std=c\+\+(11|14|17|20)",
    r"--?maxrregcount=[0-9]{1,3}",
    r"--?(ftz|prec-div|prec-sqrt|fmad)=(true|false)",
    r"--restrict|--extra-device-vectorization|-w|--disable-warnings",
    r"--expt-relaxed-constexpr|--expt-extended-lambda|--extended-lambda",
    r"-Xptxas=-O[0-3]",
)
_OPTION_RE = re.compile("(?:" + "|".join(f"(?:{p})" for p in ALLOWED_OPTIONS) + r")\Z")

# Wire types of launch arguments (PROTOCOL.md §5.4) and the struct format of each.
ARG_FORMATS: dict[str, str] = {
    "ptr": "P", "i32": "i", "u32": "I", "i64": "q", "u64": "Q", "f32": "f", "f64": "d",
}
_SCALAR_TYPES: dict[str, str] = {
    # C type (normalized: qualifiers dropped, words joined by one space) -> wire type. LP64 Linux.
    "int": "i32", "signed": "i32", "signed int": "i32", "int32_t": "i32",
    "unsigned": "u32", "unsigned int": "u32", "uint32_t": "u32",
    "long": "i64", "long int": "i64", "signed long": "i64", "long long": "i64",
    "long long int": "i64", "signed long long": "i64", "int64_t": "i64", "ptrdiff_t": "i64",
    "unsigned long": "u64", "unsigned long int": "u64", "unsigned long long": "u64",
    "unsigned long long int": "u64", "uint64_t": "u64", "size_t": "u64", "uintptr_t": "u64",
    "float": "f32", "double": "f64",
}
_QUALIFIERS = frozenset({
    "const", "volatile", "__restrict__", "__restrict", "restrict", "__grid_constant__", "register",
})
_TYPE_WORDS = frozenset({"int", "signed", "unsigned", "long", "short", "char", "float", "double", "bool"})


@dataclass(frozen=True, slots=True)
class Param:
    """One kernel parameter as a launch sees it.

    Attributes
    ----------
    name:
        Its name in the source ("" when unnamed).
    ctype:
        Its declared type, as written (for messages).
    accepts:
        The wire types a launch argument may have for it; empty: none can express it (a ``char``,
        a struct...), so the kernel cannot be launched through gpud.
    """

    name: str
    ctype: str
    accepts: tuple[str, ...]


Signature = tuple[Param, ...]


# --------------------------------------------------------------------------- load arguments


def check_load_args(kind: Any, name: Any, options: Any) -> tuple[str, str, tuple[str, ...]]:
    """Validate a ``load`` CALL's arguments; returns ``(kind, name, options)``.

    Raises
    ------
    InvalidRequest
        Unknown kind, a bad or reserved module name, or options that are not a list of allowed
        nvcc options (options are for kind ``cuda`` only).
    """
    if kind not in KINDS:
        raise InvalidRequest(f"module kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if type(name) is not str or not _NAME_RE.match(name):
        raise InvalidRequest(
            f"module name must be 1 to 64 characters, letters, digits, '_', '.', '-', starting "
            f"with a letter or '_', got {name!r}"
        )
    if name == BUILTIN_MODULE:
        raise InvalidRequest(f"module name {BUILTIN_MODULE!r} is reserved for the built-in kernels")
    if options is None:
        options = []
    if type(options) is not list or not all(type(o) is str for o in options):
        raise InvalidRequest("module options must be a list of strings")
    if options and kind != "cuda":
        raise InvalidRequest(f"options apply to CUDA C sources only, not to {kind}")
    return kind, name, check_options(options)


def check_options(options: Sequence[str]) -> tuple[str, ...]:
    """The nvcc options, each one of ``ALLOWED_OPTIONS``; InvalidRequest otherwise."""
    if len(options) > MAX_OPTIONS:
        raise InvalidRequest(f"at most {MAX_OPTIONS} compiler options, got {len(options)}")
    for opt in options:
        if not _OPTION_RE.match(opt):
            raise InvalidRequest(
                f"compiler option {opt!r} is not allowed: only macros (-DNAME[=VALUE], -UNAME), "
                "-O0..-O3, --use_fast_math, -lineinfo, -G, --std=c++NN, --maxrregcount=N, "
                "--ftz/--prec-div/--prec-sqrt/--fmad=true|false, --restrict, -w, "
                "--expt-relaxed-constexpr, --extended-lambda, -Xptxas=-ON; the worker chooses "
                "the architecture, include paths and files itself"
            )
    return tuple(options)


def decode_text(data: bytes | memoryview, kind: str) -> str:
    """A CUDA C or PTX module's text: UTF-8, without NUL bytes; InvalidRequest otherwise."""
    raw = bytes(data)
    if len(raw) > MAX_MODULE_BYTES:
        raise InvalidRequest(f"a module is at most {MAX_MODULE_BYTES} bytes, got {len(raw)}")
    if kind == "ptx" and raw.endswith(b"\0"):
        raw = raw[:-1]
    if b"\0" in raw:
        raise InvalidRequest(f"a {kind} module is text and may not contain NUL bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"a {kind} module must be UTF-8 text: {exc}") from None


# --------------------------------------------------------------------------- source checks


def strip_comments(source: str) -> str:
    """``source`` with backslash-newlines spliced and each comment replaced by one space (a
    newline per newline it held, so line numbers stay); string and character literals are kept.

    Raises
    ------
    InvalidRequest
        An unterminated comment or literal.
    """
    text = re.sub(r"\\\r?\n", "", source)
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            out.append(" ")
        elif c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise InvalidRequest("unterminated /* comment")
            out.append(" " + "\n" * text.count("\n", i, j))
            i = j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\n":
                    raise InvalidRequest("unterminated string or character literal")
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                raise InvalidRequest("unterminated string or character literal")
            out.append(text[i : j + 1])
            i = j + 1
        else:
            j = i + 1
            while j < n and text[j] not in "/\"'":
                j += 1
            out.append(text[i:j])
            i = j
    return "".join(out)


_RAW_STRING_RE = re.compile(r'(?<![A-Za-z0-9_])(?:u8|u|U|L)?R"')
_DIRECTIVE_RE = re.compile(r"^[ \t]*(?:#|%:)[ \t]*([A-Za-z_]\w*)?(.*)$", re.MULTILINE)
_SAFE_INCLUDE_RE = re.compile(r"[ \t]*<([A-Za-z0-9_][A-Za-z0-9_./+-]*)>[ \t]*\Z")


def check_cuda_source(source: str) -> str:
    """Refuse what would let the worker's compiler read files of the worker host (see the module's
    docstring); returns the source with comments stripped (``strip_comments``).

    Raises
    ------
    InvalidRequest
        Naming the line and what is not allowed.
    """
    if "??=" in source or "??/" in source:
        raise InvalidRequest("trigraphs are not allowed in module sources")
    if _RAW_STRING_RE.search(re.sub(r"\\\r?\n", "", source)):
        raise InvalidRequest("raw string literals (R\"...\") are not allowed in module sources")
    text = strip_comments(source)
    for m in _DIRECTIVE_RE.finditer(text):
        directive, rest = m.group(1) or "", m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if directive in ("include_next", "import", "embed"):
            raise InvalidRequest(f"line {line}: #{directive} is not allowed in module sources")
        if directive == "include":
            inc = _SAFE_INCLUDE_RE.match(rest)
            path = inc.group(1) if inc else ""
            if not inc or ".." in path.split("/"):
                raise InvalidRequest(
                    f"line {line}: only #include <relative/header.h> of system and CUDA headers is "
                    f"allowed (no quoted, absolute, '..' or computed include), got #include{rest}"
                )
        if directive == "pragma" and re.search(r"\bdependency\b", rest):
            raise InvalidRequest(f"line {line}: #pragma ... dependency is not allowed")
    if re.search(r"__has_include", text):
        raise InvalidRequest("__has_include is not allowed in module sources")
    if re.search(r"_Pragma\s*\([^)]*\bdependency\b", text):
        raise InvalidRequest("_Pragma(\"... dependency ...\") is not allowed in module sources")
    return text


def wrap_extern_c(source: str) -> str:
    """The source as pycuda's ``SourceModule`` compiles it by default: wrapped in ``extern "C"``
    so that kernels keep their plain names, unless the source declares ``extern "C"`` itself (then
    it chose its linkage, and templates or C++ headers may be in it)."""
    if re.search(r'\bextern\s*"C"', source):
        return source
    return 'extern "C" {\n#line 1 "kernel.cu"\n' + source + "\n}\n"


# --------------------------------------------------------------------------- signatures


_GLOBAL_RE = re.compile(
    r"\b__global__\b(?P<pre>[^;{}()]*(?:__launch_bounds__\s*\([^)]*\)[^;{}()]*)?)"
    r"\bvoid\b\s*(?:__launch_bounds__\s*\([^)]*\)\s*)?(?P<name>[A-Za-z_]\w*)\s*\((?P<params>[^)]*)\)"
)


def cuda_signatures(source: str) -> dict[str, Signature]:
    """The ``__global__`` kernels a CUDA C source declares, by name, with their parameters.

    ``source`` may hold comments (they are stripped). A kernel declared twice with different
    parameters (overloads, which need C++ linkage) is left out. Templates' parameters of a template
    type come out with ``accepts == ()``.
    """
    text = strip_comments(source)
    found: dict[str, Signature] = {}
    clash: set[str] = set()
    for m in _GLOBAL_RE.finditer(text):
        name = m.group("name")
        sig = tuple(_param(p) for p in _split_params(m.group("params")))
        if name in found and found[name] != sig:
            clash.add(name)
        found[name] = sig
    return {k: v for k, v in found.items() if k not in clash}


def _split_params(params: str) -> list[str]:
    items = [p.strip() for p in params.split(",")]
    if items == [""] or items == ["void"]:
        return []
    return items


def _param(decl: str) -> Param:
    decl = re.sub(r"\s+", " ", decl.split("=", 1)[0]).strip()  # a default argument goes
    pointer = "*" in decl or "[" in decl or "&" in decl
    words = [w for w in re.findall(r"[A-Za-z_]\w*", decl) if w not in _QUALIFIERS and w != "struct"]
    name = ""
    if len(words) > 1 and words[-1] not in _TYPE_WORDS:
        name = words.pop()
    elif pointer and words and re.search(r"[*\]]\s*[A-Za-z_]\w*\s*(\[[^\]]*\])?\s*$", decl):
        name = words.pop()
    ctype = decl[: decl.rfind(name)].strip() if name else decl
    if "&" in decl:
        return Param(name, ctype, ())  # a reference: no wire type is one
    if pointer:
        return Param(name, ctype, ("ptr",))
    tag = _SCALAR_TYPES.get(" ".join(words))
    return Param(name, ctype, (tag,) if tag else ())


_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$%][\w$%]*)\s*\(([^)]*)\)")
_PTX_PARAM_RE = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+([\w$%]+)(\s*\[\s*\d+\s*\])?")
_PTX_TYPES: dict[str, tuple[str, ...]] = {
    "f32": ("f32",), "f64": ("f64",),
    "s32": ("i32", "u32"), "u32": ("i32", "u32"), "b32": ("i32", "u32", "f32"),
    "s64": ("i64", "u64", "ptr"), "u64": ("ptr", "u64", "i64"), "b64": ("ptr", "u64", "i64", "f64"),
}


def ptx_signatures(ptx: str) -> dict[str, Signature]:
    """The ``.entry`` kernels of a PTX module with their parameters. PTX knows sizes, not C types:
    an 8-byte integer parameter accepts ``ptr``, ``u64`` or ``i64``; an array (a struct passed by
    value) accepts nothing."""
    out: dict[str, Signature] = {}
    for m in _ENTRY_RE.finditer(strip_comments(ptx)):
        params: list[Param] = []
        for decl in _split_params(m.group(2)):
            pm = _PTX_PARAM_RE.search(decl)
            if pm is None:
                params.append(Param("", decl, ()))
                continue
            kind, pname, array = pm.group(1), pm.group(2), pm.group(3)
            params.append(Param(pname, f".{kind}{array or ''}", () if array else _PTX_TYPES.get(kind, ())))
        out[m.group(1)] = tuple(params)
    return out


def describe(name: str, sig: Signature) -> str:
    """``name(type pname, ...)`` for messages."""
    return f"{name}(" + ", ".join(f"{p.ctype} {p.name}".strip() for p in sig) + ")"


def check_launch_args(module: str, name: str, sig: Signature | None, args: Sequence[tuple[str, Any]]) -> None:
    """Check a launch's typed arguments against the kernel's parameters, when they are known
    (``sig`` None: the module gave none, e.g. a cubin; the typed arguments are then passed as they
    are). Raises InvalidRequest naming the argument, the parameter and the types."""
    if sig is None:
        return
    where = f"kernel {describe(name, sig)} of module {module!r}"
    for i, p in enumerate(sig):
        if not p.accepts:
            raise InvalidRequest(
                f"{where}: parameter {i} ({p.ctype} {p.name}) has a type that launch arguments "
                f"cannot express (they are {', '.join(ARG_FORMATS)})"
            )
    if len(args) != len(sig):
        raise InvalidRequest(f"{where} takes {len(sig)} arguments, got {len(args)}")
    for i, ((tag, _), p) in enumerate(zip(args, sig, strict=True)):
        if tag not in p.accepts:
            want = " or ".join(p.accepts)
            raise InvalidRequest(
                f"{where}: argument {i} ({p.ctype} {p.name}) must be {want}, got {tag}".replace("  ", " ")
            )


def pack_format(args: Sequence[tuple[str, Any]]) -> str:
    """The struct format of a launch's argument buffer (native alignment, as CUDA lays kernel
    parameters out for these types)."""
    return "".join(ARG_FORMATS[tag] for tag, _ in args)


# --------------------------------------------------------------------------- the cache


def arch_of(cc: tuple[int, int]) -> str:
    """nvcc's ``-arch`` for a compute capability: ``(9, 0)`` -> ``sm_90``."""
    major, minor = cc
    if not (0 < major < 100 and 0 <= minor < 10):
        raise ValueError(f"bad compute capability {cc!r}")
    return f"sm_{major}{minor}"


def cache_key(kind: str, source: bytes, options: Sequence[str], cc: tuple[int, int], compiler: str) -> str:
    """sha256 (hex) of everything a compiled module depends on: its kind and source, the options,
    the GPU's architecture and the compiler's version text."""
    h = hashlib.sha256()
    for part in (b"gpud-module-v1", kind.encode(), arch_of(cc).encode(), compiler.encode(),
                 "\0".join(options).encode(), source):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """``$GPUD_MODULE_CACHE``, else ``$XDG_CACHE_HOME/gpud/modules`` (``~/.cache`` by default),
    else ``/var/cache/gpud/modules`` when running as root without a home."""
    env = os.environ.get("GPUD_MODULE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or (
        str(Path.home() / ".cache") if os.environ.get("HOME") else "/var/cache"
    )
    return Path(base) / "gpud" / "modules"


class ModuleCache:
    """Compiled modules on disk: ``ROOT/<key[:2]>/<key>.cubin`` (directories 0700, files 0600).

    Writes are atomic (a temporary file renamed into place), so workers sharing a directory and a
    crash mid-write leave either nothing or a whole file. Nothing is ever evicted: the directory
    may be emptied at any time.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError(f"bad cache key {key!r}")
        return self.root / key[:2] / f"{key}.cubin"

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except OSError:
            return None

    def put(self, key: str, data: bytes) -> Path:
        path = self.path(key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return path
