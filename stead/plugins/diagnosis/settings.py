"""The diagnosis plugin's settings: ``--set diagnosis.<name>=value`` or ``STEAD_DIAGNOSIS_<NAME>``."""

from __future__ import annotations

import dataclasses

from stead.plugin import setting

__all__ = ["DiagnosisSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnosisSettings:
    hang_detection: bool = setting(True, help="watch the job's step progress and act on a hang")
    hang_floor_s: float = setting(20.0, min=1.0, help="the shortest time without a completed step that counts as a "
                                                      "hang, whatever the step times")
    hang_factor: float = setting(10.0, min=1.0, help="a hang is this many times the longest recent gap between "
                                                     "completed steps (above hang_floor_s): at least the ratio "
                                                     "between the job's slowest and fastest steps")
    first_step_s: float = setting(600.0, min=1.0, help="how long a round may take to its first step (start-up, "
                                                        "compilation, a checkpoint load) before it counts as hung")
    phase_s: float = setting(3600.0, min=1.0, help="how long a phase a worker declared with stead.phase() may go "
                                                   "without a step")
    hang_restarts: bool = setting(True, help="restart the workers of a hung round (one restart of the budget); false: "
                                             "only record the diagnosis.hang event")
    hang_check_s: float = setting(1.0, min=0.05, help="how often the hang detector looks")
    stacks_wait_s: float = setting(5.0, min=0.1, help="how long the detector waits for every node's stacks before "
                                                      "it acts on the ones it has")
    root_cause_wait_s: float = setting(0.5, min=0.0, help="a failure that is a collective's error (usually another "
                                                          "rank's failure seen from here) waits this long for the "
                                                          "round's other failures, so the decision is about the "
                                                          "cause; 0: decide on the first failure")
    rules_file: str = setting("", help="a TOML file of failure classification rules tried before the built-in ones "
                                       "([[rules]] tables, and [actions] mapping a class to an action)")
    stragglers: bool = setting(True, help="compare the nodes' own time per step and report a node that is "
                                          "consistently slower than the others")
    straggler_factor: float = setting(1.5, min=1.0, help="a node is a straggler when its own time per step is this "
                                                         "many times the median of the other nodes'")
    straggler_window_s: float = setting(30.0, min=0.0, help="how long a node must stay over straggler_factor before "
                                                            "it is reported (and back under it to be cleared)")
    straggler_relaunch: bool = setting(False, help="replace a straggler node at the job's next committed checkpoint "
                                                   "(one node relaunch of its budget)")
