"""A DDP training script as users write it, for the zero-code metrics tests: ``init_process_group``
and ``DistributedDataParallel`` on gloo, no sarcomm import (``--library``: the script also uses
sarcomm's library, ``sar.init()`` and ``sar.all_reduce``).

Usage: ``zerocode_ddp.py OUT_DIR --steps N [--library] [--break-rank R] [--optout-rank R]
[--backend nccl]`` (nccl: the model and data on the local rank's GPU; ``scripts/gpu-check.sh``)

- ``--break-rank R``: global rank R sets a malformed ``SARCOMM_HEARTBEAT_INTERVAL`` (the progress
  record's interval, which sar-worker gives its ranks) before it imports torch, so that its
  zero-code instrumentation fails (it must train on and say so once). A malformed
  ``SAR_METRICS_PORT`` would not do: monitoring settings cost only the endpoint, never the
  instrumentation (docs/metrics.md, "Monitoring never stops a job");
- ``--optout-rank R``: global rank R sets ``SAR_AUTO_METRICS=0`` before it imports torch.

Each rank trains N steps, then makes 5 all_reduces of ``rank + 1`` (``dist.all_reduce``, or
``sar.all_reduce`` with ``--library``). The steps run on a one-layer model whose weight gradient,
averaged by DDP's all_reduce, is known: input ``rank + 1`` everywhere gives
``batch * (W + 1) / 2`` on every rank. It then writes one JSON line to ``OUT_DIR/<pid>.json`` (its
rank, the steps' and the 5 calls' wall times, whether every value was right, whether its
instrumentation is loaded and on, and with ``--library`` how many all_reduces the metrics counted
against how many ran), and waits for ``OUT_DIR/stop`` (at most 200 s) so that the
test scrapes its ``/metrics`` before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--library", action="store_true")
parser.add_argument("--break-rank", type=int, default=-1)
parser.add_argument("--optout-rank", type=int, default=-1)
parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
args = parser.parse_args()
RANK = int(os.environ["RANK"])
if args.break_rank == RANK:
    os.environ["SARCOMM_HEARTBEAT_INTERVAL"] = "not-a-number"
if args.optout_rank == RANK:
    os.environ["SAR_AUTO_METRICS"] = "0"

import torch  # noqa: E402 - after the variables above, which its entry points read
import torch.distributed as dist  # noqa: E402

BATCH, WIDTH, LIBRARY_CALLS = 4, 256, 5
STOP_WAIT_S = 200.0


def all_reduce_count() -> int:
    from sarcomm.worker.library import metrics

    key = ("all_reduce", args.backend)
    return next((s.count for s in metrics.all_stats() if (s.op, s.backend) == key), 0)


def main() -> int:
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if args.library:
        import sarcomm.worker as sar

        sar.init(backend=args.backend)
    else:
        dist.init_process_group(args.backend)
    world = dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(WIDTH, WIDTH, bias=False).to(device))
    expected = BATCH * (world + 1) / 2
    counted_before = all_reduce_count() if args.library else 0
    ok, spent = True, 0.0
    for _ in range(args.steps):
        model.zero_grad()
        start = time.perf_counter()
        model(torch.full((BATCH, WIDTH), float(RANK + 1), device=device)).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        spent += time.perf_counter() - start
        grad = model.module.weight.grad
        ok = ok and grad is not None and bool(torch.all(grad == expected))
    record: dict[str, object] = {"pid": os.getpid(), "rank": RANK, "steps": args.steps, "step_s": spent}
    # Every rank makes these calls (a collective needs them all): sarcomm's with --library.
    all_reduce = sar.all_reduce if args.library else dist.all_reduce
    start = time.perf_counter()
    for _ in range(LIBRARY_CALLS):
        value = torch.tensor([float(RANK + 1)], device=device)
        all_reduce(value)
        ok = ok and value.item() == world * (world + 1) / 2
    record["calls_s"] = time.perf_counter() - start
    if args.library:
        record["counted"] = all_reduce_count() - counted_before
        record["ran"] = args.steps + LIBRARY_CALLS
    zerocode = sys.modules.get("sarcomm.worker.library.zerocode")
    record["loaded"] = zerocode is not None
    record["instrumented"] = zerocode is not None and bool(zerocode.active())
    record["ok"] = ok
    publish(args.out / f"{os.getpid()}.json", json.dumps(record))
    deadline = time.monotonic() + STOP_WAIT_S
    while not (args.out / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
