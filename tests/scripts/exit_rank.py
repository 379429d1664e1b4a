"""One rank of a job that trains briefly and exits: ``python exit_rank.py MODE RANK WORLD PORT OUTFILE``.

Mode ``train`` is the exit after training, below. Mode ``silent-peer`` is an exit while a
collective still waits: rank 0 starts an ``all_reduce`` that the last rank never joins, writes
OUTFILE and ends with ``sys.exit(3)``; the last rank stays alive and silent until its standard
input closes.

Mode ``train``: initialises sarcomm's communication on 127.0.0.1 (gloo, interface from
``SAR_SOCKET_NAME``), runs the collectives SAR's training loop ends with (``all_to_all`` of unequal
sizes, ``all_reduce`` synchronous and asynchronous, ``exchange_tensors``), several rounds, writes
what it received to OUTFILE as JSON, runs one last ``all_reduce`` (a wrong sum fails the rank) and
returns normally: the process groups are destroyed by sarcomm's exit hook, which is the path under
test (the script never calls ``destroy_comms`` itself). The last step is arranged so that a gloo
thread needs the GIL at the moment the exit hook starts, which is when the hang happened.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.scripts.published import publish

ROUNDS = 5
#: Bounds the last step's poll (it takes milliseconds).
LAST_STEP_S = 30.0
#: How often the poll lets other threads have the GIL.
YIELD_EVERY_S = 0.005


def rows(src: int, dst: int) -> int:
    """Rows ``src`` sends ``dst``: unequal between most pairs, zero for some."""
    return (src * 7 + dst * 3 + 1) % 4 * 3


def main(argv: list[str]) -> int:
    mode, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])

    import torch

    import sarcomm.worker as sar

    sar.initialize_comms(rank, world, "127.0.0.1", "gloo", master_port_number=port)
    if mode == "silent-peer":
        return silent_peer(rank, world, out)
    wrong: list[str] = []
    for round_ in range(ROUNDS):
        send = [torch.full((rows(rank, dst), 4), float(100 * rank + dst + round_)) for dst in range(world)]
        recv = [torch.empty(rows(src, rank), 4) for src in range(world)]
        sar.all_to_all(recv, send)
        for src in range(world):
            if not torch.equal(recv[src], torch.full((rows(src, rank), 4), float(100 * src + rank + round_))):
                wrong.append(f"round {round_}: all_to_all from {src}")
        total = torch.full((3,), float(rank + 1))
        sar.all_reduce(total, torch.distributed.ReduceOp.SUM)
        if total.tolist() != [world * (world + 1) / 2] * 3:
            wrong.append(f"round {round_}: all_reduce gave {total.tolist()}")
        pending = torch.full((2,), float(rank))
        waiting = sar.all_reduce(pending, torch.distributed.ReduceOp.MAX, async_op=True)
        assert waiting is not None
        waiting.wait()
        if pending.tolist() != [world - 1.0] * 2:
            wrong.append(f"round {round_}: async all_reduce gave {pending.tolist()}")
        got = sar.exchange_tensors([torch.tensor([rank, dst, round_]) for dst in range(world)])
        if [g.tolist() for g in got] != [[src, rank, round_] for src in range(world)]:
            wrong.append(f"round {round_}: exchange_tensors gave {[g.tolist() for g in got]}")
    # Written before the last step: the test times the exit from the moment this file appears.
    publish(out, json.dumps({"rank": rank, "rounds": ROUNDS, "wrong": wrong}))
    # The last step, made to hit the exit's race every time: the main thread keeps the GIL from
    # the last collective's end to the exit hook (it polls instead of blocking, and hands the GIL to
    # no waiting thread for a minute), while a gloo thread needs the GIL to finish that collective:
    # it runs a callback on its future (as DDP's communication hooks do) and frees its tensor.
    sar.barrier()  # blocking: gloo's threads finish what earlier steps left them meanwhile
    sys.setswitchinterval(60.0)
    last = torch.ones(1024)
    handle = sar.all_reduce(last, torch.distributed.ReduceOp.SUM, async_op=True)
    assert handle is not None
    future = handle.get_future()
    future.then(lambda done: done.value()[0].sum())
    deadline = yielded = time.monotonic()
    deadline += LAST_STEP_S
    while not future.done():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"the last all_reduce did not finish within {LAST_STEP_S} s")
        if now - yielded > YIELD_EVERY_S:
            # A gloo thread still waiting for the GIL for an earlier collective would keep this
            # one from running, here or on a peer: let it have the GIL, briefly and rarely.
            time.sleep(0)
            yielded = now
    if last.tolist() != [float(world)] * 1024:
        raise AssertionError(f"the last all_reduce gave {last[:4].tolist()}..., not {world}")
    del last, handle, future
    return 0


def silent_peer(rank: int, world: int, out: Path) -> int:
    import torch

    import sarcomm.worker as sar

    if rank == world - 1:
        sys.stdin.read()  # silent until the test closes our standard input
        return 0
    # Never completes: the last rank does not join. The exit hook must end the groups anyway.
    handle = sar.all_reduce(torch.ones(8), torch.distributed.ReduceOp.SUM, async_op=True)
    publish(out, json.dumps({"rank": rank, "pending": handle is not None}))
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
