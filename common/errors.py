"""The one error hierarchy of sarcomm.

Domain code raises these. Each class names the gRPC status it stands for (``code``, the status
code's name), but this module imports no gRPC: the mapping to and from wire statuses is
:mod:`sarcomm.common.status`, used only at the edges (the servicer's interceptor and the client's
channel), so the domain stays free of gRPC. Messages are whole sentences that name the field, the
value and the rule, because they reach users verbatim.
"""

from __future__ import annotations

from collections.abc import Mapping


class SarcommError(Exception):
    """Base of every error sarcomm raises on purpose."""

    #: The name of the gRPC status code this error is sent as (``grpc.StatusCode[code]``).
    code: str = "UNKNOWN"


class InvalidArgumentError(SarcommError, ValueError):
    """Raised when a request field or a setting has a value its rule forbids."""

    code = "INVALID_ARGUMENT"


class FailedPreconditionError(SarcommError):
    """Raised when a request is valid but the job is in a state that does not allow it."""

    code = "FAILED_PRECONDITION"


class JobClosedError(FailedPreconditionError):
    """Raised when an elastic job's rendezvous is closed: a member finished or closed it, or the
    job failed, and no new world forms under it while its generation runs (torch's
    ``RendezvousClosedError``). ``beyond_max``: the caller was parked while the world already had
    max_members (torchrun then exits gracefully). On the wire it is no error status but a
    ``JoinResponse`` with ``closed`` set, which the client turns back into this error."""

    def __init__(self, message: str, *, beyond_max: bool = False) -> None:
        super().__init__(message)
        self.beyond_max = beyond_max


class AlreadyExistsError(SarcommError):
    """Raised when a member claims something another member holds, such as a rank."""

    code = "ALREADY_EXISTS"


class NotFoundError(SarcommError):
    """Raised when a request names a job or member the coordinator does not know."""

    code = "NOT_FOUND"


class UnauthenticatedError(SarcommError):
    """Raised when a call carries no valid token or member secret."""

    code = "UNAUTHENTICATED"


class ResourceExhaustedError(SarcommError):
    """Raised when a configured limit (jobs, members, streams, waiters) would be exceeded."""

    code = "RESOURCE_EXHAUSTED"


class StoreLimitError(ResourceExhaustedError):
    """Raised when the state store refuses, for good, what it was asked to keep: a job record
    larger than it takes (its own bounds, or etcd's ``--max-request-bytes``), or a lease TTL above
    etcd's maximum. The same request would be refused again, so it is not retried: the message
    names the job (when there is one), the size and the limit, and says what to do.

    ``refused`` maps each refused job, as ``(name, generation)``, to its own message; the other
    records of the same write were written.
    """

    def __init__(self, message: str, *, refused: Mapping[tuple[str, int], str] | None = None) -> None:
        super().__init__(message)
        self.refused: Mapping[tuple[str, int], str] = dict(refused or {})


class JoinTimeoutError(SarcommError, TimeoutError):
    """Raised when a job's world did not form before the join deadline."""

    code = "DEADLINE_EXCEEDED"


class CoordinatorUnavailableError(SarcommError, ConnectionError):
    """Raised when the coordinator could not be reached before the call's deadline."""

    code = "UNAVAILABLE"


class NotLeaderError(CoordinatorUnavailableError):
    """Raised by a standby coordinator (one of several sharing an etcd store) for every
    Coordinator RPC: only the leader serves them. ``leader`` is the leader's advertised gRPC
    address (``HOST:PORT``), or ``""`` while no leader is known. On the wire it is UNAVAILABLE with
    the address in the trailing metadata :data:`LEADER_METADATA_KEY`; clients follow it."""

    def __init__(self, message: str, *, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class StoreUnavailableError(CoordinatorUnavailableError):
    """Raised when the coordinator's shared state store (etcd) cannot be reached or cannot commit
    (no quorum) within the call's deadline. The message names the store, the cause and what to do;
    the change is kept and retried."""


class StoreFullError(ResourceExhaustedError, StoreUnavailableError):
    """Raised when the state store refuses every write for lack of space: etcd's NOSPACE alarm,
    raised when its database reached ``--quota-backend-bytes``. Unlike :class:`StoreLimitError`
    it passes: the changes are kept and written again once etcd takes writes again (after an
    operator compacts, defragments and disarms it), so the coordinator retries, as for a store it
    cannot reach; a call whose answer waits for a write gets RESOURCE_EXHAUSTED naming the cause."""


class LeadershipLostError(StoreUnavailableError):
    """Raised when etcd refuses a write because this coordinator no longer leads (fencing: every
    write is conditioned on the leader key it created). The coordinator steps down at once."""


#: Trailing-metadata key of an UNAVAILABLE answer from a standby: the leader's ``HOST:PORT``
#: (empty while none is known). Defined once here for both sides.
LEADER_METADATA_KEY = "sarcomm-leader"


class StateError(SarcommError):
    """Raised when the coordinator's state cannot be used: another coordinator holds it, it is not
    a sarcomm state, or it cannot be read or written. The message names the path and the cause
    and says what to do."""

    code = "FAILED_PRECONDITION"


class CoordinatorFailedError(SarcommError):
    """Raised when a part of the coordinator that must run for as long as it does (the leader
    election) ended on an unexpected error: the coordinator stops, with one line naming the error,
    rather than run on as a replica that can never lead."""

    code = "INTERNAL"


class PeerFailedError(SarcommError, RuntimeError):
    """Raised in a rank when another rank of its job failed, instead of hanging in a collective.

    ``rank``, ``host`` and ``reason`` name the failed peer (``rank`` is None when unknown).
    """

    code = "ABORTED"

    def __init__(self, message: str, *, rank: int | None = None, host: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.reason = reason


def shorten(value: object, limit: int = 64) -> str:
    """``repr`` of a value for an error message, cut so a hostile value cannot flood logs."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"
