"""A thin, blocking etcd v3 client: the few calls the store and the election make, nothing more.

It speaks etcd's own gRPC API through the generated stubs of ``aetcd`` (the maintained asyncio
etcd client, the optional extra ``sarcomm[etcd]``) on a *synchronous* gRPC channel, because its two
callers live on different threads: the store's writes run in the write-behind's writer thread
(:mod:`persistence`), the election in the event loop's executor. A synchronous channel is safe
from any thread and needs no loop; every call has a deadline.

One channel reaches every endpoint of ``--store``: etcd members given as IP addresses (or host
names, resolved once here) become one ``ipv4:``/``ipv6:`` target balanced round robin, so a member
that dies is left out by gRPC itself and the others carry on.
"""

from __future__ import annotations

import logging
import re
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import (
    InvalidArgumentError,
    StoreFullError,
    StoreLimitError,
    StoreUnavailableError,
)
from sarcomm.coordinator.storage.etcd_config import EtcdSettings

try:
    from aetcd.rpc import rpc_pb2 as etcd_pb
    from aetcd.rpc import rpc_pb2_grpc as etcd_grpc
except ImportError:  # the optional extra is not installed
    etcd_pb = None
    etcd_grpc = None

log = logging.getLogger(__name__)

T = TypeVar("T")
#: Seconds one etcd call may take before it counts as failed (a quorum lost answers nothing).
CALL_TIMEOUT_S = 2.0
#: Largest answer accepted (all job records at once when a leader takes over).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
Compare = Any  # etcd's Compare message (aetcd ships no type stubs)
RequestOp = Any
KeyValue = Any
TxnResponse = Any
#: etcd's answers to a request it will refuse however often it is sent, and the limit behind each.
_REFUSED_FOR_GOOD = {
    "request is too large": "larger than etcd's --max-request-bytes (1.5 MiB by default)",
    "too many operations in txn request": "more operations than etcd's --max-txn-ops (128 by default)",
    "too large lease TTL": "longer than the longest lease etcd grants; give a smaller --leader-ttl",
}

#: What etcd answers (RESOURCE_EXHAUSTED) to a write while its NOSPACE alarm is raised.
NOSPACE = "database space exceeded"
#: The commands that give a full etcd its space back, as etcd's own docs give them ("Space quota").
FREE_SPACE_COMMANDS = (
    "rev=$(etcdctl endpoint status --write-out=json | grep -o '\"revision\":[0-9]*' | cut -d: -f2 | "
    "head -1); etcdctl compact $rev; etcdctl defrag --cluster; etcdctl alarm disarm"
)
#: etcd's own gauge of its quota, on its /metrics (etcd 3.4 and later).
_QUOTA_SAMPLE = re.compile(rb"(?m)^etcd_server_quota_backend_bytes ([0-9.eE+-]+)$")
#: The most of an etcd /metrics answer read (it is ~100 to 200 KB).
_MAX_METRICS_BYTES = 4 * 1024 * 1024


def require_aetcd() -> None:
    """Raise a clear error when the optional extra is missing."""
    if etcd_pb is None:
        raise InvalidArgumentError(
            "--store etcd://... needs the etcd client: pip install 'sarcomm[etcd]' (installs aetcd)"
        )


def prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range of every key starting with ``prefix`` (the prefix plus one)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _target(endpoints: Sequence[tuple[str, int]]) -> tuple[str, str | None]:
    """The gRPC target reaching every endpoint, and the TLS name to check (host names only)."""
    addresses: list[str] = []
    name: str | None = None
    for host, port in endpoints:
        if parse_address(host) is not None:
            addresses.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
            continue
        name = name or host
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise InvalidArgumentError(
                f"--store endpoint {host}:{port}: the host name does not resolve ({error}); check the "
                "name or give an IP address"
            ) from None
        for info in infos:
            ip = str(info[4][0])
            addresses.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    v6 = [a for a in addresses if a.startswith("[")]
    v4 = [a for a in addresses if not a.startswith("[")]
    if v4:
        return "ipv4:" + ",".join(dict.fromkeys(v4)), name
    return "ipv6:" + ",".join(dict.fromkeys(v6)), name


class EtcdClient:
    """Blocking calls to the etcd cluster of ``settings``; safe from any thread.

    Every failure to reach etcd or to commit within ``timeout`` raises
    :class:`StoreUnavailableError` naming etcd, the cause and what to do.
    """

    def __init__(self, settings: EtcdSettings, timeout: float = CALL_TIMEOUT_S) -> None:
        require_aetcd()
        self.settings = settings
        self.timeout = timeout
        target, name = _target(settings.endpoints)
        self._tls_name = name
        options: list[tuple[str, Any]] = [
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A member that went away is tried again soon, not after gRPC's 120 s backoff cap.
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.initial_reconnect_backoff_ms", 100),
        ]
        if settings.cacert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=settings.cacert.read_bytes(),
                private_key=settings.key.read_bytes() if settings.key else None,
                certificate_chain=settings.cert.read_bytes() if settings.cert else None,
            )
            # One name for every member's certificate (a multi-address target has no single
            # authority): the first host name of --store, else its first address.
            options.append(("grpc.ssl_target_name_override", name or settings.endpoints[0][0]))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._kv = etcd_grpc.KVStub(self._channel)
        self._lease = etcd_grpc.LeaseStub(self._channel)
        self._auth = etcd_grpc.AuthStub(self._channel)
        self._maintenance = etcd_grpc.MaintenanceStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = ()

    def _authenticate(self) -> None:
        if self.settings.user is None:
            return
        answer = self._auth.Authenticate(
            etcd_pb.AuthenticateRequest(name=self.settings.user, password=self.settings.password),
            timeout=self.timeout,
        )
        self._metadata = (("token", answer.token),)

    def _call(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``; authenticate first (and again once when the token expired).

        Raises:
            StoreUnavailableError: etcd could not be reached or could not commit in time.
            StoreLimitError: etcd refused the request for good (too large, too many operations, a
                lease too long): sending it again would be refused again.
        """
        try:
            if self.settings.user is not None and not self._metadata:
                self._authenticate()
            try:
                return call()
            except grpc.RpcError as error:
                if self.settings.user is None or "token" not in str(_details(error)):
                    raise
                self._authenticate()
                return call()
        except grpc.RpcError as error:
            raise self._error(what, error) from None

    def nospace_message(self, what: str) -> str:
        """One line: etcd refused to ``what`` for space, why, and what to do about it."""
        retention = self.settings.compaction_retention
        ours = (
            f"this coordinator compacts revisions older than {retention:g} s (--etcd-compaction-retention)"
            if retention
            else "--etcd-compaction-retention is 0 here, so nothing compacts unless etcd's "
            "--auto-compaction-retention does"
        )
        return (
            f"{self.settings.describe()} refused to {what}: its database reached its quota "
            "(--quota-backend-bytes, 2 GiB by default) and it raised the NOSPACE alarm, so it takes no "
            "write until an operator frees space; reads and running jobs go on, changes are kept and "
            f"written once it takes writes again; {ours}; free space with: {FREE_SPACE_COMMANDS}"
        )

    def _error(self, what: str, error: grpc.RpcError) -> StoreUnavailableError | StoreLimitError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = _details(error)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and NOSPACE in details:
            return StoreFullError(self.nospace_message(what))
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            for refusal, limit in _REFUSED_FOR_GOOD.items():
                if refusal in details:
                    where = self.settings.describe()
                    return StoreLimitError(f"{where} refused to {what}: {details}, {limit}")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            cause = (
                f"no answer within {self.timeout:g} s: has etcd lost its quorum? start the missing members "
                "(a majority must run)"
            )
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            "auth" in details or "permission denied" in details
        ):
            cause = f"{details}: check --etcd-user and --etcd-password-file, and the user's role"
        elif code is grpc.StatusCode.UNAVAILABLE:
            cause = f"{details}: is etcd running there, and does it have a majority of its members?"
        else:
            cause = f"{code.name}: {details}"
        return StoreUnavailableError(f"{self.settings.describe()} could not {what}: {cause}")

    # -- key-value ---------------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        """The key's current value and revisions, or None; a linearizable read."""
        answer = self._call(
            f"read {key.decode()}",
            lambda: self._kv.Range(
                etcd_pb.RangeRequest(key=key), timeout=self.timeout, metadata=self._metadata
            ),
        )
        return answer.kvs[0] if answer.kvs else None

    def range_prefix(self, prefix: bytes, keys_only: bool = False, revision: int = 0) -> list[KeyValue]:
        """Every key under ``prefix``, in key order: as of ``revision`` (0: now, linearizable)."""
        answer = self._call(
            f"read the keys under {prefix.decode()}",
            lambda: self._kv.Range(
                etcd_pb.RangeRequest(
                    key=prefix, range_end=prefix_end(prefix), keys_only=keys_only, revision=revision
                ),
                timeout=self.timeout * 5,
                metadata=self._metadata,
            ),
        )
        return list(answer.kvs)

    def txn(
        self,
        what: str,
        compare: list[Compare],
        success: list[RequestOp],
        failure: list[RequestOp] | None = None,
    ) -> TxnResponse:
        """One etcd transaction; ``answer.succeeded`` tells which branch ran."""
        request = etcd_pb.TxnRequest(compare=compare, success=success, failure=failure or [])
        return self._call(what, lambda: self._kv.Txn(request, timeout=self.timeout, metadata=self._metadata))

    def compact(self, revision: int) -> None:
        """Compact etcd's history: every revision before ``revision`` is gone, for every key of
        the cluster (not only this deployment's prefix). A revision already compacted is fine."""
        try:
            self._call(
                f"compact its history up to revision {revision}",
                lambda: self._kv.Compact(
                    etcd_pb.CompactionRequest(revision=revision),
                    timeout=self.timeout * 5,
                    metadata=self._metadata,
                ),
            )
        except StoreUnavailableError as error:
            if "required revision has been compacted" not in str(error):
                raise

    def status(self) -> tuple[int, int]:
        """``(revision, database bytes)`` of the member that answers (its file on disk: what etcd
        holds against its quota)."""
        answer = self._call(
            "report its status",
            lambda: self._maintenance.Status(
                etcd_pb.StatusRequest(), timeout=self.timeout, metadata=self._metadata
            ),
        )
        return int(answer.header.revision), int(answer.dbSize)

    def quota_bytes(self) -> int | None:
        """etcd's ``--quota-backend-bytes`` as its first answering member's /metrics says it, or
        None when no member answers it (etcd before 3.4, or /metrics on another address: etcd's
        --listen-metrics-urls). Blocking, a few seconds at most per member."""
        for host, port in self.settings.endpoints:
            try:
                text = self._get_metrics(host, port)
            except (OSError, ssl.SSLError) as error:
                log.debug("etcd /metrics at %s:%d: %s", host, port, error)
                continue
            found = _QUOTA_SAMPLE.search(text)
            if found is not None:
                return int(float(found.group(1)))
        return None

    def _get_metrics(self, host: str, port: int) -> bytes:
        sock = socket.create_connection((host, port), timeout=self.timeout)
        with sock:
            stream: socket.socket = sock
            if self.settings.cacert is not None:
                context = ssl.create_default_context(cafile=str(self.settings.cacert))
                if self.settings.cert is not None and self.settings.key is not None:
                    context.load_cert_chain(str(self.settings.cert), str(self.settings.key))
                stream = context.wrap_socket(sock, server_hostname=self._tls_name or host)
            with stream:
                stream.sendall(f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
                chunks: list[bytes] = []
                size = 0
                while size < _MAX_METRICS_BYTES:
                    chunk = stream.recv(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
        return b"".join(chunks)

    # -- leases ------------------------------------------------------------------------------------

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds: ``(id, granted ttl)`` (etcd may grant more than asked)."""
        answer = self._call(
            "grant a lease",
            lambda: self._lease.LeaseGrant(
                etcd_pb.LeaseGrantRequest(TTL=ttl), timeout=self.timeout, metadata=self._metadata
            ),
        )
        if answer.error:
            raise StoreUnavailableError(f"{self.settings.describe()} refused a lease: {answer.error}")
        return int(answer.ID), int(answer.TTL)

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL from now, 0 when etcd no longer has it (expired)."""

        def renew() -> int:
            answers: Iterator[Any] = self._lease.LeaseKeepAlive(
                iter([etcd_pb.LeaseKeepAliveRequest(ID=lease)]), timeout=self.timeout, metadata=self._metadata
            )
            for answer in answers:
                return int(answer.TTL)
            return 0

        return self._call("renew the leader lease", renew)

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: its keys (the leader key) go at once."""
        self._call(
            "revoke the lease",
            lambda: self._lease.LeaseRevoke(
                etcd_pb.LeaseRevokeRequest(ID=lease), timeout=self.timeout, metadata=self._metadata
            ),
        )

    def close(self) -> None:
        self._channel.close()


def _details(error: grpc.RpcError) -> str:
    details = error.details() if hasattr(error, "details") else None
    return str(details or error)


# -- message builders (aetcd's generated types) --------------------------------------------------


def compare_create_revision(key: bytes, revision: int) -> Compare:
    """True when ``key``'s create revision is ``revision`` (0: the key does not exist)."""
    return etcd_pb.Compare(
        result=etcd_pb.Compare.EQUAL, target=etcd_pb.Compare.CREATE, key=key, create_revision=revision
    )


def put(key: bytes, value: bytes, lease: int = 0) -> RequestOp:
    return etcd_pb.RequestOp(request_put=etcd_pb.PutRequest(key=key, value=value, lease=lease))


def get(key: bytes) -> RequestOp:
    return etcd_pb.RequestOp(request_range=etcd_pb.RangeRequest(key=key))


def delete_range(key: bytes, range_end: bytes) -> RequestOp:
    """Delete every key from ``key`` (included) to ``range_end`` (excluded)."""
    return etcd_pb.RequestOp(request_delete_range=etcd_pb.DeleteRangeRequest(key=key, range_end=range_end))
