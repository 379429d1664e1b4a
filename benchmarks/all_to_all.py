"""all_to_all with unequal sizes on gloo: sarcomm vs SAR's fallback vs all_to_all_single.

Starts ``--world`` local ranks (default 4) on 127.0.0.1 and times, for each size from 1 KiB to
64 MiB sent per rank, three ways of delivering the same unequal messages:

- ``sarcomm``: ``sarcomm.worker.library.collectives.all_to_all`` (the hybrid of one packed
  all_to_all_single for small messages and direct point-to-point for large ones);
- ``sar_fallback``: what SAR does on gloo: ``isend`` to every peer, blocking ``recv`` from each in
  rank order, then a ``barrier``;
- ``a2a_single``: what a user would write with ``all_to_all_single``: ``torch.cat`` the send list,
  one call with split sizes, copy the output's slices into the receive tensors;
- ``baseline`` (with ``--baseline-ref REF``): sarcomm's all_to_all as it was at git revision REF
  (``worker/library/collectives/alltoall.py`` there, loaded beside the current one), for
  before/after in one run.

Rank ``s`` sends rank ``d`` a share of the size proportional to ``1 + (s + 2d) % world``, so every
message size differs. Calls are interleaved (the method order rotates every iteration, each call
preceded by a barrier) so that drifting machine load hits all methods alike; a call's time is the
slowest rank's, and the table shows the median over iterations. Every method's result is checked
once per size before timing.

    python benchmarks/all_to_all.py [--world 4] [--sizes 1K:64M] [--json out.json]
        [--thresholds 64K,...]  # extra sarcomm runs with other small_message_bytes, for tuning
        [--seconds-per-size 15] # how long each size is timed (1 makes a quick smoke pass)
        [--baseline-ref REF]    # also time the all_to_all of git revision REF
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import baseline
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from render import write_page
from renderers import all_to_all as all_to_all_page
from renderers.all_to_all import SizeRow

# Iterations per size: small sizes are dominated by scheduling noise (4 ranks on few cores), so
# they get many; the whole default run stays under about 4 minutes.
MIN_ITERS, MAX_ITERS = 5, 1000
TIME_PER_SIZE_S = 15.0
WARMUP_ITERS = 2
SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = SIZE_UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in SIZE_UNITS else text
    return int(float(number) * unit)


def parse_sizes(text: str) -> list[int]:
    """``1K:64M`` (powers of 4 between the two) or a comma-separated list."""
    if ":" in text:
        low, high = (parse_size(part) for part in text.split(":"))
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= 4
        return sizes
    return [parse_size(part) for part in text.split(",")]


def human(n: int) -> str:
    for unit, factor in (("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n} B"


def message_elems(total_bytes: int, world: int, src: int, dst: int) -> int:
    """float32 elements rank ``src`` sends rank ``dst`` for ``total_bytes`` per rank."""
    weights = [1 + (src + 2 * d) % world for d in range(world)]
    return max(1, total_bytes * weights[dst] // sum(weights) // 4)


def sar_fallback(recv: list[torch.Tensor], send: list[torch.Tensor]) -> None:
    """SAR's all_to_all on gloo: isend everything, recv in rank order, barrier."""
    me, world = dist.get_rank(), dist.get_world_size()
    pending = []
    for peer in range(world):
        if peer == me:
            recv[peer].copy_(send[peer])
        else:
            pending.append(dist.isend(send[peer], peer))
    for peer in range(world):
        if peer != me:
            dist.recv(recv[peer], peer)
    for work in pending:
        if work is not None:
            work.wait()
    dist.barrier()


def a2a_single(recv: list[torch.Tensor], send: list[torch.Tensor]) -> None:
    """The same exchange written with all_to_all_single and split sizes."""
    flat_in = torch.cat(send)
    flat_out = torch.empty(sum(t.numel() for t in recv), dtype=flat_in.dtype)
    dist.all_to_all_single(flat_out, flat_in, [t.numel() for t in recv], [t.numel() for t in send])
    offset = 0
    for t in recv:
        t.copy_(flat_out[offset : offset + t.numel()])
        offset += t.numel()


def methods(
    thresholds: list[int], old_source: tuple[str, str] | None
) -> dict[str, Callable[[list[torch.Tensor], list[torch.Tensor]], None]]:
    from sarcomm.worker.library import collectives

    default = collectives.all_to_all_config().small_message_bytes
    found: dict[str, Callable[[list[torch.Tensor], list[torch.Tensor]], None]] = {
        "sarcomm": collectives.all_to_all,
        "sar_fallback": sar_fallback,
        "a2a_single": a2a_single,
    }
    if old_source is not None:
        commit, source = old_source
        found["baseline"] = baseline.load(
            source, "alltoall_baseline", f"{commit}:worker/library/collectives/alltoall.py"
        ).all_to_all
    for threshold in thresholds:

        def with_threshold(
            recv: list[torch.Tensor], send: list[torch.Tensor], small: int = threshold
        ) -> None:
            collectives.configure_all_to_all(small_message_bytes=small)
            try:
                collectives.all_to_all(recv, send)
            finally:
                collectives.configure_all_to_all(small_message_bytes=default)

        found[f"sarcomm@{human(threshold).replace(' ', '')}"] = with_threshold
    return found


def rank_main(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    thresholds: list[int],
    per_size_s: float,
    out: Any,
    old_source: tuple[str, str] | None,
) -> None:
    os.environ.setdefault("SAR_SOCKET_NAME", "lo")
    torch.set_num_threads(1)
    from sarcomm.worker.library import comm

    comm.initialize_comms(rank, world, "127.0.0.1", "gloo", master_port_number=port)
    table = methods(thresholds, old_source)
    results: dict[int, dict[str, list[float]]] = {}
    for total in sizes:
        send = [
            torch.full((message_elems(total, world, rank, d),), float(rank * world + d)) for d in range(world)
        ]
        recv = [torch.empty(message_elems(total, world, s, rank)) for s in range(world)]
        for name, fn in table.items():  # correctness first, untimed
            for t in recv:
                t.fill_(-1.0)
            fn(recv, send)
            for src, t in enumerate(recv):
                if not bool((t == float(src * world + rank)).all()):
                    raise RuntimeError(f"{name} delivered wrong data from rank {src} at {human(total)}")
        # Iterations from a rough first timing, agreed on by all ranks (the max).
        dist.barrier()
        start = time.perf_counter()
        for fn in table.values():
            fn(recv, send)
        estimate = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(estimate, dist.ReduceOp.MAX)
        iters = int(min(MAX_ITERS, max(MIN_ITERS, per_size_s / max(float(estimate), 1e-6))))
        names = list(table)
        times: dict[str, list[float]] = {name: [] for name in names}
        for it in range(iters + WARMUP_ITERS):
            shift = it % len(names)
            for name in names[shift:] + names[:shift]:
                dist.barrier()
                begin = time.perf_counter()
                table[name](recv, send)
                elapsed = time.perf_counter() - begin
                if it >= WARMUP_ITERS:
                    times[name].append(elapsed)
        results[total] = times
        if rank == 0:
            print(f"  {human(total)}: {iters} iterations", file=sys.stderr, flush=True)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        out.put(gathered)
    comm.destroy_comms()


def summarise(gathered: list[dict[int, dict[str, list[float]]]], sizes: list[int]) -> list[SizeRow]:
    rows: list[SizeRow] = []
    for total in sizes:
        names = list(gathered[0][total])
        medians = {}
        for name in names:
            per_iter = zip(*(rank_results[total][name] for rank_results in gathered), strict=True)
            slowest = [max(values) for values in per_iter]
            medians[name] = statistics.median(slowest)
        ours = medians["sarcomm"]
        row: SizeRow = {
            "bytes_per_rank": total,
            "iterations": len(gathered[0][total]["sarcomm"]),
            "median_seconds": medians,
            "sar_fallback_over_sarcomm": medians["sar_fallback"] / ours,
            "a2a_single_over_sarcomm": medians["a2a_single"] / ours,
        }
        if "baseline" in medians:
            row["baseline_over_sarcomm"] = medians["baseline"] / ours
        rows.append(row)
    return rows


RATIOS = {
    "sar_fallback_over_sarcomm": "fallback / sarcomm",
    "a2a_single_over_sarcomm": "a2a_single / sarcomm",
    "baseline_over_sarcomm": "baseline / sarcomm",
}


def print_table(rows: list[SizeRow], world: int) -> None:
    names = list(rows[0]["median_seconds"])
    ratios = [key for key in RATIOS if key in rows[0]]
    print(f"all_to_all, unequal sizes, gloo, {world} ranks on loopback; median of the slowest rank, ms")
    print(
        f"{'bytes/rank':>10} "
        + " ".join(f"{n:>14}" for n in names)
        + "".join(f" {RATIOS[key].replace(' ', ''):>20}" for key in ratios)
    )
    for row in rows:
        cells = " ".join(f"{row['median_seconds'][n] * 1e3:14.3f}" for n in names)
        figures = cast(dict[str, float], row)
        print(
            f"{human(row['bytes_per_rank']):>10} {cells}"
            + "".join(f" {figures[key]:20.2f}" for key in ratios)
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument(
        "--sizes", default="1K:64M", help="bytes sent per rank: LOW:HIGH (x4 steps) or a list"
    )
    parser.add_argument("--thresholds", default="", help="extra sarcomm runs with these small_message_bytes")
    parser.add_argument(
        "--seconds-per-size",
        type=float,
        default=TIME_PER_SIZE_S,
        help=f"seconds of timed calls per size, all methods together (default {TIME_PER_SIZE_S:g})",
    )
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--markdown", help="write the table here as Markdown")
    parser.add_argument(
        "--baseline-ref",
        help="also time worker/library/collectives/alltoall.py as it was at this git revision",
    )
    args = parser.parse_args(argv)
    old_source = (
        baseline.source_at(args.baseline_ref, "worker/library/collectives/alltoall.py")
        if args.baseline_ref
        else None
    )
    sizes = parse_sizes(args.sizes)
    thresholds = [parse_size(t) for t in args.thresholds.split(",") if t.strip()]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main,
            args=(r, args.world, port, sizes, thresholds, args.seconds_per_size, out, old_source),
        )
        for r in range(args.world)
    ]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    gathered = out.get(timeout=1800)
    for proc in procs:
        proc.join(60)
    rows = summarise(gathered, sizes)
    print_table(rows, args.world)
    from sarcomm.worker.library import collectives

    report = {
        "benchmark": "all_to_all",
        "command": shlex.join(
            ["python", "benchmarks/all_to_all.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": args.world,
        "backend": "gloo",
        "transport": "TCP over loopback (127.0.0.1)",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "small_message_bytes": collectives.all_to_all_config().small_message_bytes,
        "statistic": "median over iterations of the slowest rank's wall time per call",
        "seconds_per_size": args.seconds_per_size,
        "wall_seconds": round(time.monotonic() - started, 1),
        "rows": rows,
        **({"baseline": {"ref": args.baseline_ref, "commit": old_source[0]}} if old_source else {}),
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    if args.markdown:
        write_page(report, all_to_all_page.section, Path(args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
