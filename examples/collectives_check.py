"""A rank's smallest useful job: start up through sarcomm, run collectives, check every value.

Run under the agent (it sets RANK, WORLD_SIZE, MASTER_ADDR, ... for each local rank)::

    sar-worker --coord 127.0.0.1:50051 --job demo --world-size 4 --nproc-per-node 2 -- \
        python examples/collectives_check.py

Exits non-zero, naming the collective, if any value is wrong.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

import torch

import sarcomm.worker as sar


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape or not torch.equal(got, want):
        raise SystemExit(f"rank {sar.rank()}: {name} returned {got.tolist()}, expected {want.tolist()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="how many times to run each collective")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds between rounds (a job that lasts, e.g. through a coordinator failover)",
    )
    args = parser.parse_args()

    info = sar.init()
    rank, world = info.rank, info.world_size
    for round_ in range(args.rounds):
        # all_reduce: every rank contributes rank + 1, so each element sums to W (W + 1) / 2.
        tensor = torch.full((8,), float(rank + 1 + round_))
        sar.all_reduce(tensor)
        check("all_reduce", tensor, torch.full((8,), float(world * (world + 1) // 2 + world * round_)))

        # all_to_all with unequal sizes (SAR's case): rank r sends r + p + 1 rows to peer p.
        send = [torch.full((rank + peer + 1, 3), float(100 * rank + peer + round_)) for peer in range(world)]
        recv = [torch.empty((peer + rank + 1, 3)) for peer in range(world)]
        sar.all_to_all(recv, send)
        for peer, got in enumerate(recv):
            check(
                f"all_to_all from rank {peer}",
                got,
                torch.full((peer + rank + 1, 3), float(100 * peer + rank + round_)),
            )
        if args.pause > 0:
            time.sleep(args.pause)
    print(
        f"rank {rank}/{world} on {socket.gethostname()} (generation {info.generation}, master "
        f"{info.master_addr}:{info.master_port}, backend {info.backend}): all_reduce and all_to_all "
        f"correct in {args.rounds} rounds",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
