"""Staged job inputs on the broker (PROTOCOL.md §11): the PUT dialog with clients, the FETCH
dialog with workers, and the life of each upload in the spool from its opening PUT to the end of
its job. Pure: no sockets; the core's send functions and journal carry everything out.

A PUT's REPLY goes out only once what it stored is durable (held by the passive peer, as ACKs
wait, §9.4): the client's window of unanswered PUTs then bounds how far the active broker's intake
runs ahead of its peer.

Upload and fetch are pipelined: a job may be claimed and placed while its upload still comes, and
a worker's FETCH of bytes not here yet waits on the upload until a PUT brings them.
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from gpud import protocol
from gpud.errors import (
    Busy,
    GpudError,
    InternalError,
    InvalidRequest,
    ProtocolError,
    TooLarge,
    WorkerLost,
)
from gpud.protocol import Command, Message, Peer
from gpud.transfer import ChunkWindow
from gpud_broker.spool import DEFAULT_STAGE_IDLE_S, Spool, Upload
from gpud_broker.tasks import State

if TYPE_CHECKING:
    from gpud_broker.core import BrokerCore
    from gpud_broker.registry import WorkerRecord
    from gpud_broker.tasks import Task

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 16 << 20  # the largest chunk a PUT may carry, and a FETCH ask for
BACKFILL_PER_TURN = 4  # chunks journalled per loop turn to a peer that re-synced
REPLY_BACKLOG_BYTES = 16 << 20  # past this many bytes queued for the spool's disk, PUT REPLYs wait for it
MAX_BACKLOG_BYTES = 64 << 20  # past this many, a chunk PUT for a file on disk is answered BUSY (not taken)
MAX_BACKLOG_WRITES = 4096  # and past this many writes queued (tiny chunks), likewise
LEAD_BYTES = 32 << 20  # a placed job's upload runs at most this far ahead of its worker's FETCHes (REPLYs wait)
MAX_WAITING = 8  # FETCHes of bytes not here yet kept per upload (a worker asks 4 at once); more are ignored
OUTPUTS = b"\x01"  # a job's id and this: the spool key of its staged outputs (§11.5)
PULL_AGAIN_S = 2.0  # a FETCH of outputs unanswered this long is sent again


class Pull:
    """A job's staged outputs being fetched from its worker, and the REPLY that waits for them."""

    __slots__ = ("task", "worker", "identity", "raw_header", "frames", "window", "upload", "unsettled", "held_back")

    def __init__(self, task: Task, worker: WorkerRecord, raw_header: bytes, frames: list[Any], window: ChunkWindow,
                 upload: Upload) -> None:
        self.task = task
        self.worker = worker.name
        self.identity = worker.identity
        self.raw_header = raw_header
        self.frames = frames
        self.window = window
        self.upload = upload
        self.unsettled: deque[int] = deque()  # journal seqs of chunks taken, not yet durable at the peer
        self.held_back = False  # nothing more asked for: the spool's disk queue was too long


def spool_fault(message: str, exc: OSError) -> GpudError:
    """What a job gets when the spool failed it (PROTOCOL.md §11.1): the broker's fault, never the
    request's. BUSY where the disk is full (it may have room later: try again), INTERNAL for any
    other disk error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Busy(f"{message}; the broker's spool disk is full, try again later")
    return InternalError(message)


class Staging:
    """The uploads of one broker and the PUT REPLYs waiting for durability."""

    def __init__(self, spool: Spool, max_input_bytes: int, stage_ttl: float,
                 stage_idle: float = DEFAULT_STAGE_IDLE_S) -> None:
        self.pulls: dict[bytes, Pull] = {}  # by job id
        self.spool = spool
        self.max_input_bytes = max_input_bytes
        self.stage_ttl = stage_ttl
        self.stage_idle = stage_idle
        self.lead_bytes = LEAD_BYTES
        # Staged jobs taken off their worker because their upload left it waiting (``expire``),
        # by id: out of the queue until the upload is complete, then placed again.
        self.parked: dict[bytes, Task] = {}
        # PUT REPLYs until their chunk is durable: (journal seq, spool write ticket, route, REPLY)
        self.waiting: deque[tuple[int, int, bytes, list[Any]]] = deque()
        self._backfill: deque[tuple[bytes, int, int, int]] = deque()  # (job, file, offset, nbytes) to journal again
        self._backfill_seq = 0  # the update that ended the last backfill: no PUT is answered before it is durable
        # Passive: uploads whose bytes its spool could not write (their later chunks are ignored),
        # named in its STATEs until an update drops them (PROTOCOL.md §11.4).
        self.unheld: set[bytes] = set()
        # Active: the passive peer's spool room, its last STATE's (None: not heard, or gone).
        self.peer_room: int | None = None

    # ------------------------------------------------------------------ clients: PUT

    def on_put(self, core: BrokerCore, identity: bytes, msg: Message, tenant: str | None, owner: str | None) -> None:
        rid = protocol.get_id(msg.header)
        try:
            put = protocol.parse_put(msg.header, len(msg.frames))
            who = tenant if tenant is not None else protocol.opt(msg.header, "tenant", str, "default")
            if put.sizes is not None:
                extra = self._open(core, put.job, put.sizes, who, owner)
            else:
                self._chunk(core, put.job, put.file, put.offset, msg.frames[0], who, owner)
                extra = {}
        except GpudError as exc:
            core.counters["errors"] += 1
            log.info("refused PUT %s of %s: %s %s", protocol.id_text(rid), protocol.id_text(msg.header.get("job", b"")),
                     exc.code, exc.message)
            core.send_client(identity, protocol.error_reply(rid, exc))
            return
        reply = protocol.encode(Peer.CLIENT, Command.REPLY, {"id": rid, "ok": True, **extra})
        io = self.spool.io
        # A chunk queued for the disk is as durable as one in the page cache (a broker that
        # restarts removes its spool files; the passive peer is what a failover keeps): its
        # REPLY waits for the write only while the queue is long, so that it stays short.
        ticket = io.issued if io.backlog > REPLY_BACKLOG_BYTES else 0
        seq = core.journal.seq if core.acking else 0
        up = self.spool.uploads.get(put.job) if put.sizes is None else None
        if up is not None and self._ahead(core, up):  # its worker lags: the client waits for it
            up.held.append((seq, ticket, identity, reply))
        else:
            self._reply_when_durable(core, seq, ticket, identity, reply)

    def _reply_when_durable(self, core: BrokerCore, seq: int, ticket: int, identity: bytes, reply: list[Any]) -> None:
        if core.acking or ticket > self.spool.io.done:  # not at the peer, or the disk is behind
            self.waiting.append((seq if core.acking else 0, ticket, identity, reply))
        else:
            core.send_client(identity, reply)

    def _ahead(self, core: BrokerCore, up: Upload) -> bool:
        """Whether ``up`` runs more than ``lead_bytes`` ahead of the worker its job is placed on
        (PROTOCOL.md §11.1): its PUT REPLYs are then held."""
        if not up.claimed:
            return False
        task = core.tasks.tasks.get(up.job)
        if task is None or task.state is not State.RUNNING or task.worker is None or task.started:
            return False  # not on a worker (queued again, parked, ended), or every byte is there
        fetched = up.fetched if up.fetcher == task.worker else 0
        return sum(up.have) - fetched > self.lead_bytes

    def _let_held_go(self, core: BrokerCore, up: Upload) -> None:
        """The PUT REPLYs held for ``up``'s worker go on (to wait for durability) once it no
        longer lags, or is no longer the job's."""
        if up.held and not self._ahead(core, up):
            held, up.held = up.held, []
            for seq, ticket, identity, reply in held:
                self._reply_when_durable(core, seq, ticket, identity, reply)

    def _open(self, core: BrokerCore, job: bytes, sizes: tuple[int, ...], tenant: str, owner: str | None) -> dict[str, Any]:
        total = sum(sizes)
        if total > self.max_input_bytes:
            raise TooLarge(f"the job's input files are {total} bytes, over the broker's max_job_input_bytes "
                           f"({self.max_input_bytes})")
        up = self.spool.uploads.get(job)
        task = core.tasks.tasks.get(job)
        if (up is not None and (up.tenant != tenant or up.owner != owner)) or (
                task is not None and (task.tenant != tenant or task.owner != owner)):
            raise InvalidRequest("this job id is already in use; stage under a fresh random id")
        if up is not None:
            if up.sizes != sizes:
                raise InvalidRequest("this job id is staged already with other file sizes")
            return {"have": list(up.have)}
        if task is not None:  # its REQUEST came already (a retry after a failover): nothing more is needed
            return {"have": list(sizes)}
        why = core.accounts.over_spool(tenant, total) or self.spool.no_room(sizes, self.peer_room)
        if why is not None:
            raise Busy(why)
        try:
            self._new(core, job, tenant, owner, sizes)
        except OSError as exc:
            log.error("spool: cannot stage an upload: %s", exc)
            raise Busy(f"the broker cannot spool the upload now ({exc.strerror}); try later") from None
        return {"have": [0] * len(sizes)}

    def _new(self, core: BrokerCore, job: bytes, tenant: str, owner: str | None, sizes: tuple[int, ...]) -> Upload:
        if not core.active:  # a passive broker takes what its peer took; its kept files go if that needs their room
            self.spool.make_room(sizes)
        up = self.spool.open(job, tenant, owner, sizes, core.now)
        core.accounts.reserve_spool(tenant, up.total)
        core.journal.stage(job, tenant, owner, sizes)
        return up

    def _chunk(self, core: BrokerCore, job: bytes, index: int, offset: int, frame: Any, tenant: str,
               owner: str | None) -> None:
        up = self.spool.uploads.get(job)
        if up is None or up.tenant != tenant or up.owner != owner:
            task = core.tasks.tasks.get(job)
            if task is not None and task.tenant == tenant and task.owner == owner:
                return  # its REQUEST came already: a late re-send
            raise InvalidRequest("no upload of this job id is open here (send the opening PUT again)")
        data = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        if len(data) > MAX_CHUNK_BYTES:
            raise TooLarge(f"a chunk carries at most {MAX_CHUNK_BYTES} bytes")
        io = self.spool.io
        if (io.backlog > MAX_BACKLOG_BYTES or io.issued - io.done > MAX_BACKLOG_WRITES) and up.stores[index].on_disk:
            # The disk is behind the intake: this chunk is not taken (the loop never waits for
            # the disk, and the queue of writes stays bounded); the client resumes after a pause.
            raise Busy("the broker's spool is writing what came before; open the upload again shortly and "
                       "resume from what it holds")
        if self.spool.write(up, index, offset, data, core.now):
            if not up.peer_lacks:
                core.journal.chunk(job, index, offset, data)
            if up.waiting:
                self._serve_waiting(core, up, index, offset, frame, len(data))
            if self.parked and job in self.parked and up.complete():
                log.info("staged upload of %s complete: its job is placed again", protocol.id_text(job))
                core.unpark_staged(self.parked.pop(job))

    def _serve_waiting(self, core: BrokerCore, up: Upload, index: int, offset: int, frame: Any, nbytes: int) -> None:
        """Answer the FETCHes that waited for bytes a PUT just brought: with the PUT's own frame
        when they ask for exactly its range, else from the spool. Those of a worker the job is no
        longer placed on (lost, parked, placed elsewhere, ended) are dropped unanswered: its bytes
        go to no worker but the job's (PROTOCOL.md §11.3)."""
        still = []
        served = False
        for ask in up.waiting:
            identity, name, i, start, n = ask
            if self._placed_on(core, up.job, name) is None:
                continue
            if start + n > up.have[i]:
                still.append(ask)
                continue
            served = True
            if (i, start, n) == (index, offset, nbytes):
                self.spool.mark_read(up, i, start)  # its memory copy is let go once on disk
                self._send_chunk(core, identity, up.job, i, start, frame)
            else:
                self._answer_fetch(core, identity, up, i, start, n, name)
        if served or not still:  # bytes came for the worker (it is not starved), or none waits
            up.starved = core.now if still else 0.0
        up.waiting = still

    @staticmethod
    def _placed_on(core: BrokerCore, job: bytes, name: str) -> Task | None:
        """The task of staged job ``job`` while it runs on worker ``name`` (registered), else None."""
        task = core.tasks.tasks.get(job)
        if task is None or task.state is not State.RUNNING or task.worker != name or name not in core.registry.by_name:
            return None
        return task

    def _answer_fetch(self, core: BrokerCore, identity: bytes, up: Upload, index: int, offset: int, nbytes: int,
                      name: str) -> None:
        """CHUNK, to ``identity`` (the connection the FETCH came on), with the bytes a worker's
        FETCH asks for, which the spool holds: now when they are in memory, else once the
        spool's disk thread has read them (never waiting for it), while the job is still on
        worker ``name``."""
        job = up.job

        def deliver(got: bytes | OSError) -> None:
            task = self._placed_on(core, job, name)
            if self.spool.uploads.get(job) is not up or task is None:
                return  # it ended, or was placed elsewhere, meanwhile
            if isinstance(got, OSError):
                self._read_failed(core, task, got)
            else:
                self._send_chunk(core, identity, job, index, offset, got)

        data = self.spool.read_soon(up, index, offset, nbytes, deliver)
        if data is not None:
            self._send_chunk(core, identity, job, index, offset, data)

    def _read_failed(self, core: BrokerCore, task: Task, exc: OSError) -> None:
        log.error("spool: cannot read a staged file of %s: %s", protocol.id_text(task.id), exc)
        core.abort_staged(task, spool_fault(f"the broker lost the job's staged inputs ({exc.strerror})", exc))

    @staticmethod
    def _send_chunk(core: BrokerCore, identity: bytes, job: bytes, index: int, offset: int, data: Any) -> None:
        core.send_worker(identity, protocol.encode(
            Peer.WORKER, Command.CHUNK, {"id": job, "file": index, "offset": offset}, [data]))

    def after_io(self, core: BrokerCore) -> None:
        """(Once the spool's disk thread signalled) Reads done go out; failed writes fail their uploads."""
        self.spool.take_reads()
        if self.spool.io.failed:
            self.write_failures(core)

    def take_replies(self, durable: int) -> list[tuple[bytes, list[Any]]]:
        """The PUT REPLYs whose chunks are durable now, at the peer and on disk (route, frames),
        in order."""
        waiting = self.waiting
        out: list[tuple[bytes, list[Any]]] = []
        if self._backfill or durable < self._backfill_seq:
            return out  # earlier chunks of the same uploads are not at the peer yet
        written = self.spool.io.done
        while waiting and waiting[0][0] <= durable and waiting[0][1] <= written:
            _, _, route, reply = waiting.popleft()
            out.append((route, reply))
        return out

    def write_failures(self, core: BrokerCore) -> None:
        """Uploads a spool write failed for (the disk is full?): dropped, their jobs failed. A
        passive broker lets go of their bytes and names them in its STATEs instead: its active
        peer drops them (PROTOCOL.md §11.4)."""
        failed = self.spool.io.failed
        while failed:
            job, exc = failed.pop()
            up = self.spool.uploads.get(job)
            if up is None:
                continue
            if not core.active:
                log.error("spool: cannot hold the staged bytes of %s the active broker sent (%s): it is told so",
                          protocol.id_text(job), exc.strerror)
                self.release(core, job)  # its bytes and its budget
                self.unheld.add(job)
            else:
                self._lost(core, up, f"the broker could not spool them ({exc.strerror})", exc)

    def peer_unheld(self, core: BrokerCore, jobs: Any) -> None:
        """(Active) The passive peer's STATE says it could not hold the bytes of ``jobs``: those
        uploads go on without it (no more of their chunks journalled); a failover before their
        job begins fails it (``lost_in_takeover``), PROTOCOL.md §11.4."""
        if type(jobs) is not list:
            return
        for job in jobs:
            up = self.spool.uploads.get(job) if type(job) is bytes else None
            if up is not None and not up.peer_lacks:
                up.peer_lacks = True
                log.error("spool: the passive peer cannot hold the staged bytes of %s (see its log): they go on "
                          "without it, and a failover before the job is done loses them", protocol.id_text(job))

    def lost_in_takeover(self, core: BrokerCore) -> None:
        """(A broker that has just taken over) Fail the staged jobs not begun whose upload it does
        not hold: it could not hold their bytes as the passive peer (§11.4); the job's retry
        stages them again."""
        for task in list(core.tasks.tasks.values()):
            if (task.state is not State.DONE and not task.started and type(task.body) is dict
                    and "staged" in task.body and task.id not in self.spool.uploads):
                core.abort_staged(task, Busy("the job's staged inputs were lost in a broker failover (the standby "
                                             "broker could not hold them); try again"))

    def _lost(self, core: BrokerCore, up: Upload, why: str, exc: OSError) -> None:
        job = up.job[: len(up.job) - len(OUTPUTS)] if up.job.endswith(OUTPUTS) and len(up.job) == 17 else up.job
        if job != up.job:  # outputs being pulled: the job ran
            pull = self.pulls.pop(job, None)
            if pull is not None:
                core.outputs_lost(pull.task, Busy(f"the job ran, but its outputs were lost: {why}"), pull.identity)
        else:
            task = core.tasks.tasks.get(job)
            if up.claimed and task is not None and not task.started:
                core.abort_staged(task, spool_fault(f"the job's staged inputs were lost: {why}", exc))
        self.release(core, up.job)
        core.journal.unstage(up.job)

    # ------------------------------------------------------------------ jobs: claim and release

    def check(self, job: bytes, tenant: str, owner: str | None, sizes: tuple[int, ...]) -> None:
        """A job REQUEST names staged inputs of ``sizes``: an upload of them must be open here,
        by the same tenant and key (its bytes may still be coming). InvalidRequest otherwise."""
        up = self.spool.uploads.get(job)
        if up is None or up.tenant != tenant or up.owner != owner:
            raise InvalidRequest("the job's staged inputs are not here: open their upload first (PUT)")
        if up.sizes != sizes:
            raise InvalidRequest("'staged' does not match the sizes of the upload")

    def holds_inputs(self, task: Task) -> bool:
        """Whether ``task`` is a staged job whose upload is here (complete or still coming)."""
        return "staged" in task.body and task.id in self.spool.uploads

    def claim(self, job: bytes) -> None:
        """The job's task holds its upload now: released with it, never expired."""
        up = self.spool.uploads.get(job)
        if up is not None:
            up.claimed = True

    def release(self, core: BrokerCore, job: bytes) -> None:
        """Drop an upload (its job ended, or it expired) and free its budget."""
        self.parked.pop(job, None)
        self.unheld.discard(job)
        up = self.spool.drop(job)
        if up is not None:
            core.accounts.release_spool(up.tenant, up.total)
            for seq, ticket, identity, reply in up.held:  # the chunks were taken: their client is answered
                self._reply_when_durable(core, seq, ticket, identity, reply)
            up.held = []

    def expire(self, core: BrokerCore, now: float) -> None:
        """Drop uploads unclaimed for ``stage_ttl``; fail the jobs whose upload stalled."""
        for up in self.spool.expired(now, self.stage_ttl):
            log.info("staged upload of %s unclaimed for %.0fs: dropped", protocol.id_text(up.job), self.stage_ttl)
            self.release(core, up.job)
            core.journal.unstage(up.job)
        for up in self.spool.stalled(now, self.stage_ttl):
            task = core.tasks.tasks.get(up.job)
            if task is None or up.job in self.pulls:  # outputs being pulled: PULL_AGAIN_S asks again
                continue
            if up.held and self._ahead(core, up):  # its PUTs wait for its worker (LEAD_BYTES), not for its client
                up.touched = now
                continue
            if task.started:  # its worker had every byte (from a broker that held them): it runs
                up.touched = now
                continue
            log.info("staged upload of %s stalled for %.0fs (%s): its job fails", protocol.id_text(up.job),
                     self.stage_ttl, up.missing())
            core.abort_staged(task, InvalidRequest(f"its staged inputs stopped coming ({up.missing()}, nothing "
                                                   f"for {self.stage_ttl:.0f}s)"))
        self._park_starved(core, now)
        for up in list(self.spool.uploads.values()):
            if up.held:  # the job left its worker meanwhile (lost, parked, ended)
                self._let_held_go(core, up)

    def _park_starved(self, core: BrokerCore, now: float) -> None:
        """Take off its worker a staged job whose upload has left the worker waiting for bytes
        for ``stage_idle`` (a slow or stalled upload must not hold a GPU slot): its slot is
        freed, and it is placed again once its upload is complete."""
        limit = now - self.stage_idle
        for up in list(self.spool.uploads.values()):
            if not up.waiting or up.starved > limit or not up.claimed:
                continue
            live = [ask for ask in up.waiting if self._placed_on(core, up.job, ask[1]) is not None]
            if not live:  # they waited on a worker the job has left (lost, placed elsewhere): dropped
                up.waiting, up.starved = live, 0.0
                continue
            task = core.tasks.tasks.get(up.job)
            if task is None or task.started or task.worker is None or up.job in self.pulls:
                continue
            log.info("staged upload of %s left worker %s waiting for %.0fs (%s): the job waits for it off the "
                     "worker", protocol.id_text(up.job), task.worker, self.stage_idle, up.missing())
            up.waiting.clear()
            up.starved = 0.0
            self.parked[up.job] = task
            core.park_staged(task, Busy(f"its staged upload is too slow (nothing for {self.stage_idle:.0f}s): "
                                        "the job is placed again once it is complete"))

    def clear(self, core: BrokerCore) -> None:
        self.pulls.clear()
        self.parked.clear()
        for job in list(self.spool.uploads):
            self.release(core, job)
        self.waiting.clear()
        self._backfill.clear()
        self._backfill_seq = 0
        self.unheld.clear()

    # ------------------------------------------------------------------ workers: FETCH

    def on_fetch(self, core: BrokerCore, worker: WorkerRecord, header: dict[str, Any], identity: bytes | None = None) -> None:
        """A FETCH of ``worker``'s, on its data connection ``identity`` (None: on its control
        connection), answered on the connection it came on (PROTOCOL.md §11.3)."""
        to = worker.identity if identity is None else identity
        rid = protocol.get_id(header)
        try:
            index = protocol.req(header, "file", int)
            offset = protocol.req(header, "offset", int)
            nbytes = protocol.req(header, "nbytes", int)
            if not 0 < nbytes <= MAX_CHUNK_BYTES:
                raise InvalidRequest(f"a FETCH asks for 1..{MAX_CHUNK_BYTES} bytes")
            up = self.spool.uploads.get(rid)
            if self._placed_on(core, rid, worker.name) is None or up is None or not up.claimed:
                raise InvalidRequest("no staged job of this id runs on this worker")
            nbytes = min(nbytes, max(0, up.sizes[index] - offset))
            reach = sum(up.sizes[:index]) + offset + nbytes  # how far, over the files in order, it has asked
            if up.fetcher != worker.name:  # placed on another worker: what the one it left asked is dropped
                up.fetcher, up.fetched = worker.name, 0
                up.waiting = [ask for ask in up.waiting if ask[1] == worker.name]
            if reach > up.fetched:
                up.fetched = reach
                if up.held:
                    self._let_held_go(core, up)
            if offset >= 0 and offset + nbytes > up.have[index]:  # still coming: answered when it is here
                ask = (to, worker.name, index, offset, nbytes)
                if ask not in up.waiting and len(up.waiting) < MAX_WAITING:
                    if not up.waiting:
                        up.starved = core.now
                    up.waiting.append(ask)
                return
            self._answer_fetch(core, to, up, index, offset, nbytes, worker.name)
        except (GpudError, IndexError) as exc:
            err = exc if isinstance(exc, GpudError) else InvalidRequest("no such staged file")
            core.send_worker(to, protocol.encode(Peer.WORKER, Command.ERROR,
                                                              {"code": err.code, "message": err.message, "id": rid}))

    # ------------------------------------------------------------------ outputs: pulled from workers, read by clients

    def pull(self, core: BrokerCore, worker: WorkerRecord, task: Task, raw_header: bytes, frames: list[Any],
             staged: Any) -> bool:
        """A job's RESULT says its outputs are staged on its worker: fetch them into the spool,
        then answer the client (``core.outputs_here``). False when that cannot be (the task is
        failed, with the reason)."""
        try:
            sizes = protocol.check_sizes(staged, "staged")
            key = task.id + OUTPUTS
            up = self.spool.uploads.get(key)
            if up is None:
                why = core.accounts.over_spool(task.tenant, sum(sizes)) or self.spool.no_room(sizes, self.peer_room)
                if why is not None:
                    raise Busy(f"the job ran, but the broker has no room for its outputs: {why}")
                up = self._new(core, key, task.tenant, task.owner, sizes)
            elif up.sizes != sizes:
                raise InvalidRequest("the job's outputs are staged already with other sizes")
        except GpudError as exc:
            core.fail(task, exc)
            return False
        except OSError as exc:
            core.fail(task, Busy(f"the job ran, but the broker cannot spool its outputs ({exc.strerror})"))
            return False
        up.claimed = True
        window = ChunkWindow(sizes)
        for index, have in enumerate(up.have):  # what a replica holds already (a failover)
            if have == sizes[index]:
                window.sizes[index] = 0
        pull = self.pulls[task.id] = Pull(task, worker, raw_header, frames, window, up)
        self._pull_more(core, pull)
        return True

    def _pull_more(self, core: BrokerCore, pull: Pull) -> None:
        if pull.window.done() and not pull.unsettled and self.spool.written(pull.upload):
            del self.pulls[pull.task.id]
            pull.upload.claimed = False  # from now on it expires stage_ttl after its last read
            pull.upload.touched = core.now
            core.outputs_here(pull.task, protocol.reply(pull.raw_header, pull.frames), pull.identity)
            return
        if self.spool.io.backlog > REPLY_BACKLOG_BYTES:
            pull.held_back = True  # the spool's disk is behind: asked for once it caught up (settle_pulls)
            return
        pull.held_back = False
        for ask in pull.window.asks(core.now, len(pull.unsettled)):
            self._ask(core, pull, ask)

    def _ask(self, core: BrokerCore, pull: Pull, ask: tuple[int, int, int]) -> None:
        index, offset, nbytes = ask
        core.send_worker(pull.identity, protocol.encode(Peer.WORKER, Command.FETCH, {
            "id": pull.task.id, "file": index, "offset": offset, "nbytes": nbytes, "data": True}))

    def on_output_chunk(self, core: BrokerCore, worker: WorkerRecord, msg: Message) -> None:
        rid = protocol.get_id(msg.header)
        pull = self.pulls.get(rid)
        if pull is None or pull.worker != worker.name or len(msg.frames) != 1:
            return  # a late or repeated chunk
        frame = msg.frames[0]
        data = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        index, offset = msg.header.get("file"), msg.header.get("offset")
        if not pull.window.expects(index, offset, len(data)):
            return
        assert type(index) is int and type(offset) is int  # expects() checked
        try:
            wrote = self.spool.write(pull.upload, index, offset, data, core.now, ordered=False)
        except (GpudError, OSError) as exc:
            del self.pulls[rid]
            core.outputs_lost(pull.task, Busy(f"the job ran, but the broker could not spool its outputs: {exc}"),
                              pull.identity)
            return
        if wrote:
            if not pull.upload.peer_lacks:
                core.journal.chunk(pull.upload.job, index, offset, data)
            if core.acking:  # the next chunk is asked for once this one is durable (settle_pulls)
                pull.unsettled.append(core.journal.seq)
        pull.window.took(index, offset)
        self._pull_more(core, pull)

    def settle_pulls(self, core: BrokerCore, durable: int) -> None:
        """Once per loop turn: chunks durable at the peer free their place in their pull's window,
        so that the broker never takes in outputs faster than its peer does, nor faster than its
        spool's disk (past REPLY_BACKLOG_BYTES queued for it, nothing more is asked for)."""
        for pull in list(self.pulls.values()):
            if pull.unsettled and pull.unsettled[0] <= durable:
                while pull.unsettled and pull.unsettled[0] <= durable:
                    pull.unsettled.popleft()
                self._pull_more(core, pull)
            elif (pull.window.done() and not pull.unsettled) or pull.held_back:  # waited for the disk
                self._pull_more(core, pull)

    def pull_again(self, core: BrokerCore) -> None:
        """Ask again for outputs unanswered for PULL_AGAIN_S (once per tick)."""
        for pull in list(self.pulls.values()):
            for ask in pull.window.again(core.now, core.now - PULL_AGAIN_S):
                self._ask(core, pull, ask)

    def worker_lost(self, core: BrokerCore, name: str) -> None:
        """The worker of some pulls is gone: their jobs ran, and their outputs are lost with it."""
        for rid, pull in list(self.pulls.items()):
            if pull.worker == name:
                del self.pulls[rid]
                self.release(core, pull.upload.job)
                core.journal.unstage(pull.upload.job)
                core.fail(pull.task, WorkerLost(f"worker {name} was lost before the job's outputs were fetched"))

    def on_client_fetch(self, core: BrokerCore, identity: bytes, msg: Message, tenant: str | None,
                        owner: str | None) -> None:
        header = msg.header
        rid = protocol.get_id(header)
        try:
            job = protocol.get_id(header, "job")
            index = protocol.req(header, "file", int)
            offset = protocol.req(header, "offset", int)
            nbytes = protocol.req(header, "nbytes", int)
            if not 0 < nbytes <= MAX_CHUNK_BYTES:
                raise InvalidRequest(f"a FETCH asks for 1..{MAX_CHUNK_BYTES} bytes")
            who = tenant if tenant is not None else protocol.opt(header, "tenant", str, "default")
            up = self.spool.uploads.get(job + OUTPUTS)
            if up is None or up.tenant != who or up.owner != owner:
                raise InvalidRequest("no staged outputs of this job are here (they expire stage_ttl after their "
                                     "last read)")
            if not 0 <= index < len(up.sizes):
                raise InvalidRequest(f"the job has {len(up.sizes)} staged outputs")
            up.touched = core.now

            def deliver(got: bytes | OSError) -> None:
                if isinstance(got, OSError):
                    log.error("spool: cannot read the staged outputs of %s: %s", protocol.id_text(job), got)
                    core.send_client(identity, protocol.error_reply(rid, InvalidRequest(
                        f"the broker lost the job's staged outputs ({got.strerror})")))
                else:
                    core.send_client(identity, protocol.encode(Peer.CLIENT, Command.REPLY, {"id": rid, "ok": True}, [got]))

            data = self.spool.read_soon(up, index, offset, min(nbytes, max(0, up.sizes[index] - offset)), deliver)
        except GpudError as exc:
            core.send_client(identity, protocol.error_reply(rid, exc))
            return
        if data is not None:
            deliver(data)

    # ------------------------------------------------------------------ the pair

    def to_wire(self) -> list[list[Any]]:
        """The uploads for a snapshot, without their bytes (journalled afterwards, ``backfill``)."""
        out = []
        self._backfill.clear()
        for up in self.spool.uploads.values():
            if up.peer_lacks:  # it could not hold them before: it does without them
                continue
            out.append([up.job, up.tenant, up.owner, list(up.sizes), up.claimed])
            for index, offset, nbytes in self.spool.ranges(up, MAX_CHUNK_BYTES // 2):
                self._backfill.append((up.job, index, offset, nbytes))
        return out

    def backfill(self, core: BrokerCore) -> None:
        """Journal a few of the chunks a snapshot left out (called once per loop turn)."""
        for _ in range(min(BACKFILL_PER_TURN, len(self._backfill))):
            job, index, offset, nbytes = self._backfill.popleft()
            up = self.spool.uploads.get(job)
            if up is not None and not self.spool.written(up):  # read it once on disk: the loop never waits for it
                self._backfill.appendleft((job, index, offset, nbytes))
                break
            if up is not None and offset + nbytes <= up.have[index]:
                core.journal.chunk(job, index, offset, memoryview(self.spool.read(up, index, offset, nbytes)))
        if not self._backfill:
            self._backfill_seq = core.journal.seq

    def new_stream(self) -> None:
        """The journal starts again from 1 (a takeover): nothing journalled before counts."""
        self._backfill.clear()
        self._backfill_seq = 0

    @property
    def backfilling(self) -> bool:
        return bool(self._backfill)

    def load(self, core: BrokerCore, raw: Any) -> None:
        """A snapshot's uploads (passive): opened empty; their bytes come as ``chunk`` updates."""
        if type(raw) is not list:
            raise ProtocolError("a snapshot's 'uploads' must be a list")
        for item in raw:
            if type(item) is not list or len(item) != 5:
                raise ProtocolError("a replicated upload must be a list of 5 items")
            job, tenant, owner, sizes, claimed = item
            up = self._new(core, job, tenant, owner, protocol.check_sizes(sizes, "sizes"))
            up.claimed = claimed is True

    def apply_stage(self, core: BrokerCore, job: Any, tenant: Any, owner: Any, sizes: Any) -> None:
        if type(job) is not bytes or type(tenant) is not str or (owner is not None and type(owner) is not str):
            raise ProtocolError("a replicated upload names its job, tenant and owner")
        if job not in self.spool.uploads:
            self._new(core, job, tenant, owner, protocol.check_sizes(sizes, "sizes"))

    def apply_chunk(self, core: BrokerCore, job: Any, index: Any, offset: Any, data: Any) -> None:
        up = self.spool.uploads.get(job) if type(job) is bytes else None
        if up is None and type(job) is bytes and job in self.unheld:
            return  # its bytes could not be held here: the active peer is told (STATE's unheld)
        if up is None or type(index) is not int or type(offset) is not int or type(data) is not bytes:
            raise ProtocolError("a replicated chunk names an upload this broker does not hold")
        if self.spool.write(up, index, offset, memoryview(data), core.now, ordered=False) and not self.spool.written(up):
            # Applied means held: on disk before the next update, so that what the active broker
            # sends ahead of its peer's disk stays bounded by its window (its REPLYs wait for ours).
            self.spool.io.wait(up.ticket)
        if self.spool.io.failed:  # not held: named in the STATE that reports this update applied
            self.write_failures(core)

