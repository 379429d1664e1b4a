"""A big world that does not form in time: every waiting Join gives up, one after another.

When a world's join timeout passes, each Join waiting on it describes what the world still lacks
(its error names the missing ranks) and withdraws its members, in the order the Joins came: the
coordinator does this for every Join, on its event loop. Here the membership domain does exactly
that in process (N single-rank Joins of a world of 2N, then each one's description and withdrawal
in turn), for this tree and, with ``--baseline-ref``, an earlier commit, side by side: the loop
time the whole burst takes, which every heartbeat and call waits behind.

Run::

    python benchmarks/join_giveup.py --baseline-ref a9e7663 --sizes 1024,4096,32768 \\
        --json benchmarks/results/join_giveup.json --markdown benchmarks/results/join_giveup.md
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from big_job import baseline_tree
from recording import describe, write_results
from renderers import join_giveup as page

REPOSITORY = Path(__file__).resolve().parents[1]


def burst(size: int) -> dict[str, float]:
    """Seconds to join ``size`` single members to a world of twice that, and for all of them to
    give up (describe the missing ranks, withdraw), in this interpreter's sarcomm."""
    from sarcomm.coordinator.domain import ranks
    from sarcomm.coordinator.domain.membership import Membership
    from tests.helpers import FakeClock, spec

    logging.disable(logging.INFO)  # one line per withdrawal, as the coordinator logs, is not timed here
    membership = Membership(liveness_timeout=10.0, clock=FakeClock())
    began = time.perf_counter()
    tickets = [membership.join(spec(f"h{i}", job="big", world_size=2 * size)) for i in range(size)]
    joined = time.perf_counter()
    job = tickets[0].job
    for ticket in tickets:
        ranks.describe_missing(job)
        membership.abandon(ticket)
    done = time.perf_counter()
    assert not job.members
    return {"join_s": round(joined - began, 4), "giveup_s": round(done - joined, 4)}


def run(code: str, path: Path | None, size: int, budget: float) -> dict[str, Any]:
    """One burst in a fresh interpreter (``path``: the baseline's tree on PYTHONPATH)."""
    env = {"PYTHONPATH": f"{path}:{REPOSITORY}" if path else str(REPOSITORY)}
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(size)],
            capture_output=True, text=True, timeout=budget, check=True, env=env, cwd=REPOSITORY,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"code": code, "size": size, "join_s": None, "giveup_s": None, "over_budget_s": budget}
    return {"code": code, "size": size, **json.loads(done.stdout.splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-ref", default="", help="also run this commit's membership, turn about")
    p.add_argument("--sizes", default="1024,4096,32768", help="Joins (single members) per burst")
    p.add_argument("--budget", type=float, default=120.0, help="seconds before a burst is cut off")
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(burst(args.one)))
        return 0
    with tempfile.TemporaryDirectory(prefix="join-giveup-") as work:
        codes: list[tuple[str, Path | None]] = [("current", None)]
        if args.baseline_ref:
            codes.append((f"baseline {args.baseline_ref}", baseline_tree(args.baseline_ref, Path(work))))
        sizes = [int(size) for size in args.sizes.split(",")]
        runs = [run(code, path, size, args.budget) for size in sizes for code, path in codes]
    doc = {
        "benchmark": args.json.stem if args.json else "join_giveup",
        "title": "A big world that does not form in time: every Join gives up",
        "command": "python benchmarks/join_giveup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe(),
        "runs": runs,
    }
    write_results(doc, page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
