"""Device ids the NVIDIA device plugin hands the kubelet, and the resource names it advertises.

Device ids (``deviceIDStrategy: uuid``, the default):

* ``GPU-<uuid>`` — a whole GPU;
* ``GPU-<uuid>::<n>`` — replica ``n`` of a time-sliced (or MPS-shared) GPU;
* ``MIG-<uuid>`` — a MIG device by its own UUID (R470+ drivers); the parent GPU needs NVML to resolve;
* ``MIG-GPU-<uuid>/<gi>/<ci>`` — a MIG device by parent GPU UUID, GPU instance and compute instance (older
  drivers);
* either MIG form with ``::<n>`` — a replica of a time-sliced MIG device.

Hex digits are returned lowercase, as NVML reports UUIDs, so refs compare equal to NVML's strings.
Anything else (including the ``index`` id strategy's ``0``, ``0::1``, ``0:1``) raises ``InvalidMessage`` with
reason_code ``BAD_DEVICE_ID``: an index cannot be tied to a GPU without the node's NVML enumeration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gpumeter.errors import InvalidMessage

BAD_DEVICE_ID = "BAD_DEVICE_ID"

DeviceKind = Literal["gpu", "gpu_replica", "mig"]

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_REPLICA = r"(?:::(?P<replica>0|[1-9][0-9]{0,8}))?"
_INSTANCE_ID = r"0|[1-9][0-9]{0,8}"
_GPU_ID = re.compile(rf"GPU-(?P<uuid>{_UUID}){_REPLICA}")
_MIG_ID = re.compile(rf"MIG-(?P<uuid>{_UUID}){_REPLICA}")
_MIG_LEGACY_ID = re.compile(rf"MIG-GPU-(?P<uuid>{_UUID})/(?P<gi>{_INSTANCE_ID})/(?P<ci>{_INSTANCE_ID}){_REPLICA}")

# nvidia.com/gpu, its time-slicing rename nvidia.com/gpu.shared, and MIG mixed-strategy profiles such as
# nvidia.com/mig-1g.10gb, nvidia.com/mig-1g.10gb+me, nvidia.com/mig-1c.3g.40gb (and their ".shared" renames).
# Profile names grow with each GPU generation, so any name under nvidia.com/mig- counts.
_GPU_RESOURCE = re.compile(r"nvidia\.com/(?:gpu(?:\.shared)?|mig-[0-9a-z][0-9a-z.+-]*)")


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """What a device id names.

    ``gpu_uuid`` is the physical GPU's ``GPU-...`` UUID where the id carries it (every form but ``MIG-<uuid>``);
    ``replica`` the time-slicing replica index or ``None``; ``mig_uuid`` the ``MIG-...`` UUID of the new MIG form;
    ``mig_gpu_instance_id`` / ``mig_compute_instance_id`` those of the legacy MIG form.
    """

    kind: DeviceKind
    gpu_uuid: str | None
    replica: int | None
    mig_uuid: str | None
    mig_gpu_instance_id: int | None
    mig_compute_instance_id: int | None

    @property
    def is_mig(self) -> bool:
        return self.kind == "mig"


def _replica(match: re.Match[str]) -> int | None:
    value = match.group("replica")
    return int(value) if value is not None else None


def parse_device_id(device_id: str) -> DeviceRef:
    """Parse one PodResources device id; raises ``InvalidMessage`` (``BAD_DEVICE_ID``) for any other string."""
    if not isinstance(device_id, str):
        raise InvalidMessage(f"device id must be a string, got {type(device_id).__name__}", reason_code=BAD_DEVICE_ID)
    match = _GPU_ID.fullmatch(device_id)
    if match:
        replica = _replica(match)
        return DeviceRef(
            kind="gpu" if replica is None else "gpu_replica",
            gpu_uuid="GPU-" + match.group("uuid").lower(),
            replica=replica,
            mig_uuid=None,
            mig_gpu_instance_id=None,
            mig_compute_instance_id=None,
        )
    match = _MIG_LEGACY_ID.fullmatch(device_id)
    if match:
        return DeviceRef(
            kind="mig",
            gpu_uuid="GPU-" + match.group("uuid").lower(),
            replica=_replica(match),
            mig_uuid=None,
            mig_gpu_instance_id=int(match.group("gi")),
            mig_compute_instance_id=int(match.group("ci")),
        )
    match = _MIG_ID.fullmatch(device_id)
    if match:
        return DeviceRef(
            kind="mig",
            gpu_uuid=None,
            replica=_replica(match),
            mig_uuid="MIG-" + match.group("uuid").lower(),
            mig_gpu_instance_id=None,
            mig_compute_instance_id=None,
        )
    shown = device_id if len(device_id) <= 120 else device_id[:120] + "..."
    raise InvalidMessage(f"not an NVIDIA device id: {shown!r}", reason_code=BAD_DEVICE_ID)


def is_gpu_resource(resource_name: str) -> bool:
    """True for the extended resources the NVIDIA device plugin advertises for GPUs and MIG devices."""
    return isinstance(resource_name, str) and _GPU_RESOURCE.fullmatch(resource_name) is not None
