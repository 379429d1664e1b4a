"""TLS for both sides: the coordinator's server credentials, the clients' settings, and the
diagnosis of a failed handshake.

gRPC reports a certificate problem as "the coordinator is unavailable", and with
``wait_for_ready`` not even that until the deadline passes. :func:`diagnose` repeats the handshake
with Python's ``ssl`` module to find out which side rejected what, so that a worker with a wrong or
missing certificate fails with a sentence a person can act on instead of a timeout.

This module is shared by the coordinator (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``) and
by its clients (``sar-worker --tls-ca/--tls-cert/--tls-key``, ``sar-coordinator status``); like
:mod:`~sarcomm.common.interfaces` it imports nothing of the server.
"""

from __future__ import annotations

import enum
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from sarcomm.common.errors import InvalidArgumentError

__all__ = [
    "ClientTls",
    "Diagnosis",
    "Rejection",
    "diagnose",
    "read_token_file",
    "server_credentials",
    "server_ssl_context",
]

# What an HTTP/2 client sends first; a gRPC server that accepted the connection answers it with
# its SETTINGS frame, one that rejected the client's certificate closes the connection instead.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# What OpenSSL says when the answer to a ClientHello is not TLS at all (a plaintext HTTP/2 server).
_PLAINTEXT_ANSWERS = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"}
)


def _read(field: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise InvalidArgumentError(
            f"{field} {str(path)!r} must be a readable PEM file: {error.strerror}"
        ) from None
    if b"-----BEGIN " not in data:
        raise InvalidArgumentError(f"{field} {str(path)!r} must be a PEM file (no '-----BEGIN' line in it)")
    return data


# -- the shared token ------------------------------------------------------------------------------

#: The longest token file read; a token is a line of text, not a document.
MAX_TOKEN_BYTES = 4096


def read_token_file(path: Path | str, field: str = "--token-file") -> str:
    """The shared token in ``path``: one line of printable ASCII, surrounding whitespace ignored.

    Both sides read tokens with this one rule. The token travels as gRPC metadata and an HTTP
    header, which carry printable ASCII only: a token with an inner newline or a non-ASCII byte
    would start a coordinator that no client can authenticate to, and an empty one would mean "no
    token" on one side and "everyone" on the other.

    Raises:
        InvalidArgumentError: naming ``field`` and the file, when it cannot be read, is empty, is
            longer than :data:`MAX_TOKEN_BYTES`, or holds anything but one line of printable ASCII.
    """
    shown = str(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_TOKEN_BYTES + 1)
    except OSError as error:
        raise InvalidArgumentError(
            f"{field} {shown!r} must be a readable file: {error.strerror or error}"
        ) from None
    if len(data) > MAX_TOKEN_BYTES:
        raise InvalidArgumentError(
            f"{field} {shown!r} must hold one token of at most {MAX_TOKEN_BYTES} bytes; this file is longer."
        )
    token = data.strip()
    if not token:
        raise InvalidArgumentError(
            f"{field} {shown!r} is empty: it must hold a non-empty token (an empty token would "
            "let everyone in); write one, e.g. `openssl rand -hex 32 > FILE`."
        )
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise InvalidArgumentError(
            f"{field} {shown!r} must hold one line of printable ASCII without spaces (gRPC metadata "
            "and HTTP headers carry nothing else); it has a newline, a space, a control character "
            "or a non-ASCII byte inside the token."
        )
    return token.decode("ascii")


# -- the coordinator's side ----------------------------------------------------------------------


def server_ssl_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """The HTTP side's TLS context; building it also proves that the files are usable.

    Raises:
        InvalidArgumentError: a file is unreadable or not PEM, the key does not belong to the
            certificate, or the CA bundle holds no certificate.
    """
    _read("tls_cert", cert)
    _read("tls_key", key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as error:
        raise InvalidArgumentError(
            f"tls_cert {str(cert)!r} and tls_key {str(key)!r} must be a certificate and its own "
            f"private key: {error.reason or error}"
        ) from None
    if client_ca is not None:
        _read("tls_client_ca", client_ca)
        try:
            context.load_verify_locations(cafile=str(client_ca))
        except ssl.SSLError as error:
            raise InvalidArgumentError(
                f"tls_client_ca {str(client_ca)!r} must hold PEM CA certificates: {error.reason or error}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """gRPC server credentials; with ``client_ca`` every client must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(_read("tls_key", key), _read("tls_cert", cert))],
        root_certificates=_read("tls_client_ca", client_ca) if client_ca is not None else None,
        require_client_auth=client_ca is not None,
    )


# -- the clients' side ---------------------------------------------------------------------------


#: A client's TLS flags (``sar-worker``, ``sar-coordinator status``).
TLS_FLAGS = ("--tls-ca", "--tls-cert", "--tls-key")


@dataclass(frozen=True)
class ClientTls:
    """How a client talks TLS to the coordinator.

    ``ca``: PEM bundle of the CA(s) that signed the coordinator's ``--tls-cert`` (None: the
    system's roots). ``cert``/``key``: this client's own certificate and key, for a coordinator
    started with ``--tls-client-ca`` (mutual TLS); give both or neither.

    Raises:
        InvalidArgumentError: only one of ``cert``/``key``, or a file that is not readable PEM.
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    #: The settings ``ca``, ``cert`` and ``key`` came from, as the user wrote them (flags, or the
    #: ``SARCOMM_TLS_*`` variables under torchrun and the library): what every refusal names.
    names: tuple[str, str, str] = field(default=TLS_FLAGS, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        _, cert_name, key_name = self.names
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError(
                f"{cert_name} {_shown(self.cert)} and {key_name} {_shown(self.key)} must be given together "
                "(this client's certificate and its private key)"
            )
        for name, path in zip(self.names, (self.ca, self.cert, self.key), strict=True):
            if path is not None:
                _read(name, path)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca_name, cert_name, key_name = self.names
        return grpc.ssl_channel_credentials(
            root_certificates=_read(ca_name, self.ca) if self.ca else None,
            private_key=_read(key_name, self.key) if self.key else None,
            certificate_chain=_read(cert_name, self.cert) if self.cert else None,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same settings for Python's ``ssl`` (HTTPS requests, :func:`diagnose`)."""
        context = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.cert is not None and self.key is not None:
            context.load_cert_chain(str(self.cert), str(self.key))
        return context


def _shown(path: Path | None) -> str:
    return repr(str(path)) if path is not None else "(not given)"


class Rejection(enum.Enum):
    """Who refused the connection, as far as :func:`diagnose` could tell."""

    #: This client did not accept the coordinator's certificate.
    CLIENT_REJECTED_SERVER = "client"
    #: The coordinator did not accept this client's certificate, or its lack of one.
    SERVER_REJECTED_CLIENT = "server"
    #: One side speaks TLS and the other plaintext.
    PROTOCOL_MISMATCH = "protocol"


@dataclass(frozen=True)
class Diagnosis:
    rejection: Rejection
    message: str


def diagnose(host: str, port: int, tls: ClientTls | None, timeout: float = 3.0) -> Diagnosis | None:
    """Why a connection to the coordinator at ``host:port`` fails at the TLS layer, or None.

    Blocking (run it in a thread). None means "not a TLS problem": nothing listens, the network
    drops the packets, or the handshake works, so the caller keeps its own explanation.
    """
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    with sock:
        sock.settimeout(timeout)
        if tls is None:
            return _plaintext_client(sock, host)
        return _tls_client(sock, host, tls)


def _plaintext_client(sock: socket.socket, host: str) -> Diagnosis | None:
    # Does the coordinator speak TLS where this client speaks plaintext? Try a handshake that
    # trusts anything: it only asks the question, nothing is sent over it.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(sock, server_hostname=host):
            pass
    except (ssl.SSLError, OSError):
        return None
    return Diagnosis(
        Rejection.PROTOCOL_MISMATCH,
        "it speaks TLS and this client connected in plaintext: give the client the CA that signed "
        "the coordinator's certificate (sar-worker --tls-ca or SARCOMM_TLS_CA)",
    )


def _tls_client(sock: socket.socket, host: str, tls: ClientTls) -> Diagnosis | None:
    try:
        context = tls.ssl_context()
    except (ssl.SSLError, OSError) as error:
        return Diagnosis(Rejection.CLIENT_REJECTED_SERVER, f"this client's TLS files are unusable: {error}")
    context.set_alpn_protocols(["h2"])
    try:
        tls_sock = context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as error:
        return Diagnosis(
            Rejection.CLIENT_REJECTED_SERVER,
            f"this client rejected the coordinator's certificate ({error.verify_message}): {tls.names[0]} "
            f"must hold the CA that signed the coordinator's --tls-cert, and that certificate must "
            f"name {host!r}",
        )
    except ssl.SSLError as error:
        reason = error.reason or ""
        if "ALERT" in reason:
            return _server_rejected(tls, reason)
        if reason in _PLAINTEXT_ANSWERS:
            return Diagnosis(
                Rejection.PROTOCOL_MISMATCH,
                "it does not speak TLS (it answered the TLS handshake in plaintext): start it with "
                f"--tls-cert and --tls-key, or connect without {tls.names[0]}/{tls.names[1]}",
            )
        return Diagnosis(Rejection.PROTOCOL_MISMATCH, f"the TLS handshake failed: {reason or error}")
    except OSError:
        # The coordinator hung up during the handshake: under TLS 1.2 that is how some servers
        # refuse a client certificate.
        return _server_rejected(tls, "connection closed during the handshake")
    with tls_sock:
        # Under TLS 1.3 the client finishes its handshake before the server has looked at the
        # client's certificate; the verdict is what the server does next.
        try:
            tls_sock.sendall(_H2_PREFACE)
            answer = tls_sock.recv(64)
        except ssl.SSLError as error:
            return _server_rejected(tls, error.reason or str(error))
        except TimeoutError:
            return None
        except OSError as error:
            return _server_rejected(tls, str(error))
        if not answer:
            return _server_rejected(tls, "connection closed after the handshake")
    return None


def _server_rejected(tls: ClientTls, what: str) -> Diagnosis:
    if tls.cert is None:
        advice = (
            "this client sent no certificate and the coordinator requires one (--tls-client-ca): give "
            "the client --tls-cert and --tls-key (or SARCOMM_TLS_CERT and SARCOMM_TLS_KEY)"
        )
    else:
        advice = (
            f"the coordinator rejected this client's certificate {str(tls.cert)!r}: it must be signed "
            "by a CA in the coordinator's --tls-client-ca and be valid now"
        )
    return Diagnosis(Rejection.SERVER_REJECTED_CLIENT, f"{advice} ({what})")
