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
    "report": ("services.billing.report", "costs from the ledger by namespace, pod, label, node or GPU"),
    "reconcile": ("services.billing.reconcile", "true the ledger up to a cloud bill (FOCUS or AWS CUR 2.0 export)"),
    "prices": ("services.billing.prices_cli", "price files: import the providers' own price lists (prices import)"),
    "export": ("services.billing.export", "the ledger as a FOCUS dataset (Parquet or CSV)"),
    "ledger": ("services.billing.retention", "the ledger's upkeep: drop minute lines and rollups past retention"),
    "api": ("services.billing.api", "read-only HTTP API over the ledger: OpenCost-compatible /allocation"),
    "replay": ("pipeline.cli", "attribute and price a scenario or a recording offline, no broker"),
    "record": ("pipeline.record", "record the live input topics into hourly, compressed recordings for replay"),
    "attributor": ("services.attributor.main", "run the streaming attributor (per-pod GPU shares, a Faust worker)"),
    "run": ("gpumeter.commands.run", "the whole pipeline on this machine (simulated cluster) with a live view"),
    "guard": ("services.guard.main", "the guard service: rules over samples, pods, shares and costs to violations"),
    "violations": ("services.guard.violations_cli", "the guard's violations from the compacted topic (--active)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (all of them when None), so start-up stays cheap."""
    parser = argparse.ArgumentParser(prog="gpumeter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command_parser.set_defaults(_module=module_name)
        if command is None or command == name:
            importlib.import_module(module_name).add_arguments(command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else ""
    args = build_parser(command).parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.main(args, env_snapshot()) or 0)


if __name__ == "__main__":
    sys.exit(main())
