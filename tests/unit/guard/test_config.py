"""GuardConfig: defaults, the file layout, env overrides, and ConfigError for every kind of bad value."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpumeter.errors import ConfigError
from services.guard.config import RULES, Budget, GuardConfig

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str, name: str = "guard.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_load_from_nothing_and_every_field_round_trips_through_env(tmp_path):
    assert GuardConfig.load(None, {}) == GuardConfig()
    # Every scalar field can be set from its variable; a value different from the default shows it was read.
    env = {
        "GPUMETER_GUARD_HOLD_DOWN_SECONDS": "61",
        "GPUMETER_GUARD_REFRESH_SECONDS": "62",
        "GPUMETER_GUARD_REFIRE_SUPPRESSION_SECONDS": "63",
        "GPUMETER_GUARD_DISABLED_RULES": "stale_node, gpu_error",
        "GPUMETER_GUARD_EXEMPT_NAMESPACES": "a,b",
        "GPUMETER_GUARD_EXEMPT_LABEL": "x/exempt",
        "GPUMETER_GUARD_EXEMPT_LABEL_NAMESPACES": "gpumeter, monitoring",
        "GPUMETER_GUARD_VISIBLE_DEVICES_ENVVAR_HONOURED": "false",
        "GPUMETER_GUARD_TEAM_LABEL_KEY": "squad",
        "GPUMETER_GUARD_POD_LINGER_SECONDS": "64",
        "GPUMETER_GUARD_UNREQUESTED_MIN_MEMORY_BYTES": "65",
        "GPUMETER_GUARD_IDLE_COMPUTE_BELOW_PERCENT": "6.5",
        "GPUMETER_GUARD_IDLE_FOR_SECONDS": "66",
        "GPUMETER_GUARD_IDLE_EVIDENCE_MAX_AGE_SECONDS": "67",
        "GPUMETER_GUARD_SHARED_MEMORY_USED_ABOVE_PERCENT": "68.5",
        "GPUMETER_GUARD_SHARED_MEMORY_FAIR_SHARE_FACTOR": "1.25",
        "GPUMETER_GUARD_NAMESPACE_BUDGETS": json.dumps({"ml": {"day_usd": "12.5"}}),
        "GPUMETER_GUARD_TEAM_BUDGETS": json.dumps({"*": {"month_micro_usd": 7}}),
        "GPUMETER_GUARD_BUDGET_FORECAST_WARNING_FRACTION": "0.8",
        "GPUMETER_GUARD_BUDGET_FORECAST_MIN_ELAPSED_FRACTION": "0.1",
        "GPUMETER_GUARD_COST_DEDUP_HORIZON_SECONDS": "69",
        "GPUMETER_GUARD_STALE_NODE_INTERVALS": "7",
        "GPUMETER_GUARD_STALE_NODE_MIN_SECONDS": "70",
        "GPUMETER_GUARD_STALE_NODE_FORGET_SECONDS": "7100",
        "GPUMETER_GUARD_GPU_ERROR_IGNORED": "nvmlDeviceGetPowerUsage:NOT_SUPPORTED,*:TIMEOUT",
        "GPUMETER_GUARD_GPU_ERROR_MIN_CONSECUTIVE_SAMPLES": "3",
        "GPUMETER_GUARD_CLOCK_SKEW_THRESHOLD_SECONDS": "7",
        "GPUMETER_GUARD_ALERTMANAGER_URL": "http://not-ours",  # the service's variable: ignored here
    }
    config = GuardConfig.load(None, env)
    defaults = GuardConfig()
    for field in dataclasses.fields(GuardConfig):
        variable = "GPUMETER_GUARD_" + field.name.upper()
        assert variable in env, field.name
        assert getattr(config, field.name) != getattr(defaults, field.name), field.name
    assert config.disabled_rules == frozenset({"stale_node", "gpu_error"})
    assert config.namespace_budgets["ml"] == Budget(day_micro_usd=12_500_000)
    assert config.team_budget("anyone") == Budget(month_micro_usd=7)
    assert config.gpu_error_ignored == ("nvmlDeviceGetPowerUsage:NOT_SUPPORTED", "*:TIMEOUT")
    assert not config.rule_enabled("gpu_error") and config.rule_enabled("visibility_leak")


def test_the_file_uses_rule_sections_and_env_overrides_it(tmp_path):
    path = write(tmp_path, """
hold_down_seconds: 45
visibility_leak: {exempt_namespaces: [kube-system, monitoring], exempt_label_namespaces: [gpumeter]}
idle_allocation: {compute_below_percent: 2.5, for_seconds: 600}
shared_memory_pressure: {used_above_percent: 95}
stale_node: {intervals: 4, min_seconds: 30}
gpu_error: {ignored: ["nvmlDeviceGetPowerUsage:NOT_SUPPORTED"], min_consecutive_samples: 3}
unrequested_gpu_use: {min_memory_bytes: 1048576}
budget_exceeded: {forecast_warning_fraction: 0.9, cost_dedup_horizon_seconds: 1800}
budgets:
  namespaces:
    ml: {day_usd: 250, month_usd: 6000.000001}
    "*": {day_micro_usd: 50000000}
  teams:
    research: {month_usd: 5000}
""")
    config = GuardConfig.load(path, {"GPUMETER_GUARD_IDLE_FOR_SECONDS": "900"})
    assert config.hold_down_seconds == 45
    assert config.exempt_namespaces == ("kube-system", "monitoring")
    assert config.exempt_label_namespaces == ("gpumeter",)
    assert GuardConfig().exempt_label_namespaces == (), "by default a pod's own label exempts it nowhere"
    assert (config.idle_compute_below_percent, config.idle_for_seconds) == (2.5, 900)
    assert config.shared_memory_used_above_percent == 95.0
    assert (config.stale_node_intervals, config.stale_node_min_seconds) == (4, 30)
    assert config.gpu_error_ignored == ("nvmlDeviceGetPowerUsage:NOT_SUPPORTED",)
    assert config.gpu_error_min_consecutive_samples == 3
    assert config.unrequested_min_memory_bytes == 1 << 20
    assert (config.budget_forecast_warning_fraction, config.cost_dedup_horizon_seconds) == (0.9, 1800)
    assert config.namespace_budget("ml") == Budget(day_micro_usd=250_000_000, month_micro_usd=6_000_000_001)
    assert config.namespace_budget("other") == Budget(day_micro_usd=50_000_000)
    assert config.team_budget("research") == Budget(month_micro_usd=5_000_000_000)
    assert config.team_budget("nobody") is None
    # The same file as JSON, named by GPUMETER_GUARD_CONFIG.
    as_json = write(tmp_path, json.dumps({"hold_down_seconds": 46, "budgets": {"teams": {"x": {"day_usd": 1}}}}),
                    "guard.json")
    config = GuardConfig.load(None, {"GPUMETER_GUARD_CONFIG": str(as_json)})
    assert config.hold_down_seconds == 46 and config.team_budget("x") == Budget(day_micro_usd=1_000_000)


def test_the_thresholds_shipped_with_the_guard_scenarios_load():
    config = GuardConfig.load(REPO / "scenarios" / "guard" / "thresholds.yaml", {})
    assert config.hold_down_seconds < GuardConfig().hold_down_seconds
    assert config.namespace_budgets and config.team_budgets


@pytest.mark.parametrize("text, words", [
    ("holdown_seconds: 3", "holdown_seconds"),
    ("idle_allocation: {for_minutes: 3}", "idle_allocation.for_minutes"),
    ("idle_allocation: 5", "must be a mapping"),
    ("hold_down_seconds: -1", "hold_down_seconds"),
    ("hold_down_seconds: ten", "hold_down_seconds"),
    ("hold_down_seconds: true", "hold_down_seconds"),
    ("refresh_seconds: 1.5", "refresh_seconds"),
    ("idle_allocation: {compute_below_percent: 101}", "idle_compute_below_percent"),
    ("shared_memory_pressure: {fair_share_factor: 0}", "shared_memory_fair_share_factor"),
    ("budget_exceeded: {forecast_min_elapsed_fraction: 1.5}", "budget_forecast_min_elapsed_fraction"),
    ("disabled_rules: [visibility_leak, vibes]", "vibes"),
    ("visibility_leak: {exempt_label_namespaces: ['*']}", "exempt_label_namespaces"),
    ("gpu_error: {ignored: [NOT_SUPPORTED]}", "nvmlFunction:ERROR_CODE"),
    ("stale_node: {min_seconds: 100, forget_seconds: 100}", "stale_node_forget_seconds"),
    ("budgets: {namespaces: {ml: {day_usd: 1, day_micro_usd: 1000000}}}", "not both"),
    ("budgets: {namespaces: {ml: {day_usd: 0.0000001}}}", "micro-dollars"),
    ("budgets: {namespaces: {ml: {day_usd: -1}}}", "non-negative"),
    ("budgets: {namespaces: {ml: {weekly_usd: 1}}}", "weekly_usd"),
    ("budgets: {projects: {}}", "budgets.projects"),
    ("- just\n- a list", "mapping"),
    ("hold_down_seconds: [", "YAML"),
    ("hold_down_seconds: 3\nhold_down_seconds: 4", "duplicate key"),
])
def test_bad_files_raise_config_error_naming_the_problem(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        GuardConfig.load(path, {})
    assert words in str(info.value)


def test_a_file_that_cannot_be_read_and_bad_env_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        GuardConfig.load(tmp_path / "missing.yaml", {})
    with pytest.raises(ConfigError, match="GPUMETER_GUARD_IDLE_FOR_SECONDS"):
        GuardConfig.load(None, {"GPUMETER_GUARD_IDLE_FOR_SECONDS": "soon"})
    with pytest.raises(ConfigError, match="GPUMETER_GUARD_NAMESPACE_BUDGETS"):
        GuardConfig.load(None, {"GPUMETER_GUARD_NAMESPACE_BUDGETS": "{not json"})
    with pytest.raises(ConfigError, match="set twice|already set"):
        GuardConfig.load(write(tmp_path, "idle_for_seconds: 5\nidle_allocation: {for_seconds: 6}"), {})


def test_the_visibility_section_says_whether_the_toolkit_honours_the_variable(tmp_path):
    assert GuardConfig().visible_devices_envvar_honoured is True
    hardened = GuardConfig.load(write(tmp_path, "visibility_leak: {visible_devices_envvar_honoured: false}"), {})
    assert hardened.visible_devices_envvar_honoured is False
    assert GuardConfig.load(None, {"GPUMETER_GUARD_VISIBLE_DEVICES_ENVVAR_HONOURED": "TRUE"}) == GuardConfig()
    for bad in ("0", "no", "sometimes"):
        with pytest.raises(ConfigError, match="VISIBLE_DEVICES_ENVVAR_HONOURED"):
            GuardConfig.load(None, {"GPUMETER_GUARD_VISIBLE_DEVICES_ENVVAR_HONOURED": bad})
    with pytest.raises(ConfigError, match="true or false"):
        GuardConfig(visible_devices_envvar_honoured="false")


def test_a_section_and_its_flat_field_cannot_both_be_given(tmp_path):
    with pytest.raises(ConfigError, match="already set"):
        GuardConfig.load(write(tmp_path, "exempt_label: a\nvisibility_leak: {exempt_label: b}"), {})


def test_constructor_validation_and_lookups():
    with pytest.raises(ConfigError):
        GuardConfig(namespace_budgets={"ml": 5})
    with pytest.raises(ConfigError):
        Budget(day_micro_usd=-1)
    with pytest.raises(ConfigError):
        GuardConfig(team_label_key="")
    config = GuardConfig(gpu_error_ignored=("*:NOT_SUPPORTED", "nvmlDeviceGetPowerUsage:*"))
    assert config.is_error_ignored("nvmlDeviceGetUtilizationRates", "NOT_SUPPORTED")
    assert config.is_error_ignored("nvmlDeviceGetPowerUsage", "UNKNOWN")
    assert not config.is_error_ignored("nvmlDeviceGetMemoryInfo", "UNKNOWN")
    assert set(RULES) == {"visibility_leak", "unrequested_gpu_use", "idle_allocation", "shared_memory_pressure",
                          "budget_exceeded", "stale_node", "gpu_error", "clock_skew"}
    dumped = GuardConfig(namespace_budgets={"ml": Budget(day_micro_usd=3)}).to_json()
    assert dumped["namespace_budgets"] == {"ml": {"day_micro_usd": 3, "month_micro_usd": None}}
    json.dumps(dumped)
