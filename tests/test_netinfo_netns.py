"""Tests of the worker's interface report (``sarcomm.common.netinfo``).

The ``netns`` tests build a host inside a network namespace (veths named eth0/eth1 as a container
has them, a bridge, a dummy or tap device, a bridge that is down) and run ``local_interfaces()``
inside it through ``ip netns exec``, which also mounts that namespace's sysfs. They need root and
``ip``, and skip cleanly otherwise. Every address used lives inside namespaces these tests create.

The other tests need nothing: sysfs and procfs are faked under ``tmp_path``, and the port tests
use loopback.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from sarcomm.common import netinfo
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from tests.conftest import netns_unavailable

K = InterfaceKind
_TIMEOUT_S = 30
_counter = itertools.count()


# --- helpers ----------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` with a timeout; a failure shows ip's own message."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    """Two fresh namespaces, a host under test and its neighbour, deleted afterwards.

    Names carry the pid and a counter so parallel runs and reruns after a crash do not collide.
    """
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    serial = next(_counter)
    host, neighbour = f"sarcomm-h{os.getpid()}-{serial}", f"sarcomm-n{os.getpid()}-{serial}"
    created: list[str] = []
    try:
        for name in (host, neighbour):
            result = _ip("netns", "add", name, check=False)
            if result.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {result.stderr.strip()}")
            created.append(name)
        yield host, neighbour
    finally:
        # Deleting a namespace destroys its veth ends, and with them the peers in the other one.
        for name in created:
            _ip("netns", "del", name, check=False)


def _natural(name: str) -> list[tuple[int, int | str]]:
    """Number-aware name order (eth2 before eth10), as the error message lists interfaces."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name)]


def _run_in(namespace: str, script: str) -> object:
    """Run a Python script in ``namespace`` and return the JSON it prints."""
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


_REPORT_SCRIPT = """
    import json
    from sarcomm.common.errors import InvalidArgumentError
    from sarcomm.common.interfaces import address_on, choose_interface
    from sarcomm.common.netinfo import check_socket_name, local_interfaces

    interfaces = local_interfaces()

    def error_of(name):
        try:
            check_socket_name(name, host="h1")
        except InvalidArgumentError as error:
            return str(error)
        return None

    chosen = {
        peer: choose_interface(interfaces, peer).name
        for peer in ("10.77.0.2", "fd78::2", "10.77.1.1", "127.0.0.1", "192.0.2.99")
    }
    print(json.dumps({
        "interfaces": [
            {"name": i.name, "addresses": list(i.addresses), "kind": i.kind.name,
             "default_route": i.default_route}
            for i in interfaces
        ],
        "chosen": chosen,
        "address": address_on(choose_interface(interfaces, "10.77.0.2")),
        "errors": {name: error_of(name) for name in ("eth0", "eth9", "brdown")},
    }))
"""


def _build_host(host: str, neighbour: str) -> str:
    """Lay out the host under test; returns the name of its dummy (or tap) device.

    eth0: veth, 10.77.0.2/24 + fd77::2/64, IPv4 default route via the neighbour.
    eth1: veth, fd78::2/64 only, IPv6 default route via the neighbour.
    br0: bridge, 10.77.1.1/24, up.  brdown: bridge with 10.77.3.1/24, down.
    dummy0 (or tap0 where the kernel has no dummy driver): 10.77.2.1/24, up.
    """
    _ip("-n", host, "link", "set", "lo", "up")
    _ip("-n", neighbour, "link", "set", "lo", "up")
    for index, (mine, theirs) in enumerate((("eth0", "peer0"), ("eth1", "peer1"))):
        _ip("link", "add", mine, "netns", host, "type", "veth", "peer", "name", theirs, "netns", neighbour)
        _ip("-n", neighbour, "link", "set", theirs, "up")
        _ip("-n", neighbour, "addr", "add", f"fd7{7 + index}::1/64", "dev", theirs, "nodad")
    _ip("-n", neighbour, "addr", "add", "10.77.0.1/24", "dev", "peer0")
    _ip("-n", host, "addr", "add", "10.77.0.2/24", "dev", "eth0")
    _ip("-n", host, "addr", "add", "fd77::2/64", "dev", "eth0", "nodad")
    _ip("-n", host, "addr", "add", "fd78::2/64", "dev", "eth1", "nodad")
    _ip("-n", host, "link", "set", "eth0", "up")
    _ip("-n", host, "link", "set", "eth1", "up")
    _ip("-n", host, "route", "add", "default", "via", "10.77.0.1", "dev", "eth0")
    _ip("-n", host, "-6", "route", "add", "default", "via", "fd78::1", "dev", "eth1")

    _ip("-n", host, "link", "add", "br0", "type", "bridge")
    _ip("-n", host, "addr", "add", "10.77.1.1/24", "dev", "br0")
    _ip("-n", host, "link", "set", "br0", "up")
    _ip("-n", host, "link", "add", "brdown", "type", "bridge")
    _ip("-n", host, "addr", "add", "10.77.3.1/24", "dev", "brdown")

    virtual = "dummy0"
    if _ip("-n", host, "link", "add", virtual, "type", "dummy", check=False).returncode != 0:
        virtual = "tap0"  # kernels built without the dummy driver still have tun/tap
        _ip("-n", host, "tuntap", "add", virtual, "mode", "tap")
    _ip("-n", host, "addr", "add", "10.77.2.1/24", "dev", virtual)
    _ip("-n", host, "link", "set", virtual, "up")
    return virtual


# --- netns ------------------------------------------------------------------------------------


@pytest.mark.netns
def test_local_interfaces_reports_kinds_addresses_and_default_routes_in_netns(
    namespaces: tuple[str, str],
) -> None:
    host, neighbour = namespaces
    virtual = _build_host(host, neighbour)

    report = _run_in(host, _REPORT_SCRIPT)
    assert isinstance(report, dict)
    by_name = {i["name"]: i for i in report["interfaces"]}
    assert {"lo", "eth0", "eth1", "br0", "brdown", virtual} <= set(by_name)

    assert by_name["lo"]["kind"] == "LOOPBACK"
    assert "127.0.0.1" in by_name["lo"]["addresses"]
    assert not by_name["lo"]["default_route"]

    # Veths named like a container's: the kind comes from sysfs, not the name. Both ends of each
    # pair sit at the same ifindex in their fresh namespaces, so this also covers the speed rule.
    assert by_name["eth0"]["kind"] == "VETH"
    assert {"10.77.0.2", "fd77::2"} <= set(by_name["eth0"]["addresses"])
    assert by_name["eth0"]["default_route"]  # IPv4 default
    assert by_name["eth1"]["kind"] == "VETH"
    assert "fd78::2" in by_name["eth1"]["addresses"]
    assert by_name["eth1"]["default_route"]  # IPv6 default only
    assert all("%" not in a for i in by_name.values() for a in i["addresses"])

    # An interface that is up also has its IPv6 link-local address; the coordinator skips those.
    assert (by_name["br0"]["kind"], by_name["br0"]["addresses"][:1]) == ("BRIDGE", ["10.77.1.1"])
    assert not by_name["br0"]["default_route"]
    assert (by_name["brdown"]["kind"], by_name["brdown"]["addresses"]) == ("BRIDGE", [])
    assert by_name[virtual]["kind"] == "VIRTUAL"
    assert by_name[virtual]["addresses"][:1] == ["10.77.2.1"]
    assert not by_name[virtual]["default_route"]

    # Nothing here is routable in the contract's sense, so the member's own interface wins, and
    # without one the default-route veths come first (eth0 before eth1 by name).
    assert report["chosen"] == {
        "10.77.0.2": "eth0",
        "fd78::2": "eth1",
        "10.77.1.1": "br0",
        "127.0.0.1": "eth0",
        "192.0.2.99": "eth0",
    }
    assert report["address"] == "10.77.0.2"

    assert report["errors"]["eth0"] is None
    listed = ", ".join(sorted(by_name, key=_natural))
    expected = f"socket_name 'eth9' is not an interface of host 'h1'; it has: {listed}"
    assert report["errors"]["eth9"] == expected
    assert re.match(
        r"^socket_name 'brdown' is an interface of host 'h1' without an address other hosts could "
        r"dial \(it is down or has only link-local IPv6\); interfaces with an address: .*eth0.*$",
        report["errors"]["brdown"],
    )


@pytest.mark.netns
def test_local_interfaces_reports_only_loopback_in_fresh_netns(namespaces: tuple[str, str]) -> None:
    host, _ = namespaces
    report = _run_in(
        host,
        """
        import json
        from sarcomm.common.netinfo import local_interfaces
        report = [[i.name, list(i.addresses), i.kind.name, i.default_route] for i in local_interfaces()]
        print(json.dumps(report))
        """,
    )
    assert isinstance(report, list)
    # lo is down in a fresh namespace, so it offers no address; no default route anywhere.
    assert ["lo", [], "LOOPBACK", False] in report
    assert all(not default for *_, default in report)


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
