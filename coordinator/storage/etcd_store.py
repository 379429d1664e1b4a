""":class:`StateStore` in etcd, shared by every coordinator of one ``--store``; writes fenced.

Keys, under the deployment's ``PREFIX``:

- ``PREFIX/leader``: the leader key (see :mod:`leadership`).
- ``PREFIX/@jobs/<name>/<generation>``: a job generation's record, the JSON of :mod:`records`
  (zlib-compressed above 64 KiB; a reader tells them apart by the first byte: JSON starts with
  ``{``, zlib never does). A record over 1 MiB of JSON (a world of ~1200 realistic members) keeps
  only its *head* here, the record without its members, naming where they are:
- ``PREFIX/@members/<name>/<generation>/<write>/<first>``: the members from index ``first`` on,
  each chunk a zlib-compressed JSON array of at most 256 of them (20 to 33 KB for realistic
  members; a piece too large is halved), at most 1 MiB. ``write`` names one write of the record
  (the fence and a counter of this coordinator), so a write never changes a chunk a reader may
  still be reading.

Why chunks: etcd takes at most 1.5 MiB per request (``--max-request-bytes``), and each member
carries 40 bytes that do not compress (its secret's digest, its id): a realistic 32,768-member job
is 2.5 to 4.2 MB compressed (28 MB of JSON), a 65,536-member one 5.1 to 8.3 MB
(``benchmarks/record_size.py``). A record is written chunks first, in as many fenced transactions
as they need, then its head in one more, which also deletes the chunks of earlier writes (and of
writes cut short); until that transaction the previous head and chunks stand, so a reader never
sees half a write. A reader takes the heads, then each chunked head's chunks *at the revision it
read the head at*, which etcd keeps: one consistent record. Chunks keyed by member ranges at fixed
places (from 256 k on, a halved piece between) are also what lets a later write rewrite only the
chunks that changed.

One record per job name (see :func:`~.store.newest_rows`): the first time a leader writes a
generation of a job, it lists the generations stored under ``<name>/`` (keys only; job names hold
no ``/``), writes nothing if a newer one is there, and otherwise deletes the older ones' heads and
chunks in fenced transactions after its own head. Only older ones, by number: generation numbers
do not sort as text, and a write that lags behind a newer one must never remove it.

Why ``@``: one deployment must never read (or delete) another's keys. Prefix segments are letters,
digits, ``.``, ``_`` and ``-`` (see :mod:`etcd_config`), so no deployment's prefix, however nested
(``/a`` and ``/a/jobs/team``), can begin with another's ``PREFIX/@``: the ranges read here hold
this deployment's keys and nobody else's. Records of the first layout, ``PREFIX/jobs/<name>/<gen>``
(before this release), are still read, strictly (exactly a job name and a number), so an upgrade
loses no job; they are never written or deleted.

Fencing: every write is one etcd transaction conditioned on ``PREFIX/leader`` still having the
create revision it had when this coordinator became leader. A leader whose lease expired (etcd
then deletes the key) or was replaced can never write again, however long it takes to notice:
etcd refuses the transaction, :class:`LeadershipLostError` is raised and ``on_fenced`` tells the
election to step down. A batch larger than one transaction may carry (etcd's ``--max-txn-ops``,
128 by default, and its request size) is split; each part is fenced on its own.

A record that can never be stored (over :data:`MAX_RECORD_BYTES` compressed, a member larger than
a chunk may be, or a chunk etcd refuses as too large) is left out and named in a
:class:`StoreLimitError`, and the other records of the batch are written: one job never blocks
the others.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sarcomm.common.constants import is_job_name
from sarcomm.common.errors import (
    LeadershipLostError,
    StoreLimitError,
    StoreUnavailableError,
)
from sarcomm.coordinator.storage import etcd_client
from sarcomm.coordinator.storage.etcd_client import EtcdClient, RequestOp
from sarcomm.coordinator.storage.store import MEMBERS_PER_PIECE, JobRow, newest_rows

log = logging.getLogger(__name__)

#: Records (and heads) larger than this are stored compressed.
COMPRESS_ABOVE_BYTES = 64 * 1024
#: Operations per transaction (etcd's default --max-txn-ops is 128).
MAX_TXN_OPS = 120
#: Bytes of values per transaction (etcd's default --max-request-bytes is 1.5 MiB).
MAX_TXN_BYTES = 1024 * 1024
#: A record of more JSON than this is stored as a head and chunks of members.
SPLIT_ABOVE_BYTES = 1024 * 1024
#: The largest chunk (compressed): one fits a transaction with room for its key.
MAX_CHUNK_BYTES = MAX_TXN_BYTES
#: The largest record stored (compressed, all chunks): 4x the largest realistic job (65,536
#: members, 8.3 MB), 1/64 of etcd's default 2 GiB quota; more would crowd every other job out.
MAX_RECORD_BYTES = 32 * 1024 * 1024
HEADS = "@jobs"
CHUNKS = "@members"
#: The key space of the first layout (read only, see the module's docstring).
LEGACY_JOBS = "jobs"
#: What the head of a chunked record holds instead of ``members``.
CHUNKED = "chunked"

Key = tuple[str, int]


def encode_value(record_json: str) -> bytes:
    raw = record_json.encode()
    return zlib.compress(raw, 6) if len(raw) > COMPRESS_ABOVE_BYTES else raw


def decode_value(value: bytes) -> Any:
    return json.loads(value if value[:1] in (b"{", b"[") else zlib.decompress(value))


@dataclass
class _Group:
    """Operations that must share one transaction: one chunk, or one record's head."""

    key: Key
    ops: list[RequestOp]
    size: int


@dataclass
class _Plan:
    """How one row is written: its chunks (maybe none), then its head."""

    key: Key
    chunks: list[_Group] = field(default_factory=list)
    head: _Group | None = None


class EtcdStore:
    """The coordinator's jobs in etcd under ``prefix``; writes only while :meth:`fence` is set.

    ``client`` is shared with the election (it is closed by whoever made it, not here).
    ``on_fenced`` is called (from the writer thread) when etcd refused a write because this
    coordinator no longer leads.
    """

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self._heads = f"{prefix}/{HEADS}/".encode()
        self._chunks = f"{prefix}/{CHUNKS}/".encode()
        self._legacy = f"{prefix}/{LEGACY_JOBS}/".encode()
        self.leader_key = f"{prefix}/leader".encode()
        self._fence: int | None = None
        self._writes = 0
        # The newest generation of each job name this leader wrote (and deleted the older ones
        # of): a row of an older one is not written, and that generation is not looked at again.
        self._newest: dict[str, int] = {}
        self.on_fenced: Callable[[], None] = lambda: None
        self.where = f"its state in {client.settings.describe()}"

    def fence(self, revision: int | None) -> None:
        """Write only while ``PREFIX/leader`` has create revision ``revision``; None: write nothing."""
        if revision != self._fence:
            self._newest.clear()  # another term: what another leader wrote meanwhile is not known
        self._fence = revision

    # -- keys --------------------------------------------------------------------------------------

    def _head_key(self, name: str, generation: int, space: bytes | None = None) -> bytes:
        return (space or self._heads) + f"{name}/{generation}".encode()

    def _chunk_space(self, name: str, generation: int) -> bytes:
        return self._chunks + f"{name}/{generation}/".encode()

    def _generations(self, space: bytes) -> dict[str, int]:
        """The highest generation of each job name with a record under ``space``."""
        generations: dict[str, int] = {}
        for kv in self._client.range_prefix(space, keys_only=True):
            # Exactly <job name>/<number>: anything else is not a record of ours.
            name, slash, generation = kv.key[len(space) :].decode(errors="replace").partition("/")
            if slash and generation.isascii() and generation.isdigit() and is_job_name(name):
                generations[name] = max(int(generation), generations.get(name, 0))
        return generations

    # -- reads -------------------------------------------------------------------------------------

    def last_generations(self) -> dict[str, int]:
        generations = self._generations(self._legacy)
        for name, generation in self._generations(self._heads).items():
            generations[name] = max(generation, generations.get(name, 0))
        return generations

    def load_jobs(self) -> list[dict[str, Any]]:
        # Every generation of every name stays stored (history); only the latest of each is read:
        # the keys first, then those records, a transaction of reads at a time.
        current = self._generations(self._heads)
        legacy = self._generations(self._legacy)
        keys = [
            self._head_key(name, current[name])
            if current.get(name, 0) >= legacy.get(name, 0)
            else self._head_key(name, legacy[name], self._legacy)
            for name in sorted(current.keys() | legacy.keys())
        ]
        records: list[dict[str, Any]] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start : start + MAX_TXN_OPS]
            answer = self._client.txn(
                f"read {len(batch)} job record(s)", [], [etcd_client.get(k) for k in batch]
            )
            revision = int(answer.header.revision)
            for response in answer.responses:
                for kv in response.response_range.kvs:
                    records.append(self._whole(decode_value(kv.value), revision))
        return records

    def _whole(self, record: dict[str, Any], revision: int) -> dict[str, Any]:
        """``record`` with its members, read from its chunks as of ``revision`` when it has them."""
        chunked = record.pop(CHUNKED, None)
        if chunked is None:
            return record
        name, generation = record["name"], record["generation"]
        space = self._chunk_space(name, generation) + f"{chunked['write']}/".encode()
        found = []
        for kv in self._client.range_prefix(space, revision=revision):
            first = kv.key[len(space) :].decode()
            found.append((int(first) if first.isdigit() else -1, kv.value))
        members: list[Any] = []
        complete = len(found) == chunked["chunks"]
        for first, value in sorted(found):
            complete = complete and first == len(members)
            if complete:
                members += decode_value(value)
        if not complete:
            raise StoreUnavailableError(
                f"{self._client.settings.describe()}: the record of job {name!r} generation {generation} "
                f"names {chunked['chunks']} chunks of members under {space.decode()}, but {len(found)} "
                "are there or they leave gaps; the record is damaged (was its key space written by hand?)"
            )
        record["members"] = members
        return record

    # -- writes ------------------------------------------------------------------------------------

    def write_rows(self, rows: list[JobRow]) -> None:
        fence = self._fence
        if fence is None:
            raise LeadershipLostError(
                f"this coordinator does not lead, so it writes nothing to "
                f"{self._client.settings.describe()}; the leader does"
            )
        refused: dict[Key, str] = {}
        plans: list[_Plan] = []
        older: list[_Group] = []
        for row in newest_rows(rows):
            if row.generation < self._newest.get(row.name, 0):
                continue  # a newer generation of its job is written: this one is gone for good
            if self._newest.get(row.name) != row.generation:
                stored = self._stored_generations(row.name)
                if stored and max(stored) > row.generation:
                    log.debug("job %r generation %d: not written over generation %d", *row.key, max(stored))
                    continue
                older += [self._delete_generation(row, g) for g in sorted(stored) if g < row.generation]
            try:
                plans.append(self._plan(row, fence))
            except StoreLimitError as error:
                refused[row.key] = str(error)
        # Every chunk before any head that names it; a row refused on the way keeps its old head,
        # and the generations before it.
        self._commit_groups(fence, [g for plan in plans for g in plan.chunks], refused, "record chunk(s)")
        heads = [plan.head for plan in plans if plan.head is not None and plan.key not in refused]
        self._commit_groups(fence, heads, refused, "job record(s)")
        self._commit_groups(fence, older, refused, "earlier generation(s) deleted")
        for plan in plans:
            if plan.key not in refused:
                name, generation = plan.key
                self._newest[name] = generation
        if refused:
            raise StoreLimitError("; ".join(refused.values()), refused=refused)

    def _plan(self, row: JobRow, fence: int) -> _Plan:
        """The groups that write ``row``. Raises :class:`StoreLimitError` for a row too large."""
        name, generation = row.key
        space = self._chunk_space(name, generation)
        record_json = row.record_json if sum(map(len, row.pieces)) <= SPLIT_ABOVE_BYTES else None
        plan = _Plan(row.key)
        if record_json is not None:
            value = encode_value(record_json)
            # Whole: the chunks of an earlier, larger write of it (if any) go with the same step.
            ops = [etcd_client.put(self._head_key(name, generation), value)]
            ops.append(etcd_client.delete_range(space, etcd_client.prefix_end(space)))
            plan.head = _Group(row.key, ops, len(value))
            return plan
        self._writes += 1
        write = f"{fence}-{self._writes}"
        ours = space + f"{write}/".encode()
        total = 0
        for first, value in self._chunk_values(row):
            total += len(value)
            if total > MAX_RECORD_BYTES:
                raise StoreLimitError(
                    f"job {name!r} generation {generation}: its record is more than {MAX_RECORD_BYTES} "
                    f"bytes compressed, the most one job may take in {self._client.settings.describe()} "
                    "(a realistic 65,536-member job takes 8.3 MB); it is not stored: report fewer "
                    "interfaces and addresses per host, or keep jobs this large on --state (SQLite)"
                )
            plan.chunks.append(
                _Group(row.key, [etcd_client.put(ours + str(first).encode(), value)], len(value))
            )
        head = json.loads(row.head)
        head[CHUNKED] = {"write": write, "chunks": len(plan.chunks)}
        value = encode_value(json.dumps(head))
        ops = [
            etcd_client.put(self._head_key(name, generation), value),
            # Every other write's chunks: the one this head replaces, and any cut short.
            etcd_client.delete_range(space, ours),
            etcd_client.delete_range(etcd_client.prefix_end(ours), etcd_client.prefix_end(space)),
        ]
        plan.head = _Group(row.key, ops, len(value))
        return plan

    def _stored_generations(self, name: str) -> set[int]:
        """The generations of ``name`` stored: with a head, or with chunks only (a write cut
        short)."""
        found: set[int] = set()
        for space in (self._heads, self._chunks):
            start = space + f"{name}/".encode()
            for kv in self._client.range_prefix(start, keys_only=True):
                generation = kv.key[len(start) :].split(b"/", 1)[0]
                if generation.isdigit():
                    found.add(int(generation))
        return found

    def _delete_generation(self, row: JobRow, generation: int) -> _Group:
        """The deletes of generation ``generation`` of ``row``'s job: its head and its chunks."""
        head = self._head_key(row.name, generation)
        space = self._chunk_space(row.name, generation)
        ops = [
            etcd_client.delete_range(head, head + b"\0"),
            etcd_client.delete_range(space, etcd_client.prefix_end(space)),
        ]
        return _Group(row.key, ops, 0)

    def _chunk_values(self, row: JobRow) -> Iterator[tuple[int, bytes]]:
        """``(index of the first member, compressed chunk)`` for each chunk of ``row``'s members;
        a piece too large for one chunk is halved until it fits."""
        for index, piece in enumerate(row.pieces):
            pending = [(index * MEMBERS_PER_PIECE, piece)]
            while pending:
                start, text = pending.pop(0)
                value = zlib.compress(text.encode(), 6)
                if len(value) <= MAX_CHUNK_BYTES:
                    yield start, value
                    continue
                members = json.loads(text)
                if len(members) == 1:
                    raise StoreLimitError(
                        f"job {row.name!r} generation {row.generation}: member {members[0]['member_id']} "
                        f"alone is {len(value)} bytes compressed, more than one etcd request may carry "
                        f"({MAX_CHUNK_BYTES}); it is not stored: report fewer interfaces and addresses "
                        "per host, or keep jobs this large on --state (SQLite)"
                    )
                half = len(members) // 2
                pending[:0] = [
                    (start, json.dumps(members[:half])),
                    (start + half, json.dumps(members[half:])),
                ]

    def _commit_groups(self, fence: int, groups: list[_Group], refused: dict[Key, str], what: str) -> None:
        """Commit ``groups`` in as few fenced transactions as etcd's limits allow. A transaction
        etcd refuses as too large is tried again group by group; a group refused alone refuses
        its row (named in ``refused``, whose later groups are skipped)."""
        batch: list[_Group] = []
        for group in groups:
            if group.key in refused:
                continue
            ops = sum(len(g.ops) for g in batch)
            size = sum(g.size for g in batch)
            if batch and (ops + len(group.ops) > MAX_TXN_OPS or size + group.size > MAX_TXN_BYTES):
                self._commit_or_split(fence, batch, refused, what)
                batch = []
            batch.append(group)
        if batch:
            self._commit_or_split(fence, batch, refused, what)

    def _commit_or_split(self, fence: int, batch: list[_Group], refused: dict[Key, str], what: str) -> None:
        batch = [g for g in batch if g.key not in refused]
        if not batch:
            return
        size = sum(g.size for g in batch)
        try:
            self._commit(
                fence, [op for g in batch for op in g.ops], f"write {len(batch)} {what} ({size} bytes)"
            )
        except StoreLimitError as error:
            if len(batch) == 1:
                name, generation = batch[0].key
                refused[batch[0].key] = (
                    f"job {name!r} generation {generation}: its record is not stored: {error}; start etcd "
                    "with --max-request-bytes of at least 1.5 MiB (its default), or keep jobs this large "
                    "on --state (SQLite)"
                )
                return
            for group in batch:
                self._commit_or_split(fence, [group], refused, what)

    def _commit(self, fence: int, ops: list[RequestOp], what: str) -> None:
        answer = self._client.txn(what, [etcd_client.compare_create_revision(self.leader_key, fence)], ops)
        if not answer.succeeded:
            self._fence = None
            self.on_fenced()
            raise LeadershipLostError(
                f"{self._client.settings.describe()} refused the write: this coordinator no longer leads "
                f"(the leader key {self.leader_key.decode()} it created at revision {fence} is gone or "
                "replaced); it steps down and the leader carries on"
            )

    def close(self) -> None:
        self._fence = None
