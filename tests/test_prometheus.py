"""Monitoring: the coordinator's ``/sd`` and ``/metrics``, and the shipped Prometheus config, rules
and Grafana dashboards against a real Prometheus scraping a real job.

The first tests need no Prometheus: they pin ``/sd`` and the coordinator's per-rank series with
stub members. The rest (marked ``prometheus``) start a coordinator, then Debian's ``prometheus``
with a temporary copy of ``deploy/prometheus`` (only addresses, intervals and the alerts' waiting
times rewritten, see :func:`prometheus_config`), then a job of 4 ranks (2 ``sar-worker`` agents x
2 local ranks, gloo on loopback) running ``tests/scripts/monitor_rank.py``. They check through
Prometheus' HTTP API that every rank is discovered with its labels and scraped, that every
dashboard query and recording rule returns data, and that each alert fires when its condition is
caused: a straggling rank, a rank stopped (SIGSTOP) while its peers wait in a collective, a rank
killed, the coordinator stopped. The tests of that module share one job and run in file order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import CoordinatorProcess, StartCoordinator
from tests.helpers import LO_PB as LO
from tests.helpers import SAR_WORKER, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RANK_SCRIPT = Path(__file__).parent / "scripts" / "monitor_rank.py"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "needs the `prometheus` and `promtool` binaries on PATH (Debian: apt-get install prometheus)"
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None, reason=NO_PROMETHEUS)

JOB = "mon"
RANKS = ("0", "1", "2", "3")
OPS = ("all_reduce", "all_to_all")
STRAGGLER = "1"  # sleeps before each all_reduce in the latency test
STOPPED = "2"  # SIGSTOPped, then SIGKILLed
HELD = "3"  # stays out of a collective in the blocking test: a stall
# The coordinator's --stall-threshold in the test (shipped 30 s): above the straggler's 1.5 s.
STALL_THRESHOLD_S = 3
# Panels that show data only while a job stalls; the blocking test queries them.
STALL_ONLY = "sar_coordinator_rank_blocking_seconds"
# Every wait below has a deadline; these bound the slow ones (torch start-up on 2 cores).
WORLD_DEADLINE_S = 90.0
ALERT_DEADLINE_S = 30.0
# The stuck alert's threshold in the test: shipped 120 s, which no test should wait for.
STUCK_THRESHOLD_S = 4
RATE_INTERVAL = "5m"
# How often a wait looks again, in seconds: each look is an HTTP query.
POLL_S = 0.25

AGENT = [
    *SAR_WORKER, "--job", JOB, "--world-size", "4", "--nproc-per-node", "2",
    "--backend", "gloo", "--socket-name", "lo", "--heartbeat-interval", "0.25", "--join-timeout", "60",
]  # fmt: skip


def http_get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.headers.get("Content-Type", ""), response.read().decode()


# -- /sd and the coordinator's per-rank series, with stub members (no Prometheus needed) ---------


async def join_two(stub: pb_grpc.CoordinatorAsyncStub, job: str) -> list[pb.Assignment]:
    requests = [
        pb.JoinRequest(job=job, world_size=2, host=host, interfaces=[LO], store_port=29500,
                       members=[pb.MemberSpec(rank=i, local_rank=0)])
        for i, host in enumerate(("ha", "hb"))
    ]  # fmt: skip
    responses = await asyncio.gather(*(stub.Join(r, timeout=10) for r in requests))
    return [r.assignments[0] for r in responses]


async def report(stub: pb_grpc.CoordinatorAsyncStub, reports: list[pb.MemberReport]) -> None:
    call = stub.Heartbeat(iter([pb.HeartbeatRequest(reports=reports)]), timeout=5)
    # Read to the end: the request iterator's end half-closes the stream, an orderly end. (A
    # cancelled stream reads as a dead reporter, whose members the coordinator then fails.)
    async for _ in call:
        pass


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name{labels}`` (exact label set) in exposition ``text``."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return None


async def test_sd_serves_json_with_every_live_rank_and_drops_those_that_leave_or_die(
    start_coordinator: StartCoordinator,
) -> None:
    coord: CoordinatorProcess = start_coordinator("--heartbeat-interval", "0.5", "--heartbeat-misses", "600")
    async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        a, b = await join_two(stub, "sd")
        await report(stub, [
            pb.MemberReport(member_id=a.member_id, secret=a.secret, metrics_address="0.0.0.0:9101"),
            pb.MemberReport(member_id=b.member_id, secret=b.secret, metrics_address="127.0.0.1:9102"),
        ])  # fmt: skip
        content_type, body = http_get(f"{coord.http_url}/sd")
        assert content_type.split(";")[0] == "application/json"
        groups = json.loads(body)
        coordinator = {"targets": [f"127.0.0.1:{coord.http_port}"], "labels": {"job": "sar-coordinator"}}
        assert groups[0] == coordinator
        assert sorted(groups[1:], key=lambda g: g["labels"]["rank"]) == [
            {
                "targets": [f"127.0.0.1:{9101 + r}"],
                "labels": {"job": "sd", "rank": str(r), "host": h, "generation": "1"},
            }
            for r, h in ((0, "ha"), (1, "hb"))
        ]
        # Every call answers the full list: the same again.
        assert json.loads(http_get(f"{coord.http_url}/sd")[1]) == groups
        # A member that dies fails its job: every rank of it drops out (its peers are being stopped).
        await stub.Leave(pb.LeaveRequest(member_id=b.member_id, secret=b.secret, exit_code=137), timeout=5)
        assert json.loads(http_get(f"{coord.http_url}/sd")[1]) == groups[:1]
        # One that leaves cleanly drops out too, and its job's others stay listed while they run.
        c, d = await join_two(stub, "clean")
        await report(stub, [
            pb.MemberReport(member_id=m.member_id, secret=m.secret, metrics_address=f"127.0.0.1:{9200 + i}")
            for i, m in enumerate((c, d))
        ])  # fmt: skip
        await stub.Leave(pb.LeaveRequest(member_id=c.member_id, secret=c.secret, exit_code=0), timeout=5)
        remaining = json.loads(http_get(f"{coord.http_url}/sd")[1])
        assert [g["targets"] for g in remaining] == [groups[0]["targets"], ["127.0.0.1:9201"]]


async def test_sd_never_lists_an_address_the_member_does_not_have(
    start_coordinator: StartCoordinator,
) -> None:
    coord: CoordinatorProcess = start_coordinator("--heartbeat-interval", "0.5", "--heartbeat-misses", "600")
    async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        a, b = await join_two(stub, "forged")
        forged = pb.MemberReport(member_id=a.member_id, secret=a.secret, metrics_address="169.254.169.254:80")
        fine = pb.MemberReport(member_id=b.member_id, secret=b.secret, metrics_address="127.0.0.1:9102")
        call = stub.Heartbeat(iter([pb.HeartbeatRequest(reports=[fine, forged], closing=True)]), timeout=5)
        answers = [answer async for answer in call]
        # The forged endpoint is dropped and said so; the member and the fine report are kept.
        assert [list(a.refused) for a in answers] == [[
            "reports[1].metrics_address '169.254.169.254:80' must be on an address of the member's own "
            "host 'ha' (it reported 127.0.0.1), or on 0.0.0.0; a rank's metrics endpoint is where it listens"
        ]]  # fmt: skip
        assert not answers[0].unknown_members
        groups = json.loads(http_get(f"{coord.http_url}/sd")[1])
        assert [g["targets"] for g in groups if g["labels"]["job"] == "forged"] == [["127.0.0.1:9102"]]


async def test_coordinator_exports_rank_up_and_time_inside_the_current_collective(
    start_coordinator: StartCoordinator,
) -> None:
    coord: CoordinatorProcess = start_coordinator("--heartbeat-interval", "0.5", "--heartbeat-misses", "600")
    before = coord.get_text("/metrics")
    # Every failure reason is there from the start, so rates over failures have a series.
    for reason in ("missed_heartbeats", "killed", "exit_code", "reported"):
        assert sample(before, "sar_coordinator_member_failures_total", reason=reason) == 0
    assert sample(before, "sar_coordinator_restarts_total") == 0
    async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        a, b = await join_two(stub, "gauge")
        await report(stub, [
            pb.MemberReport(member_id=a.member_id, secret=a.secret, progress=pb.Progress(
                seq=3, op="all_to_all", in_collective=True, since=time.time() - 5)),
            pb.MemberReport(member_id=b.member_id, secret=b.secret, progress=pb.Progress(
                seq=3, op="all_to_all", in_collective=False, since=time.time() - 5)),
        ])  # fmt: skip
        text = coord.get_text("/metrics")
        assert sample(text, "sar_coordinator_rank_up", job="gauge", rank="0") == 1
        assert sample(text, "sar_coordinator_rank_up", job="gauge", rank="1") == 1
        inside = sample(text, "sar_coordinator_rank_collective_seconds", job="gauge", rank="0")
        assert inside is not None
        assert 5 <= inside < 30
        assert sample(text, "sar_coordinator_rank_collective_seconds", job="gauge", rank="1") == 0
        assert sample(text, "sar_coordinator_members", state="RUNNING") == 2
        assert sample(text, "sar_coordinator_jobs", state="RUNNING") == 1
        # Rank 1 is killed; then rank 0 is stopped by its agent and fails too. Only rank 1, whose
        # failure failed the job, is down; nothing of the job is "inside a collective" any more.
        for member, code, why in ((b, 137, "killed by signal 9"), (a, 143, "killed by signal 15, stopped")):
            leave = pb.LeaveRequest(
                member_id=member.member_id, secret=member.secret, exit_code=code, reason=why
            )
            await stub.Leave(leave, timeout=5)
        text = coord.get_text("/metrics")
        assert sample(text, "sar_coordinator_rank_up", job="gauge", rank="1") == 0
        assert sample(text, "sar_coordinator_rank_up", job="gauge", rank="0") is None
        assert sample(text, "sar_coordinator_rank_collective_seconds", job="gauge", rank="0") is None
        assert sample(text, "sar_coordinator_member_failures_total", reason="killed") == 1
        assert sample(text, "sar_coordinator_jobs", state="FAILED") == 1
        # The job forming again is a restart, and its failed generation's rank is no longer down.
        await join_two(stub, "gauge")
        text = coord.get_text("/metrics")
        assert sample(text, "sar_coordinator_restarts_total") == 1
        assert sample(text, "sar_coordinator_rank_up", job="gauge", rank="1") == 1


async def test_the_rank_that_failed_a_job_is_still_down_after_a_coordinator_restart(
    start_coordinator: StartCoordinator,
) -> None:
    coord: CoordinatorProcess = start_coordinator("--heartbeat-interval", "0.5", "--heartbeat-misses", "600")
    async with grpc.aio.insecure_channel(coord.grpc_target) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        _, b = await join_two(stub, "persist")
        await stub.Leave(pb.LeaveRequest(member_id=b.member_id, secret=b.secret, exit_code=3), timeout=5)
    coord.stop()
    coord.start()
    text = coord.get_text("/metrics")
    assert sample(text, "sar_coordinator_rank_up", job="persist", rank="1") == 0
    assert sample(text, "sar_coordinator_rank_up", job="persist", rank="0") is None


# -- the shipped files against a real Prometheus ------------------------------------------------


def rewrite(text: str, old: str, new: str, count: int | None = None) -> str:
    """``text`` with ``old`` replaced; fails when the shipped file no longer holds ``old``, so the
    test cannot silently stop testing what it meant to."""
    found = text.count(old)
    assert found, f"{old!r} is not in the shipped file"
    assert count is None or found == count, f"{old!r} found {found} times, not {count}"
    return text.replace(old, new)


def prometheus_config(directory: Path, sd_url: str) -> Path:
    """A copy of ``deploy/prometheus`` in ``directory`` for the test; returns its prometheus.yml.

    Rewritten: the coordinator's /sd address; 1 s scrape, evaluation and discovery intervals
    (shipped 15 s); every alert's ``for:`` to 0 s (shipped 1 to 5 minutes); and the stuck alert's
    threshold to STUCK_THRESHOLD_S (shipped 120 s). Everything else, every expression included,
    is the shipped text.
    """
    shutil.copytree(DEPLOY / "prometheus", directory)
    config = directory / "prometheus.yml"
    text = config.read_text()
    text = rewrite(text, "http://head:9400/sd", sd_url, count=2)
    text = rewrite(text, "scrape_interval: 15s", "scrape_interval: 1s", count=1)
    text = rewrite(text, "scrape_timeout: 10s", "scrape_timeout: 1s", count=1)
    text = rewrite(text, "evaluation_interval: 15s", "evaluation_interval: 1s", count=1)
    text = rewrite(text, "refresh_interval: 15s", "refresh_interval: 1s", count=2)
    config.write_text(text)
    alerts = directory / "rules" / "sarcomm-alerts.yml"
    text = re.sub(r"(?m)^(\s+)for: \S+$", r"\1for: 0s", alerts.read_text())
    text = rewrite(
        text,
        "sar_coordinator_rank_collective_seconds > 120",
        f"sar_coordinator_rank_collective_seconds > {STUCK_THRESHOLD_S}",
        count=1,
    )
    alerts.write_text(text)
    return config


class Prometheus:
    """A ``prometheus`` process on a free loopback port, and its HTTP API."""

    def __init__(self, config: Path, data: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(self._ready, 30, what="Prometheus to be ready", interval=POLL_S)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.log()}")
        try:
            return http_get(f"{self.url}/-/ready")[1].strip() != ""
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        body = json.loads(http_get(f"{self.url}/api/v1/{path}{query}")[1])
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def firing(self, alert: str) -> list[dict[str, str]]:
        """Label sets of the firing instances of ``alert``."""
        return [
            a["labels"] for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == alert
            and a["state"] == "firing"
        ]  # fmt: skip

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class World:
    """Two ``sar-worker`` agents with two local ranks each running ``monitor_rank.py``."""

    def __init__(self, coord: CoordinatorProcess, directory: Path) -> None:
        self.control = directory / "control"
        self.control.mkdir()
        self.logs = directory
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
        self.agents = [
            subprocess.Popen(
                [
                    *AGENT,
                    "--coord",
                    coord.grpc_target,
                    "--",
                    sys.executable,
                    str(RANK_SCRIPT),
                    str(self.control),
                ],
                stdout=(directory / f"agent{i}.log").open("wb"),
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
            for i in range(2)
        ]

    def pid(self, rank: str) -> int:
        return int((self.control / f"rank{rank}.pid").read_text())

    def started(self) -> bool:
        for agent in self.agents:
            if agent.poll() is not None:
                pytest.fail(f"an agent exited with {agent.returncode}: {self.log()}")
        return all((self.control / f"rank{r}.pid").exists() for r in RANKS)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(self.logs.glob("agent*.log")))

    def stop(self) -> None:
        """Ask the ranks to finish; then make sure no agent or rank outlives the module."""
        (self.control / "stop").write_text("")
        for rank in RANKS:
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.pid(rank), signal.SIGCONT)
        for agent in self.agents:
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.terminate()  # the agent stops its ranks on SIGTERM
                try:
                    agent.wait(15)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait(5)
        for rank in RANKS:
            with contextlib.suppress(OSError, ValueError):
                os.kill(self.pid(rank), signal.SIGKILL)


class Monitoring:
    """Everything the Prometheus tests share: the coordinator, Prometheus and the running job."""

    def __init__(self, coord: CoordinatorProcess, prom: Prometheus, world: World, config: Path) -> None:
        self.coord = coord
        self.prom = prom
        self.world = world
        self.config = config
        self.fired: set[str] = set()

    def wait_firing(self, alert: str, match: Callable[[dict[str, str]], bool]) -> dict[str, str]:
        def found() -> dict[str, str] | None:
            return next((labels for labels in self.prom.firing(alert) if match(labels)), None)

        labels = wait_for(found, ALERT_DEADLINE_S, what=f"alert {alert} to fire", interval=POLL_S)
        self.fired.add(alert)
        return labels


@pytest.fixture(scope="module")
def monitoring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitoring]:
    if PROMETHEUS is None or PROMTOOL is None:
        pytest.skip(NO_PROMETHEUS)
    directory = tmp_path_factory.mktemp("monitoring")
    # Long liveness (0.5 s x 60): the stopped rank must stay "alive" for the coordinator while the
    # stuck and unreachable alerts fire; the test then kills it, which is detected at once.
    coord = CoordinatorProcess(
        grpc_port=free_port(), http_port=free_port(), state_path=directory / "state.sqlite",
        args=["--heartbeat-interval", "0.5", "--heartbeat-misses", "60", "--join-timeout", "60",
              "--stall-threshold", str(STALL_THRESHOLD_S)],
        log_path=directory / "coordinator.log",
    )  # fmt: skip
    coord.start()
    config = prometheus_config(directory / "prometheus", f"{coord.http_url}/sd")
    prom = Prometheus(config, directory / "tsdb", directory / "prometheus.log")
    world: World | None = None
    try:
        # The coordinator is scraped before the world forms, so its join and rendezvous counters
        # are seen rising (a rate over a counter first seen after the fact is 0).
        wait_for(
            lambda: prom.query('up{job="sar-coordinator"} == 1'),
            20,
            what="the coordinator target to be up",
            interval=POLL_S,
        )
        world = World(coord, directory)
        wait_for(world.started, WORLD_DEADLINE_S, what="every rank to start", interval=POLL_S)
        yield Monitoring(coord, prom, world, config)
    finally:
        if world is not None:
            world.stop()
        prom.stop()
        coord.stop()


def firing_in_job(monitoring: Monitoring, alert: str) -> list[dict[str, str]]:
    """Label sets of the firing instances of ``alert`` about the test's job."""
    return [a for a in monitoring.prom.firing(alert) if a.get("job") == JOB]


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


@pytest.mark.prometheus
@needs_prometheus
def test_promtool_accepts_the_shipped_config_and_rules() -> None:
    assert PROMTOOL is not None
    rules = sorted(str(p) for p in (DEPLOY / "prometheus" / "rules").glob("*.yml"))
    assert len(rules) >= 2
    config = str(DEPLOY / "prometheus" / "prometheus.yml")
    for args in (["check", "config", config], ["check", "rules", *rules]):
        proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.prometheus
@needs_prometheus
def test_every_rank_is_discovered_through_sd_and_scraped_with_its_labels(monitoring: Monitoring) -> None:
    prom = monitoring.prom

    def all_up() -> list[dict[str, Any]] | None:
        ranks = [t for t in prom.targets() if t["labels"].get("job") == JOB]
        return ranks if len(ranks) == 4 and all(t["health"] == "up" for t in ranks) else None

    ranks = wait_for(all_up, 30, what="4 rank targets up", interval=POLL_S)
    hosts = {t["labels"]["host"] for t in ranks}
    assert len(hosts) == 1
    assert "" not in hosts
    assert sorted(t["labels"]["rank"] for t in ranks) == list(RANKS)
    for target in ranks:
        labels = target["labels"]
        assert labels["generation"] == "1"
        assert labels["instance"].startswith("127.0.0.1:")
        assert target["scrapePool"] == "sar-ranks"
    (coordinator,) = [t for t in prom.targets() if t["scrapePool"] == "sar-coordinator"]
    assert coordinator["labels"]["job"] == "sar-coordinator"
    assert coordinator["labels"]["instance"] == f"127.0.0.1:{monitoring.coord.http_port}"
    assert coordinator["health"] == "up"
    # The same through a query: `up` of each rank, with the /sd labels on the series.
    up = prom.query(f'up{{job="{JOB}"}}')
    assert sorted((r["metric"]["rank"], r["value"][1]) for r in up) == [(r, "1") for r in RANKS]


@pytest.mark.prometheus
@needs_prometheus
def test_collective_counts_are_non_zero_for_every_rank_and_op(monitoring: Monitoring) -> None:
    def counted() -> list[dict[str, Any]] | None:
        result = monitoring.prom.query(f'sar_collective_duration_seconds_count{{job="{JOB}"}} > 0')
        return result if len(result) == len(RANKS) * len(OPS) else None

    result = wait_for(counted, 30, what="a count for every rank and op", interval=POLL_S)
    assert sorted((r["metric"]["rank"], r["metric"]["op"]) for r in result) == [
        (rank, op) for rank in RANKS for op in OPS
    ]
    assert {r["metric"]["backend"] for r in result} == {"gloo"}
    # The coordinator's per-rank series carry the rank's own job and rank (honor_labels).
    up = monitoring.prom.query(f'sar_coordinator_rank_up{{job="{JOB}"}}')
    assert sorted((r["metric"]["rank"], r["value"][1]) for r in up) == [(r, "1") for r in RANKS]


def rule_groups(prom: Prometheus) -> list[dict[str, Any]]:
    return list(prom.api("rules")["groups"])


@pytest.mark.prometheus
@needs_prometheus
def test_every_rule_loads_and_every_recording_rule_returns_data(monitoring: Monitoring) -> None:
    prom = monitoring.prom
    groups = rule_groups(prom)
    rules = [rule for group in groups for rule in group["rules"]]
    # The store's alert (etcd's quota) has its file and group of its own: it fires only on etcd.
    assert {g["name"] for g in groups} == {"sarcomm-collectives", "sarcomm-alerts", "sarcomm-store-alerts"}
    for rule in rules:
        assert rule["health"] == "ok", rule
        assert not rule.get("lastError"), rule
    recording = [r for r in rules if r["type"] == "recording"]
    assert len(recording) >= 14
    for rule in recording:
        # The recorded series, for this job, and the rule's expression evaluated now.
        # Per-rank rules hold a series for every rank (once each has two samples to rate).
        ranks: set[str | None] = set(RANKS) if rule["name"].startswith("job_rank_") else {None}
        for expr in (f'{rule["name"]}{{job="{JOB}"}}', rule["query"]):

            def complete(e: str = expr, want: set[str | None] = ranks) -> bool:
                result = [r for r in prom.query(e) if math.isfinite(float(r["value"][1]))]
                return {r["metric"].get("rank") for r in result} == want

            wait_for(complete, 15, what=f"data for every rank from {expr}", interval=POLL_S)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expression) of every target of every shipped dashboard."""
    found = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        document = json.loads(path.read_text())
        panels = list(document["panels"])
        while panels:
            panel = panels.pop()
            panels.extend(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append((path.name, panel["title"], target["expr"]))
    return found


def variable_queries() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] == "query":
                query = variable["query"]
                text = query if isinstance(query, str) else query["query"]
                found.append((path.name, variable["name"], text))
    return found


def substitute(expr: str) -> str:
    """Grafana's variables as a user would have them: this job, both ops, every rank, and a 5 m
    $__rate_interval (what Grafana derives for a range of a few hours at a 15 s scrape interval;
    long enough to hold this job's whole life, rendezvous included)."""
    values = {"$__rate_interval": RATE_INTERVAL, "$job": JOB, "$op": "|".join(OPS), "$rank": "|".join(RANKS)}
    for name, value in values.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"an unknown variable in {expr}"
    return expr


def test_the_dashboards_are_grafana_json_with_job_op_and_rank_variables() -> None:
    names = {}
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        document = json.loads(path.read_text())
        assert document["uid"]
        assert document["title"]
        assert document["panels"]
        names[path.name] = {v["name"] for v in document["templating"]["list"]}
        for panel in document["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
    assert names["sarcomm-collectives.json"] >= {"datasource", "job", "op", "rank"}
    assert names["sarcomm-coordinator.json"] >= {"datasource", "job"}
    assert len(dashboard_queries()) >= 20
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert "type: prometheus" in (provisioning / "datasources" / "sarcomm.yml").read_text()
    assert "type: file" in (provisioning / "dashboards" / "sarcomm.yml").read_text()


@pytest.mark.prometheus
@needs_prometheus
def test_every_dashboard_query_and_variable_returns_data(monitoring: Monitoring) -> None:
    prom = monitoring.prom
    for dashboard, title, expr in dashboard_queries():
        if STALL_ONLY in expr:
            continue  # no stall yet: test_blocking_alert_and_panel_name_the_rank_the_others_wait_for
        query = substitute(expr)

        def answered(q: str = query) -> bool:
            return finite(prom.query(q))

        wait_for(answered, 15, what=f"data for {dashboard} / {title}: {query}", interval=POLL_S)
    for dashboard, name, definition in variable_queries():
        # label_values(SELECTOR, LABEL) lists the values of LABEL among SELECTOR's series.
        matched = re.fullmatch(r"label_values\((.*), *(\w+)\)", definition)
        assert matched, definition
        selector, label = substitute(matched[1]), matched[2]
        values = {r["metric"].get(label) for r in prom.query(f"count by ({label}) ({selector})")}
        # Ranks export every op from the start (at 0), so `op` lists more than the job ran.
        if name == "op":
            assert values >= set(OPS), (dashboard, name, values)
        else:
            assert values == {"job": {JOB}, "rank": set(RANKS)}[name], (dashboard, name, values)


@pytest.mark.prometheus
@needs_prometheus
def test_latency_alert_fires_when_one_rank_straggles_and_the_straggler_stands_out(
    monitoring: Monitoring,
) -> None:
    prom = monitoring.prom
    # The steady state: no p99 far above its level (the baseline this alert compares with).
    assert not [a for a in prom.firing("SarCollectiveLatencyHigh") if a["job"] == JOB]
    slow = monitoring.world.control / "slow"
    slow.write_text(STRAGGLER)
    try:
        # The straggler's peers wait for it in every all_reduce.
        labels = monitoring.wait_firing(
            "SarCollectiveLatencyHigh",
            lambda a: a["job"] == JOB and a["op"] == "all_reduce" and a["rank"] != STRAGGLER,
        )
        assert labels["severity"] == "warning"
        # On the dashboard the straggler is the rank that spends the least time in collectives
        # (over a window short enough to hold only the straggling seconds).
        title = "Share of time inside collectives by rank"
        (expr,) = [e for _, t, e in dashboard_queries() if t == title]
        query = substitute(expr).replace(f"[{RATE_INTERVAL}]", "[4s]")

        def straggler_least() -> dict[str, float] | None:
            share = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(query)}
            assert sorted(share) == list(RANKS), share
            return share if min(share, key=share.__getitem__) == STRAGGLER else None

        wait_for(
            straggler_least,
            15,
            what=f"rank {STRAGGLER} to spend the least time in collectives",
            interval=POLL_S,
        )
    finally:
        slow.unlink()


@pytest.mark.prometheus
@needs_prometheus
def test_blocking_alert_and_panel_name_the_rank_the_others_wait_for(monitoring: Monitoring) -> None:
    hold = monitoring.world.control / "hold"
    hold.write_text(HELD)
    try:
        # The held rank is alive and reporting, but stays out of the next collective: its peers
        # wait in it, and past the stall threshold the coordinator names the held rank.
        labels = monitoring.wait_firing("SarRankBlocking", lambda a: a["job"] == JOB)
        assert (labels["rank"], labels["severity"]) == (HELD, "warning")
        assert labels["op"] in OPS
        assert {a["rank"] for a in firing_in_job(monitoring, "SarRankBlocking")} == {HELD}
        (expr,) = [e for _, _, e in dashboard_queries() if STALL_ONLY in e]
        shown = monitoring.prom.query(substitute(expr))
        assert [(r["metric"]["rank"], r["metric"]["op"]) for r in shown] == [(HELD, labels["op"])]
        assert float(shown[0]["value"][1]) > STALL_THRESHOLD_S
    finally:
        hold.unlink()
    # Released, the rank joins its peers and the stall is over.
    wait_for(
        lambda: not monitoring.prom.query(f"{STALL_ONLY}{{job={JOB!r}}}"),
        20,
        what="the stall to end",
        interval=POLL_S,
    )


@pytest.mark.prometheus
@needs_prometheus
def test_stuck_and_unreachable_alerts_fire_when_a_rank_is_stopped_in_a_collective(
    monitoring: Monitoring,
) -> None:
    os.kill(monitoring.world.pid(STOPPED), signal.SIGSTOP)
    # Its peers wait in the collective it does not join; the coordinator still counts it alive
    # (the liveness is 30 s here), so it stays in /sd and its scrapes time out.
    stuck = monitoring.wait_firing(
        "SarRankStuckInCollective", lambda a: a["job"] == JOB and a["rank"] != STOPPED
    )
    assert stuck["severity"] == "critical"
    unreachable = monitoring.wait_firing(
        "SarRankUnreachable", lambda a: a["job"] == JOB and a["rank"] == STOPPED
    )
    assert unreachable["severity"] == "warning"
    assert not firing_in_job(monitoring, "SarRankDown")


@pytest.mark.prometheus
@needs_prometheus
def test_rank_down_fires_for_the_killed_rank_and_every_rank_leaves_discovery(monitoring: Monitoring) -> None:
    os.kill(monitoring.world.pid(STOPPED), signal.SIGKILL)
    down = monitoring.wait_firing("SarRankDown", lambda a: a["job"] == JOB)
    assert (down["rank"], down["severity"]) == (STOPPED, "critical")
    # Only the rank that failed the job is down, not the peers its agents stopped after it.
    assert {a["rank"] for a in firing_in_job(monitoring, "SarRankDown")} == {STOPPED}
    failures = monitoring.prom.query('sar_coordinator_member_failures_total{reason="killed"}')
    assert [r["value"][1] for r in failures] == ["1"]
    # The failed job's ranks drop out of /sd (the coordinator itself stays), and so out of
    # Prometheus' targets.
    sd = json.loads(http_get(f"{monitoring.coord.http_url}/sd")[1])
    assert [g["labels"]["job"] for g in sd] == ["sar-coordinator"]
    wait_for(
        lambda: not [t for t in monitoring.prom.targets() if t["labels"].get("job") == JOB],
        20,
        what="the job's targets to leave Prometheus",
        interval=POLL_S,
    )
    for agent in monitoring.world.agents:
        assert agent.wait(30) != 0


@pytest.mark.prometheus
@needs_prometheus
def test_coordinator_down_fires_when_it_stops(monitoring: Monitoring) -> None:
    monitoring.coord.stop()
    # Discovery keeps the last list it got, so the coordinator's target stays and fails.
    labels = monitoring.wait_firing("SarCoordinatorDown", lambda a: a["job"] == "sar-coordinator")
    assert labels["instance"] == f"127.0.0.1:{monitoring.coord.http_port}"


@pytest.mark.prometheus
@needs_prometheus
def test_every_shipped_alert_fired_in_this_module(monitoring: Monitoring) -> None:
    alerts = (DEPLOY / "prometheus" / "rules" / "sarcomm-alerts.yml").read_text()
    shipped = set(re.findall(r"(?m)^\s+- alert: (\S+)$", alerts))
    assert shipped == monitoring.fired
