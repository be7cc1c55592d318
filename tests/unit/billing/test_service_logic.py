"""The billing service without a broker: its processor and ledger store on the one runner (``BillingHarness``: the
Kafka driver's own settle/checkpoint path) against a real SQLite ledger and a recording producer, fed node-window
messages as the attributor writes them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from dataclasses import replace

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from gpumeter.clock import ManualClock
from gpumeter.stream.deadletter import RawMessage
from gpumeter.kafka.producer import DeliveryError
from gpumeter.metrics import ServiceMetrics
from schemas.catalog import TopicCatalog
from schemas.records import CostRecord, CostSubjectKind, DeadLetter, GpuShare, NodeWindowCost, NodeWindowShares
from schemas.records import ShareSubjectKind
from schemas.typed import codec_for
from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window
from services.billing.ledger import LedgerError
from services.billing.pricing import DEFAULT_SPLIT_POLICY
from services.billing.sharing import KEEP_ALL, SharingPolicy
from gpumeter.kafka.processor import ServiceStopping
from services.billing.service import (
    BILLING_METRICS,
    is_rejected_by_ledger,
    is_transient_ledger_error,
    next_backoff_seconds,
)
from tests.unit.billing.conftest import WINDOW_START_MS, BillingHarness, Unit, bucket, node_window, pod, sample_shares

TOPICS = TopicCatalog(prefix="test.")
SHARES_TOPIC = TOPICS.node_window_shares
TP0 = (SHARES_TOPIC, 0)
TP1 = (SHARES_TOPIC, 1)
MINUTE_MS = 60_000


def encode(rows) -> bytes:
    """One node-window's message, as the attributor writes it."""
    return codec_for(NodeWindowShares).encode(NodeWindowShares.from_rows(rows))


class Feed:
    """Messages on the node-window-shares topic with increasing offsets per partition."""

    def __init__(self) -> None:
        self.next_offset: dict[int, int] = defaultdict(int)

    def message(self, rows=None, *, value: bytes | None = None, partition: int = 0) -> RawMessage:
        """The message of one node-window (``rows``: its ``GpuShare`` rows), or a raw ``value``."""
        offset = self.next_offset[partition]
        self.next_offset[partition] += 1
        payload = encode(rows) if rows is not None else value
        key = rows[0].node_name.encode() if rows is not None else b"x"
        return RawMessage(SHARES_TOPIC, partition, offset, key, payload, 0)

    def messages(self, windows, partition: int = 0) -> list[RawMessage]:
        """One message per node-window of ``windows``."""
        return [self.message(rows, partition=partition) for rows in windows]


class RecordingProducer:
    """Encodes every record with its real codec (so it must fit the schema) and acknowledges it, or fails the
    first ``fail_first`` sends."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.delivered: list[tuple[str, bytes | None, object]] = []
        self.attempts = 0

    async def send(self, topic, record, *, key=None):
        codec_for(type(record)).encode(record)
        self.attempts += 1
        future = asyncio.get_running_loop().create_future()
        if self.fail_first > 0:
            self.fail_first -= 1
            future.set_exception(DeliveryError("NOT_ENOUGH_REPLICAS"))
        else:
            self.delivered.append((topic, key, record))
            future.set_result(None)
        return future

    def records(self, record_type, topic=None):
        return [r for t, _, r in self.delivered if isinstance(r, record_type) and (topic is None or t == topic)]


class Pauses:
    """A sleep that records the requested pauses and runs ``on_pause`` (instead of waiting)."""

    def __init__(self, on_pause=None) -> None:
        self.seconds: list[float] = []
        self.on_pause = on_pause

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        if self.on_pause:
            self.on_pause(len(self.seconds))
        await asyncio.sleep(0)


def make_processor(ledger, producer=None, *, clock=None, memory_s=3600.0, catalog=None,
                   sleep=None, metrics=None, sharing=KEEP_ALL) -> BillingHarness:
    return BillingHarness(ledger, producer or RecordingProducer(), topics=TOPICS,
                          clock=clock or ManualClock(WINDOW_START_MS + 90_000), memory_s=memory_s, catalog=catalog,
                          sleep=sleep, metrics=metrics, sharing=sharing, owned=[TP0, TP1])


A100 = "NVIDIA A100-SXM4-40GB"


def on_gpu(uuid: str, node: str = "node-a", model: str = A100) -> dict[str, str]:
    """dcgm-exporter's labels of a pod's series on the whole GPU ``uuid`` of ``node`` (docs/billing.md)."""
    return {"container": "", "UUID": uuid, "GPU_I_PROFILE": "", "GPU_I_ID": "", "modelName": model,
            "Hostname": node, "hostname": node}


def two_gpu_window(*, node="node-a", start_ms=WINDOW_START_MS, instance_type="p4d.24xlarge"):
    units = [
        Unit("GPU-0", [pod("p1", 0.6, "ml", team="research"), bucket(ShareSubjectKind.IDLE, 0.4)]),
        Unit("GPU-1", [pod("p2", 0.3, "web", team="prod"), pod("p3", 0.5, "ml"),
                       bucket(ShareSubjectKind.UNATTRIBUTED, 0.2)]),
    ]
    return node_window(units, node=node, window_start_ms=start_ms, instance_type=instance_type)


# -- ledger error classification -------------------------------------------------------------------------------


def ledger_error(cause: Exception | None) -> LedgerError:
    error = LedgerError("writing failed")
    error.__cause__ = cause
    return error


def test_connection_problems_are_retried_and_refused_values_are_not():
    refused = OperationalError("INSERT", {}, Exception("connection refused"))
    assert is_transient_ledger_error(ledger_error(refused))
    integrity = IntegrityError("INSERT", {}, Exception("violates"))
    assert not is_transient_ledger_error(ledger_error(integrity))
    assert is_rejected_by_ledger(ledger_error(integrity))
    assert not is_transient_ledger_error(ledger_error(None))
    assert not is_rejected_by_ledger(ledger_error(None))
    assert [next_backoff_seconds(d, 4.0) for d in (0.5, 1.0, 2.0, 4.0)] == [1.0, 2.0, 4.0, 4.0]


# -- BillingProcessor ------------------------------------------------------------------------------------------


async def test_complete_windows_are_billed_published_by_node_and_committed(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    feed = Feed()
    windows = sample_shares(2)
    for message in feed.messages(windows):
        await processor.handle(message)
    await processor.flush()
    costs = producer.records(CostRecord, TOPICS.costs)
    bills = {(b["node_name"], b["window_start_unix_ms"]): b["node_cost_micro_usd"] for b in sqlite_ledger.bills()}
    assert len(bills) == len(windows)
    sums = defaultdict(int)
    for record in costs:
        sums[(record.node_name, record.window_start_unix_ms)] += record.cost_micro_usd
    assert dict(sums) == bills
    expected = [c for shares in windows for c in bill_node_window(shares, PriceCatalog.load()).costs]
    assert sorted(costs, key=repr) == sorted(expected, key=repr)
    # One NodeWindowCost per bill on the node-window-costs topic, carrying exactly the lines of the flat stream.
    window_costs = producer.records(NodeWindowCost, TOPICS.node_window_costs)
    assert len(window_costs) == len(windows)
    assert sorted((c for w in window_costs for c in w.cost_records()), key=repr) == sorted(expected, key=repr)
    assert {(w.node_name, w.window_start_unix_ms): w.node_cost_micro_usd for w in window_costs} == bills
    assert all(key == record.node_name.encode() for _, key, record in producer.delivered)
    assert processor.commit_positions() == {TP0: len(windows)}
    assert processor.stats.windows_billed == len(windows)


async def test_redelivery_to_a_fresh_processor_publishes_nothing_and_keeps_the_ledger(sqlite_ledger):
    windows = sample_shares(2)
    first = RecordingProducer()
    processor = make_processor(sqlite_ledger, first)
    for message in Feed().messages(windows):
        await processor.handle(message)
    await processor.flush()  # acknowledged: the ledger marks these windows published
    totals = sqlite_ledger.totals()
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    again = RecordingProducer()
    restarted = make_processor(sqlite_ledger, again, metrics=metrics)
    for message in Feed().messages(windows):
        await restarted.handle(message)
    await restarted.flush()
    assert again.delivered == []
    assert sqlite_ledger.totals() == totals
    assert restarted.stats.windows_already_billed == len(windows)
    duplicate_lines = metrics.registry.get_sample_value("gpumeter_billing_duplicate_rows_total")
    assert duplicate_lines == totals.cost_lines
    assert restarted.commit_positions() == {TP0: len(windows)}


async def test_garbage_is_dead_lettered_and_the_next_messages_are_billed(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    feed = Feed()
    garbage = feed.message(value=b"\x00not avro at all")
    assert await processor.handle(garbage) is False
    shares = two_gpu_window()
    assert await processor.handle(feed.message(shares)) is True
    await processor.flush()
    (letter,) = producer.records(DeadLetter, TOPICS.dead_letters)
    assert letter.reason_code == "CORRUPT"
    assert letter.raw_bytes == garbage.value
    assert (letter.source_offset, letter.service) == (0, "billing")
    assert len(producer.records(CostRecord)) == len(bill_node_window(shares, PriceCatalog.load()).costs)
    assert processor.commit_positions() == {TP0: 2}


async def test_a_record_of_another_type_is_dead_lettered_as_the_wrong_record_type(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    row = two_gpu_window()[0]  # a GpuShare row, as the old topic carried: not a node-window
    await processor.handle(Feed().message(value=codec_for(GpuShare).encode(row)))
    await processor.flush()
    (letter,) = producer.records(DeadLetter)
    assert letter.reason_code == "WRONG_RECORD_TYPE"
    assert processor.commit_positions() == {TP0: 1}


async def test_a_node_without_a_price_dead_letters_its_window_and_the_service_goes_on(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    feed = Feed()
    unpriced = feed.message(two_gpu_window(node="odd-node", instance_type="x9.nonexistent"))
    await processor.handle(unpriced)
    await processor.handle(feed.message(two_gpu_window(node="node-a")))
    await processor.flush()
    (letter,) = producer.records(DeadLetter)
    assert letter.reason_code == "NO_PRICE"
    assert (letter.source_offset, letter.raw_bytes) == (unpriced.offset, unpriced.value)
    assert "x9.nonexistent" in letter.reason
    assert {r.node_name for r in producer.records(CostRecord)} == {"node-a"}
    assert sqlite_ledger.totals().node_windows == 1
    assert processor.commit_positions() == {TP0: 2}


async def test_shares_that_do_not_add_up_dead_letter_the_whole_window(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    units = [Unit("GPU-0", [pod("p1", 0.6), bucket(ShareSubjectKind.IDLE, 0.3)])]  # adds up to 0.9
    await processor.handle(Feed().message(node_window(units)))
    await processor.flush()
    assert [l.reason_code for l in producer.records(DeadLetter)] == ["INCONSISTENT_SHARES"]
    assert sqlite_ledger.totals().node_windows == 0
    assert processor.commit_positions() == {TP0: 1}


async def test_a_window_impossible_on_its_own_is_out_of_range_before_pricing(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    rows = [replace(share, cost_share=1.5) if i == 0 else share for i, share in enumerate(two_gpu_window())]
    await processor.handle(Feed().message(rows))
    await processor.flush()
    (letter,) = producer.records(DeadLetter)
    assert letter.reason_code == "OUT_OF_RANGE" and "cost_share" in letter.reason
    assert sqlite_ledger.totals().node_windows == 0


async def test_a_crash_between_ledger_and_kafka_is_published_once_on_redelivery(sqlite_ledger):
    """The ledger committed but the cost records were never acknowledged (the process died before flush)."""
    windows = sample_shares(2)
    crashed = make_processor(sqlite_ledger, RecordingProducer())
    for message in Feed().messages(windows):
        await crashed.handle(message)
    totals = sqlite_ledger.totals()
    again = RecordingProducer()
    restarted = make_processor(sqlite_ledger, again)
    for message in Feed().messages(windows):
        await restarted.handle(message)
    await restarted.flush()
    expected = [record for record in crashed.producer.delivered]
    assert again.delivered == expected and len(expected) > 0
    assert restarted.stats.windows_republished == len(windows)
    assert sqlite_ledger.totals() == totals
    third = RecordingProducer()
    once_more = make_processor(sqlite_ledger, third)
    for message in Feed().messages(windows):
        await once_more.handle(message)
    await once_more.flush()
    assert third.delivered == []


class FlakyLedger:
    """The real ledger behind a connection that is refused ``failures`` times."""

    def __init__(self, ledger, failures: int, error: Exception | None = None) -> None:
        self.ledger = ledger
        self.failures = failures
        self.error = error
        self.calls = 0

    def write(self, costs, bills):
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            cause = self.error or OperationalError("INSERT", {}, Exception("connection refused"))
            raise LedgerError("writing failed") from cause
        return self.ledger.write(costs, bills)

    def mark_published(self, keys, published_at_unix_ms):
        return self.ledger.mark_published(keys, published_at_unix_ms)


async def test_an_unavailable_ledger_is_retried_with_backoff_without_committing(sqlite_ledger):
    producer = RecordingProducer()
    positions_while_down = []
    processor = None

    def on_pause(_count):
        positions_while_down.append(processor.commit_positions())

    pauses = Pauses(on_pause)
    ledger = FlakyLedger(sqlite_ledger, failures=5)
    processor = make_processor(ledger, producer, sleep=pauses)
    feed = Feed()
    await processor.handle(feed.message(value=b"junk"))
    await processor.flush()  # the junk's batch is checkpointed: its dead letter is out, its offset committed
    shares = two_gpu_window()
    await processor.handle(feed.message(shares))
    assert pauses.seconds == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert positions_while_down == [{TP0: 1}] * 5  # only the junk before the window was committed
    assert ledger.calls == 6
    await processor.flush()
    assert sqlite_ledger.totals().node_windows == 1
    assert producer.records(CostRecord) == list(bill_node_window(shares, PriceCatalog.load()).costs)
    assert processor.commit_positions() == {TP0: 2}


async def test_stopping_during_a_ledger_outage_leaves_the_window_uncommitted(sqlite_ledger):
    processor = None
    pauses = Pauses(lambda count: processor.stop() if count == 2 else None)
    processor = make_processor(FlakyLedger(sqlite_ledger, failures=100), sleep=pauses)
    shares = two_gpu_window()
    with pytest.raises(ServiceStopping):
        await processor.handle(Feed().message(shares))
    await processor.flush(retry=False)  # the driver's last checkpoint on the way out
    assert processor.commit_positions() == {}
    assert sqlite_ledger.totals().node_windows == 0


async def test_refused_values_dead_letter_the_window_and_bugs_stop_the_service(sqlite_ledger):
    producer = RecordingProducer()
    refused = FlakyLedger(sqlite_ledger, failures=1, error=IntegrityError("INSERT", {}, Exception("too long")))
    processor = make_processor(refused, producer)
    shares = two_gpu_window()
    await processor.handle(Feed().message(shares))
    await processor.flush()
    assert [l.reason_code for l in producer.records(DeadLetter)] == ["LEDGER_REJECTED"]
    assert processor.commit_positions() == {TP0: 1}

    class BrokenLedger:
        def write(self, costs, bills):
            raise LedgerError("cost lines add up to 1 micro-USD, the bill says 2")

    broken = make_processor(BrokenLedger(), RecordingProducer())
    with pytest.raises(LedgerError):
        await broken.handle(Feed().message(shares))
    assert broken.commit_positions() == {}
    assert broken.unacknowledged == 0


async def test_unacknowledged_records_are_sent_again_before_anything_is_committed(sqlite_ledger):
    producer = RecordingProducer(fail_first=2)
    pauses = Pauses()
    processor = make_processor(sqlite_ledger, producer, sleep=pauses)
    shares = two_gpu_window()
    await processor.handle(Feed().message(shares))
    expected = bill_node_window(shares, PriceCatalog.load()).costs
    assert processor.unacknowledged == len(expected) + 1  # the cost lines and the node-window's NodeWindowCost
    await processor.flush()
    assert pauses.seconds == [0.5]
    assert processor.unacknowledged == 0
    costs = producer.records(CostRecord)
    assert sorted(costs, key=repr) == sorted(expected, key=repr)  # each exactly once
    assert producer.attempts == len(expected) + 1 + 2
    assert sum(c.cost_micro_usd for c in costs) == sqlite_ledger.totals().bill_micro_usd
    assert await processor.flush(retry=False) is True


async def test_metrics_follow_the_bills_and_share_gauges_drop_pods_that_left(sqlite_ledger):
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    processor = make_processor(sqlite_ledger, metrics=metrics)
    feed = Feed()
    first = two_gpu_window(start_ms=WINDOW_START_MS)
    await processor.handle(feed.message(first))
    value = metrics.registry.get_sample_value
    priced = bill_node_window(first, PriceCatalog.load())
    for record in priced.costs:
        if record.subject_kind is CostSubjectKind.POD:
            team = record.labels.get("team", "")
            assert value("gpumeter_pod_gpu_cost_micro_usd_total",
                         {"namespace": record.namespace, "pod": record.pod_name, "team": team,
                          **on_gpu(record.gpu_uuid)}) == record.cost_micro_usd
    idle = sum(r.cost_micro_usd for r in priced.costs if r.subject_kind is CostSubjectKind.IDLE)
    assert value("gpumeter_bucket_cost_micro_usd_total", {"node": "node-a", "kind": "idle"}) == idle
    assert value("gpumeter_node_cost_micro_usd_total",
                 {"node": "node-a", "instance_type": "p4d.24xlarge"}) == priced.bill.node_cost_micro_usd
    assert value("gpumeter_billing_ledger_rows_written_total") == len(priced.costs)
    p1 = {"namespace": "ml", "pod": "pod-p1", "team": "research", "gpu_uuid": "GPU-0", **on_gpu("GPU-0")}
    assert value("gpumeter_pod_gpu_memory_share", p1) == 0.6
    # next window: p1 left GPU-0
    units = [Unit("GPU-0", [bucket(ShareSubjectKind.IDLE, 1.0)]),
             Unit("GPU-1", [pod("p2", 0.25, "web", team="prod"), bucket(ShareSubjectKind.IDLE, 0.75)])]
    await processor.handle(feed.message(node_window(units, window_start_ms=WINDOW_START_MS + MINUTE_MS)))
    assert value("gpumeter_pod_gpu_memory_share", p1) is None
    assert value("gpumeter_pod_gpu_compute_share",
                 {"namespace": "web", "pod": "pod-p2", "team": "prod", "gpu_uuid": "GPU-1",
                  **on_gpu("GPU-1")}) == 0.25
    assert value("gpumeter_dead_letters_total", {"service": "billing", "topic": SHARES_TOPIC,
                                                 "reason_code": "CORRUPT"}) is None
    await processor.handle(feed.message(value=b"zz"))
    assert value("gpumeter_dead_letters_total", {"service": "billing", "topic": SHARES_TOPIC,
                                                 "reason_code": "CORRUPT"}) == 1


async def test_the_sharing_policy_bills_publishes_and_counts_the_shared_lines(sqlite_ledger):
    """The one policy, applied once: the ledger, the costs topic and the metrics all get the same shared lines."""
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    sharing = SharingPolicy.parse("idle=weighted,unattributed=even,node_other=weighted")
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer, metrics=metrics, sharing=sharing)
    window = two_gpu_window()
    await processor.handle(Feed().message(window))
    assert await processor.flush(retry=False)
    priced = bill_node_window(window, PriceCatalog.load(), DEFAULT_SPLIT_POLICY, sharing)
    sent = producer.records(CostRecord)
    assert sorted(sent, key=repr) == sorted(priced.costs, key=repr)
    stored = list(sqlite_ledger.iter_cost_lines())
    assert sorted(stored, key=repr) == sorted(priced.costs, key=repr)
    assert {b["sharing"] for b in sqlite_ledger.bills()} == {sharing.describe()}
    shared = [c for c in sent if c.is_shared]
    assert {c.shared_from for c in shared} == {CostSubjectKind.IDLE, CostSubjectKind.UNATTRIBUTED,
                                               CostSubjectKind.NODE_OTHER}
    assert not [c for c in sent if c.subject_kind in (CostSubjectKind.IDLE, CostSubjectKind.NODE_OTHER)]
    value = metrics.registry.get_sample_value
    for record in shared:
        # A shared line is a bucket of the node: no GPU of its own.
        labels = {"namespace": record.namespace, "pod": record.pod_name, "team": record.labels.get("team", ""),
                  "shared_from": record.shared_from.value.lower(), **on_gpu("", model="")}
        assert value("gpumeter_pod_shared_cost_micro_usd_total", labels) == record.cost_micro_usd
    for record in (c for c in sent if c.subject_kind is CostSubjectKind.POD and not c.is_shared):
        labels = {"namespace": record.namespace, "pod": record.pod_name, "team": record.labels.get("team", ""),
                  **on_gpu(record.gpu_uuid)}
        assert value("gpumeter_pod_gpu_cost_micro_usd_total", labels) == record.cost_micro_usd
    assert value("gpumeter_bucket_cost_micro_usd_total", {"node": "node-a", "kind": "idle"}) is None


def test_the_sharing_setting_reads_env_and_the_flag_wins():
    assert parse_settings([], {}).sharing == KEEP_ALL
    env = {"GPUMETER_BILLING_SHARING": "idle=weighted"}
    assert parse_settings([], env).sharing.describe() == "idle=weighted"
    settings = parse_settings(["--sharing", "all=even"], env)
    assert settings.sharing == SharingPolicy.parse("all=even") and settings.describe()["sharing"].startswith("idle=")
    from gpumeter.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_settings(["--sharing", "idle=spread"], {})


async def test_revoked_partitions_drop_their_offsets(sqlite_ledger):
    processor = make_processor(sqlite_ledger)
    feed = Feed()
    await processor.handle(feed.message(two_gpu_window(node="node-a"), partition=0))
    await processor.handle(feed.message(two_gpu_window(node="node-b"), partition=1))
    await processor.revoke([TP0])  # the rebalance checkpoints first: both partitions' progress is committed
    assert processor.commit_positions() == {TP0: 1, TP1: 1}
    await processor.handle(feed.message(two_gpu_window(node="node-d"), partition=1))
    await processor.flush()
    assert processor.commit_positions() == {TP0: 1, TP1: 2}  # TP0 is not this member's any more
    # Assigned again later, the partition is committed from what is handled then.
    processor.assign([TP0])
    again = Feed()
    again.next_offset[0] = 5
    assert await processor.handle(again.message(two_gpu_window(node="node-c"), partition=0)) is True
    await processor.flush()
    assert processor.commit_positions() == {TP0: 6, TP1: 2}



# -- one ledger write per fetched batch -----------------------------------------------------------------------


class CountingLedger:
    """The real ledger, counting its writes and the node-windows in each."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger
        self.writes: list[int] = []

    def write(self, costs, bills):
        bills = list(bills)
        self.writes.append(len(bills))
        return self.ledger.write(costs, bills)

    def mark_published(self, keys, published_at_unix_ms):
        return self.ledger.mark_published(keys, published_at_unix_ms)


def costs_sent(producer: RecordingProducer) -> list[CostRecord]:
    return producer.records(CostRecord, TOPICS.costs)


async def test_a_batch_bills_every_window_it_brings_with_one_ledger_write(sqlite_ledger):
    ledger = CountingLedger(sqlite_ledger)
    producer = RecordingProducer()
    processor = make_processor(ledger, producer)
    feed = Feed()
    windows = sample_shares(3)  # six node-windows
    messages = feed.messages(windows)
    assert await processor.handle_batch(messages) == len(messages)
    assert ledger.writes == [len(windows)]
    assert sqlite_ledger.totals().node_windows == len(windows)
    expected = [c for shares in windows for c in bill_node_window(shares, PriceCatalog.load()).costs]
    assert costs_sent(producer) == expected  # in input order
    assert processor.stats.windows_billed == len(windows)
    await processor.flush()
    assert processor.commit_positions() == {TP0: len(messages)}


async def test_a_batch_holds_its_completed_windows_until_the_write(sqlite_ledger):
    ledger = FlakyLedger(sqlite_ledger, failures=2)
    positions_while_down = []
    processor = None
    pauses = Pauses(lambda _count: positions_while_down.append(processor.commit_positions()))
    processor = make_processor(ledger, sleep=pauses)
    feed = Feed()
    messages = [feed.message(value=b"junk")] + [feed.message(two_gpu_window(node="node-a"))] + \
        [feed.message(two_gpu_window(node="node-b"))]
    await processor.handle_batch(messages)
    assert pauses.seconds == [0.5, 1.0]
    assert positions_while_down == [{}] * 2  # nothing of the batch committed while the ledger is down
    assert ledger.calls == 3  # the same single write, retried
    await processor.flush()
    assert processor.commit_positions() == {TP0: len(messages)}
    assert sqlite_ledger.totals().node_windows == 2


async def test_a_batch_of_new_and_redelivered_windows_publishes_only_what_was_never_published(sqlite_ledger):
    first, second, third = two_gpu_window(node="node-a"), two_gpu_window(node="node-b"), two_gpu_window(node="node-c")
    published = make_processor(sqlite_ledger)
    await published.handle(Feed().message(first))
    await published.flush()  # node-a: billed and marked published
    crashed = make_processor(sqlite_ledger)
    await crashed.handle_batch([Feed().message(second)])  # node-b: billed, then the process died before the flush

    producer = RecordingProducer()
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    ledger = CountingLedger(sqlite_ledger)
    restarted = make_processor(ledger, producer, metrics=metrics)
    feed = Feed()
    await restarted.handle_batch([feed.message(first)] + [feed.message(second)] + [feed.message(third)])
    await restarted.flush()
    assert ledger.writes == [3]
    catalog = PriceCatalog.load()
    assert costs_sent(producer) == [*bill_node_window(second, catalog).costs, *bill_node_window(third, catalog).costs]
    stats = restarted.stats
    assert (stats.windows_already_billed, stats.windows_republished, stats.windows_billed) == (1, 1, 1)
    value = metrics.registry.get_sample_value
    assert value("gpumeter_billing_duplicate_rows_total") == len(bill_node_window(first, catalog).costs)
    assert value("gpumeter_billing_ledger_rows_written_total") == len(bill_node_window(third, catalog).costs)
    assert sqlite_ledger.totals().node_windows == 3
    assert restarted.commit_positions() == {TP0: 3}
    # marked published now: one more redelivery publishes nothing
    again = RecordingProducer()
    once_more = make_processor(sqlite_ledger, again)
    await once_more.handle_batch([Feed().message(first)] + [Feed().message(second)] + [Feed().message(third)])
    await once_more.flush()
    assert again.delivered == []


class RefusingLedger(CountingLedger):
    """Refuses (IntegrityError) any write holding a bill of ``node``, like a value too long for its column."""

    def __init__(self, ledger, node: str) -> None:
        super().__init__(ledger)
        self.node = node

    def write(self, costs, bills):
        bills = list(bills)
        self.writes.append(len(bills))
        if any(bill.node_name == self.node for bill in bills):
            raise LedgerError("writing failed") from IntegrityError("INSERT", {}, Exception("value too long"))
        return self.ledger.write(costs, bills)


async def test_a_window_the_ledger_refuses_is_dead_lettered_alone_and_the_rest_of_the_batch_is_billed(sqlite_ledger):
    ledger = RefusingLedger(sqlite_ledger, node="node-bad")
    producer = RecordingProducer()
    processor = make_processor(ledger, producer)
    feed = Feed()
    good_a, bad, good_b = two_gpu_window(node="node-a"), two_gpu_window(node="node-bad"), two_gpu_window(node="node-b")
    messages = [feed.message(good_a)] + [feed.message(bad)] + [feed.message(good_b)]
    await processor.handle_batch(messages)
    await processor.flush()
    assert ledger.writes == [3, 1, 1, 1]  # the batch, then each window alone
    letters = producer.records(DeadLetter)
    assert [(l.reason_code, l.source_offset) for l in letters] == [("LEDGER_REJECTED", 1)]
    assert {r.node_name for r in costs_sent(producer)} == {"node-a", "node-b"}
    assert sqlite_ledger.totals().node_windows == 2
    assert processor.commit_positions() == {TP0: len(messages)}


async def test_a_ledger_bug_in_a_batch_stops_the_service_without_committing(sqlite_ledger):
    class BrokenLedger:
        def write(self, costs, bills):
            raise LedgerError("cost lines add up to 1 micro-USD, the bill says 2")

    processor = make_processor(BrokenLedger())
    feed = Feed()
    messages = [feed.message(two_gpu_window(node="node-a"))] + [feed.message(two_gpu_window(node="node-b"))]
    with pytest.raises(LedgerError):
        await processor.handle_batch(messages)
    await processor.flush(retry=False)  # the driver's last checkpoint on the way out commits none of the batch
    assert processor.commit_positions() == {}
    assert processor.unacknowledged == 0


async def test_a_batch_stops_taking_messages_once_stopping_and_bills_what_it_completed(sqlite_ledger):
    producer = RecordingProducer()
    processor = make_processor(sqlite_ledger, producer)
    feed = Feed()
    first, second = two_gpu_window(node="node-a"), two_gpu_window(node="node-b")
    first_messages, second_messages = [feed.message(first)], [feed.message(second)]

    def fetched():
        yield from first_messages
        processor.stop()
        yield from second_messages

    assert await processor.handle_batch(fetched()) == len(first_messages)
    assert await processor.flush(retry=False) is True
    assert sqlite_ledger.totals().node_windows == 1
    assert {r.node_name for r in costs_sent(producer)} == {"node-a"}
    assert processor.commit_positions() == {TP0: len(first_messages)}  # node-b is read again after the restart


async def test_a_window_twice_in_one_batch_is_written_in_two_ledger_calls(sqlite_ledger):
    # A redelivered node-window in the same batch as the first delivery: one ledger write may not hold two bills
    # of one node-window, so the first goes out before the second is added.
    ledger = CountingLedger(sqlite_ledger)
    producer = RecordingProducer()
    processor = make_processor(ledger, producer)
    feed = Feed()
    old = two_gpu_window(node="node-a")
    newer = two_gpu_window(node="node-a", start_ms=WINDOW_START_MS + MINUTE_MS)
    messages = [feed.message(old), feed.message(newer), feed.message(old)]
    await processor.handle_batch(messages)
    assert ledger.writes == [2, 1]
    assert sqlite_ledger.totals().node_windows == 2
    await processor.flush()
    assert processor.commit_positions() == {TP0: 3}
    assert len(costs_sent(producer)) == len(bill_node_window(old, PriceCatalog.load()).costs) + len(
        bill_node_window(newer, PriceCatalog.load()).costs)  # the redelivery published nothing


def mixed_feed() -> list[RawMessage]:
    """Garbage, two nodes' windows, an unpriced window, a duplicate, shares that do not add up."""
    feed = Feed()
    a, b = two_gpu_window(node="node-a"), two_gpu_window(node="node-b")
    unpriced = two_gpu_window(node="odd-node", instance_type="x9.nonexistent")
    short = node_window([Unit("GPU-0", [pod("p1", 0.6), bucket(ShareSubjectKind.IDLE, 0.3)])], node="node-c")
    messages = [feed.message(value=b"\x00junk"), feed.message(a), feed.message(b), feed.message(unpriced),
                feed.message(a)]
    messages += feed.messages(sample_shares(2)) + [feed.message(short)]
    return messages


async def test_a_batch_has_the_same_effects_as_its_messages_one_at_a_time(tmp_path):
    from services.billing.ledger import Ledger

    results = []
    for name, batched in (("one-at-a-time", False), ("batched", True)):
        ledger = Ledger(f"sqlite:///{tmp_path / name}.sqlite3")
        ledger.migrate()
        producer = RecordingProducer()
        metrics = ServiceMetrics("billing", BILLING_METRICS)
        processor = make_processor(ledger, producer, metrics=metrics)
        messages = mixed_feed()
        for _ in range(2):  # the second pass is a redelivery to the same processor
            if batched:
                await processor.handle_batch(messages)
            else:
                for message in messages:
                    await processor.handle(message)
        await processor.flush()
        # Per topic: the order across topics (dead letters vs cost records) is not kept, nor needs to be.
        by_topic = {topic: [(k, r) for t, k, r in producer.delivered if t == topic]
                    for topic in (TOPICS.costs, TOPICS.node_window_costs, TOPICS.dead_letters)}
        assert len(producer.delivered) == sum(len(v) for v in by_topic.values())
        stats = dataclasses.replace(processor.stats, ledger_writes=0)  # how many writes is what batching changes
        results.append((by_topic, processor.commit_positions(), stats, processor.dead_lettered, ledger.totals(),
                        list(ledger.iter_cost_lines()), metrics.registry.get_sample_value(
                            "gpumeter_billing_ledger_rows_written_total")))
        ledger.close()
    one_at_a_time, batched = results
    assert batched == one_at_a_time
    # node-a, node-b and the four sample windows billed; the garbage, the unpriced and the short window
    # dead-lettered (each pass)
    assert one_at_a_time[2].windows_billed == 6 and one_at_a_time[3] == 6


# -- settings --------------------------------------------------------------------------------------------------


def parse_settings(argv, env):
    import argparse

    from services.billing.settings import add_arguments, billing_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return billing_settings(parser.parse_args(argv), env)


def test_the_default_consumer_group_carries_the_topic_prefix():
    assert parse_settings([], {"GPUMETER_KAFKA_TOPIC_PREFIX": "prod."}).consumer_group == "prod.gpumeter-billing"
    assert parse_settings(["--topic-prefix", "t1."], {}).consumer_group == "t1.gpumeter-billing"
    assert parse_settings([], {}).consumer_group == "gpumeter-billing"
    assert parse_settings([], {"GPUMETER_KAFKA_TOPIC_PREFIX": "prod.",
                               "GPUMETER_BILLING_CONSUMER_GROUP": "mine"}).consumer_group == "mine"


def test_settings_read_env_and_flags_win():
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "kafka:9092",
        "GPUMETER_KAFKA_TOPIC_PREFIX": "prod.",
        "GPUMETER_LEDGER_URL": "sqlite:///from-env.sqlite3",
        "GPUMETER_BILLING_CONSUMER_GROUP": "env-group",
        "GPUMETER_BILLING_FINISHED_WINDOW_MEMORY_SECONDS": "120",
        "GPUMETER_BILLING_SPLIT_RULE": "weights",
        "GPUMETER_BILLING_SPOT_DISCOUNTS": "aws=0.6",
        "GPUMETER_METRICS_PORT": "9999",
    }
    settings = parse_settings(["--group", "flag-group", "--split-rule", "gpu_fraction", "--gpu-fraction", "0.8"], env)
    assert settings.kafka.bootstrap_servers == "kafka:9092"
    assert settings.kafka.topic_prefix == "prod."
    assert settings.kafka.client_id == "gpumeter-billing"
    assert settings.ledger_url == "sqlite:///from-env.sqlite3"
    assert settings.consumer_group == "flag-group"
    assert settings.series_memory_seconds == 120.0  # the horizon's older name is still read
    assert settings.metrics_port == 9999
    # the price settings go through the same parsers as PriceCatalog.from_env / SplitPolicy.from_env
    from decimal import Decimal

    from services.billing.pricing import SplitPolicy

    assert settings.split_policy == SplitPolicy.from_env({"GPUMETER_BILLING_SPLIT_RULE": "gpu_fraction",
                                                          "GPUMETER_BILLING_GPU_FRACTION": "0.8"})
    assert settings.spot_discounts == {"aws": Decimal("0.6")}
    assert settings.price_catalog().quote(provider="aws", region="us-east-1", instance_type="p4d.24xlarge",
                                          price_model="spot").derivation.startswith("spot = on_demand")


def test_settings_never_show_the_ledger_password():
    settings = parse_settings(["--ledger-url", "postgresql+psycopg://billing:hunter2@db:5432/gpumeter"], {})
    for text in (repr(settings), str(settings.describe())):
        assert "hunter2" not in text
    assert settings.describe()["ledger_url"] == "postgresql+psycopg://billing:***@db:5432/gpumeter"
    assert settings.ledger_url.endswith("hunter2@db:5432/gpumeter")


@pytest.mark.parametrize("argv, env", [
    (["--series-memory", "0"], {}),
    (["--metrics-port", "70000"], {}),
    ([], {"GPUMETER_BILLING_SPOT_DISCOUNTS": "aws=1.5"}),
    ([], {"GPUMETER_BILLING_SPLIT_RULE": "by-vibes"}),
    ([], {"GPUMETER_BILLING_SERIES_MEMORY_SECONDS": "soon"}),
])
def test_unusable_settings_are_config_errors(argv, env):
    from gpumeter.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_settings(argv, env)


def test_the_entrypoint_refuses_unusable_settings_before_touching_anything(capsys):
    from gpumeter import cli

    assert cli.main(["billing", "--series-memory", "-5"]) == 2
    assert "--series-memory" in capsys.readouterr().out


async def test_a_missing_price_folder_stops_the_service_before_it_connects(tmp_path):
    from services.billing.main import serve
    from services.billing.settings import BillingSettings

    settings = BillingSettings(price_dir=tmp_path / "no-such-folder", ledger_url=f"sqlite:///{tmp_path}/l.db",
                               metrics_port=0)
    assert await serve(settings) == 2
    assert not (tmp_path / "l.db").exists()


def exported_series(metrics: ServiceMetrics, name: str) -> dict[tuple, float]:
    """The label sets (and values) ``name`` exports now, as a scrape of the registry sees them."""
    samples = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name:
                samples[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


async def test_series_of_pods_that_came_and_went_are_removed_after_their_last_window(sqlite_ledger):
    """1,000 pods come and go on two nodes, ten at a time per GPU; then one node goes away. Only the pods of the
    newest windows keep their series, each with its whole cost; the node's series go once it has billed nothing
    for the memory horizon."""
    metrics = ServiceMetrics("billing", BILLING_METRICS)
    clock = ManualClock(WINDOW_START_MS + 90_000)
    processor = make_processor(sqlite_ledger, clock=clock, metrics=metrics, memory_s=600.0)
    feed = Feed()
    windows, pods_per_window = 50, 10
    expected_cost: dict[tuple, int] = defaultdict(int)
    catalog = PriceCatalog.load()
    live: dict[str, set[tuple]] = {}
    for w in range(windows):
        start = WINDOW_START_MS + w * MINUTE_MS
        clock.set_ms(start + 90_000)
        for node in ("node-a", "node-b"):
            rows = [pod(f"{node}-w{w}-{i}", 0.09, "ml", team=f"team-{i % 3}") for i in range(pods_per_window)]
            rows.append(bucket(ShareSubjectKind.IDLE, 0.1))
            shares = node_window([Unit("GPU-0", rows)], node=node, window_start_ms=start)
            await processor.handle(feed.message(shares))
            live[node] = set()
            for record in bill_node_window(shares, catalog).costs:
                if record.subject_kind is CostSubjectKind.POD:
                    labels = tuple(sorted({"namespace": "ml", "pod": record.pod_name, "team": record.labels["team"],
                                           **on_gpu("GPU-0", node)}.items()))
                    expected_cost[labels] += record.cost_micro_usd
                    live[node].add(labels)
    assert processor.stats.windows_billed == 2 * windows  # 1,000 pods billed
    pod_cost = "gpumeter_pod_gpu_cost_micro_usd_total"
    exported = exported_series(metrics, pod_cost)
    assert set(exported) == live["node-a"] | live["node-b"]  # 20 series, not 1,000
    assert all(exported[labels] == expected_cost[labels] for labels in exported)
    assert len(exported_series(metrics, "gpumeter_pod_gpu_memory_share")) == 2 * pods_per_window

    # node-b goes away; node-a bills on beyond the memory horizon (600 s): node-b's series go, all of them.
    for w in range(windows, windows + 12):
        start = WINDOW_START_MS + w * MINUTE_MS
        clock.set_ms(start + 90_000)
        shares = node_window([Unit("GPU-0", [pod("steady", 0.5, "ml", team="team-0"),
                                             bucket(ShareSubjectKind.IDLE, 0.5)])], node="node-a",
                             window_start_ms=start)
        await processor.handle(feed.message(shares))
    for name in (pod_cost, "gpumeter_pod_gpu_memory_share", "gpumeter_pod_gpu_compute_share",
                 "gpumeter_node_cost_micro_usd_total", "gpumeter_bucket_cost_micro_usd_total"):
        nodes_and_pods = {dict(labels).get("node") or dict(labels)["pod"] for labels in exported_series(metrics, name)}
        assert nodes_and_pods in ({"node-a"}, {"pod-steady"}), (name, nodes_and_pods)


async def test_a_ledger_outage_between_two_writes_of_one_batch_keeps_what_the_first_wrote(sqlite_ledger):
    """[old, newer, old again] is two writes; the ledger goes away for the second. The retry must not take the
    first write's windows for duplicates (their records were not published yet): each is published once."""

    class DownForTheSecondWrite(CountingLedger):
        def write(self, costs, bills):
            bills = list(bills)
            self.writes.append(len(bills))
            if len(self.writes) == 2:
                raise LedgerError("writing failed") from OperationalError("INSERT", {}, Exception("refused"))
            return self.ledger.write(costs, bills)

    ledger = DownForTheSecondWrite(sqlite_ledger)
    producer = RecordingProducer()
    pauses = Pauses()
    processor = make_processor(ledger, producer, sleep=pauses)
    feed = Feed()
    old = two_gpu_window(node="node-a")
    newer = two_gpu_window(node="node-a", start_ms=WINDOW_START_MS + MINUTE_MS)
    await processor.handle_batch([feed.message(old), feed.message(newer), feed.message(old)])
    await processor.flush()
    assert ledger.writes == [2, 1, 1]  # the second write retried alone
    assert pauses.seconds == [0.5]
    catalog = PriceCatalog.load()
    assert costs_sent(producer) == [*bill_node_window(old, catalog).costs, *bill_node_window(newer, catalog).costs]
    assert len(producer.records(NodeWindowCost)) == 2
    assert processor.stats.windows_billed == 2 and processor.stats.windows_already_billed == 1
    assert processor.commit_positions() == {TP0: 3}
