"""The guard service end to end against the session's Kafka broker.

A pod whose spec sets ``NVIDIA_VISIBLE_DEVICES=all`` (no GPU requested) and a sample showing its process on a GPU
→ FIRING ``visibility_leak`` violations on the violations topic, keyed by their fingerprints; a garbage sample in
front of them → a DeadLetter while the rest is processed. The service stops and starts again from its state
file; then the pod is deleted, the next sample shows the GPU free, and once the (short) hold-down has passed every
violation is RESOLVED under the same fingerprint with its original ``first_seen`` (the state survived the
restart). ``gpumeter violations --active`` shows them while they fire and nothing at the end, when ``gpumeter
violations`` shows the resolved ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import pytest

from gpumeter import cli
from gpumeter.clock import SystemClock
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from schemas.records import DeadLetter, PodEventType, SharingMode, Violation, ViolationState
from schemas.typed import codec_for
from services.guard.config import GuardConfig
from services.guard.main import serve
from services.guard.state import GuardStateStore
from services.guard.settings import GuardSettings
from services.guard.violations_cli import violation_json
from tests.integration.topic_reading import read_records
from tests.unit.attributor import GIB, device, node_sample, pod_event

pytestmark = pytest.mark.integration

PARTITIONS = 3
HOLD_DOWN_SECONDS = 2
GARBAGE = b"\xc3\x01 not a NodeSample at all"
WAIT_S = 20.0
NODE = "gpu-node-1"
CLUSTER = "it"
GPU_UUID = "GPU-11111111-2222-3333-4444-555555555555"


async def violations_on_topic(settings, topic: str) -> list[tuple[bytes, Violation]]:
    return await read_records(settings, topic, codec_for(Violation).decode)


async def wait_for_violations(settings, topic: str, predicate, what: str) -> list[tuple[bytes, Violation]]:
    deadline = time.monotonic() + WAIT_S
    while True:
        records = await violations_on_topic(settings, topic)
        if predicate([v for _, v in records]):
            return records
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: the violations topic holds {[(v.rule, v.state, v.gpu_uuid) for _, v in records]}")
        await asyncio.sleep(0.2)


def leaky_pod(now_ms: int, pod_uid: str, event_type: PodEventType = PodEventType.ADDED):
    """A pod that requests no GPU and whose container sets NVIDIA_VISIBLE_DEVICES=all."""
    event = pod_event(pod_uid, namespace="research", name="notebook-0", node=NODE, cluster=CLUSTER,
                      observed_at_unix_ms=now_ms, event_type=event_type, labels={"team": "vision"},
                      resource_version=str(now_ms))
    (container,) = event.containers
    return dataclasses.replace(event, containers=(dataclasses.replace(container, visible_devices_env="all"),))


def sample_at(now_ms: int, pod_uid: str, *, process_memory_bytes: int):
    procs = [(0, process_memory_bytes, 40)] if process_memory_bytes else []
    gpu = device(GPU_UUID, used=process_memory_bytes, util=40 if procs else 0, procs=procs,
                 mode=SharingMode.EXCLUSIVE)
    return node_sample(now_ms, [gpu], pod_uids=[pod_uid] if procs else [], node=NODE, cluster=CLUSTER)


async def produce(settings, topics, *items) -> None:
    """``items``: ("pod", PodEvent) | ("garbage", bytes for the samples topic), in order."""
    producer = RecordProducer(settings)
    await producer.start()
    try:
        partition = partition_for_node(NODE, PARTITIONS)
        for kind, item in items:
            if kind == "pod":
                await producer.send(topics.pod_events, item, key=pod_event_key(NODE, item.uid),
                                    partition=partition)
            else:
                await producer.send_bytes(topics.node_samples, item, key=NODE.encode(), partition=partition)
        await producer.flush()
    finally:
        await producer.stop()


async def tick_like_a_collector(settings, topics, clock, pod_uid: str, *, process_memory_bytes: int,
                                interval_s: float = 0.5) -> None:
    """A sample of the node every ``interval_s`` until cancelled (the pod's process on the GPU when
    ``process_memory_bytes``). Samples and pod events are separate topics: a sample may be read before the pod
    event it needs, as in production, where the node's next sample settles it."""
    producer = RecordProducer(settings)
    await producer.start()
    try:
        while True:
            sample = sample_at(clock.now_ms(), pod_uid, process_memory_bytes=process_memory_bytes)
            await producer.send(topics.node_samples, sample, key=NODE.encode(),
                                partition=partition_for_node(NODE, PARTITIONS))
            await producer.flush()
            await asyncio.sleep(interval_s)
    finally:
        await producer.stop()


async def run_cli(capsys, *argv: str) -> list[dict]:
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


async def test_leak_fires_survives_a_restart_resolves_and_shows_in_the_cli(kafka_settings, topic_catalog, group_id,
                                                                          tmp_path, capsys):
    config = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=3600)
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group_id, metrics_port=0,
                             topic_partitions=PARTITIONS, state_path=tmp_path / "guard.state",
                             snapshot_interval_seconds=0.5, clock_interval_seconds=0.2)
    clock = SystemClock()
    pod_uid = str(uuid.uuid4())
    start_ms = clock.now_ms()
    memory_bytes = 6 * GIB

    # 1. the leak, behind a garbage sample
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=config, stop=stop, clock=clock))
    ticking = None
    try:
        await produce(kafka_settings, topic_catalog, ("pod", leaky_pod(start_ms, pod_uid)), ("garbage", GARBAGE))
        ticking = asyncio.create_task(tick_like_a_collector(kafka_settings, topic_catalog, clock, pod_uid,
                                                            process_memory_bytes=memory_bytes))

        def leak_on_the_gpu(violations):
            return any(v.rule == "visibility_leak" and v.gpu_uuid == GPU_UUID for v in violations)

        await wait_for_violations(kafka_settings, topic_catalog.violations, leak_on_the_gpu,
                                  "a FIRING visibility_leak on the GPU")
        (letter,) = [d for _, d in await read_records(kafka_settings, topic_catalog.dead_letters,
                                                      codec_for(DeadLetter).decode)]
        assert (letter.service, letter.source_topic, letter.raw_bytes) == ("guard", topic_catalog.node_samples,
                                                                           GARBAGE)
    finally:
        if ticking is not None:
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0

    # Read after the stop: it flushed, so records of one engine call on other partitions are all there.
    records = await violations_on_topic(kafka_settings, topic_catalog.violations)
    fired = {v.fingerprint: v for _, v in records}
    for key, violation in records:
        assert key == violation.fingerprint.encode()  # keyed by fingerprint on the compacted topic
        assert violation.state is ViolationState.FIRING
    leaks = {fp: v for fp, v in fired.items() if v.rule == "visibility_leak"}
    # Two leaks: the spec (NVIDIA_VISIBLE_DEVICES=all) and the process on a GPU the pod was not assigned.
    assert sorted((v.gpu_uuid or "") for v in leaks.values()) == ["", GPU_UUID]
    on_gpu = next(v for v in leaks.values() if v.gpu_uuid == GPU_UUID)
    assert (on_gpu.cluster, on_gpu.namespace, on_gpu.pod_name, on_gpu.pod_uid, on_gpu.node_name) == (
        CLUSTER, "research", "notebook-0", pod_uid, NODE)
    assert on_gpu.evidence["memory_used_bytes"] == memory_bytes
    saved = GuardStateStore(settings.state_path).load()
    assert saved is not None and saved.positions  # the stop wrote the state and the positions it covers
    common = ["--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix", kafka_settings.topic_prefix]
    active = await run_cli(capsys, "violations", "--active", "--format", "json", *common)
    assert {e["fingerprint"]: e["state"] for e in active} == {fp: "firing" for fp in fired}

    # 2. restarted from the state file: the pod goes away, the GPU is free, the hold-down passes
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=config, stop=stop, clock=clock))
    ticking = None
    try:
        gone_ms = clock.now_ms()
        await produce(kafka_settings, topic_catalog, ("pod", leaky_pod(gone_ms, pod_uid, PodEventType.DELETED)))
        # The deletion may be read after a sample that still saw the pod; the node's next sample settles it.
        ticking = asyncio.create_task(tick_like_a_collector(kafka_settings, topic_catalog, clock, pod_uid,
                                                            process_memory_bytes=0))

        def all_resolved(violations):
            latest = {v.fingerprint: v for v in violations}
            return all(latest[fp].state is ViolationState.RESOLVED for fp in fired)

        await wait_for_violations(kafka_settings, topic_catalog.violations, all_resolved,
                                  "every violation RESOLVED")
    finally:
        if ticking is not None:
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0

    records = await violations_on_topic(kafka_settings, topic_catalog.violations)
    latest = {}
    for key, violation in records:
        assert key == violation.fingerprint.encode()
        latest[violation.fingerprint] = violation
    assert set(latest) == set(fired)  # no new fingerprints: the restart re-derived nothing twice
    for fingerprint, first in fired.items():
        resolved = latest[fingerprint]
        assert resolved.state is ViolationState.RESOLVED
        assert resolved.first_seen_unix_ms == first.first_seen_unix_ms  # the state came through the restart
        assert resolved.resolved_at_unix_ms - resolved.last_seen_unix_ms >= HOLD_DOWN_SECONDS * 1000
    # Nothing fired twice: one FIRING and one RESOLVED record per fingerprint.
    states = [(v.fingerprint, v.state) for _, v in records]
    assert sorted(states) == sorted([(fp, ViolationState.FIRING) for fp in fired]
                                    + [(fp, ViolationState.RESOLVED) for fp in fired])

    # 3. the CLI
    assert await run_cli(capsys, "violations", "--active", "--format", "json", *common) == []
    shown = await run_cli(capsys, "violations", "--format", "json", *common)
    assert sorted(shown, key=lambda e: e["fingerprint"]) == sorted(
        (violation_json(v) for v in latest.values()), key=lambda e: e["fingerprint"])
    assert {e["fingerprint"] for e in shown if e["rule"] == "visibility_leak"} == set(leaks)
    assert all(e["state"] == "resolved" for e in shown)


class _NodeClock:
    """The clock of a node whose own clock is ``offset_ms`` off the real one (NTP down, a VM resumed)."""

    def __init__(self, offset_ms: int) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        return SystemClock().now_ms() + self.offset_ms


async def test_clock_skew_fires_from_the_brokers_append_time_and_resolves_when_the_clock_is_right(
        kafka_settings, topic_catalog, group_id, tmp_path):
    """Through the real broker: the samples topic is stamped by the broker (LogAppendTime), so a node whose own
    clock reads ten minutes behind is seen as such -- ``clock_skew`` FIRING with the measured offset as evidence --
    and once its clock is right again (and the hold-down passed) the violation is RESOLVED under the same
    fingerprint. Nothing else fires: the node's samples are judged on the corrected time."""
    config = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=3600)
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group_id, metrics_port=0,
                             topic_partitions=PARTITIONS, state_path=tmp_path / "guard.state",
                             snapshot_interval_seconds=0.5, clock_interval_seconds=0.2)
    behind = _NodeClock(-600_000)
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=config, stop=stop, clock=SystemClock()))
    ticking = None
    try:
        ticking = asyncio.create_task(tick_like_a_collector(kafka_settings, topic_catalog, behind, "no-pod",
                                                            process_memory_bytes=0))

        def skew_firing(violations):
            latest = {v.fingerprint: v for v in violations if v.rule == "clock_skew"}
            return any(v.state is ViolationState.FIRING for v in latest.values())

        records = await wait_for_violations(kafka_settings, topic_catalog.violations, skew_firing,
                                            "a FIRING clock_skew for the node")
        (fired,) = {v.fingerprint: v for _, v in records if v.rule == "clock_skew"}.values()
        assert fired.node_name == NODE
        # Behind by ten minutes, and the moments a sample takes to reach the broker (which read as behind too).
        assert -610 <= fired.evidence["clock_skew_seconds"] <= -600, fired.evidence
        assert {v.rule for _, v in records} == {"clock_skew"}

        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
        behind.offset_ms = 0  # NTP is back
        ticking = asyncio.create_task(tick_like_a_collector(kafka_settings, topic_catalog, behind, "no-pod",
                                                            process_memory_bytes=0))

        def skew_resolved(violations):
            latest = {v.fingerprint: v for v in violations}
            return latest[fired.fingerprint].state is ViolationState.RESOLVED

        records = await wait_for_violations(kafka_settings, topic_catalog.violations, skew_resolved,
                                            "the clock_skew RESOLVED")
        assert {v.rule for _, v in records} == {"clock_skew"}
    finally:
        if ticking is not None:
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0
