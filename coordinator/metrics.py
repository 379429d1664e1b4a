"""The coordinator's own Prometheus metrics.

Counts of members and jobs by state are read from the membership at scrape time by a custom
collector, so there is no second copy of that state to keep in step. Per-rank identity is not a
label here: it travels as target labels from ``/sd``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sarcomm.coordinator.membership import JobState, Membership, MemberState

RENDEZVOUS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30, 600)


class _StateCollector(Collector):
    def __init__(self, membership: Membership) -> None:
        self._membership = membership

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "sar_coordinator_jobs", "Jobs by state (latest generation of each name).", labels=["state"]
        )
        members = GaugeMetricFamily(
            "sar_coordinator_members", "Members of latest generations by state.", labels=["state"]
        )
        job_counts = dict.fromkeys(JobState, 0)
        member_counts = dict.fromkeys(MemberState, 0)
        for job in self._membership.jobs():
            job_counts[job.state] += 1
            for member in job.members:
                member_counts[member.state] += 1
        for job_state, count in job_counts.items():
            jobs.add_metric([job_state.value], count)
        for member_state, count in member_counts.items():
            members.add_metric([member_state.value], count)
        yield jobs
        yield members


class CoordinatorMetrics:
    """Every metric the coordinator exports, on a registry of its own."""

    def __init__(self, membership: Membership) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(membership))
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
        self.member_failures = Counter(
            "sar_coordinator_member_failures",
            "Members judged failed, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.rpcs = Counter(
            "sar_coordinator_rpcs",
            "gRPC calls handled, by method and status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            "sar_coordinator_rpc_duration_seconds",
            "gRPC call handling time by method.",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )


def failure_reason_label(reason: str) -> str:
    """A bounded label value for a failure reason (free text would explode the series count)."""
    if reason.startswith("missed heartbeats"):
        return "missed_heartbeats"
    if "signal" in reason:
        return "killed"
    if reason.startswith("exited with code"):
        return "exit_code"
    return "reported"
