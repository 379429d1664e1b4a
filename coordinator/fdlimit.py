"""The coordinator's open-file limit: raised at start, reported as the agent connections it admits,
and watched while it serves.

Every agent connection is one file descriptor in the coordinator (gRPC holds one socket per TCP
connection, whatever the streams on it). When the table is full, gRPC's listener cannot accept:
its C core logs ``File descriptor limit reached. Retrying.`` once a second, new connections wait
in the kernel's accept queue (the client's handshake completed there, so the client sees nothing
but a call that never starts) and no Python code hears of it. :class:`FileLimitWatch` finds out
by asking for one descriptor (opening ``/dev/null``) once a period: ``EMFILE`` means the table is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Descriptors kept for what is not an agent connection, beyond those open at start (listeners,
#: the store's files, event loops' epoll and wake-up descriptors): HTTP scrapes and API calls (a
#: Prometheus, ``sar-coordinator status``, a dashboard: a few each), the etcd client's
#: reconnections, SQLite's journal, a log file reopened. gRPC does not stop accepting there (it
#: accepts until the table is full): the watch warns when agents reach into it.
RESERVED_BEYOND_START = 64
#: How often the watch asks for a descriptor (one ``open`` and ``close`` of ``/dev/null``: microseconds).
WATCH_PERIOD_S = 1.0
#: The limit taken when the hard limit is unlimited.
UNLIMITED_STANDIN = 1 << 20


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (the most an unprivileged process may);
    return the soft limit now in force. Every member's connection, stream and scrape is a socket,
    and the usual soft limit of 1024 would refuse healthy agents past about a thousand."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else UNLIMITED_STANDIN
    if soft == resource.RLIM_INFINITY:
        return UNLIMITED_STANDIN
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    return int(soft)


def open_file_limit() -> int:
    """The soft RLIMIT_NOFILE in force."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return UNLIMITED_STANDIN if soft == resource.RLIM_INFINITY else int(soft)


def open_files() -> int | None:
    """Descriptors this process has open now (None where /proc does not say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


@dataclass(frozen=True)
class FileBudget:
    """What the open-file limit admits: ``limit`` descriptors, ``at_start`` open when serving
    began, :data:`RESERVED_BEYOND_START` kept for the rest; ``agent_connections`` is what is left."""

    limit: int
    at_start: int

    @property
    def reserved(self) -> int:
        return self.at_start + RESERVED_BEYOND_START

    @property
    def agent_connections(self) -> int:
        return max(0, self.limit - self.reserved)

    def describe(self) -> str:
        return (
            f"open-file limit {self.limit}: {self.agent_connections} agent connections "
            f"({self.at_start} open at start and {RESERVED_BEYOND_START} kept for HTTP and the store)"
        )


#: What :func:`next_descriptor` answers when the table is full.
FULL = -1
#: The cure, as the log says it.
_CURE = (
    "raise the hard limit (systemd LimitNOFILE=, ulimit -Hn, a container's --ulimit nofile=) "
    "or spread the agents over more coordinators"
)


def next_descriptor() -> int:
    """The descriptor a new file gets now, the lowest free one: with no gaps below it, how many are
    open (fewer with gaps). :data:`FULL` when the table is full (``EMFILE``)."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError as error:
        if error.errno == errno.EMFILE:
            return FULL
        raise
    os.close(fd)
    return fd


class FileLimitWatch:
    """Looks once a period: says once (at WARNING) when the descriptors in use pass what
    ``budget`` admits, once (at ERROR) when the table is full, each again only after a look that
    found it below, and counts each full table in ``on_full`` (a metric's ``inc``)."""

    def __init__(
        self, budget: FileBudget, on_full: Callable[[], None], probe: Callable[[], int] = next_descriptor
    ) -> None:
        self.budget = budget
        self._on_full = on_full
        self._probe = probe
        self._said_full = False
        self._said_past = False

    def check(self) -> bool:
        """One look; True when the table is full now."""
        fd = self._probe()
        full = fd == FULL
        past = full or fd > self.budget.limit - RESERVED_BEYOND_START
        if past and not self._said_past:
            self._said_past = True
            log.warning(
                "open files past what the open-file limit admits (RLIMIT_NOFILE %d: %d agent "
                "connections): what is kept for HTTP and the store is being used; at %d new "
                "connections will wait unaccepted; %s",
                self.budget.limit,
                self.budget.agent_connections,
                self.budget.limit,
                _CURE,
            )
        if full and not self._said_full:
            self._said_full = True
            self._on_full()
            log.error(
                "open-file limit reached (RLIMIT_NOFILE %d): new agent connections wait unaccepted "
                "(gRPC logs 'File descriptor limit reached. Retrying.') and their calls do not start, "
                "nor do HTTP requests; %s",
                self.budget.limit,
                _CURE,
            )
        self._said_past = self._said_past and past
        self._said_full = self._said_full and full
        return full

    async def run(self, period: float = WATCH_PERIOD_S) -> None:
        while True:
            self.check()
            await asyncio.sleep(period)
