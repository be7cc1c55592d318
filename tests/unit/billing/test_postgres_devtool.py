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
