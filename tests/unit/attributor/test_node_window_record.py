"""The close builds the emitted ``NodeWindowShares`` straight from the units' rows (``node_window_record``): the
same record, field for field, as ``NodeWindowShares.from_rows`` over ``attribute_node_window``'s rows, for any
window; and its ``rows()`` are those rows."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given

from schemas.records import NodeWindowShares, RecordShapeError, ShareSubjectKind
from services.attributor import attribution
from services.attributor.attribution import (
    OpenNodeWindow,
    ShareRow,
    attribute_node_window,
    node_window_record,
)
from services.attributor.pod_index import PodIndex
from services.attributor.windows import NodeWindow
from tests.unit.attributor import GIB, device, node_sample
from tests.unit.attributor.test_attribution_properties import PROPERTY_SETTINGS, START, WINDOW_S, policies, scenarios


@PROPERTY_SETTINGS
@given(scenario=scenarios(), policy=policies)
def test_the_record_is_from_rows_of_the_windows_rows(scenario, policy):
    window, index = scenario
    rows = attribute_node_window(window, index, policy)
    record = node_window_record(window, index, policy)
    if not rows:
        assert record is None
        return
    assert record == NodeWindowShares.from_rows(rows)
    assert record.rows() == rows
    record.check_shape()


@PROPERTY_SETTINGS
@given(scenario=scenarios(), policy=policies)
def test_the_record_from_the_window_s_sums_is_the_record_from_its_ticks(scenario, policy):
    window, index = scenario
    summed = OpenNodeWindow(window.window_seconds, policy)
    for sample in window.samples:
        summed.add(sample, index, 0)
    assert node_window_record(window, index, policy, summed) == node_window_record(window, index, policy)


def test_an_empty_window_has_no_record():
    window = NodeWindow("c", "n", START, WINDOW_S, ())
    assert node_window_record(window, PodIndex.empty(), attribution.AttributionPolicy()) is None


def _window() -> NodeWindow:
    samples = tuple(node_sample(START + t * 1000, [device("GPU-a", used=2 * GIB)]) for t in range(3))
    return NodeWindow(samples[0].cluster, samples[0].node_name, START, WINDOW_S, samples)


def _units_with(monkeypatch: pytest.MonkeyPatch, change) -> None:
    """Make the close see its units' rows changed by ``change(units)``: the shapes ``from_rows`` refuses."""
    attributed = attribution._attributed_units

    def changed(*args):
        return change(attributed(*args))

    monkeypatch.setattr(attribution, "_attributed_units", changed)


def _pod_row(row: ShareRow, uid: str | None, namespace: str) -> ShareRow:
    return row._replace(subject_kind=ShareSubjectKind.POD, pod_uid=uid, namespace=namespace)


def test_two_units_under_one_uuid_are_refused(monkeypatch):
    _units_with(monkeypatch, lambda units: units + units[:1])
    with pytest.raises(RecordShapeError, match="not together"):
        node_window_record(_window(), PodIndex.empty(), attribution.AttributionPolicy())


def test_a_pod_row_without_a_uid_is_refused(monkeypatch):
    def change(units: list[tuple]) -> list[tuple]:
        device_facts, unit = units[0]
        rows = (_pod_row(unit.rows[0], None, "ns"),) + unit.rows[1:]
        return [(device_facts, dataclasses.replace(unit, rows=rows))]

    _units_with(monkeypatch, change)
    with pytest.raises(RecordShapeError, match="without pod uid"):
        node_window_record(_window(), PodIndex.empty(), attribution.AttributionPolicy())


def test_a_pod_described_two_ways_is_refused(monkeypatch):
    def change(units: list[tuple]) -> list[tuple]:
        device_facts, unit = units[0]
        rows = (_pod_row(unit.rows[0], "uid-1", "ns-a"), _pod_row(unit.rows[1], "uid-1", "ns-b")) + unit.rows[2:]
        return [(device_facts, dataclasses.replace(unit, rows=rows))]

    _units_with(monkeypatch, change)
    with pytest.raises(RecordShapeError, match="described two ways"):
        node_window_record(_window(), PodIndex.empty(), attribution.AttributionPolicy())


def test_one_pod_on_two_units_is_one_pod_of_the_record(monkeypatch):
    def change(units: list[tuple]) -> list[tuple]:
        device_facts, unit = units[0]
        first = (_pod_row(unit.rows[0], "uid-1", "ns"),) + unit.rows[1:]
        second = tuple(row._replace(gpu_uuid="GPU-b") for row in first)
        return [(device_facts, dataclasses.replace(unit, rows=first)),
                (device_facts, dataclasses.replace(unit, unit_uuid="GPU-b", rows=second))]

    _units_with(monkeypatch, change)
    record = node_window_record(_window(), PodIndex.empty(), attribution.AttributionPolicy())
    assert [pod.pod_uid for pod in record.pods] == ["uid-1"]
    assert [unit.subject_pod_index[0] for unit in record.units] == [0, 0]
    assert record == NodeWindowShares.from_rows(record.rows())
