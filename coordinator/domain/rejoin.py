"""A Join resent after its answer was lost with the coordinator that wrote it.

A Join is answered only once its world is written; if the leader dies (or the coordinator is
restarted) between that write and the answer reaching the client, the client sends the same Join
(same ``join_id``) to the coordinator that now holds the state, which has the formed world but not
the first one's in-memory ticket. Members keep the digest of the join id that brought them, so the
resend is recognised: the same members, ranks and master get answered again, with fresh secrets
(only digests are stored, and the client never received the first ones).

The resend is honoured only while none of those members has reported to this coordinator: a
member that reported had its answer, and its secret must not change under it.
"""

from __future__ import annotations

import secrets

from sarcomm.coordinator.domain.model import Job, JobState, MemberState, Ticket, digest


def reissue(job: Job, join_id: str) -> Ticket | None:
    """A ticket for the members of ``job`` that Join ``join_id`` brought, with new secrets; None
    when the job is not running, no member came with that join id, or one of them was heard from.
    """
    if job.state is not JobState.RUNNING or not join_id:
        return None
    wanted = digest(join_id)
    members = [m for m in job.members if m.join_digest == wanted]
    if not members or any(m.state is not MemberState.RUNNING or m.last_report for m in members):
        return None
    issued = []
    for member in members:
        secret = secrets.token_urlsafe(24)
        member.secret_digest = digest(secret)
        member.verified_secret = b""
        issued.append(secret)
    # job.members keeps the order members joined in, so this is the first answer's order too.
    return Ticket(job, tuple(members), tuple(issued))
