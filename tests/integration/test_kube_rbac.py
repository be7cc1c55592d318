"""The Helm chart's RBAC enforced by a real authorizer: the chart's ServiceAccounts, the collector's ClusterRole
and binding applied to the session's kube-apiserver (``--authorization-mode=Node,RBAC``); a token for each
ServiceAccount minted with TokenRequest, as the kubelet mounts one. The collector, with its token, reads
everything it needs through its own in-cluster client; what the chart does not grant is refused (403). The other
components read no Kubernetes API (their pods do not even mount a token) and their ServiceAccounts are granted
nothing.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from gpumeter.clock import ManualClock
from gpumeter.devtools.gotools import ensure_tools
from services.collector.dra import DraResolver
from services.collector.nodefacts import read_node_object
from services.collector.podwatch import (
    ERROR_REJECTED,
    DraApiReader,
    NamespaceWatcher,
    PodWatcher,
    in_cluster_api_client,
)
from simulator.apiserver import make_node_object, make_pod_object
from tests.integration.kube_world import create_running_pod, new_namespace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpumeter"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
PATHS = {
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
}


def rendered_rbac(release: str, namespace: str) -> list[dict]:
    helm = ensure_tools()["helm"]
    result = subprocess.run([str(helm), "template", release, str(CHART), "--namespace", namespace],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc and doc.get("kind") in RBAC_KINDS]


@pytest.fixture(scope="module")
def installed(kube_apiserver):
    """The chart's RBAC objects applied under a release of their own: (release, namespace, objects)."""
    release = f"gm{uuid.uuid4().hex[:6]}"
    namespace = new_namespace(kube_apiserver, name=f"{release}-system")
    objects = rendered_rbac(release, namespace)
    for obj in objects:
        kube_apiserver.must("POST", PATHS[obj["kind"]].format(namespace=obj["metadata"].get("namespace", namespace)),
                            obj)
    return release, namespace, objects


def token_for(kube_apiserver, namespace: str, service_account: str) -> str:
    answer = kube_apiserver.must(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}})
    return answer["status"]["token"]


def service_accounts(objects: list[dict]) -> dict[str, str]:
    """component label -> ServiceAccount name."""
    return {obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj["metadata"]["name"]
            for obj in objects if obj["kind"] == "ServiceAccount"}


def in_cluster(kube_apiserver, tmp_path: Path, token: str):
    """The collector's own in-cluster client, from the files the kubelet mounts and the service's environment."""
    (tmp_path / "token").write_text(token)
    (tmp_path / "ca.crt").write_bytes(kube_apiserver.ca_file.read_bytes())
    return in_cluster_api_client(token_path=str(tmp_path / "token"), ca_path=str(tmp_path / "ca.crt"),
                                 environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                          "KUBERNETES_SERVICE_PORT": str(kube_apiserver.port)})


async def eventually(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.05)


async def test_the_collector_reads_all_it_needs_with_its_charts_token(kube_apiserver, installed, tmp_path):
    _, namespace, objects = installed
    token = await asyncio.to_thread(token_for, kube_apiserver, namespace, service_accounts(objects)["collector"])
    node = f"gpu-node-{uuid.uuid4().hex[:8]}"
    node_obj = make_node_object(node, provider="aws", region="us-east-1", zone="us-east-1a",
                                instance_type="p5.48xlarge", price_model="on_demand", provider_id="aws:///x/i-1")
    node_obj.pop("status")
    node_obj["metadata"].pop("uid")
    await asyncio.to_thread(kube_apiserver.must, "POST", "/api/v1/nodes", node_obj)
    workload_ns = await asyncio.to_thread(new_namespace, kube_apiserver, {"team": "search"})
    await asyncio.to_thread(create_running_pod, kube_apiserver,
                            make_pod_object(workload_ns, "infer-0", "u", node, gpu_requests={"nvidia.com/gpu": 1}))

    api = in_cluster(kube_apiserver, tmp_path, token)
    errors: list[str] = []
    pods, namespaces = [], []

    async def on_pod(event):
        pods.append(event)

    async def on_namespace(event):
        namespaces.append(event)

    settings = dict(backoff_initial_s=0.05, backoff_max_s=0.2, rng=random.Random(1), on_watch_error=errors.append)
    pod_watch = PodWatcher(api, node, "test", ManualClock(0), on_pod, **settings)
    ns_watch = NamespaceWatcher(api, ManualClock(0), on_namespace, **settings)
    tasks = [asyncio.create_task(pod_watch.run()), asyncio.create_task(ns_watch.run())]
    try:
        await eventually(lambda: pod_watch.has_synced and ns_watch.has_synced, what="both lists")
        assert [(e.name, e.phase) for e in pods] == [("infer-0", "Running")]
        assert {e.name: dict(e.labels) for e in namespaces}[workload_ns]["team"] == "search"
        # ... and the watches are open: a change arrives.
        await asyncio.to_thread(kube_apiserver.must, "PATCH", f"/api/v1/namespaces/{workload_ns}",
                                {"metadata": {"labels": {"team": "chat"}}}, content_type="application/merge-patch+json")
        await eventually(lambda: any(e.name == workload_ns and e.labels.get("team") == "chat" for e in namespaces),
                         what="the relabelled namespace through the watch")
        node_read = await read_node_object(api, node)
        assert node_read["spec"]["providerID"] == "aws:///x/i-1"
        reader = DraApiReader(api, node)
        assert await reader.list_slices() == []
        assert await reader.read_claim(workload_ns, "no-such-claim") is None  # 404, not 403
        resolver = DraResolver(node, reader.list_slices, reader.read_claim)
        await resolver.assignments([])
        assert errors == []
    finally:
        await pod_watch.stop()
        await ns_watch.stop()
        await asyncio.gather(*tasks)
        await api.close()


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/api/v1/secrets", None),
    ("GET", "/api/v1/namespaces/{ns}/secrets", None),
    ("PATCH", "/api/v1/namespaces/{ns}/pods/p", {"metadata": {"labels": {"x": "y"}}}),
    ("DELETE", "/api/v1/namespaces/{ns}/pods/p", None),
    ("POST", "/api/v1/namespaces/{ns}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
                                              "spec": {"containers": [{"name": "c", "image": "i"}]}}),
    ("GET", "/api/v1/nodes", None),  # get its own Node, not list every node
    ("PATCH", "/api/v1/nodes/n", {"metadata": {"labels": {"x": "y"}}}),
    ("GET", "/api/v1/configmaps", None),
    ("GET", "/apis/resource.k8s.io/v1/resourceclaims", None),  # get one claim, not list them
    ("GET", "/apis/resource.k8s.io/v1/deviceclasses", None),
    ("POST", "/api/v1/namespaces/{ns}/serviceaccounts/default/token",
     {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}),
])
def test_what_the_chart_does_not_grant_the_collector_is_refused(kube_apiserver, installed, method, path, body):
    _, namespace, objects = installed
    token = token_for(kube_apiserver, namespace, service_accounts(objects)["collector"])
    status, answer = kube_apiserver.request(method, path.format(ns=namespace), body, token=token,
                                            content_type="application/merge-patch+json" if method == "PATCH"
                                            else "application/json")
    assert status == 403 and answer["reason"] == "Forbidden", answer
    assert f"system:serviceaccount:{namespace}:{service_accounts(objects)['collector']}" in answer["message"]


async def test_a_collector_without_the_grant_logs_rejected_and_keeps_trying(kube_apiserver, installed, tmp_path):
    """A ServiceAccount the chart grants nothing (the guard's): the pod watch is refused (403) and retried, never
    fatal: fixing RBAC later needs no restart."""
    _, namespace, objects = installed
    token = await asyncio.to_thread(token_for, kube_apiserver, namespace, service_accounts(objects)["guard"])
    api = in_cluster(kube_apiserver, tmp_path, token)
    errors: list[str] = []

    async def on_pod(event):
        raise AssertionError("no pod may be read")

    watcher = PodWatcher(api, "n", "test", ManualClock(0), on_pod, backoff_initial_s=0.05, backoff_max_s=0.1,
                         rng=random.Random(2), on_watch_error=errors.append)
    task = asyncio.create_task(watcher.run())
    try:
        await eventually(lambda: len(errors) >= 2, what="two refused lists")
        assert set(errors) == {ERROR_REJECTED} and not watcher.has_synced
    finally:
        await watcher.stop()
        await task
        await api.close()


def test_no_other_component_is_granted_anything(kube_apiserver, installed):
    """Every ServiceAccount of the chart but the collector's: a token is refused the collector's reads too."""
    _, namespace, objects = installed
    accounts = service_accounts(objects)
    assert "collector" in accounts and {"guard", "billing"} <= set(accounts)
    for component, account in accounts.items():
        if component == "collector":
            continue
        token = token_for(kube_apiserver, namespace, account)
        for path in ("/api/v1/pods", "/api/v1/namespaces", "/apis/resource.k8s.io/v1/resourceslices",
                     f"/api/v1/namespaces/{namespace}/configmaps"):
            status, answer = kube_apiserver.request("GET", path, token=token)
            assert status == 403, (component, path, answer)
