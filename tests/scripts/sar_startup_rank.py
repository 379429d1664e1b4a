"""One process of a SAR-style start-up: ``python sar_startup_rank.py MODE RANK WORLD COORD JOB OUTDIR``.

Does exactly what SAR's examples do with ``nfs_ip_init``, with the coordinator instead::

    master_ip = sar.coord_ip_init(rank, coord, job=job, world_size=world)
    sar.initialize_comms(rank, world, master_ip, "gloo")

Modes:
    train       ``sync_params`` (rank 0's parameters everywhere) and ``gather_grads`` (gradients
                summed), then write what it saw to ``OUTDIR/rank<R>.json``.
    peer-dies   the last rank dies at once without leaving (``os._exit(3)``); the others wait (at
                most 30 s) to hear of it, then check that a collective raises ``PeerFailedError``
                instead of blocking, and write what they saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish

EXPORTED = ("MASTER_ADDR", "MASTER_PORT", "SAR_COORD", "SAR_JOB", "SAR_GENERATION", "SAR_SOCKET_NAME")
# Bounds the wait for the coordinator to report a dead peer.
HEAR_OF_FAILURE_S = 30.0


def main(argv: list[str]) -> int:
    mode, rank, world, coord, job, out = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4], Path(argv[5])

    import torch

    import sarcomm.worker as sar
    from sarcomm.worker.library import registration

    master_ip = sar.coord_ip_init(rank, coord, job=job, world_size=world)
    sar.initialize_comms(rank, world, master_ip, "gloo")
    result: dict[str, object] = {
        "master_ip": master_ip,
        "rank": sar.rank(),
        "world_size": sar.world_size(),
        "backend": sar.backend(),
        "env": {name: os.environ.get(name) for name in EXPORTED},
    }

    if mode == "train":
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float(rank + 1))
        sar.sync_params(model)
        result["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
        for param in model.parameters():
            param.grad = torch.full_like(param, float(rank + 1))
        sar.gather_grads(model)
        result["grads"] = [p.grad.flatten().tolist() for p in model.parameters() if p.grad is not None]
        sar.barrier()
    elif mode == "peer-dies":
        sar.barrier()
        if rank == world - 1:
            os._exit(3)  # no Leave, no goodbye: only the missed heartbeats tell
        started = time.monotonic()
        while registration.peer_failure() is None:
            if time.monotonic() - started > HEAR_OF_FAILURE_S:
                return 4
            time.sleep(0.05)
        result["heard_after_s"] = time.monotonic() - started
        try:
            sar.all_reduce(torch.ones(1))
        except sar.PeerFailedError as exc:
            result["error"] = {"type": type(exc).__name__, "message": str(exc), "rank": exc.rank}
    else:
        raise SystemExit(f"unknown mode {mode!r}")

    publish(out / f"rank{rank}.json", json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
