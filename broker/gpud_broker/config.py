"""The broker's configuration: ``BrokerConfig``, its defaults, and which of its fields a running
broker takes on reload. Pure: the file format is ``gpud.config``'s, the sockets the shell's."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpud import protocol
from gpud.heartbeat import HeartbeatPolicy
from gpud.resources import TenantLimits
from gpud_broker.accounts import Budgets, default_budget, default_held_bytes, machine_memory
from gpud_broker.gate import ConnectionLimits
from gpud_broker.policies import FACTORIES
from gpud_broker.queue import DEFAULT_AGING_S, DEFAULT_RESERVE_AFTER_S
from gpud_broker.spool import (
    DEFAULT_KEEP_BYTES,
    DEFAULT_RAM_BYTES,
    DEFAULT_STAGE_IDLE_S,
    DEFAULT_STAGE_TTL_S,
)

DEFAULT_RESULT_BYTES = 256 << 20  # the reply store's default size
DEFAULT_MAX_JOB_INPUT_BYTES = 4 << 30
DEFAULT_MAX_ECHO_BYTES = 64 << 10  # an echo is a probe; big data travels as staged files or session copies


def default_max_message_bytes() -> int:
    """The largest message by default: 1 GiB, or an eighth of this machine's memory if less."""
    return min(protocol.DEFAULT_MAX_MESSAGE_BYTES, machine_memory() // 8)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    name: str = "broker"
    heartbeat: HeartbeatPolicy = field(default_factory=HeartbeatPolicy)
    policy: str = "fgd-balanced"
    max_queue: int = 10_000
    default_deadline_ms: int = 30_000
    result_ttl: float = 60.0  # seconds a finished reply is kept for retries
    result_bytes: int = DEFAULT_RESULT_BYTES  # bytes of finished replies kept at most
    session_lease: float = 30.0  # seconds without hearing from a session's client
    max_attempts: int = 3  # placements of one request across worker losses
    max_message_bytes: int = field(default_factory=lambda: default_max_message_bytes())
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair-share weights (default 1)
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)  # per tenant (default: none)
    aging_s: float = DEFAULT_AGING_S  # seconds of waiting worth one priority level
    reserve_after: float = DEFAULT_RESERVE_AFTER_S  # seconds before a blocked request reserves a worker
    drain_timeout: float = 10.0  # seconds dispatched work may take to finish after SIGTERM (the shell's)
    tenant_pool_share: float = 0.5  # most of a worker's pool users one tenant may hold (policies.pool_allows)
    data_path: str = "auto"  # "broker": no session's CALLs go straight to its worker (PROTOCOL.md §10)
    budgets: Budgets | None = None  # what the broker holds per tenant and in all (None: sized from the machine)
    # The shell's: frontend connections per source and in all (None: sized from the descriptor
    # limit, gate.default_limits), and libzmq's I/O threads (0: sized from the CPUs).
    connection_limits: ConnectionLimits | None = None
    io_threads: int = 0
    echo_bytes_in_flight: int = 0  # the shell's: each sender's echo payload in flight (0: max_echo_bytes; intake.EchoShare)
    echo_bytes_per_s: int = 8 << 20  # the shell's: each sender's echo payload a second (0: no bound; intake.EchoShare)
    max_job_input_bytes: int = DEFAULT_MAX_JOB_INPUT_BYTES  # a job's input files together (PROTOCOL.md §11)
    max_echo_bytes: int = DEFAULT_MAX_ECHO_BYTES  # an echo's payload
    spool_dir: str = ""  # where staged inputs are spooled ("": a temporary directory of its own)
    spool_ram_bytes: int = DEFAULT_RAM_BYTES  # staged bytes held in memory at most (small files)
    spool_keep_bytes: int = DEFAULT_KEEP_BYTES  # files of ended uploads kept for the next ones (spool.Spool)
    stage_ttl: float = DEFAULT_STAGE_TTL_S  # seconds an upload no job claims is kept after its last PUT
    stage_idle_s: float = DEFAULT_STAGE_IDLE_S  # seconds a placed staged job's worker may wait for its upload
    bad_log_s: float = 10.0  # per sender (a tenant, else a routing id), one bad-message line in full per this many seconds
    # A worker silent past its liveness is suspended for this many liveness periods before it is
    # removed: its process, if alive, resumes with its work (PROTOCOL.md §4.2). 0: removed at once.
    worker_resume_periods: int = 3

    def __post_init__(self) -> None:
        if self.policy not in FACTORIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(FACTORIES)}")


# Fields a running broker can take from a reloaded configuration; the rest need a restart.
RELOADABLE = ("policy", "max_queue", "default_deadline_ms", "result_ttl", "result_bytes",
              "session_lease", "max_attempts", "tenant_weights", "tenant_limits", "aging_s",
              "reserve_after", "drain_timeout", "budgets")


def budgets(config: BrokerConfig) -> Budgets:
    """The configured budgets, or the defaults sized from the queue and this machine."""
    if config.budgets is not None:
        return config.budgets
    return Budgets(default=default_budget(config.max_queue, result_bytes=config.result_bytes),
                   max_held_bytes=default_held_bytes())
