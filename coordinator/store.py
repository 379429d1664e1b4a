"""Where the coordinator's jobs live between restarts: SQLite, embedded, one row per generation.

The store knows nothing of the domain: it keeps JSON records keyed by job name and generation.
WAL mode with ``synchronous=NORMAL`` makes every committed write survive a SIGKILL of the
coordinator (the write is in the OS before ``save_job`` returns); only a power loss can cost the
last transactions, which a restarted cluster would re-form anyway.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any, Protocol

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
    """The three things the membership logic needs from storage."""

    def load_jobs(self) -> list[dict[str, Any]]:
        """The latest generation of every job name."""
        ...

    def save_job(self, record: dict[str, Any]) -> None:
        """Insert or replace one generation of a job; durable when it returns."""
        ...

    def write_rows(self, rows: list[JobRow]) -> None:
        """Records encoded by :func:`encode_job`, in one transaction: all or none are written.

        Called from the writer thread (see :mod:`persistence`) while the loop may read.
        """
        ...

    def last_generation(self, name: str) -> int:
        """The highest generation ever stored for ``name`` (0 when none)."""
        ...


class SqliteStore:
    """:class:`StateStore` in a SQLite file (``path``), or in memory when ``path`` is None."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared by the event loop (reads at start and when a generation begins)
        # and the writer thread (see persistence.WriteBehind), one of them at a time.
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(path) if path is not None else ":memory:", isolation_level=None, check_same_thread=False
        )
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def load_jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM jobs AS j WHERE generation = "
                "(SELECT MAX(generation) FROM jobs WHERE name = j.name) ORDER BY name"
            ).fetchall()
        return [json.loads(row[0]) for row in rows]

    def save_job(self, record: dict[str, Any]) -> None:
        self.write_rows([encode_job(record)])

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

    def last_generation(self, name: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT MAX(generation) FROM jobs WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
