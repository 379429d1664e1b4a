"""This machine's memory-copy bandwidth: the ceiling every collective on loopback runs under.

A collective between ranks on one host moves its bytes through memory, never through a wire: gloo
over 127.0.0.1 copies each byte from the sender's tensor into the kernel and from the kernel into
the receiver's tensor, and a reduction reads and writes them again. So no bus bandwidth in
``sar-worker ... bench``'s table can beat what one core copies per second, and the loopback TCP
figure below is closer still to what gloo can reach. Three measurements:

- ``copy``: ``dst.copy_(src)`` of float32 tensors in one thread (``torch.set_num_threads(1)``,
  as each rank runs), for each size; bandwidth = bytes copied / time (the memory moves twice as
  many: one read, one write). Sizes above the last-level cache are the ceiling that matters.
- ``pipe``: two processes, one ``os.pipe``; the writer writes 1 MiB chunks, the reader
  ``readinto``s a preallocated buffer.
- ``tcp``: two processes over a loopback TCP connection (127.0.0.1), ``sendall`` of 1 MiB chunks
  and ``recv_into``, as gloo's transport does.

The ceilings the report draws are the best samples (of the largest copy, and of TCP): noise only
ever lowers a transfer rate, and loopback TCP on a small machine swings by 3x from sample to
sample depending on where the scheduler puts the two processes.

Every figure is the median of ``--repeats`` samples, in GB/s (1e9 bytes per second, the unit of
the bench's algbw and busbw). The pipe and TCP runs come first, in processes forked before torch
is imported (so the children inherit no thread pools).

    python benchmarks/memcpy.py --json benchmarks/results/memcpy.json \\
        --markdown benchmarks/results/memcpy.md          # about 10 s
    python benchmarks/memcpy.py --quick                  # fewer sizes and bytes, a few seconds
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recording import describe
from render import write_page
from renderers import memcpy as memcpy_page
from renderers.memcpy import Ceiling, CopyRow, StreamRow

MIB = 1024**2
COPY_SIZES_MIB = (1, 16, 64, 256)
QUICK_COPY_SIZES_MIB = (16, 128)
# Each copy sample lasts at least this long (small copies loop): a single 1 MiB copy takes tens of
# microseconds, where one timer read and one scheduler blip would be a large share.
MIN_SAMPLE_S = 0.02
CHUNK = MIB
STREAM_BYTES = 1024 * MIB
QUICK_STREAM_BYTES = 256 * MIB


# -- copy ----------------------------------------------------------------------------------------


def copy_bandwidth(size_mib: int, repeats: int) -> CopyRow:
    """Median single-thread ``copy_`` bandwidth of ``size_mib`` MiB float32 tensors, in GB/s."""
    import torch

    nbytes = size_mib * MIB
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults belong to allocation, not to copying
    start = time.perf_counter()
    dst.copy_(src)
    loops = max(1, int(MIN_SAMPLE_S / max(time.perf_counter() - start, 1e-9)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            dst.copy_(src)
        samples.append(nbytes * loops / (time.perf_counter() - start) / 1e9)
    return {
        "bytes": nbytes,
        "copies_per_sample": loops,
        "samples": len(samples),
        "gbps": statistics.median(samples),
        "min_gbps": min(samples),
        "max_gbps": max(samples),
    }


# -- two-process streams ---------------------------------------------------------------------------


def _write_all(write: Callable[[memoryview], None], total: int) -> None:
    chunk = memoryview(bytes(CHUNK))
    sent = 0
    while sent < total:
        piece = chunk[: min(CHUNK, total - sent)]
        write(piece)
        sent += len(piece)


def _pipe_writer(fd: int, total: int) -> None:
    def write(piece: memoryview) -> None:
        while piece:
            piece = piece[os.write(fd, piece) :]

    _write_all(write, total)
    os.close(fd)


def _tcp_writer(port: int, total: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        _write_all(conn.sendall, total)


def _stream(kind: str, total: int) -> float:
    """One transfer of ``total`` bytes from a forked writer to this process; GB/s as the reader
    saw it (first byte to last, so the writer's start-up is not counted)."""
    ctx = mp.get_context("fork")
    buffer = memoryview(bytearray(CHUNK))
    if kind == "pipe":
        read_fd, write_fd = os.pipe()
        writer = ctx.Process(target=_pipe_writer, args=(write_fd, total))
        writer.start()
        os.close(write_fd)
        with os.fdopen(read_fd, "rb", buffering=0) as reader:
            received = reader.readinto(buffer) or 0
            start = time.perf_counter()
            while received < total:
                got = reader.readinto(buffer)
                if not got:
                    break
                received += got
            elapsed = time.perf_counter() - start
    else:
        with socket.create_server(("127.0.0.1", 0)) as server:
            writer = ctx.Process(target=_tcp_writer, args=(server.getsockname()[1], total))
            writer.start()
            conn, _ = server.accept()
            with conn:
                received = conn.recv_into(buffer)
                start = time.perf_counter()
                while received < total:
                    got = conn.recv_into(buffer)
                    if not got:
                        break
                    received += got
                elapsed = time.perf_counter() - start
    writer.join(30)
    if received < total:
        raise RuntimeError(f"{kind}: received {received} of {total} bytes (writer exit {writer.exitcode})")
    return received / elapsed / 1e9


def stream_bandwidth(kind: str, total: int, repeats: int) -> StreamRow:
    samples = [_stream(kind, total) for _ in range(repeats)]
    return {
        "bytes_per_sample": total,
        "chunk_bytes": CHUNK,
        "samples": len(samples),
        "gbps": statistics.median(samples),
        "min_gbps": min(samples),
        "max_gbps": max(samples),
    }


# -- output --------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the numbers were measured on (see recording.describe)."""
    return describe("torch", load_at="end")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two copy sizes, 256 MiB streams, 5 samples")
    parser.add_argument("--repeats", type=int, help="samples per figure (default 15, or 5 with --quick)")
    parser.add_argument("--no-streams", action="store_true", help="skip the pipe and TCP measurements")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table, command and machine here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    command = shlex.join(["python", "benchmarks/memcpy.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    load_at_start = round(os.getloadavg()[0], 2)
    total = QUICK_STREAM_BYTES if args.quick else STREAM_BYTES
    streams: dict[str, StreamRow] = {}
    if not args.no_streams:
        for kind in ("pipe", "tcp"):
            streams[kind] = stream_bandwidth(kind, total, repeats)
            print(f"{kind:>5}: {streams[kind]['gbps']:6.2f} GB/s", flush=True)

    import torch

    torch.set_num_threads(1)  # one rank's view: sarcomm gives each rank its share of the cores
    copies: list[CopyRow] = []
    for size in QUICK_COPY_SIZES_MIB if args.quick else COPY_SIZES_MIB:
        copies.append(copy_bandwidth(size, repeats))
        print(f" copy: {copies[-1]['gbps']:6.2f} GB/s at {size} MiB", flush=True)
    report: dict[str, Any] = {
        "benchmark": "memcpy",
        "command": command,
        "quick": args.quick,
        "statistic": "median over samples; GB/s = 1e9 bytes per second",
        "machine": {**machine(), "loadavg_1m_at_start": load_at_start},
        "wall_seconds": round(time.monotonic() - started, 1),
        "copy": copies,
        **streams,
        # The figures the report draws as ceilings: the best sample (noise, such as both processes
        # landing on one core, only lowers a rate) of the largest copy, which is beyond the caches.
        "ceiling": Ceiling(
            statistic="best sample",
            copy_gbps=copies[-1]["max_gbps"],
            tcp_gbps=streams["tcp"]["max_gbps"] if "tcp" in streams else None,
        ),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        write_page(report, memcpy_page.section, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
