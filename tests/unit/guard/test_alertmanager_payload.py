"""The Alertmanager v2 payload of a violation: labels, annotations, startsAt/endsAt for firing and resolved."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone

from hypothesis import given
from hypothesis import strategies as st

from schemas.records import Severity, Violation, ViolationState
from services.guard.alertmanager import (
    DEFAULT_LEASE_SECONDS,
    alert_labels,
    format_evidence_value,
    rfc3339_ms,
    to_alertmanager,
)

FIRST_SEEN_MS = 1_780_000_000_250
LAST_SEEN_MS = FIRST_SEEN_MS + 95_500


def parse_ms(text: str) -> int:
    """RFC 3339 (as Alertmanager parses it) back to Unix ms."""
    assert text.endswith("Z")
    moment = datetime.fromisoformat(text[:-1] + "+00:00")
    assert moment.tzinfo == timezone.utc
    return round(moment.timestamp() * 1000)


def firing(**changes) -> Violation:
    violation = Violation(
        fingerprint="3f2a9c0d1e4b5a6f",
        rule="visibility_leak",
        severity=Severity.CRITICAL,
        state=ViolationState.FIRING,
        cluster="prod-eu",
        node_name="gpu-node-7",
        gpu_uuid="GPU-5e6f7a8b-0000-4000-8000-000000000001",
        namespace="research",
        pod_name="trainer-0",
        pod_uid="0b7c0e2e-8c0f-4b1e-9f63-6f3c2a1d4e5f",
        team="vision",
        summary="trainer-0 runs on a GPU its pod was not assigned",
        evidence={"memory_used_bytes": 3 * 2**30 + 2**29, "process_count": 2.0, "wasted_micro_usd": 1_250_000.0},
        first_seen_unix_ms=FIRST_SEEN_MS,
        last_seen_unix_ms=LAST_SEEN_MS,
        resolved_at_unix_ms=None,
    )
    return dataclasses.replace(violation, **changes)


def resolved(violation: Violation, resolved_at_ms: int) -> Violation:
    return dataclasses.replace(violation, state=ViolationState.RESOLVED, last_seen_unix_ms=resolved_at_ms,
                               resolved_at_unix_ms=resolved_at_ms)


def test_firing_labels_are_the_rule_severity_and_subject():
    violation = firing()
    alert = to_alertmanager(violation)
    assert alert["labels"] == {
        "alertname": violation.rule,
        "severity": violation.severity.value.lower(),
        "cluster": violation.cluster,
        "node": violation.node_name,
        "gpu_uuid": violation.gpu_uuid,
        "namespace": violation.namespace,
        "pod": violation.pod_name,
        "team": violation.team,
        "fingerprint": violation.fingerprint,
    }
    assert alert["labels"]["severity"] == "critical"
    json.dumps(alert)  # the body aiohttp sends must be plain JSON


def test_null_and_empty_subject_fields_are_left_out_never_sent_as_null():
    violation = firing(rule="budget_exceeded", severity=Severity.WARNING, node_name=None, gpu_uuid=None,
                       pod_name=None, pod_uid=None, team="", namespace="research")
    labels = to_alertmanager(violation)["labels"]
    assert set(labels) == {"alertname", "severity", "cluster", "namespace", "fingerprint"}
    assert all(isinstance(value, str) and value for value in labels.values())
    assert labels["severity"] == "warning"
    assert "pod_uid" not in to_alertmanager(violation)["annotations"]


def test_firing_starts_at_first_seen_and_ends_at_now_plus_the_lease():
    violation = firing()
    now_ms = LAST_SEEN_MS + 7_000
    lease_seconds = 120.0
    alert = to_alertmanager(violation, now_ms=now_ms, lease_seconds=lease_seconds)
    assert parse_ms(alert["startsAt"]) == violation.first_seen_unix_ms
    assert parse_ms(alert["endsAt"]) == now_ms + int(lease_seconds * 1000)
    # Without a clock reading the lease runs from the last sighting.
    default = to_alertmanager(violation)
    assert parse_ms(default["endsAt"]) == violation.last_seen_unix_ms + int(DEFAULT_LEASE_SECONDS * 1000)


def test_resolved_ends_at_its_resolution_with_the_same_labelset():
    violation = firing()
    resolved_at_ms = LAST_SEEN_MS + 30_000
    gone = resolved(violation, resolved_at_ms)
    alert = to_alertmanager(gone, now_ms=resolved_at_ms + 500_000)
    assert parse_ms(alert["startsAt"]) == violation.first_seen_unix_ms
    assert parse_ms(alert["endsAt"]) == resolved_at_ms  # not now + lease: it is over
    # Alertmanager matches the resolution to the firing alert by labelset.
    assert alert["labels"] == to_alertmanager(violation)["labels"]
    assert "resolved" in alert["annotations"]["description"]


def test_resolved_without_a_resolution_time_ends_at_its_last_sighting():
    gone = dataclasses.replace(firing(), state=ViolationState.RESOLVED, resolved_at_unix_ms=None)
    assert parse_ms(to_alertmanager(gone)["endsAt"]) == gone.last_seen_unix_ms


def test_annotations_carry_summary_and_evidence_with_units():
    violation = firing()
    annotations = to_alertmanager(violation)["annotations"]
    assert annotations["summary"] == violation.summary
    assert annotations["pod_uid"] == violation.pod_uid
    description = annotations["description"]
    assert description.startswith(violation.summary)
    memory = violation.evidence["memory_used_bytes"]
    assert f"memory_used_bytes = {memory / 2**30:.2f} GiB ({memory:.0f} B)" in description
    money = violation.evidence["wasted_micro_usd"]
    assert f"wasted_micro_usd = ${money / 1e6:,.2f} ({money:.0f} micro-USD)" in description
    assert f"process_count = {int(violation.evidence['process_count'])}" in description
    assert f"pod {violation.namespace}/{violation.pod_name}" in description
    assert f"GPU {violation.gpu_uuid}" in description
    assert rfc3339_ms(violation.first_seen_unix_ms) in description
    # The raw numbers, one annotation each, read back exactly.
    for name, value in violation.evidence.items():
        assert float(annotations[f"evidence_{name}"]) == value
    assert all(isinstance(value, str) for value in annotations.values())


def test_generator_url_only_when_given():
    violation = firing()
    assert "generatorURL" not in to_alertmanager(violation)
    url = "https://grafana.example/d/gpumeter-guard"
    assert to_alertmanager(violation, generator_url=url)["generatorURL"] == url


def test_evidence_units_follow_the_name_suffix():
    assert format_evidence_value("compute_percent", 4.5) == "4.5 %"
    assert format_evidence_value("memory_share", 0.625) == f"{0.625 * 100:.4g} %"
    idle_seconds = 15 * 60 + 30
    assert format_evidence_value("idle_seconds", idle_seconds) == f"15m 30s ({idle_seconds} s)"
    assert format_evidence_value("silence_ms", 2_500) == "2.5 s"
    assert format_evidence_value("last_sample_unix_ms", FIRST_SEEN_MS) == rfc3339_ms(FIRST_SEEN_MS)
    assert format_evidence_value("memory_used_bytes", 512) == "512 B"
    assert format_evidence_value("replicas", 4.0) == "4"


def test_labels_are_identical_across_refreshes_of_one_fingerprint():
    violation = firing()
    later = dataclasses.replace(violation, last_seen_unix_ms=LAST_SEEN_MS + 60_000,
                                evidence={**violation.evidence, "memory_used_bytes": 2.0**33})
    assert alert_labels(later) == alert_labels(violation)


@given(st.integers(min_value=0, max_value=4_102_444_800_000))
def test_rfc3339_round_trips_to_the_millisecond(unix_ms):
    assert parse_ms(rfc3339_ms(unix_ms)) == unix_ms


@given(first_ms=st.integers(min_value=0, max_value=4_000_000_000_000),
       last_delta_ms=st.integers(min_value=0, max_value=10**9),
       resolved_delta_ms=st.integers(min_value=-10**6, max_value=10**9),
       state=st.sampled_from(list(ViolationState)))
def test_ends_at_is_never_before_starts_at(first_ms, last_delta_ms, resolved_delta_ms, state):
    # Alertmanager answers 400 to an alert that ends before it starts.
    violation = firing(first_seen_unix_ms=first_ms, last_seen_unix_ms=first_ms + last_delta_ms, state=state,
                       resolved_at_unix_ms=max(0, first_ms + resolved_delta_ms)
                       if state is ViolationState.RESOLVED else None)
    alert = to_alertmanager(violation)
    assert parse_ms(alert["startsAt"]) <= parse_ms(alert["endsAt"])
