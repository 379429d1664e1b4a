"""Unit tests of the coordinator's interface choice (``sarcomm.common.interfaces``).

The hosts are made up: a "workstation" with loopback, a docker bridge, a container veth, a docker
user network bridge and two NICs (eth0 with the default route, eth1 on a second network), and the
small hosts a container or a netns host looks like.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sarcomm.common.addresses import parse_address
from sarcomm.common.errors import InvalidArgumentError
from sarcomm.common.interfaces import (
    InterfaceInfo,
    InterfaceKind,
    address_on,
    choose_interface,
    interface_with_address,
    is_avoided,
    is_routable,
    is_routable_address,
    parse_peer,
    usable_addresses,
)

K = InterfaceKind

LO = InterfaceInfo("lo", ("127.0.0.1", "::1"), K.LOOPBACK)
DOCKER0 = InterfaceInfo("docker0", ("172.17.0.1", "fe80::42:acff:fe11:1"), K.BRIDGE)
VETH = InterfaceInfo("veth1234", ("fe80::a0b:cff:fe0d:e0f",), K.VETH)
BR_ABC = InterfaceInfo("br-abc", ("172.18.0.1",), K.BRIDGE)
ETH0 = InterfaceInfo("eth0", ("10.0.0.5", "fd00::5", "fe80::5"), K.PHYSICAL, default_route=True)
ETH1 = InterfaceInfo("eth1", ("192.168.100.5", "fd01::5", "fe80::6"), K.PHYSICAL)
WORKSTATION = (LO, DOCKER0, VETH, BR_ABC, ETH0, ETH1)


def names(interfaces: list[InterfaceInfo] | tuple[InterfaceInfo, ...]) -> list[str]:
    return [i.name for i in interfaces]


# --- choose_interface: socket_name ------------------------------------------------------------


@pytest.mark.parametrize("name", ["lo", "docker0", "veth1234", "br-abc", "eth0", "eth1"])
def test_choose_interface_returns_socket_name_if_given(name: str) -> None:
    # The user's explicit choice wins, even for an interface the rules would avoid.
    chosen = choose_interface(WORKSTATION, "10.0.0.5", name)
    assert chosen.name == name


def test_choose_interface_returns_socket_name_over_single_host() -> None:
    assert choose_interface(WORKSTATION, "127.0.0.1", "eth1", single_host=True) is ETH1


def test_choose_interface_raises_naming_interfaces_if_socket_name_missing() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^socket_name 'eth9' is not an interface of host 'h1'; "
        r"it has: br-abc, docker0, eth0, eth1, lo, veth1234$",
    ):
        choose_interface(WORKSTATION, "10.0.0.5", "eth9", host="h1")


def test_choose_interface_raises_naming_this_host_if_socket_name_missing_and_no_host() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^socket_name 'eth9' is not an interface of this host; it has: eth0, lo$",
    ):
        choose_interface([ETH0, LO], None, "eth9")


def test_choose_interface_raises_saying_none_if_socket_name_given_and_no_interfaces() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^socket_name 'eth0' is not an interface of host 'h1'; it has: none$",
    ):
        choose_interface([], None, "eth0", host="h1")


def test_choose_interface_error_is_bounded_if_socket_name_is_huge() -> None:
    # Names come from the network: a hostile value must not flood the message.
    with pytest.raises(InvalidArgumentError) as caught:
        choose_interface(WORKSTATION, None, "x" * 10_000, host="h" * 10_000)
    assert len(str(caught.value)) < 400


# --- choose_interface: the peer's interface ---------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("10.0.0.5", "eth0"),
        ("192.168.100.5", "eth1"),  # the member's own path wins over the default route
        ("fd00::5", "eth0"),
        ("fd01::5", "eth1"),
        ("FD01:0:0::5", "eth1"),  # any spelling of the address
        ("::ffff:192.168.100.5", "eth1"),  # IPv4-mapped, as a dual-stack listener sees IPv4
        ("::ffff:10.0.0.5", "eth0"),
        ("fe80::6", "eth1"),  # link-local peer: its interface is still a routable one
        ("fe80::6%eth1", "eth1"),  # zone dropped
    ],
)
def test_choose_interface_returns_peer_interface_if_routable(peer: str, expected: str) -> None:
    assert choose_interface(WORKSTATION, peer).name == expected


@pytest.mark.parametrize(
    "peer",
    [
        "172.17.0.1",  # docker0: the coordinator runs in a container on this host
        "::ffff:172.17.0.1",
        "172.18.0.1",  # br-abc
        "fe80::a0b:cff:fe0d:e0f",  # veth1234
        "127.0.0.1",  # loopback: the coordinator is on this host, the other ranks may not be
        "::1",
        "::ffff:127.0.0.1",
        "203.0.113.9",  # not on any interface: NAT between member and coordinator
        "2001:db8::9",
        "not an address",
        None,  # unix socket
    ],
)
def test_choose_interface_returns_default_route_nic_if_peer_interface_not_routable(peer: str | None) -> None:
    assert choose_interface(WORKSTATION, peer) is ETH0


def test_choose_interface_returns_nic_by_name_if_no_default_route() -> None:
    eth10 = InterfaceInfo("eth10", ("10.0.10.5",), K.PHYSICAL)
    eth2 = InterfaceInfo("eth2", ("10.0.2.5",), K.PHYSICAL)
    # eth2 before eth10: names compare number-aware, and never by the order reported.
    assert choose_interface([LO, DOCKER0, eth10, eth2], "172.17.0.1") is eth2
    assert choose_interface([eth2, eth10, DOCKER0, LO], "172.17.0.1") is eth2


def test_choose_interface_ignores_interface_order() -> None:
    for peer in ("127.0.0.1", "172.17.0.1", "192.168.100.5", None):
        assert choose_interface(WORKSTATION, peer) == choose_interface(reversed(WORKSTATION), peer)


def test_choose_interface_skips_nic_if_only_link_local() -> None:
    # eth0 has only a link-local address: other hosts cannot dial it, so it is not routable.
    eth0 = InterfaceInfo("eth0", ("fe80::5", "169.254.3.4"), K.PHYSICAL, default_route=True)
    assert choose_interface([LO, eth0, ETH1], "fe80::5") is ETH1


def test_choose_interface_uses_names_if_kind_unspecified() -> None:
    # An older or non-Linux worker reports no kinds: the names tell docker0 from eth0.
    plain = [InterfaceInfo(i.name, i.addresses, default_route=i.default_route) for i in WORKSTATION]
    assert choose_interface(plain, "172.17.0.1").name == "eth0"
    assert choose_interface(plain, "127.0.0.1").name == "eth0"
    assert choose_interface(plain, "192.168.100.5").name == "eth1"


def test_choose_interface_avoids_virtual_interface_if_routable_exists() -> None:
    wg0 = InterfaceInfo("wg0", ("10.99.0.5",), K.VIRTUAL, default_route=True)
    assert choose_interface([LO, wg0, ETH1], "10.99.0.5") is ETH1


# --- choose_interface: single host ------------------------------------------------------------


def test_choose_interface_returns_loopback_if_single_host() -> None:
    assert choose_interface(WORKSTATION, "127.0.0.1", single_host=True) is LO
    assert choose_interface(WORKSTATION, "::1", single_host=True) is LO


def test_choose_interface_returns_loopback_by_name_if_single_host_and_kind_unspecified() -> None:
    lo = InterfaceInfo("lo", ("127.0.0.1",))
    assert choose_interface([ETH0, lo], "127.0.0.1", single_host=True) is lo


def test_choose_interface_applies_rules_if_single_host_and_no_loopback() -> None:
    assert choose_interface([DOCKER0, ETH0, ETH1], "127.0.0.1", single_host=True) is ETH0


# --- choose_interface: nothing routable -------------------------------------------------------


@pytest.mark.parametrize("peer", ["172.17.0.2", "127.0.0.1", None, "10.1.1.1"])
def test_choose_interface_returns_veth_if_container_has_nothing_else(peer: str | None) -> None:
    # A container or a netns host: loopback and one veth (named eth0) with the default route.
    eth0 = InterfaceInfo("eth0", ("172.17.0.2", "fe80::42:acff:fe11:2"), K.VETH, default_route=True)
    assert choose_interface([LO, eth0], peer) is eth0


def test_choose_interface_returns_peer_interface_if_nothing_routable() -> None:
    veth_a = InterfaceInfo("veth-a", ("10.200.1.2",), K.VETH, default_route=True)
    veth_b = InterfaceInfo("veth-b", ("10.200.2.2",), K.VETH)
    assert choose_interface([LO, veth_a, veth_b], "10.200.2.2") is veth_b
    assert choose_interface([LO, veth_a, veth_b], None) is veth_a


def test_choose_interface_returns_bridge_if_loopback_peer_and_only_bridge() -> None:
    # The member on the coordinator's host connects over loopback while the other ranks run in
    # containers on docker0: docker0 is the one they can reach, loopback is not.
    assert choose_interface([LO, DOCKER0], "127.0.0.1") is DOCKER0


def test_choose_interface_returns_loopback_if_host_has_only_loopback() -> None:
    assert choose_interface([LO], "127.0.0.1") is LO
    assert choose_interface([LO], None) is LO


def test_choose_interface_returns_loopback_if_others_have_no_usable_address() -> None:
    veth = InterfaceInfo("eth0", ("fe80::1",), K.VETH)
    assert choose_interface([veth, LO], "fe80::1") is LO


def test_choose_interface_returns_first_by_name_if_nothing_has_an_address() -> None:
    bare = [InterfaceInfo("eth1"), InterfaceInfo("eth0"), InterfaceInfo("lo")]
    assert choose_interface(bare, None).name == "eth0"


def test_choose_interface_raises_if_no_interfaces() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^interfaces is empty: host 'h1' reported no network interface; .*$",
    ):
        choose_interface([], "10.0.0.5", host="h1")


# --- classification ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("interface", "avoided"),
    [
        (InterfaceInfo("lo"), True),
        (InterfaceInfo("lo0"), True),
        (InterfaceInfo("docker0"), True),
        (InterfaceInfo("br-0a1b2c"), True),
        (InterfaceInfo("virbr0"), True),
        (InterfaceInfo("cni0"), True),
        (InterfaceInfo("veth9f8e"), True),
        (InterfaceInfo("flannel.1"), True),
        (InterfaceInfo("cali12ab"), True),
        (InterfaceInfo("vxlan.calico"), True),
        (InterfaceInfo("tun0"), True),
        (InterfaceInfo("tap0"), True),
        (InterfaceInfo("eth0"), False),
        (InterfaceInfo("ens5"), False),
        (InterfaceInfo("ib0"), False),
        (InterfaceInfo("bond0"), False),
        (InterfaceInfo("local-net"), False),  # only lo and loN are loopback names
        (InterfaceInfo("eth0", kind=K.VETH), True),  # a container's eth0 is a veth
        (InterfaceInfo("br0", kind=K.BRIDGE), True),
        (InterfaceInfo("dummy0", kind=K.PHYSICAL), False),  # sysfs saw a device: trust it
        (InterfaceInfo("lo", kind=K.PHYSICAL), True),  # but loopback is loopback
    ],
)
def test_is_avoided_combines_kind_and_name(interface: InterfaceInfo, avoided: bool) -> None:
    assert is_avoided(interface) is avoided


def test_is_routable_is_false_if_only_loopback_or_link_local_addresses() -> None:
    assert not is_routable(InterfaceInfo("eth0", ("fe80::1", "169.254.1.1", "127.0.0.2"), K.PHYSICAL))
    assert is_routable(InterfaceInfo("eth0", ("fe80::1", "10.0.0.1"), K.PHYSICAL))


@pytest.mark.parametrize(
    ("address", "routable"),
    [
        ("10.0.0.1", True),
        ("192.168.1.1", True),
        ("203.0.113.5", True),
        ("fd00::1", True),
        ("2001:db8::1", True),
        ("::ffff:10.0.0.1", True),
        ("127.0.0.1", False),
        ("127.1.2.3", False),
        ("::1", False),
        ("::ffff:127.0.0.1", False),
        ("169.254.10.10", False),
        ("fe80::1", False),
        ("fe80::1%eth0", False),
        ("febf::1", False),  # still inside fe80::/10
        ("0.0.0.0", False),
        ("::", False),
        ("224.0.0.1", False),
        ("garbage", False),
        ("", False),
    ],
)
def test_is_routable_address(address: str, routable: bool) -> None:
    assert is_routable_address(address) is routable


def test_parse_address_unmaps_ipv4_mapped_and_drops_zone() -> None:
    assert parse_address("::ffff:10.0.0.1") == ipaddress.IPv4Address("10.0.0.1")
    assert parse_address("fe80::1%eth0") == ipaddress.IPv6Address("fe80::1")
    assert parse_address("[fd00::1]") == ipaddress.IPv6Address("fd00::1")
    assert parse_address("eth0") is None


def test_interface_with_address_matches_any_spelling() -> None:
    assert interface_with_address(WORKSTATION, "::ffff:172.17.0.1") is DOCKER0
    assert interface_with_address(WORKSTATION, "FD00:0::5") is ETH0
    assert interface_with_address(WORKSTATION, "198.51.100.1") is None
    assert interface_with_address(WORKSTATION, None) is None
    assert interface_with_address(WORKSTATION, "") is None


def test_interface_kind_matches_proto_numbers() -> None:
    from sarcomm.v1 import coordinator_pb2 as pb

    for kind in InterfaceKind:
        assert pb.InterfaceKind.Value(f"INTERFACE_KIND_{kind.name}") == kind.value


def test_interface_info_coerces_unknown_kind_to_unspecified() -> None:
    assert InterfaceKind.coerce(99) is K.UNSPECIFIED
    assert InterfaceKind.coerce(4) is K.VETH
    info = InterfaceInfo("eth0", ["10.0.0.1"], 1)  # type: ignore[arg-type]  # what a proto gives
    assert info == InterfaceInfo("eth0", ("10.0.0.1",), K.PHYSICAL)
    assert info.kind is K.PHYSICAL


# --- address_on -------------------------------------------------------------------------------


def test_address_on_prefers_ipv4() -> None:
    assert address_on(ETH0) == "10.0.0.5"
    assert address_on(ETH0, prefer_ipv4=False) == "fd00::5"


def test_address_on_skips_link_local_ipv6_and_garbage() -> None:
    eth0 = InterfaceInfo("eth0", ("fe80::1", "nonsense", "fd00::7"), K.PHYSICAL)
    assert address_on(eth0) == "fd00::7"


def test_address_on_prefers_routable_over_ipv4_link_local() -> None:
    eth0 = InterfaceInfo("eth0", ("169.254.0.9", "fd00::7"), K.PHYSICAL)
    assert address_on(eth0) == "fd00::7"
    assert address_on(InterfaceInfo("eth0", ("169.254.0.9",), K.PHYSICAL)) == "169.254.0.9"


def test_address_on_returns_loopback_address_only_on_loopback() -> None:
    assert address_on(LO) == "127.0.0.1"
    assert address_on(LO, prefer_ipv4=False) == "::1"
    weird = InterfaceInfo("eth0", ("127.0.0.2", "10.0.0.1"), K.PHYSICAL)
    assert address_on(weird) == "10.0.0.1"


def test_address_on_normalises_spelling() -> None:
    assert address_on(InterfaceInfo("eth0", ("::ffff:10.0.0.1",), K.PHYSICAL)) == "10.0.0.1"
    assert address_on(InterfaceInfo("eth0", ("FD00:0::7",), K.PHYSICAL)) == "fd00::7"


def test_address_on_raises_if_only_link_local_ipv6() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^interface 'veth1234' has no address other hosts could dial "
        r"\(it reports: fe80::a0b:cff:fe0d:e0f\); .*$",
    ):
        address_on(VETH)


def test_address_on_raises_if_no_address() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^interface 'eth3' has no address other hosts could dial \(it reports: none\); "
        r"an interface needs an IPv4 address or an IPv6 address that is not link-local, "
        r"and loopback addresses count on loopback only\.$",
    ):
        address_on(InterfaceInfo("eth3", (), K.PHYSICAL))


def test_usable_addresses_orders_routable_ipv4_first() -> None:
    eth0 = InterfaceInfo("eth0", ("fe80::1", "fd00::1", "169.254.1.1", "10.0.0.1", "10.0.0.1"), K.PHYSICAL)
    assert [str(a) for a in usable_addresses(eth0)] == ["10.0.0.1", "fd00::1", "169.254.1.1"]


# --- parse_peer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:127.0.0.1:5555", "127.0.0.1"),
        ("ipv4:10.1.2.3:40000", "10.1.2.3"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:[fd00::5]:5555", "fd00::5"),
        ("ipv6:%5B::ffff:10.0.0.1%5D:123", "10.0.0.1"),
        ("ipv6:[::ffff:10.0.0.1]:123", "10.0.0.1"),
        ("ipv6:%5Bfe80::1%25eth0%5D:123", "fe80::1"),
        ("ipv6:[FD00:0::5]:1", "fd00::5"),
        ("unix:/tmp/sarcomm.sock", None),
        ("unix-abstract:sarcomm", None),
        ("vsock:3:5000", None),
        ("ipv4:not-an-ip:5555", None),
        ("ipv6:[::1:5555", None),
        ("", None),
        ("127.0.0.1:5555", None),
    ],
)
def test_parse_peer(peer: str, expected: str | None) -> None:
    assert parse_peer(peer) == expected


# --- properties -------------------------------------------------------------------------------

_REALISTIC_NAMES = ["lo", "lo0", "eth0", "eth1", "eth10", "ens5", "docker0", "br-abc", "veth1", "tun0", "ib0"]
_NAMES = st.one_of(
    st.sampled_from(_REALISTIC_NAMES),
    st.text(alphabet=st.characters(codec="ascii", categories=("L", "N", "P")), min_size=1, max_size=15),
)
# Addresses the rules treat specially, and strings that are not addresses at all.
_SPECIAL = ["127.0.0.1", "::1", "fe80::1", "fe80::1%eth0", "169.254.1.1", "0.0.0.0", "::", "::ffff:10.0.0.1"]
_SPECIAL_ADDRESSES = st.sampled_from([*_SPECIAL, "junk", ""])
_ADDRESSES = st.one_of(st.ip_addresses().map(str), _SPECIAL_ADDRESSES)
_INTERFACES = st.builds(
    InterfaceInfo,
    name=_NAMES,
    addresses=st.lists(_ADDRESSES, max_size=4).map(tuple),
    kind=st.sampled_from(InterfaceKind),
    default_route=st.booleans(),
)
_HOSTS = st.lists(_INTERFACES, min_size=1, max_size=8, unique_by=lambda i: i.name)


@given(interfaces=_HOSTS, data=st.data(), single_host=st.booleans())
def test_choose_interface_never_raises_and_returns_a_member(
    interfaces: list[InterfaceInfo], data: st.DataObject, single_host: bool
) -> None:
    known = [a for i in interfaces for a in i.addresses]
    peer = data.draw(st.one_of(st.none(), _ADDRESSES, st.sampled_from(known) if known else st.none()))
    chosen = choose_interface(interfaces, peer, single_host=single_host)
    assert any(chosen is i for i in interfaces)
    # The contract: never a loopback, bridge or veth interface when a routable one exists.
    if not single_host and any(is_routable(i) for i in interfaces):
        assert is_routable(chosen)
    # Deterministic whatever order the worker listed its interfaces in.
    assert choose_interface(list(reversed(interfaces)), peer, single_host=single_host) is chosen


@given(interfaces=_HOSTS, socket_name=_NAMES)
def test_choose_interface_with_socket_name_returns_it_or_raises_invalid_argument(
    interfaces: list[InterfaceInfo], socket_name: str
) -> None:
    if socket_name in names(interfaces):
        assert choose_interface(interfaces, None, socket_name, host="h").name == socket_name
    else:
        with pytest.raises(InvalidArgumentError, match=r"^socket_name .* is not an interface of host 'h'; "):
            choose_interface(interfaces, None, socket_name, host="h")


@given(text=st.text(max_size=80))
def test_parse_peer_never_raises(text: str) -> None:
    result = parse_peer(text)
    assert result is None or parse_address(result) is not None
