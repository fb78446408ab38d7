"""Embed stead's master in your own asyncio program (what a platform team does).

    .venv/bin/python examples/embed.py

It runs examples/train.py on 2 local worker processes, watches the job's state
change from inside the program, and prints the outcome.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import stead
from stead.core.launch import parse_run_args
from stead.core.runner import agent_spec_factory, job_submitted, load_platform

TRAIN = str(Path(__file__).with_name("train.py"))


async def main() -> None:
    workdir = tempfile.mkdtemp(prefix="stead-embed-")
    argv = ["--nproc-per-node", "2", "--job-name", "embedded", "--store", f"sqlite:///{workdir}/state.db",
            TRAIN, "--steps", "20"]
    config = parse_run_args(argv)
    platform = await load_platform("local", config.settings)
    master_config = stead.MasterConfig(
        job=config.job_name, store_url=config.store_url, settings=config.settings, platform=platform,
        node_spec=agent_spec_factory(config, argv), token_file=f"{workdir}/token",
    )
    async with stead.Master(master_config) as master:
        print(f"master listening on {master.address}")
        await master.submit_job(job_submitted(config))
        running = await master.reactor.wait_until(lambda s: s.phase.value == "running" or s.phase.terminal)
        print(f"job {running.phase.value}: round {running.rdzv.round} with {', '.join(running.rdzv.members)}")
        final = await master.wait()
        print(f"job {final.phase.value}: {final.reason}")


if __name__ == "__main__":
    asyncio.run(main())
