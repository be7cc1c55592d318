"""Collectors for a simulated 2-node scenario against a real broker, with a broker stop and restart mid-run.

What must hold: every tick of every node arrives (sequence numbers without a gap), each sample matches the
simulator's truth (per-process memory exact per pod and unit, every process of a pod mapped to that pod, sharing
modes right), and each pod's events carry the devices the kubelet assigned.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from gpumeter.devtools.kafka_broker import KafkaBroker
from gpumeter.kafka.admin import create_topics
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog, partition_for_node
from schemas.records import NodeSample, PodEvent, PodEventType
from schemas.typed import codec_for
from simulator.scenario import load_scenario
from simulator.world import SimWorld
from services.collector.simulation import sharing_config
from tests.integration.topic_reading import read_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "scenarios" / "two_nodes.yaml"


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory):
    """A broker of this module's own: the test stops and restarts it."""
    broker = KafkaBroker(Path(tmp_path_factory.mktemp("kafka-restart")), heap_mb=512)
    broker.start()
    yield broker
    broker.stop()


def test_two_simulated_collectors_lose_no_tick_across_a_broker_restart(own_broker, tmp_path):
    scenario = load_scenario(SCENARIO)
    settings = KafkaSettings(bootstrap_servers=own_broker.bootstrap_servers, topic_prefix=f"c{uuid.uuid4().hex[:8]}.")
    catalog = TopicCatalog(prefix=settings.topic_prefix, partitions_override=3)
    asyncio.run(create_topics(settings, catalog))
    time_scale = 10.0  # two_nodes ticks every 5 simulated seconds: one tick per 0.5 s of real time
    ticks_per_second = time_scale / scenario.interval_seconds
    # Deliveries time out after 1.5 s, so the 5 s outage below outlasts the client's own retries and the
    # collectors' buffers carry the ticks.
    env = {**os.environ, "GPUMETER_LOG_LEVEL": "INFO", "GPUMETER_DELIVERY_TIMEOUT_SECONDS": "1.5"}
    # Output goes to files, not pipes: a pipe nobody reads until the end fills up, and a full pipe blocks the
    # collector's event loop in its next log write.
    log_paths = [tmp_path / f"{node.name}.log" for node in scenario.nodes]
    collectors = []
    for node, log_path in zip(scenario.nodes, log_paths):
        with log_path.open("w") as log_file:
            collectors.append(subprocess.Popen(
                [sys.executable, "-m", "gpumeter.cli", "collector", "--node", node.name, "--simulate", str(SCENARIO),
                 "--time-scale", str(time_scale), "--metrics-port", "0",
                 "--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix],
                env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            ))
    try:
        time.sleep(3.0)
        own_broker.stop()  # the collectors keep ticking into their buffers
        time.sleep(5.0)
        own_broker.start()
        # The collectors stop (SIGTERM, as Kubernetes stops them) only once the broker is back, however long its
        # restart took: their close then has its whole drain time to deliver what the outage left buffered.
        time.sleep(2.0)
        for collector in collectors:
            collector.send_signal(signal.SIGTERM)
        for collector in collectors:
            collector.wait(timeout=90)
    finally:
        for collector in collectors:
            if collector.poll() is None:
                collector.kill()
    outputs = [log_path.read_text() for log_path in log_paths]
    assert [c.returncode for c in collectors] == [0, 0], outputs
    # The outage really hit the run: the collectors saw deliveries fail and kept the records; then they delivered
    # every one of them before exiting.
    assert all("kafka delivery failed" in output for output in outputs), outputs
    assert all(" 0 undelivered" in output for output in outputs), outputs

    samples_raw = asyncio.run(read_messages(settings, catalog.node_samples))
    events_raw = asyncio.run(read_messages(settings, catalog.pod_events))
    samples = [codec_for(NodeSample).decode(m.value) for m in samples_raw]
    events = [codec_for(PodEvent).decode(m.value) for m in events_raw]

    # No tick lost: per node, one collector run, and every tick that collector says it made is on the topic
    # (duplicates allowed). The count comes from the collector itself, not from the wall clock: on a loaded
    # machine start-up takes longer, and fewer ticks made is no loss.
    by_node: dict[str, dict[int, NodeSample]] = defaultdict(dict)
    for sample in samples:
        by_node[sample.node_name][sample.sequence] = sample
    for node, output in zip(scenario.nodes, outputs):
        made = re.search(r"stopped after (\d+) ticks", output)
        assert made, output[-4000:]
        sequences = sorted(by_node[node.name])
        assert sequences == list(range(int(made.group(1)))), f"{node.name} lost ticks: {sequences}\n{output[-4000:]}"
        # The outage (5 s of the run, ten ticks' worth) and the 2 s after it were ticked through.
        assert len(sequences) >= 5 * ticks_per_second, (node.name, sequences, output[-4000:])
        assert len({s.collector_started_at_unix_ms for s in by_node[node.name].values()}) == 1

    # `collector --simulate` reports the scenario's cluster (no --cluster given), not the default one.
    assert {s.cluster for s in samples} == {e.cluster for e in events} == {scenario.cluster} != {"default"}

    # Samples and pod events of a node share the partition number.
    for message, sample in zip(samples_raw, samples):
        assert message.partition == partition_for_node(sample.node_name, 3)
    for message, event in zip(events_raw, events):
        assert message.partition == partition_for_node(event.node_name, 3)
        assert message.key == f"{event.node_name}/{event.uid}".encode()

    # Each sample equals the simulator's truth at its time.
    world = SimWorld(scenario)
    gpu_modes = {uuid: mode for node in scenario.nodes for uuid, (mode, _) in sharing_config(node).items()}
    pods_seen = set()
    for sample in samples:
        observed: dict[tuple[str, str | None], int] = defaultdict(int)
        for device in sample.devices:
            physical = device.parent_uuid or device.uuid
            assert device.sharing_mode == gpu_modes[physical]
            for pod_index, memory in zip(device.process_pod_index, device.process_used_memory_bytes):
                pod_uid = sample.pod_uids[pod_index] if pod_index >= 0 else None
                observed[(device.uuid, pod_uid)] += memory
                pods_seen.add(pod_uid)
        truth = {(row.gpu_uuid, row.pod_uid): row.true_memory_bytes
                 for row in world.truth(sample.sampled_at_unix_ms) if row.node_name == sample.node_name}
        assert dict(observed) == truth, f"{sample.node_name} seq {sample.sequence}"

    # Pod events: every pod that ran got an ADDED event with the kubelet's device assignment.
    added = {e.uid: e for e in events if e.event_type == PodEventType.ADDED}
    for sample in samples:
        for pod in world.pods_at(sample.sampled_at_unix_ms, sample.node_name):
            assert pod.uid in added, f"no ADDED event for {pod.namespace}/{pod.name}"
            event = added[pod.uid]
            assert (event.namespace, event.name, event.node_name) == (pod.namespace, pod.name, pod.node_name)
            # Published after the namespace watch listed the namespaces: with the Namespace object's labels.
            assert event.namespace_labels.get("kubernetes.io/metadata.name") == pod.namespace
            expected_devices = {c.name: c.assigned_devices for c in pod.containers}
            assert {c.name: c.assigned_devices for c in event.containers} == expected_devices
    assert pods_seen - {None}, "the scenario's pods ran on GPUs"
