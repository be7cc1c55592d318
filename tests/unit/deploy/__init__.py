"""Offline checks of the deployment files (docker-compose.yml, deploy/kubernetes/, deploy/helm/) against the code
they run.

Shared helpers: which settings function each ``gpumeter`` role reads, which environment variables its settings
declare to the loader (``gpumeter.config``), and how a command line plus an environment becomes that role's
settings — the same path ``gpumeter <role>`` takes.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pytest

from gpumeter.cli import SUBCOMMANDS, build_parser
from gpumeter.config import env_variables
from gpumeter.settings import KafkaSettings

# The checks shared by the kustomization's and the chart's tests: their asserts explain themselves too.
pytest.register_assert_rewrite("tests.unit.deploy.manifests")

REPO_ROOT = Path(__file__).resolve().parents[3]

# Long-running roles: name -> (module holding its settings function, function name, source folder of the role).
SERVICE_ROLES: dict[str, tuple[str, str, str]] = {
    "collector": ("services.collector.settings", "collector_settings", "services/collector"),
    "attributor": ("services.attributor.settings", "attributor_settings", "services/attributor"),
    "billing": ("services.billing.settings", "billing_settings", "services/billing"),
    "guard": ("services.guard.settings", "guard_settings", "services/guard"),
    # The ledger's read-only HTTP API: billing's code (it reads billing's ledger), a role of its own.
    "api": ("services.billing.api", "api_settings", "services/billing"),
    # The recorder of the live input topics (optional in the chart: recorder.enabled).
    "record": ("pipeline.record", "record_settings", "pipeline"),
}

# Long-running roles deployed only where asked (the chart's recorder.enabled), not in docker-compose.yml.
OPTIONAL_SERVICE_ROLES = frozenset({"record"})

# Roles that run to completion on a schedule (CronJobs; in compose a loop): name -> the same triple.
TASK_ROLES: dict[str, tuple[str, str, str]] = {
    "ledger": ("services.billing.retention", "retention_settings", "services/billing"),
}

# Read by the NVIDIA container toolkit, not by gpumeter: allowed on the collector only.
NVIDIA_RUNTIME_VARIABLES = frozenset({"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"})

def settings_class(role: str) -> type:
    """The frozen settings class ``role`` loads (``gpumeter.config.load``); ``topics`` has only KafkaSettings."""
    roles = {**SERVICE_ROLES, **TASK_ROLES}
    if role not in roles:
        return KafkaSettings
    module_name, function_name, _folder = roles[role]
    module = __import__(module_name, fromlist=[function_name])
    (cls,) = {value for value in vars(module).values()
              if isinstance(value, type) and value.__module__ == module_name and value.__name__.endswith("Settings")}
    return cls


def variables_read_by(role: str) -> frozenset[str]:
    """Every environment variable ``role`` reads: those its settings class (and the KafkaSettings in it) declares
    to the loader, plus, for the guard, the guard config's ``GPUMETER_GUARD_<FIELD>`` names, which
    ``GuardConfig.load`` builds from its fields. A variable no loader declares is read by nothing."""
    names = set(env_variables(settings_class(role)))
    if role == "guard":
        from services.guard.config import ENV_PREFIX, GuardConfig

        names |= {ENV_PREFIX + f.name.upper() for f in fields(GuardConfig)}
    return frozenset(names)


def role_of(command: Sequence[str]) -> str:
    """The gpumeter subcommand a container command runs (its first word), checked against the CLI's table."""
    if not command or command[0] not in SUBCOMMANDS:
        raise AssertionError(f"{list(command)!r} does not start with a gpumeter subcommand ({sorted(SUBCOMMANDS)})")
    return command[0]


def settings_for(command: Sequence[str], env: Mapping[str, str]) -> Any:
    """Parse ``command`` with the real CLI parser and build the role's settings from it and ``env``.

    Raises AssertionError when argparse rejects the command line; the settings function raises ConfigError for
    values it cannot use. ``topics`` has no settings object of its own: its KafkaSettings are returned.
    """
    role = role_of(command)
    parser = build_parser(role)
    try:
        args = parser.parse_args(list(command))
    except SystemExit as exc:
        raise AssertionError(f"gpumeter rejects the command line {list(command)!r}") from exc
    roles = {**SERVICE_ROLES, **TASK_ROLES}
    if role not in roles:
        return KafkaSettings.from_env(env)
    module_name, function_name, _folder = roles[role]
    module = __import__(module_name, fromlist=[function_name])
    function: Callable[[Any, Mapping[str, str]], Any] = getattr(module, function_name)
    return function(args, env)
