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
5. **The view** (``gpumeter.commands.live_view``, rendered by ``run.view``) from the node-window-shares, costs,
   violations and dead-letters topics:
   live on a terminal (rich), else — or with ``--no-live`` — one progress line every ``--progress-seconds``.
6. **Stop** on Ctrl-C, SIGTERM or the end of ``--duration`` (counted from the start of the processes): collectors
   first; then the attributor once its consumer group has caught up with its input (or after ``DRAIN_SECONDS``),
   billing once it has, then the guard. Each gets SIGTERM and is killed after ``STOP_TIMEOUT_SECONDS``. A second
   Ctrl-C kills everything at once.
7. **Report**: ``gpumeter report`` by namespace and by label:team over the run's windows, reconciled to the node
   bills (with ``--sharing``, each group's cost split into its direct and shared parts); where the ledger and the
   logs are, and the command that prints the report again. Topics of a prefix the
   run made up are deleted at the end unless ``--keep-topics``.

The parts: ``run.plan`` (settings, the scenario's clock, the processes' command lines; pure), ``run.supervisor``
(starting, restarting and stopping the processes), ``run.feed`` (the broker, the view's feed of records, consumer
lag, the run's topics), ``run.view`` (the rich rendering); this module runs them in order and reports.

Exit code: 0 when every process stopped cleanly and the report reconciles, 1 otherwise, 2 for unusable settings.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpumeter.commands import live_view
from gpumeter.commands.live_view import ProcessHealth, ViewState
from gpumeter.commands.run.feed import TopicFeed, delete_run_topics, ensure_broker
from gpumeter.commands.run.plan import (
    DEFAULT_GRACE_SECONDS,
    DEFAULT_PARTITIONS,
    DEFAULT_PROGRESS_SECONDS,
    DEFAULT_SCENARIO,
    DEFAULT_TIME_SCALE,
    DEFAULT_WINDOW_SECONDS,
    REPO_ROOT,
    RunConfig,
    clock_skew_allowance_seconds,
    guard_available,
    new_run_id,
    service_specs,
    shifted_scenario_text,
    simulated_start_ms,
)
from gpumeter.commands.run.supervisor import ManagedProcess, Supervisor, write_json_atomically
from gpumeter.commands.run.view import render_view
from gpumeter.config import load
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.settings import KafkaSettings


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
        self.supervisor: Supervisor | None = None
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
        return self.supervisor.health() if self.supervisor is not None else []

    def _stop_reason(self) -> str | None:
        if (self.config.duration_seconds is not None
                and time.monotonic() - self.started_monotonic >= self.config.duration_seconds):
            self.stop_reason = f"the duration ({self.config.duration_seconds:g} s) ended"
            return self.stop_reason
        return None

    async def shutdown(self) -> None:
        """Stop every process in order, each once its consumer group caught up (``Supervisor.shutdown``)."""
        from aiokafka.admin import AIOKafkaAdminClient

        assert self.kafka is not None and self.supervisor is not None and self.feed is not None
        admin = AIOKafkaAdminClient(**self.kafka.client_kwargs())
        try:
            await admin.start()
        except Exception:  # noqa: BLE001 - without an admin client the drain is skipped
            admin = None
        try:
            await self.supervisor.shutdown(admin, self.feed.lag, self.force_event)
        finally:
            if admin is not None:
                await admin.close()

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
        from simulator.scenario import ScenarioError, load_scenario

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
        self.kafka = dataclasses.replace(load(KafkaSettings, None, self.env, defaults={"client_id": "gpumeter-run"}),
                                         bootstrap_servers=bootstrap, topic_prefix=config.prefix)
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
                      f"--window {window_text} --by namespace   (or --by pod, label:{config.team_label}, node, gpu)")
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
        self.supervisor = Supervisor([ManagedProcess(spec, config.workdir, config.log_dir, self.env) for spec in specs],
                                     config.workdir, config.run_id, self.progress, self._note)
        self.progress(f"starting {len(specs)} processes: {', '.join(s.name for s in specs)}"
                      + ("" if with_guard else " (no guard: this installation has no `gpumeter guard`)")
                      + f"; logs in {config.log_dir}")
        self.feed = TopicFeed(self.kafka)
        await self.feed.start()
        self.supervisor.start()
        self.started_monotonic = time.monotonic()
        if config.live:
            self.progress("simulated time starts at " + live_view.iso_utc(self.sim_start_ms) + "; the first "
                          "windows close after about " + f"{(config.window_seconds + config.grace_seconds) / config.time_scale + 5:.0f}"
                          " s; Ctrl-C stops everything cleanly")
        else:
            self.progress(f"simulated time starts at {live_view.iso_utc(self.sim_start_ms)}; a progress line every "
                          f"{config.progress_seconds:g} s" + ("" if config.duration_seconds else "; Ctrl-C stops"))
        consumer = asyncio.create_task(self.consume())
        supervisor = asyncio.create_task(self.supervisor.watch(self.stop_event, self._stop_reason))
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
            self.supervisor.kill_all()
            await self.feed.stop()
            self.supervisor.write_processes()
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
        failed = self.supervisor.failed()
        for process in failed:
            self.progress(f"{process.spec.name} did not stop cleanly (exit {process.exit_code}); see {process.log_path}")
        if not config.bootstrap_servers:
            self.progress("the local Kafka broker keeps running for the next run; `make stop` stops it")
        exit_code = 0 if (not failed and reconciled) else 1
        return RunResult(exit_code, reconciled, [p.describe() for p in self.supervisor.processes])


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
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve each process's /metrics and /healthz on 127.0.0.1, on ports N, N+1, ... (the "
                             "collectors, the attributor, billing, the guard, as processes.json lists them), for a "
                             "local Prometheus; default 0: none")


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
        metrics_port=getattr(args, "metrics_port", 0),
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
