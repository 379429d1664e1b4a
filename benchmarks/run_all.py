"""Run every benchmark, each writing its JSON into one results folder, then build the report.

::

    python benchmarks/run_all.py                 # everything, about 25 minutes on 2 cores
    python benchmarks/run_all.py --quick         # a smoke pass: small sizes, few repeats
    python benchmarks/run_all.py --only memcpy,bench_sweep
    python benchmarks/run_all.py --report-only   # rebuild RESULTS.md and the plots from the JSON

``benchmarks/run_all.sh`` is the same command. Benchmarks, in the order they run: memcpy (the
machine's copy ceiling), rendezvous, all_to_all, overhead, bench_sweep (a real coordinator and
``sar-worker ... bench``, 4 ranks), and failure_detection, heartbeat_load and soak when their
scripts are there. Each runs as its own process, one after another (they would skew each other's
timings), with its output shown and kept in ``RESULTS_DIR/logs/NAME.log``. One that fails does
not stop the others; the exit status is 1 when any failed.

Results go to ``benchmarks/results/`` and the report to ``benchmarks/RESULTS.md``. With
``--results-dir DIR`` both go to DIR instead (the report as ``DIR/RESULTS.md``), which keeps the
recorded results safe from a smoke pass: ``--quick`` numbers are not worth recording, so
``--quick`` without ``--results-dir`` is refused. Only JSON (and the tables that a script
generates whole, such as rendezvous.md and memcpy.md) is written; the hand-written notes in
``results/*.md`` are left alone.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results"

#: Arguments of one benchmark for a results folder: (full run, quick run).
Args = Callable[[Path], list[str]]


@dataclass(frozen=True)
class Benchmark:
    """A script in benchmarks/ and its arguments; ``optional`` ones are skipped when absent."""

    name: str
    full: Args
    quick: Args
    optional: bool = False

    @property
    def script(self) -> Path:
        return HERE / f"{self.name}.py"


def _flags(name: str, extra: str = "", markdown: bool = False) -> Args:
    """``extra`` (split on spaces), then ``--json DIR/NAME.json`` and, for scripts that write their
    Markdown whole, ``--markdown DIR/NAME.md``."""

    def build(d: Path) -> list[str]:
        outputs = ["--json", str(d / f"{name}.json")]
        return extra.split() + outputs + (["--markdown", str(d / f"{name}.md")] if markdown else [])

    return build


def _discovered(name: str, full: str = "", quick: str = "--quick") -> tuple[Args, Args]:
    """Arguments for a script written and changed by others: ``--json`` and, of ``full`` or
    ``quick``, only the flags its ``--help`` lists (values follow their flag), so that a renamed
    option costs a smoke pass its shortcut, not the run."""

    def flags(extra: str) -> Args:
        def build(d: Path) -> list[str]:
            helptext = subprocess.run(
                [sys.executable, str(HERE / f"{name}.py"), "--help"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            ).stdout
            known = set(helptext.replace(",", " ").split())
            args: list[str] = []
            keep = False
            for word in extra.split():
                if word.startswith("--"):
                    keep = word in known
                if keep:
                    args.append(word)
            return args + (["--json", str(d / f"{name}.json")] if "--json" in known else [])

        return build

    return flags(full), flags(quick)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("memcpy", _flags("memcpy", markdown=True), _flags("memcpy", "--quick", markdown=True)),
    Benchmark(
        "rendezvous",
        _flags("rendezvous", "--repeats 5", markdown=True),
        # c10d takes seconds even for 16 members: its own short deadline keeps the pass short.
        _flags("rendezvous", "--sizes 16,64 --repeats 1 --c10d-deadline 20", markdown=True),
    ),
    Benchmark(
        "all_to_all", _flags("all_to_all"), _flags("all_to_all", "--sizes 1K,64K,1M --seconds-per-size 1")
    ),
    Benchmark("overhead", _flags("overhead"), _flags("overhead", "--quick")),
    Benchmark(
        "state_writes",
        _flags("state_writes", markdown=True),
        _flags("state_writes", "--sizes 64,256", markdown=True),
    ),
    Benchmark(
        "bench_sweep",
        _flags("bench_sweep"),
        _flags("bench_sweep", "--sizes 1K:1M --factor 32 --iters 5 --warmup 1"),
    ),
    # Namespaces (root) make the partition case possible; a smoke pass needs no root and leaves the
    # host's links alone, so it runs on loopback.
    Benchmark(
        "failure_detection", *_discovered("failure_detection", quick="--quick --loopback"), optional=True
    ),
    # --pin: the coordinator on a core of its own, as on a head node; its clients on the other.
    # (The etcd store beside SQLite is a separate run: heartbeat_load_etcd.json, see README.md.)
    Benchmark("heartbeat_load", *_discovered("heartbeat_load", "--pin --scaling"), optional=True),
    # The leader SIGKILLed under a 1024-member job on etcd, beside a SQLite coordinator's restart.
    Benchmark("failover", *_discovered("failover", "", "--members 128 --kills 1"), optional=True),
    Benchmark(
        "soak",
        *_discovered("soak", "--duration 300", "--duration 30 --members 200 --jobs 4 --per-host 10"),
        optional=True,
    ),
)
NAMES = tuple(b.name for b in BENCHMARKS)


def run_one(bench: Benchmark, args: list[str], log_path: Path, timeout: float) -> tuple[str, float]:
    """Run one script, its output shown and written to ``log_path``; (status, seconds)."""
    command = [sys.executable, str(bench.script), *args]
    print(f"\n=== {bench.name}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        log.write(" ".join(command) + "\n")
        proc = subprocess.Popen(
            command, cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        # A watchdog rather than a check per line: a benchmark that hangs silently is stopped too.
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout or ():
                sys.stdout.write(line)
                log.write(line)
            code = proc.wait()
        finally:
            watchdog.cancel()
    seconds = time.monotonic() - started
    if seconds >= timeout and code < 0:
        return f"killed after {timeout:g} s", seconds
    return ("ok" if code == 0 else f"exit {code}"), seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a smoke pass")
    parser.add_argument("--only", metavar="NAME[,NAME]", help=f"run only these, from {', '.join(NAMES)}")
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing; rebuild the report from the JSON there is"
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS,
        help="where the JSON goes and the report reads it (default benchmarks/results)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one benchmark may run (default 1800)"
    )
    args = parser.parse_args(argv)
    results = args.results_dir.resolve()
    chosen = list(BENCHMARKS)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in NAMES]
        if unknown or not wanted:
            parser.error(f"--only {args.only!r}: each name must be one of {', '.join(NAMES)}")
        chosen = [b for b in BENCHMARKS if b.name in wanted]
    if args.quick and results == DEFAULT_RESULTS and not args.report_only:
        parser.error(
            "--quick would overwrite the recorded results in benchmarks/results/; "
            "give --results-dir DIR (e.g. /tmp/sarcomm-quick)"
        )
    failed = []
    summary = []
    if not args.report_only:
        (results / "logs").mkdir(parents=True, exist_ok=True)
        for bench in chosen:
            if not bench.script.exists():
                if not bench.optional:
                    failed.append(bench.name)
                summary.append((bench.name, "no script" if bench.optional else "missing", 0.0))
                continue
            flags = (bench.quick if args.quick else bench.full)(results)
            status, seconds = run_one(bench, flags, results / "logs" / f"{bench.name}.log", args.timeout)
            summary.append((bench.name, status, seconds))
            if status != "ok":
                failed.append(bench.name)
    report = [sys.executable, str(HERE / "report.py"), "--results-dir", str(results)]
    if args.quick:
        report += ["--note", "Quick pass (run_all --quick): few samples and small sizes, a smoke test only."]
    print(f"\n=== report: {' '.join(report)}", flush=True)
    report_status = subprocess.run(report, cwd=HERE.parent, check=False).returncode
    if summary:
        print(f"\n{'benchmark':<20}{'status':<24}{'seconds':>8}")
        for name, status, seconds in summary:
            print(f"{name:<20}{status:<24}{seconds:8.1f}")
        print(f"{'total':<44}{sum(s for *_, s in summary):8.1f}")
    if failed:
        print(f"failed: {', '.join(failed)}; their logs are in {results / 'logs'}", file=sys.stderr)
    return 1 if failed or report_status != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
