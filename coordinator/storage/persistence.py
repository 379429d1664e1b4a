"""Job state writes off the event loop, coalesced, with group commit for the answers that need it.

Every change to a job (a world formed, a member left or failed, a rank's metrics endpoint became
known) rewrites that job's record. Written at once, on the loop, a 4096-member job costs ~25 ms per
change (building the record, JSON, SQLite), and the 4096 first reports or 4096 leaves of such a job
would hold the loop for minutes. So a change only marks its job; a flush a moment later builds and
encodes each marked job's record once, however many changes it took (encoding again only the
members that changed since its last flush: :class:`records.JobEncoder`), and a single writer thread
writes them all in one SQLite transaction while the loop goes on serving.

Durability is kept where an answer depends on it: a Join or Leave handler awaits :meth:`durable`
before it answers, so nothing a client was told is lost with a SIGKILL (the write is in the OS, as
with the synchronous store). Changes nobody is answered about (a metrics endpoint, a verdict of
the liveness sweep) are written without anyone waiting, within milliseconds for a small job and at
most :data:`MAX_UNANSWERED_DELAY_S` for one whose record is costly to encode; after a crash a
verdict not yet written is reached again by the same rule.

A write that failed is tried again a second later, with everything marked since: a full disk or
an etcd without its quorum comes back. A record the store can never take (too large: a
:class:`StoreLimitError`) is not: the store wrote the others and named it, its job's callers get
that error (RESOURCE_EXHAUSTED, naming the limit) at once, and it is tried again only with its
job's next change. Re-queued, it would fail every later batch, and every job's answers with it.
A store that refuses every write for space (etcd's NOSPACE alarm: a :class:`StoreFullError`) is
retried like one it cannot reach, but its callers get RESOURCE_EXHAUSTED naming the cause and what
to do, and it is logged once when it begins and once when writes go through again, not every
second in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

from sarcomm.common.errors import (
    CoordinatorUnavailableError,
    LeadershipLostError,
    StoreFullError,
    StoreLimitError,
    StoreUnavailableError,
)
from sarcomm.coordinator.domain.model import Job
from sarcomm.coordinator.storage.records import JobEncoder, job_record
from sarcomm.coordinator.storage.store import JobRow, StateStore, encode_job

log = logging.getLogger(__name__)

#: How long a flush waits after the first change, gathering the changes that follow it (a burst of
#: leaves arrives over milliseconds: each one written alone would rewrite the same record).
FLUSH_DELAY_S = 0.002
#: The loop's share of a burst spent on encoding is kept under 1 / (1 + COST_FACTOR): after a
#: flush that took T on the loop, the next one gathers changes for COST_FACTOR x T (at most
#: MAX_FLUSH_DELAY_S). A 4096-member record takes ~25 ms to encode; its leaves then come in batches
#: every ~50 ms instead of one batch every 2 ms that each re-encodes the same job.
COST_FACTOR = 2.0
MAX_FLUSH_DELAY_S = 0.1
#: The same pacing for changes no answer waits for (a rank's metrics endpoint, a verdict of the
#: liveness sweep), with a loop share under 1 / (1 + UNANSWERED_COST_FACTOR): a 32,768-member job's
#: first reports (each names its endpoint) come over tens of seconds, and flushes that each took
#: 0.1 to 0.3 s held a third to a half of the loop while 4096 new streams waited for their first
#: answers (gRPC takes a new call only when the loop comes round). An answer that then waits (a
#: Join, a Leave) brings the flush forward to the pace of COST_FACTOR and MAX_FLUSH_DELAY_S.
UNANSWERED_COST_FACTOR = 8.0
MAX_UNANSWERED_DELAY_S = 2.0
#: Jobs whose encoders are kept between flushes at most (see records.JobEncoder).
MAX_ENCODERS = 256
#: After a failed write (disk full, I/O error), how long until the marked jobs are tried again.
RETRY_DELAY_S = 1.0


class WriteBehind:
    """Coalescing, ordered writer of job records to ``store``; use from the event loop only."""

    def __init__(self, store: StateStore, delay: float = FLUSH_DELAY_S, where: str = "its state") -> None:
        self._store = store
        # What a failed write names, e.g. "its state file /var/lib/sarcomm/state.sqlite".
        self._where = where
        self._delay = delay
        # One thread: batches reach the store in the order they were taken, never two at once.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self._dirty: dict[tuple[str, int], Job] = {}
        # Each job's encoder keeps its members' JSON between flushes (see records.JobEncoder).
        self._encoders: dict[tuple[str, int], JobEncoder] = {}
        # Resolved when the batch holding the changes marked since the last flush is on disk.
        self._next: asyncio.Future[None] | None = None
        self._in_flight: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Whether the flush scheduled is paced for changes nobody waits for (see mark).
        self._unanswered = False
        self._closed = False
        # Set when this coordinator stopped leading: nothing more is written, by this object.
        self._abandoned = False
        # What the last flush cost the loop (building and encoding its records), in seconds.
        self._last_cost = 0.0
        # Jobs whose latest record the store refused for good (too large), with its message; a
        # job leaves when a later record of it is written.
        self._refused: dict[tuple[str, int], str] = {}
        # Since when (wall clock) the store has refused writes for space, while it does.
        self._full_since: float | None = None

    def mark(self, job: Job) -> None:
        """Note that ``job``'s record changed; it is written in the next flush."""
        if self._abandoned:
            return
        if self._closed:
            # After close (shutdown) nothing may be lost: write at once.
            self._write_now([job])
            return
        self._dirty[(job.name, job.generation)] = job
        self._schedule(self._paced(UNANSWERED_COST_FACTOR, MAX_UNANSWERED_DELAY_S), unanswered=True)

    def _paced(self, factor: float, longest: float) -> float:
        return max(self._delay, min(longest, factor * self._last_cost))

    def _schedule(self, delay: float, unanswered: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._next = loop.create_future()
        elif self._unanswered and not unanswered and loop.time() + delay < self._timer.when():
            # An answer waits for the changes now: the flush comes at the pace answers get.
            self._timer.cancel()
        else:
            return
        self._unanswered = unanswered
        self._timer = loop.call_later(delay, self._flush)

    async def durable(self, job: Job | None = None) -> None:
        """Return once every change marked so far is in the store, ``job``'s included.

        Raises:
            CoordinatorUnavailableError: the write failed (the changes stay marked for a retry).
            StoreLimitError: the store can never take ``job``'s record as it is now.
            StoreFullError: the store takes no write until its operator frees space (the changes
                stay marked for a retry).
        """
        waiting = self._next if self._dirty else self._in_flight
        if waiting is not None:
            if self._dirty and self._timer is not None:
                self._schedule(self._paced(COST_FACTOR, MAX_FLUSH_DELAY_S))
            try:
                # Shielded: a caller that gives up must not cancel the batch for everyone else.
                await asyncio.shield(waiting)
            except (LeadershipLostError, StoreFullError):
                raise
            except (OSError, sqlite3.Error, StoreUnavailableError) as error:
                raise CoordinatorUnavailableError(
                    f"the coordinator could not write {self._where} ({error}): free space there, or "
                    f"bring its store back; the change is kept and written again every "
                    f"{RETRY_DELAY_S:g} s, and a call sent again is answered once it is written"
                ) from error
        if job is not None and (job.name, job.generation) in self._refused:
            raise StoreLimitError(self._refused[(job.name, job.generation)])

    def _flush(self) -> None:
        self._timer = None
        done, jobs = self._next, list(self._dirty.values())
        self._next, self._dirty = None, {}
        assert done is not None
        # Records are built and encoded here, on the loop, so that each is one consistent state of
        # its job (see store.encode_job for why the JSON is not left to the writer thread); SQLite's
        # part, the transaction, runs in the writer thread.
        began = time.perf_counter()
        rows = [self._encode(job) for job in jobs]
        if len(self._encoders) > MAX_ENCODERS:
            # Jobs that stopped changing without ending (withdrawn joins under many names).
            flushed = {(job.name, job.generation) for job in jobs}
            self._encoders = {k: e for k, e in self._encoders.items() if k in flushed}
        self._last_cost = time.perf_counter() - began
        self._in_flight = done
        written = asyncio.get_running_loop().run_in_executor(self._writer, self._store.write_rows, rows)
        written.add_done_callback(lambda f: self._written(f, done, jobs))

    def _encode(self, job: Job) -> JobRow:
        key = (job.name, job.generation)
        encoder = self._encoders.get(key)
        if encoder is None:
            # A new generation replaces the name's older one: its encoder goes.
            for old in [k for k in self._encoders if k[0] == job.name]:
                del self._encoders[old]
            encoder = self._encoders[key] = JobEncoder()
        row = encoder.encode(job)
        if job.state.ended and job.ended:
            # Over for every member: no more changes come (what it kept would stay for nothing).
            del self._encoders[key]
        return row

    def _written(self, written: asyncio.Future[None], done: asyncio.Future[None], jobs: list[Job]) -> None:
        if self._in_flight is done:
            self._in_flight = None
        error = written.exception()
        if isinstance(error, StoreLimitError):
            # Every other record of the batch is written: only the refused ones stay behind.
            self._note_refused(jobs, error)
            error = None
        elif error is None:
            self._note_refused(jobs, None)
        if error is None and self._full_since is not None:
            log.warning(
                "the store takes writes again: the state of %d job(s) kept since %s is written",
                len(jobs),
                time.strftime("%H:%M:%S", time.localtime(self._full_since)),
            )
            self._full_since = None
        if isinstance(error, StoreFullError) and self._full_since is not None:
            log.debug("the store is still full: %s", error)
        elif error is not None:
            if isinstance(error, StoreFullError):
                # Once per episode: the line says what to do; every second it would drown the log.
                self._full_since = time.time()
            log.error(
                "writing the state of %d job(s) failed: %s; retrying in %g s", len(jobs), error, RETRY_DELAY_S
            )
        if error is not None:
            for job in jobs:
                # A newer change of the same job, marked meanwhile, supersedes this one anyway.
                self._dirty.setdefault((job.name, job.generation), job)
            if not self._closed and not self._abandoned:
                self._schedule(RETRY_DELAY_S)
            if not done.done():
                done.set_exception(error)
            # Retrieved here so that asyncio does not log an exception nobody awaited.
            done.exception()
            return
        if not done.done():
            done.set_result(None)

    def _note_refused(self, jobs: list[Job], error: StoreLimitError | None) -> None:
        """Remember which of ``jobs`` (all written in one batch) the store refused for good."""
        for job in jobs:
            key = (job.name, job.generation)
            if error is None:
                self._refused.pop(key, None)
                continue
            # A refusal that names no job names every job of the batch (a store that cannot tell).
            message = error.refused.get(key) if error.refused else str(error)
            if message is None:
                self._refused.pop(key, None)
            else:
                self._refused[key] = message
                log.error("%s (tried again with the job's next change)", message)

    def _write_now(self, jobs: list[Job]) -> None:
        """Write ``jobs`` synchronously (after close); a record the store refuses is logged."""
        try:
            self._store.write_rows([encode_job(job_record(job)) for job in jobs])
        except StoreLimitError as error:
            self._note_refused(jobs, error)

    def abandon(self) -> None:
        """Write nothing more: this coordinator stopped leading, and the new leader owns the state
        (whatever was not written yet is re-decided there from what was)."""
        self._abandoned = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._dirty.clear()
        self._encoders.clear()
        for waiting in (self._next, self._in_flight):
            if waiting is not None and not waiting.done():
                waiting.set_exception(LeadershipLostError("this coordinator stopped leading"))
                waiting.exception()
        self._writer.shutdown(wait=False)

    async def close(self) -> None:
        """Write everything still marked and wait for it; later marks write at once."""
        if self._timer is not None:
            self._timer.cancel()
            self._flush()
        self._closed = True
        if self._in_flight is not None:
            with contextlib.suppress(Exception):  # already logged; what is left is written below
                await asyncio.shield(self._in_flight)
        self._writer.shutdown(wait=True)
        # Anything a failed batch left marked is written now, synchronously: the last chance.
        if self._dirty:
            self._write_now(list(self._dirty.values()))
        self._dirty.clear()
