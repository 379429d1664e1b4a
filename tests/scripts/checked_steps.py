"""The training loop the rank scripts share: all_reduces with checked values, one JSON line a step.

Each step all-reduces ``rank + 1`` (the sum must be ``W (W + 1) / 2``) and a stop flag (set once
the file ``OUT_DIR/stop`` exists, on any rank: all ranks then stop at the same step). Every step is
one JSON line with the script's ``record``, the step, the time and whether the value was right; the
last line of a rank that stopped says ``done``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

#: ``all_reduce(tensor, op=...)``: torch.distributed's or sarcomm's.
AllReduce = Callable[..., object]
#: The exit code a rank fails with on purpose after ``step`` steps, or None.
FailAt = Callable[[int], "int | None"]


def run_steps(
    all_reduce: AllReduce,
    stop_dir: Path,
    out: TextIO,
    record: dict[str, Any],
    *,
    step_s: float,
    fail_at: FailAt = lambda step: None,
) -> int:
    """Train until the stop flag is set on any rank; the number of steps made. A rank that
    ``fail_at`` names exits with its code (``os._exit``, no teardown: a failure on purpose)."""
    rank, world = int(record["rank"]), int(record["world"])
    expected = world * (world + 1) / 2
    step = 0
    while True:
        value = torch.tensor([float(rank + 1)])
        all_reduce(value)
        stop = torch.tensor([1.0 if (stop_dir / "stop").exists() else 0.0])
        all_reduce(stop, op=dist.ReduceOp.MAX)
        step += 1
        ok = value.item() == expected
        out.write(json.dumps({**record, "step": step, "time": time.time(), "ok": ok}) + "\n")
        if stop.item():
            break
        code = fail_at(step)
        if code is not None:
            print(f"rank {rank} fails on purpose with code {code}", file=sys.stderr, flush=True)
            out.close()
            os._exit(code)
        time.sleep(step_s)
    out.write(json.dumps({**record, "step": step, "time": time.time(), "done": True}) + "\n")
    return step
