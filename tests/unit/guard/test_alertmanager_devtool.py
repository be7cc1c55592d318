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
