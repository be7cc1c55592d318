"""The ``gpumeter`` command: one subcommand per service and tool.

Each subcommand's module exposes ``add_arguments(parser)`` and ``main(args, env) -> int``; this file only maps
names to modules, so importing it stays cheap and a service's dependencies load only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gpumeter.settings import env_snapshot

# name -> (module, one-line help). Modules are imported only for the subcommand that runs.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "topics": ("gpumeter.commands.topics", "create and list the catalog's Kafka topics"),
    "broker": ("gpumeter.commands.broker", "run a local Apache Kafka broker (development)"),
    "collector": ("services.collector.main", "the per-node agent: NVML samples and pod events to Kafka"),
    "billing": ("services.billing.main", "the billing service: shares to node bills, cost records and the ledger"),
    "report": ("services.billing.report", "costs from the ledger by namespace, label, node or GPU"),
    "attributor": ("services.attributor.main", "run the streaming attributor (per-pod GPU shares, a Faust worker)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumeter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.main(args, env_snapshot()) or 0)


if __name__ == "__main__":
    sys.exit(main())
