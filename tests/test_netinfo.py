"""The worker's interface report and ports (``sarcomm.common.netinfo``), in one process: the sysfs
rules on a fake tree and the routes on a fake procfs under ``tmp_path``, this host's loopback, the
socket name check, and the port reservations on loopback. On hosts built in network namespaces:
tests/test_netinfo_netns.py.
"""

from __future__ import annotations

import itertools
import socket
import sys
from pathlib import Path

import pytest

from sarcomm.common import netinfo
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind

K = InterfaceKind
_TIMEOUT_S = 30
_counter = itertools.count()


# --- sysfs rules on a fake tree ---------------------------------------------------------------


def _fake_interface(root: Path, name: str, **files: str) -> Path:
    """A fake /sys/class/net/<name> with the given attribute files; ``device``/``bridge`` as dirs."""
    base = root / name
    base.mkdir(parents=True)
    defaults = {"type": "1", "ifindex": "7", "iflink": "7", "uevent": f"INTERFACE={name}\nIFINDEX=7\n"}
    for key, value in {**defaults, **files}.items():
        if key in ("device", "bridge"):
            (base / key).mkdir()
        else:
            (base / key).write_text(value + "\n")
    return base


def test_interface_kind_reads_loopback_bridge_physical_from_sysfs(tmp_path: Path) -> None:
    _fake_interface(tmp_path, "lo", type="772", ifindex="1", iflink="1")
    _fake_interface(tmp_path, "lo-renamed", type="772")
    _fake_interface(tmp_path, "br0", bridge="", uevent="DEVTYPE=bridge\nINTERFACE=br0")
    _fake_interface(tmp_path, "enp3s0", device="")
    _fake_interface(tmp_path, "ib0", type="32", device="")
    assert netinfo.interface_kind("lo", tmp_path) is K.LOOPBACK
    assert netinfo.interface_kind("lo-renamed", tmp_path) is K.LOOPBACK
    assert netinfo.interface_kind("br0", tmp_path) is K.BRIDGE
    assert netinfo.interface_kind("enp3s0", tmp_path) is K.PHYSICAL
    assert netinfo.interface_kind("ib0", tmp_path) is K.PHYSICAL
    assert netinfo.interface_kind("missing0", tmp_path) is K.UNSPECIFIED


def test_interface_kind_tells_veth_from_dummy(tmp_path: Path) -> None:
    _fake_interface(tmp_path, "eth0", ifindex="2", iflink="9")  # peer in the host namespace
    _fake_interface(tmp_path, "veth-same-index", ifindex="2", iflink="2", speed="10000")
    _fake_interface(tmp_path, "dummy0", ifindex="3", iflink="3")  # reading speed fails for dummy
    _fake_interface(tmp_path, "wg0", type="65534", ifindex="4", iflink="4", uevent="DEVTYPE=wireguard")
    _fake_interface(tmp_path, "vxlan0", ifindex="5", iflink="5", uevent="DEVTYPE=vxlan", speed="-1")
    _fake_interface(tmp_path, "tap0", ifindex="6", iflink="6", speed="10000", tun_flags="0x1002")
    assert netinfo.interface_kind("eth0", tmp_path) is K.VETH
    assert netinfo.interface_kind("veth-same-index", tmp_path) is K.VETH
    assert netinfo.interface_kind("dummy0", tmp_path) is K.VIRTUAL
    assert netinfo.interface_kind("wg0", tmp_path) is K.VIRTUAL
    assert netinfo.interface_kind("vxlan0", tmp_path) is K.VIRTUAL
    assert netinfo.interface_kind("tap0", tmp_path) is K.VIRTUAL


def test_interface_kind_gives_stacked_interfaces_the_kind_below(tmp_path: Path) -> None:
    _fake_interface(tmp_path, "eno1", device="")
    _fake_interface(tmp_path, "eno2", device="")
    _fake_interface(tmp_path, "bond0", uevent="DEVTYPE=bond")
    _fake_interface(tmp_path, "bond0.100", uevent="DEVTYPE=vlan", iflink="8")
    _fake_interface(tmp_path, "dummy0")
    _fake_interface(tmp_path, "macvlan0", iflink="3")
    for upper, lower in (
        ("bond0", "eno1"),
        ("bond0", "eno2"),
        ("bond0.100", "bond0"),
        ("macvlan0", "dummy0"),
    ):
        (tmp_path / upper / f"lower_{lower}").symlink_to(tmp_path / lower)
    assert netinfo.interface_kind("bond0", tmp_path) is K.PHYSICAL
    assert netinfo.interface_kind("bond0.100", tmp_path) is K.PHYSICAL
    assert netinfo.interface_kind("macvlan0", tmp_path) is K.VIRTUAL


def test_interface_kind_stops_on_a_lower_link_loop(tmp_path: Path) -> None:
    _fake_interface(tmp_path, "a0")
    _fake_interface(tmp_path, "b0")
    (tmp_path / "a0" / "lower_b0").symlink_to(tmp_path / "b0")
    (tmp_path / "b0" / "lower_a0").symlink_to(tmp_path / "a0")
    assert netinfo.interface_kind("a0", tmp_path) is K.VIRTUAL


# --- routes on fake procfs --------------------------------------------------------------------

_ROUTE = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
"""
_IPV6_ROUTE = """\
fd000000000000000000000000000000 40 00000000000000000000000000000000 00 \
00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 \
fd000000000000000000000000000001 00000400 00000002 00000000 00000003     eth1
00000000000000000000000000000000 00 00000000000000000000000000000000 00 \
00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
"""


def test_default_route_interfaces_reads_ipv4_and_ipv6_tables(tmp_path: Path) -> None:
    (tmp_path / "route").write_text(_ROUTE)
    (tmp_path / "ipv6_route").write_text(_IPV6_ROUTE)
    # lo's unreachable ::/0 route is in every namespace and is not a way out.
    assert netinfo.default_route_interfaces(tmp_path) == {"eth0", "eth1"}


def test_default_route_interfaces_is_empty_if_files_missing(tmp_path: Path) -> None:
    assert netinfo.default_route_interfaces(tmp_path) == set()
    (tmp_path / "route").write_text("Iface\tDestination\ngarbage line\n")
    assert netinfo.default_route_interfaces(tmp_path) == set()


# --- this host --------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux sysfs")
def test_local_interfaces_reports_loopback_on_this_host() -> None:
    interfaces = netinfo.local_interfaces()
    lo = next(i for i in interfaces if i.name == "lo")
    assert lo.kind is K.LOOPBACK
    assert "127.0.0.1" in lo.addresses
    assert all("%" not in a for i in interfaces for a in i.addresses)
    assert len({i.name for i in interfaces}) == len(interfaces)


def test_host_name_is_gethostname() -> None:
    assert netinfo.host_name() == socket.gethostname()


_HOST = [
    InterfaceInfo("lo", ("127.0.0.1",), K.LOOPBACK),
    InterfaceInfo("eth0", ("10.0.0.5",), K.PHYSICAL, default_route=True),
    InterfaceInfo("docker0", ("172.17.0.1",), K.BRIDGE),
    InterfaceInfo("eth1", ("fe80::1",), K.PHYSICAL),
]


def test_check_socket_name_accepts_interface_with_address() -> None:
    netinfo.check_socket_name("eth0", _HOST, host="h1")
    netinfo.check_socket_name("docker0", _HOST, host="h1")


def test_check_socket_name_raises_naming_interfaces_if_missing() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^socket_name 'eth9' is not an interface of host 'h1'; it has: docker0, eth0, eth1, lo$",
    ):
        netinfo.check_socket_name("eth9", _HOST, host="h1")


def test_check_socket_name_raises_if_interface_has_no_usable_address() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^socket_name 'eth1' is an interface of host 'h1' without an address other hosts "
        r"could dial \(it is down or has only link-local IPv6\); interfaces with an address: "
        r"docker0, eth0, lo$",
    ):
        netinfo.check_socket_name("eth1", _HOST, host="h1")


# --- ports ------------------------------------------------------------------------------------


def test_reserve_port_holds_port_until_closed() -> None:
    with netinfo.reserve_port("127.0.0.1") as held:
        port = held.getsockname()[1]
        assert 0 < port < 65536
        # A process that does not opt in to sharing cannot take the port...
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))
        # ...but the store, which sets SO_REUSEADDR as torch's does, can bind and listen on it.
        with socket.socket() as store:
            store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            store.bind(("127.0.0.1", port))
            store.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass


def test_reserve_port_defaults_to_every_ipv4_address() -> None:
    with netinfo.reserve_port() as held:
        assert held.family == socket.AF_INET
        assert held.getsockname()[0] == "0.0.0.0"


def test_reserve_port_binds_ipv6_literal() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        held = netinfo.reserve_port("::1")
    except OSError as error:
        pytest.skip(f"no IPv6 loopback here: {error}")
    with held:
        assert held.family == socket.AF_INET6
        assert held.getsockname()[0] == "::1"


def test_reserve_port_lets_torch_store_listen_on_it() -> None:
    dist = pytest.importorskip("torch.distributed")
    import datetime

    with netinfo.reserve_port() as held:
        port = held.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("key", "value")
        assert store.get("key") == b"value"
        assert store.port == port


def test_free_port_returns_a_bindable_port() -> None:
    port = netinfo.free_port("127.0.0.1")
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
