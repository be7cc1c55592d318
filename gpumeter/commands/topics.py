"""``gpumeter topics create|list``: the catalog's topics on the configured broker."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Mapping

from gpumeter.config import load
from gpumeter.errors import GpumeterError
from gpumeter.settings import KafkaSettings
from schemas.catalog import TopicCatalog


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["create", "list"], help="create missing topics, or list the catalog")
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (default: env or 127.0.0.1:9092)")
    parser.add_argument("--topic-prefix", help="prefix for every topic name")
    parser.add_argument("--partitions", type=int, help="override every topic's partition count")


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = load(KafkaSettings, args, env, defaults={"client_id": "gpumeter-topics"})
    except GpumeterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    catalog = TopicCatalog(prefix=settings.topic_prefix, partitions_override=args.partitions)
    if args.action == "list":
        for spec in catalog:
            print(
                f"{catalog.name(spec):40} {spec.record_type.__name__:12} partitions={catalog.partitions(spec):<3} "
                f"cleanup={spec.cleanup_policy:8} key={spec.key}  producers={','.join(spec.producers)} "
                f"consumers={','.join(spec.consumers)}"
            )
        return 0
    from gpumeter.kafka.admin import create_topics

    try:
        results = asyncio.run(create_topics(settings, catalog))
    except GpumeterError as exc:
        print(f"error: {exc}")
        return 1
    for result in results:
        print(f"{'created' if result.created else 'exists '} {result.name} ({result.partitions} partitions)")
    return 0
