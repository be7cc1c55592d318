"""``gpumeter record --out DIR``: the live input topics (node samples, pod events) into rotating recordings, so that
history can be replayed (``gpumeter replay DIR``) after Kafka's retention dropped it.

Wiring only: the ``RecorderProcessor`` (``pipeline/recorder.py``: rotation, pod-state snapshots) runs on the one
runner under the ``KafkaDriver``, reading every partition of the two topics itself (``assignment="all"``: one
recorder per directory; its consumer group, ``--group``, only stores its offsets), and its changes go to a
``RecordingDirectory`` (``pipeline/recording_store.py``: the files). The runner hands the processor each message's
bytes undecoded (its inputs' record type is ``bytes``), so a recording holds exactly what the topics carried, bad
messages included (replay dead-letters them as the stream does).

Start (``--from``): ``committed`` (default) -- the group's committed offsets, else the topics' beginning;
``earliest`` -- the topics' beginning whatever the group committed; ``latest`` -- the group's committed offsets,
else only what arrives from now. Checkpoints: every ``--sync-interval`` seconds and at stop, the open file is
synced (compressed member ended, flushed, fsynced) and only then are the offsets read so far committed; a rotation
fsyncs the finished file before its name appears. The clock (the driver's ticks, every sync interval) closes a file
``--close-grace`` seconds after its hour ends when nothing newer arrives.

Exit codes: 0 after a clean stop, 1 when Kafka or the loop failed, 2 for unusable settings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from gpumeter import config
from gpumeter.clock import Clock, SystemClock
from gpumeter.config import (
    at_least,
    between,
    describe,
    greater_than,
    integer,
    load,
    nested,
    non_empty,
    number,
    one_of,
    path,
    setting,
    settings_repr,
    validate,
)
from gpumeter.entrypoint import start_logging, stop_on
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.kafka.driver import KafkaDriver
from gpumeter.health import DEFAULT_MAX_SILENCE_SECONDS
from gpumeter.metrics import ServiceMetrics
from gpumeter.settings import KafkaSettings, metrics_address_setting
from gpumeter.stream.runner import MessageRunner
from pipeline.recorder import (
    DEFAULT_CLOSE_GRACE_SECONDS,
    DEFAULT_ROTATION_SECONDS,
    POD_EVENTS,
    SAMPLES,
    RecorderProcessor,
)
from pipeline.recording_store import RecordingDirectory
from schemas.catalog import TopicCatalog

log = logging.getLogger("gpumeter.record")

DEFAULT_CONSUMER_GROUP = "gpumeter-record"
DEFAULT_SYNC_INTERVAL_SECONDS = 10.0
DEFAULT_METRICS_PORT = 9406
SERVICE_NAME = "record"
# What /metrics shows (gpumeter.metrics.METRICS): the runner's and the driver's, and the recordings' own.
RECORD_METRICS = (
    "gpumeter_messages_consumed_total",
    "gpumeter_dead_letters_total",
    "gpumeter_dead_letters_truncated_total",
    "gpumeter_record_frames_total",
    "gpumeter_record_payload_bytes_total",
    "gpumeter_record_files_finished_total",
    "gpumeter_record_syncs_total",
)


@dataclass(frozen=True)
class RecordSettings:
    """Everything ``gpumeter record`` needs, validated once.

    * ``out_dir``: the directory of recordings (created if missing); one recorder per directory.
    * ``consumer_group``: the group its offsets are committed under (lag monitoring; where a restart resumes).
    * ``start``: ``committed`` | ``earliest`` | ``latest`` (see the module docstring).
    * ``rotation_seconds``: one file per this much received time (default an hour), aligned to the epoch (UTC).
    * ``close_grace_seconds``: a file is closed this long after its period ends when nothing newer arrived.
    * ``sync_interval_seconds``: the longest time between fsyncs of the open file, each followed by a commit of
      the offsets it covers (what a crash makes the recorder read again, at most).
    * ``compression``: ``gzip`` (default: fast to write and to replay, ``zcat``-able), ``lzma`` (xz: smaller,
      several times slower to write) or ``none``.
    """

    out_dir: Path = setting(env="GPUMETER_RECORD_DIR", flag="--out", parse=path, metavar="DIR",
                            help="directory of the recordings")
    kafka: KafkaSettings = nested(KafkaSettings, client_id="gpumeter-record")
    consumer_group: str = setting(DEFAULT_CONSUMER_GROUP, env="GPUMETER_RECORD_CONSUMER_GROUP", flag="--group",
                                  check=non_empty, help="consumer group its offsets are committed under")
    start: str = setting("committed", env="GPUMETER_RECORD_START", flag="--from",
                         check=one_of("committed", "earliest", "latest"),
                         help="committed (else the beginning) | earliest | latest (committed, else from now)")
    rotation_seconds: int = setting(DEFAULT_ROTATION_SECONDS, env="GPUMETER_RECORD_ROTATION_SECONDS",
                                    flag="--rotation-seconds", parse=integer, check=at_least(1),
                                    help="seconds of received time per file")
    close_grace_seconds: int = setting(DEFAULT_CLOSE_GRACE_SECONDS, env="GPUMETER_RECORD_CLOSE_GRACE_SECONDS",
                                       flag="--close-grace", parse=integer, check=at_least(0),
                                       help="seconds after its period a quiet file is closed")
    sync_interval_seconds: float = setting(DEFAULT_SYNC_INTERVAL_SECONDS, env="GPUMETER_RECORD_SYNC_INTERVAL_SECONDS",
                                           flag="--sync-interval", parse=number, check=greater_than(0),
                                           help="seconds between fsync + offset commit")
    compression: str = setting("gzip", env="GPUMETER_RECORD_COMPRESSION", flag="--compression",
                               check=one_of("gzip", "lzma", "none"), help="gzip | lzma | none")
    retry_initial_seconds: float = setting(0.5, env="GPUMETER_RECORD_RETRY_INITIAL_SECONDS", parse=number,
                                           help="first pause while the broker cannot be reached")
    retry_max_seconds: float = setting(30.0, env="GPUMETER_RECORD_RETRY_MAX_SECONDS", parse=number,
                                       help="longest pause while the broker cannot be reached")
    max_poll_records: int = setting(2000, env="GPUMETER_RECORD_MAX_POLL_RECORDS", parse=integer, check=at_least(1),
                                    help="records per consumer poll")
    metrics_port: int = setting(DEFAULT_METRICS_PORT, env="GPUMETER_METRICS_PORT", flag="--metrics-port",
                                parse=integer, check=between(0, 65535),
                                help="port of /metrics and /healthz (0: none)")
    metrics_address: str = metrics_address_setting()
    duration_seconds: float | None = setting(None, flag="--duration", parse=number, check=greater_than(0),
                                             help="stop after this many seconds", default_text="until SIGTERM/SIGINT")
    log_level: str = setting("INFO", env="GPUMETER_LOG_LEVEL", flag="--log-level",
                             help="DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self) -> None:
        validate(self)
        if not (0 < self.retry_initial_seconds <= self.retry_max_seconds):
            raise ConfigError("retry backoff needs 0 < initial <= max seconds")

    def __repr__(self) -> str:
        return settings_repr(self)

    def describe(self) -> dict[str, Any]:
        return describe(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser, RecordSettings)


def record_settings(args: argparse.Namespace, env: Mapping[str, str]) -> RecordSettings:
    """The settings ``gpumeter record`` runs with: flags over environment over defaults."""
    return load(RecordSettings, args, env)


def recorder_topics(topics: TopicCatalog) -> dict[str, str]:
    """The recorder's input roles -> topic names."""
    return {SAMPLES: topics.node_samples, POD_EVENTS: topics.pod_events}


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = record_settings(args, env)
    except GpumeterError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    start_logging("record", settings.log_level, settings.describe())
    try:
        return asyncio.run(serve(settings, handle_signals=True))
    except KeyboardInterrupt:
        return 0


async def serve(settings: RecordSettings, *, stop: asyncio.Event | None = None, clock: Clock | None = None,
                handle_signals: bool = False) -> int:
    """Record until ``stop`` is set (or SIGTERM/SIGINT with ``handle_signals``, or ``settings.duration_seconds``);
    the open file is finished at stop. Returns the exit code."""
    stop = stop or asyncio.Event()
    clock = clock or SystemClock()
    stop_on(stop, handle_signals=handle_signals, duration_seconds=settings.duration_seconds)
    metrics: ServiceMetrics | None = None
    if settings.metrics_port:
        # Liveness: a beat per fetch and per retry pause; the longest pause must not read as a stuck loop.
        metrics = ServiceMetrics(SERVICE_NAME, RECORD_METRICS, clock=clock, max_silence_seconds=max(
            DEFAULT_MAX_SILENCE_SECONDS, 2 * settings.retry_max_seconds))
        metrics.serve(settings.metrics_port, settings.metrics_address)
    directory = RecordingDirectory(settings.out_dir, compression=settings.compression, metrics=metrics)
    processor: RecorderProcessor | None = None
    try:
        pods, last_bucket = directory.recover()
        processor = RecorderProcessor(rotation_seconds=settings.rotation_seconds,
                                      close_grace_seconds=settings.close_grace_seconds, pods=pods,
                                      last_bucket_unix_ms=last_bucket)
        topics = TopicCatalog(prefix=settings.kafka.topic_prefix)
        runner = MessageRunner(processor, recorder_topics(topics), clock, metrics=metrics,
                               max_request_size_bytes=settings.kafka.max_request_size_bytes)

        async def checkpoint(positions: Mapping[tuple[str, int], int]) -> Mapping[tuple[str, int], int]:
            # Durable first, then committed: a crash never leaves a commit past a frame not on disk.
            await asyncio.to_thread(directory.sync)
            return positions

        driver = KafkaDriver(
            runner, kafka=settings.kafka, outputs={}, producer=None, clock=clock,
            consumer_group=settings.consumer_group, store=directory, assignment="all",
            from_beginning=tuple(runner.inputs.by_topic) if settings.start == "earliest" else (),
            auto_offset_reset="latest" if settings.start == "latest" else "earliest",
            checkpoint=checkpoint, checkpoint_interval_seconds=settings.sync_interval_seconds,
            tick_seconds=min(settings.sync_interval_seconds, 5.0),
            retry_initial_seconds=settings.retry_initial_seconds, retry_max_seconds=settings.retry_max_seconds,
            max_poll_records=settings.max_poll_records, metrics=metrics)
        log.info("recording %s into %s (%s, %d s per file, %d pods known from the last file)",
                 ", ".join(driver.input_topics), settings.out_dir, settings.compression, settings.rotation_seconds,
                 len(pods))
        await driver.run(stop)
        log.info("stopped: %d frames in %d files opened, %d commits", processor.frames, processor.files_opened,
                 driver.commits)
        return 0
    except GpumeterError as exc:
        log.error("record failed: %s", exc)
        return 1
    finally:
        # The last commit (the driver's final checkpoint) came after a sync; closing only ends the file cleanly.
        if processor is not None:
            directory.apply(processor.close().changes)
        directory.close()
        if metrics is not None and metrics.server is not None:
            metrics.server.shutdown()
            metrics.server.server_close()


__all__ = ["RecordSettings", "add_arguments", "main", "record_settings", "recorder_topics", "serve"]
