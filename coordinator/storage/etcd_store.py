""":class:`StateStore` in etcd, shared by every coordinator of one ``--store``; writes fenced.

Job records live under ``PREFIX/jobs/<name>/<generation>`` (job names hold no ``/``), the JSON of
:mod:`records`; a record over 64 KiB (a world of a few hundred members) is stored zlib-compressed
(it shrinks ~10x), so a 4096-member job fits etcd's 1.5 MiB request limit. A reader tells them
apart by the first byte: JSON starts with ``{``, zlib never does.

Fencing: every write is one etcd transaction conditioned on ``PREFIX/leader`` still having the
create revision it had when this coordinator became leader. A leader whose lease expired (etcd
then deletes the key) or was replaced can never write again, however long it takes to notice:
etcd refuses the transaction, :class:`LeadershipLostError` is raised and ``on_fenced`` tells the
election to step down. A batch larger than one transaction may carry (etcd's ``--max-txn-ops``,
128 by default, and its request size) is split; each part is fenced on its own.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

from sarcomm.common.errors import LeadershipLostError, StoreUnavailableError
from sarcomm.coordinator.storage import etcd_client
from sarcomm.coordinator.storage.etcd_client import EtcdClient
from sarcomm.coordinator.storage.store import JobRow

log = logging.getLogger(__name__)

#: Records larger than this are stored compressed.
COMPRESS_ABOVE_BYTES = 64 * 1024
#: Puts per transaction (etcd's default --max-txn-ops is 128; one op is the fence's compare).
MAX_TXN_PUTS = 100
#: Bytes per transaction (etcd's default --max-request-bytes is 1.5 MiB).
MAX_TXN_BYTES = 1024 * 1024
#: The largest record one request can carry with etcd's default --max-request-bytes (1.5 MiB),
#: less room for the key and the transaction around it.
MAX_RECORD_BYTES = 1536 * 1024 - 4096


def encode_value(record_json: str) -> bytes:
    raw = record_json.encode()
    return zlib.compress(raw, 6) if len(raw) > COMPRESS_ABOVE_BYTES else raw


def decode_value(value: bytes) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(value if value[:1] == b"{" else zlib.decompress(value))
    return record


class EtcdStore:
    """The coordinator's jobs in etcd under ``prefix``; writes only while :meth:`fence` is set.

    ``client`` is shared with the election (it is closed by whoever made it, not here).
    ``on_fenced`` is called (from the writer thread) when etcd refused a write because this
    coordinator no longer leads.
    """

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self._jobs = f"{prefix}/jobs/".encode()
        self.leader_key = f"{prefix}/leader".encode()
        self._fence: int | None = None
        self.on_fenced: Callable[[], None] = lambda: None
        self.where = f"its state in {client.settings.describe()}"

    def fence(self, revision: int | None) -> None:
        """Write only while ``PREFIX/leader`` has create revision ``revision``; None: write nothing."""
        self._fence = revision

    def _key(self, name: str, generation: int) -> bytes:
        return self._jobs + f"{name}/{generation}".encode()

    def _split(self, key: bytes) -> tuple[str, int] | None:
        name, _, generation = key[len(self._jobs) :].decode().rpartition("/")
        if not name or not generation.isdigit():
            log.warning("ignoring %r under the jobs prefix: not <name>/<generation>", key)
            return None
        return name, int(generation)

    def load_jobs(self) -> list[dict[str, Any]]:
        # Every generation of every name stays stored (history); only the latest of each is read:
        # the keys first, then those records, a transaction of reads at a time.
        keys = [self._key(name, generation) for name, generation in sorted(self.last_generations().items())]
        records: list[dict[str, Any]] = []
        for start in range(0, len(keys), MAX_TXN_PUTS):
            batch = keys[start : start + MAX_TXN_PUTS]
            answer = self._client.txn(
                f"read {len(batch)} job record(s)", [], [etcd_client.get(k) for k in batch]
            )
            for response in answer.responses:
                records += [decode_value(kv.value) for kv in response.response_range.kvs]
        return records

    def last_generations(self) -> dict[str, int]:
        generations: dict[str, int] = {}
        for kv in self._client.range_prefix(self._jobs, keys_only=True):
            parsed = self._split(kv.key)
            if parsed is not None:
                generations[parsed[0]] = max(parsed[1], generations.get(parsed[0], 0))
        return generations

    def write_rows(self, rows: list[JobRow]) -> None:
        fence = self._fence
        if fence is None:
            raise LeadershipLostError(
                f"this coordinator does not lead, so it writes nothing to "
                f"{self._client.settings.describe()}; the leader does"
            )
        batch: list[Any] = []
        size = 0
        for name, generation, _, record_json in rows:
            value = encode_value(record_json)
            if len(value) > MAX_RECORD_BYTES:
                raise StoreUnavailableError(
                    f"job {name!r} generation {generation}: its record is {len(value)} bytes compressed, "
                    f"more than etcd takes in one request by default ({MAX_RECORD_BYTES}); start etcd "
                    "with a larger --max-request-bytes, or keep jobs this large on --state (SQLite)"
                )
            if batch and (len(batch) >= MAX_TXN_PUTS or size + len(value) > MAX_TXN_BYTES):
                self._commit(fence, batch)
                batch, size = [], 0
            batch.append(etcd_client.put(self._key(name, generation), value))
            size += len(value)
        if batch:
            self._commit(fence, batch)

    def _commit(self, fence: int, puts: list[Any]) -> None:
        answer = self._client.txn(
            f"write {len(puts)} job record(s)",
            [etcd_client.compare_create_revision(self.leader_key, fence)],
            puts,
        )
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
