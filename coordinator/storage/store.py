"""Where the coordinator's jobs live between restarts: SQLite, embedded, one row per generation.

The store knows nothing of the domain: it keeps JSON records keyed by job name and generation.
WAL mode with ``synchronous=NORMAL`` makes every committed write survive a SIGKILL of the
coordinator (the write is in the OS before ``write_rows`` returns); only a power loss can cost the
last transactions, which a restarted cluster would re-form anyway.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any, Protocol

from sarcomm.coordinator.storage.state_file import StateLock, open_state

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT NOT NULL,
    generation INTEGER NOT NULL,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (name, generation)
);
"""


#: One job generation as stored: name, generation, state and the JSON record.
JobRow = tuple[str, int, str, str]


def encode_job(record: dict[str, Any]) -> JobRow:
    """The row of one job record. Encoding is left to the caller's thread on purpose: JSON encoded
    in the writer thread made the coordinator's resident memory settle ~13 MiB higher (measured
    with benchmarks/soak.py), while SQLite's own work there costs nothing of the kind."""
    return (record["name"], record["generation"], record["state"], json.dumps(record))


class StateStore(Protocol):
    """The storage boundary: what the coordinator needs from wherever its jobs live.

    Records are JSON-ready dicts (see :mod:`records`), keyed by job name and generation; nothing
    here knows the domain. SQLite (:class:`SqliteStore`) is the embedded one; another backend
    (etcd) implements the same four methods and nothing else changes.
    """

    def load_jobs(self) -> list[dict[str, Any]]:
        """The latest generation of every job name; called once at start."""
        ...

    def last_generations(self) -> dict[str, int]:
        """The highest generation ever stored for each job name; called once at start."""
        ...

    def write_rows(self, rows: list[JobRow]) -> None:
        """Records encoded by :func:`encode_job`, in one transaction: all or none are written;
        durable when it returns. Called from the writer thread (see :mod:`persistence`)."""
        ...

    def close(self) -> None:
        """Release the store; nothing is written after this."""
        ...


class SqliteStore:
    """:class:`StateStore` in a SQLite file (``path``), or in memory when ``path`` is None.

    A file is checked before anything is written to it (see :mod:`.state_file`): it is locked for
    as long as this store is open, so a second coordinator on the same file stops at once, and a
    file that is not a sarcomm state is refused untouched.

    Raises:
        StateError: the file is held by another coordinator, is not a sarcomm state, or cannot be
            read or written (the message names the path, the cause and what to do).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        # One connection shared by the event loop (reads at start) and the writer thread (see
        # persistence.WriteBehind), one of them at a time.
        self._lock = threading.Lock()
        self._holder: StateLock | None = None
        if path is None:
            self._db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            self._db.executescript(_SCHEMA)
            return
        self._holder = StateLock.acquire(path)
        try:
            self._db = open_state(path, _SCHEMA)
        except BaseException:
            self._holder.release()
            raise
        self._holder.restrict()

    def load_jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM jobs AS j WHERE generation = "
                "(SELECT MAX(generation) FROM jobs WHERE name = j.name) ORDER BY name"
            ).fetchall()
        return [json.loads(row[0]) for row in rows]

    def write_rows(self, rows: list[JobRow]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT OR REPLACE INTO jobs (name, generation, state, record) VALUES (?, ?, ?, ?)", rows
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def last_generations(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT name, MAX(generation) FROM jobs GROUP BY name").fetchall()
        return {str(name): int(generation) for name, generation in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._holder is not None:
                self._holder.release()
                self._holder = None
