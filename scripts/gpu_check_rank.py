"""The rank side of ``scripts/gpu-check.sh``: one nccl rank under ``sar-worker`` (zero-code metrics on,
the library imported too).

For each size, out-of-place ``all_gather_into_tensor`` (on a world of one, a device-to-device copy
of the whole buffer by NCCL) is run ITERS times and timed three ways: CUDA events on the calling
stream around each call (the reference), the zero-code path's recorded durations (the completion
hook's ``active_duration``: the sum and count it added to ``sar_collective_duration_seconds``),
and the host's wall time of each call (the launch time). Then ITERS calls of the library's
``sar.all_reduce`` of 64 MiB (its wrapper on nccl: CUDA events of its own, resolved by polling),
against CUDA events around the same calls. Prints one JSON object.

Usage: ``python scripts/gpu_check_rank.py`` (under sar-worker).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

import sarcomm.worker as sar
from sarcomm.worker.library import comm, metrics, zerocode

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
ITERS = 20
HOOK_WAIT_S = 30.0


def stats(op: str) -> tuple[int, float]:
    snap = next((s for s in metrics.all_stats() if (s.op, s.backend) == (op, "nccl")), None)
    return (snap.count, snap.sum_seconds) if snap is not None else (0, 0.0)


def wait_for_count(op: str, count: int) -> tuple[int, float]:
    deadline = time.monotonic() + HOOK_WAIT_S
    while True:
        found = stats(op)
        if found[0] >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def main() -> int:
    sar.init(backend="nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for size in SIZES:
        inp = torch.ones(size // 4, dtype=torch.float32, device=device)
        out = torch.empty(size // 4 * dist.get_world_size(), dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(out, inp)  # warm-up (NCCL's first call sets up)
        torch.cuda.synchronize()
        count0, sum0 = wait_for_count("all_gather", stats("all_gather")[0])
        events = [(_event(), _event()) for _ in range(ITERS)]
        launch = 0.0
        for start, end in events:
            start.record()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(out, inp)
            launch += time.perf_counter() - t0
            end.record()
        torch.cuda.synchronize()
        assert bool(torch.all(out == 1.0)), "all_gather_into_tensor gave wrong values"
        event_s = sum(s.elapsed_time(e) for s, e in events) / 1e3 / ITERS
        count1, sum1 = wait_for_count("all_gather", count0 + ITERS)
        recorded_s = (sum1 - sum0) / max(count1 - count0, 1)
        rows.append(
            {"bytes": size, "event_us": event_s * 1e6, "zerocode_us": recorded_s * 1e6,
             "zerocode_calls": count1 - count0, "launch_us": launch / ITERS * 1e6}
        )  # fmt: skip
    value = torch.ones(1 << 24, device=device)
    sar.all_reduce(value)  # warm-up
    torch.cuda.synchronize()
    timer = comm.STATE.cuda_events
    assert timer is not None, "the library has no CUDA events on a CUDA comm device"
    timer.poll()
    lib0 = stats("all_reduce")
    pairs = [(_event(), _event()) for _ in range(ITERS)]
    for start, end in pairs:
        start.record()
        sar.all_reduce(value)
        end.record()
    torch.cuda.synchronize()
    assert bool(torch.all(value == 1.0)), "sar.all_reduce gave wrong values"
    timer.poll()  # what a scrape or the next call does: every pair is done after the synchronize
    lib1 = stats("all_reduce")
    library = {
        "calls": lib1[0] - lib0[0],
        "recorded_us": (lib1[1] - lib0[1]) / ITERS * 1e6,
        "event_us": sum(s.elapsed_time(e) for s, e in pairs) / ITERS * 1e3,
    }
    print(json.dumps({"rows": rows, "library_all_reduce_64MiB": library, "zerocode_on": zerocode.active()}))
    sys.stdout.flush()
    sar.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
