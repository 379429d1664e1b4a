"""Failure detection: time from a rank's death to the last other rank stopping, sarcomm against gloo.

Three faults, each injected into one rank (the last) of a 4-rank job whose ranks run gloo
``all_reduce`` (1024 floats) in a loop, 10 ms apart:

- ``kill``: SIGKILL of the rank's process.
- ``hang``: SIGSTOP of the rank's process: alive, sockets open, doing nothing (a wedged rank).
- ``partition``: the rank's host loses its network (``ip link set eth0 down`` in its namespace).

Three ways to run the job:

- ``agent``: ``sar-worker`` on each host starts the rank (``sar.init()``); agents stop their ranks
  (SIGTERM, then SIGKILL) when the coordinator reports a failure.
- ``library``: each rank registers itself (SAR's ``coord_ip_init`` + ``initialize_comms``); a
  failure reported by the coordinator aborts its process group, and the collective it waits in
  raises ``sar.PeerFailedError``.
- ``gloo``: the baseline, a plain ``torch.distributed`` gloo job (``init_process_group`` over TCP)
  with a process-group timeout of ``--gloo-timeout`` seconds (default 20, so that the benchmark
  ends; torch's default for gloo is 30 minutes, which is what a plain job waits). A run that has
  not ended by ``--gloo-timeout`` + 20 s is reported as "> deadline".

Each host is a network namespace with one veth on a bridge (the bridge lives in a namespace of its
own, so the root namespace's firewall never sees the traffic); the coordinator runs in the root
namespace with its defaults (``--heartbeat-interval 1``, ``--heartbeat-misses 3``), as do the
agents and libraries. Without root or ``ip`` the hosts share the loopback interface and
``partition`` is skipped.

Measured per run, from the instant the fault is injected (monotonic clock of this process):

- ``stopped_s``: until the last process of the other three ranks has exited (polled every 2 ms
  through /proc; for ``agent`` these are the rank processes, not the agents).
- ``told_s`` (sarcomm only): until the coordinator's MEMBER_FAILED event reached a ``Watch`` stream
  opened by this script.

Every (fault, way) pair runs ``--repeats`` times (``--baseline-repeats`` for gloo, which waits for
its timeout); the median is reported with the range. Run from the repository root::

    sudo python benchmarks/failure_detection.py --json benchmarks/results/failure_detection.json \\
        --markdown benchmarks/results/failure_detection.md     # about 8 minutes on 2 cores

A rank program is this same file (``failure_detection.py _rank ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import SAR_WORKER, CoordinatorProcess
from recording import describe, write_results
from renderers import failure_detection as failure_detection_page
from renderers.failure_detection import SummaryRow

SCENARIOS = ("kill", "hang", "partition")
MODES = ("agent", "library", "gloo")
WORLD = 4
PAUSE_S = 0.01
#: Seconds the loop runs before the fault, so that every rank is in its steady state.
WARMUP_S = 1.5
START_DEADLINE_S = 120.0
SUBNET = "10.80.0"


# -- the rank program ------------------------------------------------------------------------------


def rank_main(argv: list[str]) -> int:
    """``_rank MODE CONTROL ...``: one rank; writes CONTROL/rank<R>.pid, loops, records its end."""
    import datetime

    import torch
    import torch.distributed as dist

    mode, control = argv[0], Path(argv[1])
    reduce: Callable[[torch.Tensor], object]
    if mode == "agent":
        import sarcomm.worker as sar

        rank = sar.init().rank
        reduce = sar.all_reduce
    elif mode == "library":
        import sarcomm.worker as sar

        coord, job, rank, world = argv[2], argv[3], int(argv[4]), int(argv[5])
        master = sar.coord_ip_init(rank, coord, job=job, world_size=world)
        sar.initialize_comms(rank, world, master, "gloo")
        reduce = sar.all_reduce
    else:
        rank, world, master_addr, port, timeout = (
            int(argv[2]), int(argv[3]), argv[4], int(argv[5]), float(argv[6]),
        )  # fmt: skip
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        reduce = dist.all_reduce
    (control / f"rank{rank}.pid").write_text(str(os.getpid()))
    tensor = torch.ones(1024)
    try:
        while True:
            reduce(tensor)
            tensor.fill_(1.0)
            time.sleep(PAUSE_S)
    except Exception as exc:  # what ended the loop is the measurement's subject
        end = {"at": time.time(), "error": type(exc).__name__, "message": str(exc)[:300]}
        (control / f"rank{rank}.end").write_text(json.dumps(end))
        os._exit(3)  # at once: an orderly teardown of a broken group can hang


# -- hosts -----------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def netns_unavailable() -> str:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return ""


@dataclass
class Hosts:
    """WORLD hosts: namespaces on one bridge, or (``names`` empty) the loopback interface."""

    names: list[str] = field(default_factory=list)
    switch: str = ""
    head_link: str = ""

    @property
    def netns(self) -> bool:
        return bool(self.names)

    @property
    def coordinator_address(self) -> str:
        return f"{SUBNET}.1" if self.netns else "127.0.0.1"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}" if self.netns else "127.0.0.1"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]] if self.netns else []

    @classmethod
    def create(cls) -> Hosts:
        tag = str(os.getpid() % 100000)
        hosts = cls([f"sarfd{tag}-{i}" for i in range(WORLD)], f"sarfdsw{tag}", f"sarfd{tag}")
        try:
            for name in (hosts.switch, *hosts.names):
                _ip("netns", "add", name)
            _ip("-n", hosts.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", hosts.switch, "link", "set", "br0", "up")
            _ip("link", "add", hosts.head_link, "type", "veth", "peer", "name", "up0", "netns", hosts.switch)
            _ip("addr", "add", f"{SUBNET}.1/24", "dev", hosts.head_link)
            _ip("link", "set", hosts.head_link, "up")
            ports = ["up0"]
            for i, name in enumerate(hosts.names):
                port = f"up{i + 1}"
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", port, "netns",
                    hosts.switch)  # fmt: skip
                _ip("-n", name, "addr", "add", f"{hosts.address(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", "eth0", "up")
                ports.append(port)
            for port in ports:
                _ip("-n", hosts.switch, "link", "set", port, "master", "br0")
                _ip("-n", hosts.switch, "link", "set", port, "up")
        except BaseException:
            hosts.delete()
            raise
        return hosts

    def cut(self, i: int) -> None:
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.names[i], "link", "set", "eth0", "up")

    def delete(self) -> None:
        for name in (self.switch, *self.names):
            if name:
                _ip("netns", "del", name, check=False)
        if self.head_link:
            _ip("link", "del", self.head_link, check=False)


# -- one run ---------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Watcher:
    """Records when the coordinator's first MEMBER_FAILED of ``job`` arrives on a Watch stream.

    One long stream (events are not replayed, so a gap between two streams could lose one),
    cancelled by :meth:`close`.
    """

    def __init__(self, target: str, job: str) -> None:
        self.failed_at: float | None = None
        self.event = ""
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._watch(target, job),), daemon=True
        )
        self._thread.start()

    async def _watch(self, target: str, job: str) -> None:
        from sarcomm.common.client.coordinator_client import CoordinatorClient
        from sarcomm.common.constants import EventKind
        from sarcomm.common.errors import SarcommError

        self._task = asyncio.current_task()
        try:
            while self.failed_at is None:
                try:
                    async with CoordinatorClient(target, timeout=5.0) as client:
                        async for event in client.watch(job, timeout=600.0):
                            if event.kind is EventKind.MEMBER_FAILED and self.failed_at is None:
                                self.failed_at = time.monotonic()
                                self.event = event.describe()
                                return
                except SarcommError:
                    await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            return

    def close(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


def start_coordinator(workdir: Path, interval: float, misses: int) -> CoordinatorProcess:
    """The coordinator, its gRPC on every interface (the hosts reach it from their namespaces)."""
    coordinator = CoordinatorProcess(
        workdir / "coordinator.log",
        state=workdir / "state.sqlite",
        flags=[
            "--heartbeat-interval",
            str(interval),
            "--heartbeat-misses",
            str(misses),
            "--shutdown-grace",
            "1",
        ],
        listen_host="0.0.0.0",
        env=_env(),
    )
    try:
        coordinator.wait_serving()
    except BaseException:
        coordinator.close()
        raise
    return coordinator


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SARCOMM_", "SAR_"))}
    env.update(extra)
    return env


def run_once(
    scenario: str,
    mode: str,
    index: int,
    hosts: Hosts,
    coord: CoordinatorProcess,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    """One job, one fault; returns the measurements of this run."""
    job = f"{scenario}-{mode}-{index}"
    control = work / job
    control.mkdir()
    script = str(Path(__file__).resolve())
    target = f"{hosts.coordinator_address}:{coord.grpc_port}"
    procs: list[subprocess.Popen[bytes]] = []
    watcher = Watcher(f"127.0.0.1:{coord.grpc_port}", job) if mode != "gloo" else None
    gloo_port = 20000 + (os.getpid() * 7 + index * 131 + hash(scenario) % 97) % 20000
    log = (work / f"{job}.log").open("ab")
    victim = WORLD - 1
    result: dict[str, Any] = {"scenario": scenario, "mode": mode, "run": index}
    try:
        for i in range(WORLD):
            iface = {"GLOO_SOCKET_IFNAME": "eth0"} if hosts.netns else {}
            if mode == "agent":
                command = [*SAR_WORKER, "--coord", target, "--job", job,
                           "--world-size", str(WORLD), "--rank", str(i), "--backend", "gloo",
                           "--heartbeat-interval", str(args.interval), "--metrics-port", "-1",
                           "--", sys.executable, script, "_rank", "agent", str(control)]  # fmt: skip
                env = _env()
            elif mode == "library":
                command = [sys.executable, script, "_rank", "library", str(control), target, job, str(i),
                           str(WORLD)]  # fmt: skip
                env = _env(SARCOMM_HEARTBEAT_INTERVAL=str(args.interval), SAR_METRICS_PORT="-1", **iface)
            else:
                command = [sys.executable, script, "_rank", "gloo", str(control), str(i), str(WORLD),
                           hosts.address(0), str(gloo_port), str(args.gloo_timeout)]  # fmt: skip
                env = _env(**iface)
            procs.append(
                subprocess.Popen([*hosts.prefix(i), *command], stdout=log, stderr=subprocess.STDOUT, env=env)
            )
        deadline = time.monotonic() + START_DEADLINE_S
        pid_files = [control / f"rank{r}.pid" for r in range(WORLD)]
        while not all(f.exists() for f in pid_files):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{job}: the ranks did not start; see {work / (job + '.log')}")
            time.sleep(0.05)
        pids = [int(f.read_text()) for f in pid_files]
        time.sleep(WARMUP_S)
        if not all(_alive(p) for p in pids):
            raise RuntimeError(f"{job}: a rank ended before the fault; see {work / (job + '.log')}")

        started = time.monotonic()
        if scenario == "kill":
            os.kill(pids[victim], signal.SIGKILL)
        elif scenario == "hang":
            os.kill(pids[victim], signal.SIGSTOP)
        else:
            hosts.cut(victim)
        others = [p for r, p in enumerate(pids) if r != victim]
        limit = started + (args.gloo_timeout + 20.0 if mode == "gloo" else args.deadline)
        while any(_alive(p) for p in others) and time.monotonic() < limit:
            time.sleep(0.002)
        stopped = time.monotonic()
        result["stopped_s"] = None if any(_alive(p) for p in others) else round(stopped - started, 3)
        result["deadline_s"] = round(limit - started, 1)
        if watcher is not None:
            # The others may stop before the event reaches this Watch (gloo fails their collective
            # the moment a killed peer's connections close): give it a moment.
            told_by = time.monotonic() + 5.0
            while watcher.failed_at is None and time.monotonic() < told_by:
                time.sleep(0.01)
            result["told_s"] = round(watcher.failed_at - started, 3) if watcher.failed_at else None
            result["told"] = watcher.event
        ends = [control / f"rank{r}.end" for r in range(WORLD) if r != victim]
        errors = [json.loads(e.read_text())["error"] for e in ends if e.exists()]
        result["rank_errors"] = sorted(set(errors))
    finally:
        if watcher is not None:
            watcher.close()
        for pid_file in control.glob("rank*.pid"):
            pid = int(pid_file.read_text())
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        if scenario == "partition" and hosts.netns:
            hosts.mend(victim)
        log.close()
    return result


# -- the benchmark ---------------------------------------------------------------------------------


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    values = [r[key] for r in runs if r.get(key) is not None]
    missing = len(runs) - len(values)
    if not values:
        return {"median": None, "min": None, "max": None, "over_deadline": missing}
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "over_deadline": missing,
    }


def machine() -> dict[str, Any]:
    """What the numbers were measured on (see recording.describe)."""
    return describe("torch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=5, help="runs of each sarcomm pair (default 5)")
    parser.add_argument("--baseline-repeats", type=int, default=3, help="runs of each gloo pair (default 3)")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval, s (default 1)")
    parser.add_argument("--misses", type=int, default=3, help="heartbeat misses (default 3)")
    parser.add_argument("--gloo-timeout", type=float, default=20.0, help="the baseline's timeout, s")
    parser.add_argument("--deadline", type=float, default=30.0, help="bound of a sarcomm run, s")
    parser.add_argument("--loopback", action="store_true", help="no namespaces (and no partition)")
    parser.add_argument("--quick", action="store_true", help="one run each, gloo timeout 5 s")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write a Markdown table here")
    parser.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.baseline_repeats, args.gloo_timeout = 1, 1, 5.0
    scenarios = [s for s in args.scenarios.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for name, chosen, allowed in (("--scenarios", scenarios, SCENARIOS), ("--modes", modes, MODES)):
        bad = [c for c in chosen if c not in allowed]
        if bad:
            parser.error(f"{name} {','.join(bad)!r}: each must be one of {', '.join(allowed)}")
    why_not = "--loopback given" if args.loopback else netns_unavailable()
    if why_not and "partition" in scenarios:
        print(f"skipping partition: {why_not}", file=sys.stderr)
        scenarios.remove("partition")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="sar-failure-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    hosts = Hosts() if why_not else Hosts.create()
    coord = start_coordinator(work, args.interval, args.misses)
    runs: list[dict[str, Any]] = []
    try:
        for scenario in scenarios:
            for mode in modes:
                for index in range(args.baseline_repeats if mode == "gloo" else args.repeats):
                    result = run_once(scenario, mode, index, hosts, coord, args, work)
                    runs.append(result)
                    print(json.dumps(result), flush=True)
    finally:
        coord.close()
        hosts.delete()
    info["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)

    summary: list[SummaryRow] = []
    for scenario in scenarios:
        for mode in modes:
            mine = [r for r in runs if r["scenario"] == scenario and r["mode"] == mode]
            stopped, told = _summary(mine, "stopped_s"), _summary(mine, "told_s")
            summary.append(
                {
                    "scenario": scenario,
                    "mode": mode,
                    "runs": len(mine),
                    "stopped_median_s": stopped["median"],
                    "stopped_min_s": stopped["min"],
                    "stopped_max_s": stopped["max"],
                    "over_deadline": stopped["over_deadline"],
                    "told_median_s": told["median"],
                    "deadline_s": mine[0]["deadline_s"] if mine else None,
                }
            )
    headline = []
    for scenario in scenarios:
        row = {r["mode"]: r for r in summary if r["scenario"] == scenario}
        parts = []
        for mode in modes:
            r = row[mode]
            value = (
                f"{r['stopped_median_s']:.2f} s"
                if r["stopped_median_s"] is not None
                else f"> {r['deadline_s']:g} s"
            )
            parts.append(f"{mode} {value}")
        headline.append(f"{scenario}: last other rank stopped after " + ", ".join(parts) + " (median)")
    settings = {
        "world_size": WORLD,
        "hosts": "network namespaces on a bridge" if hosts.netns else "loopback",
        "heartbeat_interval_s": args.interval,
        "heartbeat_misses": args.misses,
        "gloo_timeout_s": args.gloo_timeout,
        "repeats": args.repeats,
        "baseline_repeats": args.baseline_repeats,
    }
    given = argv if argv is not None else sys.argv[1:]
    command = "sudo python benchmarks/failure_detection.py " + " ".join(given)
    doc = {
        "benchmark": "failure_detection",
        "title": "Failure detection: a rank's death to the last other rank stopping",
        "headline": headline,
        "summary": summary,
        "command": command.strip(),
        "settings": settings,
        "machine": info,
        "quick": args.quick,
        "runs": runs,
    }
    write_results(doc, failure_detection_page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        raise SystemExit(rank_main(sys.argv[2:]))
    raise SystemExit(main())
