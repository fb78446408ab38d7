"""``stead run`` supervises the job's master instead of being it.

The master runs in a child process. The supervisor stays small (no torch, no
event loop, no threads) and does five things:

- it holds the master's listening socket and hands it to every master it starts,
  so a restarted master answers where the one that died did: the agents'
  reconnects simply wait in the socket's backlog until it accepts them;
- it holds the job's token (found or made once, see :func:`stead.cli.run.run_token`)
  and hands it to every master it starts (``STEAD_JOB_TOKEN``), so a restarted
  master answers the agents and workers that hold it: the store keeps only a
  verifier of it;
- it starts a new master when one dies while the job runs (killed, or failed
  after it had started: exit code :data:`EXIT_MASTER_CRASHED`), up to
  ``master_max_restarts`` times; the new master replays the job's log and adopts
  the agents, whose workers kept stepping;
- it forwards SIGINT and SIGTERM to the master, which stops the job cleanly (a
  stop asked for while no master runs is passed to the next one);
- it is the agents' subreaper: agents orphaned by a dead master are re-parented
  to it, so it reaps them, and stops any still running when it gives up.

A master that ran the job to its end exits with the job's code (0 succeeded, 1
failed, 130 stopped, 2 bad input), which the supervisor returns.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

import structlog

from stead.core.config import Settings
from stead.core.jobtoken import JOB_TOKEN_ENV
from stead.core.procs import become_subreaper, children, signal_group, signal_leader, tied_argv

__all__ = ["EXIT_MASTER_CRASHED", "LISTEN_FD_ENV", "STOP_ENV", "TAKEOVER_ENV", "listen", "stop_orphans", "supervise"]

log = structlog.get_logger("stead.supervisor")

#: set for a supervised master: the file descriptor of the listening socket it serves on
LISTEN_FD_ENV = "STEAD_MASTER_LISTEN_FD"
#: set for a master started after another died: it takes the job over as it is (no resume, no new round)
TAKEOVER_ENV = "STEAD_MASTER_TAKEOVER"
#: set when a stop was asked for while no master ran: the new master stops the job (value: the reason)
STOP_ENV = "STEAD_MASTER_STOP"
#: a supervised master that failed after it had started exits with this (EX_SOFTWARE): start another
EXIT_MASTER_CRASHED = 70

_FORWARDED = (signal.SIGINT, signal.SIGTERM)


class _MasterRestarter:
    """Keeps the job's master running: starts it on the socket and with the token it holds, starts another when
    one dies while the job runs, passes signals on, and reaps (and, at the end, stops) the agents left to it."""

    def __init__(self, argv: Sequence[str], settings: Settings, host: str, token: str,
                 master_command: Sequence[str] | None = None, listener: socket.socket | None = None) -> None:
        self.argv = list(argv)
        self.settings = settings
        self.host = host
        self.listener = listener
        self.token = token
        #: what runs a master: ``stead run ARGV`` in this Python
        self.master_command = list(master_command or (sys.executable, "-m", "stead", "run", *self.argv))
        self.master: subprocess.Popen[bytes] | None = None
        self.stop: signal.Signals | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self.stop = signal.Signals(signum)
        if self.master is not None and self.master.returncode is None:
            signal_leader(self.master.pid, self.stop)

    def run(self) -> int:
        become_subreaper()
        listener = self.listener or listen(self.host)
        previous = {sig: signal.signal(sig, self.on_signal) for sig in _FORWARDED}
        try:
            return self._loop(listener)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            listener.close()
            self._stop_orphans()

    def _loop(self, listener: socket.socket) -> int:
        restarts = 0
        while True:
            started = time.monotonic()
            self.master = self._start(listener, takeover=restarts > 0)
            code = self._wait_master(self.master)
            if not _crashed(code):
                return code
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else "failed"
            if restarts >= self.settings.master_max_restarts:
                print(f"stead: the master (pid {self.master.pid}) {how}, and it was restarted "
                      f"{restarts} time(s) already (master_max_restarts); giving up: its nodes are stopped, and "
                      "`stead run` with the same job name resumes the job from its log", file=sys.stderr)
                log.error("master_restarts_exhausted", pid=self.master.pid, exit_code=code, restarts=restarts)
                return 1
            restarts += 1
            print(f"stead: the master (pid {self.master.pid}) {how} after {time.monotonic() - started:.1f} s; "
                  f"starting a new one ({restarts} of {self.settings.master_max_restarts}): the workers keep "
                  "running and the new master adopts them", file=sys.stderr)
            log.warning("master_restarting", pid=self.master.pid, exit_code=code, restart=restarts,
                        max_restarts=self.settings.master_max_restarts)

    def _start(self, listener: socket.socket, *, takeover: bool) -> subprocess.Popen[bytes]:
        env = {**os.environ, LISTEN_FD_ENV: str(listener.fileno()), JOB_TOKEN_ENV: self.token}
        if takeover:
            env[TAKEOVER_ENV] = "1"
        if self.stop is not None:
            env[STOP_ENV] = f"stopped by {self.stop.name}"
        # its own process group: a Ctrl-C in the terminal reaches the supervisor, which passes it on once;
        # SIGTERM when the supervisor dies: the master then stops the job cleanly
        command = tied_argv(self.master_command, signal.SIGTERM)
        return subprocess.Popen(command, env=env, pass_fds=(listener.fileno(),), process_group=0)

    def _wait_master(self, master: subprocess.Popen[bytes]) -> int:
        """Reap children until ``master`` exits (agents orphaned to us are reaped on the way); its exit code
        (negative: the signal that killed it)."""
        while True:
            pid, status = os.waitpid(-1, 0)  # a signal runs its handler and the wait goes on (PEP 475)
            if pid == master.pid:
                master.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait for it again
                return master.returncode
            log.debug("orphan_reaped", pid=pid, status=os.waitstatus_to_exitcode(status))

    def _stop_orphans(self) -> None:
        stop_orphans(self.settings)


def _crashed(code: int) -> bool:
    """Whether a master that exited with ``code`` died before the job ended (killed, or failed after start)."""
    return code < 0 or code == EXIT_MASTER_CRASHED


def stop_orphans(settings: Settings) -> None:
    """Stop the children a dead master left with this process (its subreaper): SIGTERM, up to
    shutdown_grace_s, then SIGKILL."""
    orphans = children()
    if not orphans:
        return
    log.warning("orphans_stopping", pids=sorted(orphans), grace_s=settings.shutdown_grace_s)
    for pid in orphans:
        signal_leader(pid, signal.SIGTERM)
    deadline = time.monotonic() + settings.shutdown_grace_s
    while orphans and time.monotonic() < deadline:
        orphans = _reap(orphans)
        time.sleep(0.05)
    for pid in orphans:
        signal_group(pid, signal.SIGKILL)  # an agent leads its own process group: its workers too
        signal_leader(pid, signal.SIGKILL)
    while orphans:
        orphans = _reap(orphans)
        time.sleep(0.01)


def _reap(pids: set[int]) -> set[int]:
    """The ``pids`` still running after reaping those that exited."""
    running = set()
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            done = pid
        if not done:
            running.add(pid)
    return running


def listen(host: str, port: int = 0) -> socket.socket:
    """The master's listening socket (a free port unless ``port``), inheritable, kept across masters."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def supervise(argv: Sequence[str], settings: Settings, *, token: str, host: str = "127.0.0.1",
              master_command: Sequence[str] | None = None, listener: socket.socket | None = None) -> int:
    """Run ``stead run ARGV``'s master in a child process, restarted when it dies, each given the job's ``token``;
    the job's exit code.

    ``master_command`` runs a master instead of ``python -m stead run ARGV`` (a test's small stand-in): it gets
    the same environment (:data:`LISTEN_FD_ENV`, :data:`TAKEOVER_ENV`, :data:`STOP_ENV`, the job token) and its
    exit code means the same (:data:`EXIT_MASTER_CRASHED` or killed: start another; any other: the job's code).
    ``listener``: the socket to serve on (a job over several hosts serves at the address its flags give), which
    the supervisor closes when it ends; default: a free port on ``host``.
    """
    return _MasterRestarter(argv, settings, host, token, master_command, listener).run()
