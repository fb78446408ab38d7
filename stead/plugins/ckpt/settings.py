"""The flash checkpoint's settings: ``--set ckpt.<name>=value`` or ``STEAD_CKPT_<NAME>``."""

from __future__ import annotations

import dataclasses

from stead.plugin import setting

__all__ = ["CheckpointSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    dir: str = setting(".stead/checkpoints", help="where checkpoints are persisted (a job's under <dir>/<job>); "
                                                   "relative to the working directory")
    keep_last: int = setting(2, min=1, help="how many persisted checkpoints are kept per job")
    commit_wait_s: float = setting(5.0, help="how long save() waits for the previous save to be committed by every "
                                             "rank before it skips this one")
    commit_poll_s: float = setting(10.0, min=0.001, help="how long an agent's long poll for a commit may stay open "
                                                          "at the master")
    agent_timeout_s: float = setting(60.0, min=0.001, help="how long a worker waits for its agent to answer "
                                                            "(allocating and pre-faulting shared memory included)")
    verify_wait_s: float = setting(30.0, help="how long load() waits for the agent to verify the checksums of the "
                                              "slot it restores")
    persist_grace_s: float = setting(60.0, help="how long an exiting agent waits for persists still running before "
                                                "it frees the shared memory")
    persist_copy: bool = setting(True, help="a persist first copies the step out of shared memory (when the host "
                                            "has twice its size free) and writes the copy, so the workers go on "
                                            "saving into both slots while it is written; off (or without the room): "
                                            "the slot stays pinned for the whole write and saves that would need it "
                                            "are skipped until it ends")
    persist_on_failure: bool = setting(True, help="when a worker fails, the agent writes the newest committed step "
                                                  "to disk (if not there yet)")
    persist_on_stop: bool = setting(True, help="when the job ends or is stopped (Ctrl-C, SIGTERM, preemption), the "
                                               "agent writes the newest committed step to disk (if not there yet) "
                                               "before it frees the memory, within persist_grace_s; a relaunched "
                                               "job resumes from it")
    shm_dir: str = setting("/dev/shm", help="the tmpfs that holds the checkpoints' shared memory; every process of "
                                            "a node reads it from STEAD_CKPT_SHM_DIR when it starts, so set it in "
                                            "the node's environment")
    shm_namespace: str = setting("", help="a tag in every shared-memory segment's name, so that jobs of the same name "
                                          "on one host (two users, two test runs) never share or remove each other's")
    replicas: int = setting(1, min=0, max=8, help="how many other hosts' memory holds a copy of each node's newest "
                                                  "committed step, so that a lost host's replacement restores it from "
                                                  "a peer instead of disk (0: none; a job on one host keeps none)")
    replica_wait_s: float = setting(30.0, min=0.001, help="how long the workers keep the slots of a step whose "
                                                          "replicas are on their way (saves that would need them "
                                                          "are skipped, so commits follow the replicas' pace) before "
                                                          "they stop waiting and save on; the next step replicated "
                                                          "everywhere makes them wait again")
    replica_max_bytes: int = setting(0, min=0, help="the most shared memory a node gives the replicas it holds for "
                                                    "other nodes, in bytes (0: as much as /dev/shm has); a replica "
                                                    "that does not fit is refused and its source says so")
