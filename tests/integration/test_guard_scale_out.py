"""Two guards of the ``nodes`` role in one consumer group on the session's Kafka broker, the second started
mid-run: they split the nodes, and the violations a rebalance moves stay as they were.

Six nodes (two per partition) each run a leaky pod (``NVIDIA_VISIBLE_DEVICES=all``, no GPU requested) and send a
sample every 0.2 s. The first guard fires the six leaks. The second joins the group: the partitions are split
(partition ``p`` of the four input topics to one member), the one that moves is rebuilt by its new owner from the
violations topic and its pod events. Then, on a moved node, one pod is deleted and a new leaky pod starts.

Asserted: every sample is handled by exactly one guard (the per-instance counts add up to the samples topic, no
offset twice) -- before this change both guards read every partition (``assignment="all"``) and each handled all
of them; the violations topic holds one FIRING per leak (none resolved and fired again by the hand-over, same
``first_seen``), the deleted pod's leak RESOLVED by the new owner under its fingerprint, the new leak FIRING once;
each guard owns a disjoint set of partitions whose union is all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import Counter

import pytest

from gpumeter.clock import SystemClock
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from schemas.records import PodEventType, SharingMode, ViolationState
from services.guard import main as guard_main
from services.guard.config import GuardConfig
from services.guard.nodes import NodeGuardProcessor
from services.guard.settings import GuardSettings
from tests.integration.test_billing_stream import wait_until_committed_to_end
from tests.integration.test_guard_stream import violations_on_topic
from tests.integration.topic_reading import end_offsets
from tests.unit.attributor import device, node_sample, pod_event

pytestmark = pytest.mark.integration

PARTITIONS = 3
HOLD_DOWN_SECONDS = 2
CLUSTER = "it"
WAIT_S = 60.0


def nodes_by_partition(per_partition: int = 2) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    i = 0
    while any(len(names) < per_partition for names in found.values()):
        name = f"scale-node-{i}"
        names = found[partition_for_node(name, PARTITIONS)]
        if len(names) < per_partition:
            names.append(name)
        i += 1
    return found


NODES = nodes_by_partition()
ALL_NODES = [n for p in sorted(NODES) for n in NODES[p]]


def leaky_pod(node: str, uid: str, now_ms: int, event_type: PodEventType = PodEventType.ADDED):
    event = pod_event(uid, namespace="research", name=f"nb-{uid[:8]}", node=node, cluster=CLUSTER,
                      observed_at_unix_ms=now_ms, event_type=event_type, resource_version=str(now_ms))
    (container,) = event.containers
    return dataclasses.replace(event, containers=(dataclasses.replace(container, visible_devices_env="all"),))


class Recording(NodeGuardProcessor):
    """The real processor, recording the (topic, partition, offset) of every record its engines handle."""

    instances: list["Recording"] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handled: list[tuple[str, int, int]] = []
        Recording.instances.append(self)

    def handle(self, event, position):
        skipped = self.stats.reread_skipped
        result = super().handle(event, position)
        if self.stats.reread_skipped == skipped:
            self.handled.append((position.topic, position.partition, position.offset))
        return result


async def produce_pods(kafka_settings, topics, *events) -> None:
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for event in events:
            await producer.send(topics.pod_events, event, key=pod_event_key(event.node_name, event.uid),
                                partition=partition_for_node(event.node_name, PARTITIONS))
        await producer.flush()
    finally:
        await producer.stop()


async def tick_nodes(kafka_settings, topics, clock, interval_s: float = 0.2) -> None:
    """A sample of every node every ``interval_s`` (a GPU, nobody on it) until cancelled."""
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        while True:
            for i, node in enumerate(ALL_NODES):
                gpu = device(f"GPU-{i:08d}-0000-0000-0000-000000000000", mode=SharingMode.EXCLUSIVE)
                await producer.send(topics.node_samples, node_sample(clock.now_ms(), [gpu], node=node,
                                                                      cluster=CLUSTER),
                                    key=node.encode(), partition=partition_for_node(node, PARTITIONS))
            await producer.flush()
            await asyncio.sleep(interval_s)
    finally:
        await producer.stop()


async def wait_for(predicate, what: str, describe=lambda: ""):
    deadline = time.monotonic() + WAIT_S
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: {describe()}")
        await asyncio.sleep(0.2)


async def test_a_second_guard_takes_half_the_nodes_without_duplicating_work_or_moving_violations(
        kafka_settings, topic_catalog, group_id, monkeypatch):
    monkeypatch.setattr(guard_main, "NodeGuardProcessor", Recording)
    Recording.instances = []
    config = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=3600)
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group_id, metrics_port=0, role="nodes",
                             topic_partitions=PARTITIONS, clock_interval_seconds=0.2)
    clock = SystemClock()
    topic = topic_catalog.violations
    uids = {node: str(uuid.uuid4()) for node in ALL_NODES}
    stops = [asyncio.Event(), asyncio.Event()]
    services: list[asyncio.Task] = []
    ticking = asyncio.create_task(tick_nodes(kafka_settings, topic_catalog, clock))

    async def violations():
        return [v for _, v in await violations_on_topic(kafka_settings, topic)]

    try:
        # 1. One guard: the six leaks fire.
        services.append(asyncio.create_task(guard_main.serve(settings, config=config, stop=stops[0], clock=clock)))
        await produce_pods(kafka_settings, topic_catalog,
                           *(leaky_pod(node, uid, clock.now_ms()) for node, uid in uids.items()))
        await wait_for(lambda: _firing_pods(violations, set(uids.values())), "the first guard fires six leaks")
        first = Recording.instances[0]
        assert first.owned == (0, 1, 2)

        # 2. A second guard joins the group: the partitions are split between the two.
        services.append(asyncio.create_task(guard_main.serve(settings, config=config, stop=stops[1], clock=clock)))

        async def split():
            if len(Recording.instances) < 2:
                return None
            a, b = (set(r.owned) for r in Recording.instances)
            return (a, b) if a and b and not a & b and a | b == {0, 1, 2} and not any(
                r.rebuilding for r in Recording.instances) else None

        owned_a, owned_b = await wait_for(split, "the two guards split the partitions",
                                          lambda: [r.owned for r in Recording.instances])
        second = Recording.instances[1]
        assert second.stats.rebuilds == len(owned_b)

        # 3. On a node the second guard took over: one leaky pod deleted, a new one started.
        moved = min(owned_b)
        gone_node, new_node = NODES[moved]
        new_uid = str(uuid.uuid4())
        await produce_pods(kafka_settings, topic_catalog,
                           leaky_pod(gone_node, uids[gone_node], clock.now_ms(), PodEventType.DELETED),
                           leaky_pod(new_node, new_uid, clock.now_ms()))

        async def settled():
            records = await violations()
            states = [(v.pod_uid, v.state) for v in records]
            return records if ((uids[gone_node], ViolationState.RESOLVED) in states
                               and (new_uid, ViolationState.FIRING) in states) else None

        records = await wait_for(settled, "the deleted leak resolves, the new one fires")
        await asyncio.sleep(2 * HOLD_DOWN_SECONDS)  # anything spurious (a resolve, a refire) would come now
        ticking.cancel()
        for t in (topic_catalog.node_samples, topic_catalog.pod_events):
            await wait_until_committed_to_end(kafka_settings, group_id, t, f"the group read {t}")
    finally:
        ticking.cancel()
        for stop in stops:
            stop.set()
        for service in services:
            assert await asyncio.wait_for(service, WAIT_S) == 0

    # Every sample handled by exactly one guard.
    ends = await end_offsets(kafka_settings, topic_catalog.node_samples)
    handled = Counter(h for r in Recording.instances for h in r.handled if h[0] == topic_catalog.node_samples)
    assert sum(ends.values()) > 0
    assert [h for h, n in handled.items() if n > 1] == []
    assert sorted(handled) == sorted((topic_catalog.node_samples, p, o) for p, end in ends.items()
                                     for o in range(end))
    by_instance = [sum(1 for h in r.handled if h[0] == topic_catalog.node_samples) for r in Recording.instances]
    assert all(n > 0 for n in by_instance) and sum(by_instance) == sum(ends.values())
    # After the split, each guard handled only its own partitions' samples.
    assert set(owned_a) | set(owned_b) == {0, 1, 2} and not set(owned_a) & set(owned_b)

    # The violations topic: one FIRING per leak, the moved ones not resolved nor fired again.
    records = await violations()
    by_pod: dict[str, list] = {}
    for v in records:
        by_pod.setdefault(v.pod_uid, []).append(v)
    for node, uid in uids.items():
        states = [v.state for v in by_pod[uid]]
        if node == gone_node:
            assert states == [ViolationState.FIRING, ViolationState.RESOLVED], (node, states)
            firing, resolved = by_pod[uid]
            assert (resolved.fingerprint, resolved.first_seen_unix_ms) == (firing.fingerprint,
                                                                            firing.first_seen_unix_ms)
        else:
            assert states == [ViolationState.FIRING], (node, states)
    assert [v.state for v in by_pod[new_uid]] == [ViolationState.FIRING]
    assert set(by_pod) == {*uids.values(), new_uid}


async def _firing_pods(violations, expected: set[str]) -> bool:
    return {v.pod_uid for v in await violations() if v.state is ViolationState.FIRING} >= expected
