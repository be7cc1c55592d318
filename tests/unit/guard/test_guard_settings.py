"""Guard service settings: flags over env over defaults, validation, secrets masked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gpumeter.errors import ConfigError
from gpumeter.settings import SECRET_MARK
from services.guard.settings import (
    ALERTMANAGER_LEASE_RESENDS,
    DEFAULT_METRICS_PORT,
    GuardSettings,
    add_arguments,
    guard_settings,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults():
    settings = guard_settings(parse(), {})
    assert settings.metrics_port == DEFAULT_METRICS_PORT == 9405
    assert settings.alertmanager_url is None
    assert settings.state_path is None
    assert settings.kafka.client_id == "gpumeter-guard"


def test_flags_win_over_env():
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": "k1:9092",
        "GPUMETER_KAFKA_TOPIC_PREFIX": "env.",
        "GPUMETER_GUARD_CONSUMER_GROUP": "env-group",
        "GPUMETER_GUARD_STATE_PATH": "/var/lib/env/state",
        "GPUMETER_GUARD_ALERTMANAGER_URL": "http://am-env:9093/",
        "GPUMETER_GUARD_ALERTMANAGER_RESEND_SECONDS": "30",
        "GPUMETER_GUARD_CONFIG": "/etc/guard/env.yaml",
    }
    settings = guard_settings(parse("--group", "flag-group", "--state", "/data/state", "--alertmanager-resend",
                                    "15", "--topic-prefix", "flag."), env)
    assert settings.kafka.bootstrap_servers == "k1:9092"
    assert settings.kafka.topic_prefix == "flag."
    assert settings.consumer_group == "flag-group"
    assert settings.state_path == Path("/data/state")
    assert settings.alertmanager_url == "http://am-env:9093"  # trailing slash dropped: paths are appended
    assert settings.alertmanager_resend_seconds == 15.0
    assert settings.alertmanager_lease_seconds == ALERTMANAGER_LEASE_RESENDS * 15.0
    assert settings.config_path == Path("/etc/guard/env.yaml")


def test_alertmanager_password_is_masked():
    settings = GuardSettings(alertmanager_url="https://guard:hunter2-secret@am.example:9093")
    assert "hunter2-secret" not in repr(settings)
    assert "hunter2-secret" not in str(settings.describe())
    assert settings.describe()["alertmanager_url"] == f"https://guard:{SECRET_MARK}@am.example:9093"
    assert settings.alertmanager_url == "https://guard:hunter2-secret@am.example:9093"


@pytest.mark.parametrize("changes", [
    {"alertmanager_url": "am.example:9093"},
    {"alertmanager_url": "ftp://am.example"},
    {"alertmanager_url": "http://am.example/?x=1"},
    {"alertmanager_resend_seconds": 0},
    {"snapshot_interval_seconds": -1},
    {"clock_interval_seconds": 0},
    {"metrics_port": 70000},
    {"auto_offset_reset": "middle"},
    {"consumer_group": ""},
])
def test_unusable_values_are_config_errors(changes):
    with pytest.raises(ConfigError):
        GuardSettings(**changes)


def test_bad_env_number_names_the_variable():
    with pytest.raises(ConfigError, match="GPUMETER_GUARD_SNAPSHOT_INTERVAL_SECONDS"):
        guard_settings(parse(), {"GPUMETER_GUARD_SNAPSHOT_INTERVAL_SECONDS": "often"})


def test_the_role_decides_the_group_and_the_nodes_role_keeps_no_state_file():
    assert guard_settings(parse(), {}).role == "all"
    nodes = guard_settings(parse("--role", "nodes", "--group", "g"), {})
    assert (nodes.role, nodes.group_id) == ("nodes", "g")
    budgets = guard_settings(parse("--group", "g", "--state", "/data/state"), {"GPUMETER_GUARD_ROLE": "budgets"})
    assert (budgets.role, budgets.group_id) == ("budgets", "g-budgets")  # beside the nodes group, not in it
    with pytest.raises(ConfigError, match="nodes role keeps no state file"):
        guard_settings(parse("--role", "nodes", "--state", "/data/state"), {})
    with pytest.raises(ConfigError):
        guard_settings(parse("--role", "everything"), {})
