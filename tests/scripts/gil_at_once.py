"""Registers itself, then holds the GIL at once: ``python gil_at_once.py COORD JOB HOLD_S``.

``coord_ip_init`` returns, and the very next statement is a C call that keeps the GIL for HOLD_S
seconds (``ctypes.PyDLL``: libc's ``sleep``), so the heartbeat thread gets no chance to run in
between. The member must not be failed: ``coord_ip_init`` returns only once the coordinator has
heard from it, and from then on its open connection (keepalive pings, answered by gRPC's core
without the GIL) stands for it. Exits 0.
"""

from __future__ import annotations

import ctypes
import sys


def main(argv: list[str]) -> int:
    import sarcomm.worker as sar

    coord, job, hold = argv[0], argv[1], int(argv[2])
    sar.coord_ip_init(0, coord, job, 1)
    ctypes.PyDLL(None).sleep(hold)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
