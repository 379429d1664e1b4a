"""One rank of the monitoring tests: ``python monitor_rank.py CONTROL_DIR``, under ``sar-worker``.

Runs ``all_reduce`` and unequal-size ``all_to_all`` (SAR's two collectives) about ten times a
second until the test asks it to stop, so Prometheus sees a steady, low call rate (each slow call
then moves the p99 of a one-minute window). The test steers it through files in CONTROL_DIR:

    rank<R>.pid   written by each rank at start, so the test can SIGSTOP or SIGKILL it.
    slow          holds a rank number: that rank sleeps SLOW_S before each all_reduce (a
                  straggler), so its peers' all_reduce latency jumps.
    hold          holds a rank number: while the file exists, that rank stays out of the next
                  collective (alive, busy in Python), so its peers wait for it there: a stall.
    stop          every rank leaves the loop at the same iteration and exits 0.

Stopping is agreed through the loop's own ``all_reduce``, so no rank leaves a peer waiting in a
collective. A rank also stops by itself after DEADLINE_S, whatever happens to the test.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish

PACE_S = 0.1
SLOW_S = 1.5
DEADLINE_S = 240.0


def names(control_file: Path, rank: int) -> bool:
    """Whether ``control_file`` exists and holds ``rank``."""
    try:
        return control_file.read_text().strip() == str(rank)
    except FileNotFoundError:
        return False


def main(control: Path) -> int:
    import torch

    import sarcomm.worker as sar

    info = sar.init()
    rank, world = info.rank, info.world_size
    publish(control / f"rank{rank}.pid", str(os.getpid()))
    deadline = time.monotonic() + DEADLINE_S
    slow_file, hold_file, stop_file = control / "slow", control / "hold", control / "stop"
    while True:
        while (
            hold_file.exists() and hold_file.read_text().strip() == str(rank) and time.monotonic() < deadline
        ):
            time.sleep(PACE_S)
        if names(slow_file, rank):
            time.sleep(SLOW_S)
        # Element 0 carries "I want to stop"; the sum tells every rank whether anyone does.
        flags = torch.ones(256)
        flags[0] = float(stop_file.exists() or time.monotonic() > deadline)
        sar.all_reduce(flags)
        if flags[0] > 0:
            break
        send = [torch.full((64 * (rank + dst + 1),), float(rank)) for dst in range(world)]
        recv = [torch.empty(64 * (src + rank + 1)) for src in range(world)]
        sar.all_to_all(recv, send)
        time.sleep(PACE_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
