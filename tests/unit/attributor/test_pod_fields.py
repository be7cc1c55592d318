"""What the attributor keeps of a pod: its grouping labels (``GPUMETER_GROUPING_LABELS``) and the one annotation
attribution reads, in the pod index, the share rows and the pod table (``pod_index.PodFields``)."""

from __future__ import annotations

import pytest

from gpumeter.errors import ConfigError
from gpumeter.validation import DEFAULT_MAX_CLOCK_SKEW_SECONDS, check_window_shares
from schemas.records import NodeWindowShares, ShareSubjectKind
from services.attributor.attribution import DEFAULT_MPS_THREAD_ANNOTATION, AttributionPolicy
from services.attributor.engine import AttributionEngine, EngineConfig
from services.attributor.pod_index import (
    PodFields,
    PodIndex,
    apply_pod_events,
    trim_pod_event,
)
from services.attributor.settings import AttributorSettings, attributor_settings
from tests.unit.attributor import GIB, device, node_sample, pod_event

FLOOD = {f"acme.io/label-{i:05d}": "v" for i in range(30_000)}


def _event(**changes):
    labels = {"team": "research", "model": "llama", "app": "trainer", **FLOOD}
    annotations = {DEFAULT_MPS_THREAD_ANNOTATION: "40", "kubectl.kubernetes.io/last-applied": "x" * 5_000_000}
    return pod_event("uid-a", devices=[("nvidia.com/gpu", ["GPU-0"])], labels=labels, annotations=annotations,
                     **changes)


def test_share_rows_carry_only_the_grouping_labels_and_say_which_were_carried():
    config = EngineConfig(window_seconds=10, grace_seconds=2, grouping_labels=("team", "model"),
                          policy=AttributionPolicy.parse("memory", "threads", DEFAULT_MPS_THREAD_ANNOTATION))
    engine = AttributionEngine(config)
    assert engine.on_pod_event(_event(observed_at_unix_ms=1_000, started_at_unix_ms=0))
    base = 1_780_000_000_000 // 10_000 * 10_000
    gpu = device("GPU-0", used=4 * GIB, util=50, procs=[(0, 2 * GIB, 30)])
    for k in range(3):
        engine.on_sample(node_sample(base + k * 1000, [gpu], pod_uids=["uid-a"], sequence=k), base + 60_000, k)
    (window,) = engine.flush().windows
    (row,) = [r for r in window.shares if r.subject_kind is ShareSubjectKind.POD]
    assert dict(row.labels) == {"team": "research", "model": "llama"}
    assert row.carried_label_keys == ("model", "team")
    # What billing and the guard check each node-window with accepts it: the carried keys are a field, not a label
    # whose value ("model,team") no Kubernetes label could hold (that version was dead-lettered INVALID_NAME).
    check_window_shares(NodeWindowShares.from_rows(window.shares), base + 60_000,
                        DEFAULT_MAX_CLOCK_SKEW_SECONDS * 1000)
    info = engine.pods.pod("uid-a")
    assert dict(info.annotations) == {DEFAULT_MPS_THREAD_ANNOTATION: "40"}


def test_no_annotation_is_kept_unless_the_platform_names_one():
    engine = AttributionEngine(EngineConfig(window_seconds=10, grace_seconds=2, grouping_labels=("team", "model")))
    assert engine.on_pod_event(_event(observed_at_unix_ms=1_000, started_at_unix_ms=0))
    assert dict(engine.pods.pod("uid-a").annotations) == {}


def test_the_trimmed_event_gives_the_same_pod_state_and_is_small():
    fields = PodFields.for_grouping(("team", "model"), (DEFAULT_MPS_THREAD_ANNOTATION,))
    event = _event()
    trimmed = trim_pod_event(event, fields)
    assert dict(trimmed.labels) == {"team": "research", "model": "llama"}
    assert (trimmed.labels_dropped, trimmed.annotations_dropped) == (30_001, 1)
    whole = apply_pod_events(PodIndex.empty(600_000, fields), [event])
    cut = apply_pod_events(PodIndex.empty(600_000, fields), [trimmed])
    assert whole.pod("uid-a") == cut.pod("uid-a")
    assert trim_pod_event(trimmed, fields) is trimmed


def test_every_label_is_carried_when_no_grouping_is_configured():
    index = apply_pod_events(PodIndex.empty(600_000), [_event()])
    info = index.pod("uid-a")
    assert len(info.labels) == 30_003 and info.carried_label_keys == ()


def test_the_setting_reads_env_and_flags_and_defaults_to_team_and_model():
    import argparse

    from services.attributor.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert AttributorSettings().engine_config().grouping_labels == ("model", "team")
    env = {"GPUMETER_GROUPING_LABELS": "team, cost-center ,team"}
    assert attributor_settings(parser.parse_args([]), env).grouping_labels == ("cost-center", "team")
    assert attributor_settings(parser.parse_args(["--grouping-labels", "owner"]), env).grouping_labels == ("owner",)
    with pytest.raises(ConfigError):
        EngineConfig(grouping_labels="team")  # a string is not a list of keys
