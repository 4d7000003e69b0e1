"""The admin protocol's command registry: ``@command`` registers a handler whose docstring is its help.

Handlers take ``(target, args)`` and return a JSON-able result; they check ``args`` before using it.
Components register their commands in their own modules; ``dispatch`` runs one by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpud.errors import InvalidRequest

Handler = Callable[[Any, dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class AdminCommand:
    name: str
    handler: Handler
    mutating: bool
    doc: str


class Registry:
    def __init__(self) -> None:
        self.commands: dict[str, AdminCommand] = {}

    def command(self, name: str, *, mutating: bool = False) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            if name in self.commands:
                raise ValueError(f"admin command {name!r} registered twice")
            self.commands[name] = AdminCommand(name, fn, mutating, (fn.__doc__ or "").strip())
            return fn

        return register

    def dispatch(self, target: Any, name: Any, args: Any) -> Any:
        if type(name) is not str or name not in self.commands:
            raise InvalidRequest(f"unknown admin command {name!r}; known: {', '.join(sorted(self.commands))}")
        if args is None:
            args = {}
        if type(args) is not dict:
            raise InvalidRequest("admin 'args' must be a map")
        return self.commands[name].handler(target, args)
