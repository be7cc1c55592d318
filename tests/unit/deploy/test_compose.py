"""docker-compose.yml: valid under the Compose Specification's JSON schema, and consistent with the code it runs.

No Docker engine is needed: the file is validated against the vendored schema (compose-spec.json, provenance in
compose-spec.md), then every gpumeter container's command line and environment are put through the real CLI
parser and settings functions, so a misspelt flag, a wrong port or a variable no code reads fails here.
Variables are interpolated as Compose does with nothing set (``${VAR:-default}`` takes its default).
"""

from __future__ import annotations

import copy
import json
import re
import urllib.parse
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import pytest
import yaml

from gpumeter.cli import build_parser
from gpumeter.health import HEALTH_PATH
from gpumeter.settings import KafkaSettings
from simulator.scenario import load_scenario
from tests.unit.deploy import (
    NVIDIA_RUNTIME_VARIABLES,
    REPO_ROOT,
    OPTIONAL_SERVICE_ROLES,
    SERVICE_ROLES,
    role_of,
    settings_for,
    variables_read_by,
)

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
SCHEMA_FILE = Path(__file__).with_name("compose-spec.json")
DOCKERFILE = REPO_ROOT / "Dockerfile"
KAFKA_POM = REPO_ROOT / "gpumeter" / "devtools" / "kafka-pom.xml"
IMAGE_WORKDIR_SCENARIOS = "/app/scenarios/"

_INTERPOLATION_RE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-)(?P<default>[^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation over a loaded document: ``$$``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``.

    Any other ``$`` form (``${VAR:?err}``, bare ``$VAR``) raises, so the file keeps to the forms checked here.
    """
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group("name"), match.group("op"), match.group("default")
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env[name] if name in env else default
        return env.get(name, "")

    result = _INTERPOLATION_RE.sub(substitute, value)
    leftover = _INTERPOLATION_RE.sub("", value)
    if "$" in leftover:
        raise AssertionError(f"unsupported interpolation in {value!r}")
    return result


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    return interpolate(raw_compose, {})


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def gpumeter_image(compose: dict) -> str:
    """The image name the Dockerfile build is tagged with (the services that carry ``build``)."""
    images = {s["image"] for s in compose["services"].values() if "build" in s}
    assert len(images) == 1, f"one image built from the Dockerfile, got {images}"
    return images.pop()


def gpumeter_services(compose: dict) -> dict[str, dict]:
    image = gpumeter_image(compose)
    return {name: s for name, s in compose["services"].items() if s.get("image") == image}


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def healthcheck_url(service: dict) -> urllib.parse.SplitResult:
    """The URL the service's python -c healthcheck fetches (its code is compiled to prove it is Python)."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], f"healthcheck is not a python -c probe: {test}"
    compile(test[3], "<healthcheck>", "exec")
    urls = re.findall(r"https?://[^'\"]+", test[3])
    assert len(urls) == 1, f"healthcheck should fetch exactly one URL: {test[3]}"
    return urllib.parse.urlsplit(urls[0])


def test_compose_file_validates_against_the_compose_specification(raw_compose, compose, validator):
    for document in (raw_compose, compose):
        errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_the_schema_rejects_what_compose_would_reject(compose, validator):
    """The vendored schema is strict enough to matter: a misspelt key and a bad depends_on condition fail it."""
    misspelt = copy.deepcopy(compose)
    misspelt["services"]["billing"]["helthcheck"] = misspelt["services"]["billing"].pop("healthcheck")
    assert any("helthcheck" in e.message for e in validator.iter_errors(misspelt))

    bad_condition = copy.deepcopy(compose)
    bad_condition["services"]["billing"]["depends_on"]["postgres"]["condition"] = "service_ready"
    assert list(validator.iter_errors(bad_condition))


def test_one_image_built_from_the_dockerfile_runs_every_gpumeter_service(compose):
    image = gpumeter_image(compose)
    services = gpumeter_services(compose)
    for name, service in services.items():
        assert service.get("build") in (".", {"context": "."}), f"{name} does not build the repository's Dockerfile"
    roles = {role_of(service["command"]) for service in services.values()}
    wanted = set(SERVICE_ROLES) - OPTIONAL_SERVICE_ROLES
    assert wanted | {"topics"} <= roles, f"missing roles in compose: {wanted - roles}"
    assert set(compose["services"]) - set(services) == {"kafka", "postgres"}, f"only {image} and the two peers"


def test_every_gpumeter_command_parses_and_builds_its_settings(compose):
    for name, service in gpumeter_services(compose).items():
        env = environment(service)
        settings = settings_for(service["command"], env)
        if role_of(service["command"]) in ("api", "ledger"):
            continue  # no Kafka: they use the ledger only (test_the_api_reads_billings_ledger, ..._ledger_retention_...)
        kafka = settings if isinstance(settings, KafkaSettings) else settings.kafka
        host, _, port = kafka.bootstrap_servers.partition(":")
        assert host in compose["services"], f"{name}: bootstrap host {host!r} is not a compose service"
        advertised = compose["services"][host]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
        assert f"://{host}:{port}" in advertised, f"{name}: {kafka.bootstrap_servers} is not advertised by {host}"


def test_every_variable_set_on_a_gpumeter_service_is_read_by_its_code(compose):
    for name, service in gpumeter_services(compose).items():
        role = role_of(service["command"])
        unknown = set(environment(service)) - variables_read_by(role) - NVIDIA_RUNTIME_VARIABLES
        assert not unknown, f"{name} ({role}) sets variables no gpumeter code reads: {sorted(unknown)}"


def test_long_running_services_have_healthchecks_on_the_port_they_serve(compose):
    for name, service in gpumeter_services(compose).items():
        role = role_of(service["command"])
        if role not in SERVICE_ROLES:
            continue
        settings = settings_for(service["command"], environment(service))
        url = healthcheck_url(service)
        # The liveness endpoint (gpumeter.health): the loop goes round, not only HTTP answering.
        assert url.hostname in ("127.0.0.1", "localhost") and url.path == HEALTH_PATH, f"{name}: probes {url}"
        assert url.port == settings.metrics_port, (
            f"{name}: the healthcheck probes port {url.port}, the service serves /metrics on {settings.metrics_port}")
    for name in ("kafka", "postgres"):
        assert compose["services"][name]["healthcheck"]["test"], f"{name} has no healthcheck"


def test_depends_on_targets_exist_and_wait_for_readiness_without_cycles(compose):
    services = compose["services"]
    for name, service in services.items():
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on {target!r}, which is not a service"
            assert target != name
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no check"
            elif condition == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} is waited on to finish but restarts"
            else:
                pytest.fail(f"{name} -> {target}: condition {condition!r} does not wait for readiness")
    _assert_acyclic(services)


def _assert_acyclic(services: dict) -> None:
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "active", f"depends_on cycle: {' -> '.join(path + (name,))}"
        state[name] = "active"
        for target in services[name].get("depends_on") or {}:
            visit(target, path + (name,))
        state[name] = "done"

    for name in services:
        visit(name, ())


def test_services_start_after_kafka_the_topics_and_their_databases(compose):
    services = compose["services"]
    topics = [n for n, s in gpumeter_services(compose).items() if role_of(s["command"]) == "topics"]
    assert len(topics) == 1
    assert services[topics[0]]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name, service in gpumeter_services(compose).items():
        role = role_of(service["command"])
        if role not in SERVICE_ROLES:
            continue
        if role == "api":  # no topics of its own: it waits for billing, which waits for them and the ledger
            assert service["depends_on"]["billing"]["condition"] == "service_healthy", name
            continue
        assert service["depends_on"][topics[0]]["condition"] == "service_completed_successfully", name
        settings = settings_for(service["command"], environment(service))
        if role == "billing":
            ledger_host = urllib.parse.urlsplit(settings.ledger_url).hostname
            assert ledger_host in services, f"billing's ledger host {ledger_host!r} is not a compose service"
            assert service["depends_on"][ledger_host]["condition"] == "service_healthy"


def test_the_ledger_retention_loops_over_billings_ledger_after_billing_migrated_it(compose):
    services = gpumeter_services(compose)
    (retention,) = [s for s in services.values() if role_of(s["command"]) == "ledger"]
    (billing,) = [s for s in services.values() if role_of(s["command"]) == "billing"]
    assert retention["depends_on"]["billing"]["condition"] == "service_healthy"
    settings = settings_for(retention["command"], environment(retention))
    assert settings.ledger_url == settings_for(billing["command"], environment(billing)).ledger_url
    assert settings.days() == {"minute": 14, "hour": 92, "day": 400}
    assert retention["command"][:2] == ["ledger", "retention"] and "--every" in retention["command"]


def test_restart_policies(compose):
    for name, service in compose["services"].items():
        command = service.get("command")
        one_shot = bool(command) and service.get("image") == gpumeter_image(compose) and command[0] == "topics"
        expected = {"no"} if one_shot else {"unless-stopped", "always", "on-failure"}
        assert service.get("restart") in expected, f"{name}: restart {service.get('restart')!r}"


def test_the_api_reads_billings_ledger_after_billing_migrated_it(compose):
    services = gpumeter_services(compose)
    (api,) = [s for s in services.values() if role_of(s["command"]) == "api"]
    (billing,) = [s for s in services.values() if role_of(s["command"]) == "billing"]
    assert settings_for(api["command"], environment(api)).ledger_url == settings_for(
        billing["command"], environment(billing)).ledger_url
    assert api["depends_on"]["billing"]["condition"] == "service_healthy"
    assert "KAFKA_BOOTSTRAP_SERVERS" not in environment(api)


def test_billing_ledger_is_the_compose_postgres_with_its_credentials(compose):
    billing = next(s for s in gpumeter_services(compose).values() if role_of(s["command"]) == "billing")
    url = urllib.parse.urlsplit(settings_for(billing["command"], environment(billing)).ledger_url)
    postgres = compose["services"][url.hostname]["environment"]
    assert url.scheme.startswith("postgresql")
    assert (url.username, url.password, url.path.lstrip("/")) == (
        postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"])


def test_collectors_simulate_every_node_of_their_scenario_from_the_image(compose):
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^COPY scenarios /app/scenarios\s*$", dockerfile, re.M), "the image lacks /app/scenarios"
    by_scenario: dict[Path, set[str]] = {}
    for name, service in gpumeter_services(compose).items():
        if role_of(service["command"]) != "collector":
            continue
        settings = settings_for(service["command"], environment(service))
        assert settings.simulate is not None, f"{name} does not run in simulate mode"
        assert str(settings.simulate).startswith(IMAGE_WORKDIR_SCENARIOS)
        source = REPO_ROOT / "scenarios" / str(settings.simulate)[len(IMAGE_WORKDIR_SCENARIOS):]
        by_scenario.setdefault(source, set()).add(settings.node_name)
    assert by_scenario, "no collector in compose"
    for source, nodes in by_scenario.items():
        scenario = load_scenario(source)
        assert nodes == {node.name for node in scenario.nodes}, f"{source.name}: collectors for {sorted(nodes)}"


def test_time_scale_defaults_faster_than_real_time_and_comes_from_the_environment(raw_compose, compose):
    overridden = interpolate(raw_compose, {"GPUMETER_TIME_SCALE": "2.5"})
    collectors = [n for n, s in gpumeter_services(compose).items() if role_of(s["command"]) == "collector"]
    assert collectors
    for name in collectors:
        default = compose["services"][name]
        assert settings_for(default["command"], environment(default)).time_scale > 1
        again = overridden["services"][name]
        assert settings_for(again["command"], environment(again)).time_scale == 2.5


def test_kafka_is_the_broker_version_the_tests_run(compose):
    pom = ElementTree.parse(KAFKA_POM).getroot()
    namespace = {"m": pom.tag.partition("}")[0].lstrip("{")} if pom.tag.startswith("{") else {}
    version = pom.find("m:properties/m:kafka.version" if namespace else "properties/kafka.version", namespace).text
    image = compose["services"]["kafka"]["image"]
    assert image == f"apache/kafka:{version}"
    env = compose["services"]["kafka"]["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}, "KRaft combined mode"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"


def test_the_commands_documented_in_the_compose_file_parse(compose):
    """The `docker compose exec <service> gpumeter ...` lines of the file's header name a gpumeter service and
    a command line the CLI accepts."""
    documented = re.findall(r"^#\s+docker compose exec (\S+) gpumeter (.+?)(?:\s+#.*)?$",
                            COMPOSE_FILE.read_text(encoding="utf-8"), re.M)
    assert documented
    services = gpumeter_services(compose)
    for service, command_line in documented:
        assert service in services, f"{service} is not a gpumeter service"
        command = command_line.split()
        role_of(command)
        try:
            build_parser(command[0]).parse_args(command)
        except SystemExit as exc:
            raise AssertionError(f"gpumeter rejects the documented command {command_line!r}") from exc
