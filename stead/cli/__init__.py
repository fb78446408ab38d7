"""The ``stead`` command line and the ``stead run`` process: the layer above the master and the agent.

:mod:`.commands` is every subcommand (``stead run | master | agent | status | events | top | report | k8s``);
:mod:`.run_args` reads ``stead run``'s torchrun flags into a :class:`~stead.core.runspec.RunConfig`; :mod:`.run`
is the ``stead run`` process (its master, its nodes, resuming a job); :mod:`.supervisor` restarts that master
when it dies.
"""

from stead.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
