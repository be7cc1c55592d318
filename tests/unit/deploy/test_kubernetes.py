"""deploy/kubernetes/: every manifest validates offline against the Kubernetes OpenAPI schemas (the
``kubernetes-validate`` package ships them), with least-privilege RBAC, the collector's host access, resources and
secrets checked, and every container's command line and environment put through the real gpumeter CLI and settings.

No cluster is needed. The files are checked as written (kustomize only adds labels and sets the image tag), so each
namespaced object carries the namespace itself and ``kubectl apply -k`` changes nothing the checks look at.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.billing.catalog import OVERRIDE_COLUMNS, parse_override_csv
from services.guard.config import GuardConfig
from tests.unit.deploy import REPO_ROOT, role_of, settings_for
from tests.unit.deploy.manifests import (
    KUBERNETES_VERSIONS,
    SECRET_VARIABLES,
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
    guard_deployments,
    mounted_file,
    named,
    of_kind,
    pod_spec,
    secret_settings_kept_out_of_repr,
    workloads,
)

MANIFEST_DIR = REPO_ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = MANIFEST_DIR / "kustomization.yaml"
GUARD_SCALED = MANIFEST_DIR / "guard-scaled"


# ----------------------------------------------------------------------------------------------------------------
# Loading and small helpers


def kustomization() -> dict:
    return yaml.safe_load(KUSTOMIZATION.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    loaded = []
    for name in kustomization()["resources"]:
        text = (MANIFEST_DIR / name).read_text(encoding="utf-8")
        loaded.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return loaded


def commented_block(path: Path, first_line: str) -> str:
    """The example in a manifest's comments that starts at the line ``#<spaces><first_line>``, uncommented: it
    runs while the following comment lines are indented at least as deep."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#") and line[1:].strip() == first_line)
    indent = lines[start].index(first_line)
    block = []
    for line in lines[start:]:
        if not line.startswith("#") or line[1:indent].strip() or not line[indent:].strip():
            break
        block.append(line[indent:])
    return "\n".join(block) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Schema validation


def test_kustomization_lists_every_manifest_file():
    listed = kustomization()["resources"]
    present = sorted(p.name for p in MANIFEST_DIR.glob("*.yaml") if p.name != KUSTOMIZATION.name)
    assert sorted(listed) == present
    assert len(set(listed)) == len(listed)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(docs, version):
    check_kubernetes_schemas(docs, version)


def test_strict_validation_rejects_a_misspelt_field(docs):
    daemonset = copy.deepcopy(of_kind(docs, "DaemonSet")[0])
    pod_spec(daemonset)["hostPid"] = pod_spec(daemonset).pop("hostPID")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)


def test_namespace_image_and_version_match_the_kustomization(docs):
    config = kustomization()
    namespace = config["namespace"]
    assert named(docs, "Namespace", namespace)
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"
    for binding in of_kind(docs, "ClusterRoleBinding", "RoleBinding"):
        assert all(s.get("namespace") == namespace for s in binding["subjects"] if s["kind"] == "ServiceAccount")
    (image,) = config["images"]
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert image["newTag"] == version
    for workload in workloads(docs):
        for container in containers(pod_spec(workload)):
            assert container["image"] == image["name"], f"{container['name']} runs {container['image']}"


# ----------------------------------------------------------------------------------------------------------------
# RBAC and service accounts


def test_the_only_role_is_the_collectors_read_only_access_to_pods_and_its_node(docs):
    check_least_privilege_rbac(docs)


def test_no_wildcards_anywhere_in_rbac(docs):
    check_no_rbac_wildcards(docs)


def test_each_workload_has_its_own_service_account_and_only_the_collector_gets_a_token(docs):
    check_service_accounts(docs)
    names = [pod_spec(w)["serviceAccountName"] for w in workloads(docs)]
    assert len(names) == len(set(names)), f"service accounts shared between workloads: {names}"


# ----------------------------------------------------------------------------------------------------------------
# The collector DaemonSet's host access


def test_collector_daemonset_reads_the_host_read_only_through_hostpid_and_two_paths(docs):
    daemonsets = of_kind(docs, "DaemonSet")
    assert len(daemonsets) == 1
    check_collector_host_access(docs)
    spec = pod_spec(daemonsets[0])
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    check_workload_selectors_are_disjoint(docs)


def test_the_collector_takes_its_price_facts_from_its_nodes_by_default(docs, tmp_path):
    # No override in the shipped ConfigMap: every fact comes from each node's own Node object.
    assert check_collector_pools_are_priced(docs, tmp_path) == 0
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpumeter-collector"]
    assert not {"GPUMETER_CLOUD_PROVIDER", "GPUMETER_REGION", "GPUMETER_INSTANCE_TYPE",
                "GPUMETER_PRICE_MODEL"} & set(configmap["data"])


# ----------------------------------------------------------------------------------------------------------------
# Pod security, resources, secrets


def test_pods_other_than_the_collector_meet_the_restricted_pod_security_standard(docs):
    check_restricted_pods(docs)


def test_every_container_requests_and_limits_cpu_and_memory(docs):
    check_resources(docs)


def test_secret_settings_are_the_ones_kept_out_of_repr():
    assert secret_settings_kept_out_of_repr() == set(SECRET_VARIABLES.values())


def test_no_secret_values_inline(docs):
    referenced = check_secrets_by_reference(docs)
    assert referenced == {"gpumeter-kafka", "gpumeter-ledger", "gpumeter-guard"}
    comments = "\n".join(p.read_text(encoding="utf-8") for p in MANIFEST_DIR.glob("*.yaml"))
    for name in referenced:
        assert f"kubectl -n gpumeter create secret generic {name} " in comments, f"how to create Secret {name}?"


# ----------------------------------------------------------------------------------------------------------------
# Commands, settings, metrics Services


def test_every_container_runs_a_gpumeter_command_with_settings_from_its_environment(docs):
    assert check_commands_and_settings(docs) == ["api", "attributor", "billing", "collector", "guard", "ledger",
                                                 "topics"]


def test_metrics_services_select_each_workload_and_carry_prometheus_annotations(docs):
    check_metrics_services(docs)


def test_price_override_configmap_and_its_documented_examples_parse(docs):
    (billing,) = [w for w in workloads(docs) if role_of(pod_spec(w)["containers"][0]["args"]) == "billing"]
    spec = pod_spec(billing)
    (container,) = spec["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    text = mounted_file(spec, container, str(settings.price_override_csv), docs)
    header = text.splitlines()[0]
    assert set(header.split(",")) == set(OVERRIDE_COLUMNS)
    assert parse_override_csv(text, "gpumeter-prices") == ()
    examples = [line[len("#   "):] for line in (MANIFEST_DIR / "billing.yaml").read_text().splitlines()
                if re.match(r"^#   (node|gpu),", line)]
    rows = parse_override_csv("\n".join([header, *examples]) + "\n", "billing.yaml comment")
    assert [row.asset_class for row in rows] == ["node", "gpu"]


def test_guard_config_configmap_loads_and_agrees_with_billing_and_the_collector(docs, tmp_path):
    by_role = {role_of(pod_spec(w)["containers"][0]["args"]): w for w in workloads(docs)}
    spec = pod_spec(by_role["guard"])
    (container,) = spec["containers"]
    env = container_env(container, docs)
    settings = settings_for(container["args"], env)
    config_file = tmp_path / "guard.yaml"
    config_file.write_text(mounted_file(spec, container, str(settings.config_path), docs), encoding="utf-8")
    config = GuardConfig.load(config_file, env)

    (billing,) = pod_spec(by_role["billing"])["containers"]
    billing_settings = settings_for(billing["args"], container_env(billing, docs))
    assert config.team_label_key == billing_settings.team_label

    collector_labels = by_role["collector"]["spec"]["template"]["metadata"]["labels"]
    assert collector_labels.get(config.exempt_label) == "true", "the collector sees every GPU by design"
    assert by_role["collector"]["metadata"]["namespace"] in config.exempt_label_namespaces, \
        "the label exempts only in the namespaces the config lists"

    example = tmp_path / "example.yaml"
    example.write_text(commented_block(MANIFEST_DIR / "guard.yaml", "budgets:"), encoding="utf-8")
    documented = GuardConfig.load(example, {})
    assert set(documented.namespace_budgets) == {"ml", "*"} and set(documented.team_budgets) == {"research"}


def test_state_is_written_only_to_mounted_volumes(docs):
    """Every path a service writes (guard state, temporary files) is on a volume: root filesystems are read-only."""
    check_state_on_volumes(docs)


def test_topics_job_cleans_up_after_itself_so_it_reruns_on_apply(docs):
    (job,) = of_kind(docs, "Job")
    assert role_of(pod_spec(job)["containers"][0]["args"]) == "topics"
    assert pod_spec(job)["containers"][0]["args"] == ["topics", "create"]
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


# ----------------------------------------------------------------------------------------------------------------
# The guard: one of role all as shipped, or scaled out with the component guard-scaled


def test_the_shipped_guard_is_one_replica_of_role_all(docs):
    assert check_guard_roles(docs) == "single"
    check_guard_pods_are_served(docs)


@pytest.fixture(scope="module")
def scaled_docs(go_tools, tmp_path_factory) -> list[dict]:
    """What `kubectl apply -k` applies once the component guard-scaled is added to the kustomization, as its
    comments say (the real kustomize)."""
    copied = shutil.copytree(MANIFEST_DIR, tmp_path_factory.mktemp("kustomize") / "kubernetes")
    with (copied / "kustomization.yaml").open("a", encoding="utf-8") as file:
        file.write("components:\n  - guard-scaled\n")
    result = subprocess.run([str(go_tools["kustomize"]), "build", str(copied)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_the_guard_scaled_component_is_a_kustomize_component_of_its_own_files():
    component = yaml.safe_load((GUARD_SCALED / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["kind"] == "Component"
    assert sorted(component["resources"]) == sorted(
        p.name for p in GUARD_SCALED.glob("*.yaml") if p.name != "kustomization.yaml")
    # The way its comments say to use it is the way scaled_docs builds it.
    assert "#   components:\n#     - guard-scaled\n" in (GUARD_SCALED / "kustomization.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_scaled_guard_validates_against_the_kubernetes_schemas(scaled_docs, version):
    check_kubernetes_schemas(scaled_docs, version)


def test_the_scaled_guard_runs_nodes_replicas_beside_one_budgets_guard(scaled_docs):
    assert check_guard_roles(scaled_docs) == "scaled"
    check_guard_pods_are_served(scaled_docs)
    guards = guard_deployments(scaled_docs)
    assert {role: g["workload"]["metadata"]["name"] for role, g in guards.items()} == {
        "nodes": "gpumeter-guard-nodes", "budgets": "gpumeter-guard-budgets"}
    assert guards["nodes"]["replicas"] >= 2
    assert not [d for d in scaled_docs if d["metadata"]["name"] == "gpumeter-guard" and d["kind"] in
                ("Deployment", "Service")], "the single guard is replaced, not run beside"
    # Both roles raise violations: both post them to Alertmanager, with the one guard config.
    for guard in guards.values():
        spec = pod_spec(guard["workload"])
        (container,) = spec["containers"]
        assert guard["settings"].alertmanager_url and str(guard["settings"].config_path) == (
            "/etc/gpumeter/guard/guard.yaml")
        assert {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v} == {"gpumeter-guard"}


def test_the_scaled_guard_keeps_every_property_of_the_manifests(scaled_docs, tmp_path):
    check_least_privilege_rbac(scaled_docs)
    check_no_rbac_wildcards(scaled_docs)
    check_service_accounts(scaled_docs)
    check_workload_selectors_are_disjoint(scaled_docs)
    check_restricted_pods(scaled_docs)
    check_resources(scaled_docs)
    check_state_on_volumes(scaled_docs)
    check_metrics_services(scaled_docs)
    assert check_secrets_by_reference(scaled_docs) == {"gpumeter-kafka", "gpumeter-ledger", "gpumeter-guard"}
    assert check_commands_and_settings(scaled_docs) == [
        "api", "attributor", "billing", "collector", "guard", "guard", "ledger", "topics"]
