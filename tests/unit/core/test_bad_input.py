"""Bad input on every input topic of every consuming service, in process (no broker).

Each service is driven through its real entry point for one message -- the attributor's ``process_sample`` /
``process_pod_event`` (the Faust agents' bodies, with plain dicts as tables and recording topics), billing's
billing's processor and ledger store on the one runner (a real SQLite ledger), the guard's ``GuardProcessor.handle`` (the real engine) -- and
every case must give:

* a ``DeadLetter`` for the bad message with the expected ``reason_code``, the service's name, the source topic,
  partition and offset, and the raw bytes unchanged;
* ``gpumeter_dead_letters_total{service,topic,reason_code}`` counting every letter of that reason;
* the next good message processed as if nothing had happened (its effect checked, no further dead letter).

Cases: undecodable bytes (random, a cut header, an unknown schema fingerprint, another record type, a body cut
short, trailing bytes, no value), values out of range (``gpumeter.validation``), and the service's own rules
(wrong key or partition, late ticks, shares that do not add up, unpriced nodes). A hypothesis fuzz sends
arbitrary bytes to every topic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import struct
from collections import Counter
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog, partition_for_node, pod_event_key
from schemas.codec import MAGIC
from schemas.packed import PackedNodeSample
from schemas.records import (
    DeadLetter,
    GpuShare,
    NodeSample,
    NodeWindowCost,
    NodeWindowShares,
    PodEvent,
    ShareSubjectKind,
    SharingMode,
)
from schemas.typed import codec_for
from services.attributor.engine import pod_table_key
from services.billing.catalog import PriceCatalog
from services.billing.ledger import Ledger
from services.billing.service import BILLING_METRICS
from services.guard.config import Budget, GuardConfig
from services.guard.processor import GUARD_METRICS, VIOLATIONS, GuardProcessor, guard_topics
from tests.unit.attributor import GIB, device, node_sample, pod_event
from tests.unit.billing.conftest import WINDOW_START_MS, Unit, bucket, node_window, pod
from tests.unit.billing.conftest import BillingHarness as BillingService

PREFIX = "bad."
TOPICS = TopicCatalog(prefix=PREFIX)
PARTITIONS = 3
NOW_MS = 1_780_000_000_000  # the attributor's and the guard's clock
WINDOW_S = 10
DAY_MS = 86_400_000

SAMPLES, PODS, SHARES, COSTS = "node-samples", "pod-events", "node-window-shares", "node-window-costs"
TOPIC_NAMES = {SAMPLES: TOPICS.node_samples, PODS: TOPICS.pod_events, SHARES: TOPICS.node_window_shares,
               COSTS: TOPICS.node_window_costs}


def metric(metrics: ServiceMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class RecordingTopic:
    """Stands in for a Faust topic: ``send`` keeps (key, value) and returns an acknowledged future."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes | None, bytes]] = []

    async def send(self, *, key=None, value=None):
        self.sent.append((key, value))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class RecordingProducer:
    """Stands in for ``RecordProducer``: encodes every record with its codec and acknowledges it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, Any]] = []

    async def send(self, topic, record, *, key=None):
        codec_for(type(record)).encode(record)
        self.sent.append((topic, key, record))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


# ----------------------------------------------------------------------------------------------------------------
# Good records (``n`` makes each one new: another tick, pod, window)


def good_sample(now_ms: int, n: int, node: str = "gpu-node-a") -> NodeSample:
    dev = device("GPU-0", used=4 * GIB, util=50, procs=[(0, 2 * GIB, 30), (-1, GIB, -1)])
    return node_sample(now_ms - 5_000 + n, [dev], pod_uids=["pod-uid-a"], sequence=1000 + n, node=node)


def good_pod_event(now_ms: int, n: int, node: str = "gpu-node-a") -> PodEvent:
    return pod_event(f"uid-{n}", node=node, devices=[("nvidia.com/gpu", ["GPU-0"])],
                     observed_at_unix_ms=now_ms - 1_000, started_at_unix_ms=now_ms - 60_000)


def good_row(now_ms: int, n: int, namespace: str = "ml", **changes) -> GpuShare:
    """The only row of a one-unit node-window that ended a minute ago (a new node per ``n``)."""
    start = (now_ms - 120_000) // 60_000 * 60_000
    (share,) = node_window([Unit("GPU-0", [pod(f"p{n}", 1.0, namespace, team="t")])], node=f"node-{n}",
                           window_start_ms=start)
    return dataclasses.replace(share, **changes)


def good_share(now_ms: int, n: int, **changes) -> NodeWindowShares:
    """That node-window as the attributor writes it (``changes`` apply to its row)."""
    return NodeWindowShares.from_rows([good_row(now_ms, n, **changes)])


def _with_pods(cost: NodeWindowCost, **changes) -> NodeWindowCost:
    return dataclasses.replace(cost, pods=tuple(dataclasses.replace(p, **changes) for p in cost.pods))


def _without_pods(cost: NodeWindowCost) -> NodeWindowCost:
    return dataclasses.replace(cost, line_pod_index=tuple(-1 for _ in cost.line_pod_index))


def good_cost(now_ms: int, n: int, **changes) -> NodeWindowCost:
    """The bill of that node-window (pod in namespace ``ns-<n>``) as billing writes it; ``changes`` apply to each
    of its lines."""
    from services.billing.costing import bill_node_window, window_cost_record

    rows = [good_row(now_ms, n, namespace=f"ns-{n}")]
    priced = bill_node_window(rows, PriceCatalog.load())
    priced = dataclasses.replace(priced, costs=tuple(dataclasses.replace(c, **changes) for c in priced.costs))
    return window_cost_record(priced, NodeWindowShares.from_rows(rows))


def encode(record) -> bytes:
    return codec_for(type(record)).encode(record)


# ----------------------------------------------------------------------------------------------------------------
# One harness per service: ``deliver(kind, value, key, partition)`` runs one message through the service's entry
# point; ``good(kind)`` sends a new good message of that topic and checks that the service used it.


class Harness:
    service: str
    kinds: tuple[str, ...]
    now_ms: int

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.offsets: Counter[tuple[str, int]] = Counter()
        self.n = 0

    def message(self, kind: str, value: bytes | None, key: bytes | None, partition: int) -> RawMessage:
        topic = TOPIC_NAMES[kind]
        offset = self.offsets[(topic, partition)]
        self.offsets[(topic, partition)] += 1
        return RawMessage(topic, partition, offset, key, value, self.now_ms)

    async def send(self, kind: str, value: bytes | None, *, key: bytes | None = b"k",
                   partition: int = 0) -> RawMessage:
        raw = self.message(kind, value, key, partition)
        await self.deliver(raw)
        return raw

    async def send_record(self, kind: str, record) -> RawMessage:
        key, partition = self.address(kind, record)
        return await self.send(kind, encode(record), key=key, partition=partition)

    def address(self, kind: str, record) -> tuple[bytes, int]:
        node = record.node_name
        if kind == PODS:
            return pod_event_key(node, record.uid), partition_for_node(node, PARTITIONS)
        return node.encode(), partition_for_node(node, PARTITIONS)

    def next_n(self) -> int:
        self.n += 1
        return self.n

    async def deliver(self, raw: RawMessage) -> None:
        raise NotImplementedError

    def dead_letters(self) -> list[DeadLetter]:
        raise NotImplementedError

    async def good(self, kind: str) -> None:
        raise NotImplementedError


class AttributorHarness(Harness):
    service = "attributor"
    kinds = (SAMPLES, PODS)
    now_ms = NOW_MS

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        from services.attributor.app import AttributorStream
        from services.attributor.settings import AttributorSettings

        settings = AttributorSettings(kafka=KafkaSettings(topic_prefix=PREFIX), partitions=PARTITIONS,
                                      data_dir=tmp_path, metrics_port=0, window_seconds=WINDOW_S, grace_seconds=2,
                                      pod_linger_seconds=600)
        self.clock = ManualClock(NOW_MS)
        self.metrics = ServiceMetrics(self.service)
        self.stream = AttributorStream(settings, self.clock, self.metrics)
        # Faust tables and topics need a running worker; the stream only uses them as mappings and senders.
        self.stream.open_samples = {}
        self.stream.pods = {}
        self.stream.shares_topic = RecordingTopic()
        self.stream.dead_letters_topic = RecordingTopic()

    async def deliver(self, raw: RawMessage) -> None:
        if raw.topic == TOPICS.node_samples:
            await self.stream.process_sample(raw)
        else:
            await self.stream.process_pod_event(raw)

    def dead_letters(self) -> list[DeadLetter]:
        return [codec_for(DeadLetter).decode(value) for _, value in self.stream.dead_letters_topic.sent]

    def open_ticks(self, sample) -> int:
        """Ticks the partition's engine holds in open windows (0 before the partition has an engine)."""
        engine = self.stream.processor.engine(partition_for_node(sample.node_name, PARTITIONS))
        return 0 if engine is None else engine.open_sample_count()

    def shares(self) -> list[GpuShare]:
        """The rows of every node-window the attributor emitted."""
        return [row for _, value in self.stream.shares_topic.sent
                for row in codec_for(NodeWindowShares).decode(value).rows()]

    async def good(self, kind: str) -> None:
        n = self.next_n()
        if kind == SAMPLES:
            sample = good_sample(self.now_ms, n)
            held = self.open_ticks(sample)
            await self.send_record(kind, sample)
            assert self.open_ticks(sample) == held + 1  # the engine holds the tick in its node's open window
        else:
            event = good_pod_event(self.now_ms, n)
            await self.send_record(kind, event)
            assert codec_for(PodEvent).decode(self.stream.pods[pod_table_key(event)]) == event


class BillingHarness(Harness):
    service = "billing"
    kinds = (SHARES,)
    now_ms = WINDOW_START_MS + 90_000

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.clock = ManualClock(self.now_ms)
        self.metrics = ServiceMetrics(self.service, BILLING_METRICS)
        self.ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
        self.ledger.migrate()
        self.producer = RecordingProducer()
        # The billing service as it runs: processor and ledger store on the one runner, in the Kafka driver.
        self.processor = BillingService(self.ledger, self.producer, topics=TOPICS, clock=self.clock,
                                        metrics=self.metrics)

    def close(self) -> None:
        self.ledger.close()

    async def deliver(self, raw: RawMessage) -> None:
        await self.processor.handle(raw)
        await self.processor.flush()

    def dead_letters(self) -> list[DeadLetter]:
        return [r for t, _, r in self.producer.sent if t == TOPICS.dead_letters]

    async def good(self, kind: str) -> None:
        billed = self.processor.stats.windows_billed
        share = good_share(self.now_ms, self.next_n())
        await self.send_record(kind, share)
        assert self.processor.stats.windows_billed == billed + 1
        bills = {(b["node_name"], b["window_start_unix_ms"]) for b in self.ledger.bills()}
        assert (share.node_name, share.window_start_unix_ms) in bills
        costs = [r for t, _, r in self.producer.sent if t == TOPICS.costs and r.node_name == share.node_name]
        assert costs and all(c.window_start_unix_ms == share.window_start_unix_ms for c in costs)


class GuardHarness(Harness):
    """The guard on the one runner: ``MessageRunner.step`` (decode, range checks, dead letters) in front of
    ``GuardProcessor.handle`` (the real engine); what it emits is kept."""

    service = "guard"
    kinds = (SAMPLES, PODS, SHARES, COSTS)
    now_ms = NOW_MS

    def __init__(self, tmp_path: Path) -> None:
        from gpumeter.stream.runner import MessageRunner

        super().__init__(tmp_path)
        self.clock = ManualClock(NOW_MS)
        self.metrics = ServiceMetrics(self.service, GUARD_METRICS)
        config = GuardConfig(namespace_budgets={f"ns-{n}": Budget(day_micro_usd=1) for n in range(1, 200)})
        self.processor = GuardProcessor(config, self.clock, metrics=self.metrics)
        self.runner = MessageRunner(self.processor, guard_topics(TOPICS), self.clock, metrics=self.metrics)
        self.emitted: list = []

    def step(self, raw: RawMessage):
        step = self.runner.step(raw)
        self.emitted.extend(step.result.emits)
        return step

    async def deliver(self, raw: RawMessage) -> None:
        self.step(raw)

    def dead_letters(self) -> list[DeadLetter]:
        from gpumeter.stream.contract import DEAD_LETTERS

        return [e.record for e in self.emitted if e.output == DEAD_LETTERS]

    def taken(self, kind: str, record) -> list:
        """Step a good record; it must be handled, not dead-lettered. Its violations."""
        step = self.step(self.message(kind, encode(record), b"k", 0))
        assert step.handled and step.dead_lettered == 0
        return [e.record for e in step.result.emits if e.output == VIOLATIONS]

    async def good(self, kind: str) -> None:
        n = self.next_n()
        engine = self.processor.engine
        if kind == SAMPLES:
            sample = good_sample(self.now_ms, n, node=f"gpu-node-{n}")
            self.taken(kind, sample)
            # The engine took it: the same tick again is a redelivery it recognises.
            ignored = engine.old_samples_ignored
            self.taken(kind, sample)
            assert engine.old_samples_ignored == ignored + 1
        elif kind == PODS:
            # A pod that sets NVIDIA_VISIBLE_DEVICES=all and requests no GPU: the guard flags it from the event.
            event = good_pod_event(self.now_ms, n)
            containers = tuple(dataclasses.replace(c, visible_devices_env="all", gpu_requests={}, assigned_devices=())
                               for c in event.containers)
            event = dataclasses.replace(event, containers=containers, gpu_requests={})
            violations = self.taken(kind, event)
            assert [(v.rule, v.pod_uid) for v in violations] == [("visibility_leak", event.uid)]
        elif kind == SHARES:
            share = good_share(self.now_ms, n)
            self.taken(kind, share)
            ignored = engine.duplicate_shares_ignored
            self.taken(kind, share)
            assert engine.duplicate_shares_ignored == ignored + 1
        else:
            record = good_cost(self.now_ms, n)
            violations = self.taken(kind, record)
            assert [(v.rule, v.namespace) for v in violations] == [("budget_exceeded", f"ns-{n}")]


HARNESSES: dict[str, Callable[[Path], Harness]] = {
    "attributor": AttributorHarness,
    "billing": BillingHarness,
    "guard": GuardHarness,
}


@pytest.fixture
def make_harness(tmp_path):
    made: list[Harness] = []

    def make(service: str) -> Harness:
        harness = HARNESSES[service](tmp_path / f"{service}-{len(made)}")
        made.append(harness)
        return harness

    yield make
    for harness in made:
        if isinstance(harness, BillingHarness):
            harness.close()


# ----------------------------------------------------------------------------------------------------------------
# Cases. A case builds (prelude records, the bad message) from the harness; ``prelude`` records are good input the
# case needs first (a window to be late for, the first row of a unit). Records are sent at their node's partition
# and key; raw bytes go to partition 0 with key b"k".


@dataclasses.dataclass(frozen=True)
class Bad:
    """The bad message: raw bytes, or a record (sent where the catalog puts it, unless ``key``/``partition``)."""

    value: bytes | None = None
    record: Any = None
    key: bytes | None = None
    partition: int | None = None


def _random_bytes(seed: int, size: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    return b"\x00" + data[1:]  # never the single-object magic c3 01


def _other_type(kind: str, h: Harness) -> bytes:
    # A valid message of another record type (one of the service's other inputs, or a record no one reads).
    other = {SAMPLES: good_pod_event(h.now_ms, 0), PODS: good_sample(h.now_ms, 0), SHARES: good_cost(h.now_ms, 0),
             COSTS: good_share(h.now_ms, 0)}[kind]
    return encode(other)


def _good_record(kind: str, h: Harness):
    return {SAMPLES: good_sample, PODS: good_pod_event, SHARES: good_share, COSTS: good_cost}[kind](h.now_ms, 900)


def codec_cases(kind: str) -> list[tuple[str, Callable[[Harness], tuple[list, Bad]], str]]:
    cases = [
        ("random bytes", lambda h: ([], Bad(_random_bytes(len(kind), 64))), "CORRUPT"),
        ("a cut header", lambda h: ([], Bad(MAGIC + b"\x01\x02")), "TRUNCATED"),
        ("an unknown schema fingerprint", lambda h: ([], Bad(MAGIC + struct.pack("<Q", 0x0123456789ABCDEF)
                                                             + _random_bytes(7, 40))), "UNKNOWN_SCHEMA"),
        ("another record type", lambda h: ([], Bad(_other_type(kind, h))), "WRONG_RECORD_TYPE"),
        ("a body cut short", lambda h: ([], Bad(encode(_good_record(kind, h))[:-3])), "TRUNCATED"),
        ("trailing bytes", lambda h: ([], Bad(encode(_good_record(kind, h)) + b"\x00")), "CORRUPT"),
    ]
    if kind != PODS:  # a pod-events value of None is the compacted topic's tombstone, not bad input
        cases.append(("no value", lambda h: ([], Bad(None)), "EMPTY"))
    if kind == SAMPLES:
        # NodeSample v4 columns share their counts by construction: a v4 message whose process columns disagree
        # (the v3 "process arrays of unequal length") or whose column is not whole entries breaks a length rule.
        cases += [
            ("process arrays of unequal length",
             lambda h: ([], Bad(_packed_bytes(_sample(h), process_pid=b"\x01\x00\x00\x00\x02\x00\x00\x00"))),
             "CORRUPT"),
            ("a column that is not whole entries",
             lambda h: ([], Bad(_packed_bytes(_sample(h), device_memory_total_bytes=b"\x00" * 7))), "CORRUPT"),
        ]
    return cases


def _packed_bytes(sample: NodeSample, **columns: bytes) -> bytes:
    """``sample`` as a NodeSample v4 message with ``columns`` replaced by the given raw bytes."""
    codec = codec_for(NodeSample)
    return codec.packed.encode({**PackedNodeSample.from_node_sample(sample).to_avro(), **columns})


def _dev(**changes):
    return dataclasses.replace(device("GPU-0", used=4 * GIB, util=50, procs=[(0, 2 * GIB, 30)]), **changes)


def _sample(h: Harness, devices=None, **changes) -> NodeSample:
    sample = node_sample(h.now_ms - 5_000, devices or [_dev()], pod_uids=["pod-uid-a"], sequence=7)
    return dataclasses.replace(sample, **changes)


def _mig_orphan() -> Any:
    return dataclasses.replace(_dev(), uuid="MIG-1", parent_uuid="GPU-not-in-the-tick", mig_gpu_instance_id=1,
                               mig_compute_instance_id=0, mig_profile="1g.10gb", mig_compute_slices=1,
                               sharing_mode=SharingMode.MIG)


SAMPLE_CASES = [
    ("negative memory", lambda h: _sample(h, [_dev(memory_used_bytes=-1)])),
    ("utilization over 100 %", lambda h: _sample(h, [_dev(gpu_utilization_percent=101)])),
    ("used above total", lambda h: _sample(h, [_dev(memory_used_bytes=81 * GIB)])),
    ("a process using more than the GPU", lambda h: _sample(h, [_dev(process_used_memory_bytes=(81 * GIB,))])),
    ("sampled a day in the future", lambda h: _sample(h, sampled_at_unix_ms=h.now_ms + DAY_MS)),
    ("sampled eight days ago", lambda h: _sample(h, sampled_at_unix_ms=h.now_ms - 8 * DAY_MS)),
    ("sampled at time zero", lambda h: _sample(h, sampled_at_unix_ms=0)),
    ("a MIG instance of an unknown GPU", lambda h: _sample(h, [_mig_orphan()])),
    ("a process of an unknown pod", lambda h: _sample(h, [_dev(process_pod_index=(3,))])),
    ("duplicate pids on one device", lambda h: _sample(h, [dataclasses.replace(
        device("GPU-0", used=4 * GIB, util=50, procs=[(0, GIB, 10), (0, GIB, 10)]), process_pids=(7, 7))])),
    ("the same GPU twice", lambda h: _sample(h, [_dev(), _dev()])),
    ("a negative interval", lambda h: _sample(h, interval_ms=-1000)),
    ("SM utilization over 100 %", lambda h: _sample(h, [_dev(process_sm_utilization_percent=(140,))])),
]


def _pod(h: Harness, **changes) -> PodEvent:
    return dataclasses.replace(good_pod_event(h.now_ms, 77), **changes)


POD_CASES = [
    ("observed a day in the future", lambda h: _pod(h, observed_at_unix_ms=h.now_ms + DAY_MS)),
    ("observed at time zero", lambda h: _pod(h, observed_at_unix_ms=0)),
    ("started in the future", lambda h: _pod(h, started_at_unix_ms=h.now_ms + DAY_MS)),
    ("a negative GPU request", lambda h: _pod(h, gpu_requests=MappingProxyType({"nvidia.com/gpu": -1}))),
    ("no uid", lambda h: _pod(h, uid="")),
]

SHARE_CASES = [
    ("memory share above 1", lambda h: good_share(h.now_ms, 500, memory_share=1.5)),
    ("negative compute share", lambda h: good_share(h.now_ms, 500, compute_share=-0.2)),
    ("cost share NaN", lambda h: good_share(h.now_ms, 500, cost_share=float("nan"))),
    ("cost share above 1", lambda h: good_share(h.now_ms, 500, cost_share=2.0)),
    ("GPU fraction zero", lambda h: good_share(h.now_ms, 500, gpu_fraction=0.0)),
    ("a window ending a day in the future", lambda h: good_share(h.now_ms, 500,
                                                                 window_start_unix_ms=h.now_ms + DAY_MS)),
    ("a window at time zero", lambda h: good_share(h.now_ms, 500, window_start_unix_ms=0)),
    ("a zero-second window", lambda h: good_share(h.now_ms, 500, window_seconds=0)),
    ("covered longer than the window", lambda h: good_share(h.now_ms, 500, node_covered_seconds=61.0)),
]

COST_CASES = [
    ("a negative cost", lambda h: good_cost(h.now_ms, 500, cost_micro_usd=-5)),
    ("cost share above 1", lambda h: good_cost(h.now_ms, 500, cost_share=1.5)),
    ("a window ending a day in the future", lambda h: good_cost(h.now_ms, 500,
                                                                window_start_unix_ms=h.now_ms + DAY_MS)),
    ("a window at time zero", lambda h: good_cost(h.now_ms, 500, window_start_unix_ms=0)),
    ("a POD line without a pod", lambda h: _without_pods(good_cost(h.now_ms, 500))),
]

RANGE_CASES = {SAMPLES: SAMPLE_CASES, PODS: POD_CASES, SHARES: SHARE_CASES, COSTS: COST_CASES}

# Names the API server would have refused (INVALID_NAME): forged text that would otherwise reach a report CSV, a
# log line or an Alertmanager label.
FORMULA = '=HYPERLINK("http://evil.example/x","click")'
NAME_CASES = {
    PODS: [
        ("a namespace that is a spreadsheet formula", lambda h: _pod(h, namespace=FORMULA)),
        ("a pod name with a newline", lambda h: _pod(h, name="train-0\n2026-01-01 INFO guard: all clear")),
        ("a label value with HTML", lambda h: _pod(h, labels=MappingProxyType({"team": "<b>ml</b>"}))),
        ("a label key with CRLF", lambda h: _pod(h, labels=MappingProxyType({"team\r\nX-Evil": "ml"}))),
        ("a label value with ANSI", lambda h: _pod(h, labels=MappingProxyType({"team": "\x1b[31mml"}))),
        ("a label value starting with =", lambda h: _pod(h, labels=MappingProxyType({"team": "=1+2"}))),
        ("an upper-case pod name", lambda h: _pod(h, name="Train-0")),
        ("a resource name with a space", lambda h: _pod(h, gpu_requests=MappingProxyType({"nvidia.com/ gpu": 1}))),
    ],
    SAMPLES: [
        ("a node name with ANSI", lambda h: _sample(h, node_name="gpu-node-a\x1b[2J")),
        ("a GPU uuid with HTML", lambda h: _sample(h, [_dev(uuid="<i>GPU-0</i>")])),
    ],
    SHARES: [
        ("a namespace that is a spreadsheet formula", lambda h: good_share(h.now_ms, 500, namespace=FORMULA)),
        ("a label value with a newline", lambda h: good_share(h.now_ms, 500,
                                                              labels=MappingProxyType({"team": "ml\nx"}))),
    ],
    COSTS: [
        ("a pod name with CRLF", lambda h: _with_pods(good_cost(h.now_ms, 500), pod_name="p\r\nx")),
    ],
}


def _late_tick(h: Harness) -> tuple[list, Bad]:
    start = (h.now_ms - 60_000) // (WINDOW_S * 1000) * (WINDOW_S * 1000)
    first = dataclasses.replace(_sample(h), sampled_at_unix_ms=start, sequence=1)
    closing = dataclasses.replace(_sample(h), sampled_at_unix_ms=start + (WINDOW_S + 3) * 1000, sequence=2)
    late = dataclasses.replace(_sample(h), sampled_at_unix_ms=start + 1_000, sequence=3)
    return [(SAMPLES, first), (SAMPLES, closing)], Bad(record=late)


def _unit_not_adding_up(h: Harness) -> tuple[list, Bad]:
    rows = node_window([Unit("GPU-0", [pod("a", 0.5, "ml"), bucket(ShareSubjectKind.IDLE, 0.2)])], node="node-x",
                       window_start_ms=(h.now_ms - 120_000) // 60_000 * 60_000)
    return [], Bad(record=NodeWindowShares.from_rows(rows))


SERVICE_CASES = [
    ("attributor", SAMPLES, "a tick on another node's partition",
     lambda h: ([], Bad(record=_sample(h), partition=(partition_for_node("gpu-node-a", PARTITIONS) + 1) % 3)),
     "WRONG_PARTITION"),
    ("attributor", SAMPLES, "a tick of a closed window", _late_tick, "LATE"),
    ("attributor", PODS, "a pod event under another pod's key",
     lambda h: ([], Bad(record=_pod(h), key=b"gpu-node-a/another-uid")), "WRONG_KEY"),
    ("attributor", PODS, "a pod event on another node's partition",
     lambda h: ([], Bad(record=_pod(h), partition=(partition_for_node("gpu-node-a", PARTITIONS) + 1) % 3)),
     "WRONG_PARTITION"),
    ("billing", SHARES, "a unit whose cost shares do not add up to 1", _unit_not_adding_up, "INCONSISTENT_SHARES"),
    ("billing", SHARES, "a node no price covers (unknown instance type)",
     lambda h: ([], Bad(record=good_share(h.now_ms, 501, instance_type="x9.unknown"))), "NO_PRICE"),
]


def _params():
    params = []
    for service, harness in HARNESSES.items():
        for kind in harness.kinds:
            for name, build, reason in codec_cases(kind):
                params.append(pytest.param(service, kind, build, reason, id=f"{service}-{kind}-{name}"))
            for name, build_record in RANGE_CASES[kind]:
                params.append(pytest.param(service, kind, (lambda b: lambda h: ([], Bad(record=b(h))))(build_record),
                                           "OUT_OF_RANGE", id=f"{service}-{kind}-{name}"))
            for name, build_record in NAME_CASES[kind]:
                params.append(pytest.param(service, kind, (lambda b: lambda h: ([], Bad(record=b(h))))(build_record),
                                           "INVALID_NAME", id=f"{service}-{kind}-{name}"))
    for service, kind, name, build, reason in SERVICE_CASES:
        params.append(pytest.param(service, kind, build, reason, id=f"{service}-{kind}-{name}"))
    return params


@pytest.mark.parametrize("service, kind, build, reason", _params())
async def test_bad_input_is_dead_lettered_counted_and_the_next_message_is_processed(make_harness, service, kind,
                                                                                    build, reason):
    h = make_harness(service)
    prelude, bad = build(h)
    for prelude_kind, record in prelude:
        await h.send_record(prelude_kind, record)
    assert h.dead_letters() == [], "the prelude is good input"
    if bad.record is not None:
        value = encode(bad.record)
        key, partition = h.address(kind, bad.record)
        key = bad.key if bad.key is not None else key
        partition = bad.partition if bad.partition is not None else partition
    else:
        value, key, partition = bad.value, b"k", 0
    raw = await h.send(kind, value, key=key, partition=partition)

    letters = h.dead_letters()
    (letter,) = [d for d in letters if (d.source_partition, d.source_offset) == (raw.partition, raw.offset)]
    assert (letter.reason_code, letter.service, letter.source_topic) == (reason, service, TOPIC_NAMES[kind]), \
        letter.reason
    assert letter.raw_bytes == (value or b"") and letter.source_key == key
    assert letter.error_type and letter.reason
    assert {d.reason_code for d in letters} == {reason}
    assert metric(h.metrics, "gpumeter_dead_letters_total", service=service, topic=TOPIC_NAMES[kind],
                  reason_code=reason) == len(letters)

    await h.good(kind)
    assert len(h.dead_letters()) == len(letters)


@pytest.mark.parametrize("service", sorted(HARNESSES))
async def test_every_input_topic_survives_a_stream_of_bad_messages(make_harness, service):
    """All of a service's bad cases, on every input topic, one after the other into one instance; then good
    input on every topic is still processed."""
    h = make_harness(service)
    sent = 0
    for kind in h.kinds:
        for _name, build, _reason in codec_cases(kind):
            _, bad = build(h)
            await h.send(kind, bad.value)
            sent += 1
        for _name, build_record in (*RANGE_CASES[kind], *NAME_CASES[kind]):
            record = build_record(h)
            key, partition = h.address(kind, record)
            await h.send(kind, encode(record), key=key, partition=partition)
            sent += 1
    letters = h.dead_letters()
    assert len(letters) == sent
    consumed = sum(metric(h.metrics, "gpumeter_messages_consumed_total", service=service, topic=TOPIC_NAMES[k])
                   for k in h.kinds)
    assert consumed == sent
    for kind in h.kinds:
        await h.good(kind)
    assert len(h.dead_letters()) == sent


@pytest.mark.parametrize("service", sorted(HARNESSES))
async def test_a_large_share_of_dead_lettered_input_makes_healthz_say_degraded_while_alive(make_harness, service):
    """Every consumer's runner reports its inputs: with the default limits (more than 10 % of at least 100 inputs
    of the last 300 s dead-lettered) /healthz says ``degraded`` with the rate, and stays 200 (issue 22)."""
    from gpumeter.health import HEALTH_PATH
    from tests.unit.core.test_health import call

    h = make_harness(service)
    app = h.metrics.wsgi_app()
    kind = h.kinds[0]
    while h.metrics.dead_letters.rate().inputs < 90:  # the guard's good() sends each record twice
        await h.good(kind)
    assert h.metrics.dead_letters.rate().inputs == 90
    for _ in range(10):
        await h.send(kind, b"\x00not a record")
    status, _, body = call(app, HEALTH_PATH)
    health = json.loads(body)
    assert status == "200 OK" and health["status"] == "ok", health  # 10 of 100: at the limit, not above it
    assert (health["dead_letters"]["inputs_count"], health["dead_letters"]["dead_letters_count"]) == (100, 10)
    await h.send(kind, b"\x00not a record")
    status, _, body = call(app, HEALTH_PATH)
    health = json.loads(body)
    assert status == "200 OK" and health["alive"] and health["status"] == "degraded", health
    assert health["dead_letters"]["ratio"] == pytest.approx(11 / 101, abs=1e-6)
    assert metric(h.metrics, "gpumeter_recent_dead_letter_ratio", service=service) == pytest.approx(11 / 101)


OVERSIZED = {
    # What the broker accepts under its default limits: ~1 MiB sent uncompressed, 3 MiB sent gzip-compressed (the
    # broker checks the compressed batch; the consumer gets the value whole).
    "1 MiB of random bytes": lambda: b"\x00" + random.Random(1).randbytes(1_040_000),
    "3 MiB behind a valid header": lambda: MAGIC + struct.pack("<Q", 0x0123456789ABCDEF) + b"\x07" * (3 << 20),
}


@pytest.mark.parametrize("size", sorted(OVERSIZED))
@pytest.mark.parametrize("service, kind", [(s, k) for s, h in HARNESSES.items() for k in h.kinds])
async def test_an_oversized_value_gets_a_dead_letter_that_fits_and_the_next_message_is_processed(
        make_harness, service, kind, size):
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    from gpumeter.stream.deadletter import dead_letter_budget_bytes
    from gpumeter.settings import DEFAULT_MAX_REQUEST_SIZE_BYTES

    h = make_harness(service)
    value = OVERSIZED[size]()
    key = b"k" * 5000  # a key longer than a dead letter carries
    raw = await h.send(kind, value, key=key)
    (letter,) = h.dead_letters()
    assert (letter.source_offset, letter.service, letter.source_topic) == (raw.offset, service, TOPIC_NAMES[kind])
    encoded = codec_for(DeadLetter).encode(letter)
    dead_letter_key = TOPIC_NAMES[kind].encode()
    assert len(encoded) + len(dead_letter_key) <= dead_letter_budget_bytes(DEFAULT_MAX_REQUEST_SIZE_BYTES)
    # What aiokafka's producer checks against max_request_size before it sends.
    assert DefaultRecordBatchBuilder.estimate_size_in_bytes(dead_letter_key, encoded, []) <= \
        DEFAULT_MAX_REQUEST_SIZE_BYTES
    assert letter.truncated and value.startswith(letter.raw_bytes) and len(letter.raw_bytes) > 900_000
    assert (letter.payload_length_bytes, letter.payload_sha256) == (len(value), hashlib.sha256(value).hexdigest())
    assert (letter.source_key, letter.source_key_length_bytes) == (key[:1024], len(key))
    assert metric(h.metrics, "gpumeter_dead_letters_truncated_total", service=service,
                  topic=TOPIC_NAMES[kind]) == 1
    await h.good(kind)
    assert len(h.dead_letters()) == 1


async def test_the_attributor_stores_a_pod_cut_to_what_it_keeps_and_refuses_one_that_stays_too_large(
        make_harness):
    """Any producer can put 30,000 labels and a 5 MB annotation in a valid pod event (one crashed the changelog
    write): the pod table keeps only the grouping labels and the annotation attribution reads (none unless the
    platform names one)."""
    from services.attributor.app import MAX_STORED_POD_BYTES
    from services.attributor.attribution import DEFAULT_MPS_THREAD_ANNOTATION

    h = make_harness("attributor")
    event = dataclasses.replace(good_pod_event(h.now_ms, 901), labels={
        "team": "t", "model": "m", **{f"acme.io/l-{i:05d}": "v" for i in range(30_000)}}, annotations={
        DEFAULT_MPS_THREAD_ANNOTATION: "50", "big": "x" * 5_000_000})
    await h.send_record(PODS, event)
    assert h.dead_letters() == []
    stored = h.stream.pods[pod_table_key(event)]
    assert len(stored) < 4096
    kept = codec_for(PodEvent).decode(stored)
    assert (dict(kept.labels), dict(kept.annotations)) == ({"team": "t", "model": "m"}, {})
    assert (kept.labels_dropped, kept.annotations_dropped) == (30_000, 2)

    containers = tuple(dataclasses.replace(event.containers[0], name=f"c{i:05d}", assigned_devices=())
                       for i in range(5_000))
    huge = dataclasses.replace(good_pod_event(h.now_ms, 902), containers=containers)
    raw = await h.send_record(PODS, huge)
    (letter,) = h.dead_letters()
    assert (letter.reason_code, letter.source_offset) == ("TOO_LARGE", raw.offset)
    assert pod_table_key(huge) not in h.stream.pods and str(MAX_STORED_POD_BYTES) in letter.reason
    await h.good(PODS)


def test_a_small_bad_value_is_dead_lettered_whole_and_says_so():
    from gpumeter.errors import CorruptMessage
    from gpumeter.stream.deadletter import dead_letter_for

    message = RawMessage("t", 2, 9, b"key", b"\x00bad", None)
    letter = dead_letter_for(message, CorruptMessage("no"), "billing", 5)
    assert (letter.raw_bytes, letter.source_key, letter.truncated) == (b"\x00bad", b"key", False)
    assert (letter.payload_length_bytes, letter.payload_sha256, letter.source_key_length_bytes) == (
        4, hashlib.sha256(b"\x00bad").hexdigest(), 3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_bytes_on_any_topic_are_dead_lettered_never_raised(tmp_path_factory, data):
    service = data.draw(st.sampled_from(sorted(HARNESSES)), label="service")
    tmp = tmp_path_factory.mktemp(service)
    harness = HARNESSES[service](tmp)
    kind = data.draw(st.sampled_from(harness.kinds), label="topic")
    payloads = data.draw(st.lists(st.binary(max_size=300) | st.binary(max_size=60).map(lambda b: MAGIC + b),
                                  min_size=1, max_size=8), label="payloads")

    async def run() -> None:
        for payload in payloads:
            await harness.send(kind, payload)
        letters = harness.dead_letters()
        assert [(d.source_offset, d.raw_bytes) for d in letters] == list(enumerate(payloads))
        assert {d.reason_code for d in letters} <= {"CORRUPT", "TRUNCATED", "UNKNOWN_SCHEMA", "WRONG_RECORD_TYPE",
                                                     "EMPTY", "OUT_OF_RANGE"}
        await harness.good(kind)
        assert len(harness.dead_letters()) == len(payloads)

    try:
        asyncio.run(run())
    finally:
        if isinstance(harness, BillingHarness):
            harness.close()


def test_the_cases_cover_every_input_topic_of_every_consuming_service():
    """The catalog says which service reads which topic; the harnesses above must drive exactly those."""
    from schemas.catalog import ALL_TOPICS

    inputs = {service: {spec.name for spec in ALL_TOPICS if service in spec.consumers}
              for service in HARNESSES}
    covered = {service: {TOPIC_NAMES[k][len(PREFIX):] for k in h.kinds} for service, h in HARNESSES.items()}
    assert inputs == covered
    assert {spec.name for spec in ALL_TOPICS if set(spec.consumers) & set(HARNESSES)} == {
        name[len(PREFIX):] for name in TOPIC_NAMES.values()}


# ----------------------------------------------------------------------------------------------------------------
# What is not bad input: values the collector reports on purpose, and old records that are legitimately old


POSSIBLE_SAMPLES = [
    ("unknown per-process memory (NVML: not available)", lambda h: _sample(h, [_dev(process_used_memory_bytes=(-1,))])),
    ("no per-process SM sample", lambda h: _sample(h, [_dev(process_sm_utilization_percent=(-1,))])),
    ("a process of no known pod", lambda h: _sample(h, [_dev(process_pod_index=(-1,))])),
    ("a lost GPU's zeros", lambda h: _sample(h, [device("GPU-0", total=0, used=0, util=None)])),
    ("a MIG instance whose GPU holds the slice count", lambda h: _sample(h, [
        dataclasses.replace(device("GPU-P", total=40 * GIB, util=None), sharing_mode=SharingMode.MIG,
                            mig_total_compute_slices=7),
        device("MIG-1", parent_uuid="GPU-P", gi=1, ci=0, profile="3g.20gb", slices=3, total_slices=0,
               total=20 * GIB, used=4 * GIB, util=None, mode=SharingMode.MIG, procs=[(0, 2 * GIB, -1)])])),
    ("sampled at the edge of the allowed skew", lambda h: _sample(h, sampled_at_unix_ms=h.now_ms + 120_000)),
    ("sampled six days ago (a backlog)", lambda h: _sample(h, sampled_at_unix_ms=h.now_ms - 6 * DAY_MS)),
]


@pytest.mark.parametrize("service", ["attributor", "guard"])
@pytest.mark.parametrize("build", [b for _, b in POSSIBLE_SAMPLES], ids=[n for n, _ in POSSIBLE_SAMPLES])
async def test_values_the_collector_reports_on_purpose_are_not_bad_input(make_harness, service, build):
    h = make_harness(service)
    sample = build(h)
    held = h.open_ticks(sample) if service == "attributor" else 0
    await h.send_record(SAMPLES, sample)
    assert h.dead_letters() == []
    if service == "attributor":
        assert h.open_ticks(sample) == held + 1


async def test_a_long_running_pods_old_event_and_an_old_window_are_not_bad_input(make_harness):
    # The compacted pod topic keeps a pod's last event as long as it lives; a window may be re-emitted long after.
    attributor, guard, billing = make_harness("attributor"), make_harness("guard"), make_harness("billing")
    for h in (attributor, guard):
        await h.send_record(PODS, _pod(h, observed_at_unix_ms=h.now_ms - 90 * DAY_MS,
                                       started_at_unix_ms=h.now_ms - 91 * DAY_MS))
    old_start = (billing.now_ms - 20 * DAY_MS) // 60_000 * 60_000
    old_rows = node_window([Unit("GPU-0", [pod("old", 1.0, "ml")])], node="node-old", window_start_ms=old_start)
    await billing.send_record(SHARES, NodeWindowShares.from_rows(old_rows))
    await guard.send_record(COSTS, good_cost(guard.now_ms, 7, window_start_unix_ms=guard.now_ms - 20 * DAY_MS))
    assert [h.dead_letters() for h in (attributor, guard, billing)] == [[], [], []]
    assert billing.processor.stats.windows_billed == 1
