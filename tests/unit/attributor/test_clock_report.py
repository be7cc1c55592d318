"""The attributor reports each node's clock offset (``gpumeter_attributor_node_clock_skew_seconds``) and the ticks
of second collectors it merged, once a second, from its processor's figures. No broker."""

from __future__ import annotations

from gpumeter.clock import ManualClock
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from services.attributor.app import AttributorStream
from services.attributor.settings import AttributorSettings


def test_every_nodes_offset_and_new_second_collector_ticks_are_reported(tmp_path):
    metrics = ServiceMetrics("attributor")
    settings = AttributorSettings(kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), partitions=2,
                                  data_dir=tmp_path, metrics_port=0)
    stream = AttributorStream(settings, ManualClock(1_796_000_000_000), metrics)
    offsets = {("c", "node-a"): 1500, ("c", "node-b"): -250}
    counts = {("c", "node-a"): 3}
    stream.processor.clock_offsets = lambda: offsets
    stream.processor.second_collector_counts = lambda: counts

    def value(name, node):
        return metrics.registry.get_sample_value(name, {"node": node})

    stream._report_clocks()
    assert value("gpumeter_attributor_node_clock_skew_seconds", "node-a") == 1.5
    assert value("gpumeter_attributor_node_clock_skew_seconds", "node-b") == -0.25
    assert value("gpumeter_attributor_second_collector_ticks_total", "node-a") == 3
    offsets[("c", "node-a")] = 0
    counts[("c", "node-a")] = 5
    stream._report_clocks()  # the gauge follows the offset; the counter grows by the ticks merged since
    assert value("gpumeter_attributor_node_clock_skew_seconds", "node-a") == 0
    assert value("gpumeter_attributor_node_clock_skew_seconds", "node-b") == -0.25
    assert value("gpumeter_attributor_second_collector_ticks_total", "node-a") == 5
