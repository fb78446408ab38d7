"""The ``stead`` command line: run, master, agent, status, events.

The CLI is the only place that configures logging and the tracing SDK; it turns
stead's errors into one clear line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stead.cli.certs import add_certs_parser, run_certs
from stead.core.config import Settings
from stead.core.errors import ConfigError, PermanentError, SteadError
from stead.core.logging import LOG_LEVELS, TRACE_CHOICES, TRACE_HELP, export_log_config, version_line
from stead.core.plugins import check_plugin_settings
from stead.core.statemachine import JobPhase
from stead.core.store import StateStore, public_store_url

__all__ = ["main"]

EXIT_FAILED = 1
EXIT_USAGE = 2
#: `stead events --follow` goes on this long after the job's end for what plugins record of it (the scaler's figures)
_AFTER_END_S = 1.0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-format", choices=("console", "json"), default="console", help="log line format (stderr)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, metavar="LEVEL",
                   help="lowest level logged: debug, info, warning or error (default: info)")
    p.add_argument("--trace", choices=TRACE_CHOICES, default=None, help=TRACE_HELP)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="override a setting (repeatable), e.g. --set heartbeat_timeout_s=10, or a plugin's: "
                   "--set ckpt.keep_last=3")


def _store_arg(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--store", required=required, default=None, metavar="URL",
                   help="state store: memory://, sqlite:///path.db or etcd://host:port[,host:port]"
                   + ("" if required else " (default: sqlite:///.stead/<job>.db)"))


def _read_job_args(p: argparse.ArgumentParser) -> None:
    """The arguments of a command that reads one job's store."""
    _store_arg(p, required=False)
    p.add_argument("--job", required=True, help="job name")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stead",
        description="Run distributed PyTorch training jobs that keep going when things break.",
        epilog="`stead run --help` lists the torchrun-compatible flags.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("run", help="run a training script like torchrun, with fast recovery", add_help=False)

    m = sub.add_parser("master", help="run a job's master (control plane) until the job ends",
                       description="Start (or resume) the master of a job. Prints its RPC address and the file "
                       "holding the job token; agents started with `stead agent` connect to it.")
    _store_arg(m, required=True)
    m.add_argument("--job", required=True, help="job name")
    m.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    m.add_argument("--port", type=int, default=0, help="RPC port (default: a free port)")
    m.add_argument("--token-file", default=None,
                   help="where to write the job token (default: .stead/<job>.token); a master of a job that runs "
                        "takes the token from this file, or from $STEAD_JOB_TOKEN")
    m.add_argument("--metrics-port", type=int, default=-1, metavar="PORT",
                   help="serve Prometheus metrics (goodput, recoveries, nodes, steps) at "
                        "http://METRICS_HOST:PORT/metrics (--set metrics_host, loopback by default; "
                        "--set metrics_token_file to require a bearer token); 0: a free port (printed), "
                        "-1: none (the default)")
    m.add_argument("--plugins", default=None, metavar="NAME,...",
                   help="run only these plugins (default: every installed one)")
    m.add_argument("--no-plugin", action="append", default=[], metavar="NAME", dest="no_plugin",
                   help="do not run this plugin (repeatable)")
    m.add_argument("--platform", default=None, metavar="NAME",
                   help="launch the job's nodes on this platform ('local', 'k8s'): the master runs the job given "
                        "by the `stead run` arguments after `--` (in a Kubernetes pod, say), taking it over where "
                        "an earlier master left it; SIGTERM leaves the nodes running for the next master")
    m.add_argument("run_args", nargs="*", metavar="-- RUN_ARGS",
                   help="with --platform: the job's `stead run` arguments (flags and the training script)")
    _add_common(m)

    a = sub.add_parser("agent", help="run one node's agent (normally started by the platform)")
    a.add_argument("--master", required=True, metavar="HOST:PORT", help="the master's RPC address")
    a.add_argument("--token-file", required=True, help="file holding the job token")
    a.add_argument("--node-id", default=None, help="this node's id, as the master requested it")
    a.add_argument("--incarnation", type=int, default=1, help="launch count of this node (default 1)")
    a.add_argument("--cleanup", action="store_true",
                   help="do not run: free what the killed agent of this node incarnation left on this machine "
                        "(its checkpoint shared memory); the platform runs it when the job ends")
    a.add_argument("--spare", action="store_true",
                   help="start warm (torch imported, zygote ready) with no node, and become the agent of the node "
                        'named by one JSON line on stdin ({"node_id": ..., "incarnation": ...}); the local '
                        "platform keeps one so that a lost node is replaced in a fraction of a second")
    _add_common(a)

    e = sub.add_parser("events", help="print a job's event log, one line per event")
    _read_job_args(e)
    e.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new events as they are appended, until the job ends (and what plugins "
                        "record of its end, such as the scaler's resource figures, within a second after it)")
    e.add_argument("--json", action="store_true",
                   help="one JSON object per event: seq, at (seconds since the epoch), type, data; strict JSON: a "
                        "number that is not finite (NaN, Infinity, in a record an older stead wrote) is null")
    e.add_argument("--from-seq", type=int, default=1, help="start at this sequence number")
    _add_common(e)

    s = sub.add_parser("status", help="show a job's phase, nodes, round, step, restarts and goodput")
    _read_job_args(s)
    s.add_argument("--json", action="store_true",
                   help="one JSON object: phase, shape, round, step, restarts, nodes, plugin lines, and the "
                        "latest master's pid, host and address (master_pid, ...)")
    s.add_argument("--follow", "-f", action="store_true",
                   help="a live view until the job ends: the same as `stead top`")
    _add_common(s)

    t = sub.add_parser("top", help="a live view of a running job: phase, nodes, step rate, goodput, recent events",
                       description="Follow a job from its store until it ends (or Ctrl-C): its phase, round, "
                       "step and step rate, the goodput so far and where the rest of the time went, each node "
                       "with its state and last diagnosis, and the latest events. In a terminal the view is "
                       "redrawn in place; piped or with --plain it prints a line when something changes.")
    _read_job_args(t)
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default: 1)")
    t.add_argument("--plain", action="store_true", help="print lines, never redraw (the default when piped)")
    _add_common(t)

    sc = sub.add_parser("scale", help="change how many nodes a running job runs on, within its MIN:MAX",
                        description="Ask a running job for N nodes (within the --nnodes MIN:MAX it started with). "
                        "The scaler's policy decides the target (capped by --set capacity_nodes); nodes are "
                        "requested or retired to match, and the running round changes size at its next "
                        "checkpoint commit, with no restart spent. Prints the target decided.")
    _read_job_args(sc)
    sc.add_argument("--nodes", type=int, required=True, metavar="N", help="how many nodes the job should run on")
    sc.add_argument("--reason", default="", help="why, recorded with the request in the job's events")
    sc.add_argument("--token-file", default=None, metavar="PATH",
                    help="the job's token file (default: $STEAD_JOB_TOKEN if set, else .stead/<job>.token, which "
                         "`stead run` writes in the directory it runs in)")
    _add_common(sc)

    _add_common(add_certs_parser(sub))

    r = sub.add_parser("report", help="write a job's report: one HTML file with its timeline, step rate and goodput",
                       description="Write one self-contained HTML file (it opens with no network) with the job's "
                       "timeline (rounds, nodes, recoveries in their phases, failures, checkpoints), its step rate "
                       "and its goodput breakdown: attach it to a bug report or a postmortem. A running job is "
                       "drawn up to now.")
    _read_job_args(r)
    r.add_argument("--output", "-o", default=None, metavar="PATH",
                   help="where to write it (default: .stead/<job>-report.html)")
    _add_common(r)

    k = sub.add_parser("k8s", help="Kubernetes: the manifests to install stead on a cluster, and its operator",
                       description="Run jobs on Kubernetes: `stead run --platform k8s ...` from a laptop (no CRD "
                       "needed), or a SteadJob resource that the operator runs. `stead k8s manifests` prints "
                       "what a cluster needs (CRD, RBAC, operator, optional etcd, an example job).")
    k8s = k.add_subparsers(dest="k8s_command", metavar="K8S_COMMAND")
    # `stead k8s manifests ...` is read by the manifests' own parser (main() hands it over before this one is
    # built): adding its flags here would load the Kubernetes client into every `stead` command
    k8s.add_parser("manifests", help="print the CRD, RBAC, operator Deployment (and etcd, an example job); "
                   "`stead k8s manifests --help` lists its flags")
    ko = k8s.add_parser("operator", help="run the operator: SteadJob resources become running jobs",
                        description="Watch SteadJob resources and run each: its token Secret, master Service, "
                        "NetworkPolicy and master pod (which runs the node pods); a master pod deleted while the "
                        "job runs is replaced; the job's phase, step, restarts and goodput go to its status.")
    ko.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                    help="serve only this namespace (repeatable; default: every namespace)")
    ko.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", metavar="URL",
                    help="serve kopf's liveness probe here (default: http://0.0.0.0:8080/healthz; '' for none)")
    _add_common(ko)
    return parser


def _settings(overrides: Sequence[str]) -> Settings:
    from stead.cli.run_args import parse_settings

    values = parse_settings(overrides)
    settings = Settings.from_mapping(values, base=Settings.from_env())
    check_plugin_settings(settings)
    return settings


def _default_store(job: str) -> str:
    return f"sqlite:///.stead/{job}.db"


def _configure(args: argparse.Namespace) -> None:
    from stead.core.logging import configure_logging
    from stead.core.views.tracing import configure_tracing

    configure_logging(args.log_format, level=args.log_level)
    configure_tracing(args.trace)
    export_log_config(args.log_format, args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Slurm's time-limit warning (sbatch --signal=USR1@SECONDS) goes to every process of the step: it must not end
    # `stead run`, the master or the rendezvous host (the default action), which pass the ignoring on to what they
    # start; the agent answers it (it persists the newest checkpoint), the workers ignore it too
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if argv and argv[0] == "run":
        from stead.cli.run import main as run_main

        return run_main(argv[1:])
    if argv[:2] == ["k8s", "manifests"]:  # output only: no logging, no settings
        from stead.platforms.k8s.manifests import main as manifests_main

        return manifests_main(argv[2:], prog="stead k8s manifests")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        _configure(args)
        settings = _settings(args.overrides)
        return asyncio.run(_dispatch(args, settings))
    except KeyboardInterrupt:
        print("stead: interrupted", file=sys.stderr)
        return 130
    except SteadError as exc:
        print(f"stead {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED


async def _dispatch(args: argparse.Namespace, settings: Settings) -> int:
    if args.command == "master":
        return await _master(args, settings)
    if args.command == "agent":
        from stead.cli.slurm_signals import slurm_warning_source
        from stead.core.agent.main import clean_up_after, run_agent

        warned_by = slurm_warning_source(os.environ)  # inside a Slurm job: its warning is reported to the master
        if args.spare:
            from stead.core.agent.spare import run_spare_agent

            return await run_spare_agent(master=args.master, token_file=args.token_file, settings=settings,
                                         warning_source=warned_by)
        if not args.node_id:
            raise ConfigError("stead agent needs --node-id (the node the master requested), or --spare")
        if args.cleanup:
            return await clean_up_after(node_id=args.node_id, incarnation=args.incarnation)
        return await run_agent(master=args.master, token_file=args.token_file, node_id=args.node_id,
                               incarnation=args.incarnation, settings=settings, warning_source=warned_by)
    if args.command == "events":
        return await _events(args, settings)
    if args.command == "top" or (args.command == "status" and args.follow):
        return await _top(args, settings)
    if args.command == "status":
        return await _status(args, settings)
    if args.command == "report":
        return await _report(args, settings)
    if args.command == "scale":
        return await _scale(args, settings)
    if args.command == "k8s":
        return await _k8s(args, settings)
    if args.command == "certs":
        return run_certs(args)
    raise ConfigError(f"unknown command {args.command!r}; see `stead --help`")


async def _master(args: argparse.Namespace, settings: Settings) -> int:
    from stead.cli.run_args import parse_plugins
    from stead.core.master import Master, MasterConfig

    plugins, disabled = parse_plugins(args.plugins, args.no_plugin)
    if args.metrics_port < -1 or args.metrics_port > 65535:
        raise ConfigError(f"--metrics-port {args.metrics_port} is not a port: use 1-65535, 0 (a free one) or -1 "
                          "(no metrics)")
    if args.platform is not None or args.run_args:
        return await _master_of_run(args)
    from stead.core.jobtoken import JOB_TOKEN_ENV

    config = MasterConfig(job=args.job, store_url=args.store, settings=settings, host=args.host, port=args.port,
                          token_file=args.token_file, plugins=plugins, disabled_plugins=disabled,
                          metrics_port=args.metrics_port, token=os.environ.get(JOB_TOKEN_ENV) or None,
                          leave_nodes_on_failure=True)
    async with Master(config) as master:
        print(f"stead master for job {args.job!r} listening on {master.address}", flush=True)
        print(f"job token written to {master.token_file}", flush=True)
        if master.metrics_url:
            print(f"metrics: {master.metrics_url}", flush=True)
        print(f"agents: stead agent --master {master.address} --token-file {master.token_file} --node-id node-0",
              flush=True)
        state = await master.wait()
        print(f"job {args.job!r} {state.phase.value}: {state.reason}", flush=True)
        return 0 if state.phase is JobPhase.SUCCEEDED else EXIT_FAILED


async def _master_of_run(args: argparse.Namespace) -> int:
    """`stead master --platform NAME -- RUN_ARGS`: the master of the job those `stead run` arguments describe."""
    from stead.cli.run import serve_job
    from stead.cli.run_args import parse_run_args
    from stead.core.jobtoken import JOB_TOKEN_ENV

    if not args.run_args:
        raise ConfigError("stead master --platform needs the job's `stead run` arguments after `--`, e.g. "
                          "stead master --job demo --store etcd://etcd:2379 --platform k8s -- --nnodes 2 train.py")
    if args.platform is None:
        raise ConfigError("stead master with `stead run` arguments needs --platform NAME (where to launch nodes)")
    argv = ["--job-name", args.job, "--store", args.store, "--platform", args.platform,
            *(f"--set={item}" for item in args.overrides), "--log-format", args.log_format,
            "--log-level", args.log_level, *args.run_args]
    config = parse_run_args(argv)
    state = await serve_job(config, host=args.host, port=args.port, token=os.environ.get(JOB_TOKEN_ENV) or None,
                            metrics_port=args.metrics_port, token_file=args.token_file)
    if state is None:
        print(f"stead master for job {args.job!r} left while the job runs: its next master takes it over", flush=True)
        return 0
    print(f"job {args.job!r} {state.phase.value}: {state.reason}", flush=True)
    return 0 if state.phase is JobPhase.SUCCEEDED else EXIT_FAILED


async def _k8s(args: argparse.Namespace, settings: Settings) -> int:
    from stead.core.config import load_settings
    from stead.platforms.k8s import operator
    from stead.platforms.k8s.settings import K8sSettings

    if args.k8s_command != "operator":
        raise ConfigError("stead k8s needs a command: manifests or operator (see `stead k8s --help`)")
    base = load_settings(K8sSettings, "k8s", settings)
    print(f"stead operator: serving SteadJobs in {', '.join(args.namespace) or 'every namespace'}", flush=True)
    await operator.run(base, namespaces=args.namespace, liveness=args.liveness or None)
    return 0


async def _events(args: argparse.Namespace, settings: Settings) -> int:
    from stead.core.events import JobFailed, JobStopped, JobSucceeded, encode_record
    from stead.core.events.log import EventLog
    from stead.core.views.display import format_record

    def show(item: Any) -> str:
        if not args.json:
            return format_record(item)
        if not hasattr(item, "event"):  # a record that cannot be decoded: say so in the same shape
            return json.dumps({"seq": getattr(item, "seq", None), "type": None, "error": str(item)})
        return json.dumps(_finite(json.loads(encode_record(item))), separators=(",", ":"), sort_keys=True,
                          allow_nan=False)

    store = await _open_existing(args, settings)
    try:
        event_log = EventLog(store, args.job)
        if args.follow:
            followed = event_log.follow(args.from_seq)
            try:
                async for item in followed:
                    print(show(item), flush=True)
                    if isinstance(getattr(item, "event", None), (JobSucceeded, JobFailed, JobStopped)):
                        break  # the job ended (a later `stead run` of it would resume it: follow that one anew)
                with contextlib.suppress(TimeoutError):  # what plugins record of the end comes just after it
                    async with asyncio.timeout(_AFTER_END_S):
                        async for item in followed:
                            print(show(item), flush=True)
            finally:
                await followed.aclose()
        else:
            items = await event_log.scan(args.from_seq)
            if not items:
                print(f"no events for job {args.job!r} in {store.url}", file=sys.stderr)
                return EXIT_FAILED
            for item in items:
                print(show(item))
    finally:
        await store.close()
    return 0


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None: NaN and Infinity are not JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _existing_store(args: argparse.Namespace) -> str:
    """The job's store URL, for reading: a SQLite file that does not exist is an error (and is not created)."""
    url: str = args.store or _default_store(args.job)
    scheme, _, rest = url.partition("://")
    if scheme == "sqlite" and rest.startswith("/") and not os.path.exists(rest[1:] or "/"):
        raise ConfigError(f"no job {args.job!r} here: {rest[1:]} does not exist; check --job, or pass the "
                          "--store the job ran with")
    return url


async def _open_existing(args: argparse.Namespace, settings: Settings) -> StateStore:
    from stead.core.master import open_store_retrying

    return await open_store_retrying(_existing_store(args), settings)


async def _status(args: argparse.Namespace, settings: Settings) -> int:
    from stead.core.events import Record
    from stead.core.statemachine import fold_all
    from stead.core.views.display import format_status, last_diagnoses, status_json
    from stead.core.views.goodput import ledger
    from stead.core.views.numerics import numerics_lines
    from stead.core.views.top import published_lines
    from stead.core.views.warnings import warning_lines

    store = await _open_existing(args, settings)
    try:
        items = await _job_records(store, args)
        plugins = await published_lines(store, args.job)
        master = await store.get(f"/stead/jobs/{args.job}/master")
    finally:
        await store.close()
    records = [item for item in items if isinstance(item, Record)]
    goodput = ledger(items, now=time.time())
    if args.json:
        try:
            about = json.loads(master.value) if master is not None else {}
        except ValueError:
            about = {}
        print(json.dumps(status_json(args.job, fold_all(records), diagnoses=last_diagnoses(records),
                                     plugins=plugins, master=about if isinstance(about, dict) else {},
                                     goodput=goodput, numerics=numerics_lines(records),
                                     warnings=warning_lines(records))))
        return 0
    print(format_status(args.job, fold_all(records), diagnoses=last_diagnoses(records), plugins=plugins,
                        goodput=goodput, numerics=numerics_lines(records), warnings=warning_lines(records)))
    return 0


def _no_job(args: argparse.Namespace) -> PermanentError:
    return PermanentError(f"no job {args.job!r} in {public_store_url(args.store or _default_store(args.job))}; "
                          "check --job and --store (stead run uses sqlite:///.stead/<job>.db by default)")


async def _job_records(store: StateStore, args: argparse.Namespace) -> list[Any]:
    """The job's records, with the unreadable and missing ones as :class:`BadRecord` (the ledger and the report
    say what they skipped); an unknown job is an error that says where it looked."""
    from stead.core.events.log import BadRecord, EventLog

    event_log = EventLog(store, args.job)
    items: list[Any] = []
    for item in await event_log.scan():
        expected = items[-1].seq + 1 if items and items[-1].seq is not None else 1
        items += [BadRecord(key=event_log.key(seq), seq=seq, error="missing from the log")
                  for seq in range(expected, item.seq if item.seq is not None else expected)]
        items.append(item)
    if not items:
        raise _no_job(args)
    return items


async def _report(args: argparse.Namespace, settings: Settings) -> int:
    from stead.core.views.report import write_report

    store = await _open_existing(args, settings)
    try:
        records = await _job_records(store, args)
    finally:
        await store.close()
    path = args.output or os.path.join(".stead", f"{args.job}-report.html")
    drawn = await asyncio.to_thread(write_report, args.job, records, path, now=time.time())
    book = drawn.ledger
    print(f"report for job {args.job!r} written to {path}: goodput {book.goodput:.1%} of {book.wall_s:.1f} s, "
          f"{len(book.recoveries)} recoveries")
    for what in drawn.missing:
        print(f"  (not shown: {what})")
    return 0


def _scale_token(args: argparse.Namespace) -> tuple[str, str]:
    """The job's token for `stead scale` and where it came from: --token-file, else STEAD_JOB_TOKEN, else
    .stead/<job>.token."""
    from stead.core.jobtoken import JOB_TOKEN_ENV, default_token_file, find_token

    path = Path(args.token_file) if args.token_file else default_token_file(args.job)
    found = find_token(path, explicit_file=bool(args.token_file))
    if found is None:
        raise ConfigError(f"no token for job {args.job!r}: {path} does not exist and {JOB_TOKEN_ENV} is not set; run "
                          "this where `stead run` ran (it writes .stead/<job>.token there), or pass --token-file "
                          f"PATH, or set {JOB_TOKEN_ENV} (on Kubernetes: the token in the job's Secret)")
    return found


async def _scale(args: argparse.Namespace, settings: Settings) -> int:
    from stead.core.events import Record
    from stead.core.events.log import job_prefix
    from stead.core.jobtoken import verifier_key
    from stead.core.rpc import client_tls, verifies
    from stead.core.statemachine import fold_all
    from stead.plugins.scaler.client import request_scale

    store = await _open_existing(args, settings)
    try:
        records = await _job_records(store, args)
        master = await store.get(f"{job_prefix(args.job)}master")
        verifier = await store.get(verifier_key(args.job))
    finally:
        await store.close()
    state = fold_all([r for r in records if isinstance(r, Record)])
    spec = state.spec
    if spec is None or state.phase.terminal:
        raise PermanentError(f"job {args.job!r} is {state.phase.value}{f' ({state.reason})' if state.reason else ''}; "
                             "only a running job can be scaled (stead run with the same --job-name resumes it)")
    if not spec.min_nodes <= args.nodes <= spec.max_nodes:
        raise ConfigError(f"--nodes {args.nodes} is outside job {args.job!r}'s MIN:MAX {spec.min_nodes}:"
                          f"{spec.max_nodes}; a job's range is fixed when it starts (stead run --nnodes MIN:MAX)")
    try:
        address = json.loads(master.value)["address"] if master is not None else None
    except (ValueError, KeyError, TypeError):
        address = None
    if not address:
        raise PermanentError(f"job {args.job!r} has no master on record in {store.url}: it is not running yet, or "
                             "its master has not announced itself; run `stead status` to see it, and scale it once "
                             "it runs")
    token, source = _scale_token(args)
    if verifier is not None and not verifies(args.job, token, verifier.value.decode("ascii", errors="replace")):
        raise ConfigError(f"the token in {source} is not job {args.job!r}'s (it does not match the verifier the "
                          "store keeps): pass the token file of this run of the job with --token-file, or its "
                          "token in STEAD_JOB_TOKEN")
    result = await request_scale(address, token, nodes=args.nodes, by="stead scale",
                                 reason=args.reason, timeout_s=settings.rpc_timeout_s, tls=client_tls(settings))
    was = f" (was {result.previous})" if result.previous != result.target else " (unchanged)"
    print(f"job {args.job!r}: target {result.target} nodes{was}: {result.reason}")
    return 0


async def _top(args: argparse.Namespace, settings: Settings) -> int:
    from stead.core.views.top import follow

    interval = getattr(args, "interval", 1.0)
    if not 0.05 <= interval <= 3600:
        raise ConfigError(f"--interval {interval} is out of range: give seconds between 0.05 and 3600")
    store = await _open_existing(args, settings)
    try:
        view = await follow(store, args.job, interval_s=interval, plain=getattr(args, "plain", False) or None)
    finally:
        await store.close()
    return 0 if view.phase == JobPhase.SUCCEEDED.value else EXIT_FAILED
