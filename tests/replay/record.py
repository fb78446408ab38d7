"""Record the event logs of real jobs into tests/replay/logs/, once: ``python tests/replay/record.py [NAME ...]``.

Each log is the event log of a real job run by one of the e2e tests (``stead run``, real
agents and gloo workers on the CPU, the fault that test injects, its assertions checked):
the test runs under pytest in a temporary directory that is kept, then the job's log is
read from the sqlite store the test's ``stead run`` left there, as ``stead events --json``
prints it (one record per line: seq, at, type, v, data). The k8s one reads what its test
read from its etcd (the store goes with the test): the last ``stead events --json`` the
test ran, kept by a wrapper this script puts around the test's helper.

Not a test: it starts real jobs (a few minutes of CPU on a laptop). Run it when a log of
a new kind of fault is wanted, or when the event format changed on purpose; then run
``python tests/replay/test_replay.py --update`` to write the expected summaries anew and
read their diff.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
LOGS = HERE / "logs"

#: the recorded jobs: log name -> the e2e test that runs the job (its fault and its checks)
SCENARIOS = {
    "worker-crash": "tests/e2e/test_run.py::test_a_crashed_worker_is_restarted_and_the_job_completes",
    "node-loss": "tests/e2e/test_run.py::test_a_sigkilled_agent_is_replaced_and_the_job_completes[cold]",
    "hang": "tests/e2e/test_hang.py::"
            "test_a_hung_rank_is_named_from_its_stack_and_the_job_restarts_and_completes[sleep]",
    "resize": "tests/e2e/test_scale.py::"
              "test_a_job_grows_with_stead_scale_shrinks_on_a_lost_node_and_keeps_its_weights_and_samples_exact",
    "master-kill": "tests/e2e/test_master_crash.py::"
                   "test_a_killed_master_is_replaced_and_its_nodes_adopted_while_the_workers_keep_stepping",
    "oom-batch": "tests/e2e/test_scale.py::test_an_out_of_memory_worker_restarts_with_half_the_batch_until_it_fits",
    "k8s-oom": "tests/e2e/test_k8s.py::test_a_job_survives_a_deleted_pod_its_master_pod_deleted_and_an_oom_kill",
}

#: a pytest plugin (this file, loaded with -p) keeps the last `stead events --json` a k8s test read here
_KEEP_ENV = "STEAD_RECORD_EVENTS_TO"


def pytest_collection_finish(session: object) -> None:
    """As a pytest plugin (``-p record``): wrap the collected k8s e2e test's ``Job.events`` so that its last answer
    is kept on disk."""
    target = os.environ.get(_KEEP_ENV)
    k8s = sys.modules.get("test_k8s")
    if not target or k8s is None:
        return
    read = k8s.Job.events

    def events(self: object) -> list[dict[str, object]]:
        answer: list[dict[str, object]] = read(self)
        Path(target).write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n"
                                        for r in answer))
        return answer

    k8s.Job.events = events


def record(name: str, test: str, workdir: Path) -> Path:
    """Run ``test`` in ``workdir`` and write its job's log to ``logs/<name>.jsonl``."""
    base = workdir / name
    kept = workdir / f"{name}.k8s.jsonl"
    env = {**os.environ, _KEEP_ENV: str(kept), "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "record",
                          f"--basetemp={base}", test], cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{test} failed, nothing recorded for {name}:\n{run.stdout[-4000:]}{run.stderr[-2000:]}")
    if kept.exists():
        lines = kept.read_text()
    else:
        (db,) = [p for p in base.rglob(".stead/*.db")]
        out = subprocess.run([sys.executable, "-m", "stead", "events", "--json", "--job", db.stem,
                              "--store", f"sqlite:///{db}"], cwd=ROOT, capture_output=True, text=True, check=True)
        lines = out.stdout
    path = LOGS / f"{name}.jsonl"
    path.write_text(_anonymous(lines, base))
    return path


def _anonymous(lines: str, base: Path) -> str:
    """``lines`` without this machine's paths (the interpreter, the checkout, the test's directory)."""
    for path, name in ((sys.executable, "python"), (str(base), "/tmp/job"), (str(ROOT), "/stead")):
        lines = lines.replace(json.dumps(path)[1:-1], name)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("names", nargs="*", help=f"the logs to record, of {', '.join(SCENARIOS)} (default: all)")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in SCENARIOS]
    if unknown:
        parser.error(f"no recorded job is named {', '.join(unknown)}; choose among {', '.join(SCENARIOS)}")
    LOGS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stead-record-") as tmp:
        for name in args.names or SCENARIOS:
            path = record(name, SCENARIOS[name], Path(tmp))
            print(f"{name}: {len(path.read_text().splitlines())} records, {path.stat().st_size} bytes", flush=True)


if __name__ == "__main__":
    main()
