"""What ``gpumeter run`` runs: its validated settings (``RunConfig``), the scenario's clock, and the processes
with their command lines (``service_specs``). Pure: nothing here starts anything."""

from __future__ import annotations

import importlib
import math
import secrets
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from gpumeter.clock import iso_utc
from gpumeter.errors import ConfigError
from gpumeter.settings import LOOPBACK_METRICS_ADDRESS

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_SCENARIO = Path("scenarios") / "demo.yaml"
DEFAULT_TIME_SCALE = 10.0
DEFAULT_WINDOW_SECONDS = 60
DEFAULT_GRACE_SECONDS = 10
DEFAULT_PARTITIONS = 3
DEFAULT_PROGRESS_SECONDS = 5.0
# With no --duration the allowed clock skew covers this much wall time at the run's speed-up.
UNBOUNDED_RUN_SKEW_WALL_SECONDS = 7 * 86_400
SKEW_MARGIN_SECONDS = 300
# Faust keeps a dead worker's partitions for the session timeout; a short one lets a restarted attributor resume
# quickly (the broker allows 6 s and up).
ATTRIBUTOR_SESSION_TIMEOUT_SECONDS = 10
# --metrics-port N gives the processes N, N+1, ...: room below 65535 for a few hundred of them.
MAX_METRICS_PORT = 65_000


@dataclass(frozen=True)
class RunConfig:
    """What ``gpumeter run`` was asked to do, validated."""

    scenario: Path
    workdir: Path
    run_id: str
    duration_seconds: float | None = None
    time_scale: float = DEFAULT_TIME_SCALE
    window_seconds: int = DEFAULT_WINDOW_SECONDS
    grace_seconds: int = DEFAULT_GRACE_SECONDS
    live: bool = True
    bootstrap_servers: str | None = None
    topic_prefix: str | None = None
    partitions: int = DEFAULT_PARTITIONS
    keep_topics: bool = False
    progress_seconds: float = DEFAULT_PROGRESS_SECONDS
    team_label: str = "team"
    sharing: str | None = None  # billing's --sharing (None: billing's own default, $GPUMETER_BILLING_SHARING)
    # The first of consecutive loopback ports the processes serve /metrics on, in service_specs' order; 0: none.
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if self.duration_seconds is not None and self.duration_seconds <= 0:
            raise ConfigError("--duration must be > 0 seconds")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ConfigError("--time-scale must be a positive number")
        if self.window_seconds < 1:
            raise ConfigError("--window-seconds must be >= 1")
        if self.grace_seconds < 0:
            raise ConfigError("--grace-seconds must be >= 0")
        if self.partitions < 1:
            raise ConfigError("--partitions must be >= 1")
        if self.progress_seconds <= 0:
            raise ConfigError("--progress-seconds must be > 0")
        if not 0 <= self.metrics_port <= MAX_METRICS_PORT:
            raise ConfigError(f"--metrics-port must be 0 (none) or a port up to {MAX_METRICS_PORT}")
        if not self.scenario.is_file():
            raise ConfigError(f"scenario {self.scenario} does not exist")
        if self.sharing is not None:
            from services.billing.sharing import SharingPolicy

            object.__setattr__(self, "sharing", SharingPolicy.parse(self.sharing).describe())

    @property
    def prefix(self) -> str:
        return self.topic_prefix if self.topic_prefix is not None else f"run-{self.run_id}."

    @property
    def owns_topics(self) -> bool:
        """Topics under a prefix the run made up are the run's own to delete."""
        return self.topic_prefix is None

    @property
    def ledger_path(self) -> Path:
        return self.workdir / "ledger.sqlite3"

    @property
    def ledger_url(self) -> str:
        return f"sqlite:///{self.ledger_path}"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"


def new_run_id(now_ms: int) -> str:
    """``20261129-174015-3fa2``: the UTC start time and 16 random bits (two runs in one second stay apart)."""
    stamp = datetime.fromtimestamp(now_ms / 1000, tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def simulated_start_ms(now_ms: int, window_seconds: int) -> int:
    """The first window boundary at or after ``now_ms``: the first window is whole and never in the past."""
    window_ms = window_seconds * 1000
    return -(-now_ms // window_ms) * window_ms


def clock_skew_allowance_seconds(time_scale: float, duration_seconds: float | None, window_seconds: int) -> int:
    """How far ahead of the wall clock simulated ticks get: the start (up to one window ahead) plus what the
    speed-up gains over the run (``UNBOUNDED_RUN_SKEW_WALL_SECONDS`` of wall time when the run has no end), plus a
    margin. At most the attributor's default (120 s) is never asked for less."""
    wall_seconds = duration_seconds if duration_seconds is not None else UNBOUNDED_RUN_SKEW_WALL_SECONDS
    gained = max(time_scale - 1.0, 0.0) * wall_seconds
    return max(120, math.ceil(window_seconds + gained + SKEW_MARGIN_SECONDS))


def shifted_scenario_text(text: str, start_ms: int) -> str:
    """The scenario YAML ``text`` with its ``start`` set to ``start_ms`` (everything else as it was)."""
    import yaml

    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"scenario is not YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError("a scenario is a YAML mapping")
    document["start"] = iso_utc(start_ms)
    return yaml.safe_dump(document, sort_keys=False)


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the run. ``data_dir_flag``: a flag given a fresh folder per start (``<workdir>/<name>/N``);
    ``restart``: start it again when it exits unexpectedly; ``stop_group``: stopped in ascending groups."""

    name: str
    argv: tuple[str, ...]
    restart: bool
    stop_group: int
    data_dir_flag: str | None = None
    drain_group: str | None = None  # consumer group that must catch up before this process is stopped
    drain_topics: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set for this process on top of the run's environment


def gpumeter_argv() -> tuple[str, ...]:
    """How to run ``gpumeter`` with this interpreter (no dependency on the console script being on PATH)."""
    return (sys.executable, "-m", "gpumeter.cli")


def guard_available() -> bool:
    """True when this installation has the guard service and its ``gpumeter guard`` command."""
    from gpumeter.cli import SUBCOMMANDS

    entry = SUBCOMMANDS.get("guard")
    if entry is None:
        return False
    try:
        importlib.import_module(entry[0])
    except ImportError:
        return False
    return True


def service_specs(config: RunConfig, node_names: Sequence[str], scenario_path: Path, bootstrap_servers: str,
                  skew_seconds: int, with_guard: bool) -> tuple[ServiceSpec, ...]:
    """Every process of the run with its command line: the collectors in ``node_names``' order, the attributor,
    billing, the guard. With ``config.metrics_port`` each serves /metrics on 127.0.0.1, on consecutive ports in
    that order; without, none does."""
    from schemas.catalog import TopicCatalog
    from services.attributor.settings import APP_ID_SUFFIX

    prefix = config.prefix
    catalog = TopicCatalog(prefix=prefix)
    kafka = ("--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix)
    # By default no metrics servers (the live view reads the topics); with --metrics-port (a local Prometheus, the
    # Prometheus integration test) one port each. Either way only this machine could reach them.
    next_port = iter(range(config.metrics_port, config.metrics_port + 65_536)) if config.metrics_port else None

    def metrics() -> tuple[str, ...]:
        port = next(next_port) if next_port is not None else 0
        return ("--metrics-port", str(port), "--metrics-address", LOOPBACK_METRICS_ADDRESS)

    base = gpumeter_argv()
    specs = [
        ServiceSpec(
            name=f"collector {node}",
            argv=(*base, "collector", "--node", node, "--simulate", str(scenario_path),
                  "--time-scale", f"{config.time_scale:g}", *metrics(), *kafka),
            restart=False,
            stop_group=0,
        )
        for node in node_names
    ]
    # A time-scaled run's ticks read ahead of the broker's clock by design (the simulation runs faster than the wall
    # clock), so the broker's append time is no reference for them: no clock correction, and no clock_skew
    # violation, within what the speed-up gains over the run.
    scaled = config.time_scale != 1.0
    skew_threshold = ("--clock-skew-threshold-seconds", str(skew_seconds)) if scaled else ()
    guard_env = (("GPUMETER_GUARD_CLOCK_SKEW_THRESHOLD_SECONDS", str(skew_seconds)),) if scaled else ()
    specs.append(ServiceSpec(
        name="attributor",
        argv=(*base, "attributor", "--window-seconds", str(config.window_seconds),
              "--grace-seconds", str(config.grace_seconds), "--max-clock-skew-seconds", str(skew_seconds),
              *skew_threshold,
              "--session-timeout-seconds", str(ATTRIBUTOR_SESSION_TIMEOUT_SECONDS), *metrics(),
              "--partitions", str(config.partitions), *kafka),
        restart=True,
        stop_group=1,
        data_dir_flag="--data-dir",
        drain_group=f"{prefix}{APP_ID_SUFFIX}",
        drain_topics=(catalog.node_samples, catalog.pod_events),
    ))
    billing_group = f"{prefix}gpumeter-billing"
    sharing = ("--sharing", config.sharing) if config.sharing is not None else ()
    specs.append(ServiceSpec(
        name="billing",
        argv=(*base, "billing", "--ledger-url", config.ledger_url, "--group", billing_group,
              "--team-label", config.team_label, *sharing, *metrics(), "--partitions", str(config.partitions),
              "--max-clock-skew-seconds", str(skew_seconds), *kafka),
        restart=True,
        stop_group=2,
        drain_group=billing_group,
        drain_topics=(catalog.node_window_shares,),
    ))
    if with_guard:
        guard_group = f"{prefix}gpumeter-guard"
        specs.append(ServiceSpec(
            name="guard",
            argv=(*base, "guard", "--group", guard_group, "--state", str(config.workdir / "guard" / "state.json"),
                  *metrics(), "--partitions", str(config.partitions),
                  "--max-clock-skew-seconds", str(skew_seconds), *kafka),
            restart=True,
            stop_group=3,
            env=guard_env,
            drain_group=guard_group,
            drain_topics=(catalog.node_window_shares, catalog.node_window_costs),
        ))
    return tuple(specs)


