"""What NVIDIA's DRA driver (``gpu.nvidia.com``) and the scheduler publish for a scenario's DRA node.

The peer's side of ``services.collector.dra``, written from the driver's behaviour, not from the collector's code:

* one ResourceSlice per node (``resource.k8s.io/v1``; pool named after the node, generation 1): a device
  ``gpu-<minor>`` per GPU without MIG (attributes ``type: gpu``, ``uuid``, ``productName``, ``driverVersion``)
  -- ``driverVersion`` a semantic version (``driver_semver``), as the server's validation demands --
  and, for a MIG GPU, a device per MIG instance ``gpu-<minor>-mig-<profile without dots>-<profile id>-<placement
  start>`` (``type: mig``, ``uuid`` of the MIG device, ``parentUUID``, ``profile``), as the driver publishes
  MIG devices that exist. ``minor`` is the GPU's index here.
* per claim a ResourceClaim with its uid (from the seed), ``status.allocation.devices.results`` naming the device
  and ``status.reservedFor`` the pods using it at the time asked; a claim on a time-sliced or MPS GPU carries a
  ``GpuConfig`` with ``sharing.strategy`` TimeSlicing or MPS (a claim is how DRA pods share a GPU);
* the kubelet's ``dynamic_resources`` for a container: claim name and namespace, and the device by driver, pool and
  name with its claim-scoped CDI id ``k8s.gpu.nvidia.com/claim=<claim uid>-<device name>``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

from services.collector.podresources.client import ContainerClaimDevice
from simulator.scenario import MIG_TOTAL_MEMORY_SLICES, SHARING_MIG, SHARING_MPS, SHARING_TIME_SLICING, GpuSpec, NodeSpec

DRIVER = "gpu.nvidia.com"
CDI_KIND = "k8s.gpu.nvidia.com/claim"
_STRATEGY = {SHARING_TIME_SLICING: "TimeSlicing", SHARING_MPS: "MPS"}


def claim_uid(seed: int, namespace: str, name: str) -> str:
    h = bytearray(hashlib.sha256(f"{seed}\x1fclaim\x1f{namespace}\x1f{name}".encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x40
    h[8] = (h[8] & 0x3F) | 0x80
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:32]}"


def device_name(gpu: GpuSpec, instance: int | None) -> str:
    """The driver's name for the whole GPU or one of its MIG instances."""
    if instance is None:
        return f"gpu-{gpu.index}"
    spec = gpu.sharing.mig_instances[instance]
    placement = sum(i.profile.memory_slices for i in gpu.sharing.mig_instances[:instance]) % MIG_TOTAL_MEMORY_SLICES
    profile = spec.profile.name.replace(".", "")
    return f"gpu-{gpu.index}-mig-{profile}-{spec.profile.nvml_profile_id}-{placement}"


def driver_semver(version: str) -> str:
    """The NVIDIA driver version as the DRA driver publishes it, a semantic version: NVML's ``570.172.08`` parsed
    and printed again, ``570.172.8`` (a version attribute must be semver 2.0.0, which allows no leading zeros:
    kube-apiserver refuses the slice otherwise)."""
    parts = [str(int(part)) for part in version.split(".")]
    return ".".join((parts + ["0", "0"])[:3])


def _string(value: str) -> dict[str, str]:
    return {"string": value}


def resource_slices(node: NodeSpec, *, generation: int = 1) -> list[dict[str, Any]]:
    """The node's ResourceSlices as the API server serialises them."""
    devices = []
    for gpu in node.gpus:
        if gpu.sharing.mode != SHARING_MIG:
            devices.append({"name": device_name(gpu, None), "attributes": {
                "type": _string("gpu"), "uuid": _string(gpu.uuid), "productName": _string(gpu.model),
                "driverVersion": {"version": driver_semver(node.driver_version)}, "index": {"int": gpu.index},
                "minor": {"int": gpu.index}},
                "capacity": {"memory": {"value": str(gpu.memory_total_bytes)}}})
            continue
        for i, spec in enumerate(gpu.sharing.mig_instances):
            devices.append({"name": device_name(gpu, i), "attributes": {
                "type": _string("mig"), "uuid": _string(spec.uuid), "parentUUID": _string(gpu.uuid),
                "profile": _string(spec.profile.name), "productName": _string(gpu.model)},
                "capacity": {"memory": {"value": str(spec.memory_total_bytes)}}})
    return [{
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node.name}-{DRIVER}-slice", "uid": claim_uid(0, "slice", node.name)},
        "spec": {"driver": DRIVER, "nodeName": node.name,
                 "pool": {"name": node.name, "generation": generation, "resourceSliceCount": 1},
                 "devices": devices},
    }]


def resource_claim(seed: int, node: NodeSpec, namespace: str, name: str, gpu: int, instance: int | None,
                   consumers: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """One ResourceClaim, allocated on ``node`` and reserved for ``consumers`` ((pod name, pod uid), in order)."""
    spec_gpu = node.gpus[gpu]
    config = []
    strategy = _STRATEGY.get(spec_gpu.sharing.mode)
    if strategy is not None:
        config = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
            "sharing": {"strategy": strategy,
                        **({"timeSlicingConfig": {"interval": "Default"}} if strategy == "TimeSlicing" else
                           {"mpsConfig": {"defaultActiveThreadPercentage": 100 // spec_gpu.sharing.replicas}})},
        }}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": claim_uid(seed, namespace, name)},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                             "config": config}},
        "status": {
            "allocation": {"devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": node.name,
                             "device": device_name(spec_gpu, instance)}],
                "config": [{"source": "FromClaim", **entry} for entry in config]}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": uid} for pod, uid in consumers],
        },
    }


def dynamic_assignment(seed: int, node: NodeSpec, namespace: str, pod_name: str, container_name: str, claim: str,
                       gpu: int, instance: int | None) -> ContainerClaimDevice:
    name = device_name(node.gpus[gpu], instance)
    return ContainerClaimDevice(namespace, pod_name, container_name, namespace, claim, DRIVER, node.name, name,
                                (f"{CDI_KIND}={claim_uid(seed, namespace, claim)}-{name}",))


def _claim_devices(pods: Iterable[Any]):
    """(pod, container, SimClaimDevice) of ``pods`` (``SimPod``s), pods in start order."""
    for pod in sorted(pods, key=lambda p: p.started_at_unix_ms):
        for container in pod.containers:
            for device in container.claim_devices:
                yield pod, container, device


def claims_for(seed: int, node: NodeSpec, pods: Iterable[Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The ResourceClaims the running ``pods`` of ``node`` use, by (namespace, name), each reserved for the pods
    using it (in start order)."""
    consumers: dict[tuple[str, str], list[tuple[str, str]]] = {}
    units: dict[tuple[str, str], tuple[int, int | None]] = {}
    for pod, _, device in _claim_devices(pods):
        key = (pod.namespace, device.claim)
        users = consumers.setdefault(key, [])
        if (pod.name, pod.uid) not in users:
            users.append((pod.name, pod.uid))
        units[key] = (device.gpu, device.instance)
    return {key: resource_claim(seed, node, key[0], key[1], *units[key], consumers[key]) for key in units}


def dynamic_assignments(seed: int, node: NodeSpec, pods: Iterable[Any]) -> list[ContainerClaimDevice]:
    """What the kubelet lists under ``dynamic_resources`` for the running ``pods`` of ``node``."""
    return [dynamic_assignment(seed, node, pod.namespace, pod.name, container.name, device.claim, device.gpu,
                               device.instance)
            for pod, container, device in _claim_devices(pods)]
