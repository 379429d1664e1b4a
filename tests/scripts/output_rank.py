"""A rank that only writes output, for the agent's output tests (no torch, no sarcomm):
``python output_rank.py LINES LENGTH EXIT_CODE``.

Writes LINES lines of LENGTH bytes of one letter per rank (rank 0 'a', rank 1 'b', ...) to stdout,
each in three ``write`` calls so that two ranks' pieces would interleave on a shared stream, and
after each a short line ``err R I`` to stderr; then ``last words R`` to stderr and exits EXIT_CODE.
"""

from __future__ import annotations

import os
import sys


def main(lines: int, length: int, exit_code: int) -> int:
    rank = int(os.environ["RANK"])
    letter = chr(ord("a") + rank).encode()
    line = letter * length + b"\n"
    third = max(1, len(line) // 3)
    for index in range(lines):
        for start in range(0, len(line), third):
            os.write(1, line[start : start + third])
        os.write(2, f"err {rank} {index}\n".encode())
    os.write(2, f"last words {rank}\n".encode())
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
