"""Every ``GPUMETER_*`` variable the deployment files and the docs name is one a settings loader reads.

Containers' environments are checked role by role against the loader of the role they run
(``check_commands_and_settings``, ``test_every_variable_set_on_a_gpumeter_service_is_read_by_its_code``). This
checks every mention anywhere in deploy/, docker-compose.yml, docs/ and README.md -- comments, tables, Helm values
-- so a renamed or dropped variable cannot stay documented: each is declared by a service's settings (or the guard
config), or is one of the few read elsewhere, listed here with the file that reads it.
"""

from __future__ import annotations

import re

from tests.unit.deploy import REPO_ROOT, SERVICE_ROLES, env_variables, variables_read_by

DOCUMENTED_IN = ("deploy", "docker-compose.yml", "docs", "README.md")
_NAME = re.compile(r"GPUMETER_[A-Z0-9_]*[A-Z0-9_]")

# Read by something other than a service's settings: variable -> the file that reads it.
READ_ELSEWHERE = {
    "GPUMETER_JAVA": "gpumeter/devtools/java.py",
    "GPUMETER_PG_BIN": "gpumeter/devtools/postgres.py",
    "GPUMETER_ALERTMANAGER_BIN": "gpumeter/devtools/alertmanager.py",
    "GPUMETER_WHEELS_DIR": "gpumeter/devtools/cache.py",
    "GPUMETER_MAVEN_REPOSITORY": "gpumeter/devtools/kafka_jars.py",
    "GPUMETER_CACHE_DIR": "gpumeter/devtools/gotools.py",
    # Interpolated by docker compose itself into the database's and billing's environment.
    "GPUMETER_POSTGRES_PASSWORD": "docker-compose.yml",
    # The benchmark's own choice of billing's deployment in the stream (no service reads it).
    "GPUMETER_BENCH_STREAM_LEDGER": "bench/stream.py",
    "GPUMETER_BENCH_STREAM_BILLING_INSTANCES": "bench/stream.py",
}


# Commands that are not deployed services but read their settings through the one loader: module -> class.
COMMAND_SETTINGS = {
    "pipeline.record": "RecordSettings",  # gpumeter record
    "services.billing.retention": "RetentionSettings",  # gpumeter ledger retention
}


def _read_by_commands() -> frozenset[str]:
    names: set[str] = set()
    for module_name, class_name in COMMAND_SETTINGS.items():
        module = __import__(module_name, fromlist=[class_name])
        names |= set(env_variables(getattr(module, class_name)))
    return frozenset(names)


def _mentions() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for entry in DOCUMENTED_IN:
        root = REPO_ROOT / entry
        paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for name in _NAME.findall(text):
                found.setdefault(name, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def test_every_documented_variable_is_read_by_a_loader():
    loaded = frozenset().union(*(variables_read_by(role) for role in [*SERVICE_ROLES, "topics"]),
                               _read_by_commands())
    mentions = _mentions()
    assert len(mentions) > 40, "the scan found too few names to be looking in the right places"
    unknown = {}
    for name, where in mentions.items():
        if name.endswith("_"):  # a family: GPUMETER_GUARD_<FIELD>, GPUMETER_BILLING_LEDGER_RETRY_*_SECONDS
            if not any(known.startswith(name) for known in loaded):
                unknown[name] = where
        elif name not in loaded and name not in READ_ELSEWHERE:
            unknown[name] = where
    assert not unknown, f"documented but read by no settings loader: {unknown}"


def test_the_variables_read_elsewhere_are_read_there():
    for name, reader in READ_ELSEWHERE.items():
        source = (REPO_ROOT / reader).read_text(encoding="utf-8")
        # A string literal in Python (the env.get argument or its constant), ${NAME} interpolation in compose.
        assert f'"{name}"' in source or f"${{{name}" in source, f"{reader} does not read {name}"


def test_every_service_setting_documented_per_role_is_read_by_that_roles_loader():
    """Where a docs table row names the role, the variable is that role's (docs/reliability.md's table)."""
    table = (REPO_ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(GPUMETER_[A-Z0-9_]+)`[^|]*\| ([^|]+) \|", table, re.MULTILINE)
    assert len(rows) >= 6
    for name, roles_text in rows:
        roles = [role for role in SERVICE_ROLES if re.search(rf"\b{role}\b", roles_text)]
        for role in roles:
            assert name in variables_read_by(role), f"docs/reliability.md: {role} does not read {name}"
