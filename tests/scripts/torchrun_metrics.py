"""A torchrun worker that trains through sarcomm's library, for the ``/sd`` tests: ``sar.init()``
(which serves ``/metrics`` and notes it for the torchrun agent), then ``sar.all_reduce`` steps,
each counted in the library's collective metrics.

Usage: ``torchrun ... torchrun_metrics.py OUT_DIR [--step-s S] [--forge-note HOST]``.

``--forge-note HOST``: local rank 0 rewrites its endpoint note to name ``HOST`` (an address not on
its host, which the coordinator must drop without costing the node anything).

Each step all-reduces ``rank + 1`` (the sum must be ``W (W + 1) / 2``) and a stop flag (set once
``OUT_DIR/stop`` exists, on any rank: all ranks stop at the same step), and appends one JSON line
to ``OUT_DIR/<pid>.jsonl`` with the rank, node, generation, the interface torchrun's sarcomm
rendezvous exported and the metrics port the library bound.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import sarcomm.worker as sar
from sarcomm.worker.endpoints import EndpointNote, note_endpoint
from sarcomm.worker.library import metrics

# Run as a file (its own folder on sys.path): the repository root makes the shared loop importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.checked_steps import run_steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--step-s", type=float, default=0.2)
    parser.add_argument("--forge-note", default="")
    args = parser.parse_args()
    env = os.environ
    info = sar.init(backend="gloo")
    if args.forge_note and env["LOCAL_RANK"] == "0":
        note = EndpointNote(
            info.rank, 0, args.forge_note, metrics.serving_port() or 65535, int(env["SAR_GENERATION"]),
            int(env["GROUP_RANK"]), int(env["LOCAL_WORLD_SIZE"]), info.world_size,
        )  # fmt: skip
        note_endpoint(Path(env["SAR_ENDPOINTS_DIR"]), note)
    rank, world = info.rank, info.world_size
    record = {
        "pid": os.getpid(),
        "rank": rank,
        "world": world,
        "local_rank": int(env["LOCAL_RANK"]),
        "group_rank": int(env["GROUP_RANK"]),
        "generation": int(env.get("SAR_GENERATION", "0")),
        "job": env.get("SAR_JOB", ""),
        "gloo_ifname": env.get("GLOO_SOCKET_IFNAME", ""),
        "metrics_port": metrics.serving_port(),
    }
    with (args.out / f"{os.getpid()}.jsonl").open("a", buffering=1) as out:
        run_steps(sar.all_reduce, args.out, out, record, step_s=args.step_s)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
