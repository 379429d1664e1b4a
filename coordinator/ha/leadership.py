"""Which of the coordinators sharing one etcd store leads: an etcd lease and a leader key.

Each coordinator holds a lease of ``--leader-ttl`` seconds and renews it a few times a second.
It campaigns with one transaction per round: create ``PREFIX/leader`` bound to its lease if the
key is absent, else read it. The coordinator whose lease owns the key leads; the others stand by
and name the key's address as the leader. A leader that dies stops renewing, etcd deletes the key
when the lease expires, and the next round of a standby creates it.

The decisions are pure (:func:`decide`, :class:`LeaseClock`); :class:`Elector` does the I/O.

No two leaders: a leader counts its lease valid only until the *send* time of its last
successful renewal plus the TTL, which is never later than etcd's own expiry of it (etcd counts
from when the renewal arrived). The :class:`Elector` steps down at that moment even while a call
to etcd hangs. Writes are fenced besides (see :mod:`etcd_store`), so even a leader that is slow to
notice can never write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sarcomm.common.errors import CoordinatorFailedError, SarcommError, StoreUnavailableError
from sarcomm.common.tasks import cancel_and_wait
from sarcomm.coordinator.storage import etcd_client
from sarcomm.coordinator.storage.etcd_client import EtcdClient

log = logging.getLogger(__name__)

#: Longest pause between two rounds (renew, campaign): a standby sees a freed leader key within it.
MAX_ROUND_S = 0.25
#: The most a leader's lease is cut short by (see LeaseClock).
MAX_MARGIN_S = 0.25
#: A failure to reach etcd is logged at most this often (every round would flood the log).
WARN_EVERY_S = 15.0


class Role(Enum):
    LEADER = "leader"
    STANDBY = "standby"


@dataclass(frozen=True)
class LeaderRecord:
    """What the leader key holds: the leader's advertised gRPC address and its replica id."""

    address: str
    replica: str

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "replica": self.replica}).encode()

    @staticmethod
    def decode(value: bytes) -> LeaderRecord | None:
        try:
            data = json.loads(value)
            return LeaderRecord(str(data["address"]), str(data["replica"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class Observed:
    """The leader key as one round saw it: who, bound to which lease, created at which revision."""

    record: LeaderRecord | None
    lease: int
    create_revision: int


@dataclass(frozen=True)
class Decision:
    """This coordinator's role; ``leader`` the leader's address ("" when unknown); ``fence`` the
    leader key's create revision that its writes are conditioned on (leader only)."""

    role: Role
    leader: str = ""
    fence: int | None = None


STANDBY_UNKNOWN = Decision(Role.STANDBY)


class LeaseClock:
    """Until when this coordinator's lease is surely alive (monotonic seconds): the send time of
    the last answered renewal plus the TTL, less a margin (a tenth of the TTL, at most
    ``MAX_MARGIN_S``) for clocks that run at slightly different rates here and on etcd."""

    def __init__(self) -> None:
        self.valid_until = -math.inf

    def renewed(self, sent_at: float, ttl: float) -> None:
        """A renewal (or grant) sent at ``sent_at`` was answered with ``ttl`` seconds (0: gone)."""
        self.valid_until = sent_at + ttl - min(MAX_MARGIN_S, ttl / 10) if ttl > 0 else -math.inf

    def lost(self) -> None:
        self.valid_until = -math.inf

    def valid(self, now: float) -> bool:
        return now < self.valid_until


def decide(observed: Observed | None, lease: int | None, lease_valid: bool, replica: str = "") -> Decision:
    """The role that follows from the leader key and this coordinator's lease.

    1. Our lease owns the key and is surely alive: lead, fenced on the key's create revision.
    2. Another coordinator's lease owns it: stand by, naming its address.
    3. No key seen, ours while our lease is in doubt, or one an earlier lease of ours (``replica``
       is our id) still holds until etcd expires it: stand by, leader unknown (never name
       ourselves to the clients we refuse).
    """
    if observed is None or observed.record is None:
        return STANDBY_UNKNOWN
    if lease is not None and observed.lease == lease:
        if lease_valid:
            return Decision(Role.LEADER, observed.record.address, observed.create_revision)
        return STANDBY_UNKNOWN
    if replica and observed.record.replica == replica:
        return STANDBY_UNKNOWN
    return Decision(Role.STANDBY, observed.record.address)


class Elector:
    """Runs the election for one coordinator; ``on_change`` hears every new :class:`Decision`.

    ``on_change`` is called on the event loop and must not block. ``changes`` counts the leader
    changes this replica has seen (a new leader key after the first one it saw). ``on_failure``
    hears the error that ended the election other than by :meth:`stop` (etcd refusing for good, a
    bug): a replica without its election can never lead, so the coordinator must stop.
    """

    def __init__(
        self,
        client: EtcdClient,
        leader_key: bytes,
        record: LeaderRecord,
        ttl: int,
        on_change: Callable[[Decision], None],
        monotonic: Callable[[], float] = time.monotonic,
        on_failure: Callable[[CoordinatorFailedError], None] = lambda error: None,
    ) -> None:
        self._client = client
        self._key = leader_key
        self._record = record
        self._ttl = ttl
        self._on_change = on_change
        self._on_failure = on_failure
        self._monotonic = monotonic
        self.decision = STANDBY_UNKNOWN
        self.changes = 0
        self._seen_revision: int | None = None
        self._lease: int | None = None
        self._period = min(MAX_ROUND_S, ttl / 4)
        self.clock = LeaseClock()
        self._watchdog: asyncio.TimerHandle | None = None
        self._warned = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="leader-election")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        assert error is not None
        self._apply(STANDBY_UNKNOWN, "the leader election stopped")
        if isinstance(error, SarcommError):
            cause = str(error)
        else:
            cause = f"an unexpected error ({type(error).__name__}: {error}); please report it"
            log.debug("the leader election's error", exc_info=error)
        self._on_failure(
            CoordinatorFailedError(
                " ".join(f"the leader election stopped: {cause}; this coordinator could never lead".split())
            )
        )

    async def stop(self, resign: bool = True) -> None:
        """Stop campaigning; with ``resign`` revoke the lease so a standby takes over at once."""
        if self._task is not None and not self._task.done():
            await cancel_and_wait(self._task)
        if self._watchdog is not None:
            self._watchdog.cancel()
        lease, self._lease = self._lease, None
        self._apply(STANDBY_UNKNOWN, "shutting down")
        if resign and lease is not None:
            try:
                await asyncio.to_thread(self._client.revoke, lease)
            except StoreUnavailableError as error:
                log.warning("could not give up the leader lease (a standby takes over in its TTL): %s", error)

    def lease_valid(self) -> bool:
        """Whether this replica's lease is surely alive now (see :class:`LeaseClock`)."""
        return self.clock.valid(self._monotonic())

    def step_down(self, reason: str) -> None:
        """Stop leading now (a fenced write failed); the next round looks again."""
        if self.decision.role is Role.LEADER:
            self._apply(STANDBY_UNKNOWN, reason)
        self._wake.set()

    # -- rounds ------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._round()
            except StoreUnavailableError as error:
                now = self._monotonic()
                if now - self._warned >= WARN_EVERY_S:
                    self._warned = now
                    log.warning("leader election: %s", error)
            self._check_lease("its lease could not be renewed within its TTL")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._period)

    async def _renew(self) -> int:
        """Renew our lease, or take a new one; returns its id.

        The lease we have is renewed even while it is in doubt (etcd unreachable for a while): if
        etcd still has it, nobody else can have held the leader key meanwhile. A new lease is taken
        only once etcd says the old one expired.
        """
        if self._lease is not None:
            sent = self._monotonic()
            ttl = await asyncio.to_thread(self._client.keepalive, self._lease)
            if ttl > 0:
                self.clock.renewed(sent, ttl)
                return self._lease
            self._lease = None
            self.clock.lost()
            self._check_lease("its lease expired in etcd")
        sent = self._monotonic()
        lease, ttl = await asyncio.to_thread(self._client.grant, self._ttl)
        self._lease = lease
        self.clock.renewed(sent, ttl)
        return lease

    async def _round(self) -> None:
        lease = await self._renew()
        self._arm_watchdog()
        answer = await asyncio.to_thread(
            self._client.txn,
            "campaign for leadership",
            [etcd_client.compare_create_revision(self._key, 0)],
            [etcd_client.put(self._key, self._record.encode(), lease)],
            [etcd_client.get(self._key)],
        )
        observed = self._observed(answer)
        if observed is not None and observed.create_revision != self._seen_revision:
            if self._seen_revision is not None:
                self.changes += 1
            self._seen_revision = observed.create_revision
        valid = self.clock.valid(self._monotonic())
        self._apply(decide(observed, self._lease, valid, self._record.replica), "")

    def _observed(self, answer: Any) -> Observed | None:
        if answer.succeeded:
            return Observed(self._record, self._lease or 0, int(answer.header.revision))
        kvs = answer.responses[0].response_range.kvs
        if not kvs:
            return None
        kv = kvs[0]
        return Observed(LeaderRecord.decode(kv.value), int(kv.lease), int(kv.create_revision))

    def _arm_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.decision.role is Role.LEADER or self.clock.valid(self._monotonic()):
            delay = max(0.0, self.clock.valid_until - self._monotonic())
            self._watchdog = asyncio.get_running_loop().call_later(delay, self._watch)

    def _watch(self) -> None:
        # The loop may run a timer a clock tick early: look again rather than miss the moment.
        self._watchdog = None
        if self.clock.valid(self._monotonic()):
            self._arm_watchdog()
            return
        self._check_lease("its lease could not be renewed within its TTL")

    def _check_lease(self, reason: str) -> None:
        # Without a live lease this replica cannot tell what etcd holds: a leader stops leading, and
        # a standby stops naming a leader it can no longer see.
        if self.decision != STANDBY_UNKNOWN and not self.clock.valid(self._monotonic()):
            self._apply(STANDBY_UNKNOWN, reason)

    def _apply(self, decision: Decision, reason: str) -> None:
        if decision == self.decision:
            return
        previous, self.decision = self.decision, decision
        if decision.role is Role.LEADER:
            log.info("leading: this coordinator (%s) holds the leader key", self._record.address)
        elif previous.role is Role.LEADER:
            log.warning("stepping down: %s", reason or f"the leader is now {decision.leader or 'unknown'}")
        elif decision.leader:
            log.info("standing by: the leader is %s", decision.leader)
        self._on_change(decision)
