"""The guard's ``nodes`` role without Kafka: ``NodeGuardProcessor`` behind the one runner, its partitions handed
over the way the driver's group hooks hand them (``suspend``, ``adopt`` with the violations topic's last
states, ``finish_rebuild`` once read to the assignment's end).

Two instances that split the partitions publish what one instance holding them all publishes, each handling only
its own nodes' records; a partition moved to another instance keeps its firing violation (same fingerprint and
first_seen, no RESOLVED from the old owner, no FIRING again from the new one) and the new owner resolves it when
its condition ends; a partition assigned back to the instance that had it resumes and skips what its engine has
already read (an old leak replayed from the pod events' beginning fires nothing); the nodes role judges no budget,
the budgets role nothing else."""

from __future__ import annotations

import dataclasses

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import TopicCatalog, partition_for_node
from schemas.records import PodEvent, PodEventType, Violation, ViolationState
from schemas.typed import codec_for
from services.guard.config import GuardConfig
from services.guard.nodes import NodeGuardProcessor
from services.guard.processor import (
    GUARD_METRICS,
    ROLE_BUDGETS,
    VIOLATIONS,
    WINDOW_COSTS,
    GuardProcessor,
    guard_topics,
)
from tests.unit.attributor import pod_event

TOPICS = TopicCatalog(prefix="unit.")
PARTITIONS = 4
START_MS = 1_780_000_000_000
HOLD_DOWN_SECONDS = 60
CONFIG = GuardConfig(hold_down_seconds=HOLD_DOWN_SECONDS, refresh_seconds=3600, pod_linger_seconds=60)


def nodes_in_partitions() -> dict[int, str]:
    """One node name per partition (partition -> node)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < PARTITIONS:
        name = f"gpu-node-{i}"
        found.setdefault(partition_for_node(name, PARTITIONS), name)
        i += 1
    return found


NODES = nodes_in_partitions()


class Log:
    """The pod-events topic: records appended with their partition's offsets, read again from any offset."""

    def __init__(self) -> None:
        self.messages: list[RawMessage] = []
        self.next_offset = {p: 0 for p in range(PARTITIONS)}

    def leaky(self, node: str, uid: str, at_ms: int, event_type: PodEventType = PodEventType.ADDED) -> RawMessage:
        event = pod_event(uid, namespace="research", name=f"nb-{uid}", observed_at_unix_ms=at_ms, node=node,
                          event_type=event_type, resource_version=str(at_ms))
        (container,) = event.containers
        event = dataclasses.replace(event, containers=(dataclasses.replace(container, visible_devices_env="all"),))
        partition = partition_for_node(node, PARTITIONS)
        message = RawMessage(TOPICS.pod_events, partition, self.next_offset[partition],
                             f"{node}/{uid}".encode(), codec_for(PodEvent).encode(event), at_ms)
        self.next_offset[partition] += 1
        self.messages.append(message)
        return message


class Instance:
    """One guard instance of the nodes role: its processor, runner and what it published."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.metrics = ServiceMetrics("guard", GUARD_METRICS, clock=clock)
        self.processor = NodeGuardProcessor(CONFIG, clock, partitions=PARTITIONS, metrics=self.metrics)
        self.runner = MessageRunner(self.processor, guard_topics(TOPICS), clock)
        self.published: list[Violation] = []
        self.handled = 0

    def read(self, messages, partitions=None) -> list[Violation]:
        out = []
        for message in messages:
            if partitions is not None and message.partition not in partitions:
                continue
            self.handled += 1
            out += self._take(self.runner.step(message).result)
        return out

    def tick(self) -> list[Violation]:
        return self._take(self.runner.tick(self.clock.now_ms(), True))

    def finish_rebuild(self) -> list[Violation]:
        return self._take(self.processor.finish_rebuild())

    def _take(self, result) -> list[Violation]:
        violations = [e.record for e in result.emits if e.output == VIOLATIONS]
        self.published += violations
        return violations


def last_states(*published: list[Violation]) -> dict[str, Violation]:
    """The compacted violations topic: the last record per fingerprint, in publication order."""
    topic: dict[str, Violation] = {}
    for records in published:
        for v in records:
            topic[v.fingerprint] = v
    return topic


def test_two_instances_splitting_the_partitions_publish_what_one_publishes_each_reading_only_its_own():
    clock = ManualClock(START_MS)
    log = Log()
    for p, node in NODES.items():
        log.leaky(node, f"uid-{p}", clock.now_ms())
    single = Instance(clock)
    single.read(log.messages)
    a, b = Instance(clock), Instance(clock)
    a.processor.adopt({0, 1}, ())
    b.processor.adopt({2, 3}, ())
    for instance in (a, b):
        instance.finish_rebuild()
        instance.read(log.messages, partitions=set(instance.processor.owned))
    assert a.handled + b.handled == len(log.messages) == PARTITIONS
    assert {v.node_name for v in a.published} == {NODES[0], NODES[1]}
    assert {v.node_name for v in b.published} == {NODES[2], NODES[3]}
    assert sorted(a.published + b.published, key=lambda v: v.fingerprint) == sorted(
        single.published, key=lambda v: v.fingerprint)
    assert len(single.published) == PARTITIONS


def test_a_moved_partition_keeps_its_violation_firing_and_its_new_owner_resolves_it_when_it_ends():
    clock = ManualClock(START_MS)
    log = Log()
    node = NODES[2]
    log.leaky(node, "leaky", clock.now_ms())
    a = Instance(clock)
    a.processor.adopt(range(PARTITIONS), ())
    a.finish_rebuild()
    (fired,) = a.read(log.messages)
    assert fired.state is ViolationState.FIRING

    # A second instance joins: the group revokes everything, then assigns {0, 1} to a and {2, 3} to b.
    clock.advance_ms(5_000)
    a.processor.suspend(range(PARTITIONS))
    a.processor.adopt({0, 1}, ())
    b = Instance(clock)
    b.processor.adopt({2, 3}, last_states(a.published).values())
    assert b.processor.rebuilding
    assert b.read(log.messages, partitions={2, 3}) == []  # pod events from the beginning, publishing nothing
    assert b.finish_rebuild() == []  # the topic has it firing already: nothing to say
    (active,) = b.processor.active()
    assert (active.fingerprint, active.first_seen_unix_ms) == (fired.fingerprint, fired.first_seen_unix_ms)
    assert b.metrics.registry.get_sample_value("gpumeter_guard_violations_firing",
                                               {"rule": "visibility_leak", "severity": "critical"}) == 1
    assert a.metrics.registry.get_sample_value("gpumeter_guard_violations_firing",
                                               {"rule": "visibility_leak", "severity": "critical"}) == 0

    # Long past a hold-down: the old owner resolves nothing (no longer its node), the new one keeps it firing.
    clock.advance_ms(10 * HOLD_DOWN_SECONDS * 1000)
    assert a.tick() == [] and b.tick() == []
    assert a.published == [fired]

    # The pod is deleted: the new owner resolves the violation after the hold-down, under the same fingerprint.
    b.read([log.leaky(node, "leaky", clock.now_ms(), PodEventType.DELETED)], partitions={2, 3})
    clock.advance_ms(HOLD_DOWN_SECONDS * 1000)
    (resolved,) = b.tick()
    assert (resolved.fingerprint, resolved.state, resolved.first_seen_unix_ms) == (
        fired.fingerprint, ViolationState.RESOLVED, fired.first_seen_unix_ms)
    assert a.published == [fired] and b.published == [resolved]


def test_a_partition_assigned_back_resumes_and_an_old_leak_re_read_from_the_beginning_fires_nothing():
    clock = ManualClock(START_MS)
    log = Log()
    node = NODES[1]
    log.leaky(node, "old", clock.now_ms())
    log.leaky(node, "old", clock.now_ms(), PodEventType.DELETED)
    a = Instance(clock)
    a.processor.adopt({1}, ())
    a.finish_rebuild()
    a.read(log.messages)
    clock.advance_ms(2 * HOLD_DOWN_SECONDS * 1000)  # resolved, and the deleted pod pruned after its linger
    a.tick()
    assert [v.state for v in a.published] == [ViolationState.FIRING, ViolationState.RESOLVED]

    # A rebalance gives partition 1 back to a: the driver seeks pod events to their beginning again.
    a.processor.suspend({1})
    assert a.processor.to_rebuild({1}) == set()
    a.processor.adopt({1}, ())
    assert not a.processor.rebuilding and a.processor.stats.resumed == 1
    assert a.read(log.messages) == []
    assert a.processor.stats.reread_skipped == 2
    clock.advance_ms(2 * HOLD_DOWN_SECONDS * 1000)
    assert a.tick() == []
    assert len(a.published) == 2

    # A partition not assigned back is dropped: assigned later, it is rebuilt, not resumed.
    a.processor.suspend({1})
    a.processor.adopt({0}, ())
    assert a.processor.to_rebuild({1}) == {1}


def test_the_nodes_role_judges_no_budget_and_the_budgets_role_reads_and_adopts_only_budgets():
    config = GuardConfig.load(None, {})
    nodes = NodeGuardProcessor(config, ManualClock(START_MS), partitions=PARTITIONS)
    assert nodes.owns(dataclasses.replace(_budget_violation(), node_name=NODES[0]), 0) is False
    budgets = GuardProcessor(config, ManualClock(START_MS), role=ROLE_BUDGETS)
    assert [i.name for i in budgets.inputs] == [WINDOW_COSTS]
    assert guard_topics(TOPICS, ROLE_BUDGETS) == {WINDOW_COSTS: TOPICS.node_window_costs}
    leak = dataclasses.replace(_budget_violation(), rule="visibility_leak", fingerprint="leak", node_name=NODES[0])
    assert [v.rule for v in budgets.begin_rebuild([_budget_violation(), leak])] == ["budget_exceeded"]
    assert nodes.owns(leak, 0) and not nodes.owns(leak, 1)


def _budget_violation() -> Violation:
    from schemas.records import Severity

    return Violation(fingerprint="budget", rule="budget_exceeded", severity=Severity.WARNING,
                     state=ViolationState.FIRING, cluster="c", node_name=None, gpu_uuid=None, namespace="research",
                     pod_name=None, pod_uid=None, team=None, summary="over budget", evidence={},
                     first_seen_unix_ms=START_MS, last_seen_unix_ms=START_MS, resolved_at_unix_ms=None)


async def test_an_assignment_whose_violations_topic_cannot_be_read_reads_it_again_before_rebuilding(monkeypatch):
    from gpumeter.kafka.processor import ConsumerUnavailable
    from services.guard import main as guard_main

    leak = dataclasses.replace(_budget_violation(), rule="visibility_leak", fingerprint="leak", node_name=NODES[3])
    answers = [ConsumerUnavailable("broker away"), ConsumerUnavailable("broker away"), (leak,)]

    async def read_last_states(kafka, topic):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(guard_main, "read_last_states", read_last_states)
    processor = NodeGuardProcessor(CONFIG, ManualClock(START_MS), partitions=PARTITIONS)
    hook = guard_main.rebuild_assigned(processor, None, "violations", retry_initial_seconds=0.001,
                                       retry_max_seconds=0.002)
    await hook({("samples", 3), ("pods", 3)})
    assert answers == [] and processor.owned == (3,)
    assert [v.fingerprint for v in processor.active()] == ["leak"]  # adopted: it stays firing, not fired again
    answers.append(AssertionError("a resumed partition needs no read"))
    processor.suspend({3})
    await hook({("samples", 3)})
    assert processor.stats.resumed == 1
