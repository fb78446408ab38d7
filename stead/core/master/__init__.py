"""The master: one job's control plane, in the process ``stead master`` (or ``stead run``'s supervised child) runs.

:mod:`.wiring` builds it (:class:`Master`); :mod:`.reactor` is its loop, one record at a time; :mod:`.journal` makes
each effect once across masters; :mod:`.executor` turns the job machine's effects into platform calls and agent
commands; :mod:`.gateway` takes the agents' calls in (:mod:`.liveness` checks and watches them,
:mod:`.command_streams` gives them their commands, :mod:`.step_progress` records their steps); :mod:`.plugin_host`
delivers events to plugins; :mod:`.tasks` supervises its background tasks; :mod:`.takeover` is what a new master
adopts; :mod:`.rdzv_stores` and :mod:`.rdzv_host` keep the workers' rendezvous stores in a process that outlives it;
:mod:`.gcsteward` keeps CPython's collector off its loop.
"""

from stead.core.master.wiring import (
    JOB_TOKEN_ENV,
    Master,
    MasterConfig,
    MasterTaskFailed,
    NodeSpecFactory,
    open_store_retrying,
)

__all__ = ["JOB_TOKEN_ENV", "Master", "MasterConfig", "MasterTaskFailed", "NodeSpecFactory", "open_store_retrying"]
