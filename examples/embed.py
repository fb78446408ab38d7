"""Embed stead's master in your own asyncio program (what a platform team does).

    .venv/bin/python examples/embed.py

It runs examples/train.py on 2 local worker processes, watches the job's state
change from inside the program, and prints the outcome. Only the public
``stead.embed`` API is used.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import stead.embed as embed

TRAIN = str(Path(__file__).with_name("train.py"))


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="stead-embed-") as workdir:  # the job's store and token, removed after
        spec = embed.JobSpec(entrypoint=(TRAIN, "--steps", "20"), nproc_per_node=2, job_name="embedded",
                             store_url=f"sqlite:///{workdir}/state.db")
        async with embed.run(spec, token_file=f"{workdir}/token") as job:
            print(f"master listening on {job.address}")
            running = await job.wait(embed.JobPhase.RUNNING)
            print(f"job {running.phase.value}: round {running.rdzv.round} with {', '.join(running.rdzv.members)}")
            final = await job.wait()
            print(f"job {final.phase.value}: {final.reason}")


if __name__ == "__main__":
    asyncio.run(main())
