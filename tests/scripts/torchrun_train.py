"""A torchrun worker for the sarcomm rendezvous tests: gloo all_reduces with checked values.

Usage: ``torchrun ... torchrun_train.py OUT_DIR [--sar-init] [--fail-rank R --fail-code C
--fail-after N] [--step-s S]``.

Each step all-reduces ``rank + 1`` (the sum must be ``W (W + 1) / 2``) and a stop flag (set once
the file ``OUT_DIR/stop`` exists, on any rank: all ranks then stop at the same step). Every step is
one JSON line in ``OUT_DIR/<pid>.jsonl`` with the rank, world, node, generation, restart count and
whether the value was right. ``--sar-init`` initialises through ``sarcomm.worker.init()`` (which reads what
torchrun and sarcomm's rendezvous set) instead of ``init_process_group``. ``--fail-rank R``: global
rank R exits with ``--fail-code`` after ``--fail-after`` steps of its first generation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--sar-init", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-code", type=int, default=3)
    parser.add_argument("--fail-after", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.2)
    args = parser.parse_args()
    env = os.environ
    if args.sar_init:
        import sarcomm.worker as sar

        info = sar.init(backend="gloo")
        rank, world = info.rank, info.world_size
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    record = {
        "pid": os.getpid(),
        "rank": rank,
        "world": world,
        "local_rank": int(env["LOCAL_RANK"]),
        "local_world": int(env["LOCAL_WORLD_SIZE"]),
        "group_rank": int(env["GROUP_RANK"]),
        "group_world": int(env["GROUP_WORLD_SIZE"]),
        "restart_count": int(env["TORCHELASTIC_RESTART_COUNT"]),
        "generation": int(env.get("SAR_GENERATION", "0")),
        "job": env.get("SAR_JOB", ""),
        "gloo_ifname": env.get("GLOO_SOCKET_IFNAME", ""),
        "use_agent_store": env.get("TORCHELASTIC_USE_AGENT_STORE", ""),
    }
    out = (args.out / f"{os.getpid()}.jsonl").open("a", buffering=1)
    expected = world * (world + 1) / 2
    step = 0
    while True:
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        stop = torch.tensor([1.0 if (args.out / "stop").exists() else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        step += 1
        ok = value.item() == expected
        out.write(json.dumps({**record, "step": step, "time": time.time(), "ok": ok}) + "\n")
        if stop.item():
            break
        if rank == args.fail_rank and step >= args.fail_after and record["restart_count"] == 0:
            print(f"rank {rank} fails on purpose with code {args.fail_code}", file=sys.stderr, flush=True)
            out.close()
            os._exit(args.fail_code)
        time.sleep(args.step_s)
    out.write(json.dumps({**record, "step": step, "time": time.time(), "done": True}) + "\n")
    out.close()
    dist.destroy_process_group()
    if not args.sar_init:
        # Done and closed: skip the interpreter's teardown of torch (about half a second of CPU
        # per worker, which a 2-core machine pays before the agent sees the worker end). A worker
        # of sarcomm.worker.init() ends normally: the library's exit hooks run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
