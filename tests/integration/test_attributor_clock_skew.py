"""A node whose clock is 10 minutes behind, through the real broker and a ``gpumeter attributor`` worker: the
broker's append time (the samples and pod-events topics are ``LogAppendTime``) is what decides, not the node's
clock nor the timestamp its producer puts on the message. Before the correction every tick of such a node was
dead-lettered ``LATE`` (its windows long closed by the worker's clock)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from aiokafka import AIOKafkaProducer

from gpumeter.clock import SystemClock
from schemas.catalog import partition_for_node, pod_event_key
from schemas.records import NodeSample, PodEvent
from schemas.typed import codec_for
from tests.integration.test_attributor_stream import PARTITIONS, WINDOW_MS, AttributorProcess, Outputs, pods_of, tick

pytestmark = pytest.mark.integration

NODE = "gpu-node-skewed"
SKEW_MS = -600_000
TICKS = 24


async def test_the_brokers_append_time_decides_the_window_of_a_node_whose_clock_is_behind(
        kafka_settings, topic_catalog, group_id, tmp_path):
    producer = AIOKafkaProducer(**kafka_settings.client_kwargs())
    outputs = Outputs(kafka_settings, topic_catalog, group_id)
    worker = AttributorProcess(kafka_settings, tmp_path, "skew", "--idle-close-seconds", "1")
    partition = partition_for_node(NODE, PARTITIONS)
    await producer.start()
    await outputs.consumer.start()
    try:
        worker.start()
        await worker.wait_ready(45)
        await asyncio.sleep(2.0)  # the worker's clock runs over a caught-up input
        started_ms = SystemClock().now_ms()
        base = started_ms + SKEW_MS  # the node's clock
        for event in pods_of(NODE, base):
            # The node's producer stamps the message with the node's clock; the topic's LogAppendTime overrides it.
            await producer.send_and_wait(topic_catalog.pod_events, codec_for(PodEvent).encode(event),
                                         key=pod_event_key(NODE, event.uid), partition=partition,
                                         timestamp_ms=event.observed_at_unix_ms)
        sent = []
        for k in range(TICKS):  # live, one tick a second
            sample = dataclasses.replace(tick(NODE, base, k), sampled_at_unix_ms=SystemClock().now_ms() + SKEW_MS)
            sent.append(sample)
            await producer.send_and_wait(topic_catalog.node_samples, codec_for(NodeSample).encode(sample),
                                         key=NODE.encode(), partition=partition, timestamp_ms=sample.sampled_at_unix_ms)
            await asyncio.sleep(1.0)
        finished_ms = SystemClock().now_ms()

        def windows() -> set[int]:
            return {s.window_start_unix_ms for s in outputs.shares}

        # Every window of the true time the ticks were sent in (the last one included), closed by the worker's clock.
        wanted = set(range(started_ms // WINDOW_MS * WINDOW_MS, (finished_ms - 1000) // WINDOW_MS * WINDOW_MS + 1,
                           WINDOW_MS))
        await outputs.poll_until(lambda: wanted <= windows() or bool(outputs.dead_letters), 60,
                                 "the node's windows", worker.log)
        await outputs.drain(3.0)
        assert worker.stop() == 0, worker.log()[-4000:]
    finally:
        worker.kill()
        await outputs.consumer.stop()
        await producer.stop()

    assert [(d.reason_code, d.reason) for d in outputs.dead_letters] == []
    got = windows()
    assert wanted <= got
    # Nothing in the node's own (10 minutes behind) windows: the broker's clock decided.
    assert min(got) >= started_ms // WINDOW_MS * WINDOW_MS - WINDOW_MS
    # Full coverage: every tick counted once, in a window of when it was really sampled.
    covered = {}
    for share in outputs.shares:
        covered[share.window_start_unix_ms] = share.node_covered_seconds
    assert sum(covered.values()) == pytest.approx(TICKS * 1.0)
    assert all(s.pod_uid in {f"{NODE}-a", f"{NODE}-b", None} for s in outputs.shares)
    assert {s.pod_uid for s in outputs.shares if s.pod_uid} == {f"{NODE}-a", f"{NODE}-b"}
