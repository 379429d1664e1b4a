"""Before and after in one run: the wrapper-cost, rendezvous and heartbeat-load benchmarks of this
tree and of a baseline checkout, alternated round by round, reported as ratios.

A change that moves modules (or anything a benchmark's ``--baseline-ref`` cannot load beside the
current code) is compared whole: the baseline is another checkout with its own virtual environment
(``BASELINE/.venv/bin/python`` with that checkout installed), and each round runs the same benchmark
command once in each tree, in ABBA order so that drifting load hits both alike. Each tree runs its
own copy of the benchmark script with its own interpreter, so each measures its own coordinator and
library. The figures are the medians over the rounds of each benchmark's headline numbers, and the
ratio is this tree's over the baseline's (below 1: this tree is faster or cheaper).

    git worktree add /tmp/base c4af642 && python -m venv /tmp/base/.venv \\
        && /tmp/base/.venv/bin/pip install -e /tmp/base
    python benchmarks/before_after.py --baseline-tree /tmp/base --rounds 2 \\
        --json benchmarks/results/before_after.json --markdown benchmarks/results/before_after.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import recording
from renderers import before_after
from renderers.before_after import Comparison, FigureRow
from renderers.heartbeat_load import HeartbeatRow
from renderers.overhead import Paired, WrapperOnly
from renderers.rendezvous import OutcomeRow

HERE = Path(__file__).resolve().parent
#: One benchmark's figures: name -> value (lower is better for every one of them).
Figures = dict[str, float]


@dataclass(frozen=True)
class Benchmark:
    """A benchmark script, the arguments of its short run, and how to read its headline figures."""

    name: str
    script: str
    args: tuple[str, ...]
    figures: Callable[[dict[str, Any]], Figures]


def _put(found: Figures, name: str, value: float | None) -> None:
    """A figure the run measured; one it did not (None) is left out, and the comparison skips a
    figure missing from any round."""
    if value is not None:
        found[name] = value


def _overhead(doc: dict[str, Any]) -> Figures:
    only = cast(WrapperOnly, doc["wrapper_only"])
    found = {f"wrapper {op} added (us)": row["added_s"] * 1e6 for op, row in only.items()}
    found["world1 all_reduce 4 B added (us)"] = cast(Paired, doc["world1_all_reduce_4B"])["added_s"] * 1e6
    return found


def _rendezvous(doc: dict[str, Any]) -> Figures:
    found: Figures = {}
    for row in cast(list[OutcomeRow], doc["results"]):
        if row["method"] == "sarcomm" and row["status"] == "ok":
            size = row["size"]
            found[f"{size} members: formation (s)"] = row["formation_s"]
            _put(found, f"{size} members: coordinator formed (s)", row["server_formed_s"])
            found[f"{size} members: coordinator CPU (s)"] = row["server_cpu_s"]
    return found


def _heartbeat_load(doc: dict[str, Any]) -> Figures:
    found: Figures = {}
    for row in cast(list[HeartbeatRow], doc["summary"]):
        shape = row["shape"]
        reports = max(float(row["reports_per_s"]), 1.0)
        cpu_share = row["coordinator_cpu_percent"] / 100
        found[f"{shape}: coordinator CPU per report (us)"] = cpu_share / reports * 1e6
        _put(found, f"{shape}: probe ack p99 (ms)", row["probe_ack_p99_ms"])
        found[f"{shape}: peak RSS (MiB)"] = row["rss_peak_mib"]
    return found


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("overhead", "overhead.py", ("--quick",), _overhead),
        Benchmark(
            "rendezvous",
            "rendezvous.py",
            ("--methods", "sarcomm", "--sizes", "256,1024", "--repeats", "3", "--procs", "4"),
            _rendezvous,
        ),
        # The batched shape (512 agents x 8): c4af642's load client crashes in the single shape
        # (InvalidStateError when the coordinator ends a stream it writes to). A generous budget
        # for joins and leaves: a loaded 2-core host takes longer than the default.
        Benchmark(
            "heartbeat_load",
            "heartbeat_load.py",
            ("--quick", "--shapes", "batched", "--join-budget", "240"),
            _heartbeat_load,
        ),
    )
}


def run_once(tree: Path, python: Path, bench: Benchmark, workdir: Path, timeout: float) -> Figures:
    """Run ``bench`` as ``tree`` has it, with ``python``; its figures."""
    out = workdir / f"{bench.name}-{time.monotonic_ns()}.json"
    command = [str(python), str(tree / "benchmarks" / bench.script), *bench.args, "--json", str(out)]
    # The tree's own benchmarks folder first on the path, nothing of this run's environment's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{bench.name} in {tree} exited with {result.returncode}: {result.stderr.strip()[-2000:]}"
        )
    return bench.figures(json.loads(out.read_text()))


def _run_with_retry(tree: Path, python: Path, bench: Benchmark, workdir: Path, timeout: float) -> Figures:
    """One run, and one more when the first fails (a loaded host can miss a benchmark's own budget)."""
    try:
        return run_once(tree, python, bench, workdir, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"{bench.name} in {tree}: {error}; running it again", file=sys.stderr, flush=True)
        return run_once(tree, python, bench, workdir, timeout)


def compare(
    bench: Benchmark, trees: dict[str, tuple[Path, Path]], rounds: int, workdir: Path, timeout: float
) -> Comparison:
    """``rounds`` ABBA rounds of ``bench`` in both trees: per figure, each side's median and the ratio."""
    samples: dict[str, list[Figures]] = {side: [] for side in trees}
    order = list(trees)
    for index in range(rounds):
        for side in order if index % 2 == 0 else reversed(order):
            tree, python = trees[side]
            print(f"{bench.name}: round {index + 1} of {rounds}, {side}", file=sys.stderr, flush=True)
            samples[side].append(_run_with_retry(tree, python, bench, workdir, timeout))
    rows: list[FigureRow] = []
    for name in samples["after"][0]:
        if not all(name in figures for side in samples.values() for figures in side):
            continue
        before = statistics.median(f[name] for f in samples["before"])
        after = statistics.median(f[name] for f in samples["after"])
        rows.append(
            {"figure": name, "before": before, "after": after, "ratio": after / before if before else None}
        )
    return {"benchmark": bench.name, "args": list(bench.args), "rounds": rounds, "rows": rows}


def _commit(tree: Path) -> str:
    found = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() or str(tree)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-tree", type=Path, required=True, help="a checkout with its own .venv")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS), help="comma-separated: %(default)s")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per benchmark (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one benchmark run may take")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    names = [n for n in args.benchmarks.split(",") if n]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"--benchmarks {','.join(unknown)!r}: not one of {', '.join(BENCHMARKS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    baseline = args.baseline_tree.resolve()
    base_python = baseline / ".venv" / "bin" / "python"
    if not base_python.exists():
        parser.error(f"--baseline-tree {baseline}: no .venv/bin/python there (make one and install the tree)")
    trees = {"before": (baseline, base_python), "after": (HERE.parent, Path(sys.executable))}
    doc: dict[str, Any] = {
        "benchmark": "before_after",
        "command": " ".join(["python", "benchmarks/before_after.py", *(argv or sys.argv[1:])]),
        "machine": recording.describe("torch", "grpcio"),
        "baseline": _commit(baseline),
        "tree": _commit(HERE.parent),
        "rounds": args.rounds,
        "benchmarks": [],
    }
    with tempfile.TemporaryDirectory(prefix="before-after-") as work:
        for name in names:
            doc["benchmarks"].append(compare(BENCHMARKS[name], trees, args.rounds, Path(work), args.timeout))
            # Written after each benchmark: a later one that fails costs none of the earlier figures.
            if args.json:
                args.json.write_text(json.dumps(doc, indent=1) + "\n")
    doc["machine"] = recording.describe("torch", "grpcio", load_at="end")
    recording.write_results(doc, before_after.section, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
