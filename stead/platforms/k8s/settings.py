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
    api_ca_file: str = setting("", help="the CA bundle that signed api_url's certificate (default: the system's)")
    insecure_skip_tls_verify: bool = setting(False, help="do not verify api_url's TLS certificate (a test cluster "
                                                         "with a self-signed one; anyone on the path can then act "
                                                         "as the API server and read the service account's token)")
    kubeconfig: str = setting("", help="kubeconfig file to use outside a cluster (default: $KUBECONFIG or "
                                       "~/.kube/config)")
    context: str = setting("", help="kubeconfig context (default: the current one)")
    pod_api_url: str = setting("", help="the API server URL the master pod uses (default: in-cluster); for test "
                                        "clusters whose API server pods reach at another address")
    image: str = setting("", help="container image of the job's pods: stead and the training script installed "
                                  "(required on Kubernetes)")
    image_pull_policy: str = setting("IfNotPresent", help="Always, IfNotPresent or Never")
    master_image: str = setting("", help="container image of the job's master pod (default: image); the operator "
                                         "runs every master with its own (stead's image, as its Deployment sets "
                                         "STEAD_K8S_MASTER_IMAGE), never a SteadJob's, since the master's account "
                                         "may create pods")
    working_dir: str = setting("", help="working directory of the agents in their pods (default: the image's)")
    service_account: str = setting("", help="service account of the master pod (default: the job's own, "
                                            "<job>-master, made with a Role that reads only this job's Secret); "
                                            "another must be in allowed_service_accounts")
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
    ptrace: bool = setting(False, help="give the agent container CAP_SYS_PTRACE (for py-spy run by hand: stead's "
                                       "own stack dumps never need it); the pod then passes only the 'privileged' "
                                       "Pod Security level, so it is refused unless allow_ptrace")
    run_as_user: int = setting(65532, min=1, help="uid, gid and fsGroup of the job's containers: not root, as the "
                                                  "'restricted' Pod Security Standard asks (the image's files must "
                                                  "be readable by it)")
    read_only_root_fs: bool = setting(True, help="the node containers' root filesystem is read-only (writable: /tmp, "
                                                 "/dev/shm, checkpoint_mount); false for a training script that "
                                                 "writes elsewhere")
    node_selector: str = setting("", help="node selector of the pods, as key=value,key=value")
    tolerations: str = setting("", help="tolerations of the node pods, as a JSON list of Kubernetes Toleration "
                                        "objects")
    env: str = setting("", help="more environment of the node containers, as a JSON list of Kubernetes EnvVar "
                                "objects (valueFrom included)")
    metrics_port: int = setting(-1, min=-1, max=65535, help="the master pod serves Prometheus metrics on this port "
                                                            "of its pod IP (-1: none); needs metrics_token_secret")
    metrics_token_secret: str = setting("", help="the Secret whose key 'token' a scrape of the master's metrics "
                                                 "must send (authorization: Bearer)")
    etcd_client_secret: str = setting("", help="the Secret with the store's client certificate (ca.crt, tls.crt, "
                                               "tls.key) the master pods use: TLS to etcd (stead-etcd-client with "
                                               "`stead k8s manifests --with-etcd`)")
    etcd_user: str = setting("", help="the etcd user the master pods authenticate as (its password: "
                                      "etcd_auth_secret)")
    etcd_auth_secret: str = setting("", help="the Secret whose key 'password' is etcd_user's password")
    allowed_service_accounts: str = setting("", help="service accounts a job may run its master as instead of its "
                                                     "own (comma-separated): its RBAC is then that account's, and "
                                                     "shared by every job that names it")
    allowed_claims: str = setting("", help="PersistentVolumeClaims a job may mount as its checkpoint volume "
                                           "(comma-separated; '*': any claim of the namespace)")
    allowed_env_secrets: str = setting("", help="Secrets a job's env may read with valueFrom.secretKeyRef "
                                                "(comma-separated)")
    allowed_env_config_maps: str = setting("", help="ConfigMaps a job's env may read with "
                                                    "valueFrom.configMapKeyRef (comma-separated; '*': any)")
    allow_ptrace: bool = setting(False, help="let a job ask for ptrace (its node pods then pass only the "
                                             "'privileged' Pod Security level)")
    node_egress_cidrs: str = setting("", help="networks the node pods may reach besides the job's own pods and "
                                              "DNS (comma-separated CIDRs, e.g. 10.0.0.0/8 for a data store, "
                                              "0.0.0.0/0 for anywhere); default: none")
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
