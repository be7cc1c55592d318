"""How a pod's events fold into what is known of the pod: the one owner of those rules for every service.

The attributor (who held a unit, and when) and the guard (who may see one, whose alert is it) both keep pods from
the compacted pod-events topic; if they folded events differently they would disagree about who holds a GPU. The
rules, each a pure function of the previous state and one ``PodEvent``:

* **Order.** An event observed before the state it would replace is stale and ignored (a compacted topic, a replay
  or a redelivery bring them out of order); one with the same observation time and resource version is a
  duplicate and ignored too, unless it is the deletion of a pod not yet deleted (``is_stale``): a deletion the
  collector synthesises (a relist that no longer finds the pod) carries the last resource version it knew.
* **Life.** A pod lives ``[started_at, ended_at)``. ``started_at`` is ``status.startTime`` (an event without it
  keeps the one known before); ``ended_at`` is the earliest observation of a terminal phase (Succeeded, Failed) or
  of the deletion; ``deleted_at`` the earliest observation of the deletion (``fold_life``).
* **Devices.** The pod's GPU assignments are the ids the kubelet gave its containers for GPU resources
  (``schemas.devices.is_gpu_resource``), each id once (init containers hand theirs on to later containers); a
  deletion event without assignments keeps the ones known before, since the kubelet forgets a deleted pod's
  devices before the API server's deletion is read (``fold_assignments``).
* **Grouping labels.** The labels a pod's rows carry are, per key, the first of an order of sources that has the
  key: the pod's own labels (which whoever creates the pod writes) or its namespace's (``namespace_labels``,
  which the platform writes) (``GroupingLabelSources``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from schemas.devices import is_gpu_resource
from schemas.records import PodEvent, PodEventType

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class PodAssignment:
    """One GPU device id a container of the pod was given, for one resource; ``owning_claim`` the DRA claim that
    holds the device alone (``DeviceAssignment.owning_claim``), None for the device plugin's."""

    container_name: str
    resource_name: str
    device_id: str
    owning_claim: str | None = None


def is_stale(observed_at_unix_ms: int, resource_version: str, deleted: bool, event: PodEvent) -> bool:
    """Whether ``event`` is older than the state observed at ``observed_at_unix_ms`` with ``resource_version``
    (``deleted``: that state is of a deleted pod), or that same event again."""
    if event.observed_at_unix_ms < observed_at_unix_ms:
        return True
    return (event.observed_at_unix_ms == observed_at_unix_ms and event.resource_version == resource_version
            and (event.event_type is PodEventType.DELETED) == deleted)


def fold_life(ended_at_unix_ms: int | None, deleted_at_unix_ms: int | None, event: PodEvent
              ) -> tuple[int | None, int | None]:
    """(ended_at, deleted_at) after ``event``: the earliest observation of an end, and of the deletion."""
    ended, deleted = ended_at_unix_ms, deleted_at_unix_ms
    t = event.observed_at_unix_ms
    if event.event_type is PodEventType.DELETED:
        deleted = t if deleted is None else min(deleted, t)
    if event.event_type is PodEventType.DELETED or event.phase in TERMINAL_PHASES:
        ended = t if ended is None else min(ended, t)
    return ended, deleted


def fold_started(started_at_unix_ms: int | None, event: PodEvent) -> int | None:
    """``status.startTime`` after ``event``: its own, else the one known before."""
    return event.started_at_unix_ms if event.started_at_unix_ms is not None else started_at_unix_ms


def gpu_assignments(event: PodEvent) -> tuple[PodAssignment, ...]:
    """The event's GPU device ids, per container in spec order, each id once."""
    out: list[PodAssignment] = []
    seen: set[str] = set()
    for container in event.containers:
        for assignment in container.assigned_devices:
            if not is_gpu_resource(assignment.resource_name):
                continue
            for device_id in assignment.device_ids:
                if device_id in seen:
                    continue
                seen.add(device_id)
                out.append(PodAssignment(container.name, assignment.resource_name, device_id,
                                         assignment.owning_claim))
    return tuple(out)


def fold_assignments(previous: Iterable[PodAssignment], event: PodEvent) -> tuple[PodAssignment, ...]:
    """The pod's assignments after ``event`` (a deletion without any keeps the previous ones)."""
    current = gpu_assignments(event)
    if not current and event.event_type is PodEventType.DELETED:
        return tuple(previous)
    return current


# --- grouping labels: which of a pod's labels, or its namespace's, a share row carries -------------------------

SOURCE_POD = "pod"
SOURCE_NAMESPACE = "namespace"
LABEL_SOURCES = (SOURCE_NAMESPACE, SOURCE_POD)


@dataclass(frozen=True, slots=True)
class GroupingLabelSources:
    """Where the value of each grouping label comes from: an order of sources per key, the first source that has
    the key (even with an empty value) giving it. ``pod`` is the pod's own labels, which whoever creates the pod
    writes; ``namespace`` is its Namespace object's labels (``PodEvent.namespace_labels``), which the platform
    writes. A key no source in its order has is not carried: the row has no such label.

    ``default`` is the order of every key ``per_key`` does not name. The text form (``parse``, the attributor's
    ``GPUMETER_GROUPING_LABEL_SOURCE``) is entries separated by ``;``, each ``[<key>=]<source>[,<source>]``:
    ``namespace,pod`` (every key from the namespace, else the pod), ``team=namespace;model=namespace,pod``
    (``team`` only from the namespace, ``model`` with a fallback, other keys from the pod: the default ``pod``).
    """

    default: tuple[str, ...] = (SOURCE_POD,)
    per_key: tuple[tuple[str, tuple[str, ...]], ...] = ()  # sorted by key

    @classmethod
    def parse(cls, text: str) -> "GroupingLabelSources":
        """The sources of ``text`` (empty: ``pod`` for every key). Raises ``ValueError`` naming what is wrong."""
        default: tuple[str, ...] | None = None
        per_key: dict[str, tuple[str, ...]] = {}
        for entry in filter(None, (part.strip() for part in text.split(";"))):
            key, has_key, order_text = entry.rpartition("=")
            order = tuple(source.strip() for source in order_text.split(","))
            unknown = [source for source in order if source not in LABEL_SOURCES]
            if unknown or not order:
                raise ValueError(f"{entry!r}: a source is one of {', '.join(LABEL_SOURCES)}, got {unknown}")
            if len(set(order)) != len(order):
                raise ValueError(f"{entry!r}: each source at most once")
            if has_key:
                key = key.strip()
                if not key or "," in key or key in per_key:
                    raise ValueError(f"{entry!r}: a label key, once")
                per_key[key] = order
            elif default is not None:
                raise ValueError(f"{text!r}: one order for every key at most (the entry without <key>=)")
            else:
                default = order
        return cls(default or (SOURCE_POD,), tuple(sorted(per_key.items())))

    def order_for(self, key: str) -> tuple[str, ...]:
        for named, order in self.per_key:
            if named == key:
                return order
        return self.default

    @property
    def keys_named(self) -> tuple[str, ...]:
        return tuple(key for key, _order in self.per_key)

    @property
    def pod_only(self) -> bool:
        """Whether every key comes from the pod's labels alone (what gpumeter did before namespace labels)."""
        return self.default == (SOURCE_POD,) and all(order == (SOURCE_POD,) for _key, order in self.per_key)

    def reads_namespace(self, key: str) -> bool:
        return SOURCE_NAMESPACE in self.order_for(key)

    def resolve(self, keys: Iterable[str] | None, pod_labels: Mapping[str, str],
                namespace_labels: Mapping[str, str]) -> dict[str, str]:
        """The grouping labels of a pod: for each of ``keys`` (None: every key either source has) the value of
        the first source in its order that has it."""
        if keys is None:
            keys = set(pod_labels) | set(namespace_labels)
        labels = {SOURCE_POD: pod_labels, SOURCE_NAMESPACE: namespace_labels}
        resolved: dict[str, str] = {}
        for key in keys:
            for source in self.order_for(key):
                value = labels[source].get(key)
                if value is not None:
                    resolved[key] = value
                    break
        return resolved

    def describe(self) -> str:
        """The text ``parse`` reads back to these sources."""
        parts = [",".join(self.default)] + [f"{key}={','.join(order)}" for key, order in self.per_key]
        return ";".join(parts)
