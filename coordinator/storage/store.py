"""Where the coordinator's jobs live between restarts: SQLite, embedded, one row per job.

The store knows nothing of the domain: it keeps JSON records keyed by job name and generation,
the newest generation of each job name only (see :func:`newest_rows`).
WAL mode with ``synchronous=NORMAL`` makes every committed write survive a SIGKILL of the
coordinator (the write is in the OS before ``write_rows`` returns); only a power loss can cost the
last transactions, which a restarted cluster would re-form anyway.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sarcomm.common.errors import StoreLimitError
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


#: Members per piece of a row (see :class:`JobRow`): a piece of realistic members is ~200 KB of
#: JSON, ~20 to 35 KB compressed, so a 65,536-member job is 256 pieces.
MEMBERS_PER_PIECE = 256
#: SQLite's default SQLITE_MAX_LENGTH: the longest text one row may hold (Python < 3.11 cannot ask).
SQLITE_MAX_LENGTH = 1_000_000_000


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job generation as stored: its name, generation and state, and its JSON record in two
    parts: ``head``, the record without its members, and ``pieces``, the members as JSON arrays of
    :data:`MEMBERS_PER_PIECE`, in order. SQLite keeps the whole record (:attr:`record_json`); etcd
    keeps the head and the members in chunks of whole pieces (see :mod:`.etcd_store`), which it
    can do without parsing the JSON again."""

    name: str
    generation: int
    state: str
    head: str
    pieces: tuple[str, ...]

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.generation

    @property
    def record_json(self) -> str:
        """The JSON of the whole record, exactly as ``json.dumps(record)`` writes it."""
        members = ", ".join(piece[1:-1] for piece in self.pieces if piece != "[]")
        return f'{self.head[:-1]}, "members": [{members}]}}'


def encode_job(record: dict[str, Any]) -> JobRow:
    """The row of one job record. Encoding is left to the caller's thread on purpose: JSON encoded
    in the writer thread made the coordinator's resident memory settle ~13 MiB higher (measured
    with benchmarks/soak.py), while SQLite's own work there costs nothing of the kind."""
    members = record["members"]
    head = json.dumps({k: v for k, v in record.items() if k != "members"})
    pieces = tuple(
        json.dumps(members[start : start + MEMBERS_PER_PIECE])
        for start in range(0, len(members), MEMBERS_PER_PIECE)
    )
    return JobRow(record["name"], record["generation"], record["state"], head, pieces)


def newest_rows(rows: list[JobRow]) -> list[JobRow]:
    """``rows`` less those a newer generation of the same job name in ``rows`` supersedes.

    Every store keeps one record per job name: the newest generation's, which is the only one ever
    read again (:meth:`StateStore.load_jobs`; its record carries the earlier generations' history),
    and whose number is the highest ever stored (:meth:`StateStore.last_generations`). Writing a
    generation deletes the earlier ones of its name; a generation older than one already written
    is not written (a job's last change of an ended generation can reach the writer after, or
    together with, the generation that followed it). Without this, every re-formation of a job
    would leave its whole record behind for good: 5 to 8 MB in etcd for a 65,536-member job.
    """
    newest: dict[str, int] = {}
    for row in rows:
        newest[row.name] = max(row.generation, newest.get(row.name, row.generation))
    return [row for row in rows if row.generation == newest[row.name]]


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
        """Records encoded by :func:`encode_job`; durable when it returns. Called from the writer
        thread (see :mod:`persistence`). A record written deletes the earlier generations of its
        job name, and one older than a generation already stored is not written (see
        :func:`newest_rows`).

        Raises:
            StoreLimitError: some records can never be stored (too large); every other record was
                written, and ``error.refused`` names the refused ones.
            StoreUnavailableError, OSError, sqlite3.Error: nothing may have been written; the same
                rows may be written again later.
        """
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
        # A record longer than SQLite stores in one row would fail the whole transaction, and the
        # next one, for ever: it is left out, named, and the others are written.
        limit = self._max_length()
        kept: list[tuple[str, int, str, str]] = []
        refused: dict[tuple[str, int], str] = {}
        storable: list[JobRow] = []
        records: dict[tuple[str, int], str] = {}
        for row in rows:
            record = row.record_json
            if len(record) > limit:
                refused[row.key] = (
                    f"job {row.name!r} generation {row.generation}: its record is {len(record)} bytes, "
                    f"more than SQLite stores in one row ({limit} bytes); it is not stored"
                )
            else:
                storable.append(row)
                records[row.key] = record
        for row in newest_rows(storable):
            kept.append((row.name, row.generation, row.state, records[row.key]))
        with self._lock:
            self._db.execute("BEGIN")
            try:
                # Not over a newer generation of the same name, and then the older ones go.
                self._db.executemany(
                    "INSERT OR REPLACE INTO jobs (name, generation, state, record) SELECT ?1, ?2, ?3, ?4 "
                    "WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE name = ?1 AND generation > ?2)",
                    kept,
                )
                self._db.executemany(
                    "DELETE FROM jobs WHERE name = ? AND generation < ?", [(k[0], k[1]) for k in kept]
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        if refused:
            raise StoreLimitError("; ".join(refused.values()), refused=refused)

    def _max_length(self) -> int:
        getlimit = getattr(self._db, "getlimit", None)  # Python 3.11+
        which = getattr(sqlite3, "SQLITE_LIMIT_LENGTH", None)
        return int(getlimit(which)) if getlimit is not None and which is not None else SQLITE_MAX_LENGTH

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
