"""HAMi's record of which GPU each container of a pod was given: the one owner of its format for every service.

HAMi (Project-HAMi/HAMi, the vGPU scheduler and device plugin) shares NVIDIA GPUs by its own CUDA interception.
Its device plugin registers ``nvidia.com/gpu`` as a count of vGPU *slots* per GPU, so the device ids the kubelet
hands out (PodResources) are placeholders, ``<GPU uuid>-<n>`` (``is_hami_placeholder``), and its ``Allocate``
ignores them: the GPU a container really gets is the one HAMi's scheduler wrote on the pod, in the annotation
``hami.io/vgpu-devices-allocated`` (``HAMI_ALLOCATED_ANNOTATION``). The format, as HAMi's
``EncodePodSingleDevice`` writes it (``pkg/device/devices.go``):

* one **segment** per container, each terminated by ``;`` -- empty segments are kept, so the n-th segment is the
  n-th container: the init containers, then ``spec.containers``, in spec order (HAMi releases before init
  containers were supported wrote ``spec.containers`` only; ``containers_of`` accepts either count);
* in a segment one **entry** per device, each terminated by ``:``;
* an entry is ``UUID,Type,UsedMemMiB,UsedCoresPercent`` (``GPU-0fc3…,NVIDIA,3000,30``): the NVML uuid, HAMi's
  device type, the device memory the container may use (MiB) and its share of the SMs (percent, 0: no limit).
  HAMi's decoder reads the first four fields of an entry and ignores any after them; so does this one.

``parse_allocation`` turns a value into segments of ``HamiDevice`` or raises ``HamiAnnotationError`` for anything
HAMi does not write (a missing terminator -- a value cut short --, an empty or forged uuid, a number that is not
a non-negative int32, cores above 100, the same GPU twice in one container). Pure; imports nothing of gpumeter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

HAMI_ALLOCATED_ANNOTATION = "hami.io/vgpu-devices-allocated"
"""The devices HAMi's scheduler allocated, per container: what a HAMi pod uses."""
HAMI_TO_ALLOCATE_ANNOTATION = "hami.io/vgpu-devices-to-allocate"
"""The same format, emptied container by container as HAMi's device plugin allocates: not read here."""
HAMI_NODE_ANNOTATION = "hami.io/vgpu-node"
"""The node HAMi's scheduler placed the pod on."""
HAMI_DEVICE_TYPE = "NVIDIA"
"""What HAMi writes as the type of an NVIDIA GPU."""

SEGMENT_TERMINATOR = ";"  # HAMi's OnePodMultiContainerSplitSymbol
ENTRY_TERMINATOR = ":"  # HAMi's OneContainerMultiDeviceSplitSymbol
FIELD_SEPARATOR = ","

MAX_INT32 = 2**31 - 1
MAX_CORES_PERCENT = 100
MAX_UUID_CHARS = 128
# An NVML uuid as HAMi copies it: GPU-<uuid> or MIG-<uuid>; no separator of the format can be in it.
_UUID = re.compile(r"(?:GPU|MIG)-[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")
# HAMi's device plugin names slot n of a GPU "<uuid>-<n>" (nvinternal/rm/devices.go); an NVML uuid's last group
# has 12 hex digits, so a last group of at most 4 decimal digits is a slot number, not part of a uuid.
_PLACEHOLDER = re.compile(r"(?P<gpu>GPU-[A-Za-z0-9][-A-Za-z0-9]*)-(?P<slot>0|[1-9][0-9]{0,3})")


class HamiAnnotationError(ValueError):
    """A HAMi allocation annotation that HAMi would not have written. ``detail`` says what is wrong."""


@dataclass(frozen=True, slots=True)
class HamiDevice:
    """One GPU HAMi gave a container: its NVML uuid, the memory (MiB) and SM share (percent) it may use."""

    uuid: str
    device_type: str
    memory_mib: int
    cores_percent: int


def parse_allocation(value: str) -> tuple[tuple[HamiDevice, ...], ...]:
    """The devices of each container segment of a ``hami.io/vgpu-devices-allocated`` value, in order (an empty
    segment is an empty tuple). An empty value is no segment at all. Raises ``HamiAnnotationError``."""
    if not isinstance(value, str):
        raise HamiAnnotationError(f"expected a string, got {type(value).__name__}")
    if value == "":
        return ()
    if not value.endswith(SEGMENT_TERMINATOR):
        raise HamiAnnotationError(f"{_shown(value)} does not end with {SEGMENT_TERMINATOR!r} (cut short?)")
    segments = value[: -len(SEGMENT_TERMINATOR)].split(SEGMENT_TERMINATOR)
    return tuple(_parse_segment(segment, index) for index, segment in enumerate(segments))


def _parse_segment(segment: str, index: int) -> tuple[HamiDevice, ...]:
    if segment == "":
        return ()
    where = f"container segment {index}"
    if not segment.endswith(ENTRY_TERMINATOR):
        raise HamiAnnotationError(f"{where} {_shown(segment)} does not end with {ENTRY_TERMINATOR!r}")
    devices: list[HamiDevice] = []
    seen: set[str] = set()
    for number, entry in enumerate(segment[: -len(ENTRY_TERMINATOR)].split(ENTRY_TERMINATOR)):
        device = _parse_entry(entry, f"{where} device {number}")
        if device.uuid.lower() in seen:
            raise HamiAnnotationError(f"{where}: {device.uuid} is given twice to one container")
        seen.add(device.uuid.lower())
        devices.append(device)
    return tuple(devices)


def _parse_entry(entry: str, where: str) -> HamiDevice:
    fields = entry.split(FIELD_SEPARATOR)
    if len(fields) < 4:
        raise HamiAnnotationError(f"{where} {_shown(entry)}: expected UUID,Type,UsedMemMiB,UsedCoresPercent")
    uuid, device_type, memory, cores = fields[:4]
    if len(uuid) > MAX_UUID_CHARS or _UUID.fullmatch(uuid) is None:
        raise HamiAnnotationError(f"{where}: {_shown(uuid)} is not an NVML GPU or MIG uuid")
    if not device_type or not device_type.isascii() or not device_type.isprintable():
        raise HamiAnnotationError(f"{where}: device type {_shown(device_type)} is empty or not printable ASCII")
    memory_mib = _number(memory, f"{where} memory (MiB)", MAX_INT32)
    cores_percent = _number(cores, f"{where} cores (%)", MAX_CORES_PERCENT)
    return HamiDevice(uuid, device_type, memory_mib, cores_percent)


def _number(text: str, where: str, maximum: int) -> int:
    if _DECIMAL.fullmatch(text) is None:
        raise HamiAnnotationError(f"{where}: {_shown(text)} is not a non-negative decimal integer")
    value = int(text)
    if value > maximum:
        raise HamiAnnotationError(f"{where}: {value} is above {maximum}")
    return value


def containers_of(segments: Sequence[tuple[HamiDevice, ...]], init_containers: Sequence[str],
                  containers: Sequence[str]) -> dict[str, tuple[HamiDevice, ...]]:
    """Container name -> its devices, for the containers that have any. The segments are the init containers'
    then the regular containers' (current HAMi), or the regular containers' alone (HAMi before it counted init
    containers): with init containers the two counts differ, so the count says which. Any other count is
    ``HamiAnnotationError``: the annotation is not this pod's."""
    if len(segments) == len(init_containers) + len(containers):
        names = [*init_containers, *containers]
    elif len(segments) == len(containers):
        names = list(containers)
    else:
        raise HamiAnnotationError(
            f"{len(segments)} container segments for a pod with {len(init_containers)} init and "
            f"{len(containers)} regular containers")
    return {name: devices for name, devices in zip(names, segments) if devices}


def is_hami_placeholder(device_id: str) -> bool:
    """Whether ``device_id`` is a slot id of HAMi's device plugin (``GPU-<uuid>-<n>``), which names no device."""
    return isinstance(device_id, str) and _PLACEHOLDER.fullmatch(device_id) is not None


def _shown(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")
