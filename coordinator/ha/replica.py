"""A coordinator as one replica of several sharing an etcd store: it leads or stands by.

The :class:`Elector` decides; this turns its decisions into terms. Becoming leader: fence the
store's writes on the leader key, read every job from etcd, and begin a :class:`Term` (its
members get ``--reconnect-grace`` before anyone is judged; a world that was forming is not in the
store, so its members' retried joins form it afresh under the next generation number, once).
Stopping leading: unfence, abandon the term (its calls end UNAVAILABLE naming the leader), and
stand by. A standby answers ``/v1/jobs`` and ``/sd`` from a read-only view of the store.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable

from sarcomm.common.errors import CoordinatorFailedError, NotLeaderError, StoreUnavailableError
from sarcomm.common.tasks import cancel_and_wait
from sarcomm.coordinator.api.metrics import CoordinatorMetrics
from sarcomm.coordinator.config import CoordinatorConfig
from sarcomm.coordinator.domain.clock import Clock
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import StoredState
from sarcomm.coordinator.ha.leadership import Decision, Elector, LeaderRecord, Role
from sarcomm.coordinator.ha.upkeep import StoreUpkeep
from sarcomm.coordinator.storage.etcd_client import CALL_TIMEOUT_S, EtcdClient
from sarcomm.coordinator.storage.etcd_config import EtcdSettings
from sarcomm.coordinator.storage.etcd_store import EtcdStore
from sarcomm.coordinator.storage.records import job_from_record, load_state
from sarcomm.coordinator.term import Term, build_membership

log = logging.getLogger(__name__)

#: How long a standby's read of the store answers /v1/jobs and /sd before it is read again.
VIEW_CACHE_S = 1.0
#: How long a standby's /v1/jobs or /sd waits for etcd before it answers 503.
VIEW_TIMEOUT_S = 2.0
#: A take-over that cannot read the jobs is retried each round; its error is logged this often.
TAKE_OVER_LOG_EVERY_S = 15.0


class Replica:
    """The etcd side of one coordinator; ``on_term`` hears each new term (None: standing by),
    ``on_failure`` the error that ended its election (the coordinator must then stop)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        settings: EtcdSettings,
        clock: Clock,
        metrics: CoordinatorMetrics,
        on_term: Callable[[Term | None], None],
        on_failure: Callable[[CoordinatorFailedError], None] = lambda error: None,
    ) -> None:
        self._config = config
        self._settings = settings
        self._clock = clock
        self._metrics = metrics
        self._on_term = on_term
        self._on_failure = on_failure
        # Election calls must answer well within the TTL, or a renewal comes too late to count.
        self.client = EtcdClient(settings, timeout=min(CALL_TIMEOUT_S, max(0.5, settings.leader_ttl / 2)))
        self.store = EtcdStore(self.client, settings.prefix)
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.address = ""
        self.elector: Elector | None = None
        self.term: Term | None = None
        self._taking_over: asyncio.Task[None] | None = None
        self._counted_changes = 0
        self._view: tuple[float, Membership] | None = None
        self._take_over_logged = -math.inf
        metrics.leader.set(0)
        # Every replica measures etcd's size; only the leader compacts its history.
        self.upkeep = StoreUpkeep(self.client, metrics.store_gauges(), lambda: self.leading)

    def start(self, address: str) -> None:
        """Begin campaigning, publishing ``address`` (this coordinator's gRPC) as leader."""
        self.address = address
        loop = asyncio.get_running_loop()

        def fenced() -> None:  # called in the writer thread
            loop.call_soon_threadsafe(self._step_down, "etcd refused a write: another coordinator leads now")

        self.store.on_fenced = fenced
        self.elector = Elector(
            self.client,
            self.store.leader_key,
            LeaderRecord(address, self.replica_id),
            self._settings.leader_ttl,
            self._decided,
            on_failure=self._on_failure,
        )
        self.elector.start()
        self.upkeep.start()
        log.info(
            "replica %s of %s: campaigning with a %d s lease",
            self.replica_id,
            self._settings.describe(),
            self._settings.leader_ttl,
        )

    @property
    def leading(self) -> bool:
        return self.serving_term() is not None

    def serving_term(self) -> Term | None:
        """The term to serve a call from, or None. Checked against the lease at this instant, not
        only by the watchdog: a process resumed after a pause (SIGSTOP, a VM stall) may see calls
        before its timers, and must not answer them as leader once its lease is in doubt."""
        term = self.term
        if term is None or term.ended or self.elector is None:
            return None
        if not self.elector.lease_valid():
            self.elector.step_down("its lease could not be renewed within its TTL")
            return None
        return term

    def _step_down(self, reason: str) -> None:
        if self.elector is not None:
            self.elector.step_down(reason)

    def _decided(self, decision: Decision) -> None:
        assert self.elector is not None
        self._metrics.leader.set(1 if decision.role is Role.LEADER else 0)
        self._metrics.leader_changes.inc(self.elector.changes - self._counted_changes)
        self._counted_changes = self.elector.changes
        if decision.role is Role.LEADER:
            if self.term is None and self._taking_over is None and decision.fence is not None:
                self._taking_over = asyncio.create_task(self._take_over(decision.fence), name="take-over")
            return
        self._stand_by()

    async def _take_over(self, fence: int) -> None:
        assert self.elector is not None
        self.store.fence(fence)
        try:
            stored = await asyncio.to_thread(load_state, self.store)
        except Exception as error:
            # Retried from the next election round (a quarter second): logged now and then only.
            if time.monotonic() - self._take_over_logged >= TAKE_OVER_LOG_EVERY_S:
                self._take_over_logged = time.monotonic()
                log.error(
                    "could not read the jobs from %s to take over: %s", self._settings.describe(), error
                )
            self._taking_over = None
            self.elector.step_down("the jobs could not be read")
            return
        self._taking_over = None
        if self.elector.decision.fence != fence:
            return  # stepped down while reading
        term = Term(self._config, self.store, stored, self._clock, self._metrics, self.store.where)
        term.start()
        self.term = term
        self._on_term(term)
        log.info(
            "took over as leader with %d job(s) from %s; their members have %g s to reconnect",
            len(stored.jobs),
            self._settings.describe(),
            max(self._config.reconnect_grace, self._config.liveness_timeout),
        )

    def _stand_by(self) -> None:
        self.store.fence(None)
        if self._taking_over is not None:
            self._taking_over.cancel()
            self._taking_over = None
        term, self.term = self.term, None
        if term is not None:
            term.abandon()
            self._on_term(None)

    def role(self) -> dict[str, str]:
        leader = self.elector.decision.leader if self.elector is not None else ""
        return {"role": "leader" if self.leading else "standby", "leader": leader}

    def not_leader(self) -> NotLeaderError:
        """The answer of this replica while it does not lead."""
        leader = self.elector.decision.leader if self.elector is not None else ""
        if leader:
            return NotLeaderError(
                f"this coordinator ({self.address}) stands by; the leader is {leader}: send Coordinator "
                "calls there (clients given every coordinator's address follow it)",
                leader=leader,
            )
        return NotLeaderError(
            f"this coordinator ({self.address}) stands by and no leader is known: "
            f"{self._settings.describe()} is unreachable or has lost its quorum, or a leader is being "
            "elected; retry in a few seconds, and check that a majority of the etcd members run",
        )

    @property
    def stored_view(self) -> Callable[[], Awaitable[Membership]] | None:
        return self._read_view

    async def _read_view(self) -> Membership:
        """A read-only membership of what the store holds (cached for a second)."""
        now = time.monotonic()  # a cache's age, not the domain's time (tests move that one)
        if self._view is not None and now - self._view[0] < VIEW_CACHE_S:
            return self._view[1]
        try:
            records = await asyncio.wait_for(asyncio.to_thread(self.store.load_jobs), VIEW_TIMEOUT_S)
        except TimeoutError:
            raise StoreUnavailableError(
                f"{self._settings.describe()} did not answer within {VIEW_TIMEOUT_S:g} s: has it lost its "
                "quorum? a majority of its members must run"
            ) from None
        stored = StoredState([job_from_record(r) for r in records])
        view = build_membership(self._config, stored, self._clock, None)
        self._view = (now, view)
        return view

    async def stop(self) -> None:
        """Orderly end: write what the term still holds, then give up the lease (a standby takes
        over at once instead of after the TTL)."""
        await self.upkeep.stop()
        await cancel_and_wait(self._taking_over)
        term, self.term = self.term, None
        if term is not None:
            try:
                await term.close()
            except Exception as error:  # etcd gone: the next leader decides from what was written
                log.warning("could not write the last changes to %s: %s", self._settings.describe(), error)
                term.abandon()
        if self.elector is not None:
            await self.elector.stop(resign=True)
        self.store.close()
        self.client.close()
