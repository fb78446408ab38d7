"""``stead run``: torchrun's command line, stead's control plane.

Parses the torchrun-compatible flags, starts an embedded master on the chosen
store, lets the platform (found through the ``stead.platforms`` entry points)
launch one agent per node, waits for the job to end and prints what happened.
Bad input is one clear line on stderr and exit code 2, before anything starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog

from stead.cli.on_hosts import (
    hosts_platform,
    hosts_token,
    join,
    listening_host,
    serving_socket,
    slurm_platform,
    tell_hosts,
)
from stead.cli.run_args import ELECTED_BACKENDS, PLATFORM_GROUP, SLURM_PLATFORM, parse_run_args
from stead.cli.slurm_signals import slurm_stop_cause, slurm_warnings
from stead.cli.supervisor import EXIT_MASTER_CRASHED, LISTEN_FD_ENV, STOP_ENV, TAKEOVER_ENV, supervise
from stead.core.config import Settings
from stead.core.entrypoints import load_named
from stead.core.errors import ConfigError, SteadError
from stead.core.events import JobResumed, JobStopped, JobSubmitted
from stead.core.jobtoken import JOB_TOKEN_ENV, default_token_file, find_token
from stead.core.master import Master, MasterConfig, open_store_retrying
from stead.core.platform import NodeSpec, Platform
from stead.core.rpc import new_token, tls_files
from stead.core.rpc.address import parse_address
from stead.core.runspec import RUN_SPEC_ENV, RunConfig, spec_text
from stead.core.statemachine import JobPhase, JobState
from stead.core.store import public_store_url
from stead.core.views.display import format_status

__all__ = ["agent_spec_factory", "job_submitted", "load_platform", "main", "run_job", "run_token", "serve_job",
           "started_job"]

log = structlog.get_logger("stead.run")


async def load_platform(name: str, settings: Settings) -> Platform:
    """The platform registered under ``name`` in the ``stead.platforms`` entry-point group."""
    _, factory, _ = load_named(PLATFORM_GROUP, name, what="platform", hint="pick one with --platform")
    platform = factory(settings=settings)  # type: ignore[operator]
    if inspect.isawaitable(platform):
        platform = await platform
    return platform  # type: ignore[no-any-return]


def platform_launcher(name: str) -> Any:
    """The platform's own way to run a whole job (``launch_job(config, argv) -> exit code``: its master runs in
    the platform, as a Kubernetes pod), or None when `stead run` runs the master here."""
    _, factory, _ = load_named(PLATFORM_GROUP, name, what="platform", hint="pick one with --platform")
    return getattr(factory, "launch_job", None)


def agent_spec_factory(config: RunConfig) -> Any:
    """How the master starts a node's agent for the job ``config`` describes: the agent gets ``config`` itself,
    typed (:func:`~stead.core.runspec.spec_text`), not the command line to parse again."""
    run_spec = spec_text(config)

    def spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
        command = (sys.executable, "-m", "stead", "agent", "--master", address, "--token-file", token_file,
                   "--node-id", node_id, "--incarnation", str(incarnation), "--log-format", config.log_format,
                   "--log-level", config.log_level)
        spare = (sys.executable, "-m", "stead", "agent", "--master", address, "--token-file", token_file, "--spare",
                 "--log-format", config.log_format, "--log-level", config.log_level)
        return NodeSpec(job=config.job_name, node_id=node_id, incarnation=incarnation, command=command,
                        env={RUN_SPEC_ENV: run_spec}, cwd=os.getcwd(), nproc=config.nproc_per_node,
                        cleanup_command=(*command, "--cleanup"), spare_command=spare)

    return spec


def job_submitted(config: RunConfig) -> JobSubmitted:
    """The event that submits the job ``config`` describes."""
    return JobSubmitted(
        job=config.job_name, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node, max_restarts=config.max_restarts,
        max_node_relaunches=config.max_node_relaunches, entrypoint=config.entrypoint,
        last_call_timeout_s=config.last_call_timeout_s, join_timeout_s=config.join_timeout_s,
        decision_timeout_s=decision_timeout(config), health_check=health_mode(config),
        health_timeout_s=config.settings.health_timeout_s, health_slow_factor=config.settings.health_slow_factor,
        start_nodes=config.start_nodes, resize_wait_s=config.settings.resize_wait_s,
        grow_window_s=config.settings.grow_window_s,
    )


def decision_timeout(config: RunConfig) -> float:
    """How long a worker failure waits for a plugin's decision: the decision_timeout_s setting; over several
    hosts also past a node's heartbeat timeout. A host lost is seen first as its peers' collective errors, and
    its loss only once its heartbeats are missed for heartbeat_timeout_s: the diagnosis waits for that cause
    (a lost node's relaunch spends no restart), which the default policy must not decide before."""
    settings = config.settings
    if not config.hosts_endpoint:
        return settings.decision_timeout_s
    return settings.decision_timeout_s + settings.heartbeat_timeout_s + 2 * settings.heartbeat_interval_s


def health_mode(config: RunConfig) -> str:
    """The job's health check mode: the health_check setting, "auto" resolved for the job's platform: every node
    on Kubernetes, where a bad host is common and a new pod pays a cold start anyway; none on the local platform,
    whose nodes share one machine (a check cannot find a host worse than the others, and a node that failed it
    could only be relaunched on that same machine), so that a lost node is back in about a second."""
    mode = config.settings.health_check
    if mode == "auto":
        return "all" if config.platform == "k8s" else "off"
    return mode


@contextlib.asynccontextmanager
async def started_job(config: RunConfig, *, token_file: str | None = None,
                      host: str = "127.0.0.1", port: int = 0, listen_fd: int | None = None, token: str | None = None,
                      takeover: bool = False, metrics_port: int | None = None,
                      leave_nodes_on_failure: bool = False) -> AsyncIterator[Master]:
    """A master running the job ``config`` describes, submitted.

    ``takeover``: this master replaces one that died while the job ran; a job that is running is taken over
    as it is (its nodes adopted), not resumed. ``token``: the job's token when it is given (a Kubernetes Secret).
    ``leave_nodes_on_failure``: a master that fails with a retryable error leaves the nodes to its successor.
    """
    settings = config.settings
    # fail early and clearly when the store is down; a master taking over a running job waits for it as long as a
    # running master would have ridden the outage out: the job's nodes train on meanwhile
    store_wait_s = settings.retry_deadline_s if takeover else None
    store = await open_store_retrying(config.store_url, settings, deadline_s=store_wait_s)
    await store.close()
    handlers: list[Any] = []
    if config.hosts_endpoint and config.rdzv_backend in ELECTED_BACKENDS:  # this host's `stead run` was elected:
        host = listening_host(listen_fd)  # its master serves where it bound the socket; the hosts find it in etcd
        platform, handlers = hosts_platform(config, await load_platform("local", settings), home=host)
    elif config.hosts_endpoint and config.platform == SLURM_PLATFORM:  # every node of the Slurm job a host step
        platform, handlers = slurm_platform(config, await load_platform("local", settings), token=token,
                                            takeover=takeover)
        host = parse_address(config.hosts_endpoint)[0]
    elif config.hosts_endpoint:  # one job over several machines: this host serves its master at the flags' address
        platform, handlers = hosts_platform(config, await load_platform("local", settings))
        host = parse_address(config.hosts_endpoint)[0]
    else:
        platform = await load_platform(config.platform, settings)
    master_config = MasterConfig(
        job=config.job_name, store_url=config.store_url, settings=settings, platform=platform,
        node_spec=agent_spec_factory(config), plugins=config.plugins, disabled_plugins=config.disabled_plugins,
        token_file=token_file, host=host, port=port, listen_fd=listen_fd, token=token,
        metrics_port=settings.metrics_port if metrics_port is None else metrics_port,
        store_wait_s=store_wait_s, leave_nodes_on_failure=leave_nodes_on_failure, rpc_handlers=handlers,
    )
    async with Master(master_config) as master:
        submitted = job_submitted(config)
        if master.state.phase is JobPhase.NEW:
            await master.submit_job(submitted)
            log.info("job_submitted", job=config.job_name, nodes=f"{config.min_nodes}:{config.max_nodes}",
                     nproc_per_node=config.nproc_per_node, store=public_store_url(config.store_url))
        elif takeover and not master.state.phase.terminal:
            log.info("job_taken_over", job=config.job_name, phase=master.state.phase.value,
                     nodes=sorted(n for n, s in master.state.nodes.items() if s.phase.alive))
        elif takeover and config.rdzv_backend in ELECTED_BACKENDS:  # a standby elected as the job ended: it ended
            log.info("job_ended_before_takeover", job=config.job_name, phase=master.state.phase.value)
        else:
            await _resume(master, config, submitted)
        yield master


#: what a resumed job may not change without --force: (field, the flag that sets it)
_SHAPE = (("min_nodes", "--nnodes"), ("max_nodes", "--nnodes"), ("nproc_per_node", "--nproc-per-node"),
          ("entrypoint", "the script or its arguments"))


async def _resume(master: Master, config: RunConfig, submitted: JobSubmitted) -> None:
    """Run the job of this name again: the same shape and script unless --force."""
    state = master.state
    assert state.spec is not None
    before = state.spec
    changed = tuple(dict.fromkeys(flag for field, flag in _SHAPE
                                  if getattr(before, field) != getattr(submitted, field)))
    if changed and not config.force:
        script = before.entrypoint[2:] if before.entrypoint[1:2] == ("-u",) else before.entrypoint
        was = f"--nnodes {before.min_nodes}:{before.max_nodes} --nproc-per-node {before.nproc_per_node} " + (
            shlex.join(script))
        raise ConfigError(
            f"job {config.job_name!r} ran before ({state.phase.value}) with other {', '.join(changed)}: {was}; "
            "run it with the same flags to resume it, add --force to resume it with the new ones (its checkpoints "
            "must fit), or choose another --job-name to start afresh")
    fields = {f.name: getattr(submitted, f.name) for f in dataclasses.fields(JobSubmitted)}
    await master.submit(JobResumed(**fields, changed=changed))
    step = f"from checkpoint step {state.checkpoint_step}" if state.checkpoint_step is not None else (
        "from its newest checkpoint on disk, if any")
    print(f"stead: resuming job {config.job_name} ({state.phase.value} before; round {state.rdzv.round + 1}) "
          f"{step}", file=sys.stderr)
    log.info("job_resumed", job=config.job_name, previous=state.phase.value, changed=list(changed),
             checkpoint_step=state.checkpoint_step)


def run_token(config: RunConfig) -> str:
    """The token `stead run` gives every master of its job: ``STEAD_JOB_TOKEN``, else the job's token file (its
    agents may still run: a `stead run` of the job before was killed with its master), else a new one."""
    found = find_token(default_token_file(config.job_name))
    if found is not None:
        log.info("job_token_found", job=config.job_name, source=found[1])
        return found[0]
    return new_token()


async def run_job(config: RunConfig, *, listen_fd: int | None = None, takeover: bool = False,
                  stop_reason: str | None = None, started: list[Master] | None = None,
                  token: str | None = None) -> JobState:
    """Run the job to its end under this process's master; ``started`` gets the master once it runs."""
    settings = config.settings
    async with started_job(config, listen_fd=listen_fd, takeover=takeover, token=token,
                           leave_nodes_on_failure=True) as master:
        if started is not None:
            started.append(master)
        if stop_reason is not None and not master.state.phase.terminal:
            await master.submit(JobStopped(reason=stop_reason))
        # the master's own warning from Slurm (under srun, or `--signal=B:USR1@S` in a batch script): logged
        async with slurm_warnings(os.environ), asyncio.TaskGroup() as tasks:
            # an elected master (--rdzv-backend etcd) stops the job on SIGINT only: SIGTERM (its host shutting down)
            # ends it where it stands, and a standby on another host takes the job over
            elected = bool(config.hosts_endpoint) and config.rdzv_backend in ELECTED_BACKENDS
            stops = (signal.SIGINT,) if elected else (signal.SIGINT, signal.SIGTERM)
            helpers = [tasks.create_task(_report_waiting(master)),
                       tasks.create_task(_stop_on_signal(master, signals=stops))]
            await master.wait()
            for helper in helpers:
                helper.cancel()
        if config.hosts_endpoint:  # what the other hosts' `stead run` print and exit with
            tell_hosts(master.config.platform, exit_code=exit_code(master.state),
                       summary=_summary(config, master.state))
        try:
            async with asyncio.timeout(settings.shutdown_grace_s):
                await master.reactor.wait_until(lambda s: not any(n.phase.alive for n in s.nodes.values()))
        except TimeoutError:
            log.warning("nodes_still_running", action="killing them")
        for recovery in master.tracer.completed:
            log.info("recovery", **{k: round(v * 1000, 1) if isinstance(v, float) else v for k, v in recovery.items()},
                     unit="ms")
        return master.state


async def serve_job(config: RunConfig, *, host: str, port: int, token: str | None,
                    metrics_port: int, token_file: str | None = None) -> JobState | None:
    """`stead master --platform NAME -- RUN_ARGS`: this process is the job's master for as long as it runs (in a
    Kubernetes pod, say), taking the job over where an earlier master left it.

    SIGINT stops the job. SIGTERM (the master's pod deleted or evicted) does not: the master leaves, its
    platform detached so that the nodes keep training, and the next master adopts them; returns None then.
    """
    async with started_job(config, host=host, port=port, token=token, takeover=True,
                           metrics_port=metrics_port, token_file=token_file, leave_nodes_on_failure=True) as master:
        print(f"stead master for job {config.job_name!r} listening on {master.address}", flush=True)
        loop = asyncio.get_running_loop()
        leaving = asyncio.Event()

        def leave() -> None:
            detach = getattr(master.config.platform, "detach", None)
            if callable(detach):
                detach()
            log.warning("master_leaving", job=config.job_name, reason="SIGTERM",
                        hint="the job goes on; its next master adopts the nodes")
            leaving.set()

        loop.add_signal_handler(signal.SIGTERM, leave)
        try:
            async with asyncio.TaskGroup() as tasks:
                helpers = [tasks.create_task(_report_waiting(master)), tasks.create_task(_stop_on_signal(
                    master, signals=(signal.SIGINT,)))]
                ended = tasks.create_task(master.wait())
                left = tasks.create_task(leaving.wait())
                await asyncio.wait([ended, left], return_when=asyncio.FIRST_COMPLETED)
                for task in (*helpers, ended, left):
                    task.cancel()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
        if leaving.is_set():
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(config.settings.shutdown_grace_s):
                await master.reactor.wait_until(lambda s: not any(n.phase.alive for n in s.nodes.values()))
        return master.state


#: how often `stead run` says what it is waiting for while nodes have not joined
WAITING_REPORT_S = 10.0


async def _report_waiting(master: Master) -> None:
    """A progress line while the job waits for nodes, so a long wait never looks like a hang."""
    while True:
        await asyncio.sleep(WAITING_REPORT_S)
        state = master.state
        if state.phase in (JobPhase.STARTING, JobPhase.RECOVERING) and state.spec is not None:
            pending = [n for n, s in state.nodes.items() if s.phase.alive and n not in state.joined]
            log.info("waiting_for_nodes", phase=state.phase.value, joined=len(state.joined),
                     min_nodes=state.spec.min_nodes, max_nodes=state.spec.max_nodes, pending=pending)


async def _stop_on_signal(master: Master, *,
                          signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """SIGINT/SIGTERM stop the job cleanly (workers told to stop, event recorded); a second one kills."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        if not received.done():
            received.set_result(signum)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        signum = await received
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    name = signal.Signals(signum).name
    print(f"stead: {name}: stopping job {master.config.job}; press Ctrl-C again to kill it", file=sys.stderr)
    # SIGTERM again while the stop is recorded is not a second stop: Slurm signals every process of its step, and
    # `stead run` passes its own SIGTERM on to this master as well
    repeats = signum == signal.SIGTERM
    if repeats:
        loop.add_signal_handler(signal.SIGTERM, log.info, "sigterm_repeated")
    try:
        # inside a Slurm job a SIGTERM is its time limit, a preemption, a cancel or a node failure: Slurm says which
        cause = await slurm_stop_cause(os.environ, signum)
        if cause is None:
            await master.submit(JobStopped(reason=f"stopped by {name}"))
            return
        log.warning("job_stopping", job=master.config.job, signal=name, cause=cause)
        await master.submit(JobStopped(reason=f"stopped by {name}: {cause}", cause=cause))
    finally:
        if repeats:
            loop.remove_signal_handler(signal.SIGTERM)


def _summary(config: RunConfig, state: JobState) -> str:
    if state.phase is JobPhase.SUCCEEDED:
        return (f"stead: job {config.job_name} succeeded after {state.restarts} restart(s); "
                f"`stead events --job {config.job_name}` shows what happened")
    head = f"stead: job {config.job_name} {state.phase.value}: {state.reason}"
    if state.message.strip():
        rank = f"rank {state.last_failure.rank}" if state.last_failure else "the failing worker"
        tail = "\n".join("    " + line for line in state.message.strip().splitlines()[-15:])
        head += f"\n  last lines of {rank}'s stderr:\n{tail}"
    return head


def main(argv: Sequence[str]) -> int:
    from stead.core.logging import configure_logging, export_log_config
    from stead.core.views.tracing import configure_tracing

    try:
        config = parse_run_args(argv)
    except ConfigError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, level=config.log_level)  # type: ignore[arg-type]
    export_log_config(config.log_format, config.log_level)
    try:
        configure_tracing(config.trace)
    except ConfigError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 2
    listen_fd = os.environ.pop(LISTEN_FD_ENV, None)
    if config.hosts_endpoint and listen_fd is None:
        return _run_on_hosts(config, argv)
    launcher = None if config.hosts_endpoint else platform_launcher(config.platform)
    if launcher is not None:  # the job's master runs where the platform puts it (a Kubernetes pod), not here
        try:
            return int(asyncio.run(launcher(config, argv)))
        except KeyboardInterrupt:
            print(f"stead: stopped following job {config.job_name}; it goes on where it runs", file=sys.stderr)
            return 130
    if listen_fd is None:
        try:
            tls_files(config.settings)  # bad TLS settings fail here, before a master or an agent starts
            job_token = run_token(config)
        except ConfigError as exc:
            print(f"stead run: error: {exc}", file=sys.stderr)
            return 2
        return supervise(argv, config.settings, token=job_token)
    takeover = os.environ.pop(TAKEOVER_ENV, None) is not None
    stop_reason = os.environ.pop(STOP_ENV, None)
    token = os.environ.pop(JOB_TOKEN_ENV, None) or None  # the agents this master starts read the token file
    started: list[Master] = []
    try:
        state = asyncio.run(run_job(config, listen_fd=int(listen_fd), takeover=takeover,
                                    stop_reason=stop_reason, started=started, token=token))
    except KeyboardInterrupt:
        print(f"stead: job {config.job_name} interrupted; its nodes were stopped", file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if started:  # a master that failed while the job ran: `stead run` starts another, which takes it over
            print(f"stead: the master failed while the job ran: {exc!r}", file=sys.stderr)
            log.error("master_crashed", exc_info=True)
            return EXIT_MASTER_CRASHED
        if not isinstance(exc, SteadError):
            raise  # a bug: its traceback, not a restart that would fail the same way
        print(f"stead run: error: {exc}", file=sys.stderr)
        if takeover:  # the job ran under an earlier master: nothing of it is lost
            print(f"stead: job {config.job_name}'s state is kept in its store; its nodes are stopped. Run "
                  f"`stead run` with the same job name (--job-name {config.job_name}) to resume it", file=sys.stderr)
        return 1
    print(_summary(config, state), file=sys.stderr)
    if state.phase not in (JobPhase.STOPPED, JobPhase.SUCCEEDED):
        print(format_status(config.job_name, state), file=sys.stderr)
    return exit_code(state)


def exit_code(state: JobState) -> int:
    """`stead run`'s exit code for a job that ended in ``state``: 0 succeeded, 130 stopped, 1 otherwise."""
    if state.phase is JobPhase.SUCCEEDED:
        return 0
    return 130 if state.phase is JobPhase.STOPPED else 1


def _run_on_hosts(config: RunConfig, argv: Sequence[str]) -> int:
    """torchrun's multi-node flags: this host serves the job's master, or joins the host that does."""
    try:
        tls_files(config.settings)  # bad TLS settings fail here, before anything starts
        # the Slurm platform hands its host steps the token (found or made as on one machine); other hosts' `stead
        # run` must each be given the same one
        token = run_token(config) if config.platform == SLURM_PLATFORM else hosts_token(config)
        listener = serving_socket(config)
    except ConfigError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 2
    if config.rdzv_backend in ELECTED_BACKENDS:  # every host a master candidate: etcd elects one
        from stead.cli.elected import run_elected  # not at import: only a job whose hosts elect its master needs it

        return run_elected(config, argv, token=token, local=lambda: load_platform("local", config.settings),
                           node_spec=agent_spec_factory(config))
    if listener is None and config.platform == SLURM_PLATFORM:
        print(f"stead run: error: the Slurm job's master serves at {config.hosts_endpoint} on this host, but the port "
              "is taken (another `stead run` of this Slurm job, or another program): give another --master-port",
              file=sys.stderr)
        return 2
    if config.platform == SLURM_PLATFORM:
        print(f"stead: job {config.job_name}: this host serves its master at {config.hosts_endpoint}; every node of "
              "the Slurm job runs a host step that joins it (the nodes beyond --nnodes are spares)", file=sys.stderr)
        return supervise(argv, config.settings, token=token, host=parse_address(config.hosts_endpoint)[0],
                         listener=listener)
    if listener is None:
        print(f"stead: job {config.job_name}: joining its master at {config.hosts_endpoint}", file=sys.stderr)
        try:
            return join(config, token=token, node_spec=agent_spec_factory(config),
                        local=lambda: load_platform("local", config.settings))
        except KeyboardInterrupt:
            print(f"stead: stopped; this host's node of job {config.job_name} was stopped", file=sys.stderr)
            return 130
    print(f"stead: job {config.job_name}: this host serves its master at {config.hosts_endpoint}; the other "
          "hosts join it", file=sys.stderr)
    return supervise(argv, config.settings, token=token, host=parse_address(config.hosts_endpoint)[0],
                     listener=listener)
