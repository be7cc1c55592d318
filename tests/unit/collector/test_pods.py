"""Pod JSON objects → PodEvent: workloads, GPU requests, container ids, env, malformed input."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumeter.errors import InvalidMessage
from schemas.records import DeviceAssignment, PodEvent, PodEventType
from schemas.typed import codec_for
from services.collector.pods import (
    ANNOTATION_VALUE_MAX_BYTES,
    BAD_POD_OBJECT,
    VALUE_FROM_MARK,
    pod_event_from_object,
    with_assignments,
)
from simulator.apiserver import make_pod_object

CLUSTER = "prod-eu"
NODE = "gpu-node-a"
OBSERVED_MS = 1_795_000_041_500
HEX = "3f9c2a1b" * 8


def parse(obj, event_type=PodEventType.ADDED) -> PodEvent:
    return pod_event_from_object(obj, event_type, CLUSTER, OBSERVED_MS)


def pod(name="trainer-0", uid="0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", **kwargs):
    # Through JSON, as the watcher receives it from the wire.
    return json.loads(json.dumps(make_pod_object("ml", name, uid, NODE, **kwargs)))


def container(event: PodEvent, name: str):
    (found,) = [c for c in event.containers if c.name == name]
    return found


# --- identity, metadata, times ------------------------------------------------------------------------------------


def test_identity_and_metadata_come_from_the_object():
    labels = {"app": "llama", "team": "research"}
    annotations = {"kubectl.kubernetes.io/default-container": "main"}
    obj = pod(labels=labels, annotations=annotations, phase="Running", started_at_unix_ms=1_794_999_000_000)
    event = parse(obj, PodEventType.MODIFIED)
    assert event.event_type == PodEventType.MODIFIED
    assert event.cluster == CLUSTER
    assert event.observed_at_unix_ms == OBSERVED_MS
    assert event.uid == obj["metadata"]["uid"]
    assert event.namespace == obj["metadata"]["namespace"]
    assert event.name == obj["metadata"]["name"]
    assert event.resource_version == obj["metadata"]["resourceVersion"]
    assert event.node_name == NODE
    assert dict(event.labels) == labels
    assert dict(event.annotations) == annotations
    assert event.phase == "Running"
    assert event.started_at_unix_ms == 1_794_999_000_000


@pytest.mark.parametrize(
    "start_time",
    ["2026-11-29T17:02:03Z", "2026-11-29T17:02:03.250Z", "2026-11-29T18:02:03.250+01:00", "2026-11-29T17:02:03+00:00"],
)
def test_start_time_rfc3339_forms(start_time):
    obj = pod()
    obj["status"]["startTime"] = start_time
    expected = datetime.fromisoformat(start_time.replace("Z", "+00:00"))
    assert parse(obj).started_at_unix_ms == round(expected.timestamp() * 1000)


def test_pending_pod_without_start_time_or_container_ids():
    obj = pod(phase="Pending")
    del obj["status"]["startTime"]
    event = parse(obj)
    assert event.phase == "Pending"
    assert event.started_at_unix_ms is None
    assert [c.container_id for c in event.containers] == [None]


def test_missing_status_reads_as_unknown_phase():
    obj = pod()
    del obj["status"]
    event = parse(obj)
    assert event.phase == "Unknown"
    assert event.started_at_unix_ms is None


def test_long_annotation_values_are_cut_to_a_kib_on_a_character_boundary():
    last_applied = '{"kind": "Pod", "spec": "' + "é" * 2000 + '"}'
    short = "x" * ANNOTATION_VALUE_MAX_BYTES
    event = parse(pod(annotations={"kubectl.kubernetes.io/last-applied-configuration": last_applied, "s": short}))
    cut = event.annotations["kubectl.kubernetes.io/last-applied-configuration"]
    assert len(cut.encode("utf-8")) <= ANNOTATION_VALUE_MAX_BYTES
    assert len(cut.encode("utf-8")) > ANNOTATION_VALUE_MAX_BYTES - 2  # at most one 2-byte character dropped
    assert last_applied.startswith(cut)
    assert event.annotations["s"] == short


# --- workloads ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "expected"),
    [
        (("Deployment", "llama-finetune"), ("Deployment", "llama-finetune")),
        (("StatefulSet", "etcd"), ("StatefulSet", "etcd")),
        (("DaemonSet", "dcgm-exporter"), ("DaemonSet", "dcgm-exporter")),
        (("Job", "train-run-17"), ("Job", "train-run-17")),
        (("LeaderWorkerSet", "vllm"), ("LeaderWorkerSet", "vllm")),
        (None, (None, None)),
    ],
)
def test_workload_from_the_controller_owner(owner, expected):
    event = parse(pod(owner=owner))
    assert (event.workload_kind, event.workload_name) == expected


def test_deployment_is_recovered_from_the_replicaset_name_and_template_hash():
    obj = pod(owner=("Deployment", "llama-finetune"))
    (reference,) = obj["metadata"]["ownerReferences"]
    assert reference["kind"] == "ReplicaSet"
    assert reference["name"] == f"llama-finetune-{obj['metadata']['labels']['pod-template-hash']}"
    assert (parse(obj).workload_kind, parse(obj).workload_name) == ("Deployment", "llama-finetune")


def test_deployment_name_with_dashes_keeps_them():
    obj = pod(owner=("Deployment", "team-a-llama-7b-serving"))
    assert parse(obj).workload_name == "team-a-llama-7b-serving"


def test_replicaset_without_a_matching_template_hash_stays_a_replicaset():
    standalone = pod(owner=("ReplicaSet", "hand-made-rs"))
    assert (parse(standalone).workload_kind, parse(standalone).workload_name) == ("ReplicaSet", "hand-made-rs")

    mismatched = pod(owner=("Deployment", "web"))
    mismatched["metadata"]["labels"]["pod-template-hash"] = "zzzzzzzzzz"
    rs_name = mismatched["metadata"]["ownerReferences"][0]["name"]
    assert (parse(mismatched).workload_kind, parse(mismatched).workload_name) == ("ReplicaSet", rs_name)


def test_cronjob_pods_are_attributed_to_their_job():
    obj = pod(owner=("CronJob", "nightly-eval"))
    job_name = obj["metadata"]["ownerReferences"][0]["name"]
    assert job_name.startswith("nightly-eval-")
    assert (parse(obj).workload_kind, parse(obj).workload_name) == ("Job", job_name)


def test_only_the_controller_reference_names_the_workload():
    obj = pod(owner=("StatefulSet", "db"))
    obj["metadata"]["ownerReferences"].insert(
        0, {"apiVersion": "v1", "kind": "ConfigMap", "name": "keeper", "uid": "u-1", "controller": False}
    )
    assert (parse(obj).workload_kind, parse(obj).workload_name) == ("StatefulSet", "db")

    obj["metadata"]["ownerReferences"] = obj["metadata"]["ownerReferences"][:1]
    assert (parse(obj).workload_kind, parse(obj).workload_name) == (None, None)


# --- GPU requests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpu_requests",
    [
        {"nvidia.com/gpu": 1},
        {"nvidia.com/gpu": 8},
        {"nvidia.com/gpu.shared": 1},
        {"nvidia.com/mig-1g.10gb": 2},
        {"nvidia.com/mig-1g.10gb": 1, "nvidia.com/mig-3g.40gb": 1},
        {"nvidia.com/mig-2g.20gb.shared": 3},
        {"nvidia.com/mig-1g.18gb": 1},
    ],
)
def test_gpu_requests_by_resource_name(gpu_requests):
    event = parse(pod(gpu_requests=gpu_requests))
    assert dict(event.gpu_requests) == gpu_requests
    assert dict(container(event, "main").gpu_requests) == gpu_requests


def test_non_gpu_resources_are_not_gpu_requests():
    obj = pod(gpu_requests={"nvidia.com/gpu": 1})
    resources = obj["spec"]["containers"][0]["resources"]
    for section in ("requests", "limits"):
        resources[section]["example.com/fpga"] = "2"
        resources[section]["amd.com/gpu"] = "1"
        resources[section]["hugepages-2Mi"] = "64Mi"
    assert dict(parse(obj).gpu_requests) == {"nvidia.com/gpu": 1}


def test_limit_wins_and_requests_are_the_fallback():
    obj = pod(containers=["main", "helper"])
    main, helper = obj["spec"]["containers"]
    main["resources"] = {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "1"}}
    helper["resources"] = {"requests": {"nvidia.com/gpu.shared": "1"}}
    event = parse(obj)
    assert dict(container(event, "main").gpu_requests) == {"nvidia.com/gpu": 2}
    assert dict(container(event, "helper").gpu_requests) == {"nvidia.com/gpu.shared": 1}
    assert dict(event.gpu_requests) == {"nvidia.com/gpu": 2, "nvidia.com/gpu.shared": 1}


@pytest.mark.parametrize(
    ("quantity", "count"), [("1", 1), ("4", 4), (2, 2), ("1k", 1000), ("2e1", 20), ("1Ki", 1024), ("0", 0)]
)
def test_quantity_forms(quantity, count):
    obj = pod()
    obj["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = quantity
    expected = {"nvidia.com/gpu": count} if count else {}
    assert dict(parse(obj).gpu_requests) == expected


def test_regular_containers_add_up():
    obj = pod(containers=["a", "b", "c"])
    for index, entry in enumerate(obj["spec"]["containers"]):
        entry["resources"]["limits"]["nvidia.com/gpu.shared"] = str(index + 1)
    event = parse(obj)
    assert dict(event.gpu_requests) == {"nvidia.com/gpu.shared": 1 + 2 + 3}


def _with_init(obj, name, gpus, *, sidecar=False, container_id=None):
    init = {"name": name, "image": "busybox:1.36", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
    if sidecar:
        init["restartPolicy"] = "Always"
    obj["spec"].setdefault("initContainers", []).append(init)
    status = {
        "name": name,
        "image": "busybox:1.36",
        "imageID": "docker.io/library/busybox@sha256:" + "ab" * 32,
        "ready": False,
        "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
    }
    if container_id is not None:
        status["containerID"] = container_id
    obj["status"].setdefault("initContainerStatuses", []).append(status)
    return obj


def test_init_containers_are_listed_first_with_their_own_ids_and_requests():
    obj = _with_init(pod(gpu_requests={"nvidia.com/gpu": 1}), "warmup", 1, container_id=f"containerd://{HEX}")
    event = parse(obj)
    assert [c.name for c in event.containers] == ["warmup", "main"]
    assert container(event, "warmup").container_id == HEX
    assert dict(container(event, "warmup").gpu_requests) == {"nvidia.com/gpu": 1}
    # The device manager hands the init container's GPU on to the app container: the pod holds one GPU.
    assert dict(event.gpu_requests) == {"nvidia.com/gpu": 1}


def test_a_larger_init_request_is_the_pod_request():
    obj = _with_init(pod(gpu_requests={"nvidia.com/gpu": 1}), "convert-weights", 4)
    assert dict(parse(obj).gpu_requests) == {"nvidia.com/gpu": 4}


def test_sidecar_init_containers_run_alongside_and_add_up():
    obj = pod(gpu_requests={"nvidia.com/gpu": 2})
    _with_init(obj, "profiler", 1, sidecar=True)
    _with_init(obj, "warmup", 2)
    # warmup runs with the profiler sidecar (1 + 2 = 3); afterwards main runs with it (2 + 1 = 3).
    assert dict(parse(obj).gpu_requests) == {"nvidia.com/gpu": 3}
    obj["spec"]["initContainers"][1]["resources"]["limits"]["nvidia.com/gpu"] = "5"
    assert dict(parse(obj).gpu_requests) == {"nvidia.com/gpu": 1 + 5}


# --- CPU and memory requests (billing's requests sharing policy) ------------------------------------------------


def _set_resources(entry, *, requests=None, limits=None):
    entry["resources"] = {k: v for k, v in (("requests", requests), ("limits", limits)) if v is not None}


@pytest.mark.parametrize(("cpu", "millicores"), [("500m", 500), ("2", 2000), ("1.5", 1500), ("0.0001", 1),
                                                  ("250.5m", 251), (3, 3000), ("1k", 1_000_000), ("2e-3", 2)])
@pytest.mark.parametrize(("memory", "bytes_"), [("1Gi", 2**30), ("512M", 512 * 10**6), ("128974848", 128974848),
                                                 ("129e6", 129 * 10**6), ("123Mi", 123 * 2**20), ("1.5Ki", 1536),
                                                 ("100m", 1)])
def test_cpu_and_memory_requests_are_read_as_kubernetes_quantities(cpu, millicores, memory, bytes_):
    obj = pod()
    _set_resources(obj["spec"]["containers"][0], requests={"cpu": cpu, "memory": memory})
    event = parse(obj)
    main = container(event, "main")
    assert (main.cpu_request_millicores, main.memory_request_bytes) == (millicores, bytes_)
    assert (event.cpu_request_millicores, event.memory_request_bytes) == (millicores, bytes_)


def test_a_missing_request_is_the_limit_and_neither_is_zero():
    obj = pod(containers=["main", "sidecar"])
    _set_resources(obj["spec"]["containers"][0], limits={"cpu": "4", "memory": "8Gi"})
    _set_resources(obj["spec"]["containers"][1], requests={"memory": "64Mi"}, limits={"memory": "128Mi"})
    event = parse(obj)
    assert (container(event, "main").cpu_request_millicores, container(event, "main").memory_request_bytes) == (
        4000, 8 * 2**30)
    assert (container(event, "sidecar").cpu_request_millicores, container(event, "sidecar").memory_request_bytes) == (
        0, 64 * 2**20)
    assert (event.cpu_request_millicores, event.memory_request_bytes) == (4000, 8 * 2**30 + 64 * 2**20)


def test_the_pods_requests_follow_the_kubernetes_init_container_rule_plus_overhead():
    obj = pod()
    _set_resources(obj["spec"]["containers"][0], requests={"cpu": "2", "memory": "4Gi"})
    _with_init(obj, "profiler", 0, sidecar=True)
    _set_resources(obj["spec"]["initContainers"][0], requests={"cpu": "500m", "memory": "1Gi"})
    _with_init(obj, "convert-weights", 0)
    _set_resources(obj["spec"]["initContainers"][1], requests={"cpu": "8", "memory": "2Gi"})
    event = parse(obj)
    # convert-weights runs with the profiler (8.5 CPUs, 3 GiB), then main runs with it (2.5 CPUs, 5 GiB): the
    # pod needs the larger of each at once, never their sum.
    assert (event.cpu_request_millicores, event.memory_request_bytes) == (8500, 5 * 2**30)
    obj["spec"]["overhead"] = {"cpu": "250m", "memory": "120Mi"}
    event = parse(obj)
    assert (event.cpu_request_millicores, event.memory_request_bytes) == (8750, 5 * 2**30 + 120 * 2**20)
    # Each container keeps its own requests.
    assert [(c.name, c.cpu_request_millicores) for c in event.containers] == [
        ("profiler", 500), ("convert-weights", 8000), ("main", 2000)]


@pytest.mark.parametrize("bad", ["-1", "1.2.3", "lots", "1Zi", "1e999", True, [1]])
def test_an_unreadable_cpu_or_memory_request_is_a_bad_pod_object(bad):
    for resource in ("cpu", "memory"):
        obj = pod()
        _set_resources(obj["spec"]["containers"][0], requests={resource: bad})
        with pytest.raises(InvalidMessage) as caught:
            parse(obj)
        assert caught.value.reason_code == BAD_POD_OBJECT


def test_the_requests_survive_the_wire():
    obj = pod()
    _set_resources(obj["spec"]["containers"][0], requests={"cpu": "1500m", "memory": "3Gi"})
    event = parse(obj)
    codec = codec_for(PodEvent)
    decoded = codec.decode(codec.encode(event))
    assert (decoded.cpu_request_millicores, decoded.memory_request_bytes) == (1500, 3 * 2**30)
    assert decoded.containers[0].cpu_request_millicores == 1500


# --- containers: ids, env, privileged -----------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["containerd", "cri-o", "docker"])
def test_container_id_runtime_prefix_is_removed(runtime):
    obj = pod(container_ids=[f"{runtime}://{HEX}"])
    assert container(parse(obj), "main").container_id == HEX


def test_container_ids_are_matched_by_name_not_position():
    ids = [f"{i:x}" * 64 for i in range(1, 4)]
    obj = pod(containers=["main", "sidecar", "exporter"], container_ids=[f"containerd://{i}" for i in ids])
    obj["status"]["containerStatuses"].reverse()
    event = parse(obj)
    assert [container(event, n).container_id for n in ("main", "sidecar", "exporter")] == ids


def test_empty_container_id_is_none():
    obj = pod()
    obj["status"]["containerStatuses"][0]["containerID"] = ""
    assert container(parse(obj), "main").container_id is None


def test_visible_devices_all_without_a_gpu_request_is_reported():
    event = parse(pod(env={"NVIDIA_VISIBLE_DEVICES": "all", "OTHER": "x"}))
    assert dict(event.gpu_requests) == {}
    assert container(event, "main").visible_devices_env == "all"


def test_visible_devices_absent_is_none_and_value_from_is_marked():
    obj = pod(containers=["main", "side"])
    obj["spec"]["containers"][1]["env"] = [
        {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "gpu", "key": "devices"}}}
    ]
    event = parse(obj)
    assert container(event, "main").visible_devices_env is None
    assert container(event, "side").visible_devices_env == VALUE_FROM_MARK


def test_visible_devices_last_entry_wins_and_empty_value_is_kept():
    obj = pod()
    obj["spec"]["containers"][0]["env"] = [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    ]
    assert container(parse(obj), "main").visible_devices_env == "void"
    obj["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES"}]
    assert container(parse(obj), "main").visible_devices_env == ""


def test_ephemeral_debug_containers_are_seen():
    obj = pod()
    obj["spec"]["ephemeralContainers"] = [
        {"name": "debugger-x7k", "image": "nvidia/cuda:12.4.1-base", "env": [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
    ]
    obj["status"]["ephemeralContainerStatuses"] = [
        {"name": "debugger-x7k", "containerID": f"containerd://{HEX}", "ready": False, "restartCount": 0}
    ]
    debugger = container(parse(obj), "debugger-x7k")
    assert (debugger.visible_devices_env, debugger.container_id) == ("all", HEX)


def test_privileged_is_per_container():
    event = parse(pod(privileged=True, containers=["main", "side"]))
    assert container(event, "main").privileged is True
    assert container(event, "side").privileged is False


def test_assigned_devices_start_empty():
    assert all(c.assigned_devices == () for c in parse(pod(gpu_requests={"nvidia.com/gpu": 1})).containers)


# --- with_assignments ---------------------------------------------------------------------------------------------


def test_with_assignments_fills_named_containers_only():
    event = parse(pod(containers=["main", "side"], gpu_requests={"nvidia.com/gpu.shared": 1}))
    main_devices = (DeviceAssignment("nvidia.com/gpu.shared", ("GPU-8d4e2f3a-6a0c-4b4e-9a57-0d3c1b2a9f11::2",)),)
    merged = with_assignments(event, {"main": main_devices, "not-in-pod": (DeviceAssignment("nvidia.com/gpu", ()),)})
    assert container(merged, "main").assigned_devices == main_devices
    assert container(merged, "side").assigned_devices == ()
    assert [c.name for c in merged.containers] == [c.name for c in event.containers]
    assert container(event, "main").assigned_devices == ()  # the original is untouched
    assert merged.uid == event.uid and merged.gpu_requests == event.gpu_requests
    again = with_assignments(merged, {"side": ()})
    assert container(again, "main").assigned_devices == main_devices


async def test_deserialised_models_read_the_same_after_sanitize_for_serialization():
    from types import SimpleNamespace

    from kubernetes_asyncio.client import ApiClient

    obj = _with_init(
        pod(owner=("Deployment", "x"), gpu_requests={"nvidia.com/gpu": 2}, env={"NVIDIA_VISIBLE_DEVICES": "all"}),
        "warmup", 1, container_id=f"cri-o://{HEX}",
    )
    async with ApiClient() as api:
        model = api.deserialize(SimpleNamespace(data=json.dumps(obj)), "V1Pod")
        assert parse(api.sanitize_for_serialization(model)) == parse(obj)


def test_events_encode_with_the_schema():
    event = with_assignments(
        parse(_with_init(pod(owner=("Deployment", "x"), gpu_requests={"nvidia.com/mig-1g.10gb": 1}), "i", 1)),
        {"main": (DeviceAssignment("nvidia.com/mig-1g.10gb", ("MIG-9a8b7c6d-5e4f-4031-8a2b-1c0d9e8f7a6b",)),)},
    )
    codec = codec_for(PodEvent)
    assert codec.decode(codec.encode(event)) == event


# --- malformed objects --------------------------------------------------------------------------------------------


def _mutate(path, value):
    def apply(obj):
        target = obj
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return obj

    return apply


_DELETE = object()


@pytest.mark.parametrize(
    "mutation",
    [
        _mutate(("metadata", "uid"), _DELETE),
        _mutate(("metadata", "uid"), ""),
        _mutate(("metadata", "uid"), 17),
        _mutate(("metadata", "name"), _DELETE),
        _mutate(("metadata", "namespace"), None),
        _mutate(("metadata",), _DELETE),
        _mutate(("metadata",), ["not", "an", "object"]),
        _mutate(("metadata", "labels"), ["app=x"]),
        _mutate(("metadata", "labels"), {"app": 3}),
        _mutate(("metadata", "annotations"), "a=b"),
        _mutate(("metadata", "ownerReferences"), {"kind": "Job"}),
        _mutate(("metadata", "ownerReferences"), [{"kind": "Job", "controller": True}]),
        _mutate(("spec",), "spec"),
        _mutate(("spec", "containers"), {"name": "main"}),
        _mutate(("spec", "containers", 0, "name"), _DELETE),
        _mutate(("spec", "containers", 0, "resources", "limits"), ["nvidia.com/gpu"]),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "one"),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "0.5"),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "-1"),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), True),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), 1.0),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "9E"),
        _mutate(("spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"), "1\n"),
        _mutate(("spec", "containers", 0, "securityContext"), {"privileged": "yes"}),
        _mutate(("spec", "containers", 0, "env"), [{"value": "all"}]),
        _mutate(("spec", "containers", 0, "env"), [{"name": "NVIDIA_VISIBLE_DEVICES", "value": 0}]),
        _mutate(("spec", "nodeName"), ["gpu-node-a"]),
        _mutate(("status", "startTime"), "yesterday"),
        _mutate(("status", "startTime"), "2026-01-01T00:00:00"),
        _mutate(("status", "phase"), 2),
        _mutate(("status", "containerStatuses"), [{"containerID": "containerd://abc"}]),
        _mutate(("status", "containerStatuses", 0, "containerID"), 12),
        _mutate(("metadata", "name"), "\ud800"),
    ],
)
def test_malformed_objects_raise_bad_pod_object(mutation):
    obj = mutation(pod(gpu_requests={"nvidia.com/gpu": 1}, env={"NVIDIA_VISIBLE_DEVICES": "all"}))
    with pytest.raises(InvalidMessage) as raised:
        parse(obj)
    assert raised.value.reason_code == BAD_POD_OBJECT


def test_duplicate_container_names_are_malformed():
    obj = _with_init(pod(), "main", 1)
    with pytest.raises(InvalidMessage) as raised:
        parse(obj)
    assert raised.value.reason_code == BAD_POD_OBJECT


@pytest.mark.parametrize("obj", [None, [], "pod", 7, {"metadata": None}, {}])
def test_non_pods_raise_bad_pod_object(obj):
    with pytest.raises(InvalidMessage) as raised:
        parse(obj)
    assert raised.value.reason_code == BAD_POD_OBJECT


# --- fuzz ---------------------------------------------------------------------------------------------------------

_json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12)
)
_json = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


_BASE = pod(
    owner=("Deployment", "fuzz"),
    gpu_requests={"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 2},
    env={"NVIDIA_VISIBLE_DEVICES": "all"},
    containers=["main", "side"],
    annotations={"a": "b"},
)
_BASE_PATHS = [p for p in _paths(_BASE) if p]


def _check_outcome(obj):
    try:
        event = parse(obj)
    except InvalidMessage as exc:
        assert exc.reason_code == BAD_POD_OBJECT
        return
    # Whatever parses must be a record the topic accepts.
    codec = codec_for(PodEvent)
    assert codec.decode(codec.encode(event)) == event


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(_BASE_PATHS), value=_json)
def test_fuzz_one_field_of_a_realistic_pod(path, value):
    obj = copy.deepcopy(_BASE)
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    _check_outcome(obj)


@settings(max_examples=200, deadline=None)
@given(obj=_json)
def test_fuzz_arbitrary_json(obj):
    _check_outcome(obj)


@settings(max_examples=200, deadline=None)
@given(
    metadata=st.fixed_dictionaries(
        {"uid": st.text(min_size=1, max_size=8), "namespace": st.text(min_size=1, max_size=8),
         "name": st.text(min_size=1, max_size=8)},
        optional={"labels": st.dictionaries(st.text(max_size=8), st.text(max_size=8)), "ownerReferences": _json},
    ),
    spec=st.dictionaries(st.sampled_from(["containers", "initContainers", "nodeName"]), _json, max_size=3),
    status=st.dictionaries(st.sampled_from(["phase", "startTime", "containerStatuses"]), _json, max_size=3),
)
def test_fuzz_pod_shaped_objects(metadata, spec, status):
    _check_outcome({"metadata": metadata, "spec": spec, "status": status})
