"""The ``SAR_*``/``SARCOMM_*`` settings a rank reads, one function per setting, each a pure
function of a mapping (the environment) that validates its value; messages name the variable, the
value and the rule.

Read one at a time, when the call that needs a setting runs (as the library always has): an
explicit argument passed beside the mapping wins over the variable without judging it
(``heartbeat_interval_setting(env, 2.0)``), and a call never fails on a variable it does not use
(``init(initialize=False)`` never judges ``SAR_COLLECTIVE_TIMEOUT``). Settings read together are
returned together, as frozen dataclasses validated when built (:class:`ProgressSettings`,
:class:`RegistrationSettings`); what never fails to read is :class:`RankIdentity`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sarcomm.common import durations
from sarcomm.common.constants import (
    AGENT_PID_VARIABLE,
    BACKEND_VARIABLE,
    COLLECTIVE_TIMEOUT_VARIABLE,
    COORD_VARIABLE,
    DEFAULT_HEARTBEAT_INTERVAL,
    ENDPOINTS_DIR_VARIABLE,
    EXIT_TIMEOUT_VARIABLE,
    GENERATION_VARIABLE,
    GLOO_INTERFACE_VARIABLE,
    GROUP_RANK_VARIABLE,
    HEARTBEAT_INTERVAL_VARIABLE,
    INTERFACE_VARIABLES,
    JOB_VARIABLE,
    LOCAL_RANK_VARIABLE,
    LOCAL_WORLD_SIZE_VARIABLE,
    MASTER_ADDR_VARIABLE,
    MASTER_PORT_VARIABLE,
    MEMBER_ID_VARIABLE,
    METRICS_HOST_VARIABLE,
    METRICS_PORT_VARIABLE,
    PROGRESS_FILE_VARIABLE,
    RANK_VARIABLE,
    SOCKET_NAME_VARIABLE,
    TLS_CA_VARIABLE,
    TLS_CERT_VARIABLE,
    TLS_KEY_VARIABLE,
    TOKEN_FILE_VARIABLE,
    WORLD_SIZE_VARIABLE,
)
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.tls import ClientTls, read_token_file
from sarcomm.worker.launch_env.launchers import check_backend

__all__ = [
    "ALL_INTERFACES",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_EXIT_TIMEOUT_S",
    "ProgressSettings",
    "RankIdentity",
    "RegistrationSettings",
    "agent_pid_setting",
    "backend_setting",
    "check_metrics_settings",
    "client_tls_setting",
    "collective_timeout_setting",
    "endpoints_dir_setting",
    "exit_timeout_setting",
    "heartbeat_interval_setting",
    "interface_setting",
    "local_rank_setting",
    "master_port_setting",
    "metrics_host",
    "metrics_host_setting",
    "metrics_port_setting",
    "metrics_report_host",
    "node_worker_metrics_port",
    "progress_settings",
    "rank_identity",
    "rank_metrics_port",
    "registration_settings",
    "required_master_port",
    "socket_environment",
    "socket_name_setting",
    "torchrun_place_setting",
]

#: Seconds a collective may block before the backend gives up, unless SAR_COLLECTIVE_TIMEOUT says.
DEFAULT_COLLECTIVE_TIMEOUT_S: Final = 300.0
#: Seconds the exit hook may take to end the process groups before it cuts the exit short, unless
#: SAR_EXIT_TIMEOUT says. A clean end takes milliseconds; what can take longer is a collective still
#: waiting for a silent peer, which the group's destructor waits for (see sarcomm.worker.library.teardown).
DEFAULT_EXIT_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True)
class RankIdentity:
    """Who the environment says this process is, as written there and not judged: for log lines,
    labels and the checks that must not fail on a value they do not use. None (or "") where a
    variable is unset.

    ``coord`` is ``SAR_COORD`` ("" counts as unset); ``rank`` is ``RANK`` as written; ``member_id``
    is ``SAR_MEMBER_ID`` (set: the process is a member at a coordinator already).
    """

    rank: str | None
    job: str
    generation: str
    coord: str | None
    member_id: str | None
    master_addr: str | None

    @property
    def rank_label(self) -> str:
        """``RANK`` for a log line; "?" when unset."""
        return "?" if self.rank is None else self.rank


def rank_identity(env: Mapping[str, str]) -> RankIdentity:
    """:class:`RankIdentity` from ``env``; never raises."""
    return RankIdentity(
        rank=env.get(RANK_VARIABLE),
        job=env.get(JOB_VARIABLE, ""),
        generation=env.get(GENERATION_VARIABLE, ""),
        coord=env.get(COORD_VARIABLE) or None,
        member_id=env.get(MEMBER_ID_VARIABLE),
        master_addr=env.get(MASTER_ADDR_VARIABLE),
    )


def backend_setting(env: Mapping[str, str]) -> str | None:
    """``SAR_BACKEND``, or None when it is unset or empty.

    Raises:
        InvalidArgumentError: it is not one of :data:`~sarcomm.common.constants.BACKENDS`.
    """
    text = env.get(BACKEND_VARIABLE)
    return check_backend(text) if text else None


def socket_name_setting(environ: Mapping[str, str]) -> str:
    """``SAR_SOCKET_NAME`` without surrounding blanks; "" when it is unset or empty (then the
    coordinator chooses the interface, and the backends keep their own defaults until it has)."""
    return environ.get(SOCKET_NAME_VARIABLE, "").strip()


def socket_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The interface variables to set: each of :data:`~sarcomm.common.constants.INTERFACE_VARIABLES`
    that ``environ`` lacks, set to ``SAR_SOCKET_NAME``; nothing when ``SAR_SOCKET_NAME`` is unset or
    empty (see :func:`socket_name_setting`)."""
    name = socket_name_setting(environ)
    if not name:
        return {}
    return {var: name for var in INTERFACE_VARIABLES if not environ.get(var)}


def interface_setting(environ: Mapping[str, str]) -> str | None:
    """The interface gloo is told (``GLOO_SOCKET_IFNAME``), or None when it is unset: then gloo
    chooses. For log lines."""
    return environ.get(GLOO_INTERFACE_VARIABLE)


def heartbeat_interval_setting(env: Mapping[str, str], value: float | None) -> float:
    """Seconds between heartbeats and progress stamps: ``value`` when given, else
    ``SARCOMM_HEARTBEAT_INTERVAL``, else the coordinator's default (1 s).

    Raises:
        InvalidArgumentError: the one in force is not a positive number of seconds.
    """
    if value is None:
        text = env.get(HEARTBEAT_INTERVAL_VARIABLE)
        if text is None:
            return DEFAULT_HEARTBEAT_INTERVAL
        try:
            return durations.duration(text)
        except ValueError:
            raise InvalidArgumentError(
                f"{HEARTBEAT_INTERVAL_VARIABLE}={shorten(text)} must be {durations.rule()}."
            ) from None
    try:
        return durations.duration(value)
    except ValueError:
        raise InvalidArgumentError(f"heartbeat_interval={value!r} must be {durations.rule()}.") from None


def agent_pid_setting(env: Mapping[str, str]) -> int | None:
    """``SAR_AGENT_PID`` as a pid, or None (unset, or not a positive integer: then not watched)."""
    text = env.get(AGENT_PID_VARIABLE, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


@dataclass(frozen=True)
class ProgressSettings:
    """Where a rank keeps the progress record its ``sar-worker`` reads (``SAR_PROGRESS_FILE``), how
    often it stamps it (``SARCOMM_HEARTBEAT_INTERVAL``, seconds), the agent it watches
    (``SAR_AGENT_PID``, None: none) and the rank's label for log lines (``RANK``)."""

    path: Path
    interval: float
    agent_pid: int | None
    rank_label: str


def progress_settings(env: Mapping[str, str]) -> ProgressSettings | None:
    """:class:`ProgressSettings` when ``SAR_PROGRESS_FILE`` is set (``sar-worker`` sets it), else
    None. Raises :class:`InvalidArgumentError` for a malformed heartbeat interval."""
    path = env.get(PROGRESS_FILE_VARIABLE)
    if not path:
        return None
    return ProgressSettings(
        Path(path),
        heartbeat_interval_setting(env, None),
        agent_pid_setting(env),
        rank_identity(env).rank_label,
    )


def metrics_port_setting(environ: Mapping[str, str], member: bool) -> int | None:
    """The port this rank serves ``/metrics`` on (0: any free port), or None for no endpoint.

    ``SAR_METRICS_PORT`` decides when set (``sar-worker`` always sets it): a port, 0 or -1 (none).
    Unset, a process that is a member at a coordinator (``member``) serves on any free port, so
    that ``/sd`` lists it; any other process serves none (a plain torchrun job opts in with the
    variable). Raises :class:`InvalidArgumentError` for a value that is not an integer in -1..65535.
    """
    raw = environ.get(METRICS_PORT_VARIABLE, "").strip()
    if not raw:
        return 0 if member else None
    try:
        port = int(raw)
    except ValueError:
        port = -2
    if not -1 <= port <= 65535:
        raise InvalidArgumentError(
            f"{METRICS_PORT_VARIABLE}={shorten(raw)} must be an integer in -1..65535 "
            "(0: any free port, -1: no metrics endpoint)."
        )
    return None if port == -1 else port


def rank_metrics_port(first_port: int, local_rank: int) -> int:
    """The ``/metrics`` port of local rank ``local_rank`` for a first port ``first_port``
    (``sar-worker --metrics-port``, ``SAR_METRICS_PORT`` under torchrun): ``first_port +
    local_rank`` for a fixed first port, else ``first_port`` itself (0: any free port, -1: none)."""
    return first_port + local_rank if first_port > 0 else first_port


def endpoints_dir_setting(environ: Mapping[str, str]) -> Path | None:
    """``SAR_ENDPOINTS_DIR``: the node's directory where a torchrun worker notes its ``/metrics``
    endpoint for its agent (torchrun's sarcomm rendezvous sets it), or None when unset."""
    raw = environ.get(ENDPOINTS_DIR_VARIABLE, "").strip()
    return Path(raw) if raw else None


def node_worker_metrics_port(environ: Mapping[str, str]) -> int | None:
    """The port a torchrun worker of the sarcomm rendezvous serves ``/metrics`` on, or None for
    none: every worker of a node inherits one ``SAR_METRICS_PORT``, so, as with ``sar-worker
    --metrics-port P``, local rank i serves on P + i (``LOCAL_RANK``); unset or 0 any free port,
    -1 none.

    Raises:
        InvalidArgumentError: a malformed variable, or P + i beyond 65535.
    """
    port = metrics_port_setting(environ, member=True)
    if port is None:
        return None
    local_rank = local_rank_setting(environ) or 0
    mine = rank_metrics_port(port, local_rank)
    if mine > 65535:
        raise InvalidArgumentError(
            f"{METRICS_PORT_VARIABLE}={port} gives local rank {local_rank} port {mine}, beyond 65535: "
            "set a first port of at most 65536 minus --nproc-per-node (or 0: any free port)."
        )
    return mine


def check_metrics_settings(environ: Mapping[str, str]) -> None:
    """Refuse a malformed ``SAR_METRICS_PORT`` or ``SAR_METRICS_HOST`` before any worker starts
    (torchrun's sarcomm rendezvous: its workers inherit them). What only a worker can find (its
    first port plus its local rank beyond 65535) costs that worker's endpoint, not its training.

    Raises:
        InvalidArgumentError: naming the variable, its value and the rule.
    """
    metrics_port_setting(environ, member=True)
    metrics_host_setting(environ)


#: Where a rank's ``/metrics`` endpoint listens unless told: every IPv4 interface.
ALL_INTERFACES: Final = "0.0.0.0"


def metrics_host(text: str, source: str) -> str:
    """``text`` (the value of ``source``, a flag or variable) as the address to serve ``/metrics``
    on: an IP address, written as Python's ``ipaddress`` writes it; "" means every interface.

    Only an IP address: the coordinator lists a rank's endpoint in ``/sd`` only on an address of
    the rank's own host (or the wildcard), and a host name would have to be resolved first.
    Raises :class:`InvalidArgumentError` naming ``source`` otherwise.
    """
    text = text.strip()
    if not text:
        return ""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise InvalidArgumentError(
            f"{source}={shorten(text)} must be an IP address of this host to serve /metrics on "
            f"(e.g. 127.0.0.1; {ALL_INTERFACES} or unset: every interface)."
        ) from None


def metrics_host_setting(environ: Mapping[str, str]) -> str:
    """The address this rank serves ``/metrics`` on: ``SAR_METRICS_HOST`` (``sar-worker
    --metrics-host`` sets it), else every interface (``0.0.0.0``). Raises
    :class:`InvalidArgumentError` for a value that is not an IP address."""
    return metrics_host(environ.get(METRICS_HOST_VARIABLE, ""), METRICS_HOST_VARIABLE) or ALL_INTERFACES


def metrics_report_host(bind_host: str, member_address: str) -> str:
    """The address to report to the coordinator for an endpoint bound on ``bind_host``: the
    member's own address when it listens on every interface ("" or a wildcard, reachable there),
    else ``bind_host`` itself, where it really listens (an address of the member's host, which the
    coordinator accepts and lists in ``/sd``)."""
    if not bind_host or ipaddress.ip_address(bind_host).is_unspecified:
        return member_address
    return bind_host


def collective_timeout_setting(environ: Mapping[str, str]) -> float:
    """The process group timeout in seconds: ``SAR_COLLECTIVE_TIMEOUT``, else
    :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`. Raises :class:`InvalidArgumentError` unless it is a
    finite number greater than 0."""
    return _seconds(environ, COLLECTIVE_TIMEOUT_VARIABLE, DEFAULT_COLLECTIVE_TIMEOUT_S)


def exit_timeout_setting(environ: Mapping[str, str]) -> float:
    """Seconds the exit hook may take to end the process groups: ``SAR_EXIT_TIMEOUT``, else
    :data:`DEFAULT_EXIT_TIMEOUT_S`. Raises :class:`InvalidArgumentError` unless it is a finite
    number greater than 0."""
    return _seconds(environ, EXIT_TIMEOUT_VARIABLE, DEFAULT_EXIT_TIMEOUT_S)


def _seconds(environ: Mapping[str, str], variable: str, default: float) -> float:
    raw = environ.get(variable)
    if raw is None or raw.strip() == "":
        return default
    try:
        return durations.duration(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"{variable}={shorten(raw)} is not a valid timeout: it must be {durations.rule()}."
        ) from None


def master_port_setting(environ: Mapping[str, str], master_port_number: int | None) -> int | None:
    """The master port: ``master_port_number`` when given, else ``MASTER_PORT``, else None (unset
    or blank).

    Raises:
        InvalidArgumentError: the one in force is not an integer port in 1..65535.
    """
    if master_port_number is None:
        raw = environ.get(MASTER_PORT_VARIABLE)
        if raw is None or raw.strip() == "":
            return None
        try:
            port = int(raw)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"{MASTER_PORT_VARIABLE}={shorten(raw)} is not an integer port in 1..65535."
            ) from exc
        field = MASTER_PORT_VARIABLE
    else:
        port, field = master_port_number, "master_port_number"
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"{field}={shorten(port)} is not an integer port in 1..65535.")
    return port


def required_master_port(environ: Mapping[str, str], master_port_number: int | None) -> int:
    """The port a new process group meets on: :func:`master_port_setting`, which must give one.

    Raises:
        InvalidArgumentError: as :func:`master_port_setting`, or neither is given.
    """
    port = master_port_setting(environ, master_port_number)
    if port is None:
        raise InvalidArgumentError(
            f"master_port_number is None and {MASTER_PORT_VARIABLE} is not set: pass master_port_number, "
            "or start the process through sar-worker (or sar.init), which exports the port the "
            "coordinator handed out."
        )
    return port


def torchrun_place_setting(environ: Mapping[str, str]) -> tuple[int, int, int] | None:
    """A torchrun worker's place: (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``), as
    torchrun sets them, or None when one is unset or not an integer (never raises)."""
    try:
        return (
            int(environ[GROUP_RANK_VARIABLE]),
            int(environ[LOCAL_WORLD_SIZE_VARIABLE]),
            int(environ[WORLD_SIZE_VARIABLE]),
        )
    except (KeyError, ValueError):
        return None


def local_rank_setting(environ: Mapping[str, str]) -> int | None:
    """``LOCAL_RANK``, or None when it is unset or blank (then the caller derives one).

    Raises:
        InvalidArgumentError: it is not an integer.
    """
    raw = environ.get(LOCAL_RANK_VARIABLE)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"{LOCAL_RANK_VARIABLE}={shorten(raw)} is not a non-negative integer."
        ) from exc


def client_tls_setting(env: Mapping[str, str]) -> ClientTls | None:
    """TLS for a process that registers itself, from ``SARCOMM_TLS_CA``, ``SARCOMM_TLS_CERT`` and
    ``SARCOMM_TLS_KEY`` (what they mean to ``sar-worker``); None when none is set.

    Raises:
        InvalidArgumentError: a file cannot be read or is no PEM, or only one of the certificate
            and its key is set (see :class:`~sarcomm.common.tls.ClientTls`).
    """
    names = (TLS_CA_VARIABLE, TLS_CERT_VARIABLE, TLS_KEY_VARIABLE)
    ca, cert, key = (env.get(name) or None for name in names)
    if ca is None and cert is None and key is None:
        return None
    return ClientTls(*(Path(value) if value else None for value in (ca, cert, key)), names=names)


@dataclass(frozen=True)
class RegistrationSettings:
    """What a process that registers itself takes from its environment, validated: the heartbeat
    ``interval`` (seconds), the interface it insists on (``socket_name``, "" for the
    coordinator's choice), where it serves ``/metrics`` (``metrics_host``), and how it reaches the
    coordinator (``tls``, ``token``)."""

    interval: float
    socket_name: str
    metrics_host: str
    tls: ClientTls | None
    token: str | None


def registration_settings(
    env: Mapping[str, str], heartbeat_interval: float | None, token: str | None
) -> RegistrationSettings:
    """:class:`RegistrationSettings` from ``env``; ``heartbeat_interval`` and ``token``, when given,
    win over ``SARCOMM_HEARTBEAT_INTERVAL`` and ``SARCOMM_TOKEN_FILE`` (which are then not read).

    Raises:
        InvalidArgumentError: a setting breaks its rule (the message names it, its value and the
            rule), or the token file or a TLS file cannot be read.
    """
    interval = heartbeat_interval_setting(env, heartbeat_interval)
    socket_name = socket_name_setting(env)
    try:
        host = metrics_host_setting(env)
    except InvalidArgumentError:  # no endpoint then: start_rank_services says so, once
        host = ALL_INTERFACES
    tls = client_tls_setting(env)
    token_file = env.get(TOKEN_FILE_VARIABLE) if token is None else None
    if token_file:
        token = read_token_file(token_file, TOKEN_FILE_VARIABLE)
    return RegistrationSettings(interval, socket_name, host, tls, token)
