"""One head node for a big job (benchmarks/big_job.py): forming the world and heartbeats at scale.

The rows the benchmark records are typed here (:class:`FormationRun`, :class:`BeatRun`), and
``big_job.py`` builds them under these types: a key renamed on one side fails mypy on the other.
The benchmark ran several times, each run for one question (the etcd store, 32,768 ranks, a
baseline); the report shows the newest run of each phase and links the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, NotRequired, TypedDict, cast

from render import (
    Context,
    Recording,
    Section,
    baseline_commit,
    command,
    machine_line,
    md_table,
    newest_per_part,
    older_runs,
    recorded,
    times,
)

TITLE = "One head node for a big job"

Phase = Literal["agents", "singles", "beat"]
#: What each phase measures, in the section's words.
PHASES: dict[str, tuple[str, str]] = {
    "agents": ("Forming the world", "agents: agents of 8 members, one Join each"),
    "singles": ("Forming the world", "singles: one member per Join"),
    "beat": ("Heartbeats", "agents of 8 members, one stream each"),
}


class Formation(TypedDict):
    """Every Join started at one instant: the coordinator's and the clients' view."""

    coordinator_view_s: float
    #: TCP connections the coordinator held before the Joins (absent from runs before it was
    #: counted, when a load process's channels shared one connection).
    connections: NotRequired[int]
    last_answer_s: float | None
    coordinator_cpu_s: float
    #: Python's garbage collections in that time (the coordinator's gc_pause metric).
    coordinator_gc_s: float
    join_errors: int
    join_error_examples: list[str]


class FormationRun(Formation):
    """One formation of ``agents`` x ``members`` ranks by ``code`` on ``store``."""

    code: str
    store: str
    agents: int
    members: int
    ranks: int


class FormationRow(FormationRun):
    """A formation phase's recorded row: the median of its rounds, and every round's view."""

    phase: Literal["agents", "singles"]
    rounds_view_s: list[float]


class BeatRun(TypedDict):
    """``agents`` x 8 ranks heartbeating for a window, by ``code`` on ``store``."""

    code: str
    store: str
    agents: int
    ranks: int
    #: TCP connections the coordinator held at the window's end (absent from older runs).
    connections: NotRequired[int]
    formation: Formation
    offered_reports_per_s: int
    acked_reports_per_s: int
    processed_reports_per_s: int
    coordinator_cpu_us_per_report: float | None
    #: What the offered rate would cost at that price: the target is a quarter of one core.
    core_share_at_offered: float | None
    coordinator_cpu_share: float
    #: Its user time alone: on loopback the kernel's delivery to the receiving client is charged
    #: to the sender's system time (sendmsg), which a NIC would not do.
    coordinator_user_us_per_report: float | None
    #: The load generator's own CPU (all its processes), as a share of one core.
    load_generator_cpu_share: float
    rss_peak_mib: float
    #: While the streams started (formation to the window): how often the coordinator's loop was
    #: held over 0.1 s and over 0.5 s, and its garbage collections (its own metrics).
    start_loop_held: list[int]
    start_gc_s: float
    window_loop_held: list[int]
    window_gc_s: float
    #: Each agent's first beat after its Join answer: written (the load generator's pace) and
    #: acknowledged (the coordinator's), p50 / max seconds.
    first_beat_written_s: list[float] | None
    first_beat_acked_s: list[float] | None
    members_failed_in_window: int
    probe_ack_p50_ms: float | None
    probe_ack_p99_ms: float | None
    probe_ack_max_ms: float | None
    endpoint_s: dict[str, float]
    failure_streams: int
    failure_streams_told: int
    failure_fanout_s: float | None
    client_errors: list[str]


class BeatRow(BeatRun):
    """The heartbeat phase's recorded row."""

    phase: Literal["beat"]


Row = FormationRow | BeatRow


def rows(doc: dict[str, Any]) -> list[Row]:
    """The rows of a recorded document (JSON: typed by what the benchmark writes)."""
    return cast(list[Row], doc["runs"])


def _phases(doc: dict[str, Any]) -> Iterable[str]:
    return dict.fromkeys(r["phase"] for r in rows(doc))


def _against(doc: dict[str, Any]) -> str:
    codes = list(dict.fromkeys(r["code"] for r in rows(doc) if r["code"] != "current"))
    return (
        " and ".join(
            f"the baseline {code.split()[1]}" if code.startswith("baseline ") else "the gRPC floor"
            for code in codes
        )
        or "nothing (the current code alone)"
    )


def headline(runs: Sequence[Row]) -> list[str]:
    """The current code against the baseline and the gRPC floor, per phase, store and size."""
    lines = []
    by = {(r["phase"], r["store"], r["ranks"], r["code"].split()[0]): r for r in runs}
    for (phase, store, ranks, code), now in by.items():
        if code != "current":
            continue
        parts = []
        others = [other for c in ("baseline", "grpc-floor") if (other := by.get((phase, store, ranks, c)))]
        if now["phase"] == "beat":
            value = now["coordinator_cpu_us_per_report"]
            parts.append(
                f"{phase} {ranks} ranks ({store}): {recorded(value)} us of coordinator CPU per report"
            )
            for other in others:
                if other["phase"] == "beat":
                    theirs = other["coordinator_cpu_us_per_report"]
                    if value and theirs:
                        parts.append(
                            f"{times(value, theirs, 'less', 'more')} than {_name(other)} ({theirs:g})"
                        )
            failed = f"members wrongly failed: {now['members_failed_in_window']}"
            base = by.get((phase, store, ranks, "baseline"))
            if base is not None and base["phase"] == "beat":
                failed += f" (the baseline: {base['members_failed_in_window']})"
            parts.append(failed)
        else:
            view = now["coordinator_view_s"]
            parts.append(f"{phase} {ranks} ranks ({store}): formed in {view:g} s (coordinator's view)")
            for other in others:
                if other["phase"] != "beat" and view and other["coordinator_view_s"]:
                    theirs = other["coordinator_view_s"]
                    parts.append(
                        f"{times(view, theirs, 'faster', 'slower')} than {_name(other)} ({theirs:g} s)"
                    )
        lines.append("; ".join(parts))
    return lines


def _name(row: Row) -> str:
    code = row["code"]
    return f"the baseline {code.split()[1]}" if code.startswith("baseline ") else "the gRPC floor"


def _split(runs: Iterable[Row]) -> tuple[list[FormationRow], list[BeatRow]]:
    """The formation rows and the heartbeat rows of ``runs``."""
    forms: list[FormationRow] = []
    beats: list[BeatRow] = []
    for r in runs:
        if r["phase"] == "beat":
            beats.append(r)
        else:
            forms.append(r)
    return forms, beats


def _tables(runs: Sequence[Row]) -> list[str]:
    tables = []
    forms, beats = _split(runs)
    if forms:
        header = ["phase", "store", "ranks", "code", "coordinator view s", "last answer s"]
        tables.append(
            md_table(
                [*header, "coordinator CPU s", "rounds"],
                [
                    (
                        r["phase"],
                        r["store"],
                        r["ranks"],
                        r["code"],
                        recorded(r["coordinator_view_s"]),
                        recorded(r["last_answer_s"]),
                        recorded(r["coordinator_cpu_s"]),
                        r["rounds_view_s"],
                    )
                    for r in forms
                ],
                "lllrrrrl",
            )
        )
    if beats:
        header = [
            "store",
            "code",
            "ranks",
            "offered/s",
            "processed/s",
            "us CPU/report",
            "core share at offered",
        ]
        header += ["RSS MiB", "failed", "probe p50/p99/max ms", "/metrics /sd /v1/jobs s", "fan-out s (told)"]
        tables.append(
            md_table(
                header,
                [
                    (
                        r["store"],
                        r["code"],
                        r["ranks"],
                        r["offered_reports_per_s"],
                        r["processed_reports_per_s"],
                        recorded(r["coordinator_cpu_us_per_report"]),
                        recorded(r["core_share_at_offered"]),
                        r["rss_peak_mib"],
                        r["members_failed_in_window"],
                        " / ".join(
                            recorded(r[k])
                            for k in ("probe_ack_p50_ms", "probe_ack_p99_ms", "probe_ack_max_ms")
                        ),
                        " / ".join(recorded(v) for v in r["endpoint_s"].values()) or "-",
                        f"{recorded(r['failure_fanout_s'])} "
                        f"({r['failure_streams_told']} of {r['failure_streams']})",
                    )
                    for r in beats
                ],
                "llrrrrrrrlll",
            )
        )
    return tables


def section(doc: dict[str, Any], ctx: Context) -> Section:
    """One recording alone (the benchmark's own page)."""
    name = str(doc.get("benchmark") or "big_job")
    return family_section([Recording(name, doc)], ctx)


def family_section(recordings: list[Recording], ctx: Context) -> Section:
    """Every recording of the benchmark: per phase, the newest one's rows; the older ones linked."""
    chosen = newest_per_part(recordings, _phases)
    shown = list(dict.fromkeys(chosen.values()))
    headlines: list[str] = []
    parts = []
    for recording in shown:
        phases = [phase for phase, r in chosen.items() if r is recording]
        runs = [r for r in rows(recording.doc) if r["phase"] in phases]
        headlines += headline(runs)
        described = [PHASES.get(phase, (phase, phase)) for phase in phases]
        title = " and ".join(dict.fromkeys(title for title, _ in described))
        parts.append(
            f"**{title}** ({'; '.join(what for _, what in described)}): run {recording.when} "
            f"(`{recording.name}.json`) against {_against(recording.doc)}."
        )
        parts += _tables(runs) or ["(no runs recorded)"]
    newest = shown[0].doc
    older = older_runs(recordings, chosen, _phases, ctx, lambda doc: baseline_commit_of(doc))
    section = Section(
        shown[0].name,
        str(TITLE),
        headlines,
        "\n\n".join(parts),
        "\n".join(command(r.doc, r.name) for r in shown),
        machine_line(newest),
        shown=[r.name for r in shown],
        older=older,
    )
    return section


def baseline_commit_of(doc: dict[str, Any]) -> str:
    """The baseline commit a recording timed beside the current code ("" when none)."""
    codes = [r["code"] for r in rows(doc) if r["code"].startswith("baseline ")]
    return codes[0].split()[1] if codes else baseline_commit(doc) if "baseline" in doc else ""
