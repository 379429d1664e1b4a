"""What this host's network looks like, for the Join request: interfaces, kinds, default route.

Names and addresses come from ``ifaddr`` (getifaddrs); what an interface *is* comes from sysfs
(``/sys/class/net/<name>``) and the default route from ``/proc/net/route`` and
``/proc/net/ipv6_route``. Both are per network namespace, so a worker in a container or under
``ip netns exec`` sees its own namespace. No subprocesses: ``ip`` or ``ethtool`` may be missing in
a slim container, and the files say everything needed.

The coordinator makes the choice (``sarcomm.common.interfaces.choose_interface``); this
module only reports, plus the two things an agent needs before it joins: checking a forced
``--socket-name`` early and holding a port for the torch.distributed store.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from pathlib import Path

import ifaddr

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.interfaces import (
    InterfaceInfo,
    InterfaceKind,
    unknown_interface_error,
    usable_addresses,
)

__all__ = [
    "check_socket_name",
    "default_route_interfaces",
    "free_port",
    "host_name",
    "interface_kind",
    "local_interfaces",
    "reserve_port",
]

log = logging.getLogger(__name__)

SYS_CLASS_NET = Path("/sys/class/net")
PROC_NET = Path("/proc/net")

# Linux ARPHRD_* link types and route flags (include/uapi/linux/if_arp.h, route.h).
_ARPHRD_ETHER = 1
_ARPHRD_LOOPBACK = 772
_IFF_UP = 0x1
_RTF_UP = 0x0001
_RTF_REJECT = 0x0200

# What the veth driver reports as its link speed (drivers/net/veth.c, veth_get_link_ksettings).
_VETH_SPEED_MBPS = 10000

# How deep to follow lower_* links (vlan on bond on NIC is 2); a bound so a loop cannot hang us.
_MAX_STACK_DEPTH = 8


def host_name() -> str:
    """This host's name as the coordinator shows it (``socket.gethostname()``)."""
    return socket.gethostname()


# --- sysfs ------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    """The stripped text of a sysfs/procfs file, or None when it is missing or unreadable."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    """A sysfs number (decimal or 0x hex), or None when missing or not a number."""
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _devtype(base: Path) -> str:
    """The ``DEVTYPE`` of an interface's uevent ("bridge", "vlan", "bond", ...), or ""."""
    for line in (_read(base / "uevent") or "").splitlines():
        key, _, value = line.partition("=")
        if key == "DEVTYPE":
            return value
    return ""


def _lower_names(base: Path) -> list[str]:
    """The interfaces this one is stacked on (a vlan's NIC, a bond's slaves, a macvlan's parent)."""
    try:
        return sorted(
            entry.name[len("lower_") :] for entry in base.iterdir() if entry.name.startswith("lower_")
        )
    except OSError:
        return []


def interface_kind(name: str, sys_class_net: Path = SYS_CLASS_NET, *, _depth: int = 0) -> InterfaceKind:
    """What sysfs says interface ``name`` is; UNSPECIFIED when sysfs does not know it.

    The rules, first match wins, each from what the kernel exposes:

    - LOOPBACK: link type 772 (ARPHRD_LOOPBACK), or the name ``lo``.
    - BRIDGE: a ``bridge/`` directory, which only bridges have.
    - PHYSICAL: a ``device`` link, i.e. a bus device (PCI, virtio, USB, InfiniBand) behind it.
    - VIRTUAL for tun/tap (``tun_flags``): VPNs and VM taps do not reach other hosts directly.
    - Stacked interfaces (``lower_*`` links: vlan, bond, team, macvlan) take the kind of what they
      sit on: ``bond0`` or ``eth0.100`` over a NIC is as routable as the NIC (PHYSICAL), over
      anything else VIRTUAL.
    - VETH: an Ethernet-type link with none of the above whose ``iflink`` (the peer's index)
      differs from its own ``ifindex`` or whose speed is the veth driver's constant (see
      :func:`_looks_like_veth`). Caveat: a macvlan whose parent lives in another namespace looks
      the same, which is harmless, since both are what a container is given.
    - VIRTUAL: everything else (dummy, vxlan, wireguard, gre, ifb, ...).

    Blocks briefly on sysfs reads; never raises.
    """
    base = sys_class_net / name
    if not base.exists():
        # Not Linux, sysfs not mounted, or the interface went away: let the coordinator go by name.
        return InterfaceKind.UNSPECIFIED
    link_type = _read_int(base / "type")
    if link_type == _ARPHRD_LOOPBACK or name == "lo":
        return InterfaceKind.LOOPBACK
    if (base / "bridge").is_dir() or _devtype(base) == "bridge":
        return InterfaceKind.BRIDGE
    if (base / "device").exists():
        return InterfaceKind.PHYSICAL
    if (base / "tun_flags").exists():
        return InterfaceKind.VIRTUAL
    lowers = _lower_names(base)
    if lowers:
        if _depth < _MAX_STACK_DEPTH and any(
            interface_kind(lower, sys_class_net, _depth=_depth + 1) == InterfaceKind.PHYSICAL
            for lower in lowers
        ):
            return InterfaceKind.PHYSICAL
        return InterfaceKind.VIRTUAL
    if link_type == _ARPHRD_ETHER and not _devtype(base) and _looks_like_veth(base):
        return InterfaceKind.VETH
    return InterfaceKind.VIRTUAL


def _looks_like_veth(base: Path) -> bool:
    """Whether a device-less Ethernet link with no DEVTYPE and nothing below it is a veth.

    ``iflink`` is the peer's ifindex, but ifindexes are per namespace, so a pair made between two
    fresh namespaces often has both ends at index 2 and ``iflink == ifindex``. The veth driver
    also reports a constant 10000 Mb/s ``speed`` while up, which dummy and ifb devices do not
    report at all, so either sign is taken.
    """
    ifindex = _read_int(base / "ifindex")
    iflink = _read_int(base / "iflink")
    if ifindex is not None and iflink is not None and iflink not in (0, ifindex):
        return True
    return _read_int(base / "speed") == _VETH_SPEED_MBPS


def _is_up(name: str, sys_class_net: Path) -> bool:
    """Whether the interface is administratively up; True when sysfs cannot tell.

    An interface that is down carries no traffic, so its addresses are not worth offering.
    """
    flags = _read_int(sys_class_net / name / "flags")
    return flags is None or bool(flags & _IFF_UP)


# --- routes -----------------------------------------------------------------------------------


def _ipv4_default_routes(text: str) -> set[str]:
    """Interfaces of IPv4 default routes in ``/proc/net/route`` text (hex, host byte order)."""
    names: set[str] = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        try:
            destination, flags, mask = int(fields[1], 16), int(fields[3], 16), int(fields[7], 16)
        except ValueError:
            continue
        if destination == 0 and mask == 0 and flags & _RTF_UP and not flags & _RTF_REJECT:
            names.add(fields[0])
    return names


def _ipv6_default_routes(text: str) -> set[str]:
    """Interfaces of IPv6 default routes in ``/proc/net/ipv6_route`` text.

    Columns: destination, prefix length, source, source prefix, next hop, metric, refcount, use,
    flags, device. Linux keeps an unreachable ``::/0`` route on ``lo`` (flags RTF_REJECT) in every
    namespace; it is not a way out, so rejecting routes are skipped.
    """
    names: set[str] = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            destination, prefix, flags = int(fields[0], 16), int(fields[1], 16), int(fields[8], 16)
        except ValueError:
            continue
        if destination == 0 and prefix == 0 and flags & _RTF_UP and not flags & _RTF_REJECT:
            names.add(fields[9])
    return names


def default_route_interfaces(proc_net: Path = PROC_NET) -> set[str]:
    """Names of the interfaces this namespace's default routes (IPv4 or IPv6) leave through.

    Reads the main routing table only (what ``/proc/net`` shows); policy routing is not followed.
    Missing files (IPv6 disabled, no procfs) give no names rather than an error.
    """
    return _ipv4_default_routes(_read(proc_net / "route") or "") | _ipv6_default_routes(
        _read(proc_net / "ipv6_route") or ""
    )


# --- interfaces -------------------------------------------------------------------------------


def _address_text(ip: object) -> str | None:
    """One ifaddr address as text: IPv6 comes as (address, flowinfo, scope_id), zone dropped."""
    raw = ip[0] if isinstance(ip, tuple) else ip
    if not isinstance(raw, str):
        return None
    text = raw.split("%", 1)[0]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _ifaddr_addresses() -> dict[str, list[str]]:
    """Addresses per interface name from getifaddrs, in the kernel's order, without duplicates."""
    found: dict[str, list[str]] = {}
    for adapter in ifaddr.get_adapters():
        name = str(adapter.name)
        addresses = found.setdefault(name, [])
        for ip in adapter.ips:
            text = _address_text(ip.ip)
            if text is not None and text not in addresses:
                addresses.append(text)
    return found


def _all_names() -> list[str]:
    """Every interface name of this namespace, in index order, with or without addresses.

    getifaddrs only lists interfaces that have an address; ``if_nameindex`` lists them all, so
    that ``--socket-name eth1`` on an interface without an address gets "has no address" rather
    than "does not exist".
    """
    try:
        return [name for _index, name in sorted(socket.if_nameindex())]
    except OSError:
        return []


def local_interfaces(
    *, sys_class_net: Path = SYS_CLASS_NET, proc_net: Path = PROC_NET
) -> list[InterfaceInfo]:
    """This host's (this network namespace's) interfaces, as the Join request reports them.

    Every interface is listed, in index order (``lo`` first on Linux). ``addresses`` holds IPv4
    and IPv6 addresses without prefix length or zone; an interface that is administratively down
    reports none. ``kind`` comes from :func:`interface_kind`, ``default_route`` from
    :func:`default_route_interfaces`. The path arguments exist for tests.

    Blocks briefly (getifaddrs, sysfs and procfs reads); raises ``OSError`` only when
    getifaddrs itself fails.
    """
    by_name = _ifaddr_addresses()
    names = _all_names()
    names += [name for name in by_name if name not in names]
    defaults = default_route_interfaces(proc_net)
    interfaces: list[InterfaceInfo] = []
    for name in names:
        up = _is_up(name, sys_class_net)
        interfaces.append(
            InterfaceInfo(
                name=name,
                addresses=tuple(by_name.get(name, ())) if up else (),
                kind=interface_kind(name, sys_class_net),
                default_route=up and name in defaults,
            )
        )
    return interfaces


def check_socket_name(name: str, interfaces: Iterable[InterfaceInfo] | None = None, host: str = "") -> None:
    """Fail early when ``--socket-name`` / ``SAR_SOCKET_NAME`` cannot work on this host.

    ``interfaces`` defaults to :func:`local_interfaces`, ``host`` to :func:`host_name`. The agent
    calls this before joining, so a typo is reported on the host that made it, with the names
    that would work, instead of as a backend hang later.

    Raises:
        InvalidArgumentError: this host has no interface ``name`` (the message lists the ones it
            has), or it has one without an address other hosts could dial (down, or link-local
            IPv6 only; the message lists the interfaces that have one).
    """
    known = list(local_interfaces() if interfaces is None else interfaces)
    where = host or host_name()
    for interface in known:
        if interface.name == name:
            if usable_addresses(interface):
                return
            with_address = sorted(i.name for i in known if usable_addresses(i))
            raise InvalidArgumentError(
                f"socket_name {shorten(name)} is an interface of host {shorten(where)} without an "
                f"address other hosts could dial (it is down or has only link-local IPv6); "
                f"interfaces with an address: {', '.join(with_address) or 'none'}"
            )
    raise unknown_interface_error(name, (i.name for i in known), where)


# --- ports ------------------------------------------------------------------------------------


def _family_for(host: str) -> tuple[socket.AddressFamily, str]:
    """The socket family and bind address for ``host`` ("" = every IPv4 address)."""
    if not host:
        return socket.AF_INET, "0.0.0.0"
    try:
        literal = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _type, _proto, _name, sockaddr = infos[0]
        return family, str(sockaddr[0])
    return (socket.AF_INET6 if literal.version == 6 else socket.AF_INET), host.strip("[]")


def reserve_port(host: str = "") -> socket.socket:
    """A TCP socket bound to a free port on ``host`` and not listening, to hold that port.

    The agent holds it from before Join (it reports the port as ``store_port``) until rank 0's
    TCPStore starts, so no other process takes the port meanwhile. ``SO_REUSEADDR`` is set and
    the socket never listens, which is what lets the store (torch sets ``SO_REUSEADDR`` too) bind
    and listen on the same port while this one is still open; close it once the store is up.
    ``host`` "" binds every IPv4 address; an IPv6 literal or a name picks that family.

    Raises:
        OSError: nothing could be bound (no free port, or ``host`` is not local).
    """
    family, address = _family_for(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 0))
    except BaseException:
        sock.close()
        raise
    log.debug("reserved port %s on %r", sock.getsockname()[1], address)
    return sock


def free_port(host: str = "") -> int:
    """A port that was free on ``host`` a moment ago (bound, read, released).

    Racy by nature: another process may take the port before the caller binds it. Prefer
    :func:`reserve_port` and hold the socket when the port matters.
    """
    with reserve_port(host) as sock:
        return int(sock.getsockname()[1])


def _debug_summary() -> str:
    """One line per interface, for ``python -m sarcomm.common.netinfo`` when debugging a host."""
    return os.linesep.join(
        f"{i.name}\t{i.kind.name}\t{'default' if i.default_route else '-'}\t{' '.join(i.addresses)}"
        for i in local_interfaces()
    )


if __name__ == "__main__":
    print(_debug_summary())
