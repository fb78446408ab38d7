"""No worker outlives its agent, even an agent killed with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _agent_helpers import alive, wait_dead, write
from _polling import wait_until

FAKE_AGENT = """
    import json, os, sys
    import anyio
    from stead.core.agent.workers import WorkerGroup, WorkerSpec
    from stead.core.agent.zygote import Zygote

    async def main(mode, worker, out):
        async with Zygote(preload=()) as zygote:
            if mode == "zygote":
                assert await zygote.wait_ready()
            async with WorkerGroup(zygote=zygote if mode == "zygote" else None) as group:
                specs = [WorkerSpec(argv=(sys.executable, "-u", worker, str(r)), env=dict(os.environ),
                                    cwd=os.path.dirname(worker), local_rank=r) for r in range(2)]
                await group.start(specs)
                with open(out, "w") as f:
                    f.write(json.dumps({"workers": list(group.pids.values()), "zygote": zygote.pid}) + "\\n")
                await anyio.sleep_forever()

    anyio.run(main, *sys.argv[1:])
"""

WORKER = """
    import subprocess, sys, time
    child = subprocess.Popen(["sleep", "60"])
    with open(sys.argv[0] + f".{sys.argv[1]}.child", "w") as f:
        f.write(f"{child.pid}\\n")
    time.sleep(60)
"""


def read_when_written(path: Path, agent: subprocess.Popen[bytes]) -> str:
    def written() -> bool:
        if agent.poll() is not None:
            pytest.fail(f"the fake agent exited early with {agent.returncode}")
        return path.exists() and path.read_text().endswith("\n")

    wait_until(written, f"the fake agent's processes wrote {path}")
    return path.read_text()


@pytest.mark.parametrize("mode", ["zygote", "spawn"])
def test_sigkilled_agent_leaves_no_worker_alive(tmp_path: Path, mode: str) -> None:
    agent_script = write(tmp_path, "agent.py", FAKE_AGENT)
    worker = write(tmp_path, "worker.py", WORKER)
    out = tmp_path / "pids.json"
    agent = subprocess.Popen([sys.executable, str(agent_script), mode, str(worker), str(out)])
    grandchildren: list[int] = []
    try:
        pids = json.loads(read_when_written(out, agent))
        grandchildren = [int(read_when_written(Path(f"{worker}.{r}.child"), agent)) for r in range(2)]
        watched = [*pids["workers"], pids["zygote"]]
        assert all(alive(pid) for pid in watched + grandchildren)
        agent.kill()
        agent.wait()
        wait_dead(watched, "the workers and the zygote of a SIGKILLed agent")
        if mode == "zygote":  # the zygote kills its workers' process groups before it goes
            wait_dead(grandchildren, "the workers' children of a SIGKILLed agent")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for pid in grandchildren:  # spawned workers' children have no one left to stop them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
