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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

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
