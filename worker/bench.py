"""``sar-worker ... bench``: the built-in collective benchmark, a table like nccl-tests'.

::

    sar-worker --coord HOST:PORT --job NAME --world-size N [--nproc-per-node K] bench
               [--ops all_reduce,all_to_all,...] [--sizes 1K:64M] [--factor F] [--iters N]
               [--warmup N] [--dtype float32|float64|int32|int64] [--json PATH]

The subcommand is an ordinary ``sar-worker`` run whose COMMAND is ``python -m
sarcomm.worker.bench <flags>``: the agent registers its K local ranks, starts each as a real
process with the contract's environment, heartbeats for them and stops them when a peer fails,
exactly as for a training script. Each rank calls ``sar.init()`` and drives the sweep through
sarcomm's own collectives, so every measured call is also timed into the rank's ``/metrics``.

For each op and each size, every rank runs ``--warmup`` untimed calls, a barrier, then ``--iters``
back-to-back calls under one clock; the row's time is the slowest rank's mean time per call (one
``all_reduce`` with MAX). Then the inputs are refilled and the op runs once more to be checked:
each rank's input is a deterministic pattern of small integers (exact in every dtype offered), so
every rank can compute what it must receive; the row's ``#wrong`` is the number of elements that
differ, summed over ranks. A non-zero total makes every rank, and so ``sar-worker``, exit 1.

Columns follow nccl-tests: ``size`` is the larger buffer of the call in bytes (the whole gathered
output for all_gather, the whole input for reduce_scatter, what each rank sends for all_to_all),
rounded down so that it splits evenly over the ranks; ``count`` is that in elements;
``algbw = size / time``; ``busbw = algbw * factor`` with nccl-tests' factors (all_reduce
``2(n-1)/n``; all_gather, reduce_scatter and all_to_all ``(n-1)/n``; broadcast 1), which makes
the figure comparable with the link's bandwidth whatever the op. ``all_to_all_unequal`` sends each
peer a different share of the same total (:func:`uneven_split`), the case SAR runs and gloo's own
all_to_all refuses.

Rank 0 prints the table to stdout at the end and, with ``--json``, writes the rows (``op``,
``bytes``, ``count``, ``dtype``, ``time_us``, ``algbw``, ``busbw``, ``wrong``) with ``world_size``,
``backend``, ``host``, ``date``, ``job``, ``generation``, ``iters``, ``warmup`` and
``rank0_metrics`` (the calls and bytes its metrics recorded per op: the bench's own calls, plus a
barrier per row and two small all_reduce per row that gather the times and counts). While the
sweep runs it reports each finished (op, size) on stderr (one line each, or one updated line on a
terminal). torch is imported only by the ranks, never by the agent.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

import sarcomm.worker as sar
from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker.agent import AgentConfig
from sarcomm.worker.cli import EXIT_USAGE, run_agent

if TYPE_CHECKING:
    import torch

    from sarcomm.worker.startup import WorkerInfo

__all__ = [
    "COMMAND",
    "DTYPES",
    "EXIT_WRONG_VALUES",
    "OPS",
    "BenchCommand",
    "BenchSettings",
    "Row",
    "add_bench_arguments",
    "bus_factor",
    "element_count",
    "format_table",
    "make_row",
    "parse_ops",
    "parse_size",
    "parse_sizes",
    "rank_main",
    "results_document",
    "uneven_split",
]

log = logging.getLogger(__name__)

#: The ops the bench runs, in the order ``--ops all`` runs them.
OPS: Final = ("all_reduce", "all_to_all", "all_to_all_unequal", "all_gather", "reduce_scatter", "broadcast")
#: ``--dtype`` choices and their element sizes in bytes. Only dtypes that hold the check pattern's
#: sums exactly (integers up to 60 x world size): half precision would report false #wrong.
DTYPES: Final = {"float32": 4, "float64": 8, "int32": 4, "int64": 8}
#: Exit status of the ranks (and so of sar-worker) when any checked value was wrong.
EXIT_WRONG_VALUES: Final = 1
#: The module each rank runs (``python -m``).
RANK_MODULE: Final = "sarcomm.worker.bench"

DEFAULT_SIZES: Final = "1K:64M"
DEFAULT_FACTOR: Final = 2
DEFAULT_ITERS: Final = 20
DEFAULT_WARMUP: Final = 5
DEFAULT_DTYPE: Final = "float32"

# Ops whose buffer is cut into one part per rank: their element count is a multiple of the world.
_SPLIT_OPS: Final = frozenset({"all_to_all", "all_to_all_unequal", "all_gather", "reduce_scatter"})
_UNITS: Final = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE: Final = re.compile(r"\s*(\d+)\s*([KMG]?)\s*", re.IGNORECASE)
_SIZE_RULE: Final = "a positive number of bytes with an optional K, M or G suffix (powers of 1024)"


# -- settings ------------------------------------------------------------------------------------


def parse_size(text: str, flag: str = "--sizes") -> int:
    """Bytes in ``text``: ``4096``, ``64K``, ``16M``, ``1G`` (suffixes are powers of 1024, any case).

    Raises:
        InvalidArgumentError: not a positive integer with an optional suffix; the message names
            ``flag``, the value and the rule.
    """
    match = _SIZE_RE.fullmatch(text)
    value = int(match.group(1)) * _UNITS[match.group(2).upper()] if match else 0
    if value < 1:
        raise InvalidArgumentError(f"{flag} {shorten(text)} must be {_SIZE_RULE}, e.g. 64K.")
    return value


def parse_sizes(text: str, factor: int = DEFAULT_FACTOR, flag: str = "--sizes") -> tuple[int, ...]:
    """The sizes of a sweep, ascending and without repeats, from a comma list of sizes and ranges.

    A range ``MIN:MAX`` is MIN, MIN x ``factor``, MIN x factor², ... up to MAX (MAX itself only when
    it lies on that grid), as nccl-tests' ``-b MIN -e MAX -f factor``: ``1K:8K`` is 1K, 2K, 4K, 8K.

    Raises:
        InvalidArgumentError: an item is empty or not a size (see :func:`parse_size`), MIN > MAX,
            or ``factor`` < 2; the message names the flag, the value and the rule.
    """
    if factor < 2:
        raise InvalidArgumentError(f"--factor {factor} must be an integer >= 2.")
    sizes: set[int] = set()
    for item in text.split(","):
        low_text, sep, high_text = item.partition(":")
        try:
            low = parse_size(low_text, flag)
            high = parse_size(high_text, flag) if sep else low
        except InvalidArgumentError:
            raise InvalidArgumentError(
                f"{flag} {shorten(text)} must be sizes or MIN:MAX ranges separated by commas, each size "
                f"{_SIZE_RULE}, e.g. 1K:64M; {shorten(item)} is not."
            ) from None
        if low > high:
            raise InvalidArgumentError(
                f"{flag} {shorten(text)} must give each range as MIN:MAX with MIN <= MAX; "
                f"{shorten(item)} has MIN {low} > MAX {high}."
            )
        size = low
        while size <= high:
            sizes.add(size)
            size *= factor
    return tuple(sorted(sizes))


def parse_ops(text: str, flag: str = "--ops") -> tuple[str, ...]:
    """The ops of a comma list, in the order given, without repeats; ``all`` is every one of :data:`OPS`.

    Raises:
        InvalidArgumentError: an item is not ``all`` or one of :data:`OPS` (the message lists them).
    """
    ops: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if item not in (*OPS, "all"):
            raise InvalidArgumentError(
                f"{flag} {shorten(text)} must be a comma list of all, {', '.join(OPS)}; "
                f"{shorten(item)} is none of them."
            )
        ops.extend(OPS if item == "all" else (item,))
    return tuple(dict.fromkeys(ops))


def _integer_flag(flag: str, text: str | None, low: int, default: int) -> int:
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        value = low - 1
    if value < low:
        raise InvalidArgumentError(f"{flag} {shorten(text)} must be an integer >= {low}.")
    return value


@dataclass(frozen=True)
class BenchSettings:
    """What to measure, validated when built (messages name the flag, the value and the rule).

    Attributes:
        ops: ops to run, in order (each one of :data:`OPS`).
        sizes: sizes in bytes, ascending (each rounded per op, see :func:`element_count`).
        iters: timed calls per (op, size), >= 1.
        warmup: untimed calls before them, >= 0.
        dtype: element type, one of :data:`DTYPES`.
        json_path: where rank 0 writes the results (None: nowhere).
    """

    ops: tuple[str, ...] = OPS
    sizes: tuple[int, ...] = parse_sizes(DEFAULT_SIZES)
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    dtype: str = DEFAULT_DTYPE
    json_path: Path | None = None

    def __post_init__(self) -> None:
        if not self.ops or any(op not in OPS for op in self.ops):
            raise InvalidArgumentError(f"--ops {shorten(self.ops)} must name some of {', '.join(OPS)}.")
        if not self.sizes or any(size < 1 for size in self.sizes):
            raise InvalidArgumentError(f"--sizes {shorten(self.sizes)} must be positive sizes in bytes.")
        if self.iters < 1:
            raise InvalidArgumentError(f"--iters {self.iters} must be an integer >= 1.")
        if self.warmup < 0:
            raise InvalidArgumentError(f"--warmup {self.warmup} must be an integer >= 0.")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"--dtype {shorten(self.dtype)} must be one of {', '.join(DTYPES)}.")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchSettings:
        """Settings from the flags :func:`add_bench_arguments` added (strings, None when absent).

        Raises:
            InvalidArgumentError: a flag's value breaks its rule; the message names the flag, the
                value and the rule.
        """
        factor = _integer_flag("--factor", getattr(args, "factor", None), 2, DEFAULT_FACTOR)
        json_text: str | None = getattr(args, "json", None)
        if json_text is not None and not json_text.strip():
            raise InvalidArgumentError("--json '' must be the path of the file to write the results to.")
        return cls(
            ops=parse_ops(getattr(args, "ops", None) or "all"),
            sizes=parse_sizes(getattr(args, "sizes", None) or DEFAULT_SIZES, factor),
            iters=_integer_flag("--iters", getattr(args, "iters", None), 1, DEFAULT_ITERS),
            warmup=_integer_flag("--warmup", getattr(args, "warmup", None), 0, DEFAULT_WARMUP),
            dtype=(getattr(args, "dtype", None) or DEFAULT_DTYPE).strip(),
            # Absolute, so that it means the same to a rank whatever directory it runs in.
            json_path=Path(json_text).expanduser().absolute() if json_text is not None else None,
        )

    def argv(self) -> list[str]:
        """Flags that make :meth:`from_args` build these settings again (for the rank command)."""
        argv = ["--ops", ",".join(self.ops), "--sizes", ",".join(map(str, self.sizes))]
        argv += ["--iters", str(self.iters), "--warmup", str(self.warmup), "--dtype", self.dtype]
        return argv + (["--json", str(self.json_path)] if self.json_path is not None else [])


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench's flags, all as strings: :meth:`BenchSettings.from_args` checks them, so that
    a bad value gets sarcomm's message (flag, value, rule) rather than argparse's."""
    parser.add_argument("--ops", metavar="LIST", help=f"comma list of {', '.join(OPS)}, or all (default all)")
    parser.add_argument(
        "--sizes",
        metavar="SPEC",
        help=f"sizes in bytes: MIN:MAX (MIN, MIN*F, ... up to MAX) or a comma list; K, M, G are powers "
        f"of 1024 (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--factor", metavar="F", help=f"growth factor of MIN:MAX ranges (default {DEFAULT_FACTOR})"
    )
    parser.add_argument("--iters", metavar="N", help=f"timed calls per op and size (default {DEFAULT_ITERS})")
    parser.add_argument("--warmup", metavar="N", help=f"untimed calls before them (default {DEFAULT_WARMUP})")
    parser.add_argument(
        "--dtype", metavar="TYPE", help=f"one of {', '.join(DTYPES)} (default {DEFAULT_DTYPE})"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results there as JSON (rank 0)")


# -- arithmetic ----------------------------------------------------------------------------------


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` in a world of ``world`` ranks: busbw = algbw x
    factor is what each link carries, so it compares with the hardware's bandwidth.

    Raises:
        InvalidArgumentError: ``op`` is not one of :data:`OPS`, or ``world`` < 1.
    """
    if world < 1:
        raise InvalidArgumentError(f"world={world} must be an integer >= 1.")
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in _SPLIT_OPS:
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise InvalidArgumentError(f"op={shorten(op)} must be one of {', '.join(OPS)}.")


def element_count(op: str, nbytes: int, itemsize: int, world: int) -> int:
    """Elements of the call's larger buffer for a requested size: ``nbytes // itemsize``, rounded
    down to a multiple of ``world`` for the ops that split their buffer over the ranks, and at least
    one element (per rank), as nccl-tests rounds."""
    count = max(1, nbytes // itemsize)
    if op in _SPLIT_OPS:
        count = max(1, count // world) * world
    return count


def uneven_split(total: int, src: int, world: int) -> list[int]:
    """How many of its ``total`` elements rank ``src`` sends to each rank in ``all_to_all_unequal``.

    Shares are proportional to ``1 + (src + dst) % world`` (so each rank sends every peer a
    different amount, and the sizes differ between senders too); the rounding remainder stays with
    ``src`` itself. Every rank computes every sender's split, so receivers know their sizes without
    asking. The parts add up to ``total``.
    """
    weights = [1 + (src + dst) % world for dst in range(world)]
    parts = [total * w // sum(weights) for w in weights]
    parts[src] += total - sum(parts)
    return parts


@dataclass(frozen=True)
class Row:
    """One measured (op, size): what the table shows and the JSON holds.

    ``bytes`` and ``count`` describe the call's larger buffer (see :func:`element_count`);
    ``time_us`` is the slowest rank's mean per call; ``algbw`` and ``busbw`` are in GB/s (1e9
    bytes per second); ``wrong`` counts elements that differed from the expected values, over all
    ranks.
    """

    op: str
    bytes: int
    count: int
    dtype: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int


def make_row(op: str, count: int, dtype: str, seconds: float, world: int, wrong: int) -> Row:
    """The row of ``count`` elements of ``dtype`` that took ``seconds`` per call."""
    nbytes = count * DTYPES[dtype]
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return Row(op, nbytes, count, dtype, seconds * 1e6, algbw, algbw * bus_factor(op, world), wrong)


# -- output --------------------------------------------------------------------------------------

# Columns after the op's: name, unit and width, as nccl-tests labels them.
_COLUMNS: Final = (
    ("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("time", "(us)", 10),
    ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("#wrong", "", 7),
)  # fmt: skip
_HEADER: Final = (
    f"#{'op':>19} " + " ".join(f"{name:>{width}}" for name, _, width in _COLUMNS),
    (f"#{'':>19} " + " ".join(f"{unit:>{width}}" for _, unit, width in _COLUMNS)).rstrip(),
)


def _format_row(row: Row) -> str:
    return (
        f"{row.op:>20} {row.bytes:>12} {row.count:>12} {row.dtype:>8} {row.time_us:>10.1f} "
        f"{row.algbw:>8.3f} {row.busbw:>8.3f} {row.wrong:>7}"
    )


def format_table(rows: Sequence[Row], title: Sequence[str] = ()) -> str:
    """The nccl-tests-like table: ``title`` lines, the header, one line per row, and the summary
    (the total of wrong values with OK or FAILED, and the mean bus bandwidth)."""
    wrong = sum(row.wrong for row in rows)
    average = sum(row.busbw for row in rows) / len(rows) if rows else 0.0
    lines = [f"# {line}" for line in title]
    lines += ["#", *_HEADER, *map(_format_row, rows)]
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {average:.4g} GB/s")
    return "\n".join(lines) + "\n"


def results_document(rows: Sequence[Row], **meta: Any) -> dict[str, Any]:
    """The ``--json`` document: ``meta`` (world_size, backend, host, date, ...) and ``rows``."""
    return {**meta, "rows": [dataclasses.asdict(row) for row in rows]}


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


# -- the rank side (imports torch) ---------------------------------------------------------------

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
            import torch

            torch.cuda.synchronize(self.device)


def _pattern(env: _Env, ranks: Sequence[int], offset: int, n: int) -> torch.Tensor:
    """Elements ``offset..offset+n-1`` of the sum over ``ranks`` of their check patterns."""
    import torch

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
    import torch

    buf = torch.empty(count, dtype=env.dtype, device=env.device)
    return _Case(
        run=lambda: sar.all_reduce(buf),
        reset=lambda: buf.copy_(_pattern(env, [env.rank], 0, count)),
        wrong=lambda: _mismatches(buf, _pattern(env, range(env.world), 0, count)),
    )


def _broadcast_case(env: _Env, count: int) -> _Case:
    import torch

    buf = torch.empty(count, dtype=env.dtype, device=env.device)
    return _Case(
        run=lambda: sar.broadcast(buf, src=0),
        reset=lambda: buf.copy_(_pattern(env, [env.rank], 0, count)),
        wrong=lambda: _mismatches(buf, _pattern(env, [0], 0, count)),
    )


def _all_gather_case(env: _Env, count: int) -> _Case:
    import torch

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
    import torch

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
    import torch

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
    import torch
    import torch.distributed as dist

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
    from sarcomm.common import netinfo

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
    from sarcomm.worker import metrics

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
    JSON could not be written, :data:`~sarcomm.worker.cli.EXIT_USAGE` for bad flags or a missing
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
    import torch

    from sarcomm.worker import comm

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


# -- the subcommand (agent side) -----------------------------------------------------------------


class BenchCommand:
    """``sar-worker ... bench``: checks its flags, then runs the bench ranks as the agent's COMMAND."""

    name: str = "bench"
    help: str = "measure the collectives over a size sweep and print a table like nccl-tests"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the bench's flags (see :func:`add_bench_arguments`)."""
        add_bench_arguments(parser)

    def run(self, config: AgentConfig, args: argparse.Namespace) -> int:
        """Check the flags before joining (a typo must not hold a whole world), then run the agent
        with ``python -m sarcomm.worker.bench`` as its COMMAND; return sar-worker's exit status
        (:data:`~sarcomm.worker.cli.EXIT_USAGE` for bad flags)."""
        try:
            settings = BenchSettings.from_args(args)
        except InvalidArgumentError as exc:
            print(f"sar-worker: error: bench: {exc}", file=sys.stderr)
            return EXIT_USAGE
        command = (sys.executable, "-m", RANK_MODULE, *settings.argv())
        return run_agent(dataclasses.replace(config, command=command))


#: The instance ``sar-worker`` registers.
COMMAND: Final = BenchCommand()


if __name__ == "__main__":
    raise SystemExit(rank_main())
