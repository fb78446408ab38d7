"""Test helpers shipped with stead: fakes and harnesses for plugin authors and stead's own tests.

- :func:`plugin_master`, :func:`make_plugin`, :func:`settle`: a plugin against a real master;
- :class:`FakeClock`: time that moves only when a test says (``await clock.advance(30)``), for the reactor's timers;
- :class:`~stead.testing.platforms.RecordingPlatform`: a Platform that runs nothing and records;
- :mod:`stead.testing.replay`: fold events without IO; :mod:`stead.testing.etcd`: a real etcd server;
- :class:`~stead.testing.swarm.Swarm`: simulated agents (the real protocol, no workers) by the thousand.
"""

from stead.testing.clock import FakeClock
from stead.testing.master import make_plugin, plugin_master, settle

__all__ = ["FakeClock", "make_plugin", "plugin_master", "settle"]
