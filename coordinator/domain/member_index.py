"""The index of the members that can act: the members of formed worlds by id, with their job.

A report, a Leave or a re-join names a member by its id; :class:`MemberIndex` finds it in O(1)
(a dict: its ``get`` is the report path's lookup). It mirrors the jobs' member lists, and
:class:`~.membership.Membership` changes it only through :meth:`MemberIndex.index` and
:meth:`MemberIndex.unindex`; :meth:`MemberIndex.check` says whether it still agrees with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sarcomm.coordinator.domain.model import Job, JobState, Member, MemberState

__all__ = ["MemberIndex"]


class MemberIndex(dict[str, tuple[Job, Member]]):
    """member id -> (its job, the member), for the members of current formed generations."""

    def index(self, job: Job, members: Iterable[Member]) -> None:
        """``members`` of formed ``job`` can act (report, leave) from now on."""
        for member in members:
            self[member.member_id] = (job, member)

    def unindex(self, members: Iterable[Member]) -> None:
        """``members`` can act no more: their job settled, or it was replaced or forgotten."""
        for member in members:
            self.pop(member.member_id, None)

    def check(self, jobs: Mapping[str, Job]) -> None:
        """Raise AssertionError when the index disagrees with ``jobs`` (the current generation of
        each name). For tests: it walks every job and member.

        - Every member in the index is one of its job's members, under its own id, and that job
          is the current, formed generation of its name.
        - Every RUNNING member of a current RUNNING generation is in the index (a FAILED one put
          back after the next generation's Joins all withdrew keeps its members out of it).
        - A forming generation's requested ranks are exactly its members' requests.
        - A formed generation's members before ``memory.running_from`` are not RUNNING.
        """
        members_of: dict[int, set[int]] = {}  # id(job) -> the ids of its members, made once
        for member_id, (job, member) in self.items():
            assert member.member_id == member_id, f"{member_id} indexed as {member.member_id}"
            assert jobs.get(job.name) is job, f"{member_id} indexed with a {job.label} not current"
            assert job.state is not JobState.FORMING, f"{member_id} indexed while {job.label} forms"
            known = members_of.get(id(job))
            if known is None:
                known = members_of[id(job)] = {id(m) for m in job.members}
            assert id(member) in known, f"{member_id} indexed, not in {job.label}"
        for name, job in jobs.items():
            assert job.name == name, f"{job.label} kept under the name {name!r}"
            memory = job.memory
            if job.state is JobState.FORMING:
                asked = {m.requested_rank: id(m) for m in job.members if m.requested_rank is not None}
                kept = {rank: id(m) for rank, m in memory.requested.items()}
                assert kept == asked, f"{job.label}: requested ranks out of step"
                continue
            for i, member in enumerate(job.members):
                if member.state is not MemberState.RUNNING:
                    continue
                found = self.get(member.member_id)
                if job.state is JobState.RUNNING:
                    assert found is not None, f"{job.label}: running {member.member_id} not indexed"
                    assert found[1] is member, f"{job.label}: {member.member_id} indexed as another"
                assert i >= memory.running_from, (
                    f"{job.label}: running_from {memory.running_from} passed a RUNNING member"
                )
