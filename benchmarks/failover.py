"""Failover: from the leading coordinator's SIGKILL to every member of a 1024-member job re-attached
to the new leader, against a lone SQLite coordinator restarted on the same host.

Two setups in one run, the same job and the same simulated agents:

- ``etcd``: a real three-member etcd cluster on loopback (``tests/etcd_cluster.py``) and two
  ``sar-coordinator`` replicas on it (``--store etcd://... --leader-ttl T``). The agents are given
  both addresses. The leader is SIGKILLed ``--kills`` times, each time under a fresh job (a kill
  that failed members fails its job); after each failover the killed replica is started again (it
  stands by) before the next kill.
- ``sqlite`` (the baseline): one ``sar-coordinator`` with a SQLite ``--state`` file, SIGKILLed and
  started again at once on the same port and file, as a supervisor (systemd's ``Restart=always``,
  ``RestartSec=0``) does when the process dies and the host does not; when the host dies, nothing
  comes back. Skip it with ``--no-baseline``.

The members: ``--members`` (1024) in agents of ``--per-agent`` (8) members, spread over ``--procs``
(4) client processes; each agent is the real client library (``CoordinatorClient`` given every
address, ``join_many``, and the ``HeartbeatStream`` that sar-worker uses, reporting every
``--interval`` s with progress), one stream per agent. Each agent notes when each heartbeat answer
arrives (``time.monotonic()``, one clock for every process on Linux).

Measured per kill: the take-over (the kill to the new leader's health SERVING for
``sarcomm.v1.Coordinator``; for SQLite, to the restarted process serving), each agent's re-attach
(the kill to its first answer after it), their distribution (p50/p90/p99/max over agents; all of an
agent's members re-attach together), the coordinator's own view (when its /v1/jobs first shows
every member reporting after the kill), and, once the reconnect grace and a liveness window have
passed, the members it failed (must be 0). Target: every member re-attached within TTL + 2 s.

Run (about 3 minutes on 2 cores)::

    python benchmarks/failover.py --json benchmarks/results/failover.json \\
        --markdown benchmarks/results/failover.md

A client process is this same file (``failover.py _client CONFIG``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import SAR_COORDINATOR, free_port
from recording import describe, write_results
from renderers import failover as failover_page
from renderers.failover import Kill, KillTimes, Reattach, SetupResult

from sarcomm.coordinator.fdlimit import raise_open_file_limit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.etcd_cluster import ETCD_MISSING, EtcdCluster

LOOPBACK = "127.0.0.1"
SERVICE = "sarcomm.v1.Coordinator"
# A reply that arrives this soon after the kill may still be the dead leader's (already in flight).
IN_FLIGHT_S = 0.05


# -- a client process ------------------------------------------------------------------------------


async def client_main(config: dict[str, Any]) -> dict[str, Any]:
    """Join ``agents`` agents of ``per_agent`` members each; heartbeat until the stop file appears;
    return every agent's answer times."""
    from sarcomm.common.client.coordinator_client import CoordinatorClient
    from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
    from sarcomm.common.messages import MemberReport, Progress

    lo = InterfaceInfo("lo", (LOOPBACK,), InterfaceKind.LOOPBACK)
    stop = asyncio.Event()
    answers: list[list[float]] = [[] for _ in range(config["agents"])]
    errors: list[str] = []
    joined = 0

    async def agent(i: int) -> None:
        nonlocal joined
        async with CoordinatorClient(config["target"], timeout=60.0) as client:
            result = await client.join_many(
                config["job"], config["world"], nproc=config["per_agent"], host=f"p{config['proc']}-a{i}",
                interfaces=[lo], store_port=29500, join_timeout=300,
            )  # fmt: skip
            joined += 1
            if joined == config["agents"]:
                await asyncio.to_thread(Path(config["ready"]).write_text, "joined")
            seq = 0

            def reports() -> list[MemberReport]:
                nonlocal seq
                seq += 1
                progress = Progress(seq, "all_reduce", seq % 2 == 1, time.time())
                return [MemberReport(a.member_id, a.secret, progress) for a in result.assignments]

            async with client.heartbeats(reports, config["interval"]) as stream:
                reading = asyncio.ensure_future(_read(stream, answers[i]))
                await stop.wait()
                reading.cancel()
            if reading.done() and not reading.cancelled() and reading.exception():
                errors.append(repr(reading.exception())[:300])

    async def watch_stop() -> None:
        stop_path = Path(config["stop"])
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)  # (never set here: a paced poll of the file)
            if await asyncio.to_thread(stop_path.exists):
                break
        stop.set()

    watcher = asyncio.ensure_future(watch_stop())
    outcomes = await asyncio.gather(*(agent(i) for i in range(config["agents"])), return_exceptions=True)
    watcher.cancel()
    errors += [repr(o)[:300] for o in outcomes if isinstance(o, BaseException)]
    return {"answers": [[round(t, 4) for t in times] for times in answers], "errors": errors[:10]}


async def _read(stream: Any, times: list[float]) -> None:
    try:
        async for _ in stream:
            times.append(time.monotonic())
    except Exception as exc:
        # The stream gave up (sar-worker logs "heartbeats stopped" then): its members will be
        # judged silent. Said at once, so the log shows when.
        print(f"heartbeats stopped at {time.monotonic():.3f}: {exc!r}", file=sys.stderr, flush=True)
        raise


def run_client(argv: list[str]) -> int:
    config = json.loads(argv[0])
    raise_open_file_limit()
    result = asyncio.run(client_main(config))
    Path(config["out"]).write_text(json.dumps(result))
    return 0


# -- coordinators ----------------------------------------------------------------------------------


class Replica:
    """One ``sar-coordinator`` process on fixed loopback ports, restartable on the same ones."""

    def __init__(self, work: Path, name: str, args: list[str]) -> None:
        self.name = name
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log_path = work / f"coordinator-{name}.log"
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    def start(self) -> None:
        log = self.log_path.open("ab")
        advertise = ["--advertise", self.target] if "--store" in self.args else []
        self.proc = subprocess.Popen(
            [*SAR_COORDINATOR, "--listen", self.target,
             "--http", f"{LOOPBACK}:{self.http_port}", *advertise, *self.args],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()

    def leads(self) -> bool:
        """Whether its health says SERVING for the Coordinator service."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        if self.proc is None or self.proc.poll() is not None:
            return False
        with grpc.insecure_channel(self.target) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE), timeout=1
                )
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def healthz(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.http_port}/healthz", timeout=2) as r:
                return dict(json.loads(r.read()))
        except (OSError, ValueError):
            return {}

    def job(self, name: str) -> dict[str, Any] | None:
        with urllib.request.urlopen(
            f"http://{LOOPBACK}:{self.http_port}/v1/jobs?job={name}", timeout=30
        ) as r:
            jobs = json.loads(r.read())["jobs"]
        return dict(jobs[0]) if jobs else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def _until(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> float:
    """Poll ``predicate`` until true; the monotonic time it first was. Raises RuntimeError naming
    ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


# -- one setup -------------------------------------------------------------------------------------


def measure(setup: str, args: argparse.Namespace, work: Path) -> SetupResult:
    """Form the job under ``setup`` ("etcd" or "sqlite"), kill the leader ``--kills`` times, and
    return what each kill took."""
    work = work / setup
    work.mkdir(parents=True, exist_ok=True)
    common = ["--heartbeat-interval", str(args.interval), "--heartbeat-misses", str(args.misses),
              "--reconnect-grace", str(args.reconnect_grace), "--join-timeout", "300",
              "--log-level", "INFO", "--shutdown-grace", "1"]  # fmt: skip
    cluster = None
    replicas: list[Replica] = []
    try:
        if setup == "etcd":
            cluster = EtcdCluster(work / "etcd")
            cluster.start()
            store = ["--store", cluster.url("bench"), "--leader-ttl", str(args.leader_ttl)]
            replicas = [Replica(work, f"r{n}", [*store, *common]) for n in range(2)]
        else:
            replicas = [Replica(work, "sqlite", ["--state", str(work / "state.sqlite"), *common])]
        replicas[0].start()
        _until(replicas[0].leads, 60, "the first coordinator to serve", 0.05)
        for replica in replicas[1:]:
            replica.start()
            _until(lambda r=replica: r.healthz().get("role") == "standby", 60, "the standby to start", 0.05)
        target = ",".join(r.target for r in replicas)
        agents = args.members // args.per_agent
        kills: list[Kill] = []
        formed: list[float] = []
        for k in range(args.kills):
            # A fresh job for every kill: a kill that failed members fails its job, which would
            # leave the next kill nothing running to measure.
            kill, formed_s = _one_job(setup, replicas, args, work / f"kill{k}", f"failover-{k}", target)
            kills.append(kill)
            formed.append(formed_s)
        return {
            "setup": setup, "members": agents * args.per_agent, "streams": agents,
            "formed_s": round(statistics.median(formed), 3), "kills": kills,
        }  # fmt: skip
    finally:
        for replica in replicas:
            replica.stop()
        if cluster is not None:
            cluster.close()


def _one_job(
    setup: str, replicas: list[Replica], args: argparse.Namespace, work: Path, job: str, target: str
) -> tuple[Kill, float]:
    """Start the clients of a fresh ``job``, let them heartbeat, kill the leader once; return the
    kill's figures (with the clients' errors) and the seconds the world took to form."""
    work.mkdir(parents=True, exist_ok=True)
    agents = args.members // args.per_agent
    share = [agents // args.procs + (1 if p < agents % args.procs else 0) for p in range(args.procs)]
    stop_file = work / "stop"
    clients: list[subprocess.Popen[bytes]] = []
    try:
        started = time.monotonic()
        for p, count in enumerate(share):
            config = {
                "target": target, "job": job, "world": agents * args.per_agent, "agents": count,
                "per_agent": args.per_agent, "interval": args.interval, "proc": p,
                "ready": str(work / f"{p}.ready"), "out": str(work / f"{p}.json"), "stop": str(stop_file),
            }  # fmt: skip
            clients.append(subprocess.Popen([sys.executable, __file__, "_client", json.dumps(config)]))
        ready = [work / f"{p}.ready" for p in range(len(share))]
        _until(lambda: all(path.exists() for path in ready), args.join_budget, "the world to form", 0.1)
        formed_s = time.monotonic() - started
        time.sleep(args.warmup)  # every agent heartbeating at its pace before the kill
        killed_at, took = _one_kill(setup, replicas, args, job)
        stop_file.write_text("stop")
        for client in clients:
            client.wait(120)
        answers: list[list[float]] = []
        errors: list[str] = []
        for p in range(len(share)):
            out = json.loads((work / f"{p}.json").read_text())
            answers += out["answers"]
            errors += out["errors"]
        kill: Kill = {**took, **_reattach(answers, killed_at, args.per_agent), "client_errors": errors}
        return kill, formed_s
    finally:
        stop_file.write_text("stop")
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(10)


def _one_kill(
    setup: str, replicas: list[Replica], args: argparse.Namespace, name: str
) -> tuple[float, KillTimes]:
    """SIGKILL the serving coordinator; wait for the take-over and every member to report again;
    return when it was killed (``time.monotonic()``), the times (seconds after the kill) and the
    members failed."""
    leader = next(r for r in replicas if r.leads())
    others = [r for r in replicas if r is not leader]
    killed_wall, killed_at = time.time(), time.monotonic()
    leader.kill()
    if setup == "sqlite":
        leader.start()  # the supervisor's restart, at once
        others = [leader]
    took = _until(lambda: any(r.leads() for r in others), 60, "a coordinator to serve again") - killed_at
    new = next(r for r in others if r.leads())

    def every_member_reported() -> bool:
        job = new.job(name)
        return job is not None and all(m["last_heartbeat"] > killed_wall for m in job["members"])

    seen: float | None
    try:
        seen = (
            _until(every_member_reported, args.reconnect_grace + 10, "every member to report", 0.2)
            - killed_at
        )
    except RuntimeError:
        seen = None  # some never did: the members failed below say which
    # Past the reconnect grace and a liveness window, nobody may have been judged.
    judged_by = killed_at + took + args.reconnect_grace + args.interval * args.misses + 1
    time.sleep(max(0.0, judged_by - time.monotonic()))
    job = new.job(name) or {}
    failed = [m for m in job.get("members", []) if m["state"] == "FAILED"]
    if setup == "etcd":
        leader.start()  # back as a standby for the next kill
        _until(lambda: leader.healthz().get("role") == "standby", 60, "the killed replica to stand by", 0.05)
    return killed_at, {
        "takeover_s": round(took, 3),
        "coordinator_saw_all_s": None if seen is None else round(seen, 2),
        "job_state": job.get("state"),
        "members_failed": len(failed),
    }


def _reattach(answers: list[list[float]], killed_at: float, per_agent: int) -> Reattach:
    """Each agent's first answer after the kill, as seconds after it: the distribution."""
    after = sorted(
        next((t for t in times if t > killed_at + IN_FLIGHT_S), float("inf")) - killed_at for times in answers
    )
    finite = [t for t in after if t != float("inf")]
    return {
        "streams_reattached": len(finite),
        "streams": len(after),
        "reattach_p50_s": _q(finite, 0.5),
        "reattach_p90_s": _q(finite, 0.9),
        "reattach_p99_s": _q(finite, 0.99),
        "reattach_max_s": round(max(finite), 3) if finite else None,
        "reattach_min_s": round(min(finite), 3) if finite else None,
        "histogram_0_25s": _histogram(finite, 0.25),
        "members_per_stream": per_agent,
    }


def _q(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _histogram(values: Sequence[float], width: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        low = int(value / width) * width
        key = f"{low:.2f}-{low + width:.2f}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: float(kv[0].split("-")[0])))


# -- report ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--members", type=int, default=1024, help="members of the job (default 1024)")
    parser.add_argument(
        "--per-agent", type=int, default=8, help="members per agent (one stream each; default 8)"
    )
    parser.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--leader-ttl", type=int, default=3, help="the replicas' --leader-ttl, s (default 3)")
    parser.add_argument("--kills", type=int, default=3, help="leader SIGKILLs per setup (default 3)")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s (default 1)")
    parser.add_argument("--misses", type=int, default=3, help="--heartbeat-misses (default 3)")
    parser.add_argument(
        "--reconnect-grace", type=float, default=10.0, help="--reconnect-grace, s (default 10)"
    )
    parser.add_argument(
        "--warmup", type=float, default=3.0, help="seconds of heartbeats before the first kill"
    )
    parser.add_argument("--join-budget", type=float, default=120.0, help="bound of forming the world, s")
    parser.add_argument("--no-baseline", action="store_true", help="skip the SQLite restart baseline")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write a Markdown table here")
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.members % args.per_agent or min(args.members, args.per_agent, args.procs, args.kills) < 1:
        parser.error("--members must be a positive multiple of --per-agent; --procs and --kills >= 1")
    if ETCD_MISSING:
        print(f"failover.py: {ETCD_MISSING}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sar-failover-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[SetupResult] = []
    for setup in ("etcd", *(() if args.no_baseline else ("sqlite",))):
        result = measure(setup, args, work)
        print(json.dumps(result)[:4000], flush=True)
        results.append(result)
    info = describe("grpcio", load_at="end")
    given = argv if argv is not None else sys.argv[1:]
    doc = {
        "benchmark": "failover",
        "title": "Failover: leader SIGKILL to every member re-attached",
        "headline": failover_page.headline(results, args.leader_ttl),
        "results": results,
        "settings": {
            "members": args.members,
            "per_agent": args.per_agent,
            "procs": args.procs,
            "leader_ttl_s": args.leader_ttl,
            "kills": args.kills,
            "interval_s": args.interval,
            "misses": args.misses,
            "reconnect_grace_s": args.reconnect_grace,
        },
        "command": "python benchmarks/failover.py " + " ".join(given),
        "machine": info,
    }
    write_results(doc, failover_page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        raise SystemExit(run_client(sys.argv[2:]))
    raise SystemExit(main())
