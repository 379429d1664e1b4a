"""Coordinator CPU, memory and heartbeat latency with 4096 heartbeating members, batched by agents
or one stream each.

Two shapes of the same 4096-member job (one job, world size 4096):

- ``batched``: 512 simulated agents of 8 ranks each. Each agent joins once with its 8 members and
  keeps one ``Heartbeat`` stream, sending one request with 8 reports (each with its progress: a
  sequence number that grows, an op, in or out of a collective; and its metrics endpoint, as
  ``sar-worker`` sends them) every interval. 512 streams, 4096 reports a second.
- ``single``: 4096 single-rank members (processes that registered themselves), each with its own
  channel (its own TCP connection), one join and one stream with one report per interval. 4096
  streams, 4096 reports a second.

The members are simulated with ``grpc.aio`` in ``--procs`` load-client processes (4), each one
asyncio loop with one channel per simulated agent or member, their beats spread over one interval;
plus one probe process that keeps ``--probes`` (32) of the streams and does nothing else, so that
its acks time the coordinator rather than a busy client's loop (its own loop lag is recorded too).
A fresh ``sar-coordinator`` (``--heartbeat-interval 1``, a SQLite ``--state`` file) serves each
shape; ``--pin`` gives it the first CPU alone and the clients the others, as on a head node.

Measured, per shape, once every member reports and after ``--warmup`` seconds (10), over
``--duration`` seconds (30), with ``/metrics`` and ``/sd`` fetched every ``--scrape-interval`` (15 s)
as Prometheus would:

- the coordinator's CPU (user + system time from /proc, as a share of one core) and memory (RSS
  when idle, at the end, and its peak);
- the reports it counted (``sar_coordinator_heartbeats_total``) per second;
- ack latency (a request written to its ack read) of the requests written in the window: probe
  streams p50/p99/max (the headline) and load clients p50/p99;
- the coordinator's own event-loop lag and full garbage collections over the window (its metrics
  ``sar_coordinator_event_loop_lag_seconds`` and ``sar_coordinator_gc_pause_seconds``);
- members the coordinator judged failed (must be 0), the time the world took to form, and, after
  the window, the time from every member's Leave (each answered once on disk) to FINISHED.

``--scaling`` adds 8 s windows at a quarter and half the members and, for ``batched``, at 2x and
4x the rate. ``--profile-coordinator PATH`` records py-spy samples of each window. Run::

    python benchmarks/heartbeat_load.py --pin --scaling --json benchmarks/results/heartbeat_load.json \\
        --markdown benchmarks/results/heartbeat_load.md        # about 4 minutes

A client process is this same file (``heartbeat_load.py _client ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import CoordinatorProcess, connections, memory_kib, own_channel, process_cpu_seconds
from recording import describe, write_results
from renderers import heartbeat_load as heartbeat_load_page
from renderers.heartbeat_load import HeartbeatRow, LoopLag

from sarcomm.coordinator.fdlimit import raise_open_file_limit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster

SHAPES = {"batched": (512, 8), "single": (4096, 1)}


# -- a client process ------------------------------------------------------------------------------


async def client_main(config: dict[str, Any]) -> dict[str, Any]:
    """Join ``agents`` agents of ``members`` members each, then heartbeat until ``end_at``."""
    import grpc

    from sarcomm.v1 import coordinator_pb2 as pb
    from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

    target, job, world = config["target"], config["job"], config["world"]
    agents, members, interval = config["agents"], config["members"], config["interval"]
    lo = pb.NetworkInterface(name="lo", addresses=["127.0.0.1"], kind=pb.INTERFACE_KIND_LOOPBACK)
    # One channel (one TCP connection: own_channel) per simulated agent, or agents spread over
    # `channels`.
    count = config["channels"] or agents
    channels = [own_channel(target) for _ in range(count)]
    # (CoordinatorAsyncStub is the stub's type on an aio channel; it exists only in the .pyi.)
    stubs: list[pb_grpc.CoordinatorAsyncStub] = [
        pb_grpc.CoordinatorStub(channels[i % count]) for i in range(agents)
    ]

    async def join(i: int) -> pb.JoinResponse:
        request = pb.JoinRequest(
            job=job, world_size=world, host=f"p{config['proc']}-a{i}", interfaces=[lo], store_port=29500,
            members=[pb.MemberSpec(local_rank=k) for k in range(members)], join_timeout_seconds=300,
        )  # fmt: skip
        return await stubs[i].Join(request, timeout=320, wait_for_ready=True)

    # (when a request was written, how long its ack took): the parent keeps the requests written
    # inside its measurement window (time.monotonic is one clock for every process on Linux).
    samples: list[tuple[float, float]] = []
    errors: list[str] = []
    acks = 0
    end_at = config["end_at"]
    joins_left = agents
    stop = asyncio.Event()

    async def watch_stop() -> None:
        # The parent creates the stop file after its measurement; end_at bounds the run anyway.
        stop_path = Path(config["stop"])
        for _ in range(int((end_at - time.monotonic()) / 0.2) + 1):
            if await asyncio.to_thread(stop_path.exists):
                break
            await asyncio.sleep(0.2)
        stop.set()

    async def agent(i: int) -> None:
        nonlocal acks, joins_left
        # As a real member: heartbeats start the moment its own join returns.
        joined = await join(i)
        joins_left -= 1
        if joins_left == 0:
            await asyncio.to_thread(Path(config["ready"]).write_text, "joined")
        call = stubs[i].Heartbeat(None, timeout=3600)  # requests go out with call.write()
        sent: list[float] = []
        seq = 0

        async def reader() -> None:
            nonlocal acks
            async for response in call:
                if not response.events and sent:
                    at = sent.pop(0)
                    samples.append((at, time.monotonic() - at))
                    acks += 1

        reading = asyncio.ensure_future(reader())
        try:
            first = True
            while not stop.is_set():
                seq += 1
                now = time.time()
                # As sar-worker's reports: every one names its rank's /metrics endpoint.
                reports = [
                    pb.MemberReport(
                        member_id=a.member_id, secret=a.secret,
                        progress=pb.Progress(seq=seq, op="all_reduce", in_collective=seq % 2 == 1, since=now),
                        metrics_address=f"127.0.0.1:{20000 + a.rank % 40000}",
                    )
                    for a in joined.assignments
                ]  # fmt: skip
                sent.append(time.monotonic())
                await call.write(pb.HeartbeatRequest(reports=reports))
                # After the first beat the agents' beats are spread over one interval, as the
                # beats of real ones drift apart.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), random.uniform(0, interval) if first else interval)
                first = False
            await call.write(pb.HeartbeatRequest(closing=True))
            await call.done_writing()
            await asyncio.wait_for(reading, 10)
            # Then its ranks exit 0, as at the end of training: one Leave per member.
            for a in joined.assignments:
                await stubs[i].Leave(pb.LeaveRequest(member_id=a.member_id, secret=a.secret), timeout=60)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            errors.append(repr(exc)[:200])
        finally:
            reading.cancel()

    lags: list[tuple[float, float]] = []

    async def watch_lag() -> None:
        # This client's own event-loop lag: an ack read late because this loop was busy (or not
        # scheduled) is this process's delay, not the coordinator's.
        while not stop.is_set():
            began = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append((began, time.monotonic() - began - 0.01))

    watcher = asyncio.ensure_future(watch_stop())
    lag_watcher = asyncio.ensure_future(watch_lag())
    await asyncio.gather(*(agent(i) for i in range(agents)))
    await watcher
    await lag_watcher
    for channel in channels:
        await channel.close(None)
    return {
        "acks": acks,
        "samples": [(round(at, 6), round(latency, 6)) for at, latency in samples],
        "loop_lags": [(round(at, 4), round(lag, 5)) for at, lag in lags if lag > 0.005],
        "errors": errors[:5],
    }


def run_client(argv: list[str]) -> int:
    config = json.loads(argv[0])
    # One channel (one connection, a few descriptors) per simulated agent.
    raise_open_file_limit()
    result = asyncio.run(client_main(config))
    Path(config["out"]).write_text(json.dumps(result))
    return 0


# -- the parent ------------------------------------------------------------------------------------


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure(
    shape: str,
    args: argparse.Namespace,
    work: Path,
    agents: int | None = None,
    interval: float | None = None,
    scaling: bool = False,
    etcd: EtcdCluster | None = None,
) -> HeartbeatRow:
    """One shape, by default at its 4096 members and ``--interval``; ``agents`` and ``interval``
    change its size and rate (the scaling sweep). With ``etcd`` the coordinator keeps its state
    there (``--store``, leading alone) instead of in a SQLite file."""
    store = "etcd" if etcd is not None else "sqlite"
    agents = agents or SHAPES[shape][0]
    members = SHAPES[shape][1]
    interval = interval or args.interval
    # Each measurement in a folder of its own: its ready, stop and result files must not meet another's.
    name = f"{shape}-{agents * members}-{interval:g}"
    work = work / ("scaling" if scaling else "main") / store / name
    work.mkdir(parents=True, exist_ok=True)
    world = agents * members
    cpus = sorted(os.sched_getaffinity(0))
    # --pin: the coordinator gets the first CPU to itself, as on a head node whose cores are its
    # own; the clients share the rest. Otherwise everything shares every CPU.
    coordinator_cpus = {cpus[0]} if args.pin and len(cpus) > 1 else set(cpus)
    client_cpus = set(cpus[1:]) if args.pin and len(cpus) > 1 else set(cpus)
    server = CoordinatorProcess(
        work / f"coordinator-{shape}.log",
        state=None if etcd else work / f"state-{shape}.sqlite",
        store=etcd.url(f"hl-{'s' if scaling else 'm'}-{name}") if etcd else None,
        flags=["--heartbeat-interval", str(interval), "--heartbeat-misses", str(args.misses),
               "--shutdown-grace", "1"],
        cpus=coordinator_cpus,
    )  # fmt: skip
    coordinator = server.proc
    profiler_log = work / f"py-spy-{shape}.log"
    clients: list[subprocess.Popen[bytes]] = []
    try:
        # A coordinator on etcd serves once it leads (alone, at once); SQLite's always leads.
        server.wait_serving()
        time.sleep(0.5)
        idle = memory_kib(coordinator.pid)
        job = f"load-{shape}"
        started = time.monotonic()
        # Clients stream until the stop file appears; end_at only bounds a run that went wrong.
        end_at = started + 2 * args.join_budget + args.warmup + args.duration
        stop_file = work / f"{shape}.stop"
        # The last client process is the probe: a few of the streams, in a process with nothing else
        # to do, so its acks time the coordinator rather than a load client's busy loop.
        probes = min(args.probes, agents - args.procs) if args.probes else 0
        load = agents - probes
        share = [load // args.procs + (1 if p < load % args.procs else 0) for p in range(args.procs)]
        share += [probes] if probes else []
        for p, count in enumerate(share):
            config = {
                "target": server.target, "job": job, "world": world, "agents": count,
                "members": members, "interval": interval, "end_at": end_at, "proc": p,
                "ready": str(work / f"{shape}-{p}.ready"), "out": str(work / f"{shape}-{p}.json"),
                "channels": args.channels, "stop": str(stop_file),
            }  # fmt: skip
            clients.append(
                subprocess.Popen(
                    [sys.executable, __file__, "_client", json.dumps(config)],
                    preexec_fn=lambda: os.sched_setaffinity(0, client_cpus),
                )
            )
        while not all((work / f"{shape}-{p}.ready").exists() for p in range(len(share))):
            if time.monotonic() > started + args.join_budget:
                raise RuntimeError(f"{shape}: the world did not form within {args.join_budget} s")
            if any(c.poll() not in (None, 0) for c in clients):
                raise RuntimeError(f"{shape}: a client process failed")
            time.sleep(0.05)
        formed_s = time.monotonic() - started
        # Every member's first report follows its own join answer; a world of thousands gets its
        # answers in a burst, which takes a while on a machine its clients share.
        while True:
            status = json.loads(server.get(f"/v1/jobs?job={job}"))["jobs"][0]
            if all(m["last_heartbeat"] > 0 for m in status["members"]):
                first_reports_s = time.time() - status["formed"]
                break
            if time.monotonic() > started + args.join_budget:
                raise RuntimeError(f"{shape}: not every member reported within {args.join_budget} s")
            time.sleep(0.5)
        time.sleep(args.warmup)
        profiler = None
        if args.profile_coordinator:
            # py-spy's on-CPU samples of the coordinator over exactly the measured window.
            profiler = subprocess.Popen(
                ["py-spy", "record", "--pid", str(coordinator.pid), "--rate", "200", "--format", "raw",
                 "--nonblocking", "--duration", str(int(args.duration)),
                 "--output", str(args.profile_coordinator.with_suffix(f".{shape}.raw"))],
                stdout=profiler_log.open("ab"), stderr=subprocess.STDOUT,
            )  # fmt: skip
        etcd_pids = [m.proc.pid for m in etcd.members if m.proc is not None] if etcd else []
        etcd_cpu0 = sum(process_cpu_seconds(pid) for pid in etcd_pids)
        cpu0, wall0 = process_cpu_seconds(coordinator.pid), time.monotonic()
        metrics0 = server.get("/metrics")
        beats0 = _counter(metrics0, "sar_coordinator_heartbeats_total")
        peak_rss = 0
        scrapes: list[float] = []
        next_scrape = wall0
        while time.monotonic() < wall0 + args.duration:
            if args.scrape_interval and time.monotonic() >= next_scrape:
                # What a Prometheus server does at its scrape interval: both endpoints, with every
                # member's per-rank series, are served from the loop that answers the heartbeats.
                for path in ("/metrics", "/sd"):
                    began = time.monotonic()
                    server.get(path)
                    scrapes.append(time.monotonic() - began)
                next_scrape += args.scrape_interval
            time.sleep(max(0.0, min(1.0, wall0 + args.duration - time.monotonic())))
            peak_rss = max(peak_rss, memory_kib(coordinator.pid)["VmRSS"])
        cpu1, wall1 = process_cpu_seconds(coordinator.pid), time.monotonic()
        held = connections(server.grpc_port, coordinator.pid)
        etcd_cpu1 = sum(process_cpu_seconds(pid) for pid in etcd_pids)
        profile: list[dict[str, Any]] = []
        if profiler is not None:
            profiler.wait(30)
            raw = args.profile_coordinator.with_suffix(f".{shape}.raw")
            if raw.exists():
                profile = hottest_frames(raw)
            else:
                print(f"py-spy wrote no profile to {raw} (see {profiler_log})", file=sys.stderr)
        metrics = server.get("/metrics")
        beats1 = _counter(metrics, "sar_coordinator_heartbeats_total")
        lag = _loop_lag(metrics0, metrics)
        memory = memory_kib(coordinator.pid)
        status = json.loads(server.get(f"/v1/jobs?job={job}"))["jobs"][0]
        failed = sum(1 for m in status["members"] if m["state"] == "FAILED")
        # How stale the stalest member was at the end: what the liveness rule saw.
        stalest_s = time.time() - min(m["last_heartbeat"] for m in status["members"])
        stop_file.write_text("stop")
        # Every member then leaves with exit code 0: the job must reach FINISHED, each leave
        # answered only once it is on disk.
        stopped = time.monotonic()
        while status["state"] != "FINISHED":
            if time.monotonic() > stopped + args.join_budget:
                raise RuntimeError(f"{shape}: the job did not finish {args.join_budget} s after the leaves")
            time.sleep(0.25)
            status = json.loads(server.get(f"/v1/jobs?job={job}"))["jobs"][0]
        all_left_s = time.monotonic() - stopped
        for client in clients:
            client.wait(60)
        results = [json.loads((work / f"{shape}-{p}.json").read_text()) for p in range(len(share))]
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
        server.close()

    # Acks of the requests written inside the measured window: not the burst of first beats that
    # follows the world's join answers, nor the closing ones.
    def window(part: list[dict[str, Any]]) -> list[float]:
        return sorted(lat for r in part for at, lat in r["samples"] if wall0 <= at < wall1)

    latencies = window(results[: args.procs])
    probed = window(results[args.procs :])
    probe_lags = sorted(
        lag for r in results[args.procs :] for at, lag in r["loop_lags"] if wall0 <= at < wall1
    )
    errors = [e for r in results for e in r["errors"]]
    row: HeartbeatRow = {
        "shape": shape,
        "store": store,
        # The three etcd members together (0 with SQLite): what the store costs besides the coordinator.
        "etcd_cpu_percent": round(100 * (etcd_cpu1 - etcd_cpu0) / (wall1 - wall0), 1),
        "streams": agents,
        # TCP connections the coordinator held at the window's end (counted, not assumed).
        "connections": held,
        "members": world,
        "members_per_stream": members,
        "interval_s": interval,
        "coordinator_cpu_percent": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 1),
        "reports_per_s": round((beats1 - beats0) / (wall1 - wall0)),
        "rss_idle_mib": round(idle["VmRSS"] / 1024, 1),
        "rss_mib": round(memory["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(max(memory["VmHWM"], peak_rss) / 1024, 1),
        "ack_p50_ms": round(1000 * statistics.median(latencies), 2) if latencies else None,
        "ack_p99_ms": _percentile_ms(latencies, 0.99),
        "ack_p999_ms": _percentile_ms(latencies, 0.999),
        "ack_max_ms": round(1000 * latencies[-1], 2) if latencies else None,
        "acks_measured": len(latencies),
        "probe_streams": probes,
        "probe_ack_p50_ms": _percentile_ms(probed, 0.5),
        "probe_ack_p99_ms": _percentile_ms(probed, 0.99),
        "probe_ack_max_ms": round(1000 * probed[-1], 2) if probed else None,
        "probe_acks_measured": len(probed),
        # The probe process's own loop lag in the window (samples every 10 ms late by over 5 ms).
        "probe_loop_lag_max_ms": round(1000 * probe_lags[-1], 1) if probe_lags else 0.0,
        "probe_loop_lags_over_20ms": sum(1 for lag in probe_lags if lag > 0.02),
        **lag,
        "scrapes": len(scrapes),
        "scrape_max_ms": round(1000 * max(scrapes), 1) if scrapes else None,
        "members_failed": failed,
        "stalest_member_s": round(stalest_s, 2),
        "job_state": status["state"],
        "world_formed_s": round(formed_s, 2),
        "all_reporting_s": round(first_reports_s, 2),
        "all_left_s": round(all_left_s, 2),
        "profile_hottest": profile,
        "client_errors": len(errors),
        "client_error_examples": errors[:3],
    }
    return row


def _buckets(metrics: str, name: str) -> dict[float, float]:
    found = {}
    for line in metrics.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            found[float(le)] = float(line.rsplit(" ", 1)[1])
    return found


def _loop_lag(before: str, after: str) -> LoopLag:
    """The coordinator's loop-lag histogram over the window: samples, and how many were late by
    more than 5 and 20 ms, with the bucket bound under which 99% of them fell; and its full
    garbage collections over the window."""
    name = "sar_coordinator_event_loop_lag_seconds"
    first, last = _buckets(before, name), _buckets(after, name)
    delta = {le: last[le] - first.get(le, 0.0) for le in sorted(last)}
    total = delta.get(float("inf"), 0.0)
    p99 = next((le for le, count in delta.items() if total and count >= 0.99 * total), None)
    full_gc = 'sar_coordinator_gc_pause_seconds_{}{{generation="2"}}'
    return {
        "loop_lag_samples": int(total),
        "loop_lag_p99_le_ms": None if p99 is None else round(1000 * p99, 1),
        "loop_lag_over_5ms": int(total - delta.get(0.005, 0.0)),
        "loop_lag_over_20ms": int(total - delta.get(0.02, 0.0)),
        "full_collections": int(
            _counter(after, full_gc.format("count")) - _counter(before, full_gc.format("count"))
        ),
        "full_collections_ms": round(
            1000 * (_counter(after, full_gc.format("sum")) - _counter(before, full_gc.format("sum"))), 1
        ),
    }


def hottest_frames(raw: Path, top: int = 12) -> list[dict[str, Any]]:
    """The frames most samples of a py-spy raw (collapsed) profile were in, with their share.

    Inclusive: a frame counts for every sample it is on the stack of (once per sample).
    """
    counts: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        for frame in set(stack.split(";")):
            counts[frame] = counts.get(frame, 0) + int(n)
    # Frames of the loop and interpreter themselves are on every stack: they say nothing.
    skip = ("runpy", "Runner.run", "uvloop/__init__", "cli.py", "loop.py", "threading.py")
    ranked = sorted(((n, f) for f, n in counts.items() if not any(k in f for k in skip)), reverse=True)
    return [{"frame": f, "share": round(n / total, 3)} for n, f in ranked[:top]] if total else []


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    return round(1000 * ordered[int(q * (len(ordered) - 1))], 2) if ordered else None


def machine() -> dict[str, Any]:
    """What the numbers were measured on (see recording.describe)."""
    return describe("grpcio")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="batched,single", help="batched, single or both")
    parser.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s (default 1)")
    parser.add_argument(
        "--misses",
        type=int,
        default=10,
        help="the coordinator's --heartbeat-misses (default 10: the clients, simulated on the "
        "coordinator's own machine, answer the join burst of a 4096-member world slowly)",
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring (default 10)")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds (default 30)")
    parser.add_argument(
        "--channels",
        type=int,
        default=0,
        help="channels (TCP connections) per client process; 0 (default): one per simulated agent",
    )
    parser.add_argument(
        "--probes",
        type=int,
        default=32,
        help="streams kept by one extra, otherwise idle client process whose acks time the "
        "coordinator (default 32; 0: none)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=15.0,
        help="GET /metrics and /sd this often while measuring, as Prometheus does (default 15 s, "
        "deploy/prometheus's interval; 0: never)",
    )
    parser.add_argument(
        "--profile-coordinator",
        type=Path,
        help="record py-spy samples of the coordinator over each measured window to PATH.SHAPE.raw "
        "(collapsed stacks; needs py-spy) and list its hottest frames in the JSON",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="run the coordinator on the first CPU alone and the clients on the others (as on a head "
        "node with cores of its own); default: all share all CPUs",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="also measure each shape at a quarter and half of its members, and batched at 2x and 4x "
        "the rate (8 s each, no scrapes): how the cost grows",
    )
    parser.add_argument("--join-budget", type=float, default=60.0, help="bound of forming the world, s")
    parser.add_argument(
        "--stores",
        default="sqlite",
        help="where the coordinator keeps its state, comma-separated, each measured in turn: sqlite "
        "(a --state file; the default) and etcd (--store on a three-member etcd cluster on loopback, "
        "the coordinator leading alone); e.g. sqlite,etcd for both side by side",
    )
    parser.add_argument("--quick", action="store_true", help="measure 5 s after 2 s of warm-up")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write a Markdown table here")
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.duration = 2.0, 5.0
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        parser.error(f"--shapes {','.join(bad)!r}: each must be one of {', '.join(SHAPES)}")
    stores = [s for s in args.stores.split(",") if s]
    if not stores or any(s not in STORES for s in stores):
        parser.error(f"--stores {args.stores!r}: each must be one of {', '.join(STORES)}")
    if "etcd" in stores and ETCD_MISSING:
        parser.error(f"--stores etcd: {ETCD_MISSING}")
    if args.profile_coordinator:
        args.profile_coordinator.parent.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sar-heartbeat-load-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    summary: list[HeartbeatRow] = []
    scaling: list[HeartbeatRow] = []
    with contextlib.ExitStack() as stack:
        etcd = None
        if "etcd" in stores:
            etcd = EtcdCluster(work / "etcd")
            stack.callback(etcd.close)
            etcd.start()
        for store in stores:
            kept = etcd if store == "etcd" else None
            for shape in shapes:
                result = measure(shape, args, work, etcd=kept)
                print(json.dumps(result), flush=True)
                summary.append(result)
            if args.scaling:
                scaling += measure_scaling(args, work, shapes, kept)
    info["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    given = argv if argv is not None else sys.argv[1:]
    doc = {
        # A run with the etcd store is recorded apart from the SQLite one (heartbeat_load_etcd.json):
        # report.py shows each part from the newest run that has it.
        "benchmark": "heartbeat_load",
        "title": "Heartbeat load: 4096 members, batched by agents or one stream each",
        "headline": heartbeat_load_page.script_headline(summary),
        "summary": summary,
        "scaling": scaling,
        "command": "python benchmarks/heartbeat_load.py " + " ".join(given),
        "settings": {
            "procs": args.procs,
            "probe_streams": args.probes,
            "pinned": args.pin,
            "interval_s": args.interval,
            "misses": args.misses,
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "scrape_interval_s": args.scrape_interval,
            "channels_per_proc": args.channels or "one per agent",
            "stores": stores,
        },
        "machine": info,
        "quick": args.quick,
    }
    write_results(doc, heartbeat_load_page.section, args.json, args.markdown)
    return 0


#: Where the coordinator keeps its state (--stores).
STORES = ("sqlite", "etcd")


def measure_scaling(
    args: argparse.Namespace, work: Path, shapes: list[str], etcd: EtcdCluster | None
) -> list[HeartbeatRow]:
    """How the coordinator's cost grows with members (at the interval) and with the rate (at the
    most members): the same measurement, shorter."""
    scaling: list[HeartbeatRow] = []
    shorter = {"warmup": 2.0, "duration": 8.0, "scrape_interval": 0.0, "profile_coordinator": None}
    sweep = argparse.Namespace(**{**vars(args), **shorter})
    for shape in shapes:
        streams = SHAPES[shape][0]
        points = [(streams // 4, args.interval), (streams // 2, args.interval), (streams, args.interval)]
        if shape == "batched":
            points += [(streams, args.interval / 2), (streams, args.interval / 4)]
        for agents, interval in points:
            result = measure(shape, sweep, work, agents=agents, interval=interval, scaling=True, etcd=etcd)
            print(json.dumps(result), flush=True)
            scaling.append(result)
    return scaling


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        raise SystemExit(run_client(sys.argv[2:]))
    raise SystemExit(main())
