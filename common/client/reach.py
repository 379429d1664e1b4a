"""Why a coordinator address cannot be used, found with plain sockets while gRPC keeps retrying.

gRPC reports every connection failure the same way (the channel is in TRANSIENT_FAILURE, calls
with ``wait_for_ready`` wait until their deadline), so a typo in a host name, a closed port, the
coordinator's HTTP port and a TLS mismatch all look alike for minutes. :func:`probe` asks the
questions one by one: does the name resolve, does anything accept a TCP connection, does it answer
the HTTP/2 connection preface as a gRPC server does (with a SETTINGS frame), and, when it does not,
does it speak TLS where the client does not, or the other way round (:func:`~sarcomm.common.tls.diagnose`).

Blocking: run it in a thread.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass

from sarcomm.common.tls import ClientTls, Rejection, diagnose

__all__ = ["Problem", "Unreachable", "probe"]

# The client's HTTP/2 connection preface and an empty SETTINGS frame: a gRPC server answers with a
# SETTINGS frame of its own (a 9-byte header whose type byte, the fourth, is 4).
_H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 4
_TLS_ALERT = 0x15


class Problem(enum.Enum):
    UNRESOLVED = "name not resolved"
    REFUSED = "connection refused"
    NO_ANSWER = "no answer"
    NOT_GRPC = "not a gRPC server"
    TLS = "TLS mismatch"


@dataclass(frozen=True)
class Unreachable:
    """What is wrong with an address; ``message`` says it and what to do."""

    problem: Problem
    message: str
    #: For TLS: who rejected what (see :class:`~sarcomm.common.tls.Rejection`).
    rejection: Rejection | None = None

    @property
    def lasting(self) -> bool:
        """Whether waiting cannot help: something answers there, but not a coordinator this client
        can talk to. A refused connection or an unknown name may heal (a coordinator starting, a
        DNS record on its way)."""
        return self.problem in (Problem.NOT_GRPC, Problem.TLS)


def probe(host: str, port: int, tls: ClientTls | None, timeout: float = 3.0) -> Unreachable | None:
    """What keeps a client from using the coordinator at ``host:port``, or None when nothing is
    found (the address looks like a gRPC server that takes this client)."""
    where = f"{host}:{port}"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        return Unreachable(
            Problem.UNRESOLVED,
            f"the host name {host!r} does not resolve ({error.strerror}): check the name in --coord, "
            "or give an IP address",
        )
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return Unreachable(
            Problem.REFUSED,
            f"nothing accepts connections on {where}: start sar-coordinator there, "
            "or give the port of its --listen (default 50051)",
        )
    except TimeoutError:
        return Unreachable(
            Problem.NO_ANSWER,
            f"no answer from {where} within {timeout:g} s: the host is down, or a firewall drops the "
            "connection",
        )
    except OSError as error:
        return Unreachable(Problem.NO_ANSWER, f"cannot connect to {where}: {error.strerror or error}")
    if tls is None:
        with sock:
            answer = _hello(sock, timeout)
        if answer is None or (len(answer) >= 9 and answer[3] == _H2_SETTINGS):
            return None  # an HTTP/2 server (or one too slow to tell): gRPC's own errors will say
        if answer.startswith(b"HTTP/"):
            return Unreachable(
                Problem.NOT_GRPC,
                f"{where} answers HTTP/1.1, not gRPC: that is not the coordinator's gRPC port (its "
                "--http port serves /metrics and /v1/jobs); give the port of its --listen (default "
                "50051)",
            )
        if not answer or answer[0] == _TLS_ALERT:
            diagnosis = diagnose(host, port, None, timeout)
            if diagnosis is not None:
                return Unreachable(Problem.TLS, diagnosis.message, diagnosis.rejection)
        shown = answer[:16]
        return Unreachable(
            Problem.NOT_GRPC,
            f"{where} is not a gRPC server (it answered the HTTP/2 preface with {shown!r}): give the "
            "address of sar-coordinator's --listen (default port 50051)",
        )
    sock.close()
    diagnosis = diagnose(host, port, tls, timeout)
    return None if diagnosis is None else Unreachable(Problem.TLS, diagnosis.message, diagnosis.rejection)


def _hello(sock: socket.socket, timeout: float) -> bytes | None:
    """The first bytes the server sends after the HTTP/2 preface; b"" when it closed, None when it
    said nothing within ``timeout``."""
    sock.settimeout(timeout)
    try:
        sock.sendall(_H2_HELLO)
        return sock.recv(64)
    except TimeoutError:
        return None
    except OSError:
        return b""
