"""``gpumeter guard``: the guard service. Reads its settings and the guard config once, prints the settings
(secrets masked), restores the engine from the state file, creates missing topics, and runs ``GuardService``
(plus the ``AlertmanagerSink`` when an Alertmanager URL is set) until SIGTERM/SIGINT or ``--duration``; all
behaviour lives in the modules it wires.

Exit codes: 0 after a clean stop, 1 when Kafka or the loop failed, 2 for unusable settings or guard config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any, Mapping

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.entrypoint import start_logging, stop_on
from gpumeter.health import DEFAULT_MAX_SILENCE_SECONDS
from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.producer import RecordProducer
from gpumeter.metrics import ServiceMetrics
from schemas.catalog import TopicCatalog
from services.guard.alertmanager import AlertmanagerSink
from services.guard.service import (
    GUARD_METRICS,
    SERVICE_NAME,
    GuardProcessor,
    GuardService,
    GuardState,
    GuardStateStore,
)
from services.guard.settings import GuardSettings, add_arguments, guard_settings

log = logging.getLogger("gpumeter.guard")

__all__ = ["add_arguments", "main", "serve"]


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = guard_settings(args, env)
        config = load_config(settings, env)
    except GpumeterError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    start_logging("guard", settings.log_level, settings.describe())
    try:
        return asyncio.run(serve(settings, config=config, handle_signals=True))
    except KeyboardInterrupt:
        return 0


def load_config(settings: GuardSettings, env: Mapping[str, str]) -> Any:
    """The guard config (``GuardConfig.load``) named by the settings; ``ConfigError`` when unusable."""
    from services.guard.config import GuardConfig

    return GuardConfig.load(settings.config_path, env)


def restore_engine(config: Any, store: GuardStateStore | None, clock: Clock) -> tuple[Any, GuardState | None]:
    """A ``GuardEngine`` from the state file when there is a usable one (and that state), else a fresh engine.
    A file that cannot be read back or restored is moved aside and the guard starts without state (logged as an
    error); the service then rebuilds from the violations topic before it raises anything
    (``GuardService``)."""
    from services.guard.engine import GuardEngine

    if store is None:
        log.warning("no state file configured: a restart forgets hold-downs and timers and re-reads pod events")
        return GuardEngine(config), None
    try:
        state = store.load()
        if state is None:
            log.info("no state file at %s yet: starting fresh", store.path)
            return GuardEngine(config), None
        engine = GuardEngine.restore(config, state.engine_bytes)
    except GpumeterError as exc:  # GuardStateError (the file) or InvalidMessage (the engine's snapshot)
        moved = store.move_aside(clock.now_ms())
        log.error("state file %s unusable (%s); moved to %s, starting fresh", store.path, exc, moved)
        return GuardEngine(config), None
    log.info("restored the guard state saved at %d (%d positions, %d firing)", state.saved_at_unix_ms,
             len(state.positions), len(tuple(engine.active())))
    return engine, state


async def serve(settings: GuardSettings, *, config: Any = None, env: Mapping[str, str] | None = None,
                stop: asyncio.Event | None = None, clock: Clock | None = None, handle_signals: bool = False) -> int:
    """Run the guard until ``stop`` is set (or SIGTERM/SIGINT with ``handle_signals``, or
    ``settings.duration_seconds``). ``config`` defaults to ``GuardConfig.load(settings.config_path, env)``.
    Returns the exit code."""
    stop = stop or asyncio.Event()
    clock = clock or SystemClock()
    stop_on(stop, handle_signals=handle_signals, duration_seconds=settings.duration_seconds)
    try:
        if config is None:
            config = load_config(settings, env or {})
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    store = GuardStateStore(settings.state_path) if settings.state_path is not None else None
    producer: RecordProducer | None = None
    sink: AlertmanagerSink | None = None
    sink_stop = asyncio.Event()
    sink_task: asyncio.Task | None = None
    try:
        engine, state = restore_engine(config, store, clock)
        topics = TopicCatalog(prefix=settings.kafka.topic_prefix, partitions_override=settings.topic_partitions)
        for result in await create_topics(settings.kafka, topics):
            if result.created:
                log.info("created topic %s (%d partitions)", result.name, result.partitions)
        # Liveness: a beat per fetch and per retry pause; the longest pause must not read as a stuck loop.
        metrics = ServiceMetrics(SERVICE_NAME, GUARD_METRICS, clock=clock, max_silence_seconds=max(
            DEFAULT_MAX_SILENCE_SECONDS, 2 * settings.retry_max_seconds))
        metrics.serve(settings.metrics_port, settings.metrics_address)
        producer = RecordProducer(settings.kafka)
        await producer.start()
        if settings.alertmanager_url:
            sink = AlertmanagerSink(settings.alertmanager_url, settings.alertmanager_timeout_seconds, clock=clock,
                                    resend_interval_s=settings.alertmanager_resend_seconds,
                                    lease_s=settings.alertmanager_lease_seconds,
                                    generator_url=settings.external_url)
            await sink.start()
            sink.update(engine.active())  # renew the leases of what the restored state holds firing
            sink_task = asyncio.create_task(sink.run(sink_stop))
        processor = GuardProcessor(
            engine=engine,
            producer=producer,
            topics=topics,
            clock=clock,
            sink=sink,
            metrics=metrics,
            retry_initial_seconds=settings.retry_initial_seconds,
            retry_max_seconds=settings.retry_max_seconds,
            positions=state.positions if state is not None else None,
            max_clock_skew_seconds=settings.max_clock_skew_seconds,
            max_sample_age_seconds=settings.max_sample_age_seconds,
            max_request_size_bytes=settings.kafka.max_request_size_bytes,
        )
        service = GuardService(
            kafka=settings.kafka,
            topics=topics,
            processor=processor,
            consumer_group=settings.consumer_group,
            store=store,
            restored=state is not None,
            auto_offset_reset=settings.auto_offset_reset,
            snapshot_interval_seconds=settings.snapshot_interval_seconds,
            clock_interval_seconds=settings.clock_interval_seconds,
            max_poll_records=settings.max_poll_records,
        )
        log.info("guarding %s as group %s%s", ", ".join(processor.input_topics), settings.consumer_group,
                 f", alerts to {sink.endpoint}" if sink else "")
        await service.run(stop)
        stats = processor.stats
        log.info("stopped: %d messages, %d violations published (%d state changes), %d dead-lettered, "
                 "%d snapshots, %d commits", stats.messages, stats.violations_published, stats.transitions,
                 processor.guard.dead_lettered, service.snapshots, service.commits)
        return 0
    except GpumeterError as exc:
        log.error("guard failed: %s", exc)
        return 1
    finally:
        if sink is not None:
            sink_stop.set()
            if sink_task is not None:
                try:
                    await sink_task
                except Exception as exc:
                    log.warning("Alertmanager sink: %r", exc)
            await sink.close()
        if producer is not None:
            try:
                await producer.stop()
            except GpumeterError as exc:
                log.warning("closing the producer: %s", exc)
