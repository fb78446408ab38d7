"""An agent's report has one shape from the wire to the event log: each message converts to its event with every
field, and each bad report is refused, by the servicer or by the master's gateway, in the same words as before.
What the agents' protocol carries beside reports (a registration and its reply, a heartbeat, each command) crosses
with every field too, to a value that spells its fields as its message does."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import betterproto2
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.config import Settings
from stead.core.events import (
    MAX_NUMERICS_RECORDS,
    MAX_WARNED_RECORDS,
    Event,
    JobWarned,
    NodeHealthReported,
    NumericsNote,
    NumericsReported,
    PeerCollective,
    Record,
    RestoreBound,
    StackSample,
    StacksDumped,
    StepSamples,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.master.gateway import SKIP_REPORTS_PER_NODE_STEP, AgentGateway
from stead.core.rpc import (
    AgentCommand,
    AgentReport,
    AgentServicer,
    CheckHealthCmd,
    DumpStacksCmd,
    HeartbeatInfo,
    MasterClient,
    RegisterInfo,
    RegisterResult,
    RpcServer,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
    attach_token,
    new_token,
)
from stead.core.rpc.convert import (
    command_from_proto,
    command_to_proto,
    failure_from_proto,
    failure_to_proto,
    health_from_proto,
    health_to_proto,
    heartbeat_from_proto,
    heartbeat_to_proto,
    numerics_from_proto,
    numerics_to_proto,
    register_from_proto,
    register_reply_from_proto,
    register_reply_to_proto,
    register_to_proto,
    stacks_from_proto,
    stacks_to_proto,
    warned_from_proto,
    warned_to_proto,
    workers_from_proto,
    workers_to_proto,
)
from stead.core.statemachine import JobState, NodePhase, NodeState
from stead.plugin import proto as pb
from stead.plugins.ckpt import proto as ckpt_pb
from stead.plugins.ckpt.events import CheckpointCorrupt

pytestmark = pytest.mark.anyio

#: (message, event it converts to, the message's fields the event does not hold: the report's envelope)
SHAPES: list[tuple[type[betterproto2.Message], type[Any], set[str]]] = [
    (pb.FailureReport, WorkerFailed, {"incarnation"}),
    (pb.WorkersReport, WorkersStarted, {"incarnation", "state"}),
    (pb.WorkersReport, WorkersSucceeded, {"incarnation", "state"}),
    (pb.StacksReport, StacksDumped, {"incarnation"}),
    (pb.WorkerStack, StackSample, set()),
    (pb.HealthReport, NodeHealthReported, set()),
    (pb.PeerCollective, PeerCollective, set()),
    (ckpt_pb.ReportCorruptRequest, CheckpointCorrupt, set()),
    (pb.RegisterRequest, RegisterInfo, set()),
    (pb.RegisterReply, RegisterResult, set()),
    (pb.HeartbeatRequest, HeartbeatInfo, set()),
]


@pytest.mark.parametrize(("message", "event", "envelope"), SHAPES,
                         ids=[f"{m.__name__}-{e.__name__}" for m, e, _ in SHAPES])
def test_each_report_message_and_its_event_spell_the_same_fields(message: type[betterproto2.Message],
                                                                 event: type[Any], envelope: set[str]) -> None:
    message_fields = {f.name for f in dataclasses.fields(cast(Any, message))}
    event_fields = {f.name for f in dataclasses.fields(event)}
    assert message_fields - envelope == event_fields, "a field the wire or the event log would drop"
    assert envelope <= message_fields


# -- every field crosses ---------------------------------------------------------------

FAILURE = AgentReport(incarnation=3, event=WorkerFailed(
    node_id="node-1", round=4, local_rank=1, rank=5, exit_code=137, signal=9, step=1234, error_tail="Killed\n",
    exited_at=1.7e9, oom="memory cgroup out of memory: Killed process 7", gpu="GPU 0: XID 79",
    exited_ok_ranks=(4, 6)))
STACKS = AgentReport(incarnation=3, event=StacksDumped(
    node_id="node-1", round=4, method="faulthandler", error="rank 6 did not answer",
    workers=(StackSample(rank=5, local_rank=1, step=77, stack='Thread 0x1:\n  File "train.py", line 3'),)))
NUMERICS = AgentReport(incarnation=3, event=NumericsReported(
    node_id="node-1", round=4, dropped=2, notes=(NumericsNote(kind="loss_spike", rank=5, step=77, loss=40.5,
                                                              median=2.25, score=31.5, action="skip", round=3,
                                                              samples=(StepSamples(dataset="d", count=40, ranges=(
                                                                  (1, 8, 40), (2, 3, 5))),)),)))
HEALTH = AgentReport(incarnation=3, event=NodeHealthReported(
    node_id="node-1", incarnation=3, check=2, matmul_s=0.0125, device="cuda:0 NVIDIA H100", error="slow peer",
    seconds=4.5, collectives=(PeerCollective(peer="node-2", seconds=0.25, error="slow"),)))
STARTED = AgentReport(incarnation=3, event=WorkersStarted(node_id="node-1", round=4))
SUCCEEDED = AgentReport(incarnation=3, event=WorkersSucceeded(node_id="node-1", round=4))
REGISTER = RegisterInfo(node_id="node-1", incarnation=3, host="host-b", pid=4242, nproc=8)
REGISTERED = RegisterResult(job="j", heartbeat_interval_s=1.5, heartbeat_timeout_s=9.0, store_host="10.0.0.1",
                            store_port=29400, progress_interval_s=5.0)
BEAT = HeartbeatInfo(node_id="node-1", incarnation=3, round=4, step=1234, workers_alive=7, rss_bytes=1 << 33,
                     cpu_percent=650.5, phase="eval", step_compute_s=0.25, gpu_memory_bytes=1 << 35,
                     gpu_util_percent=93.5, acked=("start-workers/4/node-1", "dump-stacks/17/node-1"))

#: (report with every field set, to the message, from the message)
CROSSINGS: list[tuple[Any, Callable[[Any], betterproto2.Message], Callable[[Any], Any]]] = [
    (FAILURE, failure_to_proto, failure_from_proto),
    (STACKS, stacks_to_proto, stacks_from_proto),
    (NUMERICS, numerics_to_proto, numerics_from_proto),
    (HEALTH, health_to_proto, health_from_proto),
    (STARTED, workers_to_proto, workers_from_proto),
    (SUCCEEDED, workers_to_proto, workers_from_proto),
    (REGISTER, register_to_proto, register_from_proto),
    (REGISTERED, register_reply_to_proto, register_reply_from_proto),
    (BEAT, heartbeat_to_proto, heartbeat_from_proto),
]
#: every kind of command, with every field set
COMMANDS: list[AgentCommand] = [
    StartWorkersCmd(id="start-workers/4/node-1", round=4, node_rank=1, nnodes=2, nproc_per_node=8, world_size=16,
                    restart_count=3, master_addr="10.0.0.1", master_port=29400, skip_steps=(4, 9),
                    restore_bounds=(RestoreBound(step=-1, round=1), RestoreBound(step=12, round=3))),
    StopWorkersCmd(id="stop-workers/4/node-1", round=4, reason="node-2 failed"),
    StopNodeCmd(id="stop-node/node-1/3", reason="the job succeeded"),
    DumpStacksCmd(id="dump-stacks/17/node-1", round=4, reason="no progress for 600 s"),
    CheckHealthCmd(id="check-health/2/node-1", check=2, nodes=("node-1", "node-2"), store_host="10.0.0.1",
                   store_port=29401, timeout_s=30.0),
]


def _unset_fields(value: Any) -> list[str]:
    """The fields of a dataclass or message (nested ones included) left at their defaults."""
    if not dataclasses.is_dataclass(value):
        return []
    blank = type(value)() if isinstance(value, betterproto2.Message) else None
    unset = []
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        default = getattr(blank, field.name) if blank is not None else field.default
        if item == default or item in ((), []):
            unset.append(field.name)
        for inner in item if isinstance(item, tuple | list) else (item,):
            unset += [f"{field.name}.{name}" for name in _unset_fields(inner)]
    return unset


@pytest.mark.parametrize(("report", "to_proto", "from_proto"), CROSSINGS,
                         ids=[type(getattr(r, "event", r)).__name__ for r, _, _ in CROSSINGS])
def test_each_report_crosses_the_wire_with_every_field(report: Any, to_proto: Callable[[Any], betterproto2.Message],
                                                       from_proto: Callable[[Any], Any]) -> None:
    event = getattr(report, "event", report)
    assert _unset_fields(event) == [], "set every field of the sample, a new one too, so that it is seen crossing"
    message = to_proto(report)
    assert _unset_fields(message) == [], "a field the message is not given"
    received = type(message)().parse(bytes(message))
    assert from_proto(received) == report


@pytest.mark.parametrize("command", COMMANDS, ids=[type(c).__name__ for c in COMMANDS])
def test_each_command_crosses_the_wire_with_every_field_and_spells_its_body_s_fields(command: AgentCommand) -> None:
    assert _unset_fields(command) == [], "set every field of the sample, a new one too, so that it is seen crossing"
    message = command_to_proto(command)
    _, body = betterproto2.which_one_of(message, "body")
    assert body is not None and message.id == command.id
    assert {f.name for f in dataclasses.fields(command)} - {"id"} == {f.name for f in dataclasses.fields(body)}
    assert _unset_fields(body) == [], "a field the message is not given"
    assert command_from_proto(pb.Command().parse(bytes(message))) == command


def test_a_report_and_the_event_it_holds_name_the_same_incarnation() -> None:
    with pytest.raises(ValueError, match="a report of incarnation 2 holds an event of incarnation 3"):
        AgentReport(incarnation=2, event=HEALTH.event)


# -- every bad report is refused as before -----------------------------------------------

_LIVE = "node-0"
#: the one refusal of every report from a node incarnation the job does not know live (a stale agent): one that
#: is not its node's current incarnation, and one of a node the job does not have
_STALE = ("node node-0 incarnation 2 is not a live node of job 'shapes'; this agent is stale and should exit "
          "(current incarnation 1 is joined)")
_UNKNOWN = ("node node-9 incarnation 1 is not a live node of job 'shapes'; this agent is stale and should exit "
            "(unknown node)")
#: (the stub's method, the message, the exact refusal) for the counts over a bound, checked before the message is
#: decoded: answered RESOURCE_EXHAUSTED (told apart from a master shedding load, so the agent does not retry)
OVER_BOUNDS: list[tuple[str, betterproto2.Message, str]] = [
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, exited_ok_ranks=list(range(1025))),
     "FailureReport.exited_ok_ranks has 1025 entries or more: send at most 1024 "
     "(MAX_NODE_WORKERS: a node runs at most 1024 workers)"),
    ("report_stacks", pb.StacksReport(node_id=_LIVE, incarnation=1, workers=[pb.WorkerStack()] * 1025),
     "StacksReport.workers has 1025 entries or more: send at most 1024 "
     "(MAX_NODE_WORKERS: a node runs at most 1024 workers)"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=1, collectives=[pb.PeerCollective()] * 4),
     "HealthReport.collectives has 4 entries or more: send at most 3 "
     "(MAX_HEALTH_PEERS: one partner per stage of a check)"),
    ("report_numerics", pb.NumericsReport(node_id=_LIVE, incarnation=1, notes=[pb.NumericsNote(
        kind="step_skipped", samples_known=True, samples=[pb.StepSamples(dataset="d", count=1)] * 5)]),
     "NumericsReport.notes[0].samples has 5 entries or more: send at most 4 "
     "(MAX_SAMPLE_SETS: name the first datasets only)"),
    ("report_numerics", pb.NumericsReport(node_id=_LIVE, incarnation=1, notes=[pb.NumericsNote(
        kind="step_skipped", samples_known=True, samples=[pb.StepSamples(
            dataset="d", count=90, ranges=[pb.SampleRange(part=0, start=1, end=2)] * 9)])]),
     "NumericsReport.notes[0].samples[0].ranges has 9 entries or more: send at most 8 "
     "(MAX_SAMPLE_RANGES: name the first ranges, count the rest)"),
]
#: (the stub's method, the message, the exact refusal) for the rest: answered INVALID_ARGUMENT
REFUSALS: list[tuple[str, betterproto2.Message, str]] = [
    # strings' lengths and floats' finiteness, as the message is decoded
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, error_tail="x" * (32 * 1024 + 1)),
     "FailureReport.error_tail has 32769 characters: send at most 32768 (the end of the worker's stderr)"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, oom="x" * 4097),
     "FailureReport.oom has 4097 characters: send at most 4096 (the record itself, not a log)"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, gpu="x" * 4097),
     "FailureReport.gpu has 4097 characters: send at most 4096 (the record itself, not a log)"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, exited_at=float("inf")),
     "FailureReport.exited_at is inf: send a finite number"),
    ("report_stacks", pb.StacksReport(node_id=_LIVE, incarnation=1, workers=[pb.WorkerStack(stack="s" * 65537)]),
     "StacksReport.workers[0].stack has 65537 characters: send at most 65536 (cut the dump)"),
    ("report_stacks", pb.StacksReport(node_id=_LIVE, incarnation=1, method="m" * 65),
     "StacksReport.method has 65 characters: send at most 64 (how the stacks were taken, e.g. faulthandler)"),
    ("report_stacks", pb.StacksReport(node_id=_LIVE, incarnation=1, error="e" * 4097),
     "StacksReport.error has 4097 characters: send at most 4096 (what went wrong, not a log)"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=1, matmul_s=float("nan")),
     "HealthReport.matmul_s is nan: send a finite number"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=1, device="d" * 257),
     "HealthReport.device has 257 characters: send at most 256 (a name or a short label)"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=1,
                                     collectives=[pb.PeerCollective(peer="n", error="e" * 4097)]),
     "HealthReport.collectives[0].error has 4097 characters: send at most 4096 (what went wrong, not a log)"),
    # what each field means, in the servicer
    ("report_numerics", pb.NumericsReport(node_id=_LIVE, incarnation=1, notes=[pb.NumericsNote(
        kind="loss_spike", samples_known=True, samples=[pb.StepSamples(dataset="d", count=1)])]),
     "NumericsReport.notes[0].samples: only a step_skipped note with samples_known names samples"),
    ("report_numerics", pb.NumericsReport(node_id=_LIVE, incarnation=1, notes=[pb.NumericsNote(
        kind="step_skipped", samples_known=True, samples=[pb.StepSamples(dataset="", count=1)])]),
     "NumericsReport.notes[0].samples[0].dataset is '': a name of 1 to 200 characters"),
    ("report_numerics", pb.NumericsReport(node_id=_LIVE, incarnation=1, notes=[pb.NumericsNote(
        kind="step_skipped", samples_known=True, samples=[pb.StepSamples(
            dataset="d", count=2, ranges=[pb.SampleRange(part=0, start=4, end=4)])])]),
     "NumericsReport.notes[0].samples[0].ranges[0] is part 0 slots 4-4: part >= 0 and 0 <= start < end"),
    ("report_numerics", pb.NumericsReport(node_id=_LIVE, incarnation=1, notes=[pb.NumericsNote(
        kind="step_skipped", samples_known=True, samples=[pb.StepSamples(
            dataset="d", count=2, ranges=[pb.SampleRange(part=0, start=0, end=9)])])]),
     "NumericsReport.notes[0].samples[0] names 9 samples in its ranges, more than its count 2"),
    ("report_failure", pb.FailureReport(node_id="a/b", incarnation=1),
     "FailureReport.node_id 'a/b' is not a valid name: pass the node's id (the one the agent was started with): "
     "1-253 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=0),
     "FailureReport.incarnation is 0: incarnations start at 1; pass the node's launch count"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, rank=-1),
     "FailureReport.rank is -1: it must be at least 0 (ranks count from 0)"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, signal=0),
     "FailureReport.signal is 0: it must be at least 1 (a signal number; leave it unset when none)"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, exited_ok_ranks=[1, -1]),
     "FailureReport.exited_ok_ranks[1] is -1: it must be at least 0 (ranks count from 0)"),
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=1, exited_at=-1.0),
     "FailureReport.exited_at is -1.0: send a finite time in seconds since the epoch >= 0, or leave it unset"),
    ("report_workers", pb.WorkersReport(node_id=_LIVE, incarnation=1, round=-1, state=pb.WorkersState.STARTED),
     "WorkersReport.round is -1: it must be at least 0 (rendezvous rounds count from 0)"),
    ("report_workers", pb.WorkersReport(node_id=_LIVE, incarnation=1),
     "WorkersReport.state is <WorkersState.UNSPECIFIED: 0>: send WORKERS_STATE_STARTED or WORKERS_STATE_SUCCEEDED"),
    ("report_stacks", pb.StacksReport(node_id=_LIVE, incarnation=1, workers=[pb.WorkerStack(step=-1)]),
     "StacksReport.workers[0].step is -1: it must be at least 0 (a training step; leave it unset when none)"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=0),
     "HealthReport.check is 0: it must be at least 1 (health checks count from 1)"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=1, seconds=-1.0),
     "HealthReport.seconds is -1.0: send a finite number of seconds >= 0, or leave it unset"),
    ("report_health", pb.HealthReport(node_id=_LIVE, incarnation=1, check=1,
                                     collectives=[pb.PeerCollective(peer="")]),
     "HealthReport.collectives[0].peer is empty: pass the node's id (the one the agent was started with): "
     "1-253 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    # a node incarnation the job does not know (a stale agent), in the gateway
    ("report_failure", pb.FailureReport(node_id=_LIVE, incarnation=2), _STALE),
    ("report_failure", pb.FailureReport(node_id="node-9", incarnation=1), _UNKNOWN),
    ("report_workers", pb.WorkersReport(node_id=_LIVE, incarnation=2, state=pb.WorkersState.SUCCEEDED), _STALE),
    ("report_stacks", pb.StacksReport(node_id=_LIVE, incarnation=2), _STALE),
    ("report_health", pb.HealthReport(node_id="node-9", incarnation=1, check=1), _UNKNOWN),
    # a node's report of a warning (Slurm's, before a time limit)
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, signal="SIGUSR1", source="slurm",
                                      warned_at=1.8e9, said="x" * 301),
     "WarnedReport.said has 301 characters: send at most 300 (the warning's source's words, in a line)"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, signal="USR1; rm", source="slurm",
                                      warned_at=1.8e9),
     "WarnedReport.signal is 'USR1; rm': the signal's name, e.g. SIGUSR1"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, signal="SIGUSR1", source="pbs",
                                      warned_at=1.8e9),
     "WarnedReport.source is 'pbs': who sent the warning, one of slurm"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, signal="SIGUSR1", source="slurm"),
     "WarnedReport.warned_at is 0.0: when the agent got the signal, in seconds since the epoch (> 0)"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, signal="SIGUSR1", source="slurm",
                                      warned_at=1.8e9, time_left_s=-5),
     "WarnedReport.time_left_s is -5: it must be at least 0 (a number of seconds; leave it unset when not said)"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, signal="SIGUSR1", source="slurm",
                                      warned_at=1.8e9, persisted_step=-1),
     "WarnedReport.persisted_step is -1: it must be at least 0 (a training step; leave it unset when none)"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=1, round=-1, signal="SIGUSR1", source="slurm",
                                      warned_at=1.8e9),
     "WarnedReport.round is -1: it must be at least 0 (rendezvous rounds count from 0)"),
    ("report_warned", pb.WarnedReport(node_id=_LIVE, incarnation=2, signal="SIGUSR1", source="slurm",
                                      warned_at=1.8e9), _STALE),
    ("report_warned", pb.WarnedReport(node_id="node-9", incarnation=1, signal="SIGUSR1", source="slurm",
                                      warned_at=1.8e9), _UNKNOWN),
]


#: the job's one node, joined
_JOINED = {_LIVE: NodeState(node_id=_LIVE, incarnation=1, phase=NodePhase.JOINED)}


def _recording_gateway(state: JobState | Callable[[], JobState]) -> tuple[AgentGateway, list[Event]]:
    """A real gateway of a job in ``state`` (or as a callable says it is now), and the events it records."""
    recorded: list[Event] = []

    async def submit(event: Event) -> Record:
        recorded.append(event)
        return Record(seq=len(recorded), at=0.0, event=event)

    get_state = state if callable(state) else lambda: state
    return AgentGateway(job="shapes", settings=Settings(), submit=submit, get_state=get_state,
                        store_addr=lambda: ("127.0.0.1", 1)), recorded


@pytest.fixture
async def hub_server() -> AsyncIterator[tuple[RpcServer, str, list[Event]]]:
    """A real gateway, whose job has node-0 (incarnation 1) joined, behind a real server; and what it recorded."""
    gateway, recorded = _recording_gateway(JobState(nodes=_JOINED))
    token = new_token()
    async with RpcServer([AgentServicer(gateway)], token=token, token_file="/run/stead/shapes/token") as server:
        yield server, token, recorded


@pytest.mark.parametrize(("method", "message", "status", "refusal"),
                         [(m, msg, Status.RESOURCE_EXHAUSTED, r) for m, msg, r in OVER_BOUNDS]
                         + [(m, msg, Status.INVALID_ARGUMENT, r) for m, msg, r in REFUSALS],
                         ids=[r for _, _, r in OVER_BOUNDS + REFUSALS])
async def test_each_bad_report_is_refused_in_the_same_words_and_nothing_is_recorded(
        hub_server: tuple[RpcServer, str, list[Event]], method: str, message: betterproto2.Message, status: Status,
        refusal: str) -> None:
    server, token, recorded = hub_server
    channel = Channel(server.host, server.port)
    attach_token(channel, token)
    call = getattr(pb.AgentServiceStub(channel), method)
    try:
        with pytest.raises(GRPCError) as caught:
            await call(message, timeout=10)
    finally:
        channel.close()
    assert caught.value.status == status
    assert caught.value.message == refusal
    assert recorded == []


async def test_a_live_nodes_reports_are_recorded_as_the_events_they_hold(
        hub_server: tuple[RpcServer, str, list[Event]]) -> None:
    server, token, recorded = hub_server
    started = WorkersStarted(node_id=_LIVE, round=4)
    failure = dataclasses.replace(FAILURE.event, node_id=_LIVE)
    stacks = dataclasses.replace(STACKS.event, node_id=_LIVE)
    health = dataclasses.replace(HEALTH.event, node_id=_LIVE, incarnation=1)
    channel = Channel(server.host, server.port)
    attach_token(channel, token)
    stub = pb.AgentServiceStub(channel)
    try:
        await stub.report_workers(workers_to_proto(AgentReport(incarnation=1, event=started)), timeout=10)
        await stub.report_failure(failure_to_proto(AgentReport(incarnation=1, event=failure)), timeout=10)
        await stub.report_stacks(stacks_to_proto(AgentReport(incarnation=1, event=stacks)), timeout=10)
        await stub.report_health(health_to_proto(AgentReport(incarnation=1, event=health)), timeout=10)
    finally:
        channel.close()
    assert recorded == [started, failure, stacks, health]


async def test_past_the_job_s_bound_of_numerics_reports_only_the_ranks_notes_of_decided_skips_are_still_recorded(
        ) -> None:
    # the bound reached (spec unknown: one node), step 6 decided to skip
    state = JobState(nodes=_JOINED, skip_steps=frozenset({6}), numerics_reports=MAX_NUMERICS_RECORDS)
    gateway, recorded = _recording_gateway(lambda: state)

    def report(*notes: NumericsNote) -> AgentReport[NumericsReported]:
        return AgentReport(incarnation=1, event=NumericsReported(node_id=_LIVE, round=2, notes=notes))

    skip = NumericsNote(kind="step_skipped", rank=0, step=6, samples=())
    for sent in (report(skip), report(dataclasses.replace(skip, step=7)),  # a step the master never decided
                 report(NumericsNote(kind="loss_spike", rank=0, step=9)), report(skip, NumericsNote(
                     kind="loss_spike", rank=0, step=9))):
        await gateway.report_numerics(sent)
    assert recorded == [report(skip).event]
    state = dataclasses.replace(state, numerics_reports=MAX_NUMERICS_RECORDS + SKIP_REPORTS_PER_NODE_STEP)
    await gateway.report_numerics(report(skip))  # its own bound reached too
    assert len(recorded) == 1


# -- a node's report of a warning --------------------------------------------------------

WARNED = JobWarned(node_id=_LIVE, incarnation=1, round=3, signal="SIGUSR1", source="slurm", warned_at=1.8e9,
                   time_left_s=118, said="Slurm warned: time limit in ~118 s", persisted_step=139)


def test_a_warning_crosses_the_wire_with_every_field_but_the_step_the_master_fills() -> None:
    assert _unset_fields(WARNED) == ["committed_step"]
    sent = AgentReport(incarnation=1, event=dataclasses.replace(WARNED, committed_step=7))
    message = warned_to_proto(sent)
    assert _unset_fields(message) == []
    assert {f.name for f in dataclasses.fields(pb.WarnedReport)} == {
        f.name for f in dataclasses.fields(JobWarned)} - {"committed_step"}
    assert warned_from_proto(pb.WarnedReport().parse(bytes(message))) == AgentReport(incarnation=1, event=WARNED)


async def test_each_node_s_report_of_a_warning_is_recorded_once_with_the_newest_committed_step() -> None:
    nodes = {n: NodeState(node_id=n, incarnation=1, phase=NodePhase.JOINED) for n in (_LIVE, "node-1")}
    gateway, recorded = _recording_gateway(JobState(nodes=nodes, checkpoint_step=140))
    token = new_token()
    other = dataclasses.replace(WARNED, node_id="node-1", warned_at=WARNED.warned_at + 1.5, time_left_s=117)
    async with RpcServer([AgentServicer(gateway)], token=token, token_file="/run/stead/shapes/token") as server, \
            MasterClient(server.address, token, call_timeout_s=10) as client:
        await client.report_warned(AgentReport(incarnation=1, event=WARNED))
        await client.report_warned(AgentReport(incarnation=1, event=WARNED))  # a retry: the reply was lost
        await client.report_warned(AgentReport(incarnation=1, event=other))
        await client.report_warned(AgentReport(incarnation=1, event=dataclasses.replace(
            other, warned_at=other.warned_at + 0.5)))  # the same node, the same warning, its clock read anew
    assert recorded == [dataclasses.replace(WARNED, committed_step=140), dataclasses.replace(other, committed_step=140)]


async def test_past_the_bound_of_warning_reports_a_master_records_no_more() -> None:
    gateway, recorded = _recording_gateway(JobState(nodes=_JOINED))
    for i in range(MAX_WARNED_RECORDS + 3):  # a warning every 100 s: each one anew
        await gateway.report_warned(AgentReport(incarnation=1, event=dataclasses.replace(
            WARNED, warned_at=WARNED.warned_at + 100 * i)))
    assert len(recorded) == MAX_WARNED_RECORDS


async def test_a_warning_report_that_could_not_be_recorded_is_recorded_by_its_retry() -> None:
    recorded: list[Event] = []
    failing = [True]

    async def submit(event: Event) -> Record:
        if failing.pop():
            raise OSError("the store is down")
        recorded.append(event)
        return Record(seq=len(recorded), at=0.0, event=event)

    state = JobState(nodes={_LIVE: NodeState(node_id=_LIVE, incarnation=1, phase=NodePhase.JOINED)})
    gateway = AgentGateway(job="shapes", settings=Settings(), submit=submit, get_state=lambda: state,
                           store_addr=lambda: ("127.0.0.1", 1))
    with pytest.raises(OSError, match="the store is down"):
        await gateway.report_warned(AgentReport(incarnation=1, event=WARNED))
    failing.append(False)
    await gateway.report_warned(AgentReport(incarnation=1, event=WARNED))
    assert recorded == [WARNED]
