"""Run a function in N local processes joined into one gloo group through ``initialize_comms``.

``run_gloo(world_size, fn)`` starts ``world_size`` spawned processes; each initialises sarcomm's
communication on 127.0.0.1 (interface ``lo`` through ``SAR_SOCKET_NAME``), calls
``fn(rank, world_size)`` and sends back its (picklable) result. With ``coord`` the ranks start as
SAR's examples do, through the coordinator: ``coord_ip_init`` then ``initialize_comms`` with the
port the coordinator handed out; without it, on an explicit free port. The
answer is ``{rank: result}``. Every wait has a deadline: a rank that raises, dies or does not
finish in time fails the run with its traceback or exit code, and the other ranks are killed.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.multiprocessing as mp

from tests.helpers import free_port

T = TypeVar("T")

#: Whole-run deadline by default: four spawned processes import torch on two cores in ~10 s.
DEFAULT_DEADLINE_S = 90.0
#: The collective timeout the ranks run with, so that a wedged collective fails inside the run.
RANK_COLLECTIVE_TIMEOUT_S = 30


class GlooRunError(AssertionError):
    """Raised when a rank raised, died or missed the deadline; the message says which and why."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[[int, int], Any],
    results: Any,
    env: dict[str, str],
    coord: tuple[str, str] | None,
) -> None:
    os.environ.update(env)
    try:
        from sarcomm.worker.library import comm, registration

        if coord is None:
            comm.initialize_comms(rank, world_size, "127.0.0.1", "gloo", master_port_number=port)
        else:
            target, job = coord
            master_ip = registration.coord_ip_init(rank, target, job=job, world_size=world_size, timeout=60)
            comm.initialize_comms(rank, world_size, master_ip, "gloo")
        try:
            value = fn(rank, world_size)
        finally:
            comm.destroy_comms()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_gloo(
    world_size: int,
    fn: Callable[[int, int], T],
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    env: dict[str, str] | None = None,
    coord: tuple[str, str] | None = None,
) -> dict[int, T]:
    """``{rank: fn(rank, world_size)}`` from ``world_size`` gloo ranks on loopback; ``coord``,
    ``(HOST:PORT, job name)``, starts them through that coordinator.

    ``fn`` must be a module-level function (it is pickled into spawned processes) and return
    something picklable. Raises :class:`GlooRunError` when any rank fails or the deadline passes.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    rank_env = {
        "SAR_SOCKET_NAME": "lo",
        "SAR_COLLECTIVE_TIMEOUT": str(RANK_COLLECTIVE_TIMEOUT_S),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, port, fn, results, rank_env, coord), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + deadline_s
    done: dict[int, T] = {}
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise GlooRunError(f"ranks {missing} did not finish within {deadline_s} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    (r, p.exitcode)
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in done
                ]
                if dead:
                    raise GlooRunError(f"ranks exited without a result (rank, exit code): {dead}") from None
                continue
            if not ok:
                raise GlooRunError(f"rank {rank} raised:\n{value}")
            done[rank] = value
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 1.0))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        results.close()
        results.join_thread()
    return done
