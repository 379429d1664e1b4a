"""Prometheus metrics of one worker process: per-collective latency, bytes sent and errors.

Every sarcomm collective records into a :class:`CollectiveStats` for its ``(op, backend)`` pair.
Those are plain accumulators, not ``prometheus_client`` metric children, because the collective
wrappers sit on the hot path: a ``Histogram.observe`` plus a ``Counter.inc`` costs a few
microseconds (a lock and a Python loop over the buckets each), more than the whole budget of the
wrapper around a 4-byte all_reduce. Here a call appends one tuple to a deque; the totals are
folded in batches, and :class:`_CollectiveCollector` turns them into the exported families only
when ``/metrics`` is scraped.

Exported families (all in :data:`REGISTRY`):

- ``sar_collective_duration_seconds`` histogram, labels ``op``, ``backend``; buckets 10 us to 60 s,
  three per decade (1-2-5).
- ``sar_collective_bytes_total`` counter, labels ``op``, ``backend``: payload bytes this rank sent
  to other ranks (what each op counts is listed in ``sarcomm.worker.library.collectives``).
- ``sar_collective_errors_total`` counter, labels ``op``, ``backend``: calls that raised.
- ``sar_collective_bus_factor`` gauge, labels ``op``, ``backend``: what turns this rank's bytes
  sent per second spent in the op into nccl-tests' bus bandwidth (:mod:`sarcomm.worker.bandwidth`;
  only ops with a formula, once the world size is known).
- ``sar_worker_info`` gauge, value 1, labels ``job``, ``rank``, ``world_size``, ``backend``,
  ``generation``.
- the standard ``process_*``, ``python_*`` and ``python_gc_*`` families.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from sarcomm.common.addresses import host_port
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.bandwidth import sent_bus_factor

__all__ = [
    "DURATION_BUCKETS_SECONDS",
    "REGISTRY",
    "CollectiveStats",
    "LastCollective",
    "StatsSnapshot",
    "all_stats",
    "bucket_index",
    "collective_stats",
    "last_collective",
    "serving_port",
    "set_before_scrape",
    "set_worker_info",
    "start_metrics_server",
    "stop_metrics_server",
]

log = logging.getLogger(__name__)

#: Upper bounds of the latency histogram, in seconds: 1-2-5 per decade from 10 us, capped at 60 s
#: (the backends' own timeouts are minutes, so anything slower lands in +Inf and is an outage).
DURATION_BUCKETS_SECONDS: tuple[float, ...] = (
    1e-05, 2e-05, 5e-05,
    0.0001, 0.0002, 0.0005,
    0.001, 0.002, 0.005,
    0.01, 0.02, 0.05,
    0.1, 0.2, 0.5,
    1.0, 2.0, 5.0,
    10.0, 20.0, 50.0,
    60.0,
)  # fmt: skip

# The same bounds in integer nanoseconds, to compare with perf_counter_ns readings directly.
_BOUNDS_NS: list[int] = [round(b * 1e9) for b in DURATION_BUCKETS_SECONDS]


def bucket_index(duration_ns: int) -> int:
    """Index of the histogram bucket of a duration in ns (``len(bounds)`` is +Inf). A duration
    equal to a bound counts in that bound's bucket, Prometheus' "le" rule."""
    return bisect.bisect_left(_BOUNDS_NS, duration_ns)


# repr() of these bounds is exactly what prometheus_client's own histograms print ("1e-05", "0.5").
_LE_LABELS: tuple[str, ...] = (*(repr(float(b)) for b in DURATION_BUCKETS_SECONDS), "+Inf")

# perf_counter_ns has no epoch; this offset turns its readings into Unix time for reports. Clock
# drift between the two over a process lifetime is far below what a "last collective" view needs.
_UNIX_MINUS_PERF_NS = time.time_ns() - time.perf_counter_ns()
_perf_counter_ns = time.perf_counter_ns


@dataclass(frozen=True)
class StatsSnapshot:
    """A consistent copy of one :class:`CollectiveStats` (for scrapes, reports and tests).

    ``bucket_counts`` are per bucket (not cumulative), one per bound of
    :data:`DURATION_BUCKETS_SECONDS` plus a last one for +Inf.
    """

    op: str
    backend: str
    count: int
    sum_seconds: float
    bytes_sent: int
    errors: int
    bucket_counts: tuple[int, ...]


@dataclass(frozen=True)
class LastCollective:
    """The most recently finished collective of this process: which one and when (Unix seconds)."""

    op: str
    backend: str
    finished_at: float


class CollectiveStats:
    """Running totals of one ``(op, backend)`` pair. Get instances from :func:`collective_stats`.

    :meth:`observe` runs right after a collective returns, when the thread has just woken from a
    blocking wait and its caches are cold: measured on loopback, a lock plus the bucket arithmetic
    cost about 4 us there against 0.6 us in a tight loop. So it only appends to a deque (atomic,
    lock-free) and the totals are folded in under the lock in batches of :data:`_FOLD_AT`, or
    before any read. Thread-safe.
    """

    __slots__ = (
        "_bucket_counts",
        "_bytes",
        "_errors",
        "_last_end_ns",
        "_lock",
        "_pending",
        "_sum_ns",
        "backend",
        "op",
    )

    def __init__(self, op: str, backend: str) -> None:
        self.op = op
        self.backend = backend
        self._lock = threading.Lock()
        # (duration ns, bytes, end perf_counter_ns) of calls not yet folded into the totals.
        self._pending: deque[tuple[int, int, int]] = deque()
        self._bucket_counts = [0] * (len(_BOUNDS_NS) + 1)
        self._sum_ns = 0
        self._bytes = 0
        self._errors = 0
        self._last_end_ns = 0

    def observe(self, start_ns: int, nbytes: int) -> None:
        """Record one successful call that began at ``start_ns`` (``time.perf_counter_ns()``) and
        ends now, having sent ``nbytes`` bytes. Never blocks on I/O; never raises."""
        end_ns = _perf_counter_ns()
        pending = self._pending
        pending.append((end_ns - start_ns, nbytes, end_ns))
        if len(pending) >= _FOLD_AT:
            self._fold()

    def record(self, duration_ns: int, nbytes: int) -> None:
        """Record one successful call, measured elsewhere (``duration_ns``: an nccl work's time on
        the GPU), that ends now, having sent ``nbytes`` bytes. Never blocks; never raises."""
        end_ns = _perf_counter_ns()
        pending = self._pending
        pending.append((duration_ns, nbytes, end_ns))
        if len(pending) >= _FOLD_AT:
            self._fold()

    def error(self) -> None:
        """Record one call that raised. Never raises."""
        with self._lock:
            self._errors += 1

    def _fold(self) -> None:
        """Move pending observations into the totals. Observations appended meanwhile by another
        thread are either taken now or left for the next fold; none is lost (popleft is atomic,
        and only a fold, under the lock, takes from the left).

        The batch is folded with C-level builtins instead of a Python loop over its entries
        (about 0.1 us an entry instead of 0.5): sorted, its bucket counts are the differences of
        ``bisect_right`` at each bound (a duration equal to a bound counts in that bound's
        bucket, as :func:`bucket_index` puts it); sums and the last end by ``sum`` and ``max``.
        The totals are the same integers as one entry at a time."""
        with self._lock:
            popleft = self._pending.popleft
            batch = [popleft() for _ in range(len(self._pending))]
            if not batch:
                return
            durations, sizes, ends = zip(*batch, strict=True)
            ordered = sorted(durations)
            counts = self._bucket_counts
            total = len(ordered)
            below = 0
            for index, bound in enumerate(_BOUNDS_NS):
                upto = bisect.bisect_right(ordered, bound, below)
                counts[index] += upto - below
                below = upto
                if below == total:
                    break
            counts[-1] += total - below
            self._sum_ns += sum(durations)
            self._bytes += sum(sizes)
            self._last_end_ns = max(self._last_end_ns, max(ends))

    @property
    def last_end_ns(self) -> int:
        """``perf_counter_ns()`` when the last successful call ended; 0 before the first one."""
        self._fold()
        return self._last_end_ns

    def snapshot(self) -> StatsSnapshot:
        """A consistent copy of the totals, including every call recorded so far."""
        self._fold()
        with self._lock:
            return StatsSnapshot(
                op=self.op,
                backend=self.backend,
                count=sum(self._bucket_counts),
                sum_seconds=self._sum_ns / 1e9,
                bytes_sent=self._bytes,
                errors=self._errors,
                bucket_counts=tuple(self._bucket_counts),
            )


#: Pending observations that trigger a fold: amortises the fold (its lock and bisects; about 0.1 us
#: an entry besides) and bounds the deque to a few kilobytes per (op, backend).
_FOLD_AT: Final = 256


_stats: dict[tuple[str, str], CollectiveStats] = {}
_stats_lock = threading.Lock()


def collective_stats(op: str, backend: str) -> CollectiveStats:
    """The one :class:`CollectiveStats` of ``(op, backend)``, created on first use.

    Callers on a hot path resolve it once and keep it (``sarcomm.worker.library.comm`` does so per backend
    at start-up). Raises :class:`InvalidArgumentError` when ``op`` or ``backend`` is empty.
    """
    key = (op, backend)
    stats = _stats.get(key)
    if stats is not None:
        return stats
    if not op or not backend:
        raise InvalidArgumentError(
            "collective_stats needs a non-empty op and backend; "
            f"got op={shorten(op)} and backend={shorten(backend)}."
        )
    with _stats_lock:
        return _stats.setdefault(key, CollectiveStats(op, backend))


def all_stats() -> list[StatsSnapshot]:
    """Snapshots of every ``(op, backend)`` pair seen so far, sorted by op then backend."""
    with _stats_lock:
        items = sorted(_stats.items())
    return [stats.snapshot() for _, stats in items]


def last_collective() -> LastCollective | None:
    """The most recently finished collective of this process, or None before the first one."""
    with _stats_lock:
        candidates = list(_stats.values())
    latest = max(candidates, key=lambda s: s.last_end_ns, default=None)
    if latest is None or latest.last_end_ns == 0:
        return None
    return LastCollective(latest.op, latest.backend, (latest.last_end_ns + _UNIX_MINUS_PERF_NS) / 1e9)


#: What records figures measured elsewhere before a scrape reads the totals (the CUDA events of
#: the library's calls), by name.
_before_scrape: dict[str, Callable[[], object]] = {}


def set_before_scrape(name: str, poll: Callable[[], object] | None) -> None:
    """Run ``poll`` before each scrape (None removes ``name``'s). It must not block; what it
    raises is logged, never served."""
    if poll is None:
        _before_scrape.pop(name, None)
    else:
        _before_scrape[name] = poll


class _CollectiveCollector(Collector):
    """Exports the :class:`CollectiveStats` totals as Prometheus families at scrape time."""

    def collect(self) -> Iterator[Metric]:
        for name, poll in list(_before_scrape.items()):
            try:
                poll()
            except Exception:
                log.exception("metrics: %s before the scrape failed", name)
        duration, sent, errors = self._families()
        factors = _bus_factor_family()
        world = _world_size
        for snap in all_stats():
            factor = sent_bus_factor(snap.op, world) if world > 0 else None
            if factor is not None:
                factors.add_metric([snap.op, snap.backend], factor)
            labels = [snap.op, snap.backend]
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(_LE_LABELS, snap.bucket_counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            duration.add_metric(labels, buckets, snap.sum_seconds)
            sent.add_metric(labels, float(snap.bytes_sent))
            errors.add_metric(labels, float(snap.errors))
        yield from (duration, sent, errors, factors)

    def describe(self) -> Iterable[Metric]:
        # Lets the registry reject a second family of the same name when this one is registered.
        return (*self._families(), _bus_factor_family())

    @staticmethod
    def _families() -> tuple[HistogramMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        labels = ["op", "backend"]
        return (
            HistogramMetricFamily(
                "sar_collective_duration_seconds",
                "Wall time of one collective call on this rank, from the call to its completion.",
                labels=labels,
            ),
            CounterMetricFamily(
                "sar_collective_bytes",
                "Payload bytes this rank sent to other ranks in collectives.",
                labels=labels,
            ),
            CounterMetricFamily(
                "sar_collective_errors",
                "Collective calls on this rank that raised.",
                labels=labels,
            ),
        )


def _bus_factor_family() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "sar_collective_bus_factor",
        "Multiplies this rank's bytes sent per second inside the op into nccl-tests' bus bandwidth.",
        labels=["op", "backend"],
    )


#: The world size :func:`set_worker_info` was told (0 before): the bus factors depend on it.
_world_size = 0

#: The one registry of the worker process; ``/metrics`` serves exactly this.
REGISTRY = CollectorRegistry()
REGISTRY.register(_CollectiveCollector())
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

_WORKER_INFO = Gauge(
    "sar_worker_info",
    "Identity of this worker process (value is always 1).",
    labelnames=["job", "rank", "world_size", "backend", "generation"],
    registry=REGISTRY,
)
_info_lock = threading.Lock()


def set_worker_info(*, job: str, rank: int, world_size: int, backend: str, generation: str) -> None:
    """Set the one ``sar_worker_info`` series (replacing an earlier one, e.g. after a restart into a
    new generation). ``job`` and ``generation`` may be empty when no coordinator is involved."""
    global _world_size
    with _info_lock:
        _world_size = world_size
        _WORKER_INFO.clear()
        _WORKER_INFO.labels(
            job=job, rank=str(rank), world_size=str(world_size), backend=backend, generation=generation
        ).set(1)


_server: WSGIServer | None = None
_server_thread: threading.Thread | None = None
_server_lock = threading.Lock()


def start_metrics_server(port: int, host: str = "0.0.0.0") -> tuple[str, int]:
    """Serve :data:`REGISTRY` as ``GET /metrics`` (any path, in fact) on ``host:port`` from a
    daemon thread, and return the bound ``(host, port)``.

    ``port=0`` binds any free port; the returned port is the real one. Does not block. One server
    per process: raises :class:`InvalidArgumentError` when ``port`` is outside 0..65535 or when a
    server is already running (stop it first with :func:`stop_metrics_server`), and ``OSError``
    when the address cannot be bound.
    """
    global _server, _server_thread
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(
            f"port must be an integer in 0..65535 (0 = any free port); got {shorten(port)}."
        )
    with _server_lock:
        if _server is not None:
            running_host, running_port = _address(_server)
            raise InvalidArgumentError(
                f"a metrics server is already running on {host_port(running_host, running_port)}; "
                "call stop_metrics_server() before starting another."
            )
        server, thread = start_http_server(port, addr=host, registry=REGISTRY)
        _server, _server_thread = server, thread
        # Stopped before the interpreter finalises: a daemon thread still serving then is torn
        # down with pthread_exit, which aborts a process that has loaded torch's C++ runtime
        # ("terminate called without an active exception") and turns exit 0 into SIGABRT.
        atexit.register(stop_metrics_server)
        bound_host, bound_port = _address(server)
    log.info("metrics server listening on %s", host_port(bound_host, bound_port))
    return bound_host, bound_port


def serving_port() -> int | None:
    """The port of the server :func:`start_metrics_server` started, or None when none runs."""
    with _server_lock:
        return _address(_server)[1] if _server is not None else None


def _address(server: WSGIServer) -> tuple[str, int]:
    host, port = server.server_address[:2]
    return (host.decode() if isinstance(host, bytes) else str(host)), int(port)


def stop_metrics_server(timeout: float = 5.0) -> None:
    """Stop the server :func:`start_metrics_server` started, waiting up to ``timeout`` seconds for
    its thread. Does nothing when none runs."""
    global _server, _server_thread
    with _server_lock:
        server, thread = _server, _server_thread
        _server, _server_thread = None, None
    if server is None:
        return
    server.shutdown()
    server.server_close()
    if thread is not None:
        thread.join(timeout)
