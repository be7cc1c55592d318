"""``gpumeter violations`` without a broker: compaction's view of the topic, ordering, and both formats."""

from __future__ import annotations

import json

from schemas.records import Severity
from schemas.typed import codec_for
from services.guard.violations_cli import (
    decode_latest,
    format_violations,
    iso_utc,
    latest_per_key,
    sort_violations,
    violation_json,
)
from tests.unit.guard.test_alertmanager_payload import LAST_SEEN_MS, firing, resolved


def encode(violation) -> bytes:
    return codec_for(type(violation)).encode(violation)


def test_latest_record_per_key_wins_and_tombstones_remove():
    leak = firing()
    gone = resolved(leak, LAST_SEEN_MS + 5_000)
    other = firing(fingerprint="aaaa", rule="stale_node", severity=Severity.WARNING, pod_name=None)
    dropped = firing(fingerprint="bbbb")
    records = [
        (leak.fingerprint.encode(), encode(leak)),
        (other.fingerprint.encode(), encode(other)),
        (dropped.fingerprint.encode(), encode(dropped)),
        (leak.fingerprint.encode(), encode(gone)),
        (dropped.fingerprint.encode(), None),
        (None, encode(other)),
    ]
    latest, keyless = latest_per_key(records)
    assert keyless == 1
    violations, undecodable = decode_latest(latest)
    assert undecodable == 0
    assert {v.fingerprint: v for v in violations} == {leak.fingerprint: gone, other.fingerprint: other}


def test_undecodable_values_are_counted_not_fatal():
    leak = firing()
    violations, undecodable = decode_latest({b"x": b"\xc3\x01 garbage", leak.fingerprint.encode(): encode(leak)})
    assert violations == [leak]
    assert undecodable == 1


def test_order_is_firing_first_then_severity():
    critical = firing(fingerprint="c")
    warning = firing(fingerprint="w", severity=Severity.WARNING)
    info = firing(fingerprint="i", severity=Severity.INFO)
    done = resolved(firing(fingerprint="r"), LAST_SEEN_MS + 1)
    assert sort_violations([done, info, warning, critical]) == [critical, warning, info, done]


def test_json_has_the_replay_field_names():
    gone = resolved(firing(), LAST_SEEN_MS + 60_000)
    (entry,) = json.loads(format_violations([gone], "json"))
    assert entry == violation_json(gone)
    assert entry["state"] == "resolved"
    assert entry["severity"] == gone.severity.value.lower()
    assert entry["node"] == gone.node_name
    assert entry["pod"] == gone.pod_name
    assert entry["first_seen"] == iso_utc(gone.first_seen_unix_ms)
    assert entry["resolved_at_unix_ms"] == gone.resolved_at_unix_ms
    assert entry["evidence"] == dict(gone.evidence)


def test_table_shows_one_row_per_violation_in_both_renderers():
    leak = firing()
    budget = firing(fingerprint="f2", rule="budget_exceeded", severity=Severity.WARNING, node_name=None,
                    gpu_uuid=None, pod_name=None)
    for use_rich in (True, False):
        text = format_violations(sort_violations([leak, budget]), "table", use_rich=use_rich)
        lines = [line for line in text.splitlines() if leak.rule in line or budget.rule in line]
        assert len(lines) == 2
        assert f"{leak.namespace}/{leak.pod_name}" in lines[0]
        assert "budget_exceeded" in lines[1] and budget.namespace in lines[1]
    assert format_violations([], "table") == "no violations\n"
    assert json.loads(format_violations([], "json")) == []



def test_json_objects_match_the_replay_file_but_its_publication_time():
    from services.guard.replay import violation_json as replay_json

    for violation in (firing(), resolved(firing(), LAST_SEEN_MS + 60_000)):
        replayed = replay_json(violation, LAST_SEEN_MS)
        del replayed["published_at"], replayed["published_at_unix_ms"]
        assert violation_json(violation) == replayed
