"""Test helpers shipped with stead, for the authors of plugins, platforms and stores (stead's own tests use them too).

A plugin against a real master (in-memory store, no processes), and the job machine without IO:

- :func:`plugin_master`, :func:`make_plugin`, :func:`settle` (:mod:`stead.testing.master`): the real master with only
  the given plugins, a plugin configured as ``--set`` would, and a wait until every plugin has handled every record;
- :class:`FakeClock` (:mod:`stead.testing.clock`): time that moves only when a test says (``await
  clock.advance(30)``), for the reactor's timers and effect timeouts;
- :mod:`stead.testing.replay`: events folded through the job machine as the reactor folds them, without a store;
- :class:`~stead.testing.nvml.FakeNvml`: a scripted ``pynvml``, so GPU health rules run on machines without a GPU.

A platform, or a master under load, without processes:

- :class:`~stead.testing.platforms.RecordingPlatform`: a Platform that runs nothing and records every call;
- :class:`~stead.testing.swarm.Swarm`: simulated agents (the real protocol, no workers) by the thousand.

Whole jobs, with real processes:

- :mod:`stead.testing.steps`: a training script whose rank 0 logs each step it finishes, ``read_steps`` to read them
  back (which steps ran, when, none lost or run twice), and ``free_port`` (a free loopback port);
- :mod:`stead.testing.leaks`: what a test or job left behind (child processes, listening ports, shared memory);
- :class:`~stead.testing.etcd.EtcdServer`: a real, throw-away etcd on loopback that a test can stop, kill or pause,
  with TLS from :mod:`stead.testing.tls`'s throw-away certificate authority.

What only stead's own tests use (the fake Kubernetes, hostile RPC peers, the e2e jobs' history) lives in the
repository's ``tests/support`` and is not shipped.
"""

from stead.testing.clock import FakeClock
from stead.testing.master import make_plugin, plugin_master, settle

__all__ = ["FakeClock", "make_plugin", "plugin_master", "settle"]
