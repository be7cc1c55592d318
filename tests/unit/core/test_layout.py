"""The layout holds: no service imports another service, ``schemas/`` imports nothing of the rest, the shared
library ``gpumeter/`` imports no service, nothing below ``pipeline/`` imports it, and the simulator imports only the
PodResources protocol it serves.

Every ``import`` and ``from ... import`` of every module is read with ``ast`` (function-level imports included,
since a lazy import is still a dependency), relative imports resolved against the module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SERVICES = ("attributor", "billing", "collector", "guard")


def _module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = REPO) -> set[str]:
    """Every module ``path`` (under ``root``) imports: absolute dotted names; ``from a import b`` counts as ``a``
    and ``a.b``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _modules(top: str) -> list[Path]:
    return sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


def _violations(paths, forbidden) -> list[str]:
    out = []
    for path in paths:
        for name in sorted(imports_of(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden(path)):
                out.append(f"{path.relative_to(REPO)} imports {name}")
    return out


@pytest.mark.parametrize("service", SERVICES)
def test_no_service_imports_another_service(service):
    others = [f"services.{s}" for s in SERVICES if s != service]
    assert _violations(_modules(f"services/{service}"), lambda _: others + ["pipeline"]) == []


def test_schemas_import_nothing_of_gpumeter_the_services_or_the_pipeline():
    forbidden = ["gpumeter", "services", "pipeline", "simulator", "bench", "tests"]
    assert _violations(_modules("schemas"), lambda _: forbidden) == []


def test_the_shared_library_imports_no_service():
    library = [p for p in _modules("gpumeter")
               if "commands" not in p.relative_to(REPO).parts and p.name != "cli.py"]
    assert _violations(library, lambda _: ["services", "pipeline", "simulator"]) == []


def test_the_simulator_imports_no_service_but_the_kubelet_protocol_it_serves():
    """The simulator stands in for the hardware and the node's peers: it may speak the PodResources protocol (the
    generated stubs its fake kubelet serves), and nothing else of the services or the pipeline."""
    allowed = "services.collector.podresources"

    def forbidden(_path):
        return ["pipeline", "services.attributor", "services.billing", "services.guard"]

    assert _violations(_modules("simulator"), forbidden) == []
    collector = [name for path in _modules("simulator") for name in imports_of(path)
                 if name.startswith("services.collector") and not name.startswith(allowed)]
    assert collector == []


def test_the_walk_sees_imports_of_every_form(tmp_path):
    """The checker itself: absolute, from-, function-level and relative imports are all found."""
    package = tmp_path / "services" / "billing"
    package.mkdir(parents=True)
    probe = package / "probe.py"
    probe.write_text("import services.guard.engine\nfrom services.attributor import app\n"
                     "def f():\n    from . import ledger\n    from ..guard import rules\n", encoding="utf-8")
    found = imports_of(probe, tmp_path)
    assert {"services.guard.engine", "services.attributor", "services.attributor.app", "services.billing.ledger",
            "services.guard.rules"} <= found


# Where a Kafka consumer may be built: the one driver, the attributor's Faust driver (its rebuild reads a range of
# a partition directly), and the read-only tools (billing's report of what was emitted, the guard's violations
# CLI, `gpumeter run`'s live view).
CONSUMER_OWNERS = {"gpumeter/kafka/driver.py", "services/attributor/app.py", "services/billing/emitted.py",
                   "services/guard/violations_cli.py", "gpumeter/commands/run/feed.py"}
# Each consuming service's entry point and the runner module it must drive its processor through.
SERVICE_RUNNERS = {"services/billing/main.py": ("gpumeter.stream.runner", "gpumeter.kafka.driver"),
                   "services/guard/main.py": ("gpumeter.stream.runner", "gpumeter.kafka.driver"),
                   "services/attributor/app.py": ("gpumeter.stream.runner",),
                   "pipeline/replay.py": ("gpumeter.stream.runner", "gpumeter.stream.memory"),
                   "pipeline/record.py": ("gpumeter.stream.runner", "gpumeter.kafka.driver")}


def test_every_consuming_service_runs_its_processor_on_the_one_runner():
    """No service loop of its own: billing and the guard run on the runner under the Kafka driver, the attributor
    under its Faust driver, replay under the in-memory one; nothing else builds a Kafka consumer."""
    for path, runners in SERVICE_RUNNERS.items():
        found = imports_of(REPO / path)
        assert set(runners) <= found, (path, sorted(set(runners) - found))
    builders = sorted(str(p.relative_to(REPO)) for top in ("services", "gpumeter", "pipeline") for p in _modules(top)
                      if "AIOKafkaConsumer(" in p.read_text(encoding="utf-8"))
    assert set(builders) <= CONSUMER_OWNERS, builders
    assert "gpumeter/kafka/driver.py" in builders


TRANSPORTS = ("aiokafka", "faust", "kafka", "confluent_kafka", "gpumeter.kafka")


def test_the_processing_contract_imports_no_transport():
    """``gpumeter/stream`` (the contract, the runner, the dead letter of a ``RawMessage``, the in-memory broker) is
    the transport-free layer every driver builds on: it imports no Kafka client and nothing of ``gpumeter.kafka``,
    neither itself nor through what it imports."""
    import subprocess
    import sys

    assert _violations(_modules("gpumeter/stream"), lambda _: list(TRANSPORTS)) == []
    modules = [_module_name(p) for p in _modules("gpumeter/stream")]
    probe = ("import importlib, sys\n"
             f"for m in {modules!r}: importlib.import_module(m)\n"
             f"print(sorted(k for k in sys.modules if any(k == t or k.startswith(t + '.') for t in {TRANSPORTS!r})))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_no_two_modules_of_a_service_import_each_other(service):
    """A service's modules form no import cycle of two (lazy imports counted): ``billing/export.py`` and
    ``billing/report.py`` did, each reaching into the other inside a function."""
    paths = _modules(f"services/{service}")
    names = {_module_name(p): p for p in paths}
    imported = {name: {m for m in imports_of(path) if m in names and m != name} for name, path in names.items()}
    cycles = sorted(f"{a} <-> {b}" for a, targets in imported.items() for b in targets
                    if a < b and a in imported.get(b, set()))
    assert cycles == []
