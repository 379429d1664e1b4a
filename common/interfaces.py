"""Which network interface a host's ranks use: classification and choice, as pure logic.

Workers report their interfaces (name, addresses, what sysfs says they are, whether the default
route leaves through them); the coordinator picks one per host with :func:`choose_interface` and
advertises :func:`address_on` it. Nothing here does I/O, so every rule is testable with made-up
hosts, and the worker side (``sarcomm.common.netinfo``) imports it without pulling in the server.

The rules, in the order :func:`choose_interface` applies them:

1. ``socket_name`` (``--socket-name`` / ``SAR_SOCKET_NAME``) is the user's explicit choice: that
   interface, or :class:`~sarcomm.common.errors.InvalidArgumentError` naming the ones that exist.
2. ``single_host``: when every member of the world reached the coordinator over loopback, the
   whole job runs on one machine and loopback is the right interface.
3. The interface that carries the address the coordinator saw the member connect from: that path
   demonstrably works. Unless it is a loopback, bridge, veth or other virtual interface while a
   routable one exists, because other hosts cannot reach a container bridge or a veth.
4. The best routable interface: the one the default route leaves through, then by name.
5. Nothing routable (a container or a netns host has only ``lo`` and a veth): the member's own
   interface, then any non-loopback interface with an address, then loopback.
"""

from __future__ import annotations

import enum
import functools
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sarcomm.common.addresses import IPAddress, parse_address
from sarcomm.common.errors import InvalidArgumentError, shorten

__all__ = [
    "InterfaceInfo",
    "InterfaceKind",
    "address_on",
    "choose_interface",
    "interface_with_address",
    "is_avoided",
    "is_loopback",
    "is_routable",
    "is_routable_address",
    "name_looks_virtual",
    "parse_peer",
    "unknown_interface_error",
    "usable_addresses",
]


class InterfaceKind(enum.IntEnum):
    """What sysfs says an interface is; the numbers are those of the proto's ``InterfaceKind``."""

    UNSPECIFIED = 0
    PHYSICAL = 1
    LOOPBACK = 2
    BRIDGE = 3
    VETH = 4
    VIRTUAL = 5

    @classmethod
    def coerce(cls, value: int) -> InterfaceKind:
        """The kind for a wire value; an unknown number is UNSPECIFIED.

        proto3 enums are open: a newer or hostile client may send a number this version does not
        know, and that must not crash the coordinator. UNSPECIFIED leaves the call to the name.
        """
        kind = cls.lookup(value)
        return kind if kind is not None else cls.UNSPECIFIED

    @classmethod
    def lookup(cls, value: int) -> InterfaceKind | None:
        """The kind numbered ``value``, or None when there is none (the enum's own call, which
        raises instead, is ~10x slower: every interface of every join is looked up)."""
        return _KINDS.get(value)


_KINDS = {kind.value: kind for kind in InterfaceKind}


@dataclass(frozen=True)
class InterfaceInfo:
    """One network interface of a host, as its worker reported it.

    ``addresses`` are IPv4 and IPv6 addresses without prefix length (``"10.0.0.5"``, ``"fd00::5"``);
    entries that do not parse are kept but never used, since they come from the network.
    ``kind`` accepts a plain int (a proto enum value) and stores an :class:`InterfaceKind`.
    """

    name: str
    addresses: tuple[str, ...] = ()
    kind: InterfaceKind = InterfaceKind.UNSPECIFIED
    default_route: bool = False

    def __post_init__(self) -> None:
        # Normalise what callers building this from a proto message naturally pass (a repeated
        # field, an int enum) so that equality and hashing behave.
        object.__setattr__(self, "addresses", tuple(self.addresses))
        object.__setattr__(self, "kind", InterfaceKind.coerce(int(self.kind)))
        object.__setattr__(self, "default_route", bool(self.default_route))


# --- addresses --------------------------------------------------------------------------------


def is_routable_address(address: str | IPAddress) -> bool:
    """Whether another host could reach this address (as far as the address alone tells).

    Loopback never leaves the host; link-local (169.254/16, fe80::/10) does not cross a router
    and an IPv6 one needs a zone the peer cannot know; unspecified and multicast addresses are not
    addresses of a host. Private ranges (10/8, fd00::/8) do count: clusters live on them.
    """
    parsed = parse_address(address) if isinstance(address, str) else address
    if parsed is None:
        return False
    return not (parsed.is_loopback or parsed.is_link_local or parsed.is_unspecified or parsed.is_multicast)


def usable_addresses(interface: InterfaceInfo, *, prefer_ipv4: bool = True) -> list[IPAddress]:
    """The addresses of ``interface`` that can be advertised, best first.

    Routable addresses come first, IPv4 before IPv6 when ``prefer_ipv4`` (torch's stores and gloo
    take IPv4 most reliably), then in reported order. IPv4 link-local follows: it works without a
    zone between hosts on one link. A loopback address counts only on a loopback interface, where
    it is the point (single-host jobs). IPv6 link-local is never usable: it needs a zone, and the
    zone is a name on the host that wrote it, not on the hosts that would dial it.
    """
    return list(_usable_addresses(interface, prefer_ipv4))


# Cached: a join's checks and its world's formation ask this of each of its host's interfaces
# several times (32,768 single-rank hosts: 130,000 calls, a sixth of the formation in process).
@functools.lru_cache(maxsize=8192)
def _usable_addresses(interface: InterfaceInfo, prefer_ipv4: bool) -> tuple[IPAddress, ...]:
    on_loopback = is_loopback(interface)
    ranked: list[tuple[int, int, int, IPAddress]] = []
    for index, text in enumerate(interface.addresses):
        address = parse_address(text)
        if address is None or address.is_unspecified or address.is_multicast:
            continue
        if address.is_loopback and not on_loopback:
            continue
        if address.is_link_local and address.version == 6:
            continue
        tier = 0 if is_routable_address(address) or address.is_loopback else 1
        family = 0 if (address.version == 4) == prefer_ipv4 else 1
        ranked.append((tier, family, index, address))
    ranked.sort(key=lambda entry: entry[:3])
    unique: list[IPAddress] = []
    for *_, address in ranked:
        if address not in unique:
            unique.append(address)
    return tuple(unique)


def address_on(interface: InterfaceInfo, prefer_ipv4: bool = True) -> str:
    """The address to advertise for ``interface`` (as ``MASTER_ADDR`` or a member's address).

    The first of :func:`usable_addresses`: IPv4 first by default, never link-local IPv6, never a
    loopback address on a non-loopback interface.

    Raises:
        InvalidArgumentError: the interface has no usable address (none at all, or only IPv6
            link-local ones), so nothing could dial it.
    """
    addresses = usable_addresses(interface, prefer_ipv4=prefer_ipv4)
    if not addresses:
        reported = ", ".join(_short_name(a) for a in interface.addresses[:8]) or "none"
        raise InvalidArgumentError(
            f"interface {shorten(interface.name)} has no address other hosts could dial "
            f"(it reports: {reported}); an interface needs an IPv4 address or an IPv6 address "
            f"that is not link-local, and loopback addresses count on loopback only."
        )
    return str(addresses[0])


# Cached: every call of a connection (a Join, its Heartbeat stream, its Leaves) names the same peer.
@functools.lru_cache(maxsize=4096)
def parse_peer(grpc_peer: str) -> str | None:
    """The IP address in a gRPC ``context.peer()`` string, or None when it has none.

    gRPC writes ``ipv4:127.0.0.1:5555``, ``ipv6:[::1]:5555`` and, URI-escaped,
    ``ipv6:%5B::ffff:10.0.0.1%5D:123``; ``unix:...`` and other transports carry no IP address.
    The result is normalised as :func:`parse_address` does (zone dropped, IPv4-mapped addresses
    unmapped), so ``"10.0.0.1"`` comes out of the last example: that is the address the member's
    host holds, which is what interface matching and display need.
    """
    scheme, sep, rest = grpc_peer.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return None
    rest = urllib.parse.unquote(rest)
    if rest.startswith("["):
        host, bracket, _port = rest[1:].partition("]")
        if not bracket:
            return None
        candidates = [host]
    else:
        # No brackets: "1.2.3.4:5555", or an old or odd spelling of IPv6 ("::1:5555" is ambiguous,
        # so try the whole text after stripping a port first, then the whole text).
        candidates = [rest.rsplit(":", 1)[0], rest] if ":" in rest else [rest]
    for candidate in candidates:
        address = parse_address(candidate)
        if address is not None:
            return str(address)
    return None


# --- interfaces -------------------------------------------------------------------------------

# Name prefixes of interfaces that belong to container runtimes, hypervisors, overlays and tunnels.
# They only decide when the worker could not tell the kind (UNSPECIFIED: a non-Linux host or an
# older client); when sysfs spoke, its answer is used. None of these reach other hosts directly:
# a docker bridge or a flannel overlay has an address, but not one other hosts' ranks should dial.
_VIRTUAL_NAME_PREFIXES: tuple[str, ...] = (
    "docker",  # docker0
    "br-",  # docker user-defined networks
    "virbr",  # libvirt NAT bridge
    "vnet",  # libvirt guest taps
    "vmnet",  # VMware
    "vboxnet",  # VirtualBox host-only
    "lxc",  # lxcbr0, lxc veths
    "lxdbr",  # LXD
    "podman",
    "nerdctl",
    "cni",  # cni0 and friends
    "veth",
    "flannel",
    "cali",  # calico
    "tunl",  # calico IPIP
    "cilium",
    "weave",
    "kube-",  # kube-ipvs0, kube-bridge
    "vxlan",
    "genev",  # geneve
    "tun",  # VPN tunnels
    "tap",
    "ifb",
    "dummy",
    "sit",
    "ip6tnl",
    "ip_vti",
    "ip6_vti",
    "ip6gre",
    "gre",
    "erspan",
)

# "lo" and BSD-style "lo0"; not every name starting with "lo" ("local-net" is a legitimate name).
_LOOPBACK_NAME = re.compile(r"^lo\d*$")

_AVOIDED_KINDS = frozenset(
    {InterfaceKind.LOOPBACK, InterfaceKind.BRIDGE, InterfaceKind.VETH, InterfaceKind.VIRTUAL}
)


def is_loopback(interface: InterfaceInfo) -> bool:
    """Whether ``interface`` is the host's loopback, by kind or, failing that, by name."""
    return interface.kind == InterfaceKind.LOOPBACK or bool(_LOOPBACK_NAME.match(interface.name))


def name_looks_virtual(name: str) -> bool:
    """Whether ``name`` is one that container runtimes, hypervisors or tunnels give interfaces."""
    return name.startswith(_VIRTUAL_NAME_PREFIXES)


def is_avoided(interface: InterfaceInfo) -> bool:
    """Whether ``interface`` should only be chosen when nothing routable exists.

    Loopback, bridges, veths and other virtual interfaces are avoided: a rank that advertises its
    docker bridge or container veth is unreachable from other hosts. The kind reported from sysfs
    decides; PHYSICAL is trusted over the name (sysfs saw a device behind it). Only an
    UNSPECIFIED kind falls back to the name rules.
    """
    if is_loopback(interface):
        return True
    if interface.kind in _AVOIDED_KINDS:
        return True
    if interface.kind == InterfaceKind.PHYSICAL:
        return False
    return name_looks_virtual(interface.name)


def is_routable(interface: InterfaceInfo) -> bool:
    """Whether other hosts can reach ``interface``: not avoided, and with a routable address."""
    return not is_avoided(interface) and any(is_routable_address(a) for a in interface.addresses)


def interface_with_address(interfaces: Iterable[InterfaceInfo], address: str | None) -> InterfaceInfo | None:
    """The interface that carries ``address`` (any spelling :func:`parse_address` reads), or None.

    When several carry it (a misconfiguration, or a report built that way) the routable one wins,
    then :func:`_preference`, so the answer never depends on the order interfaces were reported.
    """
    wanted = parse_address(address) if address else None
    if wanted is None:
        return None
    carriers = [i for i in interfaces if any(parse_address(a) == wanted for a in i.addresses)]
    carriers.sort(key=lambda i: (not is_routable(i), _preference(i)))
    return carriers[0] if carriers else None


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key so that eth2 comes before eth10; (0, n) and (1, s) keep the parts comparable."""
    parts = re.split(r"(\d+)", name)
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def _preference(interface: InterfaceInfo) -> tuple[bool, tuple[tuple[int, int | str], ...], str]:
    """Order among candidates: the default-route interface first, then by name.

    The default route is where the host's own traffic to other networks goes, so it is the
    interface most likely to reach the other hosts; names break ties so the choice never depends
    on the order the worker listed its interfaces in.
    """
    return (not interface.default_route, _natural_key(interface.name), interface.name)


def _short_name(name: str, limit: int = 32) -> str:
    """A name cut for an error message, since names come from the network."""
    return name if len(name) <= limit else f"{name[: limit - 3]}..."


def unknown_interface_error(
    socket_name: str, names: Iterable[str], host: str = "", *, field: str = "socket_name"
) -> InvalidArgumentError:
    """The error for a ``socket_name`` the host does not have, naming the interfaces it does have.

    For example: ``socket_name 'eth9' is not an interface of host 'h1'; it has: docker0, eth0, lo``.
    """
    unique = sorted(set(names), key=_natural_key)
    shown = ", ".join(_short_name(n) for n in unique[:32])
    if len(unique) > 32:
        shown += f" and {len(unique) - 32} more"
    where = f"host {shorten(host)}" if host else "this host"
    return InvalidArgumentError(
        f"{field} {shorten(socket_name)} is not an interface of {where}; it has: {shown or 'none'}"
    )


def _by_name(interfaces: Sequence[InterfaceInfo], socket_name: str, host: str) -> InterfaceInfo:
    """Rule 1: the user named the interface; trust it, but fail loudly on a typo."""
    for interface in interfaces:
        if interface.name == socket_name:
            return interface
    raise unknown_interface_error(socket_name, (i.name for i in interfaces), host)


def _single_host_choice(interfaces: Sequence[InterfaceInfo]) -> InterfaceInfo | None:
    """Rule 2: the loopback interface (one with a usable address first), if the host has one."""
    loopbacks = sorted((i for i in interfaces if is_loopback(i)), key=_preference)
    for interface in loopbacks:
        if usable_addresses(interface):
            return interface
    return loopbacks[0] if loopbacks else None


def _fallback_choice(interfaces: Sequence[InterfaceInfo], peer: InterfaceInfo | None) -> InterfaceInfo:
    """Rule 5: nothing routable, so take the least bad interface; never fails.

    The member's own interface first, unless it is loopback: a member on the coordinator's host
    connects over loopback even when the other ranks are elsewhere (containers on its docker
    bridge, say), so loopback is only right when the whole job is on one host, which is
    ``single_host``'s call. Then a non-loopback interface with a usable address (a container's
    veth, a host whose only address is on a bridge), then loopback, then anything at all.
    """
    if peer is not None and not is_loopback(peer) and usable_addresses(peer):
        return peer
    ordered = sorted(interfaces, key=_preference)
    for interface in ordered:
        if not is_loopback(interface) and usable_addresses(interface):
            return interface
    for interface in ordered:
        if is_loopback(interface) and usable_addresses(interface):
            return interface
    return ordered[0]


def choose_interface(
    interfaces: Iterable[InterfaceInfo],
    peer_address: str | None,
    socket_name: str = "",
    *,
    single_host: bool = False,
    host: str = "",
) -> InterfaceInfo:
    """The interface a host's ranks should use, from what the host reported.

    Args:
        interfaces: the host's interfaces, as its worker reported them (order does not matter).
        peer_address: the address the coordinator saw the member connect from (IPv4, IPv6 or
            IPv4-mapped IPv6; see :func:`parse_peer`), or None when unknown (a unix socket).
        socket_name: the interface the user forced (``--socket-name`` / ``SAR_SOCKET_NAME``);
            empty lets this function choose.
        single_host: True when every member of the world connected over loopback, i.e. the whole
            job runs on the coordinator's host. Then loopback is the right answer: nothing leaves
            the machine, and it keeps working when the host's network changes or the only other
            interface is a docker bridge. ``socket_name`` still wins over it.
        host: the host's name, used in error messages only.

    The rules and their reasons are in the module docstring. Without ``socket_name`` this never
    raises for a non-empty list and always returns one of ``interfaces``; whether the result has
    an address to advertise is :func:`address_on`'s question.

    Raises:
        InvalidArgumentError: ``socket_name`` is not among ``interfaces`` (the message names the
            field, the value and the interfaces the host has), or ``interfaces`` is empty.
    """
    candidates = list(interfaces)
    if socket_name:
        return _by_name(candidates, socket_name, host)
    if not candidates:
        where = f"host {shorten(host)}" if host else "the host"
        raise InvalidArgumentError(
            f"interfaces is empty: {where} reported no network interface; a member must report "
            f"at least one so the coordinator can choose the one its ranks use."
        )
    if single_host:
        loopback = _single_host_choice(candidates)
        # A loopback without a usable address would be handed out with nothing to dial: then the
        # host is treated like any other (its routable interface, or the fallback).
        if loopback is not None and usable_addresses(loopback):
            return loopback
    peer = interface_with_address(candidates, peer_address)
    if peer is not None and is_routable(peer):
        return peer
    routable = sorted((i for i in candidates if is_routable(i)), key=_preference)
    if routable:
        return routable[0]
    return _fallback_choice(candidates, peer)
