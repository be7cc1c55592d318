"""The one settings loader (gpumeter.config): precedence, the whitespace rule, bad values as SettingError naming the
flag, the variable and the value, secrets redacted in describe() and in errors; and the same rules in every
service's settings (metrics port, client id)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumeter.config import (
    add_arguments,
    at_least,
    check_client_id,
    describe,
    env_variables,
    flags,
    integer,
    load,
    nested,
    non_empty,
    number,
    path,
    setting,
    settings_repr,
    validate,
)
from gpumeter.errors import ConfigError, SettingError
from gpumeter.redact import SECRET_MARK, mask_url

TOKEN = "tok-9f3c-never-shown"
URL_PASSWORD = "pw-5e1d-never-shown"


def _short_token(value: str) -> str:
    if len(value) < 30:
        raise ValueError(f"token {value} is shorter than 30 characters")
    return value


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ConfigError(f"{value} is not an http(s) URL")
    return value


@dataclass(frozen=True)
class Inner:
    host: str = setting("localhost", env=("ALT_HOST", "T_HOST"), flag="--host", check=non_empty, help="the host")
    client: str = setting("inner", env="T_CLIENT", check=check_client_id, help="client id")


@dataclass(frozen=True)
class Sample:
    name: str = setting(env="T_NAME", flag="--name", check=non_empty, help="a name")
    count: int = setting(3, env="T_COUNT", flag="--count", parse=integer, check=at_least(1), help="how many")
    ratio: float = setting(0.5, env="T_RATIO", parse=number, help="a ratio")
    where: Path | None = setting(None, env="T_WHERE", flag="--where", parse=path, help="a folder")
    prefix: str = setting("", env="T_PREFIX", flag="--prefix", help="a prefix")
    token: str | None = setting(None, env="T_TOKEN", flag="--token", check=_short_token, secret=True, help="a token")
    url: str = setting("http://localhost", env="T_URL", check=_http_url, secret=True, mask=mask_url, help="a URL")
    inner: Inner = nested(Inner, client=lambda values: f"sample-{values['name']}")

    def __post_init__(self) -> None:
        validate(self)


def _load(argv=(), env=None) -> Sample:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Sample)
    return load(Sample, parser.parse_args(list(argv)), {"T_NAME": "a", **(env or {})})


@pytest.mark.parametrize("argv, env, attribute, expected", [
    ([], {}, "count", 3),                                                    # default
    ([], {"T_COUNT": "4"}, "count", 4),                                      # env over default
    (["--count", "5"], {"T_COUNT": "4"}, "count", 5),                        # flag over env
    ([], {"T_COUNT": "  7 \n"}, "count", 7),                                 # env stripped
    (["--count", " 8 "], {}, "count", 8),                                    # flag stripped
    ([], {"T_COUNT": "   "}, "count", 3),                                    # blank env is unset
    ([], {"T_COUNT": ""}, "count", 3),                                       # empty env is unset
    ([], {"T_PREFIX": " env. "}, "prefix", "env."),
    (["--prefix", ""], {"T_PREFIX": "env."}, "prefix", ""),                  # a flag given is set, even empty
    ([], {"T_WHERE": " /data "}, "where", Path("/data")),
    (["--where", "/flag"], {"T_WHERE": "/env"}, "where", Path("/flag")),
    ([], {"T_RATIO": "0.25"}, "ratio", 0.25),
])
def test_precedence_and_whitespace(argv, env, attribute, expected):
    assert getattr(_load(argv, env), attribute) == expected


@pytest.mark.parametrize("argv, env, host, client", [
    ([], {}, "localhost", "sample-a"),                                       # nested defaults from the outer values
    ([], {"ALT_HOST": "h1", "T_HOST": "h2"}, "h1", "sample-a"),              # the first variable named wins
    ([], {"ALT_HOST": "  ", "T_HOST": "h2"}, "h2", "sample-a"),              # ... when it is set
    (["--host", "h3"], {"ALT_HOST": "h1"}, "h3", "sample-a"),                # nested flags over env
    ([], {"T_CLIENT": " mine "}, "localhost", "mine"),                       # the variable over the declared default
])
def test_nested_settings_load_by_the_same_rules(argv, env, host, client):
    inner = _load(argv, env).inner
    assert (inner.host, inner.client) == (host, client)


@pytest.mark.parametrize("argv, env, flag, variables, value, source, reason", [
    ([], {"T_COUNT": "many"}, "--count", ("T_COUNT",), "many", "T_COUNT", "is not a whole number"),
    (["--count", "0"], {"T_COUNT": "4"}, "--count", ("T_COUNT",), "0", "--count", "must be >= 1"),
    (["--count", "2.5"], {}, "--count", ("T_COUNT",), "2.5", "--count", "is not a whole number"),
    ([], {"T_RATIO": "nan"}, None, ("T_RATIO",), "nan", "T_RATIO", "is not a finite number"),
    ([], {"T_NAME": "  "}, "--name", ("T_NAME",), None, None, "is required and not set"),
    ([], {"T_CLIENT": "has space"}, None, ("T_CLIENT",), "has space", "T_CLIENT", "is not a Kafka client id"),
    (["--host", ""], {}, "--host", ("ALT_HOST", "T_HOST"), "", "--host", "is empty"),
])
def test_bad_values_are_setting_errors_naming_flag_variable_and_value(argv, env, flag, variables, value, source,
                                                                      reason):
    with pytest.raises(SettingError) as caught:
        _load(argv, env)
    error = caught.value
    assert isinstance(error, ConfigError)
    assert (error.flag, error.env, error.value, error.source) == (flag, variables, value, source)
    assert error.reason.startswith(reason)
    for name in (flag, *variables):
        if name:
            assert name in str(error)


def test_a_secret_never_shows_in_describe_repr_or_errors():
    settings = _load(["--token", TOKEN * 2], {"T_URL": f"https://user:{URL_PASSWORD}@example.test/x"})
    view = describe(settings)
    assert view["token"] == SECRET_MARK
    assert view["url"] == "https://user:***@example.test/x"
    assert view["inner"] == {"host": "localhost", "client": "sample-a"}
    for text in (json.dumps(view), repr(settings), settings_repr(settings)):
        assert TOKEN not in text and URL_PASSWORD not in text
    assert settings.token == TOKEN * 2  # kept, only not shown

    with pytest.raises(SettingError) as short:
        _load([], {"T_TOKEN": TOKEN})  # the check's reason quotes the value: redacted
    assert short.value.value == SECRET_MARK and TOKEN not in str(short.value)
    assert "T_TOKEN" in str(short.value) and "--token" in str(short.value)

    with pytest.raises(SettingError) as bad_url:
        _load([], {"T_URL": f"ftp://user:{URL_PASSWORD}@example.test"})
    assert URL_PASSWORD not in str(bad_url.value)
    assert bad_url.value.value == "ftp://user:***@example.test"


def test_direct_construction_parses_text_and_checks_like_the_loader():
    assert Sample(name="a", count="5").count == 5
    assert Sample(name="a", where="  ").where is None  # blank text for a field whose default is None
    with pytest.raises(SettingError, match="--count / T_COUNT = 0: must be >= 1"):
        Sample(name="a", count=0)


def test_help_names_the_variables_and_the_default_and_flags_take_text():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Sample)
    text = " ".join(parser.format_help().split())
    assert "how many (env T_COUNT, default 3)" in text
    assert "the host (env ALT_HOST or T_HOST, default localhost)" in text
    assert parser.parse_args(["--count", "x"]).count == "x"  # refused by load, as a SettingError, not by argparse
    assert flags(Sample) == {"--name", "--count", "--where", "--prefix", "--token", "--host"}
    assert env_variables(Sample) == {"T_NAME", "T_COUNT", "T_RATIO", "T_WHERE", "T_PREFIX", "T_TOKEN", "T_URL",
                                     "ALT_HOST", "T_HOST", "T_CLIENT"}


# -- the same rules in every service ----------------------------------------------------------------------------

ROLES = {
    "collector": ("services.collector.settings", "CollectorSettings", "gpumeter-collector-gpu-node-1", 9402),
    "attributor": ("services.attributor.settings", "AttributorSettings", "gpumeter-attributor", 9403),
    "billing": ("services.billing.settings", "BillingSettings", "gpumeter-billing", 9404),
    "guard": ("services.guard.settings", "GuardSettings", "gpumeter-guard", 9405),
    "api": ("services.billing.api", "ApiSettings", None, 9003),
}
BASE_ENV = {"GPUMETER_NODE_NAME": "gpu-node-1"}


def _service(role: str, env: dict[str, str], argv=()):
    from gpumeter import cli

    module_name, class_name, _client, _port = ROLES[role]
    cls = getattr(__import__(module_name, fromlist=[class_name]), class_name)
    args = cli.build_parser(role).parse_args([role, *argv])
    return load(cls, args, {**BASE_ENV, **env})


@pytest.mark.parametrize("role", ROLES)
def test_every_service_strips_env_values_and_takes_blank_as_unset(role):
    default_port = ROLES[role][3]
    assert _service(role, {}).metrics_port == default_port
    assert _service(role, {"GPUMETER_METRICS_PORT": " 9999\n"}).metrics_port == 9999
    assert _service(role, {"GPUMETER_METRICS_PORT": "   "}).metrics_port == default_port
    assert _service(role, {"GPUMETER_METRICS_PORT": "9999"}, ["--metrics-port", "9100"]).metrics_port == 9100
    with pytest.raises(SettingError) as caught:
        _service(role, {"GPUMETER_METRICS_PORT": "ninety"})
    assert caught.value.flag in ("--metrics-port", "--port")  # the api's port flag is --port (--metrics-port too)
    assert "GPUMETER_METRICS_PORT" in str(caught.value) and caught.value.flag in str(caught.value)
    assert caught.value.value == "ninety"


@pytest.mark.parametrize("role", [role for role, (_m, _c, client, _p) in ROLES.items() if client])
def test_every_service_has_one_client_id_rule(role):
    assert _service(role, {}).kafka.client_id == ROLES[role][2]
    assert _service(role, {"GPUMETER_KAFKA_CLIENT_ID": " ops-1 "}).kafka.client_id == "ops-1"
    # An explicit id equal to the library default is still the operator's choice.
    assert _service(role, {"GPUMETER_KAFKA_CLIENT_ID": "gpumeter"}).kafka.client_id == "gpumeter"
    with pytest.raises(SettingError, match="GPUMETER_KAFKA_CLIENT_ID"):
        _service(role, {"GPUMETER_KAFKA_CLIENT_ID": "two words"})


@pytest.mark.parametrize("role", [role for role, (_m, _c, client, _p) in ROLES.items() if client])
def test_every_service_keeps_the_sasl_password_out_of_its_start_up_line(role):
    env = {"GPUMETER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "GPUMETER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
           "GPUMETER_KAFKA_SASL_USERNAME": "meter", "GPUMETER_KAFKA_SASL_PASSWORD": TOKEN}
    settings = _service(role, env)
    assert settings.kafka.sasl_password == TOKEN
    line = json.dumps(settings.describe())
    assert TOKEN not in line and TOKEN not in repr(settings)
    assert settings.describe()["kafka"]["sasl_password"] == SECRET_MARK


def test_the_configuration_page_is_the_declared_settings():
    """docs/configuration.md's tables are generated from the declarations (python -m gpumeter.commands.config_doc)
    and list every variable every role's settings read."""
    from gpumeter.commands import config_doc
    from tests.unit.deploy import SERVICE_ROLES, variables_read_by

    page = config_doc.PAGE.read_text(encoding="utf-8")
    assert config_doc.render(page) == page, "docs/configuration.md is stale: run python -m gpumeter.commands.config_doc"
    guard_config = {name for name in variables_read_by("guard") if name.startswith("GPUMETER_GUARD_")} - \
        env_variables(__import__("services.guard.settings", fromlist=["GuardSettings"]).GuardSettings)
    for role in SERVICE_ROLES:
        for name in variables_read_by(role) - guard_config:
            assert f"`{name}`" in page, f"{name} ({role}) is not on docs/configuration.md"
