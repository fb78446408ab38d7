"""A worker SIGKILLed in the middle of saving: the restarted worker gets the last committed step, intact."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from .conftest import Cluster

SAVER = textwrap.dedent("""
    import torch
    from stead.ckpt import FlashCheckpointer

    ckpt = FlashCheckpointer()
    weights = torch.empty(8 << 20)  # 32 MiB, twice: a save takes long enough to be killed in the middle
    step = 0
    while True:
        step += 1
        weights.fill_(float(step))
        ckpt.save(step, {"a": weights, "b": weights, "step": step})
        if step == 3:
            print("saving", flush=True)
""")


def test_a_worker_killed_mid_save_leaves_the_last_committed_step_intact(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    ext = cluster.agent()
    cluster.round(1)
    env = {**os.environ, **ext.worker_env(round=1, local_rank=0), "STEAD_ROUND": "1", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "STEAD_JOB": cluster.job}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
        time.sleep(random.uniform(0.0, 0.3))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    cluster.failure()
    cluster.round(2, restart_count=1)
    with cluster.worker(round_=2) as ckpt:
        restored = ckpt.load()
    assert restored is not None
    step, state = restored
    assert step >= 3 and state["step"] == step
    assert torch.equal(state["a"], torch.full((8 << 20,), float(step)))
    assert torch.equal(state["b"], state["a"])
