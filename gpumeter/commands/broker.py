"""``gpumeter broker start|stop|status|fetch``: the development Kafka broker (see gpumeter.devtools.kafka_broker)."""

from __future__ import annotations

import argparse
from typing import Mapping

from gpumeter.devtools import kafka_broker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="start|stop|status|fetch [--dir D] [--port P]")


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    return kafka_broker.main(args.rest)
