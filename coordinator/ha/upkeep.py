"""etcd's history kept bounded, and its size shown: the leader compacts, every replica measures.

etcd keeps every revision of every key until it is compacted, and stops taking writes (the NOSPACE
alarm) once its database reaches its quota. A job's record is rewritten with every change of its
members (a 32,768-member record is 2.5 to 4.2 MB compressed), so without compaction a few hundred
rewrites of big jobs, or weeks of ordinary ones, fill the default 2 GiB. The leader therefore
compacts the revisions older than ``--etcd-compaction-retention`` (300 s by default, as
Kubernetes' API server does every 5 minutes) whatever the operator's etcd does by itself.
Compaction is etcd-wide: it removes those revisions of every key, other users' included (their
watches from an older revision fail and must restart from a newer one). Defragmentation, which
gives the freed pages back to the file system, stays an operator's task (docs/high-availability.md).

:class:`CompactionPlan` decides (pure, given the time); :class:`StoreUpkeep` does the I/O: every
:func:`upkeep_period` it asks etcd for its revision and database size, sets
``sar_coordinator_store_bytes``, and compacts when the plan says so. Its quota,
``sar_coordinator_store_quota_bytes``, is read from etcd's own /metrics now and then.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable

from sarcomm.common.errors import StoreUnavailableError
from sarcomm.coordinator.api.metrics import StoreGauges
from sarcomm.coordinator.storage.etcd_client import EtcdClient

log = logging.getLogger(__name__)

#: The longest time between two looks at etcd's size (and two chances to compact).
MAX_PERIOD_S = 10.0
#: The shortest one, for tests' short retentions.
MIN_PERIOD_S = 0.2
#: How often etcd's quota is read again from its /metrics (it changes only with an etcd restart).
QUOTA_EVERY_S = 60.0
#: A failure to reach etcd here is logged at most this often (the election says it too).
WARN_EVERY_S = 60.0


def upkeep_period(retention: float) -> float:
    """Seconds between two looks: a fifth of the retention, within MIN_PERIOD_S..MAX_PERIOD_S, so
    that revisions are compacted at most a fifth of the retention later than due."""
    if retention <= 0:
        return MAX_PERIOD_S
    return min(MAX_PERIOD_S, max(MIN_PERIOD_S, retention / 5))


class CompactionPlan:
    """Which revision to compact to: the newest one seen at least ``retention`` seconds ago.

    Every revision before it was written before that look, so longer than ``retention`` ago;
    revisions written since stay. ``retention`` 0 compacts nothing.
    """

    def __init__(self, retention: float) -> None:
        self.retention = retention
        self._seen: collections.deque[tuple[float, int]] = collections.deque()
        self.compacted = 0

    def observe(self, now: float, revision: int) -> int | None:
        """Note that etcd was at ``revision`` at ``now``; the revision to compact to now, if any."""
        if self.retention <= 0:
            return None
        self._seen.append((now, revision))
        due: int | None = None
        while self._seen and self._seen[0][0] <= now - self.retention:
            due = self._seen.popleft()[1]
        if due is None or due <= self.compacted:
            return None
        return due

    def done(self, revision: int) -> None:
        """etcd compacted up to ``revision``."""
        self.compacted = max(self.compacted, revision)


class StoreUpkeep:
    """The loop of one replica: measure etcd every period; compact while ``leading()``."""

    def __init__(
        self,
        client: EtcdClient,
        gauges: StoreGauges,
        leading: Callable[[], bool],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._gauges = gauges
        self._leading = leading
        self._monotonic = monotonic
        self.plan = CompactionPlan(client.settings.compaction_retention)
        self.period = upkeep_period(client.settings.compaction_retention)
        self._quota_read = -math.inf
        self._warned = -math.inf
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="etcd-upkeep")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except StoreUnavailableError as error:
                now = self._monotonic()
                if now - self._warned >= WARN_EVERY_S:
                    self._warned = now
                    log.warning("could not measure or compact etcd's history: %s", error)
            await asyncio.sleep(self.period)

    async def tick(self) -> None:
        """One look: the quota when due, the size, and a compaction when due and leading."""
        now = self._monotonic()
        if now - self._quota_read >= QUOTA_EVERY_S:
            self._quota_read = now
            quota = await asyncio.to_thread(self._client.quota_bytes)
            if quota is not None:
                self._gauges.set_quota(quota)
        revision, size = await asyncio.to_thread(self._client.status)
        self._gauges.size_bytes.set(size)
        due = self.plan.observe(now, revision)
        if due is not None and self._leading():
            await asyncio.to_thread(self._client.compact, due)
            self.plan.done(due)
            log.debug("compacted etcd's history up to revision %d (now at %d)", due, revision)
