"""``gpumeter.metrics.child_factory``: the children it makes are the ones ``labels()`` makes -- same attributes,
same object for the same values, same exposition, removed by ``remove`` -- for the metric kinds gpumeter labels."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gpumeter.metrics import child_factory

LABELS = ("namespace", "pod", "UUID")


def _pair(kind):
    """Two identical labelled metrics on two registries: one fed through ``labels()``, one through the factory."""
    made = []
    for _ in range(2):
        registry = CollectorRegistry()
        made.append((registry, kind("gpumeter_test_series", "A test series.", LABELS, registry=registry)))
    return made


def _exposition(registry):
    """The registry's exposition less a counter's ``_created`` samples (the moment each child was made)."""
    lines = generate_latest(registry).decode().splitlines()
    kept = [line for line in lines if not line.startswith("gpumeter_test_series_created")]
    return "\n".join(kept), len(lines) - len(kept)


def _state(child):
    # The value holders and creation times are per child by design: compared through the exposition.
    return {k: v for k, v in vars(child).items() if k not in ("_value", "_created")}


@pytest.mark.parametrize("kind", [Counter, Gauge])
def test_a_factory_child_is_a_labels_child(kind):
    (reg_a, by_labels), (reg_b, by_factory) = _pair(kind)
    child = child_factory(by_factory)
    values = [("ns", "pod-a", "GPU-1"), ("ns", "pod-b", ""), ("other", "pod-a", "GPU-2")]
    for n, labels in enumerate(values):
        a, b = by_labels.labels(*labels), child(labels)
        assert type(a) is type(b) and _state(a) == _state(b)
        assert b._kwargs is not by_factory._kwargs  # a child's own dict, as the constructor gives it
        if kind is Counter:
            a.inc(n + 1.5)
            b.inc(n + 1.5)
        else:
            a.set(n * 0.25)
            b.set(n * 0.25)
        assert child(labels) is b and by_factory.labels(*labels) is b  # one child per label values
    assert _exposition(reg_a) == _exposition(reg_b)
    assert _exposition(reg_b)[1] == (3 if kind is Counter else 0)  # each counter child has its creation time
    by_factory.remove(*values[1])
    by_labels.remove(*values[1])
    assert _exposition(reg_a) == _exposition(reg_b) and "pod-b" not in _exposition(reg_b)[0]
    child(values[1]).inc()
    assert 'pod="pod-b"' in _exposition(reg_b)[0]  # made again after its removal


def test_values_are_converted_and_counted_as_labels_does():
    (reg_a, by_labels), (reg_b, by_factory) = _pair(Gauge)
    child = child_factory(by_factory)
    child(("ns", 7, None)).set(1)
    by_labels.labels("ns", 7, None).set(1)
    assert _exposition(reg_a) == _exposition(reg_b)
    assert child(("ns", "7", "None")) is by_factory.labels("ns", 7, None)
    with pytest.raises(ValueError):
        child(("ns", "pod"))
    with pytest.raises(ValueError):
        by_labels.labels("ns", "pod")


def test_a_metric_it_does_not_know_gets_labels_own_children():
    registry = CollectorRegistry()
    histogram = Histogram("gpumeter_test_seconds", "A test histogram.", ("stage",), registry=registry)
    child = child_factory(histogram)
    assert child(("decode",)) is histogram.labels("decode")
