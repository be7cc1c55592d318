"""Every guard rule fires and resolves through the real broker, record for record as in ``gpumeter replay``.

For each guard scenario (and, for ``stale_node``, a recording of ``guard_pressure.yaml`` with one collector silent
for 90 s), ``replay`` runs with a guard that also notes what it was fed: each pod event, sample, share row and
cost line, at which instant, in which order. The same records are then produced to the broker's four input topics
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

Then the violations topic must hold, per fingerprint (its key), exactly the ``Violation`` records replay
published up to that instant, in the same order — every field: rule, severity, subject, evidence, first and
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

from gpumeter.clock import ManualClock, iso_utc
from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import TopicCatalog, partition_for_node, pod_event_key
from schemas.typed import codec_for
from schemas.records import CostRecord, DeadLetter, GpuShare, NodeSample, NodeWindowCost, NodeWindowShares, PodEvent
from schemas.records import Violation, ViolationState
from pipeline import replay as attributor_replay
from pipeline.replay import read_jsonl
from pipeline.recordings import InputRecord, scenario_records, write_recording
from simulator.scenario import load_scenario
from services.guard import config as guard_config
from services.guard.config import GuardConfig
from services.guard.main import serve
from services.guard.replay import GuardReplay
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


class _NotingGuard(GuardReplay):
    """The replay's guard, noting each input (kind, instant, record) and keeping what it published."""

    instances: list["_NotingGuard"] = []

    def __init__(self, config: GuardConfig | None = None) -> None:
        super().__init__(config)
        self.inputs: list[tuple[str, int, Any]] = []
        _NotingGuard.instances.append(self)

    def pod_event(self, event: PodEvent, now_ms: int):
        self.inputs.append(("pod", now_ms, event))
        return super().pod_event(event, now_ms)

    def sample(self, sample: NodeSample, now_ms: int):
        self.inputs.append(("sample", now_ms, sample))
        return super().sample(sample, now_ms)

    def share(self, share: GpuShare, now_ms: int):
        self.inputs.append(("share", now_ms, share))
        return super().share(share, now_ms)

    def cost(self, cost: CostRecord, now_ms: int):
        self.inputs.append(("cost", now_ms, cost))
        return super().cost(cost, now_ms)


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


def _whole_windows(inputs, bills_path: Path):
    """The guard's inputs with each node-window's share rows as one ``NodeWindowShares`` and each bill's cost lines
    as one ``NodeWindowCost`` (with the bill's figures from replay's ``bills.jsonl``), as the topics carry them:
    replay hands the guard a node-window's rows and lines one after the other at one instant."""
    bills = {(b["node"], b["window_start"]): b for b in read_jsonl(bills_path)}
    grouped: list[tuple[str, int, Any]] = []
    for kind, at, record in inputs:
        window = (record.node_name, record.window_start_unix_ms) if kind in ("share", "cost") else None
        if window is not None and grouped and grouped[-1][0] == kind and grouped[-1][1] == at and (
                grouped[-1][2][0].node_name, grouped[-1][2][0].window_start_unix_ms) == window:
            grouped[-1][2].append(record)
        else:
            grouped.append((kind, at, [record] if window is not None else record))
    out = []
    for kind, at, record in grouped:
        if kind == "share":
            record = NodeWindowShares.from_rows(record)
        elif kind == "cost":
            bill = bills[(record[0].node_name, iso_utc(record[0].window_start_unix_ms))]
            record = NodeWindowCost.from_cost_records(
                record, billed_milliseconds=round(bill["billed_seconds"] * 1000), cloud_provider=bill["provider"],
                region=bill["region"], zone=bill["zone"], provider_id=bill["provider_id"],
                price_per_hour_usd=str(bill["price_per_hour_usd"]), split_rule=bill["split_rule"],
                gpu_count=bill["gpu_count"], gpu_cost_micro_usd=bill["gpu_cost_micro_usd"], sharing=bill["sharing"])
        out.append((kind, at, record))
    return out


def _plan(name: str, tmp_path: Path, topics: TopicCatalog, monkeypatch) -> Plan:
    """Replay ``name`` with a noting guard and turn its inputs into the broker plan."""
    _NotingGuard.instances.clear()
    monkeypatch.setattr(attributor_replay, "GuardReplay", _NotingGuard)
    summary = attributor_replay.replay(_input_path(name, tmp_path), tmp_path / "replay", guard_config=CONFIG)
    monkeypatch.undo()
    assert summary.dead_letters == {} and summary.unpriced == (), summary
    (guard,) = _NotingGuard.instances

    plan = Plan()
    plan.last_instant_ms = max(at for kind, at, _ in guard.inputs if kind in ("pod", "sample"))
    topic_of = {"pod": topics.pod_events, "sample": topics.node_samples, "share": topics.node_window_shares,
                "cost": topics.node_window_costs}
    for kind, at, record in _whole_windows(guard.inputs, tmp_path / "replay" / "bills.jsonl"):
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
    plan.expected = [v for at, v in guard.published if at <= plan.last_instant_ms]
    return plan


async def _committed(admin: AIOKafkaAdminClient, group: str) -> dict[tuple[str, int], int]:
    offsets = await admin.list_consumer_group_offsets(group)
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items() if meta is not None}


async def _drive(plan: Plan, kafka_settings, topics: TopicCatalog, group: str, tmp_path: Path) -> None:
    """Run the guard service over the plan's input, at the plan's instants, in the plan's order."""
    clock = ScenarioClock(plan.instants[0][0])
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group, metrics_port=0,
                             topic_partitions=PARTITIONS, state_path=tmp_path / "guard.state",
                             snapshot_interval_seconds=0.001, clock_interval_seconds=CLOCK_INTERVAL_S)
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=CONFIG, stop=stop, clock=clock))
    producer = RecordProducer(kafka_settings)
    admin = AIOKafkaAdminClient(**kafka_settings.client_kwargs())
    await producer.start()
    await admin.start()
    try:
        for at, runs in plan.instants:
            clock.set_ms(at)
            await asyncio.sleep(SETTLE_S)
            for topic, partition, records in runs:
                futures = [await producer.send(topic, record, key=key, partition=partition) for key, record in records]
                await producer.flush()
                end_offset = max(f.result().offset for f in futures) + 1
                deadline = time.monotonic() + WAIT_S
                while (await _committed(admin, group)).get((topic, partition), 0) < end_offset:
                    if service.done():
                        pytest.fail(f"the guard service stopped: {service.result()!r}")
                    if time.monotonic() > deadline:
                        pytest.fail(f"the guard did not consume {topic}[{partition}] up to {end_offset} "
                                    f"(instant {at})")
                    await asyncio.sleep(0.005)
        await asyncio.sleep(SETTLE_S)  # the clock task's runs at the last instant
    finally:
        await admin.close()
        await producer.stop()
        stop.set()
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

    await _drive(plan, kafka_settings, topics, group_id, tmp_path)

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
    for rule in expected_rules:
        resolved = [v for _, v in on_topic if v.rule == rule and v.state is ViolationState.RESOLVED]
        assert resolved, f"{rule} never resolved on the violations topic"
    letters = await read_records(kafka_settings, topics.dead_letters, codec_for(DeadLetter).decode)
    assert letters == []


def test_every_rule_has_a_broker_scenario():
    assert set().union(*EXPECTED_RULES.values()) == set(guard_config.RULES)
