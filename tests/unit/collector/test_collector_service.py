"""The collector's own wiring: assembly, the bounded buffer, pod-event merging, settings."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from schemas.catalog import TopicCatalog
from schemas.records import NodeSample, PodEvent, PodEventType, SharingMode
from schemas.typed import codec_for
from services.collector.assemble import NodeFacts, TickInfo, assemble_node_sample
from services.collector.cgroup import ProcessIdentityCache
from services.collector.main import parse_sharing
from services.collector.pods import pod_event_from_object
from services.collector.podresources.client import PodResourcesClient
from services.collector.publisher import BufferedPublisher, OutboundRecord
from services.collector.service import CollectorService
from services.collector.settings import collector_settings
from simulator.apiserver import make_pod_object
from simulator.kubelet import FakeKubelet
from simulator.scenario import load_scenario
from services.collector.simulation import node_streams

REPO = Path(__file__).resolve().parents[3]


def test_assembly_interns_ids_and_keeps_every_process():
    scenario = load_scenario(REPO / "scenarios" / "two_nodes.yaml")
    ticks = list(node_streams(scenario, scenario.nodes[1].name))
    sample = ticks[len(ticks) // 2].sample
    assert len(set(sample.pod_uids)) == len(sample.pod_uids)
    for device in sample.devices:
        lengths = {len(device.process_pids), len(device.process_pod_index),
                   len(device.process_used_memory_bytes), len(device.process_sm_utilization_percent)}
        assert len(lengths) == 1
        assert all(-1 <= i < len(sample.pod_uids) for i in device.process_pod_index)
    assert codec_for(NodeSample).decode(codec_for(NodeSample).encode(sample)) == sample


class _Identity:
    def __init__(self, container_id, pod_uid):
        self.container_id, self.pod_uid = container_id, pod_uid


class _Raw:
    """A device reading with just the fields assembly copies (others defaulted)."""

    def __init__(self, pids, memory):
        from services.collector.assemble import _COPIED_FIELDS

        for name in _COPIED_FIELDS:
            setattr(self, name, None)
        self.uuid, self.index, self.model = "GPU-1", 0, "x"
        self.sharing_mode, self.replicas = SharingMode.TIME_SLICING, 2
        self.mig_compute_slices = self.mig_total_compute_slices = 0
        self.memory_total_bytes, self.memory_used_bytes, self.memory_free_bytes, self.memory_reserved_bytes = 100, 50, 40, 10
        self.process_utilization_supported = True
        self.errors = ()
        self.process_pids = tuple(pids)
        self.process_used_memory_bytes = tuple(memory)
        self.process_sm_utilization_percent = tuple(-1 for _ in pids)


def test_assembly_maps_unknown_processes_to_minus_one_and_shares_ids_across_devices():
    identities = {1: _Identity("c" * 64, "pod-a"), 2: None, 3: _Identity("d" * 64, "pod-a")}
    facts = NodeFacts("c", "n", "aws", "r", "t", "spot")
    sample = assemble_node_sample(facts, TickInfo(3, 10, 20, 1000), [_Raw([1, 2], [5, 6]), _Raw([3, 1], [7, 8])],
                                  identities.get)
    assert sample.pod_uids == ("pod-a",)
    assert sample.devices[0].process_pod_index == (0, -1)
    assert sample.devices[1].process_pod_index == (0, 0)  # pid 3 and pid 1 are both pod-a
    assert (sample.sequence, sample.sampled_at_unix_ms, sample.price_model) == (3, 20, "spot")


class _FlakyProducer:
    """Stands in for RecordProducer's interface; fails while ``down`` is set. Unit-tests the buffer logic only."""

    def __init__(self, state):
        self.state = state
        self.closed = False
        state.setdefault("producers", []).append(self)

    async def start(self):
        if self.state["down"]:
            raise OSError("broker down")

    async def send_bytes(self, topic, value, *, key=None, partition=None):
        future = asyncio.get_running_loop().create_future()
        if self.state["down"]:
            future.set_exception(OSError("broker down"))
        else:
            self.state["delivered"].append(value)
            future.set_result(None)
        return future

    async def partitions_for(self, topic):
        return {0, 1, 2}

    async def abort(self):
        self.closed = True

    async def stop(self):
        self.closed = True


def _record(i: int) -> OutboundRecord:
    return OutboundRecord("t", b"k", None, str(i).encode(), "sample")


async def test_buffer_keeps_records_through_an_outage_and_delivers_them_in_order():
    state = {"down": True, "delivered": []}
    publisher = BufferedPublisher(lambda: _FlakyProducer(state), max_records=100, retry_backoff_s=0.01,
                                  retry_backoff_max_s=0.02)
    publisher.start()
    for i in range(10):
        publisher.offer(_record(i))
    await asyncio.sleep(0.1)
    assert publisher.depth == 10 and state["delivered"] == []
    assert publisher.delivery_failures >= 1
    state["down"] = False
    await publisher.close(timeout_s=2)
    assert state["delivered"] == [str(i).encode() for i in range(10)]
    assert publisher.depth == 0 and publisher.sent_count["sample"] == 10
    # Every client built on the way was closed, those whose start failed included: an open one keeps retrying
    # the broker in the background.
    assert len(state["producers"]) >= 2
    assert all(producer.closed for producer in state["producers"])


async def test_a_full_buffer_drops_the_oldest_and_counts_it():
    state = {"down": True, "delivered": []}
    publisher = BufferedPublisher(lambda: _FlakyProducer(state), max_records=3, retry_backoff_s=0.01)
    for i in range(5):
        publisher.offer(_record(i))
    assert publisher.dropped_count == 2 and publisher.depth == 3
    state["down"] = False
    publisher.start()
    await publisher.close(timeout_s=2)
    assert state["delivered"] == [b"2", b"3", b"4"]


class _RefusingProducer(_FlakyProducer):
    """Refuses the records ``refuse(topic, value)`` names: at enqueue (as aiokafka refuses one larger than
    max_request_size), or on the delivery future (as the broker refuses one larger than message.max.bytes), or
    fails them with an ordinary error every time (``how="flaky"``)."""

    def __init__(self, state, refuse, how):
        super().__init__(state)
        self.refuse, self.how = refuse, how

    async def send_bytes(self, topic, value, *, key=None, partition=None):
        from aiokafka.errors import MessageSizeTooLargeError, RequestTimedOutError

        from gpumeter.kafka.producer import DeliveryError

        if not self.refuse(topic, value):
            self.state.setdefault("topics", []).append(topic)
            return await super().send_bytes(topic, value, key=key, partition=partition)
        self.state["attempts"] = self.state.get("attempts", 0) + 1
        if self.how == "enqueue":
            try:
                raise MessageSizeTooLargeError("The message is 1280000 bytes when serialized")
            except MessageSizeTooLargeError as exc:
                raise DeliveryError(f"cannot enqueue to {topic}: {exc!r}") from exc
        future = asyncio.get_running_loop().create_future()
        future.set_exception(MessageSizeTooLargeError() if self.how == "broker" else RequestTimedOutError())
        return future


@pytest.mark.parametrize("how", ["enqueue", "broker", "flaky"])
async def test_a_record_kafka_will_not_take_is_dead_lettered_and_the_records_behind_it_flow(how):
    from gpumeter.metrics import ServiceMetrics
    from schemas.records import DeadLetter

    state = {"down": False, "delivered": []}
    poison = b"p" * 1000
    metrics = ServiceMetrics("collector")
    publisher = BufferedPublisher(lambda: _RefusingProducer(state, lambda t, v: v == poison, how), max_records=100,
                                  retry_backoff_s=0.01, retry_backoff_max_s=0.02, metrics=metrics,
                                  dead_letter_topic="dl", clock=ManualClock(77))
    publisher.start()
    publisher.offer(_record(0))
    publisher.offer(OutboundRecord("t", b"node/uid", None, poison, "pod_event", partition_by_node="node"))
    for i in range(1, 30):  # ticks keep coming, as a collector's do
        await asyncio.sleep(0.01)
        publisher.offer(_record(i))
    await publisher.close(timeout_s=5)
    (letter,) = [v for v in state["delivered"] if v.startswith(b"\xc3\x01")]  # in the poison's place
    ticks = [v for v in state["delivered"] if not v.startswith(b"\xc3\x01")]
    assert ticks == [str(i).encode() for i in range(30)]  # every tick, the ones behind the poison included
    letter = codec_for(DeadLetter).decode(letter)
    assert (letter.service, letter.source_topic, letter.source_offset, letter.source_key) == (
        "collector", "t", -1, b"node/uid")
    assert letter.reason_code == ("UNDELIVERABLE" if how == "flaky" else "TOO_LARGE")
    assert (letter.raw_bytes, letter.payload_length_bytes, letter.failed_at_unix_ms) == (poison, 1000, 77)
    assert state["attempts"] == (3 if how == "flaky" else 1)  # a bounded number of tries, then given up
    assert publisher.depth == 0 and publisher.sent_count == {"sample": 30, "pod_event": 0, "dead_letter": 1}
    assert metrics.registry.get_sample_value("gpumeter_collector_undeliverable_records_total",
                                             {"kind": "pod_event", "outcome": "dead_lettered"}) == 1


async def test_a_dead_letter_kafka_will_not_take_is_dropped_and_counted():
    state = {"down": False, "delivered": []}
    publisher = BufferedPublisher(lambda: _RefusingProducer(state, lambda t, v: t == "dl" or v == b"big", "broker"),
                                  max_records=100, retry_backoff_s=0.01, dead_letter_topic="dl")
    publisher.offer(OutboundRecord("t", b"k", None, b"big", "sample"))
    publisher.offer(_record(1))
    publisher.start()
    await publisher.close(timeout_s=5)
    assert state["delivered"] == [b"1"]
    assert publisher.undeliverable == {"dead_lettered": 1, "dropped": 1} and publisher.depth == 0


async def test_an_outage_gives_nothing_up_however_long_it_lasts():
    state = {"down": True, "delivered": []}
    publisher = BufferedPublisher(lambda: _FlakyProducer(state), max_records=100, retry_backoff_s=0.001,
                                  retry_backoff_max_s=0.001, dead_letter_topic="dl", max_record_tries=1)
    for i in range(5):
        publisher.offer(_record(i))
    publisher.start()
    await asyncio.sleep(0.2)
    assert publisher.delivery_failures > 5 and publisher.depth == 5
    state["down"] = False
    await publisher.close(timeout_s=2)
    assert state["delivered"] == [str(i).encode() for i in range(5)]
    assert publisher.undeliverable == {"dead_lettered": 0, "dropped": 0}


@pytest.mark.network
async def test_pod_events_carry_the_kubelets_assignments_and_changes_are_republished():
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    assignments = [("ml", "train-0", "main", "nvidia.com/gpu", ("GPU-aaaa",))]
    kubelet = FakeKubelet(str(socket_dir / "k.sock"), lambda: list(assignments))
    await kubelet.start()
    client = PodResourcesClient(socket_dir / "k.sock", 1.0)
    offered: list[OutboundRecord] = []

    class _Publisher:
        def offer(self, record):
            offered.append(record)

    clock = ManualClock(1_000)
    service = CollectorService(
        facts=NodeFacts("c", "node-1", "aws", "r", "t", "on_demand"), interval_seconds=1.0, clock=clock,
        backend=None, identities=None, publisher=_Publisher(), catalog=TopicCatalog(prefix="p."), kubelet=client,
    )
    try:
        obj = make_pod_object("ml", "train-0", "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", "node-1",
                              gpu_requests={"nvidia.com/gpu": 1})
        await service.on_pod_event(pod_event_from_object(obj, PodEventType.ADDED, "c", 1_000))
        first = codec_for(PodEvent).decode(offered[0].value)
        assert [a.device_ids for a in first.containers[0].assigned_devices] == [("GPU-aaaa",)]
        assert offered[0].key == b"node-1/0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b"
        assert offered[0].partition_by_node == "node-1" and offered[0].topic == "p.gpumeter.pod-events.v1"
        await service.refresh_assignments()
        assert len(offered) == 1, "unchanged assignments are not republished"
        assignments[0] = ("ml", "train-0", "main", "nvidia.com/gpu", ("GPU-bbbb",))
        clock.advance_ms(500)
        await service.refresh_assignments()
        second = codec_for(PodEvent).decode(offered[1].value)
        assert second.event_type == PodEventType.MODIFIED and second.observed_at_unix_ms == 1_500
        assert [a.device_ids for a in second.containers[0].assigned_devices] == [("GPU-bbbb",)]
    finally:
        await client.close()
        await kubelet.stop()


@pytest.mark.network
async def test_a_missing_kubelet_degrades_to_cgroup_mapping():
    client = PodResourcesClient("/tmp/does-not-exist-gpumeter.sock", 0.5)
    offered = []

    class _Publisher:
        def offer(self, record):
            offered.append(record)

    service = CollectorService(
        facts=NodeFacts("c", "node-1", "aws", "r", "t", "on_demand"), interval_seconds=1.0, clock=ManualClock(0),
        backend=None, identities=ProcessIdentityCache(Path("/nonexistent")), publisher=_Publisher(),
        catalog=TopicCatalog(), kubelet=client,
    )
    obj = make_pod_object("ml", "a", "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", "node-1")
    await service.on_pod_event(pod_event_from_object(obj, PodEventType.ADDED, "c", 0))
    assert service.kubelet_available is False
    assert len(offered) == 1


def test_sharing_config_parsing():
    assert parse_sharing("GPU-1=time_slicing:4, GPU-2=exclusive") == {
        "GPU-1": (SharingMode.TIME_SLICING, 4), "GPU-2": (SharingMode.EXCLUSIVE, 1)}
    with pytest.raises(ConfigError):
        parse_sharing("GPU-1=shared")


def test_settings_from_env_and_flags():
    import argparse

    from services.collector.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--interval", "2", "--bootstrap-servers", "b:1"])
    settings = collector_settings(args, {"GPUMETER_NODE_NAME": "n1", "GPUMETER_PRICE_MODEL": "spot",
                                         "GPUMETER_KAFKA_SASL_PASSWORD": "hunter2"})
    assert (settings.node_name, settings.interval_seconds, settings.price_model) == ("n1", 2.0, "spot")
    assert settings.kafka.bootstrap_servers == "b:1"
    assert "hunter2" not in str(settings.describe())
    with pytest.raises(ConfigError):
        collector_settings(parser.parse_args([]), {})


def test_a_simulated_collector_reports_the_scenarios_cluster_unless_one_is_set():
    import argparse

    from services.collector.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    path = REPO / "scenarios" / "two_nodes.yaml"
    scenario = load_scenario(path)
    simulate = ["--simulate", str(path), "--node", scenario.nodes[0].name]
    assert scenario.cluster != "default"
    assert collector_settings(parser.parse_args(simulate), {}).cluster_for(scenario.cluster) == scenario.cluster
    # Set explicitly, by flag or variable, the cluster wins over the scenario's.
    assert collector_settings(parser.parse_args([*simulate, "--cluster", "prod-eu"]), {}).cluster_for(
        scenario.cluster) == "prod-eu"
    assert collector_settings(parser.parse_args(simulate), {"GPUMETER_CLUSTER": "prod-eu"}).cluster_for(
        scenario.cluster) == "prod-eu"
    # Neither set nor simulated: the default.
    assert collector_settings(parser.parse_args(["--node", "n1"]), {}).cluster_for(None) == "default"


@pytest.mark.network
async def test_index_ids_from_the_kubelet_are_published_as_uuids_once_nvml_was_read():
    """deviceIDStrategy: index through our kubelet peer: before the first NVML read the ids cannot be resolved and
    go out as they are; the next assignment refresh after a read republishes the pod with uuids."""
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp"))
    assignments = [("ml", "train-0", "main", "nvidia.com/gpu", ("1::2",))]
    kubelet = FakeKubelet(str(socket_dir / "k.sock"), lambda: list(assignments))
    await kubelet.start()
    client = PodResourcesClient(socket_dir / "k.sock", 1.0)
    offered: list[OutboundRecord] = []

    class _Publisher:
        def offer(self, record):
            offered.append(record)

    class _Backend:
        uuid_by_index: dict[str, str] = {}

    backend = _Backend()
    service = CollectorService(
        facts=NodeFacts("c", "node-1", "aws", "r", "t", "on_demand"), interval_seconds=1.0, clock=ManualClock(1_000),
        backend=backend, identities=None, publisher=_Publisher(), catalog=TopicCatalog(prefix="p."), kubelet=client,
    )
    try:
        obj = make_pod_object("ml", "train-0", "0f6e4b2a-1c3d-4e5f-8a9b-0c1d2e3f4a5b", "node-1",
                              gpu_requests={"nvidia.com/gpu.shared": 1})
        obj["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "1"}]
        await service.on_pod_event(pod_event_from_object(obj, PodEventType.ADDED, "c", 1_000))
        first = codec_for(PodEvent).decode(offered[-1].value)
        assert [a.device_ids for a in first.containers[0].assigned_devices] == [("1::2",)]
        backend.uuid_by_index = {"0": "GPU-aaaa", "1": "GPU-bbbb"}  # NVML read
        await service.refresh_assignments()
        second = codec_for(PodEvent).decode(offered[-1].value)
        assert second.event_type == PodEventType.MODIFIED
        assert [a.device_ids for a in second.containers[0].assigned_devices] == [("GPU-bbbb::2",)]
        assert second.containers[0].visible_devices_env == "GPU-bbbb"
        await service.refresh_assignments()
        assert len(offered) == 2, "resolved and unchanged: not republished"
    finally:
        await client.close()
        await kubelet.stop()
