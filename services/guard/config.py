"""The guard's thresholds and budgets: ``GuardConfig``, loaded from a YAML/JSON file and ``GPUMETER_GUARD_*`` env.

``GuardConfig.load(path, env)`` starts from the defaults, applies the file (``path``, or the file named by
``GPUMETER_GUARD_CONFIG`` when ``path`` is None), then the environment variables, and validates the result. Any
value that cannot be used raises ``ConfigError`` naming where it came from. Every field, its default and its
reason are documented in ``docs/guard.md``.

File layout (YAML, or JSON, which YAML reads too); every key is optional, unknown keys are errors::

    hold_down_seconds: 300          # general keys: the field names below
    refresh_seconds: 120
    idle_allocation: {compute_below_percent: 5, for_seconds: 1800}
    shared_memory_pressure: {used_above_percent: 90, fair_share_factor: 1.0}
    stale_node: {intervals: 5, min_seconds: 60}
    gpu_error: {ignored: ["nvmlDeviceGetPowerUsage:NOT_SUPPORTED"], min_consecutive_samples: 2}
    clock_skew: {threshold_seconds: 5}
    unrequested_gpu_use: {min_memory_bytes: 0}
    budget_exceeded: {forecast_warning_fraction: 1.0, forecast_min_elapsed_fraction: 0.05}
    budgets:
      namespaces:
        ml: {day_usd: 250, month_usd: 6000}
        "*": {day_usd: 50}            # every namespace not listed
      teams:
        research: {month_micro_usd: 5000000000}

A key ``<section>.<key>`` is the field ``<prefix><key>`` (``idle_allocation.for_seconds`` → ``idle_for_seconds``;
prefixes in ``_SECTIONS``); top-level keys are field names. Environment: ``GPUMETER_GUARD_<FIELD>`` in upper
case for every scalar field (lists comma-separated; ``GPUMETER_GUARD_NAMESPACE_BUDGETS`` and
``GPUMETER_GUARD_TEAM_BUDGETS`` take the ``budgets.namespaces`` / ``budgets.teams`` mapping as JSON). Other
``GPUMETER_GUARD_*`` variables belong to the guard service and are ignored here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import yaml

from gpumeter.errors import ConfigError

RULE_VISIBILITY_LEAK = "visibility_leak"
RULE_UNREQUESTED_GPU_USE = "unrequested_gpu_use"
RULE_IDLE_ALLOCATION = "idle_allocation"
RULE_SHARED_MEMORY_PRESSURE = "shared_memory_pressure"
RULE_BUDGET_EXCEEDED = "budget_exceeded"
RULE_STALE_NODE = "stale_node"
RULE_GPU_ERROR = "gpu_error"
RULE_CLOCK_SKEW = "clock_skew"
RULES = (
    RULE_VISIBILITY_LEAK,
    RULE_UNREQUESTED_GPU_USE,
    RULE_IDLE_ALLOCATION,
    RULE_SHARED_MEMORY_PRESSURE,
    RULE_BUDGET_EXCEEDED,
    RULE_STALE_NODE,
    RULE_GPU_ERROR,
    RULE_CLOCK_SKEW,
)

ENV_PREFIX = "GPUMETER_GUARD_"
ENV_CONFIG_FILE = "GPUMETER_GUARD_CONFIG"
DEFAULT_BUDGET_KEY = "*"
"""The budgets entry that applies to every namespace (team) without an entry of its own."""

MICRO_PER_USD = 1_000_000
PERIOD_DAY = "day"
PERIOD_MONTH = "month"
PERIODS = (PERIOD_DAY, PERIOD_MONTH)


@dataclass(frozen=True, slots=True)
class Budget:
    """A spending limit per UTC day and per UTC calendar month, in micro-USD; None: no limit for that period."""

    day_micro_usd: int | None = None
    month_micro_usd: int | None = None

    def __post_init__(self) -> None:
        for name in ("day_micro_usd", "month_micro_usd"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"budget {name} must be a non-negative integer, got {value!r}")

    def for_period(self, period: str) -> int | None:
        """The limit for ``period`` (``day`` or ``month``)."""
        if period == PERIOD_DAY:
            return self.day_micro_usd
        if period == PERIOD_MONTH:
            return self.month_micro_usd
        raise ValueError(f"unknown budget period {period!r}")

    def to_json(self) -> dict[str, int | None]:
        return {"day_micro_usd": self.day_micro_usd, "month_micro_usd": self.month_micro_usd}


def _empty_budgets() -> Mapping[str, Budget]:
    return MappingProxyType({})


@dataclass(frozen=True)
class GuardConfig:
    """Every threshold of the guard's rules and of its state machine. Immutable; validated on construction
    (``ConfigError``). Defaults are production values, explained in ``docs/guard.md``."""

    # state machine
    hold_down_seconds: int = 300
    refresh_seconds: int = 120
    refire_suppression_seconds: int = 0
    disabled_rules: frozenset[str] = frozenset()
    # who is exempt from the visibility and unrequested-use rules (node agents see every GPU by design). Only the
    # platform decides: a pod's label is its owner's to write, so it exempts only in the namespaces listed here.
    exempt_namespaces: tuple[str, ...] = ("kube-system", "gpu-operator", "nvidia-gpu-operator", "nvidia-device-plugin")
    exempt_label: str = "gpumeter.io/guard-exempt"
    exempt_label_namespaces: tuple[str, ...] = ()
    # visibility_leak: whether the nodes' NVIDIA container toolkit honours NVIDIA_VISIBLE_DEVICES set in an
    # unprivileged container's own spec (its default). False where it is hardened
    # (accept-nvidia-visible-devices-envvar-when-unprivileged=false, with the device plugin's volume-mounts or CDI
    # device lists): the variable is then no path to a GPU, so setting it is no leak (docs/guard.md).
    visible_devices_envvar_honoured: bool = True
    team_label_key: str = "team"
    pod_linger_seconds: int = 900
    # unrequested_gpu_use
    unrequested_min_memory_bytes: int = 0
    # idle_allocation
    idle_compute_below_percent: float = 5.0
    idle_for_seconds: int = 1800
    idle_evidence_max_age_seconds: int = 900
    # shared_memory_pressure
    shared_memory_used_above_percent: float = 90.0
    shared_memory_fair_share_factor: float = 1.0
    # budget_exceeded
    namespace_budgets: Mapping[str, Budget] = field(default_factory=_empty_budgets)
    team_budgets: Mapping[str, Budget] = field(default_factory=_empty_budgets)
    budget_forecast_warning_fraction: float = 1.0
    budget_forecast_min_elapsed_fraction: float = 0.05
    cost_dedup_horizon_seconds: int = 3600
    # stale_node
    stale_node_intervals: int = 5
    stale_node_min_seconds: int = 60
    stale_node_forget_seconds: int = 86_400
    # gpu_error
    gpu_error_ignored: tuple[str, ...] = ()
    gpu_error_min_consecutive_samples: int = 2
    # clock_skew: a node's clock further off the broker's append time than this (gpumeter.clockskew)
    clock_skew_threshold_seconds: int = 5

    def __post_init__(self) -> None:
        for name in (
            "hold_down_seconds",
            "refresh_seconds",
            "refire_suppression_seconds",
            "pod_linger_seconds",
            "unrequested_min_memory_bytes",
            "idle_for_seconds",
            "stale_node_min_seconds",
            "clock_skew_threshold_seconds",
        ):
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("idle_evidence_max_age_seconds", "cost_dedup_horizon_seconds", "stale_node_forget_seconds",
                     "stale_node_intervals", "gpu_error_min_consecutive_samples"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_number("idle_compute_below_percent", self.idle_compute_below_percent, 0.0, 100.0)
        _check_number("shared_memory_used_above_percent", self.shared_memory_used_above_percent, 0.0, 100.0)
        _check_number("shared_memory_fair_share_factor", self.shared_memory_fair_share_factor, 0.0, None,
                      exclusive_minimum=True)
        _check_number("budget_forecast_warning_fraction", self.budget_forecast_warning_fraction, 0.0, None,
                      exclusive_minimum=True)
        _check_number("budget_forecast_min_elapsed_fraction", self.budget_forecast_min_elapsed_fraction, 0.0, 1.0)
        if self.stale_node_forget_seconds <= self.stale_node_min_seconds:
            raise ConfigError(
                f"stale_node_forget_seconds ({self.stale_node_forget_seconds}) must be longer than "
                f"stale_node_min_seconds ({self.stale_node_min_seconds})"
            )
        unknown = set(self.disabled_rules) - set(RULES)
        if unknown:
            raise ConfigError(f"disabled_rules names unknown rules {sorted(unknown)}; rules are {', '.join(RULES)}")
        object.__setattr__(self, "disabled_rules", frozenset(self.disabled_rules))
        object.__setattr__(self, "exempt_namespaces", tuple(self.exempt_namespaces))
        object.__setattr__(self, "exempt_label_namespaces", tuple(self.exempt_label_namespaces))
        if "*" in self.exempt_namespaces or "*" in self.exempt_label_namespaces:
            raise ConfigError("exempt_namespaces and exempt_label_namespaces name namespaces; '*' is not one")
        if not isinstance(self.visible_devices_envvar_honoured, bool):
            raise ConfigError(f"visible_devices_envvar_honoured must be true or false, got "
                              f"{self.visible_devices_envvar_honoured!r}")
        if not isinstance(self.exempt_label, str) or not isinstance(self.team_label_key, str) or \
                not self.team_label_key:
            raise ConfigError("exempt_label and team_label_key must be strings (team_label_key not empty)")
        ignored = tuple(self.gpu_error_ignored)
        for pattern in ignored:
            _check_error_pattern(pattern)
        object.__setattr__(self, "gpu_error_ignored", ignored)
        for name in ("namespace_budgets", "team_budgets"):
            budgets = getattr(self, name)
            if not isinstance(budgets, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, Budget) for k, v in budgets.items()
            ):
                raise ConfigError(f"{name} must map non-empty names to Budget values")
            object.__setattr__(self, name, MappingProxyType(dict(budgets)))

    # -- lookups -----------------------------------------------------------------------------------------------

    def rule_enabled(self, rule: str) -> bool:
        return rule not in self.disabled_rules

    def namespace_budget(self, namespace: str) -> Budget | None:
        """The namespace's own budget, else the ``*`` entry, else None."""
        return self.namespace_budgets.get(namespace) or self.namespace_budgets.get(DEFAULT_BUDGET_KEY)

    def team_budget(self, team: str) -> Budget | None:
        """The team's own budget, else the ``*`` entry, else None."""
        return self.team_budgets.get(team) or self.team_budgets.get(DEFAULT_BUDGET_KEY)

    def is_error_ignored(self, nvml_function: str, error_code: str) -> bool:
        """Whether ``gpu_error_ignored`` lists (function, code); ``*`` matches any function or any code."""
        for pattern in self.gpu_error_ignored:
            function, _, code = pattern.partition(":")
            if function in ("*", nvml_function) and code in ("*", error_code):
                return True
        return False

    # -- loading -----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | str | None, env: Mapping[str, str]) -> "GuardConfig":
        """Defaults, then the file (``path``, else ``$GPUMETER_GUARD_CONFIG``), then ``GPUMETER_GUARD_*``.

        Raises ``ConfigError`` for an unreadable or malformed file, an unknown key in it, or any bad value.
        """
        values: dict[str, Any] = {}
        if path is None and env.get(ENV_CONFIG_FILE):
            path = env[ENV_CONFIG_FILE]
        if path is not None:
            values.update(_read_file(Path(path)))
        values.update(_read_env(env))
        try:
            return cls(**values)
        except ConfigError as exc:
            where = f" (from {path} and the environment)" if path is not None else " (from the environment)"
            raise ConfigError(f"guard config{where}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON-able values (budgets as ``{name: {day_micro_usd, month_micro_usd}}``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("namespace_budgets", "team_budgets"):
                value = {k: v.to_json() for k, v in sorted(value.items())}
            elif isinstance(value, frozenset):
                value = sorted(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float, maximum: float | None, *,
                  exclusive_minimum: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (exclusive_minimum and value == minimum):
        raise ConfigError(f"{name} must be {'>' if exclusive_minimum else '>='} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value!r}")


def _check_error_pattern(pattern: Any) -> None:
    if not isinstance(pattern, str) or pattern.count(":") != 1 or "" in pattern.split(":"):
        raise ConfigError(
            f"gpu_error_ignored entries are 'nvmlFunction:ERROR_CODE' ('*' for any), got {pattern!r}"
        )


# ----------------------------------------------------------------------------------------------------------------
# Parsing


def _to_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected an integer, got {value!r}")


def _to_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected a number, got {value!r}")


def _to_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _to_str_list(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if isinstance(value, (list, tuple)):
        return tuple(_to_str(item, f"{where}[{i}]").strip() for i, item in enumerate(value))
    raise ConfigError(f"{where}: expected a list of strings or a comma-separated string, got {value!r}")


def _to_rule_set(value: Any, where: str) -> frozenset[str]:
    return frozenset(_to_str_list(value, where))


def _usd_to_micro(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected an amount in USD, got {value!r}")
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ConfigError(f"{where}: expected an amount in USD, got {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ConfigError(f"{where}: a budget is a non-negative amount, got {value!r}")
    micro = amount * MICRO_PER_USD
    if micro != micro.to_integral_value():
        raise ConfigError(f"{where}: {value!r} USD is not a whole number of micro-dollars")
    return int(micro)


def _budget(value: Any, where: str) -> Budget:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping with day_usd/day_micro_usd and/or month_usd/month_micro_usd")
    allowed = {"day_usd", "day_micro_usd", "month_usd", "month_micro_usd"}
    unknown = set(value) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(map(str, unknown))}; allowed {sorted(allowed)}")
    limits: dict[str, int | None] = {}
    for period in PERIODS:
        usd, micro = value.get(f"{period}_usd"), value.get(f"{period}_micro_usd")
        if usd is not None and micro is not None:
            raise ConfigError(f"{where}: give {period}_usd or {period}_micro_usd, not both")
        if usd is not None:
            limits[f"{period}_micro_usd"] = _usd_to_micro(usd, f"{where}.{period}_usd")
        elif micro is not None:
            amount = _to_int(micro, f"{where}.{period}_micro_usd")
            if amount < 0:
                raise ConfigError(f"{where}.{period}_micro_usd: a budget is non-negative, got {micro!r}")
            limits[f"{period}_micro_usd"] = amount
        else:
            limits[f"{period}_micro_usd"] = None
    return Budget(**limits)


def _budgets(value: Any, where: str) -> Mapping[str, Budget]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: not valid JSON: {exc}") from None
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping of name to budget, got {value!r}")
    out: dict[str, Budget] = {}
    for name, entry in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: budget names are non-empty strings, got {name!r}")
        out[name] = _budget(entry, f"{where}.{name}")
    return MappingProxyType(out)


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "hold_down_seconds": _to_int,
    "refresh_seconds": _to_int,
    "refire_suppression_seconds": _to_int,
    "disabled_rules": _to_rule_set,
    "exempt_namespaces": _to_str_list,
    "exempt_label": _to_str,
    "exempt_label_namespaces": _to_str_list,
    "visible_devices_envvar_honoured": _to_bool,
    "team_label_key": _to_str,
    "pod_linger_seconds": _to_int,
    "unrequested_min_memory_bytes": _to_int,
    "idle_compute_below_percent": _to_float,
    "idle_for_seconds": _to_int,
    "idle_evidence_max_age_seconds": _to_int,
    "shared_memory_used_above_percent": _to_float,
    "shared_memory_fair_share_factor": _to_float,
    "namespace_budgets": _budgets,
    "team_budgets": _budgets,
    "budget_forecast_warning_fraction": _to_float,
    "budget_forecast_min_elapsed_fraction": _to_float,
    "cost_dedup_horizon_seconds": _to_int,
    "stale_node_intervals": _to_int,
    "stale_node_min_seconds": _to_int,
    "stale_node_forget_seconds": _to_int,
    "gpu_error_ignored": _to_str_list,
    "gpu_error_min_consecutive_samples": _to_int,
    "clock_skew_threshold_seconds": _to_int,
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(GuardConfig)}, "every field needs a parser"

# file section -> field-name prefix of its keys
_SECTIONS: dict[str, str] = {
    RULE_VISIBILITY_LEAK: "",
    RULE_UNREQUESTED_GPU_USE: "unrequested_",
    RULE_IDLE_ALLOCATION: "idle_",
    RULE_SHARED_MEMORY_PRESSURE: "shared_memory_",
    RULE_BUDGET_EXCEEDED: "budget_",
    RULE_STALE_NODE: "stale_node_",
    RULE_GPU_ERROR: "gpu_error_",
    RULE_CLOCK_SKEW: "clock_skew_",
}
_SECTION_FIELDS: dict[str, frozenset[str]] = {
    RULE_VISIBILITY_LEAK: frozenset({"exempt_namespaces", "exempt_label", "exempt_label_namespaces",
                                     "visible_devices_envvar_honoured"}),
    RULE_BUDGET_EXCEEDED: frozenset({"budget_forecast_warning_fraction", "budget_forecast_min_elapsed_fraction",
                                     "cost_dedup_horizon_seconds"}),
}
_BUDGET_SECTION_KEYS = {"namespaces": "namespace_budgets", "teams": "team_budgets"}


def _section_field(section: str, key: str) -> str | None:
    if section == RULE_BUDGET_EXCEEDED and key == "cost_dedup_horizon_seconds":
        return "cost_dedup_horizon_seconds"
    name = _SECTIONS[section] + key
    allowed = _SECTION_FIELDS.get(section)
    if allowed is not None:
        return name if name in allowed else None
    return name if name in _PARSERS and name.startswith(_SECTIONS[section]) else None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"guard config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"guard config {path}: not valid YAML/JSON: {exc}") from None
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"guard config {path}: the top level must be a mapping")
    values: dict[str, Any] = {}

    def put(name: str, raw: Any, where: str) -> None:
        if name in values:
            raise ConfigError(f"guard config {path}: {where} sets {name}, which is already set")
        values[name] = _PARSERS[name](raw, f"guard config {path}: {where}")

    for key, raw in document.items():
        if not isinstance(key, str):
            raise ConfigError(f"guard config {path}: keys are strings, got {key!r}")
        if key == "budgets":
            if not isinstance(raw, Mapping):
                raise ConfigError(f"guard config {path}: budgets must be a mapping with namespaces and/or teams")
            for sub, entries in raw.items():
                if sub not in _BUDGET_SECTION_KEYS:
                    raise ConfigError(f"guard config {path}: budgets.{sub} is not a key (namespaces, teams)")
                put(_BUDGET_SECTION_KEYS[sub], entries, f"budgets.{sub}")
        elif key in _SECTIONS:
            if raw is None:
                continue
            if not isinstance(raw, Mapping):
                raise ConfigError(f"guard config {path}: {key} must be a mapping")
            for sub, value in raw.items():
                name = _section_field(key, str(sub))
                if name is None:
                    raise ConfigError(f"guard config {path}: {key}.{sub} is not a setting")
                put(name, value, f"{key}.{sub}")
        elif key in _PARSERS:
            put(key, raw, key)
        else:
            raise ConfigError(f"guard config {path}: {key!r} is not a setting")
    return values


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, parse in _PARSERS.items():
        variable = ENV_PREFIX + name.upper()
        raw = env.get(variable)
        if raw is None or raw.strip() == "":
            continue
        values[name] = parse(raw, variable)
    return values


__all__ = [
    "Budget",
    "DEFAULT_BUDGET_KEY",
    "ENV_CONFIG_FILE",
    "ENV_PREFIX",
    "GuardConfig",
    "PERIOD_DAY",
    "PERIOD_MONTH",
    "PERIODS",
    "RULES",
    "RULE_BUDGET_EXCEEDED",
    "RULE_CLOCK_SKEW",
    "RULE_GPU_ERROR",
    "RULE_IDLE_ALLOCATION",
    "RULE_SHARED_MEMORY_PRESSURE",
    "RULE_STALE_NODE",
    "RULE_UNREQUESTED_GPU_USE",
    "RULE_VISIBILITY_LEAK",
]
