"""The coordinator's settings: one frozen, validated object built from flags and ``SARCOMM_*``.

Configuration flows one way: ``cli`` parses flags (each falling back to ``SARCOMM_<FLAG>``), builds
a :class:`CoordinatorConfig`, and the server only ever reads that object.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from sarcomm.common import durations
from sarcomm.common.addresses import host_port, parse_host_port
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.coordinator.storage.etcd_config import EtcdSettings

#: At most this many gRPC servers share the --listen port (--acceptors).
MAX_ACCEPTORS = 64
#: --report-policy: offer reports by exception to every Heartbeat stream, or never (each reporter
#: reports every member every interval, as coordinators before reports by exception had it).
REPORT_POLICIES = ("exception", "per-second")


@dataclass(frozen=True)
class Limits:
    """Bounds that keep a hostile or broken client from exhausting the coordinator.

    Past any of them a call gets RESOURCE_EXHAUSTED naming the limit. Together they bound the
    coordinator's memory: every request is at most ``max_message_bytes``, and what it keeps is
    at most ``max_jobs`` active jobs of ``max_world_size`` members, ``max_ended_jobs`` finished or
    failed ones, ``max_join_waiters`` waiting joins and ``max_streams`` open streams.

    - ``max_world_size``: members per job (the largest ``world_size`` a join may ask for).
    - ``max_jobs``: jobs forming or running at once.
    - ``max_message_bytes``: the largest request (and answer) gRPC accepts.
    - ``max_streams``: Heartbeat, Watch and other streaming calls open at once.
    - ``max_join_waiters``: Join calls waiting for their world at once. A world whose members
      join one per call needs as many, so the default equals ``max_world_size``.
    - ``max_ended_jobs``: finished or failed jobs kept for ``status`` and ``/v1/jobs``; older ones
      are forgotten in memory (the state file keeps them).
    - ``max_interfaces``: network interfaces one join may report.
    """

    max_world_size: int = 65536
    max_jobs: int = 1024
    max_message_bytes: int = 4 * 1024 * 1024
    max_interfaces: int = 64
    max_streams: int = 65536
    max_join_waiters: int = 65536
    max_ended_jobs: int = 1024

    def __post_init__(self) -> None:
        for name in (
            "max_world_size",
            "max_jobs",
            "max_message_bytes",
            "max_interfaces",
            "max_streams",
            "max_join_waiters",
            "max_ended_jobs",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} {value!r} must be an integer >= 1")
        # The smallest useful request (a Join of one member with one interface) is ~100 bytes;
        # below 1 KiB nothing would get through.
        if self.max_message_bytes < 1024:
            raise InvalidArgumentError(
                f"max_message_bytes {self.max_message_bytes!r} must be at least 1024 bytes"
            )


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything the coordinator needs to run; see ``sar-coordinator --help`` for each field.

    Times are in seconds. ``state`` None keeps the state in an in-memory SQLite database, unless
    ``store`` puts it in etcd (shared by several coordinators, one leading). ``advertise`` is the
    gRPC address clients should use for this coordinator ("" : ``listen`` with a wildcard host
    replaced by this host's name); a leader publishes it for the standbys to name.
    """

    listen: str = "0.0.0.0:50051"
    http: str = "0.0.0.0:9400"
    state: Path | None = None
    heartbeat_interval: float = 1.0
    heartbeat_misses: int = 3
    # Seconds ranks must wait in one collective before the ranks they wait for are named.
    stall_threshold: float = 30.0
    # Seconds members restored from --state have to reconnect before they are judged.
    reconnect_grace: float = 10.0
    join_timeout: float = 600.0
    shutdown_grace: float = 5.0
    # gRPC servers sharing --listen's port (SO_REUSEPORT within this process). gRPC's asyncio
    # server takes one new call per turn of the event loop; the kernel spreads new connections
    # over the acceptors, and each takes its own, so thousands of Joins and streams arriving at
    # once wait less for a busy loop.
    acceptors: int = 1
    # "exception": offer each Heartbeat stream reports by exception (see domain.policy);
    # "per-second" (the default until a cut-off host is told from a dead one by exception, and the
    # keepalive cost at scale is settled: docs/failures.md): never offer it.
    report_policy: str = "per-second"
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    log_level: str = "INFO"
    limits: Limits = Limits()
    store: EtcdSettings | None = None
    advertise: str = ""

    def __post_init__(self) -> None:
        parse_host_port("listen", self.listen)
        parse_host_port("http", self.http)
        _positive("heartbeat_interval", self.heartbeat_interval)
        _positive("join_timeout", self.join_timeout)
        _positive("stall_threshold", self.stall_threshold)
        _positive("reconnect_grace", self.reconnect_grace, zero=True)
        _positive("shutdown_grace", self.shutdown_grace, zero=True)
        if self.store is not None and self.state is not None:
            raise InvalidArgumentError(
                f"--store {self.store.url} and --state {self.state} were both given: the state lives in "
                "etcd (--store, shared by several coordinators) or in one SQLite file (--state); give one"
            )
        if self.advertise:
            host, port = parse_host_port("advertise", self.advertise)
            if port == 0 or host in ("0.0.0.0", "::"):
                raise InvalidArgumentError(
                    f"advertise {self.advertise!r} must be the HOST:PORT clients reach this coordinator at "
                    "(no wildcard host, no port 0), e.g. head1:50051"
                )
        if not 1 <= self.acceptors <= MAX_ACCEPTORS:
            raise InvalidArgumentError(
                f"acceptors {self.acceptors!r} must be 1 to {MAX_ACCEPTORS} (gRPC servers sharing the "
                f"--listen port); 1 serves jobs of hundreds of agents, 8 jobs of thousands"
            )
        if self.report_policy not in REPORT_POLICIES:
            raise InvalidArgumentError(
                f"report_policy {self.report_policy!r} must be one of {', '.join(REPORT_POLICIES)}"
            )
        if self.heartbeat_misses < 1:
            raise InvalidArgumentError(f"heartbeat_misses {self.heartbeat_misses!r} must be >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgumentError(
                f"tls_cert {self.tls_cert} and tls_key {self.tls_key} must be given together"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidArgumentError(f"tls_client_ca {self.tls_client_ca} needs tls_cert and tls_key")
        for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise InvalidArgumentError(f"{name} {str(path)!r} must be a readable file")

    @property
    def advertised(self) -> str:
        """Where clients reach this coordinator's gRPC service (``advertise``, or ``listen`` with a
        wildcard host replaced by this host's name)."""
        if self.advertise:
            return self.advertise
        host, port = parse_host_port("listen", self.listen)
        return host_port(socket.gethostname() if host in ("0.0.0.0", "::") else host, port)

    @property
    def liveness_timeout(self) -> float:
        """Seconds of silence after which a member is judged dead (interval x misses)."""
        return self.heartbeat_interval * self.heartbeat_misses


def _positive(field: str, value: float, *, zero: bool = False) -> None:
    try:
        durations.duration(value, zero=zero)
    except ValueError:
        raise InvalidArgumentError(f"{field} {value!r} must be {durations.rule(zero=zero)}") from None
