"""``gpumeter guard``: the guard service. Reads its settings and the guard config once, prints the settings
(secrets masked), restores the engine from the state file, creates missing topics, and runs the
``GuardProcessor`` (``services/guard/processor.py``) on the one runner (``MessageRunner`` over ``KafkaDriver``,
plus the ``AlertmanagerSink`` when an Alertmanager URL is set) until SIGTERM/SIGINT or ``--duration``; all
behaviour lives in the modules it wires.

Roles (``--role``, ``GuardSettings.role``): ``all`` and ``budgets`` run one ``GuardProcessor`` whose driver reads
every partition of its inputs itself (``assignment="all"``; the group only stores offsets) -- ``all`` the four
node-keyed topics with every rule, ``budgets`` the cost lines with ``budget_exceeded`` only: one replica each.
``nodes`` runs a ``NodeGuardProcessor`` (``services/guard/nodes.py``: every rule but budgets, one engine per
partition) as a member of the consumer group (``assignment="group"``, ``co_partitioned``: partition ``p`` of the
four topics goes to one member), so that every replica takes a share of the nodes: on assignment it reads the
violations topic (``read_last_states``) and rebuilds the partitions it did not hold, pod events from the
beginning and the rest from the group's commits, publishing nothing of them until it has read as far as they
reached at the assignment (``on_read_to_start``); on revocation it flushes, commits and suspends their engines.
It commits after every batch and keeps no state file. ``all``/``budgets``, start positions: those of the state
file (a partition it has no position for is read from its beginning: the state covers none of it). Without a state
file (first start, none configured, or an unreadable one moved aside -- as is another guard's: one written by
another role or covering other input topics, ``check_state``; a file that records no role is the ``all`` role's)
the guard first reads the compacted violations topic whole (``read_last_states``) and seeds its engine with it
(``GuardProcessor.begin_rebuild``), reads pod events from the beginning of their compacted topic -- the rules need
every live pod -- and the other topics from the group's committed offsets (else ``auto_offset_reset``); it emits
no violation until it has read as far as the input reached when it started (the driver's ``on_read_to_start``:
``finish_rebuild``). Checkpoints (``StateCheckpoint``): every ``snapshot_interval_seconds`` and at stop, once
every record produced is acknowledged, the state file is written with the positions it covers, then those are
committed. The clock rules run every ``clock_interval_seconds`` with the driver's ``caught_up``. Every violation
emitted is handed to the Alertmanager sink (``on_emitted``). Bad input is dead-lettered by the runner.

Failures: Kafka not acknowledging produced violations → re-sent with backoff (``gpumeter.kafka.outbox``; only the
newest record of a fingerprint, so a stale state never overwrites a newer one) while nothing is snapshotted or
committed; Alertmanager unreachable → its alerts stay pending in the sink, consumption goes on.

Exit codes: 0 after a clean stop, 1 when Kafka or the loop failed, 2 for unusable settings or guard config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any, Iterable, Mapping, Sequence

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.entrypoint import start_logging, stop_on, tune_garbage_collector
from gpumeter.health import DEFAULT_MAX_SILENCE_SECONDS
from gpumeter.kafka.admin import create_topics
from gpumeter.kafka.driver import KafkaDriver
from gpumeter.kafka.processor import ConsumerUnavailable
from gpumeter.kafka.producer import RecordProducer
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings
from gpumeter.stream.contract import Emit
from gpumeter.stream.runner import MessageRunner
from schemas.catalog import TopicCatalog
from schemas.records import Violation
from services.guard.alertmanager import AlertmanagerSink
from services.guard.nodes import NodeGuardProcessor
from services.guard.processor import (
    GUARD_METRICS,
    ROLE_NODES,
    SERVICE_NAME,
    VIOLATIONS,
    GuardProcessor,
    engine_options,
    guard_outputs,
    guard_topics,
)
from services.guard.settings import GuardSettings, add_arguments, guard_settings
from services.guard.state import GuardState, GuardStateMismatch, GuardStateStore, StateCheckpoint, check_state

log = logging.getLogger("gpumeter.guard")

REBUILD_READ_TIMEOUT_S = 300.0  # reading the compacted violations topic whole at a start without state

__all__ = ["add_arguments", "main", "serve"]


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = guard_settings(args, env)
        config = load_config(settings, env)
    except GpumeterError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    start_logging("guard", settings.log_level, settings.describe())
    tune_garbage_collector()
    try:
        return asyncio.run(serve(settings, config=config, handle_signals=True))
    except KeyboardInterrupt:
        return 0


def load_config(settings: GuardSettings, env: Mapping[str, str]) -> Any:
    """The guard config (``GuardConfig.load``) named by the settings; ``ConfigError`` when unusable."""
    from services.guard.config import GuardConfig

    return GuardConfig.load(settings.config_path, env)


def restore_engine(config: Any, store: GuardStateStore | None, clock: Clock, *, role: str,
                   topics: Iterable[str]) -> tuple[Any, GuardState | None]:
    """A ``GuardEngine`` from the state file when there is a usable one (and that state), else a fresh engine.
    ``role`` and ``topics``: the role of this guard and the input topics it reads; a state file another role
    wrote or covering other topics (``check_state``: ``GuardStateMismatch``) is not this guard's state. A file that
    cannot be read back or restored, or is not this guard's, is moved aside (``<name>.corrupt-<ms>``, or
    ``<name>.foreign-<ms>`` for another guard's) and the guard starts without state (logged as an error); the
    service then rebuilds from the violations topic before it raises anything (see the module docstring)."""
    from services.guard.engine import GuardEngine

    if store is None:
        log.warning("no state file configured: a restart forgets hold-downs and timers and re-reads pod events")
        return GuardEngine(config, **engine_options(role)), None
    try:
        state = store.load()
        if state is None:
            log.info("no state file at %s yet: starting fresh", store.path)
            return GuardEngine(config, **engine_options(role)), None
        check_state(state, role, topics)
        engine = GuardEngine.restore(config, state.engine_bytes, **engine_options(role))
    except GuardStateMismatch as exc:
        moved = store.move_aside(clock.now_ms(), "foreign")
        log.error("state file %s is not this %s guard's: %s; moved to %s, starting without state (is another "
                  "guard configured with the same state path, or was --role changed?)", store.path, role, exc, moved)
        return GuardEngine(config, **engine_options(role)), None
    except GpumeterError as exc:  # GuardStateError (the file) or InvalidMessage (the engine's snapshot)
        moved = store.move_aside(clock.now_ms())
        log.error("state file %s unusable (%s); moved to %s, starting fresh", store.path, exc, moved)
        return GuardEngine(config, **engine_options(role)), None
    log.info("restored the guard state saved at %d (%d positions, %d firing)", state.saved_at_unix_ms,
             len(state.positions), len(tuple(engine.active())))
    return engine, state


async def read_last_states(kafka: KafkaSettings, topic: str) -> tuple[Violation, ...]:
    """The last state of every fingerprint on the compacted violations ``topic`` (what a guard without state
    rebuilds from); ``ConsumerUnavailable`` when it cannot be read whole within ``REBUILD_READ_TIMEOUT_S``."""
    from services.guard.violations_cli import ViolationsReadError, read_violations

    try:
        view = await read_violations(kafka, topic, timeout_s=REBUILD_READ_TIMEOUT_S)
    except ViolationsReadError as exc:
        raise ConsumerUnavailable(f"cannot rebuild from {topic}: {exc}") from exc
    if view.undecodable:
        log.warning("%d records on %s are no Violation: ignored", view.undecodable, topic)
    return tuple(view.violations)


async def co_partition_count(kafka: KafkaSettings, topics: TopicCatalog) -> int:
    """The partition count the node-keyed input topics share (the ``nodes`` role maps nodes to partitions with it);
    ``ConfigError`` when they differ (a node's samples and pods would land with different members),
    ``ConsumerUnavailable`` when the broker cannot tell."""
    from gpumeter.kafka.admin import partition_numbers

    names = tuple(guard_topics(topics, ROLE_NODES).values())
    try:
        known = await partition_numbers(kafka, names)
    except Exception as exc:  # KafkaError, OSError, TimeoutError: the broker is not there
        raise ConsumerUnavailable(f"cannot read the partitions of {', '.join(names)}: {exc!r}") from exc
    counts = {name: len(known.get(name, ())) for name in names}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise ConfigError(f"the guard's nodes role needs its input topics co-partitioned (equal partition counts, "
                          f"keyed by node name): {counts}")
    return next(iter(counts.values()))


def rebuild_assigned(processor: NodeGuardProcessor, kafka: KafkaSettings, violations_topic: str, *,
                     retry_initial_seconds: float = 0.5, retry_max_seconds: float = 30.0):
    """The driver's ``on_assigned`` for the ``nodes`` role: partitions to rebuild get the violations topic's last
    states (read once per assignment, and only when some partition is not resumed). A topic that cannot be read is
    read again with backoff until it can: rebuilt without it, a moved violation would fire again."""

    async def on_assigned(tps: set[tuple[str, int]]) -> None:
        partitions = {p for _, p in tps}
        states: tuple[Violation, ...] = ()
        delay = retry_initial_seconds
        while processor.to_rebuild(partitions):
            try:
                states = await read_last_states(kafka, violations_topic)
                break
            except ConsumerUnavailable as exc:
                log.warning("rebuilding partitions %s: %s; reading it again in %.1f s", sorted(partitions), exc,
                            delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, retry_max_seconds)
        processor.adopt(partitions, states)

    return on_assigned


def alert_on_emitted(sink: AlertmanagerSink):
    """The driver's ``on_emitted`` for ``sink``: every violation emitted (refreshes included) goes to the sink."""

    def on_emitted(emits: Sequence[Emit]) -> None:
        violations = [emit.record for emit in emits if emit.output == VIOLATIONS]
        if violations:
            sink.update(violations)

    return on_emitted


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
        topics = TopicCatalog(prefix=settings.kafka.topic_prefix, partitions_override=settings.topic_partitions)
        inputs = tuple(guard_topics(topics, settings.role).values())
        engine, state = (restore_engine(config, store, clock, role=settings.role, topics=inputs)
                         if settings.role != ROLE_NODES else (None, None))
        for result in await create_topics(settings.kafka, topics):
            if result.created:
                log.info("created topic %s (%d partitions)", result.name, result.partitions)
        # Liveness: a beat per fetch and per retry pause; the longest pause must not read as a stuck loop.
        metrics = ServiceMetrics(SERVICE_NAME, GUARD_METRICS, clock=clock, max_silence_seconds=max(
            DEFAULT_MAX_SILENCE_SECONDS, 2 * settings.retry_max_seconds), dead_letters=settings.dead_letters)
        metrics.serve(settings.metrics_port, settings.metrics_address)
        producer = RecordProducer(settings.kafka)
        await producer.start()
        if settings.role == ROLE_NODES:
            processor = NodeGuardProcessor(config, clock, partitions=await co_partition_count(settings.kafka, topics),
                                           metrics=metrics, max_clock_skew_seconds=settings.max_clock_skew_seconds,
                                           max_sample_age_seconds=settings.max_sample_age_seconds)
        else:
            processor = GuardProcessor(config, clock, engine=engine, metrics=metrics,
                                       max_clock_skew_seconds=settings.max_clock_skew_seconds,
                                       max_sample_age_seconds=settings.max_sample_age_seconds, role=settings.role)
            if state is None:
                processor.begin_rebuild(await read_last_states(settings.kafka, topics.violations))
        if settings.alertmanager_url:
            sink = AlertmanagerSink(settings.alertmanager_url, settings.alertmanager_timeout_seconds, clock=clock,
                                    resend_interval_s=settings.alertmanager_resend_seconds,
                                    lease_s=settings.alertmanager_lease_seconds,
                                    generator_url=settings.external_url)
            await sink.start()
            # Renew the leases of what the restored state, or the violations topic, holds firing.
            sink.update(processor.active() if settings.role == ROLE_NODES else processor.engine.active())
            sink_task = asyncio.create_task(sink.run(sink_stop))
        runner = MessageRunner(processor, guard_topics(topics, settings.role), clock, metrics=metrics,
                               max_request_size_bytes=settings.kafka.max_request_size_bytes)
        common = dict(kafka=settings.kafka, outputs=guard_outputs(topics), producer=producer, clock=clock,
                      consumer_group=settings.group_id, metrics=metrics, auto_offset_reset=settings.auto_offset_reset,
                      tick_seconds=settings.clock_interval_seconds,
                      on_emitted=alert_on_emitted(sink) if sink is not None else None,
                      retry_initial_seconds=settings.retry_initial_seconds,
                      retry_max_seconds=settings.retry_max_seconds, max_poll_records=settings.max_poll_records)
        checkpoint: StateCheckpoint | None = None
        if settings.role == ROLE_NODES:
            driver = KafkaDriver(
                runner, assignment="group", co_partitioned=True,
                # An assigned partition is rebuilt: the rules need every live pod of its nodes.
                from_beginning=(topics.pod_events,),
                on_assigned=rebuild_assigned(processor, settings.kafka, topics.violations,
                                             retry_initial_seconds=settings.retry_initial_seconds,
                                             retry_max_seconds=settings.retry_max_seconds),
                on_read_to_start=processor.finish_rebuild, **common)
        else:
            checkpoint = StateCheckpoint(processor, store, clock, topics=inputs)
            driver = KafkaDriver(
                runner, assignment="all", start_positions=state.positions if state is not None else None,
                # Restored: a partition the state has no position for is covered by none of it. Without state: the
                # rules need every live pod.
                from_beginning=(tuple(runner.inputs.by_topic) if state is not None
                                else tuple(t for t in (topics.pod_events,) if t in runner.inputs.by_topic)),
                checkpoint=checkpoint, checkpoint_interval_seconds=settings.snapshot_interval_seconds,
                on_read_to_start=processor.finish_rebuild if processor.rebuilding else None, **common)
        log.info("guarding %s as %s of group %s (%s)%s", ", ".join(driver.input_topics), settings.role,
                 settings.group_id,
                 "partitions as assigned" if settings.role == ROLE_NODES else
                 "positions from the state file" if state is not None else "no state file: rebuilt from the topics",
                 f", alerts to {sink.endpoint}" if sink else "")
        await driver.run(stop)
        stats = processor.stats
        log.info("stopped: %d messages, %d violations published, %d dead-lettered, %d snapshots, %d commits",
                 runner.consumed, stats.violations_emitted, runner.dead_lettered,
                 checkpoint.snapshots if checkpoint is not None else 0, driver.commits)
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
