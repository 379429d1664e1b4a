"""Soak: simulated members join, heartbeat and leave in waves; the coordinator's memory must come
back to its baseline.

What runs: a real ``sar-coordinator`` (started here on 127.0.0.1 with a SQLite state file and
default limits, or ``--coord``/``--pid`` to use one that runs already) and, in this process, one
asyncio loop with one gRPC channel that plays ``--members`` members (default 1,000) in ``--jobs``
jobs (default 10, 100 members each). Every wave:

1. every member joins: half the jobs as agents would (hosts of ``--per-host`` members, one Join
   per host), the other half as self-registering processes (one Join per member); so a wave holds
   hundreds of joins waiting at once;
2. every host (or process) keeps one Heartbeat stream open and reports every ``--interval``
   seconds for ``--beats`` reports;
3. every member leaves with exit code 0, except in one job per wave, where one member exits 1
   (the job fails and its other members are told, as in a real failure) before the rest leave.

The job names are the same every wave, so each wave is a new generation of each job, as for a job
that is run again and again. After every wave the coordinator's resident memory (RSS), open file
descriptors and threads are recorded. The baseline is the RSS after the warm-up waves (the first
``--warmup``, default 2: allocator arenas and gRPC's pools grow to their working size then); the
result says whether the last wave's RSS stayed within ``--tolerance-mib`` of it, and the largest
RSS seen.

Run (the recorded result; about 5 minutes on 2 cores)::

    python benchmarks/soak.py --duration 300 --json benchmarks/results/soak.json \\
        --markdown benchmarks/results/soak.md

``tests/test_soak.py`` runs it with ``--duration 36 --beats 2``. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from harness import CoordinatorProcess
from recording import write_results
from renderers import soak as soak_page
from renderers.soak import Wave

from sarcomm.common.client.coordinator_client import CoordinatorClient
from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.common.messages import JoinResult, MemberReport

LO = InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK)
# Waves whose lowest RSS makes the baseline (after the warm-up) and the final value.
WINDOW = 3


def _slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index (MiB per wave)."""
    if len(values) < 2:
        return 0.0
    mean_x, mean_y = (len(values) - 1) / 2, statistics.fmean(values)
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(len(values)))
    return round(num / den, 3)


@dataclass
class Result:
    members: int
    jobs: int
    per_host: int
    waves: list[Wave] = field(default_factory=list)
    baseline_rss_mib: float = 0.0
    final_rss_mib: float = 0.0
    max_rss_mib: float = 0.0
    tolerance_mib: float = 0.0
    rss_trend_mib_per_wave: float = 0.0
    returned_to_baseline: bool = False
    duration_s: float = 0.0
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)


async def _member_group(
    client: CoordinatorClient, job: str, world_size: int, host: str, count: int, args: argparse.Namespace
) -> JoinResult:
    return await client.join_many(
        job, world_size, nproc=count, host=host, interfaces=[LO], store_port=29500, join_timeout=120
    )


async def _beat(client: CoordinatorClient, result: JoinResult, args: argparse.Namespace) -> int:
    """One Heartbeat stream for one host (or process): ``--beats`` reports, then an orderly end."""
    reports = [MemberReport(a.member_id, a.secret) for a in result.assignments]
    received = 0
    async with client.heartbeats(lambda: reports, args.interval) as stream:
        async for _reply in stream:
            received += 1
            if received >= args.beats:
                break
    return received


async def _wave(client: CoordinatorClient, index: int, args: argparse.Namespace, rng: random.Random) -> Wave:
    started = time.monotonic()
    world = args.members // args.jobs
    groups: list[tuple[str, str, int]] = []  # (job, host, members)
    for j in range(args.jobs):
        job = f"soak-{j}"
        if j % 2 == 0:  # agents: one Join for a host's members
            groups += [(job, f"host-{j}-{h}", args.per_host) for h in range(world // args.per_host)]
        else:  # processes that register themselves: one Join each
            groups += [(job, f"proc-{j}-{m}", 1) for m in range(world)]
    rng.shuffle(groups)
    results = await asyncio.gather(
        *(_member_group(client, job, world, host, n, args) for job, host, n in groups)
    )
    joined = sum(len(r.assignments) for r in results)
    reports = sum(await asyncio.gather(*(_beat(client, r, args) for r in results)))
    # One job per wave fails: one of its members exits 1, the rest then leave with 0.
    failing = f"soak-{index % args.jobs}"
    first_failure = next(r for r in results if r.job == failing)
    await client.leave(first_failure.assignments[0].member_id, first_failure.assignments[0].secret, 1, "soak")
    leaves = [
        client.leave(a.member_id, a.secret, 0)
        for r in results
        for a in r.assignments
        if a is not first_failure.assignments[0]
    ]
    await asyncio.gather(*leaves)
    jobs = await client.list_jobs()
    return {
        "index": index,
        "seconds": round(time.monotonic() - started, 2),
        "joined": joined,
        "reports": reports,
        "finished_jobs": sum(1 for j in jobs if j.state == "FINISHED"),
        "failed_jobs": sum(1 for j in jobs if j.state == "FAILED"),
        "rss_mib": 0.0,
        "fds": 0,
        "threads": 0,
    }


async def soak(target: str, pid: int, args: argparse.Namespace) -> Result:
    process = psutil.Process(pid)
    result = Result(
        members=args.members, jobs=args.jobs, per_host=args.per_host, tolerance_mib=args.tolerance_mib
    )
    rng = random.Random(args.seed)
    started = time.monotonic()
    async with CoordinatorClient(target, timeout=60) as client:
        index = 0
        while index < args.warmup + 1 or time.monotonic() - started < args.duration:
            wave = await _wave(client, index, args, rng)
            # Give the coordinator a moment to settle (closed streams, finished calls) first.
            await asyncio.sleep(0.5)
            memory = process.memory_info()
            wave["rss_mib"] = round(memory.rss / 2**20, 1)
            wave["fds"] = process.num_fds()
            wave["threads"] = process.num_threads()
            result.waves.append(wave)
            print(
                f"wave {wave['index']}: {wave['seconds']:.1f} s, {wave['joined']} joined, "
                f"{wave['reports']} reports, RSS {wave['rss_mib']} MiB, {wave['fds']} fds, "
                f"{wave['threads']} threads",
                flush=True,
            )
            index += 1
    result.duration_s = round(time.monotonic() - started, 1)
    # RSS swings by a garbage collection's worth between waves (cyclic garbage of finished calls
    # waits for the collector), so one sample says little. What a leak raises is the floor: the
    # lowest RSS of a few waves. Baseline: the floor of the WINDOW waves after the warm-up; final:
    # the floor of the last WINDOW waves.
    measured = result.waves[args.warmup :] or result.waves
    window = min(WINDOW, max(1, len(measured) // 2))
    result.baseline_rss_mib = min(w["rss_mib"] for w in measured[:window])
    result.final_rss_mib = min(w["rss_mib"] for w in measured[-window:])
    result.max_rss_mib = max(w["rss_mib"] for w in measured)
    result.rss_trend_mib_per_wave = _slope([w["rss_mib"] for w in measured])
    result.returned_to_baseline = result.final_rss_mib <= result.baseline_rss_mib + args.tolerance_mib
    return result


def _start_coordinator(directory: Path) -> CoordinatorProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARCOMM_")}
    coordinator = CoordinatorProcess(
        directory / "coordinator.log",
        state=directory / "state.sqlite",
        flags=["--heartbeat-interval", "2"],
        env=env,
    )
    try:
        coordinator.wait_serving()
    except BaseException:
        coordinator.close()
        raise
    return coordinator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--per-host", type=int, default=10)
    parser.add_argument(
        "--duration", type=float, default=300.0, help="seconds of waves (at least warmup + 1)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--beats", type=int, default=4, help="reports per stream per wave")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--tolerance-mib", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--coord", help="HOST:PORT of a running coordinator (needs --pid)")
    parser.add_argument("--pid", type=int, help="its process id, for its memory")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.members % args.jobs or (args.members // args.jobs) % args.per_host:
        parser.error("--members must split into --jobs equal jobs of whole --per-host hosts")
    with tempfile.TemporaryDirectory(prefix="sarcomm-soak-") as tmp:
        proc = None
        if args.coord:
            if args.pid is None:
                parser.error("--coord needs --pid")
            target, pid = args.coord, args.pid
        else:
            proc = _start_coordinator(Path(tmp))
            target, pid = proc.target, proc.proc.pid
        try:
            result = asyncio.run(soak(target, pid, args))
        finally:
            if proc is not None:
                proc.close()
    result.command = "python " + " ".join(
        ["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]
    )
    result.machine = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "wave seconds median": statistics.median(w["seconds"] for w in result.waves),
    }
    verdict = "returned to baseline" if result.returned_to_baseline else "DID NOT return to baseline"
    print(
        f"baseline {result.baseline_rss_mib} MiB, final {result.final_rss_mib} MiB, "
        f"max {result.max_rss_mib} MiB, trend {result.rss_trend_mib_per_wave} MiB/wave: {verdict}"
    )
    write_results(asdict(result), soak_page.section, args.json, args.markdown)
    return 0 if result.returned_to_baseline else 1


if __name__ == "__main__":
    raise SystemExit(main())
