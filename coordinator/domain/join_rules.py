"""What a Join of a fixed world must agree with before its members are added.

:func:`check_fixed_join` is the admission rule of :meth:`~.membership.Membership.join` for a job
of one world size: the same kind of world, the same world size, the forming generation, room
for every member and free requested ranks. It only reads: a refused Join leaves the job (and the
generation before it) exactly as it was.
"""

from __future__ import annotations

from sarcomm.common.errors import AlreadyExistsError, FailedPreconditionError
from sarcomm.coordinator.domain.elastic import check_range
from sarcomm.coordinator.domain.model import Job, JoinSpec

__all__ = ["check_fixed_join"]


def check_fixed_join(job: Job, spec: JoinSpec) -> None:
    """Raise when the members of ``spec`` may not join ``job``'s forming world.

    Raises:
        FailedPreconditionError: the job is of another kind or world size, the request names a
            generation that is not the forming one, or the world has no room for its members.
        AlreadyExistsError: a requested rank is taken.
    """
    check_range(job, spec)
    if spec.world_size != job.world_size:
        raise FailedPreconditionError(
            f"world_size {spec.world_size} does not match {job.label}, which was created with "
            f"world_size {job.world_size}; every member of a job must ask for the same world size"
        )
    if spec.generation and spec.generation != job.generation:
        raise FailedPreconditionError(
            f"generation {spec.generation} is stale: {job.label} is forming now; a member of an "
            f"older generation cannot join a newer one (join with generation 0 to start afresh)"
        )
    joined = len(job.members)
    if joined + len(spec.members) > job.world_size:
        raise FailedPreconditionError(
            f"members: joining {len(spec.members)} more would make {joined + len(spec.members)} "
            f"members in {job.label}, which has world_size {job.world_size}"
        )
    for request in spec.members:
        if request.rank is not None and request.rank in job.memory.requested:
            holder = job.memory.requested[request.rank]
            raise AlreadyExistsError(
                f"rank {request.rank} is already taken in {job.label} by a member on host "
                f"{holder.host!r}; each rank can be requested once"
            )
