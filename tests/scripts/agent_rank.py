"""One rank of the ``sar-worker`` end-to-end tests: ``python agent_rank.py MODE OUTDIR [ARGS]``.

Modes:
    collectives OUTDIR        ``sar.init()``, gloo all_reduce and all_to_all (unequal sizes), its
                              own /metrics and the coordinator's /sd (``TEST_COORD_HTTP``), and
                              write what it saw to ``OUTDIR/rank<R>.json``.
    fail OUTDIR RANK CODE     rank RANK exits with CODE after a moment; the others wait (at most
                              60 s) to be stopped by their agent.
    restart OUTDIR RANK CODE  like ``fail`` in the first generation; after a restart every rank
                              writes ``OUTDIR/rank<R>.restart<N>`` and exits 0.
    sleep OUTDIR SECONDS      every rank sleeps, then exits 0.
    hang OUTDIR RANK          every rank stamps a progress record; rank RANK then stops itself
                              (SIGSTOP) while its process lives on.
    failover OUTDIR           ``sar.init()``, an all_reduce, ``OUTDIR/rank<R>.before``; then waits
                              (at most 120 s) for ``OUTDIR/go`` (the test moves the coordinator
                              meanwhile), runs all_reduce and all_to_all (unequal sizes) and writes
                              what it got and its SAR_COORD to ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Run as a file (its own folder on sys.path): the repository root makes the tests' helpers importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import wait_for, wait_for_sd
from tests.scripts.published import publish

CONTRACT_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SAR_COORD",
    "SAR_JOB", "SAR_GENERATION", "SAR_BACKEND", "SAR_SOCKET_NAME", "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "CCL_SOCKET_IFNAME", "SAR_MEMBER_ID", "SAR_MEMBER_SECRET",
    "SAR_RESTART_COUNT", "SAR_METRICS_PORT",
)  # fmt: skip

# Bounds every wait of a rank that is meant to be stopped by its agent.
WAIT_FOR_STOP_S = 60.0


def collectives(out: Path) -> int:
    import dataclasses

    import torch
    import torch.distributed as dist

    import sarcomm.worker as sar

    info = sar.init()
    rank, world = info.rank, info.world_size
    summed = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    sar.all_reduce(summed)
    # Unequal sizes on purpose: rank r sends r+d+1 values of 100*r+d to rank d.
    send = [torch.full((rank + dst + 1,), float(100 * rank + dst)) for dst in range(world)]
    recv = [torch.zeros(src + rank + 1) for src in range(world)]
    sar.all_to_all(recv, send)
    from sarcomm.worker.library import metrics

    port = metrics.serving_port()
    result = {
        "metrics_port": port,
        "metrics": _get(f"http://127.0.0.1:{port}/metrics") if port else "",
        "sd": _sd(info.job, world),
        "info": dataclasses.asdict(info),
        "env": {name: os.environ.get(name) for name in CONTRACT_VARIABLES},
        "agent": os.environ.get("TEST_AGENT"),
        "all_reduce": summed.tolist(),
        "all_to_all": [t.tolist() for t in recv],
    }
    publish(out / f"rank{rank}.json", json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _sd(job: str, world: int) -> list[dict[str, Any]]:
    """The coordinator's /sd groups of ``job`` once all ``world`` ranks are listed ([] when the
    test gave no ``TEST_COORD_HTTP``); fails the rank after 20 s."""
    url = os.environ.get("TEST_COORD_HTTP")
    return wait_for_sd(url, job, world, timeout=20.0) if url else []


def fail(out: Path, failing_rank: int, code: int) -> int:
    rank = int(os.environ["RANK"])
    publish(out / f"rank{rank}.started", os.environ["SAR_GENERATION"])
    if rank == failing_rank:
        time.sleep(0.5)
        return code
    time.sleep(WAIT_FOR_STOP_S)
    return 0


def hang(out: Path, hanging_rank: int) -> int:
    """Keep a progress record like sarcomm's library does; rank ``hanging_rank`` stops itself."""
    import signal
    import threading

    from sarcomm.worker.progress import ProgressWriter

    rank = int(os.environ["RANK"])
    writer = ProgressWriter(Path(os.environ["SAR_PROGRESS_FILE"]))
    writer.enter("all_reduce")
    interval = float(os.environ["SARCOMM_HEARTBEAT_INTERVAL"])
    stop = threading.Event()

    def stamp() -> None:
        while not stop.wait(interval):
            writer.publish()

    threading.Thread(target=stamp, daemon=True).start()
    publish(out / f"rank{rank}.started", os.environ["SAR_GENERATION"])
    if rank == hanging_rank:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGSTOP)  # wedged: the process exists but does nothing
    time.sleep(WAIT_FOR_STOP_S)
    return 0


def sleep(out: Path, seconds: float) -> int:
    rank = int(os.environ["RANK"])
    publish(out / f"rank{rank}.started", os.environ["SAR_GENERATION"])
    time.sleep(seconds)
    publish(out / f"rank{rank}.done", os.environ["SAR_GENERATION"])
    return 0


def restart(out: Path, failing_rank: int, code: int) -> int:
    restarts = int(os.environ["SAR_RESTART_COUNT"])
    if restarts == 0:
        return fail(out, failing_rank, code)
    rank = int(os.environ["RANK"])
    publish(out / f"rank{rank}.restart{restarts}", os.environ["SAR_GENERATION"])
    return 0


def failover(out: Path) -> int:
    import torch
    import torch.distributed as dist

    import sarcomm.worker as sar

    info = sar.init()
    rank, world = info.rank, info.world_size
    before = torch.tensor([float(rank + 1)])
    sar.all_reduce(before)
    publish(out / f"rank{rank}.before", str(before.item()))
    wait_for((out / "go").exists, 120.0, what="the test's go after moving the coordinator", interval=0.1)
    summed = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    sar.all_reduce(summed)
    send = [torch.full((rank + dst + 1,), float(100 * rank + dst)) for dst in range(world)]
    recv = [torch.zeros(src + rank + 1) for src in range(world)]
    sar.all_to_all(recv, send)
    result = {
        "coord": os.environ.get("SAR_COORD"),
        "before": before.tolist(),
        "all_reduce": summed.tolist(),
        "all_to_all": [t.tolist() for t in recv],
    }
    publish(out / f"rank{rank}.json", json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    mode, out = argv[0], Path(argv[1])
    if mode == "collectives":
        return collectives(out)
    if mode == "fail":
        return fail(out, int(argv[2]), int(argv[3]))
    if mode == "sleep":
        return sleep(out, float(argv[2]))
    if mode == "hang":
        return hang(out, int(argv[2]))
    if mode == "restart":
        return restart(out, int(argv[2]), int(argv[3]))
    if mode == "failover":
        return failover(out)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
