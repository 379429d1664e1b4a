"""Rendezvous benchmark: how long N concurrent members take to form a world, sarcomm against torch.

What is measured, for each world size N (default 64, 256, 1024, 4096), in one run and on one machine:

- ``sarcomm``: a real ``sar-coordinator`` process (started here, on loopback, with a SQLite state
  file). The N members are spread over ``--procs`` client processes; each process runs one asyncio
  loop with one ``grpc.aio`` channel (a TCP connection of its own) per member and sends its members'
  ``Join`` calls concurrently through the
  raw generated ``CoordinatorStub`` (one member per call, ``host=f"h{i}"``, one loopback interface).
- ``tcpstore``: the floor, a bare ``torch.distributed.TCPStore`` barrier. One master store; each
  member has its own client connection, does ``add("arrived", 1)``, the one that sees N sets
  ``"go"``, and every member returns from ``wait(["go"])``.
- ``c10d``: torch elastic's ``DynamicRendezvousHandler`` over ``C10dRendezvousBackend`` (what
  ``torchrun --rdzv-backend c10d`` uses), ``min_nodes = max_nodes = N``, one handler and one store
  connection per member, each calling ``next_rendezvous()`` in its own thread. It is known to be
  slow, so it runs under ``--c10d-deadline`` and, once a size fails, larger sizes are skipped.

How: every member's connection is made and every client process reports ready before the clock
starts, so process start-up and imports are excluded. The parent then hands all processes the same
start instant (``time.monotonic()``, which is one system-wide clock on Linux) a little in the
future; each process sleeps until it and releases all its members at once. A member's latency is
the time from that start to its own answer; the world-formation time is the start to the last
answer. Each client process shares the machine's cores with the coordinator (or the master store),
so on a small machine the client side's CPU is part of what is measured, for all three methods
alike. For sarcomm the coordinator's own view is recorded too (``ListJobs``: first join seen and
world formed, relative to the start).

sarcomm and TCPStore run ``--repeats`` rounds per size (the median round is reported; a failed
round is recorded and the next one runs); c10d runs once. Client processes fork from a server that
has imported torch already (``forkserver``), so a round's set-up takes seconds, not tens of them.
Each run also records CPU seconds per round: the coordinator's (or the master store's process's)
and all clients' together, which shows what bounds a round on a small machine.

Run (it stops by itself; about 2 minutes with the defaults on 2 cores, one of them c10d's deadline
at N=256)::

    python benchmarks/rendezvous.py --json benchmarks/results/rendezvous.json \\
        --markdown benchmarks/results/rendezvous.md
    python benchmarks/rendezvous.py --sizes 64,256,1024,2048,4096 --repeats 1
    python benchmarks/rendezvous.py --methods sarcomm --sizes 1024 --repeats 10 \\
        --profile-coordinator coordinator.raw        # py-spy samples; see benchmarks/README.md

Targets this benchmark checks sarcomm against: 1024 members form a world in under 1 s, 4096 in under
4 s, and no member waits more than 3x the median member. Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any, Literal, TypeVar

from harness import CoordinatorProcess, own_channel, process_cpu_seconds
from recording import describe, write_results
from renderers import rendezvous as rendezvous_page
from renderers.rendezvous import OutcomeRow, RoundSummary

# The etcd the tests use (Debian's etcd-server on loopback) serves the etcd methods here too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster

Method = Literal["sarcomm", "tcpstore", "c10d", "sarcomm-etcd", "etcd-v2"]
METHODS: tuple[Method, ...] = ("sarcomm", "tcpstore", "c10d", "sarcomm-etcd", "etcd-v2")
#: The methods run once per size under their own deadline, whose larger sizes are skipped after a miss.
SLOW_METHODS: tuple[Method, ...] = ("c10d", "etcd-v2")
T = TypeVar("T")

LOOPBACK = "127.0.0.1"
# The port a sarcomm member reserves for the torch store; nothing listens on it in this benchmark.
STORE_PORT = 29500
# Time between "everyone is ready" and the common start: long enough for every sleeping client
# process on a busy 2-core machine to be scheduled and waiting before the clock starts.
START_MARGIN_S = 0.3
# How long to keep listening for other client processes' errors after the first one.
ERROR_GRACE_S = 2.0
#: World size -> the time sarcomm must form it in (the performance issue's targets on 2 cores).
TARGETS = {1024: 1.0, 4096: 4.0}
TARGET_SPREAD = 3.0


# -- results ---------------------------------------------------------------------------------------


@dataclass
class Round:
    """One world formation: per-member latencies in seconds from the common start."""

    latencies: list[float]
    # CPU seconds spent from the start to the last answer: all client processes together, and
    # the server side (the coordinator process, or this process, whose thread serves the master
    # TCPStore). With two cores, the two together bound how fast a round can be.
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    # sarcomm only: the coordinator's first-join and formed times, seconds after the start.
    server_first_join_s: float | None = None
    server_formed_s: float | None = None

    @property
    def formation_s(self) -> float:
        return max(self.latencies)

    @property
    def p50_s(self) -> float:
        return statistics.median(self.latencies)

    def summary(self) -> RoundSummary:
        return {
            "formation_s": round(self.formation_s, 6),
            "member_p50_s": round(self.p50_s, 6),
            "member_min_s": round(min(self.latencies), 6),
            "max_over_p50": round(self.formation_s / self.p50_s, 3) if self.p50_s > 0 else None,
            "client_cpu_s": round(self.client_cpu_s, 4),
            "server_cpu_s": round(self.server_cpu_s, 4),
            "server_first_join_s": _rounded(self.server_first_join_s),
            "server_formed_s": _rounded(self.server_formed_s),
        }


@dataclass
class Outcome:
    """Everything measured for one method at one size: the rounds that formed a world, the failures."""

    method: Method
    size: int
    rounds: list[Round] = field(default_factory=list)
    # One line per failed round; the first full message is kept in ``message``.
    failures: list[str] = field(default_factory=list)
    message: str = ""
    timed_out: bool = False
    skipped: bool = False

    @property
    def status(self) -> Literal["ok", "partial", "timeout", "error", "skipped"]:
        """ok: every round formed; partial: some did; timeout/error: none did; skipped: not run."""
        if self.skipped:
            return "skipped"
        if self.rounds:
            return "partial" if self.failures else "ok"
        return "timeout" if self.timed_out else "error"

    @property
    def typical(self) -> Round | None:
        """The median round by formation time (the upper median for an even count)."""
        if not self.rounds:
            return None
        ordered = sorted(self.rounds, key=lambda r: r.formation_s)
        return ordered[len(ordered) // 2]

    def to_json(self) -> OutcomeRow:
        typical = self.typical
        row: OutcomeRow = {
            "method": self.method,
            "size": self.size,
            "status": self.status,
            "ok_rounds": len(self.rounds),
            "failed_rounds": len(self.failures),
            "failures": self.failures,
            "message": self.message,
            "rounds": [r.summary() for r in self.rounds],
        }
        return row if typical is None else {**row, **typical.summary()}  # the median round's figures


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class RoundError(Exception):
    """Raised when a round cannot produce a result: a client failed, or the deadline passed."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


# -- client processes ------------------------------------------------------------------------------
#
# Every client process speaks the same small protocol over its pipe: it sends ("ready",) once its
# members are connected, receives the common start instant (a time.monotonic() value), and sends
# ("result", [(member_index, monotonic_done, rank), ...], cpu_seconds), ("timeout", text) or
# ("error", text).


class Link:
    """A client process's end of its pipe to the parent."""

    def __init__(self, conn: mp_connection.Connection) -> None:
        self.conn = conn
        self.cpu_at_start = 0.0

    def await_start(self, timeout: float) -> float:
        """Report ready; block until the parent sends the start instant (at most ``timeout`` s).

        Raises:
            TimeoutError: no start arrived in time.
        """
        self.conn.send(("ready",))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no start signal from the parent within {timeout:g} s")
        start = self.conn.recv()
        if not isinstance(start, float):
            raise TypeError(f"expected a start time, got {start!r}")
        # Waiting for the start costs no CPU, so from here on the count is the round's alone.
        self.cpu_at_start = time.process_time()
        return start


def _client_main(
    conn: mp_connection.Connection, body: Callable[..., list[tuple[int, float, int]]], *args: Any
) -> None:
    """Entry point of every client process: run ``body`` and report what came of it."""
    # The parent ends stragglers with SIGTERM; exit at once without a traceback on the pipe.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    link = Link(conn)
    try:
        rows = body(link, *args)
        conn.send(("result", rows, time.process_time() - link.cpu_at_start))
    except TimeoutError:
        with contextlib.suppress(OSError):
            conn.send(("timeout", traceback.format_exc()))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when available, as the coordinator does, so clients cost less CPU."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(main)
    return uvloop.run(main)


def _sarcomm_client(
    link: Link, target: str, job: str, size: int, members: list[int], timeout: float
) -> list[tuple[int, float, int]]:
    return _run_async(_sarcomm_members(link, target, job, size, members, timeout))


async def _sarcomm_members(
    link: Link, target: str, job: str, size: int, members: list[int], timeout: float
) -> list[tuple[int, float, int]]:
    import asyncio

    from sarcomm.v1 import coordinator_pb2 as pb
    from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

    lo = pb.NetworkInterface(name="lo", addresses=[LOOPBACK], kind=pb.INTERFACE_KIND_LOOPBACK)
    requests = {
        i: pb.JoinRequest(
            job=job,
            world_size=size,
            host=f"h{i}",
            interfaces=[lo],
            store_port=STORE_PORT,
            join_timeout_seconds=timeout,
        )
        for i in members
    }
    # One TCP connection per member, as a self-registered rank has: TCPStore's and c10d's members
    # each have theirs too.
    channels = {i: own_channel(target) for i in members}
    try:
        # Connect before the clock starts: connection set-up is not what this benchmark measures.
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels.values())), timeout)
        stubs = {i: pb_grpc.CoordinatorStub(c) for i, c in channels.items()}
        start = link.await_start(timeout)
        await asyncio.sleep(max(0.0, start - time.monotonic()))

        async def join(i: int) -> tuple[int, float, int]:
            response = await stubs[i].Join(requests[i], timeout=timeout)
            return i, time.monotonic(), response.assignments[0].rank

        tasks = [asyncio.create_task(join(i)) for i in members]
        _, pending = await asyncio.wait(tasks, timeout=timeout + 1, return_when=asyncio.FIRST_EXCEPTION)
        if any(t.done() and not t.cancelled() and t.exception() for t in tasks):
            # One failed join means the world cannot form. Give the coordinator's other refusals
            # a moment to arrive, so the report says how many and why, then stop waiting.
            await asyncio.wait(pending, timeout=0.5)
            for task in tasks:
                task.cancel()
            raise RuntimeError(_join_failures(tasks, len(members)))
        if pending:
            raise TimeoutError(f"{len(pending)} of {len(members)} joins unanswered after {timeout:g} s")
        return [t.result() for t in tasks]
    finally:
        await asyncio.gather(*(c.close(None) for c in channels.values()))


def _join_failures(tasks: Sequence[Any], total: int) -> str:
    """'k of n joins failed: CODE x count (details), ...' for the failed joins among ``tasks``."""
    import collections

    import grpc

    counts: collections.Counter[str] = collections.Counter()
    for task in tasks:
        if task.cancelled() or not task.done() or task.exception() is None:
            continue
        error = task.exception()
        if isinstance(error, grpc.aio.AioRpcError):
            counts[f"{error.code().name} ({error.details()})"] += 1
        else:
            counts[repr(error)] += 1
    summary = ", ".join(f"{what} x{n}" for what, n in counts.most_common())
    return f"{sum(counts.values())} of {total} joins failed: {summary}"


def _tcpstore_client(
    link: Link, port: int, prefix: str, size: int, members: list[int], timeout: float
) -> list[tuple[int, float, int]]:
    from datetime import timedelta

    import torch.distributed as dist

    stores = {
        i: dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        for i in members
    }

    def member(i: int) -> tuple[int, float, int]:
        arrived = stores[i].add(f"{prefix}/arrived", 1)
        if arrived == size:
            stores[i].set(f"{prefix}/go", "1")
        stores[i].wait([f"{prefix}/go"])
        # The arrival order stands in for a rank, so the parent can check every member counted once.
        return i, time.monotonic(), arrived - 1

    return _run_threads(link, members, member, timeout)


def _c10d_client(
    link: Link, port: int, run_id: str, size: int, members: list[int], timeout: float
) -> list[tuple[int, float, int]]:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    handlers = {}
    for i in members:
        # One store connection per member, as separate nodes would have.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        handlers[i] = DynamicRendezvousHandler.from_backend(
            run_id=run_id,
            store=store,
            backend=C10dRendezvousBackend(store, run_id),
            min_nodes=size,
            max_nodes=size,
            local_addr=LOOPBACK,
            # Longer than our own deadline, so a slow round reads as "did not finish", not an error.
            timeout=RendezvousTimeout(join=timedelta(seconds=timeout + 30)),
        )

    def member(i: int) -> tuple[int, float, int]:
        info = handlers[i].next_rendezvous()
        return i, time.monotonic(), info.rank

    return _run_threads(link, members, member, timeout)


def _etcd_v2_client(
    link: Link, endpoint: str, run_id: str, size: int, members: list[int], timeout: float
) -> list[tuple[int, float, int]]:
    """torch elastic's ``DynamicRendezvousHandler`` over its ``etcd-v2`` backend, built as
    ``torchrun --rdzv-backend etcd-v2 --rdzv-endpoint HOST:PORT`` builds it (``create_backend``):
    one etcd client (python-etcd) and one handler per member."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.api import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    handlers = {}
    for i in members:
        params = RendezvousParameters("etcd-v2", endpoint, run_id, size, size)
        backend, store = create_backend(params)
        handlers[i] = DynamicRendezvousHandler.from_backend(
            run_id=run_id,
            store=store,
            backend=backend,
            min_nodes=size,
            max_nodes=size,
            local_addr=LOOPBACK,
            timeout=RendezvousTimeout(join=timedelta(seconds=timeout + 30)),
        )

    def member(i: int) -> tuple[int, float, int]:
        info = handlers[i].next_rendezvous()
        return i, time.monotonic(), info.rank

    return _run_threads(link, members, member, timeout)


def _run_threads(
    link: Link,
    members: list[int],
    member: Callable[[int], tuple[int, float, int]],
    timeout: float,
) -> list[tuple[int, float, int]]:
    """Run ``member(i)`` for every member in its own thread, all released at the common start."""
    go = threading.Event()
    results: dict[int, tuple[int, float, int] | BaseException] = {}

    def run(i: int) -> None:
        if not go.wait(START_MARGIN_S + timeout):
            results[i] = TimeoutError(f"member {i} was never released")
            return
        try:
            results[i] = member(i)
        except BaseException as error:
            results[i] = error

    start = link.await_start(timeout)
    # Started inside the margin before the start (a few ms for hundreds), so their wait for the
    # release is short. Daemon threads: one stuck in torch's rendezvous must not keep us alive.
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in members]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, start - time.monotonic()))
    go.set()
    deadline = start + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    out = []
    for i in members:
        result = results.get(i)
        if result is None:
            raise TimeoutError(f"member {i} did not finish within {timeout:g} s")
        if isinstance(result, BaseException):
            raise RuntimeError(f"member {i} failed") from result
        out.append(result)
    return out


# -- one round -------------------------------------------------------------------------------------


def _split(size: int, procs: int) -> list[list[int]]:
    """Member indices 0..size-1 in ``min(size, procs)`` contiguous, nearly equal groups."""
    count = min(size, procs)
    base, extra = divmod(size, count)
    groups, first = [], 0
    for p in range(count):
        length = base + (1 if p < extra else 0)
        groups.append(list(range(first, first + length)))
        first += length
    return groups


def _collect(conns: Sequence[mp_connection.Connection], deadline: float, want: str) -> list[Any]:
    """One ``want`` message from every pipe before ``deadline``; raises RoundError otherwise.

    After the first failure it listens up to ERROR_GRACE_S longer, so the error names every
    client process that failed and why, not only the quickest to report.
    """
    pending = {id(c): (n, c) for n, c in enumerate(conns)}
    got: list[Any] = [None] * len(conns)
    errors: list[str] = []
    timed_out = False
    while pending:
        left = deadline - time.monotonic()
        ready = (
            mp_connection.wait([c for _, c in pending.values()], timeout=max(0.0, left)) if left > 0 else []
        )
        if not ready:
            if not errors:
                errors.append(
                    f"{len(pending)} of {len(conns)} client processes had not sent {want!r} in time"
                )
                timed_out = True
            break
        for c in ready:
            n, conn = pending.pop(id(c))
            try:
                message = conn.recv()
            except EOFError:
                message = ("error", f"exited without sending {want!r}")
            if message[0] in ("timeout", "error"):
                timed_out = timed_out or message[0] == "timeout"
                verb = "ran out of time" if message[0] == "timeout" else "failed"
                errors.append(f"client process {n} {verb}:\n{message[1]}")
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            got[n] = message
    if errors:
        raise RoundError("\n".join(errors), timed_out=timed_out)
    return got


def run_round(
    body: Callable[..., list[tuple[int, float, int]]],
    size: int,
    procs: int,
    args: tuple[Any, ...],
    *,
    setup_timeout: float,
    timeout: float,
    server_cpu: Callable[[], float],
) -> tuple[Round, float]:
    """Start client processes running ``body(link, *args, size, members, timeout)``; time them.

    ``server_cpu`` reads the CPU seconds used so far by whatever serves the rendezvous. Blocks for
    at most ``setup_timeout + timeout`` s plus clean-up. Returns the round (latencies in seconds
    after the common start, in member order) and the start as Unix time.

    Raises:
        RoundError: a client failed, the ranks were not exactly 0..size-1, or a deadline passed
            (``timed_out`` is set then).
    """
    ctx = mp.get_context("forkserver")
    groups = _split(size, procs)
    processes, conns = [], []
    try:
        for members in groups:
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(
                target=_client_main, args=(child_end, body, *args, size, members, timeout), daemon=True
            )
            process.start()
            # Without closing our copy, a dead child's pipe would never read as EOF.
            child_end.close()
            processes.append(process)
            conns.append(parent_end)
        _collect(conns, time.monotonic() + setup_timeout, "ready")
        start = time.monotonic() + START_MARGIN_S
        start_wall = time.time() + (start - time.monotonic())
        for c in conns:
            c.send(start)
        cpu_before = server_cpu()
        messages = _collect(conns, start + timeout + 5.0, "result")
        server_cpu_s = server_cpu() - cpu_before
    finally:
        _stop_processes(processes)
        for c in conns:
            c.close()
    done = sorted(row for message in messages for row in message[1])
    ranks = sorted(rank for _, _, rank in done)
    if ranks != list(range(size)):
        raise RoundError(f"ranks handed out are not 0..{size - 1}: {len(set(ranks))} distinct of {size}")
    client_cpu_s = sum(message[2] for message in messages)
    return Round([t - start for _, t, _ in done], client_cpu_s, server_cpu_s), start_wall


def preload_torch() -> None:
    """Import torch once, in the fork server, rather than once per client process per round.

    Importing ``torch.distributed`` costs about 2 s of CPU; eight clients per round on two cores
    made each TCPStore or c10d round spend ~20 s starting up. Nothing in torch has run yet when
    the server forks, so the clients start clean.
    """
    mp.get_context("forkserver").set_forkserver_preload(
        [
            "torch.distributed",
            "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
            "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
            # (a missing module is skipped by the fork server: python-etcd is the bench extra's)
            "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend",
        ]
    )


def _stop_processes(processes: Sequence[mp.process.BaseProcess]) -> None:
    """Let finished clients exit; SIGTERM, then SIGKILL, the ones still running after 5 s."""
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)


# -- the three methods -----------------------------------------------------------------------------


def start_coordinator(
    workdir: Path, log_level: str, profile: Path | None = None, store: str | None = None
) -> CoordinatorProcess:
    """The coordinator the sarcomm rounds join: SQLite by default; with ``store`` (``etcd://...``)
    the one coordinator leads on etcd."""
    return CoordinatorProcess(
        workdir / ("coordinator-etcd.log" if store else "coordinator.log"),
        state=None if store else workdir / "state.sqlite",
        store=store,
        log_level=log_level,
        profile=profile,
        flags=[
            "--join-timeout", "120",
            # Benchmark members never heartbeat; a long liveness window keeps the sweeper from
            # failing an earlier round's members in the middle of a later round's measurement.
            "--heartbeat-interval", "600", "--heartbeat-misses", "1",
        ],
    )  # fmt: skip


class Bench:
    """Runs the rounds of every method; holds the settings shared by all of them."""

    def __init__(
        self,
        args: argparse.Namespace,
        coordinator: CoordinatorProcess | None,
        etcd_coordinator: CoordinatorProcess | None = None,
        etcd: EtcdCluster | None = None,
    ) -> None:
        self.args = args
        self.coordinator = coordinator
        self.etcd_coordinator = etcd_coordinator
        self.etcd = etcd
        self._round = 0

    def run(self, method: Method, size: int) -> Round:
        """One round of ``method`` at ``size``."""
        return {
            "sarcomm": self.sarcomm,
            "tcpstore": self.tcpstore,
            "c10d": self.c10d,
            "sarcomm-etcd": self.sarcomm_etcd,
            "etcd-v2": self.etcd_v2,
        }[method](size)

    def _name(self, method: str, size: int) -> str:
        self._round += 1
        return f"bench-{method}-{size}-{os.getpid()}-{self._round}"

    def sarcomm(self, size: int) -> Round:
        assert self.coordinator is not None
        return self._sarcomm_on(self.coordinator, "sarcomm", size)

    def sarcomm_etcd(self, size: int) -> Round:
        assert self.etcd_coordinator is not None
        coordinator = self.etcd_coordinator
        # The server side is the coordinator and the etcd it writes to, together.
        return self._sarcomm_on(
            coordinator, "sarcomm-etcd", size, lambda: coordinator.cpu_seconds() + self.etcd_cpu_seconds()
        )

    def _sarcomm_on(
        self,
        coordinator: CoordinatorProcess,
        method: str,
        size: int,
        server_cpu: Callable[[], float] | None = None,
    ) -> Round:
        job = self._name(method, size)
        result, start_wall = run_round(
            _sarcomm_client,
            size,
            self.args.procs,
            (coordinator.target, job),
            setup_timeout=self.args.setup_timeout,
            timeout=self.args.timeout,
            server_cpu=server_cpu or coordinator.cpu_seconds,
        )
        result.server_first_join_s, result.server_formed_s = coordinator.job_times(job, start_wall)
        return result

    def etcd_v2(self, size: int) -> Round:
        # The etcd server's CPU is what serves this rendezvous; the clients are measured as for all.
        assert self.etcd is not None
        result, _ = run_round(
            _etcd_v2_client,
            size,
            self.args.procs,
            (self.etcd.endpoints[0], self._name("etcd-v2", size)),
            setup_timeout=self.args.setup_timeout,
            timeout=self.args.etcd_v2_deadline,
            server_cpu=self.etcd_cpu_seconds,
        )
        return result

    def etcd_cpu_seconds(self) -> float:
        """CPU seconds used so far by the etcd server(s)."""
        members = self.etcd.members if self.etcd else []
        return sum(process_cpu_seconds(m.proc.pid) for m in members if m.proc is not None)

    def tcpstore(self, size: int) -> Round:
        with _master_store(self.args.timeout) as port:
            result, _ = run_round(
                _tcpstore_client,
                size,
                self.args.procs,
                (port, self._name("tcpstore", size)),
                setup_timeout=self.args.setup_timeout,
                timeout=self.args.timeout,
                server_cpu=time.process_time,
            )
        return result

    def c10d(self, size: int) -> Round:
        with _master_store(self.args.c10d_deadline) as port:
            result, _ = run_round(
                _c10d_client,
                size,
                self.args.procs,
                (port, self._name("c10d", size)),
                setup_timeout=self.args.setup_timeout,
                timeout=self.args.c10d_deadline,
                server_cpu=time.process_time,
            )
        return result


@contextlib.contextmanager
def _master_store(timeout: float) -> Any:
    """A master ``TCPStore`` on a free loopback port, served by a thread of this process."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        LOOPBACK, 0, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    try:
        yield store.port
    finally:
        del store


def unavailable(method: Method) -> str | None:
    """Why ``method`` cannot run on this machine, or None when it can."""
    if method in ("sarcomm-etcd", "etcd-v2") and ETCD_MISSING:
        return ETCD_MISSING
    if method == "etcd-v2":
        try:
            import etcd  # noqa: F401  (python-etcd: torch's etcd-v2 backend needs it)
        except ImportError:
            return "python-etcd is not installed (pip install -e '.[bench]')"
    return None


def deadline_of(args: argparse.Namespace, method: Method) -> float:
    """The seconds one round of ``method`` may take."""
    deadlines = {"c10d": args.c10d_deadline, "etcd-v2": args.etcd_v2_deadline}
    return float(deadlines.get(method, args.timeout))


def _skip(
    args: argparse.Namespace,
    method: Method,
    size: int,
    missing: dict[Method, str],
    failed_at: dict[Method, int],
) -> Outcome | None:
    """A skipped outcome when ``method`` does not run at ``size``, else None."""
    if method in missing:
        return Outcome(method, size, skipped=True, message=missing[method])
    if method == "etcd-v2" and size not in args.etcd_v2_sizes:
        return Outcome(method, size, skipped=True, message=f"not in --etcd-v2-sizes {args.etcd_v2_sizes}")
    missed = failed_at.get(method)
    if missed is not None and size > missed:
        message = f"{method} did not finish N={missed} within {deadline_of(args, method):g} s"
        return Outcome(method, size, skipped=True, message=message)
    return None


def measure(bench: Bench, method: Method, size: int, repeats: int) -> Outcome:
    """``repeats`` rounds of ``method`` at ``size``.

    A round that fails outright is recorded and the next one runs (a flaky failure should not hide
    the timings); a round that runs out of time ends the series, since the next would too.
    """
    outcome = Outcome(method, size)
    for _ in range(repeats):
        try:
            outcome.rounds.append(bench.run(method, size))
        except RoundError as error:
            outcome.failures.append(_first_line(str(error), error.timed_out))
            outcome.message = outcome.message or str(error)
            if error.timed_out:
                outcome.timed_out = True
                deadline = deadline_of(bench.args, method)
                outcome.failures[-1] = f"did not finish within {deadline:g} s"
                break
    return outcome


def _first_line(message: str, timed_out: bool) -> str:
    """What went wrong in a round, one line: each client's headline and its exception's last line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "timed out" if timed_out else "failed"
    # Each client's report starts "client process N ..." and, if a traceback follows, the line
    # that names the exception is the last one before the next report.
    parts: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("client process ") or i == 0:
            parts.append(line)
        elif i + 1 == len(lines) or lines[i + 1].startswith("client process "):
            parts[-1] = f"{parts[-1]} {line}"
    return "; ".join(parts)


# -- report ----------------------------------------------------------------------------------------


def _cell(outcome: Outcome | None, deadline: float) -> str:
    if outcome is None:
        return "-"
    typical = outcome.typical
    if typical is not None:
        failed = len(outcome.failures)
        total = failed + len(outcome.rounds)
        return f"{typical.formation_s:.3f}" + (f" ({failed}/{total} failed)" if failed else "")
    if outcome.status == "timeout":
        return f"DNF in {deadline:g}"
    return outcome.status


def verdict(outcomes: Sequence[Outcome]) -> str:
    """Whether sarcomm (on SQLite, and on etcd where it ran) met the targets (TARGETS) at the
    sizes measured, a sentence for each."""
    sentences = []
    for method, size in ((m, n) for m in ("sarcomm", "sarcomm-etcd") for n in TARGETS):
        seconds = TARGETS[size]
        s = next((o for o in outcomes if o.method == method and o.size == size), None)
        if s is None or s.skipped:
            continue
        if s.typical is None:
            sentences.append(f"{method} target not checked: no successful round at N={size}.")
            continue
        r = s.typical
        spread = r.formation_s / r.p50_s
        ok = r.formation_s < seconds and spread <= TARGET_SPREAD and not s.failures
        rounds = len(s.failures) + len(s.rounds)
        failed = f", {len(s.failures)} of {rounds} rounds failed" if s.failures else ""
        sentences.append(
            f"{method} at N={size}: {r.formation_s:.3f} s (target < {seconds:g} s), "
            f"max/p50 {spread:.2f} (target <= {TARGET_SPREAD:g}){failed}: {'MET' if ok else 'MISSED'}."
        )
    return " ".join(sentences) or f"sarcomm targets not checked: no size of {sorted(TARGETS)} was measured."


def machine() -> dict[str, Any]:
    """What the numbers were measured on (see recording.describe)."""
    return describe("torch", "grpcio", "python-etcd", load_at="end", etcd=_etcd_version())


def _etcd_version() -> str | None:
    """The etcd server's version (``etcd --version``'s first line), or None when it is absent."""
    if ETCD_MISSING:
        return None
    out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=10, check=False)
    return out.stdout.splitlines()[0].split(":", 1)[-1].strip() if out.stdout else None


# -- main ------------------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes {text!r} must be a comma-separated list of positive ints")
    return sizes


def _methods(text: str) -> list[Method]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"--methods {text!r}: each must be one of {', '.join(METHODS)}")
    return chosen  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default="64,256,1024,4096",
        help="world sizes, comma-separated (e.g. 64,256,1024,2048,4096)",
    )
    parser.add_argument(
        "--methods",
        type=_methods,
        default=",".join(METHODS),
        help=f"which to run, comma-separated, from {','.join(METHODS)}",
    )
    parser.add_argument("--procs", type=int, default=8, help="client processes the members are spread over")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds per size for sarcomm and TCPStore (the median is reported)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds one sarcomm or TCPStore round may take once started",
    )
    parser.add_argument(
        "--c10d-deadline",
        type=float,
        default=60.0,
        help="seconds one c10d round may take; after a miss, larger sizes are skipped",
    )
    parser.add_argument(
        "--etcd-v2-deadline",
        type=float,
        default=60.0,
        help="seconds one etcd-v2 round may take; after a miss, larger sizes are skipped",
    )
    parser.add_argument(
        "--etcd-v2-sizes",
        type=_sizes,
        default="64,256,1024",
        help="the sizes of --sizes that etcd-v2 runs at",
    )
    parser.add_argument(
        "--setup-timeout",
        type=float,
        default=120.0,
        help="seconds the client processes may take to start and connect",
    )
    parser.add_argument(
        "--coordinator-log-level",
        default="INFO",
        help="the coordinator's --log-level (INFO is what a deployment runs)",
    )
    parser.add_argument(
        "--profile-coordinator",
        type=Path,
        metavar="PATH",
        help="sample the coordinator with py-spy (pip install py-spy) into PATH, in py-spy's raw "
        "(collapsed stacks) format; the sampling costs CPU, so do not record timings from such a run",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the coordinator's log and state file here; without it they go to a temporary "
        "directory that is removed at the end",
    )
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table, command and machine here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.procs < 1 or args.repeats < 1:
        print("--procs and --repeats must be >= 1", file=sys.stderr)
        return 2
    command = (
        shlex.join([Path(sys.executable).name, *sys.argv])
        if argv is None
        else shlex.join(["python", "benchmarks/rendezvous.py", *argv])
    )
    if {"tcpstore", "c10d", "etcd-v2"} & set(args.methods):
        # TCPStore clients reverse-resolve their socket's address ([::ffff:127.0.0.1]) as they
        # connect; where no DNS server answers, each such lookup stalls 5 s. Only the clients'
        # set-up, outside the clock, is affected, but it made rounds last minutes. One-second
        # lookups (glibc reads RES_OPTIONS) keep a full run short; the fork server inherits it.
        os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
        # ... and each failed lookup logs a warning from C++; they are noise here.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        preload_torch()
    outcomes: list[Outcome] = []
    # method -> the size it missed its deadline at; its larger sizes are skipped.
    failed_at: dict[Method, int] = {}
    missing = {m: why for m in args.methods if (why := unavailable(m))}
    for method, why in missing.items():
        print(f"{method}: not run: {why}", file=sys.stderr)
    load_at_start = round(os.getloadavg()[0], 2)
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sarcomm-rdzv-")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        runnable = [m for m in args.methods if m not in missing]
        etcd = None
        if {"sarcomm-etcd", "etcd-v2"} & set(runnable):
            # One etcd member, the v2 API on for torch's backend; sarcomm's store uses v3 of the same.
            etcd = EtcdCluster(workdir / "etcd", size=1, enable_v2=True)
            stack.callback(etcd.close)
            etcd.start()
        coordinators: dict[Method, CoordinatorProcess] = {}
        served: tuple[Method, ...] = ("sarcomm", "sarcomm-etcd")
        for method in served:
            if method in runnable:
                store = etcd.url(f"bench-{os.getpid()}") if method == "sarcomm-etcd" and etcd else None
                coordinators[method] = stack.enter_context(
                    start_coordinator(
                        workdir, args.coordinator_log_level, args.profile_coordinator, store=store
                    )
                )
        bench = Bench(args, coordinators.get("sarcomm"), coordinators.get("sarcomm-etcd"), etcd)
        for method, coordinator in coordinators.items():
            # One small world first, so the coordinator's first-call costs fall outside the table.
            try:
                bench.run(method, min(8, min(args.sizes)))
            except RoundError as error:
                print(
                    f"{method}: warm-up world of 8 did not form; see {coordinator.log_path}:\n{error}",
                    file=sys.stderr,
                )
                return 1
        for size in args.sizes:
            for method in args.methods:
                outcome = _skip(args, method, size, missing, failed_at)
                if outcome is None:
                    repeats = 1 if method in SLOW_METHODS else args.repeats
                    began = time.monotonic()
                    outcome = measure(bench, method, size, repeats)
                    print(
                        f"{method:>12} N={size:<5} {outcome.status:<7} "
                        f"{_cell(outcome, deadline_of(args, method)):>14}  "
                        f"({time.monotonic() - began:.0f} s wall)"
                        + "".join(f"\n             {line}" for line in sorted(set(outcome.failures))),
                        flush=True,
                    )
                    if method in SLOW_METHODS and outcome.status != "ok":
                        failed_at[method] = size
                outcomes.append(outcome)
    doc = {
        "benchmark": "rendezvous",
        "command": command,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {**machine(), "loadavg_1m_at_start": load_at_start},
        "verdict": verdict(outcomes),
        "results": [o.to_json() for o in outcomes],
    }
    print()
    write_results(doc, rendezvous_page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
