"""The fake API server, driven by the real clients: kubernetes_asyncio (REST, watch) and kopf."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from tests.support.kube import FakeKubeApi, parse_quantity

pytestmark = pytest.mark.anyio

NS = "default"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
#: a guard against a hung test, not a measured duration
TIMEOUT_S = 10.0

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "steadjobs.stead.dev"},
    "spec": {"group": "stead.dev", "scope": "Namespaced",
             "names": {"plural": "steadjobs", "singular": "steadjob", "kind": "SteadJob", "shortNames": ["sj"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


def pod(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": [{"name": "main", "image": "stead:test", "command": ["true"]}], **spec}}


def configmap(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "data": data}


def status_of(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    return body


async def events(stream: AsyncIterator[dict[str, Any]], count: int) -> list[tuple[str, str]]:
    """The next ``count`` (type, name) of a watch stream."""
    seen: list[tuple[str, str]] = []
    async with asyncio.timeout(TIMEOUT_S):
        async for event in stream:
            seen.append((event["type"], event["raw_object"]["metadata"].get("name", "")))
            if len(seen) == count:
                break
    return seen


# ----- discovery and metadata


async def test_discovery_lists_core_group_and_status_subresources(kube_client: Any) -> None:
    assert "v1" in (await client.CoreApi(kube_client).get_api_versions()).versions
    groups = {g.name: g for g in (await client.ApisApi(kube_client).get_api_versions()).groups}
    assert {"apps", "networking.k8s.io", "rbac.authorization.k8s.io", "coordination.k8s.io", "events.k8s.io",
            "apiextensions.k8s.io"} <= set(groups)
    core = {r.name: r for r in (await client.CoreV1Api(kube_client).get_api_resources()).resources}
    assert core["pods"].namespaced and core["pods"].kind == "Pod" and "watch" in core["pods"].verbs
    assert {"pods/status", "pods/binding", "pods/log", "nodes/status"} <= set(core)
    assert not core["nodes"].namespaced and not core["namespaces"].namespaced
    apps = {r.name for r in (await client.AppsV1Api(kube_client).get_api_resources()).resources}
    assert {"deployments", "deployments/status"} <= apps
    version = await client.VersionApi(kube_client).get_code()
    assert version.major == "1"


async def test_create_fills_metadata_from_one_global_resource_version(core_v1: Any) -> None:
    first = await core_v1.create_namespaced_config_map(NS, configmap("a"))
    second = await core_v1.create_namespaced_pod(NS, pod("p"))
    assert first.metadata.uid and first.metadata.uid != second.metadata.uid
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    assert first.metadata.generation == 1 and first.metadata.namespace == NS
    assert first.metadata.creation_timestamp.tzinfo is not None
    assert second.status.phase == "Pending" and second.spec.restart_policy == "Always"
    assert second.spec.termination_grace_period_seconds == 30


async def test_generate_name_makes_a_fresh_name_and_a_taken_name_is_409(core_v1: Any) -> None:
    made = await core_v1.create_namespaced_config_map(NS, {"metadata": {"generateName": "job-"}})
    assert made.metadata.name.startswith("job-") and len(made.metadata.name) == len("job-") + 5
    with pytest.raises(ApiException) as refused:
        await core_v1.create_namespaced_config_map(NS, configmap(made.metadata.name))
    assert refused.value.status == 409
    assert status_of(refused.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as missing:
        await core_v1.read_namespaced_config_map("nope", NS)
    body = status_of(missing.value)
    assert (missing.value.status, body["kind"], body["reason"]) == (404, "Status", "NotFound")
    assert body["message"] == 'configmaps "nope" not found'


async def test_replace_with_a_stale_resource_version_is_a_conflict(core_v1: Any) -> None:
    made = await core_v1.create_namespaced_config_map(NS, configmap("c", x="1"))
    made.data = {"x": "2"}
    replaced = await core_v1.replace_namespaced_config_map("c", NS, made)
    assert replaced.data == {"x": "2"}
    made.data = {"x": "3"}  # still the first version
    with pytest.raises(ApiException) as refused:
        await core_v1.replace_namespaced_config_map("c", NS, made)
    assert refused.value.status == 409 and status_of(refused.value)["reason"] == "Conflict"
    assert "the object has been modified" in status_of(refused.value)["message"]


async def test_generation_counts_spec_changes_and_a_no_op_write_changes_nothing(kube_client: Any) -> None:
    apps = client.AppsV1Api(kube_client)
    deployment = {"metadata": {"name": "d"}, "spec": {
        "selector": {"matchLabels": {"app": "d"}},
        "template": {"metadata": {"labels": {"app": "d"}},
                     "spec": {"containers": [{"name": "main", "image": "stead:test"}]}}}}
    made = await apps.create_namespaced_deployment(NS, deployment)
    labelled = await apps.patch_namespaced_deployment("d", NS, {"metadata": {"labels": {"x": "y"}}})
    assert labelled.metadata.generation == 1
    scaled = await apps.patch_namespaced_deployment("d", NS, {"spec": {"replicas": 3}})
    assert scaled.metadata.generation == 2
    again = await apps.patch_namespaced_deployment("d", NS, {"spec": {"replicas": 3}})
    assert again.metadata.resource_version == scaled.metadata.resource_version
    assert int(made.metadata.resource_version) < int(scaled.metadata.resource_version)


async def test_strategic_merge_patch_merges_containers_and_env_by_name(kube_client: Any) -> None:
    apps = client.AppsV1Api(kube_client)
    containers = [{"name": "a", "image": "one", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                  {"name": "b", "image": "two"}]
    await apps.create_namespaced_deployment(NS, {"metadata": {"name": "d"}, "spec": {
        "selector": {"matchLabels": {"app": "d"}},
        "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": containers}}}})
    patched = await apps.patch_namespaced_deployment("d", NS, {"spec": {"template": {"spec": {"containers": [
        {"name": "a", "env": [{"name": "Y", "value": "3"}]}]}}}})  # kubernetes_asyncio sends a strategic merge
    merged = {c.name: c for c in patched.spec.template.spec.containers}
    assert set(merged) == {"a", "b"} and merged["a"].image == "one"
    assert {e.name: e.value for e in merged["a"].env} == {"X": "1", "Y": "3"}
    replaced = await apps.patch_namespaced_deployment("d", NS, {"spec": {"template": {"spec": {"containers": [
        {"name": "c", "image": "three"}]}}}}, _content_type=MERGE)
    assert [c.name for c in replaced.spec.template.spec.containers] == ["c"]


async def test_json_patch_applies_and_a_failed_test_is_422(core_v1: Any) -> None:
    made = await core_v1.create_namespaced_config_map(NS, configmap("c", a="1"))
    patched = await core_v1.patch_namespaced_config_map("c", NS, [
        {"op": "test", "path": "/metadata/resourceVersion", "value": made.metadata.resource_version},
        {"op": "add", "path": "/data/b", "value": "2"}, {"op": "remove", "path": "/data/a"}])
    assert patched.data == {"b": "2"}
    with pytest.raises(ApiException) as refused:
        await core_v1.patch_namespaced_config_map("c", NS, [
            {"op": "test", "path": "/metadata/resourceVersion", "value": made.metadata.resource_version}])
    assert refused.value.status == 422


async def test_status_subresource_keeps_status_and_spec_apart(core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("p"))
    ignored = await core_v1.patch_namespaced_pod("p", NS, {"status": {"phase": "Running"}}, _content_type=MERGE)
    assert ignored.status.phase == "Pending"
    running = await core_v1.patch_namespaced_pod_status("p", NS, {"status": {"phase": "Running"},
                                                                  "metadata": {"labels": {"ignored": "yes"}}},
                                                        _content_type=MERGE)
    assert running.status.phase == "Running" and not running.metadata.labels
    assert (await core_v1.read_namespaced_pod_status("p", NS)).status.phase == "Running"


async def test_a_pod_spec_change_beyond_images_is_refused(core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("p"))
    with pytest.raises(ApiException) as refused:
        await core_v1.patch_namespaced_pod("p", NS, {"spec": {"restartPolicy": "Never"}}, _content_type=MERGE)
    assert refused.value.status == 422 and "pod updates may not change fields" in status_of(refused.value)["message"]
    await core_v1.patch_namespaced_pod("p", NS, {"spec": {"containers": [{"name": "main", "image": "other"}]}})


# ----- lists, selectors and watches


async def test_list_then_watch_from_the_list_version_sees_only_later_changes(core_v1: Any) -> None:
    await core_v1.create_namespaced_config_map(NS, configmap("before"))
    listed = await core_v1.list_namespaced_config_map(NS)
    await core_v1.create_namespaced_config_map(NS, configmap("after"))
    await core_v1.patch_namespaced_config_map("before", NS, {"data": {"x": "1"}})
    await core_v1.delete_namespaced_config_map("after", NS)
    async with watch.Watch() as w:
        stream = w.stream(core_v1.list_namespaced_config_map, NS, resource_version=listed.metadata.resource_version)
        assert await events(stream, 3) == [("ADDED", "after"), ("MODIFIED", "before"), ("DELETED", "after")]


async def test_watch_without_a_version_starts_with_the_current_objects(core_v1: Any) -> None:
    await core_v1.create_namespaced_config_map(NS, configmap("one"))
    async with watch.Watch() as w:
        stream = w.stream(core_v1.list_namespaced_config_map, NS)
        assert await events(stream, 1) == [("ADDED", "one")]
        await core_v1.create_namespaced_config_map(NS, configmap("two"))
        assert await events(stream, 1) == [("ADDED", "two")]


async def test_a_watch_from_a_version_older_than_history_gets_410_and_a_relist_recovers(
        kube_api: FakeKubeApi, core_v1: Any) -> None:
    listed = await core_v1.list_namespaced_config_map(NS)
    await core_v1.create_namespaced_config_map(NS, configmap("c"))
    kube_api.compact()
    async with watch.Watch() as w:
        with pytest.raises(ApiException) as expired:
            async for _ in w.stream(core_v1.list_namespaced_config_map, NS,
                                    resource_version=listed.metadata.resource_version, timeout_seconds=5):
                pytest.fail("a watch from a compacted version must send no event")
    assert expired.value.status == 410 and "Expired" in str(expired.value.reason)
    relisted = await core_v1.list_namespaced_config_map(NS)
    assert [c.metadata.name for c in relisted.items] == ["c"]
    async with watch.Watch() as w:
        stream = w.stream(core_v1.list_namespaced_config_map, NS, resource_version=relisted.metadata.resource_version)
        await core_v1.delete_namespaced_config_map("c", NS)
        assert await events(stream, 1) == [("DELETED", "c")]


async def test_history_keeps_only_the_last_changes() -> None:
    async with FakeKubeApi(history=2) as api, client.ApiClient(api.configuration()) as api_client:
        v1 = client.CoreV1Api(api_client)
        start = (await v1.list_namespaced_config_map(NS)).metadata.resource_version
        for name in ("a", "b", "c"):
            await v1.create_namespaced_config_map(NS, configmap(name))
        async with watch.Watch() as w:
            with pytest.raises(ApiException) as expired:
                async for _ in w.stream(v1.list_namespaced_config_map, NS, resource_version=start, timeout_seconds=5):
                    pass
        assert expired.value.status == 410


async def test_bookmarks_come_when_allowed_and_the_stream_ends_at_its_timeout(core_v1: Any) -> None:
    listed = await core_v1.list_namespaced_config_map(NS)
    seen = []
    async with watch.Watch() as w, asyncio.timeout(TIMEOUT_S):
        async for event in w.stream(core_v1.list_namespaced_config_map, NS, allow_watch_bookmarks=True,
                                    resource_version=listed.metadata.resource_version, timeout_seconds=1):
            seen.append(event["type"])
    assert seen and set(seen) == {"BOOKMARK"}  # the stream ended by itself, after timeoutSeconds
    assert w.resource_version == listed.metadata.resource_version


async def test_an_object_that_leaves_a_watched_selector_is_deleted_for_that_watch(core_v1: Any) -> None:
    await core_v1.create_namespaced_config_map(NS, configmap("c", {"role": "node"}))
    listed = await core_v1.list_namespaced_config_map(NS, label_selector="role=node")
    async with watch.Watch() as w:
        stream = w.stream(core_v1.list_namespaced_config_map, NS, label_selector="role=node",
                          resource_version=listed.metadata.resource_version)
        await core_v1.patch_namespaced_config_map("c", NS, {"metadata": {"labels": {"role": "master"}}})
        await core_v1.create_namespaced_config_map(NS, configmap("other", {"role": "master"}))
        await core_v1.patch_namespaced_config_map("c", NS, {"metadata": {"labels": {"role": "node"}}})
        assert await events(stream, 2) == [("DELETED", "c"), ("ADDED", "c")]


@pytest.mark.parametrize(("selector", "names"), [
    ("app=a", ["a1", "a2"]), ("app==a", ["a1", "a2"]), ("app!=a", ["b1", "none"]),
    ("app in (a, b)", ["a1", "a2", "b1"]), ("app notin (a)", ["b1", "none"]), ("app", ["a1", "a2", "b1"]),
    ("!app", ["none"]), ("app=a,tier=web", ["a1"]), ("app in (a),tier notin (web)", ["a2"]),
])
async def test_label_selectors_select_like_the_real_server(core_v1: Any, selector: str, names: list[str]) -> None:
    for name, labels in (("a1", {"app": "a", "tier": "web"}), ("a2", {"app": "a"}), ("b1", {"app": "b"}),
                         ("none", {})):
        await core_v1.create_namespaced_config_map(NS, configmap(name, labels))
    listed = await core_v1.list_namespaced_config_map(NS, label_selector=selector)
    assert sorted(c.metadata.name for c in listed.items) == names


async def test_field_selectors_and_a_malformed_selector_is_400(core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("bound"))
    await core_v1.create_namespaced_pod(NS, pod("free"))
    await core_v1.create_namespaced_pod_binding("bound", NS, {"metadata": {"name": "bound"},
                                                              "target": {"kind": "Node", "name": "host-a"}},
                                                _preload_content=False)
    by_node = await core_v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=host-a")
    assert [p.metadata.name for p in by_node.items] == ["bound"]
    unbound = await core_v1.list_namespaced_pod(NS, field_selector="spec.nodeName=,status.phase=Pending")
    assert [p.metadata.name for p in unbound.items] == ["free"]
    named = await core_v1.list_namespaced_pod(NS, field_selector="metadata.name!=free")
    assert [p.metadata.name for p in named.items] == ["bound"]
    for bad_labels, bad_fields in (("app in (a", None), ("a b", None), (None, "spec.bogus=1"), (None, "nonsense")):
        with pytest.raises(ApiException) as refused:
            await core_v1.list_namespaced_pod(NS, label_selector=bad_labels, field_selector=bad_fields)
        assert refused.value.status == 400 and status_of(refused.value)["reason"] == "BadRequest"


async def test_initial_events_end_with_a_bookmark_when_asked_like_kopf_does(kube_api: FakeKubeApi,
                                                                           core_v1: Any) -> None:
    await core_v1.create_namespaced_config_map(NS, configmap("one"))
    params = {"watch": "true", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan",
              "allowWatchBookmarks": "true", "timeoutSeconds": "5"}
    lines = []
    async with aiohttp.ClientSession() as session, session.get(f"{kube_api.url}/api/v1/namespaces/{NS}/configmaps",
                                                               params=params) as response:
        async with asyncio.timeout(TIMEOUT_S):
            while len(lines) < 2:
                lines.append(json.loads(await response.content.readline()))
    assert [(e["type"], e["object"]["metadata"].get("name")) for e in lines] == [("ADDED", "one"), ("BOOKMARK", None)]
    assert lines[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_unsupported_methods_and_media_types_are_refused(kube_api: FakeKubeApi, kube_client: Any,
                                                               core_v1: Any) -> None:
    await core_v1.create_namespaced_config_map(NS, configmap("c"))
    async with aiohttp.ClientSession() as session:
        async with session.put(f"{kube_api.url}/api/v1/namespaces/{NS}/configmaps", json={}) as response:
            assert response.status == 405 and (await response.json())["reason"] == "MethodNotAllowed"
        async with session.post(f"{kube_api.url}/api/v1/configmaps", json=configmap("nowhere")) as response:
            assert response.status == 405
        async with session.patch(f"{kube_api.url}/api/v1/namespaces/{NS}/configmaps/c", data="data: {}",
                                 headers={"Content-Type": "application/apply-patch+yaml"}) as response:
            assert response.status == 415 and (await response.json())["reason"] == "UnsupportedMediaType"
    await client.ApiextensionsV1Api(kube_client).create_custom_resource_definition(CRD)
    custom = client.CustomObjectsApi(kube_client)
    await custom.create_namespaced_custom_object("stead.dev", "v1", NS, "steadjobs", {
        "apiVersion": "stead.dev/v1", "kind": "SteadJob", "metadata": {"name": "j"}})
    with pytest.raises(ApiException) as strategic:  # the real server has no strategic merge for custom resources
        await custom.patch_namespaced_custom_object("stead.dev", "v1", NS, "steadjobs", "j", {"spec": {}},
                                                    _content_type="application/strategic-merge-patch+json")
    assert strategic.value.status == 415


async def test_list_pages_with_limit_and_continue(core_v1: Any) -> None:
    for i in range(5):
        await core_v1.create_namespaced_config_map(NS, configmap(f"c{i}"))
    first = await core_v1.list_namespaced_config_map(NS, limit=2)
    assert [c.metadata.name for c in first.items] == ["c0", "c1"] and first.metadata.remaining_item_count == 3
    rest = await core_v1.list_namespaced_config_map(NS, limit=10, _continue=first.metadata._continue)
    assert [c.metadata.name for c in rest.items] == ["c2", "c3", "c4"] and not rest.metadata._continue
    assert rest.metadata.resource_version == first.metadata.resource_version


# ----- deletion


async def test_finalizers_hold_a_deleted_object_until_an_update_empties_them(core_v1: Any) -> None:
    await core_v1.create_namespaced_config_map(NS, {"metadata": {"name": "c", "finalizers": ["stead.dev/keep"]}})
    listed = await core_v1.list_namespaced_config_map(NS)
    await core_v1.delete_namespaced_config_map("c", NS)
    held = await core_v1.read_namespaced_config_map("c", NS)
    assert held.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as refused:
        await core_v1.patch_namespaced_config_map("c", NS, {"metadata": {"finalizers": ["stead.dev/keep", "more"]}},
                                                  _content_type=MERGE)
    assert refused.value.status == 422
    await core_v1.patch_namespaced_config_map("c", NS, {"metadata": {"finalizers": None}}, _content_type=MERGE)
    with pytest.raises(ApiException) as gone:
        await core_v1.read_namespaced_config_map("c", NS)
    assert gone.value.status == 404
    async with watch.Watch() as w:
        stream = w.stream(core_v1.list_namespaced_config_map, NS, resource_version=listed.metadata.resource_version)
        assert await events(stream, 2) == [("MODIFIED", "c"), ("DELETED", "c")]


async def test_owner_references_cascade_unless_orphaned(kube_api: FakeKubeApi, core_v1: Any) -> None:
    owner = await core_v1.create_namespaced_config_map(NS, configmap("owner"))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    await core_v1.create_namespaced_config_map(NS, {"metadata": {"name": "child", "ownerReferences": [ref]}})
    child = await core_v1.read_namespaced_config_map("child", NS)
    grandchild_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "child", "uid": child.metadata.uid}
    await core_v1.create_namespaced_config_map(NS, {"metadata": {"name": "grandchild",
                                                                 "ownerReferences": [grandchild_ref]}})
    await core_v1.delete_namespaced_config_map("owner", NS)
    assert [c["metadata"]["name"] for c in kube_api.objects("configmaps", NS)] == []

    owner = await core_v1.create_namespaced_config_map(NS, configmap("owner"))
    ref["uid"] = owner.metadata.uid
    await core_v1.create_namespaced_config_map(NS, {"metadata": {"name": "orphan", "ownerReferences": [ref]}})
    await core_v1.delete_namespaced_config_map("owner", NS, body=client.V1DeleteOptions(propagation_policy="Orphan"))
    orphan = kube_api.get_object("configmaps", NS, "orphan")
    assert orphan is not None and not orphan["metadata"].get("ownerReferences")


async def test_a_bound_pod_is_deleted_gracefully_and_an_unbound_one_at_once(kube_api: FakeKubeApi,
                                                                            core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("free"))
    await core_v1.delete_namespaced_pod("free", NS)
    assert kube_api.get_object("pods", NS, "free") is None
    await core_v1.create_namespaced_pod(NS, pod("bound", nodeName="host-a", terminationGracePeriodSeconds=7))
    answered = await core_v1.delete_namespaced_pod("bound", NS)
    assert answered.metadata.deletion_grace_period_seconds == 7
    held = kube_api.get_object("pods", NS, "bound")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    await core_v1.delete_namespaced_pod("bound", NS, grace_period_seconds=0)  # what the kubelet sends at the end
    assert kube_api.get_object("pods", NS, "bound") is None


async def test_delete_collection_deletes_what_the_selector_matches(kube_api: FakeKubeApi, core_v1: Any) -> None:
    for name, role in (("a", "node"), ("b", "node"), ("c", "master")):
        await core_v1.create_namespaced_config_map(NS, configmap(name, {"role": role}))
    await core_v1.delete_collection_namespaced_config_map(NS, label_selector="role=node")
    assert [c["metadata"]["name"] for c in kube_api.objects("configmaps", NS)] == ["c"]


async def test_deleting_a_namespace_deletes_what_it_holds(kube_api: FakeKubeApi, core_v1: Any) -> None:
    await core_v1.create_namespace({"metadata": {"name": "job-ns"}})
    await core_v1.create_namespaced_config_map("job-ns", configmap("c"))
    await core_v1.delete_namespace("job-ns")
    assert kube_api.objects("configmaps", "job-ns") == [] and kube_api.get_object("namespaces", None, "job-ns") is None


# ----- refusals


async def test_deny_answers_forbidden_with_the_real_message_until_allow_all(kube_api: FakeKubeApi,
                                                                            core_v1: Any) -> None:
    kube_api.deny("create", "pods", namespace="locked")
    with pytest.raises(ApiException) as refused:
        await core_v1.create_namespaced_pod("locked", pod("p"))
    assert refused.value.status == 403
    assert status_of(refused.value)["message"] == (
        'pods is forbidden: User "system:serviceaccount:default:default" cannot create resource "pods" in API group '
        '"" in the namespace "locked"')
    await core_v1.create_namespaced_pod(NS, pod("p"))  # another namespace
    kube_api.deny("get", "pods")
    with pytest.raises(ApiException) as named:
        await core_v1.read_namespaced_pod("p", NS)
    assert status_of(named.value)["message"].startswith('pods "p" is forbidden')
    kube_api.allow_all()
    await core_v1.create_namespaced_pod("locked", pod("p"))
    assert kube_api.requests[("create", "pods")] == 3


@pytest.mark.parametrize(("body", "field"), [
    (pod("Bad_Name"), "metadata.name"),
    (pod("p", labels={"app": "not a value!"}), "metadata.labels"),
    ({"metadata": {"name": "p"}, "spec": {"containers": []}}, "spec.containers"),
    ({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main"}]}}, "spec.containers[0].image"),
    ({"metadata": {"name": "p"}, "spec": {"containers": [{"image": "x"}]}}, "spec.containers[0].name"),
    ({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "image": "x", "resources": {
        "limits": {"memory": "1Gi"}, "requests": {"memory": "2Gi"}}}]}}, "spec.containers[0].resources.requests"),
])
async def test_invalid_pods_are_422_naming_the_field(core_v1: Any, body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiException) as refused:
        await core_v1.create_namespaced_pod(NS, body)
    status = status_of(refused.value)
    assert (refused.value.status, status["reason"]) == (422, "Invalid")
    assert any(cause["field"].startswith(field) for cause in status["details"]["causes"])
    assert field in status["message"]


async def test_a_quantity_that_does_not_parse_is_refused_as_the_real_server_decodes_it(core_v1: Any) -> None:
    body = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "image": "x", "resources": {
        "limits": {"memory": "lots"}}}]}}
    with pytest.raises(ApiException) as refused:
        await core_v1.create_namespaced_pod(NS, body)
    assert refused.value.status == 400  # a decoding error on a real server: "cannot be handled as a Pod"
    assert "quantities must match the regular expression" in status_of(refused.value)["message"]


async def test_services_and_namespaces_take_dns_labels(core_v1: Any) -> None:
    with pytest.raises(ApiException) as refused:
        await core_v1.create_namespace({"metadata": {"name": "has.dots"}})
    assert refused.value.status == 422
    with pytest.raises(ApiException) as service:
        await core_v1.create_namespaced_service(NS, {"metadata": {"name": "1abc"}, "spec": {"ports": [{"port": 80}]}})
    assert service.value.status == 422
    made = await core_v1.create_namespaced_service(NS, {"metadata": {"name": "rdzv"}, "spec": {"ports": [
        {"port": 29400}]}})
    assert made.spec.cluster_ip and made.spec.ports[0].target_port == 29400


@pytest.mark.parametrize(("text", "value"), [
    ("1Gi", 2**30), ("128Mi", 128 * 2**20), ("1.5Gi", 3 * 2**29), ("250m", "0.25"), ("2", 2), ("1k", 1000),
    ("1e3", 1000), ("1E", 10**18), ("12e-3", "0.012"), ("1Ki", 1024), (".5", "0.5"),
])
def test_quantities_parse_exactly_like_kubernetes(text: str, value: int | str) -> None:
    assert parse_quantity(text) == Decimal(value)


@pytest.mark.parametrize("text", ["lots", "1.2.3", "", "Gi", "1 Gi", "1KiB", "1e"])
def test_a_string_that_is_no_quantity_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="quantities must match"):
        parse_quantity(text)


# ----- custom resources, latency, clients


async def test_a_crd_serves_its_custom_resources_until_it_is_deleted(kube_api: FakeKubeApi,
                                                                     kube_client: Any) -> None:
    await client.ApiextensionsV1Api(kube_client).create_custom_resource_definition(CRD)
    custom = client.CustomObjectsApi(kube_client)
    made = await custom.create_namespaced_custom_object("stead.dev", "v1", NS, "steadjobs", {
        "apiVersion": "stead.dev/v1", "kind": "SteadJob", "metadata": {"name": "j"}, "spec": {"nodes": 2},
        "status": {"ignored": True}})
    assert "status" not in made
    status = await custom.patch_namespaced_custom_object_status("stead.dev", "v1", NS, "steadjobs", "j", {
        "status": {"phase": "Running"}}, _content_type=MERGE)
    assert status["status"] == {"phase": "Running"} and status["spec"] == {"nodes": 2}
    resources = {r.name for r in (await client.ApisApi(kube_client).get_api_versions()).groups}
    assert "stead.dev" in resources
    await client.ApiextensionsV1Api(kube_client).delete_custom_resource_definition("steadjobs.stead.dev")
    with pytest.raises(ApiException) as gone:
        await custom.list_namespaced_custom_object("stead.dev", "v1", NS, "steadjobs")
    assert gone.value.status == 404


async def test_latency_holds_each_request_before_it_is_handled(kube_api: FakeKubeApi, core_v1: Any) -> None:
    kube_api.latency_s = 0.3
    creating = asyncio.ensure_future(core_v1.create_namespaced_config_map(NS, configmap("slow")))
    await asyncio.sleep(0.05)  # well inside the latency: the request cannot have been handled yet
    assert kube_api.get_object("configmaps", NS, "slow") is None
    await creating
    assert kube_api.get_object("configmaps", NS, "slow") is not None


async def test_write_kubeconfig_is_loadable_by_kubernetes_asyncio(kube_api: FakeKubeApi, tmp_path: Path) -> None:
    path = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    async with client.ApiClient(configuration) as api_client:
        namespaces = await client.CoreV1Api(api_client).list_namespace()
    assert "default" in {n.metadata.name for n in namespaces.items}


async def test_kopf_runs_an_operator_against_the_fake(kube_api: FakeKubeApi, kube_client: Any) -> None:
    await client.ApiextensionsV1Api(kube_client).create_custom_resource_definition(CRD)
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=kube_api.url, insecure=True)

    @kopf.on.create("stead.dev", "v1", "steadjobs", registry=registry)
    def created(spec: Any, patch: Any, **_: Any) -> None:
        patch.status["nodes"] = spec["nodes"]

    @kopf.on.delete("stead.dev", "v1", "steadjobs", registry=registry)
    def deleted(**_: Any) -> None:
        pass

    stop, ready = asyncio.Event(), asyncio.Event()
    operator = asyncio.ensure_future(kopf.operator(registry=registry, standalone=True, namespaces=[NS],
                                                   stop_flag=stop, ready_flag=ready))
    try:
        await asyncio.wait_for(ready.wait(), TIMEOUT_S)
        custom = client.CustomObjectsApi(kube_client)
        await custom.create_namespaced_custom_object("stead.dev", "v1", NS, "steadjobs", {
            "apiVersion": "stead.dev/v1", "kind": "SteadJob", "metadata": {"name": "j"}, "spec": {"nodes": 2}})
        await kube_api.wait_for(lambda: (kube_api.get_object("steadjobs.stead.dev", NS, "j") or {}).get(
            "status", {}).get("nodes") == 2, TIMEOUT_S)
        held = kube_api.get_object("steadjobs.stead.dev", NS, "j")
        assert held is not None and held["metadata"]["finalizers"]  # kopf's, for its delete handler
        await custom.delete_namespaced_custom_object("stead.dev", "v1", NS, "steadjobs", "j")
        await kube_api.wait_for(lambda: kube_api.get_object("steadjobs.stead.dev", NS, "j") is None, TIMEOUT_S)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(operator, TIMEOUT_S)
