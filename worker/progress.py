"""Where a rank is in its collectives, shared with its agent through a small memory-mapped file.

The rank's library notes, on entering and leaving each collective, its sequence number, op and
time; its heartbeat thread publishes that, with a "still alive" stamp, every interval. The agent
reads every local rank's record each interval and batches them into one heartbeat stream to the
coordinator. So a rank that is stopped (SIGSTOP) or wedged stops stamping even though its agent is
fine, and a rank stuck *waiting* in collective #k (its threads still run) is seen to be alive and
in #k: the coordinator can name whom everybody waits for.

The collective path only swaps a tuple; no system call and no shared write is made there. A
seqlock (an even/odd version around each write) keeps the reader from seeing a torn record
without any lock between processes.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

# A version (u64) at offset 0, then: pid (i64), stamp (f64), seq (i64), in_collective (u8),
# since (f64), op (32 bytes), metrics_port (i32: the port of the rank's /metrics, 0 = none).
_VERSION = struct.Struct("<Q")
_LAYOUT = struct.Struct("<qdq?d32si")
RECORD_SIZE = _VERSION.size + _LAYOUT.size
OP_BYTES = 32
_READ_ATTEMPTS = 100


@dataclass(frozen=True)
class ProgressRecord:
    """One reading of a rank's record; ``stamp`` and ``since`` are Unix times in seconds."""

    pid: int
    stamp: float
    seq: int
    op: str
    in_collective: bool
    since: float
    #: Port of the rank's ``/metrics`` endpoint; 0 while it serves none.
    metrics_port: int = 0


class ProgressWriter:
    """The rank's side. ``path`` None keeps the record in anonymous memory (no agent to read it).

    :meth:`enter` and :meth:`leave` sit on every collective's path, so they only swap one tuple
    (atomic under the GIL, about 0.2 µs); :meth:`publish`, called by the rank's heartbeat thread
    every interval, copies the latest tuple and a fresh "alive" stamp into the shared record.
    """

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            self._map = mmap.mmap(-1, RECORD_SIZE)
        else:
            with open(path, "a+b") as file:
                file.truncate(RECORD_SIZE)
                self._map = mmap.mmap(file.fileno(), RECORD_SIZE)
        self._version = 0
        self._pid = os.getpid()
        self._seq = 0
        # (seq, op, in_collective, since): replaced whole, never mutated, so a reader thread
        # always sees one consistent state.
        self.current: tuple[int, str, bool, float] = (0, "", False, 0.0)
        #: The port the rank's metrics server bound (0: none); the agent reports it to the coordinator.
        self.metrics_port = 0
        self.publish()

    def enter(self, op: str) -> int:
        """Record entering the next collective; returns its sequence number."""
        self._seq += 1
        self.current = (self._seq, op, True, time.time())
        return self._seq

    def leave(self) -> None:
        """Record leaving the current collective."""
        self.current = (self._seq, self.current[1], False, time.time())

    def publish(self, stamp: float | None = None) -> ProgressRecord:
        """Write the latest state and an alive ``stamp`` (default now) into the shared record."""
        seq, op, in_collective, since = self.current
        stamp = time.time() if stamp is None else stamp
        # Odd version while writing; the reader retries until it sees the same even version on both
        # sides of its read, so it never uses a torn record.
        self._version += 1
        _VERSION.pack_into(self._map, 0, self._version)
        _LAYOUT.pack_into(
            self._map,
            _VERSION.size,
            self._pid,
            stamp,
            seq,
            in_collective,
            since,
            op.encode()[:OP_BYTES],
            self.metrics_port,
        )
        self._version += 1
        _VERSION.pack_into(self._map, 0, self._version)
        return ProgressRecord(self._pid, stamp, seq, op, in_collective, since, self.metrics_port)

    def close(self) -> None:
        self._map.close()


class ProgressReader:
    """The agent's side: reads the record a rank writes at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None

    def read(self) -> ProgressRecord | None:
        """The rank's latest consistent record, or None before the rank has written one."""
        if self._map is None:
            try:
                with open(self.path, "rb") as file:
                    if os.fstat(file.fileno()).st_size < RECORD_SIZE:
                        return None
                    self._map = mmap.mmap(file.fileno(), RECORD_SIZE, prot=mmap.PROT_READ)
            except FileNotFoundError:
                return None
        for _ in range(_READ_ATTEMPTS):
            (before,) = _VERSION.unpack_from(self._map, 0)
            if before % 2:
                continue
            fields = _LAYOUT.unpack_from(self._map, _VERSION.size)
            (after,) = _VERSION.unpack_from(self._map, 0)
            if before == after:
                if before == 0:
                    return None
                pid, stamp, seq, in_collective, since, op, metrics_port = fields
                return ProgressRecord(
                    pid,
                    stamp,
                    seq,
                    op.rstrip(b"\0").decode(errors="replace"),
                    in_collective,
                    since,
                    metrics_port,
                )
        return None  # a writer kept writing through every attempt; the next interval will do

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
