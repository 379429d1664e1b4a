"""Ports a job reserves with its master port: the rule for SAR's sampling ports, and the holding.

SAR's sampling workers each start a process group of their own whose store listens on
``master_port() + k + 1`` (worker k), on the master's host. :func:`extra_ports` is that rule;
:class:`PortBlock` holds the master port and the ``K`` ports after it on the host that reserves
them, so that no other job on that host is handed any of them while the job may use them.
"""

from __future__ import annotations

import logging
import socket

from sarcomm.common.constants import MAX_EXTRA_PORTS
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.netinfo import reserve_port

__all__ = ["PortBlock", "check_extra_ports", "extra_ports"]

log = logging.getLogger(__name__)

#: How many first ports :meth:`PortBlock.reserve` tries before it gives up.
_BLOCK_ATTEMPTS = 64


def extra_ports(master_port: int, count: int) -> tuple[int, ...]:
    """The extra ports of a job whose master port is ``master_port``: ``master_port+1`` to
    ``master_port+count``, where SAR's sampling worker k listens (``master_port() + k + 1``)."""
    return tuple(range(master_port + 1, master_port + 1 + count))


def check_extra_ports(count: object, field: str) -> int:
    """``count`` if it is an integer in 0..MAX_EXTRA_PORTS, else :class:`InvalidArgumentError`
    naming ``field`` (``--extra-ports``, ``extra_ports``)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_EXTRA_PORTS:
        raise InvalidArgumentError(
            f"{field} {shorten(count)} must be an integer in 0..{MAX_EXTRA_PORTS}: how many ports after "
            "the master port to reserve for SAR's sampling workers."
        )
    return count


class PortBlock:
    """Sockets holding a port P for the torch.distributed store (as
    :func:`~sarcomm.common.netinfo.reserve_port`) and the ``extra`` ports after it.

    Each extra port is bound *without* ``SO_REUSEADDR`` first, which fails when any other socket
    holds the port (another job's reservation, a listener, a connection in TIME_WAIT), and only then
    made reusable: the job's own ``TCPStore`` (which sets ``SO_REUSEADDR`` too) can then bind and
    listen on it while the reservation stays, and no other job's reservation can take it, because
    theirs binds without it; nor can a port the kernel picks (``bind`` to port 0 skips bound ports).

    The store port is released once the coordinator answered (:meth:`release_store_port`: rank 0's
    store binds it at once); the extra ports are kept while the job may listen on them, and only
    where the store is, i.e. when this host's port became the master port (:meth:`keep_if_master`).
    """

    def __init__(self, sockets: list[socket.socket]) -> None:
        """Holds ``sockets``: the store port's, then the extra ports' (none: holds nothing)."""
        self._store: socket.socket | None = sockets[0] if sockets else None
        self.store_port = int(sockets[0].getsockname()[1]) if sockets else 0
        self._extras = sockets[1:]

    @classmethod
    def reserve(cls, extra: int, host: str = "") -> PortBlock:
        """Reserve a free port and the ``extra`` ports after it on ``host`` ("" every IPv4 address).

        Raises:
            OSError: no ``extra + 1`` consecutive free ports were found in 64 tries.
        """
        for _ in range(_BLOCK_ATTEMPTS):
            first = reserve_port(host)
            held = [first]
            try:
                for port in extra_ports(int(first.getsockname()[1]), extra):
                    held.append(_hold_exclusively(first.family, str(first.getsockname()[0]), port))
            except (OSError, OverflowError):  # taken, or past 65535: try another first port
                for sock in held:
                    sock.close()
                continue
            if extra:
                log.debug("reserved ports %d..%d", held[0].getsockname()[1], held[-1].getsockname()[1])
            return cls(held)
        raise OSError(
            f"could not reserve {extra + 1} consecutive free TCP ports in {_BLOCK_ATTEMPTS} tries: free "
            "some ports, or ask for fewer extra ports"
        )

    @property
    def extra(self) -> tuple[int, ...]:
        """The extra ports still held."""
        return tuple(int(sock.getsockname()[1]) for sock in self._extras)

    def release_store_port(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def keep_if_master(self, master_port: int) -> None:
        """Release the store port; keep the extra ports only if ``master_port`` is this block's
        store port (the job's store, and so its sampling ports, are on this host)."""
        self.release_store_port()
        if master_port != self.store_port:
            self.close()

    def close(self) -> None:
        """Release every port still held; idempotent."""
        self.release_store_port()
        for sock in self._extras:
            sock.close()
        self._extras = []


def _hold_exclusively(family: socket.AddressFamily, address: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except BaseException:
        sock.close()
        raise
    return sock
