"""Whether a SQLite ledger's files can be used safely, checked before SQLite touches them.

Why: in WAL mode SQLite maps the ``-shm`` file (the WAL index) into memory shared with every process that has the
database open. Once it is mapped, a page fault on it that the file can no longer back kills the process with
SIGBUS -- no exception, no log line, exit code 135. Found: ``chattr +i`` on the ``-shm`` of a running billing
(ext4 refuses a write fault on an immutable file's mapping: SIGBUS at the next read or write, and at close), and
truncating the ``-shm`` under it (pages past the end of the file). Closing the connection does not help: SQLite
writes the index while closing. So the only safe move is to look before every use and, when the files are not
fit, not to call SQLite at all.

``SqliteFiles(path).problem(write=..., mapped=...)`` returns ``None`` or a ``FileProblem`` (the reason, and whether
waiting can cure it):

* for a write, the folder must exist and take a new file: a probe file of 64 KiB is written and removed (a
  read-only mount, an immutable or full filesystem fail here, before SQLite maps anything); done at the first
  write, after a failed check, and when ``probe`` is asked for (a reader such as ``gpumeter report`` needs none);
* for a write, the database file and its ``-wal`` and ``-shm``, where they exist, must be regular files this
  process may write (``access(2)``: immutable, read-only mount, permissions);
* while this process has the ``-shm`` mapped (``mapped``: it holds open connections), the ``-shm`` must still be
  the file it mapped, writable if it was, and no shorter than it was: a ``-shm`` that became unwritable is
  curable (``retry``: an operator lifts the flag, writes go on), one truncated under the mapping is not (the
  process must exit without touching it; a restart rebuilds the index from the WAL).

``remember(mapped=...)`` records the ``-shm`` as it is after a successful use (its inode, size, writability).

**Never a descriptor of the database's own files.** The checks only ``lstat`` and ``access`` the database, its
``-wal`` and its ``-shm``; they never open them. SQLite's locks are POSIX (``fcntl``) locks, which belong to the
process and the file, not to a descriptor: closing *any* descriptor of the file, one that SQLite never saw included,
drops every lock the process holds on it. A billing that had opened and closed its own ``-shm`` to see whether it
was writable held no lock any more, so the next process that opened and closed the ledger (a ``gpumeter report``,
a second billing, billing's own graceful stop) found itself the last user and deleted the ``-wal`` and ``-shm``
under it: billing went on writing a WAL nobody else could see (found: the file stuck at 46 bills while 95
node-windows were costed, then ``PRAGMA integrity_check`` reported 121 errors). ``access(2)`` sees the immutable
flag and a read-only mount without a descriptor; an append-only file it does not (SQLite then fails to open it:
an error, not a SIGBUS). The folder probe writes a file of its own, which SQLite never opens.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

PROBE_BYTES = 64 * 1024  # two of SQLite's 32 KiB WAL-index regions


@dataclass(frozen=True)
class FileProblem:
    reason: str
    retry: bool


def _describe(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else str(error)


def _libc_access():
    try:
        return ctypes.CDLL(None, use_errno=True).access
    except (AttributeError, OSError):
        return None


_ACCESS = _libc_access()


def _writable(path: Path) -> tuple[bool, str | None]:
    """Whether this process may write ``path`` (``access(2)``, which opens no descriptor: see the module
    docstring); the reason when it may not. The caller has checked with ``lstat`` that it is a regular file."""
    if _ACCESS is None:  # no C library to ask for the reason: the same check, without its errno
        return (True, None) if os.access(path, os.W_OK) else (False, "not writable by this process")
    if _ACCESS(os.fsencode(path), os.W_OK) == 0:
        return True, None
    return False, os.strerror(ctypes.get_errno())


@dataclass(frozen=True)
class _Mapped:
    inode: int
    size: int
    writable: bool


class SqliteFiles:
    """The files of one SQLite database in WAL mode (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.folder = self.path.parent
        self.wal = self.path.with_name(self.path.name + "-wal")
        self.shm = self.path.with_name(self.path.name + "-shm")
        self._probed = False
        self._mapped: _Mapped | None = None

    def problem(self, *, write: bool, mapped: bool, probe: bool = False) -> FileProblem | None:
        found = self._check(write=write, mapped=mapped, probe=write and (probe or not self._probed))
        if found is not None:
            self._probed = False  # probe again before the next use
        return found

    def _check(self, *, write: bool, mapped: bool, probe: bool) -> FileProblem | None:
        if probe:
            found = self._probe_folder()
            if found is not None:
                return found
            self._probed = True
        shm = self._lstat(self.shm)
        if isinstance(shm, FileProblem):
            return shm
        if mapped and self._mapped is not None:
            if shm is None or shm.st_ino != self._mapped.inode:
                pass  # removed or replaced: this process's mapping is of the old file, which stays valid
            elif shm.st_size < self._mapped.size:
                return FileProblem(f"{self.shm} was cut from {self._mapped.size} to {shm.st_size} bytes while "
                                   "billing had it mapped (touching it now would kill the process with SIGBUS); "
                                   "restart billing, SQLite rebuilds the index from the WAL", retry=False)
            elif self._mapped.writable:
                writable, why = _writable(self.shm)
                if not writable:
                    return FileProblem(f"{self.shm} is no longer writable ({why}) while billing has it mapped "
                                       "(touching it now would kill the process with SIGBUS)", retry=True)
        if write:
            for path in (self.path, self.wal, self.shm):
                found = self._check_writable(path)
                if found is not None:
                    return found
        return None

    def remember(self, *, mapped: bool) -> None:
        """After a successful use: the ``-shm`` this process has mapped now (``mapped``), or none."""
        if not mapped:
            self._mapped = None
            return
        try:
            shm = os.lstat(self.shm)
        except OSError:
            self._mapped = None
            return
        previous = self._mapped
        size = shm.st_size
        if previous is not None and previous.inode == shm.st_ino:
            size = max(size, previous.size)
        self._mapped = _Mapped(shm.st_ino, size, _writable(self.shm)[0])

    def _lstat(self, path: Path) -> os.stat_result | None | FileProblem:
        try:
            result = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return FileProblem(f"cannot inspect {path}: {_describe(exc)}", retry=True)
        if not stat.S_ISREG(result.st_mode):
            return FileProblem(f"{path} is not a regular file", retry=True)
        return result

    def _check_writable(self, path: Path) -> FileProblem | None:
        found = self._lstat(path)
        if found is None or isinstance(found, FileProblem):
            return found
        writable, why = _writable(path)
        if not writable:
            return FileProblem(f"{path} is not writable ({why})", retry=True)
        return None

    def _probe_folder(self) -> FileProblem | None:
        if not self.folder.is_dir():
            return FileProblem(f"the ledger's folder {self.folder} does not exist", retry=True)
        probe = self.folder / f".{self.path.name}.probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            return FileProblem(f"the ledger's folder {self.folder} takes no new file ({_describe(exc)})", retry=True)
        try:
            written = 0
            block = b"\0" * PROBE_BYTES
            while written < PROBE_BYTES:
                written += os.write(fd, block[written:])
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            return FileProblem(f"the ledger's folder {self.folder} cannot be written "
                               f"({'full: ' if full else ''}{_describe(exc)})", retry=True)
        finally:
            os.close(fd)
            try:
                os.unlink(probe)
            except OSError:
                pass
        return None


__all__ = ["FileProblem", "SqliteFiles"]
