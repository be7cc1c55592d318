"""``gpumeter run``: the whole pipeline on this machine, as separate processes, with a live terminal view.

What it does, in order (each step prints a progress line):

1. **Kafka.** Without ``--bootstrap-servers`` the local development broker (``gpumeter.devtools.kafka_broker``,
   127.0.0.1:$GPUMETER_KAFKA_PORT, default 9092) is started, or reused when it already runs; the first run
   downloads Apache Kafka's pinned jars from Maven Central (44 MB, each checked against its pinned SHA-256). The
   broker is left running afterwards so the next run starts at once; ``make stop`` (``gpumeter broker stop``)
   stops it.
2. **Topics.** The catalog's topics under a prefix of the run's own (``run-<run id>.``, or ``--topic-prefix``), so
   that runs never see each other's records or consumer state.
3. **Scenario clock.** The scenario is copied into the workdir with its start moved to the first window boundary
   at or after now. The attributor windows by event time but also watches its own wall clock (it closes the
   windows of silent nodes by it and rejects ticks too far ahead of it), so simulated time starts at the present
   and runs ``--time-scale`` times faster; the attributor's allowed clock skew is widened to what that speed-up
   reaches (``clock_skew_allowance_seconds``).
4. **Processes**, each with its log in ``<workdir>/logs``: one ``gpumeter collector --simulate`` per scenario node,
   ``gpumeter attributor``, ``gpumeter billing`` (SQLite ledger ``<workdir>/ledger.sqlite3``) and ``gpumeter
   guard`` (when this installation has it). Each runs in a session of its own (a terminal's Ctrl-C reaches only
   this process, which stops them in order) and is sent SIGTERM by the kernel if this process dies (Linux
   parent-death signal), so nothing is left behind. The attributor, billing and the guard are restarted when they
   exit unexpectedly (backoff from 1 s doubling to 30 s), as Kubernetes would; a simulated collector is not (its
   simulated clock would start over). ``<workdir>/processes.json`` has each process's pid, state and restarts;
   ``<workdir>/run.json`` the run's settings (simulated start, topic prefix, ledger).
5. **The view** (``gpumeter.commands.live_view``) from the gpu-shares, costs, violations and dead-letters topics:
   live on a terminal (rich), else — or with ``--no-live`` — one progress line every ``--progress-seconds``.
6. **Stop** on Ctrl-C, SIGTERM or the end of ``--duration`` (counted from the start of the processes): collectors
   first; then the attributor once its consumer group has caught up with its input (or after ``DRAIN_SECONDS``),
   billing once it has, then the guard. Each gets SIGTERM and is killed after ``STOP_TIMEOUT_SECONDS``. A second
   Ctrl-C kills everything at once.
7. **Report**: ``gpumeter report`` by namespace and by label:team over the run's windows, reconciled to the node
   bills (with ``--sharing``, each group's cost split into its direct and shared parts); where the ledger and the
   logs are, and the command that prints the report again. Topics of a prefix the
   run made up are deleted at the end unless ``--keep-topics``.

Exit code: 0 when every process stopped cleanly and the report reconciles, 1 otherwise, 2 for unusable settings.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.settings import LOOPBACK_METRICS_ADDRESS, KafkaSettings

from gpumeter.commands import live_view
from gpumeter.commands.live_view import ProcessHealth, ProcessState, ViewState

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SCENARIO = Path("scenarios") / "demo.yaml"
DEFAULT_TIME_SCALE = 10.0
DEFAULT_WINDOW_SECONDS = 60
DEFAULT_GRACE_SECONDS = 10
DEFAULT_PARTITIONS = 3
DEFAULT_PROGRESS_SECONDS = 5.0
# With no --duration the allowed clock skew covers this much wall time at the run's speed-up.
UNBOUNDED_RUN_SKEW_WALL_SECONDS = 7 * 86_400
SKEW_MARGIN_SECONDS = 300
STOP_TIMEOUT_SECONDS = 30.0
DRAIN_SECONDS = 20.0
RESTART_BACKOFF_INITIAL_SECONDS = 1.0
RESTART_BACKOFF_MAX_SECONDS = 30.0
# A process that ran this long before it exited starts its backoff over.
RESTART_BACKOFF_RESET_SECONDS = 60.0
# Faust keeps a dead worker's partitions for the session timeout; a short one lets a restarted attributor resume
# quickly (the broker allows 6 s and up).
ATTRIBUTOR_SESSION_TIMEOUT_SECONDS = 10
PR_SET_PDEATHSIG = 1


# ----------------------------------------------------------------------------------------------------------------
# Settings and the plan (pure)


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
    document["start"] = live_view.iso_utc(start_ms)
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
    """Every process of the run with its command line."""
    from schemas.catalog import TopicCatalog
    from services.attributor.settings import APP_ID_SUFFIX

    prefix = config.prefix
    catalog = TopicCatalog(prefix=prefix)
    kafka = ("--bootstrap-servers", bootstrap_servers, "--topic-prefix", prefix)
    # No metrics servers (the live view reads the topics); were a port set, only this machine could reach it.
    metrics = ("--metrics-port", "0", "--metrics-address", LOOPBACK_METRICS_ADDRESS)
    base = gpumeter_argv()
    specs = [
        ServiceSpec(
            name=f"collector {node}",
            argv=(*base, "collector", "--node", node, "--simulate", str(scenario_path),
                  "--time-scale", f"{config.time_scale:g}", *metrics, *kafka),
            restart=False,
            stop_group=0,
        )
        for node in node_names
    ]
    specs.append(ServiceSpec(
        name="attributor",
        argv=(*base, "attributor", "--window-seconds", str(config.window_seconds),
              "--grace-seconds", str(config.grace_seconds), "--max-clock-skew-seconds", str(skew_seconds),
              "--session-timeout-seconds", str(ATTRIBUTOR_SESSION_TIMEOUT_SECONDS), *metrics,
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
              "--team-label", config.team_label, *sharing, *metrics, "--partitions", str(config.partitions),
              "--max-clock-skew-seconds", str(skew_seconds), *kafka),
        restart=True,
        stop_group=2,
        drain_group=billing_group,
        drain_topics=(catalog.gpu_shares,),
    ))
    if with_guard:
        guard_group = f"{prefix}gpumeter-guard"
        specs.append(ServiceSpec(
            name="guard",
            argv=(*base, "guard", "--group", guard_group, "--state", str(config.workdir / "guard" / "state.json"),
                  *metrics, "--partitions", str(config.partitions),
                  "--max-clock-skew-seconds", str(skew_seconds), *kafka),
            restart=True,
            stop_group=3,
            drain_group=guard_group,
            drain_topics=(catalog.gpu_shares, catalog.costs),
        ))
    return tuple(specs)


def next_backoff_seconds(previous: float | None) -> float:
    """1 s, then doubling, at most ``RESTART_BACKOFF_MAX_SECONDS``."""
    if previous is None:
        return RESTART_BACKOFF_INITIAL_SECONDS
    return min(previous * 2, RESTART_BACKOFF_MAX_SECONDS)


# ----------------------------------------------------------------------------------------------------------------
# Processes


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the run's own stop is the only cleanup


class ManagedProcess:
    """One supervised process: started, watched (``check``), restarted by its spec's policy, stopped."""

    def __init__(self, spec: ServiceSpec, workdir: Path, log_dir: Path, env: Mapping[str, str]) -> None:
        self.spec = spec
        self.workdir = workdir
        self.log_path = log_dir / (spec.name.replace(" ", "-") + ".log")
        self.env = dict(env)
        self.process: subprocess.Popen | None = None
        self.state = ProcessState.STOPPED
        self.starts = 0
        self.restarts = 0
        self.exit_code: int | None = None
        self.started_at = 0.0
        self._backoff: float | None = None
        self._restart_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def argv(self) -> list[str]:
        argv = list(self.spec.argv)
        if self.spec.data_dir_flag:
            data_dir = self.workdir / self.spec.name.replace(" ", "-") / f"start-{self.starts}"
            data_dir.mkdir(parents=True, exist_ok=True)
            argv += [self.spec.data_dir_flag, str(data_dir)]
        return argv

    def start(self, now: float) -> None:
        argv = self.argv()
        with self.log_path.open("ab") as log:
            log.write(f"=== gpumeter run: start {self.starts} at {live_view.iso_utc(int(time.time() * 1000))}: "
                      f"{' '.join(argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.starts += 1
        self.state = ProcessState.RUNNING
        self.exit_code = None
        self.started_at = now
        self._restart_at = None

    def restart_in(self, now: float) -> float:
        """Seconds until a pending restart (0 when none is pending)."""
        return max(self._restart_at - now, 0.0) if self._restart_at is not None else 0.0

    def check(self, now: float) -> bool:
        """Notice an exit and apply the restart policy; start a due restart. True when something changed."""
        if self.state is ProcessState.RUNNING and self.process is not None:
            code = self.process.poll()
            if code is None:
                return False
            self.exit_code = code
            if self.spec.restart:
                if now - self.started_at >= RESTART_BACKOFF_RESET_SECONDS:
                    self._backoff = None
                self._backoff = next_backoff_seconds(self._backoff)
                self._restart_at = now + self._backoff
                self.state = ProcessState.RESTARTING
            else:
                self.state = ProcessState.FAILED
            return True
        if self.state is ProcessState.RESTARTING and self._restart_at is not None and now >= self._restart_at:
            self.restarts += 1
            self.start(now)
            return True
        return False

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM). A pending restart is cancelled: the process stays FAILED (its last run ended
        with an unexpected exit)."""
        if self.state is ProcessState.RESTARTING:
            self.state = ProcessState.FAILED
            return
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.state = ProcessState.STOPPING
        elif self.state is ProcessState.RUNNING and self.process is not None:
            self.exit_code = self.process.returncode
            self.state = ProcessState.FAILED if self.exit_code else ProcessState.STOPPED

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    async def stop(self, timeout_s: float = STOP_TIMEOUT_SECONDS) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit code (None if it never ran)."""
        self.terminate()
        if self.process is None:
            return None
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.process.poll() is None:
            self.process.kill()
            while self.process.poll() is None:
                await asyncio.sleep(0.05)
            self.exit_code = self.process.returncode
            self.state = ProcessState.FAILED  # did not stop when asked
            return self.exit_code
        if self.state is ProcessState.STOPPING:
            self.exit_code = self.process.returncode
            self.state = ProcessState.STOPPED if self.exit_code == 0 else ProcessState.FAILED
        return self.exit_code

    def health(self, now: float) -> ProcessHealth:
        uptime = now - self.started_at if self.state is ProcessState.RUNNING else 0.0
        return ProcessHealth(self.spec.name, self.pid, self.state, self.restarts, self.exit_code, uptime)

    def describe(self) -> dict[str, Any]:
        return {"name": self.spec.name, "pid": self.pid, "state": self.state.value, "restarts": self.restarts,
                "exit_code": self.exit_code, "log": str(self.log_path), "argv": list(self.spec.argv)}


def write_json_atomically(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# Kafka: the broker, topics, the view's feed, consumer lag


def ensure_broker(progress: Callable[[str], None], env: Mapping[str, str]) -> str:
    """The local development broker's bootstrap servers (127.0.0.1:$GPUMETER_KAFKA_PORT, default 9092), starting
    it when it is not running."""
    from gpumeter.devtools import kafka_broker

    progress("Kafka: checking Apache Kafka's pinned jars (the first run downloads them from Maven Central)...")
    try:
        port = int(env.get("GPUMETER_KAFKA_PORT") or "9092")
    except ValueError as exc:
        raise ConfigError(f"GPUMETER_KAFKA_PORT: {exc}") from exc
    try:
        kafka_broker.ensure_kafka_jars(log=progress)
        progress(f"Kafka: starting (or reusing) the local broker on 127.0.0.1:{port}...")
        code = kafka_broker.main(["start", "--port", str(port)])
    except kafka_broker.BrokerError as exc:
        raise GpumeterError(f"the local Kafka broker: {exc}") from exc
    if code != 0:
        raise GpumeterError(f"the local Kafka broker did not start (exit {code})")
    return f"127.0.0.1:{port}"


class TopicFeed:
    """Reads the view's topics from the beginning (no consumer group, nothing committed) and decodes them."""

    def __init__(self, kafka: KafkaSettings) -> None:
        from schemas.records import CostRecord, DeadLetter, GpuShare, Violation
        from schemas.typed import codec_for

        catalog = kafka.catalog
        self.kafka = kafka
        self.codecs = {
            catalog.gpu_shares: codec_for(GpuShare),
            catalog.costs: codec_for(CostRecord),
            catalog.violations: codec_for(Violation),
            catalog.dead_letters: codec_for(DeadLetter),
        }
        self.consumer = None
        self.undecodable = 0

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        self.consumer = AIOKafkaConsumer(
            *self.codecs, **self.kafka.client_kwargs(), group_id=None, auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await self.consumer.start()

    async def poll(self, timeout_ms: int = 200) -> list:
        """Decoded records that arrived, in partition order; undecodable ones are counted and skipped (the
        services dead-letter bad input; the view only shows)."""
        from gpumeter.errors import InvalidMessage

        assert self.consumer is not None
        batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=5000)
        records = []
        for tp, messages in batch.items():
            codec = self.codecs[tp.topic]
            for message in messages:
                if message.value is None:
                    continue  # a compaction tombstone
                try:
                    records.append(codec.decode(message.value))
                except InvalidMessage:
                    self.undecodable += 1
        return records

    async def lag(self, admin, group: str, topics: Sequence[str]) -> int:
        """Messages of ``topics`` not yet committed by ``group`` (a partition it never committed counts whole)."""
        from aiokafka import TopicPartition

        assert self.consumer is not None
        partitions = [TopicPartition(topic, p) for topic in topics
                      for p in sorted(self.consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            return 0
        ends = await self.consumer.end_offsets(partitions)
        committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
        total = 0
        for tp in partitions:
            meta = committed.get(tp)
            position = meta.offset if meta is not None and meta.offset >= 0 else 0
            total += max(ends.get(tp, 0) - position, 0)
        return total

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()


async def delete_run_topics(kafka: KafkaSettings, prefix: str) -> list[str]:
    """Delete every topic whose name starts with ``prefix`` (the catalog's and Faust's changelogs)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        names = [name for name in await admin.list_topics() if name.startswith(prefix)]
        if names:
            await admin.delete_topics(names)
        return sorted(names)
    finally:
        await admin.close()


# ----------------------------------------------------------------------------------------------------------------
# Rendering (rich)

_POD_COLOURS = ("dodger_blue1", "green3", "orange1", "magenta", "cyan", "gold1", "medium_purple1", "spring_green2",
                "deep_pink2", "turquoise2", "light_salmon1", "chartreuse2")
_BUCKET_STYLE = {"idle": ("░", "grey62"), "reserved": ("▒", "grey42"), "unattributed": ("▓", "red3"),
                 "unavailable": ("╳", "dark_red")}


def _segment_style(segment: live_view.BarSegment) -> tuple[str, str]:
    from schemas.records import ShareSubjectKind

    if segment.kind is ShareSubjectKind.POD:
        key = (segment.pod_uid or segment.label).encode()
        return "█", _POD_COLOURS[zlib.crc32(key) % len(_POD_COLOURS)]
    return _BUCKET_STYLE[segment.label]


def render_view(state: ViewState, health: Sequence[ProcessHealth], header: str, undecodable: int = 0):
    """The live view as one rich renderable."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    shares = Table(title="GPU shares — cost share of each GPU unit in its last closed window (adds up to 100 %)",
                   box=box.SIMPLE_HEAD, expand=False, title_justify="left", pad_edge=False)
    shares.add_column("node")
    shares.add_column("GPU unit")
    shares.add_column("mode")
    shares.add_column("window", no_wrap=True)
    shares.add_column("share", no_wrap=True)
    shares.add_column("who", overflow="fold")
    for unit in live_view.unit_windows(state):
        segments = live_view.bar_segments(unit)
        bar = Text()
        legend = Text()
        for segment in segments:
            char, style = _segment_style(segment)
            bar.append(char * segment.cells, style=style)
            if segment.tenths:
                if legend:
                    legend.append(" · ")
                legend.append(f"{segment.label} {segment.percent_text}", style=style)
        legend.append(f" = {live_view.tenths_text(sum(s.tenths for s in segments))}")
        start = live_view.iso_utc(unit.window_start_unix_ms)[11:19]
        shares.add_row(unit.key.node_name, unit.describe(), unit.first.sharing_mode.value.lower(), start, bar, legend)
    if not state.units:
        shares.add_row("-", "(waiting for the first closed window)", "", "", "", "")

    shared_total = live_view.shared_total_micro_usd(state)

    def cost_table(title: str, rows: Sequence[live_view.CostRow]) -> Table:
        # direct: the group's pods' own use; shared: their part of buckets the sharing policy shared to them.
        table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
        table.add_column("group")
        table.add_column("cost so far", justify="right")
        table.add_column("direct", justify="right")
        table.add_column("shared", justify="right")
        table.add_column("%", justify="right")
        for row in rows:
            table.add_row(Text(row.group, style="grey62" if row.is_bucket else ""), row.usd, row.direct_usd,
                          row.shared_usd, row.percent_text)
        total = state.cost_total_micro_usd
        table.add_row(Text("total", style="bold"), Text(live_view.usd_text(total), style="bold"),
                      live_view.usd_text(total - shared_total), live_view.usd_text(shared_total), "")
        return table

    costs = Table.grid(padding=(0, 4))
    costs.add_row(cost_table("Cost by namespace", live_view.namespace_costs(state)),
                  cost_table(f"Cost by label {state.team_label}", live_view.team_costs(state)))

    violations = Table(title=f"Active violations ({live_view.resolved_count(state)} resolved)", box=box.SIMPLE_HEAD,
                       title_justify="left", pad_edge=False)
    for column in ("rule", "severity", "subject", "first seen", "summary"):
        violations.add_column(column, overflow="fold")
    for row in live_view.active_violations(state):
        style = "bold red" if row.severity.value == "CRITICAL" else "yellow"
        violations.add_row(Text(row.rule, style=style), row.severity.value, row.subject,
                           live_view.iso_utc(row.first_seen_unix_ms)[11:19], row.summary)
    if not live_view.active_violations(state):
        violations.add_row("-", "", "(none firing)", "", "")

    processes = Table(title="Processes", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for column in ("process", "pid", "state", "restarts", "uptime"):
        processes.add_column(column)
    for h in health:
        style = "green" if h.state is ProcessState.RUNNING else ("red" if not h.healthy else "yellow")
        state_text = h.state.value + (f" (exit {h.exit_code})" if h.exit_code is not None else "")
        processes.add_row(h.name, str(h.pid or "-"), Text(state_text, style=style), str(h.restarts),
                          f"{h.uptime_seconds:.0f}s" if h.state is ProcessState.RUNNING else "-")
    footer = Text(style="grey62")
    footer.append(f"dead letters {sum(state.dead_letters.values())}")
    if state.dead_letters:
        footer.append(" (" + ", ".join(f"{service}/{reason} {count}"
                                       for (service, reason), count in sorted(state.dead_letters.items())) + ")")
    if undecodable:
        footer.append(f" · undecodable records {undecodable}")
    footer.append(" · Ctrl-C stops everything cleanly")
    return Group(Text(header, style="bold"), shares, costs, violations, processes, footer)


# ----------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class RunResult:
    exit_code: int
    reconciled: bool | None
    processes: list[dict[str, Any]] = field(default_factory=list)


class Run:
    """One ``gpumeter run``: see the module docstring for the order of things."""

    def __init__(self, config: RunConfig, env: Mapping[str, str], console=None) -> None:
        from rich.console import Console

        self.config = config
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self.console = console or Console()
        self.processes: list[ManagedProcess] = []
        self.state = ViewState.empty(config.team_label)
        self.stop_event = asyncio.Event()
        self.force_event = asyncio.Event()
        self.sim_start_ms = 0
        self.started_monotonic = 0.0
        self.stopped_monotonic: float | None = None
        self.kafka: KafkaSettings | None = None
        self.feed: TopicFeed | None = None
        self.stop_reason = ""
        self._notes: list[str] = []
        self._live = config.live

    # -- progress and status --------------------------------------------------------------------------------------

    def progress(self, message: str) -> None:
        self.console.print(f"[gpumeter run] {message}", highlight=False, markup=False, soft_wrap=True)

    def elapsed_seconds(self) -> float:
        end = self.stopped_monotonic if self.stopped_monotonic is not None else time.monotonic()
        return max(end - self.started_monotonic, 0.0) if self.started_monotonic else 0.0

    def sim_now_ms(self) -> int:
        return self.sim_start_ms + int(self.elapsed_seconds() * 1000 * self.config.time_scale)

    def health(self) -> list[ProcessHealth]:
        now = time.monotonic()
        return [p.health(now) for p in self.processes]

    def write_processes(self) -> None:
        write_json_atomically(self.config.workdir / "processes.json", {
            "run_id": self.config.run_id,
            "updated_at": live_view.iso_utc(int(time.time() * 1000)),
            "processes": [p.describe() for p in self.processes],
        })

    def header(self) -> str:
        duration = f" / {self.config.duration_seconds:.0f}s" if self.config.duration_seconds else ""
        return (f"gpumeter run {self.config.run_id} · {self.config.scenario.name} · simulated "
                f"{live_view.iso_utc(self.sim_now_ms())} (×{self.config.time_scale:g}, {self.config.window_seconds}s "
                f"windows) · elapsed {self.elapsed_seconds():.0f}s{duration} · topics {self.config.prefix}*")

    def _on_signal(self) -> None:
        if self.stop_event.is_set():
            self.force_event.set()
        else:
            self.stop_reason = "interrupted"
            self.stop_event.set()

    # -- phases ---------------------------------------------------------------------------------------------------

    async def prepare(self) -> tuple[Path, tuple[str, ...], int]:
        """Broker, topics, scenario copy; returns (scenario copy, node names, allowed clock skew in seconds)."""
        from gpumeter.kafka.admin import create_topics
        from schemas.catalog import TopicCatalog
        from services.collector.sim.scenario import ScenarioError, load_scenario

        config = self.config
        config.workdir.mkdir(parents=True, exist_ok=True)
        config.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            original = load_scenario(config.scenario)
        except ScenarioError as exc:
            raise ConfigError(f"scenario {config.scenario}: {exc}") from exc
        nodes = tuple(node.name for node in original.nodes)
        self.progress(f"scenario {config.scenario} — cluster {original.cluster}, {len(nodes)} nodes "
                      f"({', '.join(nodes)}); {config.window_seconds} s windows of simulated time, simulated time "
                      f"runs {config.time_scale:g}× real time; workdir {config.workdir}")
        if config.bootstrap_servers:
            bootstrap = config.bootstrap_servers
            self.progress(f"Kafka: using {bootstrap}")
        else:
            bootstrap = await asyncio.to_thread(ensure_broker, self.progress, self.env)
        self.kafka = KafkaSettings.from_env(self.env)
        self.kafka = KafkaSettings(**{**self.kafka.__dict__, "bootstrap_servers": bootstrap,
                                      "topic_prefix": config.prefix, "client_id": "gpumeter-run"})
        catalog = TopicCatalog(prefix=config.prefix, partitions_override=config.partitions)
        results = await create_topics(self.kafka, catalog)
        created = sum(1 for r in results if r.created)
        self.progress(f"topics: {created} created, {len(results) - created} already there, prefix "
                      f"{config.prefix!r}, {config.partitions} partitions each")

        self.sim_start_ms = simulated_start_ms(int(time.time() * 1000), config.window_seconds)
        scenario_copy = config.workdir / "scenario.yaml"
        scenario_copy.write_text(shifted_scenario_text(config.scenario.read_text(), self.sim_start_ms))
        try:
            load_scenario(scenario_copy)
        except ScenarioError as exc:
            raise ConfigError(f"scenario {config.scenario} with its start moved: {exc}") from exc
        skew = clock_skew_allowance_seconds(config.time_scale, config.duration_seconds, config.window_seconds)
        write_json_atomically(config.workdir / "run.json", {
            "run_id": config.run_id,
            "scenario": str(config.scenario),
            "scenario_copy": str(scenario_copy),
            "simulated_start_unix_ms": self.sim_start_ms,
            "simulated_start": live_view.iso_utc(self.sim_start_ms),
            "time_scale": config.time_scale,
            "window_seconds": config.window_seconds,
            "grace_seconds": config.grace_seconds,
            "max_clock_skew_seconds": skew,
            "bootstrap_servers": bootstrap,
            "topic_prefix": config.prefix,
            "partitions": config.partitions,
            "ledger_url": config.ledger_url,
            "nodes": list(nodes),
        })
        return scenario_copy, nodes, skew

    async def supervise(self) -> None:
        while not self.stop_event.is_set():
            now = time.monotonic()
            changed = False
            for process in self.processes:
                if process.check(now):
                    changed = True
                    if process.state is ProcessState.RESTARTING:
                        self._note(f"{process.spec.name} exited with {process.exit_code}; restarting in "
                                   f"{process.restart_in(now):.0f} s (see {process.log_path})")
                    elif process.state is ProcessState.FAILED:
                        self._note(f"{process.spec.name} exited with {process.exit_code} and is not restarted "
                                   f"(see {process.log_path})")
                    elif process.state is ProcessState.RUNNING:
                        self._note(f"{process.spec.name} restarted (pid {process.pid})")
            if changed:
                self.write_processes()
            if (self.config.duration_seconds is not None
                    and time.monotonic() - self.started_monotonic >= self.config.duration_seconds):
                self.stop_reason = f"the duration ({self.config.duration_seconds:g} s) ended"
                self.stop_event.set()
            await asyncio.sleep(0.2)

    def _note(self, message: str) -> None:
        self._notes.append(message)
        if not self._live:
            self.progress(message)

    async def consume(self) -> None:
        assert self.feed is not None
        while True:
            try:
                records = await self.feed.poll(200)
            except GpumeterError as exc:
                self._note(f"view: {exc}")
                await asyncio.sleep(1)
                continue
            if records:
                self.state = live_view.apply_records(self.state, records)

    async def show(self) -> None:
        if self._live:
            from rich.console import Group
            from rich.live import Live
            from rich.text import Text

            def frame():
                notes = Text("\n".join(self._notes[-3:]), style="yellow") if self._notes else Text("")
                return Group(render_view(self.state, self.health(), self.header(),
                                         self.feed.undecodable if self.feed else 0), notes)

            with Live(frame(), console=self.console, refresh_per_second=2, transient=False) as live:
                while not self.stop_event.is_set():
                    live.update(frame())
                    try:
                        await asyncio.wait_for(self.stop_event.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                live.update(frame())
        else:
            while not self.stop_event.is_set():
                try:
                    await asyncio.wait_for(self.stop_event.wait(), self.config.progress_seconds)
                    break
                except asyncio.TimeoutError:
                    pass
                self.console.print(live_view.progress_line(self.state, self.health(), self.elapsed_seconds(),
                                                           self.sim_now_ms()), highlight=False, markup=False,
                                   soft_wrap=True)

    async def drain(self, admin, process: ManagedProcess) -> None:
        """Wait (at most ``DRAIN_SECONDS``) until ``process``'s consumer group has committed all of its input."""
        if not process.spec.drain_group or process.state is not ProcessState.RUNNING or self.feed is None:
            return
        deadline = time.monotonic() + DRAIN_SECONDS
        lag = None
        while time.monotonic() < deadline and not self.force_event.is_set():
            try:
                lag = await self.feed.lag(admin, process.spec.drain_group, process.spec.drain_topics)
            except Exception as exc:  # noqa: BLE001 - Kafka errors of any kind: the drain is best effort
                self.progress(f"stop: cannot read {process.spec.name}'s lag ({exc!r}); stopping it anyway")
                return
            if lag == 0:
                return
            await asyncio.sleep(0.5)
        self.progress(f"stop: {process.spec.name} still had {lag} input messages to go after {DRAIN_SECONDS:.0f} s; "
                      "stopping it anyway")

    async def shutdown(self) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        assert self.kafka is not None
        admin = AIOKafkaAdminClient(**self.kafka.client_kwargs())
        try:
            await admin.start()
        except Exception:  # noqa: BLE001 - without an admin client the drain is skipped
            admin = None
        try:
            for group in sorted({p.spec.stop_group for p in self.processes}):
                members = [p for p in self.processes if p.spec.stop_group == group]
                if admin is not None:
                    for process in members:
                        await self.drain(admin, process)
                names = ", ".join(p.spec.name for p in members)
                self.progress(f"stopping {names}...")
                timeout_s = 0.0 if self.force_event.is_set() else STOP_TIMEOUT_SECONDS
                stops = {asyncio.create_task(p.stop(timeout_s)) for p in members}
                force = asyncio.create_task(self.force_event.wait())
                while stops:
                    waiting = stops if force.done() else stops | {force}
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    stops = {s for s in stops if not s.done()}
                    if force.done():
                        for p in members:
                            p.kill()
                force.cancel()
                self.write_processes()
        finally:
            if admin is not None:
                await admin.close()

    def report(self) -> bool | None:
        """Print the report by namespace and by team label; True when it reconciles (None: nothing to report)."""
        from services.billing.ledger import Grouping, Ledger
        from services.billing.report import build_report, format_report

        config = self.config
        window_ms = config.window_seconds * 1000
        end_ms = (self.sim_now_ms() // window_ms + 2) * window_ms
        if not config.ledger_path.exists():
            self.progress(f"no ledger at {config.ledger_path}: billing never started")
            return None
        reconciled = True
        with Ledger(config.ledger_url) as ledger:
            try:
                ledger.require_schema()
            except GpumeterError as exc:
                self.progress(f"ledger {config.ledger_path}: {exc}")
                return None
            for grouping in ("namespace", f"label:{config.team_label}"):
                report = build_report(ledger, Grouping.parse(grouping), start_ms=self.sim_start_ms, end_ms=end_ms)
                self.console.print(format_report(report, "table"), highlight=False, markup=False, soft_wrap=True)
                reconciled = reconciled and report.reconciliation.reconciled
            bills = ledger.bills(start_ms=self.sim_start_ms, end_ms=end_ms)
        window_text = f"{(end_ms - self.sim_start_ms) // 1000}s"
        self.progress(f"{len(bills)} node-windows billed. The ledger is {config.ledger_path} (SQLite). Again: "
                      f"gpumeter report --ledger-url {config.ledger_url} --end {live_view.iso_utc(end_ms)} "
                      f"--window {window_text} --by namespace   (or --by label:{config.team_label}, node, gpu)")
        return reconciled

    async def execute(self) -> RunResult:
        config = self.config
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal)
        scenario_copy, nodes, skew = await self.prepare()
        assert self.kafka is not None
        if self.stop_event.is_set():
            self.progress("interrupted before the processes started")
            return RunResult(1, None)
        with_guard = guard_available()
        specs = service_specs(config, nodes, scenario_copy, self.kafka.bootstrap_servers, skew, with_guard)
        self.processes = [ManagedProcess(spec, config.workdir, config.log_dir, self.env) for spec in specs]
        self.progress(f"starting {len(specs)} processes: {', '.join(s.name for s in specs)}"
                      + ("" if with_guard else " (no guard: this installation has no `gpumeter guard`)")
                      + f"; logs in {config.log_dir}")
        self.feed = TopicFeed(self.kafka)
        await self.feed.start()
        now = time.monotonic()
        for process in sorted(self.processes, key=lambda p: -p.spec.stop_group):
            process.start(now)  # consumers first, collectors last: the first ticks find their readers starting
        self.started_monotonic = time.monotonic()
        self.write_processes()
        if config.live:
            self.progress("simulated time starts at " + live_view.iso_utc(self.sim_start_ms) + "; the first "
                          "windows close after about " + f"{(config.window_seconds + config.grace_seconds) / config.time_scale + 5:.0f}"
                          " s; Ctrl-C stops everything cleanly")
        else:
            self.progress(f"simulated time starts at {live_view.iso_utc(self.sim_start_ms)}; a progress line every "
                          f"{config.progress_seconds:g} s" + ("" if config.duration_seconds else "; Ctrl-C stops"))
        consumer = asyncio.create_task(self.consume())
        supervisor = asyncio.create_task(self.supervise())
        try:
            await self.show()
            self.stopped_monotonic = time.monotonic()
            self.progress(f"stopping: {self.stop_reason or 'asked to'}")
            await self.shutdown()
            # The last records the services wrote before they stopped.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            self.progress(live_view.progress_line(self.state, self.health(), self.elapsed_seconds(),
                                                  self.sim_now_ms()))
        finally:
            supervisor.cancel()
            consumer.cancel()
            await asyncio.gather(supervisor, consumer, return_exceptions=True)
            for process in self.processes:
                process.kill()
            await self.feed.stop()
            self.write_processes()
        reconciled = await asyncio.to_thread(self.report)
        for message in self._notes:
            if self._live:
                self.progress(message)
        if config.owns_topics and not config.keep_topics:
            try:
                deleted = await delete_run_topics(self.kafka, config.prefix)
                self.progress(f"deleted the run's {len(deleted)} topics (--keep-topics keeps them)")
            except Exception as exc:  # noqa: BLE001 - the run is over; the topics are only clutter
                self.progress(f"could not delete the run's topics: {exc!r}")
        failed = [p for p in self.processes if p.state is ProcessState.FAILED]
        for process in failed:
            self.progress(f"{process.spec.name} did not stop cleanly (exit {process.exit_code}); see {process.log_path}")
        if not config.bootstrap_servers:
            self.progress("the local Kafka broker keeps running for the next run; `make stop` stops it")
        exit_code = 0 if (not failed and reconciled) else 1
        return RunResult(exit_code, reconciled, [p.describe() for p in self.processes])


# ----------------------------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", type=Path, default=None,
                        help=f"simulation scenario (default {DEFAULT_SCENARIO}: 3 nodes, exclusive, time-sliced and "
                             "MIG GPUs, a leaky pod)")
    parser.add_argument("--duration", type=float, default=None,
                        help="stop after this many seconds of real time (default: run until Ctrl-C)")
    parser.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                        help=f"simulated seconds per real second (default {DEFAULT_TIME_SCALE:g})")
    parser.add_argument("--window-seconds", type=int, default=DEFAULT_WINDOW_SECONDS,
                        help=f"attribution window in simulated seconds (default {DEFAULT_WINDOW_SECONDS})")
    parser.add_argument("--grace-seconds", type=int, default=DEFAULT_GRACE_SECONDS,
                        help=f"window grace in simulated seconds (default {DEFAULT_GRACE_SECONDS})")
    parser.add_argument("--no-live", action="store_true",
                        help="progress lines instead of the live view (the default when stdout is no terminal)")
    parser.add_argument("--progress-seconds", type=float, default=DEFAULT_PROGRESS_SECONDS,
                        help=f"seconds between progress lines without the live view (default "
                             f"{DEFAULT_PROGRESS_SECONDS:g})")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the ledger, logs and state go (default .cache/runs/<run id>)")
    parser.add_argument("--bootstrap-servers", default=None,
                        help="use this Kafka instead of starting the local broker")
    parser.add_argument("--topic-prefix", default=None,
                        help="topic prefix (default run-<run id>.: topics of the run's own, deleted at the end)")
    parser.add_argument("--partitions", type=int, default=DEFAULT_PARTITIONS,
                        help=f"partitions of each topic the run creates (default {DEFAULT_PARTITIONS})")
    parser.add_argument("--keep-topics", action="store_true", help="keep the run's own topics at the end")
    parser.add_argument("--team-label", default="team", help="pod label that names the team (default team)")
    parser.add_argument("--sharing", default=None,
                        help="billing's sharing policy, e.g. idle=weighted,node_other=weighted (default keep: every "
                             "bucket its own line; see docs/billing.md)")


def _default_scenario() -> Path:
    local = DEFAULT_SCENARIO
    return local if local.is_file() else REPO_ROOT / DEFAULT_SCENARIO


def run_config(args: argparse.Namespace, now_ms: int) -> RunConfig:
    from gpumeter.devtools.kafka_broker import DEFAULT_CACHE_DIR

    run_id = new_run_id(now_ms)
    workdir = args.workdir if args.workdir is not None else DEFAULT_CACHE_DIR / "runs" / run_id
    return RunConfig(
        scenario=(args.scenario or _default_scenario()).resolve(),
        workdir=workdir.resolve(),
        run_id=run_id,
        duration_seconds=args.duration,
        time_scale=args.time_scale,
        window_seconds=args.window_seconds,
        grace_seconds=args.grace_seconds,
        live=not args.no_live and sys.stdout.isatty(),
        bootstrap_servers=args.bootstrap_servers,
        topic_prefix=args.topic_prefix,
        partitions=args.partitions,
        keep_topics=args.keep_topics,
        progress_seconds=args.progress_seconds,
        team_label=args.team_label,
        sharing=getattr(args, "sharing", None),
    )


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        config = run_config(args, int(time.time() * 1000))
    except ConfigError as exc:
        print(f"gpumeter run: {exc}", file=sys.stderr)
        return 2
    run = Run(config, env)
    try:
        result = asyncio.run(run.execute())
    except ConfigError as exc:
        print(f"gpumeter run: {exc}", file=sys.stderr)
        return 2
    except GpumeterError as exc:
        print(f"gpumeter run: {exc}", file=sys.stderr)
        return 1
    return result.exit_code
