"""Readiness and stopping notices for systemd (``Type=notify`` units), without libsystemd.

The protocol is one datagram of ``KEY=VALUE`` lines to the Unix socket named by ``NOTIFY_SOCKET``
(a path, or ``@name`` for an abstract socket); see sd_notify(3). Outside systemd the variable is
unset and :func:`notify` does nothing, so the coordinator calls it unconditionally.

``NOTIFY_SOCKET`` is read here, where the notice is sent, and not with the settings: it is
systemd's variable, not a sarcomm setting (no flag, no ``SARCOMM_*`` name), set by the service
manager for this one process, and nothing else reads it (``tests/test_env_reads.py`` lists it).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["notify"]

log = logging.getLogger(__name__)


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``) to systemd; True when it was sent.

    Never raises: a unit without a notify socket, or a socket that is gone, only costs a debug line
    (systemd then reports the unit by its own rules: ``Type=notify`` times out at start-up).
    """
    target = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not target:
        return False
    address = "\0" + target[1:] if target.startswith("@") else target
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as error:
        log.debug("could not notify systemd at %s: %s", target, error)
        return False
    return True
