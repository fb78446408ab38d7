"""Test hosts: N network hosts on one machine, made of Linux namespaces, for the multi-host tests.

Each host is a long-lived holder process with a network, UTS (hostname) and mount namespace of its own: ``lo``
up, one veth ``eth0`` at ``10.77.0.{i+1}/24`` linked to a bridge in a "switch" network namespace, hostname
``h{i}`` (every host's ``/etc/hosts`` names every host), a private tmpfs ``/dev/shm`` and ``/tmp``. The root
namespace's links, routes and addresses are never touched; every namespace is named
``stead-hosts-<pid>-<counter>-...`` (under ``/run/netns``), so two suites side by side never collide, and the
suite's leak check (``tests/conftest.py``) fails a test that leaves one of its own::

    from tests.support.hosts import test_hosts

    async def test_two_hosts(tmp_path: Path) -> None:
        async with test_hosts(2) as hosts:                   # skips the test where namespaces cannot be made
            server = await hosts[0].spawn([sys.executable, "-m", "http.server", "--bind", hosts[0].address, "80"],
                                          cwd=tmp_path)
            rc, out, err = await hosts[1].run([sys.executable, "-c", "import urllib.request as u; "
                                               "print(u.urlopen('http://h0/').status)"])
            await hosts.partition(1)                         # h1's link to the switch down: packets stop
            await hosts.heal(1)
            await hosts.partition(0, 1)                      # only between h0 and h1 (h2, h3... still reach both)
            await hosts.heal(0, 1)
            await hosts.kill(0)                              # every process on h0 SIGKILLed, its memory gone
            await hosts.restart(0)                           # h0 back, same name and address, empty

A host's private ``/tmp`` still shows the ``shared`` paths (those that exist when the host starts) at the same
paths: by default the repo root, the Python environment and pytest's temporary directories, so that a repo cloned
under /tmp and its venv run on every host, and a test's ``tmp_path`` is a filesystem every host shares, as users
share one between machines (the job's script, a checkpoint folder, a token file). ``spawn`` returns an asyncio
subprocess running on the host in a session of its own; ``run`` waits for one and returns ``(rc, stdout,
stderr)``; ``hosts.names`` maps every hostname to its address. Where namespaces cannot be made (not root, a tool
missing, a container without CAP_SYS_ADMIN) the test is skipped with the failing command's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn, overload

import anyio
import pytest

from stead.core.procs import tied_argv

__all__ = ["DEFAULT_SHARED", "IFNAME", "NETNS_DIR", "REPO_ROOT", "Host", "Hosts", "HostsUnavailable",
           "namespaces", "remove_namespaces", "test_hosts", "unavailable_reason"]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: the hosts' subnet: only ever configured inside namespaces this module makes
SUBNET = "10.77.0"
PREFIX_LEN = 24
IFNAME = "eth0"
#: host i is at .{i+1}: .255 is the subnet's broadcast address
MAX_HOSTS = 254
#: where ``ip netns`` keeps named network namespaces (one file per namespace)
NETNS_DIR = Path("/run/netns")
#: how long a host's holder may take to set up its namespaces and mounts before the fixture gives up
HOLDER_START_TIMEOUT_S = 30.0
#: how long a killed host's processes may take to be gone (they are SIGKILLed: this only stops a hang)
KILL_TIMEOUT_S = 30.0
#: how long one ``ip`` command may take
TOOL_TIMEOUT_S = 30.0
#: how often ``spawn`` looks whether its process has entered the host yet (and a kill whether all are gone)
SPAWN_POLL_S = 0.002
#: the tools the hosts are made with, looked up on PATH
TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname", "bash", "sleep")


def _pytest_temp_root() -> Path:
    """Where pytest's ``tmp_path`` directories live (``/tmp/pytest-of-<user>``; a ``--basetemp`` elsewhere is not
    known here: pass it in ``shared``)."""
    return Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"


#: the paths every host sees as the root namespace does even under its private /tmp: the repo (and a venv in it),
#: the Python environment the tests run in, and pytest's temporary directories (every test's ``tmp_path``)
DEFAULT_SHARED: tuple[Path, ...] = (REPO_ROOT, Path(sys.prefix), _pytest_temp_root())

_instances = itertools.count()


class HostsUnavailable(RuntimeError):
    """Namespaces cannot be made on this machine; the message says which command failed and how."""


def _prefix(pid: int | None = None) -> str:
    return f"stead-hosts-{os.getpid() if pid is None else pid}-"


def namespaces(pid: int | None = None) -> set[str]:
    """The named network namespaces that the test hosts of process ``pid`` (this one by default) made and that
    still exist; another process's are never listed (the suite's leak check compares these)."""
    try:
        return {p.name for p in NETNS_DIR.iterdir() if p.name.startswith(_prefix(pid))}
    except OSError:
        return set()


def remove_namespaces(names: Iterable[str]) -> None:
    """Delete named network namespaces (with the veths and bridges in them): what a failed test left behind."""
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False, timeout=TOOL_TIMEOUT_S)


def _sweep_dead() -> None:
    """Delete the namespaces of test hosts whose process is gone (a suite killed before its cleanup ran)."""
    with contextlib.suppress(OSError):
        for path in NETNS_DIR.iterdir():
            pid = path.name.removeprefix("stead-hosts-").split("-", 1)[0]
            if path.name.startswith("stead-hosts-") and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                remove_namespaces([path.name])


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here (not root, a tool missing), or None if nothing says so yet (making the
    first namespace may still fail: :func:`test_hosts` then skips with that command's message)."""
    if not sys.platform.startswith("linux"):
        return f"test hosts need Linux namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "test hosts need root (network, UTS and mount namespaces); run the suite as root, as CI does"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"test hosts need {', '.join(missing)} on PATH (iproute2, util-linux, bash, coreutils); "
                "install them to run these tests")
    return None


async def _tool(*argv: str, check: bool = True) -> None:
    """Run one setup command; its failure raises with the command and its message (unless not ``check``)."""
    with anyio.fail_after(TOOL_TIMEOUT_S):
        done = await anyio.run_process(list(argv), check=False)
    if done.returncode != 0 and check:
        message = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
        raise HostsUnavailable(f"`{shlex.join(argv)}` failed: {message}")


def _shared_under_tmp(shared: Iterable[Path | str]) -> list[Path]:
    """The shared paths that a host's private /tmp would hide (those under /tmp), without ones inside another."""
    tmp = Path(tempfile.gettempdir()).resolve()
    paths = sorted({Path(p).resolve() for p in shared if Path(p).exists()})
    hidden = [p for p in paths if p == tmp or tmp in p.parents]
    return [p for p in hidden if not any(q in p.parents for q in hidden)]


def _holder_script(name: str, hosts_file: Path, shared: Sequence[Path]) -> str:
    """The holder's bash script: inside its new mount namespace, /etc/hosts, a private /dev/shm and /tmp, the
    shared paths bound back (through file descriptors opened before /tmp is covered), the hostname; then it says
    ``ready`` and sleeps as the host's process for as long as the host lives."""
    q = shlex.quote
    lines = ["set -e"]
    lines += [f"exec {10 + k}<{q(str(p))}" for k, p in enumerate(shared)]
    lines += [f"mount --bind {q(str(hosts_file))} /etc/hosts",
              "mount -t tmpfs -o mode=1777 tmpfs /dev/shm",
              "mount -t tmpfs -o mode=1777 tmpfs /tmp"]
    for k, p in enumerate(shared):
        make = f"mkdir -p {q(str(p))}" if p.is_dir() else f"mkdir -p {q(str(p.parent))} && touch {q(str(p))}"
        lines += [make, f"mount --no-canonicalize --rbind /proc/self/fd/{10 + k} {q(str(p))}", f"exec {10 + k}<&-"]
    lines += [f"hostname {q(name)}", "echo ready", "exec sleep infinity"]
    return "\n".join(lines)


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _pids_in(mount_ns: str) -> set[int]:
    """The live processes in mount namespace ``mount_ns`` (a zombie has no namespace left: it is not listed)."""
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _mount_ns(int(p.name)) == mount_ns}


class Host:
    """One test host: ``name`` (``h{i}``), ``address`` on the hosts' subnet, ``ifname`` (``eth0``)."""

    def __init__(self, hosts: Hosts, index: int) -> None:
        self.index = index
        self.name = f"h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.ifname = IFNAME
        self._hosts = hosts
        self.netns = f"{hosts.prefix}h{index}"
        self._holder: asyncio.subprocess.Process | None = None
        self._mount_ns: str | None = None

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address}, {'up' if self.alive else 'down'})"

    @property
    def alive(self) -> bool:
        return self._holder is not None and self._holder.returncode is None

    @property
    def holder_pid(self) -> int:
        """The pid whose namespaces are the host's (``nsenter --target PID --net --uts --mount`` runs on it)."""
        if self._holder is None or self._holder.returncode is not None:
            raise RuntimeError(f"host {self.name} is down (killed); `await hosts.restart({self.index})` brings it "
                               "back")
        return self._holder.pid

    def argv(self, argv: Sequence[str], *, cwd: Path | str | None = None) -> list[str]:
        """``argv`` as a command that runs on this host, in ``cwd`` (this process's working directory by default:
        it must be visible on the host, as the shared paths are)."""
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        return [self._hosts.tools["nsenter"], f"--target={self.holder_pid}", "--net", "--uts", "--mount",
                f"--wd={workdir}", "--", *argv]

    async def spawn(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                    cwd: Path | str | None = None, stdin: int | IO[Any] | None = subprocess.DEVNULL,
                    stdout: int | IO[Any] | None = None,
                    stderr: int | IO[Any] | None = None) -> asyncio.subprocess.Process:
        """Start ``argv`` on this host in a session (process group) of its own; returns once it runs there (so
        that a :meth:`Hosts.kill` right after kills it too). It gets SIGKILL if this process dies, so that a crashed
        suite leaves nothing running on a host."""
        proc = await asyncio.create_subprocess_exec(
            *tied_argv(self.argv(argv, cwd=cwd), signal.SIGKILL), env=None if env is None else dict(env),
            stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
        while proc.returncode is None and _mount_ns(proc.pid) not in (self._mount_ns, None):  # noqa: ASYNC110
            await anyio.sleep(SPAWN_POLL_S)  # still the shim or nsenter in the root namespace: nothing to wait on
        return proc

    async def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                  cwd: Path | str | None = None, input: bytes | None = None) -> tuple[int, str, str]:
        """Run ``argv`` on this host to its end: ``(returncode, stdout, stderr)`` (text). A caller that may wait
        long bounds it with ``anyio.fail_after``; the process is killed if the wait is cancelled."""
        proc = await self.spawn(argv, env=env, cwd=cwd, stdin=subprocess.PIPE if input is not None else None,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await proc.communicate(input)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with anyio.CancelScope(shield=True):
                    await proc.wait()
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    def processes(self) -> set[int]:
        """Every live process on this host (those in its mount namespace), its holder included."""
        return _pids_in(self._mount_ns) if self._mount_ns is not None else set()

    async def _start(self) -> None:
        """Make the host's network namespace and link, then its holder (hostname, mounts)."""
        hosts, ip = self._hosts, self._hosts.tools["ip"]
        peer = f"p{self.index}"
        await _tool(ip, "netns", "add", self.netns)
        await _tool(ip, "-n", hosts.switch, "link", "add", peer, "type", "veth", "peer", "name", IFNAME,
                    "netns", self.netns)
        await _tool(ip, "-n", hosts.switch, "link", "set", peer, "master", "br0", "up")
        await _tool(ip, "-n", self.netns, "addr", "add", f"{self.address}/{PREFIX_LEN}", "dev", IFNAME)
        await _tool(ip, "-n", self.netns, "link", "set", IFNAME, "up")
        await _tool(ip, "-n", self.netns, "link", "set", "lo", "up")
        t = hosts.tools
        argv = [t["nsenter"], f"--net={NETNS_DIR / self.netns}", t["unshare"], "--uts", "--mount",
                "--propagation", "private", "--", t["bash"], "-c",
                _holder_script(self.name, hosts.hosts_file, hosts.shared)]
        holder = await asyncio.create_subprocess_exec(
            *tied_argv(argv, signal.SIGKILL), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, cwd="/")
        self._holder = holder
        assert holder.stdout is not None and holder.stderr is not None
        with anyio.move_on_after(HOLDER_START_TIMEOUT_S):
            line = await holder.stdout.readline()
        if line.strip() != b"ready":
            if holder.returncode is None:
                holder.kill()
            err = (await holder.stderr.read()).decode(errors="replace").strip()
            await holder.wait()
            raise HostsUnavailable(f"host {self.name}'s holder (`unshare --uts --mount` in network namespace "
                                   f"{self.netns}) did not start: {err or 'no ready line within the timeout'}")
        self._mount_ns = _mount_ns(holder.pid)

    async def _kill(self) -> None:
        """Every process on the host stopped (SIGSTOP, so that none forks a child the scan misses), then all
        SIGKILLed at once, as a machine dies; then its network namespace (and link) removed. Its /dev/shm and /tmp
        tmpfs go with the last process of its mount namespace."""
        if self._mount_ns is not None:
            stopped: set[int] = set()
            while new := self.processes() - stopped:
                for pid in new:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                stopped |= new
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(KILL_TIMEOUT_S):
                if self._holder is not None:
                    await self._holder.wait()
                while self.processes():  # noqa: ASYNC110 (not all our children: nothing to wait on)
                    await anyio.sleep(SPAWN_POLL_S)
        elif self._holder is not None and self._holder.returncode is None:
            self._holder.kill()
            await self._holder.wait()
        self._holder = None
        self._mount_ns = None
        if self.netns in namespaces():
            ip = self._hosts.tools["ip"]
            # the link first: a deleted namespace's devices go later, in the kernel's own time, and the restarted
            # host's veth must not meet the old one's switch end
            await _tool(ip, "-n", self._hosts.switch, "link", "delete", f"p{self.index}", check=False)  # if made
            await _tool(ip, "netns", "delete", self.netns)


class Hosts(Sequence[Host]):
    """The hosts of one :func:`test_hosts`: ``hosts[i]``, ``len(hosts)``, ``hosts.names`` (name -> address), and
    the faults: ``kill``, ``restart``, ``partition``, ``heal``."""

    def __init__(self, n: int, shared: Iterable[Path | str], workdir: Path) -> None:
        self.prefix = f"{_prefix()}{next(_instances)}-"
        self.switch = f"{self.prefix}sw"
        self.shared = _shared_under_tmp(shared)
        self.tools = {tool: shutil.which(tool) or tool for tool in TOOLS}
        self._hosts = [Host(self, i) for i in range(n)]
        self.names = {h.name: h.address for h in self._hosts}
        self.hosts_file = workdir / "hosts"
        self.hosts_file.write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n"
                                   + "".join(f"{h.address}\t{h.name}\n" for h in self._hosts))

    @overload
    def __getitem__(self, index: int) -> Host: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Host]: ...
    def __getitem__(self, index: int | slice) -> Host | Sequence[Host]:
        return self._hosts[index]

    def __len__(self) -> int:
        return len(self._hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts)

    async def kill(self, i: int) -> None:
        """Host ``i`` dies as a machine does: every process on it SIGKILLed at once, its memory (/dev/shm, /tmp)
        and its link gone."""
        await self._hosts[i]._kill()

    async def restart(self, i: int) -> None:
        """Host ``i`` back (after :meth:`kill`, or killed now if it still runs): the same name and address, no
        process but its holder, an empty /dev/shm and /tmp."""
        host = self._hosts[i]
        await host._kill()
        await host._start()

    async def partition(self, i: int, j: int | None = None) -> None:
        """Cut host ``i`` off: its link to the switch down (processes keep running, packets stop). With ``j``:
        only the traffic between hosts ``i`` and ``j``, both ways, with blackhole routes inside the two hosts (no
        packet passes; a send there fails at once with EINVAL rather than timing out, as this machine has neither
        nftables nor iptables for a silent drop)."""
        await self._link(i, j, cut=True)

    async def heal(self, i: int, j: int | None = None) -> None:
        """Undo :meth:`partition` with the same arguments."""
        await self._link(i, j, cut=False)

    async def _link(self, i: int, j: int | None, *, cut: bool) -> None:
        ip = self.tools["ip"]
        if j is None:
            await _tool(ip, "-n", self.switch, "link", "set", f"p{i}", "down" if cut else "up")
            return
        for a, b in ((i, j), (j, i)):
            await _tool(ip, "-n", self._hosts[a].netns, "route", "add" if cut else "delete", "blackhole",
                        f"{self._hosts[b].address}/32")

    async def _start(self) -> None:
        ip = self.tools["ip"]
        await _tool(ip, "netns", "add", self.switch)
        await _tool(ip, "-n", self.switch, "link", "add", "br0", "type", "bridge")
        await _tool(ip, "-n", self.switch, "link", "set", "br0", "up")
        for host in self._hosts:
            await host._start()

    async def _close(self) -> None:
        errors: list[BaseException] = []
        for host in self._hosts:
            try:
                await host._kill()
            except Exception as exc:
                errors.append(exc)
        remove_namespaces(sorted(n for n in namespaces() if n.startswith(self.prefix)))
        if errors:
            raise errors[0]


@contextlib.asynccontextmanager
async def test_hosts(n: int, *, shared: Iterable[Path | str] = DEFAULT_SHARED,
                     skip_unavailable: bool = True) -> AsyncIterator[Hosts]:
    """``async with test_hosts(n) as hosts:`` N hosts, removed on exit (processes, namespaces, switch, mounts)
    even when the body raises or a host was killed. Skips the test where namespaces cannot be made, saying why (or
    raises :class:`HostsUnavailable`, for a benchmark, with ``skip_unavailable=False``)."""
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"test_hosts({n}): the hosts' subnet {SUBNET}.0/{PREFIX_LEN} holds 1 to {MAX_HOSTS} hosts")

    def unavailable(reason: str) -> NoReturn:
        if skip_unavailable:
            pytest.skip(reason)
        raise HostsUnavailable(reason)

    reason = unavailable_reason()
    if reason is not None:
        unavailable(reason)
    _sweep_dead()
    with tempfile.TemporaryDirectory(prefix="stead-hosts-") as workdir:
        hosts = Hosts(n, shared, Path(workdir))
        try:
            try:
                await hosts._start()
            except HostsUnavailable as exc:
                if hosts[0].alive:  # the first host started: this machine can make hosts, and something else broke
                    raise
                unavailable(f"test hosts cannot be made here: {exc}")
            yield hosts
        finally:
            with anyio.CancelScope(shield=True):
                await hosts._close()


test_hosts.__test__ = False  # type: ignore[attr-defined]  # a fixture, not a test, wherever it is imported
