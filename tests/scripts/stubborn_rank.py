"""A rank that will not stop by itself (no torch, no sarcomm): ``python stubborn_rank.py PIDFILE``.

It ignores SIGTERM and SIGINT, starts a helper (``sleep``, ignoring them too) in a session of its
own (``setsid``: no signal to the rank's process group reaches it) that holds the rank's stdout
and stderr open, writes ``RANK_PID HELPER_PID`` to PIDFILE (through a temporary file, so a reader
never sees half of it), and sleeps until killed (at most 300 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish


def main(pid_file: str) -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    # SIG_IGN stays ignored across exec: the helper ignores SIGTERM and SIGINT too.
    helper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    publish(pid_file, f"{os.getpid()} {helper.pid}\n")
    print("stubborn rank running", flush=True)
    time.sleep(300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
