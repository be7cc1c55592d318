"""The cut-to-size rule for pod events: no pod's labels or annotations can make its ``PodEvent`` too large.

Kubernetes bounds a pod object only by its total size (etcd's ~1.5 MB): a pod may carry 30,000 labels, and any
tenant who can create pods can do it. Copied whole, such a pod made a 1.28 MB ``PodEvent`` that the producer
refused; it sat at the head of the collector's buffer and silenced the node. So the collector cuts every pod's
labels and annotations to fixed caps before it encodes the event, and says on the event what it cut.

The rule (pure, deterministic; ``cut_to_size``):

* **Labels** are considered in key order (Python's ``sorted`` on the key). A label is kept while fewer than
  ``MAX_LABELS`` are kept and the kept keys and values stay within ``LABELS_MAX_BYTES`` UTF-8 bytes. A label whose
  key is longer than ``KEY_MAX_BYTES`` (Kubernetes' 253-byte prefix, "/", 63-byte name) or whose value is longer
  than ``LABEL_VALUE_MAX_BYTES`` (Kubernetes' 63 characters) is left out, never shortened: a cut label value would
  be another value (and, cut mid-way, not a valid one), so it would group costs under a team no one named.
* **Annotations** likewise, with ``MAX_ANNOTATIONS`` and ``ANNOTATIONS_MAX_BYTES``; an annotation value longer
  than ``ANNOTATION_VALUE_MAX_BYTES`` is cut to that many bytes on a character boundary (annotations carry free
  text; what gpumeter reads of them -- an MPS thread percentage -- is short).
* Every label or annotation left out is counted (``labels_dropped``, ``annotations_dropped``); ``truncated`` is set
  when anything was left out or cut.

A well-behaved pod loses nothing (real pods have tens of labels, each value at most 63 characters). A hostile pod
loses its own labels beyond the caps (its costs may then fall under ``(no team label)``), never anyone else's. With
the caps below a PodEvent's labels and annotations take at most 48 KiB, far below any producer's limit; the
collector's buffer still dead-letters a record Kafka refuses (``services.collector.publisher``).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping

from schemas.records import PodEvent

MAX_LABELS = 128
LABELS_MAX_BYTES = 16 * 1024
LABEL_VALUE_MAX_BYTES = 63
MAX_ANNOTATIONS = 64
ANNOTATIONS_MAX_BYTES = 32 * 1024
ANNOTATION_VALUE_MAX_BYTES = 1024
KEY_MAX_BYTES = 253 + 1 + 63


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def truncate_utf8(value: str, max_bytes: int) -> str:
    """``value`` cut to at most ``max_bytes`` UTF-8 bytes, on a character boundary."""
    encoded = value.encode("utf-8")
    if len(encoded) <= max_bytes:
        return value
    return encoded[:max_bytes].decode("utf-8", errors="ignore")


def _cut_map(entries: Mapping[str, str], *, max_entries: int, max_bytes: int,
             value_max_bytes: int, shorten_values: bool) -> tuple[dict[str, str], int, bool]:
    """The entries kept by the rule, how many were left out, and whether a kept value was shortened."""
    kept: dict[str, str] = {}
    used = 0
    dropped = 0
    shortened = False
    for key in sorted(entries):
        value = entries[key]
        if _utf8_len(value) > value_max_bytes:
            if not shorten_values:
                dropped += 1
                continue
            value = truncate_utf8(value, value_max_bytes)
            shortened = True
        size = _utf8_len(key) + _utf8_len(value)
        if _utf8_len(key) > KEY_MAX_BYTES or len(kept) >= max_entries or used + size > max_bytes:
            dropped += 1
            continue
        kept[key] = value
        used += size
    return kept, dropped, shortened


def cut_labels(labels: Mapping[str, str]) -> tuple[dict[str, str], int]:
    """``labels`` cut by the label rule (what ``cut_to_size`` does to a pod's labels), and how many were left out:
    also the rule for a namespace's labels on the event (``PodEvent.namespace_labels``)."""
    kept, dropped, _ = _cut_map(labels, max_entries=MAX_LABELS, max_bytes=LABELS_MAX_BYTES,
                                value_max_bytes=LABEL_VALUE_MAX_BYTES, shorten_values=False)
    return kept, dropped


def cut_to_size(event: PodEvent) -> PodEvent:
    """``event`` with its labels and annotations cut by the rule in the module docstring, and the cut recorded
    (added to what an earlier cut recorded). An event within the caps comes back unchanged."""
    labels, labels_dropped = cut_labels(event.labels)
    annotations, annotations_dropped, shortened = _cut_map(
        event.annotations, max_entries=MAX_ANNOTATIONS, max_bytes=ANNOTATIONS_MAX_BYTES,
        value_max_bytes=ANNOTATION_VALUE_MAX_BYTES, shorten_values=True)
    if not (labels_dropped or annotations_dropped or shortened):
        return event
    return dataclasses.replace(
        event,
        labels=MappingProxyType(labels),
        annotations=MappingProxyType(annotations),
        labels_dropped=event.labels_dropped + labels_dropped,
        annotations_dropped=event.annotations_dropped + annotations_dropped,
        truncated=True,
    )
