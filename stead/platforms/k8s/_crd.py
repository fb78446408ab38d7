"""The SteadJob CustomResourceDefinition: ``stead run`` as a Kubernetes resource.

Every field of ``spec`` mirrors a ``stead run`` flag (or a pod setting a job on
Kubernetes needs: image, resources, ``/dev/shm``, the checkpoint volume), with
``stead run``'s default, so that a user who knows the command line can read
the resource. The schema is *structural* (every field typed, free-form parts
marked ``x-kubernetes-preserve-unknown-fields``), which the API server requires
for defaulting and pruning; the API server then validates jobs before the
operator ever sees them.
"""

from __future__ import annotations

from typing import Any

from stead.platforms.k8s.names import API_GROUP, API_VERSION, JOB_KIND, JOB_PLURAL

__all__ = ["JOB_NAME_MAX", "JOB_NAME_PATTERN", "MASTER_ACCOUNT", "PHASES", "STORE_PATTERN",
           "custom_resource_definition"]

#: the shared ServiceAccount of masters that cordon hosts (manifests.node_cordon_rbac); a job names it in
#: spec.serviceAccountName, which the operator must allow
MASTER_ACCOUNT = "stead-master"

#: a job's name: its master's Service is ``<job>-master`` (names.master_name), and a Service name is a DNS-1035
#: label (a letter first, at most 63 characters), so the job name is one too, 7 characters shorter
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_MAX = 63 - len("-master")

#: the job's phases as the operator reports them in ``status.phase``
PHASES = ("Pending", "Running", "Recovering", "Succeeded", "Failed", "Stopped", "Suspended")

#: a Kubernetes resource.Quantity in its string form (as controller-gen renders it for built-in types)
_QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                     r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_NNODES_PATTERN = r"^[1-9][0-9]{0,5}(:[1-9][0-9]{0,5})?$"
#: etcd://host[:port][,host[:port]]: no user, no query; the store's credentials are the operator's settings
#: (a query's password_file would make the operator read its own files and send them to the job's host)
_STORE_ENDPOINT = r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?)(:[0-9]{1,5})?"
STORE_PATTERN = rf"^etcd://{_STORE_ENDPOINT}(,{_STORE_ENDPOINT})*$"
#: CEL regular expressions (RE2, matched anywhere unless anchored): a settings key is a setting's name
#: (stead.core.runspec.SETTING_NAME); a run argument that sets a k8s.* setting however it is spaced
#: (``k8s.x=1``, ``--set=k8s.x=1``, ``--set= k8s.x=1``), as the master strips a name before it reads it
_SETTING_KEY = "^[a-z][a-z0-9_.]*$"
_K8S_RUN_ARG = "^[^a-z]*(set=[^a-z]*)?k8s[.]"

Schema = dict[str, Any]


def _string(description: str, **checks: Any) -> Schema:
    return {"description": description, "type": "string", **checks}


def _integer(description: str, *, minimum: int | None = None, default: int | None = None) -> Schema:
    node: Schema = {"description": description, "type": "integer"}
    if minimum is not None:
        node["minimum"] = minimum
    if default is not None:
        node["default"] = default
    return node


def _boolean(description: str, *, default: bool) -> Schema:
    return {"description": description, "type": "boolean", "default": default}


def _quantity(description: str, *, default: str | None = None) -> Schema:
    node: Schema = {"description": description, "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "pattern": _QUANTITY_PATTERN, "x-kubernetes-int-or-string": True}
    if default is not None:
        node["default"] = default
    return node


def _string_map(description: str) -> Schema:
    return {"description": description, "type": "object", "additionalProperties": {"type": "string"}}


def _string_list(description: str, **checks: Any) -> Schema:
    return {"description": description, "type": "array", "items": {"type": "string"}, **checks}


def _free_object(description: str) -> Schema:
    return {"description": description, "type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _no_k8s_settings(rule: str) -> Schema:
    """A CEL rule the API server checks (the operator checks the same: :mod:`.policy`)."""
    return {"x-kubernetes-validations": [{
        "rule": rule, "message": "a setting is named by lowercase letters, digits, '_' and '.', and never k8s.*: "
                                 "a SteadJob's pods are set by its own fields, which the operator checks against "
                                 "what it allows"}]}


def _object(description: str, properties: dict[str, Schema], *, required: tuple[str, ...] = ()) -> Schema:
    node: Schema = {"description": description, "type": "object"}
    if required:
        node["required"] = list(required)
    node["properties"] = properties
    return node


def _resource_requirements(description: str) -> Schema:
    return _object(description, {
        "requests": {"description": "the least the container needs (the scheduler reserves it), by resource name: "
                                    "cpu, memory, nvidia.com/gpu, ...",
                     "type": "object", "additionalProperties": _quantity("a quantity, e.g. 4, 500m, 16Gi")},
        "limits": {"description": "the most the container may use, by resource name (a GPU's request equals its "
                                  "limit)",
                   "type": "object", "additionalProperties": _quantity("a quantity, e.g. 4, 500m, 16Gi")},
    })


def _spec() -> Schema:
    return _object("The job: what `stead run` would be told, and the pods its nodes run in.", {
        "nnodes": _string("Number of nodes N, or the elastic range MIN:MAX: the job runs with any count in the range "
                          "(stead run --nnodes).", pattern=_NNODES_PATTERN, maxLength=13, default="1"),
        "nprocPerNode": _integer("Worker processes per node, usually one per GPU of the node's pod "
                                 "(stead run --nproc-per-node).", minimum=1, default=1),
        "maxRestarts": _integer("Restart the workers at most this many times after failures before the job fails "
                                "(stead run --max-restarts; torchrun's default 0).", minimum=0, default=0),
        "maxNodeRelaunches": _integer("Relaunch a lost or killed node (a new pod) at most this many times before the "
                                      "job goes on without it, or fails below MIN nodes "
                                      "(stead run --max-node-relaunches).", minimum=0, default=3),
        "startNodes": _integer("With nnodes MIN:MAX, start on this many nodes (default MAX); "
                               "`stead scale` changes it while the job runs (stead run --start-nodes).", minimum=1),
        "image": _string("The container image of the job's pods: stead, torch and the training script installed.",
                         minLength=1),
        "imagePullPolicy": _string("When the kubelet pulls the image (k8s.image_pull_policy).",
                                   enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
        "command": _string_list("The training script and its arguments, as `stead run` takes them after its flags, "
                                "e.g. [train.py, --epochs, '3']; a module name with module: true.", minItems=1),
        "module": _boolean("Run the script as a module, like python -m (stead run --module).", default=False),
        "runArgs": {**_string_list("Further `stead run` flags, placed before the script, "
                                   "e.g. [--set, ckpt.keep_last=3]; no k8s.* setting (the pods are this resource's "
                                   "fields)."), **_no_k8s_settings(f"self.all(a, !a.matches('{_K8S_RUN_ARG}'))")},
        "settings": {**_string_map("stead settings by name, each passed as --set NAME=VALUE "
                                   "(e.g. heartbeat_timeout_s: '10', ckpt.keep_last: '3'); no k8s.* setting (the "
                                   "pods are this resource's fields)."),
                     **_no_k8s_settings(f"self.all(k, k.matches('{_SETTING_KEY}') && !k.startsWith('k8s.'))")},
        "resources": _resource_requirements("Compute resources of each node's pod (the node container)."),
        "shmSize": _quantity("Size of the memory-backed /dev/shm of each node's pod, which holds the flash "
                             "checkpoints (two copies of each local rank's state) and torch's shared tensors.",
                             default="1Gi"),
        "checkpointVolume": _object("Where persisted checkpoints go: a PersistentVolumeClaim every node mounts, so "
                                    "it must be ReadWriteMany, and one the operator allows (k8s.allowed_claims).", {
                                        "claimName": _string("Name of the PersistentVolumeClaim (ReadWriteMany) in "
                                                             "the job's namespace.", minLength=1),
                                        "mountPath": _string("Where the nodes mount it; the ckpt.dir setting points "
                                                             "there.", pattern="^/", default="/stead/checkpoints"),
                                    }, required=("claimName",)),
        "store": _string("The state store, etcd://HOST:PORT[,HOST:PORT] (stead run --store); the event log that "
                         "lets a restarted master pick the job up lives there. No user or query: its TLS files and "
                         "login are the operator's (STEAD_ETCD_*). Required unless the operator runs with a default "
                         "store.", pattern=STORE_PATTERN),
        "env": {"description": "Environment variables of the node containers (Kubernetes EnvVar: name with value or "
                               "valueFrom).",
                "type": "array",
                "items": _object("One environment variable.", {
                    "name": _string("The variable's name.", minLength=1),
                    "value": _string("Its value."),
                    "valueFrom": {**_object("Where its value comes from (a Kubernetes EnvVarSource, one of its "
                                            "fields); a Secret or ConfigMap must be one the operator allows "
                                            "(k8s.allowed_env_secrets, k8s.allowed_env_config_maps).", {
                                                "secretKeyRef": _free_object("A key of a Secret: name, key."),
                                                "configMapKeyRef": _free_object("A key of a ConfigMap: name, key."),
                                                "fieldRef": _free_object("A field of the pod: fieldPath."),
                                                "resourceFieldRef": _free_object("A resource of the container: "
                                                                                 "resource."),
                                            }), "minProperties": 1, "maxProperties": 1},
                }, required=("name",))},
        "serviceAccountName": _string("ServiceAccount the job's master pod runs as instead of its own "
                                      "(<job>-master, whose Role reads only this job's Secret); the operator refuses "
                                      "one not in its k8s.allowed_service_accounts. Node pods never call the API: "
                                      "they get no token.", minLength=1),
        "terminationGracePeriodSeconds": _integer("Time a node pod gets between SIGTERM and SIGKILL: the agent "
                                                  "writes the newest checkpoint to disk in it (k8s.grace_period_s).",
                                                  minimum=1, default=60),
        "ptrace": _boolean("Give the node containers CAP_SYS_PTRACE (for py-spy by hand; the pods then pass only "
                           "the 'privileged' Pod Security level): refused unless the operator's k8s.allow_ptrace.",
                           default=False),
        "nodeSelector": _string_map("Labels a Kubernetes node must have to run this job's pods."),
        "tolerations": {"description": "Taints this job's pods tolerate (Kubernetes Toleration objects).",
                        "type": "array", "items": _free_object("One toleration: key, operator, value, effect, "
                                                               "tolerationSeconds.")},
        "masterResources": _resource_requirements("Compute resources of the job's master pod."),
        "suspend": _boolean("Stop the job's pods and keep the job (its store and checkpoints); set back to false to "
                            "resume it.", default=False),
    }, required=("image", "command"))


def _status() -> Schema:
    return _object("What the operator last observed of the job.", {
        "phase": _string("The job's phase.", enum=list(PHASES)),
        "message": _string("Why the job is in this phase, in words (a failure's cause)."),
        "round": _integer("The current rendezvous round: one more each time the workers restart or the world is "
                          "resized.", minimum=0),
        "step": _integer("The latest training step the workers reported.", minimum=0),
        "restarts": _integer("How many times the workers were restarted.", minimum=0),
        "nodes": _integer("Nodes running now.", minimum=0),
        "targetNodes": _integer("Nodes the job aims at (within MIN:MAX).", minimum=0),
        "goodput": {"description": "Productive training time over wall time so far, from 0 to 1.", "type": "number",
                    "minimum": 0},
        "master": _string("Name of the master pod."),
        "startTime": _string("When the job started.", format="date-time"),
        "completionTime": _string("When the job ended.", format="date-time"),
        "observedGeneration": _integer("The spec generation this status describes.", minimum=0),
        "conditions": {"description": "Standard conditions (type, status, reason, message, lastTransitionTime).",
                       "type": "array", "items": _free_object("One condition.")},
    })


def _printer_columns() -> list[Schema]:
    def column(name: str, kind: str, path: str, description: str) -> Schema:
        return {"name": name, "type": kind, "jsonPath": path, "description": description}

    return [
        column("Phase", "string", ".status.phase", "The job's phase."),
        column("Nodes", "integer", ".status.nodes", "Nodes running now."),
        column("Target", "integer", ".status.targetNodes", "Nodes the job aims at."),
        column("Step", "integer", ".status.step", "The latest training step reported."),
        column("Restarts", "integer", ".status.restarts", "Worker restarts so far."),
        column("Goodput", "number", ".status.goodput", "Productive time over wall time."),
        column("Age", "date", ".metadata.creationTimestamp", "Time since the job was created."),
    ]


def _open_api_schema() -> Schema:
    return {
        "description": "A distributed PyTorch training job that keeps going when things break: "
                       "`stead run` on Kubernetes.",
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": _string("The versioned schema of this object: stead.dev/v1."),
            "kind": _string("SteadJob."),
            # the API server allows a CRD to restrict only metadata.name and metadata.generateName
            "metadata": {"description": "Standard object metadata; the name becomes part of pod and Service names.",
                         "type": "object",
                         "properties": {"name": _string("The job's name.", pattern=JOB_NAME_PATTERN,
                                                        maxLength=JOB_NAME_MAX)}},
            "spec": _spec(),
            "status": _status(),
        },
    }


def custom_resource_definition() -> dict[str, Any]:
    """The ``steadjobs.stead.dev`` CRD: namespaced, one served and stored version, a status subresource."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{JOB_PLURAL}.{API_GROUP}", "labels": {"app.kubernetes.io/part-of": "stead"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": JOB_KIND, "listKind": f"{JOB_KIND}List", "plural": JOB_PLURAL,
                      "singular": JOB_KIND.lower(), "shortNames": ["sj"]},
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": _printer_columns(),
                "schema": {"openAPIV3Schema": _open_api_schema()},
            }],
        },
    }
