"""The processes of ``gpumeter run``: each started in a session of its own, watched, restarted by its spec's
policy with backoff (``ManagedProcess``), and all of them stopped in order, each once its consumer group has
caught up with its input (``Supervisor``)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence

from gpumeter.clock import iso_utc
from gpumeter.commands.live_view import ProcessHealth, ProcessState
from gpumeter.commands.run.plan import ServiceSpec

STOP_TIMEOUT_SECONDS = 30.0
DRAIN_SECONDS = 20.0
RESTART_BACKOFF_INITIAL_SECONDS = 1.0
RESTART_BACKOFF_MAX_SECONDS = 30.0
# A process that ran this long before it exited starts its backoff over.
RESTART_BACKOFF_RESET_SECONDS = 60.0
PR_SET_PDEATHSIG = 1


def next_backoff_seconds(previous: float | None) -> float:
    """1 s, then doubling, at most ``RESTART_BACKOFF_MAX_SECONDS``."""
    if previous is None:
        return RESTART_BACKOFF_INITIAL_SECONDS
    return min(previous * 2, RESTART_BACKOFF_MAX_SECONDS)


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
        self.env = {**env, **dict(spec.env)}
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
            log.write(f"=== gpumeter run: start {self.starts} at {iso_utc(int(time.time() * 1000))}: "
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



Lag = Callable[[Any, str, Sequence[str]], Awaitable[int]]


class Supervisor:
    """Every process of a run: ``watch`` applies their restart policies until the run stops, ``shutdown`` stops
    them group by group (``ServiceSpec.stop_group``), each after its consumer group caught up (``lag``: messages
    of its input topics not committed yet; at most ``DRAIN_SECONDS``). ``note`` gets what is worth telling."""

    def __init__(self, processes: Sequence[ManagedProcess], workdir: Path, run_id: str,
                 progress: Callable[[str], None], note: Callable[[str], None]) -> None:
        self.processes = list(processes)
        self.workdir = workdir
        self.run_id = run_id
        self.progress = progress
        self.note = note

    def health(self) -> list[ProcessHealth]:
        now = time.monotonic()
        return [p.health(now) for p in self.processes]

    def write_processes(self) -> None:
        write_json_atomically(self.workdir / "processes.json", {
            "run_id": self.run_id,
            "updated_at": iso_utc(int(time.time() * 1000)),
            "processes": [p.describe() for p in self.processes],
        })

    def start(self) -> None:
        now = time.monotonic()
        for process in sorted(self.processes, key=lambda p: -p.spec.stop_group):
            process.start(now)  # consumers first, collectors last: the first ticks find their readers starting
        self.write_processes()

    async def watch(self, stop: asyncio.Event, should_stop: Callable[[], str | None]) -> None:
        """Until ``stop`` is set: notice exits, restart what must be, and set ``stop`` once ``should_stop()``
        names a reason."""
        while not stop.is_set():
            now = time.monotonic()
            changed = False
            for process in self.processes:
                if process.check(now):
                    changed = True
                    if process.state is ProcessState.RESTARTING:
                        self.note(f"{process.spec.name} exited with {process.exit_code}; restarting in "
                                  f"{process.restart_in(now):.0f} s (see {process.log_path})")
                    elif process.state is ProcessState.FAILED:
                        self.note(f"{process.spec.name} exited with {process.exit_code} and is not restarted "
                                  f"(see {process.log_path})")
                    elif process.state is ProcessState.RUNNING:
                        self.note(f"{process.spec.name} restarted (pid {process.pid})")
            if changed:
                self.write_processes()
            if should_stop() is not None:
                stop.set()
            await asyncio.sleep(0.2)

    async def drain(self, admin: Any, process: ManagedProcess, lag: Lag, force: asyncio.Event) -> None:
        """Wait (at most ``DRAIN_SECONDS``) until ``process``'s consumer group has committed all of its input."""
        if not process.spec.drain_group or process.state is not ProcessState.RUNNING:
            return
        deadline = time.monotonic() + DRAIN_SECONDS
        behind = None
        while time.monotonic() < deadline and not force.is_set():
            try:
                behind = await lag(admin, process.spec.drain_group, process.spec.drain_topics)
            except Exception as exc:  # noqa: BLE001 - Kafka errors of any kind: the drain is best effort
                self.progress(f"stop: cannot read {process.spec.name}'s lag ({exc!r}); stopping it anyway")
                return
            if behind == 0:
                return
            await asyncio.sleep(0.5)
        self.progress(f"stop: {process.spec.name} still had {behind} input messages to go after "
                      f"{DRAIN_SECONDS:.0f} s; stopping it anyway")

    async def shutdown(self, admin: Any | None, lag: Lag, force: asyncio.Event) -> None:
        """Stop every process, group by group (``admin`` None: no drain); ``force`` set kills what is left."""
        for group in sorted({p.spec.stop_group for p in self.processes}):
            members = [p for p in self.processes if p.spec.stop_group == group]
            if admin is not None:
                for process in members:
                    await self.drain(admin, process, lag, force)
            self.progress(f"stopping {', '.join(p.spec.name for p in members)}...")
            timeout_s = 0.0 if force.is_set() else STOP_TIMEOUT_SECONDS
            stops = {asyncio.create_task(p.stop(timeout_s)) for p in members}
            forced = asyncio.create_task(force.wait())
            while stops:
                waiting = stops if forced.done() else stops | {forced}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                stops = {s for s in stops if not s.done()}
                if forced.done():
                    for p in members:
                        p.kill()
            forced.cancel()
            self.write_processes()

    def kill_all(self) -> None:
        for process in self.processes:
            process.kill()

    def failed(self) -> list[ManagedProcess]:
        return [p for p in self.processes if p.state is ProcessState.FAILED]
