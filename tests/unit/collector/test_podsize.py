"""The collector's cut-to-size rule for pod labels and annotations (``services.collector.podsize``)."""

from __future__ import annotations

import dataclasses
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.records import PodEvent, PodEventType
from schemas.typed import codec_for
from services.collector.pods import pod_event_from_object
from services.collector.podsize import (
    ANNOTATION_VALUE_MAX_BYTES,
    ANNOTATIONS_MAX_BYTES,
    KEY_MAX_BYTES,
    LABEL_VALUE_MAX_BYTES,
    LABELS_MAX_BYTES,
    MAX_ANNOTATIONS,
    MAX_LABELS,
    cut_to_size,
)
from simulator.apiserver import make_pod_object
from tests.unit.attributor import pod_event


def _bytes(entries) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in entries.items())


def test_a_pod_with_30000_labels_becomes_a_small_event_that_says_what_was_cut():
    labels = {f"acme.io/label-{i:05d}": f"value-{i:05d}-abcdefghij" for i in range(30_000)}
    obj = json.loads(json.dumps(make_pod_object("ml", "flood", "uid-flood", "gpu-node-a", labels=labels,
                                                annotations={"team-note": "x" * 5000})))
    whole = codec_for(PodEvent).encode(PodEvent.from_avro({
        **pod_event_from_object(obj, PodEventType.ADDED, "c", 1).to_avro(), "labels": labels}))
    assert len(whole) > 1 << 20  # what the collector used to send: more than any producer takes
    event = pod_event_from_object(obj, PodEventType.ADDED, "c", 1)
    assert dict(event.labels) == {f"acme.io/label-{i:05d}": f"value-{i:05d}-abcdefghij"
                                  for i in range(MAX_LABELS)}  # the first in key order
    assert (event.labels_dropped, event.annotations_dropped, event.truncated) == (30_000 - MAX_LABELS, 0, True)
    assert event.annotations["team-note"] == "x" * ANNOTATION_VALUE_MAX_BYTES
    assert len(codec_for(PodEvent).encode(event)) < 64 * 1024


def test_a_well_behaved_pod_is_left_as_it_is():
    event = pod_event("u", labels={"team": "research", "model": "llama"}, annotations={"a": "b" * 500})
    assert cut_to_size(event) is event
    assert (event.labels_dropped, event.annotations_dropped, event.truncated) == (0, 0, False)


def test_labels_too_long_for_kubernetes_are_left_out_not_shortened_and_annotations_are_cut():
    event = pod_event("u", labels={"team": "a" * (LABEL_VALUE_MAX_BYTES + 1), "model": "ok",
                                   "x" * (KEY_MAX_BYTES + 1): "v"},
                      annotations={"long": "é" * ANNOTATION_VALUE_MAX_BYTES, "y" * (KEY_MAX_BYTES + 1): "v"})
    cut = cut_to_size(event)
    assert dict(cut.labels) == {"model": "ok"}
    assert list(cut.annotations) == ["long"]
    assert cut.annotations["long"] == "é" * (ANNOTATION_VALUE_MAX_BYTES // 2)  # on a character boundary
    assert (cut.labels_dropped, cut.annotations_dropped, cut.truncated) == (2, 1, True)
    assert cut_to_size(cut) == cut  # the rule is idempotent


def test_the_byte_caps_hold_as_well_as_the_count_caps():
    labels = {f"{'k' * 200}-{i:03d}": "v" * 63 for i in range(100)}  # 100 labels of 268 bytes: 26,800 bytes
    annotations = {f"a{i:02d}": "z" * 1000 for i in range(60)}  # 60 annotations of 1003 bytes
    cut = cut_to_size(pod_event("u", labels=labels, annotations=annotations))
    assert _bytes(cut.labels) <= LABELS_MAX_BYTES and len(cut.labels) == LABELS_MAX_BYTES // 268
    assert _bytes(cut.annotations) <= ANNOTATIONS_MAX_BYTES and len(cut.annotations) == ANNOTATIONS_MAX_BYTES // 1003
    assert cut.labels_dropped == 100 - len(cut.labels) and cut.annotations_dropped == 60 - len(cut.annotations)


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(labels=st.dictionaries(_text, _text, max_size=300), annotations=st.dictionaries(_text, st.text(max_size=2000),
                                                                                       max_size=120))
def test_any_labels_and_annotations_end_within_the_caps_and_the_counts_add_up(labels, annotations):
    cut = cut_to_size(dataclasses.replace(pod_event("u"), labels=labels, annotations=annotations))
    assert len(cut.labels) <= MAX_LABELS and _bytes(cut.labels) <= LABELS_MAX_BYTES
    assert len(cut.annotations) <= MAX_ANNOTATIONS and _bytes(cut.annotations) <= ANNOTATIONS_MAX_BYTES
    assert all(labels[k] == v for k, v in cut.labels.items())
    assert all(annotations[k].startswith(v) for k, v in cut.annotations.items())
    assert len(cut.labels) + cut.labels_dropped == len(labels)
    assert len(cut.annotations) + cut.annotations_dropped == len(annotations)
    assert cut.truncated == (cut.labels_dropped > 0 or cut.annotations_dropped > 0
                             or any(annotations[k] != v for k, v in cut.annotations.items()))
    assert codec_for(PodEvent).decode(codec_for(PodEvent).encode(cut)) == cut
