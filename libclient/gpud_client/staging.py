"""Staged job files (PROTOCOL.md §11): a job's large input files sent ahead of its REQUEST, and
its large output files read after its REPLY, both in chunks with a window of them unanswered.

Inputs (§11.1): an opening PUT that says the sizes (and gets TOO_LARGE or BUSY at once, before
any byte is sent), then the job's REQUEST (so that the job is placed, and its worker fetches each
chunk, while the rest still comes: pipelined), then the files in chunk PUTs, each answered once
the broker holds it durably.
The connection re-sends unanswered PUTs, same ids, after a failover; a broker that holds none of
the upload (it lost it) answers them INVALID_REQUEST, and the upload then resumes from what the
broker says it holds (``have``), at most ``RESUMES`` times.

Outputs (§11.5): a REPLY whose ``staged`` gives the sizes of its files is followed by FETCHes
of them from the broker's spool; a broker that does not hold them yet (it took over and is
fetching them from the worker again) is asked again, at most ``RESUMES`` times, ``RETRY_S`` apart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpud.errors import Busy, InvalidRequest, ProtocolError
from gpud.protocol import Command, Message, Peer, check_sizes, encode, id_text, new_id
from gpud.transfer import CHUNK_BYTES, WINDOW, pwrite_all
from gpud_client import _request
from gpud_client._request import JobResult
from gpud_client.chunks import plan, run_windowed
from gpud_client.connection import Connection, Pending

__all__ = ["RESUMES", "job_result", "stage"]

RESUMES = 3
"""Times an upload is opened again and resumed after a broker lost part of it, or a read of
outputs is tried again."""
RETRY_S = 0.5
"""Seconds between reads of outputs that the broker does not hold yet."""
BUSY_PAUSE_S = 0.05
"""Seconds to wait before resuming an upload whose chunk the broker's busy spool did not take."""


def stage(conn: Connection, job: bytes, views: Sequence[memoryview], tenant: str, timeout: float,
          request: Callable[[], None], chunk_bytes: int = CHUNK_BYTES, window: int = WINDOW) -> None:
    """Upload ``views`` as the staged inputs of job ``job``, calling ``request`` (which submits
    the job's REQUEST, id ``job``) once the upload is open. Each PUT is waited for at most
    ``timeout`` seconds. Returns early when the job is answered meanwhile (refused, or failed):
    its answer is the job's."""
    sizes = [v.nbytes for v in views]
    what = f"staging of job {id_text(job)}"
    resumes = 0
    requested = False
    busy_until = 0.0
    held = -1
    while True:
        have = _open(conn, job, sizes, tenant, timeout, what)
        if sum(have) > held:  # progress since the last BUSY: a fresh ``timeout`` for the next
            held, busy_until = sum(have), 0.0
        if not requested:
            request()
            requested = True
        items = [(i, start, n) for i, v in enumerate(views) for start, n in plan(v.nbytes, chunk_bytes)
                 if n and start + n > have[i]]
        try:
            run_windowed(items, window, lambda item: _put(conn, job, views, item, tenant, timeout, what),
                         lambda p: p.wait(), lambda p: p._abandon())
        except Busy:
            # The broker's spool disk is behind: the chunk was not taken (nor, then, the ones
            # after it). Resume from what it holds after a pause, for at most ``timeout`` in a row.
            if conn.has_reply(job):
                return
            now = time.monotonic()
            busy_until = busy_until or now + timeout
            if now > busy_until:
                raise
            time.sleep(BUSY_PAUSE_S)
            continue
        except InvalidRequest:
            if resumes == RESUMES or conn.has_reply(job):
                if conn.has_reply(job):
                    return  # the job ended (its upload with it): the REQUEST's answer says why
                raise
            resumes += 1
            continue  # the broker lost part of the upload (a failover): resume from what it holds
        return


def _open(conn: Connection, job: bytes, sizes: list[int], tenant: str, timeout: float, what: str) -> list[int]:
    rid = new_id()
    conn.submit(rid, encode(Peer.CLIENT, Command.PUT, {"id": rid, "job": job, "sizes": sizes, "tenant": tenant}), what)
    have = Pending(conn, rid, _have, timeout, what, cancellable=False).wait()
    if len(have) != len(sizes):
        raise ProtocolError(f"{what}: the broker's 'have' names {len(have)} files, not {len(sizes)}")
    return have


def _put(conn: Connection, job: bytes, views: Sequence[memoryview], item: tuple[int, int, int], tenant: str,
         timeout: float, what: str) -> Pending[None]:
    index, start, n = item
    rid = new_id()
    header = {"id": rid, "job": job, "file": index, "offset": start, "tenant": tenant}
    conn.submit(rid, encode(Peer.CLIENT, Command.PUT, header, [views[index][start : start + n]]), what)
    return Pending(conn, rid, _request.parse_empty, timeout, what, cancellable=False)


def _have(msg: Message) -> list[int]:
    header: dict[str, Any] = _request.check_reply(msg)
    have = header.get("have")
    if type(have) is not list or not all(type(n) is int and n >= 0 for n in have):
        raise ProtocolError("the opening PUT's reply needs 'have', a list of byte counts")
    return have


def job_result(conn: Connection, tenant: str, timeout: float, chunk_bytes: int = CHUNK_BYTES,
               window: int = WINDOW, outputs_to: Path | None = None,
               requested: Sequence[str] = ()) -> Callable[[Message], JobResult]:
    """The converter of a job's REPLY: its staged outputs, if any, are read from the broker first.
    ``outputs_to``: a directory the output files (of names in ``requested`` only) are written
    into, chunk by chunk, instead of the client's memory."""

    def convert(msg: Message) -> JobResult:
        header = _request.check_reply(msg)
        if "staged" not in header:
            if outputs_to is None:
                return _request.parse_job_result(msg)
            names = _names(header.get("files"), requested)
            result = _request.parse_job_result(msg)
            files = OutputFiles(outputs_to, names, [len(result.files[n]) for n in names])
            with files:
                for i, name in enumerate(names):
                    files.write(i, 0, memoryview(result.files[name]))
            return replace(result, files={}, paths=files.paths)
        try:
            sizes = check_sizes(header["staged"], "staged")
        except InvalidRequest as exc:
            raise ProtocolError(f"job reply: {exc.message}") from None
        job = header.get("id")
        if type(job) is not bytes or len(msg.frames) != 2:
            raise ProtocolError("a job reply with staged outputs carries its id, stdout and stderr")
        if outputs_to is None:
            out = [bytearray(n) for n in sizes]

            def into_memory(index: int, start: int, data: memoryview) -> None:
                out[index][start : start + len(data)] = data

            _read(conn, job, sizes, tenant, chunk_bytes, window, timeout, into_memory)
            return _request.parse_job_result(Message(msg.peer, msg.command, header, [*msg.frames, *out]))
        names = _names(header.get("files"), requested)
        if len(names) != len(sizes):
            raise ProtocolError("a job reply with staged outputs names as many files as it has sizes")
        files = OutputFiles(outputs_to, names, list(sizes))
        with files:
            _read(conn, job, sizes, tenant, chunk_bytes, window, timeout, files.write)
        result = _request.parse_job_result(Message(msg.peer, msg.command, {**header, "files": []}, list(msg.frames)))
        return replace(result, paths=files.paths)

    return convert


def _names(names: Any, requested: Sequence[str]) -> list[str]:
    """The reply's output names, each one the job asked for, once (never a path of the broker's choosing)."""
    asked = set(requested)
    if type(names) is not list or not all(type(n) is str and n in asked for n in names) or len(set(names)) != len(names):
        raise ProtocolError(f"the job reply names output files it did not ask for: {names!r}")
    return names


class NotWritten(InvalidRequest):
    """An output file could not be written into ``outputs_to``: the client's own disk is at
    fault, not the broker, so the read is not tried again."""


class OutputFiles:
    """Output files written into a directory as their bytes come: each first as
    ``.NAME.gpud-partial`` (created, never followed if it is a link, cut to its size), all renamed
    to ``NAME`` once every byte is written (the ``with`` block ended without an error), removed
    otherwise: a read that fails leaves no file that looks whole."""

    def __init__(self, directory: Path, names: list[str], sizes: list[int]) -> None:
        self.paths = {n: directory / n for n in names}
        self._partial = [directory / f".{n}.gpud-partial" for n in names]
        self._fds: list[int] = []
        try:
            for path, size in zip(self._partial, sizes, strict=True):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
                self._fds.append(fd)
                os.ftruncate(fd, size)
        except OSError as exc:
            self._close(remove=True)
            raise NotWritten(f"outputs_to: cannot write {exc.filename}: {exc.strerror}") from None

    def write(self, index: int, start: int, data: memoryview) -> None:
        try:
            pwrite_all(self._fds[index], data, start)
        except OSError as exc:
            raise NotWritten(f"outputs_to: cannot write {self._partial[index]}: {exc.strerror}") from None

    def _close(self, remove: bool) -> None:
        for fd in self._fds:
            os.close(fd)
        if remove:  # the ones this created, not whatever else bears such a name
            for path in self._partial[: len(self._fds)]:
                path.unlink(missing_ok=True)
        self._fds = []

    def __enter__(self) -> OutputFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._close(remove=kind is not None)
        if kind is None:
            for partial, path in zip(self._partial, self.paths.values(), strict=True):
                os.replace(partial, path)


def _read(conn: Connection, job: bytes, sizes: Sequence[int], tenant: str, chunk_bytes: int, window: int,
          timeout: float, write: Callable[[int, int, memoryview], None]) -> None:
    """Read a job's staged outputs of ``sizes`` from the broker, ``write``-ing each chunk (file
    index, offset, bytes) as it comes."""
    what = f"outputs of job {id_text(job)}"
    done = [0] * len(sizes)
    for attempt in range(RESUMES + 1):
        items = [(i, start, n) for i, size in enumerate(sizes) for start, n in plan(size, chunk_bytes)
                 if n and start >= done[i]]

        def submit(item: tuple[int, int, int]) -> tuple[tuple[int, int, int], Pending[Any]]:
            index, start, n = item
            rid = new_id()
            header = {"id": rid, "job": job, "file": index, "offset": start, "nbytes": n, "tenant": tenant}
            conn.submit(rid, encode(Peer.CLIENT, Command.FETCH, header), what, expect=n)
            return item, Pending(conn, rid, _frame, timeout, what, cancellable=False)

        def collect(entry: tuple[tuple[int, int, int], Pending[Any]]) -> None:
            (index, start, n), pending = entry
            data = pending.wait()
            if len(data) != n:
                raise ProtocolError(f"{what}: {len(data)} bytes came for {n} asked")
            write(index, start, data)
            done[index] = start + n

        try:
            run_windowed(items, window, submit, collect, lambda entry: entry[1]._abandon())
        except InvalidRequest as exc:
            if attempt == RESUMES or isinstance(exc, NotWritten):
                raise
            time.sleep(RETRY_S)  # a broker that took over fetches them from the worker again
            continue
        return
    raise InvalidRequest(f"{what}: not read")  # unreachable: the loop returns or raises


def _frame(msg: Message) -> memoryview:
    _request.check_reply(msg)
    if len(msg.frames) != 1:
        raise ProtocolError("a FETCH's reply carries one frame")
    frame = msg.frames[0]
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
