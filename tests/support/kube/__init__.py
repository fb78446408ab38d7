"""A fake Kubernetes for tests: an API server speaking the real protocol, and a kubelet running pods locally.

- :class:`FakeKubeApi`: the REST and watch API on 127.0.0.1 (every kind generically, CRDs,
  selectors, finalizers, graceful deletion, garbage collection, 410 Expired, bookmarks,
  validation), for kubernetes_asyncio and kopf to talk to;
- :class:`FakeKubelet`: a client of it that registers nodes, schedules pods and runs their
  containers as local processes (or, with ``run=False``, only reports them Running);
- :func:`local_image_env`: the environment of an "image" that is this machine's interpreter;
- :func:`parse_quantity`: Kubernetes resource quantities.
"""

from stead.core.quantity import parse_quantity
from tests.support.kube._podenv import local_image_env
from tests.support.kube.apiserver import FakeKubeApi
from tests.support.kube.kubelet import FakeKubelet

__all__ = ["FakeKubeApi", "FakeKubelet", "local_image_env", "parse_quantity"]
