"""The worker's interface report (``sarcomm.common.netinfo.local_interfaces``) on hosts built in
network namespaces: veths named eth0/eth1 as a container has them, a bridge, a dummy or tap device,
a bridge that is down. ``local_interfaces()`` runs inside the namespace through ``ip netns exec``,
which also mounts that namespace's sysfs. The tests need root and ``ip``, and skip cleanly
otherwise. Every address used lives inside namespaces these tests create. The rules themselves on
fake sysfs and procfs: tests/test_netinfo.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from sarcomm.common.interfaces import InterfaceKind
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
