"""The scaler plugin's settings: ``--set scaler.<name>=value`` or ``STEAD_SCALER_<NAME>``."""

from __future__ import annotations

import dataclasses

from stead.plugin import setting

__all__ = ["ScalerSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalerSettings:
    sample_every_s: float = setting(10.0, min=0.05, help="how often the nodes' last reported resource use (memory, "
                                                          "CPU, GPU) is added to the job's figures")
    headroom: float = setting(0.2, min=0.0, max=4.0, help="the margin a recommended request adds over what the "
                                                          "job used (0.2: 20 %)")
    policy: str = setting("default", help="the membership policy that decides how many nodes the job runs on: "
                                          "default (what stead run or stead scale asked for, capped by "
                                          "capacity_nodes), or one installed under stead.scaler_policies")
    policy_every_s: float = setting(10.0, min=0.05, help="how often the membership policy is asked again, "
                                                         "besides after each request and each lost node")
    oom_batch_factor: float = setting(0.5, min=0.01, max=1.0, help="after a worker ran out of memory, the "
                                                                    "per-worker batch hint (STEAD_BATCH_SCALE) is "
                                                                    "multiplied by this (scripts opt in with "
                                                                    "stead.data.batch_size)")
    oom_budget: int = setting(2, min=0, help="how many out-of-memory failures shrink the batch hint; later ones "
                                             "restart with the same hint (the restart budget decides)")
    oom_memory_factor: float = setting(1.5, min=1.0, max=16.0, help="a node its platform killed for its memory (a "
                                                                     "pod's OOMKilled) is relaunched with its "
                                                                     "memory limit multiplied by this")
    oom_memory_budget: int = setting(2, min=0, help="how many times a node's memory limit is raised; later "
                                                    "out-of-memory kills relaunch it with the same limit (the "
                                                    "relaunch budget decides)")
    pending_retry_s: float = setting(300.0, min=0.001, help="a node the platform has no room for (node.pending) "
                                                             "is given up while the job has MIN nodes without it, "
                                                             "and asked for again this much later, or at once "
                                                             "when the platform has room again (platform.room: a "
                                                             "host offered itself)")
    max_memory: str = setting("", help="the highest memory limit a raise goes to, as a quantity (e.g. 512Gi); "
                                       "empty: no cap but the budget")
