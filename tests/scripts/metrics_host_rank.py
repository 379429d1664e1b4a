"""A one-rank job that reports where its ``/metrics`` endpoint listens:
``python metrics_host_rank.py MODE OUT JOB [COORD]``.

MODE ``agent``: started by ``sar-worker`` (``sar.init()``); MODE ``self``: registers itself at
COORD (``coord_ip_init`` + ``initialize_comms``). Either way it then waits (at most 20 s) until the
coordinator's ``/sd`` (``TEST_COORD_HTTP``) lists it, scrapes its own endpoint on 127.0.0.1, tries
to connect on 127.0.0.2 (also loopback: it answers only when the endpoint listens on every
interface) and writes what it saw to ``OUT``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import wait_for_sd
from tests.scripts.published import publish


def main(argv: list[str]) -> int:
    mode, out, job = argv[0], Path(argv[1]), argv[2]
    import sarcomm.worker as sar
    from sarcomm.worker.library import metrics

    if mode == "agent":
        sar.init()
    else:
        master_ip = sar.coord_ip_init(0, argv[3], job=job, world_size=1, timeout=30)
        sar.initialize_comms(0, 1, master_ip, "gloo")
    port = metrics.serving_port()
    sd = wait_for_sd(os.environ["TEST_COORD_HTTP"], job, 1, timeout=20.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        scraped = "sar_worker_info" in response.read().decode()
    try:
        with socket.create_connection(("127.0.0.2", port), timeout=5):
            other = "connected"
    except ConnectionRefusedError:
        other = "refused"
    publish(out, json.dumps({"port": port, "sd": sd, "scraped": scraped, "other": other}))
    sar.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
