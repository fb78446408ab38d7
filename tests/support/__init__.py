"""What only stead's own tests and benchmarks use: fakes and hostile peers that are not shipped in the wheel.

- :mod:`tests.support.kube`: a fake Kubernetes (an API server speaking the real REST and watch protocol, and a
  kubelet running pods as local processes), for the k8s platform's tests, ``tests/e2e/test_k8s.py`` and
  ``bench/k8s.py``;
- :mod:`tests.support.kube_validate`: offline checks of Kubernetes objects (OpenAPI schemas, CRD schemas, Pod
  Security Standards), for the manifests' tests;
- :mod:`tests.support.h2peer` and :mod:`tests.support.wire`: a bare HTTP/2 peer and protobuf request bodies
  written byte by byte, what a broken or hostile client sends, for the RPC limit and fuzz tests;
- :mod:`tests.support.hosts`: test hosts made of network, UTS and mount namespaces on a bridge (own address,
  hostname, /dev/shm and /tmp), killed, restarted, partitioned and healed, for the multi-host tests;
- :mod:`tests.support.slurm`: a real Slurm cluster (Debian's slurmctld and slurmd) on such hosts, for the tests of
  stead under ``srun`` and ``sbatch``;
- :mod:`tests.support.history`: the fault injection and the surviving training history of the whole-job tests
  that check exactly-once data across failures (``tests/e2e``, ``tests/chaos``).

Helpers for plugin and platform authors stay in :mod:`stead.testing`. The repository's root is on ``sys.path``
for pytest (``pythonpath`` in ``pyproject.toml``), mypy and import-linter (they run there); a benchmark puts it
there itself.
"""
