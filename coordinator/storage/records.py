"""Jobs and members as the state store keeps them (JSON-ready dicts), and back.

The domain (:mod:`model`) knows nothing of this form; the store (:mod:`store`) knows nothing of
the domain. :func:`load_state` reads at start what the domain needs from storage.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sarcomm.common.constants import FailureReason
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.messages import WorkerEndpoint
from sarcomm.coordinator.domain.model import ElasticRange, Job, JobState, Member, MemberState, StoredState
from sarcomm.coordinator.storage.store import MEMBERS_PER_PIECE, JobRow, StateStore, encode_job


def load_state(store: StateStore) -> StoredState:
    """Read and decode everything the membership needs from ``store``; blocks on the store."""
    return StoredState([job_from_record(r) for r in store.load_jobs()], store.last_generations())


def write_at_once(store: StateStore) -> Callable[[Job], None]:
    """A ``persist`` for the membership that writes each changed job before returning (tests,
    tools; the server coalesces through :class:`persistence.WriteBehind`)."""
    return lambda job: store.write_rows([encode_job(job_record(job))])


@dataclass(frozen=True)
class StoredField:
    """One persisted field of :class:`Member`: its attribute (also its JSON key); how its value
    ``{v}`` is written to JSON, as a Python expression (compiled into :func:`member_record`, so
    that a write costs what the same code written by hand does); how it is read back (None: as it
    is); and the value a record written before the field existed reads as (:data:`REQUIRED`:
    every record has it)."""

    name: str
    write: str = "{v}"
    read: Callable[[Any], Any] | None = None
    missing: Any = None


#: :attr:`StoredField.missing` of a field every stored record has.
REQUIRED: Any = object()


def _interfaces(interfaces: tuple[InterfaceInfo, ...]) -> list[dict[str, Any]]:
    return [
        {
            "name": i.name,
            "addresses": list(i.addresses),
            "kind": int(i.kind),
            "default_route": i.default_route,
        }
        for i in interfaces
    ]


def _read_interfaces(records: list[dict[str, Any]]) -> tuple[InterfaceInfo, ...]:
    return tuple(
        InterfaceInfo(i["name"], tuple(i["addresses"]), InterfaceKind(i["kind"]), i["default_route"])
        for i in records
    )


def _read_endpoints(endpoints: list[list[Any]]) -> tuple[WorkerEndpoint, ...]:
    return tuple(WorkerEndpoint(*e) for e in endpoints)


def _read_failure(value: str | None) -> FailureReason | None:
    return FailureReason(value) if value is not None else None


#: Every persisted field of a member, in the order of its stored JSON: the one list from which
#: :func:`member_record`, :func:`member_from_record`, the change key of :class:`JobEncoder` and
#: its split around ``last_heartbeat`` are made. The first field starts every member's JSON.
MEMBER_FIELDS: tuple[StoredField, ...] = (
    StoredField("member_id", missing=REQUIRED),
    StoredField("secret_digest", missing=REQUIRED),
    StoredField("host", missing=REQUIRED),
    StoredField("local_rank", missing=REQUIRED),
    StoredField("requested_rank", missing=REQUIRED),
    StoredField("store_port", missing=REQUIRED),
    StoredField("interfaces", "_interfaces({v})", _read_interfaces, REQUIRED),
    StoredField("peer_address", missing=REQUIRED),
    StoredField("socket_name", missing=REQUIRED),
    StoredField("joined_at", missing=REQUIRED),
    StoredField("state", "{v}.value", MemberState, REQUIRED),
    StoredField("rank", missing=REQUIRED),
    StoredField("interface", missing=REQUIRED),
    StoredField("address", missing=REQUIRED),
    StoredField("exit_code", missing=REQUIRED),
    StoredField("reason", missing=REQUIRED),
    # The fields below were added after the first state files were written: .missing reads those.
    StoredField("failure", "(None if {v} is None else {v}.value)", _read_failure),
    StoredField("last_heartbeat", missing=REQUIRED),
    StoredField("metrics_address", missing=REQUIRED),
    StoredField("join_digest", missing=""),
    StoredField("worker_endpoints", "[list(e) for e in {v}]", _read_endpoints, ()),
)  # fmt: skip

#: The fields of :class:`Member` this coordinator keeps in memory only (see their comments in
#: :mod:`~sarcomm.coordinator.domain.model`); with :data:`MEMBER_FIELDS`, every field of a member.
MEMBER_MEMORY_ONLY = frozenset(
    {"last_report", "progress", "last_seen", "answered", "lost_at", "stream", "join_call", "verified_secret",
     "previous_rank", "trusted"}
)  # fmt: skip

#: The field a report moves every beat: :class:`JobEncoder` writes it between a member's two kept
#: halves of JSON, and leaves it out of the change key.
_BEAT_FIELD = "last_heartbeat"


def _compiled(name: str, body: str) -> Any:
    """A function ``name(m)`` returning ``body``, compiled once from :data:`MEMBER_FIELDS` (as
    dataclasses makes its methods): as fast as the same code written by hand, where a loop over
    the fields at each call would make every encoding slower."""
    namespace = dict(globals())
    exec(f"def {name}(m):\n    return {body}", namespace)  # our own text, made once at import
    return namespace[name]


#: The JSON-ready record of a member: one entry per field of :data:`MEMBER_FIELDS`, in order.
member_record: Callable[[Member], dict[str, Any]] = _compiled(
    "member_record",
    "{" + ", ".join(f"{f.name!r}: " + f.write.format(v=f"m.{f.name}") for f in MEMBER_FIELDS) + "}",
)

#: Every persisted field of a member but ``last_heartbeat``, as they are in the domain: whether
#: a member's kept JSON is stale (see :class:`JobEncoder`).
_member_key: Callable[[Member], tuple[Any, ...]] = _compiled(
    "member_key", "(" + ", ".join(f"m.{f.name}" for f in MEMBER_FIELDS if f.name != _BEAT_FIELD) + ",)"
)


def member_from_record(record: dict[str, Any]) -> Member:
    """The member ``record`` (from :func:`member_record`, or a state file of an earlier version)."""
    values: dict[str, Any] = {}
    for f in MEMBER_FIELDS:
        value = record[f.name] if f.missing is REQUIRED else record.get(f.name, f.missing)
        values[f.name] = f.read(value) if f.read is not None and f.name in record else value
    return Member(**values)


def job_record(job: Job) -> dict[str, Any]:
    return {**job_record_head(job), "members": [member_record(m) for m in job.members]}


def job_record_head(job: Job) -> dict[str, Any]:
    """:func:`job_record` but its members."""
    return {
        "name": job.name,
        "generation": job.generation,
        "world_size": job.world_size,
        "created": job.created,
        "backend": job.backend,
        "state": job.state.value,
        "formed": job.formed,
        "ended": job.ended,
        "master_addr": job.master_addr,
        "master_port": job.master_port,
        "restart_count": job.restart_count,
        "reason": job.reason,
        "failed_rank": job.failed_rank,
        "max_restarts": job.max_restarts,
        "history": job.history,
        "elastic": (
            [job.elastic.min_members, job.elastic.max_members, job.elastic.last_call] if job.elastic else None
        ),
        "closed": job.closed or "",  # "" while open: what versions before None was stored
        "rerendezvous_count": job.rerendezvous_count,
    }


def job_from_record(record: dict[str, Any]) -> Job:
    return Job(
        name=record["name"],
        generation=record["generation"],
        world_size=record["world_size"],
        created=record["created"],
        backend=record["backend"],
        state=JobState(record["state"]),
        formed=record["formed"],
        ended=record["ended"],
        master_addr=record["master_addr"],
        master_port=record["master_port"],
        restart_count=record["restart_count"],
        reason=record["reason"],
        # .get: state files written before the field existed hold no such key.
        failed_rank=record.get("failed_rank"),
        max_restarts=record.get("max_restarts", 0),
        history=record.get("history", []),
        members=[member_from_record(m) for m in record["members"]],
        elastic=ElasticRange(*elastic) if (elastic := record.get("elastic")) else None,
        closed=record.get("closed") or None,
        rerendezvous_count=record.get("rerendezvous_count", 0),
    )


def _json_number(value: float) -> str:
    # json.dumps writes a finite float as float.__repr__ does; anything else goes through json.
    return float.__repr__(value) if type(value) is float and math.isfinite(value) else json.dumps(value)


class JobEncoder:
    """The stored JSON of one job generation, encoding again only the members that changed.

    :func:`encode_job` of :func:`job_record` encodes every member at every write, on the event
    loop, while a big job's members' first reports (each names its metrics endpoint, a change)
    mark it changed at every flush. Here each member's JSON is kept with the fields it was made
    from (its change key, made from :data:`MEMBER_FIELDS`) and made again only when one of them
    changed. ``last_heartbeat`` moves with every report, so it
    is written between the two kept halves of the member's JSON instead of being one of those
    fields. The text is exactly ``json.dumps(job_record(job))``.
    """

    def __init__(self) -> None:
        # member_id -> (the fields it was encoded from, JSON before last_heartbeat's value, after it)
        self._members: dict[str, tuple[tuple[Any, ...], str, str]] = {}

    def encode(self, job: Job) -> JobRow:
        """The row of ``job``'s record (as :func:`encode_job` makes it); call on the event loop."""
        kept = self._members
        keys = [_member_key(m) for m in job.members]
        changed = sum(
            1 for m, key in zip(job.members, keys, strict=True) if _stale(kept.get(m.member_id), key)
        )
        if changed * 2 > len(keys):
            # Most members changed (a world just formed, or every member reported at once): one
            # encoding of the whole member list is cheaper than one per member, and it is cut into
            # the members' pieces for the next time.
            pieces = self._encode_whole(job, keys)
        else:
            fresh: dict[str, tuple[tuple[Any, ...], str, str]] = {}
            pieces = []
            for member, key in zip(job.members, keys, strict=True):
                entry = kept.get(member.member_id)
                if entry is None or entry[0] != key:
                    entry = (key, *_halves(json.dumps(member_record(member))))
                fresh[member.member_id] = entry
                pieces.append(entry[1] + _json_number(member.last_heartbeat) + entry[2])
            # Members that left the record (a withdrawn join) are dropped with the old map.
            self._members = fresh
        # In the store's pieces of MEMBERS_PER_PIECE (etcd keeps each chunk of pieces apart).
        chunks = tuple(
            "[" + ", ".join(pieces[start : start + MEMBERS_PER_PIECE]) + "]"
            for start in range(0, len(pieces), MEMBERS_PER_PIECE)
        )
        return JobRow(job.name, job.generation, job.state.value, json.dumps(job_record_head(job)), chunks)

    def _encode_whole(self, job: Job, keys: list[tuple[Any, ...]]) -> list[str]:
        """Every member's JSON, from one encoding of the member list; kept in halves for next time."""
        fresh: dict[str, tuple[tuple[Any, ...], str, str]] = {}
        pieces: list[str] = []
        if job.members:
            # Each member's JSON starts with its id, and no string inside one can hold the
            # unescaped '}, {"member_id": ' that separates two (json escapes every quote in one).
            parts = json.dumps([member_record(m) for m in job.members])[1:-1].split("}, " + _MEMBER_START)
            last = len(parts) - 1
            pieces = [
                (_MEMBER_START if i else "") + part + ("}" if i < last else "")
                for i, part in enumerate(parts)
            ]
            for member, key, piece in zip(job.members, keys, pieces, strict=True):
                fresh[member.member_id] = (key, *_halves(piece))
        self._members = fresh
        return pieces


#: How a member's JSON starts (its first field's key), which no string inside one can hold unescaped.
_MEMBER_START = json.dumps({MEMBER_FIELDS[0].name: None})[:-5]
#: The key of ``last_heartbeat`` in a member's JSON, and where its value (a number) ends.
_BEAT_KEY = json.dumps({_BEAT_FIELD: None})[1:-5]
_NUMBER_END = re.compile(r"[,}]")


def _stale(entry: tuple[tuple[Any, ...], str, str] | None, key: tuple[Any, ...]) -> bool:
    return entry is None or entry[0] != key


def _halves(member_json: str) -> tuple[str, str]:
    """A member's JSON before ``last_heartbeat``'s value (its key included) and after it,
    wherever the field is in it: a number, which ends at the next ``,`` or ``}``."""
    start = member_json.index(_BEAT_KEY) + len(_BEAT_KEY)
    end = _NUMBER_END.search(member_json, start)
    if end is None:
        raise ValueError(f"no value of {_BEAT_FIELD} in a member's JSON: {member_json[:200]}")
    return member_json[:start], member_json[end.start() :]
