"""The billing service end to end: the session's Kafka broker, a real PostgreSQL ledger, the service in-process and
then as ``gpumeter billing`` in a subprocess.

NodeWindowShares of 2 nodes x 2 windows (plus a garbage message) in → CostRecords out that add up exactly to the node
bills in the ledger; the same shares again, and a restart with a fresh consumer group, change nothing; the
garbage becomes a DeadLetter while the rest is billed; ``gpumeter report`` reconciles by namespace and by team.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from gpumeter import cli
from gpumeter.kafka.producer import RecordProducer
from schemas.records import CostRecord, CostSubjectKind, DeadLetter, NodeWindowShares
from services.billing.catalog import PriceCatalog
from services.billing.costing import bill_node_window, iso_utc
from services.billing.ledger import Ledger
from services.billing.main import serve
from services.billing.settings import BillingSettings
from tests.integration.topic_reading import end_offsets, read_topic
from tests.unit.billing.conftest import WINDOW_START_MS, sample_shares

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

REPO_ROOT = Path(__file__).resolve().parents[2]
WINDOWS = 2
PASSWORD = f"pw-{uuid.uuid4().hex[:8]}"  # trust authentication ignores it; it must never be printed
GARBAGE = b"\xc3\x01 definitely not a NodeWindowShares"
WAIT_S = 25.0


@pytest.fixture
def ledger_url(postgres_url):
    """A database of this test's own on the session server (URL with a password in it), dropped afterwards."""
    name = f"billing_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(postgres_url).set(database=name, password=PASSWORD).render_as_string(hide_password=False)
    yield url
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


async def wait_until_committed_to_end(settings, group: str, topic: str, what: str) -> None:
    """Wait until ``group`` has committed every partition of ``topic`` up to its end (everything billed)."""
    ends = await end_offsets(settings, topic)
    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    await admin.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                offsets = await admin.list_consumer_group_offsets(group)
            except KafkaError as exc:
                # A broker just started has no group coordinator until __consumer_offsets exists: retriable, so
                # it counts as "nothing committed yet" until the deadline.
                if not exc.retriable:
                    raise
                offsets = {}
            committed = {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}
            if all(committed.get(p, 0) == end for p, end in ends.items()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: group {group} committed {committed}, topic ends at {ends}")
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def produce_shares(settings, topic: str, windows, *, garbage_after: int | None = None) -> None:
    producer = RecordProducer(settings)
    await producer.start()
    try:
        for index, shares in enumerate(windows):
            # One node-window, one message, as the attributor writes it.
            await producer.send(topic, NodeWindowShares.from_rows(shares), key=shares[0].node_name.encode())
            if index == garbage_after:
                await producer.send_bytes(topic, GARBAGE, key=b"aws-node")
        await producer.flush()
    finally:
        await producer.stop()


def sums_by_node_window(records) -> dict[tuple[str, int], int]:
    sums: dict[tuple[str, int], int] = defaultdict(int)
    for record in records:
        sums[(record.node_name, record.window_start_unix_ms)] += record.cost_micro_usd
    return dict(sums)


def ledger_state(url: str):
    with Ledger(url) as ledger:
        bills = {(b["node_name"], b["window_start_unix_ms"]): b["node_cost_micro_usd"] for b in ledger.bills()}
        return bills, ledger.totals()


def report_json(capsys, url: str, by: str) -> tuple[int, dict]:
    end = iso_utc(WINDOW_START_MS + WINDOWS * 60_000)
    code = cli.main(["report", "--by", by, "--format", "json", "--window", "1h", "--end", end, "--ledger-url", url])
    return code, json.loads(capsys.readouterr().out)


async def test_shares_in_costs_out_redelivery_restart_and_reports(kafka_settings, topic_catalog, group_id,
                                                                  ledger_url, capsys):
    windows = sample_shares(WINDOWS)  # 2 nodes x 2 windows, each a complete node-window
    catalog = PriceCatalog.load()
    expected = [c for shares in windows for c in bill_node_window(shares, catalog).costs]
    settings = BillingSettings(kafka=kafka_settings, ledger_url=ledger_url, consumer_group=group_id,
                               metrics_port=0, topic_partitions=3)

    # 1. the service in-process; the garbage message sits between the first and the second windows
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop=stop))
    try:
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, windows, garbage_after=1)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares, "first delivery")
        costs = await read_topic(kafka_settings, topic_catalog.costs, CostRecord)
        bills, totals = ledger_state(ledger_url)
        assert len(bills) == 2 * WINDOWS
        assert sums_by_node_window(costs) == bills  # every node-window's records add up to its bill exactly
        assert sorted(costs, key=repr) == sorted(expected, key=repr)
        assert totals.cost_micro_usd == totals.bill_micro_usd == sum(c.cost_micro_usd for c in expected)
        (letter,) = await read_topic(kafka_settings, topic_catalog.dead_letters, DeadLetter)
        assert (letter.service, letter.source_topic, letter.raw_bytes) == ("billing", topic_catalog.node_window_shares,
                                                                           GARBAGE)
        assert letter.reason_code == "UNKNOWN_SCHEMA"  # c301 magic, then no known fingerprint

        # 2. the same shares again to the running service: nothing new anywhere
        costs_end = await end_offsets(kafka_settings, topic_catalog.costs)
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, windows)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares, "redelivery")
        assert await end_offsets(kafka_settings, topic_catalog.costs) == costs_end
        assert ledger_state(ledger_url) == (bills, totals)
    finally:
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0

    # 3. `gpumeter billing` restarted with a fresh consumer group re-reads everything: still nothing new
    fresh_group = group_id + "-restart"
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
        "GPUMETER_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
        "GPUMETER_LEDGER_URL": ledger_url,
        "GPUMETER_BILLING_CONSUMER_GROUP": fresh_group,
        "PYTHONPATH": str(REPO_ROOT),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumeter.cli", "billing", "--metrics-port", "0", cwd=REPO_ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await wait_until_committed_to_end(kafka_settings, fresh_group, topic_catalog.node_window_shares, "restart")
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), WAIT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    log = output.decode()
    assert process.returncode == 0, log
    assert PASSWORD not in log
    config_line = next(line for line in log.splitlines() if line.startswith("gpumeter billing {"))
    config = json.loads(config_line[len("gpumeter billing "):])
    assert config["ledger_url"] == make_url(ledger_url).render_as_string(hide_password=True)
    assert config["consumer_group"] == fresh_group
    assert await end_offsets(kafka_settings, topic_catalog.costs) == costs_end
    assert ledger_state(ledger_url) == (bills, totals)

    # 4. reports from the PostgreSQL ledger reconcile to the node bills
    code, by_namespace = report_json(capsys, ledger_url, "namespace")
    assert code == 0
    assert by_namespace["reconciliation"]["reconciled"] is True
    assert by_namespace["total_micro_usd"] == sum(bills.values())
    expected_ns = defaultdict(int)
    for record in expected:
        if record.subject_kind is CostSubjectKind.POD:
            expected_ns[record.namespace] += record.cost_micro_usd
    assert {l["group"]: l["cost_micro_usd"] for l in by_namespace["lines"] if l["kind"] == "pod"} == expected_ns

    code, by_team = report_json(capsys, ledger_url, "label:team")
    assert code == 0
    assert by_team["reconciliation"]["reconciled"] is True
    assert by_team["total_micro_usd"] == sum(bills.values())
    expected_team = defaultdict(int)
    for record in expected:
        if record.subject_kind is CostSubjectKind.POD:
            expected_team[record.labels.get("team", "(no team label)")] += record.cost_micro_usd
    assert {l["group"]: l["cost_micro_usd"] for l in by_team["lines"] if l["kind"] == "pod"} == expected_team


def set_database_open(postgres_url: str, ledger_url: str, is_open: bool) -> None:
    """Open or close the ledger's database to new connections; closing also ends the open ones (what clients
    see while PostgreSQL restarts: refused and broken connections)."""
    name = make_url(ledger_url).database
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {"true" if is_open else "false"}'))
            if not is_open:
                connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                        "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": name})
    finally:
        admin.dispose()


async def committed_offsets(settings, group: str, topic: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}


async def test_an_unavailable_ledger_holds_the_offsets_and_billing_resumes(kafka_settings, topic_catalog, group_id,
                                                                           postgres_url, ledger_url):
    first, second = sample_shares(2)[0::2], sample_shares(2)[1::2]  # both aws-node windows, then both gcp-node ones
    settings = BillingSettings(kafka=kafka_settings, ledger_url=ledger_url, consumer_group=group_id,
                               metrics_port=0, topic_partitions=3, ledger_retry_initial_seconds=0.2,
                               ledger_retry_max_seconds=1.0)
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop=stop))
    try:
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, first)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares,
                                          "before the outage")
        before = await committed_offsets(kafka_settings, group_id, topic_catalog.node_window_shares)
        costs_before = await end_offsets(kafka_settings, topic_catalog.costs)

        set_database_open(postgres_url, ledger_url, False)
        try:
            await produce_shares(kafka_settings, topic_catalog.node_window_shares, second)
            await asyncio.sleep(3.0)  # several retry rounds
            assert not service.done()
            assert await committed_offsets(kafka_settings, group_id, topic_catalog.node_window_shares) == before
            assert await end_offsets(kafka_settings, topic_catalog.costs) == costs_before
        finally:
            set_database_open(postgres_url, ledger_url, True)

        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares,
                                          "after the outage")
        costs = await read_topic(kafka_settings, topic_catalog.costs, CostRecord)
        bills, totals = ledger_state(ledger_url)
        assert len(bills) == len(first) + len(second)
        assert sums_by_node_window(costs) == bills
        catalog = PriceCatalog.load()
        expected = [c for shares in first + second for c in bill_node_window(shares, catalog).costs]
        assert sorted(costs, key=repr) == sorted(expected, key=repr)
    finally:
        stop.set()
        assert await asyncio.wait_for(service, WAIT_S) == 0
