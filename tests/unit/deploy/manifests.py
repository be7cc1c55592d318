"""Checks shared by the kustomization's tests (test_kubernetes.py) and the Helm chart's (test_helm.py): both give a
list of Kubernetes objects, and both must hold the same properties — valid against the Kubernetes schemas,
least-privilege RBAC, the collector's host access and security context, restricted pods elsewhere, resources,
secrets only by reference, and every container's command line and environment accepted by the real gpumeter CLI
and settings.

Each ``check_*`` function raises AssertionError (pytest rewrites the asserts here, see ``__init__.py``).
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate

from gpumeter.health import HEALTH_PATH
from gpumeter.settings import KafkaSettings
from services.billing.settings import BillingSettings
from services.guard.settings import GuardSettings
from tests.unit.deploy import NVIDIA_RUNTIME_VARIABLES, role_of, settings_for, variables_read_by

# The oldest Kubernetes minor the manifests are kept valid for, and the newest the installed schemas know.
KUBERNETES_VERSIONS = ("1.33", kubernetes_validate.latest_version())
WORKLOAD_KINDS = ("DaemonSet", "Deployment", "StatefulSet", "Job", "CronJob")
# Workloads whose pods run to completion: no metrics port, no Service, no selector of their own.
RUN_TO_COMPLETION_KINDS = ("Job", "CronJob")
READ_ONLY_VERBS = {"get", "list", "watch"}
# The collector's grant, rule by rule: (API group, resources) -> verbs. Pods of its node: the pod events. Its own
# Node object (get only): region, zone, instance type, capacity type, providerID. DRA: its node's ResourceSlices
# (list) and the ResourceClaims its pods hold (get).
COLLECTOR_RULES = {("", "pods"): READ_ONLY_VERBS, ("", "nodes"): {"get"}, ("", "namespaces"): READ_ONLY_VERBS,
                   ("resource.k8s.io", "resourceslices"): {"list"}, ("resource.k8s.io", "resourceclaims"): {"get"}}

# Environment variables whose values are secrets: they may only come from a Secret (secretKeyRef). Checked against
# the settings fields that are kept out of repr, so a new secret setting fails until it is listed.
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
# Finding things


def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [d for d in docs if d["kind"] in kinds]


def named(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def workloads(docs: list[dict]) -> list[dict]:
    return of_kind(docs, *WORKLOAD_KINDS)


def pod_template(workload: dict) -> dict:
    if workload["kind"] == "CronJob":
        return workload["spec"]["jobTemplate"]["spec"]["template"]
    return workload["spec"]["template"]


def pod_spec(workload: dict) -> dict:
    return pod_template(workload)["spec"]


def containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def is_collector(workload: dict) -> bool:
    return role_of(pod_spec(workload)["containers"][0]["args"]) == "collector"


def by_role(docs: list[dict], role: str) -> list[dict]:
    return [w for w in workloads(docs) if role_of(pod_spec(w)["containers"][0]["args"]) == role]


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
            raise AssertionError(f"{name}: unsupported valueFrom {source}")
    return env


def env_item(container: dict, name: str) -> dict:
    items = [item for item in container.get("env", []) if item["name"] == name]
    assert len(items) == 1, f"{container['name']}: {name} set {len(items)} times"
    return items[0]


def _mount_at(spec: dict, container: dict, path: str) -> tuple[dict, str]:
    """The volume mounted over ``path`` in ``container`` and the path inside it."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            return volumes[mount["name"]], path[len(prefix):]
    raise AssertionError(f"{container['name']}: no volume is mounted over {path}")


def _key_for(source: dict, relative: str) -> str:
    """The key of a ConfigMap or Secret volume projected at ``relative``: with ``items``, only those paths exist."""
    if "items" not in source:
        return relative
    keys = [item["key"] for item in source["items"] if item["path"] == relative]
    assert keys, f"the volume projects no file at {relative!r}: {source['items']}"
    return keys[0]


def mounted_file(spec: dict, container: dict, path: str, docs: list[dict]) -> str:
    """The text of the ConfigMap key mounted at ``path`` in ``container``."""
    volume, relative = _mount_at(spec, container, path)
    assert "configMap" in volume, f"{container['name']}: {path} is not from a ConfigMap"
    key = _key_for(volume["configMap"], relative)
    data = named(docs, "ConfigMap", volume["configMap"]["name"])["data"]
    assert key in data, f"{path}: ConfigMap {volume['configMap']['name']} has no key {key!r}"
    return data[key]


def mounted_secret_key(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the Secret file mounted at ``path`` in ``container``."""
    volume, relative = _mount_at(spec, container, path)
    assert "secret" in volume, f"{container['name']}: {path} is not from a Secret"
    return volume["secret"]["secretName"], _key_for(volume["secret"], relative)


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


# ----------------------------------------------------------------------------------------------------------------
# Checks


def check_kubernetes_schemas(docs: list[dict], version: str) -> None:
    """Every object of a built-in kind validates, strictly (no unknown field), against ``version``'s schemas."""
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} against {version}: {path}: "
                                 f"{exc.message}") from None


def check_least_privilege_rbac(docs: list[dict]) -> None:
    """One role: the collector's ClusterRole, read-only on pods and namespaces, `get` on nodes and, for DRA, `list` on
    resourceslices and `get` on resourceclaims, bound to the collectors' service account only; no wildcards, no
    built-in roles."""
    roles = of_kind(docs, "Role", "ClusterRole")
    assert len(roles) == 1, f"only the collector has a role, got {[r['metadata']['name'] for r in roles]}"
    role = roles[0]
    assert role["kind"] == "ClusterRole", "pods of every namespace run on a node, nodes are cluster-scoped"
    assert "aggregationRule" not in role
    granted: dict[tuple[str, ...], set[str]] = {}
    for rule in role["rules"]:
        assert len(rule.get("apiGroups", [])) == 1, rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        resources = (rule["apiGroups"][0], *rule["resources"])
        assert resources not in granted, f"{resources} granted twice"
        granted[resources] = set(rule["verbs"])
    assert granted == COLLECTOR_RULES, granted

    collectors = [w for w in workloads(docs) if is_collector(w)]
    accounts = {pod_spec(w)["serviceAccountName"] for w in collectors}
    namespaces = {w["metadata"]["namespace"] for w in collectors}
    assert len(accounts) == 1 and len(namespaces) == 1, "every collector DaemonSet runs as one service account"
    bindings = of_kind(docs, "RoleBinding", "ClusterRoleBinding")
    assert len(bindings) == 1
    binding = bindings[0]
    assert binding["kind"] == "ClusterRoleBinding"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": accounts.pop(), "namespace": namespaces.pop()}]


def check_no_rbac_wildcards(docs: list[dict]) -> None:
    for role in of_kind(docs, "Role", "ClusterRole"):
        for rule in role.get("rules", []):
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert not any("*" in item for item in rule.get(key, [])), f"{role['metadata']['name']}: {rule}"
    for binding in of_kind(docs, "RoleBinding", "ClusterRoleBinding"):
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in of_kind(docs, "Role", "ClusterRole")}, (
            "bindings refer only to roles defined here, never to built-in ones such as cluster-admin or view")
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and "*" not in subject["name"]


def check_service_accounts(docs: list[dict]) -> None:
    """A service account per role (the collector DaemonSets of several node pools share theirs); only the
    collector's is bound and gets a token."""
    accounts = {a["metadata"]["name"]: a for a in of_kind(docs, "ServiceAccount")}
    bound = {s["name"] for b in of_kind(docs, "RoleBinding", "ClusterRoleBinding") for s in b["subjects"]}
    used: dict[str, set[str]] = {}
    for workload in workloads(docs):
        spec = pod_spec(workload)
        name = spec.get("serviceAccountName")
        assert name and name != "default" and name in accounts, f"{workload['metadata']['name']}: account {name!r}"
        used.setdefault(name, set()).add(role_of(spec["containers"][0]["args"]))
        if is_collector(workload):
            assert name in bound
            assert spec.get("automountServiceAccountToken", True) is True
            assert accounts[name].get("automountServiceAccountToken", True) is True
        else:
            assert name not in bound, f"{name} has Kubernetes API access it does not need"
            assert spec.get("automountServiceAccountToken") is False, workload["metadata"]["name"]
            assert accounts[name].get("automountServiceAccountToken") is False, name
    assert all(len(roles) == 1 for roles in used.values()), f"service accounts shared between roles: {used}"
    assert set(used) == set(accounts), f"unused service accounts: {set(accounts) - set(used)}"


def check_collector_host_access(docs: list[dict]) -> None:
    """Every collector DaemonSet: hostPID, the host's /proc and the kubelet's pod-resources folder read-only, the
    NVIDIA runtime, the node name from the downward API, and a container that is root only for the socket."""
    daemonsets = of_kind(docs, "DaemonSet")
    assert daemonsets and all(is_collector(d) for d in daemonsets)
    for daemonset in daemonsets:
        where = daemonset["metadata"]["name"]
        spec = pod_spec(daemonset)
        assert spec["hostPID"] is True, where
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), where
        assert spec["runtimeClassName"] == "nvidia", where
        assert spec["nodeSelector"], f"{where}: a collector DaemonSet runs on the nodes of its pool only"
        assert spec.get("securityContext", {}).get("seccompProfile", {}).get("type") == "RuntimeDefault", where

        host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert sorted(host_paths.values()) == ["/proc", "/var/lib/kubelet/pod-resources"], where
        (container,) = spec["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        mount_of = {}
        for volume, host_path in host_paths.items():
            assert mounts[volume].get("readOnly") is True, f"{where}: {host_path} must be mounted read-only"
            mount_of[host_path] = mounts[volume]["mountPath"]

        node_name = env_item(container, "GPUMETER_NODE_NAME")
        assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        settings = settings_for(container["args"], container_env(container, docs))
        assert settings.node_name == NODE_NAME_STAND_IN
        assert str(settings.proc_root) == mount_of["/proc"]
        assert settings.kubelet_socket.parent == Path(mount_of["/var/lib/kubelet/pod-resources"])
        assert settings.kube_api == "in-cluster" and settings.simulate is None

        security = container["securityContext"]
        assert security.get("privileged") is False and security["allowPrivilegeEscalation"] is False, where
        assert security["capabilities"] == {"drop": ["ALL"]}, where
        assert security["readOnlyRootFilesystem"] is True, where
        assert not spec.get("securityContext", {}).get("capabilities"), where


def check_collector_pools_are_priced(docs: list[dict], scratch: Path) -> int:
    """Each collector DaemonSet that overrides its nodes' price facts names a node that billing prices — with the
    catalog billing loads: the bundled price files plus the override CSV mounted into its pod — and whose GPU
    count is known. A pool that overrides nothing takes every fact from its nodes' own Node objects (the collector
    reads them; tests/unit/collector/test_nodefacts.py). Returns how many pools were checked."""
    (billing,) = by_role(docs, "billing")
    spec = pod_spec(billing)
    (container,) = spec["containers"]
    settings = settings_for(container["args"], container_env(container, docs))
    overrides = scratch / "overrides.csv"
    overrides.write_text(mounted_file(spec, container, str(settings.price_override_csv), docs), encoding="utf-8")
    catalog = replace(settings, price_override_csv=overrides).price_catalog()
    checked = 0
    for daemonset in of_kind(docs, "DaemonSet"):
        (collector,) = pod_spec(daemonset)["containers"]
        facts = settings_for(collector["args"], container_env(collector, docs))
        overridden = [facts.cloud_provider, facts.region, facts.instance_type, facts.price_model]
        if not any(overridden):
            continue
        where = daemonset["metadata"]["name"]
        # An instance type without its provider and region would be looked up with the node's: say all three.
        assert facts.cloud_provider and facts.region and facts.instance_type, (
            f"{where}: overrides some price facts but not provider, region and instance type together")
        checked += 1
        quote = catalog.quote(provider=facts.cloud_provider, region=facts.region, instance_type=facts.instance_type,
                              price_model=facts.price_model or "on_demand")
        assert quote.node_price_per_hour_usd is not None and quote.node_price_per_hour_usd > 0, (where, quote)
        assert quote.spec.gpu_count, f"{where}: the instance type's GPU count is known, so the price can be split"
    return checked


def check_restricted_pods(docs: list[dict]) -> None:
    """Every pod but the collectors' meets the "restricted" Pod Security Standard."""
    others = [w for w in workloads(docs) if not is_collector(w)]
    assert {"Deployment", "Job", "CronJob"} <= {w["kind"] for w in others} <= {"Deployment", "StatefulSet", "Job",
                                                                                "CronJob"}
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


def check_resources(docs: list[dict]) -> None:
    for workload in workloads(docs):
        for container in containers(pod_spec(workload)):
            resources = container["resources"]
            for resource in ("cpu", "memory"):
                request, limit = resources["requests"][resource], resources["limits"][resource]
                assert 0 < quantity(request) <= quantity(limit), f"{container['name']} {resource}: {request}/{limit}"


def check_secrets_by_reference(docs: list[dict]) -> set[str]:
    """No Secret shipped, no credentials inline; every secret variable from a Secret. Returns the Secret names."""
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
    return referenced


def check_commands_and_settings(docs: list[dict]) -> list[str]:
    """Every container runs a gpumeter command whose settings build from its environment, which holds only
    variables gpumeter's code (or, on the collector, the NVIDIA runtime) reads. Returns the roles, sorted."""
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
    return sorted(roles)


def check_metrics_services(docs: list[dict]) -> None:
    """Each long-running workload serves /metrics and /healthz on the port its settings name, behind exactly one
    Service carrying the Prometheus annotations; a metrics Service per role (the API's also serves /allocation),
    each role on a port of its own -- a guard scaled out has a Service per guard role, on the guard's one port."""
    services = of_kind(docs, "Service")
    for workload in workloads(docs):
        if workload["kind"] in RUN_TO_COMPLETION_KINDS:
            continue
        spec = pod_spec(workload)
        (container,) = spec["containers"]
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
    ports = {}
    for service in services:
        ports.setdefault(service["metadata"]["labels"]["app.kubernetes.io/component"], set()).add(
            service["spec"]["ports"][0]["port"])
    assert all(len(found) == 1 for found in ports.values()), f"one port per role: {ports}"
    long_running = {pod_template(w)["metadata"]["labels"]["app.kubernetes.io/component"]
                    for w in workloads(docs) if w["kind"] not in RUN_TO_COMPLETION_KINDS}
    assert set(ports) == long_running and long_running >= {"api", "attributor", "billing", "collector", "guard"}
    assert len(ports) == len({port for found in ports.values() for port in found}), ports


def check_workload_selectors_are_disjoint(docs: list[dict]) -> None:
    """No workload's selector matches another workload's pods (two collector DaemonSets included)."""
    items = [w for w in workloads(docs) if w["kind"] not in RUN_TO_COMPLETION_KINDS]
    for workload in items:
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        for other in items:
            if other is not workload:
                assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items(), (
                    f"{workload['metadata']['name']} selects the pods of {other['metadata']['name']}")


def check_state_on_volumes(docs: list[dict]) -> None:
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
            out_dir = getattr(settings, "out_dir", None)  # the recorder's recordings
            if out_dir is not None:
                assert any(str(out_dir).rstrip("/") == m.rstrip("/") or str(out_dir).startswith(m.rstrip("/") + "/")
                           for m in mounts), out_dir


GUARD_ROLE_LABEL = "gpumeter.io/guard-role"


def guard_deployments(docs: list[dict]) -> dict[str, dict]:
    """The guard Deployments by the role their settings run (``GuardSettings.role``, read through the real CLI and
    loader), each with its ``workload``, ``settings``, ``replicas``, ``strategy`` and ``volumes``; asserts that two
    Deployments never run the same role and that each pod is labelled with its role."""
    found: dict[str, dict] = {}
    for workload in by_role(docs, "guard"):
        assert workload["kind"] == "Deployment", workload["metadata"]["name"]
        spec = pod_spec(workload)
        (container,) = spec["containers"]
        settings = settings_for(container["args"], container_env(container, docs))
        assert settings.role not in found, f"two guard Deployments run role {settings.role}"
        assert workload["spec"]["template"]["metadata"]["labels"].get(GUARD_ROLE_LABEL) == settings.role
        found[settings.role] = {"workload": workload, "settings": settings, "replicas": workload["spec"]["replicas"],
                                "strategy": workload["spec"].get("strategy", {}).get("type", "RollingUpdate"),
                                "volumes": {v["name"]: v for v in spec["volumes"]},
                                "mounts": {m["mountPath"] for m in container["volumeMounts"]}}
    return found


def check_guard_roles(docs: list[dict]) -> str:
    """The guard runs either as one Deployment of role ``all`` (every rule, every partition, one replica, Recreate,
    a state file on the state volume) or scaled out: role ``nodes`` (any number of replicas, rolled, no state file
    and no state volume) beside exactly one replica of role ``budgets`` (Recreate, a state file of its own on the
    state volume). Never ``all`` beside another role, never two instances reading every partition. Returns
    "single" or "scaled"."""
    guards = guard_deployments(docs)
    assert set(guards) in ({"all"}, {"nodes", "budgets"}), f"guard roles deployed: {sorted(guards)}"
    for role in set(guards) & {"all", "budgets"}:
        guard = guards[role]
        assert guard["replicas"] == 1 and guard["strategy"] == "Recreate", (role, guard["replicas"], guard["strategy"])
        assert guard["settings"].state_path is not None, f"role {role} keeps its state in a file"
        assert "state" in guard["volumes"] and "/var/lib/gpumeter" in guard["mounts"], role
    if "all" in guards:
        return "single"
    nodes, budgets = guards["nodes"], guards["budgets"]
    assert nodes["replicas"] >= 1 and nodes["strategy"] == "RollingUpdate", (nodes["replicas"], nodes["strategy"])
    assert nodes["settings"].state_path is None and "state" not in nodes["volumes"], "the nodes role keeps no state"
    assert nodes["settings"].group_id != budgets["settings"].group_id
    assert budgets["settings"].state_path.name != "guard-state.json", (
        "the budgets role never reads the file a guard of role all wrote")
    return "scaled"


def check_guard_pods_are_served(docs: list[dict]) -> None:
    """Each guard Deployment selects its role's pods only, and exactly one metrics Service selects them, a Service
    of the guard's (component guard) carrying the role's label when the guard is scaled out."""
    guards = guard_deployments(docs)
    services = of_kind(docs, "Service")
    for role, guard in guards.items():
        labels = guard["workload"]["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "guard", role
        selector = guard["workload"]["spec"]["selector"]["matchLabels"]
        for other_role, other in guards.items():
            if other_role != role:
                assert not selector.items() <= other["workload"]["spec"]["template"]["metadata"]["labels"].items()
        (service,) = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "guard"
        if len(guards) > 1:
            assert service["metadata"]["labels"][GUARD_ROLE_LABEL] == role
            assert service["spec"]["selector"][GUARD_ROLE_LABEL] == role


def secret_settings_kept_out_of_repr() -> set[tuple[type, str]]:
    return {(cls, f.name) for cls in (KafkaSettings, BillingSettings, GuardSettings) for f in fields(cls)
            if not f.repr}
