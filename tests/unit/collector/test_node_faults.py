"""Node faults through the whole collector tick: NVML failing on every call at once.

``GPU_IS_LOST`` or ``NOT_SUPPORTED`` from every NVML function (the driver gone, a GPU fallen off the bus, a
virtualised GPU without the APIs) must never stop the collector: each tick still publishes a ``NodeSample`` that
carries the errors (counted in ``gpumeter_collector_nvml_errors_total``), that sample passes the consumers' range
checks (so it is attributed, not dead-lettered), the sequence goes on without a gap, and once NVML answers again
the next tick reports the GPUs as before.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import ModuleType

import pynvml
import pytest

from gpumeter.clock import ManualClock
from gpumeter.metrics import ServiceMetrics
from gpumeter.validation import DEFAULT_MAX_CLOCK_SKEW_SECONDS, DEFAULT_MAX_SAMPLE_AGE_SECONDS, check_sample
from schemas.catalog import TopicCatalog
from schemas.records import NodeSample
from schemas.typed import codec_for
from services.collector.assemble import NodeFacts
from services.collector.cgroup import ProcessIdentityCache
from services.collector.nvml_backend import NvmlBackend
from services.collector.service import CollectorService
from simulator.nvml_driver import simulated_pynvml
from simulator.world import SimWorld
from tests.unit.collector.test_nvml_backend import Proxy, scenario, sharing_config

CODES = {"GPU_IS_LOST": pynvml.NVML_ERROR_GPU_IS_LOST, "NOT_SUPPORTED": pynvml.NVML_ERROR_NOT_SUPPORTED}


class Switch:
    """Every NVML function of the wrapped module raises ``NVMLError(code)`` while ``code`` is set, except those
    named in ``spared``."""

    def __init__(self, spared: frozenset[str] = frozenset()) -> None:
        self.code: int | None = None
        self.spared = spared

    def wrap(self, fake: ModuleType) -> Proxy:
        overrides = {}
        for name in dir(fake):
            if not name.startswith("nvml") or name in self.spared:
                continue
            real = getattr(fake, name)
            if callable(real) and not isinstance(real, type):
                overrides[name] = self._failing(real)
        return Proxy(fake, **overrides)

    def _failing(self, real):
        def call(*args, **kwargs):
            if self.code is not None:
                raise pynvml.NVMLError(self.code)
            return real(*args, **kwargs)

        return call


class Recorder:
    def __init__(self) -> None:
        self.records = []

    def offer(self, record) -> None:
        self.records.append(record)


def collector(switch: Switch):
    s = scenario("exclusive")
    node = s.nodes[0]
    clock = ManualClock(s.start_unix_ms + 30_000)
    fake = simulated_pynvml(SimWorld(s), clock, node.name)
    backend = NvmlBackend(switch.wrap(fake), clock, sharing_by_gpu_uuid=sharing_config(node))
    publisher = Recorder()
    metrics = ServiceMetrics("collector")
    service = CollectorService(
        facts=NodeFacts("c1", node.name, "aws", "us-east-1", "g5.12xlarge", "on_demand"), interval_seconds=1.0,
        clock=clock, backend=backend, identities=ProcessIdentityCache(Path("/nonexistent-gpumeter-proc")),
        publisher=publisher, catalog=TopicCatalog(prefix="t."), metrics=metrics,
    )
    return service, clock, publisher, metrics, len(node.gpus)


def nvml_errors(metrics: ServiceMetrics, function: str, code: str) -> float:
    value = metrics.registry.get_sample_value("gpumeter_collector_nvml_errors_total",
                                              {"nvml_function": function, "error_code": code})
    return 0.0 if value is None else value


def assert_consumable(sample: NodeSample, now_ms: int) -> None:
    # What the attributor and the guard check first: a faulty node's tick is not bad input.
    check_sample(sample, now_ms, DEFAULT_MAX_CLOCK_SKEW_SECONDS * 1000, DEFAULT_MAX_SAMPLE_AGE_SECONDS * 1000)


@pytest.mark.parametrize("code_name", sorted(CODES))
@pytest.mark.parametrize("from_the_start", [False, True], ids=["after-a-good-tick", "from-the-first-tick"])
async def test_every_nvml_call_failing_gives_samples_with_errors_and_the_ticks_go_on(code_name, from_the_start):
    switch = Switch()
    service, clock, publisher, metrics, gpu_count = collector(switch)
    samples = []
    if not from_the_start:
        samples.append(await service.tick())
        assert len(samples[0].devices) == gpu_count and samples[0].node_errors == ()
        clock.advance_ms(1_000)

    switch.code = CODES[code_name]
    for _ in range(2):
        faulty = await service.tick()
        samples.append(faulty)
        # NVML cannot even be initialised or count its GPUs: the tick says so and reports no device.
        failed = "nvmlInit" if from_the_start else "nvmlDeviceGetCount"
        assert [(e.nvml_function, e.error_code) for e in faulty.node_errors] == [(failed, code_name)]
        assert faulty.devices == ()
        assert_consumable(faulty, clock.now_ms())
        clock.advance_ms(1_000)
    assert nvml_errors(metrics, failed, code_name) == 2

    switch.code = None
    recovered = await service.tick()
    samples.append(recovered)
    assert len(recovered.devices) == gpu_count and recovered.node_errors == ()
    assert all(d.errors == () for d in recovered.devices)
    assert_consumable(recovered, clock.now_ms())

    # Every tick was published, decodes to what the tick returned, and the sequence has no gap.
    published = [codec_for(NodeSample).decode(r.value) for r in publisher.records]
    assert published == samples
    assert [s.sequence for s in published] == list(range(len(samples)))
    assert metrics.registry.get_sample_value("gpumeter_collector_ticks_total") == len(samples)


@pytest.mark.parametrize("code_name", sorted(CODES))
async def test_every_device_call_failing_keeps_each_gpu_in_the_sample_with_its_errors(code_name):
    # NVML itself answers (init, the device count and the handles), every question about a device fails.
    switch = Switch(spared=frozenset({"nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                                      "nvmlSystemGetDriverVersion"}))
    service, clock, publisher, metrics, gpu_count = collector(switch)
    good = await service.tick()
    clock.advance_ms(1_000)
    switch.code = CODES[code_name]
    faulty = await service.tick()
    # The GPUs stay in the sample under the uuids seen before, each with its errors and no readings.
    assert [d.uuid for d in faulty.devices] == [d.uuid for d in good.devices]
    for device in faulty.devices:
        assert device.errors and {e.error_code for e in device.errors} == {code_name}
        assert device.process_pids == () and device.process_utilization_supported is False
    assert_consumable(faulty, clock.now_ms())
    occurrences = Counter((e.nvml_function, e.error_code) for d in faulty.devices for e in d.errors)
    assert sum(occurrences.values()) >= gpu_count
    assert {key: nvml_errors(metrics, *key) for key in occurrences} == dict(occurrences)
    clock.advance_ms(1_000)
    switch.code = None
    recovered = await service.tick()
    assert [d.uuid for d in recovered.devices] == [d.uuid for d in good.devices]
    assert all(d.errors == () for d in recovered.devices)
    assert [r.kind for r in publisher.records] == ["sample"] * 3
