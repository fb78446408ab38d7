"""The zygote process: imports torch once, then forks workers on request.

Runs as a child of the agent (started by :class:`stead.core.agent.zygote.Zygote`) and
imports only the standard library itself, so that what is preloaded is exactly what was
asked for. It never runs a torch op: forking after torch's thread pools started can
deadlock the child. Each request arrives on a SOCK_SEQPACKET socket as one JSON message
with the worker's stdout/stderr fds attached (SCM_RIGHTS); the zygote forks, the child
turns itself into a fresh-looking ``python [-u] script.py args`` (or ``python -m mod``)
and runs the target in-process, or execs anything else. The zygote reaps its children
and reports every exit on the same socket, so the agent learns of it at once.

Messages (JSON objects, ``op`` says which)::

    agent -> zygote   fork {id, argv, env, cwd} + fds [stdout, stderr]
                      preload {id, modules}
    zygote -> agent   ready {pid, failed, threads, seconds}
                      forked {id, pid, mode, reason}      mode: script | module | exec
                      fork_failed {id, error}
                      preloaded {id, failed, threads}
                      exit {pid, exit_code, signal}
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import dataclasses
import errno
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PythonTarget",
    "STARTUP_ENV",
    "decode",
    "die_with",
    "encode",
    "main",
    "parse_python_argv",
    "set_pdeathsig",
    "startup_env_mismatch",
]

#: largest message either side sends (a worker's environment dominates)
MAX_MESSAGE_BYTES = 1 << 20

_PR_SET_PDEATHSIG = 1
_IGNORED_BY_PYTHON = frozenset({signal.SIGPIPE, signal.SIGXFSZ})
#: ignored by the zygote and, unless the script handles it, by its workers: Slurm's time-limit warning
#: (--signal=USR1@SECONDS), sent to every process of the step, is the agent's to answer (it persists the newest
#: checkpoint); by default it would end them
_IGNORED_IN_WORKERS = frozenset({signal.SIGUSR1})
_BLOCKED_ACROSS_FORK = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD})

#: variables read once when the interpreter or a native library (OpenMP, OpenBLAS, the
#: dynamic loader, the C locale) starts; a worker whose value differs from the zygote's
#: cannot be forked faithfully and is exec'd instead
STARTUP_ENV = (
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LANG", "LC_ALL", "LC_CTYPE",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "GOMP_CPU_AFFINITY",
    "PYTHONHOME", "PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONPLATLIBDIR", "PYTHONWARNINGS", "PYTHONIOENCODING",
    "PYTHONUTF8", "PYTHONINTMAXSTRDIGITS", "PYTHONNODEBUGRANGES", "TORCH_LOGS",
)


def encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    value = json.loads(data)
    if not isinstance(value, dict) or not isinstance(value.get("op"), str):
        raise ValueError(f"zygote message without an op: {data[:200]!r}")
    return value


def set_pdeathsig(expected_parent: int, signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent thread dies.

    Returns False when the parent is already gone (the race ``prctl`` alone cannot close).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    return os.getppid() == expected_parent


def die_with(parent: int) -> None:
    """SIGKILL when ``parent`` dies, and at once if it died already (since this process was forked): a zygote's
    workers die of SIGKILL with it whichever came first, the zygote's death or the worker's ``prctl``."""
    if not set_pdeathsig(parent):
        os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class PythonTarget:
    """What ``python [flags] script|-m module args`` would run."""

    kind: str  # "script" | "module"
    name: str  # script path as given, or module name
    args: tuple[str, ...]
    unbuffered: bool
    dont_write_bytecode: bool


def parse_python_argv(argv: Sequence[str], env: Mapping[str, str], python: str) -> PythonTarget | None:
    """The python target of ``argv``, or None when it must be exec'd.

    Only the interpreter ``python`` itself with the flags ``-u``/``-B`` (which can be
    honoured after fork) and a script or ``-m module`` qualifies.
    """
    if not argv:
        return None
    exe = argv[0]
    if os.sep not in exe:
        import shutil

        found = shutil.which(exe, path=env.get("PATH", os.defpath))
        exe = found or exe
    if os.path.abspath(exe) != os.path.abspath(python):
        return None
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    no_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or (rest.pop(0) if rest else "")
            if not module:
                return None
            return PythonTarget("module", module, tuple(rest), unbuffered, no_bytecode)
        if arg.startswith("-") and len(arg) > 1 and arg != "--":
            flags = arg[1:]
            if not set(flags) <= {"u", "B"}:
                return None
            unbuffered = unbuffered or "u" in flags
            no_bytecode = no_bytecode or "B" in flags
            continue
        if arg in ("-", "--"):
            return None
        return PythonTarget("script", arg, tuple(rest), unbuffered, no_bytecode)
    return None


def startup_env_mismatch(worker_env: Mapping[str, str], zygote_env: Mapping[str, str]) -> list[str]:
    """Names of start-up variables whose value differs between worker and zygote."""
    return [name for name in STARTUP_ENV if worker_env.get(name) != zygote_env.get(name)]


def _module_names_in(directory: str) -> set[str]:
    try:
        entries = os.listdir(directory)
    except OSError:
        return set()
    names = set()
    suffixes = tuple(importlib.machinery.all_suffixes())
    for entry in entries:
        if entry.endswith(suffixes):
            names.add(entry.split(".", 1)[0])
        elif os.path.isfile(os.path.join(directory, entry, "__init__.py")):
            names.add(entry)
    return names


def _shadowed(directories: Sequence[str]) -> list[str]:
    """Already-imported top-level modules that the worker's own path would shadow."""
    loaded = {name for name in sys.modules if "." not in name and not name.startswith("__")}
    hits = []
    for directory in directories:
        for name in sorted(_module_names_in(directory) & loaded):
            origin = getattr(sys.modules[name], "__file__", None)
            if origin is None:  # built-in modules cannot be shadowed by files in any process
                continue
            if not os.path.abspath(origin).startswith(os.path.abspath(directory) + os.sep):
                hits.append(name)
    return hits


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one fork request will run: a python target, or exec (with the reason)."""

    target: PythonTarget | None
    path: tuple[str, ...]
    reason: str


class _Zygote:
    def __init__(self, sock: socket.socket, base_path: Sequence[str], env: Mapping[str, str]) -> None:
        self.sock = sock
        self.env = dict(env)
        self.pid = os.getpid()
        own_pythonpath = {os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
        self.base_path = [p for p in base_path if os.path.abspath(p) not in own_pythonpath]
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        #: threads after the start-up imports; a preload that starts more makes forking unsafe
        self.baseline_threads: int | None = None

    def send(self, message: Mapping[str, Any]) -> None:
        self.sock.sendall(encode(message))

    def import_modules(self, modules: Sequence[str]) -> dict[str, str]:
        failed = {}
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # a preload failure is reported, never fatal
                failed[name] = f"{type(exc).__name__}: {exc}"
        return failed

    def plan(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> _Plan:
        target = parse_python_argv(argv, env, sys.executable)
        if target is None:
            return _Plan(None, (), "not a plain python script or -m module command")
        threads = _thread_count()
        if self.baseline_threads is not None and threads > self.baseline_threads:
            return _Plan(None, (), f"a preloaded module started threads ({threads}): forking could deadlock")
        mismatch = startup_env_mismatch(env, self.env)
        if mismatch:
            return _Plan(None, (), "start-up variables differ from the zygote's: " + ",".join(mismatch))
        if target.kind == "script":
            script = os.path.join(cwd, target.name)
            if not os.path.isfile(script):
                return _Plan(None, (), "script is not a regular file")
            first = os.path.dirname(os.path.realpath(script))
        else:
            first = os.path.realpath(cwd)
        extra = [os.path.abspath(os.path.join(cwd, p)) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        shadowed = _shadowed([first, *extra])
        if shadowed:
            return _Plan(None, (), "worker's path shadows preloaded modules: " + ",".join(shadowed))
        return _Plan(target, (first, *extra, *self.base_path), "")

    def handle(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message["op"]
        if op == "preload":
            failed = self.import_modules(message["modules"])
            self.send({"op": "preloaded", "id": message["id"], "failed": failed, "threads": _thread_count()})
        elif op == "fork":
            self.fork(message, fds)
        else:
            self.send({"op": "error", "error": f"unknown op {op!r}"})

    def fork(self, message: dict[str, Any], fds: list[int]) -> None:
        try:
            if len(fds) != 2:
                raise ValueError(f"fork request carries {len(fds)} fds, expected 2 (stdout, stderr)")
            argv = [str(a) for a in message["argv"]]
            env = {str(k): str(v) for k, v in message["env"].items()}
            cwd = str(message["cwd"])
            plan = self.plan(argv, env, cwd)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            # signals stay pending until the child has reset its handlers, then act as in any fresh process
            signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED_ACROSS_FORK)
            try:
                pid = os.fork()
            finally:
                if os.getpid() == self.pid:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, _BLOCKED_ACROSS_FORK)
        except Exception as exc:  # reported to the agent, which falls back to spawn
            for fd in fds:
                os.close(fd)
            self.send({"op": "fork_failed", "id": message.get("id"), "error": f"{type(exc).__name__}: {exc}"})
            return
        if pid == 0:
            code = 70  # EX_SOFTWARE: the child must never return into the zygote's loop
            try:
                code = self.become_worker(plan, argv, env, cwd, fds)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        mode = plan.target.kind if plan.target else "exec"
        self.send({"op": "forked", "id": message["id"], "pid": pid, "mode": mode, "reason": plan.reason})

    def become_worker(self, plan: _Plan, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> int:
        os.setsid()
        die_with(self.pid)
        _reset_signals()
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        if plan.target is None:
            return _exec(argv, env, cwd)
        return _run_python(plan.target, plan.path, argv, env, cwd)

    def reap(self) -> None:
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid == 0:
                return
            pid = info.si_pid
            with contextlib.suppress(OSError):  # the exited worker's children (dataloaders) must not outlive it
                os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            self.children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            exit_code, signum = (code, None) if code >= 0 else (None, -code)
            self.send({"op": "exit", "pid": pid, "exit_code": exit_code, "signal": signum})

    def serve(self) -> None:
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.reap()
        sock_fd = self.sock.fileno()
        while True:
            readable, _, _ = select.select([sock_fd, self.wake_r], [], [])
            if self.wake_r in readable:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                self.reap()
            if sock_fd in readable:
                data, fds, flags, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 2, socket.MSG_CMSG_CLOEXEC)
                if not data:
                    return
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    for fd in fds:
                        os.close(fd)
                    self.send({"op": "error", "error": "request too large; it was dropped"})
                    continue
                self.handle(decode(data), fds)

    def shutdown(self) -> None:
        """Kill every worker's process group: workers, and the children they started."""
        for pid in list(self.children):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)

    def on_parent_death(self, signum: int, frame: types.FrameType | None) -> None:
        if os.getpid() != self.pid:  # a just-forked child that has not reset its handlers: die as told
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.shutdown()
        os._exit(1)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _reset_signals() -> None:
    """Dispositions of a fresh interpreter: Python's SIGINT handler, SIGPIPE/SIGXFSZ ignored."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        wanted: Any = signal.SIG_DFL
        if signum == signal.SIGINT:
            wanted = signal.default_int_handler
        elif signum in _IGNORED_BY_PYTHON or signum in _IGNORED_IN_WORKERS:
            wanted = signal.SIG_IGN
        try:
            current = signal.getsignal(signum)
            if current is not None and current != wanted:
                signal.signal(signum, wanted)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _exec(argv: list[str], env: dict[str, str], cwd: str) -> int:
    try:
        os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        os.write(2, f"stead: cannot execute {argv[0]!r} in {cwd!r}: {exc}\n".encode(errors="replace"))
        return 126 if exc.errno in (errno.EACCES, errno.ENOEXEC) else 127
    return 127  # not reached: execvpe only returns by raising


def _reopen_stdio(unbuffered: bool) -> None:
    """Fresh sys.stdout/sys.stderr on the new fds 1 and 2, buffered like ``python [-u]``."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    errors = getattr(sys.stdout, "errors", None) or "strict"
    streams: list[io.TextIOWrapper[Any]] = []
    for fd, name in ((1, "<stdout>"), (2, "<stderr>")):
        raw = io.FileIO(fd, "w", closefd=False)
        raw.name = name
        err_mode = "backslashreplace" if fd == 2 else errors
        buffer: Any = raw if unbuffered else io.BufferedWriter(raw)
        line_buffering = not unbuffered and (fd == 2 or raw.isatty())
        streams.append(io.TextIOWrapper(buffer, encoding, err_mode, line_buffering=line_buffering,
                                        write_through=unbuffered))
    sys.stdout = sys.__stdout__ = streams[0]  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = streams[1]  # type: ignore[misc]


def _prepare_interpreter(target: PythonTarget, path: Sequence[str], argv: list[str], env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = list(path)
    sys.orig_argv = list(argv)
    sys.dont_write_bytecode = target.dont_write_bytecode
    importlib.invalidate_caches()
    _reopen_stdio(target.unbuffered)
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a fresh process seeds numpy's global generator from the OS
        numpy_random.seed()


def _run_script(target: PythonTarget) -> None:
    # like the interpreter: joined with the cwd, not normalised ("work/../code/x.py" stays)
    path = os.path.join(os.getcwd(), target.name)
    sys.argv = [target.name, *target.args]
    try:
        with io.open_code(path) as handle:
            source = handle.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __spec__=None,
        __package__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _run_module(target: PythonTarget) -> None:
    sys.argv = ["-m", *target.args]
    try:
        found = importlib.util.find_spec(target.name)
        problem = f"No module named {target.name}"
    except (ImportError, ValueError) as exc:
        found = None
        problem = f"Error while finding module specification for {target.name!r} ({type(exc).__name__}: {exc})"
    if found is None:
        print(f"{sys.executable}: {problem}", file=sys.stderr)
        raise SystemExit(1)
    runpy.run_module(target.name, run_name="__main__", alter_sys=True)


def _user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without the zygote's and runpy's own frames, as ``python script.py`` prints it."""
    ours = {__file__, getattr(runpy, "__file__", None)}
    while tb is not None and (tb.tb_frame.f_code.co_filename in ours
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb


def _exit_status(code: object) -> int:
    """The process exit status of ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(status: int) -> int:
    """What the interpreter does at exit: join threads, run atexit, flush the streams."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(BaseException):  # exiting regardless, as the interpreter does
            shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            if status == 0:
                status = 120  # what the interpreter returns when flushing stdout fails at exit
    return status


def _set_title(title: str) -> None:
    """What ``ps`` shows for this process (the fork would otherwise show the zygote's command)."""
    try:
        import setproctitle
    except ImportError:  # an optional nicety
        return
    setproctitle.setproctitle(title)


def _bootstrap_worker(argv: list[str], env: Mapping[str, str]) -> None:
    """What every worker gets before the script runs: its own title, automatic step detection."""
    _set_title(" ".join(argv))
    from stead.core.logging import configure_worker_logging

    configure_worker_logging()
    from stead.core.worker.progress import install_backward_clock, install_stack_dumps, install_step_hook

    install_stack_dumps()
    if env.get("STEAD_AUTO_STEP", "1") != "0":
        install_step_hook()
    install_backward_clock()


def _run_python(target: PythonTarget, path: Sequence[str], argv: list[str], env: dict[str, str], cwd: str) -> int:
    interrupted = False
    try:
        os.chdir(cwd)
        _prepare_interpreter(target, path, argv, env)
        _bootstrap_worker(argv, env)
        if target.kind == "script":
            _run_script(target)
        else:
            _run_module(target)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException as exc:  # the interpreter's top level: print and exit 1
        interrupted = isinstance(exc, KeyboardInterrupt)
        try:
            trimmed = _user_traceback(exc.__traceback__)
            sys.excepthook(type(exc), exc.with_traceback(trimmed), trimmed)
        except BaseException:
            traceback.print_exception(exc)
        status = 1
    status = _finish(status)
    if interrupted:  # like the interpreter: die of SIGINT so the parent sees the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def main(base_path: Sequence[str], args: Sequence[str]) -> None:
    """Entry point: ``args`` = parent pid, socket fd, comma-separated modules to preload."""
    started = time.monotonic()
    env = dict(os.environ)
    parent, fd, preload = int(args[0]), int(args[1]), [m for m in args[2].split(",") if m]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's to handle
    for signum in _IGNORED_IN_WORKERS:
        signal.signal(signum, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    zygote = _Zygote(sock, base_path, env)
    _set_title(f"stead zygote of agent {parent}")
    # SIGTERM, not SIGKILL, on the agent's death: the zygote first kills its workers' process groups,
    # so that even the workers' own children (killed with nobody left to stop them) do not outlive the agent
    signal.signal(signal.SIGTERM, zygote.on_parent_death)
    if not set_pdeathsig(parent, signal.SIGTERM):
        os._exit(1)
    try:
        failed = zygote.import_modules(preload)
        zygote.baseline_threads = _thread_count()
        zygote.send({"op": "ready", "pid": zygote.pid, "failed": failed, "threads": zygote.baseline_threads,
                     "seconds": round(time.monotonic() - started, 4)})
        zygote.serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        zygote.shutdown()
    os._exit(0)
