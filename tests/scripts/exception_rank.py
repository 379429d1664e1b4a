"""A rank of tests/test_agent_by_exception.py: ``python exception_rank.py OUTDIR``.

Keeps a progress record as the library does (stamped four times an interval) and moves through
collectives (``all_reduce``, about 50 a second) until the test says otherwise: rank 1, once
``OUTDIR/hold`` exists, enters a ``broadcast`` and stays in it; once ``OUTDIR/stop`` exists it stops
itself (SIGSTOP: its process lives on, its stamp ages). Every rank ends after 60 s unless stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from sarcomm.worker.progress import ProgressWriter

#: Bounds every rank that is meant to be stopped by its agent.
WAIT_FOR_STOP_S = 60.0


def main(out: Path) -> int:
    rank = int(os.environ["RANK"])
    writer = ProgressWriter(Path(os.environ["SAR_PROGRESS_FILE"]))
    interval = float(os.environ["SARCOMM_HEARTBEAT_INTERVAL"])
    stop = threading.Event()

    def stamp() -> None:
        while not stop.wait(interval / 4):
            writer.publish()

    threading.Thread(target=stamp, daemon=True).start()
    (out / f"rank{rank}.started").touch()
    deadline = time.monotonic() + WAIT_FOR_STOP_S
    held = False
    while time.monotonic() < deadline:
        if rank == 1 and (out / "stop").exists():
            os.kill(os.getpid(), signal.SIGSTOP)
        if rank == 1 and not held and (out / "hold").exists():
            writer.enter("broadcast")
            held = True
        if not held:
            writer.enter("all_reduce")
            writer.leave()
        time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
