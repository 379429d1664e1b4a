"""The numbers of reports by exception (the proto's ``ReportPolicy``), owned here and nowhere else.

A coordinator that takes reports by exception (``--report-policy exception``) offers them on the
first answer of each Heartbeat stream; a reporter that takes them sends only what changed (see
``docs/failures.md``). Each number follows from the coordinator's own settings:

- ``silence_seconds`` = interval x (misses - 1): a member whose own sign of life is that old is
  reported, so a stopped rank is judged silent at interval x misses (the liveness timeout), as a
  per-interval reporter's would be: one interval for the report to arrive and be swept.
- ``quiet_seconds`` = stall_threshold / 2: a member inside one collective that long is reported
  quiet, and the coordinator asks its job for progress well before the stall can be named.
- ``progress_seconds`` = stall_threshold: how long an asked reporter sends its members' progress
  changes each interval (the coordinator asks again every half of it while a stall is suspected).
- ``lease_seconds`` = clamp(streams / 128, 10, 60): an empty request renews a stream's lease; with
  ``streams`` open by-exception streams that costs streams / lease <= 128 messages a second in
  all from 1,280 streams up to 7,680 (10 s up to 1,280 streams: at most 128/s; 60 s beyond
  7,680). A stream whose reporter sends nothing for :data:`LEASE_PERIODS` leases has a stuck
  loop: its members fail. The lease is offered once per stream and offered again only when the
  number of streams grew it :data:`REOFFER_FACTOR` times or more (a reporter that took a short
  lease in a job's first second renews every 10 s, not for ever as its first offer said).
"""

from __future__ import annotations

from sarcomm.common.messages import ReportPolicy

__all__ = [
    "LEASE_MAX_S",
    "LEASE_MIN_S",
    "LEASE_PERIODS",
    "REOFFER_FACTOR",
    "STREAMS_PER_LEASE_SECOND",
    "lease_seconds",
    "progress_seconds",
    "quiet_seconds",
    "reoffer",
    "report_policy",
    "silence_seconds",
]

#: Bounds of the lease, in seconds: 10 s catches a stuck loop within 20 s in a small job; 60 s
#: (Kubernetes' node leases are renewed every 10 s and judged after 40 s) bounds it in a huge one.
LEASE_MIN_S = 10.0
LEASE_MAX_S = 60.0
#: One second of lease per this many open by-exception streams: their renewals cost at most this
#: many messages a second in all. Measured with one TCP connection per agent (2 cores): about
#: 0.6 ms of the coordinator's CPU per renewal (its read, answer and wake-ups), so 128/s is about 8%
#: of a core; the shared-connection floor's ~160 us per message does not hold per connection.
STREAMS_PER_LEASE_SECOND = 128
#: A stream with no message for this many of its leases has a stuck reporter.
LEASE_PERIODS = 2
#: A stream is offered a longer lease once the lease for today's number of streams is this many
#: times the one it holds.
REOFFER_FACTOR = 2.0


def silence_seconds(interval: float, misses: int) -> float:
    """How old a member's own sign of life is when its reporter reports it (see the module).
    With one miss (liveness = one interval) half an interval, so the report still comes before the
    member is judged."""
    return interval * (misses - 1) if misses > 1 else interval / 2


def quiet_seconds(stall_threshold: float) -> float:
    """How long a member is inside one collective when its reporter reports it quiet."""
    return stall_threshold / 2


def progress_seconds(stall_threshold: float) -> float:
    """How long an asked reporter reports its members' progress changes each interval."""
    return stall_threshold


def lease_seconds(streams: int) -> float:
    """The lease for a stream offered while ``streams`` by-exception streams are open."""
    return min(max(streams / STREAMS_PER_LEASE_SECOND, LEASE_MIN_S), LEASE_MAX_S)


def report_policy(interval: float, misses: int, stall_threshold: float, streams: int) -> ReportPolicy:
    """The policy offered to a stream while ``streams`` by-exception streams are open."""
    return ReportPolicy(
        lease_seconds=lease_seconds(streams),
        silence_seconds=silence_seconds(interval, misses),
        quiet_seconds=quiet_seconds(stall_threshold),
        progress_seconds=progress_seconds(stall_threshold),
    )


def reoffer(offered: float, streams: int) -> float | None:
    """The longer lease to offer a stream holding ``offered`` now that ``streams`` are open, or
    None to keep it (a lease is never shortened: a reporter that missed the new offer would renew
    too late)."""
    lease = lease_seconds(streams)
    return lease if lease >= offered * REOFFER_FACTOR else None
