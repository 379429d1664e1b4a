"""What sarcomm's instrumented collectives add to bare ``torch.distributed`` calls.

Three measurements, all on gloo over loopback:

1. ``wrapper``: the wrapper alone. The ``torch.distributed`` functions the wrappers call are
   replaced in-process by a function that does nothing, so the difference between calling a
   wrapper and calling that function directly is exactly the Python the wrapper runs: state check,
   routing, two clock reads, one histogram/bytes update (and, for all_to_all, whose equal-size path
   calls the process group itself, ``ProcessGroup.alltoall``, checking the lists). Deterministic,
   so it is the figure for "microseconds added per call", for every op.
2. ``world1``: a real 4-byte all_reduce in a one-rank gloo group, bare vs wrapped.
3. ``world2``: every op in a two-rank gloo group (separate processes), bare vs wrapped, 4 bytes
   and 64 KiB to 16 MiB. ``all_to_all`` sends equal sizes (its equal-size path against gloo's own
   all_to_all). ``--baseline-ref REF`` adds a row timing the all_to_all of commit REF
   (``worker/library/collectives/alltoall.py`` there, loaded beside the current one) against the
   same bare call, so that before and after are measured in one run.

Bare and wrapped calls are interleaved so that drifting load and clock speed hit both sides
alike: (1) in blocks of many calls (a call is too short to time alone), (2) and (3) call by call
(ABBA order, identical on every rank), each call timed alone. The figures are medians, and
"added" is the median of the paired differences (wrapped minus the bare call or block beside
it). (1) is deterministic; (2) and (3) include the scheduler's noise (two ranks sharing a busy
host scatter by several percent either way), so for >= 64 KiB the table also shows the bound
"wrapper cost (1) / bare time", which is what the wrapper can add at most.

    python benchmarks/overhead.py [--json out.json] [--quick] [--baseline-ref REF]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import baseline
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import free_port
from render import write_page
from renderers import overhead as overhead_page
from renderers.overhead import Paired, World2, WrapperOnly

SIZES = {"4 B": 4, "64 KiB": 64 * 1024, "1 MiB": 1024**2, "16 MiB": 16 * 1024**2}


def interleaved(
    bare: Callable[[], Any],
    wrapped: Callable[[], Any],
    calls: int,
    blocks: int,
    align: Callable[[], Any] | None = None,
) -> Paired:
    """Blocks of ``calls`` calls, bare and wrapped alternating block by block: median per-call
    seconds of each side and of the paired difference. For calls too short to time one by one."""
    bare_s: list[float] = []
    wrapped_s: list[float] = []
    for block in range(blocks):
        order = ((bare, bare_s), (wrapped, wrapped_s))
        for fn, sink in order if block % 2 == 0 else reversed(order):
            if align is not None:
                align()
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            sink.append((time.perf_counter_ns() - start) / calls / 1e9)
    paired = _summary(bare_s, wrapped_s)
    paired["blocks"], paired["calls_per_block"] = float(blocks), float(calls)
    return paired


def alternating(bare: Callable[[], Any], wrapped: Callable[[], Any], pairs: int) -> Paired:
    """Each call timed alone, bare and wrapped alternating call by call (ABBA order, the same on
    every rank): medians shrug off the scheduler stalls that swamp block means on a busy host."""
    bare_s: list[float] = []
    wrapped_s: list[float] = []
    clock = time.perf_counter_ns
    for i in range(pairs):
        order = ((bare, bare_s), (wrapped, wrapped_s))
        for fn, sink in order if i % 2 == 0 else reversed(order):
            start = clock()
            fn()
            sink.append((clock() - start) / 1e9)
    paired = _summary(bare_s, wrapped_s)
    paired["pairs"] = float(pairs)
    return paired


def _summary(bare_s: list[float], wrapped_s: list[float]) -> Paired:
    diffs = [w - b for w, b in zip(wrapped_s, bare_s, strict=True)]
    return {
        "bare_s": statistics.median(bare_s),
        "wrapped_s": statistics.median(wrapped_s),
        "added_s": statistics.median(diffs),
    }


#: torch.distributed functions that (1) replaces with a no-op, to time each op's wrapper alone.
NOOP_TARGETS = (
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather", "scatter", "send",
    "recv", "barrier",
)  # fmt: skip


class _Done:
    """A finished Work: what the no-op process group call returns."""

    def wait(self) -> bool:
        return True


def wrapper_only(quick: bool) -> WrapperOnly:
    """(1): every op's wrapper against a backend that does nothing, in this process (world size 1)."""
    from sarcomm.worker.library import collectives as sar

    results: WrapperOnly = {}
    t = torch.zeros(1)
    tensors = [torch.zeros(1)]
    real = {name: getattr(dist, name) for name in NOOP_TARGETS}
    # all_to_all's equal-size path calls the process group itself, not a dist function.
    real_alltoall = dist.ProcessGroup.alltoall
    done = _Done()

    def nothing(*args: Any, **kwargs: Any) -> int:
        return 0  # recv returns the sender's rank

    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: sar.all_reduce(t),
        "broadcast": lambda: sar.broadcast(t, 0),
        "all_gather": lambda: sar.all_gather(tensors, t),
        "reduce_scatter": lambda: sar.reduce_scatter(t, tensors),
        "reduce": lambda: sar.reduce(t, 0),
        "gather": lambda: sar.gather(t, tensors, 0),
        "scatter": lambda: sar.scatter(t, tensors, 0),
        "send": lambda: sar.send(t, 0),
        "recv": lambda: sar.recv(t, 0),
        "barrier": lambda: sar.barrier(),
        "all_to_all": lambda: sar.all_to_all(tensors, tensors),  # equal sizes
    }
    try:
        for name in NOOP_TARGETS:
            setattr(dist, name, nothing)
        dist.ProcessGroup.alltoall = lambda self, *args: done  # type: ignore[assignment,method-assign]
        calls_per_block, blocks = (20_000, 10) if quick else (100_000, 20)
        for op, wrapped in calls.items():
            results[op] = interleaved(lambda: nothing(t, 0), wrapped, calls_per_block, blocks)
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
        dist.ProcessGroup.alltoall = real_alltoall  # type: ignore[method-assign]
    return results


def world1(quick: bool) -> Paired:
    """(2): a real 4-byte gloo all_reduce in a one-rank group."""
    from sarcomm.worker.library import collectives

    tensor = torch.zeros(1)
    pairs = 5_000 if quick else 30_000
    return alternating(lambda: dist.all_reduce(tensor), lambda: collectives.all_reduce(tensor), pairs)


def pair_ops(
    rank: int, world: int, nbytes: int, old: Any = None, ref: str = ""
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """op -> (bare call, wrapped call) over tensors of ``nbytes`` bytes (float32); ``old``, the
    baseline's alltoall module, adds its all_to_all under ``ref``."""
    from sarcomm.worker.library import collectives as sar

    n = max(1, nbytes // 4)
    t = torch.zeros(n)
    chunks = [torch.zeros(n) for _ in range(world)]
    out = torch.zeros(n)
    root_list = [torch.zeros(n) for _ in range(world)] if rank == 0 else None
    ops: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "all_reduce": (lambda: dist.all_reduce(t), lambda: sar.all_reduce(t)),
        # Calibration: bare against bare. Its "added" is the measurement's own noise floor.
        "all_reduce A/A (bare vs bare)": (lambda: dist.all_reduce(t), lambda: dist.all_reduce(t)),
        "broadcast": (lambda: dist.broadcast(t, 0), lambda: sar.broadcast(t, 0)),
        "all_gather": (lambda: dist.all_gather(chunks, t), lambda: sar.all_gather(chunks, t)),
        "reduce_scatter": (lambda: dist.reduce_scatter(out, chunks), lambda: sar.reduce_scatter(out, chunks)),
        "reduce": (lambda: dist.reduce(t, 0), lambda: sar.reduce(t, 0)),
        "gather": (lambda: dist.gather(t, root_list, 0), lambda: sar.gather(t, root_list, 0)),
        "scatter": (lambda: dist.scatter(t, root_list, 0), lambda: sar.scatter(t, root_list, 0)),
        "all_to_all": (lambda: dist.all_to_all(chunks, chunks), lambda: sar.all_to_all(chunks, chunks)),
    }
    if old is not None:
        ops[baseline_row(ref)] = (
            lambda: dist.all_to_all(chunks, chunks),
            lambda: old.all_to_all(chunks, chunks),
        )
    if rank == 0:
        ops["send/recv"] = (lambda: dist.send(t, 1), lambda: sar.send(t, 1))
    else:
        ops["send/recv"] = (lambda: dist.recv(t, 0), lambda: sar.recv(t, 0))
    if nbytes == 4:
        ops["barrier"] = (lambda: dist.barrier(), lambda: sar.barrier())
    return ops


def baseline_row(ref: str) -> str:
    return f"all_to_all at {ref[:10]} (before)"


def world2_rank(
    rank: int, world: int, port: int, quick: bool, out: Any, old_source: tuple[str, str] | None
) -> None:
    os.environ.setdefault("SAR_SOCKET_NAME", "lo")
    torch.set_num_threads(1)
    from sarcomm.worker.library import comm

    ref, source = old_source if old_source is not None else ("", "")
    old = (
        baseline.load(source, "alltoall_baseline", f"{ref}:worker/library/collectives/alltoall.py")
        if source
        else None
    )

    comm.initialize_comms(rank, world, "127.0.0.1", "gloo", master_port_number=port)
    results: World2 = {}
    sizes = {k: v for k, v in SIZES.items() if not quick or v <= 1024**2}
    for label, nbytes in sizes.items():
        ops = pair_ops(rank, world, nbytes, old, ref)
        if nbytes > 4:
            # Large sizes: all_reduce and all_to_all, the ops SAR calls with big tensors; the rest at 64 KiB.
            ops = {
                k: v
                for k, v in ops.items()
                if k.startswith(("all_reduce", "all_to_all")) or nbytes == 64 * 1024
            }
        for op, (bare, wrapped) in ops.items():
            bare()  # warm-up: connections, allocations
            wrapped()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(3):
                bare()
            estimate = torch.tensor([(time.perf_counter() - start) / 3])
            dist.all_reduce(estimate, dist.ReduceOp.MAX)
            budget = 1.0 if quick else 4.0  # seconds per (op, size), both sides together
            pairs = int(max(10, min(4000, budget / 2 / max(float(estimate), 1e-6))))
            dist.barrier()
            results.setdefault(op, {})[label] = alternating(bare, wrapped, pairs)
        if rank == 0:
            print(f"  world2 {label} done", file=sys.stderr, flush=True)
    if rank == 0:
        out.put(results)
    comm.destroy_comms()


def world2(quick: bool, old_source: tuple[str, str] | None) -> World2:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=world2_rank, args=(r, 2, port, quick, out, old_source)) for r in range(2)]
    for proc in procs:
        proc.start()
    results: World2 = out.get(timeout=900)
    for proc in procs:
        proc.join(60)
    return results


def wrapper_cost(only: WrapperOnly, op: str) -> float:
    """Seconds the wrapper of ``op`` adds, as (1) measured it (0 for the calibration rows and for
    the baseline's all_to_all)."""
    if op == "send/recv":
        return max(only["send"]["added_s"], only["recv"]["added_s"])
    return only[op]["added_s"] if op in only else 0.0


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:10.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--markdown", help="write the tables here as Markdown")
    parser.add_argument("--quick", action="store_true", help="fewer iterations, sizes up to 1 MiB")
    parser.add_argument(
        "--baseline-ref",
        help="also time worker/library/collectives/alltoall.py as it was at this git revision (before/after)",
    )
    args = parser.parse_args(argv)
    old_source = (
        baseline.source_at(args.baseline_ref, "worker/library/collectives/alltoall.py")
        if args.baseline_ref
        else None
    )
    started = time.monotonic()
    os.environ.setdefault("SAR_SOCKET_NAME", "lo")
    torch.set_num_threads(1)
    from sarcomm.worker.library import comm

    comm.initialize_comms(0, 1, "127.0.0.1", "gloo", master_port_number=free_port())
    try:
        only = wrapper_only(args.quick)
        one = world1(args.quick)
    finally:
        comm.destroy_comms()
    two = world2(args.quick, old_source)

    print("(1) wrapper alone, backend replaced by a no-op (us per call)")
    print(f"{'op':<26}{'bare':>10}{'wrapped':>10}{'added':>10}")
    for op, r in only.items():
        print(f"{op:<26}{fmt_us(r['bare_s'])}{fmt_us(r['wrapped_s'])}{fmt_us(r['added_s'])}")
    print("\n(2) 4-byte all_reduce, gloo, 1 rank (us per call)")
    print(f"{'all_reduce':<26}{fmt_us(one['bare_s'])}{fmt_us(one['wrapped_s'])}{fmt_us(one['added_s'])}")
    print("\n(3) gloo, 2 ranks on loopback (us per call; added = median paired difference;")
    print("    bound = wrapper cost from (1) / bare time)")
    print(f"{'op':<26}{'size':>8}{'bare':>10}{'wrapped':>10}{'added':>10}{'added %':>9}{'bound %':>9}")
    for op, by_size in two.items():
        for label, r in by_size.items():
            r["bound_fraction"] = wrapper_cost(only, op) / r["bare_s"]
            pct = 100 * r["added_s"] / r["bare_s"]
            print(
                f"{op:<26}{label:>8}{fmt_us(r['bare_s'])}{fmt_us(r['wrapped_s'])}{fmt_us(r['added_s'])}"
                f"{pct:8.2f}%{100 * r['bound_fraction']:8.3f}%"
            )
    report = {
        "benchmark": "overhead",
        "command": shlex.join(
            ["python", "benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": "gloo",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "statistic": "medians; added = median of paired differences (wrapped - bare)",
        "quick": args.quick,
        "wall_seconds": round(time.monotonic() - started, 1),
        "wrapper_only": only,
        "world1_all_reduce_4B": one,
        "world2": two,
        **(
            {
                "baseline": {
                    "ref": args.baseline_ref,
                    "commit": old_source[0],
                    "row": baseline_row(old_source[0]),
                }
            }
            if old_source is not None
            else {}
        ),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    if args.markdown:
        write_page(report, overhead_page.section, Path(args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
