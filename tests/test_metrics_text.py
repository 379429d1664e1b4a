"""The per-rank families of the coordinator's /metrics are written by hand for speed (65,536
samples at 32,768 ranks): byte for byte what prometheus_client's generate_latest writes for the
same samples, escaping and number formatting included."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily

from sarcomm.coordinator.api.metrics import STATE_FAMILIES, StateSnapshot, _Families
from sarcomm.coordinator.domain.model import JobState, MemberState

ODD_JOB = 'we"ird\\job\nname'


def _snapshot() -> StateSnapshot:
    live = [("gnn", str(rank), inside) for rank, inside in enumerate((0.0, 0.25, 1e-7, 12.5, 1234567.0, 3e9))]
    live.append((ODD_JOB, "0", 2.0))
    return StateSnapshot(
        job_counts=dict.fromkeys(JobState, 1),
        member_counts=dict.fromkeys(MemberState, 2),
        live_ranks=live,
        failed_ranks=[("old", "3"), (ODD_JOB, "1")],
        blocking=[("gnn", "2", "all_reduce", 31.5), (ODD_JOB, "0", 'op"x', 1e10)],
    )


def _reference(
    name: str, documentation: str, labels: list[str], rows: list[tuple[list[str], float]]
) -> bytes:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return generate_latest(_Families([family]))


def test_rank_families_are_what_generate_latest_writes() -> None:
    snap = _snapshot()
    _, _, rank_up, collective, blocking = (build(snap) for build in STATE_FAMILIES)
    up_rows = [([j, r], 1.0) for j, r, _ in snap.live_ranks] + [([j, r], 0.0) for j, r in snap.failed_ranks]
    assert rank_up == _reference(
        "sar_coordinator_rank_up",
        "1 for each live rank of a running job; 0 for the rank whose failure failed its job "
        "(for an hour, or until the job's next generation starts forming).",
        ["job", "rank"],
        up_rows,
    )
    assert collective == _reference(
        "sar_coordinator_rank_collective_seconds",
        "Seconds each live rank has been inside its current collective (0 between collectives), "
        "from the progress its heartbeats carry.",
        ["job", "rank"],
        [([j, r], inside) for j, r, inside in snap.live_ranks],
    )
    assert blocking == _reference(
        "sar_coordinator_rank_blocking_seconds",
        "For each rank that other ranks wait for: seconds they have waited in the collective it "
        "has not entered (only past --stall-threshold); op is that collective.",
        ["job", "rank", "op"],
        [([j, r, op], waited) for j, r, op, waited in snap.blocking],
    )
    assert b'job="we\\"ird\\\\job\\nname"' in rank_up  # escaped as the text format wants


def test_empty_families_keep_their_help_and_type() -> None:
    empty = StateSnapshot(dict.fromkeys(JobState, 0), dict.fromkeys(MemberState, 0), [], [], [])
    texts = [build(empty) for build in STATE_FAMILIES]
    assert texts[2] == (
        b"# HELP sar_coordinator_rank_up 1 for each live rank of a running job; 0 for the rank whose failure "
        b"failed its job (for an hour, or until the job's next generation starts forming).\n"
        b"# TYPE sar_coordinator_rank_up gauge\n"
    )
    assert all(text.count(b"# TYPE ") == 1 for text in texts)
