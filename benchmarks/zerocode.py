"""What zero-code metrics cost (gloo on loopback), side by side in one run:

1. ``ddp``: a DDP training step (forward and backward of one linear layer, gradients of 4, 25 and
   100 MiB, DDP's 25 MiB buckets) in two ranks, with the dispatcher kernels registered and
   removed, block by block (ABBA) in the same processes (:func:`zerocode.set_kernels`);
2. ``per_call``: one all_reduce of 4 B, 64 KiB and 4 MiB in two ranks, four ways interleaved:
   bare ``dist.all_reduce``; the same with zero-code on; the library's ``sar.all_reduce`` alone;
   the library's with zero-code on (the kernel steps aside: counted once);
3. ``world1``: a 4-byte all_reduce in a one-rank group, bare against the library's wrapper (the
   wrapper's whole cost) with zero-code off and on (its calls dispatched below the kernels), and
   the wrapper's parts timed alone (where the cost goes); the same
   bare call against the zero-code kernel handing it on and recording it (where its cost goes).

Each figure is a median over many interleaved blocks, with the process CPU time beside the wall
time (the machine is shared: CPU time is less disturbed by other load).

    python benchmarks/zerocode.py [--quick] [--json benchmarks/results/zerocode.json]
        [--markdown benchmarks/results/zerocode.md]

The ranks are this file run with ``--rank R --world W``: they set the variables of a torchrun
worker of the sarcomm rendezvous (no endpoint) before importing torch, so that torch's entry point
instruments them as it would a real job.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from render import write_page
from renderers import zerocode as zerocode_page

ROOT = Path(__file__).resolve().parents[1]
DDP_MIB = (4, 25, 100)
PER_CALL = {"4 B": 4, "64 KiB": 64 << 10, "4 MiB": 4 << 20}


def _blocks(
    variants: dict[str, Callable[[], Any]], calls: int, rounds: int, toggle: Callable[[str], None]
) -> dict[str, Any]:
    """Each round runs every variant once (a block of ``calls`` calls), forwards then backwards
    (ABCD DCBA): medians of the per-call wall and CPU seconds of each variant."""
    names = list(variants)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            toggle(name)
            fn = variants[name]
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            wall[name].append((time.perf_counter() - t0) / calls)
            cpu[name].append((time.process_time() - c0) / calls)
    return {
        n: {"wall_s": statistics.median(wall[n]), "cpu_s": statistics.median(cpu[n]), "blocks": rounds}
        for n in names
    }


def rank_main(rank: int, world: int, quick: bool, out: Path, pin: bool = False) -> None:
    if pin:  # before torch starts its threads (gloo's included): they inherit this one CPU
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch
    import torch.distributed as dist

    import sarcomm.worker as sar
    from sarcomm.worker.library import zerocode
    from sarcomm.worker.library.collectives import timing

    assert zerocode.active(), "the entry point did not instrument this rank"
    sar.init(backend="gloo")
    torch.manual_seed(0)

    def toggle(name: str) -> None:
        zerocode.set_kernels(name.endswith("on"))
        dist.barrier()  # both ranks switch between the same calls (the barrier itself not timed)

    result: dict[str, Any] = {}
    if world > 1:
        ddp: dict[str, Any] = {}
        for mib in DDP_MIB:
            features = mib * (1 << 20) // 4 // 1024
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(features, 1024, bias=False))
            x = torch.randn(8, features)

            def step(model: Any = model, x: torch.Tensor = x) -> None:
                model(x).sum().backward()

            step()
            row = _blocks({"off": step, "on": step}, 2 if quick else 4, 6 if quick else 32, toggle)
            row["collectives_per_step"] = _collectives_per_step(step, toggle)
            ddp[f"{mib} MiB"] = row
        result["ddp"] = ddp
        per_call: dict[str, Any] = {}
        for label, nbytes in PER_CALL.items():
            tensor = torch.zeros(max(1, nbytes // 4))
            variants: dict[str, Callable[[], Any]] = {
                "bare_off": functools.partial(dist.all_reduce, tensor),
                "bare_on": functools.partial(dist.all_reduce, tensor),
                "library_off": functools.partial(sar.all_reduce, tensor),
                "library_on": functools.partial(sar.all_reduce, tensor),
            }
            calls = 200 if nbytes < (1 << 20) else 10
            per_call[label] = _blocks(variants, calls // (2 if quick else 1), 6 if quick else 20, toggle)
        result["per_call"] = per_call
    else:
        tensor = torch.zeros(1)
        result["world1"] = _blocks(
            {"bare": lambda: dist.all_reduce(tensor), "library": lambda: sar.all_reduce(tensor),
             "library_on": lambda: sar.all_reduce(tensor)},
            2000, 20 if quick else 60, lambda name: _library_mode(zerocode, timing, name),
        )  # fmt: skip
        _library_mode(zerocode, timing, "library")
        result["parts"] = _parts(tensor, timing)
        result["kernel"] = _blocks(
            {"bare": lambda: dist.all_reduce(tensor), "handed_on": lambda: dist.all_reduce(tensor),
             "recorded": lambda: dist.all_reduce(tensor)},
            500, 10 if quick else 30, lambda name: _kernel_mode(zerocode, name),
        )  # fmt: skip
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _collectives_per_step(step: Callable[[], None], toggle: Callable[[str], None]) -> int:
    """How many collectives zero-code records in one DDP step (its kernels on): the count that
    multiplies its per-collective cost into a bound on the step's."""
    from sarcomm.worker.library import metrics

    def recorded() -> int:
        return sum(s.count for s in metrics.all_stats())

    toggle("on")
    before = recorded()
    step()
    toggle("off")  # the toggle's own barrier is recorded once its kernels are off: not counted
    return recorded() - before


def _library_mode(zerocode: Any, timing: Any, name: str) -> None:
    """bare and library: zero-code off (no kernels, no progress hook: a rank without a progress
    writer, as under torchrun); library_on: zero-code on (its kernels, the wrappers dispatching
    below them, its progress hook counting the library's depth)."""
    on = name == "library_on"
    zerocode.set_kernels(on)
    timing.set_progress_hook(zerocode._LibraryCall(None) if on else None)


def _kernel_mode(zerocode: Any, name: str) -> None:
    """bare: no kernels; handed_on: the kernel runs and hands the call on (as inside the library's
    wrappers: its per-thread depth raised); recorded: the whole zero-code path."""
    zerocode.set_kernels(name != "bare")
    zerocode._tls.depth = 1 if name == "handed_on" else 0


def _parts(tensor: Any, timing: Any) -> dict[str, float]:
    """The wrapper's parts alone, ns per call (median of 20 blocks of 20,000)."""
    from sarcomm.worker.library import comm

    stats = comm.STATE.stats["all_reduce"]
    clock = time.perf_counter_ns

    def observe() -> None:
        stats.observe(clock(), 4)

    parts: dict[str, Callable[[], Any]] = {
        "empty loop": lambda: None,
        "two clock reads": lambda: (clock(), clock()),
        "tensor.nbytes": lambda: tensor.nbytes,
        "state checks (ready, cpu_group, flags)": lambda: comm.STATE.ready and comm.STATE.cpu_group is None,
        "stats.observe (append, fold every 256)": observe,
        "progress hook lookup (none set)": lambda: timing._progress,
    }
    found: dict[str, float] = {}
    for name, fn in parts.items():
        samples = []
        for _ in range(20):
            t0 = time.perf_counter_ns()
            for _ in range(20_000):
                fn()
            samples.append((time.perf_counter_ns() - t0) / 20_000)
        found[name] = statistics.median(samples)
    found.update(_cold_parts(tensor, stats))
    return found


def _cold_parts(tensor: Any, stats: Any) -> dict[str, float]:
    """The same parts timed right after a real one-rank all_reduce, as the wrapper meets them (its
    thread just back from gloo, caches cold), ns per call (median of 20 blocks of 500)."""
    import torch.distributed as dist

    from sarcomm.worker.library import comm

    clock = time.perf_counter_ns
    parts: dict[str, Callable[[], Any]] = {
        "after a real call: two clock reads": lambda: None,
        "after a real call: tensor.nbytes and state checks": lambda: (
            tensor.nbytes,
            comm.STATE.ready and comm.STATE.cpu_group is None,
        ),
        "after a real call: stats.observe": lambda: stats.observe(clock(), 4),
    }
    found: dict[str, float] = {}
    for name, fn in parts.items():
        samples = []
        for _ in range(20):
            spent = 0
            for _ in range(500):
                dist.all_reduce(tensor)
                t0 = clock()
                fn()
                spent += clock() - t0
            samples.append(spent / 500)
        found[name] = statistics.median(samples)
    return found


def run_world(world: int, quick: bool, pin: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        notes = Path(tmp) / "endpoints"
        notes.mkdir()
        port = _free_port()
        procs = []
        for rank in range(world):
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("SAR_")},
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SAR_ENDPOINTS_DIR": str(notes),
                "SAR_METRICS_PORT": "-1", "SAR_GENERATION": "1", "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            args = [sys.executable, __file__, "--rank", str(rank), "--world", str(world), "--out", str(out)]
            flags = [*(["--quick"] if quick else []), *(["--pin"] if pin else [])]
            procs.append(subprocess.Popen([*args, *flags], env=env))
        codes = [p.wait(900) for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"ranks exited {codes}")
        return dict(json.loads(out.read_text()))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args.quick, args.out, args.pin)
        return 0
    started = datetime.datetime.now(datetime.timezone.utc)
    command = ["python", "benchmarks/zerocode.py", *(argv if argv is not None else sys.argv[1:])]
    doc: dict[str, Any] = {
        "benchmark": "zerocode",
        "command": shlex.join(command),
        "quick": args.quick,
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "date": started.strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg_1m_at_start": os.getloadavg()[0],
        },
    }
    doc.update(run_world(2, args.quick))
    doc.update(run_world(1, args.quick))
    # The one-rank run again with the rank (and gloo's threads) on one CPU: what the wrapper costs
    # when its thread does not come back from the collective on another core.
    pinned = run_world(1, args.quick, pin=True)
    doc["pinned"] = {"world1": pinned["world1"], "parts": pinned["parts"]}
    doc["machine"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(write_page(doc, zerocode_page.section, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
