"""Every guard rule fires and resolves through the real broker, record for record as in ``gpumeter replay``.

For each guard scenario (and, for ``stale_node``, a recording of ``guard_pressure.yaml`` with one collector silent
for 90 s), ``replay`` runs and its in-memory broker is kept: what its guard read (each pod event, sample,
node-window of shares and node-window bill, at which instant, in which order) and what it published. The same records are then produced to the broker's four input topics
and the guard service (``services.guard.main.serve``) consumes them:

* its clock is set to each instant of the replay before that instant's input is produced, and the clock task
  (every 20 ms) is given time to run at the new instant first, as replay runs the guard's clock at each new
  instant before its records;
* each run of consecutive records bound for one topic partition is produced, then waited for: the group's
  committed offset of that partition must cover it (the service checkpoints after every fetch). Kafka orders
  records within a partition only, so this is what keeps the service's order of pod events, samples, shares and
  costs the replay's order.

Inputs after the last pod event or sample (windows closed by replay's end-of-input timer) are not produced: the
service has no end of input, and at that instant it would rightly judge every node silent.

Every other shipped scenario runs the same way (``test_every_other_scenario_...``): whatever its replay's guard
published, the service publishes. Then the violations topic must hold, per fingerprint (its key), exactly the
``Violation`` records replay published up to that instant, in the same order — every field: rule, severity, subject, evidence, first and
last seen, resolution time; each scenario's rules must fire and resolve (a lost GPU stays lost: the simulator
cannot bring it back, so ``gpu_error`` resolves through the NVML error of the same scenario); and no dead letters.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from gpumeter.clock import ManualClock
from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import TopicCatalog, partition_for_node, pod_event_key
from schemas.typed import codec_for
from schemas.records import DeadLetter, NodeSample, NodeWindowCost, NodeWindowShares, PodEvent
from schemas.records import Violation, ViolationState
from pipeline import replay as attributor_replay
from gpumeter.stream.memory import MemoryBroker
from pipeline.replay import REPLAY_TOPICS
from pipeline.recordings import InputRecord, scenario_records, write_recording
from simulator.scenario import load_scenario
from services.guard import config as guard_config
from services.guard.config import GuardConfig
from services.guard import main as guard_main
from services.guard.main import serve
from services.guard.nodes import NodeGuardProcessor
from services.guard.processor import guard_topics
from services.guard.settings import GuardSettings
from tests.integration.topic_reading import read_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "scenarios"
CONFIG = GuardConfig.load(SCENARIOS / "guard" / "thresholds.yaml", {})
PARTITIONS = 3
CLOCK_INTERVAL_S = 0.02
# Long enough for several runs of the clock task at a new instant, so one runs before the instant's input.
SETTLE_S = 5 * CLOCK_INTERVAL_S
WAIT_S = 30.0

# scenario (or recording) name -> the rules it must make fire and resolve through the broker
EXPECTED_RULES = {
    "guard_visibility": {guard_config.RULE_VISIBILITY_LEAK, guard_config.RULE_UNREQUESTED_GPU_USE},
    "guard_idle": {guard_config.RULE_IDLE_ALLOCATION},
    "guard_pressure": {guard_config.RULE_SHARED_MEMORY_PRESSURE},
    "guard_budget": {guard_config.RULE_BUDGET_EXCEEDED},
    "guard_gpu_error": {guard_config.RULE_GPU_ERROR},
    "stale_collector": {guard_config.RULE_STALE_NODE},
}


class ScenarioClock(ManualClock):
    """Wall time set by the test to the replay's instants; monotonic time real, so the service's checkpoint and
    poll timers run as in production."""

    def monotonic_s(self) -> float:
        return time.monotonic()


class _KeptBroker(MemoryBroker):
    """The replay's in-memory broker, kept for the test to read what the replay's guard read and published."""

    instances: list["_KeptBroker"] = []

    def __init__(self) -> None:
        super().__init__()
        _KeptBroker.instances.append(self)

    def trim(self) -> None:
        """Keep every message: replay forgets each chunk once processed (memory), and this test reads the whole
        run afterwards. Replay's output does not depend on it (``tests/unit/pipeline/test_replay_chunks.py``)."""


# The guard's inputs in its order of precedence at one instant (GuardProcessor.inputs).
GUARD_INPUTS = (("pod", "pod_events", PodEvent), ("sample", "node_samples", NodeSample),
                ("share", "node_window_shares", NodeWindowShares), ("cost", "node_window_costs", NodeWindowCost))


def _guard_inputs(broker: MemoryBroker) -> list[tuple[str, int, Any]]:
    """(kind, instant, record) of every message the replay's guard read, in the order it read them."""
    items = []
    for rank, (kind, topic, record_type) in enumerate(GUARD_INPUTS):
        codec = codec_for(record_type)
        for message in broker.messages(getattr(REPLAY_TOPICS, topic), 0):
            items.append(((message.timestamp_ms, rank, message.offset), kind, codec.decode(message.value)))
    return [(kind, order[0], record) for order, kind, record in sorted(items, key=lambda item: item[0])]


@dataclass
class Plan:
    """What to produce, instant by instant, and what the guard must publish."""

    instants: list[tuple[int, list[tuple[str, int, list[tuple[bytes, Any]]]]]] = field(default_factory=list)
    expected: list[Violation] = field(default_factory=list)
    last_instant_ms: int = 0


def _stale_recording(tmp_path: Path) -> Path:
    """guard_pressure.yaml with the second node's collector silent from t = 60 s to t = 150 s."""
    scenario = load_scenario(SCENARIOS / "guard_pressure.yaml")
    silent = scenario.nodes[1].name
    gap_from = scenario.start_unix_ms + 60_000
    gap_until = scenario.start_unix_ms + 150_000
    records = [r for r in scenario_records(scenario)
               if not (r.node_name == silent and gap_from < r.received_at_unix_ms <= gap_until)]
    assert all(isinstance(r, InputRecord) for r in records)
    path = tmp_path / "stale_collector.gmrec"
    write_recording(records, path)
    return path


def _input_path(name: str, tmp_path: Path) -> Path:
    return _stale_recording(tmp_path) if name == "stale_collector" else SCENARIOS / f"{name}.yaml"


def _plan(name: str, tmp_path: Path, topics: TopicCatalog, monkeypatch, *, unpriced_allowed: bool = False) -> Plan:
    """Replay ``name`` keeping its broker, and turn what the replay's guard read into the broker plan
    (``unpriced_allowed``: node-windows no bundled price covers are billing's NO_PRICE, not the guard's concern)."""
    _KeptBroker.instances.clear()
    monkeypatch.setattr(attributor_replay, "MemoryBroker", _KeptBroker)
    summary = attributor_replay.replay(_input_path(name, tmp_path), tmp_path / "replay", guard_config=CONFIG)
    monkeypatch.undo()
    if unpriced_allowed:
        assert set(summary.dead_letters) <= {"NO_PRICE"}, summary
    else:
        assert summary.dead_letters == {} and summary.unpriced == (), summary
    (broker,) = _KeptBroker.instances
    inputs = _guard_inputs(broker)

    plan = Plan()
    plan.last_instant_ms = max(at for kind, at, _ in inputs if kind in ("pod", "sample"))
    topic_of = {"pod": topics.pod_events, "sample": topics.node_samples, "share": topics.node_window_shares,
                "cost": topics.node_window_costs}
    for kind, at, record in inputs:
        if at > plan.last_instant_ms:
            break
        if not plan.instants or plan.instants[-1][0] != at:
            plan.instants.append((at, []))
        runs = plan.instants[-1][1]
        topic = topic_of[kind]
        partition = partition_for_node(record.node_name, PARTITIONS)
        key = pod_event_key(record.node_name, record.uid) if kind == "pod" else record.node_name.encode()
        if runs and runs[-1][:2] == (topic, partition):
            runs[-1][2].append((key, record))
        else:
            runs.append((topic, partition, [(key, record)]))
    published = [(m.timestamp_ms, codec_for(Violation).decode(m.value))
                 for m in broker.messages(REPLAY_TOPICS.violations, 0)]
    plan.expected = [v for at, v in published if at <= plan.last_instant_ms]
    return plan


async def _committed(admin: AIOKafkaAdminClient, group: str) -> dict[tuple[str, int], int]:
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    except KafkaError as exc:
        # A broker just started has no group coordinator until __consumer_offsets exists: retriable, so it counts
        # as "nothing committed yet" (the caller's deadline bounds the wait).
        if not exc.retriable:
            raise
        return {}
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items() if meta is not None}


class _SeenNodeGuard(NodeGuardProcessor):
    """The nodes role's processor, kept for the test to see when its partitions are assigned."""

    instances: list["_SeenNodeGuard"] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _SeenNodeGuard.instances.append(self)


async def _drive(plan: Plan, kafka_settings, topics: TopicCatalog, group: str, tmp_path: Path,
                 roles: tuple[str, ...] = ("all",), monkeypatch=None) -> None:
    """Run the guard service -- one instance per role of ``roles`` -- over the plan's input, at the plan's
    instants, in the plan's order."""
    clock = ScenarioClock(plan.instants[0][0])
    stop = asyncio.Event()
    services, readers = [], {}
    if "nodes" in roles:
        _SeenNodeGuard.instances.clear()
        monkeypatch.setattr(guard_main, "NodeGuardProcessor", _SeenNodeGuard)
    for role in roles:
        settings = GuardSettings(kafka=kafka_settings, consumer_group=group, metrics_port=0, role=role,
                                 topic_partitions=PARTITIONS,
                                 state_path=None if role == "nodes" else tmp_path / f"guard-{role}.state",
                                 snapshot_interval_seconds=0.001, clock_interval_seconds=CLOCK_INTERVAL_S)
        services.append(asyncio.create_task(serve(settings, config=CONFIG, stop=stop, clock=clock)))
        for topic in guard_topics(topics, role).values():
            readers.setdefault(topic, []).append(settings.group_id)
    producer = RecordProducer(kafka_settings)
    admin = AIOKafkaAdminClient(**kafka_settings.client_kwargs())
    await producer.start()
    await admin.start()
    try:
        if "nodes" in roles:
            # Input produced before the group assigns the partitions would be held back by their rebuild.
            deadline = time.monotonic() + WAIT_S
            while not (_SeenNodeGuard.instances and len(_SeenNodeGuard.instances[0].owned) == PARTITIONS
                       and not _SeenNodeGuard.instances[0].rebuilding):
                assert time.monotonic() < deadline, "the nodes guard was never assigned its partitions"
                await asyncio.sleep(0.05)
        for at, runs in plan.instants:
            clock.set_ms(at)
            await asyncio.sleep(SETTLE_S)
            for topic, partition, records in runs:
                futures = [await producer.send(topic, record, key=key, partition=partition) for key, record in records]
                await producer.flush()
                end_offset = max(f.result().offset for f in futures) + 1
                deadline = time.monotonic() + WAIT_S
                for reader in readers[topic]:
                    while (await _committed(admin, reader)).get((topic, partition), 0) < end_offset:
                        if any(service.done() for service in services):
                            pytest.fail(f"a guard service stopped: {[s.result() for s in services if s.done()]!r}")
                        if time.monotonic() > deadline:
                            pytest.fail(f"the guard {reader} did not consume {topic}[{partition}] up to "
                                        f"{end_offset} (instant {at})")
                        await asyncio.sleep(0.005)
        await asyncio.sleep(SETTLE_S)  # the clock task's runs at the last instant
    finally:
        await admin.close()
        await producer.stop()
        stop.set()
        for service in services:
            assert await asyncio.wait_for(service, WAIT_S) == 0  # its final checkpoint flushed every violation


@pytest.mark.parametrize("name", sorted(EXPECTED_RULES))
async def test_each_rule_fires_and_resolves_through_the_broker_as_in_replay(name, kafka_settings, group_id,
                                                                           tmp_path, monkeypatch):
    topics = TopicCatalog(prefix=kafka_settings.topic_prefix, partitions_override=PARTITIONS)
    await create_topics(kafka_settings, topics)
    plan = _plan(name, tmp_path, topics, monkeypatch)

    expected_rules = EXPECTED_RULES[name]
    replayed = {(v.rule, v.state) for v in plan.expected}
    assert {(rule, state) for rule in expected_rules for state in ViolationState} <= replayed, (
        f"replay of {name} does not fire and resolve {sorted(expected_rules)}: {sorted(replayed)}")

    on_topic = await _drive_and_compare(plan, kafka_settings, topics, group_id, tmp_path)
    for rule in expected_rules:
        resolved = [v for _, v in on_topic if v.rule == rule and v.state is ViolationState.RESOLVED]
        assert resolved, f"{rule} never resolved on the violations topic"


async def _drive_and_compare(plan: Plan, kafka_settings, topics: TopicCatalog, group_id: str, tmp_path: Path,
                             roles: tuple[str, ...] = ("all",), monkeypatch=None):
    """Run the guard service over the plan; the violations topic must hold, per fingerprint, exactly replay's
    records in replay's order, and the guard dead-letter nothing. Returns the topic's (key, violation) pairs."""
    await _drive(plan, kafka_settings, topics, group_id, tmp_path, roles, monkeypatch)
    on_topic = await read_records(kafka_settings, topics.violations, codec_for(Violation).decode)
    streamed: dict[str, list[Violation]] = defaultdict(list)
    for key, violation in on_topic:
        assert key == violation.fingerprint.encode()
        streamed[violation.fingerprint].append(violation)
    expected: dict[str, list[Violation]] = defaultdict(list)
    for violation in plan.expected:
        expected[violation.fingerprint].append(violation)
    assert set(streamed) == set(expected)
    for fingerprint, records in expected.items():
        assert streamed[fingerprint] == records, fingerprint
    letters = await read_records(kafka_settings, topics.dead_letters, codec_for(DeadLetter).decode)
    assert letters == []
    return on_topic


@pytest.mark.parametrize("name", ["guard_visibility", "guard_idle", "guard_budget"])
async def test_the_nodes_and_budgets_roles_publish_through_the_broker_what_replay_publishes(
        name, kafka_settings, group_id, tmp_path, monkeypatch):
    """The scale-out roles side by side -- a ``nodes`` guard in the group, a ``budgets`` guard beside it --
    publish replay's records, fingerprint by fingerprint (the leaks and the idle allocation from the first, the
    budgets from the second)."""
    topics = TopicCatalog(prefix=kafka_settings.topic_prefix, partitions_override=PARTITIONS)
    await create_topics(kafka_settings, topics)
    plan = _plan(name, tmp_path, topics, monkeypatch)
    assert EXPECTED_RULES[name] <= {v.rule for v in plan.expected}
    await _drive_and_compare(plan, kafka_settings, topics, group_id, tmp_path, ("nodes", "budgets"), monkeypatch)


# Every other shipped scenario: whatever replay's guard publishes (nothing, for some), the service publishes too.
OTHER_SCENARIOS = sorted(p.stem for p in SCENARIOS.glob("*.yaml") if p.stem not in EXPECTED_RULES)


@pytest.mark.parametrize("name", OTHER_SCENARIOS)
async def test_every_other_scenario_publishes_replays_violations_through_the_broker(name, kafka_settings, group_id,
                                                                                   tmp_path, monkeypatch):
    topics = TopicCatalog(prefix=kafka_settings.topic_prefix, partitions_override=PARTITIONS)
    await create_topics(kafka_settings, topics)
    plan = _plan(name, tmp_path, topics, monkeypatch, unpriced_allowed=True)
    await _drive_and_compare(plan, kafka_settings, topics, group_id, tmp_path)


# Rules whose broker test is not a replayed scenario: clock_skew is measured against the broker's own append time
# (LogAppendTime), which a replay's instants cannot stand in for on a real broker; its test ticks a node whose clock
# is off into the real broker and reads the violation off the topic.
BROKER_TESTS_ELSEWHERE = {
    guard_config.RULE_CLOCK_SKEW: (
        "test_guard_stream.py",
        "test_clock_skew_fires_from_the_brokers_append_time_and_resolves_when_the_clock_is_right"),
}


def test_every_rule_has_a_broker_scenario():
    assert set().union(*EXPECTED_RULES.values()) | set(BROKER_TESTS_ELSEWHERE) == set(guard_config.RULES)
    for module, test in BROKER_TESTS_ELSEWHERE.values():
        assert f"async def {test}(" in (Path(__file__).parent / module).read_text(), (module, test)
