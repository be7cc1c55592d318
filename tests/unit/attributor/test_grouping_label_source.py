"""Where a share row's grouping labels come from (``GPUMETER_GROUPING_LABEL_SOURCE``): the pod's own labels, which
whoever creates the pod writes, or its Namespace object's (``PodEvent.namespace_labels``), which the platform
writes -- so that a tenant cannot bill its GPU time to another team by labelling its pod."""

from __future__ import annotations

import argparse

import pytest

from gpumeter.errors import ConfigError
from schemas.pods import GroupingLabelSources
from schemas.records import ShareSubjectKind
from services.attributor.engine import AttributionEngine, EngineConfig
from services.attributor.pod_index import PodFields, PodIndex, apply_pod_events, trim_pod_event
from services.attributor.settings import AttributorSettings, add_arguments, attributor_settings
from tests.unit.attributor import GIB, device, node_sample, pod_event

BASE_MS = 1_780_000_000_000 // 10_000 * 10_000


def _row_labels(sources: str, *, pod_labels: dict, namespace_labels: dict) -> dict:
    """The labels of the pod's share row after one window, with ``sources`` as the attributor's setting."""
    config = EngineConfig(window_seconds=10, grace_seconds=2, grouping_labels=("model", "team"),
                          grouping_label_sources=GroupingLabelSources.parse(sources))
    engine = AttributionEngine(config)
    assert engine.on_pod_event(pod_event("uid-a", devices=[("nvidia.com/gpu", ["GPU-0"])], labels=pod_labels,
                                         namespace_labels=namespace_labels, observed_at_unix_ms=1_000))
    gpu = device("GPU-0", used=4 * GIB, util=50, procs=[(0, 2 * GIB, 30)])
    for k in range(3):
        engine.on_sample(node_sample(BASE_MS + k * 1000, [gpu], pod_uids=["uid-a"], sequence=k), BASE_MS + 60_000, k)
    (window,) = engine.flush().windows
    (row,) = [r for r in window.shares if r.subject_kind is ShareSubjectKind.POD]
    assert row.carried_label_keys == ("model", "team")
    return dict(row.labels)


def test_with_source_namespace_a_pod_labelled_team_a_in_a_namespace_labelled_team_b_is_billed_to_b():
    labels = _row_labels("namespace", pod_labels={"team": "a", "model": "m-pod"},
                         namespace_labels={"team": "b", "model": "m-ns"})
    assert labels == {"team": "b", "model": "m-ns"}


def test_the_default_source_is_the_pods_labels_as_before():
    labels = _row_labels("", pod_labels={"team": "a"}, namespace_labels={"team": "b", "model": "m-ns"})
    assert labels == {"team": "a"}


def test_namespace_then_pod_falls_back_to_the_pod_label_only_where_the_namespace_has_none():
    labels = _row_labels("namespace,pod", pod_labels={"team": "a", "model": "m-pod"},
                         namespace_labels={"team": "b"})
    assert labels == {"team": "b", "model": "m-pod"}


def test_with_namespace_only_a_pod_label_alone_does_not_set_the_team():
    labels = _row_labels("namespace", pod_labels={"team": "a", "model": "m-pod"}, namespace_labels={})
    assert labels == {}


def test_sources_per_key():
    labels = _row_labels("team=namespace;model=pod", pod_labels={"team": "a", "model": "m-pod"},
                         namespace_labels={"team": "b", "model": "m-ns"})
    assert labels == {"team": "b", "model": "m-pod"}
    labels = _row_labels("team=namespace", pod_labels={"team": "a", "model": "m-pod"}, namespace_labels={})
    assert labels == {"model": "m-pod"}


def test_the_pod_table_keeps_only_the_namespace_labels_a_source_reads_and_the_index_state_is_the_same():
    sources = GroupingLabelSources.parse("team=namespace,pod")
    fields = PodFields.for_grouping(("team", "model"), (), sources)
    event = pod_event("uid-a", labels={"team": "a", "model": "m", "app": "x"},
                      namespace_labels={"team": "b", "model": "m-ns", "kubernetes.io/metadata.name": "ml"})
    trimmed = trim_pod_event(event, fields)
    assert dict(trimmed.namespace_labels) == {"team": "b"}
    assert trimmed.labels_dropped == 1  # the pod's own label "app"; namespace labels are not the pod's
    whole = apply_pod_events(PodIndex.empty(600_000, fields), [event]).pod("uid-a")
    cut = apply_pod_events(PodIndex.empty(600_000, fields), [trimmed]).pod("uid-a")
    assert whole == cut and dict(whole.labels) == {"team": "b", "model": "m"}
    # With the pod as the only source nothing of the namespace is kept.
    assert dict(trim_pod_event(event, PodFields.for_grouping(("team",))).namespace_labels) == {}


def test_every_label_mode_takes_keys_from_both_sources_in_their_order():
    fields = PodFields(sources=GroupingLabelSources.parse("namespace,pod"))
    info = apply_pod_events(PodIndex.empty(600_000, fields), [
        pod_event("uid-a", labels={"team": "a", "app": "x"}, namespace_labels={"team": "b", "env": "prod"})]
    ).pod("uid-a")
    assert dict(info.labels) == {"team": "b", "app": "x", "env": "prod"}


def test_a_later_namespace_label_change_reaches_the_pod():
    fields = PodFields.for_grouping(("team",), (), GroupingLabelSources.parse("namespace"))
    index = apply_pod_events(PodIndex.empty(600_000, fields), [
        pod_event("uid-a", labels={"team": "a"}, namespace_labels={"team": "b"}, observed_at_unix_ms=1_000),
        pod_event("uid-a", labels={"team": "a"}, namespace_labels={"team": "c"}, observed_at_unix_ms=2_000,
                  resource_version="1")])
    assert dict(index.pod("uid-a").labels) == {"team": "c"}


@pytest.mark.parametrize("text, default, per_key", [
    ("", ("pod",), ()),
    ("pod", ("pod",), ()),
    ("namespace", ("namespace",), ()),
    (" namespace , pod ", ("namespace", "pod"), ()),
    ("team=namespace; model=namespace,pod", ("pod",), (("model", ("namespace", "pod")), ("team", ("namespace",)))),
    ("namespace;team=pod,namespace", ("namespace",), (("team", ("pod", "namespace")),)),
])
def test_the_source_text(text, default, per_key):
    sources = GroupingLabelSources.parse(text)
    assert (sources.default, sources.per_key) == (default, per_key)
    assert GroupingLabelSources.parse(sources.describe()) == sources


@pytest.mark.parametrize("text", ["labels", "namespace,namespace", "pod;namespace", "team=ns", "=pod",
                                  "team=pod;team=namespace", "namespace,", "team,model=pod"])
def test_a_bad_source_text_is_a_config_error(text):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError):
        attributor_settings(parser.parse_args([]), {"GPUMETER_GROUPING_LABEL_SOURCE": text})


def test_the_setting_reads_env_and_flag_and_defaults_to_pod():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert AttributorSettings().engine_config().grouping_label_sources == GroupingLabelSources()
    assert AttributorSettings().describe()["grouping_label_source"] == "pod"
    env = {"GPUMETER_GROUPING_LABEL_SOURCE": "namespace,pod"}
    settings = attributor_settings(parser.parse_args([]), env)
    assert settings.engine_config().grouping_label_sources.default == ("namespace", "pod")
    flagged = attributor_settings(parser.parse_args(["--grouping-label-source", "team=namespace"]), env)
    assert flagged.grouping_label_source.order_for("team") == ("namespace",)
    assert flagged.grouping_label_source.order_for("model") == ("pod",)


def test_a_source_for_a_key_that_is_not_a_grouping_label_is_refused():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="owner"):
        attributor_settings(parser.parse_args([]), {"GPUMETER_GROUPING_LABEL_SOURCE": "owner=namespace"})
    assert attributor_settings(parser.parse_args([]), {"GPUMETER_GROUPING_LABELS": "team,owner",
                                                       "GPUMETER_GROUPING_LABEL_SOURCE": "owner=namespace"})
