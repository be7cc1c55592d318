"""The guard's ``budgets`` role across a restart from its state file, against the session's Kafka broker: a bill
delivered again after the restart (billing republishing it, a producer retry) does not count twice, so a
namespace's budget fires at the bill that really crosses it, with the spend the ledger holds.

The role keeps of each bill only its node-window (``GuardEngine`` with ``idle=False``), so this is the test that
what it writes and reads back is enough to keep the dedup exact through the real service and state store.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gpumeter.clock import SystemClock
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node
from schemas.records import CostSubjectKind, NodeWindowCost, Violation, ViolationState
from schemas.typed import codec_for
from services.guard.config import Budget, GuardConfig
from services.guard.main import serve
from services.guard.settings import GuardSettings
from services.guard.state import GuardStateStore
from tests.integration.topic_reading import read_records
from tests.unit.guard import CLUSTER, GPU_A, NODE, cost

pytestmark = pytest.mark.integration

PARTITIONS = 3
WAIT_S = 20.0
DAY_MS = 86_400_000
BUDGET_MICRO_USD = 1_000


def bill(window_start_ms: int, pods: int, micro_usd_each: int) -> NodeWindowCost:
    """A bill of ``pods`` pod lines of namespace ``ml`` on one GPU and a node_other line."""
    lines = [cost(GPU_A, window_start=window_start_ms, micro_usd=micro_usd_each,
                  pod_uid=f"00000000-0000-4000-8000-{i:012d}", namespace="ml") for i in range(pods)]
    lines.append(cost(None, window_start=window_start_ms, micro_usd=7, kind=CostSubjectKind.NODE_OTHER))
    return NodeWindowCost.from_cost_records(
        lines, billed_milliseconds=60_000, cloud_provider="aws", region="us-east-1", zone="us-east-1a",
        provider_id="", price_per_hour_usd="1.0", split_rule="sku", gpu_count=1,
        gpu_cost_micro_usd=pods * micro_usd_each, sharing="keep")


async def produce_bills(kafka_settings, topics, *bills: NodeWindowCost) -> None:
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for record in bills:
            await producer.send(topics.node_window_costs, record, key=NODE.encode(),
                                partition=partition_for_node(NODE, PARTITIONS))
        await producer.flush()
    finally:
        await producer.stop()


async def budget_violations(kafka_settings, topics) -> list[Violation]:
    return [v for _, v in await read_records(kafka_settings, topics.violations, codec_for(Violation).decode)
            if v.rule == "budget_exceeded"]


async def test_a_bill_redelivered_after_a_restart_does_not_count_twice(kafka_settings, topic_catalog, group_id,
                                                                       tmp_path):
    config = GuardConfig(hold_down_seconds=2, budget_forecast_min_elapsed_fraction=1.0,
                         namespace_budgets={"ml": Budget(day_micro_usd=BUDGET_MICRO_USD)})
    settings = GuardSettings(kafka=kafka_settings, consumer_group=group_id, metrics_port=0, role="budgets",
                             topic_partitions=PARTITIONS, state_path=tmp_path / "guard.state",
                             snapshot_interval_seconds=0.5, clock_interval_seconds=0.2)
    clock = SystemClock()
    now_ms = clock.now_ms()
    # Three windows of today (UTC): a window may end after now, within the clock skew the guard allows.
    first = max(now_ms // 60_000 * 60_000 - 5 * 60_000, now_ms // DAY_MS * DAY_MS)
    windows = [first + k * 60_000 for k in range(3)]
    store = GuardStateStore(settings.state_path)

    # 1. 600 of the day's 1000, then a stop that writes the state and the positions it covers.
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=config, stop=stop, clock=clock))
    try:
        await produce_bills(kafka_settings, topic_catalog, bill(windows[0], 6, 100))
        deadline = time.monotonic() + WAIT_S
        while True:
            saved = store.load()
            if saved is not None and any(offset > 0 for offset in saved.positions.values()):
                break
            assert time.monotonic() < deadline, "the budgets guard never checkpointed the first bill"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0
    assert await budget_violations(kafka_settings, topic_catalog) == []

    # 2. The first bill again (a redelivery), then 400 more: 1000, at the budget -- over it only if the redelivery
    # counted. Then one micro-dollar more crosses it.
    await produce_bills(kafka_settings, topic_catalog, bill(windows[0], 6, 100), bill(windows[1], 4, 100))
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, config=config, stop=stop, clock=clock))
    try:
        await asyncio.sleep(2.0)  # room to fire, were the redelivery counted
        assert await budget_violations(kafka_settings, topic_catalog) == []
        await produce_bills(kafka_settings, topic_catalog, bill(windows[2], 1, 1))
        deadline = time.monotonic() + WAIT_S
        while not await budget_violations(kafka_settings, topic_catalog):
            assert time.monotonic() < deadline, "the budget crossed by the last bill never fired"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0
    (fired,) = await budget_violations(kafka_settings, topic_catalog)
    assert (fired.state, fired.cluster, fired.namespace) == (ViolationState.FIRING, CLUSTER, "ml")
    assert fired.evidence["spent_micro_usd"] == BUDGET_MICRO_USD + 1
