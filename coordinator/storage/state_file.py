"""The coordinator's state file on disk: one coordinator per file, and nobody else's file touched.

- :class:`StateLock`: the file is created 0600 (it holds hosts, addresses, ports and secret
  digests) and locked (``flock``) for as long as a coordinator uses it; a second coordinator on the
  same file stops at once, naming the process that holds it (read from ``/proc/locks``). SQLite's
  own locks are per transaction and would let two coordinators serve from one file, each with its
  own view of the jobs.
- :func:`open_state`: a file that is not a sarcomm state (not SQLite, truncated or damaged, another
  program's database) is refused after reading only; nothing is written to it, not even the switch
  to WAL. A sarcomm state carries SQLite's ``application_id`` :data:`APPLICATION_ID`; a state of an
  earlier version (no id, exactly the ``jobs`` table) is taken and given the id.

Every error is a :class:`~sarcomm.common.errors.StateError` of one line naming the path, the cause
and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
import stat
import urllib.parse
from pathlib import Path

from sarcomm.common.errors import StateError

__all__ = ["APPLICATION_ID", "StateLock", "open_state"]

log = logging.getLogger(__name__)

#: SQLite's application_id of a sarcomm state file: "SARC".
APPLICATION_ID = 0x53415243
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100
_JOBS_COLUMNS = ["name", "generation", "state", "record"]


def _cause(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else str(error)


class StateLock:
    """An exclusive ``flock`` on the state file, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: Path) -> StateLock:
        """Create (0600) or open ``path`` and lock it.

        Raises:
            StateError: ``path`` is a directory, cannot be created or opened for writing, or another
                process holds the lock.
        """
        if path.is_dir():
            example = path / "state.sqlite"
            raise StateError(
                f"--state {path}: is a directory, not a file; give a file in it, e.g. --state {example}"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise StateError(
                f"--state {path}: cannot be opened for reading and writing ({_cause(error)}); give a path "
                "in a writable folder, or fix the file's permissions"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _lock_holder(fd)
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateError(
                    f"--state {path}: another sar-coordinator ({holder}) is using this state file; stop "
                    "it first, or give this one another --state"
                ) from None
            raise StateError(f"--state {path}: cannot be locked ({_cause(error)})") from None
        return cls(path, fd)

    def restrict(self) -> None:
        """Make a state file of an earlier version (0644) 0600: it holds secret digests. Called
        once the file is known to be a sarcomm state (nobody else's file is changed)."""
        if self._fd is None:
            return
        mode = stat.S_IMODE(os.fstat(self._fd).st_mode)
        if mode & 0o077:
            with contextlib.suppress(OSError):
                os.fchmod(self._fd, 0o600)
                log.warning("--state %s: was readable by others (mode %o); now 0600", self.path, mode)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _lock_holder(fd: int) -> str:
    """Which process holds a ``flock`` on the file of ``fd``, as ``pid N``, from ``/proc/locks``."""
    inode = os.fstat(fd).st_ino
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "pid unknown"
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 fd:01:123456 0 EOF" ("->" marks a waiting lock)
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[2] != "->":
            with contextlib.suppress(ValueError, IndexError):
                if int(fields[5].rsplit(":", 1)[1]) == inode:
                    return f"pid {int(fields[4])}"
    return "pid unknown"


def open_state(path: Path, schema: str) -> sqlite3.Connection:
    """A connection to the sarcomm state at ``path`` (WAL, ``synchronous=NORMAL``), the schema in
    place. An empty file becomes a new state; anything else must be one already.

    Raises:
        StateError: the file is not SQLite, is truncated or damaged, is another program's
            database, or cannot be written.
    """
    with path.open("rb") as file:
        header = file.read(_HEADER_BYTES)
    if header and not header.startswith(_SQLITE_MAGIC):
        raise StateError(
            f"--state {path}: is not a SQLite database (it starts with {header[:16]!r}), so not a "
            "sarcomm state; give the path of a sarcomm state file, or of a file that does not exist yet"
        )
    if header and len(header) < _HEADER_BYTES:
        raise StateError(
            f"--state {path}: is truncated ({len(header)} bytes, less than a SQLite header); restore it "
            "from a backup, or move it away to start with an empty state"
        )
    uri = f"file:{urllib.parse.quote(str(path))}?mode=rw"
    db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    try:
        if header:
            _check_ours(db, path)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        db.executescript(schema)
    except sqlite3.DatabaseError as error:
        db.close()
        raise StateError(
            f"--state {path}: cannot be written ({error}); give a path on a writable file system with "
            "free space"
        ) from None
    except BaseException:
        db.close()
        raise
    return db


def _check_ours(db: sqlite3.Connection, path: Path) -> None:
    """Refuse, reading only, a database that is not a sarcomm state."""
    try:
        application_id = int(db.execute("PRAGMA application_id").fetchone()[0])
        tables = sorted(
            str(name)
            for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
        )
        columns = [str(row[1]) for row in db.execute("PRAGMA table_info(jobs)")]
        check = str(db.execute("PRAGMA quick_check").fetchone()[0])
    except sqlite3.DatabaseError as error:
        db.close()
        raise StateError(
            f"--state {path}: is damaged ({error}); restore it from a backup, or move it away to start "
            "with an empty state"
        ) from None
    if check != "ok":
        db.close()
        raise StateError(
            f"--state {path}: is damaged (SQLite's check says: {check[:200]}); restore it from a backup, "
            "or move it away to start with an empty state"
        )
    if application_id == APPLICATION_ID and columns not in ([], _JOBS_COLUMNS):
        db.close()
        raise StateError(
            f"--state {path}: is a sarcomm state of another schema (jobs columns: {', '.join(columns)}), "
            "written by another version of sar-coordinator; run that version, or give another --state"
        )
    ours = application_id == APPLICATION_ID or (
        application_id == 0 and tables == ["jobs"] and columns == _JOBS_COLUMNS
    )
    if not ours:
        db.close()
        shown = ", ".join(tables[:8]) or "none"
        raise StateError(
            f"--state {path}: is another program's SQLite database (tables: {shown}; application_id "
            f"{application_id}), not a sarcomm state; sarcomm leaves it untouched: give another --state"
        )
