"""deploy/kubernetes/: every manifest validates offline against the Kubernetes OpenAPI schemas (the
``kubernetes-validate`` package ships them), with least-privilege RBAC, the collector's host access, resources and
secrets checked, and every container's command line and environment put through the real gpumeter CLI and settings.

No cluster is needed. The files are checked as written (kustomize only adds labels and sets the image tag), so each
namespaced object carries the namespace itself and ``kubectl apply -k`` changes nothing the checks look at.
"""

from __future__ import annotations

import copy
import re
import tomllib
from dataclasses import fields
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml

from gpumeter.health import HEALTH_PATH
from gpumeter.settings import KafkaSettings
from services.billing.catalog import OVERRIDE_COLUMNS, PriceCatalog, parse_override_csv
from services.billing.settings import BillingSettings
from services.guard.config import GuardConfig
from services.guard.settings import GuardSettings
from tests.unit.deploy import NVIDIA_RUNTIME_VARIABLES, REPO_ROOT, role_of, settings_for, variables_read_by

MANIFEST_DIR = REPO_ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = MANIFEST_DIR / "kustomization.yaml"
# The oldest Kubernetes minor the manifests are kept valid for, and the newest the installed schemas know.
KUBERNETES_VERSIONS = ("1.33", kubernetes_validate.latest_version())
WORKLOAD_KINDS = ("DaemonSet", "Deployment", "Job")
READ_ONLY_VERBS = {"get", "list", "watch"}

# Environment variables whose values are secrets: they may only come from a Secret (secretKeyRef). Checked below
# against the settings fields that are kept out of repr, so a new secret setting fails here until it is listed.
SECRET_VARIABLES = {
    "GPUMETER_KAFKA_SASL_PASSWORD": (KafkaSettings, "sasl_password"),
    "GPUMETER_LEDGER_URL": (BillingSettings, "ledger_url"),
    "GPUMETER_GUARD_ALERTMANAGER_URL": (GuardSettings, "alertmanager_url"),
}
# What a Secret would hold, for building settings offline (never a real value).
SECRET_STAND_INS = {
    "GPUMETER_KAFKA_SASL_PASSWORD": "stand-in",
    "GPUMETER_LEDGER_URL": "postgresql+psycopg://gpumeter:stand-in@ledger.invalid:5432/gpumeter",
    "GPUMETER_GUARD_ALERTMANAGER_URL": "http://alertmanager.invalid:9093",
}
NODE_NAME_STAND_IN = "gpu-node-1"


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


def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [d for d in docs if d["kind"] in kinds]


def named(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def workloads(docs: list[dict]) -> list[dict]:
    return of_kind(docs, *WORKLOAD_KINDS)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def is_collector(workload: dict) -> bool:
    return role_of(pod_spec(workload)["containers"][0]["args"]) == "collector"


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env; secret values and
    downward-API fields replaced by stand-ins."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"envFrom may name ConfigMaps only: {source}"
        env.update(named(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = item["value"]
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            assert name in SECRET_STAND_INS, f"{name} comes from a Secret but has no stand-in value here"
            env[name] = SECRET_STAND_INS[name]
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "spec.nodeName", f"unexpected downward-API field for {name}"
            env[name] = NODE_NAME_STAND_IN
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[name] = named(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            pytest.fail(f"{name}: unsupported valueFrom {source}")
    return env


def env_item(container: dict, name: str) -> dict:
    items = [item for item in container.get("env", []) if item["name"] == name]
    assert len(items) == 1, f"{container['name']}: {name} set {len(items)} times"
    return items[0]


def mounted_file(spec: dict, container: dict, path: str, docs: list[dict]) -> str:
    """The text of the ConfigMap key mounted at ``path`` in ``container``."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        volume = volumes[mount["name"]]
        if path.startswith(prefix) and "configMap" in volume:
            key = path[len(prefix):]
            for item in volume["configMap"].get("items", []):
                if item["path"] == key:
                    key = item["key"]
            data = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
            assert key in data, f"{path}: ConfigMap {volume['configMap']['name']} has no key {key!r}"
            return data[key]
    raise AssertionError(f"{container['name']}: nothing from a ConfigMap is mounted at {path}")


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from strings_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)


_QUANTITY_RE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)(?P<suffix>m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SUFFIX = {None: Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
           "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20,
           "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40}


def quantity(text: Any) -> Decimal:
    match = _QUANTITY_RE.match(str(text))
    assert match, f"not a resource quantity this test reads: {text!r}"
    return Decimal(match.group("number")) * _SUFFIX[match.group("suffix")]


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
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against {version}: {path}: {exc.message}")


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


def test_the_only_role_is_the_collectors_read_only_access_to_pods(docs):
    roles = of_kind(docs, "Role", "ClusterRole")
    assert len(roles) == 1, f"only the collector has a role, got {[r['metadata']['name'] for r in roles]}"
    role = roles[0]
    assert role["kind"] == "ClusterRole", "pods of every namespace run on a node: the grant is cluster-wide"
    assert "aggregationRule" not in role
    for rule in role["rules"]:
        assert rule.get("apiGroups") == [""] and rule.get("resources") == ["pods"], rule
        assert set(rule["verbs"]) <= READ_ONLY_VERBS, rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
    assert {verb for rule in role["rules"] for verb in rule["verbs"]} == READ_ONLY_VERBS

    (daemonset,) = [w for w in workloads(docs) if is_collector(w)]
    bindings = of_kind(docs, "RoleBinding", "ClusterRoleBinding")
    assert len(bindings) == 1
    binding = bindings[0]
    assert binding["kind"] == "ClusterRoleBinding"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod_spec(daemonset)["serviceAccountName"],
                                    "namespace": daemonset["metadata"]["namespace"]}]


def test_no_wildcards_anywhere_in_rbac(docs):
    for role in of_kind(docs, "Role", "ClusterRole"):
        for rule in role.get("rules", []):
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert not any("*" in item for item in rule.get(key, [])), f"{role['metadata']['name']}: {rule}"
    for binding in of_kind(docs, "RoleBinding", "ClusterRoleBinding"):
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in of_kind(docs, "Role", "ClusterRole")}, (
            "bindings refer only to roles defined here, never to built-in ones such as cluster-admin or view")
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and "*" not in subject["name"]


def test_each_workload_has_its_own_service_account_and_only_the_collector_gets_a_token(docs):
    accounts = {a["metadata"]["name"]: a for a in of_kind(docs, "ServiceAccount")}
    bound = {s["name"] for b in of_kind(docs, "RoleBinding", "ClusterRoleBinding") for s in b["subjects"]}
    used = []
    for workload in workloads(docs):
        spec = pod_spec(workload)
        name = spec.get("serviceAccountName")
        assert name and name != "default" and name in accounts, f"{workload['metadata']['name']}: account {name!r}"
        used.append(name)
        if is_collector(workload):
            assert name in bound
            assert spec.get("automountServiceAccountToken", True) is True
            assert accounts[name].get("automountServiceAccountToken", True) is True
        else:
            assert name not in bound, f"{name} has Kubernetes API access it does not need"
            assert spec.get("automountServiceAccountToken") is False, workload["metadata"]["name"]
            assert accounts[name].get("automountServiceAccountToken") is False, name
    assert len(used) == len(set(used)), f"service accounts shared between workloads: {used}"
    assert set(used) == set(accounts), f"unused service accounts: {set(accounts) - set(used)}"


# ----------------------------------------------------------------------------------------------------------------
# The collector DaemonSet's host access


def test_collector_daemonset_reads_the_host_read_only_through_hostpid_and_two_paths(docs):
    daemonsets = of_kind(docs, "DaemonSet")
    assert len(daemonsets) == 1 and is_collector(daemonsets[0])
    spec = pod_spec(daemonsets[0])
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]

    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert sorted(host_paths.values()) == ["/proc", "/var/lib/kubelet/pod-resources"]
    (container,) = spec["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    mount_of = {}
    for volume, host_path in host_paths.items():
        assert mounts[volume].get("readOnly") is True, f"{host_path} must be mounted read-only"
        mount_of[host_path] = mounts[volume]["mountPath"]

    node_name = env_item(container, "GPUMETER_NODE_NAME")
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    settings = settings_for(container["args"], container_env(container, docs))
    assert settings.node_name == NODE_NAME_STAND_IN
    assert str(settings.proc_root) == mount_of["/proc"]
    assert settings.kubelet_socket.parent == Path(mount_of["/var/lib/kubelet/pod-resources"])
    assert settings.kube_api == "in-cluster" and settings.simulate is None

    security = container["securityContext"]
    assert security.get("privileged") is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True


def test_collector_node_pool_is_priced_by_the_bundled_catalog(docs):
    (daemonset,) = of_kind(docs, "DaemonSet")
    (container,) = pod_spec(daemonset)["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    quote = PriceCatalog.load().quote(provider=settings.cloud_provider, region=settings.region,
                                      instance_type=settings.instance_type, price_model=settings.price_model)
    assert quote.node_price_per_hour_usd is not None and quote.node_price_per_hour_usd > 0, quote
    assert quote.spec.gpu_count, "the instance type's GPU count is known, so the node price can be split"


# ----------------------------------------------------------------------------------------------------------------
# Pod security, resources, secrets


def test_pods_other_than_the_collector_meet_the_restricted_pod_security_standard(docs):
    others = [w for w in workloads(docs) if not is_collector(w)]
    assert {w["kind"] for w in others} == {"Deployment", "Job"}
    for workload in others:
        spec = pod_spec(workload)
        pod_security = spec.get("securityContext", {})
        assert not any(spec.get(k) for k in ("hostPID", "hostNetwork", "hostIPC")), workload["metadata"]["name"]
        assert all("hostPath" not in v for v in spec.get("volumes", [])), workload["metadata"]["name"]
        for container in containers(spec):
            security = {**pod_security, **container.get("securityContext", {})}
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert security.get("runAsNonRoot") is True and security.get("runAsUser", 1) != 0, where
            assert security.get("allowPrivilegeEscalation") is False, where
            assert "ALL" in security.get("capabilities", {}).get("drop", []), where
            assert not security.get("capabilities", {}).get("add"), where
            assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
            assert security.get("readOnlyRootFilesystem") is True, where
            assert not security.get("privileged"), where


def test_every_container_requests_and_limits_cpu_and_memory(docs):
    for workload in workloads(docs):
        for container in containers(pod_spec(workload)):
            resources = container["resources"]
            for resource in ("cpu", "memory"):
                request, limit = resources["requests"][resource], resources["limits"][resource]
                assert 0 < quantity(request) <= quantity(limit), f"{container['name']} {resource}: {request}/{limit}"


def test_secret_settings_are_the_ones_kept_out_of_repr():
    hidden = {(cls, f.name) for cls in (KafkaSettings, BillingSettings, GuardSettings) for f in fields(cls)
              if not f.repr}
    assert hidden == set(SECRET_VARIABLES.values())


def test_no_secret_values_inline(docs):
    assert not of_kind(docs, "Secret"), "Secrets are created by the operator, never shipped with values"
    for doc in docs:
        for text in strings_in(doc):
            assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", text), f"credentials in a URL in {doc['metadata']['name']}"
    for config_map in of_kind(docs, "ConfigMap"):
        for key in config_map["data"]:
            assert key not in SECRET_VARIABLES and not re.search(r"PASSWORD|SECRET|TOKEN", key, re.I), key
    referenced = set()
    for workload in workloads(docs):
        for container in containers(pod_spec(workload)):
            for item in container.get("env", []):
                secret_ref = item.get("valueFrom", {}).get("secretKeyRef")
                if item["name"] in SECRET_VARIABLES:
                    assert secret_ref, f"{container['name']}: {item['name']} must come from a Secret"
                if secret_ref:
                    referenced.add(secret_ref["name"])
    comments = "\n".join(p.read_text(encoding="utf-8") for p in MANIFEST_DIR.glob("*.yaml"))
    for name in referenced:
        assert f"kubectl -n gpumeter create secret generic {name} " in comments, f"how to create Secret {name}?"


# ----------------------------------------------------------------------------------------------------------------
# Commands, settings, metrics Services


def test_every_container_runs_a_gpumeter_command_with_settings_from_its_environment(docs):
    roles = []
    for workload in workloads(docs):
        for container in containers(pod_spec(workload)):
            role = role_of(container["args"])
            roles.append(role)
            env = container_env(container, docs)
            allowed = variables_read_by(role) | (NVIDIA_RUNTIME_VARIABLES if role == "collector" else set())
            unknown = set(env) - allowed
            assert not unknown, f"{container['name']} ({role}) gets variables no gpumeter code reads: {unknown}"
            settings_for(container["args"], env)
    assert sorted(roles) == ["attributor", "billing", "collector", "guard", "topics"]


def test_metrics_services_select_each_workload_and_carry_prometheus_annotations(docs):
    services = of_kind(docs, "Service")
    for workload in workloads(docs):
        spec = pod_spec(workload)
        (container,) = spec["containers"]
        if role_of(container["args"]) == "topics":
            continue
        (port,) = [p for p in container["ports"] if p["name"] == "metrics"]
        settings = settings_for(container["args"], container_env(container, docs))
        assert settings.metrics_port == port["containerPort"], container["name"]
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, (container["name"], probe)
        # Liveness asks whether the service's loop goes round (gpumeter.health), not only whether HTTP answers.
        assert container["livenessProbe"]["httpGet"] == {"path": HEALTH_PATH, "port": "metrics"}, container["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        matching = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert len(matching) == 1, f"{workload['metadata']['name']}: {len(matching)} Services select it"
        service = matching[0]
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]
        assert service["spec"]["ports"][0]["port"] == port["containerPort"]
        annotations = service["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port["containerPort"]),
                               "prometheus.io/path": "/metrics"}
    ports = sorted(s["spec"]["ports"][0]["port"] for s in services)
    assert len(ports) == len(set(ports)) == 4


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

    example = tmp_path / "example.yaml"
    example.write_text(commented_block(MANIFEST_DIR / "guard.yaml", "budgets:"), encoding="utf-8")
    documented = GuardConfig.load(example, {})
    assert set(documented.namespace_budgets) == {"ml", "*"} and set(documented.team_budgets) == {"research"}


def test_state_is_written_only_to_mounted_volumes(docs):
    """Every path a service writes (guard state, temporary files) is on a volume: root filesystems are read-only."""
    for workload in workloads(docs):
        spec = pod_spec(workload)
        for container in containers(spec):
            mounts = [m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")]
            assert "/tmp" in mounts, f"{container['name']}: /tmp must be a writable volume"
            settings = settings_for(container["args"], container_env(container, docs))
            state_path = getattr(settings, "state_path", None)
            if state_path is not None:
                assert any(str(state_path).startswith(m.rstrip("/") + "/") for m in mounts), state_path


def test_topics_job_cleans_up_after_itself_so_it_reruns_on_apply(docs):
    (job,) = of_kind(docs, "Job")
    assert role_of(pod_spec(job)["containers"][0]["args"]) == "topics"
    assert pod_spec(job)["containers"][0]["args"] == ["topics", "create"]
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")
