"""The labels of the pods' namespaces, read from the Namespace objects: what the collector carries on every pod
event (``PodEvent.namespace_labels``, PodEvent v3).

A pod's own labels are written by whoever may create the pod; a Namespace's labels by whoever may edit
Namespaces, which on a multi-tenant cluster is the platform. The attributor can therefore take its grouping labels
(``team``, ``model``, ...) from the namespace (``GPUMETER_GROUPING_LABEL_SOURCE``), so that no tenant bills its GPU
time to another team by labelling its pod. The namespace labels on an event come only from the Namespace object
the collector read from the API server: nothing of the pod object is read into them.

Rules (pure; the watch itself is ``podwatch.NamespaceWatcher``):

* ``namespace_event_from_object`` reads one Namespace object (``metadata.uid``, ``name``, ``resourceVersion``,
  ``labels``); its labels are cut by the pod-label rule (``podsize.cut_labels``), so a namespace cannot make
  every event of its pods too large to deliver either.
* ``with_namespace_labels`` puts them on a pod event (a copy).
* ``NamespaceLabels`` is the collector's current view: namespace name -> labels. ``apply`` returns whether the
  labels of that namespace changed (then the collector republishes the namespace's pods on its node, so the
  attributor's view of them follows the platform's relabelling). A namespace the collector has not read yet, or
  that is gone, has no labels: ``labels_of`` returns None, and the collector keeps what it last published for a
  pod it knew (a pod's deletion arrives after its namespace is read, and a deleted namespace's pods are deleted
  before it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from gpumeter.errors import InvalidMessage
from schemas.records import PodEvent, PodEventType
from services.collector.podsize import cut_labels

BAD_NAMESPACE_OBJECT = "BAD_NAMESPACE_OBJECT"


@dataclass(frozen=True, slots=True)
class NamespaceEvent:
    """One change of a Namespace object as the watch saw it (``event_type`` ADDED, MODIFIED or DELETED)."""

    event_type: PodEventType
    observed_at_unix_ms: int
    resource_version: str
    uid: str
    name: str
    labels: Mapping[str, str]
    labels_dropped: int = 0


def namespace_event_from_object(obj: Any, event_type: PodEventType, observed_at_unix_ms: int) -> NamespaceEvent:
    """The ``NamespaceEvent`` of one Namespace object. ``InvalidMessage`` (``BAD_NAMESPACE_OBJECT``) when it is not
    one we can read: not a mapping, no ``metadata.uid``/``name``, labels that are not a string map."""
    if not isinstance(obj, Mapping):
        raise _bad("a Namespace object is not a JSON object")
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        raise _bad("a Namespace object without metadata")
    name, uid = metadata.get("name"), metadata.get("uid")
    if not isinstance(name, str) or not name or not isinstance(uid, str) or not uid:
        raise _bad("a Namespace object without metadata.name or metadata.uid")
    resource_version = metadata.get("resourceVersion") or ""
    raw_labels = metadata.get("labels") or {}
    if not isinstance(resource_version, str) or not isinstance(raw_labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_labels.items()):
        raise _bad(f"namespace {name!r}: resourceVersion or labels of the wrong type")
    labels, dropped = cut_labels(raw_labels)
    return NamespaceEvent(event_type, observed_at_unix_ms, resource_version, uid, name,
                          MappingProxyType(labels), dropped)


def with_namespace_labels(event: PodEvent, labels: Mapping[str, str]) -> PodEvent:
    """``event`` carrying ``labels`` as its namespace's (the same event when it already does)."""
    if dict(event.namespace_labels) == dict(labels):
        return event
    return dataclasses.replace(event, namespace_labels=MappingProxyType(dict(labels)))


class NamespaceLabels:
    """The labels of every namespace the watch has reported, by name."""

    def __init__(self) -> None:
        self._labels: dict[str, Mapping[str, str]] = {}

    def labels_of(self, namespace: str) -> Mapping[str, str] | None:
        """The namespace's labels, or None when it is not known (not read yet, or deleted)."""
        return self._labels.get(namespace)

    def apply(self, event: NamespaceEvent) -> bool:
        """Take ``event`` in; True when the namespace's labels changed (a deletion forgets them: no change)."""
        if event.event_type is PodEventType.DELETED:
            self._labels.pop(event.name, None)
            return False
        previous = self._labels.get(event.name)
        self._labels[event.name] = event.labels
        return previous is None or dict(previous) != dict(event.labels)

    def __len__(self) -> int:
        return len(self._labels)


def _bad(detail: str) -> InvalidMessage:
    return InvalidMessage(detail, reason_code=BAD_NAMESPACE_OBJECT)
