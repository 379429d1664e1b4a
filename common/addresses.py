"""Network addresses as text, read and written one way: IP addresses, ``HOST:PORT`` for listening
sockets and for the coordinator's address, and ``host:port`` as sarcomm writes it."""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import TypeAlias

from sarcomm.common.errors import InvalidArgumentError, shorten

__all__ = [
    "IPAddress",
    "host_port",
    "parse_address",
    "parse_host_port",
    "parse_targets",
    "split_target",
    "validate_target",
]

IPAddress: TypeAlias = "ipaddress.IPv4Address | ipaddress.IPv6Address"


# Cached: forming a world parses every member's addresses several times (4096 members: ~25,000
# parses, most of the formation's time before); the results are immutable.
@functools.lru_cache(maxsize=16384)
def parse_address(text: str) -> IPAddress | None:
    """``text`` as an IP address, or None when it is not one.

    The IPv6 zone (``fe80::1%eth0``) is dropped: a zone names an interface of the host that wrote
    it, so it means nothing when comparing addresses across hosts. An IPv4-mapped IPv6 address
    (``::ffff:10.0.0.1``, what a dual-stack listener sees for an IPv4 client) becomes the IPv4
    address, so that it matches the IPv4 address the interface reports.
    """
    host = text.strip().split("%", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


_TARGET_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.%a-zA-Z]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


#: Target schemes gRPC's resolvers know (``dns:///head:50051``, ``unix:/run/sar.sock`` ...).
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "dns:", "vsock:", "xds:", "google-c2p:")


def validate_target(target: str) -> str:
    """Check a coordinator address and return it unchanged.

    Accepts ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) with a port in 1..65535, or any gRPC URI
    with a scheme (``dns:///head:50051``, ``unix:/run/sar.sock``), which gRPC checks itself.

    Raises:
        InvalidArgumentError: when the address has neither form.
    """
    if target.startswith(_GRPC_SCHEMES):
        return target
    if "://" in target:
        scheme = target.split("://", 1)[0]
        raise InvalidArgumentError(
            f"The coordinator address {shorten(target)} has the scheme {shorten(scheme)}, which gRPC "
            "does not dial: give HOST:PORT of sar-coordinator's --listen (e.g. head:50051), not a URL "
            "of its --http port."
        )
    match = _TARGET_RE.match(target)
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise InvalidArgumentError(
            f"The coordinator address {shorten(target)} must have the form HOST:PORT "
            "(e.g. head:50051 or [fd00::1]:50051) with a port in 1..65535."
        )
    return target


def parse_targets(text: str) -> tuple[str, ...]:
    """The coordinator addresses in ``text``: one address (checked by :func:`validate_target`,
    returned as it is), or several separated by commas (``a:50051,b:50051``), the replicas of one
    coordinator that clients fail over between, in the order given. Spaces around an item are
    dropped.

    Raises:
        InvalidArgumentError: naming the item and the rule, for a blank item, an item given twice
            or an item that is not an address.
    """
    if "," not in text:
        return (validate_target(text),)
    items = [item.strip() for item in text.split(",")]
    seen: dict[str, int] = {}
    for number, item in enumerate(items, start=1):
        where = f"item {number} of the coordinator address list {shorten(text)}"
        if not item:
            raise InvalidArgumentError(
                f"The {where} is blank: give addresses separated by single commas, e.g. a:50051,b:50051."
            )
        if item in seen:
            raise InvalidArgumentError(
                f"The {where} repeats item {seen[item]} ({shorten(item)}): give each coordinator once."
            )
        seen[item] = number
        try:
            validate_target(item)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"The {where} is wrong: {exc}") from None
    return tuple(items)


def split_target(target: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` coordinator address (brackets of an IPv6 host removed),
    or None when ``target`` has another form (a gRPC URI such as ``unix:/run/sar.sock``)."""
    match = _TARGET_RE.match(target)
    if match is None:
        return None
    return target[: match.start(1) - 1].strip("[]"), int(match.group(1))


def parse_host_port(field: str, value: str) -> tuple[str, int]:
    """Split a listening address ``HOST:PORT`` (``[v6]:PORT`` for IPv6); port 0 means "any free
    port" and an empty host means every interface (``0.0.0.0``).

    Raises:
        InvalidArgumentError: naming ``field`` when the value is not of that form.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidArgumentError(
            f"{field} {value!r} must be HOST:PORT with a port in 0..65535, e.g. 0.0.0.0:50051"
        )
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


def host_port(address: str, port: int) -> str:
    """``address:port``, with an IPv6 address in brackets (``[fd00::1]:9100``)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
