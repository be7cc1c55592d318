"""deploy/helm/gpumeter: `helm lint` and `helm template` with the real helm, for the default values and the chart's
ci/ overlays (two node pools with Kafka over SASL_SSL; ServiceMonitors, alerts and mutual TLS). Every rendering
holds what the kustomization's tests hold (tests/unit/deploy/manifests.py: Kubernetes schemas, least-privilege
RBAC, the collector's host access and security context, restricted pods, resources, secrets by reference, and every
container's command line and environment through the real gpumeter CLI and settings); the ServiceMonitors and the
PrometheusRule validate against prometheus-operator's CRD schemas (vendored in prometheus-operator/), and every
metric an alert reads is in gpumeter/metrics.py (read by Prometheus' own parser). With the default values the chart renders the objects the real
kustomize builds from deploy/kubernetes, field by field, less the differences listed in DEFAULT_DIFFERENCES.

No cluster is needed; helm and kustomize come from the session fixture ``go_tools``, the PromQL parser from
``promql`` (tests/conftest.py).
"""

from __future__ import annotations

import ast
import copy
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gpumeter.metrics import METRICS
from services.billing.catalog import OVERRIDE_COLUMNS, parse_override_csv
from services.guard.config import GuardConfig
from tests.unit.deploy import REPO_ROOT, role_of, settings_for
from tests.unit.deploy.manifests import (
    KUBERNETES_VERSIONS,
    by_role,
    check_collector_host_access,
    check_collector_pools_are_priced,
    check_commands_and_settings,
    check_guard_pods_are_served,
    check_guard_roles,
    check_kubernetes_schemas,
    check_least_privilege_rbac,
    check_metrics_services,
    check_no_rbac_wildcards,
    check_resources,
    check_restricted_pods,
    check_secrets_by_reference,
    check_service_accounts,
    check_state_on_volumes,
    check_workload_selectors_are_disjoint,
    container_env,
    containers,
    env_item,
    guard_deployments,
    mounted_file,
    mounted_secret_key,
    of_kind,
    pod_spec,
    workloads,
)
from gpumeter.devtools.prometheus import labels_read, metric_names, selectors

CHART = REPO_ROOT / "deploy" / "helm" / "gpumeter"
KUSTOMIZE_DIR = REPO_ROOT / "deploy" / "kubernetes"
CRD_DIR = Path(__file__).with_name("prometheus-operator")
CRD_FILES = {
    "ServiceMonitor": CRD_DIR / "monitoring.coreos.com_servicemonitors.yaml",
    "PrometheusRule": CRD_DIR / "monitoring.coreos.com_prometheusrules.yaml",
}
ROLES = ("collector", "attributor", "billing", "guard", "api")
# Where each role's code is: services/<role>, but the API's, which is billing's read side.
ROLE_SOURCES = {"api": ("services/billing/api.py", "services/billing/allocation.py")}

# Labels Helm's conventions add (and the chart's selectors include, so two releases never select each other's
# pods); the comparison with the kustomization ignores them.
HELM_STANDARD_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance"}
# What else the chart's default rendering has that the kustomization's objects do not, and why:
# * the topics Job is a Helm hook run after every install and upgrade (a Job's pod template is immutable, so an
#   upgrade could not change it in place; kubectl apply -k relies on the Job's TTL instead);
# * a checksum of the price list and of the guard config on their pods, so a changed value rolls them (the files
#   are read at start);
# * the guard config is rendered from values with toYaml (keys sorted, no comment): compared as parsed YAML.
DEFAULT_DIFFERENCES = {
    ("Job", "gpumeter-topics", "metadata.annotations"):
        {"helm.sh/hook": "post-install,post-upgrade", "helm.sh/hook-delete-policy": "before-hook-creation"},
    ("Deployment", "gpumeter-billing", "spec.template.metadata.annotations"): {"checksum/prices"},
    ("Deployment", "gpumeter-guard", "spec.template.metadata.annotations"): {"checksum/config"},
    ("Deployment", "gpumeter-guard-nodes", "spec.template.metadata.annotations"): {"checksum/config"},
    ("Deployment", "gpumeter-guard-budgets", "spec.template.metadata.annotations"): {"checksum/config"},
}
# Series Prometheus makes itself for every scrape target, which an alert may read besides gpumeter's registry.
PROMETHEUS_SERIES = {"up"}
# Labels every series scraped through a ServiceMonitor carries (prometheus-operator's target labels).
TARGET_LABELS = {"namespace", "job", "pod", "service", "endpoint", "instance", "container"}


# ----------------------------------------------------------------------------------------------------------------
# Running helm and kustomize


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory) -> dict[str, str]:
    """helm's own folders in a scratch place: rendering reads and writes nothing of the user's helm set-up."""
    home = tmp_path_factory.mktemp("helm-home")
    return {**os.environ, "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data")}


def run_tool(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="session")
def helm(go_tools, helm_env):
    """``helm(*args)``: run the built helm, returning the completed process."""

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_tool([str(go_tools["helm"]), *args], helm_env)

    return run


# (name, release, namespace, values files): the renderings every property is checked on.
RENDERINGS = {
    "default": ("gpumeter", "gpumeter", ()),
    "two-pools-sasl": ("gpumeter", "gpumeter", ("ci/two-pools-sasl-values.yaml",)),
    "monitoring": ("acme", "metering", ("ci/monitoring-values.yaml",)),
    "guard-scaled": ("gpumeter", "gpumeter", ("ci/guard-scaled-values.yaml",)),
}
# The monitoring renderings: one guard, and the guard scaled out (a metrics Service, ServiceMonitor and job per
# guard role).
MONITORING = {"single": ("ci/monitoring-values.yaml",),
              "scaled": ("ci/monitoring-values.yaml", "ci/guard-scaled-values.yaml")}


@pytest.fixture(scope="session")
def render(helm):
    """``render(release, namespace, *values_files, set_values=())``: the objects `helm template` renders."""

    @cache
    def rendered(release: str, namespace: str, values_files: tuple[str, ...] = (),
                 set_values: tuple[str, ...] = ()) -> tuple[dict, ...]:
        args = ["template", release, str(CHART), "--namespace", namespace]
        for name in values_files:
            args += ["--values", str(CHART / name)]
        for item in set_values:
            args += ["--set", item]
        result = helm(*args)
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)

    return lambda release, namespace, *files, set_values=(): [
        copy.deepcopy(d) for d in rendered(release, namespace, tuple(files), tuple(set_values))]


@pytest.fixture(params=sorted(RENDERINGS))
def rendering(request, render) -> tuple[str, str, str, list[dict]]:
    """(name, release, namespace, objects) of each rendering in RENDERINGS."""
    release, namespace, files = RENDERINGS[request.param]
    return request.param, release, namespace, render(release, namespace, *files)


@pytest.fixture(scope="session")
def kustomize_objects(go_tools) -> list[dict]:
    """What `kubectl apply -k deploy/kubernetes` applies: the real kustomize's build."""
    result = run_tool([str(go_tools["kustomize"]), "build", str(KUSTOMIZE_DIR)])
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def kustomize_scaled_objects(go_tools, tmp_path_factory) -> list[dict]:
    """deploy/kubernetes with the component guard-scaled added to its kustomization, as its comments say."""
    copied = shutil.copytree(KUSTOMIZE_DIR, tmp_path_factory.mktemp("kustomize") / "kubernetes")
    with (copied / "kustomization.yaml").open("a", encoding="utf-8") as file:
        file.write("components:\n  - guard-scaled\n")
    result = run_tool([str(go_tools["kustomize"]), "build", str(copied)])
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def values(*files: str) -> dict:
    """The chart's values with the given overlays merged in (maps merge, everything else is replaced)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))

    def merge(base: dict, overlay: dict) -> dict:
        for key, value in overlay.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                merge(base[key], value)
            else:
                base[key] = value
        return base

    for name in files:
        merge(merged, yaml.safe_load((CHART / name).read_text(encoding="utf-8")))
    return merged


# ----------------------------------------------------------------------------------------------------------------
# The chart itself


def test_chart_version_and_app_version_are_the_projects():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "gpumeter"
    assert chart["version"] == version and chart["appVersion"] == version
    kustomization = yaml.safe_load((KUSTOMIZE_DIR / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["images"][0]["newTag"] == version


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_helm_lint_passes_strictly(helm, name):
    _release, _namespace, files = RENDERINGS[name]
    args = ["lint", str(CHART), "--strict"]
    for file in files:
        args += ["--values", str(CHART / file)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_lint_and_template_fail_on_a_broken_chart(helm, tmp_path):
    """The two commands above can fail: a template error and a value the schema forbids are both reported."""
    broken = shutil.copytree(CHART, tmp_path / "gpumeter")
    path = broken / "templates" / "guard.yaml"
    path.write_text(path.read_text(encoding="utf-8").replace("{{- $values := .Values.guard }}",
                                                             "{{- $values := .Values.guard "), encoding="utf-8")
    assert helm("lint", str(broken), "--strict").returncode != 0
    result = helm("template", "gpumeter", str(CHART), "--set", "collector.intervalSecond=1")
    assert result.returncode != 0 and "additional properties 'intervalSecond' not allowed" in result.stderr


def test_the_kubernetes_version_constraint_is_the_oldest_one_the_manifests_are_checked_for(helm):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["kubeVersion"] == f">={KUBERNETES_VERSIONS[0]}.0-0"
    older = f"{KUBERNETES_VERSIONS[0].split('.')[0]}.{int(KUBERNETES_VERSIONS[0].split('.')[1]) - 1}.0"
    assert helm("template", "gpumeter", str(CHART), "--kube-version", f"{KUBERNETES_VERSIONS[0]}.0").returncode == 0
    result = helm("template", "gpumeter", str(CHART), "--kube-version", older)
    assert result.returncode != 0 and "kubeVersion" in result.stderr


def test_values_not_passed_yet_and_ambiguous_pools_fail_the_render(helm, tmp_path):
    # metrics.address is reserved for GPUMETER_METRICS_ADDRESS, which the services do not read yet.
    result = helm("template", "gpumeter", str(CHART), "--set", "metrics.address=127.0.0.1")
    assert result.returncode != 0 and "GPUMETER_METRICS_ADDRESS" in result.stderr
    pools = values("ci/two-pools-sasl-values.yaml")["collector"]["nodePools"]
    for broken, message in (([pools[0], {**pools[1], "name": "default"}], "used twice"),
                            ([pools[0], {k: v for k, v in pools[1].items() if k != "nodeSelector"}],
                             "missing property 'nodeSelector'")):
        overlay = tmp_path / "pools.yaml"
        overlay.write_text(yaml.safe_dump({"collector": {"nodePools": broken}}), encoding="utf-8")
        result = helm("template", "gpumeter", str(CHART), "--values", str(overlay))
        assert result.returncode != 0 and message in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------------------------
# The same objects as the kustomization


def without_helm_labels(value: Any) -> Any:
    """``value`` less Helm's standard labels wherever a label map (metadata, selectors, pod templates) holds them."""
    if isinstance(value, dict):
        return {k: without_helm_labels(v) for k, v in value.items() if k not in HELM_STANDARD_LABELS}
    if isinstance(value, list):
        return [without_helm_labels(v) for v in value]
    return value


def differences(left: Any, right: Any, path: str = "") -> list[str]:
    """Every path where ``left`` and ``right`` differ (dicts by key, lists by position)."""
    if isinstance(left, dict) and isinstance(right, dict):
        found = []
        for key in sorted(set(left) | set(right)):
            where = f"{path}.{key}" if path else str(key)
            if key not in right:
                found.append(f"{where}: only in the kustomization")
            elif key not in left:
                found.append(f"{where}: only in the chart")
            else:
                found.extend(differences(left[key], right[key], where))
        return found
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        return [d for i, (a, b) in enumerate(zip(left, right)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if left == right else [f"{path}: {left!r} != {right!r}"]


def by_identity(docs: list[dict]) -> dict[tuple[str, str], dict]:
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(keyed) == len(docs), "two objects of one kind and name"
    return keyed


def take(doc: dict, dotted: str) -> Any:
    """Remove and return the value at a dotted path of ``doc`` (None when absent)."""
    *parents, last = dotted.split(".")
    node = doc
    for key in parents:
        node = node.get(key, {})
    return node.pop(last, None) if isinstance(node, dict) else None


def assert_same_objects(kustomized: dict[tuple[str, str], dict], charted: dict[tuple[str, str], dict],
                        expected_keys: set[tuple[str, str]]) -> None:
    """The chart's objects are the kustomization's, field by field, less DEFAULT_DIFFERENCES and Helm's labels."""
    assert set(charted) == expected_keys, (
        f"only in the chart: {set(charted) - expected_keys}; only in the kustomization: "
        f"{expected_keys - set(charted)}")
    for key in sorted(expected_keys):
        ours, theirs = copy.deepcopy(kustomized[key]), without_helm_labels(charted[key])
        for (kind, name, dotted), allowed in DEFAULT_DIFFERENCES.items():
            if key == (kind, name):
                extra = take(theirs, dotted)
                assert extra is not None and set(extra) == set(allowed), (key, dotted, extra)
                if isinstance(allowed, dict):
                    assert extra == allowed, (key, dotted, extra)
        if key == ("ConfigMap", "gpumeter-guard"):
            assert yaml.safe_load(ours["data"].pop("guard.yaml")) == yaml.safe_load(
                theirs["data"].pop("guard.yaml"))
        assert not differences(ours, theirs), f"{key}:\n" + "\n".join(differences(ours, theirs))


def test_default_values_render_the_kustomizations_objects_field_by_field(render, kustomize_objects):
    kustomized = by_identity(kustomize_objects)
    for namespace_create in (False, True):
        charted = by_identity(render("gpumeter", "gpumeter", set_values=(f"namespace.create={namespace_create}",)))
        expected_keys = set(kustomized) - (set() if namespace_create else {("Namespace", "gpumeter")})
        assert_same_objects(kustomized, charted, expected_keys)


def test_the_scaled_guard_renders_the_kustomize_components_objects_field_by_field(render, kustomize_scaled_objects):
    kustomized = by_identity(kustomize_scaled_objects)
    charted = by_identity(render("gpumeter", "gpumeter", set_values=("guard.mode=scaled", "namespace.create=true")))
    assert {key for key in kustomized if "guard" in key[1]} == {
        ("ServiceAccount", "gpumeter-guard"), ("ConfigMap", "gpumeter-guard"),
        ("Deployment", "gpumeter-guard-nodes"), ("Service", "gpumeter-guard-nodes"),
        ("Deployment", "gpumeter-guard-budgets"), ("Service", "gpumeter-guard-budgets")}
    assert_same_objects(kustomized, charted, set(kustomized))


def test_the_comparison_sees_a_changed_field(render, kustomize_objects):
    charted = by_identity(render("gpumeter", "gpumeter", set_values=("billing.resources.limits.memory=2Gi",)))
    theirs = without_helm_labels(charted[("Deployment", "gpumeter-billing")])
    ours = by_identity(kustomize_objects)[("Deployment", "gpumeter-billing")]
    assert differences(ours, theirs) == [
        "spec.template.metadata.annotations: only in the chart",
        "spec.template.spec.containers[0].resources.limits.memory: '1Gi' != '2Gi'"]


# ----------------------------------------------------------------------------------------------------------------
# Every rendering: the kustomization's properties


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendering, version):
    _name, _release, _namespace, docs = rendering
    built_in = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    check_kubernetes_schemas(built_in, version)


def test_every_namespaced_object_is_in_the_release_namespace(rendering):
    _name, _release, namespace, docs = rendering
    for doc in docs:
        if doc["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            continue
        assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"
    for ns in of_kind(docs, "Namespace"):
        assert ns["metadata"]["name"] == namespace
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_least_privilege_rbac(rendering):
    _name, _release, _namespace, docs = rendering
    check_least_privilege_rbac(docs)
    check_no_rbac_wildcards(docs)
    check_service_accounts(docs)


def test_collector_host_access_and_security_context(rendering):
    _name, _release, _namespace, docs = rendering
    check_collector_host_access(docs)
    check_workload_selectors_are_disjoint(docs)


def test_pods_other_than_the_collectors_are_restricted_with_resources(rendering):
    _name, _release, _namespace, docs = rendering
    check_restricted_pods(docs)
    check_resources(docs)
    check_state_on_volumes(docs)


def test_secrets_only_by_reference(rendering):
    name, _release, _namespace, docs = rendering
    referenced = check_secrets_by_reference(docs)
    documented = (CHART / "values.yaml").read_text(encoding="utf-8")
    if name == "default":
        assert referenced == {"gpumeter-kafka", "gpumeter-ledger", "gpumeter-guard"}
        for secret in referenced:
            assert f"kubectl -n gpumeter create secret generic {secret} " in documented, f"how to create {secret}?"


def test_every_container_command_line_and_environment_goes_through_the_real_cli_and_settings(rendering):
    _name, _release, _namespace, docs = rendering
    roles = check_commands_and_settings(docs)
    recorder = bool(values(*RENDERINGS[_name][2])["recorder"]["enabled"])
    assert set(roles) == {"api", "attributor", "billing", "collector", "guard", "ledger", "topics"} | (
        {"record"} if recorder else set())
    assert roles.count("collector") == len(of_kind(docs, "DaemonSet"))


def test_metrics_services_probes_and_ports(rendering):
    _name, _release, _namespace, docs = rendering
    check_metrics_services(docs)


def test_the_guard_runs_as_one_all_role_or_scaled_out_as_nodes_beside_one_budgets(rendering):
    name, _release, _namespace, docs = rendering
    assert check_guard_roles(docs) == ("scaled" if name == "guard-scaled" else "single")
    check_guard_pods_are_served(docs)


def test_guard_mode_scaled_renders_nodes_replicas_beside_one_budgets_guard(render, helm):
    def helm_fails(*set_values: str) -> bool:
        args = ["template", "gpumeter", str(CHART)]
        for item in set_values:
            args += ["--set", item]
        return helm(*args).returncode != 0

    single = guard_deployments(render("gpumeter", "gpumeter"))
    assert set(single) == {"all"} and single["all"]["workload"]["metadata"]["name"] == "gpumeter-guard"
    assert str(single["all"]["settings"].state_path) == "/var/lib/gpumeter/guard-state.json"

    for replicas in (2, 5):
        docs = render("gpumeter", "gpumeter", set_values=("guard.mode=scaled", f"guard.nodes.replicas={replicas}",
                                                          "guard.state.existingClaim=guard-claim"))
        guards = guard_deployments(docs)
        assert {role: g["workload"]["metadata"]["name"] for role, g in guards.items()} == {
            "nodes": "gpumeter-guard-nodes", "budgets": "gpumeter-guard-budgets"}
        assert (guards["nodes"]["replicas"], guards["budgets"]["replicas"]) == (replicas, 1)
        assert guards["budgets"]["volumes"]["state"]["persistentVolumeClaim"] == {"claimName": "guard-claim"}
        assert "state" not in guards["nodes"]["volumes"]
        for guard in guards.values():
            # Both roles raise violations: both post them to Alertmanager.
            (container,) = pod_spec(guard["workload"])["containers"]
            assert env_item(container, "GPUMETER_GUARD_ALERTMANAGER_URL")["valueFrom"]["secretKeyRef"] == {
                "name": "gpumeter-guard", "key": "alertmanager-url", "optional": True}
        assert check_guard_roles(docs) == "scaled"
    assert helm_fails("guard.mode=sharded") and helm_fails("guard.mode=scaled", "guard.nodes.replicas=0")


def test_every_collector_pool_is_priced_by_billing(rendering, tmp_path):
    name, _release, _namespace, docs = rendering
    checked = check_collector_pools_are_priced(docs, tmp_path)
    # The default values override nothing (facts from the nodes); the two-pool example overrides both pools.
    assert checked == (2 if "two-pools" in name else 0), name


# ----------------------------------------------------------------------------------------------------------------
# Values reach the objects


def test_each_node_pool_gets_its_own_daemonset_with_its_selector_tolerations_and_facts(render):
    docs = render("gpumeter", "gpumeter", "ci/two-pools-sasl-values.yaml")
    pools = values("ci/two-pools-sasl-values.yaml")["collector"]["nodePools"]
    daemonsets = of_kind(docs, "DaemonSet")
    assert [d["metadata"]["name"] for d in daemonsets] == ["gpumeter-collector", "gpumeter-collector-l4-spot"]
    for daemonset, pool in zip(daemonsets, pools):
        spec = pod_spec(daemonset)
        assert spec["nodeSelector"] == pool["nodeSelector"]
        assert spec["tolerations"] == pool["tolerations"]
        assert daemonset["spec"]["selector"]["matchLabels"]["gpumeter.io/node-pool"] == pool["name"]
        (container,) = spec["containers"]
        settings = settings_for(container["args"], container_env(container, docs))
        assert (settings.cloud_provider, settings.region, settings.instance_type, settings.price_model) == (
            pool["cloudProvider"], pool["region"], pool["instanceType"], pool["priceModel"])
        assert settings.sharing_config == pool.get("sharing", "")
        assert settings.cluster == "research"
        expected = pool.get("resources") or values()["collector"]["resources"]
        assert container["resources"] == expected
    # The pools' nodes do not overlap: no node matches two pools' selectors.
    first, second = (set(p["nodeSelector"].items()) for p in pools)
    assert {k for k, _ in first} & {k for k, _ in second}, "the pools select on a shared label key"
    assert dict(first) != dict(second)


def no_kafka_client(container: dict, docs: list[dict]) -> bool:
    """The API and the ledger's retention use the ledger only: no Kafka settings, no Kafka secret, no Kafka mounts
    (checked here)."""
    if role_of(container["args"]) not in ("api", "ledger"):
        return False
    assert not [name for name in container_env(container, docs) if "KAFKA" in name], container["name"]
    assert not [m for m in container.get("volumeMounts", []) if m["mountPath"] != "/tmp"], container["name"]
    return True


def test_kafka_over_sasl_ssl_reaches_every_container(render):
    docs = render("gpumeter", "gpumeter", "ci/two-pools-sasl-values.yaml")
    kafka = values("ci/two-pools-sasl-values.yaml")["kafka"]
    for workload in workloads(docs):
        spec = pod_spec(workload)
        for container in containers(spec):
            if no_kafka_client(container, docs):
                continue
            settings = settings_for(container["args"], container_env(container, docs))
            client = getattr(settings, "kafka", settings)  # topics: its KafkaSettings themselves
            where = container["name"]
            assert client.bootstrap_servers == kafka["bootstrapServers"], where
            assert client.topic_prefix == "prod.", where
            assert (client.security_protocol, client.sasl_mechanism, client.sasl_username) == (
                "SASL_SSL", "SCRAM-SHA-512", "gpumeter"), where
            password = env_item(container, "GPUMETER_KAFKA_SASL_PASSWORD")["valueFrom"]["secretKeyRef"]
            # SASL on: the Secret is required, so a missing one stops the pod instead of failing to authenticate.
            assert password == {"name": "kafka-user-gpumeter", "key": "password"}, where
            assert mounted_secret_key(spec, container, client.ssl_cafile) == ("kafka-cluster-ca-cert", "ca.crt")
            assert client.ssl_certfile is None and client.ssl_keyfile is None
    attributor = settings_for(["attributor"], container_env(pod_spec(by_role(docs, "attributor")[0])["containers"][0],
                                                          docs))
    assert attributor.topic_replication_factor == kafka.get("replicationFactor", 3)


def test_mutual_tls_mounts_the_client_certificate_and_plaintext_stays_plain(render):
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    for workload in workloads(docs):
        spec = pod_spec(workload)
        for container in containers(spec):
            if no_kafka_client(container, docs):
                continue
            settings = settings_for(container["args"], container_env(container, docs))
            client = getattr(settings, "kafka", settings)  # topics: its KafkaSettings themselves
            assert client.security_protocol == "SSL" and client.sasl_mechanism is None
            assert mounted_secret_key(spec, container, client.ssl_cafile) == ("kafka-ca", "ca.pem")
            assert mounted_secret_key(spec, container, client.ssl_certfile) == ("gpumeter-kafka-client", "tls.crt")
            assert mounted_secret_key(spec, container, client.ssl_keyfile) == ("gpumeter-kafka-client", "tls.key")
            password = env_item(container, "GPUMETER_KAFKA_SASL_PASSWORD")["valueFrom"]["secretKeyRef"]
            assert password == {"name": "acme-gpumeter-kafka", "key": "sasl-password", "optional": True}
    default = render("gpumeter", "gpumeter")
    for workload in workloads(default):
        spec = pod_spec(workload)
        assert all("secret" not in v for v in spec["volumes"]), "no TLS: no Secret volume"


def test_the_api_takes_its_bearer_tokens_from_the_named_secret_mounted_whole(render):
    docs = render("gpumeter", "gpumeter", set_values=("api.auth.tokenSecret.name=api-tokens",
                                                      "api.auth.tokenSecret.key=current"))
    (api,) = by_role(docs, "api")
    spec = pod_spec(api)
    (container,) = spec["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    assert settings.token_file is not None
    assert mounted_secret_key(spec, container, str(settings.token_file)) == ("api-tokens", "current")
    mount = next(m for m in container["volumeMounts"] if str(settings.token_file).startswith(m["mountPath"]))
    assert "subPath" not in mount and mount["readOnly"], "a subPath mount never sees a rotated Secret"
    # Without a Secret: no token file, no volume.
    (plain,) = pod_spec(by_role(render("gpumeter", "gpumeter"), "api")[0])["containers"]
    assert "GPUMETER_API_TOKEN_FILE" not in {e["name"] for e in plain["env"]}


def api_policy_namespaces(docs: list[dict]) -> list[str] | None:
    """The namespaces the API's NetworkPolicy admits (None: no policy); checks it selects the API's pods only."""
    policies = [d for d in of_kind(docs, "NetworkPolicy")]
    if not policies:
        return None
    (policy,) = policies
    (api,) = by_role(docs, "api")
    assert policy["spec"]["podSelector"]["matchLabels"] == api["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector"}, "namespaces only: no ipBlock or podSelector widening it"
    (expression,) = peer["namespaceSelector"]["matchExpressions"]
    assert (expression["key"], expression["operator"]) == ("kubernetes.io/metadata.name", "In")
    return expression["values"]


def test_a_network_policy_admits_only_the_namespaces_the_values_name(render):
    assert api_policy_namespaces(render("acme", "metering")) == ["metering"]
    listed = render("acme", "metering", set_values=("api.networkPolicy.allowedNamespaces={monitoring,finops}",))
    assert api_policy_namespaces(listed) == ["metering", "monitoring", "finops"]
    off = render("acme", "metering", set_values=("api.networkPolicy.enabled=false",))
    assert api_policy_namespaces(off) is None
    assert api_policy_namespaces(render("acme", "metering", set_values=("api.enabled=false",))) is None


def test_image_registry_digest_pull_secrets_and_guard_state_claim(render):
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    chosen = values("ci/monitoring-values.yaml")
    for workload in workloads(docs):
        spec = pod_spec(workload)
        assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
        for container in containers(spec):
            assert container["image"] == f"{chosen['image']['repository']}@{chosen['image']['digest']}"
    (guard,) = by_role(docs, "guard")
    volumes = {v["name"]: v for v in pod_spec(guard)["volumes"]}
    assert volumes["state"] == {"name": "state", "persistentVolumeClaim": {"claimName": "gpumeter-guard-state"}}
    (attributor,) = by_role(docs, "attributor")
    assert attributor["spec"]["replicas"] == 3
    assert pod_spec(attributor)["priorityClassName"] == "platform-high"


def test_price_overrides_render_as_the_csv_billing_reads(render):
    docs = render("gpumeter", "gpumeter", "ci/two-pools-sasl-values.yaml")
    (billing,) = by_role(docs, "billing")
    spec = pod_spec(billing)
    (container,) = spec["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    text = mounted_file(spec, container, str(settings.price_override_csv), docs)
    assert set(text.splitlines()[0].split(",")) == set(OVERRIDE_COLUMNS)
    rows = parse_override_csv(text, "chart")
    wanted = values("ci/two-pools-sasl-values.yaml")["billing"]["priceOverrides"]
    assert len(rows) == len(wanted)
    # The CSV round-trips every value, quoting included (a Source with a comma and quotes).
    parsed = list(csv.DictReader(io.StringIO(text)))
    for row, want in zip(parsed, wanted):
        assert {k: v for k, v in row.items() if v} == {k: str(v) for k, v in want.items()}
    assert any('"' in str(w.get("Source", "")) for w in wanted) and any("," in str(w.get("Source", "")) for w in wanted)


def test_the_values_schema_knows_exactly_the_price_columns():
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    row = schema["properties"]["billing"]["properties"]["priceOverrides"]["items"]
    assert set(row["properties"]) == set(OVERRIDE_COLUMNS)
    template = (CHART / "templates" / "billing.yaml").read_text(encoding="utf-8")
    (columns,) = re.findall(r'\$columns := list ((?:\s*"\w+")+)', template)
    assert set(re.findall(r'"(\w+)"', columns)) == set(OVERRIDE_COLUMNS)


def test_guard_config_from_values_loads_and_agrees_with_billing_and_the_collectors(render, tmp_path):
    docs = render("gpumeter", "gpumeter", "ci/two-pools-sasl-values.yaml")
    (guard,) = by_role(docs, "guard")
    spec = pod_spec(guard)
    (container,) = spec["containers"]
    env = container_env(container, docs)
    settings = settings_for(container["args"], env)
    config_file = tmp_path / "guard.yaml"
    config_file.write_text(mounted_file(spec, container, str(settings.config_path), docs), encoding="utf-8")
    config = GuardConfig.load(config_file, env)
    assert set(config.namespace_budgets) == {"ml", "*"} and set(config.team_budgets) == {"research"}
    assert config.hold_down_seconds == 300
    (billing,) = pod_spec(by_role(docs, "billing")[0])["containers"]
    assert config.team_label_key == settings_for(billing["args"], container_env(billing, docs)).team_label
    for daemonset in of_kind(docs, "DaemonSet"):
        assert daemonset["spec"]["template"]["metadata"]["labels"].get(config.exempt_label) == "true"
        # The label is honoured only where the config lists the namespace (the release's, by default).
        assert config.exempt_label_namespaces == (daemonset["metadata"]["namespace"],)


def test_the_collector_is_exempt_in_the_release_namespace_unless_the_values_list_namespaces(render, tmp_path):
    def loaded(docs):
        (guard,) = by_role(docs, "guard")
        spec = pod_spec(guard)
        (container,) = spec["containers"]
        env = container_env(container, docs)
        path = tmp_path / "guard.yaml"
        path.write_text(mounted_file(spec, container, str(settings_for(container["args"], env).config_path), docs),
                        encoding="utf-8")
        return GuardConfig.load(path, env)

    assert loaded(render("acme", "metering")).exempt_label_namespaces == ("metering",)
    chosen = render("acme", "metering", set_values=(
        "guard.config.visibility_leak.exempt_label_namespaces={metering,monitoring}",))
    assert loaded(chosen).exempt_label_namespaces == ("metering", "monitoring")


def test_a_changed_config_rolls_its_pods(render):
    before = by_identity(render("gpumeter", "gpumeter"))
    after = by_identity(render("gpumeter", "gpumeter", set_values=("guard.config.hold_down_seconds=600",
                                                                   "billing.priceOverrides[0].AssetClass=node",
                                                                   "billing.priceOverrides[0].MarketPriceHourly=1")))
    for name, key in (("gpumeter-guard", "checksum/config"), ("gpumeter-billing", "checksum/prices")):
        old = before[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"][key]
        new = after[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"][key]
        assert old != new, name


def test_topics_job_runs_after_every_install_and_upgrade(rendering):
    _name, _release, _namespace, docs = rendering
    (job,) = of_kind(docs, "Job")
    assert pod_spec(job)["containers"][0]["args"] == ["topics", "create"]
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "post-install,post-upgrade"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0 and pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


# ----------------------------------------------------------------------------------------------------------------
# prometheus-operator: ServiceMonitors and the PrometheusRule


def strict(schema: Any) -> Any:
    """A CRD's structural schema made strict as the API server's field validation is: an object schema that lists
    its properties and does not keep unknown fields (x-kubernetes-preserve-unknown-fields) allows no others."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def crd_validator(kind: str) -> jsonschema.Draft4Validator:
    crd = yaml.safe_load(CRD_FILES[kind].read_text(encoding="utf-8"))
    assert crd["spec"]["names"]["kind"] == kind and crd["spec"]["group"] == "monitoring.coreos.com"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    return jsonschema.Draft4Validator(strict(version["schema"]["openAPIV3Schema"]))


_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_custom_resource(doc: dict) -> None:
    group, _, version = doc["apiVersion"].partition("/")
    assert (group, version) == ("monitoring.coreos.com", "v1"), doc["apiVersion"]
    errors = sorted(crd_validator(doc["kind"]).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.absolute_path))}: "
                                 f"{e.message}" for e in errors)
    # The CRD schema leaves metadata to the API server: the ObjectMeta fields the chart sets.
    metadata = doc["metadata"]
    assert set(metadata) <= {"name", "namespace", "labels", "annotations"}, metadata
    assert _DNS_LABEL_RE.match(metadata["name"]) and len(metadata["name"]) <= 63
    for key in ("labels", "annotations"):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.get(key, {}).items()), metadata


def test_vendored_crds_are_the_files_their_readme_names():
    readme = (CRD_DIR / "README.md").read_text(encoding="utf-8")
    for path in CRD_FILES.values():
        assert hashlib.sha256(path.read_bytes()).hexdigest() in readme, path.name
    assert (CRD_DIR / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")
    assert (CRD_DIR / "NOTICE").is_file()


def test_monitoring_is_off_by_default():
    chosen = values()
    assert chosen["serviceMonitor"]["enabled"] is False and chosen["prometheusRule"]["enabled"] is False


def test_service_monitors_and_prometheus_rule_validate_against_the_crds(render):
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    custom = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert sorted(d["kind"] for d in custom) == ["PrometheusRule"] + ["ServiceMonitor"] * (len(ROLES) + 1)  # recorder
    for doc in custom:
        check_custom_resource(doc)


def test_crd_validation_rejects_a_misspelt_field_and_a_wrong_type(render):
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    monitor = copy.deepcopy(of_kind(docs, "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["honourLabels"] = monitor["spec"]["endpoints"][0].pop("honorLabels")
    with pytest.raises(AssertionError, match="honourLabels"):
        check_custom_resource(monitor)
    (rule,) = copy.deepcopy(of_kind(docs, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(AssertionError, match="for"):
        check_custom_resource(rule)


@pytest.mark.parametrize("guard_mode", sorted(MONITORING))
def test_one_service_monitor_per_role_scrapes_exactly_that_roles_metrics_service(render, guard_mode):
    docs = render("acme", "metering", *MONITORING[guard_mode])
    chosen = values(*MONITORING[guard_mode])["serviceMonitor"]
    monitors = of_kind(docs, "ServiceMonitor")
    services = of_kind(docs, "Service")
    scraped = []
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == chosen["labels"]["release"]
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["metering"]}
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == chosen["interval"]
        role = service["metadata"]["labels"]["app.kubernetes.io/component"]
        # Every role's series keep their `service` label (not the Service's name), billing's per-pod series the
        # namespace/pod labels of the pods they bill.
        assert endpoint["honorLabels"] is True
        scraped.append(role)
    # Scaled out, the guard has a metrics Service, and so a ServiceMonitor, per role: nodes and budgets.
    recorder = ("recorder",) if values(*MONITORING[guard_mode])["recorder"]["enabled"] else ()
    assert sorted(scraped) == sorted(ROLES + recorder + (("guard",) if guard_mode == "scaled" else ()))
    guards = guard_deployments(docs)
    monitored = [s for s in services if any(m["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"]
                                            .items() for m in monitors)]
    for role, guard in guards.items():
        pods = guard["workload"]["spec"]["template"]["metadata"]["labels"]
        assert [s for s in monitored if s["spec"]["selector"].items() <= pods.items()], f"guard {role} unscraped"


def alert_rules(docs: list[dict]) -> list[dict]:
    (rule,) = of_kind(docs, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def exposed_series() -> dict[str, set[str]]:
    """Every series name gpumeter's registry exposes, with the labels it carries."""
    series = {}
    for name, definition in METRICS.items():
        names = [name]
        if definition.kind == "histogram":
            names = [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
        for exposed in names:
            series[exposed] = set(definition.labels) | ({"le"} if exposed.endswith("_bucket") else set())
    return series


# The alerts' PromQL is read by Prometheus' own parser (the ``promql`` fixture: a server of our build answering
# /api/v1/parse_query on loopback), hence the network marker.
@pytest.mark.network
def test_every_alert_reads_metrics_of_the_registry_with_their_labels(render, promql):
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    series = exposed_series()
    rules = alert_rules(docs)
    assert {r["alert"] for r in rules} >= {"GpumeterCollectorStalled", "GpumeterConsumerStalled",
                                           "GpumeterAttributionLagging", "GpumeterDeadLetterRate"}
    used = set()
    for rule in rules:
        tree = promql.parse(rule["expr"])
        assert all(s.metric for s in selectors(tree)), f"{rule['alert']}: a selector without a metric name"
        metrics = metric_names(tree)
        unknown = metrics - set(series) - PROMETHEUS_SERIES
        assert not unknown, f"{rule['alert']} reads metrics gpumeter does not export: {unknown}"
        known_labels = set().union(*(series.get(m, set()) for m in metrics)) | TARGET_LABELS
        labels = labels_read(tree)
        assert labels <= known_labels, f"{rule['alert']}: labels no series has: {labels - known_labels}"
        used |= metrics
    assert used - PROMETHEUS_SERIES, "the alerts read gpumeter's own metrics"


@pytest.mark.network
def test_a_misspelt_metric_or_label_in_an_alert_is_caught(render, promql):
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    expr = alert_rules(docs)[1]["expr"]
    assert "gpumeter_collector_ticks_total" in metric_names(promql.parse(expr))
    misspelt = promql.parse(expr.replace("gpumeter_collector_ticks_total", "gpumeter_collector_tick_total"))
    assert "gpumeter_collector_tick_total" in metric_names(misspelt) - set(exposed_series())
    # A matcher on a label the series lacks is read as such, not lost.
    wrong_label = promql.parse(expr.replace('namespace="metering"', 'namspace="metering"'))
    assert "namspace" in labels_read(wrong_label) - TARGET_LABELS - exposed_series()["gpumeter_collector_ticks_total"]


@cache
def roles_producing(metric: str) -> frozenset[str]:
    """The roles whose code sets ``metric``: its name is in the role's source, or in a shared gpumeter module the
    role imports (the dead-letter guard's counters). Prometheus' own ``up``: every role."""
    if metric in PROMETHEUS_SERIES:
        return frozenset(ROLES)
    base = re.sub(r"_(bucket|sum|count)$", "", metric) if metric not in METRICS else metric
    spelled = f'"{base}"'
    # Shared module -> its top-level classes and functions whose code sets the metric (importing the module's
    # other names, e.g. a pure helper beside the class that counts, sets nothing).
    shared: dict[str, set[str]] = {}
    for path in (REPO_ROOT / "gpumeter").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name == "metrics.py" or spelled not in text:
            continue
        names = {node.name for node in ast.parse(text).body
                 if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and spelled in (ast.get_source_segment(text, node) or "")}
        shared[".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)] = names
    roles = set()
    for role in ROLES:
        paths = ([REPO_ROOT / path for path in ROLE_SOURCES[role]] if role in ROLE_SOURCES else
                 [p for p in (REPO_ROOT / "services" / role).rglob("*.py")
                  if str(p.relative_to(REPO_ROOT)) not in {f for files in ROLE_SOURCES.values() for f in files}])
        source = "\n".join(p.read_text(encoding="utf-8") for p in paths)
        imported = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module in shared:
                imported |= {alias.name for alias in node.names} & shared[node.module]
            elif isinstance(node, ast.Import) and any(alias.name in shared for alias in node.names):
                imported.add(node.names[0].name)
        if spelled in source or imported:
            roles.add(role)
    return frozenset(roles)


@pytest.mark.network
@pytest.mark.parametrize("guard_mode", sorted(MONITORING))
def test_alerts_select_exactly_the_services_that_set_their_metrics(render, promql, guard_mode):
    docs = render("acme", "metering", *MONITORING[guard_mode])
    services = {s["metadata"]["name"]: s["metadata"]["labels"]["app.kubernetes.io/component"]
                for s in of_kind(docs, "Service")}
    chosen = values(*MONITORING[guard_mode])["prometheusRule"]
    guard_jobs = {"scaled": {"acme-gpumeter-guard-nodes", "acme-gpumeter-guard-budgets"},
                  "single": {"acme-gpumeter-guard"}}[guard_mode]
    assert guard_jobs == {name for name, role in services.items() if role == "guard"}
    for rule in alert_rules(docs):
        for metric, found in selectors(promql.parse(rule["expr"])):
            where = f"{rule['alert']}: {metric}"
            assert ("namespace", "=", "metering") in found, where
            jobs = [(op, value) for label, op, value in found if label == "job"]
            assert len(jobs) == 1, f"{where} reads series of any job"
            ((op, value),) = jobs
            assert op in ("=", "=~"), where
            # Prometheus anchors regular expressions at both ends.
            names = {name for name in services if (name == value if op == "=" else re.fullmatch(value, name))}
            selected = {services[name] for name in names}
            assert selected == roles_producing(metric), f"{where}: job {op}{value!r} selects {selected}"
            # Every guard role's job, when the alert reads the guard's series.
            assert "guard" not in selected or guard_jobs <= names, f"{where}: job {op}{value!r} misses a guard role"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["labels"]["team"] == chosen["alertLabels"]["team"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_roles_producing_reads_the_code():
    assert roles_producing("gpumeter_collector_ticks_total") == {"collector"}
    assert roles_producing("gpumeter_dead_letters_total") == {"attributor", "billing", "guard"}
    assert roles_producing("up") == set(ROLES)


def test_the_ledger_retention_cronjob_runs_the_values_retention_and_can_be_turned_off(render, helm):
    docs = render("gpumeter", "gpumeter", set_values=(
        "billing.retention.schedule=5 */2 * * *", "billing.retention.minuteLinesDays=30",
        "billing.retention.hourlyRollupsDays=120", "billing.retention.dailyRollupsDays=730",
        "billing.ledgerSecret.name=ledger-db"))
    (cronjob,) = of_kind(docs, "CronJob")
    assert cronjob["spec"]["schedule"] == "5 */2 * * *" and cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    (container,) = pod_spec(cronjob)["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    assert settings.days() == {"minute": 30, "hour": 120, "day": 730}
    assert env_item(container, "GPUMETER_LEDGER_URL")["valueFrom"]["secretKeyRef"] == {"name": "ledger-db",
                                                                                      "key": "url"}
    billing = next(w for w in workloads(docs) if role_of(pod_spec(w)["containers"][0]["args"]) == "billing")
    assert env_item(pod_spec(billing)["containers"][0], "GPUMETER_LEDGER_URL") == env_item(container,
                                                                                         "GPUMETER_LEDGER_URL")
    # Days that shrink with the grain fail the render, as `gpumeter ledger retention` would refuse them every hour.
    result = helm("template", "gpumeter", str(CHART), "--set", "billing.retention.minuteLinesDays=100")
    assert result.returncode != 0 and "must not shrink with the grain" in result.stderr, result.stderr
    off = render("gpumeter", "gpumeter", set_values=("billing.retention.enabled=false",))
    assert not of_kind(off, "CronJob")
    assert not [d for d in off if d["metadata"]["name"].endswith("ledger-retention")]


def test_the_recorder_is_one_replica_recording_onto_its_own_claim_when_enabled(render):
    assert not [d for d in render("gpumeter", "gpumeter") if "recorder" in d["metadata"]["name"]]  # off by default
    docs = render("acme", "metering", "ci/monitoring-values.yaml")
    chosen = values("ci/monitoring-values.yaml")["recorder"]
    (recorder,) = of_kind(docs, "StatefulSet")
    assert recorder["spec"]["replicas"] == 1  # it reads every partition itself: a second would record twice
    spec = pod_spec(recorder)
    (container,) = spec["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    assert (settings.compression, settings.rotation_seconds) == (chosen["compression"], chosen["rotationSeconds"])
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "recordings"]
    assert str(settings.out_dir) == mount["mountPath"] and not mount.get("readOnly")
    (claim,) = recorder["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "recordings"
    assert claim["spec"]["resources"]["requests"]["storage"] == chosen["storage"]["size"]
    assert claim["spec"]["storageClassName"] == chosen["storage"]["storageClassName"]
    assert spec["automountServiceAccountToken"] is False
    account = spec["serviceAccountName"]
    assert not [b for b in of_kind(docs, "RoleBinding", "ClusterRoleBinding")
                if any(subject["name"] == account for subject in b["subjects"])]
