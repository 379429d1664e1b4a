"""Checks of every request field, in one place, before any state changes.

Each failure is an :class:`InvalidArgumentError` whose message names the field, the (shortened)
value and the rule, e.g. ``job '' must be 1 to 128 letters, digits, '.', '_' or '-', starting with a
letter or digit``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

from sarcomm.common import constants, durations
from sarcomm.common.addresses import parse_address
from sarcomm.common.constants import JOB_NAME_RULE, is_job_name
from sarcomm.common.errors import InvalidArgumentError, ResourceExhaustedError, shorten
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind, interface_with_address, usable_addresses
from sarcomm.common.messages import Progress, WorkerEndpoint
from sarcomm.coordinator.api.views import MemberSelection
from sarcomm.coordinator.config import Limits
from sarcomm.coordinator.domain.model import (
    ElasticRange,
    JoinSpec,
    MemberRequest,
    MemberState,
)
from sarcomm.v1 import coordinator_pb2 as pb

_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
# Linux interface names: up to 15 bytes, no '/', no whitespace.
_IFACE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
_MEMBER_ID = re.compile(r"[0-9a-f]{1,64}")
BACKENDS = ("", "auto", "gloo", "nccl", "ccl", "mpi", "ucc")
MAX_ADDRESSES_PER_INTERFACE = 32
MAX_REASON_CHARS = 1024
MAX_OP_CHARS = 64
# The longest IPv6 address with a zone (39 characters, '%', a 15-byte interface name) fits.
MAX_ADDRESS_CHARS = 64
# Secrets that Join hands out are 32 characters; anything much longer is not one.
MAX_SECRET_CHARS = 256
# One heartbeat carries the reports of one agent's local ranks.
MAX_REPORTS = 4096
# A member's workers' endpoints in one report (a torchrun node's workers: one per local rank).
MAX_WORKER_ENDPOINTS = 1024
_OP_NAME = re.compile(r"[A-Za-z0-9_.:-]*")
MAX_RESTARTS = constants.MAX_RESTARTS
MAX_LAST_CALL_S = constants.MAX_LAST_CALL_TIMEOUT


def invalid(field: str, value: object, rule: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{field} {shorten(value)} {rule}")


def job_name(value: str, field: str = "job") -> str:
    if not is_job_name(value):
        raise invalid(field, value, JOB_NAME_RULE)
    return value


def join_spec(request: pb.JoinRequest, peer_address: str | None, limits: Limits) -> JoinSpec:
    """The validated domain form of a ``JoinRequest``."""
    job = job_name(request.job)
    elastic = _elastic(request, limits)
    if elastic is None:
        _world_size(request.world_size, "world_size", limits)
    # An elastic world's size is decided when it forms; members are checked against its maximum.
    world_size = elastic.max_members if elastic is not None else request.world_size
    if not _HOST_NAME.fullmatch(request.host):
        raise invalid("host", request.host, "must be 1 to 253 letters, digits, '.', '_' or '-'")
    if not 1 <= request.store_port <= 65535:
        raise invalid("store_port", request.store_port, "must be a TCP port in 1..65535")
    if request.backend not in BACKENDS:
        raise invalid("backend", request.backend, f"must be one of {', '.join(b for b in BACKENDS if b)}")
    if request.generation < 0:
        raise invalid("generation", request.generation, "must be >= 0 (0 = the forming generation)")
    if not 0 <= request.max_restarts <= MAX_RESTARTS:
        raise invalid("max_restarts", request.max_restarts, f"must be in 0..{MAX_RESTARTS}")
    timeout = request.join_timeout_seconds
    try:
        durations.duration(timeout, zero=True)  # 0: the coordinator's --join-timeout
    except ValueError:
        raise invalid("join_timeout_seconds", timeout, f"must be {durations.rule(zero=True)}") from None
    interfaces = _interfaces(request, limits.max_interfaces)
    members = _members(request, world_size)
    if elastic is not None and any(m.rank is not None for m in members):
        raise invalid(
            "members.rank", [m.rank for m in members], "must be unset in an elastic job: ranks are dealt"
        )
    rejoin = _rejoin(request, elastic)
    if request.socket_name:
        if not _IFACE_NAME.fullmatch(request.socket_name):
            raise invalid(
                "socket_name",
                request.socket_name,
                "must be a Linux interface name (1 to 15 letters, digits, '_', '.', ':', '@', '-')",
            )
        names = sorted(i.name for i in interfaces)
        if request.socket_name not in names:
            raise invalid(
                "socket_name",
                request.socket_name,
                f"is not an interface of host {request.host!r}; it has: {', '.join(names)}",
            )
        forced = next(i for i in interfaces if i.name == request.socket_name)
        if not usable_addresses(forced):
            raise invalid(
                "socket_name",
                request.socket_name,
                f"must name an interface with an address other hosts can dial; host {request.host!r} "
                f"reported {list(forced.addresses) or 'no addresses'} on it",
            )
    elif not any(usable_addresses(i) for i in interfaces):
        raise invalid(
            "interfaces",
            [i.name for i in interfaces],
            "must include at least one interface with an address other hosts can dial",
        )
    return JoinSpec(
        job=job,
        world_size=world_size,
        host=request.host,
        interfaces=interfaces,
        members=members,
        store_port=request.store_port,
        socket_name=request.socket_name,
        generation=request.generation,
        backend=request.backend,
        peer_address=peer_address,
        max_restarts=request.max_restarts,
        elastic=elastic,
        rejoin_member_id=rejoin,
        rejoin_secret=request.rejoin_secret,
    )


def _world_size(value: int, field: str, limits: Limits) -> int:
    if value < 1:
        raise invalid(field, value, f"must be in 1..{limits.max_world_size}")
    if value > limits.max_world_size:
        # A configured limit rather than a malformed value: the same request could pass elsewhere.
        raise ResourceExhaustedError(
            f"{field} {value} must be in 1..{limits.max_world_size}: the coordinator's "
            f"limit max_world_size (--max-world-size) is {limits.max_world_size} members per job"
        )
    return value


def _elastic(request: pb.JoinRequest, limits: Limits) -> ElasticRange | None:
    """The elastic range of a join (None: a fixed world_size), checked: max_members > 0 makes it
    elastic, world_size must then be 0, and 1 <= min_members <= max_members."""
    if request.max_members == 0 and request.min_members == 0:
        if request.last_call_timeout_seconds:
            raise invalid(
                "last_call_timeout_seconds", request.last_call_timeout_seconds,
                "must be 0 unless max_members is set (only an elastic world has a last call)",
            )  # fmt: skip
        return None
    maximum = _world_size(request.max_members, "max_members", limits)
    if not 1 <= request.min_members <= maximum:
        raise invalid("min_members", request.min_members, f"must be in 1..max_members ({maximum})")
    if request.world_size:
        raise invalid(
            "world_size", request.world_size,
            "must be 0 in an elastic job (max_members set): its size is decided when it forms",
        )  # fmt: skip
    last_call = request.last_call_timeout_seconds
    if not (math.isfinite(last_call) and 0 <= last_call <= MAX_LAST_CALL_S):
        raise invalid(
            "last_call_timeout_seconds", last_call, f"must be a number of seconds in 0..{MAX_LAST_CALL_S:g}"
        )
    return ElasticRange(request.min_members, maximum, last_call)


def _rejoin(request: pb.JoinRequest, elastic: ElasticRange | None) -> str:
    """``rejoin_member_id`` checked (a re-join is an elastic job's re-rendezvous), or ""."""
    if not request.rejoin_member_id:
        if request.rejoin_secret:
            raise invalid("rejoin_secret", "<secret>", "must come with rejoin_member_id")
        return ""
    if elastic is None:
        raise invalid(
            "rejoin_member_id",
            request.rejoin_member_id,
            "must be unset unless max_members is set (an elastic job)",
        )
    secret(request.rejoin_secret, "rejoin_secret")
    return member_id(request.rejoin_member_id, "rejoin_member_id")


def _interfaces(request: pb.JoinRequest, max_interfaces: int) -> tuple[InterfaceInfo, ...]:
    if not request.interfaces:
        raise invalid("interfaces", [], "must list at least one network interface of the host")
    if len(request.interfaces) > max_interfaces:
        raise invalid(
            "interfaces",
            f"<{len(request.interfaces)} entries>",
            f"must list at most {max_interfaces} interfaces",
        )
    seen: set[str] = set()
    result = []
    for i, iface in enumerate(request.interfaces):
        field = f"interfaces[{i}]"
        if not _IFACE_NAME.fullmatch(iface.name):
            raise invalid(
                f"{field}.name",
                iface.name,
                "must be a Linux interface name (1 to 15 letters, digits, '_', '.', ':', '@', '-')",
            )
        if iface.name in seen:
            raise invalid(f"{field}.name", iface.name, "must not repeat an earlier interface")
        seen.add(iface.name)
        if len(iface.addresses) > MAX_ADDRESSES_PER_INTERFACE:
            raise invalid(
                f"{field}.addresses",
                f"<{len(iface.addresses)} entries>",
                f"must hold at most {MAX_ADDRESSES_PER_INTERFACE} addresses",
            )
        for j, address in enumerate(iface.addresses):
            if not _is_ip(address):
                raise invalid(
                    f"{field}.addresses[{j}]",
                    address,
                    "must be an IPv4 or IPv6 address without prefix length (an IPv6 zone must be an "
                    f"interface name), at most {MAX_ADDRESS_CHARS} characters",
                )
        kind = InterfaceKind.lookup(iface.kind)
        if kind is None:
            raise invalid(f"{field}.kind", iface.kind, "must be a known InterfaceKind")
        result.append(InterfaceInfo(iface.name, tuple(iface.addresses), kind, iface.default_route))
    return tuple(result)


def _members(request: pb.JoinRequest, world_size: int) -> tuple[MemberRequest, ...]:
    if not request.members:
        return (MemberRequest(local_rank=0),)
    if len(request.members) > world_size:
        raise invalid(
            "members",
            f"<{len(request.members)} entries>",
            f"must hold at most world_size ({world_size}) members",
        )
    local_ranks: set[int] = set()
    ranks: set[int] = set()
    result = []
    for i, member in enumerate(request.members):
        # A process that joins alone may be local rank 3 of its host: bound by the world, not the call.
        if not 0 <= member.local_rank < world_size:
            raise invalid(
                f"members[{i}].local_rank",
                member.local_rank,
                f"must be in 0..{world_size - 1} (world_size {world_size})",
            )
        if member.local_rank in local_ranks:
            raise invalid(f"members[{i}].local_rank", member.local_rank, "must not repeat in one request")
        local_ranks.add(member.local_rank)
        rank: int | None = None
        if member.HasField("rank"):
            rank = member.rank
            if not 0 <= rank < world_size:
                raise invalid(
                    f"members[{i}].rank", rank, f"must be in 0..{world_size - 1} (world_size {world_size})"
                )
            if rank in ranks:
                raise invalid(f"members[{i}].rank", rank, "must not be requested twice in one request")
            ranks.add(rank)
        result.append(MemberRequest(local_rank=member.local_rank, rank=rank))
    return tuple(result)


def member_id(value: str, field: str = "member_id") -> str:
    if not _MEMBER_ID.fullmatch(value):
        raise invalid(field, value, "must be the member id that Join returned")
    return value


def secret(value: str, field: str = "secret") -> str:
    # Never echo the value: even a wrong secret may be another member's, or a near miss.
    if len(value) > MAX_SECRET_CHARS:
        raise invalid(field, f"<{len(value)} characters>", f"must be at most {MAX_SECRET_CHARS} characters")
    return value


def report_count(count: int) -> None:
    if count > MAX_REPORTS:
        raise invalid("reports", f"<{count} entries>", f"must hold at most {MAX_REPORTS} reports")


def member_selection(request: pb.ListJobsRequest) -> MemberSelection:
    """The members a ``ListJobsRequest`` asks to list."""
    if request.member_limit < 0:
        raise invalid("member_limit", request.member_limit, "must be >= 0 (0 = every member)")
    if request.member_offset < 0:
        raise invalid("member_offset", request.member_offset, "must be >= 0")
    states = frozenset(request.member_states)
    known = [s.value for s in MemberState]
    for i, state in enumerate(request.member_states):
        if state not in known:
            raise invalid(f"member_states[{i}]", state, f"must be one of {', '.join(known)}")
    return MemberSelection(request.member_limit, request.member_offset, states)


def watch_generation(value: int) -> int:
    if value < 0:
        raise invalid("generation", value, "must be >= 0 (0 = the current generation)")
    return value


def progress(message: pb.Progress, field: str) -> Progress:
    if message.seq < 0:
        raise invalid(f"{field}.seq", message.seq, "must be >= 0")
    if not valid_op(message.op):
        raise invalid(
            f"{field}.op",
            message.op,
            f"must be at most {MAX_OP_CHARS} letters, digits, '_', '.', ':' or '-' (a collective's name)",
        )
    if not math.isfinite(message.since):
        raise invalid(f"{field}.since", message.since, "must be a finite Unix time")
    return Progress(message.seq, message.op, message.in_collective, message.since)


def valid_op(op: str) -> bool:
    """Whether ``op`` is a collective's name as a progress report may carry it."""
    return len(op) <= MAX_OP_CHARS and _valid_op_name(op)


# Cached (names of at most MAX_OP_CHARS only): every report of a rank names its op, from a handful.
@functools.lru_cache(maxsize=256)
def _valid_op_name(op: str) -> bool:
    return _OP_NAME.fullmatch(op) is not None


def age_seconds(value: float, field: str) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise invalid(field, value, "must be a finite number of seconds >= 0 (0 = alive now)")
    return value


def metrics_address(value: str, field: str) -> str:
    if not value:
        return value
    host, sep, port = value.rpartition(":")
    # isascii/isdigit: int() would also take " 80", "8_0" or other scripts' digits, and /sd hands
    # the text on as it is.
    if not (
        sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535 and _is_ip(host.strip("[]"))
    ):
        raise invalid(field, value, "must be IP:PORT of the rank's metrics endpoint")
    return value


def worker_endpoints(
    values: Sequence[pb.WorkerEndpoint], field: str
) -> tuple[tuple[WorkerEndpoint, ...], list[str]]:
    """A report's ``worker_endpoints.endpoints``: the entries that keep the rule (a rank and local
    rank >= 0, ranks distinct, an ``IP:PORT`` as :func:`metrics_address`, never empty; at most
    :data:`MAX_WORKER_ENDPOINTS`), and one line for each entry that does not (``field`` names the
    list). An entry costs only itself: a worker's metrics endpoint is monitoring, never a reason to
    refuse its node's report."""
    result: list[WorkerEndpoint] = []
    refused: list[str] = []
    ranks: set[int] = set()
    for i, value in enumerate(values):
        if i == MAX_WORKER_ENDPOINTS:
            refused.append(
                f"{field}: {len(values) - i} entries beyond the first {MAX_WORKER_ENDPOINTS} dropped "
                f"(a list holds at most {MAX_WORKER_ENDPOINTS} endpoints)"
            )
            break
        try:
            if value.rank < 0 or value.rank in ranks:
                raise invalid(
                    f"{field}[{i}].rank", value.rank, "must be a worker's global rank: >= 0 and distinct"
                )
            if value.local_rank < 0:
                raise invalid(f"{field}[{i}].local_rank", value.local_rank, "must be >= 0")
            if not value.metrics_address:
                raise invalid(
                    f"{field}[{i}].metrics_address", "", "must be IP:PORT of the worker's metrics endpoint"
                )
            address = metrics_address(value.metrics_address, f"{field}[{i}].metrics_address")
        except InvalidArgumentError as error:
            refused.append(str(error))
            continue
        ranks.add(value.rank)
        result.append(WorkerEndpoint(value.rank, value.local_rank, address))
    return tuple(result), refused


_JOIN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def join_id(value: str, field: str = "join_id") -> str:
    if not _JOIN_ID.fullmatch(value):
        raise invalid(field, value, "must be 1 to 64 letters, digits, '_' or '-' (a random id per join)")
    return value


def own_metrics_address(value: str, field: str, host: str, interfaces: Sequence[InterfaceInfo]) -> str:
    """``value`` (already :func:`metrics_address`) if its IP is one the member's host reported as
    its own, or the wildcard (which ``/sd`` replaces by the member's address): a report must not
    make Prometheus scrape somewhere else (the same rule as the master address)."""
    ip = value.rpartition(":")[0].strip("[]")
    parsed = parse_address(ip)
    if not value or (parsed is not None and parsed.is_unspecified) or interface_with_address(interfaces, ip):
        return value
    own = ", ".join(a for i in interfaces for a in i.addresses)[:200]
    raise invalid(
        field,
        value,
        f"must be on an address of the member's own host {host!r} (it reported {own or 'none'}), or on "
        "0.0.0.0; a rank's metrics endpoint is where it listens",
    )


# Cached: every heartbeat report repeats its rank's metrics endpoint, and parsing it each time was a
# visible share of the coordinator's CPU at 4096 reports a second.
@functools.lru_cache(maxsize=16384)
def _is_ip(text: str) -> bool:
    """An IPv4 or IPv6 address as :func:`~sarcomm.common.addresses.parse_address` reads it, written
    strictly: no brackets or surrounding space, and a zone only on an IPv6 address and shaped like
    an interface name (``fe80::1%eth0``).

    ``parse_address`` drops any zone, control characters included, and these strings reach logs,
    ``status`` and ``/sd``.
    """
    if len(text) > MAX_ADDRESS_CHARS or text != text.strip() or text.startswith("["):
        return False
    address, percent, zone = text.partition("%")
    if percent and not (":" in address and _IFACE_NAME.fullmatch(zone)):
        return False
    return parse_address(text) is not None


def exit_code(value: int) -> int:
    if not -255 <= value <= 255:
        raise invalid("exit_code", value, "must be in -255..255 (negative = killed by that signal)")
    return value


def reason(value: str) -> str:
    if len(value) > MAX_REASON_CHARS:
        raise invalid("reason", value, f"must be at most {MAX_REASON_CHARS} characters")
    # Reasons reach other ranks' logs and `status` on a terminal: no escape sequences in them.
    if any(not c.isprintable() and c not in "\t\n" for c in value):
        raise invalid("reason", value, "must be printable text (tabs and newlines allowed)")
    return value
