"""What summing gradients in SAR's order costs: ``gather_grads(model, bucketed=False)`` (one
all_reduce per parameter, as SAR) against the default ``bucketed=True`` (one all_reduce per
25 MiB bucket), in a two-rank gloo group on loopback, for a few model shapes.

The two are interleaved call by call (ABBA, identical on both ranks) so that drifting load hits both
alike; the figures are medians of each side's calls, and the ratio is SAR's order over bucketed
(> 1: SAR's order is slower). Each row also gives the collectives per call: 1 + parameters against
1 + buckets (the first, small all_reduce agrees on which parameters have a gradient).

    python benchmarks/gather_grads.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from harness import free_port
from recording import describe
from renderers import gather_grads as gather_grads_page
from renderers.gather_grads import GatherRow, Timing

#: name -> parameter shapes (one tensor each); float32.
MODELS: dict[str, list[tuple[int, ...]]] = {
    # A GNN as SAR trains it: 3 layers of 256 hidden features (weights and biases), 0.3 MiB.
    "gnn 3x256": [(256, 128), (256,), (256, 256), (256,), (40, 256), (40,)],
    # Many small parameters: 100 of 1 K floats (0.4 MiB), where per-call latency dominates.
    "100 x 1K": [(1024,)] * 100,
    # Few large ones: 8 of 1 M floats (32 MiB, two buckets).
    "8 x 1M": [(1024 * 1024,)] * 8,
}
BUCKET_BYTES = 25 * 1024 * 1024


def buckets(shapes: list[tuple[int, ...]]) -> int:
    """Buckets model_sync makes of these float32 gradients (one dtype, one device)."""
    count, size = 1, 0
    for shape in shapes:
        nbytes = 4 * int(torch.Size(shape).numel())
        if size and size + nbytes > BUCKET_BYTES:
            count, size = count + 1, 0
        size += nbytes
    return count


def rank_main(rank: int, world: int, port: int, calls: int, out: Any) -> None:
    os.environ.setdefault("SAR_SOCKET_NAME", "lo")
    torch.set_num_threads(1)
    import sarcomm.worker as sar

    sar.initialize_comms(rank, world, "127.0.0.1", "gloo", master_port_number=port)
    results: dict[str, Timing] = {}
    for name, shapes in MODELS.items():
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        model = torch.nn.ParameterList(params)
        for p in params:
            p.grad = torch.ones_like(p)
        times: dict[bool, list[float]] = {True: [], False: []}
        sar.gather_grads(model)  # warm-up: connections, allocations
        sar.gather_grads(model, bucketed=False)
        for i in range(calls):
            # ABBA: bucketed first on even pairs, SAR's order first on odd ones.
            for bucketed in (True, False) if i % 2 == 0 else (False, True):
                sar.barrier()
                start = time.perf_counter()
                sar.gather_grads(model, bucketed=bucketed)
                times[bucketed].append(time.perf_counter() - start)
        bucketed_s, sar_s = statistics.median(times[True]), statistics.median(times[False])
        results[name] = {
            "params": len(shapes),
            "mib": round(sum(4 * int(torch.Size(s).numel()) for s in shapes) / 2**20, 2),
            "bucketed_ms": round(bucketed_s * 1e3, 3),
            "sar_order_ms": round(sar_s * 1e3, 3),
            "ratio": round(sar_s / bucketed_s, 2),
            "collectives_bucketed": 1 + buckets(shapes),
            "collectives_sar_order": 1 + len(shapes),
        }
        if rank == 0:
            print(f"  {name} done", file=sys.stderr, flush=True)
    if rank == 0:
        out.put(results)
    sar.finalize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--quick", action="store_true", help="5 calls per side instead of 30")
    args = parser.parse_args(argv)
    calls = 5 if args.quick else 30
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, calls, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        results: dict[str, Timing] = out.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    rows: list[GatherRow] = [{"model": name, **r} for name, r in results.items()]
    print(f"{'model':<12}{'params':>7}{'MiB':>7}{'bucketed ms':>13}{'SAR order ms':>14}{'ratio':>7}")
    for r in rows:
        print(
            f"{r['model']:<12}{r['params']:>7}{r['mib']:>7}{r['bucketed_ms']:>13}{r['sar_order_ms']:>14}"
            f"{r['ratio']:>7}"
        )
    if args.json:
        doc = {
            "benchmark": "gather_grads",
            "title": gather_grads_page.TITLE,
            "headline": gather_grads_page.headline(rows),
            "command": shlex.join(
                ["python", "benchmarks/gather_grads.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "machine": describe("torch", world_size=2, calls_per_side=calls),
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
