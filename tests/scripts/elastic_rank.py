"""A rank of an elastic ``sar-worker`` job: gloo all_reduces with checked values, per generation.

Usage: ``elastic_rank.py OUT_DIR [--step-s S] [--fail-rank R]``.

Initialises torch.distributed from what the agent set (``RANK``, ``WORLD_SIZE``, ``MASTER_*``);
each step all-reduces ``rank + 1`` (the sum must be ``W (W + 1) / 2``) and a stop flag (set once the
file ``OUT_DIR/stop`` exists, on any rank: all ranks then stop at the same step). Every step is one
JSON line in ``OUT_DIR/<agent>-<pid>.jsonl`` (``TEST_AGENT`` names the agent) with the rank, world,
generation, restart count and whether the value was right; the last line of a rank that stopped
says ``done``. ``--fail-rank R``: global rank R exits with code 3 after its third step.
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
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    env = os.environ
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {
        "agent": env.get("TEST_AGENT", ""),
        "pid": os.getpid(),
        "rank": rank,
        "world": world,
        "generation": int(env["SAR_GENERATION"]),
        "restart_count": int(env["SAR_RESTART_COUNT"]),
    }
    fail_at = lambda step: 3 if rank == args.fail_rank and step >= 3 else None  # noqa: E731
    with (args.out / f"{record['agent']}-{os.getpid()}.jsonl").open("a", buffering=1) as out:
        run_steps(dist.all_reduce, args.out, out, record, step_s=args.step_s, fail_at=fail_at)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
