"""Failure classification: the rules table, the rules file, and the decisions that carry class, rule and evidence."""

from __future__ import annotations

import dataclasses
import re
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stead.core.agent.gpu import GpuHealth
from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.events import (
    Event,
    JobSubmitted,
    NodeExited,
    NodeJoined,
    NodeLost,
    Record,
    RecoveryAction,
    RecoveryDecided,
    WorkerFailed,
)
from stead.core.plugins import NodeTelemetry, PluginContext
from stead.core.statemachine import JobPhase, JobState
from stead.core.statemachine.rendezvous import RendezvousState
from stead.core.store import open_store
from stead.plugins.diagnosis import DiagnosisPlugin, DiagnosisSettings, FailureClassified
from stead.plugins.diagnosis.rules import (
    BUILTIN_RULES,
    Action,
    Facts,
    FailureClass,
    Repeats,
    Rule,
    RuleSet,
    classify,
    load_repeats,
    load_rules_file,
    rules_from_entry_point,
)
from stead.testing import FakeClock
from stead.testing.nvml import FakeNvml

TB = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n{}\n"
KERNEL_OOM = ("kernel: Memory cgroup out of memory: Killed process 4242 (python) total-vm:221448kB, "
              "anon-rss:211200kB")


def worker(tail: str = "", *, exit_code: int | None = 1, sig: int | None = None, oom: str = "", gpu: str = "",
           step: int | None = 3, round: int = 1) -> WorkerFailed:
    return WorkerFailed(node_id="node-0", round=round, local_rank=0, rank=2, exit_code=exit_code, signal=sig,
                        step=step, error_tail=tail, oom=oom, gpu=gpu)


CASES = [
    # (what, failure facts, class, rule)
    ("torch.OutOfMemoryError", Facts.of_worker(worker(TB.format(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"))),
     FailureClass.OOM, "torch-out-of-memory"),
    ("CUDA OOM inside a RuntimeError", Facts.of_worker(worker(TB.format(
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB"))), FailureClass.OOM, "cuda-out-of-memory"),
    ("the kernel OOM killer, with its record", Facts.of_worker(worker(exit_code=None, sig=9, oom=KERNEL_OOM)),
     FailureClass.OOM, "kernel-oom-kill"),
    ("137 under a shell, with a cgroup record", Facts.of_worker(worker(
        exit_code=137, oom="memory cgroup /job: oom_kill 0 -> 1 (memory.oom_control)")),
     FailureClass.OOM, "kernel-oom-kill"),
    ("SIGKILL without an OOM record is not an OOM", Facts.of_worker(worker(exit_code=None, sig=9)),
     FailureClass.TRANSIENT, "killed-by-signal"),
    ("137 alone is not an OOM", Facts.of_worker(worker(exit_code=137)), FailureClass.TRANSIENT, "unknown"),
    ("an allocation refused under RLIMIT_AS", Facts.of_worker(worker(TB.format(
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
        "tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"))),
     FailureClass.OOM, "allocation-refused"),
    ("Python's MemoryError", Facts.of_worker(worker(TB.format("MemoryError"))), FailureClass.OOM,
     "python-memory-error"),
    ("a gloo peer that went away", Facts.of_worker(worker(TB.format(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:5678"))), FailureClass.COLLECTIVE, "gloo-error"),
    ("a gloo peer that cannot be reached (a partition)", Facts.of_worker(worker(TB.format(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/socket.cc:142] rv != -1. -1 vs -1. connect: Invalid "
        "argument"))), FailureClass.COLLECTIVE, "gloo-error"),
    ("a gloo timeout", Facts.of_worker(worker(TB.format(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
        "for recv operation to complete"))), FailureClass.COLLECTIVE, "gloo-error"),
    ("an NCCL error", Facts.of_worker(worker(TB.format(
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, "
        "NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or external library call failed"))),
     FailureClass.COLLECTIVE, "nccl-error"),
    ("the NCCL watchdog's timeout", Facts.of_worker(worker(
        "[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=42, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", exit_code=None,
        sig=6)), FailureClass.COLLECTIVE, "nccl-error"),
    ("a connection reset", Facts.of_worker(worker(TB.format("ConnectionResetError: Connection reset by peer"))),
     FailureClass.COLLECTIVE, "gloo-error"),
    ("an uncorrectable ECC error", Facts.of_worker(worker(TB.format(
        "RuntimeError: CUDA error: uncorrectable ECC error encountered"))), FailureClass.HARDWARE,
     "cuda-or-nvml-error"),
    ("a GPU fault the agent saw", Facts.of_worker(worker(TB.format("RuntimeError: CUDA error: unknown error"),
                                                          gpu="GPU 1: XID 79 (GPU has fallen off the bus)")),
     FailureClass.HARDWARE, "gpu-fault"),
    ("a NameError", Facts.of_worker(worker(TB.format("NameError: name 'modle' is not defined"))),
     FailureClass.USER_ERROR, "deterministic-python-error"),
    ("stead refusing a checkpoint that does not fit", Facts.of_worker(worker(TB.format(
        "[rank0]: stead.plugins.ckpt.errors.StateMismatch: step 3 does not fit"))), FailureClass.USER_ERROR,
     "deterministic-python-error"),
    ("a NaN gradient stead.numerics caught", Facts.of_worker(worker(TB.format(
        "[rank1]: stead.core.worker.numerics.NonFiniteGradientError: non-finite gradient (NaN or Inf) on rank 1"))),
     FailureClass.NUMERICAL, "non-finite-gradient"),
    ("a replica whose parameters differ from the majority's", Facts.of_worker(worker(TB.format(
        "[rank2]: stead.core.worker.numerics.ReplicaMismatchError: replica mismatch: rank 2 (host h2) at step 4"))),
     FailureClass.NUMERICAL, "replica-mismatch"),
    ("replicas that differ with nobody to blame", Facts.of_worker(worker(TB.format(
        "stead.core.worker.numerics.ReplicaMismatchError: replicas' parameters differ at step 4 and no replica can "
        "be blamed: 2 replicas"))), FailureClass.NUMERICAL, "replica-mismatch-unattributed"),
    ("an illegal memory access is not called hardware", Facts.of_worker(worker(TB.format(
        "RuntimeError: CUDA error: an illegal memory access was encountered"))), FailureClass.TRANSIENT, "unknown"),
    ("a node whose heartbeats stopped", Facts.of_node(NodeLost(node_id="n", incarnation=1)),
     FailureClass.NODE_LOST, "node-lost"),
    ("a pod the kubelet OOM-killed", Facts.of_node(NodeLost(node_id="n", incarnation=1,
                                                            reason="pod deleted: OOMKilled")),
     FailureClass.OOM, "platform-oom-killed"),
    ("an agent that exited", Facts.of_node(NodeExited(node_id="n", incarnation=1, exit_code=1)),
     FailureClass.NODE_LOST, "node-lost"),
    ("a pod whose container was OOM-killed", Facts.of_node(NodeExited(node_id="n", incarnation=1, signal=9,
                                                                      reason="OOMKilled")),
     FailureClass.OOM, "platform-oom-killed"),
    ("an evicted pod", Facts.of_node(NodeExited(node_id="n", incarnation=1, reason="Evicted: low on memory")),
     FailureClass.NODE_LOST, "node-lost"),
]


@pytest.mark.parametrize(("what", "facts", "failure_class", "rule"), CASES, ids=[c[0] for c in CASES])
def test_each_failure_gets_its_class_from_the_rule_that_matches(what: str, facts: Facts,
                                                                 failure_class: FailureClass, rule: str) -> None:
    found = classify(facts, BUILTIN_RULES)
    assert (found.failure_class, found.rule) == (failure_class, rule), what
    assert found.evidence


@pytest.mark.parametrize(("failure_class", "action", "recovery"), [
    (FailureClass.USER_ERROR, Action.FAIL, RecoveryAction.FAIL),
    (FailureClass.OOM, Action.MORE_MEMORY, RecoveryAction.RESTART),
    (FailureClass.HARDWARE, Action.RELAUNCH, RecoveryAction.RELAUNCH),
    (FailureClass.NODE_LOST, Action.RELAUNCH, RecoveryAction.RELAUNCH),
    (FailureClass.COLLECTIVE, Action.RESTART, RecoveryAction.RESTART),
    (FailureClass.TRANSIENT, Action.RESTART, RecoveryAction.RESTART),
])
def test_each_class_leads_to_its_action(failure_class: FailureClass, action: Action,
                                        recovery: RecoveryAction) -> None:
    rule = Rule(name="r", failure_class=failure_class)
    found = classify(Facts(), (rule,))
    assert (found.action, found.action.recovery) == (action, recovery)


@pytest.mark.parametrize(("message", "action"), [
    ("replica mismatch: rank 2 (host h2) at step 4: its parameters differ from the majority's", Action.RELAUNCH),
    ("replicas' parameters differ at step 4 and no replica can be blamed", Action.RESTART),
], ids=["odd-rank-known", "nobody-to-blame"])
def test_a_replica_that_differs_has_its_node_relaunched_and_a_mismatch_nobody_can_be_blamed_for_restarts(
        message: str, action: Action) -> None:
    found = classify(Facts.of_worker(worker(TB.format(f"ReplicaMismatchError: {message}"))), BUILTIN_RULES)
    assert (found.failure_class, found.action) == (FailureClass.NUMERICAL, action)


def test_the_evidence_names_what_matched() -> None:
    found = classify(Facts.of_worker(worker(TB.format("RuntimeError: x\nConnection reset by peer"))), BUILTIN_RULES)
    assert found.evidence == "Connection reset by peer"
    assert classify(Facts.of_worker(worker(exit_code=None, sig=9, oom=KERNEL_OOM)), BUILTIN_RULES).evidence == \
        KERNEL_OOM


@given(st.builds(Facts, on=st.sampled_from(["worker", "node"]), exit_code=st.none() | st.integers(-300, 300),
                 signal=st.none() | st.integers(0, 70), exception=st.text(max_size=30), message=st.text(max_size=60),
                 tail=st.text(max_size=300), oom=st.text(max_size=20), gpu=st.text(max_size=20),
                 platform_reason=st.text(max_size=30)))
def test_every_failure_is_classified_and_nothing_raises(facts: Facts) -> None:
    found = classify(facts, BUILTIN_RULES)
    assert isinstance(found.failure_class, FailureClass) and isinstance(found.evidence, str)
    if facts.gpu:
        assert found.failure_class is FailureClass.HARDWARE  # a GPU fault outranks whatever else it shows


# -- rules from users -----------------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    return path


def test_a_rules_file_goes_before_the_built_in_rules_and_can_change_a_class_action(tmp_path: Path) -> None:
    rules, actions = load_rules_file(write(tmp_path, '''
[actions]
oom = "fail"

[[rules]]
name = "stale-nfs"
class = "transient"
exception = "OSError"
message = "Stale file handle"

[[rules]]
name = "our-nan-guard"
class = "user_error"
tail = "loss is NaN"
signals = ["SIGABRT", 11]
'''))
    table = RuleSet((*rules, *BUILTIN_RULES), {**RuleSet(()).actions, **actions})
    stale = table.classify(Facts.of_worker(worker(TB.format("OSError: [Errno 116] Stale file handle"))))
    assert (stale.rule, stale.failure_class, stale.action) == ("stale-nfs", FailureClass.TRANSIENT, Action.RESTART)
    nan = table.classify(Facts.of_worker(worker("loss is NaN at step 7", exit_code=None, sig=signal.SIGABRT)))
    assert (nan.rule, nan.action) == ("our-nan-guard", Action.FAIL)
    assert nan.evidence == "loss is NaN at step 7; killed by SIGABRT"
    oom = table.classify(Facts.of_worker(worker(TB.format("MemoryError"))))
    assert (oom.failure_class, oom.action) == (FailureClass.OOM, Action.FAIL)


@pytest.mark.parametrize(("text", "problem"), [
    ("[[rules]\nname=", "is not valid TOML"),
    ("[[rules]]\nclass = 'oom'\n", "every rule needs a name"),
    ("[[rules]]\nname = 'x'\nclass = 'bad'\n", "class = 'bad'; use one of 'user_error', 'oom'"),
    ("[[rules]]\nname = 'x'\nclass = 'oom'\ntail = '('\n", "tail = '(' is not a valid regular expression"),
    ("[[rules]]\nname = 'x'\nclass = 'oom'\nexcepton = 'E'\n", "unknown key(s) ['excepton']"),
    ("[[rules]]\nname = 'x'\nclass = 'oom'\nsignals = ['SIGFOO']\n", "'SIGFOO' is not a signal name"),
    ("[[rules]]\nname = 'x'\nclass = 'oom'\nexit_codes = 1\n", "exit_codes must be a list of integers"),
    ("[[rules]]\nname = 'x'\nclass = 'oom'\noom_record = 'yes'\n", "oom_record must be true or false"),
    ("[actions]\noom = 'explode'\n", "[actions]: oom = 'explode'; use one of 'fail', 'restart'"),
    ("[rule]\nname = 'x'\n", "unknown table(s) ['rule']"),
])
def test_a_rules_file_that_is_wrong_is_refused_saying_where_and_why(tmp_path: Path, text: str,
                                                                     problem: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(problem)) as caught:
        load_rules_file(path)
    assert str(path) in str(caught.value)


def test_a_missing_rules_file_stops_the_plugin_before_the_job_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot be read.*fix diagnosis\.rules_file"):
        DiagnosisPlugin(settings=DiagnosisSettings(rules_file=str(tmp_path / "nope.toml")))


def test_an_entry_point_gives_rules_as_a_sequence_or_a_function() -> None:
    rule = Rule(name="ours", failure_class=FailureClass.HARDWARE, tail=re.compile("MyAccelError"))
    assert rules_from_entry_point("x", [rule]) == (rule,)
    assert rules_from_entry_point("x", lambda: (rule,)) == (rule,)
    with pytest.raises(ConfigError, match=r"entry point .x. of stead\.diagnosis_rules gave dict"):
        rules_from_entry_point("x", {"name": "ours"})


# -- the plugin's decisions -------------------------------------------------------------------------------------


class Harness:
    def __init__(self, plugin: DiagnosisPlugin, state: JobState) -> None:
        self.plugin, self.state, self.emitted = plugin, state, list[Event]()
        self.clock = FakeClock()
        #: what the nodes' last heartbeats said
        self.telemetry: dict[str, NodeTelemetry] = {}

    async def __aenter__(self) -> Harness:
        self.store = await open_store("memory://")

        async def emit(event: Event) -> Record:
            self.emitted.append(event)
            return Record(seq=len(self.emitted), at=0.0, event=event)

        self.ctx = PluginContext(plugin="diagnosis", job="j", settings=self.plugin.settings, stead_settings=Settings(),
                                 store=self.store, state=lambda: self.state, emit=emit, add_rpc_handler=None,
                                 clock=self.clock, telemetry=lambda: self.telemetry)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.store.close()

    async def fail(self, failure: WorkerFailed) -> RecoveryDecided:
        self.state = dataclasses.replace(self.state, last_failure=failure)
        await self.plugin.handle(record=Record(seq=1, at=0.0, event=failure), ctx=self.ctx)
        decision = self.emitted[-1]
        assert isinstance(decision, RecoveryDecided)
        return decision

    async def feed(self, event: Event) -> None:
        await self.plugin.handle(record=Record(seq=1, at=0.0, event=event), ctx=self.ctx)


AWAITING = JobState(phase=JobPhase.RECOVERING, awaiting_decision=True)


@pytest.mark.anyio
async def test_a_decision_carries_its_class_rule_and_evidence() -> None:
    async with Harness(DiagnosisPlugin(), AWAITING) as h:
        decision = await h.fail(worker(exit_code=None, sig=9, oom=KERNEL_OOM))
    assert (decision.action, decision.failure_class, decision.rule) == (RecoveryAction.RESTART, "oom",
                                                                       "kernel-oom-kill")
    assert decision.evidence == KERNEL_OOM
    assert "more memory wanted" in decision.reason and decision.decided_by == "diagnosis"


@pytest.mark.anyio
async def test_a_gpu_fault_from_nvml_relaunches_the_node() -> None:
    nvml = FakeNvml(gpus=2)
    gpus = GpuHealth(nvml=nvml)
    assert gpus.open() == ""
    nvml.xid(1, 79)
    faults = "; ".join(str(p) for p in gpus.check())
    gpus.close()
    async with Harness(DiagnosisPlugin(), AWAITING) as h:
        decision = await h.fail(worker(TB.format("RuntimeError: CUDA error: unknown error"), gpu=faults))
    assert (decision.action, decision.failure_class, decision.rule) == (RecoveryAction.RELAUNCH, "hardware",
                                                                       "gpu-fault")
    assert decision.evidence == "GPU 1: XID 79 (GPU has fallen off the bus)"


@pytest.mark.anyio
async def test_a_lost_node_is_classified_once_and_stead_s_own_relaunches_are_not() -> None:
    running = JobState(phase=JobPhase.RUNNING)
    async with Harness(DiagnosisPlugin(), running) as h:
        await h.feed(NodeJoined(node_id="node-1", incarnation=1))
        await h.feed(NodeLost(node_id="node-1", incarnation=1, reason="no heartbeat for 10 s"))
        await h.feed(NodeExited(node_id="node-1", incarnation=1, signal=9))  # its kill: the same failure
        await h.feed(NodeJoined(node_id="node-1", incarnation=2))
        await h.feed(NodeLost(node_id="node-1", incarnation=2, reason="relaunched: GPU 0: XID 79"))
        await h.feed(NodeJoined(node_id="node-0", incarnation=1))
        await h.feed(NodeExited(node_id="node-0", incarnation=1, exit_code=1))
    assert h.emitted == [
        FailureClassified(node_id="node-1", incarnation=1, failure_class="node_lost", action="relaunch",
                          rule="node-lost", evidence="platform: no heartbeat for 10 s"),
        FailureClassified(node_id="node-0", incarnation=1, failure_class="node_lost", action="relaunch",
                          rule="node-lost", evidence="exit code 1"),
    ]


def test_the_readme_rules_file_loads_and_does_what_it_says(tmp_path: Path) -> None:
    section = (Path(__file__).parents[2] / "README.md").read_text().split("## What a failure was", 1)[1]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    rules, actions = load_rules_file(write(tmp_path, toml))
    table = RuleSet((*rules, *BUILTIN_RULES), {**RuleSet(()).actions, **actions})
    stale = table.classify(Facts.of_worker(worker(TB.format("OSError: [Errno 116] Stale file handle"))))
    assert (stale.rule, stale.failure_class) == ("stale-nfs", FailureClass.TRANSIENT)
    assert table.classify(Facts.of_worker(worker(TB.format("MemoryError")))).action is Action.FAIL
    assert load_repeats(write(tmp_path, toml)) == Repeats(after=3, failure_class=FailureClass.USER_ERROR,
                                                          of=frozenset({FailureClass.TRANSIENT}))


GLOO_RESET = TB.format("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                       "peer [127.0.0.1]:5678")


async def settle(h: Harness) -> None:
    """Wait for the plugin's root-cause decision (its window is short in these tests)."""
    pending = h.plugin._root_cause
    if pending is not None and pending.task is not None:
        await pending.task


async def decided_after_window(symptom: WorkerFailed, state: JobState = AWAITING) -> RecoveryDecided:
    """The one decision on ``symptom`` alone, once the root-cause window (5 s of the fake clock) has passed."""
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=5.0))
    async with Harness(plugin, dataclasses.replace(state, last_failure=symptom)) as h:
        await h.feed(symptom)
        await h.clock.advance(4.9)
        assert h.emitted == []  # the window is still open: no decision yet
        await h.clock.advance(0.1)
        await settle(h)
    (decision,) = h.emitted
    assert isinstance(decision, RecoveryDecided)
    return decision


@pytest.mark.anyio
async def test_a_collective_error_waits_for_the_round_s_real_cause_and_the_decision_is_about_it() -> None:
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=5.0))
    async with Harness(plugin, AWAITING) as h:
        symptom = dataclasses.replace(worker(GLOO_RESET), rank=0, exited_at=100.2)
        h.state = dataclasses.replace(h.state, last_failure=symptom)
        await h.feed(symptom)
        assert h.emitted == []  # waiting for the cause
        cause = dataclasses.replace(worker(exit_code=None, sig=9, oom=KERNEL_OOM), node_id="node-1", rank=3,
                                    exited_at=100.0)
        await h.feed(cause)  # a cause arrived: decided without waiting out the window
        await settle(h)
    (decision,) = h.emitted
    assert isinstance(decision, RecoveryDecided)
    assert (decision.failure_class, decision.node_id, decision.rank) == ("oom", "node-1", 3)
    assert "the likeliest cause among 2 failures of the round" in decision.reason


@pytest.mark.anyio
async def test_a_collective_error_alone_is_decided_after_the_window() -> None:
    decision = await decided_after_window(worker(GLOO_RESET))
    assert (decision.failure_class, decision.rule, decision.action) == ("collective", "gloo-error",
                                                                       RecoveryAction.RESTART)


@pytest.mark.anyio
async def test_a_collective_error_after_a_rank_of_the_node_exited_0_blames_that_rank() -> None:
    decision = await decided_after_window(dataclasses.replace(worker(GLOO_RESET), rank=0, exited_ok_ranks=(1,)))
    assert (decision.failure_class, decision.rule, decision.action) == ("user_error", "early-exit",
                                                                       RecoveryAction.FAIL)
    assert (decision.node_id, decision.rank) == ("node-0", 1)
    assert "rank 1 (on node-0) exited 0 while rank 0 was still in a collective" in decision.evidence


@pytest.mark.anyio
async def test_a_collective_error_after_another_node_s_workers_all_exited_0_blames_that_node() -> None:
    spec = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=2)
    rdzv = RendezvousState(round=1, members=("node-0", "node-1"), active=True, succeeded=frozenset({"node-1"}))
    decision = await decided_after_window(dataclasses.replace(worker(GLOO_RESET), rank=0),
                                          dataclasses.replace(AWAITING, spec=spec, rdzv=rdzv))
    assert (decision.rule, decision.node_id, decision.rank) == ("early-exit", "node-1", 2)
    assert "ranks 2, 3 (on node-1) exited 0 while rank 0 was still in a collective" in decision.evidence


@pytest.mark.anyio
async def test_a_stopped_plugin_leaves_no_root_cause_wait_behind() -> None:
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=60.0))
    async with Harness(plugin, AWAITING) as h:
        symptom = worker(GLOO_RESET)
        h.state = dataclasses.replace(h.state, last_failure=symptom)
        await h.feed(symptom)
        task = plugin._root_cause.task if plugin._root_cause else None
        await plugin.stop(ctx=h.ctx)
    assert task is not None and task.cancelled() and h.emitted == []


@pytest.mark.anyio
async def test_a_collective_error_is_decided_at_once_when_a_member_node_ends_and_the_reason_says_so() -> None:
    # a pod OOM-killed whole: its agent dies with its workers, so no failure of theirs comes, only the pod's end
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=60.0))
    rdzv = RendezvousState(round=1, members=("node-0", "node-1"), active=True)
    async with Harness(plugin, dataclasses.replace(AWAITING, rdzv=rdzv)) as h:
        symptom = dataclasses.replace(worker(GLOO_RESET), rank=0)
        h.state = dataclasses.replace(h.state, last_failure=symptom)
        await h.feed(symptom)
        await h.feed(NodeExited(node_id="node-9", incarnation=1, exit_code=137))  # not a member: still waiting
        assert h.emitted == []
        await h.feed(NodeExited(node_id="node-1", incarnation=1, exit_code=137, reason="OOMKilled", oom=True))
        await settle(h)
    (decision,) = h.emitted
    assert isinstance(decision, RecoveryDecided)
    assert (decision.failure_class, decision.action) == ("collective", RecoveryAction.RESTART)
    assert "node node-1 exited meanwhile (platform: OOMKilled" in decision.reason, decision.reason
    assert "no restart is spent" in decision.reason



def beat(at: float) -> NodeTelemetry:
    return NodeTelemetry(incarnation=1, round=1, step=10, step_compute_s=None, rss_bytes=None, cpu_percent=None,
                         seen=at)


@pytest.mark.anyio
@pytest.mark.parametrize("silent_node", ["lost", "heard again"])
async def test_a_collective_error_waits_past_its_window_for_a_member_silent_since_it(silent_node: str) -> None:
    # a host gone with its node: its peers see a collective error, and nothing else comes until its heartbeats are
    # missed for heartbeat_timeout_s (5 s by default); deciding at 0.5 s would spend a restart (or fail the job)
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=0.5))
    rdzv = RendezvousState(round=1, members=("node-0", "node-1"), active=True)
    async with Harness(plugin, dataclasses.replace(AWAITING, rdzv=rdzv)) as h:
        h.telemetry = {"node-0": beat(-0.2), "node-1": beat(-0.3)}
        symptom = dataclasses.replace(worker(GLOO_RESET), rank=0)
        h.state = dataclasses.replace(h.state, last_failure=symptom)
        await h.feed(symptom)
        await h.clock.advance(3.0)
        assert h.emitted == []  # node-1 has not been heard from since the failure: its loss may be coming
        if silent_node == "lost":
            await h.feed(NodeLost(node_id="node-1", incarnation=1, reason="no heartbeat for 5 s"))
        else:
            h.telemetry["node-1"] = beat(h.clock.now())
            await h.clock.advance(0.2)
        await settle(h)
    (decision,) = h.emitted
    assert isinstance(decision, RecoveryDecided)
    assert decision.failure_class == "collective"
    assert ("node node-1 was lost meanwhile" in decision.reason) is (silent_node == "lost"), decision.reason
