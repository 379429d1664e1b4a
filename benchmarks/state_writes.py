"""State writes: what a job's changes cost the coordinator's event loop, written at once or behind.

Every change to a job rewrites its record in the SQLite state file. The coordinator used to write
it at once, on the event loop (``immediate``, the baseline); it now marks the job and a flush a
moment later writes each marked job once, from a writer thread, with Join and Leave answers waiting
for it (``write_behind``, :mod:`sarcomm.coordinator.storage.persistence`). Both run here on the same
domain objects (a real :class:`Membership`, a real SQLite file in WAL mode) and the same events,
for a job of N single-rank members:

- ``form``: N joins, the last of which forms the world (one record of N members);
- ``first reports``: each member's first report names its /metrics endpoint (N changes);
- ``leaves``: every member leaves with exit code 0 (N changes; the last one finishes the job).

Each change runs as its own step of an asyncio loop, as RPC handlers do (a ``sleep(0)`` between
two), and each phase ends once everything is on disk. Per phase: the loop thread's CPU time, the
longest the loop was held between two steps (what a heartbeat waiting for it would wait), the wall
time to durable, and how many batches reached SQLite. The immediate baseline costs O(N) per change,
O(N^2) per phase: above ``--full-baseline-max`` members (1024) it runs the first ``--sample``
changes (512) of each phase and scales by N / sample, as labelled in the table.

Run::

    python benchmarks/state_writes.py --json benchmarks/results/state_writes.json \\
        --markdown benchmarks/results/state_writes.md          # about 2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recording import describe, write_results
from renderers import state_writes as state_writes_page
from renderers.state_writes import StateWritesRow

from sarcomm.common.interfaces import InterfaceInfo, InterfaceKind
from sarcomm.coordinator.domain.membership import JoinSpec, MemberRequest, Membership, Progress
from sarcomm.coordinator.storage.persistence import WriteBehind
from sarcomm.coordinator.storage.records import write_at_once
from sarcomm.coordinator.storage.store import JobRow, SqliteStore

LO = InterfaceInfo("lo", ("127.0.0.1",), InterfaceKind.LOOPBACK)
MODES = ("immediate", "write_behind")
PHASES = ("form", "first reports", "leaves")


class CountingStore(SqliteStore):
    """The real store, counting the transactions that reach it."""

    batches = 0

    def write_rows(self, rows: list[JobRow]) -> None:
        self.batches += 1
        super().write_rows(rows)


def join_spec(i: int, world: int) -> JoinSpec:
    return JoinSpec(
        job="bench", world_size=world, host=f"h{i}", interfaces=(LO,),
        members=(MemberRequest(local_rank=0),), store_port=29500, peer_address="127.0.0.1",
    )  # fmt: skip


async def run_mode(mode: str, world: int, sample: int | None, work: Path) -> list[dict[str, Any]]:
    path = work / f"{mode}-{world}.sqlite"
    path.unlink(missing_ok=True)
    store = CountingStore(path)
    writes = WriteBehind(store) if mode == "write_behind" else None
    membership = Membership(liveness_timeout=600.0, persist=writes.mark if writes else write_at_once(store))
    tickets: list[Any] = []

    async def durable() -> None:
        if writes is not None:
            await writes.durable()

    async def phase(name: str, steps: list[Callable[[], object]]) -> dict[str, Any]:
        batches0 = store.batches
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        longest = 0.0
        last = time.perf_counter()
        for step in steps:
            step()
            await asyncio.sleep(0)  # the next RPC's turn; a due flush runs here
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now
        await durable()
        wall = time.perf_counter() - wall0
        cpu = time.thread_time() - cpu0
        scale = world / len(steps)
        return {
            "mode": mode, "members": world, "phase": name, "changes": len(steps),
            "scaled_by": round(scale, 3),
            "loop_cpu_s": round(cpu * scale, 4), "wall_s": round(wall * scale, 4),
            "longest_hold_ms": round(1000 * longest, 2), "batches": store.batches - batches0,
        }  # fmt: skip

    def form(i: int) -> None:
        tickets.append(membership.join(join_spec(i, world)))

    results = []
    results.append(await phase("form", [functools.partial(form, i) for i in range(world)]))
    count = sample or world
    now = time.time()

    def report(i: int) -> None:
        member, secret = tickets[i].members[0], tickets[i].secrets[0]
        progress = Progress(seq=1, op="all_reduce", in_collective=False, since=now)
        membership.heartbeat(member.member_id, secret, progress, f"127.0.0.1:{20000 + i}")

    def leave(i: int) -> None:
        member, secret = tickets[i].members[0], tickets[i].secrets[0]
        membership.leave(member.member_id, secret, 0)

    results.append(await phase("first reports", [functools.partial(report, i) for i in range(count)]))
    results.append(await phase("leaves", [functools.partial(leave, i) for i in range(count)]))
    if writes is not None:
        await writes.close()
    store.close()
    return results


def machine() -> dict[str, Any]:
    """What the numbers were measured on (see recording.describe)."""
    import sqlite3

    return describe(sqlite=sqlite3.sqlite_version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,1024,4096", help="members per job (default 256,1024,4096)")
    parser.add_argument(
        "--full-baseline-max", type=int, default=1024, help="largest N the baseline runs in full"
    )
    parser.add_argument("--sample", type=int, default=512, help="baseline changes per phase above that N")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write a Markdown table here")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    bad = [n for n in sizes if n < 2]
    if bad:
        parser.error(f"--sizes {bad[0]}: each size must be at least 2 members")
    work = Path(tempfile.mkdtemp(prefix="sar-state-writes-"))
    summary: list[StateWritesRow] = []
    for world in sizes:
        sample = args.sample if world > args.full_baseline_max else None
        immediate = asyncio.run(run_mode("immediate", world, sample, work))
        behind = asyncio.run(run_mode("write_behind", world, None, work))
        for base, ours in zip(immediate, behind, strict=True):
            row: StateWritesRow = {
                "members": world,
                "phase": base["phase"],
                "immediate_changes": base["changes"],
                "immediate_scaled_by": base["scaled_by"],
                "immediate_loop_cpu_s": base["loop_cpu_s"],
                "immediate_wall_s": base["wall_s"],
                "immediate_longest_hold_ms": base["longest_hold_ms"],
                "write_behind_loop_cpu_s": ours["loop_cpu_s"],
                "write_behind_wall_s": ours["wall_s"],
                "write_behind_longest_hold_ms": ours["longest_hold_ms"],
                "write_behind_batches": ours["batches"],
                "loop_cpu_ratio": round(base["loop_cpu_s"] / ours["loop_cpu_s"], 1)
                if ours["loop_cpu_s"]
                else None,
            }
            print(json.dumps(row), flush=True)
            summary.append(row)
    given = argv if argv is not None else sys.argv[1:]
    doc = {
        "benchmark": "state_writes",
        "title": "State writes: immediate against write-behind",
        "headline": state_writes_page.headline(summary),
        "summary": summary,
        "command": "python benchmarks/state_writes.py " + " ".join(given),
        "settings": {"sizes": sizes, "full_baseline_max": args.full_baseline_max, "sample": args.sample},
        "machine": machine(),
    }
    write_results(doc, state_writes_page.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
