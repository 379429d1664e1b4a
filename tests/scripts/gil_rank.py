"""A rank whose Python holds the GIL for long: ``python gil_rank.py CONTROL HOLD_S [COORD JOB]``.

Under ``sar-worker`` it calls ``sar.init(initialize=False)`` (the agent's progress record), else it
registers itself with ``COORD`` as the only member of ``JOB``. It writes
``CONTROL/<job>.rank<R>.holding`` (its pid), then keeps the GIL for HOLD_S seconds:

- rank 0 in one C call that blocks without releasing it (``ctypes.PyDLL``, unlike ``CDLL``, keeps
  the GIL: ``sleep(3)`` from libc, for HOLD_S seconds);
- the other ranks burning CPU in ``re`` matches that backtrack for seconds each (sre keeps the GIL
  for a whole match), so that 8 ranks on 2 cores are busy as SAR's own test suite makes them.

Then it exits 0. Neither its stamping nor its heartbeat thread runs meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish

# A match of this pattern against "a" * N + "b" takes exponential time in N: 34 is about 1.5 s of
# one core here, and far more with 8 ranks on 2 cores.
_BACKTRACK = re.compile(r"(a|aa)+$")
_BACKTRACK_N = 34


def main(argv: list[str]) -> int:
    import sarcomm.worker as sar

    control, hold = Path(argv[0]), float(argv[1])
    if len(argv) > 2:
        sar.init(coord=argv[2], job=argv[3], world_size=1, initialize=False)
    else:
        sar.init(initialize=False)
    job, rank = os.environ["SAR_JOB"], int(os.environ["RANK"])
    publish(control / f"{job}.rank{rank}.holding", str(os.getpid()))
    end = time.monotonic() + hold
    if rank == 0:
        ctypes.PyDLL(None).sleep(int(hold))
    else:
        while time.monotonic() < end:
            _BACKTRACK.match("a" * _BACKTRACK_N + "b")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
