"""``sar-worker ... bench``: the built-in collective benchmark, a table like nccl-tests'.

::

    sar-worker --coord HOST:PORT --job NAME --world-size N [--nproc-per-node K] bench
               [--ops all_reduce,all_to_all,...] [--sizes 1K:64M] [--factor F] [--iters N]
               [--warmup N] [--dtype float32|float64|int32|int64] [--json PATH]

The subcommand is an ordinary ``sar-worker`` run whose COMMAND is ``python -m
sarcomm.worker.library.bench_rank <flags>``: the agent registers its K local ranks, starts each as a real
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
terminal). torch is imported only by the ranks (:mod:`sarcomm.worker.library.bench_rank`), never by the
agent: this module holds the settings, the arithmetic, the table and the subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.worker import bandwidth
from sarcomm.worker.agent.config import AgentConfig
from sarcomm.worker.agent.runner import EXIT_USAGE, run_agent

__all__ = [
    "COMMAND",
    "DTYPES",
    "EXIT_WRONG_VALUES",
    "OPS",
    "RANK_MODULE",
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
    "results_document",
    "uneven_split",
]

#: The ops the bench runs, in the order ``--ops all`` runs them.
OPS: Final = ("all_reduce", "all_to_all", "all_to_all_unequal", "all_gather", "reduce_scatter", "broadcast")
#: ``--dtype`` choices and their element sizes in bytes. Only dtypes that hold the check pattern's
#: sums exactly (integers up to 60 x world size): half precision would report false #wrong.
DTYPES: Final = {"float32": 4, "float64": 8, "int32": 4, "int64": 8}
#: Exit status of the ranks (and so of sar-worker) when any checked value was wrong.
EXIT_WRONG_VALUES: Final = 1
#: The module each rank runs (``python -m``).
RANK_MODULE: Final = "sarcomm.worker.library.bench_rank"

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
    factor is what each link carries, so it compares with the hardware's bandwidth (the formulas:
    :mod:`sarcomm.worker.bandwidth`).

    Raises:
        InvalidArgumentError: ``op`` is not one of :data:`OPS`, or ``world`` < 1.
    """
    if world < 1:
        raise InvalidArgumentError(f"world={world} must be an integer >= 1.")
    factor = bandwidth.bus_factor(op, world) if op in OPS else None
    if factor is None:
        raise InvalidArgumentError(f"op={shorten(op)} must be one of {', '.join(OPS)}.")
    return factor


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
        with ``python -m sarcomm.worker.library.bench_rank`` as its COMMAND; return sar-worker's exit status
        (:data:`~sarcomm.worker.agent.runner.EXIT_USAGE` for bad flags)."""
        try:
            settings = BenchSettings.from_args(args)
        except InvalidArgumentError as exc:
            print(f"sar-worker: error: bench: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if config.elastic:
            print(f"sar-worker: error: bench: --world-size {config.world_text} must be a fixed N: a "
                  "benchmark measures one world, which an elastic job re-forms", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
        command = (sys.executable, "-m", RANK_MODULE, *settings.argv())
        # Rank 0 prints the table: untagged, so it reads (and parses) as nccl-tests' does.
        return run_agent(dataclasses.replace(config, command=command, output_tag=""))


#: The instance ``sar-worker`` registers.
COMMAND: Final = BenchCommand()
