"""The table of the broker's admin commands: names, docstrings (the help) and argument schemas.

One table, three readers: the broker implements exactly these commands (``gpud_broker.commands``
registers against it and checks the set at import), ``gpudctl`` builds one subcommand per entry with
the docstring as its help, and ``docs/OPERATIONS.md`` carries the section ``markdown()`` renders
(``python -m gpud.admin_commands`` prints it; a test keeps the document in step).
"""

from __future__ import annotations

import sys

from gpud.admin import Arg, CommandSpec, Operand

__all__ = ["COMMANDS", "markdown", "usage"]

STATES = ("queued", "running", "done")
TASK_KINDS = ("echo", "job", "session", "call")
MAX_LIST = 10_000

_WORKER = Arg("worker", str, "the worker's name (as `gpudctl workers` shows)", positional=True, metavar="WORKER")
_GPU = Arg("gpu", str, "the GPU: its uuid, or WORKER/INDEX (as `gpudctl gpus` shows)", positional=True, metavar="GPU")

_TABLE = (
    CommandSpec(
        "status",
        """The broker: role, peer state, uptime, counts, counters, and every worker and GPU.

        The human form is a summary line and one row per GPU; --json gives everything, with
        how long placement decisions take (placement: count, p50_us, p99_us, max_us).

        Example: gpudctl status
        Example: gpudctl status --json
        """,
    ),
    CommandSpec(
        "workers",
        """Connected workers: host, GPUs, slots in use, draining, running work, last heard.

        STATE is ok, draining, or SUSPENDED with the time left of its grace window: the worker
        is silent past its liveness, nothing new goes to it, and it is lost unless heard again
        before then. --json gives suspended and grace_left_s (seconds; null when not suspended).

        Example: gpudctl workers
        """,
    ),
    CommandSpec(
        "gpus",
        """Every GPU: model, memory, utilization, temperature, grants, running work, health.

        Health is what the worker measured (ok, degraded, failed), or "cordoned"; SIM marks a
        simulated GPU. GPU names are WORKER/INDEX; --json also gives each uuid.

        Example: gpudctl gpus
        Example: gpudctl gpus --worker w0 --json
        """,
        args=(Arg("worker", str, "only the GPUs of this worker", metavar="WORKER"),),
    ),
    CommandSpec(
        "queue",
        """Queued requests in placement order: what each needs, how long it waited, and why.

        Why it waits is the first that holds of: the broker places nothing now (passive,
        settling, no worker with a free slot), its tenant's limits, no connected worker could
        ever take it, no GPU fits it now, it fits only on workers reserved for requests that
        waited longer, it is behind higher priority, behind tenants with less fair share used.
        --json gives the reason's code (wait) besides the sentence (why).

        Example: gpudctl queue
        """,
    ),
    CommandSpec(
        "tasks",
        """Requests the broker knows, newest first: queued, running, and done (kept for retries).

        Each shows the chain tenant -> worker -> GPUs. Filters combine; done requests are kept for
        the broker's result TTL (60 s by default). In `--json`, `started` says a job may have
        begun (its worker asked to start it): if its worker is lost, it is not run again.

        Example: gpudctl tasks --state running
        Example: gpudctl tasks --tenant default --kind echo --limit 20
        """,
        args=(
            Arg("tenant", str, "only this tenant's requests", metavar="TENANT"),
            Arg("state", str, "only requests in this state", choices=STATES),
            Arg("kind", str, "only requests of this kind", choices=TASK_KINDS),
            Arg("worker", str, "only requests placed on this worker", metavar="WORKER"),
            Arg("limit", int, "show at most N (default 100)", default=100, min=1, max=MAX_LIST, metavar="N"),
        ),
    ),
    CommandSpec(
        "sessions",
        """Open device sessions: tenant, worker, GPU, grant, age, and when their client was last heard.

        Example: gpudctl sessions
        Example: gpudctl sessions --tenant default --json
        """,
        args=(
            Arg("tenant", str, "only this tenant's sessions", metavar="TENANT"),
            Arg("worker", str, "only sessions on this worker", metavar="WORKER"),
        ),
    ),
    CommandSpec(
        "drain",
        """Place no new work on a worker; the work running there finishes.

        Queued and new requests go to other workers. The drain lasts until `undrain`, also across
        a reconnection of the worker (not across a broker restart).

        Example: gpudctl drain w0
        """,
        args=(_WORKER,),
        mutating=True,
    ),
    CommandSpec(
        "undrain",
        """Let a drained worker take new work again; queued requests are placed at once.

        Example: gpudctl undrain w0
        """,
        args=(_WORKER,),
        mutating=True,
    ),
    CommandSpec(
        "cordon",
        """Place no new work on one GPU; the grants it holds run on.

        The cordon lasts until `uncordon`, also across a reconnection of its worker. Health shows
        "cordoned" meanwhile.

        Example: gpudctl cordon w0/0
        """,
        args=(_GPU,),
        mutating=True,
    ),
    CommandSpec(
        "uncordon",
        """Let a cordoned GPU take new work again; queued requests are placed at once.

        Example: gpudctl uncordon w0/0
        """,
        args=(_GPU,),
        mutating=True,
    ),
    CommandSpec(
        "cancel",
        """Cancel a queued request: its client gets CANCELLED.

        ID is the request id in hex, or a unique prefix of at least 8 hex digits (`gpudctl queue`
        and `tasks` show 12). Running work cannot be cancelled yet: it runs until it finishes or
        reaches its time limit, and the error says so; `drain` keeps new work off a worker.

        Example: gpudctl cancel 0123456789abcdef  # exit 1: no request with id 0123456789abcdef
        """,
        args=(Arg("id", str, "the request id (hex, or a unique prefix of 8+ digits)", positional=True, metavar="ID"),),
        mutating=True,
    ),
    CommandSpec(
        "failover",
        """Hand the active role to the peer broker of the standby pair.

        Ask the active broker: it stops accepting work, lets its passive peer apply the updates
        still on their way to it (under load there always are some; it waits at most the peer
        expiry), and the peer takes over with a new epoch; clients follow by themselves. Failing
        back after a crash is this command too: a restarted broker comes back passive. A passive
        broker, one whose peer is not connected or not in sync by then, and a standalone broker
        (no peer) refuse.

        Example: gpudctl failover  # exit 1: this broker has no peer (standalone)
        """,
        mutating=True,
    ),
    CommandSpec(
        "reload",
        """Re-read the broker's configuration file, as SIGHUP does.

        A broker started without a configuration file has nothing to re-read and says so.

        Example: gpudctl reload
        """,
        mutating=True,
    ),
)

# GPU VMs through Nova (gpud_broker.openstack), one command with an ACTION.
OPENSTACK_ACTIONS = ("list", "boot", "replace", "retire", "actions")
_OPENSTACK = CommandSpec(
    "openstack",
    """GPU VMs on OpenStack: list them, boot, replace or retire one, and the actions taken.

    ACTION is one of:

        list            Nova's gpud servers (status, host, addresses, the flavor's PCI alias or
                        vGPU) matched to the connected workers by the Nova instance id each worker
                        reports; servers without a worker and workers without a server as well
        boot [N]        boot N new GPU VMs (default 1), up to [openstack] max_workers
        replace WORKER  a new GPU VM instead of WORKER (a worker, or a server's name or id): the
                        new one boots first and the old one is then retired; a dead one is
                        deleted first
        retire WORKER   drain WORKER, let its work finish, then delete its server
        actions         what runs and what ran (also healing and scaling), newest first, with why

    Changes answer at once; `gpudctl openstack actions` follows them. One action at a time per
    worker. Needs [openstack] enabled (docs/OPERATIONS.md, OpenStack); every request, reading ones
    too, is logged with who asked.

    Example: gpudctl openstack list  # exit 1: OpenStack is not enabled on this broker
    Example: gpudctl openstack boot 2  # exit 1: OpenStack is not enabled on this broker
    """,
    args=(
        Arg("action", str, "what to do: " + ", ".join(OPENSTACK_ACTIONS), positional=True, choices=OPENSTACK_ACTIONS,
            metavar="ACTION"),
        Arg("worker", str, "replace, retire: the worker, or a server's name or id (or give it after ACTION)",
            metavar="WORKER"),
        Arg("count", int, "boot: how many servers, default 1 (or give N after ACTION)", min=1, max=100, metavar="N"),
    ),
    mutating=True,
    operand=Operand("N|WORKER", "boot: how many (as --count); replace, retire: the worker (as --worker)",
                    (("boot", "count"), ("replace", "worker"), ("retire", "worker"))),
)

COMMANDS: dict[str, CommandSpec] = {spec.name: spec for spec in (*_TABLE, _OPENSTACK)}
"""Every admin command of the broker, by name, in the order ``gpudctl --help`` lists them."""


def usage(spec: CommandSpec) -> str:
    """``gpudctl NAME ARGS... [--json]`` for one command."""
    parts = ["gpudctl", spec.name]
    for a in spec.args:
        if a.positional:
            parts.append(a.metavar or a.name.upper())
        else:
            value = "|".join(a.choices) if a.choices else (a.metavar or a.name.upper())
            parts.append(f"[{a.flag} {value}]")
    parts.append("[--json]")
    return " ".join(parts)


def markdown() -> str:
    """The "Admin commands" reference of docs/OPERATIONS.md, rendered from the table."""
    out = [
        "| command | changes state | what it does |",
        "| --- | --- | --- |",
    ]
    for spec in COMMANDS.values():
        out.append(f"| `{spec.name}` | {'yes' if spec.mutating else 'no'} | {spec.summary} |")
    for spec in COMMANDS.values():
        text = [line for line in spec.doc.splitlines() if not line.startswith("Example:")]
        while text and not text[-1]:
            text.pop()
        out += ["", f"#### `{usage(spec)}`", "", *text, ""]
        for a in spec.args:
            name = (a.metavar or a.name.upper()) if a.positional else a.flag
            out.append(f"- `{name}`: {a.help}")
        for cmd, status, error in spec.examples:
            outcome = f" (exit {status}: {error})" if status else ""
            out.append(f"- example: `{cmd}`{outcome}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
