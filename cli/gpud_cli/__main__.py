"""``python -m gpud_cli``: the ``gpud`` command."""

import sys

from gpud_cli.main import main

sys.exit(main())
