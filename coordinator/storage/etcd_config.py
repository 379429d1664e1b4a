"""The etcd store's settings: ``--store etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` and its flags.

:func:`parse_store_url` checks the URL field by field; :class:`EtcdSettings` holds it with the
lease TTL, the TLS files and the credentials, validated when built. Every message names the flag,
the value and the rule, and says what to write instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sarcomm.common.addresses import host_port, parse_address
from sarcomm.common.errors import InvalidArgumentError

SCHEME = "etcd://"
#: Where a coordinator keeps its keys when the URL names no prefix.
DEFAULT_PREFIX = "/sarcomm"
#: Seconds a leader's lease lives without renewal: how long a dead leader holds the job.
DEFAULT_LEADER_TTL = 5
#: The longest --leader-ttl: a dead leader holds every job that long before a standby takes over,
#: and an hour already defeats having a standby (etcd itself grants at most ~285 years).
MAX_LEADER_TTL = 3600
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,128}")
_EXAMPLE = "e.g. etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/sarcomm"


#: Seconds of history the leader keeps in etcd: it compacts the revisions older than this, as
#: Kubernetes' API server does every 5 minutes. 0 leaves compaction to the operator.
DEFAULT_COMPACTION_RETENTION = 300.0
#: The longest --etcd-compaction-retention: 30 days of revisions of big jobs would fill any quota.
MAX_COMPACTION_RETENTION = 30 * 24 * 3600.0
#: The shortest one other than 0: a reader needs the revision it read a record's head at for as
#: long as it takes to read that record's chunks.
MIN_COMPACTION_RETENTION = 1.0
#: What --etcd-compaction-retention must be, as its messages say it.
COMPACTION_RETENTION_RULE = (
    f"must be 0 (leave compaction to etcd's --auto-compaction-retention or its operator) or a number of "
    f"seconds in {MIN_COMPACTION_RETENTION:g}..{MAX_COMPACTION_RETENTION:g} (how long etcd keeps the "
    f"revisions it replaced), e.g. {DEFAULT_COMPACTION_RETENTION:g}"
)


def compaction_retention_ok(value: float) -> bool:
    """Whether ``value`` follows :data:`COMPACTION_RETENTION_RULE`."""
    return value == 0 or MIN_COMPACTION_RETENTION <= value <= MAX_COMPACTION_RETENTION


#: What --leader-ttl must be, as its messages say it.
LEADER_TTL_RULE = (
    f"must be a whole number of seconds in 1..{MAX_LEADER_TTL} (how long a dead leader holds the jobs "
    f"before a standby takes over; etcd leases count whole seconds), e.g. {DEFAULT_LEADER_TTL}"
)


def _bad(value: str, rule: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"--store {value!r}: {rule}; {_EXAMPLE}")


def _endpoint(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or parse_address(host) is None:
            raise _bad(url, f"endpoint {text!r} must be [IPv6]:PORT, HOST:PORT or IPv4:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise _bad(url, f"endpoint {text!r} must be HOST:PORT (etcd's client port, usually 2379)")
        if parse_address(host) is None and not _HOST.fullmatch(host):
            raise _bad(url, f"endpoint {text!r}: host {host!r} must be a host name or an IP address")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _bad(url, f"endpoint {text!r}: port {port!r} must be a number in 1..65535")
    return host, int(port)


def parse_store_url(url: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """``(endpoints, prefix)`` of an ``etcd://`` store URL.

    Raises:
        InvalidArgumentError: naming the part of ``url`` that breaks its rule.
    """
    if not url.startswith(SCHEME):
        scheme = url.partition("://")[0] if "://" in url else ""
        raise _bad(url, f"scheme {scheme!r} must be 'etcd' (SQLite is --state PATH, not --store)")
    rest = url[len(SCHEME) :]
    if any(c in rest for c in "?#@ "):
        raise _bad(url, "must hold no user, query, fragment or space (credentials go in --etcd-user)")
    hosts, slash, path = rest.partition("/")
    if not hosts:
        raise _bad(url, "must name at least one endpoint HOST:PORT")
    endpoints = tuple(_endpoint(url, text) for text in hosts.split(","))
    if len(set(endpoints)) != len(endpoints):
        raise _bad(url, "names an endpoint twice")
    prefix = DEFAULT_PREFIX
    if slash:
        segments = path.split("/")
        for segment in segments:
            if not _SEGMENT.fullmatch(segment) or segment in (".", ".."):
                raise _bad(
                    url,
                    f"prefix '/{path}': segment {segment!r} must be 1 to 128 letters, digits, '.', '_' or "
                    "'-' (no empty segment, no trailing '/', no '.' or '..')",
                )
        prefix = "/" + path
    return endpoints, prefix


@dataclass(frozen=True)
class EtcdSettings:
    """Where and how the coordinator reaches etcd, and its leader lease.

    ``leader_ttl`` is whole seconds (etcd leases count whole seconds). TLS is on when ``cacert`` is
    given (the CA that signed etcd's certificates); ``cert`` and ``key`` (together) are this
    client's certificate for etcd's ``--client-cert-auth``. ``user`` and ``password`` (together)
    authenticate to etcd's auth; the password is read from a file by the CLI.
    ``compaction_retention``: seconds of etcd's history the leader keeps (0: it compacts nothing).
    """

    url: str
    leader_ttl: int = DEFAULT_LEADER_TTL
    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = None
    compaction_retention: float = DEFAULT_COMPACTION_RETENTION

    def __post_init__(self) -> None:
        parse_store_url(self.url)
        retention = self.compaction_retention
        if (
            isinstance(retention, bool)
            or not isinstance(retention, int | float)
            or not compaction_retention_ok(float(retention))
        ):
            raise InvalidArgumentError(
                f"--etcd-compaction-retention {retention!r} {COMPACTION_RETENTION_RULE}"
            )
        if (
            isinstance(self.leader_ttl, bool)
            or not isinstance(self.leader_ttl, int)
            or not 1 <= self.leader_ttl <= MAX_LEADER_TTL
        ):
            raise InvalidArgumentError(f"--leader-ttl {self.leader_ttl!r} {LEADER_TTL_RULE}")
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError(
                f"--etcd-cert {self.cert} and --etcd-key {self.key} must be given together (this "
                "coordinator's client certificate for etcd and its key)"
            )
        if self.cert is not None and self.cacert is None:
            raise InvalidArgumentError(
                f"--etcd-cert {self.cert} needs --etcd-cacert, the CA bundle that signed etcd's certificate"
            )
        for flag, path in (
            ("--etcd-cacert", self.cacert),
            ("--etcd-cert", self.cert),
            ("--etcd-key", self.key),
        ):
            if path is not None and not Path(path).is_file():
                raise InvalidArgumentError(f"{flag} {str(path)!r} must be a readable file")
        if (self.user is None) != (self.password is None):
            raise InvalidArgumentError(
                f"--etcd-user {self.user!r} and --etcd-password-file must be given together"
            )
        if self.user is not None and not self.user:
            raise InvalidArgumentError("--etcd-user '' must be a non-empty etcd user name")

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        return parse_store_url(self.url)[0]

    @property
    def prefix(self) -> str:
        return parse_store_url(self.url)[1]

    @property
    def tls(self) -> bool:
        return self.cacert is not None

    def describe(self) -> str:
        """``etcd://H:P,H:P/prefix`` as users wrote it, for messages (never the password)."""
        hosts = ",".join(host_port(h, p) for h, p in self.endpoints)
        return f"etcd at {hosts} (prefix {self.prefix})"


def read_password_file(path: Path) -> str:
    """The etcd password in ``path``: its first line, which must not be empty.

    Raises:
        InvalidArgumentError: the file cannot be read or holds no password.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"--etcd-password-file {str(path)!r} cannot be read: {error}") from None
    password = text.splitlines()[0] if text.splitlines() else ""
    if not password:
        raise InvalidArgumentError(
            f"--etcd-password-file {str(path)!r} is empty: it must hold the etcd user's password on its "
            "first line"
        )
    return password
