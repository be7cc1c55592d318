"""``gpumeter billing``: the billing service. Reads its settings once, prints them (secrets masked), migrates the
ledger, creates missing topics, and runs ``BillingProcessor`` with its ``LedgerStore`` on the one runner
(``MessageRunner`` in a ``KafkaDriver`` consumer group) until SIGTERM/SIGINT or ``--duration``; all behaviour lives
in the modules it wires.

A SQLite file ledger takes one billing process: billing holds ``<ledger>.billing.lock`` from before it migrates
until it exits (``services.billing.ledger_lock``) and a second one on the same file is refused at start.

Exit codes: 0 after a clean stop, 1 when Kafka, the ledger or the loop failed, 2 for unusable settings (also: the
SQLite ledger is held by another billing).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Mapping

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.entrypoint import start_logging, stop_on, tune_garbage_collector
from gpumeter.health import DEFAULT_MAX_SILENCE_SECONDS
from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.driver import KafkaDriver
from gpumeter.kafka.producer import RecordProducer
from gpumeter.metrics import ServiceMetrics
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import TopicCatalog
from services.billing.ledger import Ledger, LedgerError, abandoned_ledgers
from services.billing.ledger_lock import BillingLock, LedgerInUse
from services.billing.service import (
    BILLING_METRICS,
    SERVICE_NAME,
    BillingProcessor,
    LedgerStore,
    billing_inputs,
    billing_outputs,
    is_transient_ledger_error,
    next_backoff_seconds,
)
from services.billing.settings import BillingSettings, add_arguments, billing_settings

log = logging.getLogger("gpumeter.billing")

__all__ = ["add_arguments", "main", "serve"]


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = billing_settings(args, env)
    except GpumeterError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    start_logging("billing", settings.log_level, settings.describe())
    tune_garbage_collector()
    try:
        code = asyncio.run(serve(settings, handle_signals=True))
    except KeyboardInterrupt:
        code = 0
    if abandoned_ledgers():
        # Finalising the interpreter would close the ledger's connections, and closing writes the WAL index of a
        # -shm that can no longer back it: SIGBUS. Committed windows are in the WAL; the next start reads them.
        log.error("exiting without closing the ledger: %s", "; ".join(abandoned_ledgers()))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def _migrate(ledger: Ledger, settings: BillingSettings, stop: asyncio.Event,
                   lock: BillingLock | None = None) -> str | None:
    """Take ``lock`` (a SQLite file's) and migrate the ledger, waiting (with backoff) while the database cannot be
    reached; None if stopped first. ``LedgerInUse`` when another billing holds the lock."""
    delay = settings.ledger_retry_initial_seconds
    while not stop.is_set():
        try:
            if lock is not None:
                lock.acquire()
            return await asyncio.to_thread(ledger.migrate)
        except LedgerError as exc:
            if not is_transient_ledger_error(exc):
                raise
            log.warning("ledger unavailable, migrating again in %.1f s: %s", delay, exc)
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = next_backoff_seconds(delay, settings.ledger_retry_max_seconds)
    return None


# How often billing makes sure the partitions of the days ahead exist (PostgreSQL; ``services.billing.partitions``).
PARTITIONS_EVERY_SECONDS = 3600.0


async def _keep_partitions_ahead(ledger: Ledger, clock: Clock, stop: asyncio.Event) -> None:
    """Create the partitions of the days ahead with billing's clock, hourly until ``stop`` (a no-op on SQLite).
    A failure is logged and tried again at the next hour: a write still creates the partition it needs."""
    while not stop.is_set():
        try:
            created = await asyncio.to_thread(ledger.ensure_partitions, clock.now_ms())
            if created:
                log.info("created %d ledger partitions ahead", created)
        except LedgerError as exc:
            log.warning("creating the ledger's partitions ahead failed (a write creates the one it needs): %s", exc)
        try:
            await asyncio.wait_for(stop.wait(), PARTITIONS_EVERY_SECONDS)
        except asyncio.TimeoutError:
            pass


async def serve(settings: BillingSettings, *, stop: asyncio.Event | None = None, clock: Clock | None = None,
                handle_signals: bool = False) -> int:
    """Run the billing service until ``stop`` is set (or SIGTERM/SIGINT with ``handle_signals``, or
    ``settings.duration_seconds``). Returns the exit code."""
    stop = stop or asyncio.Event()
    clock = clock or SystemClock()
    stop_on(stop, handle_signals=handle_signals, duration_seconds=settings.duration_seconds)
    try:
        catalog = settings.price_catalog()
        # The ledger is the arbiter of who publishes a node-window's cost records: the group whose write inserted it.
        ledger = Ledger(settings.ledger_url, publisher=settings.consumer_group, team_label=settings.team_label)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except LedgerError as exc:
        log.error("%s", exc)
        return 2
    # One billing per SQLite file (services.billing.ledger_lock); PostgreSQL takes several.
    lock = None if ledger.sqlite_file is None else BillingLock(
        ledger.sqlite_file, holder=f"pid {os.getpid()} on {socket.gethostname()}, group {settings.consumer_group}")
    producer: RecordProducer | None = None
    try:
        try:
            revision = await _migrate(ledger, settings, stop, lock)
        except LedgerInUse as exc:
            log.error("refusing to start: %s", exc)
            return 2
        if revision is None:
            return 0
        log.info("ledger %r at schema revision %s", ledger, revision)
        topics = TopicCatalog(prefix=settings.kafka.topic_prefix, partitions_override=settings.topic_partitions)
        for result in await create_topics(settings.kafka, topics):
            if result.created:
                log.info("created topic %s (%d partitions)", result.name, result.partitions)
        # Liveness: a beat per fetch and per retry pause; the longest pause must not read as a stuck loop.
        metrics = ServiceMetrics(SERVICE_NAME, BILLING_METRICS, clock=clock, max_silence_seconds=max(
            DEFAULT_MAX_SILENCE_SECONDS, 2 * settings.ledger_retry_max_seconds), dead_letters=settings.dead_letters)
        metrics.serve(settings.metrics_port, settings.metrics_address)
        producer = RecordProducer(settings.kafka)
        await producer.start()
        processor = BillingProcessor(catalog=catalog, policy=settings.split_policy, sharing=settings.sharing,
                                     max_clock_skew_seconds=settings.max_clock_skew_seconds)
        store = LedgerStore(ledger, metrics=metrics, team_label=settings.team_label,
                            series_memory_seconds=settings.series_memory_seconds)
        runner = MessageRunner(processor, billing_inputs(topics), clock, metrics=metrics,
                               max_request_size_bytes=settings.kafka.max_request_size_bytes)
        driver = KafkaDriver(
            runner,
            kafka=settings.kafka,
            outputs=billing_outputs(topics),
            producer=producer,
            clock=clock,
            consumer_group=settings.consumer_group,
            store=store,
            metrics=metrics,
            auto_offset_reset=settings.auto_offset_reset,
            retry_initial_seconds=settings.ledger_retry_initial_seconds,
            retry_max_seconds=settings.ledger_retry_max_seconds,
            max_poll_records=settings.max_poll_records,
            max_poll_interval_seconds=settings.max_poll_interval_seconds,
        )
        log.info("billing %s as group %s", topics.node_window_shares, settings.consumer_group)
        partitions_ahead = asyncio.create_task(_keep_partitions_ahead(ledger, clock, stop))
        try:
            await driver.run(stop)
        finally:
            stop.set()
            await partitions_ahead
        stats = store.stats
        log.info("stopped: %d node-windows billed, %d already in the ledger, %d republished, %d dead-lettered, "
                 "%d refused by the ledger, %d cost records, %d ledger retries, %d commits", stats.windows_billed,
                 stats.windows_already_billed, stats.windows_republished, runner.dead_lettered,
                 stats.windows_rejected_by_ledger, stats.cost_records_owed, driver.store_retries, driver.commits)
        return 0
    except GpumeterError as exc:
        log.error("billing failed: %s", exc)
        return 1
    finally:
        if producer is not None:
            try:
                await producer.stop()
            except GpumeterError as exc:
                log.warning("closing the producer: %s", exc)
        if not ledger.close():
            # The lock stays held with the connections left open; the process's exit drops both.
            log.error("the ledger's files cannot be used safely; its connections are left open: %s",
                      abandoned_ledgers()[-1])
        elif lock is not None:
            lock.release()
