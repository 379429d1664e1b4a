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
import os
import sys
from pathlib import Path

import torch.distributed as dist

# Run as a file (its own folder on sys.path): the repository root makes the shared loop importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.checked_steps import run_steps


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

    def fail_at(step: int) -> int | None:
        first = record["restart_count"] == 0
        return args.fail_code if rank == args.fail_rank and step >= args.fail_after and first else None

    with (args.out / f"{os.getpid()}.jsonl").open("a", buffering=1) as out:
        run_steps(dist.all_reduce, args.out, out, record, step_s=args.step_s, fail_at=fail_at)
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
