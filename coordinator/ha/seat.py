"""A coordinator's seat: whether it serves Coordinator calls now, and from which term.

The server holds one :class:`Seat` and never asks which kind: a coordinator on SQLite is the
:class:`SoleSeat` (no peers: it leads for its whole life, one term), a coordinator on etcd is a
:class:`~sarcomm.coordinator.ha.replica.Replica` (it leads or stands by; a new term each time it
leads). The same router (:mod:`.router`) serves calls from either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from sarcomm.common.errors import NotLeaderError
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain.clock import Clock
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.storage.records import load_state
from sarcomm.coordinator.storage.store import SqliteStore, StateStore
from sarcomm.coordinator.term import Term


class Seat(Protocol):
    """What the server needs of a coordinator's standing among its peers."""

    @property
    def store(self) -> StateStore:
        """Where the jobs are kept."""

    @property
    def term(self) -> Term | None:
        """The term being served (None while standing by)."""

    @property
    def stored_view(self) -> Callable[[], Awaitable[Membership]] | None:
        """A read-only view of the store for ``/v1/jobs`` and ``/sd`` while standing by (None:
        this coordinator never stands by)."""

    def start(self, address: str) -> None:
        """Begin serving (or campaigning), reachable at ``address`` (``HOST:PORT`` of gRPC)."""

    def serving_term(self) -> Term | None:
        """The term to serve a call from at this instant, or None."""

    def not_leader(self) -> NotLeaderError:
        """The answer to a call while no term serves."""

    def role(self) -> dict[str, str]:
        """This coordinator's role for ``/healthz`` and ``status`` (``role`` and, on etcd, ``leader``)."""

    async def stop(self) -> None:
        """Orderly end: write what the term holds, give the seat up."""


class SoleSeat:
    """The seat of a coordinator without peers (the SQLite store, ``--state``): one term, read from
    the state file at construction, served from :meth:`start` until :meth:`stop`."""

    def __init__(self, config: CoordinatorConfig, clock: Clock, metrics: CoordinatorMetrics) -> None:
        self._store = SqliteStore(config.state)
        where = f"its state file {config.state}" if config.state is not None else "its state"
        self._term: Term | None = Term(config, self._store, load_state(self._store), clock, metrics, where)
        self._address = ""

    @property
    def store(self) -> StateStore:
        return self._store

    @property
    def term(self) -> Term | None:
        return self._term

    @property
    def stored_view(self) -> Callable[[], Awaitable[Membership]] | None:
        return None

    def start(self, address: str) -> None:
        self._address = address
        if self._term is not None:
            self._term.start()

    def serving_term(self) -> Term | None:
        term = self._term
        return term if term is not None and not term.ended else None

    def not_leader(self) -> NotLeaderError:
        # Only reached by a call that arrives while the coordinator shuts down.
        return NotLeaderError(f"this coordinator ({self._address}) is shutting down: retry in a few seconds")

    def role(self) -> dict[str, str]:
        return {"role": "leader"}

    async def stop(self) -> None:
        term, self._term = self._term, None
        if term is not None:
            await term.close()
        self._store.close()
