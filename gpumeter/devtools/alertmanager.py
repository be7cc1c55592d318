"""A real, throwaway Prometheus Alertmanager on loopback, for tests and local runs.

Contract:

* ``find_alertmanager(env)`` finds the binary: ``GPUMETER_ALERTMANAGER_BIN`` when set, then ``alertmanager`` and
  ``prometheus-alertmanager`` on ``PATH``, then ``/usr/bin/prometheus-alertmanager`` (Debian's package).
  Without one it raises ``AlertmanagerServerError`` saying to ``apt-get install prometheus-alertmanager``.
* ``AlertmanagerServer().start()`` writes a minimal config (one route to a receiver that notifies nobody) and a
  storage folder into a fresh temporary folder under ``/tmp``, starts Alertmanager on a free port of 127.0.0.1
  with clustering off (``--cluster.listen-address=`` empty), waits until ``GET /-/ready`` answers 200, and
  returns its base URL (``http://127.0.0.1:<port>``). ``stop()`` ends it (SIGTERM, then SIGKILL after a timeout)
  and removes the folder. Also a context manager.

Command line (people): ``python -m gpumeter.devtools.alertmanager`` starts one, prints its URL, and stops it on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping

BINARY_ENV = "GPUMETER_ALERTMANAGER_BIN"
BINARY_NAMES = ("alertmanager", "prometheus-alertmanager")
DEBIAN_BINARY = Path("/usr/bin/prometheus-alertmanager")
INSTALL_HINT = (f"install Prometheus Alertmanager: apt-get install prometheus-alertmanager (or set {BINARY_ENV} "
                "to the binary)")

CONFIG = """\
route:
  receiver: blackhole
  group_by: ['alertname']
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: blackhole
"""


class AlertmanagerServerError(RuntimeError):
    """The Alertmanager binary could not be found, or the server could not be started or stopped."""


def find_alertmanager(env: Mapping[str, str] | None = None) -> Path:
    """The Alertmanager binary (see the module docstring for the search order)."""
    env = dict(os.environ) if env is None else env
    explicit = env.get(BINARY_ENV)
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise AlertmanagerServerError(f"{BINARY_ENV}={explicit} is not an executable file; {INSTALL_HINT}")
    for name in BINARY_NAMES:
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            return Path(found)
    if DEBIAN_BINARY.is_file() and os.access(DEBIAN_BINARY, os.X_OK):
        return DEBIAN_BINARY
    raise AlertmanagerServerError(f"Alertmanager binary not found; {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class AlertmanagerServer:
    """One throwaway Alertmanager. ``start()`` returns its base URL; ``stop()`` ends it and removes its folder."""

    def __init__(self, *, port: int = 0, binary: Path | None = None, base_dir: Path | None = None,
                 config: str = CONFIG) -> None:
        self.port = port
        self.binary = binary
        self.base_dir = base_dir
        self.config = config
        self.root: Path | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        assert self.root is not None
        return self.root / "alertmanager.log"

    def _log_tail(self) -> str:
        if self.root is None or not self.log_file.exists():
            return ""
        return self.log_file.read_text(errors="replace")[-4000:]

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the server and wait until it is ready; return its base URL."""
        if self._process is not None:
            return self.url
        self.binary = self.binary or find_alertmanager()
        self.root = Path(tempfile.mkdtemp(prefix="gpumeter-alertmanager-", dir=self.base_dir or "/tmp"))
        config_file = self.root / "alertmanager.yml"
        config_file.write_text(self.config)
        storage = self.root / "data"
        storage.mkdir()
        self.port = self.port or free_port()
        command = [
            str(self.binary),
            f"--config.file={config_file}",
            f"--storage.path={storage}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]
        try:
            self._log = open(self.log_file, "wb")
            self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=self.root)
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        problem = "no answer yet"
        while True:
            code = self._process.poll()
            if code is not None:
                raise AlertmanagerServerError(f"Alertmanager exited with {code} at start:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
                    problem = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                problem = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                problem = repr(exc)
            if time.monotonic() > deadline:
                raise AlertmanagerServerError(f"Alertmanager on port {self.port} not ready within {timeout_s:.0f}s "
                                              f"({problem}):\n{self._log_tail()}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout_s``) and remove its folder. Safe to call twice."""
        process, self._process = self._process, None
        try:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout_s)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
                self.root = None

    def __enter__(self) -> "AlertmanagerServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alertmanager", description="Run a throwaway Alertmanager for gpumeter.")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = AlertmanagerServer(port=args.port)
    stop_requested = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        print(server.start(), flush=True)
    except AlertmanagerServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        while not stop_requested:
            time.sleep(0.2)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
