"""The admin protocol's command registry and request schema.

A command is first *specified* (``CommandSpec``: name, docstring, argument schema, whether it changes
state) in a table that the client side can import (``gpud.admin_commands``: ``gpudctl`` builds its
subcommands and help from it, and must not import the broker). A component then *implements* the
specified commands with ``@registry.command(name)``: the handler gets the spec's docstring, and
``Registry.verify`` checks that the implemented set is exactly the table.

Handlers take ``(target, args)`` and return a JSON-able result. ``dispatch`` checks ``args`` against
the command's schema before the handler sees them (unknown keys, wrong types and out-of-range values
are an InvalidRequest naming the argument), serializes the commands that change state and logs each
of those at WARNING with who asked.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpud.errors import InvalidRequest

log = logging.getLogger(__name__)

Handler = Callable[[Any, dict[str, Any]], Any]

MAX_TEXT = 256  # characters of a string argument, at most

_EXAMPLE_RE = re.compile(r"^\s*Example:\s*`{0,2}(gpudctl\b[^`#]*?)`{0,2}\s*(?:#\s*(.*?)\s*)?$")


@dataclass(frozen=True, slots=True)
class Arg:
    """One argument of an admin command: its wire key, type and the ``gpudctl`` flag for it.

    A ``positional`` argument is required and given on the command line without a flag (``gpudctl
    drain w0``); the others are optional flags (``--tenant alice``, the key with ``-`` for ``_``).
    """

    name: str
    type: type[str] | type[int]
    help: str
    positional: bool = False
    choices: tuple[str, ...] = ()
    default: str | int | None = None  # what the handler gets when the argument is absent
    min: int | None = None
    max: int | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, command: str, value: Any) -> str | int:
        """``value`` when it is of this argument's type and range; InvalidRequest otherwise."""
        where = f"{command}: argument {self.name!r}"
        if self.type is int:
            if type(value) is not int:
                raise InvalidRequest(f"{where} must be an integer, not {type(value).__name__}")
            if self.min is not None and value < self.min:
                raise InvalidRequest(f"{where} must be at least {self.min}")
            if self.max is not None and value > self.max:
                raise InvalidRequest(f"{where} must be at most {self.max}")
            return value
        if type(value) is not str:
            raise InvalidRequest(f"{where} must be a string, not {type(value).__name__}")
        if not 0 < len(value) <= MAX_TEXT or not value.isprintable():
            raise InvalidRequest(f"{where} must be 1-{MAX_TEXT} printable characters")
        if self.choices and value not in self.choices:
            raise InvalidRequest(f"{where} must be one of {', '.join(self.choices)}; got {value!r}")
        return value


@dataclass(frozen=True, slots=True)
class Operand:
    """An optional word after a command's first positional argument that stands for one of its
    flags, chosen by that argument's value: ``gpudctl openstack boot 2`` for ``--count 2``."""

    metavar: str
    help: str
    by: tuple[tuple[str, str], ...]  # (value of the first positional argument, the argument the word gives)


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """What an admin command is, independent of who implements it.

    ``doc`` is its docstring: the first line is the one-line help; ``Example:`` lines give exact
    ``gpudctl`` invocations, optionally followed by ``# exit N: text`` when the example shows an
    error (the documentation test runs every example against a live broker).
    """

    name: str
    doc: str
    args: tuple[Arg, ...] = ()
    mutating: bool = False
    operand: Operand | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "doc", inspect.cleandoc(self.doc))
        names = [a.name for a in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"admin command {self.name!r} names an argument twice")

    @property
    def summary(self) -> str:
        """The one-line help."""
        return self.doc.splitlines()[0] if self.doc else ""

    @property
    def examples(self) -> list[tuple[str, int, str]]:
        """``(gpudctl command line, expected exit status, text the error must contain)`` per
        ``Example:`` line of the docstring."""
        found = []
        for line in self.doc.splitlines():
            m = _EXAMPLE_RE.match(line)
            if m is None:
                continue
            outcome = m.group(2) or ""
            status, text = 0, ""
            e = re.fullmatch(r"exit (\d+):\s*(.*)", outcome)
            if e is not None:
                status, text = int(e.group(1)), e.group(2)
            found.append((m.group(1).strip(), status, text))
        return found

    def with_operand(self, args: dict[str, Any], word: str | None) -> dict[str, Any]:
        """``args`` with the ``operand`` ``word`` given as the argument it stands for; ValueError
        says what is wrong (a word where none is taken, the argument given twice, not a number)."""
        if word is None:
            return args
        first = next((a for a in self.args if a.positional), None)
        key = dict(self.operand.by).get(str(args.get(first.name))) if self.operand and first else None
        if key is None or first is None:
            raise ValueError(f"{args.get(first.name) if first else self.name} takes nothing after it")
        arg = next(a for a in self.args if a.name == key)
        shown = arg.metavar or arg.name.upper()
        if key in args:
            raise ValueError(f"give {shown} or {arg.flag}, not both")
        if arg.type is int:
            if not word.isdigit():
                raise ValueError(f"{args[first.name]} {shown}: {shown} is a number, not {word!r}")
            return {**args, key: int(word)}
        return {**args, key: word}

    def check(self, args: Any) -> dict[str, Any]:
        """The checked arguments, with defaults filled in; InvalidRequest on anything wrong."""
        if args is None:
            args = {}
        if type(args) is not dict:
            raise InvalidRequest("admin 'args' must be a map")
        known = {a.name: a for a in self.args}
        for key in args:
            if key not in known:
                shown = repr(key)[:40]
                hint = f"; known: {', '.join(known)}" if known else "; it takes none"
                raise InvalidRequest(f"{self.name}: unknown argument {shown}{hint}")
        checked: dict[str, Any] = {}
        for a in self.args:
            value = args.get(a.name)
            if value is None:
                if a.positional:
                    raise InvalidRequest(f"{self.name}: argument {a.name!r} is required")
                checked[a.name] = a.default
            else:
                checked[a.name] = a.check(self.name, value)
        return checked


@dataclass(frozen=True, slots=True)
class AdminCommand:
    name: str
    handler: Handler
    mutating: bool
    doc: str
    spec: CommandSpec | None = None


class Registry:
    """Implemented admin commands by name.

    With a ``table`` (name -> CommandSpec), only commands of the table can be registered, each takes
    its docstring, schema and ``mutating`` flag from there, and ``verify`` checks that every one of
    them is implemented. Without a table, handlers bring their own docstring and check their own
    arguments.
    """

    def __init__(self, table: Mapping[str, CommandSpec] | None = None) -> None:
        self.commands: dict[str, AdminCommand] = {}
        self.table = table
        # Commands that change state run one at a time. The broker answers its admin socket from
        # its single loop thread, so this is uncontended there; it keeps the guarantee for callers
        # that dispatch from several threads.
        self._serial = threading.Lock()

    def command(self, name: str, *, mutating: bool | None = None) -> Callable[[Handler], Handler]:
        spec: CommandSpec | None = None
        if self.table is not None:
            spec = self.table.get(name)
            if spec is None:
                raise ValueError(f"admin command {name!r} is not in the command table")
            if mutating is not None and mutating != spec.mutating:
                raise ValueError(f"admin command {name!r}: mutating={mutating} disagrees with the table")

        def register(fn: Handler) -> Handler:
            if name in self.commands:
                raise ValueError(f"admin command {name!r} registered twice")
            if spec is not None:
                fn.__doc__ = spec.doc
                self.commands[name] = AdminCommand(name, fn, spec.mutating, spec.doc, spec)
            else:
                self.commands[name] = AdminCommand(name, fn, bool(mutating), (fn.__doc__ or "").strip())
            return fn

        return register

    def verify(self) -> None:
        """ValueError unless the implemented commands are exactly those of the table."""
        if self.table is None:
            return
        missing = sorted(set(self.table) - set(self.commands))
        extra = sorted(set(self.commands) - set(self.table))
        if missing or extra:
            raise ValueError(f"admin commands differ from the table: missing {missing}, not in the table {extra}")

    def dispatch(self, target: Any, name: Any, args: Any, who: str = "unknown") -> Any:
        """Run command ``name`` on ``target`` with ``args``; ``who`` is logged for mutating ones."""
        if type(name) is not str or name not in self.commands:
            shown = repr(name)[:40]
            raise InvalidRequest(f"unknown admin command {shown}; known: {', '.join(sorted(self.commands))}")
        cmd = self.commands[name]
        if cmd.spec is not None:
            args = cmd.spec.check(args)
        elif args is None:
            args = {}
        elif type(args) is not dict:
            raise InvalidRequest("admin 'args' must be a map")
        if not cmd.mutating:
            return cmd.handler(target, args)
        with self._serial:
            shown = " ".join(f"{k}={v}" for k, v in args.items() if v is not None) or "-"
            log.warning("admin %s %s by %s", name, shown, who)
            return cmd.handler(target, args)
