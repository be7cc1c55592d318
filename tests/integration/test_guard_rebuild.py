"""A guard whose state file is damaged rebuilds from the compacted violations topic before it raises anything
(the session's Kafka broker, the real service and state store).

Before this work such a guard moved the file aside and replayed the pod events from the start: a leaky pod
deleted long before fired a critical ``visibility_leak`` again (and resolved it a hold-down later), although its
alert had resolved. Now the guard reads every fingerprint's last state from the violations topic first, re-reads
its input publishing nothing, and then only says what the topic does not know:

* the deleted pod's resolved leak: nothing at all;
* a pod still leaky: no new FIRING transition, the same ``first_seen``;
* a pod deleted while the guard was down (its leak FIRING on the topic): RESOLVED after the hold-down;
* a pod that started leaking while the guard was down: FIRING.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid

import pytest

from gpumeter.clock import SystemClock
from schemas.records import PodEventType, Violation, ViolationState
from schemas.typed import codec_for
from services.guard.config import GuardConfig
from services.guard.engine import GuardEngine
from services.guard.main import serve
from services.guard.settings import GuardSettings
from services.guard.state import STATE_MAGIC
from tests.integration.test_billing_stream import wait_until_committed_to_end
from tests.integration.test_guard_stream import (
    PARTITIONS,
    WAIT_S,
    leaky_pod,
    produce,
    violations_on_topic,
    wait_for_violations,
)
from tests.integration.topic_reading import end_offsets, read_messages

pytestmark = pytest.mark.integration

HOLD_DOWN_SECONDS = 2


def spec_leaks(records, pod_uid: str):
    """The spec leak (``NVIDIA_VISIBLE_DEVICES=all``) records of one pod, in topic order."""
    return [v for _, v in records if v.rule == "visibility_leak" and v.pod_uid == pod_uid and v.gpu_uuid is None]


async def run_guard_until_read(settings, config, clock, kafka_settings, topics, *, then_s: float = 0.0,
                               before=None) -> None:
    """Run the guard until it has committed every input partition to its end (read everything), ``then_s``
    longer, and stop it."""
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=config, stop=stop, clock=clock))
    try:
        if before is not None:
            await before()
        for topic in (topics.pod_events, topics.node_samples, topics.node_window_shares, topics.node_window_costs):
            await wait_until_committed_to_end(kafka_settings, settings.consumer_group, topic, f"guard read {topic}")
        await asyncio.sleep(then_s)
    finally:
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0


def budgets_role_state(topic_catalog, engine_bytes: bytes) -> bytes:
    """A state file the ``budgets`` role wrote (its header spelled out, as ``encode_state`` writes it): an engine
    that heard no pod, positions on the cost lines only."""
    header = {"saved_at_unix_ms": 0, "positions": [[topic_catalog.node_window_costs, 0, 0]],
              "engine_bytes": len(engine_bytes), "engine_sha256": hashlib.sha256(engine_bytes).hexdigest(),
              "role": "budgets", "topics": [topic_catalog.node_window_costs]}
    return STATE_MAGIC + json.dumps(header, sort_keys=True).encode("utf-8") + b"\n" + engine_bytes


@pytest.mark.parametrize("damage", ["corrupt", "foreign"])
async def test_a_damaged_state_file_rebuilds_from_the_violations_topic_and_fires_nothing_old(
        kafka_settings, topic_catalog, group_id, tmp_path, damage):
    """``corrupt``: the file cannot be read back. ``foreign``: a readable file of another guard role (the
    ``budgets`` one's), refused like a damaged one -- restored, its empty engine would replay the old leaks."""
    config = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=3600)
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group_id, metrics_port=0,
                             topic_partitions=PARTITIONS, state_path=tmp_path / "guard.state",
                             snapshot_interval_seconds=0.5, clock_interval_seconds=0.2)
    clock = SystemClock()
    gone, stays, deleted_while_down, new = (str(uuid.uuid4()) for _ in range(4))

    # 1. The first guard: three leaky pods fire; one of them is deleted and its leak resolves.
    async def first_run() -> None:
        now = clock.now_ms()
        await produce(kafka_settings, topic_catalog, *(("pod", leaky_pod(now, uid)) for uid in
                                                       (gone, stays, deleted_while_down)))
        await wait_for_violations(kafka_settings, topic_catalog.violations,
                                  lambda vs: {v.pod_uid for v in vs} >= {gone, stays, deleted_while_down},
                                  "three spec leaks FIRING")
        await produce(kafka_settings, topic_catalog, ("pod", leaky_pod(clock.now_ms(), gone, PodEventType.DELETED)))
        await wait_for_violations(
            kafka_settings, topic_catalog.violations,
            lambda vs: any(v.pod_uid == gone and v.state is ViolationState.RESOLVED for v in vs),
            "the deleted pod's leak RESOLVED")

    await run_guard_until_read(settings, config, clock, kafka_settings, topic_catalog, before=first_run)
    before = await violations_on_topic(kafka_settings, topic_catalog.violations)
    ends_before = await end_offsets(kafka_settings, topic_catalog.violations)
    first_seen = {uid: spec_leaks(before, uid)[0].first_seen_unix_ms for uid in (stays, deleted_while_down)}
    assert [v.state for v in spec_leaks(before, gone)] == [ViolationState.FIRING, ViolationState.RESOLVED]

    # 2. While the guard is down: one pod is deleted, another starts leaking; the state file is damaged.
    await produce(kafka_settings, topic_catalog,
                  ("pod", leaky_pod(clock.now_ms(), deleted_while_down, PodEventType.DELETED)),
                  ("pod", leaky_pod(clock.now_ms(), new)))
    settings.state_path.write_bytes(b"GPUMETER-GUARD-STATE 1\n{not json" if damage == "corrupt"
                                    else budgets_role_state(topic_catalog, GuardEngine(config).snapshot()))

    # 3. The second guard: no state, so it rebuilds from the topic and re-reads the pod events from the start.
    await run_guard_until_read(settings, config, clock, kafka_settings, topic_catalog,
                               then_s=HOLD_DOWN_SECONDS + 1.5)
    assert list(tmp_path.glob(f"guard.state.{damage}-*"))  # the damaged file was kept for a post-mortem
    # What the second guard published: the records past each partition's end before it started.
    decode = codec_for(Violation).decode
    added = [(m.key, decode(m.value)) for m in await read_messages(kafka_settings, topic_catalog.violations)
             if m.offset >= ends_before[m.partition]]

    assert spec_leaks(added, gone) == []  # the old, resolved leak does not fire again
    assert all(v.state is ViolationState.FIRING and v.first_seen_unix_ms == first_seen[stays]
               for v in spec_leaks(added, stays))  # no new violation, at most a refresh of the same one
    resolved = spec_leaks(added, deleted_while_down)
    assert [v.state for v in resolved] == [ViolationState.RESOLVED], resolved
    assert resolved[0].first_seen_unix_ms == first_seen[deleted_while_down]
    assert [v.state for v in spec_leaks(added, new)] == [ViolationState.FIRING]
