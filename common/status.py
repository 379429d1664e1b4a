"""sarcomm's errors on the wire: the one mapping between :mod:`.errors` and gRPC status codes.

Only the edges import this: the coordinator's interceptor sends an error as a status with
:func:`to_status`; the client's channel turns a failed call back into the same class with
:func:`from_rpc_error`.
"""

from __future__ import annotations

import grpc

from sarcomm.common.errors import (
    AlreadyExistsError,
    CoordinatorUnavailableError,
    FailedPreconditionError,
    InvalidArgumentError,
    JoinTimeoutError,
    NotFoundError,
    PeerFailedError,
    ResourceExhaustedError,
    SarcommError,
    UnauthenticatedError,
)

# One class per status code a client turns back into an error (the base classes of each code).
_BY_CODE: dict[grpc.StatusCode, type[SarcommError]] = {
    grpc.StatusCode[cls.code]: cls
    for cls in (
        InvalidArgumentError,
        FailedPreconditionError,
        AlreadyExistsError,
        NotFoundError,
        UnauthenticatedError,
        ResourceExhaustedError,
        JoinTimeoutError,
        CoordinatorUnavailableError,
        PeerFailedError,
    )
}


def status_code(error: SarcommError) -> grpc.StatusCode:
    """The gRPC status code ``error`` is sent as."""
    return grpc.StatusCode[error.code]


def to_status(error: SarcommError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details a servicer sends for ``error``."""
    return status_code(error), str(error)


def from_rpc_error(error: grpc.RpcError) -> SarcommError:
    """The sarcomm error that a failed call's status stands for (``SarcommError`` if unmapped)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, SarcommError)
    message = details or f"the coordinator answered {code.name} without details"
    return cls(message)
