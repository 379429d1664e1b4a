"""The rules that judge running members: silence, broken streams, exits, and stalls.

Functions of a member's (or a job's) fields and the time, without I/O. The judgements
(:func:`silence_verdict`, :func:`silent_members`, :func:`exit_verdict`, :func:`find_stall`) only
read; :mod:`membership` and :mod:`sweep` apply what they decide through :mod:`transitions`. The
bookkeeping of a member's liveness fields is here too, and changes the fields it names:
:func:`note_report`, :func:`excuse`, :func:`mark_answered` and :func:`new_stall_line`.

Liveness: a member is alive while reports about it arrive and say it showed a sign of life
recently (``age``: an agent reports each rank's own alive stamp, so a stopped rank of a healthy
agent ages). It fails when that sign is older than the liveness timeout (interval x misses), or,
sooner, when the stream that carried its reports broke (its process or agent died: the kernel
closes the connection) and no report about it arrived within ``lost_grace``.

A reporter that sends nothing while its stream stays open is busy, not dead: a self-registered
process whose Python holds the GIL (a long C call, a CPU-starved host) cannot send its reports, but
gRPC's core threads, which need no GIL, still answer the coordinator's keepalive pings
(:func:`keepalive_settings`: the server pings every connection and closes one whose ping is not
answered in time, so a stopped or vanished process's stream breaks within about the liveness
timeout). So a member is judged for silence only from reports that arrive (an agent's report
carries the rank's own age) or once its stream is gone: not while its stream is open and quiet.
A reporter by exception builds on that: while its open stream stands for a member (its last
report fresh), the sweep does not look at the member at all (:mod:`.reporters`,
:mod:`.by_exception`).

Stalls: the progress each report carries (the sequence number of the collective a rank is in or
finished last) shows, when some ranks have waited in collective #k for longer than the stall
threshold, which ranks have not entered #k: the ones everybody waits for (:func:`find_stall`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sarcomm.common.constants import FailureReason
from sarcomm.common.messages import Progress
from sarcomm.coordinator.domain.model import Job, JobState, Member, MemberState, Stall, member_rank

#: A shell reports death by signal N as exit status 128 + N; Linux signals go up to 64 (SIGRTMAX).
SIGNAL_EXIT_BASE = 128
MAX_SIGNAL = 64

#: A judgement: the bounded reason, and the text people read.
Verdict = tuple[FailureReason, str]


def keepalive_settings(liveness_timeout: float) -> tuple[float, float]:
    """(ping every, answer within) seconds for the server's keepalive pings: a connection whose
    process stopped answering breaks at most ``liveness_timeout`` after its last answer, so that a
    quiet reporter (see the module's docstring) is judged in the time a silent one is."""
    return liveness_timeout / 4, liveness_timeout * 3 / 4


def starting(first_heard: float, now: float, liveness_timeout: float) -> bool:
    """Whether a job whose members were last heard from for the first time at monotonic
    ``first_heard`` (0.0: never) is still starting at ``now``: a first report came within the
    liveness timeout, so its members' streams are still being opened and accepted."""
    return first_heard > 0.0 and now - first_heard <= liveness_timeout


def silence_verdict(
    member: Member,
    now: float,
    liveness_timeout: float,
    lost_grace: float,
    answer_timeout: float = 600.0,
    first_heard: float = 0.0,
) -> Verdict | None:
    """Why running ``member`` has failed at monotonic time ``now``, or None while it is alive.

    A member whose Join has not been answered yet (its world's state could not be written, e.g. a
    full disk, while its client sends the same Join again) cannot report: it is judged only once
    ``answer_timeout`` (the join timeout) has passed since the world formed.

    A member answered but never heard from (no report reached this coordinator yet) is not failed
    while its job is :func:`starting` (``first_heard``: when a member of its job was last heard
    from for the first time): thousands of streams opening at once are accepted over seconds by
    a busy coordinator, and silence measured while its stream waits to be accepted is the
    coordinator's. It fails once the liveness timeout has passed both since its answer and since
    the job's last first report: a process that died right after its answer, in a job whose other
    members all report, is caught one liveness timeout after the last of them first reported."""
    silent = now - member.last_seen
    if not member.answered:
        if silent <= answer_timeout:
            return None
        return (
            FailureReason.MISSED_HEARTBEATS,
            f"missed heartbeats: its Join was not answered (its state not written) in {silent:.1f} s",
        )
    if not member.last_report and silent > liveness_timeout:
        if starting(first_heard, now, liveness_timeout):
            return None
        return (
            FailureReason.MISSED_HEARTBEATS,
            f"missed heartbeats: never heard from in the {silent:.1f} s since its Join was answered "
            f"(no other member of its job first reported in the last {liveness_timeout:g} s)",
        )
    # A stream that broke long after its last report broke for want of keepalive answers (the
    # process is stopped or cut off: judged by its silence), not because the process died (the
    # kernel closes a dead process's connections at once: judged after lost_grace).
    quiet_when_lost = (
        member.lost_at is not None
        and member.lost_at - member.last_report >= 0.9 * keepalive_settings(liveness_timeout)[1]
    )
    if member.lost_at is not None and not quiet_when_lost and now - member.lost_at > lost_grace:
        return (
            FailureReason.CONNECTION_LOST,
            f"connection lost: its heartbeat stream broke and no report came within {lost_grace:g} s "
            f"(process or agent gone)",
        )
    if silent <= liveness_timeout:
        return None
    if member.stream is not None and member.lost_at is None and now - member.last_report > liveness_timeout:
        # No report arrived, but its stream is open: the transport still answers keepalive pings.
        return None
    why = "; its connection stopped answering keepalive pings" if quiet_when_lost else ""
    return FailureReason.MISSED_HEARTBEATS, f"missed heartbeats: silent for {silent:.1f} s{why}"


def silent_members(
    job: Job, now: float, liveness_timeout: float, lost_grace: float, answer_timeout: float
) -> Iterator[tuple[Member, Verdict]]:
    """The RUNNING members of ``job`` that have failed at monotonic ``now``, each with its
    :func:`silence_verdict`, one at a time: the caller fails each before the next is looked at (an
    elastic generation that ends lets its other members go, and they are not RUNNING then).

    Only the members the sweep judges (``job.memory.judged``) are looked at: a member whose open
    by-exception stream stands for it is not (see :mod:`.reporters`); the members that stopped
    running leave that set here.

    Only a member that may be silent is asked: one whose stream broke, whose Join is unanswered,
    or that was last seen before the liveness timeout (and was heard from, or its job is no longer
    starting). Any other one :func:`silence_verdict` finds alive, and this test, written out in
    the loop, spares a call for it: the sweep runs four times an interval over every member of a
    big job (32,768 of them).
    """
    first_heard = job.memory.first_heard
    is_starting = starting(first_heard, now, liveness_timeout)
    heard_since = now - liveness_timeout
    judged = job.memory.judged
    gone: list[str] = []
    # A copy: the caller fails each member before the next is looked at.
    for member in list(judged.values()):
        if member.state is not MemberState.RUNNING:
            gone.append(member.member_id)  # stopped running: never judged again
            continue
        if (
            member.lost_at is None
            and member.answered
            and not (member.last_seen < heard_since and (member.last_report or not is_starting))
        ):
            continue
        verdict = silence_verdict(member, now, liveness_timeout, lost_grace, answer_timeout, first_heard)
        if verdict is not None:
            yield member, verdict
    for member_id in gone:
        judged.pop(member_id, None)


def note_report(
    member: Member, now: float, wall: float, progress: Progress | None, age: float, stream: object | None
) -> None:
    """A report about ``member`` at monotonic ``now`` (Unix ``wall``) over ``stream``: it showed a
    sign of life ``age`` seconds ago, and is at ``progress`` (None: not told)."""
    seen = now - age
    # max: a report delayed in transit, or reordered with a fresher one, never moves it back;
    # but the first report of a restored member ends its grace (a last_seen in the future).
    member.last_seen = seen if member.last_seen > now else max(member.last_seen, seen)
    member.last_heartbeat = max(member.last_heartbeat, wall - age)
    member.last_report = now
    member.lost_at = None
    member.stream = stream
    if progress is not None:
        member.progress = progress


def excuse(member: Member, seconds: float) -> None:
    """Stop ``member``'s clocks for ``seconds`` the coordinator was not listening.

    Reports that arrived while the coordinator's loop was held up (a burst of thousands of new
    streams, a machine whose CPUs are taken by others) wait unread in its queues: silence measured
    over that time is the coordinator's, not the member's. Every time its judgement reads moves on
    by ``seconds`` together, so nothing but the silence it judges changes."""
    member.last_seen += seconds
    if member.last_report:
        member.last_report += seconds
    if member.lost_at is not None:
        member.lost_at += seconds


def describe_exit(exit_code: int) -> str:
    """The text of an exit the member did not describe itself."""
    return f"exited with code {exit_code}"


def exit_verdict(exit_code: int, reason: str) -> Verdict:
    """Why a member that left with non-zero ``exit_code`` failed; ``reason`` is its own text.

    Decided by the exit code: negative is death by that signal, as the wire defines it (Python's
    ``returncode``, which sar-worker reports), and so is 128+N for a signal N (1..64), the shell's
    convention that launchers and container runtimes report (137: SIGKILL, the OOM killer's):
    KILLED. Any other code is the member's own exit: EXIT_CODE when it gave no text or the plain
    description of that code (what sar-worker sends for a rank that exited), REPORTED when its
    text says something else (an uncaught exception, a start-up failure).
    """
    if exit_code < 0 or SIGNAL_EXIT_BASE < exit_code <= SIGNAL_EXIT_BASE + MAX_SIGNAL:
        return FailureReason.KILLED, reason or describe_exit(exit_code)
    plain = describe_exit(exit_code)
    if not reason or reason == plain or reason.startswith(plain + ","):
        return FailureReason.EXIT_CODE, reason or plain
    return FailureReason.REPORTED, reason


def connection_lost_blame(other_rank: int | None, other_host: str, own_reason: str) -> Verdict:
    """The verdict on a member with a broken stream when a peer then exits non-zero: the broken
    one is the cause (its death broke the peer's collectives)."""
    return (
        FailureReason.CONNECTION_LOST,
        f"connection lost: its heartbeat stream broke (process or agent gone), and then rank "
        f"{other_rank} on host {other_host} {own_reason}",
    )


def find_stall(job: Job, now_wall: float, threshold: float) -> Stall | None:
    """The ranks of running ``job`` that the others wait for, at Unix time ``now_wall``, or None.

    Ranks make the same sequence of collectives, so sequence numbers line up across them: when
    ranks have been inside collective #k (the highest number any rank reports) for longer than
    ``threshold`` seconds, the live ranks whose last collective is below k have not entered it.
    None while nobody has waited that long, or when every rank is in #k (then nobody holds it).
    """
    if job.state is not JobState.RUNNING:
        return None
    live = [m for m in job.members if m.state is MemberState.RUNNING and m.rank is not None]
    if not live:
        return None
    top = max(m.progress.seq for m in live)
    if top == 0:
        return None
    waiting = [m for m in live if m.progress.seq == top and m.progress.in_collective]
    if not waiting:
        return None
    since = min(m.progress.since for m in waiting)
    waited = now_wall - since
    if waited < threshold:
        return None
    blocking = [m for m in live if m.progress.seq < top]
    if not blocking:
        return None
    return Stall(
        seq=top,
        op=waiting[0].progress.op,
        since=since,
        waited=waited,
        waiting=tuple(sorted(member_rank(m) for m in waiting)),
        blocking=tuple(sorted(member_rank(m) for m in blocking)),
    )


def mark_answered(members: Iterable[Member], now: float, answered: bool = True) -> None:
    """Whether the members' Join was answered (at monotonic ``now``): their liveness counts from
    the answer; unanswered, they are judged by the join timeout (see :func:`silence_verdict`)."""
    for member in members:
        if member.answered != answered:
            member.answered = answered
            member.last_seen = max(member.last_seen, now)


def new_stall_line(job: Job, stall: Stall | None) -> str:
    """The log line for ``stall`` of ``job`` the first time it is seen (then "")."""
    if stall is None or stall.seq == job.memory.logged_stall:
        return ""
    job.memory.logged_stall = stall.seq
    hosts = sorted({m.host for m in job.members if m.rank in stall.blocking})
    return f"{job.label}: {stall.describe()} (on host(s) {', '.join(hosts)})"
