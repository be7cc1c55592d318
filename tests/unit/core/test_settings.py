from __future__ import annotations

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from gpumeter.settings import SECRET_MARK, KafkaSettings


def test_env_overrides_defaults_and_kafka_bootstrap_wins():
    settings = KafkaSettings.from_env(
        {"GPUMETER_KAFKA_BOOTSTRAP_SERVERS": "a:1", "KAFKA_BOOTSTRAP_SERVERS": "b:2", "GPUMETER_KAFKA_TOPIC_PREFIX": "x."}
    )
    assert settings.bootstrap_servers == "b:2"
    assert settings.topic_prefix == "x."
    assert settings.catalog.node_samples == "x.gpumeter.node-samples.v3"


def test_sasl_settings_reach_the_client_and_the_password_stays_hidden():
    settings = KafkaSettings.from_env(
        {
            "GPUMETER_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "GPUMETER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "GPUMETER_KAFKA_SASL_USERNAME": "meter",
            "GPUMETER_KAFKA_SASL_PASSWORD": "s3cret-value",
        }
    )
    kwargs = settings.client_kwargs()
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_username"] == "meter"
    assert kwargs["sasl_plain_password"] == "s3cret-value"
    assert "s3cret-value" not in repr(settings)
    assert "s3cret-value" not in str(settings.describe())
    assert settings.describe()["sasl_password"] == SECRET_MARK


def test_bad_security_protocol_is_a_config_error():
    with pytest.raises(ConfigError):
        KafkaSettings(security_protocol="TLS")
    with pytest.raises(ConfigError):
        KafkaSettings(security_protocol="SASL_SSL")


def test_manual_clock_moves_only_forward():
    clock = ManualClock(1_000)
    clock.advance_ms(500)
    assert clock.now_ms() == 1_500
    with pytest.raises(ValueError):
        clock.set_ms(10)


def test_replication_factor_from_env_is_an_int_and_checked():
    assert KafkaSettings.from_env({"GPUMETER_KAFKA_REPLICATION_FACTOR": "3"}).replication_factor == 3
    with pytest.raises(ConfigError):
        KafkaSettings.from_env({"GPUMETER_KAFKA_REPLICATION_FACTOR": "three"})
    with pytest.raises(ConfigError):
        KafkaSettings(replication_factor=0)


def test_kafka_flags_override_the_environment_and_an_empty_prefix_flag_counts():
    import argparse

    from gpumeter.config import add_arguments, load

    parser = argparse.ArgumentParser()
    add_arguments(parser, KafkaSettings)
    env = {"GPUMETER_KAFKA_BOOTSTRAP_SERVERS": "broker-env:9092", "GPUMETER_KAFKA_TOPIC_PREFIX": "env."}
    from_env = load(KafkaSettings, parser.parse_args([]), env)
    assert (from_env.bootstrap_servers, from_env.topic_prefix) == ("broker-env:9092", "env.")
    flagged = load(KafkaSettings, parser.parse_args(["--bootstrap-servers", "broker-flag:9092", "--topic-prefix", ""]),
                   env)
    assert (flagged.bootstrap_servers, flagged.topic_prefix) == ("broker-flag:9092", "")
    assert flagged.client_id == from_env.client_id == "gpumeter"
