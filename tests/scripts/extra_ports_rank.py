"""A rank that uses its job's extra ports as SAR's sampling workers do:
``python extra_ports_rank.py OUT GO`` (under ``sar-worker --extra-ports K``), or
``python extra_ports_rank.py OUT GO HOW COORD JOB K`` (registering itself, HOW being
``coord_ip_init`` or ``init``: ``coord_ip_init(..., extra_ports=K)``, ``init(coord=...,
extra_ports=K)``).

Writes ``MASTER_PORT`` and ``SAR_EXTRA_PORTS`` to OUT, waits (at most 60 s) until the file GO
exists, then starts a torch.distributed store, the master side of a process group, on each extra
port, as SAR's sampling worker k does on ``master_port() + k + 1``, checks that each serves, and
writes the ports it served on to OUT.bound.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish

GO_WAIT_S = 60.0


def main(argv: list[str]) -> int:
    out, go = Path(argv[0]), Path(argv[1])
    if len(argv) > 2:
        import sarcomm.worker as sar

        how, coord, job, count = argv[2], argv[3], argv[4], int(argv[5])
        if how == "coord_ip_init":
            sar.coord_ip_init(0, coord, job=job, world_size=1, timeout=60, extra_ports=count)
        else:
            sar.init(coord=coord, job=job, world_size=1, initialize=False, timeout=60, extra_ports=count)
    extra = [int(port) for port in os.environ["SAR_EXTRA_PORTS"].split(",")]
    publish(out, json.dumps({"master_port": int(os.environ["MASTER_PORT"]), "extra": extra}))
    deadline = time.monotonic() + GO_WAIT_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go} did not appear within {GO_WAIT_S} s")
        time.sleep(0.05)

    from torch._C._distributed_c10d import TCPStore

    served = []
    stores = []
    for port in extra:
        timeout = datetime.timedelta(seconds=10)
        store = TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timeout, wait_for_workers=False)
        store.set("sampling", str(port))
        if store.get("sampling") == str(port).encode():
            served.append(port)
        stores.append(store)
    publish(Path(f"{out}.bound"), json.dumps(served))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
