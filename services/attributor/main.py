"""``gpumeter attributor``: run the streaming attributor (a Faust worker) until SIGTERM/SIGINT or ``--duration``.

Reads settings once (flags over ``GPUMETER_*`` env), prints them with secrets masked, creates the catalog's
topics if missing, checks that samples and pod events have the same partition count (co-partitioning), then runs
``services.attributor.app.build_app`` in a Faust worker. Faust creates its own changelog topics
(``<app id>-open_samples-changelog``, ``<app id>-pods-changelog``) through the admin API, so the broker may
keep ``auto.create.topics.enable=false``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from gpumeter.clock import SystemClock
from gpumeter.entrypoint import tune_garbage_collector
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog
from services.attributor import settings as settings_module
from services.attributor.settings import AttributorSettings, attributor_settings

EX_CONFIG = 2
EX_UNAVAILABLE = 1


class TopicMetadataError(GpumeterError):
    """The input topics' partition counts could not be read."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings_module.add_arguments(parser)


async def input_partition_counts(
    kafka: KafkaSettings, catalog: TopicCatalog, timeout_s: float = 30.0
) -> dict[str, int]:
    """Partition counts of the node-samples and pod-events topics, as the broker has them."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(**kafka.client_kwargs(), request_timeout_ms=int(timeout_s * 1000))
    names = [catalog.node_samples, catalog.pod_events]
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        described = await asyncio.wait_for(admin.describe_topics(names), timeout_s)
    except (KafkaError, OSError, asyncio.TimeoutError) as exc:
        raise TopicMetadataError(f"cannot read topic metadata from {kafka.bootstrap_servers}: {exc!r}") from exc
    finally:
        await admin.close()
    counts = {name: 0 for name in names}
    for topic in described:
        if topic.get("topic") in counts and not topic.get("error_code"):
            counts[topic["topic"]] = len(topic.get("partitions") or ())
    missing = [name for name, count in counts.items() if count == 0]
    if missing:
        raise TopicMetadataError(f"topics missing on {kafka.bootstrap_servers}: {', '.join(missing)}")
    return counts


async def _prepare_topics(settings: AttributorSettings) -> int:
    from gpumeter.kafka.admin import create_topics, ensure_topics
    from services.attributor.app import PODS_TABLE, SAMPLES_TABLE, changelog_topic

    catalog = settings.kafka.catalog
    await create_topics(settings.kafka, catalog)
    counts = await input_partition_counts(settings.kafka, catalog)
    if len(set(counts.values())) != 1:
        raise ConfigError(
            "samples and pod events must have the same partition count to be joined per node; broker has "
            + ", ".join(f"{name}={count}" for name, count in counts.items())
        )
    partitions = next(iter(counts.values()))
    # Faust creates its changelogs itself, but on a fresh broker it can subscribe before they are in its
    # metadata and then fail with PartitionsMismatch ("changelog has 0 partitions"): create them first.
    await ensure_topics(
        settings.kafka,
        {changelog_topic(settings.app_id, table): (partitions, {"cleanup.policy": "compact"})
         for table in (SAMPLES_TABLE, PODS_TABLE)},
        settings.topic_replication_factor,
    )
    return partitions


def resolve_settings(settings: AttributorSettings, partitions: int) -> AttributorSettings:
    """``settings`` with the broker's partition count (a configured count must match it)."""
    if settings.partitions is not None and settings.partitions != partitions:
        raise ConfigError(f"--partitions {settings.partitions} but the input topics have {partitions} partitions")
    return settings.replace(partitions=partitions)


def _check_store(settings: AttributorSettings) -> None:
    if settings.store == "rocksdb://":
        if importlib.util.find_spec("rocksdict") is None and importlib.util.find_spec("rocksdb") is None:
            raise ConfigError("store rocksdb:// needs the rocksdict package (pip install rocksdict)")
        if settings.data_dir is None:
            raise ConfigError("store rocksdb:// keeps state on disk: give it a --data-dir that outlives the worker")


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = attributor_settings(args, env)
        _check_store(settings)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EX_CONFIG
    created_dir: Path | None = None
    if settings.data_dir is None:
        # Memory store: nothing in it outlives the worker, and two workers must never share one.
        created_dir = Path(tempfile.mkdtemp(prefix="gpumeter-attributor-"))
        settings = settings.replace(data_dir=created_dir)
    try:
        try:
            partitions = asyncio.run(_prepare_topics(settings))
            settings = resolve_settings(settings, partitions)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EX_CONFIG
        except GpumeterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EX_UNAVAILABLE
        print(json.dumps({"attributor": settings.describe()}, default=str), flush=True)
        return _run_worker(settings)
    finally:
        if created_dir is not None:
            shutil.rmtree(created_dir, ignore_errors=True)


def _run_worker(settings: AttributorSettings) -> int:
    from gpumeter.metrics import ServiceMetrics
    from services.attributor.app import SERVICE, AttributorWorker, build_app

    tune_garbage_collector()
    # asyncio.run above closed its loop and left none current; Faust's worker runs on the current one.
    asyncio.set_event_loop(asyncio.new_event_loop())
    metrics = ServiceMetrics(SERVICE, dead_letters=settings.dead_letters)
    metrics.serve(settings.metrics_port, settings.metrics_address)

    def stop_worker(exc: BaseException) -> None:
        # The same path as an operator's SIGTERM: the worker's handler stops it cleanly; main then exits non-zero.
        os.kill(os.getpid(), signal.SIGTERM)

    app = build_app(settings, SystemClock(), metrics, on_failure=stop_worker)
    if settings.duration_seconds is not None:
        duration_s = settings.duration_seconds

        @app.task
        async def stop_after_duration() -> None:
            await asyncio.sleep(duration_s)
            # The same path as an operator's SIGTERM: the worker's handler stops it cleanly.
            os.kill(os.getpid(), signal.SIGTERM)

    worker = AttributorWorker(app, loglevel=settings.log_level.lower(), quiet=True, redirect_stdouts=False)
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    else:
        code = 0
    if app.attributor.failure is not None:  # type: ignore[attr-defined]
        print(f"error: the attributor stopped on {app.attributor.failure!r}", file=sys.stderr)  # type: ignore
        return code or EX_UNAVAILABLE
    return code
