"""Where a torchrun worker's ``/metrics`` endpoint is noted for its agent, so that the coordinator's
``/sd`` lists it.

Under ``torchrun --rdzv-backend=sarcomm`` the coordinator's member is the node (the torchrun
agent), not each worker. The rendezvous gives every node a directory of its own
(``SAR_ENDPOINTS_DIR``, inherited by the workers, emptied at each rendezvous); a worker whose
library serves ``/metrics`` notes there, once bound, its global rank, local rank, address, port,
generation and place (torchrun's node rank, local world size and world size), one small file per
worker written whole (a rename). The agent's heartbeats read the notes of its own workers each
interval (:class:`NoteReader`: a note for a rank outside the node's workers is never listed, and
junk named like notes never starves a real one) and report them to the coordinator, which lists
one ``/sd`` target per worker.

A local directory, not the agents' TCPStore: the note never leaves the node, costs no store
traffic, and outlives nothing (the agent empties it when its workers stop).

Imports neither torch nor the library: the rank side (the library) writes, the agent side (the
torchrun rendezvous) reads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EndpointNote", "NoteReader", "clear_notes", "note_endpoint", "read_notes"]

#: A worker's note: ``rank-<RANK>.json``.
_PREFIX, _SUFFIX = "rank-", ".json"
#: Notes read at most in one pass while the node's workers are not known yet (a node runs one
#: worker per local rank; junk named like notes is passed over a pass at a time).
MAX_NOTES = 1024
#: Directory entries listed at most in one pass (the names only: a directory filled with junk
#: costs a bounded listing, never a read of each).
MAX_ENTRIES = 65536
#: The longest rank a note's name may carry (the protocol's ranks are int32).
_MAX_RANK_DIGITS = 10


@dataclass(frozen=True)
class EndpointNote:
    """One worker's ``/metrics`` endpoint: ``host`` is the address it listens on (``0.0.0.0``:
    every interface), ``generation`` the sarcomm generation it started in; ``node_rank``,
    ``local_world_size`` and ``world_size`` are torchrun's ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``
    and ``WORLD_SIZE`` of the worker: where it stands among its node's workers."""

    rank: int
    local_rank: int
    host: str
    port: int
    generation: int
    node_rank: int = -1
    local_world_size: int = 0
    world_size: int = 0

    @property
    def workers(self) -> tuple[int, int, int]:
        """The node's workers as this note places them: (first rank, how many, world size)."""
        return self.rank - self.local_rank, self.local_world_size, self.world_size

    def fits(self) -> bool:
        """Whether the note places its worker consistently: a TCP port, a local rank among the
        node's workers, and the node's ranks inside the world."""
        first, count, world = self.workers
        return (
            0 < self.port <= 65535 and 0 <= self.local_rank < count and first >= 0 and first + count <= world
        )


def note_endpoint(directory: Path, note: EndpointNote) -> Path:
    """Write ``note`` into ``directory`` whole (a reader never sees half of it); returns its path.

    Raises:
        OSError: the directory is gone or not writable.
    """
    path = directory / _name(note.rank)
    partial = directory / f".{path.name}.{os.getpid()}"
    partial.write_text(json.dumps(note.__dict__))
    os.replace(partial, path)
    return path


def _name(rank: int) -> str:
    return f"{_PREFIX}{rank}{_SUFFIX}"


def _rank_of(name: str) -> int | None:
    """The rank a note's file name carries, written as :func:`note_endpoint` writes it (no sign,
    no leading zero), else None: any other name is not read."""
    digits = name[len(_PREFIX) : -len(_SUFFIX)] if name.startswith(_PREFIX) and name.endswith(_SUFFIX) else ""
    if not (digits.isascii() and digits.isdigit() and len(digits) <= _MAX_RANK_DIGITS):
        return None
    if digits != "0" and digits.startswith("0"):
        return None
    return int(digits)


def _load(path: Path) -> EndpointNote | None:
    try:
        raw = json.loads(path.read_text())
        return EndpointNote(
            int(raw["rank"]),
            int(raw["local_rank"]),
            str(raw["host"]),
            int(raw["port"]),
            int(raw["generation"]),
            int(raw["node_rank"]),
            int(raw["local_world_size"]),
            int(raw["world_size"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class NoteReader:
    """The notes in ``directory`` of the workers of node ``node_rank`` in ``generation``.

    A note counts when it is of that generation and node, places its worker consistently
    (:meth:`EndpointNote.fits`) and is named for its rank. The first that counts, in rank order,
    tells the node's workers (first rank, count, world size); from then on only their notes are
    read, by their exact names, and only the notes that agree with it count. Until then a pass
    lists at most :data:`MAX_ENTRIES` names and reads at most :data:`MAX_NOTES` of them, going on
    where the last pass stopped: junk named like notes is passed over, never starves a real note.
    """

    def __init__(self, directory: Path, generation: int, node_rank: int) -> None:
        self._directory, self._generation, self._node_rank = directory, generation, node_rank
        self._workers: tuple[int, int, int] | None = None
        self._cursor = 0

    def read(self) -> list[EndpointNote]:
        """The node's workers' notes, by rank (none while no note counts)."""
        if self._workers is None:
            self._workers = self._find_workers()
        if self._workers is None:
            return []
        first, count, _ = self._workers
        notes = []
        for rank in range(first, first + count):
            note = _load(self._directory / _name(rank))
            if note is not None and note.rank == rank and self._counts(note):
                notes.append(note)
        return notes

    def _counts(self, note: EndpointNote) -> bool:
        return (
            note.generation == self._generation
            and note.node_rank == self._node_rank
            and note.fits()
            and (self._workers is None or note.workers == self._workers)
        )

    def _find_workers(self) -> tuple[int, int, int] | None:
        try:
            with os.scandir(self._directory) as entries:
                names = [e.name for e in itertools.islice(entries, MAX_ENTRIES)]
        except OSError:
            return None
        ranks = sorted(r for r in map(_rank_of, names) if r is not None)
        if self._cursor >= len(ranks):
            self._cursor = 0
        chosen = ranks[self._cursor : self._cursor + MAX_NOTES]
        self._cursor += len(chosen)
        for rank in chosen:
            note = _load(self._directory / _name(rank))
            if note is not None and note.rank == rank and self._counts(note):
                return note.workers
        return None


def read_notes(directory: Path, generation: int, node_rank: int) -> list[EndpointNote]:
    """One pass of a :class:`NoteReader` (a missing directory holds none)."""
    return NoteReader(directory, generation, node_rank).read()


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
