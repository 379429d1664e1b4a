"""One head node for a big job: formation, heartbeats, a failure's fan-out and the endpoints, with
the coordinator of this tree and (``--baseline-ref``) the one of an earlier commit side by side.

What is measured, each with a fresh ``sar-coordinator`` on loopback (``--state`` SQLite file, or
``--store`` on a one-member etcd with ``--stores sqlite,etcd``), the code under test and the
baseline taking turns at every size:

- ``agents``: formation of A simulated agents joining 8 members each (one Join per agent, one
  connection each), A = ``--agents`` (512, 1024, 2048, 4096): the coordinator's own view (first
  Join seen to world formed, its ``sar_coordinator_rendezvous_duration_seconds``), the last
  answer after the common start, and the coordinator's CPU seconds for it.
- ``singles``: formation of N self-registered single-rank members (one Join each, over
  ``--single-channels`` connections per client process), N = ``--singles`` (4096 ... 32768).

Every simulated connection is a TCP connection of its own (``harness.own_channel``); the number
the coordinator holds is counted (``connections`` in each run: before the Joins, and at the end of
the beat window).
- ``beat``: at ``--beat-agents`` agents x 8 (4096: 32,768 ranks), after formation every agent keeps
  one ``Heartbeat`` stream and writes one request with its 8 reports every interval, for
  ``--warmup`` then ``--duration`` seconds. Recorded over the measured window: reports offered
  (written by the clients) and processed (the coordinator's ``sar_coordinator_heartbeats_total``)
  per second, the coordinator's CPU time per processed report (``psutil``'s cpu_times of its pid:
  a load generator that cannot keep up on a small machine does not flatter it) and as a share of
  one core at the offered rate, RSS, members failed (must be 0), probe-ack p50/p99/max (a probe
  process holding 32 of the agents and nothing else), and then ``/metrics``, ``/sd`` and
  ``/v1/jobs`` each fetched 3 times (the slowest is kept); then one member leaves with exit code 1
  and the time until every agent stream received the failure is recorded.

The simulated agents are ``load_agents.py`` processes (``--procs`` of them, plus the probe):
pre-built requests, bytes in and out, so that the load is offered at the rate asked for.

Run::

    python benchmarks/big_job.py --baseline-ref bc48c2d --json benchmarks/results/big_job.json \\
        --markdown benchmarks/results/big_job.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
from harness import connections, free_port
from recording import describe, write_results
from renderers import big_job as big_job_page
from renderers.big_job import BeatRow, BeatRun, Formation, FormationRow, FormationRun, Row

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster  # noqa: E402 (after the path above)

LOOPBACK = "127.0.0.1"
AGENT = Path(__file__).resolve().parent / "load_agents.py"
FLOOR = Path(__file__).resolve().parent / "grpc_floor.py"
#: Targets of the big-job issue on the 2-core machine.
TARGET_AGENTS_S = 1.0
TARGET_SINGLES_S = 4.0
TARGET_ETCD_RATIO = 1.5
TARGET_CORE_SHARE = 0.25
TARGET_PROBE_P99_MS = 50.0
TARGET_RSS_MIB = 1024.0
TARGET_FANOUT_S = 1.0
TARGET_ENDPOINT_S = 1.0


@dataclass(frozen=True)
class Code:
    """Which coordinator runs: this tree's (``path`` None) or a link tree of another commit; or,
    with ``floor``, ``grpc_floor.py``: gRPC with nothing decided (the least any coordinator on
    this stack can cost)."""

    name: str
    path: Path | None
    floor: bool = False

    @property
    def current(self) -> bool:
        """This tree's coordinator."""
        return self.path is None and not self.floor


def baseline_tree(ref: str, work: Path) -> Path:
    """The files of commit ``ref`` (``git archive``: nothing registered in the repository) laid out
    as they install (that commit's scripts/linktree.sh); the path to put on PYTHONPATH."""
    checkout = work / f"baseline-{ref}"
    if not checkout.exists():
        checkout.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", ref], cwd=REPOSITORY, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive.stdout, check=True)
    tree = subprocess.run(
        ["bash", "scripts/linktree.sh"], cwd=checkout, check=True, capture_output=True, text=True
    )
    return checkout / tree.stdout.strip()


def _get(url: str, timeout: float = 60) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def metric_sum(metrics: str, name: str) -> float:
    """The sum of every sample of ``name`` (all its label sets; or one, named with its labels)."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    for match in pattern.finditer(metrics):
        total += float(match.group(2))
    return total


class Coordinator:
    """A ``sar-coordinator`` process of ``code``; a context manager that stops it."""

    def __init__(
        self,
        code: Code,
        work: Path,
        store: str | None,
        interval: float,
        misses: int,
        acceptors: int = 1,
        flags: Sequence[str] = (),
    ) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        env = dict(os.environ)
        if code.path is not None:
            env["PYTHONPATH"] = str(code.path)
        state = (
            ["--store", store] if store else ["--state", str(work / f"state-{time.monotonic_ns()}.sqlite")]
        )
        self.log_path = work / f"coordinator-{code.name}.log"
        self.log = self.log_path.open("ab")
        program = [str(FLOOR)] if code.floor else ["-m", "sarcomm.coordinator.cli"]
        self.proc = subprocess.Popen(
            [sys.executable, *program, "--listen", f"{LOOPBACK}:{self.grpc_port}",
             "--http", f"{LOOPBACK}:{self.http_port}", *state, "--heartbeat-interval", str(interval),
             "--heartbeat-misses", str(misses), "--join-timeout", "300", "--max-world-size", "65536",
             "--log-level", "WARNING", "--shutdown-grace", "1",
             *(["--acceptors", str(acceptors)] if acceptors > 1 and code.current else []), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=work,
        )  # fmt: skip
        self.ps = psutil.Process(self.proc.pid)
        self.http = f"http://{LOOPBACK}:{self.http_port}"
        self.target = f"{LOOPBACK}:{self.grpc_port}"

    def __enter__(self) -> Coordinator:
        deadline = time.monotonic() + 60
        while True:
            try:
                if json.loads(_get(f"{self.http}/healthz", 2)).get("role", "leader") == "leader":
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start; see {self.log.name}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def cpu(self) -> float:
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    def user_cpu(self) -> float:
        return float(self.ps.cpu_times().user)

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def connections(self) -> int:
        """TCP connections it holds on its gRPC port now (counted, not assumed)."""
        return connections(self.grpc_port, self.proc.pid)

    def metrics(self) -> str:
        return _get(f"{self.http}/metrics")

    def get(self, path: str) -> str:
        """The body of ``GET path`` from its HTTP endpoint."""
        return _get(f"{self.http}{path}")


class Clients:
    """``load_agents.py`` processes sharing ``agents`` agents of ``members`` members."""

    def __init__(self, target: str, job: str, agents: int, members: int, args: argparse.Namespace,
                 channels: int, probe: int = 0, *, world: int | None = None, host_prefix: str = "",
                 protocol: str = "per-second", reconnect: bool = False) -> None:  # fmt: skip
        load = agents - probe
        shares = [load // args.procs + (1 if p < load % args.procs else 0) for p in range(args.procs)]
        shares += [probe] if probe else []
        self.procs = []
        for p, count in enumerate(shares):
            config = {
                "target": target, "job": job, "world": world or agents * members, "agents": count,
                "host_prefix": f"{host_prefix}{p}" if host_prefix else "", "protocol": protocol,
                "reconnect": reconnect,
                "members": members, "proc": p, "channels": channels, "interval": args.interval,
                "coordinator_interval": args.interval,
                "join_timeout": 300, "timed": probe > 0 and p == len(shares) - 1,
            }  # fmt: skip
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(AGENT), json.dumps(config)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        self.answer_all("ready")

    def ask(self, proc: int, command: dict[str, Any]) -> None:
        stdin = self.procs[proc].stdin
        assert stdin is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def answer(self, proc: int, key: str) -> dict[str, Any]:
        stdout = self.procs[proc].stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"load process {proc} ended (exit {self.procs[proc].wait()})")
        message: dict[str, Any] = json.loads(line)
        if key not in message:
            raise RuntimeError(f"load process {proc}: expected {key!r}, got {line[:200]}")
        return message

    def answer_all(self, key: str) -> list[dict[str, Any]]:
        return [self.answer(p, key) for p in range(len(self.procs))]

    def tell_all(self, command: dict[str, Any]) -> None:
        for p in range(len(self.procs)):
            self.ask(p, command)

    def answer_all_after(self, command: dict[str, Any], key: str) -> list[dict[str, Any]]:
        """Every process's answer ``key`` to ``command``."""
        self.tell_all(command)
        return self.answer_all(key)

    def cpu(self) -> float:
        """CPU seconds of every load process so far."""
        total = 0.0
        for proc in self.procs:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(proc.pid).cpu_times()
                total += times.user + times.system
        return total

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                self.ask(self.procs.index(proc), {"quit": True})
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def clients(*args: Any, **kwargs: Any) -> Iterator[Clients]:
    made = Clients(*args, **kwargs)
    try:
        yield made
    finally:
        made.close()


def form(coordinator: Coordinator, group: Clients, profiler: subprocess.Popen[bytes] | None = None
         ) -> Formation:  # fmt: skip
    """Start every Join at one instant; the coordinator's and the clients' view of the formation."""
    cpu0 = coordinator.cpu()
    held = coordinator.connections()
    gc0 = metric_sum(coordinator.metrics(), "sar_coordinator_gc_pause_seconds_sum")
    start = time.monotonic() + 0.5
    group.tell_all({"join": start})
    answers = group.answer_all("joined")
    times = [t for a in answers for t in a["joined"]]
    errors = [e for a in answers for e in a["errors"]]
    cpu = coordinator.cpu() - cpu0
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)
        profiler.wait(60)
    metrics = coordinator.metrics()
    view = metric_sum(metrics, "sar_coordinator_rendezvous_duration_seconds_sum")
    return {
        "coordinator_view_s": round(view, 3),
        "connections": held,
        "last_answer_s": round(max(times) - start, 3) if times and min(times) > 0 else None,
        "coordinator_cpu_s": round(cpu, 3),
        "coordinator_gc_s": round(metric_sum(metrics, "sar_coordinator_gc_pause_seconds_sum") - gc0, 3),
        "join_errors": len(errors),
        "join_error_examples": errors[:3],
    }


def run_formation(code: Code, args: argparse.Namespace, work: Path, store: str | None, agents: int,
                  members: int, channels: int) -> FormationRun:  # fmt: skip
    with (
        Coordinator(code, work, store, 600, 1, args.acceptors) as coordinator,
        clients(coordinator.target, f"form-{agents}x{members}", agents, members, args, channels) as group,
    ):
        result = form(
            coordinator,
            group,
            _profile(coordinator, args, f"form-{code.name.split()[0]}-{agents}x{members}", None),
        )
    return {"code": code.name, "store": "etcd" if store else "sqlite", "agents": agents, "members": members,
            "ranks": agents * members, **result}  # fmt: skip


def _profile(coordinator: Coordinator, args: argparse.Namespace, name: str, seconds: float | None
             ) -> subprocess.Popen[bytes] | None:  # fmt: skip
    """py-spy samples of the coordinator into ``--profile``/NAME.raw (collapsed stacks), for
    ``seconds`` (None: until interrupted); the sampling costs CPU: no timings from such a run."""
    if args.profile is None:
        return None
    args.profile.mkdir(parents=True, exist_ok=True)
    duration = ["--duration", str(int(seconds))] if seconds else []
    # (py-spy reads native stacks only with the process stopped at each sample)
    duration += ["--native"] if args.profile_native else ["--nonblocking"]
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(coordinator.proc.pid), "--rate", "200", "--format", "raw",
         *duration, "--output", str(args.profile / f"{name}.raw")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


GC_SUM = "sar_coordinator_gc_pause_seconds_sum"
LAG = "sar_coordinator_event_loop_lag_seconds_bucket"


def _held(before: str, after: str) -> list[int]:
    """How often the loop was held over 0.1 s and over 0.5 s between two scrapes."""

    def over(metrics: str, bound: str) -> float:
        return metric_sum(metrics, f'{LAG}{{le="+Inf"}}') - metric_sum(metrics, f'{LAG}{{le="{bound}"}}')

    return [int(over(after, b) - over(before, b)) for b in ("0.1", "0.5")]


def _spread(ordered: list[float]) -> list[float] | None:
    """[p50, max] of sorted seconds."""
    return [ordered[len(ordered) // 2], ordered[-1]] if ordered else None


def _timed_get(url: str) -> float:
    began = time.monotonic()
    _get(url)
    return time.monotonic() - began


def run_beats(code: Code, args: argparse.Namespace, work: Path, store: str | None, agents: int) -> BeatRun:
    members = 8
    job = "beat"
    with (
        Coordinator(code, work, store, args.interval, args.misses, args.acceptors) as coordinator,
        clients(coordinator.target, job, agents, members, args, 0, probe=args.probes) as group,
    ):
        formed = form(
            coordinator, group, _profile(coordinator, args, f"beatform-{code.name.split()[0]}", None)
        )
        start_metrics = coordinator.metrics()
        began = time.monotonic()
        window = (began + args.warmup, began + args.warmup + args.duration)
        until = window[1] + args.after
        group.tell_all({"beat": {"until": until, "window": window}})
        starting = _profile(coordinator, args, f"beatstart-{code.name.split()[0]}", args.warmup - 1)
        group.answer_all("beating")
        time.sleep(max(0.0, window[0] - time.monotonic()))
        warm_metrics = coordinator.metrics()
        profiler = _profile(coordinator, args, f"beat-{code.name.split()[0]}", args.duration)
        cpu0, beats0 = (
            coordinator.cpu(),
            metric_sum(coordinator.metrics(), "sar_coordinator_heartbeats_total"),
        )
        user0, clients0 = coordinator.user_cpu(), group.cpu()
        rss = coordinator.rss_mib()
        while time.monotonic() < window[1]:
            time.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
            rss = max(rss, coordinator.rss_mib())
        cpu1, metrics = coordinator.cpu(), coordinator.metrics()
        user1, clients1 = coordinator.user_cpu(), group.cpu()
        held = coordinator.connections()
        for running in (starting, profiler):
            if running is not None:
                running.wait(60)
        span = time.monotonic() - window[0]
        processed = metric_sum(metrics, "sar_coordinator_heartbeats_total") - beats0
        failed = metric_sum(metrics, 'sar_coordinator_members{state="FAILED"}')
        endpoints = {
            path: round(max(_timed_get(f"{coordinator.http}{path}") for _ in range(3)), 3)
            for path in ("/metrics", "/sd", f"/v1/jobs?job={job}")
            if not code.floor
        }
        failed_at = 0.0
        if args.fail and not code.floor and not failed:
            group.ask(0, {"fail": True})
            failed_at = group.answer(0, "failed_at")["failed_at"]
            time.sleep(max(2.0, until - time.monotonic()))
        group.tell_all({"results": True})
        results = group.answer_all("results")
    beat = [r["results"] for r in results]
    written = sum(b["written"] for b in beat) * members / (window[1] - window[0])
    acked = sum(b["acked"] for b in beat) * members / (window[1] - window[0])
    probe = sorted(lat for b in beat[args.procs :] for lat in b["latencies"])
    events = [t for b in beat for t in b["events"].values()]
    streams = sum(b["streams"] for b in beat)
    cpu_per_report = (cpu1 - cpu0) / processed if processed else None
    first_written = sorted(t for b in beat for t in b["first_written_s"])
    first_acked = sorted(t for b in beat for t in b["first_acked_s"])
    return {
        "code": code.name, "store": "etcd" if store else "sqlite", "agents": agents,
        "ranks": agents * members,
        "connections": held,
        "formation": formed,
        "offered_reports_per_s": round(written), "acked_reports_per_s": round(acked),
        "processed_reports_per_s": round(processed / span),
        "coordinator_cpu_us_per_report": round(1e6 * cpu_per_report, 2) if cpu_per_report else None,
        "core_share_at_offered": round(cpu_per_report * written, 3) if cpu_per_report else None,
        "coordinator_cpu_share": round((cpu1 - cpu0) / span, 3),
        "coordinator_user_us_per_report": round(1e6 * (user1 - user0) / processed, 2) if processed else None,
        "load_generator_cpu_share": round((clients1 - clients0) / span, 3),
        "rss_peak_mib": round(rss, 1),
        "start_loop_held": _held(start_metrics, warm_metrics),
        "start_gc_s": round(metric_sum(warm_metrics, GC_SUM) - metric_sum(start_metrics, GC_SUM), 3),
        "window_loop_held": _held(warm_metrics, metrics),
        "window_gc_s": round(metric_sum(metrics, GC_SUM) - metric_sum(warm_metrics, GC_SUM), 3),
        "first_beat_written_s": _spread(first_written),
        "first_beat_acked_s": _spread(first_acked),
        "members_failed_in_window": int(failed),
        "probe_ack_p50_ms": round(1000 * statistics.median(probe), 2) if probe else None,
        "probe_ack_p99_ms": round(1000 * probe[int(0.99 * (len(probe) - 1))], 2) if probe else None,
        "probe_ack_max_ms": round(1000 * probe[-1], 2) if probe else None,
        "endpoint_s": endpoints,
        "failure_streams": streams,
        "failure_streams_told": len(events),
        "failure_fanout_s": round(max(events) - failed_at, 3) if events and failed_at else None,
        "client_errors": [e for r in results for e in r["errors"]][:5],
    }  # fmt: skip


def _median_round(phase: Literal["agents", "singles"], rounds: list[FormationRun]) -> FormationRow:
    ok = [r for r in rounds if not r["join_errors"]] or rounds
    ordered = sorted(ok, key=lambda r: r["coordinator_view_s"])
    return {
        "phase": phase,
        **ordered[len(ordered) // 2],
        "rounds_view_s": [r["coordinator_view_s"] for r in rounds],
    }


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-ref", default="", help="also run this commit's coordinator, turn about")
    p.add_argument("--floor", action="store_true", help="also run grpc_floor.py, turn about")
    p.add_argument("--phases", default="agents,singles,beat", help="which of agents, singles, beat")
    p.add_argument("--stores", default="sqlite", help="sqlite, etcd or both (comma-separated)")
    p.add_argument("--agents", type=_sizes, default=[512, 1024, 2048, 4096], help="agents of 8 (formation)")
    p.add_argument("--singles", type=_sizes, default=[4096, 8192, 16384, 32768], help="single members")
    p.add_argument("--single-channels", type=int, default=64, help="connections per client process (singles)")
    p.add_argument("--repeats", type=int, default=3, help="formation rounds per size and code (median kept)")
    p.add_argument("--beat-agents", type=_sizes, default=[1024, 2048, 4096], help="agents of 8 heartbeating")
    p.add_argument("--procs", type=int, default=4, help="load client processes (besides the probe)")
    p.add_argument("--probes", type=int, default=32, help="agents of the probe process")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s")
    p.add_argument(
        "--misses",
        type=int,
        default=10,
        help="the coordinator's --heartbeat-misses (10, as heartbeat_load.py: the simulated agents share the "
        "coordinator's 2 cores and answer a join burst of thousands slowly)",
    )
    p.add_argument(
        "--acceptors",
        type=int,
        default=1,
        help="the current code's --acceptors (gRPC servers sharing its port; the baseline keeps one)",
    )
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of beats before measuring")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    p.add_argument("--after", type=float, default=4.0, help="seconds of beats after the window")
    p.add_argument("--no-fail", dest="fail", action="store_false", help="skip the failure fan-out")
    p.add_argument("--profile", type=Path, default=None, help="py-spy samples of each coordinator here")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C and Cython frames)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    phases = set(args.phases.split(","))
    stores = args.stores.split(",")
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="big-job-")))
        work.mkdir(parents=True, exist_ok=True)
        codes = [Code("current", None)]
        if args.floor:
            codes.append(Code("grpc-floor", None, floor=True))
        if args.baseline_ref:
            codes.append(Code(f"baseline {args.baseline_ref}", baseline_tree(args.baseline_ref, work)))
        etcd_url: dict[str, str | None] = {"sqlite": None}
        if "etcd" in stores:
            if ETCD_MISSING:
                raise SystemExit(f"--stores etcd: {ETCD_MISSING}")
            cluster = EtcdCluster(work / "etcd", size=1)
            stack.callback(cluster.close)
            cluster.start()
            etcd_url["etcd"] = cluster.url("big")
        runs: list[Row] = []

        def store_for(store: str, what: str) -> str | None:
            url = etcd_url[store]
            return f"{url}-{what}-{time.monotonic_ns()}" if url else None

        for store in stores:
            if "agents" in phases:
                for agents in args.agents:
                    for code in codes:
                        rounds = [run_formation(code, args, work, store_for(store, "a"), agents, 8, 0)
                                  for _ in range(args.repeats)]  # fmt: skip
                        runs.append(_median_round("agents", rounds))
                        print(json.dumps(runs[-1]), flush=True)
            if "singles" in phases:
                for size in args.singles:
                    for code in codes:
                        rounds = [
                            run_formation(
                                code, args, work, store_for(store, "s"), size, 1, args.single_channels
                            )
                            for _ in range(args.repeats)
                        ]
                        runs.append(_median_round("singles", rounds))
                        print(json.dumps(runs[-1]), flush=True)
            if "beat" in phases:
                for agents in args.beat_agents:
                    for code in codes:
                        result = run_beats(code, args, work, store_for(store, "b"), agents)
                        row: BeatRow = {"phase": "beat", **result}
                        runs.append(row)
                        print(json.dumps(runs[-1]), flush=True)
    doc = {
        # report.py reads a result under its file's name.
        "benchmark": args.json.stem if args.json else "big_job",
        "title": "One head node for a big job: " + ", ".join(sorted(phases)) + " (" + ", ".join(stores) + ")",
        "command": "python benchmarks/big_job.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "headline": big_job_page.headline(runs),
        "rows": [flat(r) for r in runs],
        "machine": describe("grpcio", "protobuf", load_at="end"),
        "runs": runs,
    }
    write_results(doc, big_job_page.section, args.json, args.markdown)
    return 0


def flat(run: Row) -> dict[str, Any]:
    """One run as a row of plain values (report.py's generic table and plot)."""
    row: dict[str, Any] = {
        "ranks": run["ranks"],
        "phase": run["phase"],
        "store": run["store"],
        "code": run["code"],
    }
    if run["phase"] == "beat":
        row.update(
            us_cpu_per_report=run["coordinator_cpu_us_per_report"],
            processed_per_s=run["processed_reports_per_s"],
            offered_per_s=run["offered_reports_per_s"],
            members_failed=run["members_failed_in_window"],
            probe_p99_ms=run["probe_ack_p99_ms"],
            formation_view_s=run["formation"]["coordinator_view_s"],
        )
    else:
        row.update(
            coordinator_view_s=run["coordinator_view_s"],
            last_answer_s=run["last_answer_s"],
            coordinator_cpu_s=run["coordinator_cpu_s"],
            join_errors=run["join_errors"],
        )
    return row


if __name__ == "__main__":
    sys.exit(main())
