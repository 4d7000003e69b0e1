"""gpud_cli: the ``gpud`` command line, ``LocalCluster`` (daemons as child processes) and the demo.

It sits above every component: the core (:mod:`gpud`) imports none of them, and each subcommand
imports its component only when it runs.
"""
