"""One chain of an OpenStack ``*-manage`` tool's commands in one process, run with .venv-nova's
Python:

    python manage.py MODULE '[["nova-manage", "--config-file", "...", "api_db", "sync"], ...]'

calls MODULE's ``main`` (``nova.cmd.manage``, ``keystone.cmd.manage``: what the console script
calls) with each argv in turn, as the operator's commands one after another would, and stops at
the first that fails (its exit status). Each command in a process of its own spent most of its
seconds importing the tool again (about 3 s of CPU each, nine commands). Between two commands the
tool's configuration is cleared (oslo.config's ``CONF.clear``: the options stay registered, the
parsed arguments and files go) and nova's two database transaction factories are replaced by
fresh unconfigured ones (oslo.db's ``patch_factory``, its hook for test suites), since each
command configures them from its arguments again.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any


def _database_managers(module: str) -> list[tuple[Any, Any]]:
    """Nova's transaction context managers, each with an unconfigured copy made before any use."""
    if module != "nova.cmd.manage":
        return []
    from nova.db.api import api as api_db
    from nova.db.main import api as main_db

    return [(cm, cm.make_new_manager()) for cm in (main_db.context_manager, api_db.context_manager)]


def main() -> int:
    from oslo_config import cfg

    module, commands = sys.argv[1], json.loads(sys.argv[2])
    entry = importlib.import_module(module).main
    managers = _database_managers(module)
    for argv in commands:
        for cm, pristine in managers:
            cm.patch_factory(pristine.make_new_manager())
        sys.argv = argv
        try:
            code = entry()
        except SystemExit as exc:  # placement-manage's main exits, the others return
            code = exc.code
        if code:
            print(f"{' '.join(argv)} exited {code}", file=sys.stderr)
            return code if isinstance(code, int) else 1
        cfg.CONF.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
