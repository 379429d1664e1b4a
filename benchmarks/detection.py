"""Failure detection inside a big job: each failure class of issue 28 measured in a job of
``--agents`` simulated agents x ``--ranks-per-agent`` ranks (4,096 x 8 at full size), one fault per
fresh job, the victim an agent simulated in a ``load_agents.py`` process of its own.

Classes (``--faults``), with the bound issue 28 sets:

- ``kill``: the victim's process SIGKILLed (its connection closes): its members judged within 1.5 s;
- ``stop``: the victim's process SIGSTOPped (its connection stays open; only the server's keepalive
  pings find it): within 5 s;
- ``silent``: one rank of the victim stops; the victim reports it with a growing age, as the real
  agent does (by exception: once, past the policy's ``silence_seconds``): within 5 s;
- ``stuck``: the victim's loop is stuck: its stream stays open and it renews no lease: within two
  lease periods (the coordinator's policy; per second: its heartbeat misses);
- ``stall``: every other agent's ranks enter collective #S (reported quiet by exception after
  ``quiet_seconds``) while the victim's ranks stay at #S-1: the coordinator names them as blocking
  (its log line for the Stall, on its own clock) within ``--stall-threshold`` + 2 s;
- and from the ``kill`` run (or the first failure run): ``fanout``, the MEMBER_FAILED verdict to the
  event arriving on every other agent's stream: within 1 s.

Times are taken from the fault (its wall and monotonic instants in this process, one clock on one
host) to the coordinator's verdict on its own clock (the MEMBER_FAILED event's ``time`` on a Watch
stream this script opens before the fault; the stall's WARNING line in the coordinator's log), and
to the event's arrival on the Watch stream and on the agents' streams.

Run::

    python benchmarks/detection.py --agents 4096 --json benchmarks/results/detection.json \\
        --markdown benchmarks/results/detection.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import grpc
from big_job import Clients, Code, Coordinator
from recording import write_rows
from renderers import detection as page
from renderers.detection import DetectionRow

from sarcomm.v1 import coordinator_pb2 as pb
from sarcomm.v1 import coordinator_pb2_grpc as pb_grpc

FAULTS = ("kill", "stop", "silent", "stuck", "stall")
TARGET_S = {"kill": 1.5, "stop": 5.0, "silent": 5.0, "fanout": 1.0}
VICTIM = "victim"
#: The stall's collectives: the others wait in #SEQ, the victim's ranks stay at #SEQ - 1.
SEQ = 1000
#: Seconds after which a class is given up, beyond its bound.
SLACK_S = 10.0


class Watcher:
    """The MEMBER_FAILED events of ``job`` on one Watch stream, in a thread: (arrival monotonic,
    the event)."""

    def __init__(self, target: str, job: str) -> None:
        self.events: list[tuple[float, pb.JobEvent]] = []
        self._channel = grpc.insecure_channel(target)
        self._call = pb_grpc.CoordinatorStub(self._channel).Watch(pb.WatchRequest(job=job), timeout=3600)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for event in self._call:
                if event.kind == pb.JobEvent.MEMBER_FAILED:
                    self.events.append((time.monotonic(), event))

    def close(self) -> None:
        self._call.cancel()  # type: ignore[no-untyped-call]  # (grpc-stubs leaves it untyped)
        self._thread.join(5)
        self._channel.close()


def stall_line(log: Path, after: float) -> tuple[float, str] | None:
    """The first stall line (one naming the victim's host) the coordinator logged at or after Unix
    time ``after``: (its time on the coordinator's clock, the line)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if "which have not entered it" not in line or f"{VICTIM}0-a0" not in line:
            continue
        try:
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if at >= after - 0.001:
            return at, line[24:]
    return None


def run_fault(
    fault: str, index: int, coordinator: Coordinator, args: argparse.Namespace
) -> list[DetectionRow]:
    """One fresh job, one fault: its row (and, for the first failure, the fan-out's)."""
    job = f"detect-{fault}-{index}"
    world = args.agents * args.ranks_per_agent
    bulk_args = copy.copy(args)
    victim_args = copy.copy(args)
    victim_args.procs = 1
    bulk = Clients(
        coordinator.target, job, args.agents - 1, args.ranks_per_agent, bulk_args, 0, world=world,
        protocol=args.protocol,
    )  # fmt: skip
    victims = Clients(
        coordinator.target, job, 1, args.ranks_per_agent, victim_args, 0, world=world,
        host_prefix=VICTIM, protocol=args.protocol,
    )  # fmt: skip
    groups = (bulk, victims)
    watcher = Watcher(coordinator.target, job)
    victim = victims.procs[0]
    try:
        start = time.monotonic() + 0.5
        for group in groups:
            group.tell_all({"join": start})
        for group in groups:
            errors = [e for a in group.answer_all("joined") for e in a["errors"]]
            if errors:
                raise RuntimeError(f"{job}: {len(errors)} joins failed, e.g. {errors[0]}")
        began = time.monotonic()
        for group in groups:
            group.tell_all({"beat": {"until": began + 36000, "window": [began, began + 36000]}})
            group.answer_all("beating")
        time.sleep(args.warmup)
        offered = bulk.answer_all_after({"lease": True}, "lease") + victims.answer_all_after(
            {"lease": True}, "lease"
        )
        leases = [a["lease"] for a in offered if a["lease"]]
        lease = max(leases) if leases else None
        switched = sum(a["by_exception"] for a in offered)
        stuck_bound = 2 * lease if lease else args.interval * args.misses
        target = {**TARGET_S, "stuck": stuck_bound, "stall": args.stall_threshold + 2.0}[fault]
        deadline = target + SLACK_S
        fault_wall, fault_mono = time.time(), time.monotonic()
        if fault == "kill":
            os.kill(victim.pid, signal.SIGKILL)
        elif fault == "stop":
            os.kill(victim.pid, signal.SIGSTOP)
        elif fault == "silent":
            fault_mono = victims.answer_all_after({"silence": True}, "silenced")[0]["silenced"]
            fault_wall = time.time() - (time.monotonic() - fault_mono)
        elif fault == "stuck":
            victims.answer_all_after({"stick": True}, "stuck")
        else:
            fault_wall, fault_mono = time.time(), time.monotonic()
            bulk.answer_all_after({"progress": {"seq": SEQ, "in_collective": True}}, "progress")
            victims.answer_all_after({"progress": {"seq": SEQ - 1, "in_collective": False}}, "progress")
        detected: float | None = None
        watch: float | None = None
        verdict = ""
        failed_at = 0.0
        while time.monotonic() < fault_mono + deadline:
            if fault == "stall":
                found = stall_line(coordinator.log_path, fault_wall)
                if found is not None:
                    detected, verdict = found[0] - fault_wall, found[1]
                    break
            elif watcher.events:
                arrived, event = watcher.events[0]
                detected, watch = event.time - fault_wall, arrived - fault_mono
                verdict = f"rank {event.rank} on {event.host}: {event.reason}"
                failed_at = event.time
                break
            time.sleep(0.02)
        fanout: float | None = None
        told = 0
        streams = 0
        if failed_at:
            time.sleep(args.fanout_wait)
        if fault in ("stop",):
            with contextlib.suppress(OSError):
                os.kill(victim.pid, signal.SIGKILL)
        bulk.tell_all({"results": True})
        results = [r["results"] for r in bulk.answer_all("results")]
        streams = sum(r["streams"] for r in results)
        arrivals = [t for r in results for t in r["failed_events"].values()]
        told = len(arrivals)
        if failed_at and arrivals and told == streams:
            # (monotonic arrivals against the coordinator's wall time: one host, both clocks here)
            fanout = max(arrivals) + (time.time() - time.monotonic()) - failed_at
    finally:
        watcher.close()
        if victim.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(victim.pid, signal.SIGCONT)
        for group in groups:
            group.close()
    row: DetectionRow = {
        "fault": fault, "agents": args.agents, "ranks": world, "protocol": args.protocol,
        "streams_by_exception": switched, "lease_s": lease, "streams_told": told, "streams": streams,
        "target_s": round(target, 3),
        "detected_s": None if detected is None else round(detected, 3),
        "watch_s": None if watch is None else round(watch, 3),
        "fanout_s": None if fanout is None else round(fanout, 3),
        "deadline_s": round(deadline, 3), "verdict": verdict[:300],
        "met": detected is not None and detected <= target,
    }  # fmt: skip
    return [row]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--agents", type=int, default=4096, help="simulated agents of the job, the victim among them"
    )
    p.add_argument("--ranks-per-agent", type=int, default=8, help="ranks of each agent (8)")
    p.add_argument("--faults", default=",".join(FAULTS), help="which classes (comma-separated)")
    p.add_argument(
        "--protocol", choices=("exception", "per-second"), default="exception", help="how agents report"
    )
    p.add_argument("--procs", type=int, default=4, help="load processes of the other agents (4)")
    p.add_argument("--interval", type=float, default=1.0, help="the coordinator's --heartbeat-interval (1)")
    p.add_argument("--misses", type=int, default=3, help="the coordinator's --heartbeat-misses (3)")
    p.add_argument(
        "--stall-threshold", type=float, default=3.0, help="the coordinator's --stall-threshold (3)"
    )
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of reports before the fault (5)")
    p.add_argument(
        "--fanout-wait", type=float, default=2.0, help="seconds given the verdict to reach every stream (2)"
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep the coordinator's log here")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--markdown", type=Path, default=None, help="write its page here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad or args.agents < 2:
        parser().error(f"--faults: each of {', '.join(FAULTS)}; --agents at least 2")
    args.probes = 0  # (what big_job.Clients reads: no probe process here)
    rows: list[DetectionRow] = []
    with tempfile.TemporaryDirectory(prefix="detection-") as scratch:
        work = args.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        flags = ["--stall-threshold", str(args.stall_threshold), "--report-policy", "exception"]
        with Coordinator(Code("current", None), work, None, args.interval, args.misses, flags=flags) as coord:
            for index, fault in enumerate(faults):
                rows += run_fault(fault, index, coord, args)
                print(rows[-1], flush=True)
    fanout = next((r for r in rows if r["fanout_s"] is not None and r["fault"] == "kill"), None) or next(
        (r for r in rows if r["fanout_s"] is not None), None
    )
    if fanout is not None:
        spread: DetectionRow = {
            **fanout, "fault": "fanout", "target_s": TARGET_S["fanout"], "detected_s": fanout["fanout_s"],
            "verdict": f"from the {fanout['fault']} run: " + fanout["verdict"],
            "met": fanout["fanout_s"] is not None and fanout["fanout_s"] <= TARGET_S["fanout"],
        }  # fmt: skip
        rows.append(spread)
    write_rows(__file__, argv, page.TITLE, page.headline(rows), rows, page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
