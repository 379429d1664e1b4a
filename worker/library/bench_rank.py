"""One rank of ``sar-worker ... bench`` (``python -m sarcomm.worker.library.bench_rank``): runs the sweep
through sarcomm's own collectives, checks every result and, on rank 0, prints the table and writes
the JSON. The settings, the arithmetic and the table are in :mod:`sarcomm.worker.agent.bench`, which the
agent imports without torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TextIO

import torch
import torch.distributed as dist

import sarcomm.worker as sar
from sarcomm.common import netinfo
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.agent.bench import (
    DTYPES,
    EXIT_WRONG_VALUES,
    OPS,
    RANK_MODULE,
    BenchSettings,
    Row,
    add_bench_arguments,
    element_count,
    format_table,
    make_row,
    results_document,
    uneven_split,
)
from sarcomm.worker.agent.runner import EXIT_USAGE
from sarcomm.worker.library import comm, metrics
from sarcomm.worker.library.startup import WorkerInfo

__all__ = ["rank_main"]


class _Progress:
    """Rank 0's progress on stderr: one line per finished (op, size), or, on a terminal, one line
    rewritten in place (a long sweep on a terminal should not scroll the table away)."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self._stream = stream
        self._total = total
        self._done = 0
        self._started = time.monotonic()
        self._tty = stream.isatty()

    def row_done(self, row: Row) -> None:
        self._done += 1
        line = (
            f"bench: [{self._done}/{self._total}] {row.op} {row.bytes} B: {row.time_us:.1f} us, "
            f"busbw {row.busbw:.3f} GB/s, {row.wrong} wrong ({time.monotonic() - self._started:.1f} s)"
        )
        self._stream.write(f"\r\x1b[K{line}" if self._tty else f"{line}\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tty and self._done:
            self._stream.write("\n")
            self._stream.flush()


# The check pattern: element i of rank r's buffer is (7 i + 13 r) % 61. Small integers, so sums
# over ranks are exact in every dtype offered. 61 is prime, so a part delivered to the wrong
# offset (a power-of-two part size off) or from the wrong rank (fewer than 61 ranks off) differs.
_PERIOD: Final = 61
# Written into outputs before the checked call: no pattern value or sum is negative, so an
# element the call never wrote is counted as wrong.
_UNWRITTEN: Final = -1


@dataclass(frozen=True)
class _Env:
    """Where the rank's tensors live and how to wait for them."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype

    def sync(self) -> None:
        """Wait until the device finished queued work (nccl runs asynchronously to the host)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _pattern(env: _Env, ranks: Sequence[int], offset: int, n: int) -> torch.Tensor:
    """Elements ``offset..offset+n-1`` of the sum over ``ranks`` of their check patterns."""
    k = torch.arange(_PERIOD, dtype=torch.int64) + offset
    period = torch.zeros(_PERIOD, dtype=torch.int64)
    for r in ranks:
        period += (7 * k + 13 * r) % _PERIOD
    # One period, then tiled: cheap for any n, and never an int64 tensor of n elements.
    tiles = -(-n // _PERIOD)
    return period.to(device=env.device, dtype=env.dtype).repeat(tiles)[:n]


def _mismatches(got: torch.Tensor, expected: torch.Tensor) -> int:
    return int((got != expected).sum().item())


@dataclass(frozen=True)
class _Case:
    """One op at one size on this rank: ``reset`` fills the inputs with the pattern and the outputs
    with :data:`_UNWRITTEN`, ``run`` makes one call, ``wrong`` counts this rank's wrong elements."""

    run: Callable[[], object]
    reset: Callable[[], object]
    wrong: Callable[[], int]


def _all_reduce_case(env: _Env, count: int) -> _Case:
    buf = torch.empty(count, dtype=env.dtype, device=env.device)
    return _Case(
        run=lambda: sar.all_reduce(buf),
        reset=lambda: buf.copy_(_pattern(env, [env.rank], 0, count)),
        wrong=lambda: _mismatches(buf, _pattern(env, range(env.world), 0, count)),
    )


def _broadcast_case(env: _Env, count: int) -> _Case:
    buf = torch.empty(count, dtype=env.dtype, device=env.device)
    return _Case(
        run=lambda: sar.broadcast(buf, src=0),
        reset=lambda: buf.copy_(_pattern(env, [env.rank], 0, count)),
        wrong=lambda: _mismatches(buf, _pattern(env, [0], 0, count)),
    )


def _all_gather_case(env: _Env, count: int) -> _Case:
    part = count // env.world
    inp = torch.empty(part, dtype=env.dtype, device=env.device)
    out = torch.empty(count, dtype=env.dtype, device=env.device)
    outs = list(torch.split(out, part))

    def reset() -> None:
        inp.copy_(_pattern(env, [env.rank], 0, part))
        out.fill_(_UNWRITTEN)

    def wrong() -> int:
        return _mismatches(out, torch.cat([_pattern(env, [r], 0, part) for r in range(env.world)]))

    return _Case(run=lambda: sar.all_gather(outs, inp), reset=reset, wrong=wrong)


def _reduce_scatter_case(env: _Env, count: int) -> _Case:
    part = count // env.world
    inp = torch.empty(count, dtype=env.dtype, device=env.device)
    ins = list(torch.split(inp, part))
    out = torch.empty(part, dtype=env.dtype, device=env.device)

    def reset() -> None:
        inp.copy_(_pattern(env, [env.rank], 0, count))
        out.fill_(_UNWRITTEN)

    def wrong() -> int:
        return _mismatches(out, _pattern(env, range(env.world), env.rank * part, part))

    return _Case(run=lambda: sar.reduce_scatter(out, ins), reset=reset, wrong=wrong)


def _all_to_all_case(env: _Env, count: int, split: Callable[[int], list[int]]) -> _Case:
    """``split(src)``: how many elements rank ``src`` sends to each rank (adding up to ``count``)."""
    splits = [split(src) for src in range(env.world)]
    me = env.rank
    send = torch.empty(count, dtype=env.dtype, device=env.device)
    sends = list(torch.split(send, splits[me]))
    recv_sizes = [splits[src][me] for src in range(env.world)]
    recv = torch.empty(sum(recv_sizes), dtype=env.dtype, device=env.device)
    recvs = list(torch.split(recv, recv_sizes))

    def reset() -> None:
        send.copy_(_pattern(env, [me], 0, count))
        recv.fill_(_UNWRITTEN)

    def wrong() -> int:
        # From rank src: its part for me, which starts after its parts for ranks 0..me-1.
        expected = [_pattern(env, [src], sum(splits[src][:me]), splits[src][me]) for src in range(env.world)]
        return _mismatches(recv, torch.cat(expected))

    return _Case(run=lambda: sar.all_to_all(recvs, sends), reset=reset, wrong=wrong)


def _build_case(op: str, env: _Env, count: int) -> _Case:
    if op == "all_reduce":
        return _all_reduce_case(env, count)
    if op == "broadcast":
        return _broadcast_case(env, count)
    if op == "all_gather":
        return _all_gather_case(env, count)
    if op == "reduce_scatter":
        return _reduce_scatter_case(env, count)
    if op == "all_to_all":
        return _all_to_all_case(env, count, lambda src: [count // env.world] * env.world)
    if op == "all_to_all_unequal":
        return _all_to_all_case(env, count, lambda src: uneven_split(count, src, env.world))
    raise InvalidArgumentError(f"op={shorten(op)} must be one of {', '.join(OPS)}.")


def _over_ranks(env: _Env, seconds: float, wrong: int) -> tuple[float, int]:
    """The slowest rank's ``seconds`` and the sum of every rank's ``wrong``, through sarcomm's
    all_reduce (two small calls, recorded in the metrics like the measured ones)."""
    slowest = torch.tensor([seconds], dtype=torch.float64, device=env.device)
    sar.all_reduce(slowest, dist.ReduceOp.MAX)
    total = torch.tensor([wrong], dtype=torch.int64, device=env.device)
    sar.all_reduce(total)
    return float(slowest.item()), int(total.item())


def _measure(op: str, nbytes: int, settings: BenchSettings, env: _Env) -> Row:
    """One row: warm up, time ``iters`` calls, then check one call on fresh inputs."""
    count = element_count(op, nbytes, DTYPES[settings.dtype], env.world)
    case = _build_case(op, env, count)
    case.reset()
    for _ in range(settings.warmup):
        case.run()
    env.sync()
    sar.barrier()  # start together: otherwise the first rank's clock includes waiting for the last
    start = time.perf_counter_ns()
    for _ in range(settings.iters):
        case.run()
    env.sync()
    seconds = (time.perf_counter_ns() - start) / settings.iters / 1e9
    # The timed calls may have changed the inputs (all_reduce works in place): check on fresh ones.
    case.reset()
    case.run()
    env.sync()
    slowest, wrong = _over_ranks(env, seconds, case.wrong())
    return make_row(op, count, settings.dtype, slowest, env.world, wrong)


def _run_sweep(settings: BenchSettings, env: _Env, progress: _Progress | None) -> list[Row]:
    rows = []
    for op in settings.ops:
        for nbytes in settings.sizes:
            rows.append(_measure(op, nbytes, settings, env))
            if progress is not None:
                progress.row_done(rows[-1])
    if progress is not None:
        progress.close()
    return rows


def _report(rows: list[Row], settings: BenchSettings, info: WorkerInfo, backend: str) -> int:
    """Rank 0: print the table, write the JSON; 0, or 1 when the JSON could not be written."""
    host = netinfo.host_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    title = (
        f"sar-worker bench: job {info.job}, generation {info.generation}, world size {info.world_size}, "
        f"backend {backend}, rank 0 on {host}, {date}",
        f"dtype {settings.dtype}, {settings.warmup} warm-up + {settings.iters} timed calls per row; time: "
        "slowest rank's mean per call; busbw: algbw x nccl-tests' bus factor",
    )
    sys.stdout.write(format_table(rows, title))
    sys.stdout.flush()
    if settings.json_path is None:
        return 0
    document = results_document(
        rows, world_size=info.world_size, backend=backend, host=host, date=date, job=info.job,
        generation=info.generation, iters=settings.iters, warmup=settings.warmup,
        rank0_metrics=_recorded_calls(),
    )  # fmt: skip
    try:
        settings.json_path.parent.mkdir(parents=True, exist_ok=True)
        settings.json_path.write_text(json.dumps(document, indent=2) + "\n")
    except OSError as exc:
        print(f"sar-worker bench: error: could not write --json {settings.json_path}: {exc}", file=sys.stderr)
        return 1
    return 0


def _recorded_calls() -> dict[str, dict[str, int]]:
    """What this rank's metrics recorded per op (calls, bytes sent): the bench's calls went through
    sarcomm's collectives, so they are what its ``/metrics`` exported during the run."""
    return {
        f"{s.op}/{s.backend}": {"calls": s.count, "bytes_sent": s.bytes_sent, "errors": s.errors}
        for s in metrics.all_stats()
        if s.count or s.errors
    }


def _rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {RANK_MODULE}",
        description="One rank of sar-worker's bench; run it through 'sar-worker ... bench', which sets "
        "the environment it needs.",
    )
    add_bench_arguments(parser)
    return parser


def rank_main(argv: Sequence[str] | None = None) -> int:
    """Run one rank of the bench (the ranks ``sar-worker ... bench`` starts); return its exit status.

    Needs the environment ``sar-worker`` gives a rank (or torchrun's, see ``sar.init``). Returns 0,
    :data:`EXIT_WRONG_VALUES` on every rank when any checked value was wrong, 1 on rank 0 when the
    JSON could not be written, :data:`~sarcomm.worker.agent.runner.EXIT_USAGE` for bad flags or a missing
    or bad launch environment.

    Raises:
        SystemExit: from argparse, for ``--help`` and malformed flags.
        PeerFailedError: a peer failed during the sweep; and the backend's errors.
    """
    args = _rank_parser().parse_args(argv)
    try:
        settings = BenchSettings.from_args(args)
    except InvalidArgumentError as exc:
        print(f"sar-worker bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        info = sar.init()  # under sar-worker this also starts the rank's /metrics endpoint
    except InvalidArgumentError as exc:
        print(f"sar-worker bench: error: {exc} (run it as 'sar-worker ... bench')", file=sys.stderr)
        return EXIT_USAGE
    dtype = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
    env = _Env(info.rank, info.world_size, sar.comm_device(), dtype[settings.dtype])
    lead = info.rank == 0
    total = len(settings.ops) * len(settings.sizes)
    rows = _run_sweep(settings, env, _Progress(sys.stderr, total) if lead else None)
    status = _report(rows, settings, info, sar.backend()) if lead else 0
    wrong = sum(row.wrong for row in rows)
    if wrong and lead:
        print(f"sar-worker bench: {wrong} wrong value(s); see the #wrong column", file=sys.stderr)
    sar.barrier()  # nobody tears the group down while rank 0 still reports
    comm.destroy_comms()
    return EXIT_WRONG_VALUES if wrong else status


if __name__ == "__main__":
    raise SystemExit(rank_main())
