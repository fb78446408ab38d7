"""The Kubernetes platform's settings: ``--set k8s.<name>=value`` or ``STEAD_K8S_<NAME>``.

One typed object, so that every timeout and size the platform uses is named and
documented here. The resources and volumes of a node's pod are settings too: the
``SteadJob`` resource and ``stead run --platform k8s`` both become these values
on the master's command line, so both paths build the same pods.
"""

from __future__ import annotations

import dataclasses

from stead.plugin import setting

__all__ = ["K8sSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class K8sSettings:
    namespace: str = setting("", help="namespace of the job's pods (default: the master pod's own namespace, or the "
                                      "kubeconfig context's, or 'default')")
    api_url: str = setting("", help="the Kubernetes API server URL, instead of the in-cluster service account or "
                                    "the kubeconfig (http(s)://host:port)")
    kubeconfig: str = setting("", help="kubeconfig file to use outside a cluster (default: $KUBECONFIG or "
                                       "~/.kube/config)")
    context: str = setting("", help="kubeconfig context (default: the current one)")
    pod_api_url: str = setting("", help="the API server URL the master pod uses (default: in-cluster); for test "
                                        "clusters whose API server pods reach at another address")
    image: str = setting("", help="container image of the job's pods: stead and the training script installed "
                                  "(required on Kubernetes)")
    image_pull_policy: str = setting("IfNotPresent", help="Always, IfNotPresent or Never")
    working_dir: str = setting("", help="working directory of the agents in their pods (default: the image's)")
    service_account: str = setting("stead-master", help="service account of the master pod (RBAC: deploy/rbac.yaml)")
    cpu: str = setting("", help="CPU request and limit of a node's pod, e.g. 8 or 7500m (default: none)")
    memory: str = setting("", help="memory request and limit of a node's pod, e.g. 64Gi (default: none); an "
                                   "out-of-memory kill relaunches the node with more (scaler.oom_memory_factor)")
    gpus: int = setting(0, min=0, help="GPUs per node's pod (nvidia.com/gpu)")
    shm_size: str = setting("1Gi", help="size of the pods' /dev/shm (a memory emptyDir): it holds the flash "
                                        "checkpoint's two slots per local rank")
    checkpoint_claim: str = setting("", help="a ReadWriteMany PersistentVolumeClaim for persisted checkpoints, "
                                             "mounted at checkpoint_mount in every pod so that a node relaunched on "
                                             "another host restores from disk (default: none)")
    checkpoint_mount: str = setting("/stead/checkpoints", help="where checkpoint_claim is mounted (ckpt.dir points "
                                                               "there)")
    grace_period_s: int = setting(60, min=1, help="the pods' terminationGracePeriodSeconds: time for an agent to "
                                                   "persist its checkpoint on SIGTERM")
    ptrace: bool = setting(False, help="give the agent CAP_SYS_PTRACE, so that a hang's stacks include native "
                                       "frames (py-spy)")
    node_selector: str = setting("", help="node selector of the pods, as key=value,key=value")
    tolerations: str = setting("", help="tolerations of the node pods, as a JSON list of Kubernetes Toleration "
                                        "objects")
    env: str = setting("", help="more environment of the node containers, as a JSON list of Kubernetes EnvVar "
                                "objects (valueFrom included)")
    master_port: int = setting(50051, min=1, max=65535, help="the master pod's RPC port (its Service's port)")
    master_host: str = setting("", help="the host name agents dial for the master (default: its Service, "
                                        "<job>-master.<namespace>.svc)")
    create_concurrency: int = setting(64, min=1, help="pods created or deleted at the same time (a relaunch of 300 "
                                                       "nodes goes out in parallel, not from a timed queue)")
    pending_timeout_s: float = setting(120.0, min=0.001, help="a pod not scheduled after this long is reported "
                                                              "(node.pending) for the scaler to decide about, "
                                                              "instead of a rendezvous timing out")
    bad_host_expiry_s: float = setting(3600.0, min=0.0, help="how long a host excluded as faulty is kept out of "
                                                              "the job's later pods (node anti-affinity)")
    cordon_bad_hosts: bool = setting(False, help="also cordon a host excluded as faulty (needs the optional "
                                                 "stead-node-cordon ClusterRole)")
    watch_timeout_s: float = setting(300.0, min=1.0, help="a pod watch is reopened from its last resourceVersion "
                                                          "after this long (the API server ends watches anyway)")
    request_timeout_s: float = setting(30.0, min=0.001, help="how long one API request may take")
