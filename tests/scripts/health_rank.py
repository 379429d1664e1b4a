"""One rank of the failure tests (``tests/test_health.py``): an all_reduce loop the test can disturb.

Under ``sar-worker``::

    python health_rank.py CONTROL_DIR

Registered by itself (library mode: SAR's ``coord_ip_init`` + ``initialize_comms``)::

    python health_rank.py CONTROL_DIR COORD JOB RANK WORLD

Each rank writes ``CONTROL_DIR/rank<R>.pid`` once communication is up, then runs all_reduce in a
loop (a short pause between calls), checking each result. The test steers it through files:

    slow    holds a rank number: that rank sleeps SLOW_S before each all_reduce, alive (its
            progress keeps being stamped) but late, so the others wait for it in the collective.
    stop    every rank leaves the loop at the same iteration (agreed through the all_reduce itself,
            so no rank leaves a peer waiting) and exits 0.

How it ends is written to ``CONTROL_DIR/rank<R>.gen<G>.json``: the iterations, wrong results and,
when a collective raised ``PeerFailedError``, its message, rank and Unix time (then it exits 3).

After a restart (``SAR_RESTART_COUNT`` > 0) each rank runs RESTART_ITERS iterations with rank
dependent values and exits 0: the test checks the results are right in the new world. A rank also
gives up by itself after DEADLINE_S, whatever happens to the test.
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

PAUSE_S = 0.02
SLOW_S = 1.5
RESTART_ITERS = 20
DEADLINE_S = 120.0


def main(argv: list[str]) -> int:
    import torch

    import sarcomm.worker as sar

    control = Path(argv[0])
    if len(argv) > 1:
        coord, job, rank, world = argv[1], argv[2], int(argv[3]), int(argv[4])
        master = sar.coord_ip_init(rank, coord, job=job, world_size=world)
        sar.initialize_comms(rank, world, master, "gloo")
        generation, restarts = int(os.environ["SAR_GENERATION"]), 0
    else:
        info = sar.init()
        rank, world, generation, restarts = info.rank, info.world_size, info.generation, info.restart_count
    publish(control / f"rank{rank}.pid", str(os.getpid()))
    result: dict[str, object] = {"rank": rank, "generation": generation, "restarts": restarts}
    iterations, wrong = 0, 0
    deadline = time.monotonic() + DEADLINE_S
    slow_file, stop_file = control / "slow", control / "stop"
    code = 0
    try:
        while True:
            if restarts == 0 and slow_file.exists() and slow_file.read_text().strip() == str(rank):
                time.sleep(SLOW_S)
            # [stop wanted, rank + 1 + iteration]: the sum says whether anyone stops, and is checked.
            values = torch.tensor([0.0, float(rank + 1 + iterations)])
            values[0] = float(stop_file.exists() or time.monotonic() > deadline)
            sar.all_reduce(values)
            expected = world * (world + 1) / 2 + world * iterations
            wrong += int(values[1].item() != expected)
            iterations += 1
            if values[0] > 0 or (restarts > 0 and iterations >= RESTART_ITERS):
                break
            time.sleep(PAUSE_S)
    except sar.PeerFailedError as error:
        result["error"] = {"message": str(error), "rank": error.rank, "raised_at": time.time()}
        code = 3
    result.update(iterations=iterations, wrong=wrong)
    publish(control / f"rank{rank}.gen{generation}.json", json.dumps(result))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
