"""Range checks on decoded input records: values no real record can hold. One module for every consumer.

Each ``check_*`` function returns None for a possible record and raises ``OutOfRange`` (reason ``OUT_OF_RANGE``)
naming the first impossible value otherwise; the runner (``gpumeter.stream.runner``) turns that into a
``DeadLetter``.
They are pure: the time to judge timestamps against comes in as ``now_unix_ms``.

Names first: every name, namespace, label, resource name and id a record carries must have the syntax Kubernetes
itself enforces (or, for ids Kubernetes does not define, letters, digits and ``-._:/``), else ``InvalidName``
(reason ``INVALID_NAME``). The API server refuses anything else, so such a record is forged or broken; refused
here, its text never reaches the ledger, a report, a log line or an Alertmanager label (a namespace ``=cmd()``
would be a spreadsheet formula, a pod name with a newline a forged log line, ANSI or HTML a label that rewrites
someone's screen). The rules (``check_names`` of ``PodEvent``; the same for the names in samples, shares and cost
lines):

* pod name, node name, workload name, the prefix of a qualified name: DNS-1123 subdomain (lower-case letters,
  digits, ``-`` and ``.``, at most 253, each dot-separated part at most 63, alphanumeric at both ends);
* namespace, container name: DNS-1123 label (the same without dots, at most 63);
* label keys, annotation keys, resource names (``nvidia.com/gpu``): qualified names (an optional subdomain prefix
  and ``/``, then at most 63 of letters, digits, ``-``, ``_``, ``.``, alphanumeric at both ends);
* label values: empty, or at most 63 with the name part's syntax;
* uids, GPU and MIG uuids, container ids, device-plugin ids, the cluster name: ids as above, at most 253;
  resource versions the same or empty; a phase letters only; a workload kind a letter then letters and digits.

Annotation values and ``NVIDIA_VISIBLE_DEVICES`` values are free text in Kubernetes too and are not refused: where
they are shown, ``gpumeter.safetext`` escapes them.

Who calls what (the decode/validate step of each service):

* attributor: ``check_sample`` (inside ``AttributionEngine.on_sample``, so ``gpumeter replay`` judges alike) and
  ``check_pod_event`` on its two input topics;
* guard: ``check_node_sample`` (``check_sample``, on the v4 record's arrays while the sample holds them),
  ``check_pod_event``, ``check_window_shares`` and ``check_window_cost``, one per input topic (whether a unit's shares add up to 1 is a matter of money, checked by billing);
* billing: ``check_window_shares`` on each node-window before pricing it (the checks of money, such as unit
  shares that must add up to 1, are the costing's: ``InconsistentShares``).

Timestamps: a record stamped more than ``max_clock_skew_ms`` ahead of the consumer's clock is impossible (its
clock is broken, or its unit is wrong); one before ``EARLIEST_UNIX_MS`` (2000-01-01) is a zero, a negative or a
seconds-for-milliseconds mix-up. Samples also have a maximum age (``max_age_ms``): no collector buffers a tick
for days and the samples topic keeps one day, so an older tick can only be garbage -- and attributed, it would
open a window long closed everywhere else. Pod events have no maximum age (the compacted topic keeps a pod's
last event for as long as the pod lives). Shares and costs have none either: the attributor only emits windows
of ticks it accepted, and a ledger may legitimately receive an old window re-emitted after a restore.

What is *not* an error here, because the collector reports it on purpose: a lost GPU's zeros, the zeros of a
device whose memory info failed (its processes' memory is then not compared with them), unknown
utilization (None), a process of no known pod or container (index -1), unknown per-process memory (-1, NVML's
"not available") and no per-process SM sample (-1).
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from gpumeter.errors import InvalidName, OutOfRange
from schemas.packed import MISSING_I4, MISSING_I8, PackedNodeSample, column_ints
from schemas.records import (
    MEMORY_INFO_FUNCTION,
    GpuDeviceSample,
    NodeSample,
    NodeWindowCost,
    NodeWindowShares,
    PodEvent,
    RecordShapeError,
    WindowPod,
)

EARLIEST_UNIX_MS = 946_684_800_000  # 2000-01-01T00:00:00Z
DEFAULT_MAX_CLOCK_SKEW_SECONDS = 120  # the attributor: a tick from the future moves its node's watermark
# Billing and the guard: a record from the future there misleads only what it is about (one node-window's bill,
# one node's, pod's or unit's newest), so the bound only has to catch a broken clock or a wrong unit. An hour also
# keeps ``gpumeter run``'s simulated clock (ahead of the wall clock by its speed-up) inside it for minutes of run.
DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS = 3600
DEFAULT_MAX_SAMPLE_AGE_SECONDS = 7 * 86_400
SHARE_TOLERANCE = 1e-6
_NO_LIMIT = 2**63
COVERED_SECONDS_TOLERANCE = 1e-3  # as billing's costing: covered time is summed from float tick intervals

__all__ = [
    "DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS",
    "DEFAULT_MAX_CLOCK_SKEW_SECONDS",
    "DEFAULT_MAX_SAMPLE_AGE_SECONDS",
    "EARLIEST_UNIX_MS",
    "SHARE_TOLERANCE",
    "check_names",
    "check_pod_event",
    "check_node_sample",
    "check_sample",
    "check_sample_names",
]


# -- names ------------------------------------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_IDENTIFIER = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?")
_PHASE = re.compile(r"[A-Za-z]*")
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9]*")


def _dns_subdomain(value: str) -> bool:
    return (0 < len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None
            and all(len(part) <= 63 for part in value.split(".")))


def _qualified_name(value: str) -> bool:
    prefix, slash, name = value.rpartition("/")
    if slash and not _dns_subdomain(prefix):
        return False
    return 0 < len(name) <= 63 and _NAME_PART.fullmatch(name) is not None


# kind -> (rule, what the error says it must be)
_SYNTAX = {
    "subdomain": (_dns_subdomain, "a DNS-1123 subdomain (lower-case letters, digits, '-', '.'; at most 253)"),
    "label": (lambda v: 0 < len(v) <= 63 and _DNS_LABEL.fullmatch(v) is not None,
              "a DNS-1123 label (lower-case letters, digits, '-'; at most 63)"),
    "qualified": (_qualified_name, "a qualified name ([subdomain/]name; letters, digits, '-', '_', '.'; at most 63)"),
    "label_value": (lambda v: len(v) <= 63 and (v == "" or _NAME_PART.fullmatch(v) is not None),
                    "a label value (empty, or letters, digits, '-', '_', '.'; at most 63)"),
    "id": (lambda v: 0 < len(v) <= 253 and _IDENTIFIER.fullmatch(v) is not None,
           "an id (letters, digits, '-', '_', '.', ':', '/'; at most 253)"),
    "version": (lambda v: v == "" or (len(v) <= 253 and _IDENTIFIER.fullmatch(v) is not None),
                "a resource version (letters, digits, '-', '_', '.', ':', '/'; at most 253)"),
    "phase": (lambda v: len(v) <= 63 and _PHASE.fullmatch(v) is not None, "a phase (letters only)"),
    "kind": (lambda v: 0 < len(v) <= 63 and _KIND.fullmatch(v) is not None, "a kind (a letter, then letters and "
                                                                              "digits)"),
}


@lru_cache(maxsize=1 << 16)
def _valid(kind: str, value: str) -> bool:
    # Cached: the same names come in with every tick, share and event.
    return _SYNTAX[kind][0](value)


def shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message may quote it: ``repr`` (every control character escaped), cut at ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _check_name(where: str, field: str, value: str | None, kind: str) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not _valid(kind, value):
        raise InvalidName(f"{where}: {field} {shown(value)} is not {_SYNTAX[kind][1]}")


def _check_labels(where: str, field: str, labels: Mapping[str, str], *, values: bool = True) -> None:
    for key, value in labels.items():
        _check_name(where, f"{field} key", key, "qualified")
        if values:
            _check_name(where, f"{field} {key}", value, "label_value")


def check_names(event: PodEvent) -> None:
    """Raise ``InvalidName`` for the first name, label, resource name or id of ``event`` whose syntax the API server
    would have refused (see the module docstring); the message quotes it escaped."""
    where = f"pod event {shown(event.uid, 60)}"
    _check_name(where, "uid", event.uid, "id")
    _check_name(where, "cluster", event.cluster, "id")
    _check_name(where, "node name", event.node_name, "subdomain")
    _check_name(where, "namespace", event.namespace, "label")
    _check_name(where, "name", event.name, "subdomain")
    _check_name(where, "resource version", event.resource_version, "version")
    _check_name(where, "phase", event.phase, "phase")
    _check_name(where, "workload kind", event.workload_kind, "kind")
    _check_name(where, "workload name", event.workload_name, "subdomain")
    _check_labels(where, "label", event.labels)
    _check_labels(where, "annotation", event.annotations, values=False)
    for resource in event.gpu_requests:
        _check_name(where, "requested resource", resource, "qualified")
    for container in event.containers:
        _check_name(where, "container name", container.name, "label")
        _check_name(where, f"container {container.name} id", container.container_id, "id")
        for resource in container.gpu_requests:
            _check_name(where, f"container {container.name} requested resource", resource, "qualified")
        for assignment in container.assigned_devices:
            _check_name(where, f"container {container.name} assigned resource", assignment.resource_name,
                        "qualified")
            for device_id in assignment.device_ids:
                _check_name(where, f"container {container.name} device id", device_id, "id")


def _check_time(where: str, name: str, value: int, now_unix_ms: int, max_clock_skew_ms: int) -> None:
    if value < EARLIEST_UNIX_MS:
        raise OutOfRange(f"{where}: {name} {value} is before 2000-01-01 (ms since the Unix epoch expected)")
    if value > now_unix_ms + max_clock_skew_ms:
        raise OutOfRange(f"{where}: {name} {value} is {value - now_unix_ms} ms in the future (allowed clock skew "
                         f"{max_clock_skew_ms} ms)")


def _check_fraction(where: str, name: str, value: float) -> None:
    if not math.isfinite(value) or not -SHARE_TOLERANCE <= value <= 1 + SHARE_TOLERANCE:
        raise OutOfRange(f"{where}: {name} {value!r} outside [0, 1]")


def _first_duplicate(values: Iterable) -> object | None:
    seen = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


def _first_duplicate_in(values: tuple) -> object | None:
    """``_first_duplicate`` of a sequence, with one C-level set build when there is none (the common case)."""
    try:
        if len(set(values)) == len(values):
            return None
    except TypeError:
        pass  # an unhashable value: the loop raises where it always did
    return _first_duplicate(values)


def check_sample(sample: NodeSample, now_unix_ms: int, max_clock_skew_ms: int,
                 max_age_ms: int | None = None, *, names: bool = True) -> None:
    """Raise ``OutOfRange`` when ``sample`` holds values no real tick can have; return None otherwise.

    Impossible: sampled further in the future than ``now + max_clock_skew_ms`` (it would move the node's watermark
    and make its real ticks late), sampled before 2000 or more than ``max_age_ms`` before now (when given), a
    negative sequence or interval; the same pod uid listed twice; per device: the same uuid twice in the tick, a
    MIG instance whose parent GPU is not in the tick (an unknown GPU), negative or more-than-total memory (used,
    free, reserved, and any one process), device utilization outside [0, 100], negative power, fewer than one
    replica, MIG slices outside [0, total]; per process: arrays of different lengths, the same pid twice on one
    device, a negative pid, a pod index outside [-1, pod count) (an unknown pod), memory below -1, SM
    utilization outside [-1, 100]. Container ids and indexes are carried for people, read by no consumer, and
    not checked. The first impossible value in that order is the one named. Before all that, ``InvalidName`` for
    a cluster, node name, pod uid, container id or GPU/MIG uuid of the wrong syntax (``names=False``: the caller
    ran ``check_sample_names`` already).
    """
    if names:
        _check_sample_names(sample)
    # Runs on every tick the attributor takes in: each group of checks is one plain condition, and only when it
    # fails are the values walked again, in the documented order, to name the first impossible one.
    sampled_at = sample.sampled_at_unix_ms
    if (sampled_at < EARLIEST_UNIX_MS or sampled_at > now_unix_ms + max_clock_skew_ms
            or (max_age_ms is not None and sampled_at < now_unix_ms - max_age_ms)
            or sample.sequence < 0 or sample.interval_ms < 0):
        where = _sample_where(sample)
        _check_time(where, "sampled_at", sampled_at, now_unix_ms, max_clock_skew_ms)
        if max_age_ms is not None and sampled_at < now_unix_ms - max_age_ms:
            raise OutOfRange(f"{where}: sampled_at {sampled_at} is {now_unix_ms - sampled_at}"
                             f" ms old (at most {max_age_ms} ms allowed)")
        if sample.sequence < 0:
            raise OutOfRange(f"{where}: negative sequence {sample.sequence}")
        raise OutOfRange(f"{where}: negative interval_ms {sample.interval_ms}")
    pod_uids = sample.pod_uids
    duplicate = _first_duplicate_in(pod_uids)
    if duplicate is not None:
        raise OutOfRange(f"{_sample_where(sample)}: pod_uids lists {duplicate!r} twice")
    devices = sample.devices
    duplicate = _first_duplicate(dev.uuid for dev in devices)
    if duplicate is not None:
        raise OutOfRange(f"{_sample_where(sample)}: device {duplicate} listed twice")
    gpus = {dev.uuid: dev for dev in devices if dev.parent_uuid is None}
    pod_count = len(pod_uids)
    for dev in devices:
        total = dev.memory_total_bytes
        used = dev.memory_used_bytes
        free = dev.memory_free_bytes
        reserved = dev.memory_reserved_bytes
        gpu_util = dev.gpu_utilization_percent
        memory_util = dev.memory_utilization_percent
        if ((dev.parent_uuid is not None and dev.parent_uuid not in gpus)
                or total < 0 or used < 0 or free < 0 or reserved < 0
                or used > total or free > total or reserved > total
                or (gpu_util is not None and not 0 <= gpu_util <= 100)
                or (memory_util is not None and not 0 <= memory_util <= 100)
                or (dev.power_milliwatts is not None and dev.power_milliwatts < 0)
                or dev.replicas < 1 or dev.mig_compute_slices < 0 or dev.mig_total_compute_slices < 0
                or dev.mig_compute_slices > 0):
            # Something to name, or MIG slices to compare with their total (the instance's or its parent's).
            _check_device(_sample_where(sample), dev, gpus)
        pids = dev.process_pids
        pods = dev.process_pod_index
        memory = dev.process_used_memory_bytes
        sm = dev.process_sm_utilization_percent
        n = len(pids)
        if len(pods) != n or len(memory) != n or len(sm) != n:
            raise OutOfRange(
                f"{_sample_where(sample)} device {dev.uuid}: per-process arrays differ in length (pids "
                f"{len(dev.process_pids)}, pods {len(dev.process_pod_index)}, memory "
                f"{len(dev.process_used_memory_bytes)}, sm "
                f"{len(dev.process_sm_utilization_percent)})"
            )
        duplicate = _first_duplicate_in(pids)
        if duplicate is not None:
            raise OutOfRange(f"{_sample_where(sample)} device {dev.uuid}: process {duplicate} listed twice")
        # A device whose memory info failed has no total to compare a process with (its figures are 0, unknown).
        limit = total if dev.memory_known else _NO_LIMIT
        for pid, pod, used_bytes, sm_percent in zip(pids, pods, memory, sm):
            if (pid < 0 or not -1 <= pod < pod_count or used_bytes < -1 or used_bytes > limit
                    or not -1 <= sm_percent <= 100):
                _check_process(f"{_sample_where(sample)} device {dev.uuid}", pid, pod, pod_count, used_bytes, limit,
                               sm_percent)
        servers = dev.mps_server_pids
        if servers and not set(servers) <= set(pids):
            raise OutOfRange(f"{_sample_where(sample)} device {dev.uuid}: MPS server pids {list(servers)} are not "
                             "all among its processes")


_VALID_SAMPLE_NAMES: set[tuple] = set()
_VALID_SAMPLE_NAMES_MAX = 4096


def check_sample_names(sample: NodeSample) -> None:
    """The names part of ``check_sample`` alone: ``InvalidName`` for a name of the wrong syntax."""
    _check_sample_names(sample)


def _check_sample_names(sample: NodeSample) -> None:
    # A node's names change rarely between its ticks: one set lookup for the common case keeps the hot path cheap.
    key = (sample.cluster, sample.node_name, tuple(sample.pod_uids),
           tuple([(dev.uuid, dev.parent_uuid) for dev in sample.devices]))
    if key in _VALID_SAMPLE_NAMES:
        return
    where = f"tick {sample.collector_started_at_unix_ms}/{sample.sequence}"
    _check_name(where, "cluster", sample.cluster, "id")
    _check_name(where, "node name", sample.node_name, "subdomain")
    for uid in sample.pod_uids:
        _check_name(where, "pod uid", uid, "id")
    for dev in sample.devices:
        _check_name(where, "device uuid", dev.uuid, "id")
        _check_name(where, "device parent uuid", dev.parent_uuid, "id")
    if len(_VALID_SAMPLE_NAMES) >= _VALID_SAMPLE_NAMES_MAX:
        _VALID_SAMPLE_NAMES.clear()
    _VALID_SAMPLE_NAMES.add(key)


def _sample_where(sample: NodeSample) -> str:
    return f"node {sample.node_name} tick {sample.collector_started_at_unix_ms}/{sample.sequence}"


def _check_process(unit: str, pid: int, pod: int, pod_count: int, used_bytes: int, total: int,
                   sm_percent: int) -> None:
    """The per-process checks of ``check_sample``, in its order, naming the first impossible value."""
    if pid < 0:
        raise OutOfRange(f"{unit}: negative pid {pid}")
    if not -1 <= pod < pod_count:
        raise OutOfRange(f"{unit}: process {pid} names pod {pod} of {pod_count} (unknown pod)")
    if used_bytes < -1:
        raise OutOfRange(f"{unit}: process {pid} has negative used memory {used_bytes}")
    if used_bytes > total:
        raise OutOfRange(f"{unit}: process {pid} uses {used_bytes} bytes of {total}")
    if not -1 <= sm_percent <= 100:
        raise OutOfRange(f"{unit}: process {pid} SM utilization {sm_percent} outside [-1, 100]")


def _check_device(where: str, dev: GpuDeviceSample, gpus: dict[str, GpuDeviceSample]) -> None:
    """The device-level checks of ``check_sample``, in its order, naming the first impossible value."""
    unit = f"{where} device {dev.uuid}"
    if dev.parent_uuid is not None and dev.parent_uuid not in gpus:
        raise OutOfRange(f"{unit}: MIG instance of GPU {dev.parent_uuid}, which is not in the tick")
    for name in ("memory_total_bytes", "memory_used_bytes", "memory_free_bytes", "memory_reserved_bytes"):
        if getattr(dev, name) < 0:
            raise OutOfRange(f"{unit}: negative {name} {getattr(dev, name)}")
    for name in ("memory_used_bytes", "memory_free_bytes", "memory_reserved_bytes"):
        if getattr(dev, name) > dev.memory_total_bytes:
            raise OutOfRange(f"{unit}: {name} {getattr(dev, name)} > total {dev.memory_total_bytes}")
    for name in ("gpu_utilization_percent", "memory_utilization_percent"):
        value = getattr(dev, name)
        if value is not None and not 0 <= value <= 100:
            raise OutOfRange(f"{unit}: {name} {value} outside [0, 100]")
    if dev.power_milliwatts is not None and dev.power_milliwatts < 0:
        raise OutOfRange(f"{unit}: negative power_milliwatts {dev.power_milliwatts}")
    if dev.replicas < 1:
        raise OutOfRange(f"{unit}: replicas {dev.replicas} < 1")
    # An instance may leave the GPU's slice count to its parent (0 on the instance).
    total_slices = dev.mig_total_compute_slices or (
        gpus[dev.parent_uuid].mig_total_compute_slices if dev.parent_uuid is not None else 0)
    if dev.mig_compute_slices < 0 or dev.mig_total_compute_slices < 0 or (
            total_slices > 0 and dev.mig_compute_slices > total_slices):
        raise OutOfRange(f"{unit}: MIG slices {dev.mig_compute_slices} of {total_slices}")


def check_pod_event(event: PodEvent, now_unix_ms: int, max_clock_skew_ms: int) -> None:
    """Raise ``OutOfRange`` for a pod event no API server can have produced: no uid or node, observed before 2000
    or further ahead than ``now + max_clock_skew_ms`` (an event from the future would make every real later event
    of the pod look stale, and move the pod index's clock past every deleted pod's linger), started at a
    negative time or in the future, or a negative GPU request. ``InvalidName`` for a name of the wrong syntax
    (``check_names``)."""
    if not event.uid:
        raise OutOfRange(f"pod event of {shown(event.namespace, 70)}/{shown(event.name, 70)}: empty uid")
    if not event.node_name:
        raise OutOfRange(f"pod event {shown(event.uid, 60)}: empty node name")
    check_names(event)
    where = f"pod event of {event.namespace}/{event.name} ({event.uid})"
    _check_time(where, "observed_at", event.observed_at_unix_ms, now_unix_ms, max_clock_skew_ms)
    started = event.started_at_unix_ms
    if started is not None and not 0 <= started <= now_unix_ms + max_clock_skew_ms:
        raise OutOfRange(f"{where}: started_at {started} is negative or further ahead than the allowed clock skew")
    for resource, count in event.gpu_requests.items():
        if count < 0:
            raise OutOfRange(f"{where}: negative request {count} of {resource}")
    for container in event.containers:
        for resource, count in container.gpu_requests.items():
            if count < 0:
                raise OutOfRange(f"{where} container {container.name}: negative request {count} of {resource}")


def _check_window(where: str, start_unix_ms: int, window_seconds: int, now_unix_ms: int,
                  max_clock_skew_ms: int) -> None:
    if window_seconds <= 0:
        raise OutOfRange(f"{where}: window_seconds {window_seconds} must be > 0")
    _check_time(where, "window start", start_unix_ms, now_unix_ms, max_clock_skew_ms)
    end = start_unix_ms + window_seconds * 1000
    if end > now_unix_ms + max_clock_skew_ms:
        raise OutOfRange(f"{where}: the window ends {end - now_unix_ms} ms in the future; a share or cost exists "
                         f"only once its window closed (allowed clock skew {max_clock_skew_ms} ms)")


def _check_window_pods(where: str, pods: Iterable[WindowPod]) -> None:
    uids = []
    for pod in pods:
        _check_name(where, "pod uid", pod.pod_uid, "id")
        _check_name(where, "namespace", pod.namespace, "label")
        _check_name(where, "pod name", pod.pod_name, "subdomain")
        _check_labels(where, "label", pod.labels)
        for key in pod.carried_label_keys:
            _check_name(where, "carried label key", key, "qualified")
        _check_name(where, "workload kind", pod.workload_kind, "kind")
        _check_name(where, "workload name", pod.workload_name, "subdomain")
        if pod.cpu_request_millicores < 0 or pod.memory_request_bytes < 0:
            raise OutOfRange(f"{where}: pod {pod.pod_uid}: negative requests")
        uids.append(pod.pod_uid)
    duplicate = _first_duplicate_in(tuple(uids))
    if duplicate is not None:
        raise OutOfRange(f"{where}: pod {duplicate} is listed twice")


def check_window_shares(shares: NodeWindowShares, now_unix_ms: int, max_clock_skew_ms: int) -> None:
    """Raise ``OutOfRange`` for a ``NodeWindowShares`` that cannot be true on its own: arrays that do not line up
    or indexes that name no pod (``check_shape``), no unit or a unit without rows, a unit or pod listed twice, a
    window not ended yet (beyond the clock skew) or starting before 2000, covered seconds outside [0, window] or
    not finite, a GPU fraction outside (0, 1], a memory/compute/cost share outside [0, 1] or not finite, negative
    average memory or sample count. ``InvalidName`` for a name of the wrong syntax. Whether each unit's shares add
    up to 1 is a check of money, billing's (``InconsistentShares``)."""
    where = f"shares of {shown(shares.cluster)}/{shown(shares.node_name)}@{shares.window_start_unix_ms}"
    try:
        shares.check_shape()
    except RecordShapeError as exc:
        raise OutOfRange(f"{where}: {exc}") from exc
    _check_name(where, "cluster", shares.cluster, "id")
    _check_name(where, "node name", shares.node_name, "subdomain")
    _check_window(where, shares.window_start_unix_ms, shares.window_seconds, now_unix_ms, max_clock_skew_ms)
    window = shares.window_seconds + COVERED_SECONDS_TOLERANCE
    if not math.isfinite(shares.node_covered_seconds) or not 0 <= shares.node_covered_seconds <= window:
        raise OutOfRange(f"{where}: node_covered_seconds {shares.node_covered_seconds!r} outside "
                         f"[0, {shares.window_seconds}]")
    if not shares.units:
        raise OutOfRange(f"{where}: a node-window has at least one unit")
    _check_window_pods(where, shares.pods)
    duplicate = _first_duplicate_in(tuple(u.gpu_uuid for u in shares.units))
    if duplicate is not None:
        raise OutOfRange(f"{where}: unit {duplicate} is listed twice")
    for unit in shares.units:
        at = f"{where} unit {unit.gpu_uuid}"
        _check_name(where, "gpu uuid", unit.gpu_uuid, "id")
        _check_name(where, "parent gpu uuid", unit.parent_gpu_uuid, "id")
        if not unit.subject_kinds:
            raise OutOfRange(f"{at}: a unit has at least one row")
        if not math.isfinite(unit.covered_seconds) or not 0 <= unit.covered_seconds <= window:
            raise OutOfRange(f"{at}: covered_seconds {unit.covered_seconds!r} outside [0, {shares.window_seconds}]")
        if not math.isfinite(unit.gpu_fraction) or not 0 < unit.gpu_fraction <= 1 + SHARE_TOLERANCE:
            raise OutOfRange(f"{at}: gpu_fraction {unit.gpu_fraction!r} outside (0, 1]")
        if unit.sample_count < 0:
            raise OutOfRange(f"{at}: negative sample_count {unit.sample_count}")
        for name in ("memory_share", "compute_share", "cost_share"):
            for value in getattr(unit, name):
                _check_fraction(at, name, value)
        for value in unit.memory_used_bytes_avg:
            if not math.isfinite(value) or value < 0:
                raise OutOfRange(f"{at}: memory_used_bytes_avg {value!r} must be >= 0")


def check_window_cost(cost: NodeWindowCost, now_unix_ms: int, max_clock_skew_ms: int) -> None:
    """Raise ``OutOfRange`` for a ``NodeWindowCost`` that cannot be true: line arrays that do not line up, indexes
    that name nothing, lines that do not add up to the bill (``check_shape``), a negative cost, a GPU part larger
    than the bill or a node_other that is not the rest, a share outside [0, 1], a window not ended yet (beyond the
    clock skew) or starting before 2000. ``InvalidName`` for a name of the wrong syntax."""
    where = f"bill of {shown(cost.cluster)}/{shown(cost.node_name)}@{cost.window_start_unix_ms}"
    try:
        cost.check_shape()
    except RecordShapeError as exc:
        raise OutOfRange(f"{where}: {exc}") from exc
    _check_name(where, "cluster", cost.cluster, "id")
    _check_name(where, "node name", cost.node_name, "subdomain")
    _check_window(where, cost.window_start_unix_ms, cost.window_seconds, now_unix_ms, max_clock_skew_ms)
    for uuid in cost.unit_uuids:
        _check_name(where, "gpu uuid", uuid, "id")
    _check_window_pods(where, cost.pods)
    if cost.node_cost_micro_usd < 0 or not 0 <= cost.gpu_cost_micro_usd <= cost.node_cost_micro_usd:
        raise OutOfRange(f"{where}: node cost {cost.node_cost_micro_usd} and GPU part {cost.gpu_cost_micro_usd} "
                         "micro-USD cannot be")
    if cost.node_other_micro_usd != cost.node_cost_micro_usd - cost.gpu_cost_micro_usd:
        raise OutOfRange(f"{where}: node_other {cost.node_other_micro_usd} is not the bill less its GPU part")
    if not 0 <= cost.billed_milliseconds <= cost.window_seconds * 1000 + COVERED_SECONDS_TOLERANCE * 1000:
        raise OutOfRange(f"{where}: billed_milliseconds {cost.billed_milliseconds} outside the window")
    for micro in cost.line_cost_micro_usd:
        if micro < 0:
            raise OutOfRange(f"{where}: negative cost line {micro} micro-USD")
    for name in ("line_cost_share", "line_memory_share", "line_compute_share"):
        for value in getattr(cost, name):
            _check_fraction(where, name, value)


_NO_PARENTS = np.array([-1], dtype="<i2").tobytes()  # device_parent_uuid of a GPU
_GPU_NAME_PAIRS: dict[tuple[str, ...], tuple[tuple[str, None], ...]] = {}
# Pod lists and process lists (pids, pod slots) seen valid, by their columns' bytes: a node's ticks repeat them. Keys
# are tuples of the record's own bytes objects, not one joined copy: a bytes object hashes once (its hash is kept),
# and the pod list's is hashed again by the decoder's own cache (``pod_uid_strings``).
_UNIQUE_LISTS: set[tuple] = set()
_UNIQUE_LISTS_MAX = 16_384


def _unique_list_seen(key: tuple, unique: Callable[[], bool]) -> bool:
    if key in _UNIQUE_LISTS:
        return True
    if not unique():
        return False
    if len(_UNIQUE_LISTS) >= _UNIQUE_LISTS_MAX:
        _UNIQUE_LISTS.clear()
    _UNIQUE_LISTS.add(key)
    return True


# Device columns a node repeats tick to tick (total and reserved memory, replicas, MIG slices), seen to pass their
# checks, by their bytes -> (the smallest total, whether every device's total is that one). Bounded like _UNIQUE_LISTS.
_STATIC_DEVICE_COLUMNS: dict[tuple[bytes, ...], tuple[int, bool]] = {}
# Process memory columns seen, by their bytes -> (smallest, largest): a process's allocation moves rarely.
_PROCESS_MEMORY_BOUNDS: dict[bytes, tuple[int, int]] = {}
_min_of, _max_of = np.minimum.reduce, np.maximum.reduce  # ndarray.min/max less their Python wrapper


def _static_devices(sample: PackedNodeSample, raw: Mapping[str, bytes]) -> tuple[int, bool] | None:
    """(smallest total, whether all totals are equal) when every device has 0 <= reserved <= total, replicas >= 1,
    no MIG compute slices and a non-negative slice total; None otherwise. Judged once per distinct set of columns
    (every column's length is the device count times its fixed item size, so two sets cannot share a key)."""
    key = (raw["device_memory_total_bytes"], raw["device_memory_reserved_bytes"], raw["device_replicas"],
           raw["device_mig_compute_slices"], raw["device_mig_total_compute_slices"])
    found = _STATIC_DEVICE_COLUMNS.get(key)
    if found is not None:
        return found
    totals = sample.device_memory_total_bytes.tolist()
    for t, r, replicas, slices, total_slices in zip(
            totals, sample.device_memory_reserved_bytes.tolist(), sample.device_replicas.tolist(),
            sample.device_mig_compute_slices.tolist(), sample.device_mig_total_compute_slices.tolist()):
        if not (0 <= r <= t and replicas >= 1 and slices == 0 and total_slices >= 0):
            return None
    smallest = min(totals)
    if len(_STATIC_DEVICE_COLUMNS) >= _UNIQUE_LISTS_MAX:
        _STATIC_DEVICE_COLUMNS.clear()
    found = _STATIC_DEVICE_COLUMNS[key] = (smallest, smallest == max(totals))
    return found


def _percents_valid(values: Sequence[int]) -> bool:
    """Every value in [0, 100] or the missing sentinel."""
    return (min(values) >= 0 and max(values) <= 100) or all(0 <= v <= 100 or v == MISSING_I4 for v in values)


def _clearly_valid(sample: PackedNodeSample, now_unix_ms: int, max_clock_skew_ms: int, max_age_ms: int | None) -> bool:
    """True only when the record passes every ``check_sample`` range check, judged by a few whole-column bounds
    (the common tick: whole GPUs, no MPS server, no uid in text); False means "look closer", never "invalid".

    What a node repeats from tick to tick (its pod list, its processes, its devices' totals) is judged once per
    distinct value (the caches above); what moves every tick (used and free memory, utilization, power, SM
    utilization) is judged each tick by its smallest and largest value."""
    sampled_at = sample.sampled_at_unix_ms
    devices = sample.device_count
    raw = sample.raw_columns  # the columns' bytes: cache keys, and the few values read here, need no array
    if (sample.pod_uid_texts or sampled_at < EARLIEST_UNIX_MS or sampled_at > now_unix_ms + max_clock_skew_ms
            or (max_age_ms is not None and sampled_at < now_unix_ms - max_age_ms)
            or sample.sequence < 0 or sample.interval_ms < 0 or not devices or raw["mps_server_pids"]
            or len(set(sample.device_uuids)) != devices
            or raw["device_parent_uuid"] != _NO_PARENTS * devices):
        return False
    pod_uids_raw = raw["pod_uids"]
    if not _unique_list_seen(("p", pod_uids_raw), lambda: _uids_unique(sample.pod_uids)):
        return False
    static = _static_devices(sample, raw)
    if static is None:
        return False
    smallest_total, uniform = static
    used, free = column_ints(raw["device_memory_used_bytes"], "q"), column_ints(raw["device_memory_free_bytes"], "q")
    if uniform:  # every device's total is smallest_total: each column against it by its extremes
        if min(used) < 0 or max(used) > smallest_total or min(free) < 0 or max(free) > smallest_total:
            return False
    elif not all(0 <= u <= t and 0 <= f <= t
                 for t, u, f in zip(sample.device_memory_total_bytes.tolist(), used, free)):
        return False
    power = column_ints(raw["device_power_milliwatts"], "q")
    if (not _percents_valid(column_ints(raw["device_gpu_utilization_percent"], "i"))
            or not _percents_valid(column_ints(raw["device_memory_utilization_percent"], "i"))
            or (min(power) < 0 and not all(p >= 0 or p == MISSING_I8 for p in power))):
        return False
    memory_raw = raw["process_used_memory_bytes"]
    if not memory_raw:
        return True
    bounds = _PROCESS_MEMORY_BOUNDS.get(memory_raw)
    if bounds is None:
        if len(_PROCESS_MEMORY_BOUNDS) >= _UNIQUE_LISTS_MAX:
            _PROCESS_MEMORY_BOUNDS.clear()
        memory = sample.process_used_memory_bytes
        bounds = _PROCESS_MEMORY_BOUNDS[memory_raw] = (int(_min_of(memory)), int(_max_of(memory)))
    # Every process's memory against the smallest total: enough where it passes (a device whose memory is unknown
    # only raises its own limit).
    if bounds[0] < -1 or bounds[1] > smallest_total:
        return False
    sm = column_ints(raw["process_sm_utilization_percent"], "i")
    if min(sm) < -1 or max(sm) > 100:
        return False

    def processes_valid() -> bool:  # non-negative pids, each once per device; pod slots of this tick's pods
        pids, pods = sample.process_pid, sample.process_pod_index
        if pids.min() < 0 or pods.min() < -1 or pods.max() >= len(pod_uids_raw) // 16:
            return False
        keys = ((np.repeat(np.arange(devices, dtype=np.int64), sample.device_process_count) << 32)
                | (pids.astype(np.int64) & 0xFFFFFFFF))
        return len(np.unique(keys)) == len(keys)

    # A node's ticks repeat their processes: judged once per (pod count, processes per device, pids, pod slots).
    key = (len(pod_uids_raw) // 16, raw["device_process_count"], raw["process_pid"], raw["process_pod_index"])
    return _unique_list_seen(key, processes_valid)


def _uids_unique(pod_uids: np.ndarray) -> bool:
    """Whether no pod uid (16 bytes each) is in the list twice."""
    return len(np.unique(pod_uids)) == len(pod_uids)


def check_packed_sample_names(sample: PackedNodeSample, pod_uids: tuple[str, ...] | None = None) -> None:
    """``check_sample_names`` of a NodeSample v4 record: one set lookup when its names were seen valid before.
    ``pod_uids``: ``sample.pod_uid_strings()`` when the caller has it already (the ``NodeSample`` decoded from the
    record carries it), else None."""
    uuids = sample.device_uuids
    if sample.column_bytes("device_parent_uuid") == _NO_PARENTS * len(uuids):  # whole GPUs: pairs repeat tick to tick
        pairs = _GPU_NAME_PAIRS.get(uuids)
        if pairs is None:
            if len(_GPU_NAME_PAIRS) >= _VALID_SAMPLE_NAMES_MAX:
                _GPU_NAME_PAIRS.clear()
            pairs = _GPU_NAME_PAIRS[uuids] = tuple((uuid, None) for uuid in uuids)
    else:
        pairs = tuple(zip(uuids, sample.device_parent_uuid_strings()))
    key = (sample.cluster, sample.node_name, sample.pod_uid_strings() if pod_uids is None else pod_uids, pairs)
    if key not in _VALID_SAMPLE_NAMES:
        _check_sample_names(sample.to_node_sample())


def check_node_sample(sample: NodeSample, now_unix_ms: int, max_clock_skew_ms: int,
                      max_age_ms: int | None = None) -> None:
    """``check_sample`` of any ``NodeSample``: on its arrays (``check_packed_sample``: the same verdict, reason
    code and message) while it holds the v4 record it was decoded from, on its objects otherwise."""
    packed = getattr(sample, "packed", None)
    if packed is not None:
        check_packed_sample(packed, now_unix_ms, max_clock_skew_ms, max_age_ms)
    else:
        check_sample(sample, now_unix_ms, max_clock_skew_ms, max_age_ms)


def check_packed_sample(sample: PackedNodeSample, now_unix_ms: int, max_clock_skew_ms: int,
                        max_age_ms: int | None = None, *, names: bool = True) -> None:
    """``check_sample`` on a NodeSample v4 record's arrays: the same verdict, reason code and message.

    The checks run as whole-array conditions (no Python object per process); only when one fails is the record
    converted and ``check_sample`` run on it, so the value named is the one ``check_sample`` names, in its order.
    Names are checked the same way, once per distinct set of names (``check_sample``'s own cache)."""
    if _clearly_valid(sample, now_unix_ms, max_clock_skew_ms, max_age_ms):
        if names:
            check_packed_sample_names(sample)
        return
    devices = sample.device_count
    sampled_at = sample.sampled_at_unix_ms
    total = sample.device_memory_total_bytes
    used, free = sample.device_memory_used_bytes, sample.device_memory_free_bytes
    reserved = sample.device_memory_reserved_bytes
    gpu_util, memory_util = sample.device_gpu_utilization_percent, sample.device_memory_utilization_percent
    power = sample.device_power_milliwatts
    uuids, parents = sample.device_uuids, sample.device_parent_uuid_strings()
    gpus = {u for u, p in zip(uuids, parents) if p is None}
    suspect = (
        sample.pod_uid_texts != ()  # uids in text: their duplicates and names are check_sample's to judge
        or sampled_at < EARLIEST_UNIX_MS or sampled_at > now_unix_ms + max_clock_skew_ms
        or (max_age_ms is not None and sampled_at < now_unix_ms - max_age_ms)
        or sample.sequence < 0 or sample.interval_ms < 0
        or not _uids_unique(sample.pod_uids)
        or len(set(uuids)) != devices
        or any(p is not None and p not in gpus for p in parents)
    )
    if not suspect and devices:
        suspect = bool(
            (total < 0).any() or (used < 0).any() or (free < 0).any() or (reserved < 0).any()
            or (used > total).any() or (free > total).any() or (reserved > total).any()
            or ((gpu_util != MISSING_I4) & ((gpu_util < 0) | (gpu_util > 100))).any()
            or ((memory_util != MISSING_I4) & ((memory_util < 0) | (memory_util > 100))).any()
            or ((power != MISSING_I8) & (power < 0)).any()
            or (sample.device_replicas < 1).any() or (sample.device_mig_compute_slices < 0).any()
            or (sample.device_mig_total_compute_slices < 0).any()
            or (sample.device_mig_compute_slices > 0).any()  # slices against their total: check_sample's walk
        )
    if not suspect and sample.process_count:
        pids, pods = sample.process_pid, sample.process_pod_index
        memory, sm = sample.process_used_memory_bytes, sample.process_sm_utilization_percent
        limit = total.copy()
        for position, error in sample.device_errors:
            if MEMORY_INFO_FUNCTION in error.nvml_function:
                limit[position] = np.iinfo(np.int64).max  # memory unknown: no total to compare a process with
        process_device = sample.process_device
        # (device, pid) as one int64: the same pid twice on one device is a repeated key.
        keys = (process_device.astype(np.int64) << 32) | (pids.astype(np.int64) & 0xFFFFFFFF)
        suspect = bool(
            (pids < 0).any() or (pods < -1).any() or (pods >= len(sample.pod_uids)).any()
            or (memory < -1).any() or (memory > limit[process_device]).any()
            or (sm < -1).any() or (sm > 100).any()
            or len(np.unique(keys)) != len(keys)
        )
        if not suspect and len(sample.mps_server_pids):
            server_devices = np.repeat(np.arange(devices, dtype=np.int64), sample.device_mps_server_count)
            server_keys = (server_devices << 32) | (sample.mps_server_pids.astype(np.int64) & 0xFFFFFFFF)
            suspect = not np.isin(server_keys, keys).all()
    if suspect:
        check_sample(sample.to_node_sample(), now_unix_ms, max_clock_skew_ms, max_age_ms, names=names)
        return
    if names:
        check_packed_sample_names(sample)
