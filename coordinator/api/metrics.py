"""The coordinator's own Prometheus metrics.

Counts of members and jobs by state are read from the membership at scrape time (a snapshot, then
formatted one family at a time so that a 4096-rank scrape does not hold up the heartbeats for its
whole ~30 ms), so there is no second copy of that state to keep in step. Per-rank identity is not a
label on the ranks' own series: it travels as target labels from ``/sd``.

Three per-rank families are the exception, because only the coordinator knows them: whether a
rank is up (a rank that died is gone from ``/sd``, so its target's ``up`` says nothing), how long
it has been inside its current collective (a hung rank still answers scrapes), and how long the
others have waited for a rank that has not entered their collective (comparing every rank's
progress is only possible where all of them report). They carry ``job`` and
``rank`` with the same values as the rank's own target labels, so the shipped Prometheus config
scrapes the coordinator with ``honor_labels: true`` and they join the ranks' series on
``(job, rank)``. Their series are bounded by the live ranks plus one per recently failed job.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sarcomm.common.constants import FailureReason
from sarcomm.coordinator.api.views import job_state
from sarcomm.coordinator.domain.membership import Membership
from sarcomm.coordinator.domain.model import JobState, MemberState

RENDEZVOUS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 600)
#: Every ``reason`` label value (the :class:`FailureReason` values); each is exported from the start
#: (at 0), so a rate or increase over failures has a series to work on before the first failure.
FAILURE_REASONS = tuple(reason.value for reason in FailureReason)
#: How long after its job failed the rank that failed it is still exported as down. Long enough
#: for an alert to fire and be seen; bounded so that a coordinator that has seen many failed job
#: names over months does not export a series for each of them for ever.
FAILED_RANK_RETENTION_S = 3600.0


@dataclass(frozen=True)
class StateSnapshot:
    """What the state families show, copied from the membership in one go on the event loop.

    Copying is cheap (a tuple per live rank); turning it into text is not (~30 ms for 4096 ranks),
    so that part runs off the loop on this immutable copy (see :meth:`CoordinatorMetrics.render`).
    """

    job_counts: dict[JobState, int]
    member_counts: dict[MemberState, int]
    #: (job, rank, seconds inside the current collective) per live rank of a running job
    live_ranks: list[tuple[str, str, float]]
    #: (job, rank) whose failure failed its job recently
    failed_ranks: list[tuple[str, str]]
    #: (job, rank, op, seconds the others waited) per rank others wait for
    blocking: list[tuple[str, str, str, float]]


def snapshot_state(membership: Membership, now: float) -> StateSnapshot:
    job_counts = dict.fromkeys(JobState, 0)
    member_counts = dict.fromkeys(MemberState, 0)
    live: list[tuple[str, str, float]] = []
    failed: list[tuple[str, str]] = []
    blocking: list[tuple[str, str, str, float]] = []
    running = MemberState.RUNNING
    for job in membership.jobs():
        job_counts[JobState(job_state(job))] += 1  # a world no member was told of is not RUNNING
        for member in job.members:
            member_counts[member.state] += 1
        if job.state is JobState.RUNNING:
            stall = membership.stall(job)
            if stall is not None:
                blocking += [(job.name, str(rank), stall.op, stall.waited) for rank in stall.blocking]
            for member in job.members:
                if member.state is not running or member.rank is None:
                    continue
                progress = member.progress
                # The rank stamps `since` with its own clock: clamp a small skew to 0.
                inside = max(0.0, now - progress.since) if progress.in_collective else 0.0
                live.append((job.name, str(member.rank), inside))
        elif (
            job.state is JobState.FAILED
            and job.failed_rank is not None
            # `ended` stays 0 while stopped peers are still leaving: that failure is recent.
            and (not job.ended or now - job.ended < FAILED_RANK_RETENTION_S)
        ):
            failed.append((job.name, str(job.failed_rank)))
    return StateSnapshot(job_counts, member_counts, live, failed, blocking)


class _Families(Collector):
    """Families already built, as a collector ``generate_latest`` can format."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self._families = families

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families)


def _by_state(name: str, documentation: str, counts: Mapping[Any, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["state"])
    for state, count in counts.items():
        family.add_metric([state.value], count)
    return family


def _job_counts(snap: StateSnapshot) -> GaugeMetricFamily:
    return _by_state(
        "sar_coordinator_jobs", "Jobs by state (latest generation of each name).", snap.job_counts
    )


def _member_counts(snap: StateSnapshot) -> GaugeMetricFamily:
    return _by_state("sar_coordinator_members", "Members of latest generations by state.", snap.member_counts)


def _escape(value: str) -> str:
    """A label value as the text format writes it (as prometheus_client does)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _gauge_text(
    name: str, documentation: str, labels: tuple[str, ...], rows: Iterable[tuple[tuple[str, ...], str]]
) -> bytes:
    """A gauge family in the text format, byte for byte what ``generate_latest`` writes for it
    (``rows``: label values in the order of ``labels``, sorted by name, and the value's text).

    The per-rank families are 65,536 samples at 32,768 ranks: prometheus_client builds a Sample
    and sorts its labels for each (~8 us a sample, 0.55 s a scrape); this writes each line from
    strings made once per job."""
    escaped: dict[str, str] = {}
    lines = [f"# HELP {name} {documentation}\n# TYPE {name} gauge\n"]
    for values, value in rows:
        parts = []
        for label, text in zip(labels, values, strict=True):
            quoted = escaped.get(text)
            if quoted is None:
                quoted = escaped[text] = _escape(text)
            parts.append(f'{label}="{quoted}"')
        lines.append(f"{name}{{{','.join(parts)}}} {value}\n")
    return "".join(lines).encode()


#: prometheus_client's number format (untyped there).
_number: Callable[[float], str] = cast("Callable[[float], str]", floatToGoString)
_ONE = _number(1)
_ZERO = _number(0)


def _rank_up(snap: StateSnapshot) -> bytes:
    live = (((job, rank), _ONE) for job, rank, _ in snap.live_ranks)
    failed = (((job, rank), _ZERO) for job, rank in snap.failed_ranks)
    return _gauge_text(
        "sar_coordinator_rank_up",
        "1 for each live rank of a running job; 0 for the rank whose failure failed its job "
        "(for an hour, or until the job's next generation starts forming).",
        ("job", "rank"),
        itertools.chain(live, failed),
    )


def _rank_collective_seconds(snap: StateSnapshot) -> bytes:
    return _gauge_text(
        "sar_coordinator_rank_collective_seconds",
        "Seconds each live rank has been inside its current collective (0 between collectives), "
        "from the progress its heartbeats carry.",
        ("job", "rank"),
        (((job, rank), _ZERO if not inside else _number(inside)) for job, rank, inside in snap.live_ranks),
    )


def _rank_blocking_seconds(snap: StateSnapshot) -> bytes:
    # The labels in name order (job, op, rank), as generate_latest sorts them.
    return _gauge_text(
        "sar_coordinator_rank_blocking_seconds",
        "For each rank that other ranks wait for: seconds they have waited in the collective it "
        "has not entered (only past --stall-threshold); op is that collective.",
        ("job", "op", "rank"),
        (((job, op, rank), _number(waited)) for job, rank, op, waited in snap.blocking),
    )


def _counted(family: Callable[[StateSnapshot], GaugeMetricFamily]) -> Callable[[StateSnapshot], bytes]:
    return lambda snap: generate_latest(_Families([family(snap)]))


#: The families read from the membership, in the order /metrics shows them, each as its text.
STATE_FAMILIES: tuple[Callable[[StateSnapshot], bytes], ...] = (
    _counted(_job_counts),
    _counted(_member_counts),
    _rank_up,
    _rank_collective_seconds,
    _rank_blocking_seconds,
)


class StoreGauges:
    """The etcd store's size against its quota (coordinators on ``--store`` only; see
    :mod:`sarcomm.coordinator.ha.upkeep`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.size_bytes = Gauge(
            "sar_coordinator_store_bytes",
            "Size of the etcd store's database file (the answering member's), which etcd holds "
            "against its quota; compaction frees pages in it, defragmentation shrinks it.",
            registry=registry,
        )
        self._quota: Gauge | None = None

    def set_quota(self, value: float) -> None:
        """Export the quota; registered at its first value, so that no ratio is ever taken
        against a quota nobody read (etcd before 3.4 does not tell it)."""
        if self._quota is None:
            self._quota = Gauge(
                "sar_coordinator_store_quota_bytes",
                "The etcd store's --quota-backend-bytes, from etcd's own /metrics: past it etcd "
                "raises the NOSPACE alarm and refuses every write.",
                registry=self._registry,
            )
        self._quota.set(value)


class CoordinatorMetrics:
    """Every metric the coordinator exports, on a registry of its own."""

    def __init__(self, membership: Membership | None, wall: Callable[[], float] = time.time) -> None:
        # The leader's membership; None on a standby, whose state families are then empty (the
        # leader counts every job once, however many replicas Prometheus scrapes).
        self.membership = membership
        self._wall = wall
        # Instrumented metrics only; the state families come from a snapshot per scrape (render).
        self.registry = CollectorRegistry()
        self.joins = Counter("sar_coordinator_joins", "Members that joined a job.", registry=self.registry)
        self.rendezvous_duration = Histogram(
            "sar_coordinator_rendezvous_duration_seconds",
            "Time from a generation's first join to its world forming.",
            buckets=RENDEZVOUS_BUCKETS,
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "sar_coordinator_heartbeats", "Member reports received.", registry=self.registry
        )
        self.heartbeat_streams = Gauge(
            "sar_coordinator_heartbeat_streams",
            "Heartbeat streams open, by how they report: exception (only what changed, a lease "
            "renewed) or per-second (every member every interval; also a stream before it switches).",
            ["protocol"],
            registry=self.registry,
        )
        for protocol in ("exception", "per-second"):
            self.heartbeat_streams.labels(protocol)
        self.leases = Counter(
            "sar_coordinator_leases",
            "Lease renewals received: requests of a by-exception stream that carried no report.",
            registry=self.registry,
        )
        self.progress_asks = Counter(
            "sar_coordinator_progress_asks",
            "Asks for a job's progress (progress_wanted) pushed to by-exception Heartbeat streams.",
            registry=self.registry,
        )
        self.member_failures = Counter(
            "sar_coordinator_member_failures",
            "Members judged failed, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in FAILURE_REASONS:
            self.member_failures.labels(reason)
        self.restarts = Counter(
            "sar_coordinator_restarts",
            "Worlds formed under a job name whose previous generation failed.",
            registry=self.registry,
        )
        self.rerendezvous = Counter(
            "sar_coordinator_rerendezvous",
            "Generations of elastic jobs that ended in a re-rendezvous (JOB_RESTARTING: a member "
            "went, or members wait to join): the world re-forms; no failure, no restart.",
            registry=self.registry,
        )
        self.rpcs = Counter(
            "sar_coordinator_rpcs",
            "gRPC calls handled, by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "sar_coordinator_event_loop_lag_seconds",
            "How late a timer due every 50 ms fired: the time anything ready (a heartbeat to ack, a "
            "scrape, a join) waited for the one event loop that serves them all.",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.gc_pause = Histogram(
            "sar_coordinator_gc_pause_seconds",
            "Python garbage collections and how long each held the coordinator (every thread), by "
            "generation.",
            ["generation"],
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.leader = Gauge(
            "sar_coordinator_leader",
            "1 while this coordinator leads (always, on SQLite), 0 while it stands by.",
            registry=self.registry,
        )
        self.leader.set(1)
        self._store: StoreGauges | None = None
        self.leader_changes = Counter(
            "sar_coordinator_leader_changes",
            "Leader changes this coordinator has seen in the shared etcd store.",
            registry=self.registry,
        )
        self.open_file_limit = Gauge(
            "sar_coordinator_open_file_limit",
            "The coordinator's open-file limit (soft RLIMIT_NOFILE, raised to the hard limit at "
            "start): one descriptor per agent connection, the rest for listeners, store and HTTP.",
            registry=self.registry,
        )
        self.open_file_limit_reached = Counter(
            "sar_coordinator_open_file_limit_reached",
            "Times the coordinator found its open-file limit reached: while it lasts, new "
            "connections wait unaccepted and their calls do not start.",
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            "sar_coordinator_rpc_duration_seconds",
            "gRPC call handling time by method.",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )

    def store_gauges(self) -> StoreGauges:
        """Register the store's gauges (once: a coordinator on etcd calls it) and return them."""
        if self._store is None:
            self._store = StoreGauges(self.registry)
        return self._store

    def snapshot(self) -> StateSnapshot:
        """The membership's state for one scrape; call on the event loop (it reads live objects)."""
        if self.membership is None:
            return StateSnapshot(dict.fromkeys(JobState, 0), dict.fromkeys(MemberState, 0), [], [], [])
        return snapshot_state(self.membership, self._wall())

    def render(self, snapshot: StateSnapshot) -> Iterator[bytes]:
        """The exposition text of every metric, in parts: the instrumented metrics, then one part
        per state family (the per-rank ones are ~60 ms each for 32,768 ranks), so that a caller on
        the event loop can let other work through between two parts."""
        yield generate_latest(self.registry)
        for build in STATE_FAMILIES:
            # Built, formatted and dropped in one step: nothing of the 4096-sample family lives on
            # while the caller lets other work run (see http.collector_paused).
            yield build(snapshot)
