"""The messages the coordinator client and its callers exchange, with their proto conversion.

These are the shared layer's types: the client returns them, the agent and the library read them,
and the coordinator's views build the same protos. Field meanings follow ``coordinator.proto``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from sarcomm.common.constants import EventKind, FailureReason
from sarcomm.common.interfaces import InterfaceInfo
from sarcomm.v1 import coordinator_pb2 as pb

__all__ = [
    "Assignment",
    "Event",
    "EventKind",
    "FailureReason",
    "HeartbeatReply",
    "JoinResult",
    "MemberReport",
    "Progress",
    "RendezvousState",
    "ReportPolicy",
    "WorkerEndpoint",
    "failure_from_proto",
    "failure_to_proto",
    "interface_to_proto",
    "paced_interval",
]


@dataclass(frozen=True)
class Event:
    """One job event. ``rank``, ``host`` and ``reason`` describe the failed member for
    ``MEMBER_FAILED`` (and the cause for ``JOB_FAILED``), ``failure`` says why as a bounded value
    (None when not told); ``time`` is Unix time in seconds."""

    kind: EventKind
    job: str
    generation: int
    rank: int = 0
    host: str = ""
    reason: str = ""
    time: float = 0.0
    failure: FailureReason | None = None

    @classmethod
    def from_proto(cls, msg: pb.JobEvent) -> Event:
        try:
            kind = EventKind(msg.kind)
        except ValueError:  # a newer coordinator may send kinds this client does not know
            kind = EventKind.UNSPECIFIED
        failure = failure_from_proto(msg.failure)
        return cls(kind, msg.job, msg.generation, msg.rank, msg.host, msg.reason, msg.time, failure)

    def describe(self) -> str:
        """One human sentence, e.g. ``rank 2 on host n1 failed: exited with code 3``."""
        if self.kind is EventKind.MEMBER_FAILED:
            who = f"rank {self.rank}" if self.rank >= 0 else "a rank"  # the coordinator sends -1 if unknown
            where = f" on host {self.host}" if self.host else ""
            return f"{who}{where} failed: {self.reason or 'no reason given'}"
        return f"{self.kind.name.lower().replace('_', ' ')}" + (f": {self.reason}" if self.reason else "")


@dataclass(frozen=True)
class Assignment:
    """What one member (one local rank) got from ``Join``.

    ``master_addr``/``master_port`` are the torch.distributed rendezvous (rank 0's store);
    ``interface``/``address`` are this host's network interface and its address on it.
    ``member_id`` and ``secret`` identify the member on ``Heartbeat`` and ``Leave``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    interface: str
    address: str
    generation: int
    member_id: str
    secret: str = field(repr=False)
    job: str
    restart_count: int


def paced_interval(configured: float, coordinator: float) -> float:
    """Seconds between heartbeats: ``configured``, or the coordinator's interval when that is
    shorter (0: not told). The coordinator judges silence by its own interval, so a member that
    beats slower than it expects would be taken for dead while healthy."""
    return min(configured, coordinator) if coordinator > 0 else configured


@dataclass(frozen=True)
class JoinResult:
    """The answer to one ``Join`` for the K members of one host; ``assignments`` follow the
    order of the request's members (local rank 0 first when the agent builds it)."""

    job: str
    generation: int
    world_size: int
    master_addr: str
    master_port: int
    interface: str
    address: str
    restart_count: int
    assignments: tuple[Assignment, ...]
    #: The coordinator's expected seconds between reports (0: not told); see :func:`paced_interval`.
    heartbeat_interval: float = 0.0

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in request order."""
        return tuple(a.rank for a in self.assignments)


class Progress(NamedTuple):
    """Where a rank is in its sequence of collectives (``since`` is Unix time in seconds).

    A named tuple, immutable like the dataclasses around it, but made in a quarter of the time:
    the coordinator makes one for every report it takes (32,768 a second for a 4096 x 8 job)."""

    seq: int = 0
    op: str = ""
    in_collective: bool = False
    since: float = 0.0


class WorkerEndpoint(NamedTuple):
    """The ``/metrics`` endpoint of a worker that is not a member itself (a torchrun worker),
    reported by the member that started it: the worker's global ``rank``, its ``local_rank`` on the
    node, and ``address``, ``host:port`` (see ``coordinator.proto``'s ``WorkerEndpoint``)."""

    rank: int
    local_rank: int
    address: str


@dataclass(frozen=True)
class MemberReport:
    """One member's liveness report; ``metrics_address`` is ``host:port`` of its /metrics.

    ``age`` is how many seconds ago the member itself last showed a sign of life (0: now). An agent
    reports each rank's own alive stamp, so a rank that is stopped or wedged ages although the
    agent reporting for it is fine, and the coordinator judges it by its own silence.
    """

    member_id: str
    secret: str = field(repr=False)
    progress: Progress | None = None
    metrics_address: str = ""
    age: float = 0.0
    #: Close the rendezvous of the member's elastic job (torch's ``set_closed``).
    close_job: bool = False
    #: The endpoints of the workers it started that are not members (a torchrun node's): the full
    #: list (empty: none yet); None sends none (the coordinator keeps what it had).
    worker_endpoints: tuple[WorkerEndpoint, ...] | None = None

    def to_proto(self) -> pb.MemberReport:
        msg = pb.MemberReport(
            member_id=self.member_id,
            secret=self.secret,
            metrics_address=self.metrics_address,
            age_seconds=self.age,
            close_job=self.close_job,
        )
        if self.worker_endpoints is not None:
            msg.worker_endpoints.SetInParent()  # present even when empty: "none yet"
            msg.worker_endpoints.endpoints.extend(
                pb.WorkerEndpoint(rank=e.rank, local_rank=e.local_rank, metrics_address=e.address)
                for e in self.worker_endpoints
            )
        if self.progress is not None:
            p = self.progress
            msg.progress.CopyFrom(
                pb.Progress(seq=p.seq, op=p.op, in_collective=p.in_collective, since=p.since)
            )
        return msg


@dataclass(frozen=True)
class RendezvousState:
    """An elastic job's rendezvous as its running members see it: ``waiting`` members parked for
    the next generation that would fit in it (> 0: re-form a larger world), and whether it is
    ``closed`` (no new world forms under the job while generation ``generation`` runs)."""

    job: str
    generation: int
    waiting: int = 0
    closed: bool = False


@dataclass(frozen=True)
class ReportPolicy:
    """How a reporter by exception reports (the proto's ``ReportPolicy``, which says when a member
    is reported): a lease renewal every ``lease_seconds`` when nothing changed; a member reported
    once its own sign of life is older than ``silence_seconds``, or once it has been inside one
    collective for longer than ``quiet_seconds`` (and when it moves again); progress changes each
    interval for ``progress_seconds`` after the coordinator asked for a job's progress."""

    lease_seconds: float
    silence_seconds: float
    quiet_seconds: float
    progress_seconds: float

    def to_proto(self) -> pb.ReportPolicy:
        return pb.ReportPolicy(
            lease_seconds=self.lease_seconds,
            silence_seconds=self.silence_seconds,
            quiet_seconds=self.quiet_seconds,
            progress_seconds=self.progress_seconds,
        )

    @classmethod
    def from_proto(cls, msg: pb.ReportPolicy) -> ReportPolicy:
        return cls(msg.lease_seconds, msg.silence_seconds, msg.quiet_seconds, msg.progress_seconds)


@dataclass(frozen=True)
class HeartbeatReply:
    """The coordinator's answer to one heartbeat: members it no longer knows, job events (a
    ``MEMBER_FAILED`` here means the reporters should stop), its current heartbeat interval
    (0: not told), which the reporters follow (see :func:`paced_interval`), the rendezvous of
    the reported members' elastic jobs, and what it dropped from the reports."""

    unknown_members: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    heartbeat_interval: float = 0.0
    rendezvous: tuple[RendezvousState, ...] = ()
    #: What the coordinator dropped from the reports (a bad metrics endpoint), one line each.
    refused: tuple[str, ...] = ()
    #: The reporting policy the coordinator offers (None: it takes only per-interval reports).
    policy: ReportPolicy | None = None
    #: Jobs whose members' progress the coordinator asks for now (see :class:`ReportPolicy`).
    progress_wanted: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.HeartbeatResponse) -> HeartbeatReply:
        return cls(
            tuple(msg.unknown_members),
            tuple(Event.from_proto(e) for e in msg.events),
            msg.heartbeat_interval_seconds,
            tuple(RendezvousState(r.job, r.generation, r.waiting_members, r.closed) for r in msg.rendezvous),
            tuple(msg.refused),
            ReportPolicy.from_proto(msg.policy) if msg.HasField("policy") else None,
            tuple(msg.progress_wanted),
        )


_PROTO_PREFIX = "FAILURE_REASON_"


def failure_to_proto(failure: FailureReason | None) -> pb.FailureReason.ValueType:
    """``failure`` as the proto enum (None: ``FAILURE_REASON_UNSPECIFIED``)."""
    if failure is None:
        return pb.FAILURE_REASON_UNSPECIFIED
    return pb.FailureReason.Value(_PROTO_PREFIX + failure.name)


def failure_from_proto(value: int) -> FailureReason | None:
    """The proto enum as a :class:`FailureReason`; None for UNSPECIFIED and for numbers this side
    does not know (a newer coordinator may send reasons added later)."""
    try:
        name = pb.FailureReason.Name(pb.FailureReason.ValueType(value))
    except ValueError:
        return None
    return FailureReason.__members__.get(name.removeprefix(_PROTO_PREFIX))


def interface_to_proto(info: InterfaceInfo) -> pb.NetworkInterface:
    return pb.NetworkInterface(
        name=info.name,
        addresses=list(info.addresses),
        kind=pb.InterfaceKind.ValueType(int(info.kind)),
        default_route=info.default_route,
    )
