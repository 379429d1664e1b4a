"""A job whose ranks are ``multiprocessing`` children, as SAR's test suite starts them:
``python mp_children_job.py METHOD MODE WORLD COORD JOB``.

The parent starts WORLD children with start method METHOD (fork, spawn or forkserver); each joins
JOB at COORD with ``coord_ip_init``, initialises gloo, checks one all_reduce and then:

    return      returns normally (a fork child then ends with os._exit: no atexit runs)
    raise       rank 1 raises ValueError("rank 1 broke on purpose"); the others return
    exit3       rank 1 calls sys.exit(3) while handling an exception (as torch.multiprocessing.spawn's
                wrapper does with sys.exit(1)); the others return
    finalize    calls sar.finalize() twice (the second does nothing), then returns

The parent waits for every child (at most 90 s, then kills them) and exits 0 when each child's exit
code is the one its mode means (0; 1 for the rank that raised, 3 for the one that called
sys.exit(3)), else 1 naming the children.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

DEADLINE_S = 90.0


def rank_main(mode: str, rank: int, world: int, coord: str, job: str) -> None:
    import torch

    import sarcomm.worker as sar

    os.environ["SAR_SOCKET_NAME"] = "lo"
    master_ip = sar.coord_ip_init(rank, coord, job=job, world_size=world, timeout=60)
    sar.initialize_comms(rank, world, master_ip, "gloo")
    total = torch.ones(1)
    sar.all_reduce(total)
    if total.item() != world:
        raise AssertionError(f"rank {rank}: all_reduce gave {total.item()}, not {world}")
    if mode == "raise" and rank == 1:
        raise ValueError("rank 1 broke on purpose")
    if mode == "exit3" and rank == 1:
        try:
            raise KeyError("rank 1's table")
        except KeyError:
            sys.exit(3)
    if mode == "finalize":
        sar.finalize()
        sar.finalize()
        if sar.is_initialized():
            raise AssertionError("finalize() left communication initialised")


def main(argv: list[str]) -> int:
    method, mode, world, coord, job = argv[0], argv[1], int(argv[2]), argv[3], argv[4]
    contexts: dict[str, ForkContext | SpawnContext | ForkServerContext] = {
        "fork": multiprocessing.get_context("fork"),
        "spawn": multiprocessing.get_context("spawn"),
        "forkserver": multiprocessing.get_context("forkserver"),
    }
    ctx = contexts[method]
    children = [ctx.Process(target=rank_main, args=(mode, r, world, coord, job)) for r in range(world)]
    for child in children:
        child.start()
    deadline = time.monotonic() + DEADLINE_S
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    wrong = []
    for rank, child in enumerate(children):
        if child.is_alive():
            child.kill()
            child.join(5.0)
            wrong.append(f"rank {rank} still running after {DEADLINE_S:g} s")
            continue
        expected = {"raise": 1, "exit3": 3}.get(mode, 0) if rank == 1 else 0
        if child.exitcode != expected:
            wrong.append(f"rank {rank} exited with {child.exitcode}, expected {expected}")
    if wrong:
        print("; ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
