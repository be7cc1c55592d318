"""One ``gpumeter billing`` per SQLite ledger file: ``<ledger>.billing.lock``, held for the billing process's life.

Why: a SQLite ledger is for ``make run`` and small clusters -- one billing process on one machine's disk. SQLite
takes one writer at a time (a second billing only queues behind the first, ``busy_timeout``), shares its WAL index
through a memory-mapped ``-shm`` (every process must be on the same host; a network filesystem's locks are not
SQLite's), and a second billing group reads and bills every share again. Two instances on one file are therefore
refused at start, loudly, rather than left to race on one file: several billing instances need PostgreSQL
(docs/billing.md).

``BillingLock(database, holder=...)``: ``acquire()`` takes an exclusive ``flock`` on ``<database>.billing.lock``
without waiting and writes ``holder`` (pid, host, consumer group) into it for the next one's error message;
``release()`` lets it go (so does the process's exit, however it ends: the kernel drops the lock). The lock file
is never one of SQLite's (``-wal``, ``-shm``, ``-journal``): SQLite's POSIX locks belong to the process and the
file, and closing any descriptor of a SQLite file drops them all (``services.billing.sqlite_files``); a ``flock``
on a file of its own touches none of them. It is left in place at exit (removing it would race a starting
instance). Readers -- ``gpumeter report``, ``api``, ``export``, ``reconcile`` -- never take it.

Raises ``LedgerInUse`` when another process holds the lock (not transient: billing exits 2), ``LedgerUnusable``
(``retry``) when the lock file cannot be created (a missing or read-only folder: billing waits, as it does to
migrate such a ledger).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from services.billing.ledger import LedgerError, LedgerUnusable

LOCK_SUFFIX = ".billing.lock"
_HOLDER_BYTES = 512


class LedgerInUse(LedgerError):
    """Another billing process holds this SQLite ledger file (its ``.billing.lock``): one billing per file."""

    def __init__(self, message: str, *, lock_path: Path, holder: str) -> None:
        super().__init__(message)
        self.lock_path = lock_path
        self.holder = holder


def lock_path_of(database: Path) -> Path:
    """The billing lock file of the SQLite database file ``database``."""
    database = Path(database)
    return database.with_name(database.name + LOCK_SUFFIX)


class BillingLock:
    """The exclusive billing lock of one SQLite ledger file (see the module docstring)."""

    def __init__(self, database: Path, *, holder: str) -> None:
        self.database = Path(database)
        self.path = lock_path_of(self.database)
        self.holder = holder
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise (``LedgerInUse``, ``LedgerUnusable``); a no-op when already held."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise LedgerUnusable(f"cannot create the billing lock {self.path}: {os.strerror(exc.errno or 0)}",
                                 retry=True) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read_holder(fd)
            os.close(fd)
            raise LedgerInUse(
                f"another billing holds the SQLite ledger {self.database} ({other or 'holder unknown'}; lock "
                f"{self.path}): a SQLite ledger takes one billing instance -- stop that one, or run several "
                "instances on PostgreSQL (docs/billing.md)", lock_path=self.path, holder=other) from None
        except OSError as exc:
            os.close(fd)
            raise LedgerUnusable(f"cannot lock {self.path}: {os.strerror(exc.errno or 0)}", retry=True) from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.holder}\n".encode()[:_HOLDER_BYTES], 0)
        except OSError:
            pass  # the holder's name is only for the next one's message; the lock is what counts
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # drops the flock


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, _HOLDER_BYTES, 0).decode(errors="replace").strip()
    except OSError:
        return ""


__all__ = ["BillingLock", "LOCK_SUFFIX", "LedgerInUse", "lock_path_of"]
