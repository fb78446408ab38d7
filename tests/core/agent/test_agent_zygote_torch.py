"""Workers forked from a zygote that imported torch: gloo process groups and DataLoader workers work."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _agent_helpers import py, spec, wait_for_file, write

from stead.core.agent.workers import WorkerExit, WorkerGroup
from stead.core.agent.zygote import Zygote
from stead.testing import leaks

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def torch_zygote(anyio_backend: str) -> AsyncIterator[Zygote]:
    """One zygote with torch imported, shared by this module's tests (importing torch takes seconds)."""
    async with Zygote(preload=("torch",)) as zygote:
        assert zygote.pid is not None
        leaks.LONG_LIVED.add(zygote.pid)
        try:
            assert await zygote.wait_ready()
            assert zygote.info["failed"] == {}
            yield zygote
        finally:
            leaks.LONG_LIVED.discard(zygote.pid)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def run_one(zygote: Zygote, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> WorkerExit:
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(argv, cwd, env=env)])
        results = [e async for e in group.exits()]
    return results[0]


async def test_forked_worker_runs_a_gloo_process_group(tmp_path: Path, torch_zygote: Zygote) -> None:
    out = tmp_path / "out"
    script = write(tmp_path, "ddp.py", f"""
        import os, sys
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        open({str(out)!r}, "w").write(f"{{t.item()}} {{os.getppid()}} {{'torch' in sys.modules}}\\n")
    """)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    result = await run_one(torch_zygote, py(script), tmp_path, env)
    assert result.exit_code == 0, result.error_tail
    total, ppid, had_torch = (await wait_for_file(out)).split()
    assert (float(total), int(ppid), had_torch) == (1.0, torch_zygote.pid, "True")


async def test_forked_worker_uses_dataloader_worker_processes(tmp_path: Path, torch_zygote: Zygote) -> None:
    out = tmp_path / "out"
    script = write(tmp_path, "loader.py", f"""
        import os
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Squares(Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return torch.tensor([i * i, os.getpid()])

        if __name__ == "__main__":
            rows = torch.cat(list(DataLoader(Squares(), batch_size=2, num_workers=2)))
            pids = set(rows[:, 1].tolist()) - {{os.getpid()}}
            open({str(out)!r}, "w").write(f"{{int(rows[:, 0].sum())}} {{len(pids)}}\\n")
    """)
    result = await run_one(torch_zygote, py(script), tmp_path)
    assert result.exit_code == 0, result.error_tail
    assert (await wait_for_file(out)).split() == ["140", "2"]


async def test_torch_threads_follow_the_workers_setting(tmp_path: Path, torch_zygote: Zygote) -> None:
    out = tmp_path / "out"
    script = write(tmp_path, "threads.py", f"""
        import torch
        x = torch.randn(64, 64) @ torch.randn(64, 64)
        open({str(out)!r}, "w").write(f"{{torch.get_num_threads()}}\\n")
    """)
    result = await run_one(torch_zygote, py(script), tmp_path, {"OMP_NUM_THREADS": "1"})
    assert result.exit_code == 0, result.error_tail
    assert await wait_for_file(out) == "1\n"
