"""The throwaway Alertmanager helper: finding the binary, and the error when it is missing."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gpumeter.devtools import alertmanager
from gpumeter.devtools.alertmanager import AlertmanagerServer, AlertmanagerServerError, find_alertmanager


def fake_binary(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_explicit_binary_wins(tmp_path):
    binary = fake_binary(tmp_path / "opt" / "am")
    on_path = fake_binary(tmp_path / "bin" / "alertmanager")
    assert find_alertmanager({"GPUMETER_ALERTMANAGER_BIN": str(binary), "PATH": str(on_path.parent)}) == binary


def test_path_names_upstream_and_debian(tmp_path):
    debian = fake_binary(tmp_path / "bin" / "prometheus-alertmanager")
    assert find_alertmanager({"PATH": str(debian.parent)}) == debian
    upstream = fake_binary(tmp_path / "bin" / "alertmanager")
    assert find_alertmanager({"PATH": str(upstream.parent)}) == upstream


def test_missing_binary_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(alertmanager, "DEBIAN_BINARY", tmp_path / "absent")
    with pytest.raises(AlertmanagerServerError, match="apt-get install prometheus-alertmanager"):
        find_alertmanager({"PATH": str(tmp_path)})
    with pytest.raises(AlertmanagerServerError, match="apt-get install prometheus-alertmanager"):
        find_alertmanager({"GPUMETER_ALERTMANAGER_BIN": str(tmp_path / "nope")})


@pytest.mark.network  # the readiness probe knocks on the loopback port the fake never opens
def test_a_binary_that_exits_at_start_is_reported_with_its_log(tmp_path):
    failing = tmp_path / "am"
    failing.write_text("#!/bin/sh\necho 'bad flag' >&2\nexit 3\n")
    failing.chmod(failing.stat().st_mode | stat.S_IXUSR)
    server = AlertmanagerServer(binary=failing, base_dir=tmp_path)
    with pytest.raises(AlertmanagerServerError, match="exited with 3(.|\n)*bad flag"):
        server.start(timeout_s=10)
    assert server.root is None  # its folder is gone


DEBIAN = {"ID": "debian", "VERSION_ID": "12"}
UBUNTU = {"ID": "ubuntu", "ID_LIKE": "debian"}


class FakeApt:
    """apt-get as ``ensure_alertmanager`` runs it: records each command; ``install`` puts the binary in place."""

    def __init__(self, binary: Path, *, fail_first_install: bool = False) -> None:
        self.binary = binary
        self.fail_first_install = fail_first_install
        self.commands: list[list[str]] = []

    def __call__(self, command, env):
        import subprocess

        self.commands.append(command[1:])
        assert env["DEBIAN_FRONTEND"] == "noninteractive"
        if command[1] == "install":
            if self.fail_first_install:
                self.fail_first_install = False
                return subprocess.CompletedProcess(command, 100)
            fake_binary(self.binary)
        return subprocess.CompletedProcess(command, 0)


def apt_on_path(tmp_path: Path) -> str:
    fake_binary(tmp_path / "sbin" / "apt-get")
    return str(tmp_path / "sbin")


def test_root_on_debian_installs_the_package_before_any_test(tmp_path, monkeypatch):
    monkeypatch.setattr(alertmanager, "DEBIAN_BINARY", tmp_path / "usr" / "bin" / "prometheus-alertmanager")
    apt = FakeApt(alertmanager.DEBIAN_BINARY)
    found = alertmanager.ensure_alertmanager({"PATH": apt_on_path(tmp_path)}, platform="linux", os_release=UBUNTU,
                                             euid=0, run=apt, log=lambda m: None)
    assert found == alertmanager.DEBIAN_BINARY
    assert apt.commands == [["install", "-y", "-q", "--no-install-recommends", "prometheus-alertmanager"]]


def test_stale_package_lists_are_updated_once_and_the_install_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(alertmanager, "DEBIAN_BINARY", tmp_path / "usr" / "bin" / "prometheus-alertmanager")
    apt = FakeApt(alertmanager.DEBIAN_BINARY, fail_first_install=True)
    alertmanager.ensure_alertmanager({"PATH": apt_on_path(tmp_path)}, platform="linux", os_release=DEBIAN, euid=0,
                                     run=apt, log=lambda m: None)
    assert [c[0] for c in apt.commands] == ["install", "update", "install"]


@pytest.mark.parametrize(("platform", "os_release", "euid", "command"), [
    ("linux", DEBIAN, 1000, "sudo apt-get install -y prometheus-alertmanager"),
    ("darwin", {}, 501, "brew install alertmanager"),
    ("linux", {"ID": "fedora"}, 0, "go install github.com/prometheus/alertmanager/cmd/alertmanager@latest"),
])
def test_elsewhere_it_stops_with_the_one_command_to_run(tmp_path, monkeypatch, platform, os_release, euid, command):
    monkeypatch.setattr(alertmanager, "DEBIAN_BINARY", tmp_path / "absent")

    def run(*args, **kwargs):
        raise AssertionError("nothing is installed here")

    with pytest.raises(AlertmanagerServerError, match="Alertmanager is missing") as caught:
        alertmanager.ensure_alertmanager({"PATH": apt_on_path(tmp_path)}, platform=platform, os_release=os_release,
                                         euid=euid, run=run)
    assert command in str(caught.value)


def test_nothing_is_installed_when_alertmanager_is_there(tmp_path):
    binary = fake_binary(tmp_path / "bin" / "alertmanager")

    def run(*args, **kwargs):
        raise AssertionError("nothing is installed here")

    assert alertmanager.ensure_alertmanager({"PATH": str(binary.parent)}, platform="linux", os_release=DEBIAN,
                                            euid=0, run=run) == binary
