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

* ``ensure_alertmanager()`` is ``make test``'s step before any test runs (there is no wheel of Alertmanager):
  when ``find_alertmanager`` finds none and this is Debian or Ubuntu run as root, it installs Debian's
  ``prometheus-alertmanager`` package with apt-get (``apt-get update`` first only when the install fails on stale
  package lists) and returns the binary; anywhere else it raises ``AlertmanagerServerError`` whose message is the
  one command to run (``missing_command``), so ``make test`` stops before any test instead of skipping some.

Command line (people): ``python -m gpumeter.devtools.alertmanager`` starts one, prints its URL, and stops it on
Ctrl-C or SIGTERM; ``python -m gpumeter.devtools.alertmanager ensure`` is the step above.
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
DEBIAN_PACKAGE = "prometheus-alertmanager"
OS_RELEASE = Path("/etc/os-release")
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


def _os_release(path: Path = OS_RELEASE) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"')
    return values


def is_debian_like(os_release: Mapping[str, str]) -> bool:
    """Debian, Ubuntu and their derivatives (``ID`` or ``ID_LIKE`` of ``/etc/os-release``)."""
    names = {os_release.get("ID", "")} | set(os_release.get("ID_LIKE", "").split())
    return bool(names & {"debian", "ubuntu"})


def missing_command(*, platform: str, os_release: Mapping[str, str], root: bool) -> str:
    """The one command that installs Alertmanager on this machine (for the error when it is missing)."""
    if platform.startswith("linux") and is_debian_like(os_release):
        return f"{'' if root else 'sudo '}apt-get install -y {DEBIAN_PACKAGE}"
    if platform == "darwin":
        return "brew install alertmanager"
    return (f"go install github.com/prometheus/alertmanager/cmd/alertmanager@latest (then {BINARY_ENV}="
            "$(go env GOPATH)/bin/alertmanager)")


def _log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_alertmanager(env: Mapping[str, str] | None = None, *, platform: str = sys.platform,
                        os_release: Mapping[str, str] | None = None, euid: int | None = None,
                        run=subprocess.run, log=_log_to_stderr) -> Path:
    """``find_alertmanager``, installing Debian's package first where this process may (see the module docstring)."""
    env = dict(os.environ) if env is None else dict(env)
    try:
        return find_alertmanager(env)
    except AlertmanagerServerError as missing:
        if env.get(BINARY_ENV):
            raise
        os_release = _os_release() if os_release is None else os_release
        root = (os.geteuid() if euid is None else euid) == 0
        apt = shutil.which("apt-get", path=env.get("PATH"))
        if not (platform.startswith("linux") and is_debian_like(os_release) and root and apt):
            command = missing_command(platform=platform, os_release=os_release, root=root)
            raise AlertmanagerServerError(f"Alertmanager is missing (the guard's integration tests need it). "
                                          f"Run:\n    {command}") from missing
    log(f"Alertmanager: not found; installing Debian's {DEBIAN_PACKAGE} package with apt-get...")
    apt_env = {**env, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "-q", "--no-install-recommends", DEBIAN_PACKAGE]
    if run(install, env=apt_env).returncode != 0:
        log("Alertmanager: apt-get install failed; updating the package lists and trying again...")
        if run([apt, "update", "-q"], env=apt_env).returncode != 0 or run(install, env=apt_env).returncode != 0:
            raise AlertmanagerServerError(f"apt-get could not install {DEBIAN_PACKAGE}; install it and run again")
    return find_alertmanager(env)


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
    parser.add_argument("action", nargs="?", choices=["serve", "ensure"], default="serve",
                        help="serve (default): start one until Ctrl-C; ensure: find or install the binary")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.action == "ensure":
        try:
            binary = ensure_alertmanager()
        except AlertmanagerServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(binary)
        return 0
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
