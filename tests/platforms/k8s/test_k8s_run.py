"""`stead run --platform k8s` refuses bad input with one clear line and leaves nothing half-made on the cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.support.kube import FakeKubeApi, FakeKubelet

pytestmark = pytest.mark.anyio

#: a guard against a hung command, not a measured duration
TIMEOUT_S = 120.0


async def stead_run(tmp_path: Path, api_url: str, *flags: str, store: str = "etcd://127.0.0.1:2379",
                    job: str = "bad") -> tuple[int, str]:
    (tmp_path / "train.py").write_text("print('never run')\n")
    image = () if any(flag.startswith("k8s.image=") for flag in flags) else ("--set", "k8s.image=stead:test")
    command = [sys.executable, "-m", "stead", "run", "--platform", "k8s", "--job-name", job, "--store", store,
               "--set", f"k8s.api_url={api_url}", *image, "--set", "k8s.request_timeout_s=5", *flags, "train.py"]
    with anyio.fail_after(TIMEOUT_S):
        done = await anyio.run_process(command, cwd=tmp_path, check=False, stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr.decode()


def _error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert lines, stderr
    assert "Traceback" not in stderr, stderr
    return lines[-1]


@pytest.mark.parametrize(("flags", "job", "store", "message"), [
    (("--set", "k8s.memory=lots"), "bad", "etcd://127.0.0.1:2379", "k8s.memory 'lots' is not a Kubernetes quantity"),
    ((), "9lives", "etcd://127.0.0.1:2379", "job name '9lives' cannot name Kubernetes objects"),
    ((), "bad", "sqlite:///job.db", "needs a store that every master pod reaches"),
    (("--set", "k8s.env=[1]"), "bad", "etcd://127.0.0.1:2379", "k8s.env must be a JSON list"),
    # an escalation is said twice: the ask, and the allowance beside it
    (("--set", "k8s.ptrace=true"), "bad", "etcd://127.0.0.1:2379",
     "k8s.ptrace=true: CAP_SYS_PTRACE takes the node pods past the 'restricted' and 'baseline' Pod Security "
     "levels; this command allows it with k8s.allow_ptrace"),
    (("--set", "k8s.service_account=admin"), "bad", "etcd://127.0.0.1:2379",
     "k8s.service_account=admin: a job's master runs as its own ServiceAccount"),
])
async def test_a_spec_kubernetes_would_refuse_is_said_before_anything_is_made(
        tmp_path: Path, kube_api: FakeKubeApi, flags: tuple[str, ...], job: str, store: str, message: str) -> None:
    code, stderr = await stead_run(tmp_path, kube_api.url, *flags, store=store, job=job)
    assert code == 2 and message in _error(stderr)
    assert kube_api.objects("secrets") == [] and kube_api.objects("pods") == []


async def test_an_api_server_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    code, stderr = await stead_run(tmp_path, "http://127.0.0.1:9")
    assert code == 1 and "cannot be reached" in _error(stderr) and "check that the cluster is up" in stderr


async def test_missing_rbac_is_one_line_naming_the_rules_and_nothing_is_left(tmp_path: Path,
                                                                             kube_api: FakeKubeApi) -> None:
    kube_api.deny("create", "pods")
    code, stderr = await stead_run(tmp_path, kube_api.url)
    assert code == 1 and "refused POST" in _error(stderr) and "deploy/rbac.yaml" in stderr
    # what it made before the refusal is deleted again
    await kube_api.wait_for(lambda: not kube_api.objects("secrets") and not kube_api.objects("services"), TIMEOUT_S)


async def test_an_image_that_cannot_be_pulled_fails_fast_and_the_job_is_removed(tmp_path: Path,
                                                                                kube_api: FakeKubeApi,
                                                                                kubelet: FakeKubelet) -> None:
    code, stderr = await stead_run(tmp_path, kube_api.url, "--set", "k8s.image=registry.invalid/nope:1")
    assert code == 1
    line = _error(stderr)
    assert "cannot start: ErrImagePull" in line or "cannot start: ImagePullBackOff" in line
    assert "fix k8s.image" in line
    await kube_api.wait_for(lambda: not (kube_api.objects("secrets") or kube_api.objects("services")
                                         or kube_api.objects("pods")), TIMEOUT_S)
