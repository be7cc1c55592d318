"""A SQLite ledger keeps SQLite's own locks while other processes read it, and takes one billing per file.

Before: billing's file checks (``services.billing.sqlite_files``) opened and closed the database, ``-wal`` and
``-shm`` to see whether they were writable. On Linux closing any descriptor of a file drops every POSIX lock the
process holds on it, SQLite's included, so billing held no lock (``/proc/locks``) and the next process that opened
and closed the ledger -- a ``gpumeter report`` -- took itself for the last user and deleted the ``-wal`` and
``-shm`` under it: billing went on writing into a WAL no one else could see.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from services.billing.ledger import Ledger, LedgerUnusable
from services.billing.ledger_lock import BillingLock, LedgerInUse, lock_path_of
from tests.unit.billing.conftest import WINDOW_START_MS, posix_locks_held, sample_costs

REPO_ROOT = Path(__file__).resolve().parents[3]
HOUR_MS = 3_600_000


def everything(results):
    return [c for r in results for c in r.costs], [r.bill for r in results]


def clean_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUMETER_", "KAFKA_"))},
            "PYTHONPATH": str(REPO_ROOT)}


def gpumeter_report(db: Path) -> subprocess.CompletedProcess:
    """``gpumeter report`` over every sample window, in a process of its own (it opens and closes the ledger)."""
    end = datetime.fromtimestamp((WINDOW_START_MS + 4 * HOUR_MS) / 1000, timezone.utc).isoformat()
    return subprocess.run([sys.executable, "-m", "gpumeter.cli", "report", "--ledger-url", f"sqlite:///{db}",
                           "--by", "node", "--window", "5h", "--end", end],
                          cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)


READ_BACK = """
import json, sqlite3, sys
connection = sqlite3.connect(sys.argv[1])
print(json.dumps({
    "bills": connection.execute("SELECT node_name, window_start_unix_ms FROM node_bills").fetchall(),
    "lines": connection.execute("SELECT count(*) FROM cost_lines").fetchone()[0],
    "distinct_lines": connection.execute("SELECT count(*) FROM (SELECT DISTINCT window_start_unix_ms, cluster, "
                                         "node_name, gpu_uuid, subject_kind, pod_uid, shared_from FROM cost_lines)"
                                         ).fetchone()[0],
    "integrity": connection.execute("PRAGMA integrity_check").fetchall(),
}))
connection.close()
"""


def read_back(db: Path) -> dict:
    """The ledger as another process sees it (plain sqlite3, opened and closed there)."""
    import json

    result = subprocess.run([sys.executable, "-c", READ_BACK, str(db)], env=clean_env(), capture_output=True,
                            text=True, timeout=60, check=True)
    found = json.loads(result.stdout)
    found["bills"] = sorted(tuple(b) for b in found["bills"])
    return found


def bill_keys(results) -> list[tuple[str, int]]:
    return sorted((r.bill.node_name, r.bill.window_start_unix_ms) for r in results)


def test_a_report_opening_and_closing_the_ledger_leaves_billing_its_locks_and_loses_nothing(tmp_path):
    """Billing's ledger (a publisher, as ``gpumeter billing`` opens it) writes, a ``gpumeter report`` in another
    process opens and closes the file, billing writes on: billing still holds SQLite's locks on the database and
    the ``-shm``, the ``-wal`` is the one it writes, and another process reads every bill once, every line once,
    ``integrity_check`` ok -- also after billing's own graceful close. Before: no lock after the first write, the
    report deleted the ``-wal``/``-shm``, and the second batch never reached the file."""
    db = tmp_path / "ledger.sqlite3"
    wal, shm = db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")
    first = sample_costs(2)
    second = sample_costs(2, start_ms=WINDOW_START_MS + HOUR_MS)
    third = sample_costs(2, start_ms=WINDOW_START_MS + 2 * HOUR_MS)
    lock = BillingLock(db, holder="this test's billing")
    lock.acquire()  # as gpumeter billing holds it: readers do not take it
    billing = Ledger(f"sqlite:///{db}", publisher="billing-group")
    try:
        billing.migrate()
        assert billing.write(*everything(first)).written == {r.bill.key for r in first}
        assert posix_locks_held(os.getpid(), shm), "billing lost SQLite's lock on the -shm after a write"
        assert posix_locks_held(os.getpid(), db), "billing lost SQLite's lock on the database after a write"
        wal_inode = os.lstat(wal).st_ino

        report = gpumeter_report(db)
        assert report.returncode == 0, report.stdout + report.stderr
        assert "aws-node" in report.stdout and "gcp-node" in report.stdout
        assert wal.exists() and shm.exists(), "the report deleted billing's -wal/-shm"
        assert os.lstat(wal).st_ino == wal_inode
        assert posix_locks_held(os.getpid(), shm) and posix_locks_held(os.getpid(), db)

        assert billing.write(*everything(second)).written == {r.bill.key for r in second}
        assert billing.write(*everything(first)).written == frozenset()  # a redelivery: nothing twice
        seen = read_back(db)  # another plain reader opens and closes it
        assert seen["bills"] == bill_keys(first + second), "bills written after the report never reached the file"
        assert seen["lines"] == seen["distinct_lines"] == len(everything(first + second)[0])
        assert seen["integrity"] == [["ok"]]
        assert posix_locks_held(os.getpid(), shm) and posix_locks_held(os.getpid(), db)

        assert billing.write(*everything(third)).written == {r.bill.key for r in third}
        assert billing.totals().node_windows == len(first + second + third)
    finally:
        assert billing.close()  # billing's graceful stop
        lock.release()
    seen = read_back(db)
    assert seen["bills"] == bill_keys(first + second + third)
    assert seen["lines"] == seen["distinct_lines"] == len(everything(first + second + third)[0])
    assert seen["integrity"] == [["ok"]]


def test_the_file_checks_never_open_a_descriptor_of_the_ledgers_files(tmp_path, monkeypatch):
    """Every Python-level open while billing migrates, writes, reads and closes its ledger: none is of the database,
    its ``-wal`` or its ``-shm`` (only SQLite opens those); the checks still refuse a file that is not fit."""
    db = tmp_path / "ledger.sqlite3"
    sqlite_files = {str(db), str(db) + "-wal", str(db) + "-shm"}
    opened: list[str] = []

    def recording(real_open):
        def recording_open(path, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)):
                opened.append(os.fsdecode(path))
            return real_open(path, *args, **kwargs)
        return recording_open

    monkeypatch.setattr(os, "open", recording(os.open))
    monkeypatch.setattr(io, "open", recording(io.open))
    monkeypatch.setattr(builtins, "open", recording(builtins.open))
    ledger = Ledger(f"sqlite:///{db}", publisher="billing-group")
    ledger.migrate()
    results = sample_costs(2)
    ledger.write(*everything(results))
    ledger.write(*everything(results))
    assert ledger.totals().node_windows == len(results)
    assert ledger.close()
    assert any(".probe-" in Path(path).name for path in opened), "the folder probe opens a file of its own"
    assert sqlite_files.isdisjoint(opened), sorted(sqlite_files & set(opened))

    os.mkfifo(db.with_name(db.name + "-shm"))  # not a regular file: refused without opening it
    with pytest.raises(LedgerUnusable, match="-shm is not a regular file"):
        Ledger(f"sqlite:///{db}").write(*everything(results))
    assert sqlite_files.isdisjoint(opened)


def test_a_second_billing_lock_on_one_sqlite_file_is_refused_until_the_first_is_released(tmp_path):
    db = tmp_path / "ledger.sqlite3"
    first = BillingLock(db, holder="pid 1 on host-a, group one")
    second = BillingLock(db, holder="pid 2 on host-b, group two")
    first.acquire()
    first.acquire()  # held: a no-op
    with pytest.raises(LedgerInUse, match="another billing holds the SQLite ledger") as refused:
        second.acquire()
    assert refused.value.holder == "pid 1 on host-a, group one"
    assert "pid 1 on host-a, group one" in str(refused.value) and "PostgreSQL" in str(refused.value)
    assert refused.value.lock_path == lock_path_of(db) == tmp_path / "ledger.sqlite3.billing.lock"
    assert not second.held
    BillingLock(tmp_path / "other.sqlite3", holder="x").acquire()  # another file: another lock
    first.release()
    second.acquire()
    assert second.held
    assert lock_path_of(db).read_text() == "pid 2 on host-b, group two\n"
    second.release()
    assert not db.exists()  # the lock is a file of its own: SQLite's files are never touched


def test_a_billing_lock_in_a_missing_folder_is_a_retryable_unusable_ledger(tmp_path):
    from services.billing.service import is_transient_ledger_error

    lock = BillingLock(tmp_path / "gone" / "ledger.sqlite3", holder="x")
    with pytest.raises(LedgerUnusable, match="cannot create the billing lock") as unusable:
        lock.acquire()
    assert is_transient_ledger_error(unusable.value)
    (tmp_path / "gone").mkdir()
    lock.acquire()
    assert lock.held
    lock.release()


def test_a_billing_lock_held_by_another_process_is_seen(tmp_path):
    """flock is between open files, so also between processes: a lock a child process holds refuses this one."""
    db = tmp_path / "ledger.sqlite3"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from services.billing.ledger_lock import BillingLock; "
         f"lock = BillingLock({str(db)!r}, holder='pid child'); lock.acquire(); print('held', flush=True); "
         "sys.stdin.read()"],
        cwd=REPO_ROOT, env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LedgerInUse, match="pid child"):
            BillingLock(db, holder="me").acquire()
    finally:
        holder.stdin.close()
        holder.wait(30)
    lock = BillingLock(db, holder="me")
    lock.acquire()  # the child's exit dropped its lock
    lock.release()


async def test_billing_refuses_to_start_on_a_sqlite_ledger_another_billing_holds(tmp_path, caplog):
    """``serve`` exits 2 with a line naming the holder, before SQLite or Kafka is touched."""
    from services.billing.main import serve
    from services.billing.settings import BillingSettings

    db = tmp_path / "l.db"
    other = BillingLock(db, holder="pid 4242 on elsewhere, group first-billing")
    other.acquire()
    try:
        settings = BillingSettings(ledger_url=f"sqlite:///{db}", metrics_port=0)
        with caplog.at_level(logging.ERROR, logger="gpumeter.billing"):
            assert await serve(settings) == 2
    finally:
        other.release()
    assert "refusing to start: another billing holds the SQLite ledger" in caplog.text
    assert "pid 4242 on elsewhere, group first-billing" in caplog.text
    assert not db.exists()
