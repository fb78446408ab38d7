"""Suite-wide fixtures: the anyio backend and the leak check every test passes.

The leak check looks only at what this test session started: its own child
processes, its own listening sockets, the shared memory of its own
namespace (every job of the session, its agents included, names its segments
with ``STEAD_CKPT_SHM_NAMESPACE``), and the network namespaces its test hosts
made (named after this process, with the bridges and veths inside them), so
that two suites side by side never fail each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from stead.core.config import env_name
from stead.testing import leaks
from stead.testing.etcd import EtcdServer
from tests.support import hosts

#: under pytest-xdist each worker process has a namespace of its own (``t<pid>gw0``, ...)
SHM_NAMESPACE = os.environ[leaks.SHM_NAMESPACE_ENV] = (
    os.environ.get(leaks.SHM_NAMESPACE_ENV, f"t{os.getpid()}") + os.environ.get("PYTEST_XDIST_WORKER", ""))
#: the suite's jobs start no warm spare agent: a spare is a Python with torch imported (~5 s of CPU on the 2-core
#: CI machine) kept for a node loss that most tests never have; the tests of spares ask for one
#: (``--set spare_agents=1``), and a lost node's replacement starts cold elsewhere (the same agent, from scratch)
SPARES_ENV = env_name("", "spare_agents")
os.environ.setdefault(SPARES_ENV, "0")


#: set by `make chaos`: the tests marked ``extended`` run too (skipped in `make test`, saying what covers them)
EXTENDED_ENV = "STEAD_EXTENDED"
#: the tests that run whole jobs (most of the suite's time) go first on each xdist worker, so that the suite's tail
#: is short tests that the workers share out, not one long job on one worker while the other waits
WHOLE_JOB_DIRS = ("e2e", "chaos")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def whole_job(item: pytest.Item) -> bool:
        return (any(part in WHOLE_JOB_DIRS for part in item.path.relative_to(item.config.rootpath).parts[:2])
                or item.get_closest_marker("e2e") is not None)

    def seconds(item: pytest.Item) -> float:  # a long test's expected seconds: the longest start first, so that
        marker = item.get_closest_marker("long")  # none is still running alone at the end of the run
        return float(marker.args[0]) if marker is not None else 0.0

    skipped: set[pytest.Item] = set()
    if not os.environ.get(EXTENDED_ENV):
        for item in items:
            marker = item.get_closest_marker("extended")
            if marker is not None:
                item.add_marker(pytest.mark.skip(reason=f"runs in `make chaos` ({EXTENDED_ENV}=1); in `make test`: "
                                                        f"{marker.args[0]}"))
                skipped.add(item)
    jobs = [item for item in items if whole_job(item) and item not in skipped]
    items[:] = _worker_runs(jobs, [item for item in items if not whole_job(item) or item in skipped], seconds,
                            workers=_xdist_workers(config))


def _xdist_workers(config: pytest.Config) -> int:
    """How many xdist workers share the run (asked in a worker, where the collection that counts is made)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput.get("workercount", 1)) if isinstance(workerinput, dict) else 1


def _worker_runs(jobs: list[pytest.Item], rest: list[pytest.Item], seconds: Callable[[pytest.Item], float], *,
                 workers: int) -> list[pytest.Item]:
    """The order that starts every xdist worker on whole jobs: ``--dist worksteal`` first hands worker k the k-th of
    ``workers`` runs of the collection (each what is left over the workers left), and an idle worker later steals
    from the end of another's queue. So each run is its share of the whole-job tests (longest first, each to the
    share expected to end soonest) followed by its share of the short tests, and the stolen tests are short ones."""
    ordered = sorted(jobs, key=lambda item: -seconds(item))  # stable: the order within each length stays
    if workers == 1:
        return ordered + rest
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for item in ordered:
        k = min(range(workers), key=lambda w: (loads[w], len(shares[w])))
        shares[k].append(item)
        loads[k] += seconds(item) or 1.0  # a whole job of no stated length: a few seconds
    total, taken = len(jobs) + len(rest), 0
    out: list[pytest.Item] = []
    for k in range(workers):
        fill = max(0, (total - len(out)) // (workers - k) - len(shares[k]))
        out += shares[k] + rest[taken:taken + fill]
        taken += fill
    return out + rest[taken:]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def etcd_url() -> Iterator[str]:
    """One real etcd server for the whole session, on free loopback ports (never skipped in CI)."""
    before = leaks.descendants()
    with EtcdServer() as server:
        owned = leaks.descendants() - before
        leaks.LONG_LIVED.update(owned)
        yield server.url
    leaks.LONG_LIVED.difference_update(owned)


@pytest.fixture(scope="session")
def secure_etcd() -> Iterator[EtcdServer]:
    """One etcd for the session that takes only TLS clients with a certificate of its CA, and only logged-in
    users (``secure_etcd.client_settings()`` gets in); started when a test first asks for it."""
    before = leaks.descendants()
    with EtcdServer(tls=True, auth=True) as server:
        owned = leaks.descendants() - before
        leaks.LONG_LIVED.update(owned)
        yield server
    leaks.LONG_LIVED.difference_update(owned)


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """After every test: no new child process, listening port, stead shared-memory segment or test hosts' network
    namespace."""
    before, namespaces = leaks.snapshot(), hosts.namespaces()
    yield
    left = leaks.wait_clean(before)
    if left:
        leaks.remove(left)  # reported below, but not left to the machine
    made = hosts.namespaces() - namespaces
    hosts.remove_namespaces(made)
    assert not left, f"the test left behind: {left}"
    assert not made, f"the test left behind network namespaces (test hosts): {sorted(made)}"
