"""What the ranks print: whole lines, tagged with the rank, to the agent's console and log files.

The agent starts every rank with its stdout and stderr on pipes of their own and reads them here:

- Console (``--tee console`` or ``both``): each line goes to the agent's stdout or stderr, the
  stream the rank wrote it to, prefixed with the tag (``[rank 3] `` by default, ``--output-tag``;
  empty: no tag), as torchrun's ``--log-line-prefix-template`` and mpirun's ``--tag-output`` do.
  One thread per console stream writes whole lines, one at a time, under the lock the agent's own
  log lines take too (:func:`console_lock`), so no two lines ever share a line of the console. It
  writes off the event loop: a console that reads slowly holds up the ranks' pipes (the ranks then
  wait in ``write``, as they would on a terminal), never the agent's heartbeats.
- Files (``--log-dir DIR``, ``--tee files`` or ``both``): ``DIR/JOB/GENERATION/rank-R.stdout`` and
  ``.stderr`` get exactly the bytes the rank wrote, untagged.
- Tail: the last :data:`TAIL_LINES` lines of each rank's stderr and stdout (at most
  :data:`TAIL_BYTES`) are kept, so that when a rank fails the agent can print them under the
  failure line: stderr's, where a traceback goes, or stdout's when it wrote no stderr.

A line longer than :data:`MAX_LINE_BYTES` is passed on in pieces of that size (each a line of the
console), so that a rank that never writes a newline cannot make the agent hold unbounded memory.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import logging
import os
import re
import string
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sarcomm.common.errors import InvalidArgumentError, shorten
from sarcomm.common.tasks import cancel_and_wait

__all__ = [
    "DEFAULT_OUTPUT_TAG",
    "EXIT_DRAIN_S",
    "MAX_LINE_BYTES",
    "MAX_TAG_WIDTH",
    "TAG_PLACEHOLDERS",
    "TAIL_BYTES",
    "TAIL_LINES",
    "Console",
    "ConsoleLogHandler",
    "RankOutput",
    "Tee",
    "check_log_dir",
    "check_output_tag",
    "console_lock",
    "log_paths",
    "make_log_dir",
]

log = logging.getLogger(__name__)

#: The tag each console line of a rank starts with; ``{rank}`` and ``{local_rank}`` are filled in.
DEFAULT_OUTPUT_TAG = "[rank {rank}] "
#: The placeholders a tag may hold.
TAG_PLACEHOLDERS = ("rank", "local_rank")
#: The widest a tag's placeholder may be padded (characters): a width of millions would cost that
#: much memory on every line (and ``{rank:99999999999}`` raises MemoryError).
MAX_TAG_WIDTH = 64
#: A placeholder's format: Python's format mini-language for a whole number (fill and alignment,
#: sign, ``#``, ``0``, width, ``,`` or ``_``, and a type of b, d, n, o, x, X); the width is group 1.
_NUMBER_FORMAT = re.compile(r"(?:.?[<>=^])?[-+ ]?#?0?(\d*)[,_]?[bdnoxX]?", re.DOTALL)
#: Lines longer than this are passed on in pieces (bytes).
MAX_LINE_BYTES = 1 << 20
#: How much of a failed rank's output the agent prints under the failure line.
TAIL_LINES = 20
TAIL_BYTES = 8192
#: How long the agent waits for a rank's pipes to reach their end once the rank exited (a child
#: of the rank may hold them open; its output is then not waited for).
DRAIN_DEADLINE_S = 2.0
#: How long the agent waits for that before it reports the rank's exit (so that the rank's last
#: lines come before the line about its exit). An exited rank's pipes end at once unless a process
#: it left holds them, and that one must not hold up the report: it has to reach the coordinator
#: before the coordinator judges the rank by its silence (interval x misses, 1.5 s in fast tests).
EXIT_DRAIN_S = 0.25

_READ_BYTES = 1 << 16
_CONSOLE_LOCK = threading.Lock()


def console_lock() -> threading.Lock:
    """The lock every whole-line write to the agent's console takes: rank lines here, and the
    agent's own log lines (``sarcomm.worker.agent.cli`` installs a handler that takes it)."""
    return _CONSOLE_LOCK


class ConsoleLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The agent's own log lines, on stderr, written whole under :func:`console_lock`, so that a
    rank's line and a log line never share a line of the console."""

    def emit(self, record: logging.LogRecord) -> None:
        with _CONSOLE_LOCK:
            super().emit(record)


class Tee(str, enum.Enum):
    """Where the ranks' output goes (``--tee``)."""

    CONSOLE = "console"
    FILES = "files"
    BOTH = "both"

    @property
    def console(self) -> bool:
        return self is not Tee.FILES

    @property
    def files(self) -> bool:
        return self is not Tee.CONSOLE


def check_output_tag(template: str, field: str = "--output-tag") -> str:
    """``template`` if it is text with the placeholders ``{rank}`` and ``{local_rank}``, each with at
    most a number format of width up to :data:`MAX_TAG_WIDTH` (``{rank:>3}``, ``{rank:03d}``); else
    an error naming ``field``, the template and what is wrong with it.

    Raises:
        InvalidArgumentError: a line break, a brace without its pair, another placeholder (a name,
            a position, ``{}``), an index or attribute (``{rank[0]}``, ``{rank.real}``), a
            conversion (``{rank!r}``), a placeholder in a format, a format that is not one for a
            number, or a width above :data:`MAX_TAG_WIDTH`.
    """
    problem = _tag_problem(template)
    if problem is not None:
        raise InvalidArgumentError(
            f"{field} {shorten(template)} must be text with the placeholders {{rank}} and {{local_rank}} "
            f"only, each with at most a number format such as {{rank:>3}} (write '{{{{' and '}}}}' for "
            f"braces): {problem}."
        )
    return template


def _tag_problem(template: str) -> str | None:
    """What is wrong with the tag ``template`` (see :func:`check_output_tag`), or None."""
    if "\n" in template or "\r" in template:
        return "it holds a line break (each line a rank writes gets the tag once)"
    try:
        fields = [
            (name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
        ]
    except ValueError as error:
        return f"a brace has no pair ({error})"
    for name, format_spec, conversion in fields:
        if name is None:  # literal text only
            continue
        spec = format_spec or ""
        shown = shorten(
            "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        )
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not base:
            return f"{shown} names no placeholder"
        if base.isdigit():
            return f"{shown} is a position, not a name"
        if base not in TAG_PLACEHOLDERS:
            return f"{shown} is not one of them"
        if name != base:
            return f"{shown} {'indexes' if name[len(base)] == '[' else 'reads an attribute of'} {base}"
        if conversion:
            return f"{shown} converts {base} (!{conversion}); a tag takes no conversion"
        if "{" in spec or "}" in spec:
            return f"{shown} has a placeholder in its format"
        number = _NUMBER_FORMAT.fullmatch(spec)
        if number is None:
            return (
                f"{shown}: {shorten(spec)} is not a format for a whole number (fill and align, sign, #, "
                "0, width, ',' or '_', and a type of b, d, n, o, x or X)"
            )
        if number[1] and int(number[1]) > MAX_TAG_WIDTH:
            return f"{shown}: width {number[1]} is above {MAX_TAG_WIDTH}"
        try:
            format(0, spec)
        except ValueError as error:
            return f"{shown}: {str(error).rstrip('.')}"
    return None


def check_log_dir(text: str) -> Path:
    """``text`` as the absolute path of a folder this user can write to, or create: it is one, or
    the nearest of its parents that exists is one this user can create folders in. Creates nothing.

    Raises:
        InvalidArgumentError: it is empty, it or a parent is not a folder, or this user cannot
            write there (the message says which path and why, and the rule).
    """
    rule = "give a folder this user can write to, or create"
    if not text.strip():
        raise InvalidArgumentError(f"no folder named; {rule} ('.' for the current one).")
    path = Path(text).absolute()
    nearest = path
    try:
        # exists() is False past a parent that is a file (ENOTDIR), and for a link to nothing.
        while not nearest.exists() and not nearest.is_symlink():
            nearest = nearest.parent
        if not nearest.is_dir():
            below = f", so {path} cannot be created" if nearest != path else ""
            raise InvalidArgumentError(f"{nearest} is not a folder{below}; {rule}.")
        if not os.access(nearest, os.W_OK | os.X_OK):
            where = f"write to {path}" if nearest == path else f"create folders in {nearest}"
            raise InvalidArgumentError(f"this user cannot {where}; {rule}.")
    except OSError as exc:  # a parent it may not look into
        raise InvalidArgumentError(f"{exc.strerror or exc}: {exc.filename or nearest}; {rule}.") from None
    return path


def make_log_dir(log_dir: Path, field: str = "--log-dir") -> None:
    """Create ``log_dir`` (and its parents) if it is not there yet.

    Raises:
        InvalidArgumentError: it cannot be created (the message names ``field``).
    """
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(
            f"{field} {shorten(str(log_dir))} must be a folder this user can create or write to: "
            f"{exc.strerror or exc}."
        ) from None


def log_paths(log_dir: Path, job: str, generation: int, rank: int) -> tuple[Path, Path]:
    """The files of one rank's stdout and stderr under ``log_dir``."""
    folder = log_dir / job / str(generation)
    return folder / f"rank-{rank}.stdout", folder / f"rank-{rank}.stderr"


class _ConsoleStream:
    """Whole lines to one file descriptor, written in order by one thread of its own."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"sar-worker-console-{fd}")

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        with _CONSOLE_LOCK:
            while view:
                try:
                    written = os.write(self.fd, view)
                except InterruptedError:
                    continue
                except OSError:  # the console is gone (a closed pipe): the output is dropped
                    return
                view = view[written:]

    async def write(self, data: bytes) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, self._write, data)

    def close(self) -> None:
        self._writer.shutdown(wait=True)


class Console:
    """The agent's stdout and stderr, shared by every rank of a run."""

    def __init__(self, stdout_fd: int = 1, stderr_fd: int = 2) -> None:
        self.stdout = _ConsoleStream(stdout_fd)
        self.stderr = _ConsoleStream(stderr_fd)

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()


@dataclass
class _Sink:
    console: _ConsoleStream | None
    file: BinaryIO | None
    tail: collections.deque[bytes]


class RankOutput:
    """Reads one rank's stdout and stderr pipes to their end; see the module docstring.

    ``open_files()`` opens the log files (before the rank starts: a folder that cannot be made
    fails the rank's start, not its output); ``start(stdout, stderr)`` begins reading; ``await
    drained()`` waits (bounded) until both ended; ``tail()`` gives the last lines; ``close()``
    closes the files.
    """

    def __init__(
        self,
        rank: int,
        local_rank: int,
        *,
        tag: str,
        console: Console | None,
        files: tuple[Path, Path] | None,
    ) -> None:
        self.rank = rank
        self.prefix = tag.format(rank=rank, local_rank=local_rank).encode()
        self.files = files
        self._console = console
        # The last lines of stdout and of stderr, each in its own order (two pipes have no common one).
        self._tails: tuple[collections.deque[bytes], ...] = tuple(
            collections.deque(maxlen=TAIL_LINES) for _ in range(2)
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._handles: list[BinaryIO] = []

    def open_files(self) -> None:
        """Create the log files' folder and open them for appending (once; without files, nothing).

        Raises:
            OSError: the folder or a file cannot be created or opened.
        """
        if self.files is None or self._handles:
            return
        self.files[0].parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as opened:
            handles: list[BinaryIO] = [
                opened.enter_context(path.open("ab", buffering=0)) for path in self.files
            ]
            opened.pop_all()  # both opened: kept until close()
        self._handles = handles

    def start(self, stdout: asyncio.StreamReader | None, stderr: asyncio.StreamReader | None) -> None:
        self.open_files()
        for index, stream in enumerate((stdout, stderr)):
            if stream is None:
                continue
            console = None
            if self._console is not None:
                console = self._console.stdout if index == 0 else self._console.stderr
            file = self._handles[index] if self._handles else None
            sink = _Sink(console, file, self._tails[index])
            self._tasks.append(asyncio.ensure_future(self._pump(stream, sink)))

    async def _pump(self, stream: asyncio.StreamReader, sink: _Sink) -> None:
        pending = b""
        try:
            while True:
                chunk = await stream.read(_READ_BYTES)
                if not chunk:
                    break
                if sink.file is not None:
                    sink.file.write(chunk)
                pending += chunk
                lines, pending = _split_lines(pending)
                if lines:
                    await self._emit(lines, sink)
            if pending:
                await self._emit([pending + b"\n"], sink)
        except Exception:  # a broken pipe or file must not take the agent down
            log.exception("reading the output of rank %d failed; the rest of it is lost", self.rank)

    async def _emit(self, lines: Iterable[bytes], sink: _Sink) -> None:
        lines = list(lines)
        sink.tail.extend(lines)
        if sink.console is not None:
            await sink.console.write(b"".join(self.prefix + line for line in lines))

    async def drained(self, timeout: float = DRAIN_DEADLINE_S) -> None:
        """Wait until both pipes ended, at most ``timeout`` seconds (a child of the rank that
        keeps them open does not hold the agent up)."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)

    def tail(self) -> tuple[str, list[str]]:
        """The rank's last lines (newest last, at most :data:`TAIL_LINES` and :data:`TAIL_BYTES`)
        of stderr, where a failure's traceback goes, or of stdout when it wrote no stderr; and
        which stream they are from."""
        stream, tail = ("stderr", self._tails[1]) if self._tails[1] else ("stdout", self._tails[0])
        kept: list[str] = []
        size = 0
        for line in reversed(tail):
            size += len(line)
            if size > TAIL_BYTES and kept:
                break
            kept.append(line[-TAIL_BYTES:].decode(errors="replace").rstrip("\n"))
        return stream, kept[::-1]

    async def close(self) -> None:
        try:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                await cancel_and_wait(task)
        finally:  # the files are closed even when this close is itself cancelled
            for handle in self._handles:
                handle.close()


def _split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of ``data`` (each with its newline; pieces of MAX_LINE_BYTES for longer
    ones) and the incomplete rest."""
    lines: list[bytes] = []
    start = 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            break
        while end + 1 - start > MAX_LINE_BYTES:
            lines.append(data[start : start + MAX_LINE_BYTES] + b"\n")
            start += MAX_LINE_BYTES
        lines.append(data[start : end + 1])
        start = end + 1
    rest = data[start:]
    while len(rest) > MAX_LINE_BYTES:
        lines.append(rest[:MAX_LINE_BYTES] + b"\n")
        rest = rest[MAX_LINE_BYTES:]
    return lines, rest
