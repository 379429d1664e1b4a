"""Where a torchrun worker's ``/metrics`` endpoint is noted for its agent, so that the coordinator's
``/sd`` lists it.

Under ``torchrun --rdzv-backend=sarcomm`` the coordinator's member is the node (the torchrun
agent), not each worker. The rendezvous gives every node a directory of its own
(``SAR_ENDPOINTS_DIR``, inherited by the workers, emptied at each rendezvous); a worker whose
library serves ``/metrics`` notes there, once bound, its global rank, local rank, address, port
and generation, one small file per worker written whole (a rename). The agent's heartbeats read
the directory each interval and report the endpoints of the running generation to the
coordinator, which lists one ``/sd`` target per worker.

A local directory, not the agents' TCPStore: the note never leaves the node, costs no store
traffic, and outlives nothing (the agent empties it when its workers stop).

Imports neither torch nor the library: the rank side (the library) writes, the agent side (the
torchrun rendezvous) reads.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EndpointNote", "clear_notes", "note_endpoint", "read_notes"]

#: A worker's note: ``rank-<RANK>.json``.
_PREFIX, _SUFFIX = "rank-", ".json"
#: Notes read at most from one directory (a node runs one worker per local rank).
MAX_NOTES = 1024


@dataclass(frozen=True)
class EndpointNote:
    """One worker's ``/metrics`` endpoint: ``host`` is the address it listens on (``0.0.0.0``:
    every interface), ``generation`` the sarcomm generation it started in."""

    rank: int
    local_rank: int
    host: str
    port: int
    generation: int


def note_endpoint(directory: Path, note: EndpointNote) -> Path:
    """Write ``note`` into ``directory`` whole (a reader never sees half of it); returns its path.

    Raises:
        OSError: the directory is gone or not writable.
    """
    path = directory / f"{_PREFIX}{note.rank}{_SUFFIX}"
    partial = directory / f".{path.name}.{os.getpid()}"
    partial.write_text(json.dumps(note.__dict__))
    os.replace(partial, path)
    return path


def read_notes(directory: Path, generation: int) -> list[EndpointNote]:
    """The notes in ``directory`` of workers of ``generation``, by rank: a file that is not a
    note, or one of another generation, is passed over; a missing directory holds none."""
    notes: list[EndpointNote] = []
    try:
        entries = sorted(e.name for e in os.scandir(directory) if e.name.startswith(_PREFIX))
    except OSError:
        return notes
    for name in entries[:MAX_NOTES]:
        try:
            raw = json.loads((directory / name).read_text())
            note = EndpointNote(
                int(raw["rank"]),
                int(raw["local_rank"]),
                str(raw["host"]),
                int(raw["port"]),
                int(raw["generation"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (
            note.generation == generation
            and 0 < note.port <= 65535
            and note.rank >= 0
            and note.local_rank >= 0
        ):
            notes.append(note)
    return sorted(notes, key=lambda n: n.rank)


def clear_notes(directory: Path) -> None:
    """Remove every note from ``directory`` (its workers are stopped; the next ones note anew)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith((_PREFIX, f".{_PREFIX}")):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
