"""Creates the catalog's topics idempotently, and reads topics' partition numbers, with aiokafka's admin client."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from gpumeter.errors import GpumeterError
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog


class TopicAdminError(GpumeterError):
    """Topics could not be created or listed."""


@dataclass(frozen=True)
class TopicResult:
    name: str
    partitions: int
    created: bool


async def create_topics(
    settings: KafkaSettings, catalog: TopicCatalog | None = None, timeout_s: float = 60.0
) -> list[TopicResult]:
    """Create every catalog topic that does not exist yet; existing ones are left as they are."""
    catalog = catalog or settings.catalog
    admin = AIOKafkaAdminClient(**settings.client_kwargs(), request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        existing = set(await admin.list_topics())
        wanted = [spec for spec in catalog if catalog.name(spec) not in existing]
        results = [TopicResult(catalog.name(s), catalog.partitions(s), False) for s in catalog if s not in wanted]
        if wanted:
            new_topics = [
                NewTopic(
                    name=catalog.name(spec),
                    num_partitions=catalog.partitions(spec),
                    replication_factor=settings.replication_factor,
                    topic_configs=spec.config(),
                )
                for spec in wanted
            ]
            try:
                response = await admin.create_topics(new_topics, validate_only=False)
            except TopicAlreadyExistsError:
                response = None
            errors = _creation_errors(response)
            if errors:
                raise TopicAdminError("; ".join(errors))
            results += [TopicResult(catalog.name(s), catalog.partitions(s), True) for s in wanted]
        return sorted(results, key=lambda r: r.name)
    except (KafkaError, OSError, asyncio.TimeoutError) as exc:
        raise TopicAdminError(f"cannot create topics on {settings.bootstrap_servers}: {exc!r}") from exc
    finally:
        await admin.close()


_TOPIC_ALREADY_EXISTS = 36


def _creation_errors(response) -> list[str]:
    if response is None:
        return []
    errors = []
    for item in getattr(response, "topic_errors", []):
        name, code = item[0], item[1]
        message = item[2] if len(item) > 2 else ""
        if code not in (0, _TOPIC_ALREADY_EXISTS):
            errors.append(f"{name}: error {code} {message or ''}".strip())
    return errors


async def ensure_topics(settings: KafkaSettings, topics: dict[str, tuple[int, dict[str, str]]],
                        replication_factor: int, timeout_s: float = 60.0) -> list[TopicResult]:
    """Create each ``name -> (partitions, config)`` topic that does not exist yet (topics outside the catalog,
    e.g. the attributor's changelogs); existing ones are left as they are."""
    admin = AIOKafkaAdminClient(**settings.client_kwargs(), request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        existing = set(await admin.list_topics())
        wanted = {name: spec for name, spec in topics.items() if name not in existing}
        if wanted:
            try:
                response = await admin.create_topics([
                    NewTopic(name=name, num_partitions=partitions, replication_factor=replication_factor,
                             topic_configs=config)
                    for name, (partitions, config) in sorted(wanted.items())
                ])
            except TopicAlreadyExistsError:
                response = None
            errors = _creation_errors(response)
            if errors:
                raise TopicAdminError("; ".join(errors))
        return [TopicResult(name, partitions, name in wanted) for name, (partitions, _) in sorted(topics.items())]
    except (KafkaError, OSError, asyncio.TimeoutError) as exc:
        raise TopicAdminError(f"cannot create topics on {settings.bootstrap_servers}: {exc!r}") from exc
    finally:
        await admin.close()


async def partition_numbers(kafka, topics: Iterable[str], timeout_s: float = 30.0) -> dict[str, tuple[int, ...]]:
    """The partition numbers of each of ``topics`` from the broker's metadata (all topics are asked for, so a
    missing one is never auto-created); a topic that does not exist is absent from the result. Raises what
    aiokafka raises (``KafkaError``, ``OSError``) and ``asyncio.TimeoutError``."""
    wanted = set(topics)
    admin = AIOKafkaAdminClient(**kafka.client_kwargs(), request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        described = await asyncio.wait_for(admin.describe_topics(), timeout_s)
    finally:
        await admin.close()
    return {t["topic"]: tuple(sorted(p["partition"] for p in t["partitions"]))
            for t in described if t["topic"] in wanted and t["partitions"]}
