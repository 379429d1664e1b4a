"""Bursts a big job brings the coordinator: thousands of calls at one moment that each change the
same job, on its event loop, which every heartbeat and call waits behind.

- ``giveup``: a world that does not form in time. Each waiting Join names the ranks its world
  still lacks (its error says so) and withdraws its members, in the order the Joins came.
- ``finish``: a formed world whose members all leave with exit code 0 (the job's end).
- ``fail``: a formed world where one member exits 1 and then every other exits non-zero (stopped
  by their agents after the failure).
- ``elastic``: an elastic world (2 to N members, torchrun's nodes or ``--world-size MIN:MAX``)
  formed by N Joins: each Join asks whether the world may form now.

The membership domain does exactly what the coordinator does for each call, in process, with
N single-rank members, for this tree and (``--baseline-ref``) an earlier commit, each burst in a
fresh interpreter: the seconds the whole burst holds the loop.

Run::

    python benchmarks/bursts.py --baseline-ref a9e7663 --sizes 1024,4096,32768 \\
        --json benchmarks/results/bursts.json --markdown benchmarks/results/bursts.md
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from big_job import baseline_tree
from recording import describe, write_results
from renderers import bursts as page
from renderers.bursts import BurstRun

REPOSITORY = Path(__file__).resolve().parents[1]
KINDS = ("giveup", "finish", "fail", "elastic")


def burst(kind: str, size: int) -> float:
    """Seconds the ``kind`` burst of ``size`` single-rank members takes, in this interpreter's
    sarcomm (the members join first, untimed)."""
    from sarcomm.coordinator.domain import ranks
    from sarcomm.coordinator.domain.membership import Membership
    from sarcomm.coordinator.domain.model import ElasticRange
    from tests.helpers import FakeClock, spec

    logging.disable(logging.CRITICAL)  # a line per call, as the coordinator logs, is not timed here
    membership = Membership(liveness_timeout=10.0, clock=FakeClock())
    if kind == "elastic":
        elastic = ElasticRange(2, size, 3.0)
        specs = [
            dataclasses.replace(spec(f"h{i}", job="e", world_size=size), elastic=elastic) for i in range(size)
        ]
        began = time.perf_counter()
        tickets = [membership.join(one) for one in specs]
        assert tickets[0].job.state.value == "RUNNING"
        return round(time.perf_counter() - began, 4)
    world = 2 * size if kind == "giveup" else size
    tickets = [membership.join(spec(f"h{i}", job="big", world_size=world)) for i in range(size)]
    job = tickets[0].job
    began = time.perf_counter()
    if kind == "giveup":
        for ticket in tickets:
            ranks.describe_missing(job)
            membership.abandon(ticket)
        assert not job.members
    else:
        for ticket in tickets:
            membership.answered(ticket)
        for i, ticket in enumerate(tickets):
            code = 0 if kind == "finish" else (1 if i == 0 else -15)
            membership.leave(ticket.members[0].member_id, ticket.secrets[0], code)
        assert job.state.value == ("FINISHED" if kind == "finish" else "FAILED")
    return round(time.perf_counter() - began, 4)


def run(code: str, path: Path | None, kind: str, size: int, budget: float) -> BurstRun:
    """One burst in a fresh interpreter (``path``: the baseline's tree on PYTHONPATH)."""
    env = {"PYTHONPATH": f"{path}:{REPOSITORY}" if path else str(REPOSITORY)}
    row: BurstRun = {"kind": kind, "size": size, "code": code, "seconds": None, "cut_off_s": None}
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", kind, str(size)],
            capture_output=True, text=True, timeout=budget, check=True, env=env, cwd=REPOSITORY,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        row["cut_off_s"] = budget
        return row
    row["seconds"] = float(done.stdout.splitlines()[-1])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-ref", default="", help="also run this commit's membership, turn about")
    p.add_argument("--sizes", default="1024,4096,32768", help="members per burst")
    p.add_argument("--kinds", default=",".join(KINDS), help="which bursts")
    p.add_argument("--budget", type=float, default=120.0, help="seconds before a burst is cut off")
    p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    if args.one:
        print(burst(args.one[0], int(args.one[1])))
        return 0
    with tempfile.TemporaryDirectory(prefix="bursts-") as work:
        codes: list[tuple[str, Path | None]] = [("current", None)]
        if args.baseline_ref:
            codes.append((f"baseline {args.baseline_ref}", baseline_tree(args.baseline_ref, Path(work))))
        sizes = [int(size) for size in args.sizes.split(",")]
        runs = [
            run(code, path, kind, size, args.budget)
            for kind in args.kinds.split(",")
            for size in sizes
            for code, path in codes
        ]
    doc = {
        "benchmark": args.json.stem if args.json else "bursts",
        "title": "Bursts of a big job: every Join giving up, every member leaving",
        "command": "python benchmarks/bursts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(),
        "runs": runs,
    }
    write_results(doc, page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
